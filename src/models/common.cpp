#include "models/common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "mixlens/errors.h"
#include "ops/ops.h"

namespace mixlens::detail {

Tensor load_embedding(const io::WeightStore& w, std::initializer_list<const char*> names, const Shape& shape) {
  for (const char* n : names)
    if (w.has(n)) return w.get_matmul(n, shape);
  return w.get_matmul(*names.begin(), shape);  // raises the missing-tensor error with suggestions
}

Tensor embed_tokens(const Tensor& embed, const Batch& in, const char* family) {
  const int64_t V = embed.size(0), D = embed.size(1);
  if (in.embeds.defined()) {  // inputs_embeds: the rows as given (shape checked by the caller)
    if (in.embeds.shape() != Shape{in.batch, in.seq, D})
      throw InputError(std::string(family) + ": inputs_embeds has shape " + shape_str(in.embeds.shape()) +
                       ", expected " + shape_str({in.batch, in.seq, D}));
    return in.embeds.clone();
  }
  Tensor h({in.batch, in.seq, D});
  for (int64_t i = 0; i < in.batch * in.seq; ++i) {
    const int32_t id = in.ids[static_cast<size_t>(i)];
    if (id < 0 || id >= V)
      throw InputError(std::string(family) + ": token id " + std::to_string(id) + " at position " +
                       std::to_string(i % in.seq) + " is outside the vocabulary [0, " + std::to_string(V) + ")");
    ops::copy_row(embed, id, h.data() + i * D);  // any weight dtype
  }
  return h;
}

Tensor lm_logits(const Tensor& lm_head, const Tensor& h, Listener* ls, bool all_logits, float soft_cap) {
  const int64_t B = h.size(0), T = h.size(1), D = h.size(2), V = lm_head.size(0);
  const bool full = all_logits || (ls && ls->wants(-1, Value::logits));
  const auto cap = [&](Tensor& l) {
    if (soft_cap > 0.0f)
      for (int64_t e = 0; e < l.numel(); ++e) l[e] = soft_cap * std::tanh(l[e] / soft_cap);
  };
  if (full) {
    Tensor logits({B, T, V});
    ops::linear(h.data(), B * T, D, lm_head, logits.data());
    cap(logits);
    visit_if(ls, -1, Value::logits, logits);
    return logits;
  }
  Tensor last({B, 1, D});
  for (int64_t b = 0; b < B; ++b)
    std::memcpy(last.data() + b * D, h.data() + (b * T + T - 1) * D, sizeof(float) * static_cast<size_t>(D));
  Tensor logits({B, 1, V});
  ops::linear(last.data(), B, D, lm_head, logits.data());
  cap(logits);
  return logits;
}

void add_state_methods(std::map<std::string, std::map<int, std::string>>& s) {
  auto it = s.find("linear_attn.state");
  if (it == s.end()) return;
  const auto per_layer = it->second;
  s["linear_attn.state_after"] = per_layer;
  s["linear_attn.set_state_after"] = per_layer;
}

void one_kind_info(ModelInfo& info, const io::Config& cfg, const char* family, int64_t layers, int64_t hidden,
                   int64_t vocab, LayerKind kind) {
  info.family = family;
  info.model_type = cfg.get<std::string>("model_type");
  info.num_layers = static_cast<int>(layers);
  info.hidden_size = hidden;
  info.vocab_size = vocab;
  info.layer_kinds.assign(static_cast<size_t>(layers), kind);
}

RowStateCache::RowStateCache(int64_t b, int64_t layers, int64_t row_numel) {
  batch = b;
  for (int64_t i = 0; i < layers; ++i) state.push_back(Tensor({b, row_numel}));
}

std::unique_ptr<CacheState> RowStateCache::clone() const {
  auto c = std::make_unique<RowStateCache>(*this);
  deep_copy(c->state);
  return c;
}

namespace {
Tensor copy_state(const Tensor& s) { return s.clone(); }
void lay_back(const Tensor& o, Tensor& s) { std::copy(o.begin(), o.end(), s.data()); }
}  // namespace

Tensor& RowStateCache::begin_state(int li, Listener* ls, const WriteCheck& check) {
  Tensor& S = state[static_cast<size_t>(li)];
  visit_state_input(li, S, has_state, ls, {S.size(1)}, copy_state, [&](const Tensor& o, Tensor& s) {
    if (check) check(o, "state_input");
    lay_back(o, s);
  });
  return S;
}

void RowStateCache::end_state(int li, Listener* ls, const WriteCheck& check) {
  visit_state_output(li, state[static_cast<size_t>(li)], ls, copy_state, [&](const Tensor& o, Tensor& s) {
    if (check) check(o, "state_output");
    lay_back(o, s);
  });
}

void add_mixing_support(std::map<std::string, std::map<int, std::string>>& s, const ModelInfo& info,
                        const FamilyModel::ValueTable& table) {
  for (Value v : {Value::token_mixing, Value::state_input_mixing}) {
    auto& per_layer = s["linear_attn." + std::string(value_name(v))];
    for (int i = 0; i < info.num_layers; ++i) {
      std::string& r = per_layer[i];
      if (!r.empty() || table.at.count(site_path({i, v}))) continue;
      // Every recurrent kind serves it; softmax attention has attention_probabilities instead.
      r = "block " + std::to_string(i) + " is a " + std::string(layer_kind_name(info.layer_kinds[static_cast<size_t>(i)])) +
          " block: it has no recurrent mixer (self_attn serves attention_probabilities)";
    }
  }
}

std::map<std::string, std::map<int, std::string>> served_support(const FamilyModel& family) {
  auto s = family.support();
  add_state_methods(s);  // every family, hybrids included: as linear_attn.state
  add_mixing_support(s, family.info, family.value_table());
  return s;
}

std::map<std::string, std::map<int, std::string>> mixer_only_support(int num_layers, const std::string& family) {
  std::map<std::string, std::map<int, std::string>> s;
  for (int v = 0; v < kNumValues; ++v) {
    const Value val = static_cast<Value>(v);
    if (value_component(val) != Component::linear_attn) continue;
    for (int i = 0; i < num_layers; ++i) s["linear_attn." + std::string(value_name(val))][i] = "";
  }
  for (int i = 0; i < num_layers; ++i) {
    const std::string block = "block " + std::to_string(i) + " is a " + family + " block";
    for (Value v : {Value::attn_queries, Value::attn_keys, Value::attn_values, Value::attn_gate, Value::attn_output,
                    Value::attn_probs})
      s["self_attn." + std::string(value_name(v))][i] =
          block + " (recurrent mixer linear_attn), not softmax attention: use linear_attn values";
    s["mlp.output"][i] = block + ", which has no MLP: the mixer output is layers." + std::to_string(i) +
                         ".linear_attn.attention_output";
  }
  return s;
}

std::vector<int64_t> group_limited_topk(const float* sc, const float* bias, int64_t E, int64_t G, int64_t topk_group,
                                        int64_t topk) {
  const int64_t per = E / G;
  std::vector<float> choice(static_cast<size_t>(E)), gs(static_cast<size_t>(G));
  std::vector<int64_t> gi(static_cast<size_t>(G)), ei(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) choice[static_cast<size_t>(e)] = sc[e] + bias[e];
  for (int64_t g = 0; g < G; ++g) {  // sum of the group's two best choice scores
    float a = -INFINITY, b2 = -INFINITY;
    for (int64_t j = 0; j < per; ++j) {
      const float v = choice[static_cast<size_t>(g * per + j)];
      if (v > a) { b2 = a; a = v; } else if (v > b2) { b2 = v; }
    }
    gs[static_cast<size_t>(g)] = per >= 2 ? a + b2 : a;
    gi[static_cast<size_t>(g)] = g;
  }
  std::partial_sort(gi.begin(), gi.begin() + topk_group, gi.end(), [&](int64_t a, int64_t b) {
    return gs[static_cast<size_t>(a)] > gs[static_cast<size_t>(b)] || (gs[static_cast<size_t>(a)] == gs[static_cast<size_t>(b)] && a < b);
  });
  std::vector<uint8_t> keep(static_cast<size_t>(G), 0);
  for (int64_t k = 0; k < topk_group; ++k) keep[static_cast<size_t>(gi[static_cast<size_t>(k)])] = 1;
  for (int64_t e = 0; e < E; ++e) {
    if (!keep[static_cast<size_t>(e / per)]) choice[static_cast<size_t>(e)] = -INFINITY;
    ei[static_cast<size_t>(e)] = e;
  }
  std::partial_sort(ei.begin(), ei.begin() + topk, ei.end(), [&](int64_t a, int64_t b) {
    return choice[static_cast<size_t>(a)] > choice[static_cast<size_t>(b)] ||
           (choice[static_cast<size_t>(a)] == choice[static_cast<size_t>(b)] && a < b);
  });
  ei.resize(static_cast<size_t>(topk));
  return ei;
}

}  // namespace mixlens::detail
