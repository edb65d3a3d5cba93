// Backward of the Qwen gated-DeltaNet hybrids (Qwen3.5, Qwen3-Next; issue 12, docs/gradients.md):
// views of a QwenHybrid's weights (models/qwen_hybrid.cpp keeps them private) and the pieces its
// FamilyModel::backward runs. Each mixer is recomputed from its normed input with the tape's writes
// re-applied (output() is the mixer output as the forward added it), then differentiated.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "grad/tape.h"
#include "models/hybrid_cache.h"

namespace mixlens::grad {

/// Qwen3_5GatedDeltaNet: in_proj rows [q | k | v | z | b | a] (models/qwen_hybrid.h GdnDims).
struct GdnView {
  int64_t D = 0, HK = 0, HV = 0, Dk = 0, Dv = 0, K = 0;
  float eps = 1e-6f;
  const Tensor* in_proj = nullptr;   ///< [proj_rows, D]
  const Tensor* conv_wT = nullptr;   ///< [K, conv_dim]
  const Tensor* neg_A = nullptr;     ///< [HV] -exp(A_log)
  const Tensor* dt_bias = nullptr;   ///< [HV]
  const Tensor* gnorm = nullptr;     ///< [Dv]
  const Tensor* out_proj = nullptr;  ///< [D, HV*Dv]
};

/// Qwen3_5Attention: q_proj gives per head [query | gate], q_norm / k_norm ((1 + w)), partial RoPE, GQA.
struct AttnView {
  int64_t D = 0, H = 0, Hkv = 0, hd = 0, rot = 0;
  float eps = 1e-6f;
  const std::vector<float>* inv_freq = nullptr;
  const Tensor *q_proj = nullptr, *k_proj = nullptr, *v_proj = nullptr, *o_proj = nullptr, *q_norm = nullptr,
               *k_norm = nullptr;
};

/// SwiGLU MLP (dense) or Qwen3NextSparseMoeBlock.
struct MlpView {
  bool moe = false;
  int64_t D = 0, I = 0, Is = 0, topk = 0;
  bool norm_topk = true;
  const Tensor *gate_up = nullptr, *down = nullptr;  ///< dense: [2I, D] (gate | up), [D, I]
  const Tensor* router = nullptr;                    ///< [E, D]
  const std::vector<Tensor>* expert_gate_up = nullptr;
  const std::vector<Tensor>* expert_down = nullptr;
  const Tensor *shared_gate_up = nullptr, *shared_down = nullptr, *shared_gate = nullptr;
};

struct QwenLayerView {
  bool linear = true;
  const Tensor *in_norm = nullptr, *post_norm = nullptr;  ///< zero-centred (1 + w)
  GdnView gdn;
  AttnView attn;
  MlpView mlp;
};

struct QwenBackbone {
  const Tensor* norm = nullptr;     ///< final (1 + w) RMSNorm
  const Tensor* lm_head = nullptr;  ///< [V, D]
  float eps = 1e-6f;
  int64_t D = 0, L = 0, V = 0;
  std::vector<QwenLayerView> layers;
};

/// Backward of QwenHybrid::forward: LM head, final norm, blocks (mixer, MLP) from last to first.
void qwen_hybrid_backward(const QwenBackbone& bb, const Tape& tape, const Tensor& dlogits, GradSink& sink);

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
};

/// The gated softmax attention of one layer, recomputed for its backward.
class AttnMixerGrad {
 public:
  AttnMixerGrad(const AttnView& w, int layer, const Tensor& n, const detail::HybridCache& before,
                const std::vector<int64_t>& pos, const Tape& tape);
  const Tensor& output() const { return out_; }
  void backward(const Tensor& dout, Tensor& dn, GradSink& sink) const;

 private:
  const AttnView& w_;
  int li_;
  const Tape& tape_;
  const detail::HybridCache& before_;
  const std::vector<int64_t>& pos_;
  std::vector<std::vector<uint8_t>> key_mask_;
  int64_t past_ = 0;
  Tensor n_, qpre_, kpre_, q_, k_, v_, gate_, att_, out_;
  detail::KvCache kv_;
};

/// Backward of one layer's MLP at x [B,T,D] (recomputed): dx (overwritten) from dL/d(output).
/// `gu_kept` (dense MLP): the forward's gate|up product [rows, 2I]; x is then not read.
void mlp_backward(const MlpView& m, const Tensor& x, const Tensor& dout, Tensor& dx, const Tensor* gu_kept = nullptr);

}  // namespace mixlens::grad
