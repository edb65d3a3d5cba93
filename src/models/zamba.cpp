// Zamba (ZambaForCausalLM, model_type "zamba"): Mamba layers, and "hybrid" layers (layers_block_type)
// where ONE shared transformer block runs first: t = linear_i(MLP(RMSNorm(attention(RMSNorm([h,
// embeddings]))))), then h += Mamba(RMSNorm(h + t)) (the block feeds the mixer's input, not the
// residual), as Zamba2 with a single block, no LoRA adapters, no RoPE, and a ZambaMLP of separate
// gate_proj / up_proj (gelu(gate) * up). The attention reads the concatenated input (width
// attention_hidden_size = 2 * hidden_size, head_dim attention_head_dim, softmax scale
// (head_dim / 2)^-0.5). The mixer is Mamba-1 per Mamba head (ZambaMambaMixer: n_mamba_heads heads of
// intermediate / heads channels, each with its own x_proj / dt_proj; in_proj's x and z interleaved).
// Values of the shared block are addressed at each layer where it runs (layers.i.self_attn.*,
// layers.i.mlp.output): a write there changes that depth only. Reference: transformers 5.18
// models/zamba/modeling_zamba.py, configuration_zamba.py. Runs on the Mamba hybrid skeleton
// (models/mamba2_hybrid.*) with HybridMixer::mamba1 and Zamba2's shared-block options.
#include <cmath>

#include "mixlens/errors.h"
#include "models/common.h"
#include "models/config.h"
#include "models/mamba2_hybrid.h"
#include "models/registry.h"

namespace mixlens::detail {

std::unique_ptr<FamilyModel> make_zamba(const io::Config& cfg, const io::WeightStore& w) {
  Mamba2HybridSpec s;
  s.family = "zamba";
  s.pretty = "Zamba";
  std::vector<std::string> types;
  std::string field;
  // Absent, ZambaConfig.__post_init__ builds [mamba, mamba, hybrid] + hybrid where
  // i % attn_layer_period == attn_layer_offset.
  if (!read_zamba_layers(cfg, s, types, field)) {
    const int64_t L = cfg.get<int64_t>("num_hidden_layers");
    const int64_t period = cfg.get_or<int64_t>("attn_layer_period", 6);
    const int64_t offset = cfg.get_or<int64_t>("attn_layer_offset", 4);
    require_positive(cfg, {{"attn_layer_period", period}});
    if (L < 3)  // transformers would build 3 layers whatever num_hidden_layers says
      throw ConfigError(where(cfg) + ": num_hidden_layers (" + std::to_string(L) +
                        ") must be at least 3 when layers_block_type is not given");
    types = {"linear_attention", "linear_attention", "hybrid"};
    for (int64_t i = 0; i < L - 3; ++i) types.push_back(i % period == offset ? "hybrid" : "linear_attention");
  }
  use_feed_forward_layout(s);
  s.shared_mod = "shared_transf.";
  s.shared_mlp_split = true;
  read_shared_layers(cfg, s, types, field, 1, LayerKind::mamba);
  s.shared_in_norm = "mamba_decoder.input_layernorm.weight";
  s.shared_mamba_mod = "mamba_decoder.mamba";

  const std::string act = cfg.get_or<std::string>("hidden_act", "gelu");
  if (act != "gelu")
    throw UnsupportedError(where(cfg) + ": hidden_act '" + act + "' is not supported (Zamba's shared MLP: gelu)");
  const std::string mact = cfg.get_or<std::string>("hidden_mamba_act", "silu");
  if (mact != "silu" && mact != "swish")
    throw UnsupportedError(where(cfg) + ": hidden_mamba_act '" + mact + "' is not supported (Zamba's mixer: silu)");

  read_hybrid_mamba1(cfg, s);
  MambaMixerDims& d = s.mamba1;
  d.per_head = true;
  d.heads = cfg.get_or<int64_t>("n_mamba_heads", 2);
  require_positive(cfg, {{"n_mamba_heads", d.heads}});
  if (d.E % d.heads != 0)  // ZambaConfig.validate_architecture
    throw ConfigError(where(cfg) + ": mamba_expand * hidden_size (" + std::to_string(d.E) +
                      ") must be divisible by n_mamba_heads (" + std::to_string(d.heads) + ")");

  // ZambaAttention: input [h, embeddings] (attention_hidden_size, which must be 2 * hidden_size),
  // head_dim attention_head_dim (head_dim is its alias; absent: 2 * hidden_size / heads).
  read_attention_heads(cfg, 2 * s.D, s.attn);
  for (const char* f : {"attention_head_dim", "head_dim"})
    if (cfg.has(f) && !cfg.is_null(f)) {
      s.attn.hd = cfg.get<int64_t>(f);
      require_positive(cfg, {{f, s.attn.hd}});
      break;
    }
  if (cfg.has("attention_hidden_size") && !cfg.is_null("attention_hidden_size") &&
      cfg.get<int64_t>("attention_hidden_size") != 2 * s.D)
    throw ConfigError(where(cfg) + ": attention_hidden_size (" + std::to_string(cfg.get<int64_t>("attention_hidden_size")) +
                      ") must be 2 * hidden_size (" + std::to_string(2 * s.D) + "): the shared block reads [h, embeddings]");
  s.attn.in_width = 2 * s.D;
  s.attn.scale = static_cast<float>(std::pow(static_cast<double>(s.attn.hd) / 2.0, -0.5));
  s.attn.rope = false;

  s.mlp = HybridMlp::geglu;
  s.I = cfg.get_or<int64_t>("intermediate_size", 14848);
  require_positive(cfg, {{"intermediate_size", s.I}});
  return make_mamba2_hybrid(s, cfg, w);
}

}  // namespace mixlens::detail
