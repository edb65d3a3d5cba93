// Value serving shared by every forward (models and mixers): the padding row mask, the state_input /
// state_output sites, per-token state copies, value-table entries and the non-finite watch. Lower
// than the mixers so a mixer serves its values without reaching up into models/.
#pragma once
#include <functional>
#include <optional>
#include <string>
#include <utility>

#include "hooks/listener.h"
#include "mixlens/model.h"
#include "mixlens/values.h"

namespace mixlens::detail {

/// Watches one forward for the first value that goes non-finite (NaN or +-inf), so a poisoned call
/// raises NumericError instead of returning NaN logits (greedy would then pick id 0 and generation
/// would stop silently, or attention would turn NaN rows into finite wrong numbers). Every family's
/// forward calls check() on the values it adds to the residual stream (embeddings, each mixer /
/// attention / MLP output, each layer output: one pass over [B,T,D], negligible next to the
/// matmuls) and finish() on the logits.
class FiniteWatch {
 public:
  explicit FiniteWatch(std::string family) : family_(std::move(family)) {}
  /// Remembers `layer`/`v` if `t` is the first non-finite tensor of the call (no scan after that).
  void check(int layer, Value v, const Tensor& t);
  /// NumericError "<family>: forward produced non-finite logits (N of M entries are NaN/inf); the
  /// first non-finite value was layers.3.linear_attn.attention_output = NaN at [0, 2, 17] (layers.2.layer_output was
  /// finite)" when `logits` holds a NaN or inf, or when a checked value did (even if the logits
  /// computed, e.g. only the last position's, stayed finite); nothing otherwise.
  void finish(const Tensor& logits) const;
  bool tripped() const { return !first_.empty(); }

 private:
  std::string family_, first_;
  std::optional<Site> last_finite_;
};

/// Multiplies each [B,T,...] row by the batch's 0/1 mask (apply_mask_to_padding_states).
void apply_row_mask(Tensor& t, const Batch& in);
/// A mixer's input as its projections read it: `x` itself, or when `masked` a copy with the padding
/// rows zeroed (apply_mask_to_padding_states on the mixer input only).
Tensor masked_input(const Tensor& x, const Batch& in, bool masked);
/// Per row, its first real token (the number of left-padding positions; 0 without a mask): where a
/// recurrent layer's scan of the row starts (RowScan::first).
std::vector<int64_t> first_real_tokens(const Batch& in);

ValueInfo global_value(Value v, Shape shape, std::string meaning);
ValueInfo layer_value(int layer, Value v, Shape shape, bool per_token, std::string meaning);
/// The state_input site of a recurrent layer: serves the kernel-layout state S [B,...] as serve(S)
/// with row shape `served_row` (None on a fresh call: S is the cache's zeros, every cache starts
/// zeroed and one whose call stopped midway refuses further calls), and lays a write back with
/// store(served, S). Shared by every family so the semantics cannot drift apart.
void visit_state_input(int layer, Tensor& S, bool has_state, Listener* ls, const Shape& served_row,
                       const std::function<Tensor(const Tensor&)>& serve,
                       const std::function<void(const Tensor&, Tensor&)>& store);
/// The state_output site: serves serve(S) and lays a write back (the next call starts from it).
void visit_state_output(int layer, Tensor& S, Listener* ls, const std::function<Tensor(const Tensor&)>& serve,
                        const std::function<void(const Tensor&, Tensor&)>& store);

}  // namespace mixlens::detail
