// The linear layer of few rows (decode steps) with bf16 or int8 weights on the CPU, behind a plain C interface
// (built with the other kernels here by hybridlm/ops/cpu_kernels.py):
//   y[m, n] = round(scale[n] * sum_k x[m, k] (w[n, k] - zero[n]) + bias[n])
// w is nn.Linear's own layout [out_features, in_features] (or packed in blocks of outputs: linear_rows_packed),
// bf16, or int8 codes with one fp32 scale and one int8 zero point per output row (torchao's weight-only int8: zero
// points are 0 when symmetric); x and y are fp32 or bf16 rows. Each weight vector is widened to fp32 in registers
// as it is loaded and multiplied there, the sums kept in fp32 and the output rounded once. A CPU with no bf16 or
// int8 products of its own (AVX2) has nothing faster in torch's eager products: its bf16 products take a slow
// path, and a copy of the weights in fp32 reads and writes them all again each call. Reading the weights is what a
// decode step waits for, and bf16 halves it, int8 quarters it.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vectors.h"

namespace {

using hybridlm_cpu::bf16_to_float;
using hybridlm_cpu::float_to_bf16;
using hybridlm_cpu::Floats;
using hybridlm_cpu::kLanes;
using hybridlm_cpu::lane_sum;
using hybridlm_cpu::load_floats;
typedef int8_t Bytes __attribute__((vector_size(kLanes)));

enum Kind : int { kFloat32 = 0, kBfloat16 = 1, kInt8 = 2 };

// kLanes weights from p, widened to fp32.
template <int W>
inline Floats load_weights(const void* p) {
  if constexpr (W == kFloat32) {
    return load_floats(static_cast<const float*>(p));
  } else if constexpr (W == kBfloat16) {
    return hybridlm_cpu::load_bf16(p);
  } else {
#if defined(__AVX2__)
    const __m128i b = _mm_loadl_epi64(static_cast<const __m128i*>(p));
    return (Floats)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
#else
    Bytes b;
    std::memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, Floats);
#endif
  }
}

template <int W>
inline float weight_at(const void* w, int64_t i) {
  if constexpr (W == kFloat32) return static_cast<const float*>(w)[i];
  else if constexpr (W == kBfloat16) return bf16_to_float(static_cast<const uint16_t*>(w)[i]);
  else return float(static_cast<const int8_t*>(w)[i]);
}

constexpr int64_t item_size(int W) { return W == kFloat32 ? 4 : W == kBfloat16 ? 2 : 1; }

struct LinearArgs {
  const float* x;      // [rows, in] fp32 (bf16 inputs widened before)
  const void* w;       // [out, in], bf16 or int8
  const float* scale;  // [out], or null: 1
  const int8_t* zero;  // [out], or null: 0
  const float* x_sums; // [rows]: sum_k x[m, k], where zero is given
  const float* bias;   // [out], or null: 0
  void* y;             // [rows, out], fp32 or bf16
  int64_t rows, in, out;
  bool y_bf16;
};

inline void store(const LinearArgs& a, int64_t m, int64_t n, float sum) {
  if (a.zero) sum -= float(a.zero[n]) * a.x_sums[m];
  float v = a.scale ? sum * a.scale[n] : sum;
  if (a.bias) v += a.bias[n];
  if (a.y_bf16) static_cast<uint16_t*>(a.y)[m * a.out + n] = float_to_bf16(v);
  else static_cast<float*>(a.y)[m * a.out + n] = v;
}

// Input rows [m0, m0 + R) against the O weight rows at `w` (of kind W, rows `in` apart; their first is output
// n0): R x O dot products along `in`, kLanes at a time, each weight vector widened once for the R rows.
template <int W, int R, int O>
void block(const LinearArgs& a, const void* w, int64_t m0, int64_t n0) {
  const int64_t K = a.in, whole = K - K % kLanes;
  const char* wb = static_cast<const char*>(w);
  Floats acc[R][O] = {};
  for (int64_t k = 0; k < whole; k += kLanes) {
    Floats wv[O];
    for (int j = 0; j < O; ++j) wv[j] = load_weights<W>(wb + (j * K + k) * item_size(W));
    for (int r = 0; r < R; ++r) {
      const Floats xv = load_floats(a.x + (m0 + r) * K + k);
      for (int j = 0; j < O; ++j) acc[r][j] += xv * wv[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < O; ++j) {
      float sum = lane_sum(acc[r][j]);
      for (int64_t k = whole; k < K; ++k) sum += a.x[(m0 + r) * K + k] * weight_at<W>(w, j * K + k);
      store(a, m0 + r, n0 + j, sum);
    }
}

// All input rows against O weight rows (outputs n0...): 4 rows at a time (12 accumulators, 3 weight vectors and
// one input vector fill AVX2's 16 registers), then the remaining 1-3 rows in one block, each weight vector widened
// again for every block of rows (it is in the L1 cache by then). Measured against widening each weight block once
// into an fp32 scratch for all the rows (the earlier design): weights out of the caches, SmolLM2's shapes, 1
// thread, C++ timing, min of three interleaved runs: 4 rows 15.2 against 21.9 ms, 16 rows 43.2 against 56.0.
template <int W, int O>
void rows_against(const LinearArgs& a, const void* w, int64_t n0) {
  int64_t m = 0;
  for (; m + 4 <= a.rows; m += 4) block<W, 4, O>(a, w, m, n0);
  switch (a.rows - m) {
    case 3: return block<W, 3, O>(a, w, m, n0);
    case 2: return block<W, 2, O>(a, w, m, n0);
    case 1: return block<W, 1, O>(a, w, m, n0);
  }
}

// Ask for the weight block after the `bytes` at `w` (up to `left` bytes) while this one is multiplied, rather than
// waiting on each of its cache lines in turn: the hardware prefetcher alone keeps up badly with the few short rows
// of a block. Weights out of the caches, 1 row, SmolLM2's shapes, 1 thread, C++ timing: 8.6 against 11.2 GB/s for
// bf16, 7.0 against 10.8 for int8 (a plain streaming sum reads 15 GB/s on that machine).
inline void prefetch_next(const char* w, int64_t bytes, int64_t left) {
  for (int64_t i = 0; i < std::min(bytes, left); i += 64) __builtin_prefetch(w + bytes + i, 0, 2);
}

template <int W, int O>
void outputs(const LinearArgs& a, int64_t n0) {
  const char* w = static_cast<const char*>(a.w) + n0 * a.in * item_size(W);
  const int64_t bytes = O * a.in * item_size(W), left = (a.out - n0 - O) * a.in * item_size(W);
  prefetch_next(w, bytes, left);
  rows_against<W, O>(a, w, n0);
}

template <int W>
void linear(const LinearArgs& a, int threads) {
  constexpr int O = 3;  // weight rows of a block (see rows_against)
  const int64_t blocks = (a.out + O - 1) / O;
  // Threads split the weight rows (each is read from memory once); a second thread from 2^16 weights per thread.
  const int64_t useful = std::max<int64_t>(1, std::min<int64_t>(threads, a.out * a.in >> 16));
#pragma omp parallel for num_threads(useful) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t n0 = b * O;
    if (n0 + O <= a.out) outputs<W, O>(a, n0);
    else
      for (int64_t n = n0; n < a.out; ++n) outputs<W, 1>(a, n);
  }
}

// The same product over weights packed in blocks of kPackedOutputs outputs, [blocks, in, kPackedOutputs]
// (cpu_kernels.pack_linear_weight; outputs past `out` are zero): for each input feature k, the block's weights
// are one contiguous run of kPackedOutputs, widened into 2 vectors and multiplied by x[m, k] broadcast, 6 rows at
// a time (12 accumulators, 2 weight vectors and a broadcast: AVX2's 16 registers). A thread reads its blocks as
// one stream, which the hardware prefetcher follows at full speed (prefetching the next block, as outputs() does,
// made it slower), and no sums across lanes are needed. A row alone would have only 2 accumulators, each waiting
// on its last multiply-add every feature: it takes two sets, for even and odd features, added at the end. Weights
// out of the caches, SmolLM2's shapes, 1 thread, C++ timing, min of interleaved runs, against block() on
// nn.Linear's layout: 1 row 16.4-17.1 against 10.6-11.2 GB/s (bf16; int8 codes 15.4-16.1), 4 rows 9.4-9.6 against
// 16.5 ms, 16 rows 25.1-25.6 against 50.1 ms (80 against 40 GFLOP/s). Against blocks of 24 outputs, 4 rows at a
// time and one set of accumulators (the first version): 16 rows 1.07x, int8 codes of 1 row 1.14x. The packing is
// a copy of the weights: a compiled step folds it into a constant of the graph once (inductor's freezing), as
// inductor packs the weights of its own products.
constexpr int kPackedOutputs = 2 * kLanes;

template <int W, int R>
void packed_block(const LinearArgs& a, const char* w, int64_t m0, int64_t n0) {
  constexpr int V = kPackedOutputs / kLanes;
  constexpr int S = R == 1 ? 2 : 1;  // sets of accumulators
  Floats acc[S][R][V] = {};
  auto multiply_add = [&](Floats (&sums)[R][V], int64_t k) {
    Floats wv[V];
    for (int v = 0; v < V; ++v) wv[v] = load_weights<W>(w + (k * kPackedOutputs + v * kLanes) * item_size(W));
    for (int r = 0; r < R; ++r) {
      const Floats xv = hybridlm_cpu::broadcast(a.x[(m0 + r) * a.in + k]);
      for (int v = 0; v < V; ++v) sums[r][v] += xv * wv[v];
    }
  };
  int64_t k = 0;
  for (; k + S <= a.in; k += S)
    for (int s = 0; s < S; ++s) multiply_add(acc[s], k + s);
  for (; k < a.in; ++k) multiply_add(acc[0], k);
  for (int s = 1; s < S; ++s)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[0][r][v] += acc[s][r][v];
  // through memory only now: indexing the accumulators' lanes by a variable would keep them there in the loop too
  float sums[R][kPackedOutputs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) hybridlm_cpu::store_floats(sums[r] + v * kLanes, acc[0][r][v]);
  const int64_t valid = std::min<int64_t>(kPackedOutputs, a.out - n0);
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < valid; ++j) store(a, m0 + r, n0 + j, sums[r][j]);
}

template <int W>
void packed_linear(const LinearArgs& a, int threads) {
  const int64_t blocks = (a.out + kPackedOutputs - 1) / kPackedOutputs;
  const int64_t useful = std::max<int64_t>(1, std::min<int64_t>(threads, a.out * a.in >> 16));
#pragma omp parallel for num_threads(useful) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const char* w = static_cast<const char*>(a.w) + b * a.in * kPackedOutputs * item_size(W);
    int64_t m = 0;
    for (; m + 6 <= a.rows; m += 6) packed_block<W, 6>(a, w, m, b * kPackedOutputs);
    switch (a.rows - m) {
      case 5: packed_block<W, 5>(a, w, m, b * kPackedOutputs); break;
      case 4: packed_block<W, 4>(a, w, m, b * kPackedOutputs); break;
      case 3: packed_block<W, 3>(a, w, m, b * kPackedOutputs); break;
      case 2: packed_block<W, 2>(a, w, m, b * kPackedOutputs); break;
      case 1: packed_block<W, 1>(a, w, m, b * kPackedOutputs); break;
    }
  }
}

// The product (over nn.Linear's layout, or `packed`) of x widened to fp32, with its row sums for zero points.
int product(const void* x, int64_t x_kind, const void* w, int64_t w_kind, const float* scale, const int8_t* zero,
            const float* bias, void* y, int64_t rows, int64_t in, int64_t out, int64_t threads, bool packed) {
  if ((x_kind != kFloat32 && x_kind != kBfloat16) || (w_kind != kBfloat16 && w_kind != kInt8)) return -1;
  std::vector<float> widened;
  const float* xf = static_cast<const float*>(x);
  if (x_kind == kBfloat16) {
    widened.resize(rows * in);
    const uint16_t* xh = static_cast<const uint16_t*>(x);
    for (int64_t i = 0; i < rows * in; ++i) widened[i] = bf16_to_float(xh[i]);
    xf = widened.data();
  }
  std::vector<float> x_sums(zero ? rows : 0);
  for (int64_t m = 0; m < int64_t(x_sums.size()); ++m)
    for (int64_t k = 0; k < in; ++k) x_sums[m] += xf[m * in + k];
  const LinearArgs args{xf, w, scale, zero, x_sums.data(), bias, y, rows, in, out, x_kind == kBfloat16};
  if (packed && w_kind == kBfloat16) packed_linear<kBfloat16>(args, int(threads));
  else if (packed) packed_linear<kInt8>(args, int(threads));
  else if (w_kind == kBfloat16) linear<kBfloat16>(args, int(threads));
  else linear<kInt8>(args, int(threads));
  return 0;
}

}  // namespace

extern "C" {

// x: [rows, in] of x_kind (fp32 or bf16), rows contiguous; w: [out, in] of w_kind (bf16 or int8); scale, bias:
// [out] fp32 or null; zero: [out] int8 or null; y: [rows, out], of x's kind. Returns 0, or -1 for a kind it does
// not take.
int linear_rows(const void* x, int64_t x_kind, const void* w, int64_t w_kind, const float* scale,
                const int8_t* zero, const float* bias, void* y, int64_t rows, int64_t in, int64_t out,
                int64_t threads) {
  return product(x, x_kind, w, w_kind, scale, zero, bias, y, rows, in, out, threads, false);
}

// The outputs of a block of linear_rows_packed's weights (kPackedOutputs).
int64_t linear_packed_outputs() { return kPackedOutputs; }

// linear_rows over `packed`: the weights in blocks of 16 outputs, [ceil(out / 16), in, 16] (packed_block).
int linear_rows_packed(const void* x, int64_t x_kind, const void* packed, int64_t w_kind, const float* scale,
                       const int8_t* zero, const float* bias, void* y, int64_t rows, int64_t in, int64_t out,
                       int64_t threads) {
  return product(x, x_kind, packed, w_kind, scale, zero, bias, y, rows, in, out, threads, true);
}

}  // extern "C"
