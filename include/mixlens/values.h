// The value vocabulary of shared/spec/values.md: every readable / writable site of a model.
// Paths are strings such as "layers.3.linear_attn.betas"; they map to typed Sites.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "mixlens/tensor.h"

namespace mixlens {

/// Every value kind mixlens serves. Mixer values keep the names of values.md exactly.
enum class Value : uint8_t {
  // global
  embed_output,     ///< "embed_tokens.output" [B,T,hidden]
  ln_final_output,  ///< "ln_final.output" [B,T,hidden]
  logits,           ///< "logits" [B,T,vocab]
  // per block
  layer_input,   ///< "layers.{i}.layer_input" [B,T,hidden] residual stream entering block i
  layer_output,  ///< "layers.{i}.layer_output" [B,T,hidden] residual stream leaving block i
  // recurrent mixer ("layers.{i}.linear_attn.<name>")
  attention_queries,       ///< what reads the state (Mamba-2: C [B,T,groups,state_dim])
  attention_keys,          ///< where each token writes (Mamba-2: B [B,T,groups,state_dim])
  attention_values,        ///< what each token writes (Mamba-2: x [B,T,heads,head_dim])
  betas,                   ///< write strength (Mamba-2: dt [B,T,heads], >= 0)
  decays,                  ///< log state decay, <= 0 (Mamba-2: A*dt [B,T,heads])
  state_input,             ///< state the call starts from (None on a fresh prompt)
  state_output,            ///< state after the call's last token
  states,                  ///< state after every token [B,T,...], read-only, computed on demand
  state,                   ///< state after one token t ("...linear_attn.state@t5"), read/write [B,...]
  attention_head_outputs,  ///< each head's read of the state incl. the D skip (Mamba-2: y)
  attention_output,        ///< what the mixer adds to the residual stream [B,T,hidden]
  // softmax attention of a hybrid ("layers.{i}.self_attn.<name>")
  attn_queries,  ///< "attention_queries": q after q_norm and RoPE [B,T,heads,head_dim]
  attn_keys,     ///< "attention_keys": k after k_norm and RoPE [B,T,kv_heads,head_dim]
  attn_values,   ///< "attention_values": v [B,T,kv_heads,head_dim]
  attn_gate,     ///< "gate": output-gate logits before the sigmoid [B,T,heads*head_dim]
  attn_output,   ///< "attention_output": what the attention adds to the residual [B,T,hidden]
  attn_probs,    ///< "attention_probabilities": softmax weights [B,heads,T,T_k], read-only, computed on demand
  // feed-forward ("layers.{i}.mlp.output")
  mlp_output,    ///< "output": MLP / MoE output added to the residual [B,T,hidden]
  // derived from a recurrent mixer's values (issue 26; "layers.{i}.linear_attn.<name>"), read-only
  token_mixing,        ///< "token_mixing": exact token-to-token mixing [B,H,T,T], computed on demand
  state_input_mixing,  ///< "state_input_mixing": rows of the state_input term [B,H,T,state key dim]
  kCount
};
constexpr int kNumValues = static_cast<int>(Value::kCount);

/// Which component of a block a value belongs to.
enum class Component : uint8_t { global, block, linear_attn, self_attn, mlp };

/// The kind of a block's sequence mixer.
/// A block's kind: its recurrent mixer, softmax attention, an MLP-only or MoE-only block
/// (Nemotron-H '-' / 'E'), or a Falcon-H1 hybrid block (Mamba-2 and attention side by side).
enum class LayerKind : uint8_t { mamba2, mamba, gated_deltanet, attention, mlp, hybrid, moe, short_conv, rwkv, rg_lru, lightning, mlstm };
std::string_view layer_kind_name(LayerKind k);

/// A typed site: layer -1 for global values.
struct Site {
  int layer = -1;
  Value value = Value::logits;
  bool operator==(const Site&) const = default;
};

/// Per-token addressing of Value::state in a path: "layers.1.linear_attn.state@t5" is the state
/// after token 5 of the call, "@t-1" after its last token (negative counts from the end).
/// Splits `path` into the path without the suffix and the token; nullopt when there is none.
/// InputError on a malformed suffix ("@t", "@tx").
std::optional<int64_t> split_token(std::string& path);
/// Resolves a possibly negative token against a call of `seq` tokens; InputError when out of range.
int64_t resolve_token(int64_t t, int64_t seq, const std::string& path);

/// Values derived from others and recomputed from them (attention_probabilities, token_mixing,
/// state_input_mixing): why a write of `v` is refused and what to write instead; empty for every
/// other value. The one wording of WriteError for them (Trace, Session).
std::string derived_value_reason(Value v);

/// Name of a value inside its component ("betas", "layer_input", "output" for embed/ln_final, "logits").
std::string_view value_name(Value v);
Component value_component(Value v);
/// Canonical path of a site, e.g. "layers.3.linear_attn.betas", "logits".
std::string site_path(const Site& s);

/// Description of one value of a model for a given batch and call length.
struct ValueInfo {
  std::string path;        ///< canonical path ("layers.0.linear_attn.states")
  Site site;
  Shape shape;             ///< for the batch / length asked for
  bool writable = true;
  bool per_token = true;   ///< has a token axis (axis 1)
  std::string meaning;     ///< one line: what the value is and which reference quantity it equals
};

}  // namespace mixlens
