// Dispatch of the 16-bit-weight GEMM (gemm16.h).
#include "ops/gemm16.h"

#include "ops/kernels.h"

namespace mixlens::ops {

Gemm16Fn gemm16() {
#if defined(__x86_64__)
  // AVX2 only: at the AVX-512 levels OpenBLAS's sgemm runs AVX-512 code, twice our kernel's width,
  // and widen + sgemm stays (not measured against ours: no AVX-512 machine at hand).
  if (isa() == Isa::avx2) return kGemm16Avx2;
#endif
  return nullptr;
}

}  // namespace mixlens::ops
