// Pieces shared by the model families: embedding lookup, LM head, padding masks, value tables.
#pragma once
#include <functional>
#include <initializer_list>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "io/json.h"
#include "io/weights.h"
#include "mixlens/model.h"
#include "runtime/listener.h"

namespace mixlens::detail {

/// "config.json (<path>)" for messages.
std::string where(const io::Config& cfg);
/// ConfigError naming the first field that is not > 0.
void require_positive(const io::Config& cfg, std::initializer_list<std::pair<const char*, int64_t>> fields);
/// The first of `names` present in the checkpoint, checked against `shape`.
Tensor load_embedding(const io::WeightStore& w, std::initializer_list<const char*> names, const Shape& shape);
/// conv1d.weight [C,1,K] -> [K,C].
Tensor transpose_conv(const Tensor& w);
/// Embedding rows for the batch's ids; InputError for an id outside [0, vocab).
Tensor embed_tokens(const Tensor& embed, const Batch& in, const char* family);
/// Final logits: [B,T,V] when all_logits or someone wants them, else [B,1,V] (last position).
Tensor lm_logits(const Tensor& lm_head, const Tensor& h, Listener* ls, bool all_logits);
/// Multiplies each [B,T,...] row by the batch's 0/1 mask (apply_mask_to_padding_states).
void apply_row_mask(Tensor& t, const Batch& in);

ValueInfo global_value(Value v, Shape shape, std::string meaning);
ValueInfo layer_value(int layer, Value v, Shape shape, bool per_token, std::string meaning);
/// Copies one state per row, `state` [B,...], into token t of `states` [B,T,...] (a written
/// per-token state is what `states` then reports at t).
void copy_state_into(const Tensor& state, Tensor& states, int64_t t);
/// support() entries for the per-token state methods (state_after, set_state_after): as "state".
void add_state_methods(std::map<std::string, std::map<int, std::string>>& s);
/// The state_input site of a recurrent layer: zeroes the kernel-layout state S [B,...] on a fresh
/// call, serves it (None when fresh) as serve(S) with row shape `served_row`, and lays a write back
/// with store(served, S). Shared by every family so the semantics cannot drift apart.
void visit_state_input(int layer, Tensor& S, bool has_state, Listener* ls, const Shape& served_row,
                       const std::function<Tensor(const Tensor&)>& serve,
                       const std::function<void(const Tensor&, Tensor&)>& store);
/// The state_output site: serves serve(S) and lays a write back (the next call starts from it).
void visit_state_output(int layer, Tensor& S, Listener* ls, const std::function<Tensor(const Tensor&)>& serve,
                        const std::function<void(const Tensor&, Tensor&)>& store);

/// support() for a model whose every block is one recurrent mixer: everything available,
/// self_attn values unavailable with the reason.
std::map<std::string, std::map<int, std::string>> mixer_only_support(int num_layers, const std::string& family);

}  // namespace mixlens::detail
