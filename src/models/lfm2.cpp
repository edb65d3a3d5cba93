// LFM2 and LFM2-MoE (model_type "lfm2", "lfm2_moe"): the Qwen hybrid block stack (qwen_hybrid.cpp with
// QwenHybridSpec::lfm2) with gated short conv blocks (mixers/short_conv_mixer.h) and GQA attention
// blocks (per-head q / k RMS norms, full RoPE, no gate), then a SwiGLU MLP or LFM2-MoE's sparse block.
// Reference: transformers 5.18 models/lfm2/modeling_lfm2.py, models/lfm2_moe/modeling_lfm2_moe.py and
// their configuration files.
#include <string>
#include <utility>

#include "mixlens/errors.h"
#include "models/config.h"
#include "models/qwen_hybrid.h"
#include "models/registry.h"

namespace mixlens::detail {

namespace {

// Lfm2Config / Lfm2MoeConfig onto the fields the stack reads: norm_eps as rms_norm_eps, conv_L_cache
// as the conv width, "conv" layers as its linear layers (layer_types, or full_attn_idxs as
// Lfm2Config.__post_init__ reads it), Lfm2MLP's block_auto_adjust_ff_dim width, and LFM2-MoE's first
// num_dense_layers as its dense (mlp_only) layers. The GDN head fields are placeholders the short conv
// does not read.
io::Config lfm2_text(const io::Config& cfg, bool moe) {
  nlohmann::json j = cfg.json();
  const auto has = [&](const char* k) { return j.contains(k) && !j[k].is_null(); };
  const int64_t L = cfg.get<int64_t>("num_hidden_layers");
  j["rms_norm_eps"] = cfg.get_double_or("norm_eps", 1e-5);
  j["linear_conv_kernel_dim"] = cfg.get_or<int64_t>("conv_L_cache", 3);
  for (const char* k : {"linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"})
    j[k] = 1;
  std::vector<std::string> types;
  if (has("layer_types")) {
    types = cfg.get<std::vector<std::string>>("layer_types");
  } else if (has("full_attn_idxs")) {
    types.assign(static_cast<size_t>(L), "conv");
    for (int64_t i : cfg.get<std::vector<int64_t>>("full_attn_idxs")) {
      if (i < 0 || i >= L) throw ConfigError(where(cfg) + ": full_attn_idxs names layer " + std::to_string(i) + " of " + std::to_string(L));
      types[static_cast<size_t>(i)] = "full_attention";
    }
  } else {
    throw ConfigError(where(cfg) + ": neither layer_types nor full_attn_idxs is given");
  }
  for (size_t i = 0; i < types.size(); ++i) {
    if (types[i] != "conv" && types[i] != "full_attention")
      throw ConfigError(where(cfg) + ": layer_types[" + std::to_string(i) + "] is '" + types[i] + "' (expected 'conv' or 'full_attention')");
    if (types[i] == "conv") types[i] = "linear_attention";
  }
  j["layer_types"] = types;
  if (!has("tie_word_embeddings")) j["tie_word_embeddings"] = has("tie_embedding") ? j["tie_embedding"] : nlohmann::json(true);
  if (!has("intermediate_size") && has("block_ff_dim")) j["intermediate_size"] = j["block_ff_dim"];
  if (!moe) {
    int64_t I = j.contains("intermediate_size") ? j["intermediate_size"].get<int64_t>() : 12288;
    if (cfg.get_or<bool>("block_auto_adjust_ff_dim", true)) {  // Lfm2MLP.__init__
      I = static_cast<int64_t>(2 * I / 3);
      if (has("block_ffn_dim_multiplier") || !j.contains("block_ffn_dim_multiplier")) {
        const double mult = cfg.get_double_or("block_ffn_dim_multiplier", 1.0);
        const int64_t of = cfg.get_or<int64_t>("block_multiple_of", 256);
        require_positive(cfg, {{"block_multiple_of", of}});
        I = static_cast<int64_t>(mult * static_cast<double>(I));
        I = of * ((I + of - 1) / of);
      }
    }
    j["intermediate_size"] = I;
    j["num_experts"] = 0;
    return io::Config(std::move(j), cfg.path(), "");
  }
  for (const auto& [k, v] : {std::pair{"num_experts", 32}, {"num_experts_per_tok", 4}, {"moe_intermediate_size", 1792},
                             {"intermediate_size", 7168}})
    if (!has(k)) j[k] = v;
  nlohmann::json dense = nlohmann::json::array();
  for (int64_t i = 0; i < cfg.get_or<int64_t>("num_dense_layers", 2) && i < L; ++i) dense.push_back(i);
  j["mlp_only_layers"] = dense;
  j["decoder_sparse_step"] = 1;
  j["n_group"] = j["topk_group"] = 1;
  return io::Config(std::move(j), cfg.path(), "");
}

std::unique_ptr<FamilyModel> make(const char* family, bool moe, const io::Config& config, const io::WeightStore& weights) {
  QwenHybridSpec spec{family, nullptr};
  spec.lfm2 = true;
  spec.conv_bias = config.get_or<bool>("conv_bias", false);
  spec.centred_norms = false;  // Lfm2RMSNorm: plain weight
  spec.final_norm = "embedding_norm";
  spec.norm_aliases = {{"input_layernorm", "operator_norm"}, {"post_attention_layernorm", "ffn_norm"}};
  spec.attention = [](const io::Config& cfg, AttentionMixerDims& md) {
    // Lfm2Attention: per-head q / k norms (plain w), RoPE over the whole head, no gate, no biases.
    double theta = 0.0, partial = 1.0;
    read_rope(cfg, 1.0, theta, partial);
    md.rope = true;
    md.rot = md.hd;
    md.theta = theta;
    md.qk_norm = AttentionQkNorm::per_head;
    md.o_name = "out_proj";
    md.q_norm_name = "q_layernorm";
    md.k_norm_name = "k_layernorm";
  };
  return make_qwen_hybrid(spec, config, lfm2_text(config, moe), weights);
}

}  // namespace

std::unique_ptr<FamilyModel> make_lfm2(const io::Config& config, const io::WeightStore& weights) {
  return make("lfm2", false, config, weights);
}

std::unique_ptr<FamilyModel> make_lfm2_moe(const io::Config& config, const io::WeightStore& weights) {
  return make("lfm2_moe", true, config, weights);
}

}  // namespace mixlens::detail
