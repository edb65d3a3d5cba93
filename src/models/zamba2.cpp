// Zamba2 (Zamba2ForCausalLM, model_type "zamba2"): Mamba-2 layers, and "hybrid" layers
// (layers_block_type) where one of num_mem_blocks shared transformer blocks runs first:
// t = linear_i(MLP(RMSNorm(attention(RMSNorm([h, embeddings]))))), then h += Mamba-2(RMSNorm(h + t))
// (the shared block feeds the mixer's input, not the residual). The shared attention reads the
// concatenated input (width 2 * hidden_size, head_dim 2 * hidden_size / heads, softmax scale
// (head_dim / 2)^-0.5, RoPE when use_mem_rope); per depth it adds its own LoRA adapters on q / k / v
// (use_shared_attention_adapter) and on the MLP's gate_up_proj (always: Zamba2MLP has no switch).
// Values of a shared block are addressed at each layer where it runs (layers.i.self_attn.*,
// layers.i.mlp.output): a write there changes that depth only. Reference: transformers 5.18
// models/zamba2/modeling_zamba2.py; the mixer's gated norm is grouped with eps 1e-5 whatever
// rms_norm_eps says, its conv has a bias whatever use_conv_bias says, dt is clamped to
// time_step_min on prompts only. transformers ties the hybrid layers' blocks only when
// tie_word_embeddings is true: untied checkpoints hold (and run) one block per hybrid layer, which the
// skeleton reads from the layer's own prefix when it is there.
#include <cmath>

#include "mixlens/errors.h"
#include "models/common.h"
#include "models/config.h"
#include "models/mamba2_hybrid.h"
#include "models/registry.h"

namespace mixlens::detail {

std::unique_ptr<FamilyModel> make_zamba2(const io::Config& cfg, const io::WeightStore& w) {
  Mamba2HybridSpec s;
  s.family = "zamba2";
  s.pretty = "Zamba2";
  std::vector<std::string> types;
  std::string field;
  if (!read_zamba_layers(cfg, s, types, field))
    throw ConfigError(where(cfg) + ": layers_block_type is missing (Zamba2 needs the list of mamba / hybrid layers)");
  const int64_t n_mem = cfg.get_or<int64_t>("num_mem_blocks", 1);
  require_positive(cfg, {{"num_mem_blocks", n_mem}});
  use_feed_forward_layout(s);
  read_shared_layers(cfg, s, types, field, n_mem, LayerKind::mamba2);
  // Its Mamba layers carry Bamba's names (use_feed_forward_layout above; it has no attention or
  // feed-forward blocks of its own, so those names are never read); the shared blocks' names follow.
  s.shared_in_norm = "mamba_decoder.input_layernorm.weight";
  s.shared_mamba_mod = "mamba_decoder.mamba";

  const std::string act = cfg.get_or<std::string>("hidden_act", "gelu");
  if (act != "gelu")
    throw UnsupportedError(where(cfg) + ": hidden_act '" + act + "' is not supported (Zamba2's shared MLP: gelu)");
  const bool bias = cfg.get_or<bool>("add_bias_linear", false);
  Mamba2Spelling names;
  names.heads = {"n_mamba_heads"};
  names.head_dim = {"mamba_headdim"};
  names.state = {"mamba_d_state"};
  names.groups = {"mamba_ngroups"};
  names.conv = {"mamba_d_conv"};
  names.chunk = {"chunk_size"};
  names.heads_default = 8;
  names.state_default = 64;
  Mamba2MixerDims& d = s.mamba;
  read_mamba2_dims(cfg, s.D, 1e-5f, names, d);  // Zamba2RMSNormGated(eps=1e-5), grouped
  d.norm = Mamba2Norm::gated_grouped;
  d.in_proj_bias = d.out_proj_bias = bias;
  d.conv_bias = true;
  const double dt_min = cfg.get_double_or("time_step_min", 0.001);
  if (!(dt_min >= 0.0) || !std::isfinite(dt_min)) throw ConfigError(where(cfg) + ": time_step_min must be a finite number >= 0");
  d.dt_lo = static_cast<float>(dt_min);  // Zamba2MambaMixer.time_step_limit = (time_step_min, inf)

  // Zamba2Attention: input 2D wide (attention_hidden_size), head_dim 2D / heads.
  read_attention_heads(cfg, 2 * s.D, s.attn);
  s.attn.hd = 2 * s.D / s.attn.H;
  s.attn.in_width = 2 * s.D;
  s.attn.scale = static_cast<float>(std::pow(static_cast<double>(s.attn.hd) / 2.0, -0.5));
  s.attn.rope = cfg.get_or<bool>("use_mem_rope", false);
  if (s.attn.rope) {
    double partial = 1.0;
    read_rope(cfg, 1.0, s.attn.theta, partial);  // Zamba2RotaryEmbedding spans the whole head
    s.attn.rot = s.attn.hd;
  }
  const int64_t rank = cfg.get_or<int64_t>("adapter_rank", 128);
  require_positive(cfg, {{"adapter_rank", rank}});
  if (cfg.get_or<bool>("use_shared_attention_adapter", false)) s.attn.lora_rank = rank;

  s.mlp = HybridMlp::geglu;
  s.I = cfg.has("intermediate_size") && !cfg.is_null("intermediate_size") ? cfg.get<int64_t>("intermediate_size") : 4 * s.D;
  require_positive(cfg, {{"intermediate_size", s.I}});
  s.mlp_bias = bias;
  s.mlp_lora_rank = rank;
  return make_mamba2_hybrid(s, cfg, w);
}

}  // namespace mixlens::detail
