// Prompt-sized matrix products with 16-bit (bfloat16 / float16) weights and float32 activations:
// the weights are widened while they are packed for the register-blocked kernel, in one pass,
// instead of widened into a float32 copy that OpenBLAS's sgemm then packs a second time.
// Why our own code: no library on this CPU class (AVX2 + FMA, no AVX512-BF16) multiplies 16-bit
// weights by float32 activations; oneDNN 2.6's bf16 matmul rounds the activations to bf16 and has
// no AVX2 kernel for it (bench/results/gemm16.md has the numbers against widen + sgemm).
#pragma once
#include <cstdint>

namespace mixlens::ops {

/// C[r*ldc + o] = sum_k X[r*ldx + k] * float(W[o*ldw + k]) for r < rows, o < n, k < K, with W the
/// bits of bfloat16 (f16 false) or IEEE float16 (f16 true) values; float32 products and sums
/// (fused multiply-adds, k in blocks: the sum order differs from a plain loop by rounding only).
/// Single-threaded (callers split the output features); C is overwritten.
using Gemm16Fn = void (*)(const float* X, int64_t ldx, int64_t rows, const uint16_t* W, int64_t ldw, bool f16,
                          int64_t n, int64_t K, float* C, int64_t ldc);

/// K up to this runs as one k block (each output written once); a larger K re-reads and re-writes
/// the output once per block, which costs at many rows (bench/results/gemm16.md).
constexpr int64_t kGemm16KBlock = 768;

/// The kernel for the ISA level in use, or nullptr where widen + sgemm is the better choice (the
/// scalar level; the AVX-512 levels, where OpenBLAS's sgemm runs AVX-512 code and ours does not).
Gemm16Fn gemm16();
/// The AVX2 + FMA + F16C kernel (tests; call only where ops::isa_supported(Isa::avx2)).
extern const Gemm16Fn kGemm16Avx2;

}  // namespace mixlens::ops
