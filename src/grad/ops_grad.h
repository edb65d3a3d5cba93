// Backward of the dense ops the forwards run (issue 12): each op's vector-Jacobian product, in its
// own file under src/grad/, checked against double-precision finite differences in
// tests/cpp/test_grad_ops.cpp. Every function writes (or adds, with `accumulate`) the gradient of
// the op's input given the gradient of its output; weights are constants (no weight gradients).
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

#include "mixers/attention.h"
#include "mixlens/tensor.h"
#include "ops/ops.h"

namespace mixlens::grad {

/// y[rows,out] = x[rows,in] W[out,in]^T (+ b): dx[rows,in] (+)= dy[rows,out] W.
void linear_backward(const float* dy, int64_t rows, int64_t out, const Tensor& W, float* dx, bool accumulate);
/// The same for W stacked from parts (ops::RowStack).
void linear_backward(const float* dy, int64_t rows, int64_t out, const ops::RowStack& W, float* dx, bool accumulate);

/// y += up(down(x)) (a LoRA adapter, detail::add_lora): dx[rows,in] += dy[rows,out] up down.
void lora_backward(const float* dy, int64_t rows, int64_t out, const Tensor& down, const Tensor& up, float* dx);

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
/// silu(v) and d silu(v) / dv given s = sigmoid(v) (from ops::sigmoid over a whole array: the
/// backward's elementwise loops then need no scalar exp).
inline float silu_s(float v, float s) { return v * s; }
inline float silu_grad_s(float v, float s) { return s * (1.0f + v * (1.0f - s)); }
/// d gelu_tanh(v) / dv (transformers' gelu_pytorch_tanh: 0.5 v (1 + tanh(s (v + 0.044715 v^3))), s = sqrt(2 / pi)).
inline float gelu_tanh_grad(float v) {
  const float s = 0.7978845608028654f, th = std::tanh(s * (v + 0.044715f * v * v * v));
  return 0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * s * (1.0f + 3.0f * 0.044715f * v * v);
}
/// d softplus(v) / dv for torch's softplus (beta 1, threshold 20: linear above 20).
inline float softplus_grad(float v) { return v > 20.0f ? 1.0f : 1.0f / (1.0f + std::exp(-v)); }

/// Backward of sigmoid top-k routing weights for one token (NemotronHTopkRouter, KimiLinearTopkRouter):
/// w_k = scale * s_k / (sum_j s_j + eps) over the K chosen experts (norm), else scale * s_k, with
/// s = sigmoid(router logits) [E]; the choice (`chosen` [K]) is a constant and the choice bias
/// (e_score_correction_bias) carries no gradient. Adds dL/d(logits) into dlog [E] from dw [K].
void sigmoid_topk_weights_backward(const float* s, const int64_t* chosen, int64_t K, const float* dw, bool norm,
                                   float eps, float scale, float* dlog);

/// y = (x - mean) / sqrt(var + eps) * w + b per row (ops::layernorm, nn.LayerNorm): dx (+)= from dy.
void layernorm_backward(const float* x, const float* w, const float* dy, float* dx, int64_t rows, int64_t dim, float eps,
                        bool accumulate);
/// y = down(relu(up x)^2) (NemotronH's relu2 experts, RWKV's channel-mix value(relu(key x)^2)), x [rows, in]:
/// dx (+)= from dy [rows, down rows].
void relu2_mlp_backward(const Tensor& up_w, const Tensor& down_w, const float* x, const float* dy, int64_t rows,
                        int64_t in, int64_t I, float* dx, bool accumulate);

/// Backward of the Mamba-2 SSD scan of one batch row (mixers/ssd.h, either kernel): per head h
/// (group g = h / (H/G))  S_t = exp(a_t) S_{t-1} + dt_t x_t B_t^T,  y_t = S_t C_t + D x_t, with the log
/// decay a_t = A dt_t, or da[t] where given (SsdArgs::da: lightning attention's per-token decays).
/// Outputs are overwritten. dstates (optional) receives dL/dS_t in the served layout [T,H,N,P]
/// (the adjoint of the state that y_t reads and later tokens continue from).
struct SsdGradArgs {
  int64_t T = 0, H = 0, P = 0, G = 0, N = 0;
  const float* x = nullptr;   ///< [T,H,P]
  const float* B = nullptr;   ///< [T,G,N]
  const float* C = nullptr;   ///< [T,G,N]
  const float* dt = nullptr;  ///< [T,H]
  const float* A = nullptr;   ///< [H]
  /// [T,H] optional: each token's log decay in place of A dt (as SsdArgs::da; dt then only scales the
  /// write, and ddA is d/d(da)).
  const float* da = nullptr;
  const float* D = nullptr;   ///< [H]
  const float* S0 = nullptr;  ///< [H,P,N] initial state (kernel layout)
  const float* dy = nullptr;  ///< [T,H,P]
  float* dx = nullptr;        ///< [T,H,P]
  float* dB = nullptr;        ///< [T,G,N]
  float* dC = nullptr;        ///< [T,G,N]
  float* ddt = nullptr;       ///< [T,H] through dt x B^T only (the write strength)
  float* ddA = nullptr;       ///< [T,H] through exp(A dt) only (the decay, d/d(A dt); d/d(da) with da)
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

/// Backward of detail::causal_attention (GQA, softmax scale `scale` (0: 1/sqrt(d)), causal over the cache, key padding
/// mask (key_mask[b][kv.offset + j]), sliding `window` (0: none); a query with no visible key has output 0 and gets dq = 0). Inputs as the forward saw
/// them: q [B,T,H,d] (after RoPE), `kv` holding past + T tokens per row (the cache before the call
/// with the call's k / v [B,T,Hkv,d] appended, after any writes), key_mask[b] of length >= past + T,
/// dout [B,T,H,d]. Writes (overwrites) dq [B,T,H,d] and dk, dv [B,T,Hkv,d] for the call's T new
/// tokens only: the cached keys / values (positions < past) are constants. Softmax rows are
/// recomputed per query (memory O(past + T) per thread). InputError when kv.len != past + T or H is
/// not a multiple of Hkv.
void causal_attention_backward(const float* q, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t d, int64_t past,
                               const detail::KvCache& kv, const std::vector<std::vector<uint8_t>>& key_mask,
                               const float* dout, float* dq, float* dk, float* dv, float scale = 0.0f,
                               int64_t window = 0);

/// Backward of detail::apply_rope (rotate-half on the first rotary_dim dims of each head of
/// [rows, heads, head_dim], the rest passing through), in place: g := R(pos)^T g, the inverse
/// rotation. Same arguments as the forward (pos per row, rope_inv_freq(rotary_dim, theta)).
void apply_rope_backward(float* g, int64_t rows, int64_t heads, int64_t head_dim, int64_t rotary_dim,
                         const int64_t* pos, const std::vector<float>& inv_freq);

}  // namespace mixlens::grad

namespace mixlens::grad {

/// Backward of the gated delta rule (mixers/gated_delta.h, either kernel: they compute the same
/// function) for rows of [B,T,H,...] in the served layouts: per value head, with q^ = l2norm(q) /
/// sqrt(Dk), k^ = l2norm(k),  S_t = exp(g_t) S_{t-1} + k^ (beta_t (v_t - exp(g_t) S_{t-1}^T k^))^T,
/// o_t = S_t^T q^. The states are recomputed with the token recurrence from checkpoints kept every
/// `chunk` tokens (memory: T/chunk + chunk states per head). Outputs are overwritten; dq / dk are
/// with respect to q / k before the in-kernel L2 norm (one per value head, as the kernel reads them).
struct GatedDeltaGradArgs {
  int64_t B = 0, T = 0, H = 0, Dk = 0, Dv = 0;
  const float* q = nullptr;     ///< [B,T,H,Dk]
  const float* k = nullptr;     ///< [B,T,H,Dk]
  const float* v = nullptr;     ///< [B,T,H,Dv]
  const float* g = nullptr;     ///< [B,T,H] log decay; [B,T,H,Dk] with g_per_key
  bool g_per_key = false;       ///< one decay per key channel (Kimi Delta Attention): diag(exp(g_t)) S_{t-1}
  const float* beta = nullptr;  ///< [B,T,H]
  const float* S0 = nullptr;    ///< [B,H,Dk,Dv] the state the call starts from
  const float* dout = nullptr;  ///< [B,T,H,Dv] dL/do
  float* dq = nullptr;          ///< [B,T,H,Dk]
  float* dk = nullptr;          ///< [B,T,H,Dk]
  float* dv = nullptr;          ///< [B,T,H,Dv]
  float* dg = nullptr;          ///< [B,T,H]; [B,T,H,Dk] with g_per_key
  float* dbeta = nullptr;       ///< [B,T,H]
  float* dS0 = nullptr;         ///< [B,H,Dk,Dv]
  float* dstates = nullptr;     ///< optional [B,T,H,Dk,Dv]: dL/dS_t (what o_t reads and later tokens continue from)
  int64_t chunk = 64;
  /// Optional [B,H,ceil(T/chunk),Dk,Dv]: the state entering every chunk (the forward kernel's own, when
  /// the caller recomputed the forward chunk by chunk); nullptr: a forward pass here keeps them.
  const float* ckpt = nullptr;
};
/// The backward the mixer calls: the chunked form, or the token recurrence when dstates is asked for.
void gated_delta_backward(const GatedDeltaGradArgs& a);
/// Token recurrence (the reference; serves dstates).
void gated_delta_backward_recurrent(const GatedDeltaGradArgs& a);
/// Matmul form per chunk of `chunk` tokens (the WY / UT representation): BLAS products and two
/// triangular solves per chunk; needs only the chunk-entry states (ckpt, or computed here). dstates
/// is not formed (nullptr required).
void gated_delta_backward_chunked(const GatedDeltaGradArgs& a);

/// y = scale * x / sqrt(sum(x^2) + 1e-6) (transformers' l2norm, then the query scale): dx from dy.
void l2norm_backward(const float* x, const float* dy, float* dx, int64_t n, float scale);
/// Backward of the Mamba-1 selective scan of one batch row (mixers/selective_scan.h, either kernel):
/// per channel e and state index n  S_t[e,n] = exp(A[e,n] dt_t[e]) S_{t-1}[e,n] + dt_t[e] B_t[n] u_t[e],
/// y_t[e] = sum_n S_t[e,n] C_t[n] + D[e] u_t[e]. The states are recomputed from checkpoints every
/// `chunk` tokens (memory: T/chunk + chunk states per channel, not T). Outputs are overwritten.
struct SelectiveScanGradArgs {
  int64_t T = 0, E = 0, N = 0;
  const float* u = nullptr;   ///< [T,E]
  const float* dt = nullptr;  ///< [T,E]
  const float* B = nullptr;   ///< [T,N]
  const float* C = nullptr;   ///< [T,N]
  const float* A = nullptr;   ///< [E,N]
  const float* D = nullptr;   ///< [E]
  const float* S0 = nullptr;  ///< [E,N] initial state
  const float* dy = nullptr;  ///< [T,E]
  float* du = nullptr;        ///< [T,E] through the state write and the D skip
  float* dB = nullptr;        ///< [T,N]
  float* dC = nullptr;        ///< [T,N]
  float* ddt = nullptr;       ///< [T,E] through dt B u only (the write strength)
  float* ddtA = nullptr;      ///< [T,E] the decay path as a gradient of dt: sum_n A[e,n] ddA[t,e,n]
  float* ddA = nullptr;       ///< optional [T,E,N]: d/d(A dt) per element (the decays value)
  float* dS0 = nullptr;       ///< [E,N]
  float* dstates = nullptr;   ///< optional [T,E,N]: dL/dS_t (served layout)
  int64_t chunk = 64;
  int64_t groups = 1;         ///< channel groups with their own B / C (then B, C, dB, dC are [T,groups,N])
};
void selective_scan_backward(const SelectiveScanGradArgs& a);

}  // namespace mixlens::grad

namespace mixlens::grad {

/// Backward of the RG-LRU recurrence of one batch row (mixers/rg_lru_mixer.cpp; transformers'
/// RecurrentGemmaRglru): per channel c, from the served values u (attention_values), i (betas) and
/// log a (decays),  h_t = a_t h_{t-1} + m_t i_t u_t  with a_t = exp(log a_t), m_t = sqrt(1 - a_t^2), and
/// at a reset token (a sequence's first) a_t = 0, m_t = 1. dm/d(1 - a^2) is transformers'
/// SqrtBoundDerivative: 1 / sqrt(max(4 (1 - a^2), 1e-6)). Outputs are overwritten.
struct RgLruGradArgs {
  int64_t T = 0, W = 0;
  const float* u = nullptr;        ///< [T,W]
  const float* ig = nullptr;       ///< [T,W]
  const float* la = nullptr;       ///< [T,W] log a_t (<= 0)
  const uint8_t* reset = nullptr;  ///< [T] 1 at a reset token
  const float* h0 = nullptr;       ///< [W] the state before token 0
  const float* dy = nullptr;       ///< [T,W] dL/dh_t as the output (attention_head_outputs)
  float* du = nullptr;             ///< [T,W] through the write m i u
  float* dig = nullptr;            ///< [T,W]
  float* dla = nullptr;            ///< [T,W] through a_t and m_t (0 at a reset)
  float* dh0 = nullptr;            ///< [W]
  float* dstates = nullptr;        ///< optional [T,W]: dL/dh_t (the output and every later token)
};
void rg_lru_backward(const RgLruGradArgs& a);

}  // namespace mixlens::grad
