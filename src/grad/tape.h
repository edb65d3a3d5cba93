// What a forward call keeps for Trace::backward (issue 12, docs/gradients.md): the call's input,
// the cache it started from, every block's input (post-write) as a recomputation checkpoint, and
// every write made during the call (the written value and which elements it changed). The
// backward recomputes one block at a time from its checkpoint, re-applying the recorded writes,
// so the memory held is one residual stream per block plus what the block being differentiated
// needs.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "hooks/kept.h"
#include "hooks/listener.h"
#include "mixlens/model.h"
#include "models/family.h"

namespace mixlens::grad {

/// One write of a call: the value the forward used and the elements the write changed (elements a
/// write left bitwise equal pass the gradient through; changed ones are constants upstream).
struct Written {
  Tensor value;
  std::vector<uint8_t> changed;  ///< per element, 1 = overwritten
  /// Applies the write to a recomputed value (changed elements take the written value).
  void apply(Tensor& t) const;
  /// Zeroes the gradient of changed elements (they do not depend on what came before the write).
  void block(Tensor& g) const;
  bool any() const;
};

struct Tape : KeptTensors {
  const detail::FamilyModel* family = nullptr;
  Batch batch;
  std::unique_ptr<detail::CacheState> cache_before;  ///< deep copy taken before the call
  std::string kernel;
  int step = 0;
  std::vector<Tensor> layer_inputs;  ///< per block, as consumed (after writes)
  Tensor final_hidden;               ///< the last block's layer_output as consumed (before ln_final)
  /// ln_final_output as the LM head read it (after writes): the logits of any position are
  /// recomputed from it (logits_at), so the forward need not form every position's logits.
  Tensor final_normed;
  detail::FamilyModel::Head head;    ///< the family's LM head (lm_head, logit scale); lm_head null: none declared
  std::map<std::pair<int, int>, Written> writes;
  std::string unsupported;           ///< non-empty: why backward cannot run for this call
  Shape logits_shape;                ///< the call's returned logits: [B,T,V], or [B,1,V] (last position)

  const Written* write(int layer, Value v) const {
    auto it = writes.find({layer, static_cast<int>(v)});
    return it == writes.end() ? nullptr : &it->second;
  }
  /// The recorded write of (layer, v) applied to `t`, if any.
  void apply(int layer, Value v, Tensor& t) const {
    if (const Written* w = write(layer, v)) w->apply(t);
  }
  void block(int layer, Value v, Tensor& g) const {
    if (const Written* w = write(layer, v)) w->block(g);
  }
};

/// Where a family's backward puts the gradients asked for.
class GradSink {
 public:
  GradSink(std::vector<Site> wanted);
  bool wants(int layer, Value v) const;
  /// Whether a wanted gradient lies below block `layer`'s output: a value of that block other than
  /// its layer_output, of an earlier block, or embed_output. False: the backward stops there (the
  /// blocks below would compute gradients nobody asked for).
  bool needs_below(int layer) const;
  /// The call positions dlogits covers (ascending, distinct): every position of the call, or the
  /// few a metric reads (the LM head's backward then runs on those rows only).
  std::vector<int64_t> positions;
  /// Stores a copy of `g` as the gradient of (layer, v) if it was asked for.
  void put(int layer, Value v, const Tensor& g);
  std::map<std::string, Tensor>& grads() { return grads_; }

 private:
  std::vector<Site> wanted_;
  std::map<std::string, Tensor> grads_;
};

/// Wraps the call's listener (trace / session): records block inputs and writes into `tape`.
class Recorder final : public detail::Listener {
 public:
  Recorder(detail::Listener* inner, Tape& tape) : inner_(inner), tape_(tape) {}
  void begin_call(const detail::CallCtx& ctx, int num_layers) override;
  void end_call() override;
  bool visit(int layer, Value v, Tensor& value, const Shape& shape) override;
  int64_t next_state_token(int layer, int64_t after) const override;
  bool visit_state(int layer, int64_t t, Tensor& value, const Shape& shape) override;
  void revised(int layer, Value v, const Tensor& value) override;

 private:
  void refresh();
  detail::Listener* inner_;
  Tape& tape_;
  int layers_ = 0;
  std::vector<float> before_;  ///< a visited value before the inner listener saw it (reused)
};

/// Runs the family's backward for `tape` and returns path -> gradient for `wanted`. `dlogits` is
/// [B,P,V] for `positions` (empty: every position of the call, or the call's own logits shape).
std::map<std::string, Tensor> run_backward(const Tape& tape, const Tensor& dlogits, const std::vector<Site>& wanted,
                                           const std::vector<int64_t>& positions = {});
/// The call's logits [B,P,V] at `positions` (call positions, ascending), from tape.final_normed.
Tensor logits_at(const Tape& tape, const std::vector<int64_t>& positions);
/// The LM head's backward, shared by the families: dL/d(ln_final_output) [B,T,D] from dlogits
/// [B,P,V] at sink.positions (rows elsewhere get 0). Puts the logits' and ln_final_output's
/// gradients into the sink (a full [B,T,V] only when the logits gradient is asked for or a write
/// changed logits) and blocks written elements. `scale`: the served logits' multiplier. `soft_cap` > 0: the
/// served logits are soft_cap * tanh(z / soft_cap) (RecurrentGemma's logits_soft_cap, xLSTM's soft_cap), z recomputed from
/// tape.final_normed.
Tensor head_backward(const Tape& tape, const Tensor& dlogits, const Tensor& lm_head, float scale, GradSink& sink,
                     float soft_cap = 0.0f);

}  // namespace mixlens::grad

namespace mixlens::detail {
/// Model-side access to a Trace's gradient record (defined in runtime/trace.cpp).
struct GradAccess {
  static bool enabled(const Trace& t);
  static void store(Trace& t, std::shared_ptr<grad::Tape> tape);
  /// The tape of the trace's last recorded call, or nullptr (tests: drop what the forward kept).
  static grad::Tape* tape(Trace& t);
};
}  // namespace mixlens::detail

namespace mixlens::grad {
/// A tape for a call about to run: the batch and a deep copy of the cache it starts from.
std::shared_ptr<Tape> begin_tape(const detail::FamilyModel& family, const Batch& in, const detail::CacheState& cache,
                                 const detail::CallCtx& ctx);
}  // namespace mixlens::grad
