// Falcon-H1 (FalconH1ForCausalLM, model_type "falcon_h1"): every decoder layer runs the Mamba-2
// mixer and RoPE attention side by side on the same normed input and adds
// mamba(x) * ssm_out_multiplier + attention(x * attention_in_multiplier) * attention_out_multiplier
// to the residual, then h += SwiGLU MLP(RMSNorm(h)). µP multipliers exactly where transformers
// applies them: embeddings * embedding_multiplier, logits * lm_head_multiplier, keys * key_multiplier,
// mixer input * ssm_in_multiplier, the z|x|B|C|dt projection sections * ssm_multipliers,
// MLP gate * mlp_multipliers[0], MLP output * mlp_multipliers[1].
// The mixer's gated norm is optional (mamba_rms_norm) and grouped (mamba_n_groups), with
// mamba_norm_before_gate choosing the order. Reference: transformers 5.18
// models/falcon_h1/modeling_falcon_h1.py.
#include <algorithm>
#include <cmath>

#include "mixlens/errors.h"
#include "models/common.h"
#include "models/mamba2_hybrid.h"
#include "models/registry.h"

namespace mixlens::detail {

namespace {
std::vector<double> multipliers(const io::Config& cfg, const char* name, size_t n) {
  if (!cfg.has(name) || cfg.is_null(name)) return std::vector<double>(n, 1.0);
  auto v = cfg.get<std::vector<double>>(name);
  if (v.size() != n)
    throw ConfigError(where(cfg) + ": " + name + " must have " + std::to_string(n) + " entries (got " + std::to_string(v.size()) + ")");
  for (double x : v)
    if (!std::isfinite(x)) throw ConfigError(where(cfg) + ": " + name + " entries must be finite");
  return v;
}

float scalar(const io::Config& cfg, const char* name) {
  const double v = cfg.has(name) && !cfg.is_null(name) ? cfg.get_double(name) : 1.0;
  if (!std::isfinite(v)) throw ConfigError(where(cfg) + ": " + name + " must be finite");
  return static_cast<float>(v);
}
}  // namespace

std::unique_ptr<FamilyModel> make_falcon_h1(const io::Config& cfg, const io::WeightStore& w) {
  Mamba2HybridSpec s;
  s.family = "falcon_h1";
  s.pretty = "Falcon-H1";
  const int64_t L = read_hybrid_sizes(cfg, s, 1e-5);
  for (int64_t i = 0; i < L; ++i) {
    HybridBlock b;
    b.mamba = b.attn = b.ff = true;
    b.kind = LayerKind::hybrid;
    s.blocks.push_back(b);
  }
  use_feed_forward_layout(s);

  require_silu(cfg, s);
  Mamba2MixerDims& d = s.mamba;
  read_mamba2_dims(cfg, s.D, s.eps, true, d);
  if (!cfg.get_or<bool>("mamba_rms_norm", false)) d.norm = Mamba2Norm::none;
  else d.norm = cfg.get_or<bool>("mamba_norm_before_gate", true) ? Mamba2Norm::grouped_then_gate : Mamba2Norm::gated_grouped;
  d.in_proj_bias = cfg.get_or<bool>("mamba_proj_bias", false);
  d.out_proj_bias = cfg.get_or<bool>("projectors_bias", false);
  d.conv_bias = cfg.get_or<bool>("mamba_conv_bias", true);
  read_time_step_limit(cfg, d);
  d.in_multiplier = scalar(cfg, "ssm_in_multiplier");
  d.out_multiplier = scalar(cfg, "ssm_out_multiplier");
  const auto sm = multipliers(cfg, "ssm_multipliers", 5);
  for (size_t k = 0; k < 5; ++k) d.proj_multipliers[k] = static_cast<float>(sm[k]);

  read_attention_heads(cfg, s.D, s.attn);
  double partial = 1.0;
  read_rope(cfg, 1.0, s.attn.theta, partial);
  s.attn.rot = s.attn.hd;  // FalconH1RotaryEmbedding ignores partial_rotary_factor
  s.attn.bias = cfg.get_or<bool>("attention_bias", false);
  s.attn.key_multiplier = scalar(cfg, "key_multiplier");
  s.attn.in_multiplier = scalar(cfg, "attention_in_multiplier");
  s.attn.out_multiplier = scalar(cfg, "attention_out_multiplier");
  s.embedding_multiplier = scalar(cfg, "embedding_multiplier");
  s.lm_head_multiplier = scalar(cfg, "lm_head_multiplier");

  s.mlp = HybridMlp::swiglu;
  s.I = cfg.get<int64_t>("intermediate_size");
  require_positive(cfg, {{"intermediate_size", s.I}});
  s.mlp_bias = cfg.get_or<bool>("mlp_bias", false);
  const auto mm = multipliers(cfg, "mlp_multipliers", 2);
  s.mlp_gate_multiplier = static_cast<float>(mm[0]);
  s.mlp_down_multiplier = static_cast<float>(mm[1]);
  return make_mamba2_hybrid(s, cfg, w);
}

}  // namespace mixlens::detail
