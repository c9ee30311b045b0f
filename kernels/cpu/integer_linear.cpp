// The linear layer in int8 x int8 products on the CPU (decode steps and prefill rows), behind a plain C interface
// (built with the other kernels here by hybridlm/ops/cpu_kernels.py): llama.cpp's Q8_0 scheme. The weights are int8
// codes with one fp32 scale per output and group of G input features (torchao's weight-only int8 in groups,
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

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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
  const float* bias;   // [out], or null
  void* y;             // [rows, out], fp32 or bf16
  int64_t rows, in, out, group;
  bool y_bf16;
};

// Input rows [m0, m0 + R) against the 16 outputs from n0, whose codes w [in / 2, 16, 2] and scales sw [in / group,
// 16] are packed: per group, R x 16 sums in int32 over its pairs of features (each pair of weight vectors widened
// once for the R rows), then scaled into fp32 sums.
template <int R>
void block(const Args& a, const int8_t* w, const float* sw, int64_t n0, int64_t m0) {
  const int64_t groups = a.in / a.group;
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
  const int64_t valid = std::min<int64_t>(kBlockOutputs, a.out - n0);
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < valid; ++j) {
      const float v = out[r][j] + (a.bias ? a.bias[n0 + j] : 0.f);
      const int64_t at = (m0 + r) * a.out + n0 + j;
      if (a.y_bf16) static_cast<uint16_t*>(a.y)[at] = hybridlm_cpu::float_to_bf16(v);
      else static_cast<float*>(a.y)[at] = v;
    }
}

// The 16 outputs from n0 of codes [out, in] and scales [out, groups] in the packed layout (zero past out): w [in / 2,
// 16, 2], sw [groups, 16]. Each feature pair's two codes move as one int16, so the codes' block is a 16 x in / 2
// transpose of int16, done 8 x 8 at a time with SSE2's unpacks where there are (three rounds of interleaving: pairs,
// then quads, then halves), element by element for the rest. Packing a block where it is multiplied costs about
// one read of its codes, against a whole copy of the weights packed ahead (cpu_kernels.pack_int8_pairs).
void pack_block(const int8_t* codes, const float* scales, int64_t n0, int64_t out, int64_t in, int64_t groups,
                int8_t* w, float* sw) {
  const int64_t pairs = in / 2, valid = std::min<int64_t>(kBlockOutputs, out - n0);
  const int16_t* rows = reinterpret_cast<const int16_t*>(codes) + n0 * pairs;  // [valid, pairs]
  int16_t* packed = reinterpret_cast<int16_t*>(w);                              // [pairs, 16]
  int64_t p = 0;
#if defined(__SSE2__)
  for (; p + 8 <= pairs; p += 8)
    for (int64_t half = 0; half < kBlockOutputs; half += 8) {
      __m128i r[8], t[8], u[8];
      for (int j = 0; j < 8; ++j)
        r[j] = half + j < valid ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + (half + j) * pairs + p))
                                : _mm_setzero_si128();
      for (int j = 0; j < 4; ++j) {  // t[2j]: pairs 0-3 of outputs 2j and 2j + 1 interleaved; t[2j + 1]: pairs 4-7
        t[2 * j] = _mm_unpacklo_epi16(r[2 * j], r[2 * j + 1]);
        t[2 * j + 1] = _mm_unpackhi_epi16(r[2 * j], r[2 * j + 1]);
      }
      for (int j = 0; j < 2; ++j)  // u[4j..4j + 3]: pairs (0, 1), (2, 3), (4, 5), (6, 7) of outputs 4j..4j + 3
        for (int h = 0; h < 2; ++h) {
          u[4 * j + 2 * h] = _mm_unpacklo_epi32(t[4 * j + h], t[4 * j + h + 2]);
          u[4 * j + 2 * h + 1] = _mm_unpackhi_epi32(t[4 * j + h], t[4 * j + h + 2]);
        }
      for (int j = 0; j < 4; ++j) {  // pairs 2j and 2j + 1 of the eight outputs: u[j] (outputs 0-3), u[j + 4]
        _mm_storeu_si128(reinterpret_cast<__m128i*>(packed + (p + 2 * j) * kBlockOutputs + half),
                         _mm_unpacklo_epi64(u[j], u[j + 4]));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(packed + (p + 2 * j + 1) * kBlockOutputs + half),
                         _mm_unpackhi_epi64(u[j], u[j + 4]));
      }
    }
#endif
  for (; p < pairs; ++p)
    for (int64_t j = 0; j < kBlockOutputs; ++j) packed[p * kBlockOutputs + j] = j < valid ? rows[j * pairs + p] : 0;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t j = 0; j < kBlockOutputs; ++j)
      sw[g * kBlockOutputs + j] = j < valid ? scales[(n0 + j) * groups + g] : 0.f;
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

// x: [rows, in], fp32 (x_bf16 = 0) or bf16 (1), rows contiguous; codes: packed (w_packed = 1) [ceil(out / 16),
// in / 2, 16, 2] int8 with scales [ceil(out / 16), in / group, 16] fp32, or as they are (0) [out, in] with scales
// [out, in / group], each block then packed by the thread that multiplies it; bias: [out] fp32 or null; y: [rows,
// out] of x's kind. group even and dividing in. Returns 0, or -1 for a group it does not take.
int int8_linear_rows(const void* x, int64_t x_bf16, const int8_t* codes, const float* scales, int64_t w_packed,
                     const float* bias, void* y, int64_t rows, int64_t in, int64_t out, int64_t group,
                     int64_t threads) {
  if (group <= 0 || group % 2 || in % group) return -1;
  std::vector<int16_t> qx(rows * in);
  std::vector<float> sx(rows * (in / group));
  const int64_t blocks = (out + kBlockOutputs - 1) / kBlockOutputs, groups = in / group;
  // Threads split the blocks of outputs (each read from memory once); a second thread from 2^16 weights per thread.
  const int64_t useful = std::max<int64_t>(1, std::min<int64_t>(threads, out * in >> 16));
#pragma omp parallel for num_threads(useful) schedule(static) if (rows >= 16)
  for (int64_t m = 0; m < rows; ++m) quantize_row(x, x_bf16 != 0, m, in, group, qx.data(), sx.data());
  const Args a{qx.data(), sx.data(), bias, y, rows, in, out, group, x_bf16 != 0};
#pragma omp parallel num_threads(useful)
  {
    std::vector<int8_t> own_codes(w_packed ? 0 : in * kBlockOutputs);  // this thread's packed block
    std::vector<float> own_scales(w_packed ? 0 : groups * kBlockOutputs);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int8_t* w = codes + b * in * kBlockOutputs;
      const float* sw = scales + b * groups * kBlockOutputs;
      if (!w_packed) {
        pack_block(codes, scales, b * kBlockOutputs, out, in, groups, own_codes.data(), own_scales.data());
        w = own_codes.data();
        sw = own_scales.data();
      }
      int64_t m = 0;
      for (; m + 4 <= rows; m += 4) block<4>(a, w, sw, b * kBlockOutputs, m);
      switch (rows - m) {
        case 3: block<3>(a, w, sw, b * kBlockOutputs, m); break;
        case 2: block<2>(a, w, sw, b * kBlockOutputs, m); break;
        case 1: block<1>(a, w, sw, b * kBlockOutputs, m); break;
      }
    }
  }
  return 0;
}

}  // extern "C"
