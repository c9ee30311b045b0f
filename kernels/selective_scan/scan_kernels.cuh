// Device code of the Mamba-1 selective scan: forward and backward kernels (see selective_scan.h).
//
// One block of kThreads threads scans one (batch, channel) row. The row is cut into chunks of kChunk steps; each
// thread holds kItems consecutive steps of a chunk. For every state index n the block composes the affine maps
// h -> exp(dt A) h + dt B u of its steps (a parallel scan: sequential inside a thread, shuffles inside a warp, one
// thread across warps), starting from the state carried over from the previous chunk. The backward pass walks the
// chunks in reverse: it recomputes the states of a chunk from the state the forward kept at its start, then runs
// the adjoint recurrence dL/dh[t-1] = exp(dt[t] A) (C[t] dy[t] + dL/dh[t]) as a reverse scan of the same kind.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "selective_scan.h"

namespace hybridlm_scan {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Calls f(T{}) with T the element type named by dtype.
template <typename F>
void with_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: f(float{}); break;
    case DType::kFloat16: f(__half{}); break;
    case DType::kBFloat16: f(__nv_bfloat16{}); break;
  }
}

// 16 bytes, moved by one vector load or store when aligned.
struct alignas(16) Bytes16 {
  unsigned int words[4];
};

// Whether this thread's kItems steps at `p` can move as whole 16-byte vectors.
template <typename T>
__device__ __forceinline__ bool vectorizable(const T* p, int t0, int seqlen) {
  static_assert(kItems * sizeof(T) % sizeof(Bytes16) == 0, "a thread's steps must fill whole vectors");
  return t0 + kItems <= seqlen && reinterpret_cast<uintptr_t>(p) % sizeof(Bytes16) == 0;
}

// This thread's kItems steps of a row, starting at step t0; steps at or past `seqlen` read as zero.
template <typename T>
__device__ __forceinline__ void load_items(const T* row, int t0, int seqlen, float (&out)[kItems]) {
  const T* p = row + t0;
  if (vectorizable(p, t0, seqlen)) {
    Bytes16 packed[kItems * sizeof(T) / sizeof(Bytes16)];
#pragma unroll
    for (int v = 0; v < int(sizeof(packed) / sizeof(Bytes16)); ++v) packed[v] = reinterpret_cast<const Bytes16*>(p)[v];
    T values[kItems];
    memcpy(values, packed, sizeof(values));
#pragma unroll
    for (int i = 0; i < kItems; ++i) out[i] = to_float(values[i]);
  } else {
#pragma unroll
    for (int i = 0; i < kItems; ++i) out[i] = t0 + i < seqlen ? to_float(p[i]) : 0.f;
  }
}

template <typename T>
__device__ __forceinline__ void store_items(T* row, int t0, int seqlen, const float (&values)[kItems]) {
  T* p = row + t0;
  if (vectorizable(p, t0, seqlen)) {
    T converted[kItems];
#pragma unroll
    for (int i = 0; i < kItems; ++i) converted[i] = from_float<T>(values[i]);
    Bytes16 packed[kItems * sizeof(T) / sizeof(Bytes16)];
    memcpy(packed, converted, sizeof(packed));
#pragma unroll
    for (int v = 0; v < int(sizeof(packed) / sizeof(Bytes16)); ++v) reinterpret_cast<Bytes16*>(p)[v] = packed[v];
  } else {
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      if (t0 + i < seqlen) p[i] = from_float<T>(values[i]);
    }
  }
}

// torch.nn.functional.softplus with its default threshold of 20, and its derivative.
__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float softplus_grad(float x) { return x > 20.f ? 1.f : 1.f / (1.f + expf(-x)); }

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

// The map h -> a * h + b: one step of the recurrence, or a run of steps composed.
struct Affine {
  float a, b;
};

// `first`, then `second`.
__device__ __forceinline__ Affine then(Affine first, Affine second) {
  return {first.a * second.a, second.a * first.b + second.b};
}

struct ChainScratch {
  Affine warp_map[kWarps];
  float warp_input[kWarps];
};

// Chains the threads' maps in thread order (kReverse: in reverse thread order). Thread 0 reads the value entering
// the block from *start and, unless `end` is null, writes the value leaving it to *end. Returns the value entering
// this thread's run. Every thread of the block must call it.
template <bool kReverse>
__device__ __forceinline__ float chain(Affine mine, const float* start, float* end, ChainScratch& scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  Affine inclusive = mine;  // the maps from the warp's first lane (in chain order) through this one
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    Affine before;
    before.a = kReverse ? __shfl_down_sync(kFullMask, inclusive.a, offset)
                        : __shfl_up_sync(kFullMask, inclusive.a, offset);
    before.b = kReverse ? __shfl_down_sync(kFullMask, inclusive.b, offset)
                        : __shfl_up_sync(kFullMask, inclusive.b, offset);
    if (kReverse ? lane + offset < 32 : lane >= offset) inclusive = then(before, inclusive);
  }
  Affine exclusive;
  exclusive.a = kReverse ? __shfl_down_sync(kFullMask, inclusive.a, 1) : __shfl_up_sync(kFullMask, inclusive.a, 1);
  exclusive.b = kReverse ? __shfl_down_sync(kFullMask, inclusive.b, 1) : __shfl_up_sync(kFullMask, inclusive.b, 1);
  if (lane == (kReverse ? 31 : 0)) exclusive = {1.f, 0.f};
  if (lane == (kReverse ? 0 : 31)) scratch.warp_map[warp] = inclusive;
  __syncthreads();
  if (threadIdx.x == 0) {
    float value = *start;
    for (int k = 0; k < kWarps; ++k) {
      const int w = kReverse ? kWarps - 1 - k : k;
      scratch.warp_input[w] = value;
      value = scratch.warp_map[w].a * value + scratch.warp_map[w].b;
    }
    if (end != nullptr) *end = value;
  }
  __syncthreads();
  return exclusive.a * scratch.warp_input[warp] + exclusive.b;
}

// Pointers of the row a block works on.
template <typename T>
struct Row {
  const T *u, *delta, *z, *B, *C;
  const float* A;
  float D, delta_bias;
  int64_t index;                      // b * dim + d
  int64_t row, state_row, group_row;  // offsets of [b, d, :] in [.., seqlen], of [b, d, :] in [.., dstate], of [b, g]

  __device__ Row(const ScanArgs& args, int b, int d) {
    const int g = d / (args.dim / args.groups);
    index = int64_t(b) * args.dim + d;
    row = index * args.seqlen;
    state_row = index * args.dstate;
    group_row = (int64_t(b) * args.groups + g) * args.dstate * args.seqlen;
    u = static_cast<const T*>(args.u) + row;
    delta = static_cast<const T*>(args.delta) + row;
    z = args.z != nullptr ? static_cast<const T*>(args.z) + row : nullptr;
    B = static_cast<const T*>(args.B) + group_row;
    C = static_cast<const T*>(args.C) + group_row;
    A = args.A + int64_t(d) * args.dstate;
    D = args.D != nullptr ? args.D[d] : 0.f;
    delta_bias = args.delta_bias != nullptr ? args.delta_bias[d] : 0.f;
  }

  // Loads u and the step sizes dt of this thread's items; `raw` gets delta + delta_bias (softplus's input).
  __device__ void load_steps(const ScanArgs& args, int t0, float (&uu)[kItems], float (&raw)[kItems],
                             float (&dt)[kItems]) const {
    load_items(u, t0, args.seqlen, uu);
    load_items(delta, t0, args.seqlen, raw);
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      raw[i] += delta_bias;
      dt[i] = t0 + i < args.seqlen ? (args.softplus ? softplus(raw[i]) : raw[i]) : 0.f;  // dt = 0: no step
    }
  }

  // For state index n: the decay and input of each item, and their composition over the thread's run.
  __device__ Affine steps(const ScanArgs& args, int n, int t0, const float (&uu)[kItems], const float (&dt)[kItems],
                          float (&Bn)[kItems], float (&Cn)[kItems], float (&decay)[kItems],
                          float (&drive)[kItems]) const {
    load_items(B + int64_t(n) * args.seqlen, t0, args.seqlen, Bn);
    load_items(C + int64_t(n) * args.seqlen, t0, args.seqlen, Cn);
    Affine run{1.f, 0.f};
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      decay[i] = expf(dt[i] * A[n]);
      drive[i] = dt[i] * Bn[i] * uu[i];
      run = then(run, Affine{decay[i], drive[i]});
    }
    return run;
  }

  // y[i] += sum_n C h over every state index, starting each chunk from states[n] (which the forward advances).
  __device__ void accumulate_output(const ScanArgs& args, int t0, const float (&uu)[kItems], const float (&dt)[kItems],
                                    const float* start, float* end, float (&y)[kItems],
                                    ChainScratch& scratch) const {
    for (int n = 0; n < args.dstate; ++n) {
      float Bn[kItems], Cn[kItems], decay[kItems], drive[kItems];
      const Affine run = steps(args, n, t0, uu, dt, Bn, Cn, decay, drive);
      float h = chain<false>(run, start + n, end != nullptr ? end + n : nullptr, scratch);
#pragma unroll
      for (int i = 0; i < kItems; ++i) {
        h = decay[i] * h + drive[i];
        y[i] += Cn[i] * h;
      }
    }
  }
};

template <typename T>
__global__ void __launch_bounds__(kThreads) scan_forward_kernel(ScanForward p) {
  const ScanArgs& args = p.args;
  const Row<T> row(args, blockIdx.y, blockIdx.x);
  const int chunks = num_chunks(args.seqlen);
  __shared__ float state[kMaxState];  // the state entering the current chunk
  __shared__ ChainScratch scratch;
  for (int n = threadIdx.x; n < args.dstate; n += kThreads) {
    state[n] = p.initial_state != nullptr ? p.initial_state[row.state_row + n] : 0.f;
  }
  __syncthreads();
  for (int c = 0; c < chunks; ++c) {
    if (p.chunk_states != nullptr) {
      float* kept = p.chunk_states + (row.index * chunks + c) * args.dstate;
      for (int n = threadIdx.x; n < args.dstate; n += kThreads) kept[n] = state[n];
    }
    __syncthreads();
    const int t0 = c * kChunk + threadIdx.x * kItems;
    float uu[kItems], raw[kItems], dt[kItems], y[kItems];
    row.load_steps(args, t0, uu, raw, dt);
#pragma unroll
    for (int i = 0; i < kItems; ++i) y[i] = row.D * uu[i];
    row.accumulate_output(args, t0, uu, dt, state, state, y, scratch);
    if (row.z != nullptr) {
      float zz[kItems];
      load_items(row.z, t0, args.seqlen, zz);
#pragma unroll
      for (int i = 0; i < kItems; ++i) y[i] *= zz[i] / (1.f + expf(-zz[i]));
    }
    store_items(static_cast<T*>(p.out) + row.row, t0, args.seqlen, y);
  }
  __syncthreads();
  for (int n = threadIdx.x; n < args.dstate; n += kThreads) p.final_state[row.state_row + n] = state[n];
}

template <typename T>
__global__ void __launch_bounds__(kThreads) scan_backward_kernel(ScanBackward p) {
  const ScanArgs& args = p.args;
  const Row<T> row(args, blockIdx.y, blockIdx.x);
  const int d = blockIdx.x, lane = threadIdx.x % 32;
  const int chunks = num_chunks(args.seqlen);
  __shared__ float adjoint[kMaxState];  // dL/dh at the end of the current chunk
  __shared__ float dA[kMaxState];
  __shared__ float staged_dB[kChunk], staged_dC[kChunk];  // one state's dB, dC of the chunk, in time order
  __shared__ ChainScratch scratch;
  for (int n = threadIdx.x; n < args.dstate; n += kThreads) {
    adjoint[n] = p.dfinal_state != nullptr ? p.dfinal_state[row.state_row + n] : 0.f;
    dA[n] = 0.f;
  }
  __syncthreads();
  float* dB = p.dB + row.group_row;
  float* dC = p.dC + row.group_row;
  float dD = 0.f, ddelta_bias = 0.f;
  for (int c = chunks - 1; c >= 0; --c) {
    const int t0 = c * kChunk + threadIdx.x * kItems;
    const float* kept = p.chunk_states + (row.index * chunks + c) * args.dstate;
    float uu[kItems], raw[kItems], dt[kItems], dy[kItems], du[kItems], ddt[kItems];
    row.load_steps(args, t0, uu, raw, dt);
    load_items(static_cast<const T*>(p.dout) + row.row, t0, args.seqlen, dy);
    if (row.z != nullptr) {  // recompute the ungated output: the gate's gradient needs it
      float zz[kItems], y[kItems], dz[kItems];
#pragma unroll
      for (int i = 0; i < kItems; ++i) y[i] = row.D * uu[i];
      row.accumulate_output(args, t0, uu, dt, kept, nullptr, y, scratch);
      load_items(row.z, t0, args.seqlen, zz);
#pragma unroll
      for (int i = 0; i < kItems; ++i) {
        const float sig = 1.f / (1.f + expf(-zz[i]));
        dz[i] = dy[i] * y[i] * sig * (1.f + zz[i] * (1.f - sig));
        dy[i] *= zz[i] * sig;
      }
      store_items(static_cast<T*>(p.dz) + row.row, t0, args.seqlen, dz);
    }
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      dD += dy[i] * uu[i];
      du[i] = dy[i] * row.D;
      ddt[i] = 0.f;
    }
    for (int n = 0; n < args.dstate; ++n) {
      float Bn[kItems], Cn[kItems], decay[kItems], drive[kItems], before[kItems];
      const Affine run = row.steps(args, n, t0, uu, dt, Bn, Cn, decay, drive);
      float h = chain<false>(run, kept + n, nullptr, scratch);
      Affine back{1.f, 0.f};  // dL/dh at the end of this thread's run -> dL/dh before its first step
#pragma unroll
      for (int i = 0; i < kItems; ++i) {
        before[i] = h;
        h = decay[i] * h + drive[i];
      }
#pragma unroll
      for (int i = kItems - 1; i >= 0; --i) back = then(back, Affine{decay[i], decay[i] * Cn[i] * dy[i]});
      float later = chain<true>(back, adjoint + n, adjoint + n, scratch);  // dL/dh[t] from steps after t
      float dA_n = 0.f;
#pragma unroll
      for (int i = kItems - 1; i >= 0; --i) {
        const float grad_h = Cn[i] * dy[i] + later;  // dL/dh[t]
        const float grad_decay = grad_h * before[i];
        staged_dC[threadIdx.x * kItems + i] = dy[i] * (decay[i] * before[i] + drive[i]);
        staged_dB[threadIdx.x * kItems + i] = grad_h * dt[i] * uu[i];
        du[i] += grad_h * dt[i] * Bn[i];
        ddt[i] += grad_h * Bn[i] * uu[i] + grad_decay * decay[i] * row.A[n];
        dA_n += grad_decay * decay[i] * dt[i];
        later = decay[i] * grad_h;
      }
      dA_n = warp_sum(dA_n);
      if (lane == 0) atomicAdd(dA + n, dA_n);
      // dB, dC are shared by the channels (blocks): added with striped ownership, consecutive threads on
      // consecutive time steps, so that a warp's atomics coalesce
      __syncthreads();
      for (int j = threadIdx.x; j < kChunk; j += kThreads) {
        const int t = c * kChunk + j;
        if (t < args.seqlen) {
          atomicAdd(dC + int64_t(n) * args.seqlen + t, staged_dC[j]);
          atomicAdd(dB + int64_t(n) * args.seqlen + t, staged_dB[j]);
        }
      }
      __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const bool valid = t0 + i < args.seqlen;
      ddt[i] = valid ? (args.softplus ? ddt[i] * softplus_grad(raw[i]) : ddt[i]) : 0.f;
      ddelta_bias += ddt[i];
    }
    store_items(static_cast<T*>(p.du) + row.row, t0, args.seqlen, du);
    store_items(static_cast<T*>(p.ddelta) + row.row, t0, args.seqlen, ddt);
  }
  __syncthreads();
  for (int n = threadIdx.x; n < args.dstate; n += kThreads) {
    if (p.dinitial_state != nullptr) p.dinitial_state[row.state_row + n] = adjoint[n];
    atomicAdd(p.dA + int64_t(d) * args.dstate + n, dA[n]);
  }
  dD = warp_sum(dD);
  ddelta_bias = warp_sum(ddelta_bias);
  if (lane == 0 && p.dD != nullptr) atomicAdd(p.dD + d, dD);
  if (lane == 0 && p.ddelta_bias != nullptr) atomicAdd(p.ddelta_bias + d, ddelta_bias);
}

}  // namespace hybridlm_scan
