// Softmax attention of a few queries over a bf16 key/value cache on the CPU, behind a plain C interface (built
// with the other kernels here by hybridlm/ops/cpu_kernels.py): hybridlm.ops.attention's _fp32_grouped_attention,
// fp32 arithmetic throughout, without its fp32 copies of the keys and values. Those copies are a decode step's
// largest cost on a CPU without bf16 products: a fresh fp32 buffer twice the cache's size, written and read back
// on every call. Here each key and value row is widened to fp32 as it is read, once for all the queries of its
// group (the query heads sharing a key/value head, times the queries of the step), and slots that no query may
// attend to are not read at all.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "fast_exp.h"

namespace {

inline void widen(const uint16_t* in, int64_t n, float* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t word = uint32_t(in[i]) << 16;
    std::memcpy(out + i, &word, 4);
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
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

// One (batch row, key/value head): scores, their softmax, and the probability-weighted sum of the values.
void attend(const AttentionArgs& a, int64_t b, int64_t h, std::vector<float>& scores, std::vector<float>& row,
            std::vector<float>& sums, std::vector<int64_t>& mask_rows) {
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  const int64_t unit = b * a.heads + h, rows = a.group * a.q_len, slots = a.slots;
  const int64_t* st = a.strides;
  const float* q = a.q + unit * rows * a.dim;
  const uint16_t* k = a.k + b * st[0] + h * st[1];
  const uint16_t* v = a.v + b * st[3] + h * st[4];
  float* out = a.out + unit * rows * a.dim_v;
  scores.assign(rows * slots, kMasked);
  row.resize(std::max(a.dim, a.dim_v));
  sums.assign(rows, 0.f);
  mask_rows.resize(rows);  // where row r's mask starts: query head h * group + r / q_len, query r % q_len
  for (int64_t r = 0; r < rows; ++r)
    mask_rows[r] = b * st[6] + (h * a.group + r / a.q_len) * st[7] + (r % a.q_len) * st[8];
  auto allowed = [&](int64_t r, int64_t s) { return !a.mask || a.mask[mask_rows[r] + s * st[9]]; };
  auto any_allowed = [&](int64_t s) {
    for (int64_t r = 0; r < rows; ++r)
      if (allowed(r, s)) return true;
    return false;
  };
  for (int64_t s = 0; s < slots; ++s) {  // scores [rows, slots]; masked ones stay -inf
    if (!any_allowed(s)) continue;
    widen(k + s * st[2], a.dim, row.data());
    for (int64_t r = 0; r < rows; ++r)
      if (allowed(r, s)) scores[r * slots + s] = dot(q + r * a.dim, row.data(), a.dim) * a.scale;
  }
  for (int64_t r = 0; r < rows; ++r) {  // exp(score - max), each row's sum kept to divide by at the end
    float* p = scores.data() + r * slots;
    const float top = *std::max_element(p, p + slots);
    if (top == kMasked) {  // nothing to attend to: NaN, as softmax over all -inf gives
      sums[r] = std::numeric_limits<float>::quiet_NaN();
      std::fill(p, p + slots, 0.f);
      continue;
    }
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t s = 0; s < slots; ++s) {
      p[s] = hybridlm_cpu::decay_exp(p[s] - top);  // -inf - top: below exp's range, 0
      sum += p[s];
    }
    sums[r] = sum;
  }
  std::fill(out, out + rows * a.dim_v, 0.f);
  for (int64_t s = 0; s < slots; ++s) {  // out [rows, dim_v] += p[:, s] v[s]
    if (!any_allowed(s)) continue;
    widen(v + s * st[5], a.dim_v, row.data());
    for (int64_t r = 0; r < rows; ++r) {
      const float p = scores[r * slots + s];
      float* o = out + r * a.dim_v;
#pragma omp simd
      for (int64_t i = 0; i < a.dim_v; ++i) o[i] += p * row[i];
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inverse = 1.f / sums[r];
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
    std::vector<float> scores, row, sums;
    std::vector<int64_t> mask_rows;
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; ++u) attend(args, u / heads, u % heads, scores, row, sums, mask_rows);
  }
}

}  // extern "C"
