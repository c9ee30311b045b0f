// The linear layer of few rows (decode steps) in int8 x int8 products on the CPU, behind a plain C interface (built
// with the other kernels here by hybridlm/ops/cpu_kernels.py): llama.cpp's Q8_0 scheme. The weights are int8 codes
// with one fp32 scale per output and group of G input features (torchao's weight-only int8 in groups,
// hybridlm.model.quantize_weights(group_size=G)); each input row is quantized here, per group of the same G
// features, to int8 codes with their own scale:
//   sx[m, g] = max_{k in g} |x[m, k]| / 127,  qx[m, k] = round_half_even(x[m, k] / sx[m, g])  (0 where sx is 0)
//   y[m, n] = round(sum_g sx[m, g] sw[n, g] sum_{k in g} qx[m, k] qw[n, k] + bias[n])
// The sum within a group is exact, in int32; the groups are summed in fp32 and the output rounded once.
// Why: weight-only int8 codes must each be widened to fp32 before a multiply-add (about four vector instructions per
// 8 codes on AVX2), which holds a single row's step below the memory's read speed (15-16 GB/s of codes where a
// plain read gets 20). Here 16 codes are widened to int16 by one instruction and multiplied and summed in pairs by
// one more (vpmaddwd), and the per-group scales cost two multiply-adds per 16 outputs and G features.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vectors.h"

namespace {

using hybridlm_cpu::bf16_to_float;
using hybridlm_cpu::Floats;
using hybridlm_cpu::kLanes;
typedef int32_t Ints __attribute__((vector_size(kLanes * 4)));

// Outputs of a block of packed weights: [blocks, in / 2, kBlockOutputs, 2], the codes of a block's outputs for
// features 2p and 2p + 1 side by side (cpu_kernels.pack_int8_pairs); scales [blocks, in / G, kBlockOutputs].
constexpr int kBlockOutputs = 2 * kLanes;

// 16 codes at p widened to int16: 8 outputs' pairs of features.
inline Ints widen_pairs(const int8_t* p) {
#if defined(__AVX2__)
  return (Ints)_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  Ints v;
  for (int i = 0; i < kLanes; ++i)
    v[i] = int32_t(uint16_t(int16_t(p[2 * i]))) | int32_t(uint32_t(int16_t(p[2 * i + 1])) << 16);
  return v;
#endif
}

// Each lane's two int16 products summed: lane i of w (two codes) against the pair of input codes in x.
inline Ints multiply_pairs(Ints w, Ints x) {
#if defined(__AVX2__)
  return (Ints)_mm256_madd_epi16((__m256i)w, (__m256i)x);
#else
  Ints v;
  for (int i = 0; i < kLanes; ++i)
    v[i] = int32_t(int16_t(w[i])) * int16_t(x[i]) + int32_t(int16_t(w[i] >> 16)) * int16_t(x[i] >> 16);
  return v;
#endif
}

struct Args {
  const int16_t* qx;   // [rows, in] input codes
  const float* sx;     // [rows, in / group] their scales
  const int8_t* w;     // [blocks, in / 2, 16, 2] weight codes
  const float* sw;     // [blocks, in / group, 16] their scales
  const float* bias;   // [out], or null
  void* y;             // [rows, out], fp32 or bf16
  int64_t rows, in, out, group;
  bool y_bf16;
};

// Input rows [m0, m0 + R) against block b's 16 outputs: per group, R x 16 sums in int32 over its pairs of features
// (each pair of weight vectors widened once for the R rows), then scaled into fp32 sums.
template <int R>
void block(const Args& a, int64_t b, int64_t m0) {
  const int64_t groups = a.in / a.group;
  const int8_t* w = a.w + b * a.in * kBlockOutputs;
  const float* sw = a.sw + b * groups * kBlockOutputs;
  Floats acc[R][2] = {};
  for (int64_t g = 0; g < groups; ++g) {
    Ints sums[R][2] = {};
    for (int64_t k = g * a.group; k < (g + 1) * a.group; k += 2) {
      const Ints low = widen_pairs(w + k * kBlockOutputs), high = widen_pairs(w + k * kBlockOutputs + kLanes * 2);
      for (int r = 0; r < R; ++r) {
        int32_t pair;  // the input codes of features k and k + 1, broadcast
        std::memcpy(&pair, a.qx + (m0 + r) * a.in + k, 4);
        const Ints x = Ints{} + pair;
        sums[r][0] += multiply_pairs(low, x);
        sums[r][1] += multiply_pairs(high, x);
      }
    }
    const Floats low = hybridlm_cpu::load_floats(sw + g * kBlockOutputs);
    const Floats high = hybridlm_cpu::load_floats(sw + g * kBlockOutputs + kLanes);
    for (int r = 0; r < R; ++r) {
      const Floats scale = hybridlm_cpu::broadcast(a.sx[(m0 + r) * groups + g]);
      acc[r][0] += __builtin_convertvector(sums[r][0], Floats) * (low * scale);
      acc[r][1] += __builtin_convertvector(sums[r][1], Floats) * (high * scale);
    }
  }
  float out[R][kBlockOutputs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2; ++v) hybridlm_cpu::store_floats(out[r] + v * kLanes, acc[r][v]);
  const int64_t n0 = b * kBlockOutputs, valid = std::min<int64_t>(kBlockOutputs, a.out - n0);
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < valid; ++j) {
      const float v = out[r][j] + (a.bias ? a.bias[n0 + j] : 0.f);
      const int64_t at = (m0 + r) * a.out + n0 + j;
      if (a.y_bf16) static_cast<uint16_t*>(a.y)[at] = hybridlm_cpu::float_to_bf16(v);
      else static_cast<float*>(a.y)[at] = v;
    }
}

// Row m of x (fp32, or bf16 where x_bf16) quantized per group: codes into qx, scales into sx.
void quantize_row(const void* x, bool x_bf16, int64_t m, int64_t in, int64_t group, int16_t* qx, float* sx) {
  std::vector<float> row(in);
  for (int64_t k = 0; k < in; ++k)
    row[k] = x_bf16 ? bf16_to_float(static_cast<const uint16_t*>(x)[m * in + k])
                    : static_cast<const float*>(x)[m * in + k];
  for (int64_t g = 0; g < in / group; ++g) {
    float largest = 0.f;
    for (int64_t k = g * group; k < (g + 1) * group; ++k) largest = std::max(largest, std::fabs(row[k]));
    const float scale = largest / 127.f;
    sx[m * (in / group) + g] = scale;
    for (int64_t k = g * group; k < (g + 1) * group; ++k)
      qx[m * in + k] = scale > 0.f ? int16_t(std::nearbyint(row[k] / scale)) : 0;
  }
}

}  // namespace

extern "C" {

// The outputs of a block of int8_linear_rows' packed weights.
int64_t int8_linear_block_outputs() { return kBlockOutputs; }

// x: [rows, in], fp32 (x_bf16 = 0) or bf16 (1), rows contiguous; packed: [ceil(out / 16), in / 2, 16, 2] int8
// codes; scales: [ceil(out / 16), in / group, 16] fp32; bias: [out] fp32 or null; y: [rows, out] of x's kind.
// group even and dividing in. Returns 0, or -1 for a group it does not take.
int int8_linear_rows(const void* x, int64_t x_bf16, const int8_t* packed, const float* scales, const float* bias,
                     void* y, int64_t rows, int64_t in, int64_t out, int64_t group, int64_t threads) {
  if (group <= 0 || group % 2 || in % group) return -1;
  std::vector<int16_t> qx(rows * in);
  std::vector<float> sx(rows * (in / group));
  const int64_t blocks = (out + kBlockOutputs - 1) / kBlockOutputs;
  // Threads split the blocks of outputs (each read from memory once); a second thread from 2^16 weights per thread.
  const int64_t useful = std::max<int64_t>(1, std::min<int64_t>(threads, out * in >> 16));
#pragma omp parallel for num_threads(useful) schedule(static) if (rows >= 16)
  for (int64_t m = 0; m < rows; ++m) quantize_row(x, x_bf16 != 0, m, in, group, qx.data(), sx.data());
  const Args a{qx.data(), sx.data(), packed, scales, bias, y, rows, in, out, group, x_bf16 != 0};
#pragma omp parallel for num_threads(useful) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    int64_t m = 0;
    for (; m + 4 <= rows; m += 4) block<4>(a, b, m);
    switch (rows - m) {
      case 3: block<3>(a, b, m); break;
      case 2: block<2>(a, b, m); break;
      case 1: block<1>(a, b, m); break;
    }
  }
  return 0;
}

}  // extern "C"
