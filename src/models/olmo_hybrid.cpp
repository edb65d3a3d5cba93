// OLMo-Hybrid (model_type "olmo_hybrid", OlmoHybridForCausalLM): the gated-DeltaNet hybrid stack
// (qwen_hybrid.cpp) with OLMo's own placements, set as QwenHybridSpec options. Reference:
// transformers 5.18 models/olmo_hybrid/modeling_olmo_hybrid.py.
//  - Plain RMSNorm weights (w, not Qwen's 1 + w) everywhere.
//  - Attention blocks are post-norm (OlmoHybridAttentionDecoderLayer): no input norm,
//    h += post_attention_layernorm(self_attn(h)); h += post_feedforward_layernorm(mlp(h)).
//    GDN blocks are pre-norm as Qwen's.
//  - Attention: q / k RMS norms over the whole projection (plain w), no output gate, attention_bias,
//    RoPE over the whole head, or none (NoPE) when rope_theta is null as in the released checkpoints.
//  - GDN: separate q / k / v / g (the gate z) / b / a projections, beta = 2 sigmoid(b) with
//    linear_allow_neg_eigval, gated norm o_norm with eps 1e-5 (not rms_norm_eps), output o_proj.
//  - Checkpoint names: save_pretrained (and the released files) store input_layernorm as
//    attention_layer_norm, post_attention_layernorm as feedforward_layer_norm and the conv as
//    q_conv1d / k_conv1d / v_conv1d (transformers' conversion_mapping); the module names are read too.
#include <string>
#include <utility>

#include "mixlens/errors.h"
#include "models/common.h"
#include "models/config.h"
#include "models/qwen_hybrid.h"
#include "models/registry.h"

namespace mixlens::detail {

namespace {

// The layer's q_proj | k_proj | v_proj | g_proj | b_proj | a_proj as the stack's [q | k | v | z | b | a].
ops::RowStack load_gdn_in_proj(const io::WeightStore& w, const std::string& p, const GdnDims& g) {
  return ops::RowStack({w.get_matmul(p + "q_proj.weight", {g.key_dim(), g.D}), w.get_matmul(p + "k_proj.weight", {g.key_dim(), g.D}),
                   w.get_matmul(p + "v_proj.weight", {g.value_dim(), g.D}), w.get_matmul(p + "g_proj.weight", {g.value_dim(), g.D}),
                   w.get_matmul(p + "b_proj.weight", {g.HV, g.D}), w.get_matmul(p + "a_proj.weight", {g.HV, g.D})});
}

// RoPE unless rope_theta is null (OlmoHybridModel builds no rotary embedding then): rope_parameters'
// rope_theta where the key is given, else the top-level one, else transformers' default (on).
bool has_rope(const io::Config& cfg) {
  if (cfg.has("rope_parameters") && !cfg.is_null("rope_parameters")) {
    const io::Config rp = cfg.sub("rope_parameters");
    if (rp.has("rope_theta")) return !rp.is_null("rope_theta");
  }
  if (cfg.has("rope_theta")) return !cfg.is_null("rope_theta");
  return true;
}

void olmo_attention(const io::Config& cfg, AttentionMixerDims& ad) {
  ad.rope = has_rope(cfg);
  if (ad.rope) {
    double theta = 0.0, partial = 1.0;
    read_rope(cfg, 1.0, theta, partial);  // the default rope init rotates the whole head: partial is not read
    ad.rot = ad.hd;
    ad.theta = theta;
  }
  ad.gate = false;
  ad.qk_norm = AttentionQkNorm::whole;
  ad.qk_norm_centred = false;
  ad.bias = cfg.get_or<bool>("attention_bias", false);
}

// OlmoHybridConfig.__post_init__'s defaults for the fields a hand-written config may leave out
// (transformers writes them all on save): the GDN sizes from the attention heads and hidden size,
// and layer_types (attention every fourth block, else the last).
io::Config with_defaults(const io::Config& cfg) {
  nlohmann::json j = cfg.json();
  const auto absent = [&](const char* k) { return !j.contains(k) || j[k].is_null(); };
  const int64_t D = cfg.get<int64_t>("hidden_size"), H = cfg.get<int64_t>("num_attention_heads");
  require_positive(cfg, {{"hidden_size", D}, {"num_attention_heads", H}});
  if (absent("linear_num_key_heads")) j["linear_num_key_heads"] = H;
  if (absent("linear_num_value_heads")) j["linear_num_value_heads"] = H;
  if (absent("linear_key_head_dim"))
    j["linear_key_head_dim"] = static_cast<int64_t>(0.75 * static_cast<double>(D) / j["linear_num_key_heads"].get<double>());
  if (absent("linear_value_head_dim")) j["linear_value_head_dim"] = 2 * j["linear_key_head_dim"].get<int64_t>();
  if (absent("layer_types")) {
    const int64_t L = cfg.get<int64_t>("num_hidden_layers");
    require_positive(cfg, {{"num_hidden_layers", L}});
    nlohmann::json types = nlohmann::json::array();
    for (int64_t i = 0; i < L; ++i) types.push_back(i % 4 == 3 ? "full_attention" : "linear_attention");
    if (L < 4) types[static_cast<size_t>(L - 1)] = "full_attention";
    j["layer_types"] = types;
  }
  io::Config out(std::move(j), cfg.path(), "");
  // OlmoHybridConfig.validate_architecture: both kinds of block.
  const auto types = out.get<std::vector<std::string>>("layer_types");
  bool lin = false, full = false;
  for (const auto& t : types) (t == "linear_attention" ? lin : full) = true;
  if (!lin || !full)
    throw ConfigError(where(cfg) + ": layer_types must hold at least one 'linear_attention' and one 'full_attention' "
                                   "block (OLMo-Hybrid is a hybrid)");
  return out;
}

}  // namespace

std::unique_ptr<FamilyModel> make_olmo_hybrid(const io::Config& config, const io::WeightStore& weights) {
  QwenHybridSpec spec{"olmo_hybrid", load_gdn_in_proj};
  spec.centred_norms = false;
  spec.attention_post_norms = true;
  spec.attention = olmo_attention;
  spec.gdn.beta_scale = config.get_or<bool>("linear_allow_neg_eigval", true) ? 2.0f : 1.0f;
  spec.gdn.norm_eps = 1e-5f;  // OlmoHybridRMSNormGated(eps=1e-5), whatever rms_norm_eps says
  spec.gdn.norm_name = "o_norm";
  spec.gdn.out_name = "o_proj";
  // The checkpoints' own names (transformers' conversion_mapping renames them at load): both are read.
  spec.gdn.split_conv = true;
  spec.norm_aliases = {{"input_layernorm", "attention_layer_norm"}, {"post_attention_layernorm", "feedforward_layer_norm"}};
  const io::Config text = with_defaults(config);
  return make_qwen_hybrid(spec, text, text, weights);
}

}  // namespace mixlens::detail
