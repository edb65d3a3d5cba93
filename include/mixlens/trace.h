// Trace: reads (saves) and writes (edits) registered before a run, TransformerLens-style.
// A trace is bound to a model when a run starts; every path is validated then, so a typo
// fails before any computation with the closest valid name suggested.
#pragma once
#include <climits>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "mixlens/tensor.h"
#include "mixlens/values.h"

namespace mixlens {

/// Which forward calls (generation steps) a save or edit applies to: step 0 is the prompt,
/// step k >= 1 the k-th single-token decode step. A plain run is step 0. A save or write whose first
/// step a call never makes raises InputError rather than being absent or silently not applied:
/// Model::run() and the Session factories before running, Model::generate() before generating (a step
/// >= max_new_tokens) and after (every row stopped at EOS first). A Trace passed to several
/// Model::forward() calls is not checked (the steps still to come are unknown).
struct Steps {
  int first = 0;
  int last = INT_MAX;  ///< inclusive
  static Steps all() { return {}; }
  static Steps only(int k) { return {k, k}; }
  static Steps range(int first, int last) { return {first, last}; }
  bool contains(int s) const { return s >= first && s <= last; }
};

/// A save / edit key and the steps it names: "path@step3" -> {"path", Steps::only(3)}; a key without
/// the suffix -> {key, Steps::all()}. The one parser of the "@step<k>" suffix (Python saves= / edits=
/// keys, CLI --save; saved values are keyed the same way): "layers.0.linear_attn.state@t0@step2" is
/// the state after the only token of step 2's call. InputError on a malformed suffix ("@step",
/// "@stepx", "@step-1", a step above INT_MAX).
struct StepPath {
  std::string path;
  Steps steps;
};
StepPath split_step(std::string_view key);

/// Where an edit is being applied.
struct SiteContext {
  Site site;
  std::string path;
  int step = 0;
  int64_t batch = 0;
  int64_t seq = 0;          ///< tokens in this call
  std::string kernel;       ///< "chunked" or "recurrent" for mixer values, "" otherwise
};

/// An edit receives a copy of the value and may modify it in place or assign a new tensor of
/// the same shape. A state_input on a fresh prompt arrives undefined (None); assigning a
/// tensor then makes the call start from it.
using EditFn = std::function<void(Tensor& value, const SiteContext& where)>;

/// One forward call as it happened: observable kernel choice and length (values.md). (kernel, seq,
/// first) are the seed's per-call (state op, sequence length, first) of every recurrent mixer of the
/// call (docs/values.md "Kernel identity").
struct CallRecord {
  int step = 0;
  int64_t batch = 0;
  int64_t seq = 0;
  bool fresh = true;        ///< no cached state before the call
  std::string kernel;       ///< recurrent-mixer algorithm that ran: "chunked" or "recurrent"
  /// Positions earlier calls of this run (on this cache) pushed through each layer: 0 for a prompt;
  /// step k of a generation after a T-position prompt has first = T + k - 1 (left padding counts, as
  /// in Cache::seen_tokens).
  int64_t first = 0;
};

class Model;

/// What a recurrent mixer is and runs (values.md "Derived values and identity", docs/values.md
/// "Kernel identity"): the seed's mixer kind, prompt and step kernels and state op.
struct MixerIdentity {
  std::string kind;           ///< "ssd" (Mamba-2), "selective_scan" (Mamba-1), "gated_delta" (DeltaNet), "kimi_delta" (KDA)
  std::string prompt_kernel;  ///< algorithm a fresh prompt of the given length runs: "chunked" or "recurrent"
  std::string step_kernel;    ///< algorithm a one-token decode step over a cache runs
  std::string state_op;       ///< the one-token state update: "selective_state_update", "gated_delta_rule", "kimi_delta_rule"
};

/// The identity of layer `layer`'s recurrent mixer (`linear_attn`) under the current kernel route
/// (route_kernels) and chunk size; `prompt_seq` (>= 1) is the prompt length prompt_kernel is for
/// (Mamba-1 picks its prompt scan by length and width). InputError for a layer out of range or
/// prompt_seq < 1; UnsupportedError for a block without a recurrent mixer (attention, MLP, MoE).
MixerIdentity mixer_identity(const Model& model, int layer, int64_t prompt_seq);

namespace detail { class TraceListener; struct GradAccess; }

/// Default budget for the values one Trace saves (see Trace::save).
inline constexpr uint64_t kDefaultSaveBudgetBytes = uint64_t{8} << 30;
/// The budget in force: $MIXLENS_SAVE_BUDGET_MB MiB when set (InputError if malformed), else
/// kDefaultSaveBudgetBytes.
uint64_t save_budget_bytes();

class Trace {
 public:
  Trace();
  ~Trace();
  Trace(Trace&&) noexcept;
  Trace& operator=(Trace&&) noexcept;

  /// Save a value (a copy) at the given steps. `path` may use "*" for the layer index
  /// ("layers.*.linear_attn.state_output": every layer that has that value). The saved copies of
  /// one trace are held to save_budget_bytes() (default 8 GiB; $MIXLENS_SAVE_BUDGET_MB): the save
  /// that would pass it raises ResourceError during the run, so a long generation saving every
  /// step stops with a clear error instead of exhausting memory.
  /// Per-token state: "layers.1.linear_attn.state@t5" is the state after token 5 of the call
  /// ([B, ...state], served layout), "@t-1" after its last token; saved and fetched under the path
  /// as spelled. A write (edit / set) there replaces it, and tokens 6.. continue from it (the scan
  /// is split at t, chunked or not, in the rows whose state the write changes). A token out of range for a call raises InputError before it
  /// runs (restrict `steps` for decode steps, which have one token).
  Trace& save(std::string_view path, Steps steps = Steps::all());
  /// Modify a value before it is consumed; everything computed after it follows.
  /// Writes are checked: same shape, no NaN, betas >= 0, decays <= 0 (WriteError otherwise).
  Trace& edit(std::string_view path, EditFn fn, Steps steps = Steps::all());
  /// Replace a value by a fixed tensor (checked like edit()).
  Trace& set(std::string_view path, Tensor value, Steps steps = Steps::all());

  /// True if `path` (canonical, no wildcard) was saved at `step` with a value (state_input on a
  /// fresh prompt is None and is not stored).
  bool has(std::string_view path, int step = 0) const;
  /// The saved value (a handle to the saved copy, valid after later runs on this trace);
  /// UnknownValueError if it was not saved at that step.
  Tensor get(std::string_view path, int step = 0) const;
  /// Every saved value as "path@step{k}" -> tensor, in the order produced.
  const std::vector<std::pair<std::string, Tensor>>& saved() const;
  /// The forward calls this trace observed.
  const std::vector<CallRecord>& calls() const;
  /// Forget saved values and call records (registrations stay).
  void clear_results();

  // ---- Gradients (issue 12; docs/gradients.md) ---------------------------------------------
  /// Record what backward() needs during the next forward calls made with this trace (each call
  /// replaces the previous record): the call's input and starting cache, every block's input, and
  /// every write with the elements it changed. Costs one copy of the residual stream per block.
  Trace& enable_grad(bool on = true);
  bool grad_enabled() const;
  /// Reverse pass through the most recent forward call recorded with enable_grad(): `dlogits` is
  /// dMetric/dLogits [B,T,vocab] of that call (see mixlens/grad.h for metric helpers). Computes the
  /// gradient of the metric with respect to every value in `paths` (patterns as save(), "*" for
  /// every layer; default: every path registered with save()), through the edited forward: an
  /// element a write changed is a constant (no gradient flows to what computed it), as a tensor
  /// assignment in torch. The cache the call started from is a constant (its gradient is
  /// state_input's); state_output feeds only the next call, so its gradient is zero. A per-token
  /// state 'layers.i.linear_attn.state@t5' gets dL/dS_5, token 5 of that layer's `states` gradient
  /// (computed for the layer, kept only if asked for too), [B, ...state] as the value.
  /// Errors: InputError (no recorded call, wrong dlogits shape, non-finite dlogits, a token outside
  /// the call), UnknownValueError (bad path, '@t' on a value other than 'state'), UnsupportedError (a family
  /// without a backward yet, a call that wrote a per-token state). The Model must still be alive.
  void backward(const Tensor& dlogits, const std::vector<std::string>& paths = {});
  /// As backward(dlogits, paths), with `dlogits` [B,P,vocab] covering only `positions` (ascending,
  /// distinct call positions; the others' dMetric/dLogits is zero): the LM head's backward runs on
  /// those rows only (a metric of the last position: 1 row instead of T). InputError on bad positions.
  void backward(const Tensor& dlogits, const std::vector<std::string>& paths, const std::vector<int64_t>& positions);
  /// The logits [B,P,vocab] of the recorded call at `positions` (call positions), formed from its
  /// recorded LM-head input: a call recorded with enable_grad returns every position's logits only
  /// when all_logits (or someone saves them), so a metric reads its rows from here. InputError
  /// (no recorded call, a position outside it).
  Tensor logits_at(const std::vector<int64_t>& positions) const;
  /// True when the last backward() computed the gradient of `path` (canonical, no "*").
  bool has_grad(std::string_view path) const;
  /// dMetric/d(value) from the last backward(), shaped as the value; UnknownValueError when it was
  /// not computed (name it in backward's paths or save() it).
  Tensor grad(std::string_view path) const;
  /// Every gradient of the last backward(), path -> tensor.
  const std::map<std::string, Tensor>& grads() const;

 private:
  friend class Model;
  friend class detail::TraceListener;
  friend struct detail::GradAccess;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mixlens
