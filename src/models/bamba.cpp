// Bamba (BambaForCausalLM, model_type "bamba"): decoder layers of h += (Mamba-2 | attention)(RMSNorm(h))
// (attention on attn_layer_indices, partial RoPE), then h += SwiGLU MLP(RMSNorm(h)) in every layer.
// Reference: transformers 5.18 models/bamba/modeling_bamba.py. The Mamba-2 gated norm is full-width
// (BambaRMSNormGated ignores mamba_n_groups); dt is clamped to time_step_limit on prompts.
#include <algorithm>
#include <cmath>

#include "mixlens/errors.h"
#include "models/common.h"
#include "models/mamba2_hybrid.h"
#include "models/registry.h"

namespace mixlens::detail {

std::unique_ptr<FamilyModel> make_bamba(const io::Config& cfg, const io::WeightStore& w) {
  Mamba2HybridSpec s;
  s.family = "bamba";
  s.pretty = "Bamba";
  const int64_t L = read_hybrid_sizes(cfg, s, 1e-5);
  const auto attn = cfg.has("attn_layer_indices") && !cfg.is_null("attn_layer_indices")
                        ? cfg.get<std::vector<int64_t>>("attn_layer_indices") : std::vector<int64_t>{};
  for (int64_t i : attn)
    if (i < 0 || i >= L)
      throw ConfigError(where(cfg) + ": attn_layer_indices entry " + std::to_string(i) + " is outside 0.." + std::to_string(L - 1));
  for (int64_t i = 0; i < L; ++i) {
    HybridBlock b;
    b.attn = std::find(attn.begin(), attn.end(), i) != attn.end();
    b.mamba = !b.attn;
    b.ff = true;
    b.kind = b.attn ? LayerKind::attention : LayerKind::mamba2;
    s.blocks.push_back(b);
  }
  use_feed_forward_layout(s);

  require_silu(cfg, s);
  Mamba2MixerDims& d = s.mamba;
  read_mamba2_dims(cfg, s.D, s.eps, false, d);  // BambaConfig has no mamba_d_ssm
  d.norm = Mamba2Norm::gated_full;
  d.in_proj_bias = d.out_proj_bias = cfg.get_or<bool>("mamba_proj_bias", false);
  d.conv_bias = cfg.get_or<bool>("mamba_conv_bias", true);
  read_time_step_limit(cfg, d);

  read_attention_heads(cfg, s.D, s.attn);
  double partial = 0.5;
  read_rope(cfg, 0.5, s.attn.theta, partial);  // BambaConfig hard-codes partial_rotary_factor 0.5
  s.attn.rot = static_cast<int64_t>(static_cast<double>(s.attn.hd) * partial);
  s.attn.bias = cfg.get_or<bool>("attention_bias", false);

  s.mlp = HybridMlp::swiglu;
  s.I = cfg.get<int64_t>("intermediate_size");
  require_positive(cfg, {{"intermediate_size", s.I}});
  s.mlp_bias = cfg.get_or<bool>("mlp_bias", false);
  return make_mamba2_hybrid(s, cfg, w);
}

}  // namespace mixlens::detail
