#include "mixlens/values.h"

#include <algorithm>
#include <cctype>

#include "mixers/rwkv_mixer.h"
#include "mixlens/errors.h"

namespace mixlens {

std::string_view layer_kind_name(LayerKind k) {
  switch (k) {
    case LayerKind::mamba2: return "mamba2";
    case LayerKind::mamba: return "mamba";
    case LayerKind::gated_deltanet: return "gated_deltanet";
    case LayerKind::attention: return "attention";
    case LayerKind::mlp: return "mlp";
    case LayerKind::hybrid: return "hybrid";
    case LayerKind::moe: return "moe";
    case LayerKind::short_conv: return "short_conv";
    case LayerKind::rwkv: return "rwkv";
    case LayerKind::rg_lru: return "rg_lru";
    case LayerKind::lightning: return "lightning";
    case LayerKind::mlstm: return "mlstm";
  }
  return "?";
}

std::string_view value_name(Value v) {
  switch (v) {
    case Value::embed_output: return "output";
    case Value::ln_final_output: return "output";
    case Value::logits: return "logits";
    case Value::layer_input: return "layer_input";
    case Value::layer_output: return "layer_output";
    case Value::attention_queries: return "attention_queries";
    case Value::attention_keys: return "attention_keys";
    case Value::attention_values: return "attention_values";
    case Value::betas: return "betas";
    case Value::decays: return "decays";
    case Value::state_input: return "state_input";
    case Value::state_output: return "state_output";
    case Value::states: return "states";
    case Value::state: return "state";
    case Value::attention_head_outputs: return "attention_head_outputs";
    case Value::attention_output: return "attention_output";
    case Value::attn_queries: return "attention_queries";
    case Value::attn_keys: return "attention_keys";
    case Value::attn_values: return "attention_values";
    case Value::attn_gate: return "gate";
    case Value::attn_output: return "attention_output";
    case Value::attn_probs: return "attention_probabilities";
    case Value::mlp_output: return "output";
    case Value::token_mixing: return "token_mixing";
    case Value::state_input_mixing: return "state_input_mixing";
    case Value::kCount: break;
  }
  return "?";
}

Component value_component(Value v) {
  switch (v) {
    case Value::embed_output:
    case Value::ln_final_output:
    case Value::logits: return Component::global;
    case Value::layer_input:
    case Value::layer_output: return Component::block;
    case Value::attn_queries:
    case Value::attn_keys:
    case Value::attn_values:
    case Value::attn_gate:
    case Value::attn_output:
    case Value::attn_probs: return Component::self_attn;
    case Value::mlp_output: return Component::mlp;
    default: return Component::linear_attn;
  }
}

std::string site_path(const Site& s) {
  switch (s.value) {
    case Value::embed_output: return "embed_tokens.output";
    case Value::ln_final_output: return "ln_final.output";
    case Value::logits: return "logits";
    default: break;
  }
  std::string p = "layers." + std::to_string(s.layer) + ".";
  switch (value_component(s.value)) {
    case Component::linear_attn: p += "linear_attn."; break;
    case Component::self_attn: p += "self_attn."; break;
    case Component::mlp: p += "mlp."; break;
    default: break;
  }
  return p + std::string(value_name(s.value));
}

std::string derived_value_reason(Value v) {
  switch (v) {
    case Value::attn_probs:
      return "the softmax weights are recomputed from the queries and keys; write self_attn.attention_queries / "
             "attention_keys instead";
    case Value::token_mixing:
    case Value::state_input_mixing:
      return "it is derived: computed from the mixer's attention_queries / attention_keys / betas / decays; write "
             "those instead";
    default: return "";
  }
}

std::optional<int64_t> split_token(std::string& path) {
  const size_t at = path.rfind("@t");
  if (at == std::string::npos) return std::nullopt;
  const std::string num = path.substr(at + 2);
  const size_t digits = num.size() - (num.rfind('-', 0) == 0 ? 1 : 0);
  if (digits == 0 || digits > 12 ||
      !std::all_of(num.end() - static_cast<std::ptrdiff_t>(digits), num.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); }))
    throw InputError("value path '" + path + "': a token suffix is '@t<index>' (e.g. '@t5', '@t-1' for the last token)");
  path.resize(at);
  return std::stoll(num);
}

int64_t resolve_token(int64_t t, int64_t seq, const std::string& path) {
  const int64_t r = t < 0 ? seq + t : t;
  if (r < 0 || r >= seq)
    throw InputError("'" + path + "': token " + std::to_string(t) + " is out of range for a call of " + std::to_string(seq) +
                     " tokens (0.." + std::to_string(seq - 1) + ", or -" + std::to_string(seq) + "..-1)");
  return r;
}

}  // namespace mixlens
