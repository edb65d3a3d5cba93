#include "mixlens/values.h"

namespace mixlens {

std::string_view layer_kind_name(LayerKind k) {
  switch (k) {
    case LayerKind::mamba2: return "mamba2";
    case LayerKind::mamba: return "mamba";
    case LayerKind::gated_deltanet: return "gated_deltanet";
    case LayerKind::attention: return "attention";
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
    case Value::attention_head_outputs: return "attention_head_outputs";
    case Value::attention_output: return "attention_output";
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
  if (value_component(s.value) == Component::linear_attn) p += "linear_attn.";
  return p + std::string(value_name(s.value));
}

}  // namespace mixlens
