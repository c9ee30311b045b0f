// CPU scans of hybridlm, behind a plain C interface (no torch headers: the build takes about a second).
// hybridlm/ops/cpu_kernels.py compiles this file on first use and calls it through ctypes.
//
// ssd_scan_f32: Mamba-2's SSD as the literal recurrence, one token after the other, per (batch row, head):
//   S[t] = exp(dt[t] A) S[t-1] + dt[t] x[t] (outer) B[t]        y[t] = S[t] C[t] + D x[t]
// selective_scan_f32: Mamba-1's, per channel d and state index n (one exp per state element and token):
//   h[t] = exp(dt[t] A[d, n]) h[t-1] + dt[t] B[t, n] u[t]        y[t] = sum_n C[t, n] h[t, n]
// gated_delta_rule_f32: the gated delta rule (Gated DeltaNet, KDA), per head, state S [dim_k, dim_v]:
//   S = diag(exp(g[t])) S;  u = beta[t] (v[t] - S^T k[t]);  S += k[t] u^T;  o[t] = S^T (scale q[t])
// On the CPU these beat the chunked scans of hybridlm/ops/ssd.py and selective_scan.py (the references), whose many
// small tensor ops and passes over memory cost more than the arithmetic. All arithmetic is fp32.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "fast_exp.h"

namespace {

using hybridlm_cpu::decay_exp;

struct SsdArgs {
  const float* x;   // [batch, time, heads, head_dim]
  const float* dt;  // [batch, time, heads]
  const float* A;   // [heads]
  const float* B;   // [batch, time, groups, dstate]
  const float* C;   // [batch, time, groups, dstate]
  const float* D;   // [heads, head_dim], or null: no skip
  float* state;     // [batch, heads, head_dim, dstate]: the initial state in, the final state out
  float* y;         // [batch, time, heads, head_dim]
  int64_t batch, time, heads, head_dim, groups, dstate;
};

// Tokens of one (batch row, head) on `W` consecutive entries of head_dim from `p0`, with the state held [n, p]
// in `s` (row stride `stride`): the W inputs and outputs stay in registers while n runs, so that both the update
// and the readout are vector operations along p, without horizontal sums.
template <int W>
void scan_block(const SsdArgs& a, int64_t b, int64_t h, int64_t p0, float* s, int64_t stride) {
  const int64_t g = h / (a.heads / a.groups), N = a.dstate, P = a.head_dim;
  const float decay_rate = a.A[h];
  for (int64_t t = 0; t < a.time; ++t) {
    const int64_t row = b * a.time + t;
    const float dt = a.dt[row * a.heads + h];
    const float decay = std::exp(dt * decay_rate);
    const float* Bt = a.B + (row * a.groups + g) * N;
    const float* Ct = a.C + (row * a.groups + g) * N;
    const float* xt = a.x + (row * a.heads + h) * P + p0;
    float v[W], out[W];
#pragma omp simd
    for (int j = 0; j < W; ++j) {
      v[j] = dt * xt[j];
      out[j] = 0.f;
    }
    for (int64_t n = 0; n < N; ++n) {
      const float bn = Bt[n], cn = Ct[n];
      float* sn = s + n * stride + p0;
#pragma omp simd
      for (int j = 0; j < W; ++j) {
        const float value = sn[j] * decay + v[j] * bn;
        sn[j] = value;
        out[j] += value * cn;
      }
    }
    float* yt = a.y + (row * a.heads + h) * P + p0;
    const float* Dh = a.D ? a.D + h * P + p0 : nullptr;
    for (int j = 0; j < W; ++j) yt[j] = Dh ? out[j] + Dh[j] * xt[j] : out[j];
  }
}

void scan_head(const SsdArgs& a, int64_t b, int64_t h) {
  const int64_t P = a.head_dim, N = a.dstate;
  float* state = a.state + (b * a.heads + h) * P * N;  // [p, n]
  std::vector<float> s(N * P);                          // [n, p]
  for (int64_t p = 0; p < P; ++p)
    for (int64_t n = 0; n < N; ++n) s[n * P + p] = state[p * N + n];
  int64_t p0 = 0;
  for (; p0 + 16 <= P; p0 += 16) scan_block<16>(a, b, h, p0, s.data(), P);
  for (; p0 + 8 <= P; p0 += 8) scan_block<8>(a, b, h, p0, s.data(), P);
  for (; p0 < P; ++p0) scan_block<1>(a, b, h, p0, s.data(), P);
  for (int64_t p = 0; p < P; ++p)
    for (int64_t n = 0; n < N; ++n) state[p * N + n] = s[n * P + p];
}

struct SelectiveArgs {
  const float* u;   // [batch, time, dim]
  const float* dt;  // [batch, time, dim]: already biased and soft-plussed
  const float* A;   // [dim, dstate]
  const float* B;   // [batch, time, groups, dstate]
  const float* C;   // [batch, time, groups, dstate]
  float* state;     // [batch, dim, dstate]: the initial state in, the final state out
  float* y;         // [batch, time, dim]: sum_n C h, before the skip and the gate
  int64_t batch, time, dim, groups, dstate;
};

// Tokens of `W` consecutive channels from `d0` (one group) of batch row `b`: their states held [n, W] and their
// decay rates [n, W] in scratch, so that every step is a vector operation across the channels.
template <int W>
void selective_block(const SelectiveArgs& a, int64_t b, int64_t d0) {
  const int64_t N = a.dstate, D = a.dim, g = d0 / (D / a.groups);
  std::vector<float> scratch(2 * N * W);  // states, then decay rates
  float* s = scratch.data();
  float* rate = s + N * W;
  for (int64_t n = 0; n < N; ++n)
    for (int j = 0; j < W; ++j) {
      s[n * W + j] = a.state[(b * D + d0 + j) * N + n];
      rate[n * W + j] = a.A[(d0 + j) * N + n];
    }
  for (int64_t t = 0; t < a.time; ++t) {
    const int64_t row = b * a.time + t;
    const float* ut = a.u + row * D + d0;
    const float* dtt = a.dt + row * D + d0;
    const float* Bt = a.B + (row * a.groups + g) * N;
    const float* Ct = a.C + (row * a.groups + g) * N;
    float step[W], v[W], out[W];
#pragma omp simd
    for (int j = 0; j < W; ++j) {
      step[j] = dtt[j];
      v[j] = dtt[j] * ut[j];
      out[j] = 0.f;
    }
    for (int64_t n = 0; n < N; ++n) {
      const float bn = Bt[n], cn = Ct[n];
      float* sn = s + n * W;
      const float* rn = rate + n * W;
#pragma omp simd
      for (int j = 0; j < W; ++j) {
        const float value = sn[j] * decay_exp(step[j] * rn[j]) + v[j] * bn;
        sn[j] = value;
        out[j] += value * cn;
      }
    }
    float* yt = a.y + row * D + d0;
    for (int j = 0; j < W; ++j) yt[j] = out[j];
  }
  for (int64_t n = 0; n < N; ++n)
    for (int j = 0; j < W; ++j) a.state[(b * D + d0 + j) * N + n] = s[n * W + j];
}

struct DeltaArgs {
  const float* q;     // [batch, time, key_heads, dim_k]
  const float* k;     // [batch, time, key_heads, dim_k]
  const float* v;     // [batch, time, heads, dim_v]
  const float* gate;  // log gates [batch, time, heads, gate_width] (gate_width 1 or dim_k), or null: no decay
  const float* beta;  // [batch, time, heads]
  float* state;       // [batch, heads, dim_k, dim_v]: the initial state in, the final state out
  float* o;           // [batch, time, heads, dim_v]
  float scale;
  int64_t batch, time, heads, key_heads, dim_k, dim_v, gate_width;
};

// One token of one (batch row, head) on `W` consecutive columns of the state from `p0`: two passes over the rows
// (decay and read S^T k; then write k u^T and read S^T q), the W columns of the sums in registers. `decay` holds
// the token's row decays (null: no gate).
template <int W>
void delta_block(const DeltaArgs& a, int64_t b, int64_t h, int64_t t, int64_t p0, const float* decay) {
  const int64_t K = a.dim_k, V = a.dim_v, kh = h / (a.heads / a.key_heads), row = b * a.time + t;
  float* S = a.state + (b * a.heads + h) * K * V + p0;  // row i at S + i * V
  const float* kt = a.k + (row * a.key_heads + kh) * K;
  const float* qt = a.q + (row * a.key_heads + kh) * K;
  const float* vt = a.v + (row * a.heads + h) * V + p0;
  const float beta = a.beta[row * a.heads + h];
  float read[W], u[W], out[W];
#pragma omp simd
  for (int j = 0; j < W; ++j) read[j] = out[j] = 0.f;
  for (int64_t i = 0; i < K; ++i) {
    float* Si = S + i * V;
    const float g = decay ? decay[i] : 1.f, ki = kt[i];
#pragma omp simd
    for (int j = 0; j < W; ++j) {
      const float value = Si[j] * g;
      Si[j] = value;
      read[j] += ki * value;
    }
  }
#pragma omp simd
  for (int j = 0; j < W; ++j) u[j] = beta * (vt[j] - read[j]);
  for (int64_t i = 0; i < K; ++i) {
    float* Si = S + i * V;
    const float ki = kt[i], qi = a.scale * qt[i];
#pragma omp simd
    for (int j = 0; j < W; ++j) {
      const float value = Si[j] + ki * u[j];
      Si[j] = value;
      out[j] += qi * value;
    }
  }
  float* ot = a.o + (row * a.heads + h) * V + p0;
  for (int j = 0; j < W; ++j) ot[j] = out[j];
}

// The tokens of one (batch row, head): each token's decays once (one exp for a gate per head), then every block of
// columns.
void delta_head(const DeltaArgs& a, int64_t b, int64_t h) {
  std::vector<float> decay(a.dim_k);
  for (int64_t t = 0; t < a.time; ++t) {
    if (a.gate) {
      const float* gt = a.gate + ((b * a.time + t) * a.heads + h) * a.gate_width;
      if (a.gate_width == 1) {
        std::fill(decay.begin(), decay.end(), decay_exp(gt[0]));
      } else {
#pragma omp simd
        for (int64_t i = 0; i < a.dim_k; ++i) decay[i] = decay_exp(gt[i]);
      }
    }
    const float* rows = a.gate ? decay.data() : nullptr;
    int64_t p0 = 0;
    for (; p0 + 16 <= a.dim_v; p0 += 16) delta_block<16>(a, b, h, t, p0, rows);
    for (; p0 + 8 <= a.dim_v; p0 += 8) delta_block<8>(a, b, h, t, p0, rows);
    for (; p0 < a.dim_v; ++p0) delta_block<1>(a, b, h, t, p0, rows);
  }
}

// Below this many state updates (time x head_dim x dstate, summed over its share of heads) a thread is not worth
// waking: about 25 us of work. The threads are OpenMP's, the same runtime (libgomp.so.1) and pool as torch's, so
// that torch's threads, spinning after its last parallel region, do not compete with threads of our own.
constexpr int64_t kMinUpdatesPerThread = 1 << 18;

}  // namespace

extern "C" void ssd_scan_f32(const float* x, const float* dt, const float* A, const float* B, const float* C,
                             const float* D, float* state, float* y, int64_t batch, int64_t time, int64_t heads,
                             int64_t head_dim, int64_t groups, int64_t dstate, int64_t threads) {
  const SsdArgs a{x, dt, A, B, C, D, state, y, batch, time, heads, head_dim, groups, dstate};
  const int64_t items = batch * heads;
  const int64_t updates = items * time * head_dim * dstate;
  threads = std::max<int64_t>(1, std::min({threads, items, updates / kMinUpdatesPerThread}));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < items; ++i) scan_head(a, i / a.heads, i % a.heads);
}

extern "C" void selective_scan_f32(const float* u, const float* dt, const float* A, const float* B, const float* C,
                                   float* state, float* y, int64_t batch, int64_t time, int64_t dim, int64_t groups,
                                   int64_t dstate, int64_t threads) {
  const SelectiveArgs a{u, dt, A, B, C, state, y, batch, time, dim, groups, dstate};
  // work items: blocks of 16, then 8, then single channels, never across a group's boundary
  struct Block { int64_t b, d0; int width; };
  std::vector<Block> blocks;
  const int64_t per_group = dim / groups;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t g = 0; g < groups; ++g) {
      int64_t d = g * per_group;
      const int64_t end = d + per_group;
      for (; d + 16 <= end; d += 16) blocks.push_back({b, d, 16});
      for (; d + 8 <= end; d += 8) blocks.push_back({b, d, 8});
      for (; d < end; ++d) blocks.push_back({b, d, 1});
    }
  const int64_t items = static_cast<int64_t>(blocks.size());
  const int64_t updates = batch * dim * time * dstate;
  threads = std::max<int64_t>(1, std::min({threads, items, updates / kMinUpdatesPerThread}));
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t i = 0; i < items; ++i) {
    const Block& block = blocks[i];
    if (block.width == 16) selective_block<16>(a, block.b, block.d0);
    else if (block.width == 8) selective_block<8>(a, block.b, block.d0);
    else selective_block<1>(a, block.b, block.d0);
  }
}

extern "C" void gated_delta_rule_f32(const float* q, const float* k, const float* v, const float* gate,
                                     const float* beta, float* state, float* o, float scale, int64_t batch,
                                     int64_t time, int64_t heads, int64_t key_heads, int64_t dim_k, int64_t dim_v,
                                     int64_t gate_width, int64_t threads) {
  const DeltaArgs a{q, k, v, gate, beta, state, o, scale, batch, time, heads, key_heads, dim_k, dim_v, gate_width};
  const int64_t items = batch * heads;
  const int64_t updates = items * time * dim_k * dim_v;
  threads = std::max<int64_t>(1, std::min({threads, items, updates / kMinUpdatesPerThread}));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < items; ++i) delta_head(a, i / heads, i % heads);
}
