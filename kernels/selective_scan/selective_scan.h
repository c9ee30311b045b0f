// Interface between the PyTorch binding (host C++) and the CUDA launchers of the Mamba-1 selective scan.
//
// Plain data only, no CUDA and no torch types, so that the binding compiles with a host compiler and the kernels
// compile with nvcc, each on its own. The recurrence, per batch row b, channel d and state index n:
//
//     dt[t] = softplus?(delta[t] + delta_bias[d])
//     h[t]  = exp(dt[t] * A[d, n]) * h[t-1] + dt[t] * B[g, n, t] * u[t]        (g = d / (dim / groups))
//     y[t]  = (sum_n C[g, n, t] * h[t, n] + D[d] * u[t]) * silu(z[t])           (each factor only if given)
#pragma once

#include <cstdint>

namespace hybridlm_scan {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

constexpr int kThreads = 128;              // threads per block; a block scans one (batch, channel) row
constexpr int kItems = 8;                  // consecutive time steps held by each thread
constexpr int kChunk = kThreads * kItems;  // time steps a block scans at once
constexpr int kMaxState = 256;             // largest dstate: per-state shared arrays are sized for it

#if defined(__CUDACC__)
#define HYBRIDLM_HOST_DEVICE __host__ __device__
#else
#define HYBRIDLM_HOST_DEVICE
#endif

HYBRIDLM_HOST_DEVICE inline int num_chunks(int seqlen) { return (seqlen + kChunk - 1) / kChunk; }

// Inputs shared by the forward and the backward pass. Every array is contiguous.
struct ScanArgs {
  int batch, dim, seqlen, dstate, groups;
  bool softplus;
  const void* u;      // input dtype [batch, dim, seqlen]
  const void* delta;  // input dtype [batch, dim, seqlen]
  const void* z;      // input dtype [batch, dim, seqlen], or null (no gate)
  const void* B;      // input dtype [batch, groups, dstate, seqlen]
  const void* C;      // input dtype [batch, groups, dstate, seqlen]
  const float* A;           // [dim, dstate]
  const float* D;           // [dim], or null
  const float* delta_bias;  // [dim], or null
};

struct ScanForward {
  ScanArgs args;
  const float* initial_state;  // [batch, dim, dstate], or null (zeros)
  void* out;                   // input dtype [batch, dim, seqlen]
  float* final_state;          // [batch, dim, dstate]
  float* chunk_states;         // [batch, dim, num_chunks, dstate]: the state entering each chunk, or null (not kept)
};

struct ScanBackward {
  ScanArgs args;
  const float* chunk_states;  // as written by the forward
  const void* dout;           // input dtype [batch, dim, seqlen]
  const float* dfinal_state;  // [batch, dim, dstate], or null (zeros)
  void* du;                   // input dtype [batch, dim, seqlen]
  void* ddelta;               // input dtype [batch, dim, seqlen]
  void* dz;                   // input dtype [batch, dim, seqlen]; null when z is
  // Accumulated with atomics, so zero-filled by the caller; dD and ddelta_bias are null when D and delta_bias are.
  float* dA;           // [dim, dstate]
  float* dB;           // [batch, groups, dstate, seqlen]
  float* dC;           // [batch, groups, dstate, seqlen]
  float* dD;           // [dim]
  float* ddelta_bias;  // [dim]
  float* dinitial_state;  // [batch, dim, dstate], or null (not wanted)
};

// Launch on `stream` (a cudaStream_t). Return null on success, else the CUDA error message.
const char* scan_forward(const ScanForward& params, DType dtype, void* stream);
const char* scan_backward(const ScanBackward& params, DType dtype, void* stream);

}  // namespace hybridlm_scan
