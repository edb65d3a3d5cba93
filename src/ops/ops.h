// Dense building blocks (float32). Matrix products go to BLAS; the rest are simple loops the
// compiler vectorizes.
#pragma once
#include <cmath>
#include <cstdint>
#include <functional>

#include "mixlens/tensor.h"

namespace mixlens::ops {

/// y[rows, out] = x[rows, in] @ W[out, in]^T (+ bias[out]). PyTorch nn.Linear.
void linear(const float* x, int64_t rows, int64_t in, const Tensor& W, float* y,
            const float* bias = nullptr);

/// Row-major C[M,N] = alpha * op(A) @ op(B) + beta * C with explicit leading dimensions.
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

/// RMSNorm over the last axis: y = w * x / sqrt(mean(x^2) + eps) (Mamba2RMSNorm); with
/// `zero_centred` the scale is (1 + w) (Qwen3.5 / Qwen3-Next). In-place allowed (y == x).
void rmsnorm(const float* x, const float* w, float* y, int64_t rows, int64_t dim, float eps,
             bool zero_centred = false);

inline float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }
inline float silu(float v) { return v / (1.0f + std::exp(-v)); }
/// torch.nn.functional.softplus with beta 1, threshold 20.
inline float softplus(float v) { return v > 20.0f ? v : std::log1p(std::exp(v)); }

/// Runs f(i) for i in [0, n) on the worker pool (calling thread included).
void parallel_for(int64_t n, const std::function<void(int64_t)>& f);
/// Number of threads parallel_for uses (MIXLENS_NUM_THREADS, default hardware concurrency).
int num_threads();

}  // namespace mixlens::ops

namespace mixlens::ops {

/// Causal depthwise conv1d with a cached window (model-math.md §3.0, §5.1), optional SiLU.
/// Row (b,t) of the input is `in + (b*T + t) * in_stride` (C channels); `state` is [B,K,C] holding
/// the K previous inputs (oldest first, zeros on a fresh prompt) and is replaced by the last K
/// inputs of state ++ input. out[b,t,c] = act(bias[c] + sum_j wT[j,c] * ext[b, t+1+j, c]).
void causal_conv1d(const float* in, int64_t in_stride, int64_t B, int64_t T, int64_t C, int64_t K,
                   const float* wT, const float* bias, float* state, float* out, bool silu);

}  // namespace mixlens::ops
