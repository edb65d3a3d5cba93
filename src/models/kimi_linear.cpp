// Kimi-Linear (model_type "kimi_linear"): the Qwen hybrid block stack (qwen_hybrid.cpp with
// QwenHybridSpec::kimi) with Kimi Delta Attention linear blocks (the gated DeltaNet mixer's kda
// option: a forget gate per key channel), latent attention (MLA, no RoPE) blocks and KimiLinearMoE /
// SwiGLU MLPs as mlp_layer_types says. Reference: transformers 5.18
// models/kimi_linear/modeling_kimi_linear.py and configuration_kimi_linear.py.
#include <string>
#include <utility>

#include "mixlens/errors.h"
#include "models/config.h"
#include "models/qwen_hybrid.h"
#include "models/registry.h"
#include "ops/ops.h"

namespace mixlens::detail {

namespace {

// KimiLinearDeltaAttention's input projections as the stack's in_proj, rows
// [q | k | v | g_a (the output gate's latent) | b | f_a (the forget gate's latent)] (GdnDims::kda).
ops::RowStack load_kda_in_proj(const io::WeightStore& w, const std::string& m, const GdnDims& g) {
  std::vector<Tensor> parts;
  for (const auto& [name, rows] : {std::pair{"q_proj", g.key_dim()}, {"k_proj", g.key_dim()}, {"v_proj", g.value_dim()},
                                   {"g_a_proj", g.Dk}, {"b_proj", g.HV}, {"f_a_proj", g.Dk}})
    parts.push_back(w.get_matmul(m + name + ".weight", {rows, g.D}));
  return ops::RowStack(std::move(parts));
}

// KimiLinearConfig onto the fields the stack reads: one head count and size for q / k / v
// (linear_num_heads, linear_head_dim, or the published linear_attn_config), attention head_dim =
// qk_nope_head_dim + qk_rope_head_dim (the file's head_dim is qk_rope_head_dim), the MoE under
// Qwen3-Next's names (dense layers as mlp_only_layers), and the 1-indexed layer lists of
// linear_attn_config when layer_types is absent, as KimiLinearConfig.__post_init__ does.
io::Config kimi_text(const io::Config& cfg) {
  nlohmann::json j = cfg.json();
  const nlohmann::json lac = j.contains("linear_attn_config") && j["linear_attn_config"].is_object()
                                 ? j["linear_attn_config"] : nlohmann::json::object();
  const auto pick = [&](const char* key, const char* nested, int64_t fallback) {
    if (lac.contains(nested) && !lac[nested].is_null()) return lac[nested].get<int64_t>();
    return cfg.get_or<int64_t>(key, fallback);
  };
  const int64_t heads = pick("linear_num_heads", "num_heads", 32), hd = pick("linear_head_dim", "head_dim", 128);
  j["linear_num_key_heads"] = j["linear_num_value_heads"] = heads;
  j["linear_key_head_dim"] = j["linear_value_head_dim"] = hd;
  j["linear_conv_kernel_dim"] = pick("linear_conv_kernel_dim", "short_conv_kernel_size", 4);
  const int64_t L = cfg.get<int64_t>("num_hidden_layers");
  if (!j.contains("layer_types") || j["layer_types"].is_null()) {
    std::vector<std::string> types(static_cast<size_t>(L));
    if (lac.contains("full_attn_layers") && lac.contains("kda_layers")) {
      for (const auto& [key, kind] : {std::pair{"full_attn_layers", "full_attention"}, {"kda_layers", "linear_attention"}})
        for (int64_t i : lac[key].get<std::vector<int64_t>>()) {
          if (i < 1 || i > L) throw ConfigError(where(cfg) + ": linear_attn_config." + key + " names layer " + std::to_string(i) + " (1-indexed, of " + std::to_string(L) + ")");
          types[static_cast<size_t>(i - 1)] = kind;
        }
    } else {
      for (int64_t i = 0; i < L; ++i) types[static_cast<size_t>(i)] = i && i % 4 == 0 ? "full_attention" : "linear_attention";
    }
    j["layer_types"] = types;
  }
  j["head_dim"] = cfg.get_or<int64_t>("qk_nope_head_dim", 128) + cfg.get_or<int64_t>("qk_rope_head_dim", 64);
  for (const auto& [key, value] : {std::pair{"qk_nope_head_dim", 128}, {"qk_rope_head_dim", 64}, {"v_head_dim", 128},
                                   {"kv_lora_rank", 512}})
    if (!j.contains(key) || j[key].is_null()) j[key] = value;
  // The MoE (attribute_map: the file spells num_experts, num_experts_per_token, num_expert_group,
  // moe_renormalize, num_shared_experts).
  const auto alias = [&](const char* key, const char* file_key) {
    if (j.contains(file_key) && !j[file_key].is_null()) j[key] = j[file_key];
  };
  alias("num_experts_per_tok", "num_experts_per_token");
  alias("n_group", "num_expert_group");
  alias("norm_topk_prob", "moe_renormalize");
  alias("n_shared_experts", "num_shared_experts");
  std::vector<std::string> mlp_types;
  if (j.contains("mlp_layer_types") && !j["mlp_layer_types"].is_null()) {
    mlp_types = j["mlp_layer_types"].get<std::vector<std::string>>();
  } else {
    const int64_t first_dense = cfg.get_or<int64_t>("first_k_dense_replace", 1);
    for (int64_t i = 0; i < L; ++i) mlp_types.push_back(i < first_dense ? "dense" : "sparse");
  }
  if (static_cast<int64_t>(mlp_types.size()) != L)
    throw ConfigError(where(cfg) + ": mlp_layer_types has " + std::to_string(mlp_types.size()) + " entries but num_hidden_layers is " + std::to_string(L));
  nlohmann::json dense = nlohmann::json::array();
  bool any_sparse = false;
  for (int64_t i = 0; i < L; ++i) {
    const std::string& t = mlp_types[static_cast<size_t>(i)];
    if (t != "dense" && t != "sparse")
      throw ConfigError(where(cfg) + ": mlp_layer_types[" + std::to_string(i) + "] is '" + t + "' (expected 'dense' or 'sparse')");
    if (t == "dense") dense.push_back(i);
    any_sparse = any_sparse || t == "sparse";
  }
  j["mlp_only_layers"] = dense;
  j["decoder_sparse_step"] = 1;
  if (!any_sparse) {
    j["num_experts"] = 0;
  } else {
    if (!j.contains("num_experts") || j["num_experts"].is_null()) j["num_experts"] = 256;
    if (!j.contains("num_experts_per_tok") || j["num_experts_per_tok"].is_null()) j["num_experts_per_tok"] = 8;
    const int64_t moe_i = cfg.get_or<int64_t>("moe_intermediate_size", 1024);
    j["moe_intermediate_size"] = moe_i;
    j["shared_expert_intermediate_size"] = moe_i * (j.contains("n_shared_experts") && !j["n_shared_experts"].is_null()
                                                        ? j["n_shared_experts"].get<int64_t>() : 1);
  }
  if (!j.contains("rms_norm_eps") || j["rms_norm_eps"].is_null()) j["rms_norm_eps"] = 1e-5;
  return io::Config(std::move(j), cfg.path(), "");
}

}  // namespace

std::unique_ptr<FamilyModel> make_kimi_linear(const io::Config& config, const io::WeightStore& weights) {
  QwenHybridSpec spec{"kimi_linear", load_kda_in_proj};
  spec.kimi = true;
  spec.centred_norms = false;  // KimiRMSNorm: plain weight
  spec.attention = [](const io::Config& cfg, AttentionMixerDims& md) {
    // KimiLinearAttention: latent attention, no RoPE (head_dim = qk_nope + qk_rope)
    md.rope = false;
    md.kv_lora_rank = cfg.get<int64_t>("kv_lora_rank");
    md.q_lora_rank = cfg.get_or<int64_t>("q_lora_rank", 0);  // null: q_proj
    md.qk_nope = cfg.get<int64_t>("qk_nope_head_dim");
    md.qk_rope = cfg.get<int64_t>("qk_rope_head_dim");
    md.v_hd = cfg.get<int64_t>("v_head_dim");
    require_positive(cfg, {{"kv_lora_rank", md.kv_lora_rank}, {"v_head_dim", md.v_hd}});
  };
  return make_qwen_hybrid(spec, config, kimi_text(config), weights);
}

}  // namespace mixlens::detail
