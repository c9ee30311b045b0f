// The short causal convolution of Mamba, Mamba-2 and Gated DeltaNet on the CPU, behind a plain C interface (built
// and loaded with scans.cpp by hybridlm/ops/cpu_kernels.py). Depthwise over channels, causal over time:
//   y[b, t, c] = act(bias[c] + sum_k w[k, c] x'[b, t + k, c]),   x' = [the window (width - 1 steps), x]
// The reference (hybridlm/ops/causal_conv1d.py) makes x' by concatenation and runs one tensor op per tap, then a
// SiLU: a pass over memory and a dispatch each. Here each token's channels are read once, contiguous
// (time-major, the layout the mixers' projections produce), and the SiLU is applied in registers. fp32 throughout.

#include <algorithm>
#include <cstdint>

#include "fast_exp.h"

namespace {

struct ConvArgs {
  const float* x;       // x[b, t, c] at x + b * batch_stride + t * time_stride + c
  const float* window;  // [batch, channels, width - 1], or null: zeros
  const float* taps;    // [width, channels]
  const float* bias;    // [channels] (zeros for none: adding 0 leaves every sum as it was)
  float* y;             // [batch, time, channels]
  int64_t batch_stride, time_stride, batch, time, channels, width;
  bool silu;
};

// x'[b, s, c] for s in [0, width - 1 + time): the window's entries first, then x's.
inline float padded(const ConvArgs& a, int64_t b, int64_t s, int64_t c) {
  const int64_t history = a.width - 1;
  if (s >= history) return a.x[b * a.batch_stride + (s - history) * a.time_stride + c];
  return a.window ? a.window[(b * a.channels + c) * history + s] : 0.f;
}

// silu(v) = v sigmoid(v), with sigmoid from e = exp(-|v|) <= 1 (no overflow): 1 / (1 + e) for v >= 0,
// e / (1 + e) below.
inline float silu(float v) {
  const float e = hybridlm_cpu::decay_exp(v >= 0.f ? -v : v);
  return v * ((v >= 0.f ? 1.f : e) / (1.f + e));
}

// One token's outputs from its first input row `first` (x' at the token; the next taps' rows follow `stride`
// apart), channels vectorized, each output summed in a register in the reference's order (bias + w0 x0, then
// + w1 x1, ...). Width K known at compile time (the taps unrolled), or K = 0: taken from `width`.
template <int K, bool Silu>
void conv_row(const float* __restrict first, int64_t stride, const float* __restrict taps,
              const float* __restrict bias, float* __restrict y, int64_t channels, int64_t width) {
  const int64_t taps_count = K > 0 ? K : width;
#pragma omp simd
  for (int64_t c = 0; c < channels; ++c) {
    float acc = bias[c] + taps[c] * first[c];
    for (int64_t k = 1; k < taps_count; ++k) acc += taps[k * channels + c] * first[k * stride + c];
    y[c] = Silu ? silu(acc) : acc;
  }
}

template <bool Silu>
void conv_row_any(const float* first, int64_t stride, const float* taps, const float* bias, float* y,
                  int64_t channels, int64_t width) {
  switch (width) {
    case 2: return conv_row<2, Silu>(first, stride, taps, bias, y, channels, width);
    case 3: return conv_row<3, Silu>(first, stride, taps, bias, y, channels, width);
    case 4: return conv_row<4, Silu>(first, stride, taps, bias, y, channels, width);
    default: return conv_row<0, Silu>(first, stride, taps, bias, y, channels, width);
  }
}

// Tokens [t0, t1) of batch row b. The first width - 1 tokens of a row read the window, channel by channel; the
// rest read x only, with conv_row.
void conv_tokens(const ConvArgs& a, int64_t b, int64_t t0, int64_t t1) {
  const int64_t C = a.channels, K = a.width;
  for (int64_t t = t0; t < std::min(t1, K - 1); ++t) {
    float* yt = a.y + (b * a.time + t) * C;
    for (int64_t c = 0; c < C; ++c) {
      float acc = a.bias[c] + a.taps[c] * padded(a, b, t, c);
      for (int64_t k = 1; k < K; ++k) acc += a.taps[k * C + c] * padded(a, b, t + k, c);
      yt[c] = a.silu ? silu(acc) : acc;
    }
  }
  for (int64_t t = std::max(t0, K - 1); t < t1; ++t) {
    const float* first = a.x + b * a.batch_stride + (t - (K - 1)) * a.time_stride;  // x'[b, t] = x[b, t - K + 1]
    float* yt = a.y + (b * a.time + t) * C;
    if (a.silu) conv_row_any<true>(first, a.time_stride, a.taps, a.bias, yt, C, K);
    else conv_row_any<false>(first, a.time_stride, a.taps, a.bias, yt, C, K);
  }
}

// Below this many multiply-adds a second thread is not worth waking (a few microseconds of work).
constexpr int64_t kMinMacsPerThread = 1 << 17;
constexpr int64_t kTokensPerItem = 64;

}  // namespace

extern "C" void causal_conv1d_f32(const float* x, int64_t batch_stride, int64_t time_stride, const float* window,
                                  const float* taps, const float* bias, float* y, float* final_window, int64_t batch,
                                  int64_t time, int64_t channels, int64_t width, int64_t silu, int64_t threads) {
  const ConvArgs a{x, window, taps, bias, y, batch_stride, time_stride, batch, time, channels, width, silu != 0};
  const int64_t per_row = (time + kTokensPerItem - 1) / kTokensPerItem, items = batch * per_row;
  threads = std::max<int64_t>(1, std::min({threads, items, batch * time * channels * width / kMinMacsPerThread}));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < items; ++i) {
    const int64_t b = i / per_row, t0 = (i % per_row) * kTokensPerItem;
    conv_tokens(a, b, t0, std::min(time, t0 + kTokensPerItem));
  }
  // the window after the last token: x''s last width - 1 steps, [batch, channels, width - 1]
  const int64_t history = width - 1;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t c = 0; c < channels; ++c)
      for (int64_t j = 0; j < history; ++j) final_window[(b * channels + c) * history + j] = padded(a, b, time + j, c);
}
