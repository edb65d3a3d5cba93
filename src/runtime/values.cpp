#include "mixlens/values.h"

namespace mixlens {

std::string_view layer_kind_name(LayerKind k) {
  switch (k) {
    case LayerKind::mamba2: return "mamba2";
    case LayerKind::mamba: return "mamba";
    case LayerKind::gated_deltanet: return "gated_deltanet";
    case LayerKind::attention: return "attention";
    case LayerKind::mlp: return "mlp";
    case LayerKind::hybrid: return "hybrid";
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
    case Value::attn_queries: return "attention_queries";
    case Value::attn_keys: return "attention_keys";
    case Value::attn_values: return "attention_values";
    case Value::attn_gate: return "gate";
    case Value::attn_output: return "attention_output";
    case Value::attn_probs: return "attention_probabilities";
    case Value::mlp_output: return "output";
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

}  // namespace mixlens
