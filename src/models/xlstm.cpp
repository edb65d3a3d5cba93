// xLSTM-7B (xLSTMForCausalLM, model_type "xlstm"): embeddings -> blocks of h += mlstm(norm_mlstm(h))
// (layers.i.linear_attn, mixers/mlstm_mixer.*), h += ffn(norm_ffn(h)) (layers.i.mlp: proj_down(silu(gate) *
// up)) -> out_norm -> lm_head -> output_logit_soft_cap * tanh(logits / cap). Reference: transformers 5.18
// models/xlstm/modeling_xlstm.py, pure torch (no `xlstm` package), mode "inference".
// Left padding: transformers takes no attention_mask for xLSTM (padding flows through its recurrence);
// mixlens scans each row from its first real token, so a padded row equals its unpadded run.
#include <cmath>
#include <string>
#include <vector>

#include "mixers/mlstm_mixer.h"
#include "mixlens/errors.h"
#include "models/common.h"
#include "models/config.h"
#include "models/registry.h"
#include "models/xlstm.h"
#include "ops/ops.h"

namespace mixlens::detail {

namespace {

/// A soft cap from the config: absent -> `fallback`, null -> none (0).
float read_cap(const io::Config& cfg, const char* key, double fallback) {
  const float c = cfg.has(key) && cfg.is_null(key) ? 0.0f : static_cast<float>(cfg.get_double_or(key, fallback));
  if (!(c >= 0.0f) || !std::isfinite(c)) throw ConfigError(where(cfg) + ": " + key + " must be null or a finite number > 0");
  return c;
}

class XlstmModel final : public FamilyModel {
 public:
  XlstmModel(const io::Config& cfg, const io::WeightStore& w) {
    // xLSTMConfig.__post_init__: hidden_size / embedding_dim and num_hidden_layers / num_blocks stand for each other.
    D_ = cfg.get_or<int64_t>("hidden_size", cfg.get_or<int64_t>("embedding_dim", 0));
    L_ = cfg.get_or<int64_t>("num_blocks", cfg.get_or<int64_t>("num_hidden_layers", 0));
    V_ = cfg.get<int64_t>("vocab_size");
    const int64_t NH = cfg.get<int64_t>("num_heads");
    require_positive(cfg, {{"hidden_size", D_}, {"num_blocks", L_}, {"vocab_size", V_}, {"num_heads", NH}});
    if (cfg.get_or<int64_t>("embedding_dim", D_) != D_)
      throw UnsupportedError(where(cfg) + ": embedding_dim != hidden_size (transformers' blocks are hidden_size wide)");
    if (cfg.get_or<bool>("use_bias", false))
      throw UnsupportedError(where(cfg) + ": use_bias true (biased projections and norms) is not implemented; "
                             "xLSTM-7B has use_bias false");
    const std::string mode = cfg.get_or<std::string>("weight_mode", "single");
    if (mode != "single" && mode != "fused") throw ConfigError(where(cfg) + ": weight_mode must be 'single' or 'fused'");
    // xLSTMLayer: q / k / v widths int(hidden_size * factor), split evenly over the heads.
    const auto width = [&](const char* f, double def) {
      const int64_t n = static_cast<int64_t>(static_cast<double>(D_) * cfg.get_double_or(f, def));
      if (n <= 0 || n % NH != 0)
        throw ConfigError(where(cfg) + ": int(hidden_size * " + f + ") must be a positive multiple of num_heads");
      return n / NH;
    };
    MlstmMixerDims d;
    d.D = D_, d.NH = NH, d.Dqk = width("qk_dim_factor", 0.5), d.Dv = width("v_dim_factor", 1.0);
    d.chunk = cfg.get_or<int64_t>("chunk_size", 64);
    d.eps = static_cast<float>(cfg.get_double_or("eps", 1e-6));
    d.norm_eps = eps_ = static_cast<float>(cfg.get_double_or("norm_eps", 1e-6));
    d.gate_cap = read_cap(cfg, "gate_soft_cap", 15.0);
    cap_ = read_cap(cfg, "output_logit_soft_cap", 30.0);
    require_positive(cfg, {{"chunk_size", d.chunk}});
    chunk_ = d.chunk;
    if (!(d.eps >= 0.0f) || !(eps_ > 0.0f)) throw ConfigError(where(cfg) + ": eps must be >= 0 and norm_eps > 0");
    const std::string ff_round = "ffn_round_up_to_multiple_of";
    const int64_t r = cfg.get_or<int64_t>(ff_round, 64);
    require_positive(cfg, {{"ffn_round_up_to_multiple_of", r}});
    // round_up_to_next_multiple_of(hidden_size * ffn_proj_factor, ffn_round_up_to_multiple_of), in floats as Python.
    I_ = static_cast<int64_t>(std::ceil(static_cast<double>(D_) * cfg.get_double_or("ffn_proj_factor", 2.667) /
                                        static_cast<double>(r))) * r;
    mixer_ = MlstmMixer(d);
    const bool fused = mode == "fused";
    embed_ = load_embedding(w, {"backbone.embeddings.weight"}, {V_, D_});
    for (int64_t i = 0; i < L_; ++i) {
      const std::string b = "backbone.blocks." + std::to_string(i) + ".";
      XlstmBlock blk;
      blk.norm_mlstm = w.get(b + "norm_mlstm.weight", {D_});
      blk.norm_ffn = w.get(b + "norm_ffn.weight", {D_});
      blk.mlstm = mixer_.load(w, b + "mlstm_layer.", fused);
      if (fused) {
        blk.up_gate = w.get_matmul(b + "ffn.proj_up_gate_z.weight", {2 * I_, D_});
      } else {
        const Tensor g = w.get_matmul(b + "ffn.proj_up_gate.weight", {I_, D_});
        const Tensor u = w.get_matmul(b + "ffn.proj_up.weight", {I_, D_});
        blk.up_gate = ops::RowStack({g, u});
      }
      blk.down = w.get_matmul(b + "ffn.proj_down.weight", {D_, I_});
      blocks_.push_back(blk);
    }
    // transformers 5.18 always applies out_norm (add_out_norm is not read by xLSTMModel).
    out_norm_ = w.get("backbone.out_norm.weight", {D_});
    // xLSTMForCausalLM declares no tied weights: transformers 5.18 keeps lm_head its own whatever
    // tie_word_embeddings says; only a checkpoint without lm_head.weight falls back to the embeddings.
    lm_head_ = w.has("lm_head.weight") || !cfg.get_or<bool>("tie_word_embeddings", false)
                   ? w.get_matmul("lm_head.weight", {V_, D_})
                   : embed_;
    one_kind_info(info, cfg, "xlstm", L_, D_, V_, LayerKind::mlstm);
  }

  void set_chunk_size(int64_t c) override { mixer_.set_chunk(c > 0 ? c : chunk_); }
  MixerConsts mixer_consts(int) const override {
    MixerConsts c;
    c.eps = mixer_.dims().eps;
    return c;
  }

  std::unique_ptr<CacheState> new_cache(int64_t batch) const override {
    return std::make_unique<RowStateCache>(batch, L_, mixer_.dims().row_numel());  // zeros, as xLSTMCache
  }

  // transformers' inference: a prompt (or several new tokens) runs the chunkwise kernel, a one-token step the
  // recurrent step; route_kernels forces either.
  std::string kernel_for(const CacheState& cache, int64_t seq) const override {
    switch (kernel_route("xlstm")) {
      case KernelRoute::chunked: return "chunked";
      case KernelRoute::recurrent: return "recurrent";
      default: break;
    }
    return static_cast<const RowStateCache&>(cache).has_state && seq == 1 ? "recurrent" : "chunked";
  }

  std::vector<ValueInfo> values(int64_t B, int64_t T) const override {
    std::vector<ValueInfo> v;
    v.push_back(global_value(Value::embed_output, {B, T, D_}, "token embeddings (backbone.embeddings)"));
    for (int i = 0; i < static_cast<int>(L_); ++i) {
      v.push_back(layer_value(i, Value::layer_input, {B, T, D_}, true, "residual stream entering the block"));
      mixer_.values(i, B, T, v);
      v.push_back(layer_value(i, Value::mlp_output, {B, T, D_}, true,
                              "feed-forward proj_down(silu(proj_up_gate(x)) * proj_up(x)) of norm_ffn(h), added to the residual"));
      v.push_back(layer_value(i, Value::layer_output, {B, T, D_}, true, "residual stream leaving the block"));
    }
    v.push_back(global_value(Value::ln_final_output, {B, T, D_}, "final RMSNorm output (backbone.out_norm)"));
    v.push_back(global_value(Value::logits, {B, T, V_},
                             "soft-capped logits: output_logit_soft_cap * tanh(lm_head(h) / output_logit_soft_cap)"));
    return v;
  }

  Tensor forward(const Batch& in, CacheState& cache_base, Listener* ls, const CallCtx& ctx,
                 bool all_logits) const override {
    auto& cache = static_cast<RowStateCache&>(cache_base);
    const int64_t B = in.batch, T = in.seq, BT = B * T;
    FiniteWatch watch("xlstm");
    MlstmMixerCall call;
    call.ls = ls;
    call.chunked = kernel_for(cache, T) == "chunked";
    Tensor h = embed_tokens(embed_, in, "xlstm"), n({B, T, D_});
    visit_if(ls, -1, Value::embed_output, h);
    watch.check(-1, Value::embed_output, h);
    int li = 0;  // the block the loop is in: the state sites below serve its row
    call.begin_state = [&]() -> Tensor& { return cache.begin_state(li, ls); };
    call.end_state = [&] { cache.end_state(li, ls); };
    for (const XlstmBlock& blk : blocks_) {
      ctx.check_cancel();
      visit_if(ls, li, Value::layer_input, h);
      norm(h, blk.norm_mlstm, n);
      call.layer = li;
      Tensor out = mixer_.forward(blk.mlstm, n, in, call);
      watch.check(li, Value::attention_output, out);
      for (int64_t k = 0; k < BT * D_; ++k) h[k] += out[k];
      norm(h, blk.norm_ffn, n);
      Tensor ug({BT, 2 * I_}), act({BT, I_});
      ops::linear(n.data(), BT, D_, blk.up_gate, ug.data());
      for (int64_t r = 0; r < BT; ++r)  // silu(gate) * up (xLSTMFeedForward)
        for (int64_t c = 0; c < I_; ++c) act[r * I_ + c] = ops::silu(ug[r * 2 * I_ + c]) * ug[r * 2 * I_ + I_ + c];
      Tensor mlp({B, T, D_});
      ops::linear(act.data(), BT, I_, blk.down, mlp.data());
      visit_if(ls, li, Value::mlp_output, mlp);
      watch.check(li, Value::mlp_output, mlp);
      for (int64_t k = 0; k < BT * D_; ++k) h[k] += mlp[k];
      visit_if(ls, li, Value::layer_output, h);
      watch.check(li++, Value::layer_output, h);
    }
    cache.has_state = true;
    return head_logits(h, ls, all_logits, watch);
  }

  std::map<std::string, std::map<int, std::string>> support() const override {
    auto s = mixer_only_support(static_cast<int>(L_), "xlstm");
    for (int i = 0; i < static_cast<int>(L_); ++i) s["mlp.output"][i] = "";
    return s;
  }

  std::unique_ptr<BackwardParts> backward_parts() const override {
    auto p = std::make_unique<XlstmParts>();
    p->D = D_, p->L = L_, p->I = I_, p->eps = eps_, p->cap = cap_;
    p->mixer = &mixer_, p->blocks = &blocks_, p->out_norm = &out_norm_, p->lm_head = &lm_head_;
    return p;
  }

  Head head() const override {
    throw UnsupportedError("xlstm: project_on_vocab / head() do not apply output_logit_soft_cap (read ln_final.output "
                           "and logits instead)");
  }
  Unembed unembed() const override { return {&lm_head_, 1.0f, cap_}; }

 private:
  // out_norm -> lm_head -> soft cap, serving ln_final.output and logits.
  Tensor head_logits(Tensor& h, Listener* ls, bool all_logits, FiniteWatch& watch) const {
    norm(h, out_norm_, h);
    visit_if(ls, -1, Value::ln_final_output, h);
    Tensor logits = lm_logits(lm_head_, h, ls, all_logits, cap_);
    watch.finish(logits);
    return logits;
  }

  void norm(const Tensor& x, const Tensor& w, Tensor& y) const {
    ops::parallel_rows(x.numel() / D_, D_, [&](int64_t r0, int64_t r1) {
      ops::rmsnorm(x.data() + r0 * D_, w.data(), y.data() + r0 * D_, r1 - r0, D_, eps_);
    });
  }

  int64_t D_ = 0, L_ = 0, V_ = 0, I_ = 0, chunk_ = 64;
  float eps_ = 1e-6f, cap_ = 30.0f;
  MlstmMixer mixer_;
  std::vector<XlstmBlock> blocks_;
  Tensor embed_, out_norm_, lm_head_;
};

}  // namespace

std::unique_ptr<FamilyModel> make_xlstm(const io::Config& config, const io::WeightStore& weights) {
  return std::make_unique<XlstmModel>(config, weights);
}

}  // namespace mixlens::detail
