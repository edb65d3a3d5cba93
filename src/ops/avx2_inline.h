// Small AVX2 + FMA helpers shared by the files compiled with those flags (ops/kernels_avx2.cpp,
// ops/tile_kernels_avx2.cpp, mixers/ssm_kernels_avx2.cpp, and ops/kernels_avx512.cpp, whose int8 sum must
// end as the AVX2 level's). Include it only there: the anonymous
// namespace keeps each copy internal, so the linker never hands an AVX2 body to other callers.
#pragma once
#if defined(__x86_64__)
#include <immintrin.h>

namespace mixlens::avx2 {
namespace {

/// v[0] + ... + v[7].
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/// The Cephes exp core on an already clamped x: n = round(x / ln 2) (returned) and the polynomial
/// p ~ exp(x - n ln 2); callers scale p by 2^n in the way their range needs.
inline __m256 exp_core(__m256 x, __m256& n) {
  n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  return _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
}

}  // namespace
}  // namespace mixlens::avx2
#endif
