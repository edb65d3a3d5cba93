// Binds a Trace's registrations to a model for one forward call and serves them as a Listener.
#pragma once
#include <string>
#include <vector>

#include "hooks/listener.h"
#include "mixlens/trace.h"

namespace mixlens::detail {

class FamilyModel;

/// Resolves `pattern` ("layers.*.linear_attn.betas", "logits", ...) to canonical sites of `model`.
/// UnknownValueError naming the problem (unknown name with the nearest suggestion, layer out of
/// range, a component the block does not have, named by the block's kind). The messages name the path
/// as `shown` (the caller's spelling, e.g. with its "@t5" suffix) when given, else `pattern`.
std::vector<Site> resolve_path(const FamilyModel& model, const std::string& pattern, const std::string& shown = {});

class TraceListener final : public Listener {
 public:
  /// Validates every registration of `trace` against `model` (throws before any computation).
  TraceListener(Trace& trace, const FamilyModel& model);
  void begin_call(const CallCtx& ctx, int num_layers) override;
  void end_call() override;
  bool visit(int layer, Value v, Tensor& value, const Shape& shape) override;
  int64_t next_state_token(int layer, int64_t after) const override;
  bool visit_state(int layer, int64_t t, Tensor& value, const Shape& shape) override;
  void revised(int layer, Value v, const Tensor& value) override;
  void defer_saves() override { defer_saves_ = true; }
  void settled(int layer, Value v, const Tensor& value) override;
  void settled_state(int layer, int64_t t, const Tensor& value) override;

  /// InputError for a save or write registered at one step or a range (Steps::only / range) whose
  /// first step is not in made_first..made_last, the steps a run made: the save would be absent,
  /// the write silently not applied. Same message as the Python package.
  static void check_steps_made(const Trace& trace, int made_first, int made_last);
  /// Before generating: InputError for a registration whose first step is >= max_new_tokens.
  static void check_steps_reachable(const Trace& trace, int max_new_tokens);

 private:
  /// Edits of (layer, v) at this step (for Value::state, those whose token is `token`), then saves.
  bool serve(int layer, Value v, int64_t token, Tensor& value, const Shape& shape);
  /// Stores `value` for every save registration of `site` at this step (all = also sites saved
  /// before; revised() passes false to update only those already stored).
  void record_saves(Site site, int64_t token, const Tensor& value, bool only_existing);
  bool defer_saves_ = false;
  Trace& trace_;
  const std::vector<std::vector<Site>>& sites_;  // per registration (bound in the Trace)
  CallCtx ctx_;
};

/// Checks a write: defined, same shape, no NaN, value range (betas >= 0, decays <= 0).
void check_write(const std::string& path, Value v, const Tensor& written, const Shape& expected);

}  // namespace mixlens::detail
