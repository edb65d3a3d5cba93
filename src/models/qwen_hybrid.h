// Shared implementation of the gated-DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-Hybrid):
// decoder blocks whose mixer is either a gated DeltaNet (linear_attn) or softmax attention
// (self_attn), as config.layer_types says, followed by a dense SwiGLU MLP or a sparse MoE. The
// per-family files say how their checkpoints lay out the GDN input projections and set the options
// in which OLMo-Hybrid differs (norm weights, post-norm attention blocks, attention and GDN options).
#pragma once
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "io/json.h"
#include "io/weights.h"
#include "mixers/attention_mixer.h"
#include "mixers/gated_delta_mixer.h"
#include "mixers/lightning_mixer.h"
#include "mixers/short_conv_mixer.h"
#include "models/family.h"

namespace mixlens::detail {

struct QwenHybridSpec {
  using GdnInProj = std::function<ops::RowStack(const io::WeightStore&, const std::string& prefix, const GdnDims&)>;
  QwenHybridSpec() = default;
  /// The two fields every family sets; the options below keep their defaults unless it sets them.
  QwenHybridSpec(std::string family_name, GdnInProj in_proj)
      : family(std::move(family_name)), load_gdn_in_proj(std::move(in_proj)) {}
  std::string family;  ///< route_kernels family name ("qwen3_5", "qwen3_next")
  /// Returns layer `prefix`'s GDN input projections as one [proj_rows, D] stack (no copy) with rows in the
  /// order q (HK*Dk, head-major) | k | v (HV*Dv) | z (HV*Dv) | b (HV) | a (HV).
  GdnInProj load_gdn_in_proj;
  /// RMSNorm weights (input / post / final norms) are zero-centred, applied as (1 + w) (Qwen), else
  /// plain w (OLMo-Hybrid).
  bool centred_norms = true;
  /// Attention blocks norm what their mixer and MLP return instead of their inputs (OLMo-Hybrid):
  /// h += post_attention_layernorm(self_attn(h)); h += post_feedforward_layernorm(mlp(h)).
  bool attention_post_norms = false;
  /// The attention options past the heads (RoPE, gate, q / k norms, biases), from the text config;
  /// null: Qwen3_5Attention's (gated, per-head (1 + w) q / k norms, partial RoPE).
  std::function<void(const io::Config&, AttentionMixerDims&)> attention;
  GdnOptions gdn;  ///< the GDN's beta scale, gated-norm eps and weight names
  /// Block norm names a checkpoint may use instead of the module's (module name, stored name), read
  /// when the module name is absent (OLMo-Hybrid: input_layernorm as attention_layer_norm,
  /// post_attention_layernorm as feedforward_layer_norm).
  std::vector<std::pair<std::string, std::string>> norm_aliases;
  /// Kimi-Linear's block stack (kimi_linear.cpp, which also maps its config onto the fields read
  /// here): Kimi Delta Attention linear blocks (GdnDims::kda), latent attention blocks (MLA), plain
  /// weight RMS norms, and KimiLinearMoE where mlp_layer_types says "sparse" (sigmoid router with
  /// e_score_correction_bias, group-limited top-k, routed_scaling_factor, ungated shared experts);
  /// MLP weights under block_sparse_moe. as the published checkpoints name them.
  bool kimi = false;
  /// LFM2's block stack (lfm2.cpp, which also maps its config onto the fields read here): gated short
  /// conv blocks (mixers/short_conv_mixer.h) where layer_types says linear_attention, plain weight RMS
  /// norms (norm_aliases: operator_norm / ffn_norm), final norm `final_norm`, SwiGLU MLPs as
  /// feed_forward.w1 / w3 / w2, and LFM2-MoE's sparse block (sigmoid router, expert_bias chooses the
  /// experts and does not weight them, top-k renormalised with + 1e-6, routed_scaling_factor, no shared
  /// expert). conv_bias: the short conv's biases. Backward: grad/short_conv_mixer_grad.cpp, qwen_hybrid_grad.cpp.
  bool lfm2 = false;
  bool conv_bias = false;
  std::string final_norm = "norm";  ///< the final norm's module name (LFM2: embedding_norm)
  /// MiniMax's block stack (minimax.cpp, which also maps its config onto the fields read here):
  /// lightning attention blocks (mixers/lightning_mixer.h, module self_attn) where layer_types says
  /// linear_attention, plain weight RMS norms, every MLP the Mixtral-style sparse block under
  /// block_sparse_moe (softmax router, top-k renormalised, experts w1 / w3 / w2, no shared expert),
  /// and MiniMaxDecoderLayer's residual: the normed input is the residual,
  /// h = alpha * norm(h) + beta * mixer(norm(h)) (the *_attn_alpha / beta_factor of the block kind),
  /// then h = mlp_alpha_factor * norm2(h) + mlp_beta_factor * moe(norm2(h)). Backward:
  /// grad/lightning_mixer_grad.cpp, qwen_hybrid_grad.cpp.
  bool minimax = false;
  struct Factors {
    float linear_alpha = 1, linear_beta = 1, full_alpha = 1, full_beta = 1, mlp_alpha = 1, mlp_beta = 1;
  } factors;
};

/// Qwen3_5GatedDeltaNet: in_proj rows [q | k | v | z | b | a] (GdnDims).
struct GdnView {
  int64_t D = 0, HK = 0, HV = 0, Dk = 0, Dv = 0, K = 0;
  float eps = 1e-6f;                 ///< the gated norm's
  float beta_scale = 1.0f;           ///< beta = beta_scale * sigmoid(b)
  const ops::RowStack* in_proj = nullptr;   ///< [proj_rows, D]
  const Tensor* conv_wT = nullptr;   ///< [K, conv_dim]
  const Tensor* neg_A = nullptr;     ///< [HV] -exp(A_log)
  const Tensor* dt_bias = nullptr;   ///< [HV]
  const Tensor* gnorm = nullptr;     ///< [Dv]
  const Tensor* out_proj = nullptr;  ///< [D, HV*Dv]
  /// Kimi Delta Attention (GdnDims::kda): in_proj rows [q | k | v | g_a (Dk) | b | f_a (Dk)], dt_bias
  /// [HV*Dk], the decay per key channel from f_b [HV*Dk, Dk], the gate sigmoid(g_b [HV*Dv, Dk] g_a x).
  bool kda = false;
  const Tensor *f_b = nullptr, *g_b = nullptr;
};

/// SwiGLU MLP (dense) or Qwen3NextSparseMoeBlock.
struct MlpView {
  bool moe = false;
  int64_t D = 0, I = 0, Is = 0, topk = 0;
  bool norm_topk = true;
  const ops::RowStack* gate_up = nullptr;           ///< dense: [2I, D] (gate | up)
  const Tensor* down = nullptr;                      ///< dense: [D, I]
  const Tensor* router = nullptr;                    ///< [E, D]
  const std::vector<ops::RowStack>* expert_gate_up = nullptr;
  const std::vector<Tensor>* expert_down = nullptr;
  const ops::RowStack* shared_gate_up = nullptr;
  const Tensor *shared_down = nullptr, *shared_gate = nullptr;  ///< shared_gate undefined: ungated (Kimi)
  /// Kimi's sigmoid router (sigmoid_topk_route) when defined: e_score_correction_bias [E]; else Qwen's softmax.
  const Tensor* router_bias = nullptr;
  int64_t n_group = 1, topk_group = 1;
  float routed_scale = 1.0f, topk_eps = 1e-20f;
};

/// KimiLinearTopkRouter (Lfm2MoeTopKRouter: one group) for one token's router logits lg [E]: writes the
/// scores s = sigmoid(lg) [E] and the chosen experts' weights w [topk] (s / (sum of the chosen s + eps)
/// when norm, times scale); returns the chosen experts (group_limited_topk of s + bias, best first).
std::vector<int64_t> sigmoid_topk_route(const float* lg, const float* bias, int64_t E, int64_t n_group,
                                        int64_t topk_group, int64_t topk, bool norm, float eps, float scale, float* s,
                                        float* w);

struct QwenLayerView {
  bool linear = true;
  /// Pre-norm blocks: in_norm before the mixer, post_norm before the MLP. Post-norm blocks
  /// (post_norms): post_norm on the mixer's output, ff_norm on the MLP's, no in_norm.
  bool post_norms = false;
  const Tensor *in_norm = nullptr, *post_norm = nullptr, *ff_norm = nullptr;
  GdnView gdn;
  const ShortConvMixerWeights* sc = nullptr;    ///< LFM2's short conv layers (instead of gdn)
  const LightningMixerWeights* lightning = nullptr;  ///< MiniMax's lightning layers (instead of gdn)
  const AttentionMixerWeights* attn = nullptr;  ///< attention layers
  MlpView mlp;
  /// QwenHybridParts::normed_residual: h1 = mix_alpha n1 + mix_beta mixer(n1), h2 = mlp_alpha n2 + mlp_beta mlp(n2).
  float mix_alpha = 1, mix_beta = 1, mlp_alpha = 1, mlp_beta = 1;
};

/// What the backward (src/grad/qwen_hybrid_grad.cpp) reads of a loaded model (pointers into it).
struct QwenHybridParts : BackwardParts {
  const Tensor* norm = nullptr;     ///< final RMSNorm
  bool centred = true;              ///< every RMSNorm weight is (1 + w) (else w)
  const Tensor* lm_head = nullptr;  ///< [V, D]
  float eps = 1e-6f;
  int64_t D = 0, L = 0, V = 0;
  const AttentionMixer* attn = nullptr;  ///< the attention layers' mixer
  const ShortConvMixer* conv = nullptr;  ///< LFM2: the short conv layers' mixer
  const LightningMixer* lightning = nullptr;  ///< MiniMax: the lightning layers' mixer
  /// MiniMaxDecoderLayer's residual (QwenHybridSpec::minimax): each branch adds to its normed input,
  /// scaled by the layer's factors (QwenLayerView::mix_alpha ...), instead of to the block input.
  bool normed_residual = false;
  std::vector<QwenLayerView> layers;
};

/// Builds the model. `text` is the text-model config (text_config of a VLM config, else the
/// config itself); `top` the file's top-level config (tie_word_embeddings fallback).
std::unique_ptr<FamilyModel> make_qwen_hybrid(const QwenHybridSpec& spec, const io::Config& top,
                                              const io::Config& text, const io::WeightStore& weights);

}  // namespace mixlens::detail
