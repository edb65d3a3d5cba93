// Listener: how a forward hands values to whoever asked for them (DESIGN.md "Sites and listeners").
// A site nobody wants costs one bit test; a wanted value is visited in its served layout.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "mixlens/errors.h"
#include "mixlens/tensor.h"
#include "mixlens/values.h"

namespace mixlens::grad {
struct KeptTensors;
}

namespace mixlens::detail {

/// Set (on its thread) by a Session whose forward runs on the caller's thread as a fiber: called
/// by check_cancel, so a signal (Ctrl-C) is noticed between layers while nobody else waits.
/// It may throw (the run stops with that error); it limits its own rate.
inline thread_local void (*tl_poll)(void*) = nullptr;
inline thread_local void* tl_poll_arg = nullptr;

/// Facts about the forward call in progress.
struct CallCtx {
  int step = 0;
  int64_t batch = 0;
  int64_t seq = 0;
  bool fresh = true;           ///< no cached recurrent state before this call
  int64_t first = 0;           ///< positions earlier calls on this cache pushed through (CallRecord::first)
  std::string kernel;          ///< "chunked" or "recurrent"
  /// Set by another thread to stop the run (Ctrl-C, Session::abort); may be null.
  const std::atomic<bool>* cancel = nullptr;
  /// A call recorded for gradients (src/grad): the forward may keep there intermediates its backward
  /// would otherwise recompute (grad::KeptTensors::keep, the grad::Tape's); null otherwise.
  grad::KeptTensors* tape = nullptr;
  /// Called by the forwards between layers: InterruptedError once `cancel` is set.
  void check_cancel() const {
    if (tl_poll != nullptr) tl_poll(tl_poll_arg);
    if (cancel && cancel->load(std::memory_order_relaxed))
      throw InterruptedError("the run was interrupted (cancelled at step " + std::to_string(step) + ")");
  }
};

class Listener {
 public:
  virtual ~Listener() = default;
  /// Called before a forward call; must fill mask_ (num_layers + 1 entries, [0] = global).
  virtual void begin_call(const CallCtx& ctx, int num_layers) = 0;
  virtual void end_call() {}
  /// True when someone wants (layer, v) in this call. layer -1 = global values.
  bool wants(int layer, Value v) const {
    return (mask_[static_cast<size_t>(layer + 1)] >> static_cast<unsigned>(v)) & 1u;
  }
  /// Hands over `value` (served layout, shape `shape`; undefined for a None state_input).
  /// The listener may read it and may overwrite it in place or replace it (validated, same
  /// shape). Returns true when the value was written.
  virtual bool visit(int layer, Value v, Tensor& value, const Shape& shape) = 0;
  /// Per-token state (Value::state, values.md "state_after"): the first token > `after` of this
  /// call (0..seq-1) at which `layer`'s state is wanted, or -1 for none. Asked only when
  /// wants(layer, Value::state); asked again after each visit_state, so the answer may change.
  virtual int64_t next_state_token(int /*layer*/, int64_t /*after*/) const { return -1; }
  /// Hands over the state after token `t` (served layout [B, ...state], key side first); the
  /// listener may read it or write it (same contract as visit()); the scan resumes from it.
  virtual bool visit_state(int /*layer*/, int64_t /*t*/, Tensor& /*value*/, const Shape& /*shape*/) { return false; }
  /// Per layer (index layer + 1) bit set of the wanted values, as filled by begin_call.
  const std::vector<uint32_t>& mask() const { return mask_; }
  /// An already-visited value changed as a consequence of a later write (Mamba's betas = dt after a
  /// decays write): `value` is what the forward uses now. Saves and copies of it follow.
  virtual void revised(int layer, Value v, const Tensor& value) { (void)layer, (void)v, (void)value; }
  /// ChainListener calls this on its first listener: record saves in settled(), after every later
  /// listener's writes, so a save holds the value the forward consumes.
  virtual void defer_saves() {}
  /// The value as the forward consumes it, after every listener of the chain visited it.
  virtual void settled(int layer, Value v, const Tensor& value) { (void)layer, (void)v, (void)value; }
  /// As settled(), for the per-token state after token t (visit_state).
  virtual void settled_state(int layer, int64_t t, const Tensor& value) { (void)layer, (void)t, (void)value; }

  /// A buffer for a `states` stack of `shape`, contents uninitialised (the scans write every
  /// element): the previous layer's stack when nobody holds it any more (the reader dropped it, as
  /// a loop reading every layer's states does). Fresh pages cost a page fault and a kernel zeroing
  /// each, which was half the time of reading every layer's states (issue 7 item 3).
  Tensor stack_buffer(const Shape& shape) {
    Tensor t = std::move(spare_stack_);
    spare_stack_ = Tensor();
    if (t.defined() && t.sole_owner() && t.shape() == shape) return t;
    t = Tensor();  // held elsewhere (a save, a Python array) or of another shape: never reused
    ++stacks_made_;
    return Tensor::uninitialized(shape);
  }
  /// Stacks stack_buffer had to allocate (not reused) so far.
  int64_t stacks_made() const { return stacks_made_; }
  /// After the stack was served: kept for the next stack_buffer (reused only once nobody else holds it).
  void recycle_stack(Tensor&& stack) { spare_stack_ = std::move(stack); }
  /// Drops the kept stack (a listener that outlives one forward call, at its end).
  void release_stack() { spare_stack_ = Tensor(); }

 protected:
  std::vector<uint32_t> mask_;

 private:
  Tensor spare_stack_;
  int64_t stacks_made_ = 0;
};

/// Serves two listeners in one forward: `first` (a Trace's saves / edits) sees each value before
/// `second` (the Session interleaver), so the interleaved block reads pre-registered edits.
/// `second` may change what it wants while it is inside a callback; the union is refreshed after
/// each one.
class ChainListener final : public Listener {
 public:
  ChainListener(Listener& first, Listener& second) : first_(first), second_(second) { first_.defer_saves(); }
  void begin_call(const CallCtx& ctx, int num_layers) override {
    first_.begin_call(ctx, num_layers);
    second_.begin_call(ctx, num_layers);
    refresh();
  }
  void end_call() override {
    first_.end_call();
    second_.end_call();
  }
  int64_t next_state_token(int layer, int64_t after) const override {
    const int64_t a = first_.wants(layer, Value::state) ? first_.next_state_token(layer, after) : -1;
    const int64_t b = second_.wants(layer, Value::state) ? second_.next_state_token(layer, after) : -1;
    return a < 0 ? b : b < 0 ? a : std::min(a, b);
  }
  bool visit_state(int layer, int64_t t, Tensor& value, const Shape& shape) override {
    bool written = false;
    const bool first = first_.wants(layer, Value::state) && first_.next_state_token(layer, t - 1) == t;
    if (first) written = first_.visit_state(layer, t, value, shape);
    if (second_.wants(layer, Value::state) && second_.next_state_token(layer, t - 1) == t)
      written = second_.visit_state(layer, t, value, shape) || written;
    if (first) first_.settled_state(layer, t, value);
    refresh();
    return written;
  }
  bool visit(int layer, Value v, Tensor& value, const Shape& shape) override {
    bool written = false;
    const bool first = first_.wants(layer, v);
    if (first) written = first_.visit(layer, v, value, shape);
    if (second_.wants(layer, v)) written = second_.visit(layer, v, value, shape) || written;
    if (first) first_.settled(layer, v, value);
    refresh();
    return written;
  }
  void revised(int layer, Value v, const Tensor& value) override {
    first_.revised(layer, v, value);
    second_.revised(layer, v, value);
  }

 private:
  void refresh() {
    const auto& a = first_.mask();
    const auto& b = second_.mask();
    mask_.assign(std::max(a.size(), b.size()), 0u);
    for (size_t i = 0; i < a.size(); ++i) mask_[i] |= a[i];
    for (size_t i = 0; i < b.size(); ++i) mask_[i] |= b[i];
  }
  Listener& first_;
  Listener& second_;
};

/// Splits a scan over tokens [0, T) at every token where `ls` wants `layer`'s per-token state:
/// run(t0, t1) scans tokens [t0, t1) from the current state (the kernel restarts there, chunked or
/// not: no token loop), at(t) serves the state after token t and lays a write back before the scan
/// resumes at t + 1. With no listener interest this is one run(0, T).
template <class Run, class At>
void scan_with_stops(Listener* ls, int layer, int64_t T, Run&& run, At&& at) {
  int64_t t0 = 0;
  if (ls && ls->wants(layer, Value::state)) {
    for (int64_t t = ls->next_state_token(layer, -1); t >= t0 && t < T; t = ls->next_state_token(layer, t)) {
      run(t0, t + 1);
      at(t);
      t0 = t + 1;
      if (!ls->wants(layer, Value::state)) break;
    }
  }
  if (t0 < T) run(t0, T);
}

/// Shorthand used by the forward code: visit only when wanted.
inline bool visit_if(Listener* l, int layer, Value v, Tensor& value) {
  return l && l->wants(layer, v) && l->visit(layer, v, value, value.shape());
}

}  // namespace mixlens::detail
