#include "models/ssm_lm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>

#include "mixlens/errors.h"
#include "models/common.h"
#include "ops/ops.h"

namespace mixlens::detail {

void SsmLm::load_backbone(const io::Config& cfg, const io::WeightStore& w, const std::string& family,
                          bool tie_default) {
  family_ = family;
  D_ = cfg.get<int64_t>("hidden_size");
  L_ = cfg.get<int64_t>("num_hidden_layers");
  V_ = cfg.get<int64_t>("vocab_size");
  K_ = cfg.get<int64_t>("conv_kernel");
  eps_ = static_cast<float>(cfg.get_double_or("layer_norm_epsilon", 1e-5));
  if (!(eps_ > 0.0f) || !std::isfinite(eps_))
    throw ConfigError(where(cfg) + ": layer_norm_epsilon must be a finite number > 0");
  require_positive(cfg, {{"hidden_size", D_}, {"num_hidden_layers", L_}, {"vocab_size", V_}, {"conv_kernel", K_}});
  const std::string act = cfg.get_or<std::string>("hidden_act", "silu");
  if (act != "silu" && act != "swish")
    throw UnsupportedError(where(cfg) + ": hidden_act '" + act + "' is not supported (" + family + " uses silu)");
  const bool tie = cfg.get_or<bool>("tie_word_embeddings", tie_default);
  // Original state-spaces checkpoints name the table "embedding" (transformers 4.x renamed it at
  // load; the 5.18 loader no longer does, mixlens still accepts it).
  embed_ = load_embedding(w, {"backbone.embeddings.weight", "backbone.embedding.weight"}, {V_, D_});
  norm_f_ = w.get("backbone.norm_f.weight", {D_});
  lm_head_ = tie ? embed_ : w.get_matmul("lm_head.weight", {V_, D_});
  norms_.clear();
  for (int64_t i = 0; i < L_; ++i) norms_.push_back(w.get("backbone.layers." + std::to_string(i) + ".norm.weight", {D_}));
  info.family = family;
  info.model_type = cfg.get<std::string>("model_type");
  info.num_layers = static_cast<int>(L_);
  info.hidden_size = D_;
  info.vocab_size = V_;
}

std::unique_ptr<CacheState> SsmLm::new_cache(int64_t batch) const {
  auto c = std::make_unique<SsmCache>();
  c->batch = batch;
  Shape s{batch};
  for (int64_t d : ssm_state_shape()) s.push_back(d);
  for (int64_t i = 0; i < L_; ++i) {
    c->conv.emplace_back(Shape{batch, K_, conv_channels()});
    c->ssm.push_back(Tensor::uninitialized(s));
  }
  // The states (0.75 MiB a layer on mamba2-130m, a new cache every run()) zeroed per layer on the
  // pool rather than by one serial memset each before the prompt starts.
  ops::parallel_for(L_, [&](int64_t i) {
    Tensor& t = c->ssm[static_cast<size_t>(i)];
    std::memset(t.data(), 0, sizeof(float) * static_cast<size_t>(t.numel()));
  });
  return c;
}

std::string SsmLm::prompt_kernel(int64_t) const { return "chunked"; }

std::string SsmLm::kernel_for(const CacheState& cache, int64_t seq) const {
  switch (kernel_route(family_)) {
    case KernelRoute::chunked: return "chunked";
    case KernelRoute::recurrent: return "recurrent";
    default: break;
  }
  const bool decode = static_cast<const SsmCache&>(cache).has_state && seq == 1;
  return decode ? "recurrent" : prompt_kernel(seq);
}

Tensor SsmLm::forward(const Batch& in, CacheState& cache_base, Listener* ls, const CallCtx& ctx,
                      bool all_logits) const {
  auto& cache = static_cast<SsmCache&>(cache_base);
  const int64_t B = in.batch, T = in.seq;
  Tensor h = embed_tokens(embed_, in, family_.c_str());
  visit_if(ls, -1, Value::embed_output, h);
  FiniteWatch watch(family_);
  watch.check(-1, Value::embed_output, h);
  Tensor n = Tensor::uninitialized({B, T, D_});  // written whole by every layer's norm
  for (int64_t i = 0; i < L_; ++i) {
    const int li = static_cast<int>(i);
    ctx.check_cancel();
    visit_if(ls, li, Value::layer_input, h);
    // MambaRMSNorm / Mamba2RMSNorm; with float32 weights residual_in_fp32 changes nothing.
    const float* w = norms_[static_cast<size_t>(i)].data();
    ops::parallel_rows(B * T, D_, [&](int64_t r0, int64_t r1) {
      ops::rmsnorm(h.data() + r0 * D_, w, n.data() + r0 * D_, r1 - r0, D_, eps_);
    });
    Tensor out = mixer(li, n, in, cache, ls, ctx);
    watch.check(li, Value::attention_output, out);
    float* hp = h.data();
    const float* op = out.data();
    ops::parallel_rows(B * T, D_, [&](int64_t r0, int64_t r1) {
      for (int64_t k = r0 * D_; k < r1 * D_; ++k) hp[k] += op[k];
    });
    visit_if(ls, li, Value::layer_output, h);
    watch.check(li, Value::layer_output, h);
  }
  cache.has_state = true;
  ops::parallel_rows(B * T, D_, [&](int64_t r0, int64_t r1) {
    ops::rmsnorm(h.data() + r0 * D_, norm_f_.data(), h.data() + r0 * D_, r1 - r0, D_, eps_);
  });
  visit_if(ls, -1, Value::ln_final_output, h);
  Tensor logits = lm_logits(lm_head_, h, ls, all_logits);
  watch.finish(logits);
  return logits;
}

std::vector<ValueInfo> SsmLm::values(int64_t B, int64_t T) const {
  std::vector<ValueInfo> v;
  v.push_back(global_value(Value::embed_output, {B, T, D_}, "token embeddings (backbone.embeddings)"));
  for (int i = 0; i < static_cast<int>(L_); ++i) {
    v.push_back(layer_value(i, Value::layer_input, {B, T, D_}, true, "residual stream entering the block"));
    mixer_values(i, B, T, v);
    v.push_back(layer_value(i, Value::layer_output, {B, T, D_}, true, "residual stream leaving the block"));
  }
  v.push_back(global_value(Value::ln_final_output, {B, T, D_}, "final RMSNorm output (backbone.norm_f)"));
  v.push_back(global_value(Value::logits, {B, T, V_}, "lm_head logits, float32"));
  return v;
}

std::map<std::string, std::map<int, std::string>> SsmLm::support() const {
  return mixer_only_support(static_cast<int>(L_), family_);
}

void SsmLm::store_served_state(const Tensor& served, Tensor& S) const {
  std::copy(served.begin(), served.end(), S.data());
}

Tensor& SsmLm::begin_state(int li, SsmCache& cache, Listener* ls) const {
  Tensor& S = cache.ssm[static_cast<size_t>(li)];
  visit_state_input(li, S, cache.has_state, ls, served_state_shape(), [this](const Tensor& s) { return served_state(s); },
                    [this](const Tensor& o, Tensor& s) { store_served_state(o, s); });
  return S;
}

void SsmLm::end_state(int li, SsmCache& cache, Listener* ls) const {
  visit_state_output(li, cache.ssm[static_cast<size_t>(li)], ls, [this](const Tensor& s) { return served_state(s); },
                     [this](const Tensor& o, Tensor& s) { store_served_state(o, s); });
}

}  // namespace mixlens::detail
