// Mamba-2 hybrids. References: transformers 5.18 models/nemotron_h/modeling_nemotron_h.py
// (NemotronHBlock, NemotronHAttention, NemotronHMLP), models/bamba/modeling_bamba.py
// (BambaDecoderLayer, BambaAttention, BambaMLP), models/falcon_h1/modeling_falcon_h1.py
// (FalconH1DecoderLayer, FalconH1Attention, FalconH1MLP, FalconH1Model, FalconH1ForCausalLM),
// models/granitemoehybrid/modeling_granitemoehybrid.py (GraniteMoeHybridDecoderLayer,
// GraniteMoeHybridMoE, GraniteMoeHybridMLP, GraniteMoeHybridModel), models/jamba/modeling_jamba.py
// (JambaMambaDecoderLayer, JambaAttentionDecoderLayer, JambaSparseMoeBlock, JambaMLP).
// Everything runs in float32.
#include "models/mamba2_hybrid.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>

#include "mixers/attention_mixer.h"
#include "hooks/serve.h"
#include "mixlens/errors.h"
#include "models/common.h"
#include "models/config.h"
#include "models/hybrid_cache.h"
#include "ops/ops.h"

namespace mixlens::detail {

namespace {
const float* opt(const Tensor& t) { return t.defined() ? t.data() : nullptr; }
}  // namespace

Tensor swiglu_mlp(const Tensor& gate_w, const Tensor& up_w, const Tensor& down_w, const float* x, int64_t rows,
                  int64_t in, int64_t I) {
  Tensor g({rows, I}), u({rows, I}), out({rows, down_w.size(0)});
  ops::linear(x, rows, in, gate_w, g.data());
  ops::linear(x, rows, in, up_w, u.data());
  ops::mul_silu(u.data(), g.data(), u.data(), rows * I);  // silu(gate) * up
  ops::linear(u.data(), rows, I, down_w, out.data());
  return out;
}

Tensor hybrid_expert(const Mamba2HybridSpec& s, const HybridMoeWeights& m, int64_t e, const float* xs, int64_t rows) {
  const size_t i = static_cast<size_t>(e);
  const int64_t in = s.latent > 0 ? s.latent : s.D;
  return s.moe_kind != HybridMoeKind::nemotron_h ? swiglu_mlp(m.gate[i], m.up[i], m.down[i], xs, rows, in, s.moe_I)
                                              : relu2_mlp(m.up[i], m.down[i], xs, rows, in, s.moe_I);
}

Tensor relu2_mlp(const Tensor& up_w, const Tensor& down_w, const float* x, int64_t rows, int64_t in, int64_t I) {
  Tensor u({rows, I}), out({rows, down_w.size(0)});
  ops::linear(x, rows, in, up_w, u.data());
  for (int64_t k = 0; k < rows * I; ++k) {
    const float r = std::max(u[k], 0.0f);
    u[k] = r * r;
  }
  ops::linear(u.data(), rows, I, down_w, out.data());
  return out;
}

Tensor hybrid_embeddings(const Mamba2HybridSpec& s, const Tensor& embed, const Batch& in) {
  Tensor h = embed_tokens(embed, in, s.family.c_str());
  // FalconH1Model multiplies looked-up ids only: inputs_embeds go in as given (GraniteMoeHybridModel
  // multiplies both).
  if (s.embedding_multiplier != 1.0f && (!in.embeds.defined() || s.embedding_multiplier_on_embeds))
    for (int64_t k = 0; k < h.numel(); ++k) h[k] *= s.embedding_multiplier;
  return h;
}

Tensor hybrid_mlp(const Mamba2HybridSpec& s, const HybridMlpWeights& m, const float* x, int64_t rows) {
  const int64_t I = s.I, D = s.D;
  Tensor up({rows, I}), out({rows, D});
  ops::linear(x, rows, D, m.up, up.data(), opt(m.up_b));
  Tensor g;
  if (s.mlp != HybridMlp::relu2) {
    g = Tensor({rows, I});
    ops::linear(x, rows, D, m.gate, g.data(), opt(m.gate_b));
  }
  if (m.lora_a.defined()) {  // Zamba2MLP: gate_up_proj(x) + this depth's adapter(x), before the activation
    add_lora(x, rows, m.lora_a, m.lora_gate, g);
    add_lora(x, rows, m.lora_a, m.lora_up, up);
  }
  if (s.mlp == HybridMlp::geglu) {  // exact GELU (ACT2FN["gelu"]) on the gate, times up
    for (int64_t k = 0; k < rows * I; ++k)
      up[k] *= 0.5f * g[k] * (1.0f + std::erf(g[k] * 0.70710678118654752440f));
  } else if (s.mlp == HybridMlp::swiglu) {
    if (s.mlp_gate_multiplier != 1.0f)
      for (int64_t k = 0; k < rows * I; ++k) g[k] *= s.mlp_gate_multiplier;
    ops::mul_silu(up.data(), g.data(), up.data(), rows * I);  // up * silu(gate), vectorized
  } else {
    for (int64_t k = 0; k < rows * I; ++k) {
      const float r = std::max(up[k], 0.0f);
      up[k] = r * r;
    }
  }
  ops::linear(up.data(), rows, I, m.down, out.data(), opt(m.down_b));
  if (s.mlp_down_multiplier != 1.0f)
    for (int64_t k = 0; k < out.numel(); ++k) out[k] *= s.mlp_down_multiplier;
  return out;
}

// NemotronHMoE: fp32 sigmoid router; choice scores + e_score_correction_bias; the topk_group
// groups with the largest sum of their top-2 choice scores stay eligible; top-k experts by choice
// score, weighted by their plain sigmoid scores (renormalised when norm_topk_prob, + 1e-20),
// times routed_scaling_factor. GraniteMoeHybridTopKRouter: top-k of the fp32 logits, weighted by
// the softmax over those k logits. JambaSparseMoeBlock: top-k of the softmax over all E logits,
// weighted by those probabilities as they are.
HybridMoeRouting hybrid_moe_route(const Mamba2HybridSpec& s, const HybridMoeWeights& m, const float* x, int64_t rows) {
  const int64_t E = s.n_experts, K = s.topk;
  Tensor logits({rows, E});
  ops::linear(x, rows, s.D, m.router, logits.data());
  HybridMoeRouting rt;
  rt.topk = K;
  rt.scores.resize(static_cast<size_t>(rows * E));
  rt.chosen.resize(static_cast<size_t>(rows * K));
  rt.weights.resize(static_cast<size_t>(rows * K));
  rt.total.resize(static_cast<size_t>(rows));
  rt.routed.resize(static_cast<size_t>(E));
  if (s.moe_kind != HybridMoeKind::nemotron_h) {
    const bool jamba = s.moe_kind == HybridMoeKind::jamba;
    std::vector<int64_t> ei(static_cast<size_t>(E));
    for (int64_t r = 0; r < rows; ++r) {
      float* lg = logits.data() + r * E;
      if (jamba) {  // Jamba ranks and weights by the softmax over all E (float32, as torch's)
        const float mx = *std::max_element(lg, lg + E);
        float sum = 0.0f;
        for (int64_t e = 0; e < E; ++e) sum += (lg[e] = std::exp(lg[e] - mx));
        for (int64_t e = 0; e < E; ++e) lg[e] /= sum;
      }
      std::copy(lg, lg + E, rt.scores.begin() + r * E);
      for (int64_t e = 0; e < E; ++e) ei[static_cast<size_t>(e)] = e;
      std::partial_sort(ei.begin(), ei.begin() + K, ei.end(),
                        [&](int64_t a, int64_t b) { return lg[a] > lg[b] || (lg[a] == lg[b] && a < b); });
      // Granite: softmax over the chosen logits (the first is the largest)
      const float mx = lg[ei[0]];
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        const float ex = jamba ? lg[ei[static_cast<size_t>(k)]] : std::exp(lg[ei[static_cast<size_t>(k)]] - mx);
        rt.weights[static_cast<size_t>(r * K + k)] = ex;
        sum += ex;
      }
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = ei[static_cast<size_t>(k)];
        if (!jamba) rt.weights[static_cast<size_t>(r * K + k)] /= sum;
        rt.chosen[static_cast<size_t>(r * K + k)] = e;
        rt.routed[static_cast<size_t>(e)].push_back({r, k});
      }
    }
    return rt;
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* sc = rt.scores.data() + r * E;
    for (int64_t e = 0; e < E; ++e) sc[e] = ops::sigmoid(logits[r * E + e]);
    const std::vector<int64_t> ei = group_limited_topk(sc, m.bias.data(), E, s.n_group, s.topk_group, s.topk);
    float tot = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = ei[static_cast<size_t>(k)];
      rt.chosen[static_cast<size_t>(r * K + k)] = e;
      tot += sc[e];
      rt.routed[static_cast<size_t>(e)].push_back({r, k});
    }
    rt.total[static_cast<size_t>(r)] = tot;
    for (int64_t k = 0; k < K; ++k) {
      const float v = sc[rt.chosen[static_cast<size_t>(r * K + k)]];
      rt.weights[static_cast<size_t>(r * K + k)] = (s.norm_topk ? v / (tot + 1e-20f) : v) * s.routed_scaling;
    }
  }
  return rt;
}

Tensor hybrid_moe_input(const Mamba2HybridSpec& s, const HybridMoeWeights& m, const float* x, int64_t rows) {
  if (s.latent <= 0) return Tensor();
  Tensor xin({rows, s.latent});
  ops::linear(x, rows, s.D, m.fc1, xin.data(), opt(m.fc1_b));
  return xin;
}

Tensor ff_branch(const Mamba2HybridSpec& s, const HybridBlockWeights& w, const HybridBlock& b, const float* x, int64_t rows) {
  if (b.moe && s.moe_kind == HybridMoeKind::jamba) return hybrid_moe(s, w.moe, x, rows);  // experts instead of the MLP
  Tensor out = hybrid_mlp(s, w.mlp, x, rows);
  if (b.moe) {  // GraniteMoeHybridDecoderLayer: block_sparse_moe(x) + shared_mlp(x)
    const Tensor moe = hybrid_moe(s, w.moe, x, rows);
    for (int64_t k = 0; k < out.numel(); ++k) out[k] = moe[k] + out[k];
  }
  if (s.residual_multiplier != 1.0f)
    for (int64_t k = 0; k < out.numel(); ++k) out[k] *= s.residual_multiplier;
  return out;
}

Tensor gather_routed_rows(const float* x, int64_t in, const std::vector<std::pair<int64_t, int64_t>>& toks) {
  const int64_t nt = static_cast<int64_t>(toks.size());
  Tensor xs({nt, in});
  for (int64_t j = 0; j < nt; ++j)
    std::memcpy(xs.data() + j * in, x + toks[static_cast<size_t>(j)].first * in, sizeof(float) * static_cast<size_t>(in));
  return xs;
}

// Experts summed in expert order (as index_add_), then fc2, plus the shared expert (Nemotron-H; a
// Granite block adds its shared MLP itself).
Tensor hybrid_moe(const Mamba2HybridSpec& s, const HybridMoeWeights& m, const float* x, int64_t rows) {
  const int64_t E = s.n_experts, D = s.D, in = s.latent > 0 ? s.latent : D;
  const HybridMoeRouting rt = hybrid_moe_route(s, m, x, rows);
  const Tensor xin = hybrid_moe_input(s, m, x, rows);
  const float* xe = xin.defined() ? xin.data() : x;
  Tensor acc({rows, in});
  for (int64_t e = 0; e < E; ++e) {
    const auto& toks = rt.routed[static_cast<size_t>(e)];
    if (toks.empty()) continue;
    const Tensor xs = gather_routed_rows(xe, in, toks);
    const Tensor y = hybrid_expert(s, m, e, xs.data(), static_cast<int64_t>(toks.size()));
    for (size_t j = 0; j < toks.size(); ++j) {
      const auto [r, k] = toks[j];
      const float wgt = rt.weight(r, k);
      for (int64_t d = 0; d < in; ++d) acc[r * in + d] += y[static_cast<int64_t>(j) * in + d] * wgt;
    }
  }
  Tensor out({rows, D});
  if (s.latent > 0) ops::linear(acc.data(), rows, in, m.fc2, out.data(), opt(m.fc2_b));
  else std::memcpy(out.data(), acc.data(), sizeof(float) * static_cast<size_t>(rows * D));
  if (s.moe_kind != HybridMoeKind::nemotron_h) return out;
  const Tensor sh = relu2_mlp(m.shared_up, m.shared_down, x, rows, D, s.shared_I);
  for (int64_t k = 0; k < rows * D; ++k) out[k] += sh[k];
  return out;
}

namespace {

using BlockW = HybridBlockWeights;


void scale_by(Tensor& t, float f) {
  if (f == 1.0f) return;
  for (int64_t k = 0; k < t.numel(); ++k) t[k] *= f;
}

void add_into(Tensor& h, const Tensor& x) {
  float* hp = h.data();
  const float* xp = x.data();
  for (int64_t k = 0; k < h.numel(); ++k) hp[k] += xp[k];
}


// The first of `names` the checkpoint holds (transformers-saved and published spellings); the
// first name when none is there, so that w.get names a missing tensor as expected.
std::string first_present(const io::WeightStore& w, std::initializer_list<std::string> names) {
  for (const auto& n : names)
    if (w.has(n)) return n;
  return *names.begin();
}

std::string kind_phrase(LayerKind k) {
  const std::string n(layer_kind_name(k));
  return (n[0] == 'a' ? "an " : "a ") + n + " block";
}

class Mamba2Hybrid final : public FamilyModel {
 public:
  Mamba2Hybrid(const Mamba2HybridSpec& spec, const io::Config& cfg, const io::WeightStore& w) : s_(spec) {
    L_ = static_cast<int64_t>(s_.blocks.size());
    // Granite's residual_multiplier on the mixer and attention branches: the served attention_output
    // values are what the block adds.
    s_.mamba.out_multiplier *= s_.residual_multiplier;
    s_.attn.out_multiplier *= s_.residual_multiplier;
    bool any_mamba = false, any_attn = false, any_mlp = false;
    for (const auto& b : s_.blocks) {
      any_mamba |= b.mamba;
      any_attn |= b.attn;
      any_mlp |= b.branch_mlp || b.ff;
    }
    const bool m1 = s_.mixer == HybridMixer::mamba1;
    if (any_mamba && m1) mixer1_ = MambaMixer(s_.mamba1);
    if (any_mamba && !m1) mixer_ = Mamba2Mixer(s_.mamba, where(cfg));
    s_.attn.D = s_.D;
    for (const auto& b : s_.blocks) any_attn |= b.shared;
    if (any_attn) attn_ = AttentionMixer(s_.attn, where(cfg));
    // The first prefix under which the embeddings exist names the layout (published vs saved).
    std::string p;
    for (const auto& cand : s_.prefixes)
      if (w.has(cand + s_.embed)) { p = cand; break; }
    if (p.empty() && !s_.prefixes.empty()) p = s_.prefixes.front();  // w.get below names the missing tensor
    embed_ = w.get_matmul(p + s_.embed, {s_.V, s_.D});
    norm_f_ = w.get(p + s_.final_norm, {s_.D});
    lm_head_ = s_.tie ? embed_ : w.get_matmul("lm_head.weight", {s_.V, s_.D});
    const int64_t I = s_.I;
    std::map<std::string, BlockW> shared_once;  // each shared block's tensors by prefix, loaded once
    for (int64_t i = 0; i < L_; ++i) {
      const HybridBlock& b = s_.blocks[static_cast<size_t>(i)];
      const std::string lp = p + "layers." + std::to_string(i) + ".";
      BlockW bw;
      bw.in_norm = w.get(lp + (b.shared ? s_.shared_in_norm : s_.in_norm), {s_.D});
      const std::string mixer_mod = lp + (b.shared ? s_.shared_mamba_mod : s_.mamba_mod) + ".";
      if (b.mamba && m1) bw.mamba1 = mixer1_.load(w, mixer_mod);
      if (b.mamba && !m1) bw.mamba = mixer_.load(w, mixer_mod);
      if (b.attn) bw.attn = attn_.load(w, lp + s_.attn_mod + ".");
      if (b.shared) load_shared(w, lp, b, shared_once, bw);
      const bool moe_only = b.moe && s_.moe_kind == HybridMoeKind::jamba;  // experts in place of the MLP
      if (b.moe && s_.moe_kind != HybridMoeKind::nemotron_h) {
        // GraniteMoeHybridMoE: router [E, D]; experts gate_up [E, 2I, D] (gate rows first), down [E, D, I].
        // transformers 5.18 renames the published block_sparse_moe.{router.layer, input_linear,
        // output_linear} on load (conversion_mapping "granitemoe"); both spellings are read. Jamba
        // (JambaSparseMoeBlock) stores router / experts.gate_up_proj / experts.down_proj alike.
        const std::string m = lp + (s_.moe_mod.empty() ? s_.mlp_mod : s_.moe_mod) + ".";
        const int64_t E = s_.n_experts, Ie = s_.moe_I, D = s_.D;
        bw.moe.router = w.get(first_present(w, {m + "router.weight", m + "router.layer.weight"}), {E, D});
        if (s_.moe_kind == HybridMoeKind::jamba && !w.has(m + "experts.gate_up_proj")) {
          // Jamba as published and as transformers 5.18 saves it: one gate_proj / up_proj / down_proj per expert.
          for (int64_t e = 0; e < E; ++e) {
            const std::string ep = m + "experts." + std::to_string(e) + ".";
            bw.moe.gate.push_back(w.get_matmul(ep + "gate_proj.weight", {Ie, D}));
            bw.moe.up.push_back(w.get_matmul(ep + "up_proj.weight", {Ie, D}));
            bw.moe.down.push_back(w.get_matmul(ep + "down_proj.weight", {D, Ie}));
          }
        } else {
          const Tensor gu = w.get_matmul(first_present(w, {m + "experts.gate_up_proj", m + "input_linear.weight"}), {E, 2 * Ie, D});
          const Tensor dn = w.get_matmul(first_present(w, {m + "experts.down_proj", m + "output_linear.weight"}), {E, D, Ie});
          for (int64_t e = 0; e < E; ++e) {
            bw.moe.gate.push_back(row_block(gu, e * 2 * Ie, {Ie, D}));
            bw.moe.up.push_back(row_block(gu, e * 2 * Ie + Ie, {Ie, D}));
            bw.moe.down.push_back(row_block(dn, e * D, {D, Ie}));
          }
        }
      }
      if (b.moe && s_.moe_kind == HybridMoeKind::nemotron_h) {
        const std::string m = lp + s_.mlp_mod + ".";
        const int64_t E = s_.n_experts, in = s_.latent > 0 ? s_.latent : s_.D;
        bw.moe.router = w.get(m + "gate.weight", {E, s_.D});
        bw.moe.bias = w.get(m + "gate.e_score_correction_bias", {E});
        for (int64_t e = 0; e < E; ++e) {
          const std::string ep = m + "experts." + std::to_string(e) + ".";
          bw.moe.up.push_back(w.get_matmul(ep + "up_proj.weight", {s_.moe_I, in}));
          bw.moe.down.push_back(w.get_matmul(ep + "down_proj.weight", {in, s_.moe_I}));
        }
        bw.moe.shared_up = w.get_matmul(m + "shared_experts.up_proj.weight", {s_.shared_I, s_.D});
        bw.moe.shared_down = w.get_matmul(m + "shared_experts.down_proj.weight", {s_.D, s_.shared_I});
        if (s_.latent > 0) {
          bw.moe.fc1 = w.get_matmul(m + "fc1_latent_proj.weight", {s_.latent, s_.D});
          bw.moe.fc2 = w.get_matmul(m + "fc2_latent_proj.weight", {s_.D, s_.latent});
          if (s_.mlp_bias) {
            bw.moe.fc1_b = w.get(m + "fc1_latent_proj.bias", {s_.latent});
            bw.moe.fc2_b = w.get(m + "fc2_latent_proj.bias", {s_.D});
          }
        }
      } else if (b.branch_mlp || b.ff) {
        if (b.ff) bw.ff_norm = w.get(lp + s_.ff_norm, {s_.D});
        const std::string m = lp + s_.mlp_mod + ".";
        if (s_.mlp_fused && !moe_only) {  // GraniteMoeHybridMLP: input_linear [2I, D] = gate | up, output_linear [D, I]
          const Tensor gu = w.get_matmul(m + "input_linear.weight", {2 * I, s_.D});
          bw.mlp.gate = row_block(gu, 0, {I, s_.D});
          bw.mlp.up = row_block(gu, I, {I, s_.D});
          bw.mlp.down = w.get_matmul(m + "output_linear.weight", {s_.D, I});
        } else if (!moe_only) {  // (Jamba's experts block has no MLP beside them)
          if (s_.mlp == HybridMlp::swiglu) bw.mlp.gate = w.get_matmul(m + "gate_proj.weight", {I, s_.D});
          bw.mlp.up = w.get_matmul(m + "up_proj.weight", {I, s_.D});
          bw.mlp.down = w.get_matmul(m + "down_proj.weight", {s_.D, I});
        }
        if (s_.mlp_bias && !s_.mlp_fused && !moe_only) {
          if (s_.mlp == HybridMlp::swiglu) bw.mlp.gate_b = w.get(m + "gate_proj.bias", {I});
          bw.mlp.up_b = w.get(m + "up_proj.bias", {I});
          bw.mlp.down_b = w.get(m + "down_proj.bias", {s_.D});
        }
      }
      blocks_.push_back(std::move(bw));
    }
    (void)any_mlp;
    info.family = s_.family;
    info.model_type = cfg.get<std::string>("model_type");
    info.num_layers = static_cast<int>(L_);
    info.hidden_size = s_.D;
    info.vocab_size = s_.V;
    for (const auto& b : s_.blocks) info.layer_kinds.push_back(b.kind);
    config_chunk_ = s_.mamba.chunk;
  }

  // A Zamba2 hybrid layer's shared block at its depth: the block's tensors (read once, under the
  // prefix of the first layer that runs it; every depth shares their storage), then this depth's
  // adapters and the layer's own linear.
  // transformers 5.18 ties the blocks only with tie_word_embeddings (its tying is all or nothing):
  // untied, every hybrid layer saves and runs a block of its own, read from the layer's prefix.
  void load_shared(const io::WeightStore& w, const std::string& lp, const HybridBlock& b,
                   std::map<std::string, BlockW>& once, BlockW& bw) const {
    const int64_t D = s_.D, I = s_.I, r = s_.mlp_lora_rank;
    const std::string own = lp + s_.shared_mod;
    const std::string& sp = w.has(own + "input_layernorm.weight") ? own : s_.shared_prefixes.at(static_cast<size_t>(b.shared_block));
    bw.shared.prefix = sp;
    BlockW& o = once[sp];
    if (!o.shared.in_norm.defined()) {
      o.shared.in_norm = w.get(sp + "input_layernorm.weight", {2 * D});
      o.shared.ff_norm = w.get(sp + "pre_ff_layernorm.weight", {D});
      o.attn = attn_.load(w, sp + "self_attn.");
      const std::string m = sp + "feed_forward.";
      if (s_.shared_mlp_split) {  // ZambaMLP
        o.mlp.gate = w.get_matmul(m + "gate_proj.weight", {I, D});
        o.mlp.up = w.get_matmul(m + "up_proj.weight", {I, D});
      } else {
        const Tensor gu = w.get_matmul(m + "gate_up_proj.weight", {2 * I, D});  // [gate | up] rows
        o.mlp.gate = row_block(gu, 0, {I, D});
        o.mlp.up = row_block(gu, I, {I, D});
      }
      o.mlp.down = w.get_matmul(m + "down_proj.weight", {D, I});
      if (s_.mlp_bias) {
        const Tensor gb = w.get(m + "gate_up_proj.bias", {2 * I});
        o.mlp.gate_b = Tensor({I});
        o.mlp.up_b = Tensor({I});
        std::memcpy(o.mlp.gate_b.data(), gb.data(), sizeof(float) * static_cast<size_t>(I));
        std::memcpy(o.mlp.up_b.data(), gb.data() + I, sizeof(float) * static_cast<size_t>(I));
        o.mlp.down_b = w.get(m + "down_proj.bias", {D});
      }
    }
    bw.shared.in_norm = o.shared.in_norm;
    bw.shared.ff_norm = o.shared.ff_norm;
    bw.attn = o.attn;
    if (s_.attn.lora_rank > 0) attn_.load_adapters(w, sp + "self_attn.", b.shared_depth, bw.attn);
    bw.mlp = o.mlp;
    if (r > 0) {  // Zamba2MLP: an adapter per depth, always (no config switch)
      const std::string a = sp + "feed_forward.gate_up_proj_adapter_list." + std::to_string(b.shared_depth) + ".";
      bw.mlp.lora_a = w.get_matmul(a + "0.weight", {r, D});
      const Tensor up = w.get_matmul(a + "1.weight", {2 * I, r});
      bw.mlp.lora_gate = row_block(up, 0, {I, r});
      bw.mlp.lora_up = row_block(up, I, {I, r});
    }
    bw.shared.linear = w.get_matmul(lp + "linear.weight", {D, D});
  }

  // Zamba2AttentionDecoderLayer + the layer's linear at depth `li`: linear(mlp(RMSNorm(attn(
  // RMSNorm([h, h0]))))) [B,T,D], serving self_attn.* and mlp.output of layer li on the way.
  Tensor shared_block(const BlockW& bw, const Tensor& h, const Tensor& h0, const Batch& in, HybridCache& cache,
                      const std::vector<int64_t>& pos, Listener* ls, int li, FiniteWatch& watch) const {
    const int64_t B = in.batch, T = in.seq, BT = B * T, D = s_.D;
    Tensor c({B, T, 2 * D});
    for (int64_t r = 0; r < BT; ++r) {
      std::memcpy(c.data() + r * 2 * D, h.data() + r * D, sizeof(float) * static_cast<size_t>(D));
      std::memcpy(c.data() + r * 2 * D + D, h0.data() + r * D, sizeof(float) * static_cast<size_t>(D));
    }
    ops::rmsnorm(c.data(), bw.shared.in_norm.data(), c.data(), BT, 2 * D, s_.eps);
    Tensor a = attn_.forward(bw.attn, c, in, cache.attention_call(li, pos, ls));
    watch.check(li, Value::attn_output, a);
    Tensor n({BT, D});
    ops::rmsnorm(a.data(), bw.shared.ff_norm.data(), n.data(), BT, D, s_.eps);
    Tensor m = hybrid_mlp(s_, bw.mlp, n.data(), BT).reshape({B, T, D});
    visit_if(ls, li, Value::mlp_output, m);
    watch.check(li, Value::mlp_output, m);
    Tensor t({B, T, D});
    ops::linear(m.data(), BT, D, bw.shared.linear, t.data());
    return t;
  }

  void set_chunk_size(int64_t c) override {
    mixer1_.set_chunk(c);  // 0 restores the Mamba-1 default
    mixer_.set_chunk(c > 0 ? c : config_chunk_);
  }
  Tensor betas_for_decays(int li, const Tensor& betas_before, const Tensor& decays) const override {
    const BlockW& bw = blocks_[static_cast<size_t>(li)];
    if (mamba1()) return mixer1_.betas_for_decays(li, bw.mamba1, betas_before, decays);
    return mixer_.betas_for_decays(bw.mamba, betas_before, decays);
  }
  MixerConsts mixer_consts(int li) const override {
    const HybridBlock& b = s_.blocks[static_cast<size_t>(li)];
    const BlockW& bw = blocks_[static_cast<size_t>(li)];
    if (!b.mamba) return {};
    return {mamba1() ? bw.mamba1.D : bw.mamba.D, {}, {}, {}};
  }

  std::unique_ptr<CacheState> new_cache(int64_t batch) const override {
    std::vector<bool> is_mixer;
    for (const HybridBlock& b : s_.blocks) is_mixer.push_back(b.mamba);
    // Mamba-1: a conv window over the E channels and a state [E, N] (the served layout).
    if (mamba1()) return std::make_unique<HybridCache>(batch, is_mixer, s_.mamba1.K, s_.mamba1.E, Shape{s_.mamba1.E, s_.mamba1.N});
    return std::make_unique<HybridCache>(batch, is_mixer, s_.mamba.K, s_.mamba.conv_dim(), mixer_.state_shape());
  }

  std::string kernel_for(const CacheState& cache, int64_t seq) const override {
    const std::string k = hybrid_kernel(s_.family, cache, seq);
    // Mamba-1 prompts take the mixer's own default (the token loop), as on the Mamba-1 LMs.
    if (mamba1() && k == "chunked" && kernel_route(s_.family) == KernelRoute::default_route) return mixer1_.prompt_kernel(seq);
    return k;
  }

  Tensor forward(const Batch& in, CacheState& cache_base, Listener* ls, const CallCtx& ctx,
                 bool all_logits) const override {
    auto& cache = static_cast<HybridCache&>(cache_base);
    const int64_t B = in.batch, T = in.seq, BT = B * T, D = s_.D;
    const std::vector<int64_t> pos = cache.advance_positions(in);
    Tensor h = hybrid_embeddings(s_, embed_, in);
    visit_if(ls, -1, Value::embed_output, h);
    FiniteWatch watch(s_.family);  // a poisoned forward raises NumericError instead of NaN logits
    watch.check(-1, Value::embed_output, h);
    // Zamba2Model: the shared blocks read the embeddings (as served, after any write) at every depth.
    const Tensor h0 = s_.shared_prefixes.empty() ? Tensor() : h.clone();
    if (ctx.tape && h0.defined()) ctx.tape->keep(-1, grad::Kept::embeddings, h0);  // read-only from here on
    Tensor n({B, T, D});
    for (int64_t i = 0; i < L_; ++i) {
      const int li = static_cast<int>(i);
      const HybridBlock& b = s_.blocks[static_cast<size_t>(i)];
      const BlockW& bw = blocks_[static_cast<size_t>(i)];
      ctx.check_cancel();
      visit_if(ls, li, Value::layer_input, h);
      if (b.shared) {  // Zamba2MambaDecoderLayer: the mixer reads RMSNorm(h + shared block), the residual is h
        Tensor x = shared_block(bw, h, h0, in, cache, pos, ls, li, watch);
        add_into(x, h);
        ops::rmsnorm(x.data(), bw.in_norm.data(), n.data(), BT, D, s_.eps);
      } else {
        ops::rmsnorm(h.data(), bw.in_norm.data(), n.data(), BT, D, s_.eps);
      }
      Tensor branch({B, T, D});
      if (b.mamba && mamba1()) {
        Tensor out = mamba1_forward(li, bw, n, in, cache, ls, ctx);
        watch.check(li, Value::attention_output, out);
        add_into(branch, out);
      } else if (b.mamba) {
        Mamba2MixerCall call;
        call.layer = li;
        call.conv = &cache.conv[static_cast<size_t>(i)];
        call.ssm = &cache.ssm[static_cast<size_t>(i)];
        call.has_state = cache.has_state;
        call.chunked = ctx.kernel == "chunked";
        call.ls = ls;
        call.tape = ctx.tape;  // a gradient call keeps in_proj's output and y for the backward
        Tensor out = mixer_.forward(bw.mamba, n, in, call);
        watch.check(li, Value::attention_output, out);
        add_into(branch, out);
      }
      if (b.attn) {
        // No tape: the backward recomputes the attention from the block input (what a hybrid
        // gradient call keeps is unchanged by the move to the attention mixer).
        Tensor out = attn_.forward(bw.attn, n, in, cache.attention_call(li, pos, ls));
        watch.check(li, Value::attn_output, out);
        add_into(branch, out);
      }
      if (b.branch_mlp) {
        Tensor m = (b.moe ? hybrid_moe(s_, bw.moe, n.data(), BT) : hybrid_mlp(s_, bw.mlp, n.data(), BT)).reshape({B, T, D});
        scale_by(m, s_.residual_multiplier);
        visit_if(ls, li, Value::mlp_output, m);
        watch.check(li, Value::mlp_output, m);
        add_into(branch, m);
      }
      add_into(h, branch);
      if (b.ff) {
        ops::rmsnorm(h.data(), bw.ff_norm.data(), n.data(), BT, D, s_.eps);
        Tensor m = ff_branch(s_, bw, b, n.data(), BT).reshape({B, T, D});
        visit_if(ls, li, Value::mlp_output, m);
        watch.check(li, Value::mlp_output, m);
        add_into(h, m);
      }
      visit_if(ls, li, Value::layer_output, h);
      watch.check(li, Value::layer_output, h);
    }
    cache.has_state = true;
    ops::rmsnorm(h.data(), norm_f_.data(), h.data(), BT, D, s_.eps);
    visit_if(ls, -1, Value::ln_final_output, h);
    Tensor logits;
    if (s_.lm_head_multiplier == 1.0f) {
      logits = lm_logits(lm_head_, h, ls, all_logits);
    } else {  // Falcon-H1: logits = lm_head(h) * lm_head_multiplier, served (and sampled) so
      const bool full = all_logits || (ls && ls->wants(-1, Value::logits));
      logits = lm_logits(lm_head_, h, nullptr, full);
      for (int64_t k = 0; k < logits.numel(); ++k) logits[k] *= s_.lm_head_multiplier;
      if (full) visit_if(ls, -1, Value::logits, logits);
    }
    watch.finish(logits);
    return logits;
  }

  // Gradients (src/grad/mamba2_hybrid_grad.cpp, docs/gradients.md).
  std::unique_ptr<BackwardParts> backward_parts() const override {
    auto p = std::make_unique<Mamba2HybridParts>();
    p->spec = &s_;
    p->mixer = &mixer_;
    p->mixer1 = &mixer1_;
    p->attn = &attn_;
    p->norm_f = &norm_f_;
    p->lm_head = &lm_head_;
    p->embed = &embed_;
    p->blocks = &blocks_;
    return p;
  }

  Head head() const override { return {&embed_, &norm_f_, &lm_head_, s_.eps, false, s_.lm_head_multiplier}; }
  ResidualWrite residual_write(int layer) const override {
    ResidualWrite w = FamilyModel::residual_write(layer);
    // Zamba / Zamba2 hybrid layer: the shared block feeds the mixer's input; only the mixer reaches the residual.
    if (s_.blocks[static_cast<size_t>(layer)].shared) w.added = {"linear_attn.attention_output"};
    return w;
  }

  std::vector<ValueInfo> values(int64_t B, int64_t T) const override {
    const int64_t D = s_.D;
    std::vector<ValueInfo> v;
    v.push_back(global_value(Value::embed_output, {B, T, D},
                             s_.embedding_multiplier != 1.0f ? "token embeddings * embedding_multiplier" : "token embeddings"));
    for (int i = 0; i < static_cast<int>(L_); ++i) {
      const HybridBlock& b = s_.blocks[static_cast<size_t>(i)];
      v.push_back(layer_value(i, Value::layer_input, {B, T, D}, true, "residual stream entering the block"));
      if (b.shared) {  // the shared block runs first; its values are this depth's alone
        const size_t first = v.size();
        attn_.values(i, B, T, v);
        v.push_back(layer_value(i, Value::mlp_output, {B, T, D}, true,
                                "shared block's GeGLU MLP output (before the layer's linear, which feeds the mixer input)"));
        const std::string& from = blocks_[static_cast<size_t>(i)].shared.prefix;
        const std::string note = " [shared block " + std::to_string(b.shared_block) + " at depth " +
                                 std::to_string(b.shared_depth) + ", weights from " + from +
                                 ": adapters and values this depth's own]";
        for (size_t k = first; k < v.size(); ++k) v[k].meaning += note;
      }
      if (b.mamba && mamba1()) mixer1_.values(i, B, T, v);
      else if (b.mamba) mixer_.values(i, B, T, v);
      if (b.attn) attn_.values(i, B, T, v);
      if ((b.branch_mlp || b.ff) && !b.shared) {
        std::string what = b.moe && s_.moe_kind == HybridMoeKind::jamba   ? "MoE output: routed SwiGLU experts (top-k of the router softmax)"
                           : b.moe && s_.moe_kind == HybridMoeKind::granite ? "MoE output: routed SwiGLU experts (softmax top-k) + shared SwiGLU MLP"
                           : b.moe                                        ? "MoE output: routed relu2 experts + shared expert"
                           : s_.mlp == HybridMlp::relu2                   ? "relu2 MLP output"
                           : s_.mlp_fused                                 ? "shared SwiGLU MLP output"
                                                                          : "SwiGLU MLP output";
        if (s_.residual_multiplier != 1.0f) what += " * residual_multiplier, added to the residual";
        v.push_back(layer_value(i, Value::mlp_output, {B, T, D}, true, what));
      }
      v.push_back(layer_value(i, Value::layer_output, {B, T, D}, true, "residual stream leaving the block"));
    }
    v.push_back(global_value(Value::ln_final_output, {B, T, D}, "final RMSNorm output"));
    v.push_back(global_value(Value::logits, {B, T, s_.V},
                             s_.lm_head_multiplier != 1.0f ? "lm_head logits * the µP logit multiplier (Falcon-H1 lm_head_multiplier, Granite 1 / logits_scaling)" : "lm_head logits"));
    return v;
  }

  std::map<std::string, std::map<int, std::string>> support() const override {
    std::map<std::string, std::map<int, std::string>> sup;
    std::string shared_at;  // Zamba2: where the shared blocks run
    for (int i = 0; i < static_cast<int>(L_); ++i)
      if (s_.blocks[static_cast<size_t>(i)].shared) shared_at += (shared_at.empty() ? "" : ", ") + std::to_string(i);
    if (!shared_at.empty())
      shared_at = "; " + s_.pretty + " re-applies its shared attention + MLP block at layers " + shared_at +
                  " (addressed per depth there)";
    for (int i = 0; i < static_cast<int>(L_); ++i) {
      const HybridBlock& b = s_.blocks[static_cast<size_t>(i)];
      const std::string block = "block " + std::to_string(i) + " is " + kind_phrase(b.kind);
      for (int vi = 0; vi < kNumValues; ++vi) {
        const Value val = static_cast<Value>(vi);
        const Component c = value_component(val);
        if (c == Component::linear_attn)
          sup["linear_attn." + std::string(value_name(val))][i] =
              b.mamba ? "" : block + ", which has no " + (mamba1() ? "Mamba" : "Mamba-2") + " mixer (linear_attn)" + (b.attn ? ": use self_attn values" : "");
        else if (c == Component::self_attn) {
          std::string r;
          if (!b.attn && !b.shared)
            r = block + ", which has no softmax attention (self_attn)" + (b.mamba ? ": use linear_attn values" : "") + shared_at;
          else if (val == Value::attn_gate) r = block + " whose attention has no output gate (" + s_.pretty + " attention is ungated)";
          sup["self_attn." + std::string(value_name(val))][i] = r;
        }
      }
      sup["mlp.output"][i] = (b.branch_mlp || b.ff || b.shared) ? ""
                             : !shared_at.empty() ? block + ", which has no MLP" + shared_at
                                                  : block + ", which has no MLP (" + s_.pretty + " puts its MLPs in blocks of their own)";
    }
    return sup;
  }

 private:
  bool mamba1() const { return s_.mixer == HybridMixer::mamba1; }

  // One Mamba-1 mixer call (Jamba) over the layer's cache slots; its state is served as the cache
  // holds it ([B, E, N]), a state_input / state_output write laid back in.
  Tensor mamba1_forward(int li, const BlockW& bw, const Tensor& n, const Batch& in, HybridCache& cache, Listener* ls,
                        const CallCtx& ctx) const {
    const size_t i = static_cast<size_t>(li);
    Tensor& S = cache.ssm[i];
    const auto serve = [](const Tensor& s) { return s.clone(); };
    const auto store = [](const Tensor& o, Tensor& s) { std::copy(o.begin(), o.end(), s.data()); };
    MambaMixerCall call;
    call.layer = li;
    call.conv = &cache.conv[i];
    call.chunked = ctx.kernel == "chunked";
    call.ls = ls;
    call.begin_state = [&]() -> Tensor& {
      visit_state_input(li, S, cache.has_state, ls, {s_.mamba1.E, s_.mamba1.N}, serve, store);
      return S;
    };
    call.end_state = [&] { visit_state_output(li, S, ls, serve, store); };
    return mixer1_.forward(bw.mamba1, n, in, call);
  }

  Mamba2HybridSpec s_;
  int64_t L_ = 0, config_chunk_ = 256;
  MambaMixer mixer1_;
  Mamba2Mixer mixer_;
  AttentionMixer attn_;
  Tensor embed_, norm_f_, lm_head_;
  std::vector<BlockW> blocks_;
};

}  // namespace

int64_t read_hybrid_sizes(const io::Config& cfg, Mamba2HybridSpec& s, double default_eps) {
  s.D = cfg.get<int64_t>("hidden_size");
  s.V = cfg.get<int64_t>("vocab_size");
  const int64_t L = cfg.get<int64_t>("num_hidden_layers");
  require_positive(cfg, {{"hidden_size", s.D}, {"vocab_size", s.V}, {"num_hidden_layers", L}});
  s.eps = static_cast<float>(cfg.get_double_or("rms_norm_eps", default_eps));
  if (!(s.eps > 0.0f) || !std::isfinite(s.eps)) throw ConfigError(where(cfg) + ": rms_norm_eps must be a finite number > 0");
  s.tie = cfg.get_or<bool>("tie_word_embeddings", false);
  return L;
}

void use_feed_forward_layout(Mamba2HybridSpec& s) {
  s.prefixes = {"model."};
  s.embed = "embed_tokens.weight";
  s.final_norm = "final_layernorm.weight";
  s.in_norm = "input_layernorm.weight";
  s.ff_norm = "pre_ff_layernorm.weight";
  s.mamba_mod = "mamba";
  s.attn_mod = "self_attn";
  s.mlp_mod = "feed_forward";
}

void read_hybrid_mamba1(const io::Config& cfg, Mamba2HybridSpec& s) {
  s.mixer = HybridMixer::mamba1;
  MambaMixerDims& d = s.mamba1;
  d.D = s.D;
  d.E = cfg.get_or<int64_t>("mamba_expand", 2) * s.D;
  d.N = cfg.get_or<int64_t>("mamba_d_state", 16);
  d.K = cfg.get_or<int64_t>("mamba_d_conv", 4);
  d.R = read_dt_rank(cfg, "mamba_dt_rank", s.D);
  require_positive(cfg, {{"mamba_expand * hidden_size", d.E}, {"mamba_d_state", d.N}, {"mamba_d_conv", d.K},
                         {"mamba_dt_rank", d.R}});
  d.use_conv_bias = cfg.get_or<bool>("mamba_conv_bias", true);
  d.use_bias = cfg.get_or<bool>("mamba_proj_bias", false);
}

bool read_zamba_layers(const io::Config& cfg, Mamba2HybridSpec& s, std::vector<std::string>& types, std::string& field) {
  const int64_t L = read_hybrid_sizes(cfg, s, 1e-5);
  s.tie = cfg.get_or<bool>("tie_word_embeddings", true);
  return read_layer_types(cfg, {"layers_block_type", "layer_types"}, L, types, field);
}

void read_shared_layers(const io::Config& cfg, Mamba2HybridSpec& s, const std::vector<std::string>& types,
                        const std::string& field, int64_t n_mem, LayerKind mamba_kind) {
  int64_t depth = 0;
  for (size_t i = 0; i < types.size(); ++i) {
    const std::string& t = types[i];
    HybridBlock b;
    b.mamba = true;
    if (t == "hybrid") {
      b.shared = true;
      b.kind = LayerKind::hybrid;
      b.shared_depth = depth;
      b.shared_block = depth % n_mem;
      if (depth < n_mem) s.shared_prefixes.push_back(s.prefixes.front() + "layers." + std::to_string(i) + "." + s.shared_mod);
      ++depth;
    } else if (t == "linear_attention" || t == "mamba") {
      b.kind = mamba_kind;
    } else {
      throw ConfigError(where(cfg) + ": " + field + "[" + std::to_string(i) + "] is '" + t +
                        "' (expected mamba / linear_attention or hybrid)");
    }
    s.blocks.push_back(b);
  }
}

void require_silu(const io::Config& cfg, const Mamba2HybridSpec& s) {
  const std::string act = cfg.get_or<std::string>("hidden_act", "silu");
  if (act != "silu" && act != "swish")
    throw UnsupportedError(where(cfg) + ": hidden_act '" + act + "' is not supported (" + s.pretty + " uses silu)");
}

std::unique_ptr<FamilyModel> make_mamba2_hybrid(const Mamba2HybridSpec& spec, const io::Config& cfg,
                                                const io::WeightStore& weights) {
  return std::make_unique<Mamba2Hybrid>(spec, cfg, weights);
}

}  // namespace mixlens::detail
