// Shared implementation of the Qwen gated-DeltaNet hybrids (Qwen3.5, Qwen3-Next): decoder blocks
// whose mixer is either a gated DeltaNet (linear_attn) or gated softmax attention (self_attn), as
// config.layer_types says, followed by a dense SwiGLU MLP or a sparse MoE. The per-family files
// (qwen3_5.cpp, qwen3_next.cpp) only say how their checkpoints lay out the GDN input projections.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "io/json.h"
#include "io/weights.h"
#include "mixers/attention_mixer.h"
#include "mixers/gated_delta_mixer.h"
#include "models/family.h"

namespace mixlens::detail {

struct QwenHybridSpec {
  std::string family;  ///< route_kernels family name ("qwen3_5", "qwen3_next")
  /// Returns layer `prefix`'s GDN input projections as one [proj_rows, D] matrix with rows in the
  /// order q (HK*Dk, head-major) | k | v (HV*Dv) | z (HV*Dv) | b (HV) | a (HV).
  std::function<Tensor(const io::WeightStore&, const std::string& prefix, const GdnDims&)> load_gdn_in_proj;
  /// Kimi-Linear's block stack (kimi_linear.cpp, which also maps its config onto the fields read
  /// here): Kimi Delta Attention linear blocks (GdnDims::kda), latent attention blocks (MLA), plain
  /// weight RMS norms, and KimiLinearMoE where mlp_layer_types says "sparse" (sigmoid router with
  /// e_score_correction_bias, group-limited top-k, routed_scaling_factor, ungated shared experts);
  /// MLP weights under block_sparse_moe. as the published checkpoints name them. No backward.
  bool kimi = false;
};

/// Qwen3_5GatedDeltaNet: in_proj rows [q | k | v | z | b | a] (GdnDims).
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
  const AttentionMixerWeights* attn = nullptr;  ///< attention layers
  MlpView mlp;
};

/// What the backward (src/grad/qwen_hybrid_grad.cpp) reads of a loaded model (pointers into it).
struct QwenHybridParts : BackwardParts {
  const Tensor* norm = nullptr;     ///< final (1 + w) RMSNorm
  const Tensor* lm_head = nullptr;  ///< [V, D]
  float eps = 1e-6f;
  int64_t D = 0, L = 0, V = 0;
  const AttentionMixer* attn = nullptr;  ///< Qwen3_5Attention (gated, per-head (1 + w) q / k norms, partial RoPE)
  std::vector<QwenLayerView> layers;
};

/// Builds the model. `text` is the text-model config (text_config of a VLM config, else the
/// config itself); `top` the file's top-level config (tie_word_embeddings fallback).
std::unique_ptr<FamilyModel> make_qwen_hybrid(const QwenHybridSpec& spec, const io::Config& top,
                                              const io::Config& text, const io::WeightStore& weights);

}  // namespace mixlens::detail
