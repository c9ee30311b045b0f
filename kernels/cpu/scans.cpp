// CPU scans of hybridlm, behind a plain C interface (no torch headers: the build takes about a second).
// hybridlm/ops/cpu_kernels.py compiles this file on first use and calls it through ctypes.
//
// ssd_scan_f32: Mamba-2's SSD as the literal recurrence, one token after the other, per (batch row, head):
//   S[t] = exp(dt[t] A) S[t-1] + dt[t] x[t] (outer) B[t]        y[t] = S[t] C[t] + D x[t]
// On the CPU this beats the chunked scan of hybridlm/ops/ssd.py (the reference), whose many small tensor ops
// cost more than the arithmetic at the state sizes of small and mid-sized models. All arithmetic is fp32.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

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
