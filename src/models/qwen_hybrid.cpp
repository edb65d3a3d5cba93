// Gated-DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-Hybrid). Reference: transformers
// models/qwen3_5/modeling_qwen3_5.py and models/qwen3_next/modeling_qwen3_next.py
// (Qwen3_5GatedDeltaNet, Qwen3_5Attention, Qwen3_5DecoderLayer, Qwen3NextSparseMoeBlock),
// models/olmo_hybrid/modeling_olmo_hybrid.py (its decoder layers' norm placement, QwenHybridSpec);
// math in shared/spec/model-math.md §3.3, §5, §6. Everything runs in float32.
#include "models/qwen_hybrid.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "hooks/mixing.h"
#include "mixers/attention_mixer.h"
#include "mixers/gated_delta_mixer.h"
#include "mixlens/errors.h"
#include "models/common.h"
#include "models/hybrid_cache.h"
#include "ops/ops.h"

namespace mixlens::detail {

namespace {

struct Mlp {
  bool moe = false;
  int64_t I = 0;             // dense / per-expert intermediate width
  ops::RowStack gate_up;     // dense: [2I, D] (gate_proj | up_proj, two tensors multiplied as one)
  Tensor down;               // dense: [D, I]
  Tensor router;             // [E, D]
  Tensor router_bias;        // Kimi: [E] e_score_correction_bias, LFM2-MoE: expert_bias (choose experts, do not weight them)
  std::vector<ops::RowStack> expert_gate_up;  // per expert [2I, D]
  std::vector<Tensor> expert_down;            // per expert [D, I]
  ops::RowStack shared_gate_up;     // [2Is, D]
  Tensor shared_down, shared_gate;  // [D, Is], [1, D]
  int64_t Is = 0;
};

// The GDN weights (the base) are set on gated DeltaNet layers only.
struct Layer : GatedDeltaMixerWeights {
  bool linear = true;  // gated DeltaNet (else softmax attention)
  bool post_norms = false;  // QwenLayerView::post_norms
  Tensor in_norm, post_norm, ff_norm;
  AttentionMixerWeights attn;  // attention layers
  ShortConvMixerWeights sc;    // LFM2's conv layers
  LightningMixerWeights lightning;  // MiniMax's lightning layers
  Mlp mlp;
};

// Qwen3_5Attention: gated, per-head (1 + w) q / k norms, partial RoPE (rope_parameters, with the
// older top-level fields as fallback). mrope_section only matters for image/video grids: text
// positions are equal on all three rows, which makes the interleaved mrope exactly plain 1-D RoPE.
void qwen3_5_attention(const io::Config& cfg, AttentionMixerDims& ad) {
  double theta = 0.0, partial = 1.0;
  read_rope(cfg, 1.0, theta, partial);
  const int64_t rot = static_cast<int64_t>(static_cast<double>(ad.hd) * partial);
  if (rot <= 0 || rot > ad.hd || rot % 2 != 0)
    throw ConfigError(where(cfg) + ": rotary dim int(head_dim * partial_rotary_factor) = " + std::to_string(rot) +
                      " must be even and in (0, head_dim]");
  ad.rope = true;
  ad.rot = rot;
  ad.theta = theta;
  ad.gate = true;
  ad.qk_norm = AttentionQkNorm::per_head;
  ad.qk_norm_centred = true;
}

class QwenHybrid final : public FamilyModel {
 public:
  QwenHybrid(const QwenHybridSpec& spec, const io::Config& top, const io::Config& cfg, const io::WeightStore& w)
      : spec_(spec) {
    D_ = cfg.get<int64_t>("hidden_size");
    L_ = cfg.get<int64_t>("num_hidden_layers");
    V_ = cfg.get<int64_t>("vocab_size");
    require_positive(cfg, {{"hidden_size", D_}, {"num_hidden_layers", L_}, {"vocab_size", V_}});
    AttentionMixerDims ad;
    read_attention_heads(cfg, D_, ad);
    g_.D = D_;
    g_.HK = cfg.get<int64_t>("linear_num_key_heads");
    g_.HV = cfg.get<int64_t>("linear_num_value_heads");
    g_.Dk = cfg.get<int64_t>("linear_key_head_dim");
    g_.Dv = cfg.get<int64_t>("linear_value_head_dim");
    K_ = cfg.get_or<int64_t>("linear_conv_kernel_dim", 4);
    require_positive(cfg, {{"linear_num_key_heads", g_.HK}, {"linear_num_value_heads", g_.HV},
                           {"linear_key_head_dim", g_.Dk}, {"linear_value_head_dim", g_.Dv},
                           {"linear_conv_kernel_dim", K_}});
    g_.kda = spec_.kimi;
    if (g_.HV % g_.HK != 0)
      throw ConfigError(where(cfg) + ": linear_num_value_heads (" + std::to_string(g_.HV) +
                        ") is not divisible by linear_num_key_heads (" + std::to_string(g_.HK) + ")");
    eps_ = static_cast<float>(cfg.get_double_or("rms_norm_eps", 1e-6));
    topk_eps_ = spec_.lfm2 ? 1e-6f : 1e-20f;
    no_shared_ = spec_.lfm2 || spec_.minimax;  // Lfm2MoeSparseMoeBlock, MiniMaxSparseMoeBlock
    if (!(eps_ > 0.0f) || !std::isfinite(eps_))
      throw ConfigError(where(cfg) + ": rms_norm_eps must be a finite number > 0");
    const std::string act = cfg.get_or<std::string>("hidden_act", "silu");
    if (act != "silu" && act != "swish")
      throw UnsupportedError(where(cfg) + ": hidden_act '" + act + "' is not supported (" + spec_.family + " uses silu)");

    // layer_types as given; transformers' own default (every full_attention_interval-th block) only
    // when the field is absent.
    std::vector<std::string> types;
    if (cfg.has("layer_types") && !cfg.is_null("layer_types")) {
      types = cfg.get<std::vector<std::string>>("layer_types");
      if (static_cast<int64_t>(types.size()) != L_)
        throw ConfigError(where(cfg) + ": layer_types has " + std::to_string(types.size()) +
                          " entries but num_hidden_layers is " + std::to_string(L_));
    } else {
      const int64_t every = cfg.get_or<int64_t>("full_attention_interval", 4);
      require_positive(cfg, {{"full_attention_interval", every}});
      for (int64_t i = 0; i < L_; ++i) types.push_back((i + 1) % every == 0 ? "full_attention" : "linear_attention");
    }
    for (size_t i = 0; i < types.size(); ++i)
      if (types[i] != "linear_attention" && types[i] != "full_attention")
        throw ConfigError(where(cfg) + ": layer_types[" + std::to_string(i) + "] is '" + types[i] +
                          "' (expected 'linear_attention' or 'full_attention')");

    ad.D = D_;
    ad.eps = eps_;
    (spec_.attention ? spec_.attention : qwen3_5_attention)(cfg, ad);
    attn_ = AttentionMixer(ad, where(cfg));

    // MoE fields (Qwen3-Next; absent in dense Qwen3.5).
    const int64_t E = cfg.get_or<int64_t>("num_experts", 0);
    const int64_t sparse_step = cfg.get_or<int64_t>("decoder_sparse_step", 1);
    const auto mlp_only = cfg.get_or<std::vector<int64_t>>("mlp_only_layers", {});
    if (E > 0) {
      topk_ = cfg.get<int64_t>("num_experts_per_tok");
      require_positive(cfg, {{"num_experts_per_tok", topk_}, {"decoder_sparse_step", sparse_step}});
      if (topk_ > E)
        throw ConfigError(where(cfg) + ": num_experts_per_tok (" + std::to_string(topk_) + ") exceeds num_experts (" +
                          std::to_string(E) + ")");
      norm_topk_ = cfg.get_or<bool>("norm_topk_prob", true);
      // Post-norm blocks' backward recomputes a dense MLP only; no family pairs them with experts.
      if (spec_.attention_post_norms)
        throw UnsupportedError(where(cfg) + ": " + spec_.family + " with num_experts > 0 (a sparse MoE after its "
                               "post-norm attention blocks) is not supported");
      if (spec_.kimi || spec_.lfm2) {  // KimiLinearTopkRouter; Lfm2MoeTopKRouter is its one-group case
        n_group_ = cfg.get_or<int64_t>("n_group", 1);
        topk_group_ = cfg.get_or<int64_t>("topk_group", 1);
        routed_scale_ = static_cast<float>(cfg.get_double_or("routed_scaling_factor", 1.0));
        require_positive(cfg, {{"n_group", n_group_}, {"topk_group", topk_group_}});
        if (E % n_group_ != 0 || topk_group_ > n_group_ || E / n_group_ < 2)
          throw ConfigError(where(cfg) + ": num_experts (" + std::to_string(E) + ") must split into n_group (" +
                            std::to_string(n_group_) + ") groups of at least 2, and topk_group <= n_group");
      }
    }

    gdn_ = GatedDeltaMixer(g_, K_, eps_, spec_.gdn);
    conv_ = ShortConvMixer(D_, K_, spec_.conv_bias);
    block_size_ = cfg.get_or<int64_t>("block_size", 256);
    if (spec_.minimax) lightning_ = LightningMixer({D_, ad.H, ad.hd, L_, block_size_, 1e-6f}, where(cfg));
    // Weights: published VLM checkpoints keep the text model under model.language_model.
    const std::string p = w.has("model.language_model.embed_tokens.weight") ? "model.language_model." : "model.";
    const bool tie = cfg.get_or<bool>("tie_word_embeddings", top.get_or<bool>("tie_word_embeddings", false));
    embed_ = w.get_matmul(p + "embed_tokens.weight", {V_, D_});
    norm_ = w.get(p + spec_.final_norm + ".weight", {D_});
    lm_head_ = tie ? embed_ : w.get_matmul("lm_head.weight", {V_, D_});
    const int64_t I = cfg.get_or<int64_t>("intermediate_size", 0);
    layers_.resize(static_cast<size_t>(L_));
    for (int64_t i = 0; i < L_; ++i) {
      const std::string lp = p + "layers." + std::to_string(i) + ".";
      Layer& l = layers_[static_cast<size_t>(i)];
      l.linear = types[static_cast<size_t>(i)] == "linear_attention";
      l.post_norms = !l.linear && spec_.attention_post_norms;
      if (l.post_norms)
        l.ff_norm = block_norm(w, lp, "post_feedforward_layernorm");
      else
        l.in_norm = block_norm(w, lp, "input_layernorm");
      l.post_norm = block_norm(w, lp, "post_attention_layernorm");
      if (l.linear && spec_.lfm2) {
        conv_.load(w, lp + "conv.", l.sc);
      } else if (l.linear && spec_.minimax) {
        l.lightning = lightning_.load(w, lp + "self_attn.", static_cast<int>(i));
      } else if (l.linear) {
        const std::string m = lp + (spec_.kimi ? "self_attn." : "linear_attn.");
        l.in_proj = spec_.load_gdn_in_proj(w, m, g_);
        // Each part was read at its checked shape; the stack must cover the mixer's rows exactly.
        if (l.in_proj.size(0) != g_.proj_rows())
          throw Error(m + ": the input projections stack to " + std::to_string(l.in_proj.size(0)) + " rows, not " +
                      std::to_string(g_.proj_rows()));
        gdn_.load(w, m, l);
      } else {
        l.attn = attn_.load(w, lp + "self_attn.");
      }
      const bool moe = E > 0 && std::find(mlp_only.begin(), mlp_only.end(), i) == mlp_only.end() &&
                       (i + 1) % sparse_step == 0;
      const std::string mp = lp + (spec_.kimi || spec_.minimax ? "block_sparse_moe." : spec_.lfm2 ? "feed_forward." : "mlp.");
      const bool w123 = spec_.kimi || spec_.lfm2 || spec_.minimax;  // published names: w1 gate, w3 up, w2 down
      if (moe) {
        Mlp& x = l.mlp;
        x.moe = true;
        x.I = cfg.get<int64_t>("moe_intermediate_size");
        x.Is = no_shared_ ? 0 : cfg.get<int64_t>("shared_expert_intermediate_size");
        require_positive(cfg, {{"moe_intermediate_size", x.I}});
        if (!no_shared_) require_positive(cfg, {{"shared_expert_intermediate_size", x.Is}});
        x.router = w.get(mp + "gate.weight", {E, D_});
        if (spec_.kimi) x.router_bias = w.get(mp + "gate.e_score_correction_bias", {E});
        // use_expert_bias false: zero biases choose exactly as the plain top-k does.
        if (spec_.lfm2) x.router_bias = cfg.get_or<bool>("use_expert_bias", true) ? w.get(mp + "expert_bias", {E}) : Tensor({E});
        // transformers 5.18 save_pretrained and the published files store one tensor per expert;
        // fused [E, 2I, D] / [E, D, I] tensors (the in-memory layout) are accepted too.
        const bool fused = w.has(mp + "experts.gate_up_proj");
        Tensor gu_all, down_all;  // fused: each expert a view of its rows (narrow weights stay narrow)
        if (fused) {
          gu_all = w.get_matmul(mp + "experts.gate_up_proj", {E, 2 * x.I, D_});
          down_all = w.get_matmul(mp + "experts.down_proj", {E, D_, x.I});
        }
        for (int64_t e = 0; e < E; ++e) {
          if (fused) {
            x.expert_gate_up.emplace_back(row_block(gu_all, e * 2 * x.I, {2 * x.I, D_}));
            x.expert_down.push_back(row_block(down_all, e * D_, {D_, x.I}));
          } else {
            const std::string ep = mp + "experts." + std::to_string(e) + ".";
            const char* gate = w123 ? "w1.weight" : "gate_proj.weight";
            const char* up = w123 ? "w3.weight" : "up_proj.weight";
            const char* down = w123 ? "w2.weight" : "down_proj.weight";
            x.expert_gate_up.push_back(ops::RowStack({w.get_matmul(ep + gate, {x.I, D_}), w.get_matmul(ep + up, {x.I, D_})}));
            x.expert_down.push_back(w.get_matmul(ep + down, {D_, x.I}));
          }
        }
        const std::string sp = mp + (spec_.kimi ? "shared_experts." : "shared_expert.");
        if (no_shared_) continue;
        x.shared_gate_up = ops::RowStack({w.get_matmul(sp + "gate_proj.weight", {x.Is, D_}),
                                     w.get_matmul(sp + "up_proj.weight", {x.Is, D_})});
        x.shared_down = w.get_matmul(sp + "down_proj.weight", {D_, x.Is});
        if (!spec_.kimi) x.shared_gate = w.get(mp + "shared_expert_gate.weight", {1, D_});
      } else {
        require_positive(cfg, {{"intermediate_size", I}});
        l.mlp.I = I;
        l.mlp.gate_up = ops::RowStack({w.get_matmul(mp + (spec_.lfm2 ? "w1.weight" : "gate_proj.weight"), {I, D_}),
                                  w.get_matmul(mp + (spec_.lfm2 ? "w3.weight" : "up_proj.weight"), {I, D_})});
        l.mlp.down = w.get_matmul(mp + (spec_.lfm2 ? "w2.weight" : "down_proj.weight"), {D_, I});
      }
    }
    info.family = spec_.family;
    info.model_type = top.get<std::string>("model_type");
    info.num_layers = static_cast<int>(L_);
    info.hidden_size = D_;
    info.vocab_size = V_;
    const LayerKind lin = spec_.lfm2 ? LayerKind::short_conv : spec_.minimax ? LayerKind::lightning : LayerKind::gated_deltanet;
    for (const auto& l : layers_) info.layer_kinds.push_back(l.linear ? lin : LayerKind::attention);
  }

  std::unique_ptr<CacheState> new_cache(int64_t batch) const override {
    std::vector<bool> is_mixer;
    for (const Layer& l : layers_) is_mixer.push_back(l.linear);
    if (spec_.lfm2)  // the conv window is the whole state (no ssm rows beyond a placeholder)
      return std::make_unique<HybridCache>(batch, is_mixer, K_, D_, Shape{1});
    if (spec_.minimax)  // the kv state is the whole state (no conv window beyond a placeholder)
      return std::make_unique<HybridCache>(batch, is_mixer, 1, 1, lightning_.state_shape());
    return std::make_unique<HybridCache>(batch, is_mixer, K_, g_.conv_dim(), Shape{g_.HV, g_.Dk, g_.Dv});
  }

  std::string kernel_for(const CacheState& cache, int64_t seq) const override {
    if (spec_.lfm2) return "recurrent";  // the one kernel (route_kernels refuses 'chunked': registry.cpp)
    // MiniMaxLightningAttention takes its token loop on every call with a cached state (continuations too).
    if (spec_.minimax && static_cast<const HybridCache&>(cache).has_state) return hybrid_kernel(spec_.family, cache, 1);
    return hybrid_kernel(spec_.family, cache, seq);
  }

  Tensor forward(const Batch& in, CacheState& cache_base, Listener* ls, const CallCtx& ctx,
                 bool all_logits) const override {
    auto& cache = static_cast<HybridCache&>(cache_base);
    const int64_t B = in.batch, T = in.seq, BT = B * T;
    const std::vector<int64_t> pos = cache.advance_positions(in);
    Tensor h = embed_tokens(embed_, in, spec_.family.c_str());
    visit_if(ls, -1, Value::embed_output, h);
    FiniteWatch watch(spec_.family);
    watch.check(-1, Value::embed_output, h);
    // create_recurrent_attention_mask: GDN input masked only for multi-token calls with padding.
    const bool masked = T > 1 && in.has_padding();
    Tensor n = Tensor::uninitialized({B, T, D_});  // every buffer below is written whole: no zero-fill pass
    for (int64_t i = 0; i < L_; ++i) {
      const int li = static_cast<int>(i);
      const Layer& l = layers_[static_cast<size_t>(i)];
      ctx.check_cancel();
      visit_if(ls, li, Value::layer_input, h);
      if (l.post_norms)  // the mixer reads the residual itself (a copy: h is added to in place below)
        std::memcpy(n.data(), h.data(), sizeof(float) * static_cast<size_t>(h.numel()));
      else
        norm_rows(h, l.in_norm, n);
      if (i == L_ - 1 && last_rows_only(ls, ctx, all_logits, T)) {
        h = last_block_on_last_rows(li, l, h, n, in, masked, pos, cache, ls, ctx, watch);
        break;
      }
      Tensor out = l.linear ? gdn(li, l, n, in, masked, cache, ls, ctx) : attention(li, l, n, in, pos, cache, ls, ctx.tape);
      watch.check(li, l.linear ? Value::attention_output : Value::attn_output, out);
      // A gradient call keeps the mixer output as added (after writes) and the dense MLP's gate|up product
      // (with the GDN in_proj and the attention projections, the products its backward would otherwise recompute).
      if (ctx.tape) ctx.tape->keep(li, grad::Kept::mixer_output, out);
      if (l.post_norms) out = normed(out, l.post_norm);  // not in place: the tape keeps out
      if (spec_.minimax) scaled_residual(h, n, out, l.linear ? spec_.factors.linear_alpha : spec_.factors.full_alpha,
                                         l.linear ? spec_.factors.linear_beta : spec_.factors.full_beta);
      else add_into(h, out);
      if (!l.post_norms) norm_rows(h, l.post_norm, n);
      const Tensor& mlp_in = l.post_norms ? h : n;
      Tensor gu_kept;
      Tensor m = (l.mlp.moe ? moe(l.mlp, mlp_in)
                            : dense(l.mlp.gate_up, l.mlp.down, l.mlp.I, mlp_in.data(), BT, ctx.tape ? &gu_kept : nullptr))
                     .reshape({B, T, D_});
      if (gu_kept.defined()) ctx.tape->keep(li, grad::Kept::mlp_gate_up, gu_kept);
      visit_if(ls, li, Value::mlp_output, m);
      watch.check(li, Value::mlp_output, m);
      if (l.post_norms) {
        if (ctx.tape) ctx.tape->keep(li, grad::Kept::mlp_output, m);
        m = normed(m, l.ff_norm);
      }
      if (spec_.minimax) scaled_residual(h, n, m, spec_.factors.mlp_alpha, spec_.factors.mlp_beta);
      else add_into(h, m);
      visit_if(ls, li, Value::layer_output, h);
      watch.check(li, Value::layer_output, h);
    }
    cache.has_state = true;
    norm_rows(h, norm_, h);
    visit_if(ls, -1, Value::ln_final_output, h);
    Tensor logits = lm_logits(lm_head_, h, ls, all_logits);
    watch.finish(logits);
    return logits;
  }

  // Gradients (src/grad/qwen_hybrid_grad.cpp and the mixers' backwards, docs/gradients.md).
  std::unique_ptr<BackwardParts> backward_parts() const override {
    auto parts = std::make_unique<QwenHybridParts>();
    QwenHybridParts& bb = *parts;
    bb.norm = &norm_;
    bb.centred = spec_.centred_norms;
    bb.lm_head = &lm_head_;
    bb.eps = eps_;
    bb.D = D_;
    bb.L = L_;
    bb.V = V_;
    bb.attn = &attn_;
    if (spec_.lfm2) bb.conv = &conv_;
    if (spec_.minimax) bb.lightning = &lightning_;
    bb.normed_residual = spec_.minimax;
    for (const Layer& l : layers_) {
      QwenLayerView v;
      v.linear = l.linear;
      v.post_norms = l.post_norms;
      v.in_norm = &l.in_norm;
      v.post_norm = &l.post_norm;
      v.ff_norm = &l.ff_norm;
      if (l.linear && spec_.lfm2) {
        v.sc = &l.sc;
      } else if (l.linear && spec_.minimax) {
        v.lightning = &l.lightning;
      } else if (l.linear) {
        v.gdn = {D_, g_.HK, g_.HV, g_.Dk, g_.Dv, K_, gdn_.norm_eps(), gdn_.beta_scale(), &l.in_proj, &l.conv_wT, &l.neg_A, &l.dt_bias, &l.gnorm, &l.out_proj};
        v.gdn.kda = g_.kda;
        v.gdn.f_b = &l.f_b;
        v.gdn.g_b = &l.g_b;
      } else {
        v.attn = &l.attn;
      }
      const auto& f = spec_.factors;
      v.mix_alpha = l.linear ? f.linear_alpha : f.full_alpha;
      v.mix_beta = l.linear ? f.linear_beta : f.full_beta;
      v.mlp_alpha = f.mlp_alpha;
      v.mlp_beta = f.mlp_beta;
      const Mlp& m = l.mlp;
      v.mlp.moe = m.moe;
      v.mlp.D = D_;
      v.mlp.I = m.I;
      v.mlp.Is = m.Is;
      v.mlp.topk = topk_;
      v.mlp.norm_topk = norm_topk_;
      v.mlp.gate_up = &m.gate_up;
      v.mlp.down = &m.down;
      v.mlp.router = &m.router;
      v.mlp.expert_gate_up = &m.expert_gate_up;
      v.mlp.expert_down = &m.expert_down;
      v.mlp.shared_gate_up = &m.shared_gate_up;
      v.mlp.shared_down = &m.shared_down;
      v.mlp.shared_gate = &m.shared_gate;
      if ((spec_.kimi || spec_.lfm2) && m.moe) {  // KimiLinearTopkRouter (route_sigmoid); LFM2-MoE's is its one-group case
        v.mlp.router_bias = &m.router_bias;
        v.mlp.n_group = n_group_;
        v.mlp.topk_group = topk_group_;
        v.mlp.routed_scale = routed_scale_;
        v.mlp.topk_eps = topk_eps_;
      }
      bb.layers.push_back(v);
    }
    return parts;
  }

  MixerConsts mixer_consts(int li) const override {
    const Layer& l = layers_[static_cast<size_t>(li)];
    if (!spec_.lfm2 || !l.linear) return {};
    return {{}, l.sc.conv_wT, conv_.bias() ? l.sc.conv_bias : Tensor(), {}};
  }
  Head head() const override { return {&embed_, &norm_, &lm_head_, eps_, spec_.centred_norms}; }
  ResidualWrite residual_write(int layer) const override {
    ResidualWrite w = FamilyModel::residual_write(layer);
    if (spec_.minimax)
      w.why = "MiniMaxDecoderLayer re-norms the residual (h = alpha * norm(h) + beta * branch): the block's change "
              "is not a sum of its outputs";
    else if (layers_[static_cast<size_t>(layer)].post_norms)
      w.why = "a post-norm attention block adds post_attention_layernorm(self_attn.attention_output) and "
              "post_feedforward_layernorm(mlp.output), not the served outputs";
    return w;
  }

  std::vector<ValueInfo> values(int64_t B, int64_t T) const override {
    const int64_t HV = g_.HV, Dk = g_.Dk, Dv = g_.Dv;
    std::vector<ValueInfo> v;
    v.push_back(global_value(Value::embed_output, {B, T, D_}, "token embeddings (embed_tokens)"));
    for (int i = 0; i < static_cast<int>(L_); ++i) {
      v.push_back(layer_value(i, Value::layer_input, {B, T, D_}, true, "residual stream entering the decoder layer"));
      if (layers_[static_cast<size_t>(i)].linear && spec_.lfm2) {
        conv_.values(i, B, T, v);
      } else if (layers_[static_cast<size_t>(i)].linear && spec_.minimax) {
        lightning_.values(i, B, T, v);
      } else if (layers_[static_cast<size_t>(i)].linear) {
        v.push_back(layer_value(i, Value::attention_queries, {B, T, HV, Dk}, true,
                                "q after conv+SiLU and head repetition, before the in-kernel L2 norm; a write is used per value head"));
        v.push_back(layer_value(i, Value::attention_keys, {B, T, HV, Dk}, true,
                                "k after conv+SiLU and head repetition, before the in-kernel L2 norm; a write is used per value head"));
        v.push_back(layer_value(i, Value::attention_values, {B, T, HV, Dv}, true, "v after conv+SiLU"));
        v.push_back(layer_value(i, Value::betas, {B, T, HV}, true,
                                gdn_.beta_scale() == 1.0f ? "beta = sigmoid(b); independent of decays"
                                                          : "beta = 2 * sigmoid(b) (linear_allow_neg_eigval); independent of decays"));
        if (g_.kda)
          v.push_back(layer_value(i, Value::decays, {B, T, HV, Dk}, true,
                                  "g per key channel = -exp(A_log) * softplus(f_b_proj(f_a_proj(x)) + dt_bias), <= 0"));
        else
          v.push_back(layer_value(i, Value::decays, {B, T, HV}, true, "g = -exp(A_log) * softplus(a + dt_bias), <= 0"));
        v.push_back(layer_value(i, Value::state_input, {B, HV, Dk, Dv}, true, "recurrent state the call starts from; None on a fresh prompt"));
        auto s = layer_value(i, Value::states, {B, T, HV, Dk, Dv}, false, "recurrent state after every token (computed only when asked)");
        s.writable = false;
        v.push_back(s);
        v.push_back(layer_value(i, Value::state_output, {B, HV, Dk, Dv}, true, "recurrent state after the call's last token (goes to the cache)"));
        v.push_back(layer_value(i, Value::attention_head_outputs, {B, T, HV, Dv}, true, "gated delta rule output per value head, before the gated RMSNorm"));
        add_mixing_values(i, B, T, HV, Dk, "nothing (no skip)", v);
        v.push_back(layer_value(i, Value::attention_output, {B, T, D_}, true, "out_proj(gated RMSNorm(o, z)), added to the residual"));
      } else {
        attn_.values(i, B, T, v);
        if (layers_[static_cast<size_t>(i)].post_norms)  // attn_output is the mixer's last entry
          v.back().meaning = "o_proj(attention), before post_attention_layernorm (the normed output is added to the residual)";
      }
      const Layer& l = layers_[static_cast<size_t>(i)];
      v.push_back(layer_value(i, Value::mlp_output, {B, T, D_}, true,
                              l.mlp.moe ? (no_shared_ ? "sparse MoE output (no shared expert)" : "sparse MoE + gated shared expert output")
                              : l.post_norms ? "SwiGLU MLP output, before post_feedforward_layernorm" : "SwiGLU MLP output"));
      v.push_back(layer_value(i, Value::layer_output, {B, T, D_}, true, "residual stream leaving the decoder layer"));
    }
    v.push_back(global_value(Value::ln_final_output, {B, T, D_},
                             spec_.centred_norms ? "final zero-centred RMSNorm output (norm)" : "final RMSNorm output (norm)"));
    v.push_back(global_value(Value::logits, {B, T, V_}, "lm_head logits"));
    return v;
  }

  void set_chunk_size(int64_t c) override {
    if (spec_.minimax) {  // the lightning blocks' block size (0: block_size again)
      if (c < 0) throw InputError("set_chunk_size(" + std::to_string(c) + "): must be >= 0");
      lightning_.set_chunk(c == 0 ? block_size_ : c);
      return;
    }
    if (c != 0 && spec_.lfm2)
      throw UnsupportedError("set_chunk_size(" + std::to_string(c) + "): " + info.family +
                             "'s short conv has no chunks (one token loop); per-token states are served on any call");
    if (c != 0)
      throw UnsupportedError("set_chunk_size(" + std::to_string(c) + "): " + info.family +
                             "'s gated delta rule runs chunks of 64 tokens, fixed as in transformers' " +
                             (spec_.kimi ? "chunk_kimi_delta_attention" : "torch_chunk_gated_delta_rule") +
                             "; per-token states are served on any chunk (0 keeps the default)");
  }
  int64_t key_head_repeat() const override { return g_.HV / g_.HK; }

  std::map<std::string, std::map<int, std::string>> support() const override {
    std::map<std::string, std::map<int, std::string>> s;
    for (int i = 0; i < static_cast<int>(L_); ++i) {
      const bool lin = layers_[static_cast<size_t>(i)].linear;
      // Kimi: the delta rule's per-key-channel variant and latent attention, named so a reader knows which.
      const std::string block = "block " + std::to_string(i) +
                                (lin && spec_.lfm2 ? std::string(" is a short_conv block")
                                 : lin && spec_.minimax ? std::string(" is a lightning block")
                                 : lin ? std::string(" is a gated_deltanet block") + (spec_.kimi ? " (Kimi Delta Attention)" : "")
                                     : std::string(" is an attention block") + (spec_.kimi ? " (latent attention)" : ""));
      for (int vi = 0; vi < kNumValues; ++vi) {
        const Value val = static_cast<Value>(vi);
        const Component c = value_component(val);
        if (c == Component::linear_attn)
          s["linear_attn." + std::string(value_name(val))][i] =
              !lin ? block + " (softmax self_attn), which has no recurrent state: use self_attn values"
              : spec_.lfm2 && (val == Value::betas || val == Value::decays)
                  ? block + " (LFM2's gated short conv): nothing scales its writes or decays its window, which shifts "
                    "one token a step through fixed conv weights; B and C gate per channel (attention_keys / attention_queries)"
              : spec_.minimax && val == Value::betas
                  ? block + " (MiniMax lightning attention): every token writes k v^T unscaled (no write strength, "
                    "no delta rule); the decay is decays, one constant per head"
                  : "";
        else if (c == Component::self_attn)
          s["self_attn." + std::string(value_name(val))][i] =
              lin ? block + " (recurrent mixer linear_attn), not softmax attention: use linear_attn values"
              : val == Value::attn_gate && !attn_.dims().gate
                  ? block + " whose attention has no output gate (" + info.family + " attention is ungated)"
                  : "";
      }
      s["mlp.output"][i] = "";
    }
    return s;
  }

 private:
  // The last block feeds only the LM head: when only the last position's logits are returned and
  // nothing of the call is observed (no listener wants any value now: the mask only changes inside
  // a visit, and none is left), its rows at earlier positions feed nothing (llama.cpp prunes them
  // too). Checked after the block's layer_input visit.
  static bool last_rows_only(Listener* ls, const CallCtx& ctx, bool all_logits, int64_t T) {
    if (all_logits || ctx.tape || T < 2) return false;
    return !ls || std::all_of(ls->mask().begin(), ls->mask().end(), [](uint32_t w) { return w == 0; });
  }

  // The last block for the last row of each sequence ([B,1,D] out): the mixer still runs on every
  // row where later calls need it (an attention block's keys and values go to the cache, a GDN's
  // scan makes the state), but the queries, attention, o_proj (attention blocks) and the MLP run on
  // B rows instead of B*T. Each kept row is computed by the same per-row operations as in the full
  // block, up to the matmul kernel chosen for B rows.
  Tensor last_block_on_last_rows(int li, const Layer& l, const Tensor& h, const Tensor& n, const Batch& in,
                                 bool masked, const std::vector<int64_t>& pos, HybridCache& cache, Listener* ls,
                                 const CallCtx& ctx, FiniteWatch& watch) const {
    const int64_t B = in.batch, T = in.seq;
    Tensor out = l.linear ? gdn(li, l, n, in, masked, cache, ls, ctx) : attention(li, l, n, in, pos, cache, ls, nullptr, true);
    const int64_t ot = out.size(1);  // T (GDN) or 1 (attention on the last rows)
    watch.check(li, l.linear ? Value::attention_output : Value::attn_output, out);
    if (l.post_norms) out = normed(out, l.post_norm);
    Tensor hl = Tensor::uninitialized({B, 1, D_}), nl = Tensor::uninitialized({B, 1, D_});
    const float fa = l.linear ? spec_.factors.linear_alpha : spec_.factors.full_alpha;
    const float fb = l.linear ? spec_.factors.linear_beta : spec_.factors.full_beta;
    for (int64_t b = 0; b < B; ++b) {
      const float* hr = (spec_.minimax ? n : h).data() + (b * T + T - 1) * D_;  // MiniMax: the normed input is the residual
      const float* orow = out.data() + (b * ot + ot - 1) * D_;
      float* y = hl.data() + b * D_;
      if (spec_.minimax)
        for (int64_t e = 0; e < D_; ++e) y[e] = hr[e] * fa + orow[e] * fb;  // scaled_residual's operation
      else
        for (int64_t e = 0; e < D_; ++e) y[e] = hr[e] + orow[e];  // add_into's operation
    }
    if (!l.post_norms) norm_rows(hl, l.post_norm, nl);
    const Tensor& mlp_in = l.post_norms ? hl : nl;
    Tensor m = l.mlp.moe ? moe(l.mlp, mlp_in) : dense(l.mlp.gate_up, l.mlp.down, l.mlp.I, mlp_in.data(), B);
    watch.check(li, Value::mlp_output, m);
    if (l.post_norms) norm_rows(m, l.ff_norm, m);
    if (spec_.minimax) scaled_residual(hl, nl, m, spec_.factors.mlp_alpha, spec_.factors.mlp_beta);
    else add_into(hl, m);
    watch.check(li, Value::layer_output, hl);
    return hl;
  }

  // Layer `lp`'s norm `name`.weight, or its stored alias (QwenHybridSpec::norm_aliases) when absent.
  Tensor block_norm(const io::WeightStore& w, const std::string& lp, const std::string& name) const {
    if (!w.has(lp + name + ".weight"))
      for (const auto& [module, stored] : spec_.norm_aliases)
        if (module == name && w.has(lp + stored + ".weight")) return w.get(lp + stored + ".weight", {D_});
    return w.get(lp + name + ".weight", {D_});
  }

  // MiniMaxDecoderLayer's residual: h = residual * alpha + x * beta, the residual being the normed
  // block input n (not h).
  static void scaled_residual(Tensor& h, const Tensor& n, const Tensor& x, float alpha, float beta) {
    float* hp = h.data();
    const float *np = n.data(), *xp = x.data();
    const int64_t cols = h.size(-1);
    ops::parallel_rows(h.numel() / cols, cols, [&](int64_t r0, int64_t r1) {
      for (int64_t k = r0 * cols; k < r1 * cols; ++k) hp[k] = np[k] * alpha + xp[k] * beta;
    });
  }

  static void add_into(Tensor& h, const Tensor& x) {
    float* hp = h.data();
    const float* xp = x.data();
    const int64_t cols = h.size(-1);
    ops::parallel_rows(h.numel() / cols, cols, [&](int64_t r0, int64_t r1) {
      for (int64_t k = r0 * cols; k < r1 * cols; ++k) hp[k] += xp[k];
    });
  }

  Tensor normed(Tensor& x, const Tensor& w) const {
    Tensor y = Tensor::uninitialized(x.shape());
    norm_rows(x, w, y);
    return y;
  }

  // RMSNorm ((1 + w) or w, QwenHybridSpec::centred_norms) of every row of x [.., D] into y (in place
  // allowed), rows spread on the pool.
  void norm_rows(Tensor& x, const Tensor& w, Tensor& y) const {
    const float* xp = x.data();
    float* yp = y.data();
    ops::parallel_rows(x.numel() / D_, D_, [&](int64_t r0, int64_t r1) {
      ops::rmsnorm(xp + r0 * D_, w.data(), yp + r0 * D_, r1 - r0, D_, eps_, spec_.centred_norms);
    });
  }

  // SwiGLU with gate|up fused in one product: down(silu(gate x) * up x).
  // `gu_out`: receives the gate|up product (kept for a backward).
  Tensor dense(const ops::RowStack& gate_up, const Tensor& down, int64_t I, const float* x, int64_t rows,
               Tensor* gu_out = nullptr) const {
    Tensor gu = Tensor::uninitialized({rows, 2 * I}), act = Tensor::uninitialized({rows, I}), out = Tensor::uninitialized({rows, D_});
    if (gu_out) *gu_out = gu;
    ops::linear(x, rows, D_, gate_up, gu.data());
    ops::parallel_rows(rows, I, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)  // up * silu(gate), vectorized
        ops::mul_silu(gu.data() + r * 2 * I + I, gu.data() + r * 2 * I, act.data() + r * I, I);
    });
    ops::linear(act.data(), rows, I, down, out.data());
    return out;
  }

  // Qwen3NextSparseMoeBlock: softmax router (fp32), top-k, optional renormalisation, experts on the
  // tokens routed to them, plus sigmoid(shared_expert_gate x) * shared_expert(x).
  Tensor moe(const Mlp& m, const Tensor& n) const {
    const int64_t rows = n.size(0) * n.size(1), E = m.router.size(0);
    Tensor logits({rows, E});
    ops::linear(n.data(), rows, D_, m.router, logits.data());
    std::vector<std::vector<std::pair<int64_t, float>>> routed(static_cast<size_t>(E));
    std::vector<int64_t> idx(static_cast<size_t>(E));
    std::vector<float> p(static_cast<size_t>(E));
    for (int64_t r = 0; r < rows && m.router_bias.defined(); ++r) route_sigmoid(m, logits.data() + r * E, E, r, routed);
    for (int64_t r = 0; r < rows && !m.router_bias.defined(); ++r) {
      const float* lg = logits.data() + r * E;
      const float mx = *std::max_element(lg, lg + E);
      float sum = 0.0f;
      for (int64_t e = 0; e < E; ++e) sum += (p[static_cast<size_t>(e)] = std::exp(lg[e] - mx));
      for (auto& x : p) x /= sum;
      std::iota(idx.begin(), idx.end(), 0);
      // torch.topk order: largest first; ties to the lower index.
      std::partial_sort(idx.begin(), idx.begin() + topk_, idx.end(), [&](int64_t a, int64_t b) {
        return p[static_cast<size_t>(a)] > p[static_cast<size_t>(b)] || (p[static_cast<size_t>(a)] == p[static_cast<size_t>(b)] && a < b);
      });
      float tot = 0.0f;
      for (int64_t k = 0; k < topk_; ++k) tot += p[static_cast<size_t>(idx[static_cast<size_t>(k)])];
      for (int64_t k = 0; k < topk_; ++k) {
        const int64_t e = idx[static_cast<size_t>(k)];
        routed[static_cast<size_t>(e)].push_back({r, norm_topk_ ? p[static_cast<size_t>(e)] / tot : p[static_cast<size_t>(e)]});
      }
    }
    Tensor out = m.Is > 0 ? dense(m.shared_gate_up, m.shared_down, m.Is, n.data(), rows) : Tensor({rows, D_});
    Tensor sg({rows, 1});
    if (m.shared_gate.defined()) ops::linear(n.data(), rows, D_, m.shared_gate, sg.data());
    for (int64_t r = 0; r < rows && m.shared_gate.defined(); ++r) {
      const float s = ops::sigmoid(sg[r]);
      for (int64_t d = 0; d < D_; ++d) out[r * D_ + d] *= s;
    }
    for (int64_t e = 0; e < E; ++e) {
      const auto& toks = routed[static_cast<size_t>(e)];
      if (toks.empty()) continue;
      const int64_t nt = static_cast<int64_t>(toks.size());
      Tensor xs({nt, D_});
      for (int64_t k = 0; k < nt; ++k)
        std::memcpy(xs.data() + k * D_, n.data() + toks[static_cast<size_t>(k)].first * D_, sizeof(float) * static_cast<size_t>(D_));
      Tensor y = dense(m.expert_gate_up[static_cast<size_t>(e)], m.expert_down[static_cast<size_t>(e)], m.I, xs.data(), nt);
      for (int64_t k = 0; k < nt; ++k) {
        const auto& [r, wgt] = toks[static_cast<size_t>(k)];
        for (int64_t d = 0; d < D_; ++d) out[r * D_ + d] += wgt * y[k * D_ + d];
      }
    }
    return out;
  }

  // KimiLinearTopkRouter for one token's router logits lg [E]: scores sigmoid(lg); expert groups ranked
  // by the sum of their two best biased scores (scores + e_score_correction_bias), the topk_group best
  // kept; the top-k biased scores among those choose the experts, weighted by their unbiased scores
  // (renormalised with + 1e-20 when norm_topk_prob) times routed_scaling_factor. Lfm2MoeTopKRouter is
  // the one-group case with expert_bias and + 1e-6.
  void route_sigmoid(const Mlp& m, const float* lg, int64_t E, int64_t r,
                  std::vector<std::vector<std::pair<int64_t, float>>>& routed) const {
    std::vector<float> sc(static_cast<size_t>(E)), w(static_cast<size_t>(topk_));
    const std::vector<int64_t> chosen = sigmoid_topk_route(lg, m.router_bias.data(), E, n_group_, topk_group_, topk_,
                                                           norm_topk_, topk_eps_, routed_scale_, sc.data(), w.data());
    for (size_t k = 0; k < chosen.size(); ++k) routed[static_cast<size_t>(chosen[k])].push_back({r, w[k]});
  }

  // Gated DeltaNet mixer (src/mixers/gated_delta_mixer.cpp).
  // LFM2: the gated short conv mixer (src/mixers/short_conv_mixer.cpp) in its place.
  Tensor gdn(int li, const Layer& l, const Tensor& n_in, const Batch& in, bool masked, HybridCache& cache,
             Listener* ls, const CallCtx& ctx) const {
    if (spec_.lfm2) {
      ShortConvMixerCall sc;
      sc.layer = li;
      sc.conv = &cache.conv[static_cast<size_t>(li)];
      sc.has_state = cache.has_state;
      sc.ls = ls;
      return conv_.forward(l.sc, n_in, in, masked, sc);
    }
    if (spec_.minimax) {
      LightningMixerCall lc;
      lc.layer = li;
      lc.ssm = &cache.ssm[static_cast<size_t>(li)];
      lc.has_state = cache.has_state;
      lc.chunked = ctx.kernel == "chunked";
      lc.ls = ls;
      return lightning_.forward(l.lightning, n_in, in, masked, lc);
    }
    GatedDeltaMixerCall call;
    call.layer = li;
    call.conv = &cache.conv[static_cast<size_t>(li)];
    call.ssm = &cache.ssm[static_cast<size_t>(li)];
    call.has_state = cache.has_state;
    call.chunked = ctx.kernel == "chunked";
    call.ls = ls;
    call.tape = ctx.tape;
    return gdn_.forward(l, n_in, in, masked, call);
  }

  // Gated softmax attention (Qwen3_5Attention, src/mixers/attention_mixer.cpp).
  // `last_only` (last_block_on_last_rows): queries, attention and o_proj for the last row of each
  // sequence only ([B,1,D] out, nothing visited); keys and values for every row, into the cache.
  Tensor attention(int li, const Layer& l, const Tensor& n, const Batch& in, const std::vector<int64_t>& pos,
                   HybridCache& cache, Listener* ls, grad::KeptTensors* tape, bool last_only = false) const {
    AttentionMixerCall call = cache.attention_call(li, pos, ls);
    call.last_rows_only = last_only;
    call.tape = tape;
    return attn_.forward(l.attn, n, in, call);
  }

  QwenHybridSpec spec_;
  int64_t D_ = 0, L_ = 0, V_ = 0, K_ = 0, topk_ = 0;
  bool norm_topk_ = true;
  int64_t n_group_ = 1, topk_group_ = 1;  // Kimi's router
  float routed_scale_ = 1.0f;
  float topk_eps_ = 1e-20f;  // the router's renormalisation epsilon (Kimi 1e-20, LFM2-MoE 1e-6)
  GdnDims g_;
  GatedDeltaMixer gdn_;
  ShortConvMixer conv_;
  LightningMixer lightning_;
  bool no_shared_ = false;
  int64_t block_size_ = 256;  // MiniMax's  // the sparse block has no shared expert (LFM2-MoE, MiniMax)
  AttentionMixer attn_;
  float eps_ = 1e-6f;
  Tensor embed_, norm_, lm_head_;
  std::vector<Layer> layers_;
};

}  // namespace

std::vector<int64_t> sigmoid_topk_route(const float* lg, const float* bias, int64_t E, int64_t n_group,
                                        int64_t topk_group, int64_t topk, bool norm, float eps, float scale, float* s,
                                        float* w) {
  for (int64_t e = 0; e < E; ++e) s[e] = ops::sigmoid(lg[e]);
  std::vector<int64_t> chosen = group_limited_topk(s, bias, E, n_group, topk_group, topk);
  float tot = 0.0f;
  for (int64_t e : chosen) tot += s[e];
  for (size_t k = 0; k < chosen.size(); ++k) w[k] = (norm ? s[chosen[k]] / (tot + eps) : s[chosen[k]]) * scale;
  return chosen;
}

std::unique_ptr<FamilyModel> make_qwen_hybrid(const QwenHybridSpec& spec, const io::Config& top, const io::Config& text,
                                              const io::WeightStore& weights) {
  return std::make_unique<QwenHybrid>(spec, top, text, weights);
}

}  // namespace mixlens::detail
