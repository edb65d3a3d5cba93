// Backward of the Qwen gated-DeltaNet hybrids (Qwen3.5, Qwen3-Next; issue 12, docs/gradients.md):
// the pieces FamilyModel::backward runs on a QwenHybridParts (views of a QwenHybrid's weights,
// models/qwen_hybrid.h). The attention layers' backward is the attention mixer's
// (AttentionMixerGrad, grad/families.h); LFM2's short conv layers' is ShortConvMixerGrad, MiniMax's
// lightning layers' LightningMixerGrad. Each mixer is recomputed from its normed input with the tape's
// writes re-applied (output() is the mixer output as the forward added it), then differentiated.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "grad/tape.h"
#include "models/hybrid_cache.h"
#include "models/qwen_hybrid.h"

namespace mixlens::grad {

using detail::GdnView;
using detail::MlpView;
using detail::QwenLayerView;

/// Backward of QwenHybrid::forward: LM head, final norm, blocks (mixer, MLP) from last to first.
void qwen_hybrid_backward(const detail::QwenHybridParts& bb, const Tape& tape, const Tensor& dlogits, GradSink& sink);

/// The gated DeltaNet mixer of one layer, recomputed for its backward.
class GdnMixerGrad {
 public:
  GdnMixerGrad(const GdnView& w, int layer, const Tensor& n, const detail::HybridCache& before, const Tape& tape);
  /// The mixer output as the forward added it (attention_output, writes applied).
  const Tensor& output() const { return out_; }
  /// dn [B,T,D] (overwritten) from dL/d(output); puts the linear_attn values' gradients.
  void backward(const Tensor& dout, Tensor& dn, GradSink& sink) const;

 private:
  const GdnView& w_;
  int li_;
  const Tape& tape_;
  bool masked_ = false, has_state_ = false;
  static constexpr int64_t kChunk = 64;  ///< the forward kernel's chunk (GatedDeltaArgs' default)
  Tensor proj_, u_, q_, k_, v_, beta_, g_, S0_, o_, out_, ckpt_;
  Tensor su_, sz_;  ///< sigmoid of the conv output u_ [B,T,cd] and of the gate z [B,T,HV*Dv] (vectorized once)
  Tensor zk_, fa_;  ///< kda: the gate logits g_b(g_a(x)) [BT,HV*Dv] and f_b(f_a(x)) [BT,HV*Dk]
  /// Row `row`, value head j's gate logits (z in in_proj's output, or kda's zk_).
  const float* gate_logits(int64_t row, int64_t j) const;
};

/// LFM2's gated short conv mixer of one layer (mixers/short_conv_mixer.h), recomputed for its backward
/// from the normed input with the tape's writes re-applied; the window the call starts from is a
/// constant of the call (its gradient is served as state_input).
class ShortConvMixerGrad {
 public:
  ShortConvMixerGrad(const detail::ShortConvMixer& mixer, const detail::ShortConvMixerWeights& w, int layer,
                     const Tensor& n, const detail::HybridCache& before, const Tape& tape);
  /// The mixer output as the forward added it (attention_output, writes applied).
  const Tensor& output() const { return out_; }
  /// dn [B,T,D] (overwritten) from dL/d(output); puts the linear_attn values' gradients.
  void backward(const Tensor& dout, Tensor& dn, GradSink& sink) const;

 private:
  const detail::ShortConvMixerWeights& w_;
  int li_;
  const Tape& tape_;
  int64_t D_ = 0, K_ = 0;
  bool masked_ = false, has_state_ = false;
  std::vector<int64_t> first_;  ///< per row, its first real token (left padding is skipped by the scan)
  Tensor Bg_, Cg_, xg_;         ///< [B,T,D] in_proj's B | C | x (writes applied)
  Tensor S0_;                   ///< [B,D,K] the window before the call, served layout (writes applied)
  Tensor acc_;                  ///< [B,T,D] the conv output (before * C)
  Tensor out_;
};

/// MiniMax's lightning attention mixer of one layer (mixers/lightning_mixer.h), recomputed for its
/// backward from the normed input with the tape's writes re-applied (the kernel the call ran: block
/// form or token loop); the kv state the call starts from is a constant of the call (its gradient is
/// served as state_input). The scan's backward is the SSD's (ssd_backward with SsdGradArgs::da).
class LightningMixerGrad {
 public:
  LightningMixerGrad(const detail::LightningMixer& mixer, const detail::LightningMixerWeights& w, int layer,
                     const Tensor& n, const detail::HybridCache& before, const Tape& tape);
  /// The mixer output as the forward added it (attention_output, writes applied; before the block's beta).
  const Tensor& output() const { return out_; }
  /// dn [B,T,D] (overwritten) from dL/d(output); puts the linear_attn values' gradients.
  void backward(const Tensor& dout, Tensor& dn, GradSink& sink) const;

 private:
  const detail::LightningMixerWeights& w_;
  int li_;
  const Tape& tape_;
  int64_t D_ = 0, H_ = 0, Dh_ = 0;
  float eps_ = 1e-6f;
  bool masked_ = false, has_state_ = false;
  std::vector<int64_t> first_;  ///< per row, its first real token (the scan starts there, as the forward's)
  Tensor qkv_;                  ///< [BT, 3 H Dh] qkv_proj's output before the SiLU
  Tensor q_, k_, v_;            ///< [B,T,H,Dh] after the SiLU (writes applied)
  Tensor da_;                   ///< [B,T,H] the log decay per token (decays, writes applied)
  Tensor S0_;                   ///< [B,H,Dh(v),Dh(k)] the state before the call, kernel layout (writes applied)
  Tensor y_;                    ///< [B,T,H,Dh] the scan's output (attention_head_outputs, writes applied)
  Tensor sg_;                   ///< [BT, H Dh] sigmoid(output_gate(n))
  Tensor out_;
};

/// Backward of one layer's MLP at x [B,T,D] (recomputed): dx (overwritten) from dL/d(output).
/// `gu_kept` (dense MLP): the forward's gate|up product [rows, 2I]; x is then not read.
void mlp_backward(const MlpView& m, const Tensor& x, const Tensor& dout, Tensor& dx, const Tensor* gu_kept = nullptr);

}  // namespace mixlens::grad
