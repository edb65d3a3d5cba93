// Hot kernels with run-time ISA dispatch. Each level is compiled in a file of its own with that
// level's target flags (CMakeLists.txt), so the library itself needs no -march=native; the level
// is picked once from __builtin_cpu_supports, or forced with MIXLENS_ISA=avx512bf16|avx512|avx2|scalar
// (a level the CPU lacks is refused with an Error) or ops::set_isa (tests).
#pragma once
#include <cstdint>
#include <string>

namespace mixlens::ops {

enum class Isa { scalar, avx2, avx512, avx512bf16 };
/// "scalar", "avx2", "avx512", "avx512bf16".
const char* isa_name(Isa i);
/// The level in use (MIXLENS_ISA, else the best the CPU supports).
Isa isa();
/// The best level this CPU supports.
Isa best_isa();
/// Whether the CPU can run level `i`.
bool isa_supported(Isa i);
/// Forces a level (tests, benchmarks). Error when the CPU cannot run it.
void set_isa(Isa i);
/// Parses a level name; InputError naming the choices otherwise.
Isa parse_isa(const std::string& name);

/// One ISA level's kernels. Matrices are row-major with `ld` elements between rows.
struct KernelTable {
  /// y[o] = sum_k W[o*ld + k] * x[k] for o < n, k < in (float32 products and sums).
  void (*matvec_f32)(const float* W, int64_t ld, const float* x, float* y, int64_t n, int64_t in);
  void (*matvec_bf16)(const uint16_t* W, int64_t ld, const float* x, float* y, int64_t n, int64_t in);
  void (*matvec_f16)(const uint16_t* W, int64_t ld, const float* x, float* y, int64_t n, int64_t in);
  /// Y[r*ldy + o] = sum_k W[o*ld + k] * X[r*ldx + k] for r < rows, o < n, k < in: each element summed
  /// in exactly the order of this level's matvec of the same dtype, so a row's results are bitwise
  /// the same whatever the row count, the row's position or the split of the outputs (issue 23).
  /// Single-threaded (callers split the outputs).
  void (*gemm_f32)(const float* W, int64_t ld, const float* X, int64_t ldx, int64_t rows, float* Y, int64_t ldy,
                   int64_t n, int64_t in);
  void (*gemm_bf16)(const uint16_t* W, int64_t ld, const float* X, int64_t ldx, int64_t rows, float* Y, int64_t ldy,
                    int64_t n, int64_t in);
  void (*gemm_f16)(const uint16_t* W, int64_t ld, const float* X, int64_t ldx, int64_t rows, float* Y, int64_t ldy,
                   int64_t n, int64_t in);
  /// dst[i] = float(src[i]) (exact).
  void (*widen_bf16)(const uint16_t* src, float* dst, int64_t n);
  void (*widen_f16)(const uint16_t* src, float* dst, int64_t n);
  /// y[i] = exp(x[i]); in place allowed.
  void (*exp)(const float* x, float* y, int64_t n);
  /// y[i] = x[i] * g[i] / (1 + exp(-g[i])), x == nullptr meaning 1 (silu); in place allowed.
  void (*mul_silu)(const float* x, const float* g, float* y, int64_t n);
  /// y[i] = 1 / (1 + exp(-x[i])).
  void (*sigmoid)(const float* x, float* y, int64_t n);
  /// o[e] += sum_j p[j] * V[j*ld + e] for e < d, j < n, summed in increasing j (a row's result
  /// depends on nothing but its inputs: attention outputs do not change with the tiling).
  void (*acc_rows)(const float* p, const float* V, int64_t ld, int64_t n, int64_t d, float* o);
  /// int8 blocks (ops/dtype.h), row o at W + o * ld bytes: y[o] = sum over blocks of s * (sum of q * x),
  /// each block's products summed in float32 before its scale multiplies them; a partial last block
  /// one fused multiply-add at a time. gemm_q8 sums each element in matvec_q8's order (batch invariance).
  void (*matvec_q8)(const uint8_t* W, int64_t ld, const float* x, float* y, int64_t n, int64_t in);
  void (*gemm_q8)(const uint8_t* W, int64_t ld, const float* X, int64_t ldx, int64_t rows, float* Y, int64_t ldy,
                  int64_t n, int64_t in);
  /// dst[r * in + k] = float(q * s) for `rows` rows of `in` weights, row r at W + r * ld bytes.
  void (*widen_q8)(const uint8_t* W, int64_t ld, float* dst, int64_t rows, int64_t in);
};

/// The table of the level in use.
const KernelTable& kernels();
/// The table of a given level (tests); nullptr when not compiled in.
const KernelTable* kernels_for(Isa i);

// Per-level tables (kernels_*.cpp).
extern const KernelTable kScalarKernels;
extern const KernelTable kAvx2Kernels;
extern const KernelTable kAvx512Kernels;

// The AVX2 level's int8 kernels, which the AVX-512 levels reuse (kernels_avx2.cpp).
void q8_matvec_avx2(const uint8_t* W, int64_t ld, const float* x, float* y, int64_t n, int64_t in);
void q8_gemm_avx2(const uint8_t* W, int64_t ld, const float* X, int64_t ldx, int64_t rows, float* Y, int64_t ldy,
                  int64_t n, int64_t in);
void q8_widen_avx2(const uint8_t* W, int64_t ld, float* dst, int64_t rows, int64_t in);

}  // namespace mixlens::ops
