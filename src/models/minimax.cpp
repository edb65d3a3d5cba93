// MiniMax (model_type "minimax", MiniMaxForCausalLM): the Qwen hybrid block stack (qwen_hybrid.cpp with
// QwenHybridSpec::minimax) with lightning attention blocks (mixers/lightning_mixer.h) where layer_types
// says linear_attention and GQA softmax attention blocks (full RoPE, no q / k norms, no gate)
// elsewhere, a Mixtral-style sparse MoE on every block, and MiniMaxDecoderLayer's scaled residuals.
// Reference: transformers 5.18 models/minimax/modeling_minimax.py and configuration_minimax.py.
#include <cmath>
#include <string>
#include <utility>

#include "mixlens/errors.h"
#include "models/config.h"
#include "models/qwen_hybrid.h"
#include "models/registry.h"

namespace mixlens::detail {

namespace {

// MiniMaxConfig onto the fields the stack reads: layer_types (or the published attn_type_list, 1 =
// softmax attention; absent both, MiniMaxConfig.__post_init__'s default: full attention at even
// indices), num_local_experts / intermediate_size as the sparse block's experts and width, top-k
// renormalised, rope_theta's MiniMax default 1e6. The GDN head fields are placeholders the lightning
// blocks do not read.
io::Config minimax_text(const io::Config& cfg) {
  nlohmann::json j = cfg.json();
  const auto has = [&](const char* k) { return j.contains(k) && !j[k].is_null(); };
  const int64_t L = cfg.get<int64_t>("num_hidden_layers");
  require_positive(cfg, {{"num_hidden_layers", L}});
  j["rms_norm_eps"] = cfg.get_double_or("rms_norm_eps", 1e-5);
  j["linear_conv_kernel_dim"] = 1;
  for (const char* k : {"linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"})
    j[k] = 1;
  std::vector<std::string> types;
  if (has("layer_types")) {
    types = cfg.get<std::vector<std::string>>("layer_types");
  } else if (has("attn_type_list")) {
    for (int64_t t : cfg.get<std::vector<int64_t>>("attn_type_list")) {
      if (t != 0 && t != 1) throw ConfigError(where(cfg) + ": attn_type_list entries must be 0 (lightning) or 1 (softmax), got " + std::to_string(t));
      types.push_back(t == 1 ? "full_attention" : "linear_attention");
    }
  } else {
    for (int64_t i = 0; i < L; ++i) types.push_back((i + 1) % 2 ? "full_attention" : "linear_attention");
  }
  j["layer_types"] = types;  // the skeleton checks the length and the names
  if (!has("rope_theta") && !has("rope_parameters")) j["rope_theta"] = 1e6;
  if (!has("tie_word_embeddings")) j["tie_word_embeddings"] = false;
  j["num_experts"] = cfg.get_or<int64_t>("num_local_experts", 8);
  j["num_experts_per_tok"] = cfg.get_or<int64_t>("num_experts_per_tok", 2);
  j["moe_intermediate_size"] = cfg.get_or<int64_t>("intermediate_size", 14336);
  j["norm_topk_prob"] = true;  // MiniMaxTopKRouter divides the top-k by their sum
  j["decoder_sparse_step"] = 1;
  j["mlp_only_layers"] = nlohmann::json::array();
  return io::Config(std::move(j), cfg.path(), "");
}

// A residual factor as MiniMaxConfig names it, else as the published remote-code configs do
// (layernorm_<kind>_alpha / beta), else 1.
float factor(const io::Config& cfg, const char* name, const char* published) {
  const char* f = cfg.has(name) && !cfg.is_null(name) ? name : published;
  const double v = cfg.get_double_or(f, 1.0);
  if (!std::isfinite(v)) throw ConfigError(where(cfg) + ": " + f + " must be a finite number");
  return static_cast<float>(v);
}

}  // namespace

std::unique_ptr<FamilyModel> make_minimax(const io::Config& config, const io::WeightStore& weights) {
  QwenHybridSpec spec;
  spec.family = "minimax";
  spec.minimax = true;
  spec.centred_norms = false;  // MiniMaxRMSNorm: plain weight
  spec.factors = {factor(config, "linear_attn_alpha_factor", "layernorm_linear_attention_alpha"),
                  factor(config, "linear_attn_beta_factor", "layernorm_linear_attention_beta"),
                  factor(config, "full_attn_alpha_factor", "layernorm_full_attention_alpha"),
                  factor(config, "full_attn_beta_factor", "layernorm_full_attention_beta"),
                  factor(config, "mlp_alpha_factor", "layernorm_mlp_alpha"),
                  factor(config, "mlp_beta_factor", "layernorm_mlp_beta")};
  spec.attention = [](const io::Config& cfg, AttentionMixerDims& md) {
    // MiniMaxAttention: RoPE over the whole head (compute_default_rope_parameters uses head_dim, no
    // partial factor), no q / k norms, no gate, no biases; sliding_window as transformers' mask.
    read_full_rope(cfg, md);
    if (cfg.has("sliding_window") && !cfg.is_null("sliding_window")) {
      md.window = cfg.get<int64_t>("sliding_window");
      require_positive(cfg, {{"sliding_window", md.window}});
    }
  };
  return make_qwen_hybrid(spec, config, minimax_text(config), weights);
}

}  // namespace mixlens::detail
