// Granite 4.0-H (GraniteMoeHybridForCausalLM, model_type "granitemoehybrid"): decoder layers of
// h += residual_multiplier * (Mamba-2 | attention)(RMSNorm(h)) (layer_types / layers_block_type),
// then h += residual_multiplier * (MoE(x) + shared MLP(x)), x = RMSNorm(h); num_local_experts 0
// leaves the shared MLP alone. µP: embeddings (ids and inputs_embeds) * embedding_multiplier, the
// attention softmax scale is attention_multiplier (not 1/sqrt(head_dim)), logits / logits_scaling.
// RoPE over the full head only when position_embedding_type is "rope" (published: "nope").
// Reference: transformers 5.18 models/granitemoehybrid/modeling_granitemoehybrid.py. The Mamba-2
// gated norm is full-width (GraniteMoeHybridRMSNormGated ignores mamba_n_groups); dt is clamped to
// time_step_limit on prompts.
#include <cmath>

#include "mixlens/errors.h"
#include "models/common.h"
#include "models/config.h"
#include "models/mamba2_hybrid.h"
#include "models/registry.h"

namespace mixlens::detail {

namespace {

// A finite, positive µP multiplier (default 1).
float multiplier(const io::Config& cfg, const char* field) {
  const double v = cfg.get_double_or(field, 1.0);
  if (!(v > 0.0) || !std::isfinite(v)) throw ConfigError(where(cfg) + ": " + field + " must be a finite number > 0");
  return static_cast<float>(v);
}

}  // namespace

std::unique_ptr<FamilyModel> make_granitemoehybrid(const io::Config& cfg, const io::WeightStore& w) {
  Mamba2HybridSpec s;
  s.family = "granitemoehybrid";
  s.pretty = "Granite 4.0-H";
  const int64_t L = read_hybrid_sizes(cfg, s, 1e-6);

  // layer_types (layers_block_type is its attribute_map alias); transformers 5.18 reads the legacy
  // "mamba" / "attention" as "linear_attention" / "full_attention". Absent: every layer is Mamba-2.
  std::vector<std::string> types;
  std::string field;
  if (!read_layer_types(cfg, {"layer_types", "layers_block_type"}, L, types, field))
    types.assign(static_cast<size_t>(L), "linear_attention");
  const int64_t E = cfg.get_or<int64_t>("num_local_experts", 8);
  if (E < 0) throw ConfigError(where(cfg) + ": num_local_experts must be >= 0");
  for (size_t i = 0; i < types.size(); ++i) {
    const std::string& t = types[i];
    HybridBlock b;
    if (t == "linear_attention" || t == "mamba") {
      b.mamba = true;
      b.kind = LayerKind::mamba2;
    } else if (t == "full_attention" || t == "attention") {
      b.attn = true;
      b.kind = LayerKind::attention;
    } else {
      throw ConfigError(where(cfg) + ": " + field + "[" + std::to_string(i) + "] is '" + t +
                        "' (expected linear_attention / mamba or full_attention / attention)");
    }
    b.ff = true;
    b.moe = E > 0;  // GraniteMoeHybridDecoderLayer.has_experts
    s.blocks.push_back(b);
  }
  s.prefixes = {"model."};
  s.embed = "embed_tokens.weight";
  s.final_norm = "norm.weight";
  s.in_norm = "input_layernorm.weight";
  s.ff_norm = "post_attention_layernorm.weight";
  s.mamba_mod = "mamba";
  s.attn_mod = "self_attn";
  s.mlp_mod = "shared_mlp";
  s.moe_mod = "block_sparse_moe";
  s.mlp_fused = true;

  // hidden_act is the mixer's conv activation, the shared MLP's and the experts' gate activation.
  require_silu(cfg, s);
  Mamba2MixerDims& d = s.mamba;
  read_mamba2_dims(cfg, s.D, s.eps, false, d);  // GraniteMoeHybridConfig has no mamba_d_ssm
  d.norm = Mamba2Norm::gated_full;
  d.in_proj_bias = d.out_proj_bias = cfg.get_or<bool>("mamba_proj_bias", false);
  d.conv_bias = cfg.get_or<bool>("mamba_conv_bias", true);
  read_time_step_limit(cfg, d);

  read_attention_heads(cfg, s.D, s.attn);
  s.attn.bias = cfg.get_or<bool>("attention_bias", false);
  // GraniteMoeHybridModel builds its rotary embedding only for "rope"; null (the class default) and
  // the published "nope" mean no positional encoding.
  const std::string pe = cfg.has("position_embedding_type") && !cfg.is_null("position_embedding_type")
                             ? cfg.get<std::string>("position_embedding_type") : "nope";
  if (pe != "rope" && pe != "nope")
    throw UnsupportedError(where(cfg) + ": position_embedding_type '" + pe + "' is not supported (rope, nope or null)");
  s.attn.rope = pe == "rope";
  if (s.attn.rope) {
    double partial = 1.0;
    read_rope(cfg, 1.0, s.attn.theta, partial);  // the rotary embedding spans the whole head whatever the factor says
    s.attn.rot = s.attn.hd;
  }
  s.attn.scale = multiplier(cfg, "attention_multiplier");

  s.mlp = HybridMlp::swiglu;
  s.I = cfg.get_or<int64_t>("shared_intermediate_size", 1024);
  require_positive(cfg, {{"shared_intermediate_size", s.I}});
  if (E > 0) {
    s.moe_kind = HybridMoeKind::granite;
    s.n_experts = E;
    s.topk = cfg.get_or<int64_t>("num_experts_per_tok", 2);
    s.moe_I = cfg.get_or<int64_t>("intermediate_size", 11008);
    require_positive(cfg, {{"num_experts_per_tok", s.topk}, {"intermediate_size", s.moe_I}});
    if (s.topk > E)
      throw ConfigError(where(cfg) + ": num_experts_per_tok (" + std::to_string(s.topk) + ") exceeds num_local_experts (" +
                        std::to_string(E) + ")");
  }

  s.embedding_multiplier = multiplier(cfg, "embedding_multiplier");
  s.embedding_multiplier_on_embeds = true;
  s.residual_multiplier = multiplier(cfg, "residual_multiplier");
  // logits / logits_scaling, served as lm_head(h) * (1 / logits_scaling) (one rounding apart).
  s.lm_head_multiplier = 1.0f / multiplier(cfg, "logits_scaling");
  return make_mamba2_hybrid(s, cfg, w);
}

}  // namespace mixlens::detail
