// Dense building blocks (float32 activations). Matrix products run our ISA-dispatched kernels
// (ops/kernels.h) or BLAS; the rest are simple loops the compiler vectorizes.
#pragma once
#include <limits>
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "mixlens/tensor.h"
#include "ops/kernels.h"

namespace mixlens::ops {

/// y[rows, out] = x[rows, in] @ W[out, in]^T (+ bias[out]). PyTorch nn.Linear. W may be float32,
/// bfloat16 or float16 (a narrow matmul weight): products and sums are float32 either way. int8 W
/// (blocks, ops/dtype.h): the same with 5+ rows; with 1-4 rows, or any under deterministic(), x is
/// rounded to int16 per block first (KernelTable::matvec_q8).
void linear(const float* x, int64_t rows, int64_t in, const Tensor& W, float* y,
            const float* bias = nullptr);

/// X's rows rounded to int16 for the int8 kernels (ops/kernels.h round_x16), owning the buffers.
class RoundedX16 {
 public:
  RoundedX16(const float* X, int64_t ldx, int64_t rows, int64_t in);
  const X16& view() const { return view_; }

 private:
  std::vector<int16_t> q_;
  std::vector<float> s_, f_;
  X16 view_;
};

/// A matmul weight [rows, cols] kept as the row blocks it stacks (gate_proj over up_proj; in_proj_qkv |
/// in_proj_z | in_proj_b | in_proj_a), each where the loader left it: a fused projection of 16-bit
/// weights served from the mapped file costs no copy (a copy of a 9B model's fused projections was
/// 8.9 GB). Parts are 2-D, of one dtype and one column count (else InputError); a Tensor converts to a
/// stack of one (an undefined Tensor to an undefined stack).
class RowStack {
 public:
  RowStack() = default;
  RowStack(Tensor whole);  // NOLINT(google-explicit-constructor): a single weight is a stack of one
  explicit RowStack(std::vector<Tensor> parts);
  bool defined() const { return !parts_.empty(); }
  /// size(0): the rows of all parts; size(1) / size(-1): the columns.
  int64_t size(int64_t i) const;
  ScalarType dtype() const { return parts_.empty() ? ScalarType::float32 : parts_.front().dtype(); }
  const std::vector<Tensor>& parts() const { return parts_; }
  /// starts()[p]: the first row of part p; starts().back() == size(0).
  const std::vector<int64_t>& starts() const { return starts_; }

 private:
  std::vector<Tensor> parts_;
  std::vector<int64_t> starts_{0};
};
/// ops::linear of the stacked parts: y's columns [starts[p], starts[p+1]) are part p's outputs. On the
/// matvec and batch-invariant paths every element is bitwise what the one stacked matrix gives.
void linear(const float* x, int64_t rows, int64_t in, const RowStack& W, float* y, const float* bias = nullptr);

/// Whether ops::linear runs its batch-invariant kernels on this thread: every output element one
/// dot product in the matvec's order (KernelTable::gemm_*), so a row's results are bitwise the same
/// alone or in any batch, at any position, on any thread count. Otherwise more than 4 rows go to
/// BLAS / gemm16, whose sums depend on the row count.
bool deterministic();
/// Sets deterministic() on this thread for the scope's lifetime (restores the previous setting).
class DeterministicScope {
 public:
  explicit DeterministicScope(bool on);
  ~DeterministicScope();
  DeterministicScope(const DeterministicScope&) = delete;
  DeterministicScope& operator=(const DeterministicScope&) = delete;

 private:
  int prev_;
};

/// This thread's raw setting (-1: the process default, MIXLENS_DETERMINISTIC; 0 / 1), for code that
/// runs several computations on one thread in turns (detail::Fiber keeps one per fiber).
int deterministic_state();
void set_deterministic_state(int state);

/// Row r of a 2-D tensor of any dtype, as float32, into out[cols] (embedding lookup).
void copy_row(const Tensor& W, int64_t r, float* out);

/// Row-major C[M,N] = alpha * op(A) @ op(B) + beta * C with explicit leading dimensions. OpenBLAS
/// sgemm, except C = A B^T (no trans_a, trans_b, alpha 1, beta 0) under deterministic(), which runs
/// KernelTable::gemm_f32 (a row's results independent of M).
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

/// RMSNorm over the last axis: y = w * x / sqrt(mean(x^2) + eps) (Mamba2RMSNorm); with
/// `zero_centred` the scale is (1 + w) (Qwen3.5 / Qwen3-Next). In-place allowed (y == x).
void rmsnorm(const float* x, const float* w, float* y, int64_t rows, int64_t dim, float eps,
             bool zero_centred = false);

/// 1 / sqrt(mean_sq + eps) of a norm's row, or NaN when its mean of squares overflowed float32 (|x|
/// beyond ~1e19, only from an extreme write or input). transformers' float32 norms give 0 there: a row
/// of zeros, finite and silently wrong; NaN reaches FiniteWatch, which raises NumericError naming the
/// value where it appeared. Every norm (rmsnorm, layernorm, the mixers' gated and l2 norms) uses it.
inline float inv_rms(float mean_sq, float eps) {
  return std::isinf(mean_sq) ? std::numeric_limits<float>::quiet_NaN() : 1.0f / std::sqrt(mean_sq + eps);
}

/// LayerNorm over the last axis (torch.nn.LayerNorm): y = (x - mean) / sqrt(var + eps) * w + b, biased
/// variance, sums in double. In place allowed (y == x).
void layernorm(const float* x, const float* w, const float* b, float* y, int64_t rows, int64_t dim, float eps);
/// The mean of x [dim] (returned) and the sum of its squared deviations (ss), in double: LayerNorm's statistics.
double mean_ss(const float* x, int64_t dim, double& ss);

inline float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }
inline float silu(float v) { return v / (1.0f + std::exp(-v)); }
/// torch.nn.functional.softplus with beta 1, threshold 20.
inline float softplus(float v) { return v > 20.0f ? v : std::log1p(std::exp(v)); }
/// GELU, tanh approximation (transformers' gelu_pytorch_tanh): RecurrentGemma's MLP and y branch.
inline float gelu_tanh(float v) {
  return 0.5f * v * (1.0f + std::tanh(0.7978845608028654f * (v + 0.044715f * v * v * v)));
}

/// Array forms on the dispatched kernels (AVX-512 / AVX2 polynomial exp, max error ~2 ulp of
/// float32; the scalar level calls std::exp). In place allowed (y == x).
void exp(const float* x, float* y, int64_t n);
/// y = x * sigmoid(x) = x / (1 + exp(-x)).
void silu(const float* x, float* y, int64_t n);
/// y = 1 / (1 + exp(-x)).
void sigmoid(const float* x, float* y, int64_t n);
/// y = x * silu(g) (the gated-norm gate, elementwise).
void mul_silu(const float* x, const float* g, float* y, int64_t n);

/// dst[c, r] = src[r, c] for a row-major [rows, cols] src (dst is [cols, rows]; no overlap). Tiled,
/// so neither side is walked with a large stride element by element (Mamba-2's served state layout).
void transpose(const float* src, int64_t rows, int64_t cols, float* dst);

/// Runs f(i) for i in [0, n) on the worker pool (calling thread included), each under the caller's
/// deterministic() setting.
void parallel_for(int64_t n, const std::function<void(int64_t)>& f);
/// Number of threads parallel_for uses (MIXLENS_NUM_THREADS, default hardware concurrency).
int num_threads();
/// Runs f(r0, r1) over consecutive blocks of rows [0, rows) on the pool when there is enough work
/// (rows * row_elems >= 32k elements, more than one thread), else f(0, rows) on the caller: the
/// elementwise passes between matmuls (norms, gates, residual adds) would otherwise leave the other
/// threads idle. Rows must be independent, so the blocking changes no value.
void parallel_rows(int64_t rows, int64_t row_elems, const std::function<void(int64_t, int64_t)>& f);
/// The caller is about to stop using the pool for a while (a Session pausing for Python code): its
/// idle threads go to sleep now instead of spinning for the next op, which would burn CPU time
/// while the block runs (issue 9 item 5). The next parallel_for wakes them.
void park_threads();

}  // namespace mixlens::ops

namespace mixlens::ops {

/// Causal depthwise conv1d with a cached window (model-math.md §3.0, §5.1), optional SiLU.
/// Row (b,t) of the input is `in + (b*T + t) * in_stride` (C channels); `state` is [B,K,C] holding
/// the K previous inputs (oldest first, zeros on a fresh prompt) and is replaced by the last K
/// inputs of state ++ input. out[b,t,c] = act(bias[c] + sum_j wT[j,c] * ext[b, t+1+j, c]).
void causal_conv1d(const float* in, int64_t in_stride, int64_t B, int64_t T, int64_t C, int64_t K,
                   const float* wT, const float* bias, float* state, float* out, bool silu);

}  // namespace mixlens::ops
