// Nemotron-H (NemotronHForCausalLM, model_type "nemotron_h"): one residual block per entry of the
// layer pattern (hybrid_override_pattern "M*-E" or layers_block_type / layer_types), each
// h += mixer(RMSNorm(h)) with mixer = Mamba-2 (M), attention without positional encoding (*),
// a relu2 MLP (-) or a MoE of relu2 experts (E). Reference: transformers 5.18 models/nemotron_h/modeling_nemotron_h.py.
// Mamba-2 here: n_groups > 1 with the grouped gated norm (Zamba2RMSNormGated, group = E / n_groups),
// dt clamped to [time_step_min, inf) on prompts (NemotronHMamba2Mixer ignores time_step_limit).
#include <algorithm>
#include <cmath>

#include "mixlens/errors.h"
#include "models/common.h"
#include "models/mamba2_hybrid.h"
#include "models/registry.h"

namespace mixlens::detail {

namespace {

// Pattern characters and list entries (current and legacy names) -> block.
HybridBlock block_for(const std::string& t, const io::Config& cfg, size_t i) {
  HybridBlock b;
  if (t == "M" || t == "linear_attention" || t == "mamba") {
    b.mamba = true;
    b.kind = LayerKind::mamba2;
  } else if (t == "*" || t == "full_attention" || t == "attention") {
    b.attn = true;
    b.kind = LayerKind::attention;
  } else if (t == "-" || t == "mlp") {
    b.branch_mlp = true;
    b.kind = LayerKind::mlp;
  } else if (t == "E" || t == "moe") {
    b.branch_mlp = b.moe = true;
    b.kind = LayerKind::moe;
  } else {
    throw ConfigError(where(cfg) + ": block " + std::to_string(i) + " has type '" + t +
                      "' (expected M / linear_attention, * / full_attention, - / mlp or E / moe)");
  }
  return b;
}

}  // namespace

std::unique_ptr<FamilyModel> make_nemotron_h(const io::Config& cfg, const io::WeightStore& w) {
  Mamba2HybridSpec s;
  s.family = "nemotron_h";
  s.pretty = "Nemotron-H";
  s.D = cfg.get<int64_t>("hidden_size");
  s.V = cfg.get<int64_t>("vocab_size");
  require_positive(cfg, {{"hidden_size", s.D}, {"vocab_size", s.V}});
  s.eps = static_cast<float>(cfg.get_double_or("layer_norm_epsilon", 1e-5));
  if (!(s.eps > 0.0f) || !std::isfinite(s.eps)) throw ConfigError(where(cfg) + ": layer_norm_epsilon must be a finite number > 0");
  // NemotronHForCausalLM ties nothing (_tied_weights_keys = {}): lm_head.weight is always its own,
  // whatever tie_word_embeddings says.
  s.tie = false;

  std::vector<std::string> types;
  std::string field;
  for (const char* f : {"layer_types", "layers_block_type"})
    if (types.empty() && cfg.has(f) && !cfg.is_null(f)) {
      types = cfg.get<std::vector<std::string>>(f);
      field = f;
    }
  if (types.empty() && cfg.has("hybrid_override_pattern") && !cfg.is_null("hybrid_override_pattern")) {
    field = "hybrid_override_pattern";
    for (char c : cfg.get<std::string>(field)) types.emplace_back(1, c);
  }
  if (types.empty())
    throw ConfigError(where(cfg) + ": Nemotron-H needs the block pattern: hybrid_override_pattern, layers_block_type or layer_types");
  // transformers only warns and uses the pattern's length; a mismatch is almost always a wrong
  // file, so mixlens refuses it.
  if (cfg.has("num_hidden_layers") && !cfg.is_null("num_hidden_layers") &&
      cfg.get<int64_t>("num_hidden_layers") != static_cast<int64_t>(types.size()))
    throw ConfigError(where(cfg) + ": " + field + " has " + std::to_string(types.size()) +
                      " blocks but num_hidden_layers is " + std::to_string(cfg.get<int64_t>("num_hidden_layers")));
  for (size_t i = 0; i < types.size(); ++i) s.blocks.push_back(block_for(types[i], cfg, i));

  s.prefixes = {"model.", "backbone."};  // transformers 5.18 save_pretrained / published checkpoints
  s.embed = "embeddings.weight";
  s.final_norm = "norm_f.weight";
  s.in_norm = "norm.weight";
  s.mamba_mod = s.attn_mod = s.mlp_mod = "mixer";

  // NemotronHConfig's names and defaults (the mamba_* names are its older spellings); the width is
  // mamba_num_heads * mamba_head_dim, not an expand factor.
  Mamba2Spelling f;
  f.heads = {"mamba_num_heads"};
  f.head_dim = {"mamba_head_dim"};
  f.state = {"ssm_state_size"};
  f.groups = {"n_groups", "mamba_n_groups"};
  f.conv = {"conv_kernel", "mamba_d_conv"};
  f.chunk = {"chunk_size", "mamba_chunk_size"};
  f.heads_default = 128;
  f.head_dim_default = 64;
  f.state_default = 128;
  f.groups_default = 8;
  f.conv_default = 4;
  f.chunk_default = 128;
  f.width_from_heads = true;
  Mamba2MixerDims& d = s.mamba;
  read_mamba2_dims(cfg, s.D, s.eps, f, d);
  d.norm = Mamba2Norm::gated_grouped;
  d.in_proj_bias = d.out_proj_bias = cfg.get_or<bool>("use_bias", false);
  d.conv_bias = cfg.get_or<bool>("use_conv_bias", cfg.get_or<bool>("mamba_conv_bias", true));
  // NemotronHMamba2Mixer: time_step_limit = (time_step_min, inf), whatever time_step_limit says.
  d.dt_lo = static_cast<float>(cfg.get_double_or("time_step_min", cfg.get_double_or("mamba_dt_min", 0.001)));
  const std::string mact = cfg.get_or<std::string>("mamba_hidden_act", "silu");
  if (mact != "silu" && mact != "swish")
    throw UnsupportedError(where(cfg) + ": mamba_hidden_act '" + mact + "' is not supported (Nemotron-H uses silu)");

  s.attn.H = cfg.get_or<int64_t>("num_attention_heads", 32);
  s.attn.Hkv = cfg.get_or<int64_t>("num_key_value_heads", s.attn.H);
  s.attn.hd = cfg.get_or<int64_t>("head_dim", 128);  // NemotronHConfig's default, not hidden/heads
  require_positive(cfg, {{"num_attention_heads", s.attn.H}, {"num_key_value_heads", s.attn.Hkv}, {"head_dim", s.attn.hd}});
  s.attn.rope = false;  // NemotronHAttention has no positional encoding

  s.mlp = HybridMlp::relu2;
  s.I = cfg.get_or<int64_t>("intermediate_size", 21504);
  require_positive(cfg, {{"intermediate_size", s.I}});
  s.mlp_bias = cfg.get_or<bool>("mlp_bias", false);
  if (std::any_of(s.blocks.begin(), s.blocks.end(), [](const HybridBlock& b) { return b.moe; })) {
    s.n_experts = cfg.get_or<int64_t>("n_routed_experts", 8);
    s.topk = cfg.get_or<int64_t>("num_experts_per_tok", 2);
    s.n_group = cfg.get_or<int64_t>("n_group", 1);
    s.topk_group = cfg.get_or<int64_t>("topk_group", 1);
    s.moe_I = cfg.get_or<int64_t>("moe_intermediate_size", 7688);
    s.shared_I = cfg.get_or<int64_t>("moe_shared_expert_intermediate_size", 7688);
    s.latent = cfg.has("moe_latent_size") && !cfg.is_null("moe_latent_size") ? cfg.get<int64_t>("moe_latent_size") : 0;
    require_positive(cfg, {{"n_routed_experts", s.n_experts}, {"num_experts_per_tok", s.topk}, {"n_group", s.n_group},
                           {"topk_group", s.topk_group}, {"moe_intermediate_size", s.moe_I},
                           {"moe_shared_expert_intermediate_size", s.shared_I}});
    if (s.latent < 0) throw ConfigError(where(cfg) + ": moe_latent_size must be positive or null");
    if (s.n_experts % s.n_group != 0 || s.topk_group > s.n_group || s.topk > s.n_experts)
      throw ConfigError(where(cfg) + ": MoE routing sizes are inconsistent (n_routed_experts " + std::to_string(s.n_experts) +
                        ", n_group " + std::to_string(s.n_group) + ", topk_group " + std::to_string(s.topk_group) +
                        ", num_experts_per_tok " + std::to_string(s.topk) + ")");
    if (cfg.get_or<int64_t>("n_shared_experts", 1) != 1)
      throw UnsupportedError(where(cfg) + ": n_shared_experts other than 1 is not supported (NemotronHMoE builds one shared expert)");
    s.norm_topk = cfg.get_or<bool>("norm_topk_prob", true);
    s.routed_scaling = static_cast<float>(cfg.get_double_or("routed_scaling_factor", 1.0));
  }
  const std::string act = cfg.get_or<std::string>("mlp_hidden_act", "relu2");
  if (act != "relu2") throw UnsupportedError(where(cfg) + ": mlp_hidden_act '" + act + "' is not supported (Nemotron-H uses relu2)");
  return make_mamba2_hybrid(s, cfg, w);
}

}  // namespace mixlens::detail
