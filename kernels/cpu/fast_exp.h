// Shared by the CPU kernels of hybridlm (scans.cpp, conv.cpp): an exp the compiler vectorizes.
#pragma once

#include <cstdint>

namespace hybridlm_cpu {

// exp(x) for the decays (x <= 0), written so that the compiler vectorizes it (a libm call would not be): 2^k
// times a degree-7 polynomial of r = x - k ln2, |r| <= ln2 / 2; k is rounded by adding 1.5 * 2^23, whose low bits
// then hold it. Within 1.3 ulp of exp over [-80, 0] (checked against float64 in the tests). Decays below
// exp(-80) (1.8e-35) are zero, as in the references (ops/ssd.py's LOG_FLOOR): states that small would be denormal,
// and slow. Selects rather than branches, which -fno-trapping-math lets the compiler if-convert.
inline float decay_exp(float x) {
  const float keep = x >= -80.f ? 1.f : 0.f;
  x = x >= -87.f ? x : -87.f;
  const float shifted = x * 1.44269504088896341f + 12582912.f;
  const float k = shifted - 12582912.f;
  const float r = (x - k * 0.693145751953125f) - k * 1.42860682030941723e-6f;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t exponent = (__builtin_bit_cast(int32_t, shifted) - 0x4B400000 + 127) << 23;
  return keep * (p * __builtin_bit_cast(float, exponent));
}

}  // namespace hybridlm_cpu
