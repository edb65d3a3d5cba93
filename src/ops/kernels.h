// Hot kernels with run-time ISA dispatch. Each level is compiled in a file of its own with that
// level's target flags (CMakeLists.txt), so the library itself needs no -march=native; the level
// is picked once from __builtin_cpu_supports, or forced with MIXLENS_ISA=avx512bf16|avx512|avx2|scalar
// (a level the CPU lacks is refused with an Error) or ops::set_isa (tests).
#pragma once
#include <cstdint>
#include <string>

#include "ops/q8_layout.h"

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

/// Activations rounded to int16 for the int8 kernels, per block of kQ8Block k (the weights' blocks):
/// for the block's largest magnitude m, the scale s = float(m * p / 32767) and q = round-half-even(x *
/// 32767 / m) in double, |q| <= 32767; the last block zero-padded. m = 0: s = 0, q = 0. A block
/// holding an inf or NaN: s = NaN, so every output it reaches is NaN. p = 1 and the row factor
/// f = 1, except for a row whose largest magnitude M is below 2^-60: there p = 2^-e and f = 2^e for
/// M = g * 2^e, g in [0.5, 1), so the scales stay normal floats (a subnormal scale lost the rounding's
/// precision: activations of 1e-36 moved by 1%). Row r's q at q + r * nb * kQ8Block, its scales at
/// s + r * nb, its factor f[r].
struct X16 {
  const int16_t* q;
  const float* s;
  const float* f;
  int64_t nb;  // blocks per row: ceil(in / kQ8Block)
  /// Row r alone.
  X16 row(int64_t r) const { return {q + r * nb * kQ8Block, s + r * nb, f + r, nb}; }
};
/// Blocks of kQ8Block k in a row of `in`.
constexpr int64_t q8_blocks(int64_t in) { return (in + kQ8Block - 1) / kQ8Block; }
/// X's `rows` rows (row r at X + r * ldx) rounded into q (rows * q8_blocks(in) * kQ8Block values), s
/// (rows * q8_blocks(in)) and f (rows); the view of them. ops::RoundedX16 owns such buffers.
X16 round_x16(const float* X, int64_t ldx, int64_t rows, int64_t in, int16_t* q, float* s, float* f);

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
  /// int8 blocks (ops/dtype.h), row o at W + o * ld bytes, times x rounded to int16 per block of the
  /// same 32 k (X16, from round_x16): y[o] = f * sum over blocks b of float(s_w * s_x) * (sum over the
  /// block of q_w * q_x), the products and their sums exact in integers (8 lanes of 4 products each),
  /// each lane converted to float32 and accumulated by a fused multiply-add, even and odd blocks
  /// apart, then one fixed horizontal sum times the row factor f (a power of two). Every level computes bitwise the same; gemm_q8 too, for
  /// X's `rows` rows at any row count (batch invariance). Rounding x moves an element by at most
  /// max|x_block| / 65534; rounding the weights to int8 moved one by up to max|w_block| / 254.
  void (*matvec_q8)(const uint8_t* W, int64_t ld, const X16& x, float* y, int64_t n);
  void (*gemm_q8)(const uint8_t* W, int64_t ld, const X16& X, int64_t rows, float* Y, int64_t ldy, int64_t n);
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
void q8_matvec_avx2(const uint8_t* W, int64_t ld, const X16& x, float* y, int64_t n);
void q8_gemm_avx2(const uint8_t* W, int64_t ld, const X16& X, int64_t rows, float* Y, int64_t ldy, int64_t n);
void q8_widen_avx2(const uint8_t* W, int64_t ld, float* dst, int64_t rows, int64_t in);

}  // namespace mixlens::ops
