// Register-blocked tile kernels for attention on prompts (many queries at once), with run-time ISA
// dispatch like ops/kernels.h (AVX2 + FMA in tile_kernels_avx2.cpp, scalar otherwise). Each output
// element is computed in one fixed order that does not depend on the tile sizes or on where the
// element sits in the tile, so a query's result does not depend on how queries were grouped.
#pragma once
#include <cstdint>

namespace mixlens::ops {

struct TileKernels {
  /// S[i*lds + j] = sum_e Q[i*ldq + e] * K[j*ldk + e] for i < nq, j < nk, e < d (float32).
  void (*dots)(const float* Q, int64_t ldq, int64_t nq, const float* K, int64_t ldk, int64_t nk, int64_t d, float* S,
               int64_t lds);
  /// O[i*ldo + e] += sum_j P[i*ldp + j] * V[j*ldv + e] for i < nq, e < d, j < nk, summed in increasing
  /// j (the AVX2 level: one fused multiply-add per term, as KernelTable::acc_rows).
  void (*acc_tile)(const float* P, int64_t ldp, int64_t nq, const float* V, int64_t ldv, int64_t nk, int64_t d,
                   float* O, int64_t ldo);
};

/// The table of the ISA level in use (ops::isa(): AVX2 code for the avx2 and avx512 levels).
const TileKernels& tile_kernels();

extern const TileKernels kScalarTileKernels;
extern const TileKernels kAvx2TileKernels;

}  // namespace mixlens::ops
