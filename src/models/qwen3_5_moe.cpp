// Qwen3.5-MoE (model_type "qwen3_5_moe": the published Qwen3_5MoeForConditionalGeneration checkpoints,
// text weights under model.language_model.*, vision tower ignored; "qwen3_5_moe_text": text-only
// Qwen3_5MoeForCausalLM, model.*). The Qwen3.5 block stack (qwen_hybrid.cpp, Qwen3.5's separate GDN
// projections, qwen3_5.h) with Qwen3_5MoeSparseMoeBlock as every layer's MLP: softmax router (fp32),
// top-k renormalised, experts gate_up_proj [E, 2I, D] / down_proj [E, D, I] (fused, or one tensor per
// expert as save_pretrained of the text-only model writes them), shared expert gated by
// sigmoid(shared_expert_gate). Reference: transformers 5.18 models/qwen3_5_moe/modeling_qwen3_5_moe.py.
#include <string>
#include <utility>

#include "models/qwen3_5.h"
#include "models/qwen_hybrid.h"
#include "models/registry.h"

namespace mixlens::detail {

namespace {

// The shared stack reads Qwen3-Next's MoE fields; Qwen3.5-MoE has none of them and transformers
// ignores them if a file carries them (every layer is the MoE, the top-k weights always sum to 1),
// so they are set to that before the stack reads the config. Absent sizes take
// Qwen3_5MoeTextConfig's defaults.
io::Config qwen3_5_moe_text(const io::Config& config) {
  const bool nested = config.has("text_config") && !config.is_null("text_config");
  const io::Config text = qwen3_5_text_config(config);
  nlohmann::json j = text.json();
  j["decoder_sparse_step"] = 1;
  j["mlp_only_layers"] = nlohmann::json::array();
  j["norm_topk_prob"] = true;
  const std::pair<const char*, int> defaults[] = {{"num_experts", 256}, {"num_experts_per_tok", 8},
                                                  {"moe_intermediate_size", 512}, {"shared_expert_intermediate_size", 512}};
  for (const auto& [key, value] : defaults)
    if (!j.contains(key) || j[key].is_null()) j[key] = value;
  return io::Config(std::move(j), text.path(), nested ? "text_config." : "");
}

}  // namespace

std::unique_ptr<FamilyModel> make_qwen3_5_moe(const io::Config& config, const io::WeightStore& weights) {
  return make_qwen_hybrid(QwenHybridSpec{"qwen3_5_moe", load_qwen3_5_gdn_in_proj}, config, qwen3_5_moe_text(config),
                          weights);
}

}  // namespace mixlens::detail
