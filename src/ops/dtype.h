// Scalar conversions between float32 and the 16-bit weight types (bfloat16, IEEE half).
#pragma once
#include <cstdint>
#include <cstring>

#include "mixlens/tensor.h"

namespace mixlens::ops {

/// bfloat16 bits -> float (exact: bf16 is the top half of a float32).
inline float bf16_to_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
/// float -> bfloat16 bits, round to nearest even (torch's .to(torch.bfloat16)); NaN stays NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
/// IEEE half bits -> float (exact).
inline float f16_to_f32(uint16_t h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return static_cast<float>(x);
}
/// float -> IEEE half bits, round to nearest even; out of range -> +-inf.
inline uint16_t f32_to_f16(float f) {
  const _Float16 x = static_cast<_Float16>(f);
  uint16_t h;
  std::memcpy(&h, &x, 2);
  return h;
}

/// dst[i] = float(src[i]) for n 16-bit (bf16 / f16) or float32 values.
inline void widen(ScalarType t, const void* src, float* dst, int64_t n) {
  const auto* s = static_cast<const uint16_t*>(src);
  if (t == ScalarType::bfloat16)
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
  else if (t == ScalarType::float16)
    for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
  else
    std::memcpy(dst, src, sizeof(float) * static_cast<size_t>(n));
}

}  // namespace mixlens::ops
