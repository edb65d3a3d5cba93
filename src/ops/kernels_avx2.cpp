// AVX2 + FMA + F16C kernels (8 floats per register). Compiled with those target flags
// (CMakeLists.txt), called only after __builtin_cpu_supports says so; keep free of library
// templates/inline functions (see kernels_avx512.cpp).
#if defined(__x86_64__)
// GCC 12's own intrinsic headers trip -Wmaybe-uninitialized (their __Y = __Y idiom).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <cstdint>

#include "ops/avx2_inline.h"
#include "ops/kernels.h"
#include "ops/q8_layout.h"

namespace mixlens::ops {
namespace {

using avx2::hsum;

inline float bf16f(uint16_t b) {
  const __m128i v = _mm_cvtsi32_si128(static_cast<int>(static_cast<uint32_t>(b) << 16));
  return _mm_cvtss_f32(_mm_castsi128_ps(v));
}
inline float f16f(uint16_t h) { return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h))); }

struct F32 {
  using T = float;
  static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static float one(const float* p) { return *p; }
};
struct BF16 {
  using T = uint16_t;
  static __m256 load(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
  static float one(const uint16_t* p) { return bf16f(*p); }
};
struct F16 {
  using T = uint16_t;
  static __m256 load(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static float one(const uint16_t* p) { return f16f(*p); }
};

// Decode streams each weight row once: a software prefetch this far ahead crosses the 4 KiB
// boundaries the hardware prefetchers stop at (2 MiB folios: 26 -> 29-31 GB/s bf16 on 2 threads here,
// 0.5 / 2 / 4 KiB measured worse; the int8 matvec 23 -> 25.5). No effect on any value.
constexpr int64_t kPrefetchBytes = 1024;

// One (row, output) sum: four accumulators over blocks of 32 k, blocks of 8 into the first, one
// fixed horizontal sum, then the tail one fused multiply-add at a time. R rows run together (the
// weights loaded once for all), each in exactly this order: the matvec is the R = 1 tile, so a
// row's results do not depend on how many rows run with it. 4 R accumulators of 16 registers.
template <class L, int R>
void dot_tile(const typename L::T* w, const float* X, int64_t ldx, float* Y, int64_t ldy, int64_t in) {
  const int64_t in32 = in & ~int64_t{31}, in8 = in & ~int64_t{7};
  __m256 a[R][4];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) a[r][q] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k < in32; k += 32) {
    if constexpr (R == 1) {  // the matvec: one stream the hardware prefetcher stops following at 4 KiB
      const char* pf = reinterpret_cast<const char*>(w + k) + kPrefetchBytes;
      _mm_prefetch(pf, _MM_HINT_T0);
      if constexpr (sizeof(typename L::T) == 4) _mm_prefetch(pf + 64, _MM_HINT_T0);
    }
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      __m256 wv = L::load(w + k + 8 * q);
      if constexpr (R > 1) __asm__("" : "+v"(wv));  // one load for the R FMAs (GCC would fold it into each)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) a[r][q] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(X + r * ldx + k + 8 * q), a[r][q]);
    }
  }
  for (; k < in8; k += 8) {
    const __m256 wv = L::load(w + k);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) a[r][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(X + r * ldx + k), a[r][0]);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    float s = hsum(_mm256_add_ps(_mm256_add_ps(a[r][0], a[r][1]), _mm256_add_ps(a[r][2], a[r][3])));
    for (int64_t j = k; j < in; ++j) s = __builtin_fmaf(L::one(w + j), X[r * ldx + j], s);
    Y[r * ldy] = s;
  }
}

// dot_tile<L, 1> for two weight rows at once, each summed in exactly that order (so bitwise the
// same): two streams, far apart, for the core's memory accesses.
template <class L>
void dot_pair(const typename L::T* w0, const typename L::T* w1, const float* x, float* y0, float* y1, int64_t in) {
  const int64_t in32 = in & ~int64_t{31}, in8 = in & ~int64_t{7};
  __m256 a[2][4];
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) a[0][q] = a[1][q] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k < in32; k += 32) {
    const char* pf0 = reinterpret_cast<const char*>(w0 + k) + kPrefetchBytes;
    const char* pf1 = reinterpret_cast<const char*>(w1 + k) + kPrefetchBytes;
    _mm_prefetch(pf0, _MM_HINT_T0);
    _mm_prefetch(pf1, _MM_HINT_T0);
    if constexpr (sizeof(typename L::T) == 4) _mm_prefetch(pf0 + 64, _MM_HINT_T0), _mm_prefetch(pf1 + 64, _MM_HINT_T0);
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      const __m256 xv = _mm256_loadu_ps(x + k + 8 * q);
      a[0][q] = _mm256_fmadd_ps(L::load(w0 + k + 8 * q), xv, a[0][q]);
      a[1][q] = _mm256_fmadd_ps(L::load(w1 + k + 8 * q), xv, a[1][q]);
    }
  }
  for (; k < in8; k += 8) {
    const __m256 xv = _mm256_loadu_ps(x + k);
    a[0][0] = _mm256_fmadd_ps(L::load(w0 + k), xv, a[0][0]);
    a[1][0] = _mm256_fmadd_ps(L::load(w1 + k), xv, a[1][0]);
  }
  const typename L::T* w[2] = {w0, w1};
  float* y[2] = {y0, y1};
  for (int r = 0; r < 2; ++r) {
    float s = hsum(_mm256_add_ps(_mm256_add_ps(a[r][0], a[r][1]), _mm256_add_ps(a[r][2], a[r][3])));
    for (int64_t j = k; j < in; ++j) s = __builtin_fmaf(L::one(w[r] + j), x[j], s);
    *y[r] = s;
  }
}

// Rows o and o + ceil(n / 2) together (dot_pair), the middle row of an odd n alone. One core pulls
// more from memory on two streams far apart than on one: FalconMamba-7B's bf16 weights from the page
// cache (2 MiB folios), 2 threads: 29 -> 33 GB/s median, 1 thread 17 -> 22 (3 or 4 streams: no more).
template <class L>
void matvec(const typename L::T* W, int64_t ld, const float* x, float* y, int64_t n, int64_t in) {
  const int64_t h = n - n / 2;
  for (int64_t o = 0; o < n / 2; ++o) dot_pair<L>(W + o * ld, W + (o + h) * ld, x, y + o, y + o + h, in);
  if (n & 1) dot_tile<L, 1>(W + (h - 1) * ld, x, 0, y + h - 1, 0, in);
}

// Rows in groups of 3, outputs in blocks of kGemmNB (their weights stay in L2 while every row
// group passes over them).
constexpr int64_t kGemmNB = 64;
template <class L>
void gemm(const typename L::T* W, int64_t ld, const float* X, int64_t ldx, int64_t rows, float* Y, int64_t ldy,
          int64_t n, int64_t in) {
  for (int64_t o0 = 0; o0 < n; o0 += kGemmNB) {
    const int64_t o1 = n - o0 < kGemmNB ? n : o0 + kGemmNB;
    int64_t r = 0;
    for (; r + 3 <= rows; r += 3)
      for (int64_t o = o0; o < o1; ++o) dot_tile<L, 3>(W + o * ld, X + r * ldx, ldx, Y + r * ldy + o, ldy, in);
    if (rows - r == 2)
      for (int64_t o = o0; o < o1; ++o) dot_tile<L, 2>(W + o * ld, X + r * ldx, ldx, Y + r * ldy + o, ldy, in);
    if (rows - r == 1)
      for (int64_t o = o0; o < o1; ++o) dot_tile<L, 1>(W + o * ld, X + r * ldx, ldx, Y + r * ldy + o, ldy, in);
  }
}

void mv_f32(const float* W, int64_t ld, const float* x, float* y, int64_t n, int64_t in) { matvec<F32>(W, ld, x, y, n, in); }
void mv_bf16(const uint16_t* W, int64_t ld, const float* x, float* y, int64_t n, int64_t in) { matvec<BF16>(W, ld, x, y, n, in); }
void mv_f16(const uint16_t* W, int64_t ld, const float* x, float* y, int64_t n, int64_t in) { matvec<F16>(W, ld, x, y, n, in); }
void gemm_f32(const float* W, int64_t ld, const float* X, int64_t ldx, int64_t rows, float* Y, int64_t ldy, int64_t n,
              int64_t in) {
  gemm<F32>(W, ld, X, ldx, rows, Y, ldy, n, in);
}
void gemm_bf16(const uint16_t* W, int64_t ld, const float* X, int64_t ldx, int64_t rows, float* Y, int64_t ldy,
               int64_t n, int64_t in) {
  gemm<BF16>(W, ld, X, ldx, rows, Y, ldy, n, in);
}
void gemm_f16(const uint16_t* W, int64_t ld, const float* X, int64_t ldx, int64_t rows, float* Y, int64_t ldy,
              int64_t n, int64_t in) {
  gemm<F16>(W, ld, X, ldx, rows, Y, ldy, n, in);
}

template <class L>
void widen(const uint16_t* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, L::load(s + i));
  for (; i < n; ++i) d[i] = L::one(s + i);
}

// exp as in kernels_avx512.cpp; 2^n is built from exponent bits in two halves so that
// n in [-150, 128] (gradual underflow, overflow to inf) stays representable.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.8f), _mm256_max_ps(_mm256_set1_ps(-104.0f), x));  // NaN passes
  __m256 n;
  const __m256 p = avx2::exp_core(x, n);
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

void exp_(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, exp8(_mm256_loadu_ps(x + i)));
  if (i < n) {
    float xb[8] = {0}, yb[8];
    for (int64_t j = i; j < n; ++j) xb[j - i] = x[j];
    _mm256_storeu_ps(yb, exp8(_mm256_loadu_ps(xb)));
    for (int64_t j = i; j < n; ++j) y[j] = yb[j - i];
  }
}
inline __m256 sigmoid8(__m256 v) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), v))));
}
inline __m256 mul_silu8(__m256 xv, __m256 gv) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_mul_ps(xv, _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)))));
}
void sigmoid(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, sigmoid8(_mm256_loadu_ps(x + i)));
  if (i < n) {
    float xb[8] = {0}, yb[8];
    for (int64_t j = i; j < n; ++j) xb[j - i] = x[j];
    _mm256_storeu_ps(yb, sigmoid8(_mm256_loadu_ps(xb)));
    for (int64_t j = i; j < n; ++j) y[j] = yb[j - i];
  }
}
void mul_silu(const float* x, const float* g, float* y, int64_t n) {
  int64_t i = 0;
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, mul_silu8(x ? _mm256_loadu_ps(x + i) : one, _mm256_loadu_ps(g + i)));
  if (i < n) {
    float xb[8] = {0}, gb[8] = {0}, yb[8];
    for (int64_t j = i; j < n; ++j) xb[j - i] = x ? x[j] : 1.0f, gb[j - i] = g[j];
    _mm256_storeu_ps(yb, mul_silu8(_mm256_loadu_ps(xb), _mm256_loadu_ps(gb)));
    for (int64_t j = i; j < n; ++j) y[j] = yb[j - i];
  }
}

void acc_rows(const float* p, const float* V, int64_t ld, int64_t n, int64_t d, float* o) {
  const int64_t d8 = d & ~int64_t{7};
  for (int64_t e = 0; e < d8; e += 8) {
    __m256 acc = _mm256_loadu_ps(o + e);
    for (int64_t j = 0; j < n; ++j) acc = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(V + j * ld + e), acc);
    _mm256_storeu_ps(o + e, acc);
  }
  for (int64_t e = d8; e < d; ++e) {
    float acc = o[e];
    for (int64_t j = 0; j < n; ++j) acc = __builtin_fmaf(p[j], V[j * ld + e], acc);
    o[e] = acc;
  }
}

// int8 blocks (ops/dtype.h): 8 int8 values sign-extended and converted, exactly (widen_q8).
inline __m256 q8load(const uint8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}
inline float q8scale(const uint8_t* b) {
  float s;
  __builtin_memcpy(&s, b, 4);
  return s;
}

// One (row, output) sum over int8 blocks times int16 x (KernelTable::matvec_q8): per block the 32
// products in integers, lane i of the two madds holding k = 2i, 2i+1, 16+2i, 16+2i+1 (|sum| < 2^24,
// so its float32 conversion is exact), scaled by float(s_w * s_x) into one of two accumulators
// (even / odd blocks) by a fused multiply-add; one fixed horizontal sum (kernels_scalar.cpp does the
// same lane by lane). Integer madds instead of widening each weight to float32: those instructions
// bound the int8 decode here (FalconMamba-7B, 2 threads: 2.2-2.3 -> 2.6-2.8 tok/s, measured with x
// rounded per pool block). R rows share the weight loads.
template <int R>
void q8_tile(const uint8_t* w, const X16& x, int64_t r0, float* Y, int64_t ldy) {
  const int64_t nb = x.nb;
  __m256 a[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * kQ8BlockBytes;
    if constexpr (R == 1) _mm_prefetch(reinterpret_cast<const char*>(blk) + kPrefetchBytes, _MM_HINT_T0);
    __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4)));
    __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 20)));
    if constexpr (R > 1) __asm__("" : "+v"(w0), "+v"(w1));
    const float sw = q8scale(blk);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int16_t* q = x.q + ((r0 + r) * nb + b) * kQ8Block;
      const __m256i d = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))),
                                         _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 16))));
      const __m256 s = _mm256_set1_ps(sw * x.s[(r0 + r) * nb + b]);
      a[r][b & 1] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(d), a[r][b & 1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) Y[r * ldy] = hsum(_mm256_add_ps(a[r][0], a[r][1])) * x.f[r0 + r];
}

// q8_tile<1> for two weight rows at once, each summed in exactly that order (see dot_pair).
void q8_pair(const uint8_t* w0, const uint8_t* w1, const X16& x, float* y0, float* y1) {
  __m256 a[2][2] = {{_mm256_setzero_ps(), _mm256_setzero_ps()}, {_mm256_setzero_ps(), _mm256_setzero_ps()}};
  for (int64_t b = 0; b < x.nb; ++b) {
    const uint8_t* blk[2] = {w0 + b * kQ8BlockBytes, w1 + b * kQ8BlockBytes};
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + b * kQ8Block));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + b * kQ8Block + 16));
    const float xs = x.s[b];
#pragma GCC unroll 2
    for (int r = 0; r < 2; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(blk[r]) + kPrefetchBytes, _MM_HINT_T0);
      const __m256i q0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[r] + 4)));
      const __m256i q1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[r] + 20)));
      const __m256i d = _mm256_add_epi32(_mm256_madd_epi16(q0, x0), _mm256_madd_epi16(q1, x1));
      a[r][b & 1] = _mm256_fmadd_ps(_mm256_set1_ps(q8scale(blk[r]) * xs), _mm256_cvtepi32_ps(d), a[r][b & 1]);
    }
  }
  *y0 = hsum(_mm256_add_ps(a[0][0], a[0][1])) * x.f[0];
  *y1 = hsum(_mm256_add_ps(a[1][0], a[1][1])) * x.f[0];
}

}  // namespace

// Rows paired as in matvec (two streams per core).
void q8_matvec_avx2(const uint8_t* W, int64_t ld, const X16& x, float* y, int64_t n) {
  const int64_t h = n - n / 2;
  for (int64_t o = 0; o < n / 2; ++o) q8_pair(W + o * ld, W + (o + h) * ld, x, y + o, y + o + h);
  if (n & 1) q8_tile<1>(W + (h - 1) * ld, x, 0, y + h - 1, 0);
}

void q8_gemm_avx2(const uint8_t* W, int64_t ld, const X16& X, int64_t rows, float* Y, int64_t ldy, int64_t n) {
  for (int64_t o0 = 0; o0 < n; o0 += kGemmNB) {
    const int64_t o1 = n - o0 < kGemmNB ? n : o0 + kGemmNB;
    int64_t r = 0;
    for (; r + 3 <= rows; r += 3)
      for (int64_t o = o0; o < o1; ++o) q8_tile<3>(W + o * ld, X, r, Y + r * ldy + o, ldy);
    if (rows - r == 2)
      for (int64_t o = o0; o < o1; ++o) q8_tile<2>(W + o * ld, X, r, Y + r * ldy + o, ldy);
    if (rows - r == 1)
      for (int64_t o = o0; o < o1; ++o) q8_tile<1>(W + o * ld, X, r, Y + r * ldy + o, ldy);
  }
}

void q8_widen_avx2(const uint8_t* W, int64_t ld, float* dst, int64_t rows, int64_t in) {
  const int64_t full = in / kQ8Block;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = W + r * ld;
    float* d = dst + r * in;
    for (int64_t b = 0; b < full; ++b) {
      const uint8_t* blk = row + b * kQ8BlockBytes;
      const __m256 s = _mm256_broadcast_ss(reinterpret_cast<const float*>(blk));
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(d + b * kQ8Block + 8 * i, _mm256_mul_ps(q8load(blk + 4 + 8 * i), s));
    }
    const uint8_t* tail = row + full * kQ8BlockBytes;
    for (int64_t k = full * kQ8Block; k < in; ++k)
      d[k] = static_cast<float>(reinterpret_cast<const int8_t*>(tail + 4)[k - full * kQ8Block]) * q8scale(tail);
  }
}

const KernelTable kAvx2Kernels = {mv_f32,     mv_bf16, mv_f16,   gemm_f32, gemm_bf16, gemm_f16, widen<BF16>,
                                  widen<F16>, exp_,    mul_silu, sigmoid,  acc_rows, q8_matvec_avx2, q8_gemm_avx2,
                                  q8_widen_avx2};

}  // namespace mixlens::ops
#endif  // __x86_64__
