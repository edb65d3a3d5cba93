// RWKV-4 (RwkvForCausalLM, model_type "rwkv"): embeddings -> blocks of [pre_ln on block 0] h +=
// time_mix(ln1(h)) (layers.i.linear_attn, mixers/rwkv_mixer.*), h += channel_mix(ln2(h)) (layers.i.mlp),
// h /= 2 after every rescale_every-th block -> ln_out -> head. Reference: transformers 5.18
// models/rwkv/modeling_rwkv.py in inference (eval) mode, where RwkvModel._rescale_layers has divided
// block i's attention.output and feed_forward.value weights by 2^(i // rescale_every) and forward halves
// the hidden states after blocks i with (i + 1) % rescale_every == 0; mixlens does both, exactly.
// Left padding: transformers ignores attention_mask; mixlens scans each row from its first real token
// and starts both token shifts there from the cached last x, so a row equals its unpadded run.
#include <cmath>
#include <string>
#include <vector>

#include "mixers/rwkv_mixer.h"
#include "mixlens/errors.h"
#include "models/common.h"
#include "models/config.h"
#include "models/mamba2_hybrid.h"
#include "models/registry.h"
#include "models/rwkv.h"
#include "ops/ops.h"

namespace mixlens::detail {

namespace {

using FeedForward = RwkvFeedForward;

class RwkvModel final : public FamilyModel {
 public:
  RwkvModel(const io::Config& cfg, const io::WeightStore& w) {
    D_ = cfg.get<int64_t>("hidden_size");
    L_ = cfg.get<int64_t>("num_hidden_layers");
    V_ = cfg.get<int64_t>("vocab_size");
    // RwkvConfig.__post_init__: null sizes default to hidden_size and 4 * hidden_size.
    const int64_t A = cfg.get_or<int64_t>("attention_hidden_size", D_);
    I_ = cfg.get_or<int64_t>("intermediate_size", 4 * D_);
    rescale_every_ = cfg.get_or<int64_t>("rescale_every", 6);
    eps_ = static_cast<float>(cfg.get_double_or("layer_norm_epsilon", 1e-5));
    if (!(eps_ > 0.0f) || !std::isfinite(eps_))
      throw ConfigError(where(cfg) + ": layer_norm_epsilon must be a finite number > 0");
    require_positive(cfg, {{"hidden_size", D_}, {"num_hidden_layers", L_}, {"vocab_size", V_},
                           {"attention_hidden_size", A}, {"intermediate_size", I_}});
    mixer_ = RwkvMixer({D_, A});
    const std::string p = "rwkv.";
    embed_ = load_embedding(w, {"rwkv.embeddings.weight"}, {V_, D_});
    pre_ln_w_ = w.get(p + "blocks.0.pre_ln.weight", {D_});
    pre_ln_b_ = w.get(p + "blocks.0.pre_ln.bias", {D_});
    for (int64_t i = 0; i < L_; ++i) {
      const std::string b = p + "blocks." + std::to_string(i) + ".";
      // 2^(i // rescale_every): transformers' inference rescale of the two output weights.
      const float scale = rescale_every_ > 0 ? std::ldexp(1.0f, static_cast<int>(i / rescale_every_)) : 1.0f;
      for (const char* ln : {"ln1.", "ln2."}) {
        ln_w_.push_back(w.get(b + ln + "weight", {D_}));
        ln_b_.push_back(w.get(b + ln + "bias", {D_}));
      }
      layers_.push_back(mixer_.load(w, b + "attention.", scale));
      const std::string f = b + "feed_forward.";
      FeedForward ff;
      ff.mix_k = w.get(f + "time_mix_key", {1, 1, D_}).reshape({D_});
      ff.mix_r = w.get(f + "time_mix_receptance", {1, 1, D_}).reshape({D_});
      ff.key = w.get_matmul(f + "key.weight", {I_, D_});
      ff.receptance = w.get_matmul(f + "receptance.weight", {D_, D_});
      ff.value = w.get(f + "value.weight", {D_, I_}).clone();
      for (int64_t k = 0; k < D_ * I_; ++k) ff.value[k] /= scale;
      ffn_.push_back(ff);
    }
    ln_out_w_ = w.get(p + "ln_out.weight", {D_});
    ln_out_b_ = w.get(p + "ln_out.bias", {D_});
    lm_head_ = cfg.get_or<bool>("tie_word_embeddings", false) ? embed_ : w.get_matmul("head.weight", {V_, D_});
    one_kind_info(info, cfg, "rwkv", L_, D_, V_, LayerKind::rwkv);
  }

  std::unique_ptr<CacheState> new_cache(int64_t batch) const override {
    const RwkvMixerDims& d = mixer_.dims();
    auto c = std::make_unique<RowStateCache>(batch, L_, d.row_numel());  // zeros: num, den and both shift states
    for (Tensor& s : c->state)
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t a = 0; a < d.A; ++a) s[b * d.row_numel() + 2 * d.A + a] = kRwkvFreshMax;
    return c;
  }

  // One kernel (route_kernels refuses 'chunked' for this family: its registry line).
  std::string kernel_for(const CacheState&, int64_t) const override { return "recurrent"; }
  MixerConsts mixer_consts(int li) const override { return {{}, {}, {}, layers_[static_cast<size_t>(li)].time_first}; }

  Tensor forward(const Batch& in, CacheState& cache_base, Listener* ls, const CallCtx& ctx,
                 bool all_logits) const override {
    auto& cache = static_cast<RowStateCache&>(cache_base);
    const int64_t B = in.batch, T = in.seq, BT = B * T;
    const std::vector<int64_t> first = first_real_tokens(in);
    Tensor h = embed_tokens(embed_, in, "rwkv");
    visit_if(ls, -1, Value::embed_output, h);
    FiniteWatch watch("rwkv");
    watch.check(-1, Value::embed_output, h);
    Tensor n({B, T, D_});
    for (int64_t i = 0; i < L_; ++i) {
      const int li = static_cast<int>(i);
      const size_t si = static_cast<size_t>(i);
      ctx.check_cancel();
      visit_if(ls, li, Value::layer_input, h);
      if (i == 0) norm(h, pre_ln_w_, pre_ln_b_, h);
      norm(h, ln_w_[2 * si], ln_b_[2 * si], n);
      Tensor ffn_start;
      RwkvMixerCall call;
      call.layer = li;
      call.ls = ls;
      const auto den_check = [&](const Tensor& o, const char* what) { mixer_.check_state_write(o.begin(), B, li, what); };
      call.begin_state = [&]() -> Tensor& { return cache.begin_state(li, ls, den_check); };
      call.end_state = [&] { cache.end_state(li, ls, den_check); };
      call.ffn_shift = [&](int64_t b, int64_t t, const float* att_out, float* x) {
        const float* hr = h.data() + (b * T + t) * D_;
        for (int64_t d = 0; d < D_; ++d) x[d] = hr[d] + att_out[d];
        ops::layernorm(x, ln_w_[2 * si + 1].data(), ln_b_[2 * si + 1].data(), x, 1, D_, eps_);
      };
      call.ffn_start = &ffn_start;
      Tensor out = mixer_.forward(layers_[si], n, in, call);
      watch.check(li, Value::attention_output, out);
      for (int64_t k = 0; k < BT * D_; ++k) h[k] += out[k];
      // Channel mixing: r * value(relu(key(xk))^2), both inputs token-shifted from ln2's output.
      norm(h, ln_w_[2 * si + 1], ln_b_[2 * si + 1], n);
      const FeedForward& ff = ffn_[si];
      Tensor xm({B, T, D_}), r({B, T, D_});
      token_shift_mix(n, ffn_start.data(), first, ff.mix_r.data(), xm);
      ops::linear(xm.data(), BT, D_, ff.receptance, r.data());
      ops::sigmoid(r.data(), r.data(), BT * D_);
      token_shift_mix(n, ffn_start.data(), first, ff.mix_k.data(), xm);
      Tensor mlp = relu2_mlp(ff.key, ff.value, xm.data(), BT, D_, I_).reshape({B, T, D_});
      for (int64_t k = 0; k < BT * D_; ++k) mlp[k] *= r[k];
      visit_if(ls, li, Value::mlp_output, mlp);
      watch.check(li, Value::mlp_output, mlp);
      for (int64_t k = 0; k < BT * D_; ++k) h[k] += mlp[k];
      if (rescale_every_ > 0 && (i + 1) % rescale_every_ == 0)
        for (int64_t k = 0; k < BT * D_; ++k) h[k] /= 2.0f;
      visit_if(ls, li, Value::layer_output, h);
      watch.check(li, Value::layer_output, h);
    }
    cache.has_state = true;
    // RwkvModel's ln_out is nn.LayerNorm(hidden_size): eps 1e-5 whatever layer_norm_epsilon says.
    norm(h, ln_out_w_, ln_out_b_, h, 1e-5f);
    visit_if(ls, -1, Value::ln_final_output, h);
    Tensor logits = lm_logits(lm_head_, h, ls, all_logits);
    watch.finish(logits);
    return logits;
  }

  std::vector<ValueInfo> values(int64_t B, int64_t T) const override {
    std::vector<ValueInfo> v;
    v.push_back(global_value(Value::embed_output, {B, T, D_}, "token embeddings (rwkv.embeddings)"));
    for (int i = 0; i < static_cast<int>(L_); ++i) {
      v.push_back(layer_value(i, Value::layer_input, {B, T, D_}, true,
                              i == 0 ? "hidden states entering block 0 (before its pre_ln)"
                                     : "residual stream entering the block"));
      mixer_.values(i, B, T, v);
      v.push_back(layer_value(i, Value::mlp_output, {B, T, D_}, true,
                              "channel mixing sigmoid(receptance(xr)) * value(relu(key(xk))^2), added to the residual"));
      v.push_back(layer_value(i, Value::layer_output, {B, T, D_}, true,
                              "residual stream leaving the block (halved after every rescale_every-th block)"));
    }
    v.push_back(global_value(Value::ln_final_output, {B, T, D_}, "final LayerNorm output (rwkv.ln_out)"));
    v.push_back(global_value(Value::logits, {B, T, V_}, "head logits, float32"));
    return v;
  }

  std::map<std::string, std::map<int, std::string>> support() const override {
    auto s = mixer_only_support(static_cast<int>(L_), "rwkv");
    for (int i = 0; i < static_cast<int>(L_); ++i) {
      s["mlp.output"][i] = "";
      s["linear_attn.betas"][i] =
          "RWKV-4 has no write strength apart from its key: a token writes exp(k) v (exp(time_first + k) v into its "
          "own read), so the log write strength is layers." + std::to_string(i) + ".linear_attn.attention_keys";
    }
    return s;
  }

  // Gradients (src/grad/rwkv_grad.cpp, docs/gradients.md).
  std::unique_ptr<BackwardParts> backward_parts() const override {
    auto p = std::make_unique<RwkvParts>();
    p->D = D_; p->L = L_; p->I = I_; p->rescale_every = rescale_every_; p->eps = eps_;
    p->mixer = &mixer_; p->layers = &layers_; p->ffn = &ffn_;
    p->pre_ln_w = &pre_ln_w_; p->pre_ln_b = &pre_ln_b_; p->ln_w = &ln_w_; p->ln_b = &ln_b_;
    p->ln_out_w = &ln_out_w_; p->lm_head = &lm_head_;
    return p;
  }

  ResidualWrite residual_write(int layer) const override {
    ResidualWrite w = FamilyModel::residual_write(layer);
    if (layer == 0) w.why = "block 0 applies pre_ln to the embeddings before its branches";
    // transformers' inference rescale: h /= 2 after every rescale_every-th block.
    if (rescale_every_ > 0 && (layer + 1) % rescale_every_ == 0) w.scale = 0.5f;
    return w;
  }

  Head head() const override {
    throw UnsupportedError("rwkv: project_on_vocab / head() assume an RMSNorm final norm; RWKV's ln_out is a "
                           "LayerNorm with a bias (read ln_final.output and logits instead)");
  }
  Unembed unembed() const override { return {&lm_head_, 1.0f, 0.0f}; }

 private:
  void norm(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y, float eps = 0.0f) const {
    const int64_t rows = x.numel() / D_;
    const float e = eps > 0.0f ? eps : eps_;
    ops::parallel_rows(rows, D_, [&](int64_t r0, int64_t r1) {
      ops::layernorm(x.data() + r0 * D_, w.data(), b.data(), y.data() + r0 * D_, r1 - r0, D_, e);
    });
  }

  int64_t D_ = 0, L_ = 0, V_ = 0, I_ = 0, rescale_every_ = 6;
  float eps_ = 1e-5f;
  Tensor embed_, pre_ln_w_, pre_ln_b_, ln_out_w_, ln_out_b_, lm_head_;
  std::vector<Tensor> ln_w_, ln_b_;  // per layer: ln1, ln2
  RwkvMixer mixer_;
  std::vector<RwkvMixerWeights> layers_;
  std::vector<FeedForward> ffn_;
};

}  // namespace

std::unique_ptr<FamilyModel> make_rwkv(const io::Config& config, const io::WeightStore& weights) {
  return std::make_unique<RwkvModel>(config, weights);
}

}  // namespace mixlens::detail
