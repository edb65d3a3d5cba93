// Backward of the dense ops the forwards run (issue 12): each op's vector-Jacobian product, in its
// own file under src/grad/, checked against double-precision finite differences in
// tests/cpp/test_grad_ops.cpp. Every function writes (or adds, with `accumulate`) the gradient of
// the op's input given the gradient of its output; weights are constants (no weight gradients).
#pragma once
#include <cmath>
#include <cstdint>

#include "mixlens/tensor.h"

namespace mixlens::grad {

/// y[rows,out] = x[rows,in] W[out,in]^T (+ b): dx[rows,in] (+)= dy[rows,out] W.
void linear_backward(const float* dy, int64_t rows, int64_t out, const Tensor& W, float* dx, bool accumulate);

/// y = w * x / sqrt(mean(x^2) + eps) per row ((1 + w) when zero_centred), ops::rmsnorm:
/// dx (+)= r (w dy) - x r^3 mean(x (w dy)).
void rmsnorm_backward(const float* x, const float* w, const float* dy, float* dx, int64_t rows, int64_t dim,
                      float eps, bool zero_centred, bool accumulate);

/// ops::causal_conv1d before its activation: u[b,t,c] = bias[c] + sum_j wT[j,c] ext[b,t+1+j,c], with
/// ext = window (K rows, constant) ++ input. Given du [B,T,C], writes din (row (b,t) at
/// din + (b*T+t)*din_stride, C channels; overwritten).
void causal_conv1d_backward(const float* du, int64_t B, int64_t T, int64_t C, int64_t K, const float* wT,
                            float* din, int64_t din_stride);

inline float sigmoid_d(float s) { return s * (1.0f - s); }
/// d silu(v) / dv.
inline float silu_grad(float v) {
  const float s = 1.0f / (1.0f + std::exp(-v));
  return s * (1.0f + v * (1.0f - s));
}
/// d softplus(v) / dv for torch's softplus (beta 1, threshold 20: linear above 20).
inline float softplus_grad(float v) { return v > 20.0f ? 1.0f : 1.0f / (1.0f + std::exp(-v)); }

/// Backward of the Mamba-2 SSD scan of one batch row (mixers/ssd.h, either kernel): per head h
/// (group g = h / (H/G))  S_t = exp(A dt_t) S_{t-1} + dt_t x_t B_t^T,  y_t = S_t C_t + D x_t.
/// Outputs are overwritten. dstates (optional) receives dL/dS_t in the served layout [T,H,N,P]
/// (the adjoint of the state that y_t reads and later tokens continue from).
struct SsdGradArgs {
  int64_t T = 0, H = 0, P = 0, G = 0, N = 0;
  const float* x = nullptr;   ///< [T,H,P]
  const float* B = nullptr;   ///< [T,G,N]
  const float* C = nullptr;   ///< [T,G,N]
  const float* dt = nullptr;  ///< [T,H]
  const float* A = nullptr;   ///< [H]
  const float* D = nullptr;   ///< [H]
  const float* S0 = nullptr;  ///< [H,P,N] initial state (kernel layout)
  const float* dy = nullptr;  ///< [T,H,P]
  float* dx = nullptr;        ///< [T,H,P]
  float* dB = nullptr;        ///< [T,G,N]
  float* dC = nullptr;        ///< [T,G,N]
  float* ddt = nullptr;       ///< [T,H] through dt x B^T only (the write strength)
  float* ddA = nullptr;       ///< [T,H] through exp(A dt) only (the decay, d/d(A dt))
  float* dS0 = nullptr;       ///< [H,P,N]
  float* dstates = nullptr;   ///< optional [T,H,N,P]
  int64_t chunk = 64;         ///< recurrent: checkpoint interval; chunked: chunk length Q
};
/// The backward the mixers call: the chunked form, measured 5-10x faster than the recurrent one at
/// every length from 1 token (decode) to 2,048 (bench/ssd_grad_bench.sh, bench/results/grad.md).
void ssd_backward(const SsdGradArgs& a);
/// Token recurrence; states recomputed from checkpoints every `chunk` tokens (memory per head:
/// T/chunk + chunk states).
void ssd_backward_recurrent(const SsdGradArgs& a);
/// Matmul form, the transpose of ssd_chunked (BLAS products per chunk of `chunk` tokens; memory per
/// head: T/chunk states and a few chunk x chunk matrices).
void ssd_backward_chunked(const SsdGradArgs& a);

}  // namespace mixlens::grad
