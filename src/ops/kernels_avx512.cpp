// AVX-512 (F + BW + VL, FMA, F16C) kernels. Compiled with those target flags (CMakeLists.txt)
// and only called after __builtin_cpu_supports says so (kernels.cpp). Keep this file free of
// library templates/inline functions: a copy compiled here could be picked by the linker for
// other files and run AVX-512 code on a CPU without it.
#if defined(__x86_64__)
// GCC 12's own intrinsic headers trip -Wmaybe-uninitialized (their __Y = __Y idiom).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"  // the same idiom, in _mm512_reduce_add_ps inlined into the tiles
#endif
#include <immintrin.h>

#include <cstdint>

#include "ops/avx2_inline.h"
#include "ops/kernels.h"

namespace mixlens::ops {
namespace {

// How far ahead a matvec prefetches each weight row: Nemotron-H-8B bf16 decode, 2-core Xeon, 4 rounds
// each: 512 B 1.87 tok/s, 1024 B 1.85, 2048 B 1.98-2.01, 3072-4096 B 1.98.
constexpr int64_t kPrefetchBytes = 2048;

inline __mmask16 tail_mask(int64_t r) { return static_cast<__mmask16>((1u << r) - 1u); }

struct F32 {
  using T = float;
  static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
};
struct BF16 {
  using T = uint16_t;
  // bf16 -> f32 is a 16-bit left shift: exact, 2 µops per 16 weights.
  static __m512 load(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
  static __m512 load(const uint16_t* p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
  }
};
struct F16 {
  using T = uint16_t;
  static __m512 load(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static __m512 load(const uint16_t* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
};

// Keeps v in a register: otherwise GCC folds the load of an x (or weight) vector into each of the
// FMAs that use it, and the tile becomes load-bound (32-36 loads per 24 FMAs for 3 x 2, against
// 20). Changes no value.
inline void pin(__m512& v) { __asm__("" : "+v"(v)); }

// One (row, output) sum: four accumulators over blocks of 64 k (they hide the FMA latency), blocks
// of 16 into the first, the masked tail into the second, then one fixed reduction. R rows x N
// outputs run together (x and the weights loaded once per tile), each pair in exactly this order:
// the matvec is the 1 x 1 tile, so a row's results do not depend on how many rows run with it.
template <class L, int R, int N>
void dot_tile(const typename L::T* W, int64_t ld, const float* X, int64_t ldx, float* Y, int64_t ldy, int64_t in) {
  const int64_t in64 = in & ~int64_t{63}, in16 = in & ~int64_t{15};
  __m512 a[R][N][4];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int n = 0; n < N; ++n)
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) a[r][n][q] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k < in64; k += 64) {
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      __m512 w[N];
#pragma GCC unroll 16
      for (int n = 0; n < N; ++n) {
        w[n] = L::load(W + n * ld + k + 16 * q);
        if constexpr (R > 1) pin(w[n]);
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        __m512 xv = _mm512_loadu_ps(X + r * ldx + k + 16 * q);
        if constexpr (N > 1) pin(xv);
#pragma GCC unroll 16
        for (int n = 0; n < N; ++n) a[r][n][q] = _mm512_fmadd_ps(w[n], xv, a[r][n][q]);
      }
    }
  }
  for (; k < in16; k += 16)
#pragma GCC unroll 16
    for (int n = 0; n < N; ++n) {
      const __m512 w = L::load(W + n * ld + k);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) a[r][n][0] = _mm512_fmadd_ps(w, _mm512_loadu_ps(X + r * ldx + k), a[r][n][0]);
    }
  if (k < in) {
    const __mmask16 mt = tail_mask(in - k);
#pragma GCC unroll 16
    for (int n = 0; n < N; ++n) {
      const __m512 w = L::load(W + n * ld + k, mt);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) a[r][n][1] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(mt, X + r * ldx + k), a[r][n][1]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int n = 0; n < N; ++n)
      Y[r * ldy + n] =
          _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[r][n][0], a[r][n][1]), _mm512_add_ps(a[r][n][2], a[r][n][3])));
}

// Rows o and o + ceil(n / 2) together (the 1 x 2 tile with the pair's distance as its stride; each
// row summed exactly as alone), the middle row of an odd n alone: two sequential streams far apart
// per core, as the AVX2 level. Nemotron-H-8B bf16 decode on a 2-core Xeon (AVX-512): one stream
// 1.67 tok/s, the AVX2 level's pairs 1.89 (four adjacent rows interleaved measured 40% slower on
// an older host: bench/results/kernels.md).
// rows(o, dist, t): row o into t[0] and, when dist > 0, row o + dist into t[1].
template <class Rows>
void paired_rows(int64_t n, float* y, Rows rows) {
  const int64_t h = n - n / 2;
  float t[2];
  for (int64_t o = 0; o < n / 2; ++o) {
    rows(o, h, t);
    y[o] = t[0], y[o + h] = t[1];
  }
  if (n & 1) rows(h - 1, 0, t), y[h - 1] = t[0];
}
template <class L>
void matvec(const typename L::T* W, int64_t ld, const float* x, float* y, int64_t n, int64_t in) {
  paired_rows(n, y, [&](int64_t o, int64_t dist, float* t) {
    if (dist) dot_tile<L, 1, 2>(W + o * ld, dist * ld, x, 0, t, 0, in);
    else dot_tile<L, 1, 1>(W + o * ld, ld, x, 0, t, 0, in);
  });
}

// Rows in groups of 3 x outputs in pairs (24 accumulators of 32 registers); outputs in blocks of
// kGemmNB so that their weights stay in L2 while every row group passes over them.
constexpr int64_t kGemmNB = 64;
template <class L, int R>
void gemm_rows(const typename L::T* W, int64_t ld, const float* X, int64_t ldx, float* Y, int64_t ldy, int64_t n,
               int64_t in) {
  int64_t o = 0;
  for (; o + 2 <= n; o += 2) dot_tile<L, R, 2>(W + o * ld, ld, X, ldx, Y + o, ldy, in);
  if (o < n) dot_tile<L, R, 1>(W + o * ld, ld, X, ldx, Y + o, ldy, in);
}
template <class L>
void gemm(const typename L::T* W, int64_t ld, const float* X, int64_t ldx, int64_t rows, float* Y, int64_t ldy,
          int64_t n, int64_t in) {
  for (int64_t o0 = 0; o0 < n; o0 += kGemmNB) {
    const int64_t nb = n - o0 < kGemmNB ? n - o0 : kGemmNB;
    int64_t r = 0;
    for (; r + 3 <= rows; r += 3) gemm_rows<L, 3>(W + o0 * ld, ld, X + r * ldx, ldx, Y + r * ldy + o0, ldy, nb, in);
    if (rows - r == 2) gemm_rows<L, 2>(W + o0 * ld, ld, X + r * ldx, ldx, Y + r * ldy + o0, ldy, nb, in);
    if (rows - r == 1) gemm_rows<L, 1>(W + o0 * ld, ld, X + r * ldx, ldx, Y + r * ldy + o0, ldy, nb, in);
  }
}

void mv_f32(const float* W, int64_t ld, const float* x, float* y, int64_t n, int64_t in) { matvec<F32>(W, ld, x, y, n, in); }
// bf16 without a widening shuffle: one 512-bit load holds 32 weights; the even ones become floats
// by a 16-bit left shift, the odd ones by masking off the low half. x is deinterleaved once per
// call to match (xd: per 32-block, 16 even then 16 odd entries), so a row costs per 32 weights
// 1 load + 1 shift + 1 and + 2 FMA (vpmovzxwd + shift per 16 was shuffle-port bound).
constexpr int64_t kMaxDeinterleave = 32768;
alignas(64) thread_local float xd_buf[kMaxDeinterleave];

void deinterleave(const float* x, int64_t in32, float* xd) {
  const __m512i idx_even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i idx_odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  for (int64_t k = 0; k < in32; k += 32) {
    const __m512 a = _mm512_loadu_ps(x + k), b = _mm512_loadu_ps(x + k + 16);
    _mm512_store_ps(xd + k, _mm512_permutex2var_ps(a, idx_even, b));
    _mm512_store_ps(xd + k + 16, _mm512_permutex2var_ps(a, idx_odd, b));
  }
}

// R rows (deinterleaved in XD, row stride ldxd; the plain rows in X for the tail) x N outputs of
// the bf16 dot in one fixed order per pair: a0 / b0 (even / odd of the first 32 of each 64), a1 /
// b1 (the second 32), the 32-blocks past the last 64 into a0 / b0, then the < 32 rest by dot_tile.
template <int R, int N>
void bf16_tile(const uint16_t* W, int64_t ld, const float* XD, int64_t ldxd, const float* X, int64_t ldx, float* Y,
               int64_t ldy, int64_t in) {
  const int64_t in32 = in & ~int64_t{31}, in64 = in & ~int64_t{63};
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  __m512 a[R][N][4];  // a0, b0, a1, b1
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int n = 0; n < N; ++n)
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) a[r][n][q] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k < in64; k += 64) {
    if constexpr (R == 1)  // a matvec: its weights come from memory (see paired_rows)
#pragma GCC unroll 16
      for (int n = 0; n < N; ++n) {
        const char* pf = reinterpret_cast<const char*>(W + n * ld + k) + kPrefetchBytes;
        _mm_prefetch(pf, _MM_HINT_T0), _mm_prefetch(pf + 64, _MM_HINT_T0);
      }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m512 e[N], d[N];
#pragma GCC unroll 16
      for (int n = 0; n < N; ++n) {
        const __m512i v = _mm512_loadu_si512(W + n * ld + k + 32 * h);
        e[n] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        d[n] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        __m512 xe = _mm512_load_ps(XD + r * ldxd + k + 32 * h), xo = _mm512_load_ps(XD + r * ldxd + k + 32 * h + 16);
        if constexpr (N > 1) pin(xe), pin(xo);
#pragma GCC unroll 16
        for (int n = 0; n < N; ++n) {
          a[r][n][2 * h] = _mm512_fmadd_ps(e[n], xe, a[r][n][2 * h]);
          a[r][n][2 * h + 1] = _mm512_fmadd_ps(d[n], xo, a[r][n][2 * h + 1]);
        }
      }
    }
  }
  for (; k < in32; k += 32)
#pragma GCC unroll 16
    for (int n = 0; n < N; ++n) {
      const __m512i v = _mm512_loadu_si512(W + n * ld + k);
      const __m512 e = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), d = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        a[r][n][0] = _mm512_fmadd_ps(e, _mm512_load_ps(XD + r * ldxd + k), a[r][n][0]);
        a[r][n][1] = _mm512_fmadd_ps(d, _mm512_load_ps(XD + r * ldxd + k + 16), a[r][n][1]);
      }
    }
  const int64_t rest = in - in32;
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int n = 0; n < N; ++n) {
      float t = 0;
      if (rest) dot_tile<BF16, 1, 1>(W + n * ld + in32, ld, X + r * ldx + in32, 0, &t, 0, rest);
      const __m512 s0 = _mm512_add_ps(a[r][n][0], a[r][n][2]), s1 = _mm512_add_ps(a[r][n][1], a[r][n][3]);
      Y[r * ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) + t;
    }
}

void mv_bf16(const uint16_t* W, int64_t ld, const float* x, float* y, int64_t n, int64_t in) {
  const int64_t in32 = in & ~int64_t{31};
  if (in32 == 0 || in32 > kMaxDeinterleave) {
    matvec<BF16>(W, ld, x, y, n, in);
    return;
  }
  deinterleave(x, in32, xd_buf);
  paired_rows(n, y, [&](int64_t o, int64_t dist, float* t) {  // rows paired as in matvec
    if (dist) bf16_tile<1, 2>(W + o * ld, dist * ld, xd_buf, 0, x, 0, t, 0, in);
    else bf16_tile<1, 1>(W + o * ld, ld, xd_buf, 0, x, 0, t, 0, in);
  });
}
void mv_f16(const uint16_t* W, int64_t ld, const float* x, float* y, int64_t n, int64_t in) { matvec<F16>(W, ld, x, y, n, in); }

void gemm_f32(const float* W, int64_t ld, const float* X, int64_t ldx, int64_t rows, float* Y, int64_t ldy, int64_t n,
              int64_t in) {
  gemm<F32>(W, ld, X, ldx, rows, Y, ldy, n, in);
}
void gemm_f16(const uint16_t* W, int64_t ld, const float* X, int64_t ldx, int64_t rows, float* Y, int64_t ldy,
              int64_t n, int64_t in) {
  gemm<F16>(W, ld, X, ldx, rows, Y, ldy, n, in);
}
// Deinterleaved rows, three at a time, then every output of the block against them (as gemm).
template <int R>
void bf16_rows(const uint16_t* W, int64_t ld, const float* XD, int64_t ldxd, const float* X, int64_t ldx, float* Y,
               int64_t ldy, int64_t n, int64_t in) {
  int64_t o = 0;
  for (; o + 2 <= n; o += 2) bf16_tile<R, 2>(W + o * ld, ld, XD, ldxd, X, ldx, Y + o, ldy, in);
  if (o < n) bf16_tile<R, 1>(W + o * ld, ld, XD, ldxd, X, ldx, Y + o, ldy, in);
}
void gemm_bf16(const uint16_t* W, int64_t ld, const float* X, int64_t ldx, int64_t rows, float* Y, int64_t ldy,
               int64_t n, int64_t in) {
  const int64_t in32 = in & ~int64_t{31};
  if (in32 == 0 || 3 * in32 > kMaxDeinterleave) {
    if (in32 == 0 || in32 > kMaxDeinterleave) {
      gemm<BF16>(W, ld, X, ldx, rows, Y, ldy, n, in);
      return;
    }
    for (int64_t r = 0; r < rows; ++r) mv_bf16(W, ld, X + r * ldx, Y + r * ldy, n, in);  // rows too wide for 3
    return;
  }
  for (int64_t r = 0; r < rows; r += 3) {
    const int64_t R = rows - r < 3 ? rows - r : 3;
    for (int64_t i = 0; i < R; ++i) deinterleave(X + (r + i) * ldx, in32, xd_buf + i * in32);
    for (int64_t o0 = 0; o0 < n; o0 += kGemmNB) {
      const int64_t nb = n - o0 < kGemmNB ? n - o0 : kGemmNB;
      const uint16_t* w = W + o0 * ld;
      float* y = Y + r * ldy + o0;
      if (R == 3) bf16_rows<3>(w, ld, xd_buf, in32, X + r * ldx, ldx, y, ldy, nb, in);
      if (R == 2) bf16_rows<2>(w, ld, xd_buf, in32, X + r * ldx, ldx, y, ldy, nb, in);
      if (R == 1) bf16_rows<1>(w, ld, xd_buf, in32, X + r * ldx, ldx, y, ldy, nb, in);
    }
  }
}

template <class L>
void widen(const uint16_t* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(d + i, L::load(s + i));
  if (i < n) _mm512_mask_storeu_ps(d + i, tail_mask(n - i), L::load(s + i, tail_mask(n - i)));
}

// exp: Cephes expf on r = x - n ln2 (|r| <= ln2/2), 2^n applied with scalef (handles overflow to
// inf and gradual underflow). Max error ~2 ulp (tests/cpp/test_kernels.cpp measures it).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(88.8f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x));  // NaN passes
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

template <class F>
inline void map(const float* x, float* y, int64_t n, F f) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, f(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(y + i, m, f(_mm512_maskz_loadu_ps(m, x + i)));
  }
}

void exp_(const float* x, float* y, int64_t n) { map(x, y, n, exp16); }
void sigmoid(const float* x, float* y, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  map(x, y, n, [one](__m512 v) { return _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), v)))); });
}
void mul_silu(const float* x, const float* g, float* y, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  auto f = [one](__m512 xv, __m512 gv) {
    const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
    return _mm512_mul_ps(xv, s);
  };
  if (!x) {
    map(g, y, n, [&f, one](__m512 gv) { return f(one, gv); });
    return;
  }
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, f(_mm512_loadu_ps(x + i), _mm512_loadu_ps(g + i)));
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(y + i, m, f(_mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, g + i)));
  }
}

// A 16-wide block of o stays in a register while j streams (same order as the scalar level,
// but fused multiply-adds).
void acc_rows(const float* p, const float* V, int64_t ld, int64_t n, int64_t d, float* o) {
  for (int64_t e = 0; e < d; e += 16) {
    const __mmask16 m = d - e >= 16 ? static_cast<__mmask16>(0xffff) : tail_mask(d - e);
    __m512 acc = _mm512_maskz_loadu_ps(m, o + e);
    for (int64_t j = 0; j < n; ++j) acc = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_maskz_loadu_ps(m, V + j * ld + e), acc);
    _mm512_mask_storeu_ps(o + e, m, acc);
  }
}

// int8 rows times int16 x (KernelTable::matvec_q8), bitwise the AVX2 and scalar levels' sums: per block
// the same 8 integer lane sums (lane i: k = 2i, 2i+1, 16 + 2i, 17 + 2i; integers, so their order is
// free), the same float scale product and fused multiply-add into the even or odd accumulator, the same
// final sum. Two blocks per 512-bit vector: the even block in the low half (the AVX2 level's even
// accumulator), the odd one in the high half. N rows `ld` apart share the x loads.
inline __m512i q8_madd(const uint8_t* blk, const int16_t* xq) {
  const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 4)));
  return _mm512_madd_epi16(w, _mm512_loadu_si512(xq));
}
inline float q8scale(const uint8_t* b) {
  float s;
  __builtin_memcpy(&s, b, 4);
  return s;
}
template <int N>
void q8_rows(const uint8_t* W, int64_t ld, const X16& x, float* y) {
  const int64_t nb = x.nb, nb2 = nb & ~int64_t{1};
  __m512 acc[N];
#pragma GCC unroll 4
  for (int n = 0; n < N; ++n) acc[n] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb2; b += 2) {
    const int16_t* xq = x.q + b * kQ8Block;
    const float xs0 = x.s[b], xs1 = x.s[b + 1];
#pragma GCC unroll 4
    for (int n = 0; n < N; ++n) {
      const uint8_t* blk = W + n * ld + b * kQ8BlockBytes;
      _mm_prefetch(reinterpret_cast<const char*>(blk) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(blk) + kPrefetchBytes + 64, _MM_HINT_T0);
      const __m512i p0 = q8_madd(blk, xq), p1 = q8_madd(blk + kQ8BlockBytes, xq + kQ8Block);
      const __m512i d = _mm512_add_epi32(_mm512_shuffle_i64x2(p0, p1, 0x44), _mm512_shuffle_i64x2(p0, p1, 0xee));
      const __m512 sc = _mm512_mask_blend_ps(static_cast<__mmask16>(0xff00), _mm512_set1_ps(q8scale(blk) * xs0),
                                             _mm512_set1_ps(q8scale(blk + kQ8BlockBytes) * xs1));
      acc[n] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(d), acc[n]);
    }
  }
#pragma GCC unroll 4
  for (int n = 0; n < N; ++n) {
    __m256 a0 = _mm512_castps512_ps256(acc[n]);
    const __m256 a1 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[n]), 1));
    if (nb & 1) {  // the last block is even: the low half alone
      const uint8_t* blk = W + n * ld + nb2 * kQ8BlockBytes;
      const __m512i p = q8_madd(blk, x.q + nb2 * kQ8Block);
      const __m256i d = _mm256_add_epi32(_mm512_castsi512_si256(p), _mm512_extracti64x4_epi64(p, 1));
      a0 = _mm256_fmadd_ps(_mm256_set1_ps(q8scale(blk) * x.s[nb2]), _mm256_cvtepi32_ps(d), a0);
    }
    y[n] = avx2::hsum(_mm256_add_ps(a0, a1)) * x.f[0];  // the AVX2 level's final sum
  }
}

void q8_matvec(const uint8_t* W, int64_t ld, const X16& x, float* y, int64_t n) {
  paired_rows(n, y, [&](int64_t o, int64_t dist, float* t) {  // rows paired as in matvec
    if (dist) q8_rows<2>(W + o * ld, dist * ld, x, t);
    else q8_rows<1>(W + o * ld, ld, x, t);
  });
}

}  // namespace

const KernelTable kAvx512Kernels = {mv_f32,  mv_bf16,  mv_f16,   gemm_f32, gemm_bf16, gemm_f16, widen<BF16>,
                                    widen<F16>, exp_, mul_silu, sigmoid, acc_rows, q8_matvec, q8_gemm_avx2,
                                    q8_widen_avx2};

}  // namespace mixlens::ops
#endif  // __x86_64__
