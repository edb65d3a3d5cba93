// Pieces shared by the model families: embedding lookup, LM head, padding masks, value tables.
#pragma once
#include <functional>
#include <initializer_list>
#include <map>
#include <optional>
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
/// ConfigError naming the first field that is not in [1, kMaxConfigDim].
void require_positive(const io::Config& cfg, std::initializer_list<std::pair<const char*, int64_t>> fields);

// ---- Config range validation (every family; run by build_family before any factory) ------------
/// Largest value of any one size field (hidden_size, vocab_size, heads, head dims, state sizes...).
/// Real checkpoints stay under 2^18; the bound makes every product of two sizes fit int64 exactly.
inline constexpr int64_t kMaxConfigDim = int64_t{1} << 24;
/// Largest product of sizes that becomes one tensor (matches the safetensors / Tensor numel limit).
inline constexpr int64_t kMaxConfigNumel = int64_t{1} << 40;
/// Largest SSD / scan chunk length: the chunked kernels hold [chunk, chunk] blocks per head (cost
/// and memory grow with its square: 16384 took 89 s and 3.2 GB for 4 tokens). Published models use
/// 64-256.
inline constexpr int64_t kMaxChunkSize = 2048;

/// Validates the ranges of config.json (and its text_config / rope_parameters) before a family reads
/// it, so no family computes with a wrapped, absurd or non-finite number. ConfigError naming the field:
///  - size fields (hidden_size, vocab_size, *_size, *_dim, *_heads, *_layers, n_groups, ...): an
///    integer in [0, kMaxConfigDim] ("field 'X' = V is out of range: a size must be in [0, 16777216]");
///  - chunk sizes (chunk_size, *_chunk_size): an integer in [1, kMaxChunkSize];
///  - rope_theta, *eps* fields, expand / *_expand: finite and > 0; partial_rotary_factor in (0, 1];
///    time_step_* floats finite and >= 0;
///  - products of sizes that the families allocate (num_heads * head_dim, expand * hidden_size,
///    vocab_size * hidden_size, chunk_size^2 * num_heads, ...) at most kMaxConfigNumel, computed
///    without overflow;
///  - token ids (bos / eos / pad_token_id; an int or a list of ints; null allowed): in [0, vocab_size).
void validate_config(const io::Config& cfg);
/// An overflow-checked product of sizes; ConfigError naming `what` when it exceeds `limit`.
int64_t checked_size_product(const io::Config& cfg, const std::string& what, std::initializer_list<int64_t> factors,
                             int64_t limit = kMaxConfigNumel);
/// The first of `names` present in the checkpoint, checked against `shape`.
Tensor load_embedding(const io::WeightStore& w, std::initializer_list<const char*> names, const Shape& shape);
/// conv1d.weight [C,1,K] -> [K,C].
Tensor transpose_conv(const Tensor& w);
/// Embedding rows for the batch's ids; InputError for an id outside [0, vocab).
Tensor embed_tokens(const Tensor& embed, const Batch& in, const char* family);
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

/// Final logits: [B,T,V] when all_logits or someone wants them, else [B,1,V] (last position).
Tensor lm_logits(const Tensor& lm_head, const Tensor& h, Listener* ls, bool all_logits);
/// Multiplies each [B,T,...] row by the batch's 0/1 mask (apply_mask_to_padding_states).
void apply_row_mask(Tensor& t, const Batch& in);
/// Per row, its first real token (the number of left-padding positions; 0 without a mask): where a
/// recurrent layer's scan of the row starts (RowScan::first).
std::vector<int64_t> first_real_tokens(const Batch& in);

ValueInfo global_value(Value v, Shape shape, std::string meaning);
ValueInfo layer_value(int layer, Value v, Shape shape, bool per_token, std::string meaning);
/// support() entries for the per-token state methods (state_after, set_state_after): as "state".
void add_state_methods(std::map<std::string, std::map<int, std::string>>& s);
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

/// support() for a model whose every block is one recurrent mixer: everything available,
/// self_attn values unavailable with the reason.
std::map<std::string, std::map<int, std::string>> mixer_only_support(int num_layers, const std::string& family);

}  // namespace mixlens::detail
