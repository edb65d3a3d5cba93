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

void add_state_methods(std::map<std::string, std::map<int, std::string>>& s) {
  auto it = s.find("linear_attn.state");
  if (it == s.end()) return;
  const auto per_layer = it->second;
  s["linear_attn.state_after"] = per_layer;
  s["linear_attn.set_state_after"] = per_layer;
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
