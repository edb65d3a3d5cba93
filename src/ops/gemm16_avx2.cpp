// AVX2 + FMA + F16C GEMM with 16-bit weights (gemm16.h). BLIS-style: x is packed once per call into
// panels of 6 rows, the weights a block of [256 k x 256 outputs] at a time into panels of 16
// outputs (widened and transposed in registers: one pass over the 16-bit bytes), and a 6 x 16
// register tile (12 accumulators) runs over each pair of panels. Compiled with those target flags
// (CMakeLists.txt), called only after ops::isa() says so; keep free of library templates/inline
// functions (see kernels_avx512.cpp).
#if defined(__x86_64__)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <new>

#include "ops/gemm16.h"

namespace mixlens::ops {
namespace {

constexpr int64_t kMR = 6, kNR = 16;
// A weight block of up to kKC x kNC floats (384 KiB) stays in L2 while each row panel of x (up to
// 6 x kKC floats, 18 KiB) stays in L1 across the block's output panels; with K <= kKC each output
// tile is written once (k blocks of 256 / 384 re-read and re-write C per block; measured no faster).
// Both overridable together (-DMIXLENS_G16_KC=.. -DMIXLENS_G16_NC=..) for block-size experiments.
#ifndef MIXLENS_G16_KC
#define MIXLENS_G16_KC kGemm16KBlock
#define MIXLENS_G16_NC 128
#endif
constexpr int64_t kKC = MIXLENS_G16_KC, kNC = MIXLENS_G16_NC;

// A grow-only per-thread buffer, 64-byte aligned (aligned panel loads; no std templates here).
struct Buf {
  float* p = nullptr;
  int64_t n = 0;
  ~Buf() { std::free(p); }
  float* get(int64_t want) {
    if (want > n) {
      std::free(p);
      const size_t bytes = (static_cast<size_t>(want) * sizeof(float) + 63) & ~size_t{63};
      p = static_cast<float*>(std::aligned_alloc(64, bytes));
      if (!p) {
        n = 0;
        throw std::bad_alloc();
      }
      n = want;
    }
    return p;
  }
};

inline __m256 widen8(const uint16_t* p, bool f16) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (f16) return _mm256_cvtph_ps(v);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
inline float widen1(uint16_t b, bool f16) {
  if (f16) return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(b)));
  return _mm_cvtss_f32(_mm_castsi128_ps(_mm_cvtsi32_si128(static_cast<int>(static_cast<uint32_t>(b) << 16))));
}

// r[i] (row i, 8 columns) -> r[j] (column j, 8 rows).
inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// x rows [0, rows) -> panels of 6 rows, each [K][6] (rows past the end zero). 8 k at a time by an
// 8 x 8 transpose whose columns are stored 6 floats apart, each store's last 2 floats overwritten
// by the next (so Ap needs 2 floats of slack past its end).
void pack_x(const float* X, int64_t ldx, int64_t rows, int64_t K, float* Ap) {
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t r0 = 0; r0 < rows; r0 += kMR) {
    float* dst = Ap + r0 * K;  // panel r0 / 6 starts at (r0 / 6) * 6 * K
    const int64_t mr = rows - r0 < kMR ? rows - r0 : kMR;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      __m256 r[8];
      for (int64_t i = 0; i < 8; ++i) r[i] = i < mr ? _mm256_loadu_ps(X + (r0 + i) * ldx + k) : zero;
      transpose8(r);
      for (int64_t j = 0; j < 8; ++j) _mm256_storeu_ps(dst + (k + j) * kMR, r[j]);
    }
    for (; k < K; ++k)
      for (int64_t i = 0; i < kMR; ++i) dst[k * kMR + i] = i < mr ? X[(r0 + i) * ldx + k] : 0.0f;
  }
}

// Rows 0..7 (stride ldw) x k 0..7 of bf16 -> dst[k*16 + row], float32: rows i and i+4 share a
// register (one per 128-bit lane), the interleave with zeros widens bf16 to float32 exactly, and a
// 4 x 4 transpose per lane finishes: 28 shuffles for 64 values against 40 for widen + 8 x 8
// transpose (the packing is ~8% of a 128-token prompt).
inline void pack8x8_bf16(const uint16_t* w, int64_t ldw, float* dst) {
  const __m256i zero = _mm256_setzero_si256();
  __m256 lo[4], hi[4];
  for (int64_t i = 0; i < 4; ++i) {
    const __m256i v = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i * ldw))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (i + 4) * ldw)), 1);
    lo[i] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));  // k 0..3 of rows i | i + 4
    hi[i] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));  // k 4..7
  }
  for (int64_t h = 0; h < 2; ++h) {
    const __m256* q = h ? hi : lo;
    const __m256 t0 = _mm256_unpacklo_ps(q[0], q[1]), t1 = _mm256_unpackhi_ps(q[0], q[1]);
    const __m256 t2 = _mm256_unpacklo_ps(q[2], q[3]), t3 = _mm256_unpackhi_ps(q[2], q[3]);
    float* d = dst + h * 4 * kNR;
    _mm256_store_ps(d, _mm256_shuffle_ps(t0, t2, 0x44));
    _mm256_store_ps(d + kNR, _mm256_shuffle_ps(t0, t2, 0xEE));
    _mm256_store_ps(d + 2 * kNR, _mm256_shuffle_ps(t1, t3, 0x44));
    _mm256_store_ps(d + 3 * kNR, _mm256_shuffle_ps(t1, t3, 0xEE));
  }
}

// Weights [nc outputs][kc] (row stride ldw) -> panels of 16 outputs, each [kc][16], widened.
void pack_w(const uint16_t* W, int64_t ldw, bool f16, int64_t nc, int64_t kc, float* Bp) {
  for (int64_t j0 = 0; j0 < nc; j0 += kNR) {
    float* dst = Bp + (j0 / kNR) * kc * kNR;
    const int64_t nr = nc - j0 < kNR ? nc - j0 : kNR;
    int64_t k = 0;
    if (nr == kNR) {
      if (!f16)
        for (; k + 8 <= kc; k += 8)
          for (int64_t h = 0; h < 2; ++h) pack8x8_bf16(W + (j0 + h * 8) * ldw + k, ldw, dst + k * kNR + h * 8);
      for (; k + 8 <= kc; k += 8)
        for (int64_t h = 0; h < 2; ++h) {
          __m256 r[8];
          for (int64_t i = 0; i < 8; ++i) r[i] = widen8(W + (j0 + h * 8 + i) * ldw + k, f16);
          transpose8(r);
          for (int64_t i = 0; i < 8; ++i) _mm256_store_ps(dst + (k + i) * kNR + h * 8, r[i]);
        }
    }
    for (; k < kc; ++k)
      for (int64_t j = 0; j < kNR; ++j) dst[k * kNR + j] = j < nr ? widen1(W[(j0 + j) * ldw + k], f16) : 0.0f;
  }
}

#define MIXLENS_G16_ROW(i)                        \
  if constexpr (MR > (i)) {                       \
    a = _mm256_broadcast_ss(A + k * kMR + (i));   \
    c##i##0 = _mm256_fmadd_ps(a, b0, c##i##0);    \
    c##i##1 = _mm256_fmadd_ps(a, b1, c##i##1);    \
  }
#define MIXLENS_G16_STORE(i)                                                                   \
  if constexpr (MR > (i)) {                                                                    \
    if (acc) {                                                                                 \
      c##i##0 = _mm256_add_ps(_mm256_loadu_ps(C + (i) * ldc), c##i##0);                        \
      c##i##1 = _mm256_add_ps(_mm256_loadu_ps(C + (i) * ldc + 8), c##i##1);                    \
    }                                                                                          \
    _mm256_storeu_ps(C + (i) * ldc, c##i##0);                                                  \
    _mm256_storeu_ps(C + (i) * ldc + 8, c##i##1);                                              \
  }

// C[i, j] (+)= sum_k A[k*6 + i] * B[k*16 + j] for i < MR, j < nr. MR < 6 for the last rows (a
// 128-token prompt ends in a 2-row panel: computing it as 6 rows cost ~3% of the GEMM).
template <int MR>
void tile(int64_t kc, const float* A, const float* B, float* C, int64_t ldc, bool acc, int64_t nr) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_load_ps(B + k * kNR), b1 = _mm256_load_ps(B + k * kNR + 8);
    __m256 a;
    MIXLENS_G16_ROW(0)
    MIXLENS_G16_ROW(1)
    MIXLENS_G16_ROW(2)
    MIXLENS_G16_ROW(3)
    MIXLENS_G16_ROW(4)
    MIXLENS_G16_ROW(5)
  }
  if (nr == kNR) {
    MIXLENS_G16_STORE(0)
    MIXLENS_G16_STORE(1)
    MIXLENS_G16_STORE(2)
    MIXLENS_G16_STORE(3)
    MIXLENS_G16_STORE(4)
    MIXLENS_G16_STORE(5)
    return;
  }
  alignas(32) float t[kMR][kNR];
  _mm256_store_ps(t[0], c00), _mm256_store_ps(t[0] + 8, c01);
  _mm256_store_ps(t[1], c10), _mm256_store_ps(t[1] + 8, c11);
  _mm256_store_ps(t[2], c20), _mm256_store_ps(t[2] + 8, c21);
  _mm256_store_ps(t[3], c30), _mm256_store_ps(t[3] + 8, c31);
  _mm256_store_ps(t[4], c40), _mm256_store_ps(t[4] + 8, c41);
  _mm256_store_ps(t[5], c50), _mm256_store_ps(t[5] + 8, c51);
  for (int64_t i = 0; i < MR; ++i)
    for (int64_t j = 0; j < nr; ++j) C[i * ldc + j] = acc ? C[i * ldc + j] + t[i][j] : t[i][j];
}
#undef MIXLENS_G16_ROW
#undef MIXLENS_G16_STORE

using TileFn = void (*)(int64_t, const float*, const float*, float*, int64_t, bool, int64_t);
constexpr TileFn kTiles[kMR + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

void gemm16_avx2(const float* X, int64_t ldx, int64_t rows, const uint16_t* W, int64_t ldw, bool f16, int64_t n,
                 int64_t K, float* C, int64_t ldc) {
  if (rows <= 0 || n <= 0) return;
  if (K <= 0) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < n; ++o) C[r * ldc + o] = 0.0f;
    return;
  }
  thread_local Buf abuf, bbuf;
  const int64_t panels = (rows + kMR - 1) / kMR;
  float* Ap = abuf.get(panels * kMR * K + 2);
  float* Bp = bbuf.get(kKC * kNC);
  pack_x(X, ldx, rows, K, Ap);
  // Equal k blocks of at most kKC (K = 1536: two of 768).
  const int64_t nk = (K + kKC - 1) / kKC, kb = (K + nk - 1) / nk;
  const int64_t tiles = panels * ((kNC + kNR - 1) / kNR);  // tile calls per block (at most)
  for (int64_t jc = 0; jc < n; jc += kNC) {
    const int64_t nc = n - jc < kNC ? n - jc : kNC;
    for (int64_t pc = 0; pc < K; pc += kb) {
      const int64_t kc = K - pc < kb ? K - pc : kb;
      pack_w(W + jc * ldw + pc, ldw, f16, nc, kc, Bp);
      // The next block's weights come from memory: prefetch them into L2 a few lines per tile
      // call while this block computes, so that its packing does not wait on DRAM.
      int64_t njc = jc, npc = pc + kb;
      if (npc >= K) njc += kNC, npc = 0;
      const int64_t nnc = njc < n ? (n - njc < kNC ? n - njc : kNC) : 0;
      const int64_t nkc = K - npc < kb ? K - npc : kb;
      const int64_t row_lines = (nkc * 2 + 63) / 64, lines = nnc * row_lines;
      const int64_t per = (lines + tiles - 1) / tiles;
      const char* next = reinterpret_cast<const char*>(W + njc * ldw + npc);
      int64_t line = 0;
      for (int64_t ir = 0; ir < rows; ir += kMR) {
        const int64_t mr = rows - ir < kMR ? rows - ir : kMR;
        for (int64_t jr = 0; jr < nc; jr += kNR) {
          for (int64_t e = line + per < lines ? line + per : lines; line < e; ++line)
            _mm_prefetch(next + (line / row_lines) * ldw * 2 + (line % row_lines) * 64, _MM_HINT_T1);
          kTiles[mr](kc, Ap + ir * K + pc * kMR, Bp + (jr / kNR) * kc * kNR, C + ir * ldc + jc + jr, ldc, pc > 0,
                     nc - jr < kNR ? nc - jr : kNR);
        }
      }
    }
  }
}

}  // namespace

const Gemm16Fn kGemm16Avx2 = gemm16_avx2;

}  // namespace mixlens::ops
#endif  // __x86_64__
