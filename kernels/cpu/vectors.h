// fp32 vectors of the CPU kernels (linear.cpp, integer_linear.cpp, attention.cpp), as GCC vector extensions: the
// compiler maps them to AVX2 (or splits them for narrower units), with intrinsics only where a widening has no
// portable spelling as fast.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace hybridlm_cpu {

constexpr int kLanes = 8;  // fp32 lanes of one vector (AVX2's 256 bits)
typedef float Floats __attribute__((vector_size(kLanes * 4)));
typedef uint16_t Halves __attribute__((vector_size(kLanes * 2)));
typedef uint32_t Words __attribute__((vector_size(kLanes * 4)));

inline Floats load_floats(const float* p) {
  Floats v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store_floats(float* p, Floats v) { std::memcpy(p, &v, sizeof v); }

// kLanes copies of f: one broadcast (`Floats{} + f` would add +0.0 first, an instruction and a register more).
inline Floats broadcast(float f) { return Floats{f, f, f, f, f, f, f, f}; }

// The sum of v's lanes, in lane order.
inline float lane_sum(Floats v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// kLanes bf16 values from p, widened to fp32 (exact: a bf16 is the top half of an fp32).
inline Floats load_bf16(const void* p) {
#if defined(__AVX2__)
  const __m128i h = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return (Floats)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
  Halves h;
  std::memcpy(&h, p, sizeof h);
  return (Floats)(__builtin_convertvector(h, Words) << 16);
#endif
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t word = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &word, 4);
  return f;
}

// Round to nearest even, as torch rounds fp32 to bf16 (a NaN stays a NaN).
inline uint16_t float_to_bf16(float f) {
  uint32_t word;
  std::memcpy(&word, &f, 4);
  if ((word & 0x7fffffffu) > 0x7f800000u) return uint16_t((word >> 16) | 0x40);
  return uint16_t((word + 0x7fffu + ((word >> 16) & 1u)) >> 16);
}

}  // namespace hybridlm_cpu
