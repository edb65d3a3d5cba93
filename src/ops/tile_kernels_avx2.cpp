// AVX2 + FMA tile kernels (tile_kernels.h). Compiled with those target flags (CMakeLists.txt) and
// called only when ops::isa() is a vector level; templates stay in an anonymous namespace (a copy
// compiled here must never be picked by the linker for other files).
#if defined(__x86_64__)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <cstdint>

#include "ops/tile_kernels.h"
#include "ops/avx2_inline.h"

namespace mixlens::ops {
namespace {

using avx2::hsum;

// NQ x NK dot products, one 8-lane accumulator per pair, then a fixed horizontal sum and a scalar
// FMA tail: the same order for every block shape, so S does not depend on the blocking.
template <int NQ, int NK>
void block(const float* Q, int64_t ldq, const float* K, int64_t ldk, int64_t d, float* S, int64_t lds) {
  __m256 acc[NQ][NK];
  for (int i = 0; i < NQ; ++i)
    for (int j = 0; j < NK; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t d8 = d & ~int64_t{7};
  for (int64_t e = 0; e < d8; e += 8) {
    __m256 k[NK];
    for (int j = 0; j < NK; ++j) k[j] = _mm256_loadu_ps(K + j * ldk + e);
    for (int i = 0; i < NQ; ++i) {
      const __m256 q = _mm256_loadu_ps(Q + i * ldq + e);
      for (int j = 0; j < NK; ++j) acc[i][j] = _mm256_fmadd_ps(q, k[j], acc[i][j]);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int j = 0; j < NK; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t e = d8; e < d; ++e) s = __builtin_fmaf(Q[i * ldq + e], K[j * ldk + e], s);
      S[i * lds + j] = s;
    }
}

template <int NQ>
void row_block(const float* Q, int64_t ldq, const float* K, int64_t ldk, int64_t nk, int64_t d, float* S, int64_t lds) {
  int64_t j = 0;
  for (; j + 4 <= nk; j += 4) block<NQ, 4>(Q, ldq, K + j * ldk, ldk, d, S + j, lds);
  switch (nk - j) {
    case 3: block<NQ, 3>(Q, ldq, K + j * ldk, ldk, d, S + j, lds); break;
    case 2: block<NQ, 2>(Q, ldq, K + j * ldk, ldk, d, S + j, lds); break;
    case 1: block<NQ, 1>(Q, ldq, K + j * ldk, ldk, d, S + j, lds); break;
    default: break;
  }
}

void dots(const float* Q, int64_t ldq, int64_t nq, const float* K, int64_t ldk, int64_t nk, int64_t d, float* S,
          int64_t lds) {
  int64_t i = 0;
  for (; i + 3 <= nq; i += 3) row_block<3>(Q + i * ldq, ldq, K, ldk, nk, d, S + i * lds, lds);
  if (nq - i == 2) row_block<2>(Q + i * ldq, ldq, K, ldk, nk, d, S + i * lds, lds);
  else if (nq - i == 1) row_block<1>(Q + i * ldq, ldq, K, ldk, nk, d, S + i * lds, lds);
}

// O rows += P V for NQ queries and 16 output dims at a time: V's two vectors are loaded once for
// all NQ queries; every element is summed in increasing j with one FMA per term.
template <int NQ>
void acc_block(const float* P, int64_t ldp, const float* V, int64_t ldv, int64_t nk, int64_t d, float* O, int64_t ldo) {
  const int64_t d16 = d & ~int64_t{15}, d8 = d & ~int64_t{7};
  int64_t e = 0;
  for (; e < d16; e += 16) {
    __m256 a[NQ][2];
    for (int i = 0; i < NQ; ++i) {
      a[i][0] = _mm256_loadu_ps(O + i * ldo + e);
      a[i][1] = _mm256_loadu_ps(O + i * ldo + e + 8);
    }
    for (int64_t j = 0; j < nk; ++j) {
      const __m256 v0 = _mm256_loadu_ps(V + j * ldv + e), v1 = _mm256_loadu_ps(V + j * ldv + e + 8);
      for (int i = 0; i < NQ; ++i) {
        const __m256 p = _mm256_broadcast_ss(P + i * ldp + j);
        a[i][0] = _mm256_fmadd_ps(p, v0, a[i][0]);
        a[i][1] = _mm256_fmadd_ps(p, v1, a[i][1]);
      }
    }
    for (int i = 0; i < NQ; ++i) {
      _mm256_storeu_ps(O + i * ldo + e, a[i][0]);
      _mm256_storeu_ps(O + i * ldo + e + 8, a[i][1]);
    }
  }
  for (; e < d8; e += 8) {
    __m256 a[NQ];
    for (int i = 0; i < NQ; ++i) a[i] = _mm256_loadu_ps(O + i * ldo + e);
    for (int64_t j = 0; j < nk; ++j) {
      const __m256 v0 = _mm256_loadu_ps(V + j * ldv + e);
      for (int i = 0; i < NQ; ++i) a[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(P + i * ldp + j), v0, a[i]);
    }
    for (int i = 0; i < NQ; ++i) _mm256_storeu_ps(O + i * ldo + e, a[i]);
  }
  for (; e < d; ++e)
    for (int i = 0; i < NQ; ++i) {
      float acc = O[i * ldo + e];
      for (int64_t j = 0; j < nk; ++j) acc = __builtin_fmaf(P[i * ldp + j], V[j * ldv + e], acc);
      O[i * ldo + e] = acc;
    }
}

void acc_tile(const float* P, int64_t ldp, int64_t nq, const float* V, int64_t ldv, int64_t nk, int64_t d, float* O,
              int64_t ldo) {
  int64_t i = 0;
  for (; i + 4 <= nq; i += 4) acc_block<4>(P + i * ldp, ldp, V, ldv, nk, d, O + i * ldo, ldo);
  switch (nq - i) {
    case 3: acc_block<3>(P + i * ldp, ldp, V, ldv, nk, d, O + i * ldo, ldo); break;
    case 2: acc_block<2>(P + i * ldp, ldp, V, ldv, nk, d, O + i * ldo, ldo); break;
    case 1: acc_block<1>(P + i * ldp, ldp, V, ldv, nk, d, O + i * ldo, ldo); break;
    default: break;
  }
}

}  // namespace

const TileKernels kAvx2TileKernels = {dots, acc_tile};

}  // namespace mixlens::ops
#endif  // __x86_64__
