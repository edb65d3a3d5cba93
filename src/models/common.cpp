#include "models/common.h"

#include <cstring>

#include "mixlens/errors.h"
#include "ops/ops.h"

namespace mixlens::detail {

std::string where(const io::Config& cfg) { return "config.json (" + cfg.path().string() + ")"; }

void require_positive(const io::Config& cfg, std::initializer_list<std::pair<const char*, int64_t>> fields) {
  for (const auto& [name, v] : fields)
    if (v <= 0 || v > (int64_t{1} << 32))
      throw ConfigError(where(cfg) + ": field '" + name + "' = " + std::to_string(v) +
                        " is out of range (must be a positive size)");
}

Tensor load_embedding(const io::WeightStore& w, std::initializer_list<const char*> names, const Shape& shape) {
  for (const char* n : names)
    if (w.has(n)) return w.get(n, shape);
  return w.get(*names.begin(), shape);  // raises the missing-tensor error with suggestions
}

Tensor transpose_conv(const Tensor& w) {
  const int64_t C = w.size(0), K = w.size(2);
  Tensor t({K, C});
  for (int64_t c = 0; c < C; ++c)
    for (int64_t k = 0; k < K; ++k) t[k * C + c] = w[c * K + k];
  return t;
}

Tensor embed_tokens(const Tensor& embed, const Batch& in, const char* family) {
  const int64_t V = embed.size(0), D = embed.size(1);
  Tensor h({in.batch, in.seq, D});
  for (int64_t i = 0; i < in.batch * in.seq; ++i) {
    const int32_t id = in.ids[static_cast<size_t>(i)];
    if (id < 0 || id >= V)
      throw InputError(std::string(family) + ": token id " + std::to_string(id) + " at position " +
                       std::to_string(i % in.seq) + " is outside the vocabulary [0, " + std::to_string(V) + ")");
    std::memcpy(h.data() + i * D, embed.data() + id * D, sizeof(float) * static_cast<size_t>(D));
  }
  return h;
}

Tensor lm_logits(const Tensor& lm_head, const Tensor& h, Listener* ls, bool all_logits) {
  const int64_t B = h.size(0), T = h.size(1), D = h.size(2), V = lm_head.size(0);
  const bool full = all_logits || (ls && ls->wants(-1, Value::logits));
  if (full) {
    Tensor logits({B, T, V});
    ops::linear(h.data(), B * T, D, lm_head, logits.data());
    visit_if(ls, -1, Value::logits, logits);
    return logits;
  }
  Tensor last({B, 1, D});
  for (int64_t b = 0; b < B; ++b)
    std::memcpy(last.data() + b * D, h.data() + (b * T + T - 1) * D, sizeof(float) * static_cast<size_t>(D));
  Tensor logits({B, 1, V});
  ops::linear(last.data(), B, D, lm_head, logits.data());
  return logits;
}

void apply_row_mask(Tensor& t, const Batch& in) {
  const int64_t rows = in.batch * in.seq;
  const int64_t width = t.numel() / rows;
  float* p = t.data();
  for (int64_t r = 0; r < rows; ++r)
    if (!in.mask[static_cast<size_t>(r)]) std::memset(p + r * width, 0, sizeof(float) * static_cast<size_t>(width));
}

ValueInfo global_value(Value v, Shape shape, std::string meaning) {
  ValueInfo i;
  i.site = {-1, v};
  i.path = site_path(i.site);
  i.shape = std::move(shape);
  i.meaning = std::move(meaning);
  return i;
}

ValueInfo layer_value(int layer, Value v, Shape shape, bool per_token, std::string meaning) {
  ValueInfo i;
  i.site = {layer, v};
  i.path = site_path(i.site);
  i.shape = std::move(shape);
  i.per_token = per_token;
  i.meaning = std::move(meaning);
  return i;
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

}  // namespace mixlens::detail
