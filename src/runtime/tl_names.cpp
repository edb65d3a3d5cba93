#include "runtime/tl_names.h"

#include <algorithm>
#include <cctype>

#include "mixlens/errors.h"
#include "models/family.h"
#include "models/rwkv.h"

namespace mixlens::detail {
namespace {

// A TL name's meaning on one block: the mixlens path after "layers.{i}." (or a global path), or,
// when it has none, why not (`why`, with what to read instead).
struct Mapped {
  std::string target;
  std::string why;
};
Mapped to(std::string t) { return {std::move(t), {}}; }
Mapped no(std::string why) { return {{}, std::move(why)}; }

bool starts(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }

// TL 4.3's component names per family (its supported_architectures adapters): the recurrent mixer's
// slot, the softmax attention's slot and the MLP's slot; "" where the family has none.
struct Slots {
  std::string_view mixer, attn, mlp;
};
Slots slots_of(const std::string& family) {
  if (family == "qwen3_5" || family == "qwen3_5_moe" || family == "qwen3_next") return {"linear_attn", "attn", "mlp"};
  // OLMo-Hybrid: the same kinds of block as the Qwen hybrids, named as theirs.
  if (family == "olmo_hybrid") return {"linear_attn", "attn", "mlp"};
  // granitemoehybrid: TL's MLP branch is shared_mlp (+ moe), and neither is mixlens's mlp.output.
  if (family == "granitemoehybrid") return {"mixer", "attn", ""};
  if (family == "falcon_h1") return {"mamba", "attn", "mlp"};
  if (family == "bamba") return {"mixer", "attn", "mlp"};
  if (family == "nemotron_h") return {"mixer", "mixer", "mixer"};  // one mixer slot per block, any kind
  // Jamba: TL's JambaArchitectureAdapter, a BlockBridge with the Mamba-1 `mixer`, `attn` and `mlp` (dense or MoE).
  if (family == "jamba") return {"mixer", "attn", "mlp"};
  // LFM2 / LFM2-MoE: TL's Lfm2(Moe)ArchitectureAdapter, a BlockBridge with the short conv `conv`, `attn`, `mlp`.
  if (family == "lfm2" || family == "lfm2_moe") return {"conv", "attn", "mlp"};
  // Zamba2: TL's SSMBlockBridge, `mixer` on the Mamba layers only (block_name below).
  return {"mixer", "", ""};                                         // mamba, mamba2
}

bool recurrent(LayerKind k) {
  return k == LayerKind::mamba2 || k == LayerKind::mamba || k == LayerKind::gated_deltanet || k == LayerKind::hybrid ||
         k == LayerKind::rg_lru || k == LayerKind::short_conv;
}
bool has_attention(LayerKind k) { return k == LayerKind::attention || k == LayerKind::hybrid; }
bool is_falcon(const FamilyModel& m) { return m.info.family == "falcon_h1"; }
bool is_granite(const FamilyModel& m) { return m.info.family == "granitemoehybrid"; }
bool is_zamba2(const FamilyModel& m) { return m.info.family == "zamba2"; }

// Granite 4.0-H scales every branch by residual_multiplier (and the embeddings, logits) outside the
// modules TL hooks; mixlens's values are what the block adds, so those hooks are not aliases.
Mapped granite_scaled(const std::string& what, const std::string& read) {
  return no(what + "; Granite 4.0-H applies residual_multiplier (embedding_multiplier, logits_scaling) outside "
            "the module TransformerLens hooks, while mixlens serves what the block adds (multiplier included, "
            "docs/values.md): read " + read);
}

const std::string kFalconScaled =
    "Falcon-H1 applies its multiplier outside the module TransformerLens hooks, while mixlens serves what the "
    "block adds (multiplier included, docs/values.md)";

// The recurrent mixer's hooks (TL's SSMMixerBridge, SSM2MixerBridge, GatedDeltaNetBridge).
Mapped recurrent_hook(const FamilyModel& m, LayerKind kind, std::string_view h) {
  if (h == "hook_in" || h == "hook_linear_attn_in")
    return no("the mixer's input (the normed residual stream) is not a mixlens value; read layer_input");
  if (kind == LayerKind::short_conv) {  // TL's Lfm2ShortConvBridge: hook_in / hook_out and three submodule aliases
    if (h == "hook_out") return to("linear_attn.attention_output");
    if (h == "hook_gated") return to("linear_attn.attention_head_outputs");  // out_proj's input: C * conv(B * x)
    if (h == "hook_in_proj")
      return no("in_proj's output is B | C | x in one tensor; mixlens serves the three chunks as "
                "linear_attn.attention_keys, attention_queries, attention_values");
    if (h == "hook_conv")
      return no("the conv output conv(B * x), before C and the cut to the sequence, is not a mixlens value; "
                "linear_attn.attention_head_outputs is C * conv(B * x)");
    if (starts(h, "hook_ssm_"))
      return no("TransformerLens 4.3's LFM2 short conv has no " + std::string(h) + " (its hooks: hook_in, "
                "hook_in_proj, hook_conv, hook_gated, hook_out); mixlens serves the conv window as linear_attn.states, "
                "B as attention_keys, C as attention_queries, the output as attention_output");
    return no("TransformerLens's LFM2 short conv has no hook '" + std::string(h) + "'");
  }
  if (h == "hook_out" || h == "hook_ssm_out" || (kind == LayerKind::gated_deltanet && h == "hook_linear_attn_out")) {
    if (is_falcon(m)) return no("its hook_out is the mixer's output before ssm_out_multiplier; " + kFalconScaled +
                                ": read linear_attn.attention_output (= hook_out * ssm_out_multiplier)");
    if (is_granite(m)) return granite_scaled("its hook_out is the mixer's output before residual_multiplier",
                                             "linear_attn.attention_output (= hook_out * residual_multiplier)");
    return to("linear_attn.attention_output");
  }
  if (kind == LayerKind::gated_deltanet) {
    const int64_t r = m.key_head_repeat();
    const auto qk = [&](const std::string& name, const std::string& value) {
      if (r == 1) return to("linear_attn." + value);
      return no("TransformerLens's " + name + " has one head per key head, before the repetition to " +
                "the value heads (" + std::to_string(r) + " each here); mixlens serves it after: linear_attn." + value +
                "[:, :, ::" + std::to_string(r) + "] equals " + name);
    };
    if (h == "hook_q" || h == "hook_ssm_C") return qk(std::string(h), "attention_queries");
    if (h == "hook_k" || h == "hook_ssm_B") return qk(std::string(h), "attention_keys");
    if (h == "hook_v") return to("linear_attn.attention_values");
    if (h == "hook_beta" || h == "hook_ssm_write") return to("linear_attn.betas");  // TL 4.3 aliases ssm_write to beta
    if (h == "hook_log_decay" || h == "hook_ssm_decay") return to("linear_attn.decays");
    if (h == "hook_recurrence_out") return to("linear_attn.attention_head_outputs");
    if (h == "hook_ssm_state") return to("linear_attn.states");
    if (h == "hook_beta_logit")
      return no("b before the sigmoid is not a mixlens value; linear_attn.betas is sigmoid(b) (OLMo-Hybrid with "
                "linear_allow_neg_eigval: 2 * sigmoid(b))");
    if (h == "hook_q_pre_conv" || h == "hook_k_pre_conv" || h == "hook_v_pre_conv")
      return no("the projections before the causal conv are not mixlens values; linear_attn.attention_queries / "
                "attention_keys / attention_values are after the conv and SiLU");
    if (h == "hook_gate_input") return no("the output gate z is not a mixlens value");
    if (h == "hook_ssm_dt") return no("TransformerLens has no hook_ssm_dt on a gated DeltaNet; the decay is linear_attn.decays");
    return no("TransformerLens's gated DeltaNet has no hook '" + std::string(h) + "'");
  }
  if (kind == LayerKind::mamba) {  // Mamba-1: TL's SSMMixerBridge, per-channel layouts [batch, channels, seq, ...]
    if (h == "hook_ssm_dt")
      return no("it is dt_proj's output before the softplus; mixlens serves dt after it: linear_attn.betas = "
                "softplus(hook_ssm_dt)");
    if (h == "hook_ssm_state")
      return no("its layout is [batch, channels, seq, state] and it fires only on TL's eager scan; the same numbers "
                "are linear_attn.states [B,T,d_inner,state] (hook_ssm_state = states.permute(0, 2, 1, 3)), read-only");
    if (h == "hook_ssm_write")
      return no("dt*x*B is not a mixlens value; it is linear_attn.betas * attention_values (per channel) times "
                "attention_keys (per state)");
    if (h == "hook_ssm_B" || h == "hook_ssm_C" || h == "hook_ssm_decay")
      return no("TransformerLens 4.3 has no " + std::string(h) + " on Mamba-1 (B and C are x_proj's output); mixlens "
                "serves B, C and A*dt as linear_attn.attention_keys, attention_queries, decays");
    if (h == "hook_in_proj" || h == "hook_conv" || h == "hook_x_proj" || h == "hook_dt_proj")
      return no("the projections and the conv output are not mixlens values; linear_attn.attention_values is the conv "
                "output after SiLU, betas is softplus(dt_proj)");
    return no("TransformerLens's Mamba-1 mixer has no hook '" + std::string(h) + "'");
  }
  // Mamba-2 (and the Mamba-2 mixers of Nemotron-H, Bamba, Falcon-H1): TL's SSM2MixerBridge.
  if (h == "hook_ssm_state")
    return no("its layout is [batch, seq, heads, head_dim, state] and it fires only on TL's eager scan; mixlens "
              "serves the state key side first: linear_attn.states [B,T,heads,state,head_dim] "
              "(hook_ssm_state = states.transpose(-1, -2)), read-only");
  if (h == "hook_ssm_write")
    return no("dt*(x outer B) is not a mixlens value; it is linear_attn.betas * attention_values outer attention_keys");
  if (h == "hook_ssm_B" || h == "hook_ssm_C" || h == "hook_ssm_dt" || h == "hook_ssm_decay")
    return no("TransformerLens 4.3 has no " + std::string(h) + " on a Mamba-2 mixer (B, C and dt are fused in its "
              "in_proj / conv1d outputs); mixlens serves B, C, dt, A*dt as linear_attn.attention_keys, "
              "attention_queries, betas, decays");
  if (h == "hook_in_proj" || h == "hook_conv" || h == "hook_inner_norm")
    return no("the projection, conv and gated-norm outputs are not mixlens values; linear_attn.attention_values / "
              "attention_keys / attention_queries are the conv output after SiLU, split");
  return no("TransformerLens's Mamba-2 mixer has no hook '" + std::string(h) + "'");
}

// The softmax attention's hooks (TL's AttentionBridge).
Mapped attention_hook(const FamilyModel& m, std::string_view h) {
  if (h == "hook_out") {
    if (is_falcon(m)) return no("its hook_out is before attention_out_multiplier; " + kFalconScaled +
                                ": read self_attn.attention_output");
    if (is_granite(m)) return granite_scaled("its hook_out is o_proj's output before residual_multiplier",
                                             "self_attn.attention_output (= hook_out * residual_multiplier)");
    return to("self_attn.attention_output");
  }
  if (h == "hook_pattern") return to("self_attn.attention_probabilities");
  if (h == "hook_q" || h == "hook_k" || h == "hook_v")
    return no("TransformerLens's " + std::string(h) + " is the q/k/v projection's output (before the q/k norms and "
              "RoPE; Qwen3.5's q_proj also carries the output gate); mixlens serves q and k after them, and v, as "
              "self_attn.attention_queries / attention_keys / attention_values [B,T,heads,head_dim]");
  if (h == "hook_rot_q" || h == "hook_rot_k")
    return no("not aliased: read self_attn.attention_queries / attention_keys (after the q/k norms and RoPE, "
              "[B,T,heads,head_dim])");
  if (h == "hook_z")
    return no("the heads' output before o_proj is not a mixlens value; self_attn.attention_output is after o_proj");
  if (h == "hook_attn_scores" || h == "hook_result" || h == "hook_hidden_states" || h == "hook_in" ||
      h == "hook_attn_in" || h == "hook_q_input" || h == "hook_k_input" || h == "hook_v_input")
    return no("not a mixlens value; the attention serves self_attn.attention_queries, attention_keys, "
              "attention_values, attention_probabilities, attention_output");
  return no("TransformerLens's attention has no hook '" + std::string(h) + "'");
}

Mapped mlp_hook(std::string_view h) {
  if (h == "hook_out") return to("mlp.output");
  if (h == "hook_in" || h == "hook_pre" || h == "hook_post")
    return no("the MLP's input and hidden activations are not mixlens values; mlp.output is what it adds");
  return no("TransformerLens's MLP has no hook '" + std::string(h) + "'");
}

std::string kind_phrase(int layer, LayerKind k) {
  const std::string name(layer_kind_name(k));
  return "block " + std::to_string(layer) + (name[0] == 'a' ? " is an " : " is a ") + name + " block";
}

// RWKV-4: TL 4.3's RwkvArchitectureAdapter (_RwkvBlockBridge): time_mix (HF's attention) and channel_mix (its
// feed_forward), hooked on their outputs' first element; transformers halves the residual stream *between*
// blocks (after every rescale_every-th), outside the block whose hook_out TL reads.
Mapped rwkv_block_name(const FamilyModel& m, int layer, std::string_view rest) {
  if (rest == "hook_resid_pre" || rest == "hook_in") return to("layer_input");
  if (rest == "hook_resid_post" || rest == "hook_out") {
    const auto parts = m.backward_parts();
    const auto* rp = dynamic_cast<const RwkvParts*>(parts.get());
    const int64_t every = rp ? rp->rescale_every : 0;
    if (every > 0 && (layer + 1) % every == 0)
      return no("it is the block's output before transformers halves the residual stream (after every "
                "rescale_every-th block, outside the block), and mixlens's layer_output is after: hook_resid_post = "
                "2 * layers." + std::to_string(layer) + ".layer_output");
    return to("layer_output");
  }
  if (rest == "hook_time_mix_out" || rest == "time_mix.hook_out") return to("linear_attn.attention_output");
  if (rest == "hook_channel_mix_out" || rest == "channel_mix.hook_out") return to("mlp.output");
  if (rest == "hook_resid_mid")
    return no("the residual between time and channel mixing is not a mixlens value; it is layer_input plus "
              "linear_attn.attention_output");
  if (rest == "hook_time_mix_in" || rest == "hook_channel_mix_in" || rest == "time_mix.hook_in" ||
      rest == "channel_mix.hook_in")
    return no("a mixer's input (the LayerNorm's output) is not a mixlens value; read layer_input");
  return no("TransformerLens 4.3's RWKV-4 blocks have no mixlens alias for '" + std::string(rest) + "' (mapped: "
            "hook_resid_pre, hook_resid_post, hook_time_mix_out / time_mix.hook_out, hook_channel_mix_out / "
            "channel_mix.hook_out); read mixlens names (layers.i.linear_attn.*, layers.i.mlp.output)");
}

// `rest`: the name after "blocks.{i}.".
Mapped block_name(const FamilyModel& m, int layer, std::string_view rest) {
  const LayerKind kind = m.info.layer_kinds[static_cast<size_t>(layer)];
  const Slots s = slots_of(m.info.family);
  if (m.info.family == "rwkv") return rwkv_block_name(m, layer, rest);
  // TL 4.3's RecurrentGemma adapter wraps each decoder layer whole (RecurrentGemmaBlockBridge): residual hooks only.
  if (m.info.family == "recurrent_gemma" && rest != "hook_resid_pre" && rest != "hook_in" &&
      rest != "hook_resid_post" && rest != "hook_out")
    return no("TransformerLens 4.3's RecurrentGemma adapter wraps each layer whole: only hook_resid_pre / "
              "hook_resid_post map here; read mixlens names (layers.i.linear_attn.*, layers.i.self_attn.*, "
              "layers.i.mlp.output)");
  // TransformerLens 4.3 has no MiniMax (MiniMaxForCausalLM; its minimax_m2 is another model) or xLSTM adapter, so
  // only the residual stream's names mean the same tensor.
  const char* no_adapter = m.info.family == "minimax" ? "MiniMax"
                           : m.info.family == "xlstm"   ? "xLSTM"
                                                        : nullptr;
  if (no_adapter && rest != "hook_resid_pre" && rest != "hook_in" && rest != "hook_resid_post" && rest != "hook_out")
    return no("TransformerLens 4.3 has no " + std::string(no_adapter) +
              " adapter: only hook_resid_pre / hook_resid_post map here; read mixlens names (layers.i.linear_attn.*, "
              "layers.i.self_attn.*, layers.i.mlp.output)");
  // TL's Zamba2 blocks (SSMBlockBridge) have no attention / MLP hooks, and a hybrid layer's Mamba-2 sits
  // under .mamba_decoder, which its adapter does not map: say so rather than "no MLP" on a block with one.
  if (is_zamba2(m)) {
    const bool hybrid = kind == LayerKind::hybrid;
    const std::string shared = hybrid ? "; the shared transformer block at this depth serves self_attn.* and "
                                        "mlp.output, and the block's Mamba-2 linear_attn.*"
                                      : "";
    if (rest == "hook_attn_out" || rest == "hook_mlp_out" || rest == "hook_resid_mid")
      return no("TransformerLens's Zamba2 blocks (SSMBlockBridge) have no " + std::string(rest) + shared);
    if (hybrid && (rest == "hook_mixer_out" || starts(rest, "mixer.")))
      return no("TransformerLens's Zamba2 adapter maps `mixer` on the Mamba layers only (a hybrid layer's Mamba-2 is "
                ".mamba_decoder.mamba, not mapped)" + shared);
    if (!starts(rest, "hook_") && !starts(rest, "mixer.") && !starts(rest, "norm."))
      return no("TransformerLens's Zamba2 blocks have the components norm and mixer (Mamba layers) only" + shared);
  }
  const auto mixer_out = [&]() -> Mapped {
    if (recurrent(kind)) return recurrent_hook(m, kind, "hook_out");
    if (kind == LayerKind::attention) return attention_hook(m, "hook_out");
    return to("mlp.output");  // Nemotron-H's '-' / 'E' blocks: the MLP is the block's mixer
  };
  if (starts(rest, "hook_")) {
    if (rest == "hook_resid_pre" || rest == "hook_in") return to("layer_input");
    if (rest == "hook_resid_post" || rest == "hook_out") return to("layer_output");
    if (rest == "hook_attn_out") {
      if (!has_attention(kind)) return no(kind_phrase(layer, kind) + " without softmax attention");
      return attention_hook(m, "hook_out");
    }
    if (rest == "hook_mlp_out") {
      if (is_granite(m))
        return granite_scaled("TransformerLens 4.3 fires hook_mlp_out only without experts, on shared_mlp's output",
                              "mlp.output (= (experts + shared_mlp) * residual_multiplier)");
      if (kind == LayerKind::mlp || kind == LayerKind::moe || (!s.mlp.empty() && s.mlp != "mixer")) return to("mlp.output");
      return no(kind_phrase(layer, kind) + " without an MLP");
    }
    if (rest == "hook_mixer_out") return mixer_out();
    if (rest == "hook_resid_mid")
      return no("the residual between the mixer and the MLP is not a mixlens value; it is layer_input plus the "
                "mixer's output (linear_attn / self_attn .attention_output)");
    if (rest == "hook_mixer_in" || rest == "hook_attn_in" || rest == "hook_mlp_in")
      return no("a sublayer's input (the normed residual stream) is not a mixlens value; read layer_input");
    return no("TransformerLens's blocks have no hook '" + std::string(rest) + "'");
  }
  const size_t dot = rest.find('.');
  if (dot == std::string_view::npos) return no("a TransformerLens name ends in a hook ('blocks.3.hook_resid_post')");
  const std::string_view slot = rest.substr(0, dot), h = rest.substr(dot + 1);
  if (h.find('.') != std::string_view::npos)
    return no("the hooks of TransformerLens's submodules (in_proj, conv1d, q, ...) are not mixlens values");
  if (slot == "ln1" || slot == "ln2" || slot == "norm")
    return no("the block's norms are not mixlens values");
  if (is_granite(m) && (slot == "shared_mlp" || slot == "moe"))
    return granite_scaled("TransformerLens's " + std::string(slot) + " is one part of the MLP branch, before residual_multiplier",
                          "mlp.output (= (experts + shared_mlp) * residual_multiplier)");
  if (slot == s.mixer && recurrent(kind)) return recurrent_hook(m, kind, h);
  if (!s.attn.empty() && slot == s.attn && has_attention(kind)) return attention_hook(m, h);
  if (!s.mlp.empty() && slot == s.mlp) {
    if (kind == LayerKind::mlp || kind == LayerKind::moe || s.mlp != "mixer") return mlp_hook(h);
  }
  std::string have;
  for (std::string_view c : {s.mixer, s.attn, s.mlp}) {
    if (c.empty() || have.find(std::string(c) + ",") != std::string::npos) continue;
    const bool present = c == s.mixer && recurrent(kind) ? true
                         : c == s.attn && has_attention(kind) ? true
                         : c == s.mlp && (kind == LayerKind::mlp || kind == LayerKind::moe || s.mlp != "mixer");
    if (present) have += std::string(c) + ",";
  }
  if (!have.empty()) have.pop_back();
  return no(kind_phrase(layer, kind) + ": TransformerLens names no component '" + std::string(slot) + "' there (" +
            (have.empty() ? std::string("it has none") : "its components: " + have) + ")");
}

Mapped global_name(const FamilyModel& m, std::string_view p) {
  if (p == "hook_embed" || p == "embed.hook_out") {
    if (is_falcon(m)) return no("its hook_embed is the embedding before embedding_multiplier; " + kFalconScaled +
                                ": read embed_tokens.output (= hook_embed * embedding_multiplier)");
    if (is_granite(m)) return granite_scaled("its hook_embed is the embedding before embedding_multiplier",
                                             "embed_tokens.output (= hook_embed * embedding_multiplier)");
    if (m.info.family == "recurrent_gemma")
      return no("its hook_embed is embed_tokens' output before RecurrentGemma's normalizer; mixlens's "
                "embed_tokens.output is after it (= hook_embed * sqrt(hidden_size), the factor rounded to bfloat16)");
    return to("embed_tokens.output");
  }
  if (p == "ln_final.hook_out") return to("ln_final.output");
  if (p == "ln_final.hook_normalized")
    return no("it is x / rms(x), before the norm's weight; mixlens serves the norm's output, weight applied: "
              "ln_final.output (= TransformerLens's ln_final.hook_out)");
  if (p == "ln_final.hook_scale" || p == "ln_final.hook_in")
    return no("not a mixlens value; ln_final.output is the norm's output, the last block's layer_output its input");
  if (p == "hook_unembed" || p == "unembed.hook_out") {
    if (is_falcon(m)) return no("it is lm_head's output before lm_head_multiplier; mixlens's logits include it");
    if (is_granite(m)) return no("it is lm_head's output before the division by logits_scaling; mixlens's logits include it");
    if (m.info.family == "recurrent_gemma")
      return no("it is lm_head's output before RecurrentGemma's logits_soft_cap; mixlens's logits are soft-capped "
                "(= cap * tanh(hook_unembed / cap))");
    return to("logits");
  }
  return no("TransformerLens name '" + std::string(p) + "' is not a mixlens value (embedding: hook_embed, final "
            "norm: ln_final.hook_out, logits: hook_unembed)");
}

[[noreturn]] void refuse(const FamilyModel& m, const std::string& path, const std::string& why) {
  throw UnknownValueError("TransformerLens name '" + path + "' has no mixlens alias on this " + m.info.family +
                          " model: " + why + " (docs/transformer_lens.md)");
}

}  // namespace

bool is_tl_name(std::string_view p) {
  return starts(p, "blocks.") || starts(p, "hook_") || starts(p, "embed.") || starts(p, "unembed.") ||
         starts(p, "ln_final.hook_");
}

std::vector<std::string> tl_canonical_paths(const FamilyModel& m, const std::string& path) {
  if (m.info.family == "kimi_linear")  // no TL tensor exists to be an alias of
    refuse(m, path, "TransformerLens has no Kimi-Linear adapter (KimiLinearForCausalLM is not among its supported "
                    "architectures); read the mixlens paths (layers.{i}.linear_attn.*, self_attn.*, mlp.output, "
                    "layer_output)");
  if (!starts(path, "blocks.")) {
    Mapped g = global_name(m, path);
    if (g.target.empty()) refuse(m, path, g.why);
    return {g.target};
  }
  const size_t end = path.find('.', 7);
  const std::string layer = path.substr(7, end == std::string::npos ? std::string::npos : end - 7);
  const std::string rest = end == std::string::npos ? std::string() : path.substr(end + 1);
  const int L = m.info.num_layers;
  if (layer == "*") {
    std::vector<std::string> out;
    std::string first_why;
    for (int i = 0; i < L; ++i) {
      Mapped b = block_name(m, i, rest);
      if (!b.target.empty()) out.push_back("layers." + std::to_string(i) + "." + b.target);
      else if (first_why.empty()) first_why = b.why;
    }
    if (out.empty()) refuse(m, path, "no block has it (" + first_why + ")");
    return out;
  }
  if (layer.empty() || layer.size() > 9 || !std::all_of(layer.begin(), layer.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); }))
    refuse(m, path, "the block index '" + layer + "' is not a number or '*'");
  const int li = std::stoi(layer);
  if (li >= L)
    refuse(m, path, "block " + layer + " is out of range (the model has " + std::to_string(L) + " blocks, 0.." +
                        std::to_string(L - 1) + ")");
  Mapped b = block_name(m, li, rest);
  if (b.target.empty()) refuse(m, path, b.why);
  return {"layers." + layer + "." + b.target};
}

std::string tl_key(const std::string& path, int layer) {
  if (starts(path, "blocks.*.")) return "blocks." + std::to_string(layer) + path.substr(8);
  return path;
}

}  // namespace mixlens::detail
