// Scalar conversions between float32 and the narrow weight types (bfloat16, IEEE half, blocked int8).
#pragma once
#include <cstdint>
#include <cstring>
#include <memory>

#include "mixlens/tensor.h"
#include "ops/q8_layout.h"

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
/// IEEE half bits -> float (exact; bit manipulation: clang has no _Float16 on plain x86-64).
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  float f;
  if (e == 0) {  // zero / subnormal: m * 2^-24, exact in float
    f = static_cast<float>(m) * 0x1p-24f;
    return sign ? -f : f;
  }
  const uint32_t u = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112u) << 23) | (m << 13));
  std::memcpy(&f, &u, 4);
  return f;
}
/// float -> IEEE half bits, round to nearest even; beyond 65504 (after rounding) -> +-inf; NaN stays
/// NaN (F. Giesen's float_to_half_fast3_rtne).
inline uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  if (u >= 0x47800000u) return static_cast<uint16_t>(sign | (u > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (u < 0x38800000u) {  // result subnormal or zero: let the FPU round at the 2^-24 grid
    float g;
    std::memcpy(&g, &u, 4);
    g += 0.5f;
    uint32_t r;
    std::memcpy(&r, &g, 4);
    return static_cast<uint16_t>(sign | (r - 0x3f000000u));
  }
  const uint32_t odd = (u >> 13) & 1u;
  u += 0xc8000fffu + odd;  // rebias the exponent (127 -> 15) and round to nearest even
  return static_cast<uint16_t>(sign | (u >> 13));
}

/// Storage for `n` 16-bit weights: 64-byte aligned (vector loads of a row start never split a
/// cache line); buffers of 4 MiB and more are 2 MiB aligned and advised as transparent huge pages
/// (a decode step streams every weight: 4 KiB pages cost TLB misses). Throws std::bad_alloc.
std::shared_ptr<uint16_t> alloc_weights16(int64_t n);
/// The same storage for any weight of `bytes` bytes (free with std::free).
void* alloc_weights(size_t bytes);

inline int64_t q8_row_bytes(int64_t in) { return (in + kQ8Block - 1) / kQ8Block * kQ8BlockBytes; }
/// Bytes of one row of `cols` weights of dtype t.
inline int64_t row_bytes(ScalarType t, int64_t cols) {
  switch (t) {
    case ScalarType::float32: return 4 * cols;
    case ScalarType::bfloat16:
    case ScalarType::float16: return 2 * cols;
    case ScalarType::int8: return q8_row_bytes(cols);
  }
  return 0;
}
/// Quantizes one row: per block s = max|w| / 127 and q = w / s rounded to nearest even (|q| <= 127;
/// a block of zeros has s = 0), as llama.cpp's Q8_0 but with a float32 scale (no float16 rounding
/// of s). `w` must be finite. Writes q8_row_bytes(in) bytes.
void quantize_q8_row(const float* w, int64_t in, uint8_t* dst);

/// dst[r * cols + c] = float(W[r0 + r, c]) for rows [r0, r0 + n) of a 2-D-or-more tensor of any dtype
/// (rows: every axis but the last). Exact for bf16 / f16; q * s for int8.
void widen_rows(const Tensor& W, int64_t r0, int64_t n, float* dst);

}  // namespace mixlens::ops
