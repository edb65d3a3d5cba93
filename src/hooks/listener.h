// Listener: how a forward hands values to whoever asked for them (DESIGN.md "Sites and listeners").
// A site nobody wants costs one bit test; a wanted value is visited in its served layout.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
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
  int64_t first = 0;           ///< positions earlier calls on this cache pushed through (CallRecord::first)
  std::string kernel;          ///< "chunked" or "recurrent"
  /// Set by another thread to stop the run (Ctrl-C, Session::abort); may be null.
  const std::atomic<bool>* cancel = nullptr;
  /// A call recorded for gradients (src/grad): the forward may keep there intermediates its backward
  /// would otherwise recompute (grad::KeptTensors::keep, the grad::Tape's); null otherwise.
  grad::KeptTensors* tape = nullptr;
  /// No cached recurrent state before this call: nothing was pushed through the cache yet.
  bool fresh() const { return first == 0; }
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
  /// listener may read it or write it (same contract as visit()); the scan resumes from it (a row
  /// whose state a write left bit for bit as served resumes as if unwritten: scan_rows).
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

/// One recurrent layer's scan as the per-token state machinery drives it (values.md "state_after",
/// "One number per value"). Rows are scanned one at a time from their first real token (left
/// padding: a row's chunk grid starts at its own first token, so its values do not depend on the
/// batch; padded tokens neither write nor decay the state). Everything works on float rows:
/// `row_numel` floats per row's state, in the kernel's layout (`S`), served through serve/store.
struct RowScan {
  int64_t B = 0, T = 0;
  int64_t row_numel = 0;        ///< floats of one row's state
  float* S = nullptr;           ///< [B, row_numel] the live state, kernel layout (in: start, out: end)
  std::vector<int64_t> first;   ///< per row: its first real token (0 without padding)
  /// Chunked kernels: the chunk size Q of the grid (anchored at the row's segment start); 0 for a
  /// token loop (the state after t is the live state once tokens up to t ran).
  int64_t chunk = 0;
  /// Runs row b's kernel over tokens [t0, t1) from `S_row` (kernel layout, updated in place).
  /// `y_scratch`: write the head outputs of those tokens there ([T, ...] of the row, absolute token
  /// index) instead of the real output; `states_row`: the row's [T, ...] stack (absolute token
  /// index) or null. t0 is always a grid point of the row's current segment.
  std::function<void(int64_t b, int64_t t0, int64_t t1, float* S_row, float* y_scratch, float* states_row)> run;
  /// Floats of one row's head outputs over all T tokens (the size of a y_scratch).
  int64_t y_row_numel = 0;
  /// Kernel layout -> served layout and back (one row).
  std::function<void(const float* S_row, float* served)> serve;
  std::function<void(const float* served, float* S_row)> store;
  /// Chunked kernels: row b's state after token t (served layout) from the state `S_ck` entering
  /// the chunk that starts at ck and holds t, with the same arithmetic the kernel uses for that
  /// chunk's states and end state (so the three agree bitwise). Called right after run(b, ck, ce).
  std::function<void(int64_t b, int64_t ck, const float* S_ck, int64_t t, float* served)> state_at;
};

/// Runs `rs` over tokens [0, T), serving the per-token state where `ls` wants it and the `states`
/// stack when wanted (also when it is first wanted at a pause: the tokens already scanned are
/// scanned again, on the side, from the kept segment starts). A READ of the state after t is
/// computed on the side from the chunk-start state: the kernel runs whole chunks of its grid, so
/// reading changes no other number of the call. Only a WRITE that changes a row's state (any bit)
/// splits that row's scan: it restarts at t + 1 from the written state, its outputs through t kept
/// as the whole chunk gave them; every other row (and a row written with its own state) runs on as
/// if nothing was written. Returns the stack (undefined when nobody wanted it); its rows are the
/// same numbers state_after / state_output give.
inline Tensor scan_rows(Listener* ls, int layer, RowScan& rs, const Shape& stack_shape) {
  const int64_t B = rs.B, T = rs.T, n = rs.row_numel;
  const auto row = [&](int64_t b) { return rs.S + b * n; };
  Tensor states;
  if (ls && ls->wants(layer, Value::states)) states = ls->stack_buffer(stack_shape);
  const auto stack_row = [&](int64_t b) { return states.defined() ? states.data() + b * T * n : nullptr; };
  // Per row: the segment starts (token, state entering it; a write at t starts one at t + 1), how far
  // the kernel ran, and the last chunk's start and entering state (chunked kernels).
  struct Seg {
    int64_t start;
    std::vector<float> S;
  };
  std::vector<std::vector<Seg>> segs(static_cast<size_t>(B));
  std::vector<int64_t> anchor(static_cast<size_t>(B)), cur(static_cast<size_t>(B)), ck(static_cast<size_t>(B), -1);
  std::vector<std::vector<float>> Sck(static_cast<size_t>(B));
  const bool stops = ls && ls->wants(layer, Value::state);
  // The stack's rows for tokens [t0, t1) that hold a state without scanning it (left padding).
  const auto hold = [&](int64_t b, int64_t t0, int64_t t1, const float* S_row) {
    if (!states.defined() || t0 >= t1) return;
    float* base = stack_row(b);
    rs.serve(S_row, base + t0 * n);
    for (int64_t t = t0 + 1; t < t1; ++t) std::copy(base + t0 * n, base + (t0 + 1) * n, base + t * n);
  };
  for (int64_t b = 0; b < B; ++b) {
    const size_t i = static_cast<size_t>(b);
    anchor[i] = cur[i] = std::min(rs.first[i], T);
    if (stops) segs[i].push_back({0, std::vector<float>(row(b), row(b) + n)});
    hold(b, 0, anchor[i], row(b));
  }
  // The tokens scanned so far into a stack first wanted at a pause: each segment again from its start.
  const auto fill_late = [&]() {
    std::vector<float> S(static_cast<size_t>(n)), y(static_cast<size_t>(rs.y_row_numel));
    for (int64_t b = 0; b < B; ++b) {
      const auto& sg = segs[static_cast<size_t>(b)];
      for (size_t k = 0; k < sg.size(); ++k) {
        const int64_t s0 = sg[k].start;
        const int64_t a0 = std::max(s0, std::min(rs.first[static_cast<size_t>(b)], T));
        // A written segment as the scan ran it: on through the end of the grid chunk holding the
        // written token (later rows are then rescanned by the next segment, the written token's
        // replaced), so the per-token states are those of the scan whatever the chunk length does.
        int64_t end = cur[static_cast<size_t>(b)];  // exclusive
        if (k + 1 < sg.size()) {
          end = sg[k + 1].start;
          if (rs.chunk > 0 && a0 < end) end = std::min(T, a0 + (end - 1 - a0) / rs.chunk * rs.chunk + rs.chunk);
        }
        std::copy(sg[k].S.begin(), sg[k].S.end(), S.begin());
        hold(b, s0, std::min(a0, end), S.data());
        if (a0 < end) rs.run(b, a0, end, S.data(), y.data(), stack_row(b));
        if (k + 1 < sg.size()) rs.serve(sg[k + 1].S.data(), stack_row(b) + (sg[k + 1].start - 1) * n);
      }
    }
  };
  if (stops) {
    Tensor served = Tensor::uninitialized([&] {
      Shape s{B};
      for (size_t d = 2; d < stack_shape.size(); ++d) s.push_back(stack_shape[d]);
      return s;
    }());
    std::vector<float> before(static_cast<size_t>(B * n));  // what each row was served at a pause
    for (int64_t t = ls->next_state_token(layer, -1); t >= 0 && t < T; t = ls->next_state_token(layer, t)) {
      for (int64_t b = 0; b < B; ++b) {
        const size_t i = static_cast<size_t>(b);
        float* out = served.data() + b * n;
        if (t < anchor[i]) {  // a padded token: the state is held
          rs.serve(row(b), out);
        } else if (rs.chunk <= 0) {  // token loop: run up to t, the live state is the state after t
          rs.run(b, cur[i], t + 1, row(b), nullptr, stack_row(b));
          cur[i] = t + 1;
          rs.serve(row(b), out);
        } else {
          const int64_t cs = anchor[i] + (t - anchor[i]) / rs.chunk * rs.chunk;
          if (ck[i] != cs) {
            if (cur[i] < cs) rs.run(b, cur[i], cs, row(b), nullptr, stack_row(b));
            Sck[i].assign(row(b), row(b) + n);
            ck[i] = cs;
            cur[i] = std::min(cs + rs.chunk, T);
            rs.run(b, cs, cur[i], row(b), nullptr, stack_row(b));
          }
          rs.state_at(b, cs, Sck[i].data(), t, out);
        }
      }
      std::copy(served.data(), served.data() + B * n, before.begin());
      const bool written = ls->visit_state(layer, t, served, served.shape());
      if (written) {
        for (int64_t b = 0; b < B; ++b) {
          const size_t i = static_cast<size_t>(b);
          // A row whose state is bit for bit what was served is not split (a write on another row,
          // or of the state read): its scan goes on as if no write existed, so its numbers are those
          // of the unwritten run. A split row's tokens through t keep the outputs and states of the
          // whole chunk (the unwritten run's); tokens after t are scanned again from the written state.
          if (std::memcmp(served.data() + b * n, before.data() + b * n, sizeof(float) * static_cast<size_t>(n)) == 0)
            continue;
          rs.store(served.data() + b * n, row(b));
          anchor[i] = cur[i] = std::max(t + 1, std::min(rs.first[i], T));
          ck[i] = -1;
          segs[i].push_back({t + 1, std::vector<float>(row(b), row(b) + n)});
          if (states.defined()) std::copy(served.data() + b * n, served.data() + (b + 1) * n, stack_row(b) + t * n);
          hold(b, t + 1, anchor[i], row(b));
        }
      }
      if (!states.defined() && ls->wants(layer, Value::states)) {  // asked for at this pause
        states = ls->stack_buffer(stack_shape);
        fill_late();
      }
      if (!ls->wants(layer, Value::state)) break;
    }
  }
  for (int64_t b = 0; b < B; ++b) {
    const size_t i = static_cast<size_t>(b);
    if (cur[i] < T) rs.run(b, cur[i], T, row(b), nullptr, stack_row(b));
  }
  return states;
}

/// Shorthand used by the forward code: visit only when wanted.
inline bool visit_if(Listener* l, int layer, Value v, Tensor& value) {
  return l && l->wants(layer, v) && l->visit(layer, v, value, value.shape());
}

}  // namespace mixlens::detail
