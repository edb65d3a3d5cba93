// RecurrentGemma (model_type "recurrent_gemma", RecurrentGemmaForCausalLM; Griffin). Reference:
// transformers 5.18 models/recurrent_gemma/modeling_recurrent_gemma.py. Each residual block:
//   h += temporal_block(temporal_pre_norm(h));  h += mlp_block(channel_pre_norm(h))
// with (1 + w) RMSNorms; temporal blocks cycle through block_types: "recurrent" is the RG-LRU
// mixer (mixers/rg_lru_mixer.h, served as layers[i].linear_attn), "attention" the attention mixer
// as local MQA (num_key_value_heads, partial RoPE, no q / k / v bias unless attention_bias, o_proj
// always biased, attention_window_size). The MLP is gelu_tanh(gate_proj(x)) * up_proj(x) ->
// down_proj, all biased, intermediate_size / 2 wide. Embeddings are scaled by sqrt(hidden_size)
// rounded to bfloat16 (RecurrentGemmaModel.normalizer is a bf16 buffer); logits are soft-capped.
// Backward: src/grad/recurrent_gemma_grad.cpp (from backward_parts()).
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "mixers/attention_mixer.h"
#include "mixers/rg_lru_mixer.h"
#include "mixlens/errors.h"
#include "models/common.h"
#include "models/config.h"
#include "models/hybrid_cache.h"
#include "models/recurrent_gemma.h"
#include "models/registry.h"
#include "ops/dtype.h"
#include "ops/ops.h"

namespace mixlens::detail {

namespace {

using Layer = RecurrentGemmaLayer;

class RecurrentGemma final : public FamilyModel {
 public:
  RecurrentGemma(const io::Config& cfg, const io::WeightStore& w)
      : D_(cfg.get<int64_t>("hidden_size")), L_(cfg.get<int64_t>("num_hidden_layers")), V_(cfg.get<int64_t>("vocab_size")) {
    const int64_t W = cfg.get_or<int64_t>("lru_width", D_);
    const int64_t K = cfg.get_or<int64_t>("conv1d_width", 4);
    const int64_t I2 = cfg.get<int64_t>("intermediate_size");
    require_positive(cfg, {{"hidden_size", D_}, {"num_hidden_layers", L_}, {"vocab_size", V_}, {"lru_width", W},
                           {"conv1d_width", K}, {"intermediate_size", I2}});
    I_ = I2 / 2;  // RecurrentGemmaMlp: intermediate_size // 2
    eps_ = static_cast<float>(cfg.get_double_or("rms_norm_eps", 1e-6));
    if (!(eps_ > 0.0f) || !std::isfinite(eps_)) throw ConfigError(where(cfg) + ": rms_norm_eps must be a finite number > 0");
    cap_ = static_cast<float>(cfg.get_double_or("logits_soft_cap", 30.0));
    if (!(cap_ > 0.0f) || !std::isfinite(cap_)) throw ConfigError(where(cfg) + ": logits_soft_cap must be a finite number > 0");
    const std::string act = cfg.get_or<std::string>("hidden_activation", "gelu_pytorch_tanh");
    if (act != "gelu_pytorch_tanh")
      throw UnsupportedError(where(cfg) + ": hidden_activation '" + act + "' is not supported (recurrent_gemma uses gelu_pytorch_tanh)");
    AttentionMixerDims ad;
    read_attention_heads(cfg, D_, ad);
    ad.hd = D_ / ad.H;  // RecurrentGemmaConfig: head_dim = hidden_size // num_attention_heads, whatever is stored
    if (W % ad.H != 0)
      throw ConfigError(where(cfg) + ": lru_width (" + std::to_string(W) + ") is not divisible by num_attention_heads (" +
                        std::to_string(ad.H) + ")");
    double theta = 0.0, partial = 0.5;
    read_rope(cfg, 0.5, theta, partial);
    ad.D = D_;
    ad.eps = eps_;
    ad.rope = true;
    ad.rot = static_cast<int64_t>(static_cast<double>(ad.hd) * partial);
    ad.theta = theta;
    ad.bias = cfg.get_or<bool>("attention_bias", false);
    ad.out_bias = true;
    ad.window = cfg.get_or<int64_t>("attention_window_size", 2048);
    require_positive(cfg, {{"attention_window_size", ad.window}});
    attn_ = AttentionMixer(ad, where(cfg));
    rg_ = RgLruMixer(RgLruMixerDims{D_, W, ad.H, K});

    // layers_block_type: block_types repeated to num_hidden_layers.
    const auto kinds = cfg.get_or<std::vector<std::string>>("block_types", {"recurrent", "recurrent", "attention"});
    if (kinds.empty()) throw ConfigError(where(cfg) + ": block_types is empty");
    for (size_t i = 0; i < kinds.size(); ++i)
      if (kinds[i] != "recurrent" && kinds[i] != "attention")
        throw ConfigError(where(cfg) + ": block_types[" + std::to_string(i) + "] is '" + kinds[i] +
                          "' (expected 'recurrent' or 'attention')");
    embed_ = w.get_matmul("model.embed_tokens.weight", {V_, D_});
    norm_ = w.get("model.final_norm.weight", {D_});
    const bool tie = cfg.get_or<bool>("tie_word_embeddings", true);
    lm_head_ = tie ? embed_ : w.get_matmul("lm_head.weight", {V_, D_});
    // torch.tensor(hidden_size ** 0.5, dtype=torch.bfloat16), applied in float32.
    scale_ = ops::bf16_to_f32(ops::f32_to_bf16(std::sqrt(static_cast<float>(D_))));
    layers_.resize(static_cast<size_t>(L_));
    for (int64_t i = 0; i < L_; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      Layer& l = layers_[static_cast<size_t>(i)];
      l.recurrent = kinds[static_cast<size_t>(i) % kinds.size()] == "recurrent";
      is_rec_.push_back(l.recurrent);
      info.layer_kinds.push_back(l.recurrent ? LayerKind::rg_lru : LayerKind::attention);
      l.temporal_norm = w.get(p + "temporal_pre_norm.weight", {D_});
      l.channel_norm = w.get(p + "channel_pre_norm.weight", {D_});
      if (l.recurrent)
        l.rg = rg_.load(w, p + "temporal_block.");
      else
        l.attn = attn_.load(w, p + "temporal_block.");
      const std::string m = p + "mlp_block.";
      l.gate = w.get_matmul(m + "gate_proj.weight", {I_, D_});
      l.up = w.get_matmul(m + "up_proj.weight", {I_, D_});
      l.down = w.get_matmul(m + "down_proj.weight", {D_, I_});
      l.gate_b = w.get(m + "gate_proj.bias", {I_});
      l.up_b = w.get(m + "up_proj.bias", {I_});
      l.down_b = w.get(m + "down_proj.bias", {D_});
    }
    info.family = "recurrent_gemma";
    info.model_type = cfg.get<std::string>("model_type");
    info.num_layers = static_cast<int>(L_);
    info.hidden_size = D_;
    info.vocab_size = V_;
  }

  std::unique_ptr<CacheState> new_cache(int64_t batch) const override {
    // The RG-LRU state row holds its own conv window ([K, W], rg_lru_mixer.h): no separate conv slot.
    return std::make_unique<HybridCache>(batch, is_rec_, 1, 1, Shape{rg_.dims().K, rg_.dims().W});
  }

  // One kernel: the diagonal recurrence runs as a token loop for prompts and steps alike
  // (route_kernels refuses 'chunked' for this family: its registry line).
  std::string kernel_for(const CacheState&, int64_t) const override { return "recurrent"; }

  Tensor forward(const Batch& in, CacheState& cache_base, Listener* ls, const CallCtx& ctx, bool all_logits) const override {
    auto& cache = static_cast<HybridCache&>(cache_base);
    const int64_t B = in.batch, T = in.seq, BT = B * T;
    const std::vector<int64_t> pos = cache.advance_positions(in);
    Tensor h = embed_tokens(embed_, in, "recurrent_gemma");
    for (int64_t e = 0; e < h.numel(); ++e) h[e] *= scale_;
    visit_if(ls, -1, Value::embed_output, h);
    FiniteWatch watch("recurrent_gemma");
    watch.check(-1, Value::embed_output, h);
    Tensor n = Tensor::uninitialized({B, T, D_});
    for (int64_t i = 0; i < L_; ++i) {
      const int li = static_cast<int>(i);
      const Layer& l = layers_[static_cast<size_t>(i)];
      ctx.check_cancel();
      visit_if(ls, li, Value::layer_input, h);
      ops::rmsnorm(h.data(), l.temporal_norm.data(), n.data(), BT, D_, eps_, true);
      Tensor out;
      if (l.recurrent) {
        RgLruMixerCall c;
        c.layer = li;
        c.h = &cache.ssm[static_cast<size_t>(i)];
        c.has_state = cache.has_state;
        c.pos = &pos;
        c.ls = ls;
        out = rg_.forward(l.rg, n, in, c);
      } else {
        out = attn_.forward(l.attn, n, in, cache.attention_call(li, pos, ls));
      }
      watch.check(li, l.recurrent ? Value::attention_output : Value::attn_output, out);
      for (int64_t e = 0; e < h.numel(); ++e) h[e] += out[e];
      ops::rmsnorm(h.data(), l.channel_norm.data(), n.data(), BT, D_, eps_, true);
      Tensor g = Tensor::uninitialized({B, T, I_}), u = Tensor::uninitialized({B, T, I_});
      ops::linear(n.data(), BT, D_, l.gate, g.data(), l.gate_b.data());
      ops::linear(n.data(), BT, D_, l.up, u.data(), l.up_b.data());
      for (int64_t e = 0; e < BT * I_; ++e) g[e] = ops::gelu_tanh(g[e]) * u[e];
      Tensor m = Tensor::uninitialized({B, T, D_});
      ops::linear(g.data(), BT, I_, l.down, m.data(), l.down_b.data());
      visit_if(ls, li, Value::mlp_output, m);
      watch.check(li, Value::mlp_output, m);
      for (int64_t e = 0; e < h.numel(); ++e) h[e] += m[e];
      visit_if(ls, li, Value::layer_output, h);
      watch.check(li, Value::layer_output, h);
    }
    cache.has_state = true;
    ops::rmsnorm(h.data(), norm_.data(), h.data(), BT, D_, eps_, true);
    visit_if(ls, -1, Value::ln_final_output, h);
    Tensor logits = lm_logits(lm_head_, h, ls, all_logits, cap_);
    watch.finish(logits);
    return logits;
  }

  std::vector<ValueInfo> values(int64_t B, int64_t T) const override {
    std::vector<ValueInfo> v{
        global_value(Value::embed_output, {B, T, D_}, "token embeddings * sqrt(hidden_size) (bf16-rounded normalizer)")};
    for (int i = 0; i < static_cast<int>(L_); ++i) {
      v.push_back(layer_value(i, Value::layer_input, {B, T, D_}, true, "residual stream entering the residual block"));
      if (layers_[static_cast<size_t>(i)].recurrent)
        rg_.values(i, B, T, v);
      else
        attn_.values(i, B, T, v);
      v.push_back(layer_value(i, Value::mlp_output, {B, T, D_}, true, "mlp_block output: down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))"));
      v.push_back(layer_value(i, Value::layer_output, {B, T, D_}, true, "residual stream leaving the residual block"));
    }
    v.push_back(global_value(Value::ln_final_output, {B, T, D_}, "final (1 + w) RMSNorm output (final_norm)"));
    v.push_back(global_value(Value::logits, {B, T, V_}, "soft-capped logits: logits_soft_cap * tanh(lm_head(h) / logits_soft_cap)"));
    return v;
  }

  std::unique_ptr<BackwardParts> backward_parts() const override {
    auto p = std::make_unique<RecurrentGemmaParts>();
    p->D = D_; p->L = L_; p->I = I_;
    p->eps = eps_; p->cap = cap_;
    p->rg = &rg_; p->attn = &attn_;
    p->norm = &norm_; p->lm_head = &lm_head_;
    p->layers = &layers_;
    return p;
  }

  std::map<std::string, std::map<int, std::string>> support() const override {
    std::map<std::string, std::map<int, std::string>> s;
    for (int i = 0; i < static_cast<int>(L_); ++i) {
      const bool rec = layers_[static_cast<size_t>(i)].recurrent;
      const std::string block = "block " + std::to_string(i) + (rec ? " is a recurrent (RG-LRU) block" : " is a local attention block");
      for (int vi = 0; vi < kNumValues; ++vi) {
        const Value val = static_cast<Value>(vi);
        const Component c = value_component(val);
        if (c == Component::linear_attn) {
          std::string why;
          if (!rec) why = block + ", which has no recurrent state: use self_attn values";
          else if (val == Value::attention_queries || val == Value::attention_keys)
            why = block + ": the RG-LRU recurrence is diagonal (h_t = a_t h_{t-1} + ...), no query reads the state "
                          "and no key addresses it";
          s["linear_attn." + std::string(value_name(val))][i] = why;
        } else if (c == Component::self_attn) {
          s["self_attn." + std::string(value_name(val))][i] =
              rec ? block + " (recurrent mixer linear_attn), not softmax attention: use linear_attn values"
              : val == Value::attn_gate ? block + " whose attention has no output gate (RecurrentGemmaAttention is ungated)"
                                        : "";
        }
      }
      s["mlp.output"][i] = "";
    }
    add_state_methods(s);
    return s;
  }

 private:
  int64_t D_ = 0, L_ = 0, V_ = 0, I_ = 0;
  float eps_ = 1e-6f, cap_ = 30.0f, scale_ = 1.0f;
  AttentionMixer attn_;
  RgLruMixer rg_;
  Tensor embed_, norm_, lm_head_;
  std::vector<Layer> layers_;
  std::vector<bool> is_rec_;  // per block: the RG-LRU (else attention), as the cache lays out its slots
};

}  // namespace

std::unique_ptr<FamilyModel> make_recurrent_gemma(const io::Config& config, const io::WeightStore& weights) {
  return std::make_unique<RecurrentGemma>(config, weights);
}

}  // namespace mixlens::detail
