// Lightning attention (MiniMax's MiniMaxLightningAttention): linear attention with a constant decay
// per head, S_t = exp(-s_h) S_{t-1} + k_t v_t^T, o_t = q_t S_t, where q | k | v = silu(qkv_proj(x))
// per head, then RMSNorm over all heads (eps 1e-6), * sigmoid(output_gate(x)), out_proj. s_h is the
// layer's slope rate, (1 / 2^(8/H))^(h+1) * (1 - layer / (num_hidden_layers - 1 + 1e-5) + 1e-5).
// The scan is Mamba-2's SSD (mixers/ssd.h) with x = v, B = k, C = q (one group per head), dt = 1,
// D = 0 and the per-token log decay -s_h as SsdArgs::da: transformers' block-wise form (intra-block
// (Q K^T * decay) V plus the inter-block Q (K^T V)) is the SSD chunk form with chunk = block_size, and
// its decode loop is the SSD token step. Reference: transformers 5.18 models/minimax/modeling_minimax.py.
// Backward: grad/lightning_mixer_grad.cpp (LightningMixerGrad, grad/qwen_grad.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "hooks/listener.h"
#include "io/weights.h"
#include "mixlens/model.h"

namespace mixlens::detail {

/// Sizes of one model's lightning blocks (all share them; the slope depends on the layer index).
struct LightningMixerDims {
  int64_t D = 0;         ///< hidden_size
  int64_t H = 0;         ///< num_attention_heads
  int64_t Dh = 0;        ///< head_dim (q, k and v alike)
  int64_t L = 1;         ///< num_hidden_layers (the slope's layer factor)
  int64_t chunk = 256;   ///< block_size: the chunked kernel's block
  float eps = 1e-6f;     ///< the output RMSNorm's (MiniMaxRMSNorm default; not rms_norm_eps)
};

/// One layer's weights (HF names under the layer's `self_attn.` prefix) and its slope rates.
struct LightningMixerWeights {
  Tensor qkv_proj;     ///< [3 H Dh, D]; per head rows q | k | v
  Tensor output_gate;  ///< [H Dh, D]
  Tensor out_proj;     ///< [D, H Dh]
  Tensor norm;         ///< [H Dh]
  Tensor neg_slope;    ///< [H] -s_h, the log decay per token
};

/// What one mixer call reads and updates besides its input.
struct LightningMixerCall {
  int layer = 0;
  Tensor* ssm = nullptr;   ///< [B, H, Dh(v), Dh(k)] the SSD kernel-layout kv state (updated)
  bool has_state = false;  ///< ssm holds a previous call's state (else zeros)
  bool chunked = true;     ///< the chunked (block) kernel, else the token recurrence
  Listener* ls = nullptr;
};

class LightningMixer {
 public:
  LightningMixer() = default;
  /// ConfigError naming `where` and the field unless every size is positive.
  LightningMixer(const LightningMixerDims& dims, const std::string& where);
  const LightningMixerDims& dims() const { return d_; }
  void set_chunk(int64_t c) { d_.chunk = c; }
  /// Loads `prefix`qkv_proj / output_gate / out_proj / norm weights; the slope of layer `layer`
  /// (MiniMaxLightningAttention.get_slope_rate, in float32 as torch computes it).
  LightningMixerWeights load(const io::WeightStore& w, const std::string& prefix, int layer) const;
  /// One row's kernel-layout state [H, Dv, Dk] (SSD's [H, P, N]).
  Shape state_shape() const { return {d_.H, d_.Dh, d_.Dh}; }
  /// The linear_attn values of layer `layer`, in forward order.
  void values(int layer, int64_t B, int64_t T, std::vector<ValueInfo>& out) const;
  /// One call on the normed block input x [B,T,D]; `masked`: zero the padding rows first
  /// (apply_mask_to_padding_states on qkv; silu(0) = 0, so masking x is the same). Returns
  /// out_proj(norm(o) * sigmoid(output_gate(x))) [B,T,D], before the block's beta factor.
  Tensor forward(const LightningMixerWeights& w, const Tensor& x, const Batch& in, bool masked,
                 const LightningMixerCall& call) const;

 private:
  LightningMixerDims d_;
};

}  // namespace mixlens::detail
