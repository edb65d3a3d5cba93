// Scalar tile kernels and the dispatch (tile_kernels.h).
#include "ops/tile_kernels.h"

#include <cmath>

#include "ops/kernels.h"

namespace mixlens::ops {
namespace {

void dots(const float* Q, int64_t ldq, int64_t nq, const float* K, int64_t ldk, int64_t nk, int64_t d, float* S,
          int64_t lds) {
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t j = 0; j < nk; ++j) {
      float s = 0.0f;
      for (int64_t e = 0; e < d; ++e) s += Q[i * ldq + e] * K[j * ldk + e];
      S[i * lds + j] = s;
    }
}

void acc_tile(const float* P, int64_t ldp, int64_t nq, const float* V, int64_t ldv, int64_t nk, int64_t d, float* O,
              int64_t ldo) {
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t j = 0; j < nk; ++j) {
      const float p = P[i * ldp + j];
      for (int64_t e = 0; e < d; ++e) O[i * ldo + e] += p * V[j * ldv + e];
    }
}

}  // namespace

const TileKernels kScalarTileKernels = {dots, acc_tile};

const TileKernels& tile_kernels() {
#if defined(__x86_64__)
  if (isa() != Isa::scalar) return kAvx2TileKernels;  // every vector level has AVX2 + FMA
#endif
  return kScalarTileKernels;
}

}  // namespace mixlens::ops
