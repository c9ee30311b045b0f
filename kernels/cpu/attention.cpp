// Softmax attention of a few queries over a bf16 key/value cache on the CPU, behind a plain C interface (built
// with the other kernels here by hybridlm/ops/cpu_kernels.py): hybridlm.ops.attention's _fp32_grouped_attention,
// fp32 arithmetic throughout, without its fp32 copies of the keys and values. Those copies are a decode step's
// largest cost on a CPU without bf16 products: a fresh fp32 buffer twice the cache's size, written and read back
// on every call. Here each key and value vector is widened to fp32 in registers as it is read, the queries of a
// group (the query heads sharing a key/value head, times the queries of the step) taking turns on the keys and
// sharing each value vector, and slots that no query may attend to are not read at all. Scores are computed 8 keys
// at a time and values summed in register tiles: against one dot and one value row at a time (the first version),
// batch 16 x 2,048 keys, 3 key/value heads of 64, groups of 3, 1 thread, C++ timing, min of six interleaved runs:
// 4.1 against 6.8 ms; SmolLM2's step at 256 tokens in a 320-slot cache, 0.50 against 0.87 ms a layer.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "fast_exp.h"
#include "vectors.h"

namespace {

using hybridlm_cpu::bf16_to_float;
using hybridlm_cpu::Floats;
using hybridlm_cpu::kLanes;
using hybridlm_cpu::lane_sum;
using hybridlm_cpu::load_bf16;
using hybridlm_cpu::load_floats;

constexpr float kMasked = -std::numeric_limits<float>::infinity();
// slots scored together, one accumulator each (see dots)
constexpr int kSlots = 8;

// out[j] = q . keys[j] for the J bf16 key rows at `keys` (`stride` apart), each widened as it is loaded; one
// accumulator per key so that the multiply-adds of a key do not wait on each other's latency (a lone dot of 64
// entries is a chain of 8 dependent multiply-adds); with J = kSlots the eight sums fold into one vector at the end.
template <int J>
inline void dots(const float* q, const uint16_t* keys, int64_t dim, int64_t stride, float* out) {
  const int64_t whole = dim - dim % kLanes;
  Floats acc[J] = {};
  for (int64_t i = 0; i < whole; i += kLanes) {
    const Floats qv = load_floats(q + i);
    for (int j = 0; j < J; ++j) acc[j] += qv * load_bf16(keys + j * stride + i);
  }
#if defined(__AVX__)
  if constexpr (J == 8) {  // lanes summed pairwise within each 128-bit half, then the halves added
    __m256 a[8];
    for (int j = 0; j < 8; ++j) a[j] = (__m256)acc[j];
    const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                                        _mm256_permute2f128_ps(low, high, 0x31)));
  } else
#endif
    for (int j = 0; j < J; ++j) out[j] = lane_sum(acc[j]);
  for (int j = 0; j < J; ++j)
    for (int64_t i = whole; i < dim; ++i) out[j] += q[i] * bf16_to_float(keys[j * stride + i]);
}

// out[r, c...] = sum over the slots `seen` of p[r, s] v[s, c...] for R rows and C vectors of value columns from
// c: R x C accumulators held in registers over all the slots, each value vector widened once for the R rows.
template <int R, int C>
void weighted_values(const float* p, int64_t slots, const uint16_t* v, int64_t v_stride, const uint8_t* seen,
                     int64_t c, float* out, int64_t dim_v) {
  Floats acc[R][C] = {};
  for (int64_t s = 0; s < slots; ++s) {
    if (!seen[s]) continue;
    Floats values[C];
    for (int i = 0; i < C; ++i) values[i] = load_bf16(v + s * v_stride + c + i * kLanes);
    for (int r = 0; r < R; ++r) {
      const Floats weight = hybridlm_cpu::broadcast(p[r * slots + s]);
      for (int i = 0; i < C; ++i) acc[r][i] += weight * values[i];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < C; ++i) hybridlm_cpu::store_floats(out + r * dim_v + c + i * kLanes, acc[r][i]);
}

// weighted_values for R rows over all the value columns: 4 vectors at a time (12 accumulators for 3 rows),
// then single vectors, then the last columns one by one.
template <int R>
void weighted_value_rows(const float* p, int64_t slots, const uint16_t* v, int64_t v_stride, const uint8_t* seen,
                         float* out, int64_t dim_v) {
  int64_t c = 0;
  for (; c + 4 * kLanes <= dim_v; c += 4 * kLanes)
    weighted_values<R, 4>(p, slots, v, v_stride, seen, c, out, dim_v);
  for (; c + kLanes <= dim_v; c += kLanes) weighted_values<R, 1>(p, slots, v, v_stride, seen, c, out, dim_v);
  for (; c < dim_v; ++c)
    for (int r = 0; r < R; ++r) {
      float sum = 0.f;
      for (int64_t s = 0; s < slots; ++s)
        if (seen[s]) sum += p[r * slots + s] * bf16_to_float(v[s * v_stride + c]);
      out[r * dim_v + c] = sum;
    }
}

struct AttentionArgs {
  const float* q;        // [batch, heads, rows, dim]: rows = group x q_len, the queries of key/value head h
  const uint16_t* k;     // bf16 keys: (b, h, s, i) at b * strides[0] + h * strides[1] + s * strides[2] + i
  const uint16_t* v;     // bf16 values: the same with strides[3..5] and dim_v
  const uint8_t* mask;   // 1 where query (b, q_head, t) may see slot s, at strides[6..9]; null: everywhere
  float* out;            // [batch, heads, rows, dim_v]
  int64_t heads, group, q_len, slots, dim, dim_v;
  const int64_t* strides;
  float scale;
};

struct Scratch {
  std::vector<float> scores, sums;
  std::vector<uint8_t> seen;
  std::vector<int64_t> mask_rows;
};

// One (batch row, key/value head): scores, their softmax, and the probability-weighted sum of the values.
void attend(const AttentionArgs& a, int64_t b, int64_t h, Scratch& w) {
  const int64_t unit = b * a.heads + h, rows = a.group * a.q_len;
  const int64_t* st = a.strides;
  const float* q = a.q + unit * rows * a.dim;
  const uint16_t* k = a.k + b * st[0] + h * st[1];
  const uint16_t* v = a.v + b * st[3] + h * st[4];
  float* out = a.out + unit * rows * a.dim_v;
  w.mask_rows.resize(rows);  // where row r's mask starts: query head h * group + r / q_len, query r % q_len
  for (int64_t r = 0; r < rows; ++r)
    w.mask_rows[r] = b * st[6] + (h * a.group + r / a.q_len) * st[7] + (r % a.q_len) * st[8];
  auto allowed = [&](int64_t r, int64_t s) { return !a.mask || a.mask[w.mask_rows[r] + s * st[9]]; };
  w.seen.assign(a.slots, !a.mask);  // slots some row may see: the only ones read
  for (int64_t r = 0; a.mask && r < rows; ++r) {
    const auto first = w.mask_rows.begin();
    if (std::find(first, first + r, w.mask_rows[r]) != first + r) continue;  // a mask row shared with an earlier row
    for (int64_t s = 0; s < a.slots; ++s) w.seen[s] |= a.mask[w.mask_rows[r] + s * st[9]];
  }
  // Only up to the last slot seen from here on: a static cache's unfilled tail is often most of it (SmolLM2's
  // step at 257 of 2,048 slots, 1 row: 103 against 35 us for a cache of 320).
  int64_t slots = a.slots;
  while (slots > 0 && !w.seen[slots - 1]) --slots;
  w.scores.assign(rows * slots, kMasked);
  w.sums.assign(rows, 0.f);

  for (int64_t s = 0; s < slots;) {  // scores [rows, slots]; masked ones stay -inf
    const bool block = s + kSlots <= slots && std::count(&w.seen[s], &w.seen[s + kSlots], 1) == kSlots;
    const int count = block ? kSlots : 1;
    if (block || w.seen[s]) {  // kSlots slots together, or this one alone; scored for every row, masked after
      for (int64_t r = 0; r < rows; ++r) {
        float* p = w.scores.data() + r * slots + s;
        if (block) dots<kSlots>(q + r * a.dim, k + s * st[2], a.dim, st[2], p);
        else dots<1>(q + r * a.dim, k + s * st[2], a.dim, st[2], p);
        for (int j = 0; j < count; ++j) p[j] = allowed(r, s + j) ? p[j] * a.scale : kMasked;
      }
    }
    s += count;
  }
  for (int64_t r = 0; r < rows; ++r) {  // exp(score - max), each row's sum kept to divide by at the end
    float* p = w.scores.data() + r * slots;
    const float top = *std::max_element(p, p + slots);
    if (top == kMasked) {  // nothing to attend to: NaN, as softmax over all -inf gives
      w.sums[r] = std::numeric_limits<float>::quiet_NaN();
      std::fill(p, p + slots, 0.f);
      continue;
    }
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t s = 0; s < slots; ++s) {
      p[s] = hybridlm_cpu::decay_exp(p[s] - top);  // -inf - top: below exp's range, 0
      sum += p[s];
    }
    w.sums[r] = sum;
  }
  int64_t r = 0;  // out [rows, dim_v] = p [rows, slots] v [slots, dim_v], 3 rows at a time
  const float* p = w.scores.data();
  for (; r + 3 <= rows; r += 3)
    weighted_value_rows<3>(p + r * slots, slots, v, st[5], w.seen.data(), out + r * a.dim_v, a.dim_v);
  for (; r < rows; ++r)
    weighted_value_rows<1>(p + r * slots, slots, v, st[5], w.seen.data(), out + r * a.dim_v, a.dim_v);
  for (r = 0; r < rows; ++r) {
    const float inverse = 1.f / w.sums[r];
    for (int64_t i = 0; i < a.dim_v; ++i) out[r * a.dim_v + i] *= inverse;
  }
}

}  // namespace

extern "C" {

// q: [batch, heads, group * q_len, dim] fp32; k, v: bf16 rows of dim / dim_v contiguous entries; mask: bytes
// (bools) or null; strides (in elements): k's batch, head, slot; v's; the mask's batch, query head, query, slot
// (0 where it broadcasts); out: [batch, heads, group * q_len, dim_v] fp32. (batch, head) pairs go to OpenMP
// threads from 2^17 multiply-adds per thread.
void grouped_attention_bf16(const float* q, const uint16_t* k, const uint16_t* v, const uint8_t* mask, float* out,
                            int64_t batch, int64_t heads, int64_t group, int64_t q_len, int64_t slots, int64_t dim,
                            int64_t dim_v, const int64_t* strides, float scale, int64_t threads) {
  const AttentionArgs args{q, k, v, mask, out, heads, group, q_len, slots, dim, dim_v, strides, scale};
  const int64_t units = batch * heads, work = units * group * q_len * slots * (dim + dim_v);
  const int64_t useful = std::max<int64_t>(1, std::min<int64_t>({threads, units, work >> 17}));
#pragma omp parallel num_threads(useful)
  {
    Scratch scratch;
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; ++u) attend(args, u / heads, u % heads, scratch);
  }
}

}  // extern "C"
