// Jamba (JambaForCausalLM, model_type "jamba"): decoder layers of h += (Mamba-1 | attention)(RMSNorm(h))
// then h += feed_forward(RMSNorm(h)) (pre_ff_layernorm). Layer i is attention when
// i % attn_layer_period == attn_layer_offset (else Mamba), and its feed_forward is the routed experts
// (JambaSparseMoeBlock: top-k of the softmax over all router logits, not renormalised, SwiGLU
// experts) when i % expert_layer_period == expert_layer_offset and num_experts > 1, else the SwiGLU
// MLP. The Mamba mixer is Mamba-1 with RMS norms (weights dt_layernorm / b_layernorm / c_layernorm,
// eps rms_norm_eps) on x_proj's dt_low, B and C; attention has no positional encoding.
// Reference: transformers 5.18 models/jamba/modeling_jamba.py, configuration_jamba.py.
// Runs on the Mamba hybrid skeleton (models/mamba2_hybrid.*) with HybridMixer::mamba1.
#include "mixlens/errors.h"
#include "models/common.h"
#include "models/config.h"
#include "models/mamba2_hybrid.h"
#include "models/registry.h"

namespace mixlens::detail {

namespace {

// A layer pattern (period, offset) as JambaConfig.validate_architecture checks it.
std::pair<int64_t, int64_t> read_period(const io::Config& cfg, const char* period_field, int64_t period_default,
                                        const char* offset_field, int64_t offset_default) {
  const int64_t p = cfg.get_or<int64_t>(period_field, period_default);
  const int64_t o = cfg.get_or<int64_t>(offset_field, offset_default);
  require_positive(cfg, {{period_field, p}});
  if (o < 0 || o >= p)
    throw ConfigError(where(cfg) + ": " + offset_field + " (" + std::to_string(o) + ") must be in [0, " + period_field +
                      " = " + std::to_string(p) + ")");
  return {p, o};
}

}  // namespace

std::unique_ptr<FamilyModel> make_jamba(const io::Config& cfg, const io::WeightStore& w) {
  Mamba2HybridSpec s;
  s.family = "jamba";
  s.pretty = "Jamba";
  const int64_t L = read_hybrid_sizes(cfg, s, 1e-6);

  const auto [attn_p, attn_o] = read_period(cfg, "attn_layer_period", 8, "attn_layer_offset", 4);
  const auto [exp_p, exp_o] = read_period(cfg, "expert_layer_period", 2, "expert_layer_offset", 1);
  // num_local_experts is JambaConfig's attribute_map alias of num_experts.
  const int64_t E = cfg.get_or<int64_t>("num_experts", cfg.get_or<int64_t>("num_local_experts", 16));
  require_positive(cfg, {{"num_experts", E}});
  for (int64_t i = 0; i < L; ++i) {
    HybridBlock b;
    b.attn = i % attn_p == attn_o;
    b.mamba = !b.attn;
    b.kind = b.attn ? LayerKind::attention : LayerKind::mamba;
    b.ff = true;
    b.moe = E > 1 && i % exp_p == exp_o;  // layers_num_experts: one "expert" is the plain MLP
    s.blocks.push_back(b);
  }
  use_feed_forward_layout(s);
  s.moe_mod = "feed_forward";

  // hidden_act is the mixer's conv activation and the MLP's / experts' gate activation.
  require_silu(cfg, s);

  // JambaMambaMixer: intermediate = mamba_expand * hidden_size, dt rank "auto" = ceil(hidden / 16).
  read_hybrid_mamba1(cfg, s);
  MambaMixerDims& d = s.mamba1;
  d.bcdt_rms_norm = true;
  d.bcdt_norm_weights = true;
  d.mixer_rms_eps = s.eps;  // the inner norms are JambaRMSNorm(eps = rms_norm_eps)

  read_attention_heads(cfg, s.D, s.attn);
  s.attn.rope = false;  // JambaAttention: no positional encoding, scale head_dim^-0.5, no biases

  s.mlp = HybridMlp::swiglu;
  s.I = cfg.get_or<int64_t>("intermediate_size", 14336);
  require_positive(cfg, {{"intermediate_size", s.I}});
  s.moe_kind = HybridMoeKind::jamba;
  s.n_experts = E;
  s.moe_I = s.I;
  s.topk = cfg.get_or<int64_t>("num_experts_per_tok", 2);
  require_positive(cfg, {{"num_experts_per_tok", s.topk}});
  if (E > 1 && s.topk > E)
    throw ConfigError(where(cfg) + ": num_experts_per_tok (" + std::to_string(s.topk) + ") exceeds num_experts (" +
                      std::to_string(E) + ")");
  return make_mamba2_hybrid(s, cfg, w);
}

}  // namespace mixlens::detail
