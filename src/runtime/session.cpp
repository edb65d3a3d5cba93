#include "mixlens/session.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string_view>
#include <thread>
#include <tuple>
#include <unordered_map>

#include "hooks/listener.h"
#include "mixlens/errors.h"
#include "models/family.h"
#include "ops/arena.h"
#include "ops/ops.h"
#include "runtime/fiber.h"
#include "runtime/model_access.h"
#include "runtime/trace_listener.h"

namespace mixlens {

namespace {

// Thrown in the forward to unwind a run the caller abandoned; never leaves the fiber.
struct Aborted {};

// An independent copy of a value. A small float32 one is written once (Tensor::clone zero-fills
// its new buffer first; the session copies every value it hands out or stashes: issue 9 item 5);
// large ones keep clone's recycled arena pages (fresh pages would fault in instead).
Tensor copy_of(const Tensor& v) {
  if (!v.defined() || v.dtype() != ScalarType::float32 ||
      sizeof(float) * static_cast<size_t>(v.numel()) >= detail::kArenaMinBytes)
    return v.clone();
  Tensor t = Tensor::uninitialized(v.shape());
  if (v.numel() > 0) std::memcpy(t.data(), v.data(), sizeof(float) * static_cast<size_t>(v.numel()));
  return t;
}

// The session whose forward this thread is running (null otherwise): a read from inside the forward
// (an edit function calling back into the session) would wait on itself forever.
thread_local const void* tl_worker_of = nullptr;

// A position in the run: step, then 2 * the value's index in Model::values() order. Start and end of
// a call bracket its values so "the forward is between calls" is a position too.
constexpr int kCallStart = -1;
constexpr int kCallEnd = INT_MAX;
// Per-token values (Value::state) add the token: (step, order, token), so a layer's states go in
// token order; -1 for every other value.
struct Pos {
  int step = 0;
  int order = kCallStart;
  int64_t token = -1;
  auto operator<=>(const Pos&) const = default;
};

// Values that exist together before the kernel consumes them (values.md "moment"): reads among
// them may go in any order. 0 = not part of a moment.
int moment_of(Value v) {
  switch (v) {
    case Value::attention_queries:
    case Value::attention_keys:
    case Value::attention_values: return 1;
    case Value::betas:
    case Value::decays: return 2;
    case Value::attn_queries:
    case Value::attn_keys:
    case Value::attn_values: return 3;
    // One kernel call computes the per-token states, the final state and the head outputs.
    case Value::states:
    case Value::state_output:
    case Value::attention_head_outputs: return 4;
    default: return 0;
  }
}

}  // namespace

struct Session::Impl {
  struct Target {
    Pos pos;
    Site site;
    bool is_value = false;  // false: the start of a call (reach_step)
  };

  // Serves the forward's values to the caller: pauses at the target, stashes moment siblings.
  class Interleaver final : public detail::Listener {
   public:
    explicit Interleaver(Impl& s) : s_(s) {}
    void begin_call(const detail::CallCtx& ctx, int num_layers) override {
      std::unique_lock<std::mutex> lk(s_.mu);
      ctx_ = ctx;
      num_layers_ = num_layers;
      s_.calls.push_back({ctx.step, ctx.batch, ctx.seq, ctx.fresh(), ctx.kernel, ctx.first});
      s_.pos = {ctx.step, kCallStart, -1};
      s_.stash.clear();
      s_.wait_while_paused(lk);
      refresh_mask();
    }
    void end_call() override {
      release_stack();  // the session outlives the call: do not keep a stack of it
      std::unique_lock<std::mutex> lk(s_.mu);
      s_.pos = {ctx_.step, kCallEnd, -1};
      s_.wait_while_paused(lk);
      refresh_mask();
    }
    void revised(int layer, Value v, const Tensor& value) override {
      std::lock_guard<std::mutex> lk(s_.mu);
      auto it = s_.stash.find(Site{layer, v});
      if (it != s_.stash.end()) it->second = copy_of(value);
    }
    bool visit(int layer, Value v, Tensor& value, const Shape& shape) override {
      std::unique_lock<std::mutex> lk(s_.mu);
      const Site site{layer, v};
      s_.pos = {ctx_.step, s_.order_of(site), -1};
      const bool at_target = s_.target && s_.target->is_value && s_.target->pos == s_.pos;
      if (!at_target) {
        // Besides the target only its earlier moment siblings are wanted: keep them for reads.
        s_.stash_put(site, value);
        s_.wait_while_paused(lk);
        refresh_mask();
        return false;
      }
      if (moment_of(v) == 0) s_.stash.clear();
      s_.live = &value;
      s_.live_shape = shape;
      s_.live_written = false;
      s_.wait_while_paused(lk);
      const bool written = s_.live_written;
      s_.live = nullptr;
      // As consumed, after the caller's writes. A prompt's `states` stack (hundreds of MiB) is not
      // copied again: the caller holds it already (Session::read hands it over).
      if (moment_of(v) != 0 && !(v == Value::states && ctx_.seq > 1)) s_.stash_put(site, value);
      refresh_mask();
      return written;
    }

    // The scan stops only at the token the caller is waiting for (asked again after each stop).
    int64_t next_state_token(int layer, int64_t after) const override {
      std::unique_lock<std::mutex> lk(s_.mu);
      if (!s_.target || !s_.target->is_value || s_.target->pos.step != ctx_.step) return -1;
      if (s_.target->site != Site{layer, Value::state}) return -1;
      return s_.target->pos.token > after ? s_.target->pos.token : -1;
    }
    bool visit_state(int layer, int64_t t, Tensor& value, const Shape& shape) override {
      std::unique_lock<std::mutex> lk(s_.mu);
      s_.pos = {ctx_.step, s_.order_of({layer, Value::state}), t};
      s_.stash.clear();
      const bool at_target = s_.target && s_.target->is_value && s_.target->pos == s_.pos;
      if (!at_target) {
        s_.wait_while_paused(lk);
        refresh_mask();
        return false;
      }
      s_.live = &value;
      s_.live_shape = shape;
      s_.live_written = false;
      s_.wait_while_paused(lk);
      const bool written = s_.live_written;
      s_.live = nullptr;
      refresh_mask();
      return written;
    }

   private:
    // Wanted now: the target if it is in this call, plus its earlier moment siblings (stashed).
    // Called on the worker only, after the caller may have moved the target.
    void refresh_mask() {
      mask_.assign(static_cast<size_t>(num_layers_ + 1), 0u);
      if (!s_.target || !s_.target->is_value || s_.target->pos.step != ctx_.step || s_.finishing) return;
      const Site t = s_.target->site;
      auto want = [&](Site x) { mask_[static_cast<size_t>(x.layer + 1)] |= 1u << static_cast<unsigned>(x.value); };
      want(t);
      const int m = moment_of(t.value);
      if (m == 0) return;
      for (int v = 0; v < kNumValues; ++v) {
        const Site x{t.layer, static_cast<Value>(v)};
        // The per-token stack costs a pass of its own on a multi-token call: kept for a later
        // read only on a decode step, where it is one state.
        if (x.value == Value::states && ctx_.seq > 1) continue;
        if (moment_of(x.value) == m && s_.has_order(x) && s_.order_of(x) < s_.target->pos.order &&
            s_.order_of(x) > s_.pos.order)
          want(x);
      }
    }
    Impl& s_;
    detail::CallCtx ctx_;
    int num_layers_ = 0;
  };

  Impl(const Model& m, Trace* t)
      : family(detail::ModelAccess::family(m)), table(family.value_table()), trace(t), listener(*this) {
    // Validate the trace's registrations now, on the caller, rather than at the first request.
    if (trace) detail::TraceListener check(*trace, family);
  }

  static size_t slot(Site s) { return detail::FamilyModel::ValueTable::slot(s); }
  // Orders are 2 * (index in Model::values()); the per-token `state` (not in values(): it addresses
  // `states` by token) sits just before `states`, as the scan visits it before the stack is served.
  bool has_order(Site s) const {
    if (s.value == Value::state) s.value = Value::states;
    return slot(s) < table.at_site.size() && table.at_site[slot(s)] >= 0;
  }
  int order_of(Site s) const {
    if (s.value == Value::state) return has_order(s) ? 2 * table.at_site[slot({s.layer, Value::states})] - 1 : kCallEnd - 1;
    return has_order(s) ? 2 * table.at_site[slot(s)] : kCallEnd - 1;
  }
  // The site of a canonical path (Model::values()), or null.
  const Site* site_of(std::string_view path) const {
    auto it = table.at.find(path);
    return it == table.at.end() ? nullptr : &table.values[it->second].site;
  }

  // Worker side, lock held.
  void stash_put(Site site, const Tensor& value) {
    const std::pair<int, int> key{site.layer, moment_of(site.value)};
    if (key != stash_moment) {
      stash.clear();
      stash_moment = key;
    }
    stash[site] = value.defined() ? copy_of(value) : Tensor();
  }

  // Worker side, lock held: stay paused while there is nowhere further to go (no target beyond the
  // current position and not finishing). The caller reads `paused` and `pos` meanwhile.
  void wait_while_paused(std::unique_lock<std::mutex>& lk) {
    if (aborted) throw Aborted{};
    while (!aborted && !finishing && !(target && pos < target->pos)) {
      paused = true;
      ops::park_threads();  // the pool's threads would spin for the next op while the caller runs
      lk.unlock();  // the caller runs next on this very thread and takes the lock
      fiber->yield();
      lk.lock();
    }
    paused = false;
    if (aborted) throw Aborted{};
  }

  // The forward runs as a fiber on the caller's thread (issue 9 item 5): it starts at the first
  // request and runs only inside run_forward(), so handing a value over is a stack switch, not a
  // thread wake-up.
  void start_worker(std::function<SessionResult(detail::Listener*)> body) {
    fiber = std::make_unique<detail::Fiber>([this, body = std::move(body)] {
      try {
        SessionResult r = body(&listener);
        std::lock_guard<std::mutex> lk(mu);
        result = std::move(r);
      } catch (const Aborted&) {
      } catch (...) {
        std::lock_guard<std::mutex> lk(mu);
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> lk(mu);
      done = true;
      paused = false;
    });
  }

  // Runs the forward until it pauses or ends (mu not held). One thread at a time runs it: the
  // owner, or abort() from another thread (run_mu).
  void run_forward() {
    std::lock_guard<std::mutex> run(run_mu);
    if (fiber->finished()) return;
    const void* prev_worker = tl_worker_of;
    void (*prev_poll)(void*) = detail::tl_poll;
    void* prev_arg = detail::tl_poll_arg;
    tl_worker_of = this;
    detail::tl_poll = interrupt_check ? &Impl::poll_interrupt : nullptr;
    detail::tl_poll_arg = this;
    fiber->resume();
    tl_worker_of = prev_worker;
    detail::tl_poll = prev_poll;
    detail::tl_poll_arg = prev_arg;
  }

  // In the forward (check_cancel, between layers): interrupt_check about every 50 ms. An exception
  // from it aborts the run: it ends the forward and reaches the caller as the forward's error.
  static void poll_interrupt(void* self) {
    Impl& s = *static_cast<Impl*>(self);
    const auto now = std::chrono::steady_clock::now();
    if (now - s.last_poll < std::chrono::milliseconds(50)) return;
    s.last_poll = now;
    try {
      s.interrupt_check();
    } catch (...) {
      std::lock_guard<std::mutex> lk(s.mu);
      s.interrupted = true;
      s.cancel.store(true);
      throw;
    }
  }

  // Caller side: the thread that created the session, never the worker (DESIGN: one caller).
  void check_caller(const char* verb) const {
    if (tl_worker_of == this)
      throw InputError(std::string("Session::") + verb +
                       " called from inside the forward (an edit function registered on the trace reads or writes "
                       "through the open tracer): it would wait on itself forever. Inside an edit, use the value it "
                       "is given; read other values in the block instead");
    if (std::this_thread::get_id() != owner)
      throw InputError(std::string("Session::") + verb +
                       ": this session belongs to the thread that opened it; another thread cannot read or write it "
                       "(open a trace in that thread: one trace at a time per model, the second waits)");
    std::lock_guard<std::mutex> lk(mu);
    if (aborted)
      throw InputError(interrupted ? "this run was interrupted; start a new one"
                                   : "this session was aborted; start a new one");
  }

  // Caller side: runs the forward until `pred` holds (it pauses where asked, or ends). Signals are
  // checked by the forward itself between layers (poll_interrupt): an interrupt ends it with the
  // signal's error, which the caller rethrows; the session then counts as aborted.
  template <class Pred>
  void wait_caller(std::unique_lock<std::mutex>& lk, Pred pred) {
    while (!pred()) {
      lk.unlock();
      run_forward();
      lk.lock();
      if (interrupted) aborted = true;
    }
  }

  // Caller side, lock held.
  void rethrow_worker_error() {
    if (error) {
      // Rethrown once: the caller (e.g. nanobind) may consume the exception object.
      std::exception_ptr e = error;
      error = nullptr;
      error_reported = true;
      std::rethrow_exception(e);
    }
    if (error_reported) throw InputError("this session stopped after an error (raised earlier); start a new one");
  }

  std::string describe(Pos p) const {
    if (p.order == kCallStart) return "the start of step " + std::to_string(p.step);
    if (p.order == kCallEnd) return "the end of step " + std::to_string(p.step);
    const auto& values = table.values;
    const size_t i = static_cast<size_t>((p.order + 1) / 2);  // odd orders: the `state` before `states`
    std::string path = p.order >= 0 && i < values.size() ? values[i].path : "?";
    if (p.order % 2 != 0 && !path.empty() && path.back() == 's') path.pop_back();
    return "'" + path + (p.token >= 0 ? "@t" + std::to_string(p.token) : std::string()) + "' at step " +
           std::to_string(p.step);
  }
  std::string where_locked() const {
    if (done) return "finished";
    if (!started) return "not started";
    return describe(pos);
  }

  Target resolve(int step, std::string_view path_view, const char* verb) const {
    // The per-value path: a canonical path (no '@t' token, no '*') at a step of this run, from the
    // table without building a string.
    // (A loop, not find_first_of: libstdc++ calls memchr once per character for that.)
    if (step >= first_step && step <= last_step &&
        std::none_of(path_view.begin(), path_view.end(), [](char c) { return c == '@' || c == '*'; })) {
      if (const Site* site = site_of(path_view); site != nullptr && site->value != Value::state)
        return {{step, order_of(*site), -1}, *site, true};
    }
    const std::string path(path_view);
    if (path.find('*') != std::string::npos)
      throw InputError(std::string(verb) + " '" + path + "': takes one value; '*' patterns are for Trace::save");
    std::string base = path;
    const std::optional<int64_t> token = split_token(base);
    // A canonical path (or its per-token `state`) resolves from the model's table; anything else
    // goes the long way (resolve_path: patterns, layer ranges), which also words the errors.
    std::vector<Site> found;
    if (const Site* site = site_of(base)) {
      found.push_back(*site);
    } else if (base.size() > 18 && base.compare(base.size() - 18, 18, ".linear_attn.state") == 0 &&
               (site = site_of(base + "s")) != nullptr) {
      found.push_back({site->layer, Value::state});
    } else {
      found = detail::resolve_path(family, base, path);
    }
    if (found.size() != 1) throw InputError(std::string(verb) + " '" + path + "': names " + std::to_string(found.size()) + " values");
    check_step(step, path, verb);
    if ((found[0].value == Value::state) != token.has_value())
      throw UnknownValueError("value path '" + path + "': " +
                              (token ? std::string("only 'linear_attn.state' takes a token suffix '@t<t>'")
                                     : "'state' is addressed per token, e.g. '" + base + "@t5' (negative counts from the end)"));
    // Tokens resolve against the call's length: the prompt's padded length at the first step, 1 after.
    const int64_t t = token ? resolve_token(*token, step == first_step ? first_seq : 1, path) : -1;
    return {{step, order_of(found[0]), t}, found[0], true};
  }
  void check_step(int step, const std::string& path, const char* verb) const {
    if (step < first_step || step > last_step) {
      const std::string range = first_step == last_step ? "only step " + std::to_string(first_step)
                                                        : "steps " + std::to_string(first_step) + ".." +
                                                              std::to_string(last_step);
      throw InputError(std::string(verb) + " '" + path + "' at step " + std::to_string(step) + ": this run has " + range);
    }
  }

  enum class Arrival { at_target, passed, skipped, ended };

  // Caller side: move the worker to `t` (unless it is there or past it) and wait until it stops at
  // or past `t`, or the run ends.
  Arrival advance_to(std::unique_lock<std::mutex>& lk, const Target& t) {
    rethrow_worker_error();
    if (done) return Arrival::ended;
    if (started && paused && pos == t.pos) return Arrival::at_target;
    if (started && t.pos < pos) return Arrival::passed;
    target = t;
    started = true;
    wait_caller(lk, [&] { return done || (paused && !(pos < t.pos)); });
    rethrow_worker_error();
    if (done) return step_ran(t.pos.step) ? Arrival::skipped : Arrival::ended;
    return pos == t.pos ? Arrival::at_target : Arrival::skipped;
  }

  bool step_ran(int step) const {
    return std::any_of(calls.begin(), calls.end(), [&](const CallRecord& c) { return c.step == step; });
  }

  // The rule for one layer's `states` and its per-token `state` in one block, and why (values.md).
  static std::string stack_or_tokens_rule(int layer) {
    const std::string base = "layers." + std::to_string(layer) + ".linear_attn.";
    return "a layer's per-token `state` can be read after its `states` (it is states[:, t]) but written only "
           "before: the per-token state is written during the layer's scan and the `states` stack is served "
           "when the scan ends. Write the state (set_state_after) before reading `states`, or pre-register the "
           "write (Python edits={'" + base + "state@t<t>': v}, C++ Trace::set)";
  }

  [[noreturn]] void not_served(const Target& t, const std::string& path, const char* verb, Arrival a) const {
    const std::string asked = std::string("cannot ") + verb + " '" + path + "' at step " + std::to_string(t.pos.step);
    // A layer's stack after its per-token state in this call, or the reverse: say the rule, not only
    // "not produced" / "passed".
    const auto read_other = [&](Value other) { return touched.count({t.pos.step, t.site.layer, static_cast<int>(other)}) > 0; };
    if (t.site.value == Value::state && a == Arrival::passed && read_other(Value::states))
      throw OutOfOrderError(asked + ": this block already read that layer's `states` at this step; " +
                            stack_or_tokens_rule(t.site.layer));
    switch (a) {
      case Arrival::passed:
        throw OutOfOrderError(asked + ": the forward has already passed it and is at " + where_locked() +
                              "; values are served in forward order (Model::values(), step by step)" +
                              (t.site.value == Value::state
                                   ? std::string("; a layer's per-token states go in token order, and the forward runs "
                                                 "layer 0 over every token before layer 1: loop layers outside tokens, "
                                                 "save 'states', or pre-register the write (Trace::set / edits)")
                               : t.site.value == Value::states
                                   ? std::string("; a layer's `states` stack is computed only if asked for before its "
                                                 "scan: read it before that layer's attention_head_outputs / "
                                                 "state_output / attention_output, or pre-register it (Python "
                                                 "saves=['" + path + "'] and tracer.saved after the block, C++ "
                                                 "Trace::save)")
                                   : std::string()));
      case Arrival::skipped:
        throw InputError(asked + ": the forward did not produce it (" +
                         (done ? std::string("the run ended without visiting it)") : "it went on to " + where_locked() + ")"));
      default:
        if (!step_ran(t.pos.step))
          throw InputError(asked + ": the run ended after " + std::to_string(calls.size()) +
                           " forward calls (every row reached EOS?), so that step never ran");
        throw OutOfOrderError(asked + ": the run has finished; read it inside the block or save it with a Trace");
    }
  }

  void settle_handed(const Target* keep);
  // at_live (optional): set to whether the value came from the forward's own tensor, paused there.
  Tensor read_at(const Target& t, std::string_view path, bool* at_live = nullptr);
  void write_at(const Target& t, std::string_view path, const Tensor& value);

  const detail::FamilyModel& family;
  // Model::values() and its indexes (built once per model). A value's order in the run is 2 * its
  // index there.
  const detail::FamilyModel::ValueTable& table;
  Trace* trace;
  int first_step = 0, last_step = 0;
  int64_t first_seq = 0;  // tokens in the first call (left-padded prompt or continuation)

  std::thread::id owner = std::this_thread::get_id();  // the caller thread (created the session)
  std::function<void()> interrupt_check;
  std::chrono::steady_clock::time_point last_poll = std::chrono::steady_clock::now();
  std::atomic<bool> cancel{false};  // stops the forward between layers (abort, interrupt)
  bool interrupted = false;

  mutable std::mutex mu;
  std::mutex run_mu;  // held while the forward runs (run_forward)
  // Caller -> worker.
  std::optional<Target> target;
  bool started = false, finishing = false, aborted = false;
  // Worker -> caller.
  bool paused = false, done = false, error_reported = false;
  Pos pos;
  // (step, layer, value) of the `states` / per-token `state` the caller read or wrote, for the error
  // that states the one-or-the-other rule.
  std::set<std::tuple<int, int, int>> touched;
  // The last `states` stack read (step, layer, the stack): a per-token state of that layer read after
  // it is its row (the same number by construction), until the caller asks for anything else.
  struct KeptStack {
    int step = -1, layer = -1;
    Tensor stack;
  } kept_stack;
  Tensor* live = nullptr;  // the value the worker is paused at (its own tensor)
  Shape live_shape;
  bool live_written = false;
  struct SiteLess {
    bool operator()(const Site& a, const Site& b) const {
      return a.layer != b.layer ? a.layer < b.layer : a.value < b.value;
    }
  };
  std::map<Site, Tensor, SiteLess> stash;  // copies of the current moment's values already passed
  std::pair<int, int> stash_moment{-2, 0};  // (layer, moment) the stash holds
  std::vector<CallRecord> calls;
  // read_live's value, shared with the caller, and what it held when handed out: the forward's own
  // value while it stays paused there (`at_live`: no second copy per read), else a copy (pristine).
  struct Handed {
    Target target;
    Tensor value, pristine;
    bool at_live = false;
  };
  std::optional<Handed> handed;
  std::string handed_path;  // the path `handed` was read as (a buffer reused read after read)
  std::exception_ptr error;
  SessionResult result;

  Interleaver listener;
  std::unique_ptr<detail::Fiber> fiber;  // the forward; last, so it goes first (it refers to the rest)
};

Session::Session(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Session::Session(Session&&) noexcept = default;
Session& Session::operator=(Session&& other) noexcept {
  if (this != &other) {
    abort();
    impl_ = std::move(other.impl_);
  }
  return *this;
}
Session::~Session() { abort(); }

void Session::abort() {
  if (!impl_) return;
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    impl_->aborted = true;
    impl_->cancel.store(true);
  }
  // From inside the forward (an edit function): it stops at its next value or layer on its own.
  if (tl_worker_of == impl_.get() || !impl_->fiber) return;
  // A forward paused half-way unwinds (Aborted at its pause point) so its frames free what they
  // own; one never started is just dropped.
  if (impl_->fiber->started()) impl_->run_forward();
}

Session Session::run(const Model& model, std::vector<std::vector<int32_t>> prompts, Trace* trace) {
  return run(model, Batch::left_padded(prompts, model.pad_token_id()), trace);  // validates now, on the caller
}

Session Session::run(const Model& model, Batch batch, Trace* trace, bool all_logits) {
  if (trace) detail::TraceListener::check_steps_made(*trace, 0, 0);
  auto impl = std::make_unique<Impl>(model, trace);
  impl->first_seq = batch.seq;
  const std::atomic<bool>* cancel = &impl->cancel;
  impl->start_worker([&model, trace, batch = std::move(batch), cancel, all_logits](detail::Listener* l) {
    Cache cache = model.new_cache(batch.batch);
    SessionResult r;
    r.logits.push_back(detail::ModelAccess::forward(model, batch, cache, trace, l, all_logits, cancel));
    r.steps = 1;
    return r;
  });
  return Session(std::move(impl));
}

Session Session::generate(const Model& model, std::vector<std::vector<int32_t>> prompts, GenerateOptions options,
                          Trace* trace) {
  return generate(model, Batch::left_padded(prompts, model.pad_token_id()), options, trace);
}

Session Session::generate(const Model& model, Batch prompt, GenerateOptions options, Trace* trace) {
  if (options.max_new_tokens < 1) throw InputError("generate: max_new_tokens must be >= 1");
  if (trace) detail::TraceListener::check_steps_reachable(*trace, options.max_new_tokens);
  auto impl = std::make_unique<Impl>(model, trace);
  impl->first_seq = prompt.seq;
  impl->last_step = options.max_new_tokens - 1;
  const std::atomic<bool>* cancel = &impl->cancel;
  impl->start_worker([&model, trace, prompt = std::move(prompt), options, cancel](detail::Listener* l) {
    GenerationResult g = detail::ModelAccess::generate(model, prompt, options, trace, l, cancel);
    SessionResult r;
    r.new_tokens = std::move(g.new_tokens);
    r.steps = g.steps;
    return r;
  });
  return Session(std::move(impl));
}

Session Session::teacher_forced(const Model& model, std::vector<std::vector<int32_t>> prompts,
                                std::vector<std::vector<int32_t>> forced, Trace* trace) {
  Batch batch = Batch::left_padded(prompts, model.pad_token_id());
  if (forced.size() != prompts.size())
    throw InputError("teacher_forced: " + std::to_string(forced.size()) + " rows of forced tokens for " +
                     std::to_string(prompts.size()) + " prompts");
  for (const auto& row : forced)
    if (row.size() != forced[0].size()) throw InputError("teacher_forced: every row needs the same number of forced tokens");
  const int n_steps = static_cast<int>(forced[0].size()) + 1;
  if (trace) detail::TraceListener::check_steps_made(*trace, 0, n_steps - 1);
  auto impl = std::make_unique<Impl>(model, trace);
  impl->first_seq = batch.seq;
  impl->last_step = n_steps - 1;
  const std::atomic<bool>* cancel = &impl->cancel;
  impl->start_worker([&model, trace, batch = std::move(batch), forced = std::move(forced), n_steps,
                      cancel](detail::Listener* l) mutable {
    Cache cache = model.new_cache(batch.batch);
    SessionResult r;
    r.new_tokens.resize(static_cast<size_t>(batch.batch));
    for (int step = 0; step < n_steps; ++step) {
      Tensor logits = detail::ModelAccess::forward(model, batch, cache, trace, l, true, cancel);
      const int64_t T = logits.size(1), V = logits.size(2);
      for (int64_t b = 0; b < batch.batch; ++b) {
        const float* row = logits.data() + (b * T + T - 1) * V;
        r.new_tokens[static_cast<size_t>(b)].push_back(static_cast<int32_t>(std::max_element(row, row + V) - row));
      }
      r.logits.push_back(std::move(logits));
      r.steps += 1;
      if (step + 1 == n_steps) break;
      batch.seq = 1;
      batch.ids.clear();
      for (const auto& row : forced) batch.ids.push_back(row[static_cast<size_t>(step)]);
      batch.mask.assign(batch.ids.size(), 1);
    }
    return r;
  });
  return Session(std::move(impl));
}

Session Session::forward(const Model& model, Batch batch, Cache& cache, Trace* trace, bool all_logits) {
  detail::ModelAccess::check_cache(cache, "continue");  // now, not at the first read
  if (trace) detail::TraceListener::check_steps_made(*trace, cache.steps(), cache.steps());
  auto impl = std::make_unique<Impl>(model, trace);
  impl->first_step = impl->last_step = cache.steps();
  impl->pos = {cache.steps(), kCallStart, -1};
  impl->first_seq = batch.seq;
  const std::atomic<bool>* cancel = &impl->cancel;
  impl->start_worker([&model, &cache, trace, batch = std::move(batch), all_logits, cancel](detail::Listener* l) {
    SessionResult r;
    r.logits.push_back(detail::ModelAccess::forward(model, batch, cache, trace, l, all_logits, cancel));
    r.steps = 1;
    return r;
  });
  return Session(std::move(impl));
}

// Caller side, mu not held: the live value's in-place changes go in as a write, unless `keep` (a
// write about to replace that very value) supersedes them.
void Session::Impl::settle_handed(const Target* keep) {
  if (!handed) return;
  if (keep && keep->pos == handed->target.pos && keep->site == handed->target.site) return;
  Handed h = std::move(*handed);
  handed.reset();
  const Tensor* as_read = &h.pristine;
  if (h.at_live) {
    // Nothing moved the forward since the read (every request settles first) and only a write of
    // this value changes it there (which takes a pristine copy instead): `live` is what was read.
    std::lock_guard<std::mutex> lk(mu);
    if (!(paused && live != nullptr && pos == h.target.pos))
      throw Error("internal: the live value's forward moved before its in-place edits were checked");
    as_read = live;
  }
  const size_t bytes = sizeof(float) * static_cast<size_t>(h.value.numel());
  if (h.value.shape() == as_read->shape() && std::memcmp(h.value.data(), as_read->data(), bytes) == 0) return;
  const std::string what =
      "in-place edit of '" + handed_path + "' (read at step " + std::to_string(h.target.pos.step) + ") could not be applied: ";
  try {
    write_at(h.target, handed_path, h.value);
  } catch (const OutOfOrderError& e) {
    throw OutOfOrderError(what + e.what());
  } catch (const WriteError& e) {
    throw WriteError(what + e.what());
  }
}

Tensor Session::Impl::read_at(const Target& t, std::string_view path, bool* at_live) {
  std::unique_lock<std::mutex> lk(mu);
  const bool of_kept = t.site.value == Value::state && kept_stack.step == t.pos.step && kept_stack.layer == t.site.layer;
  if (!of_kept) kept_stack = {};  // held no longer than needed: the forward reuses a dropped stack
  const Arrival a = advance_to(lk, t);
  // A per-token state after its layer's `states` was read: that stack's row (states[:, t]).
  if (a == Arrival::passed && of_kept && kept_stack.stack.defined()) {
    const Tensor& st = kept_stack.stack;
    const int64_t B = st.size(0), T = st.size(1), per = st.numel() / (B * T);
    Shape shape{B};
    for (size_t d = 2; d < st.shape().size(); ++d) shape.push_back(st.shape()[d]);
    Tensor out = Tensor::uninitialized(shape);
    for (int64_t b = 0; b < B; ++b)
      std::memcpy(out.data() + b * per, st.data() + (b * T + t.pos.token) * per, sizeof(float) * static_cast<size_t>(per));
    return out;
  }
  if (at_live) *at_live = a == Arrival::at_target && paused && live != nullptr;
  if (a == Arrival::at_target) {
    if (t.site.value == Value::states || t.site.value == Value::state)
      touched.insert({t.pos.step, t.site.layer, static_cast<int>(t.site.value)});
    if (!live->defined()) return Tensor();
    // `states` is read-only and the forward drops it after this visit: hand over the stack itself
    // rather than copying hundreds of MiB (the caller still owns an independent value).
    if (t.site.value == Value::states) {
      kept_stack = {t.pos.step, t.site.layer, *live};
      return *live;
    }
    return copy_of(*live);
  }
  // Passed, but an earlier value of the moment the forward is in: served from its copy.
  if (a == Arrival::passed && t.pos.step == pos.step) {
    auto it = stash.find(t.site);
    if (it != stash.end()) {
      // Mamba betas and decays are two views of one dt: after a decays write (the forward is
      // paused at it) betas is the dt the write implies, which the forward will use.
      if (live_written && t.site.value == Value::betas && target && target->site.value == Value::decays &&
          target->site.layer == t.site.layer && it->second.defined()) {
        Tensor dt = family.betas_for_decays(t.site.layer, it->second, *live);
        if (dt.defined()) return dt;
      }
      return it->second.defined() ? copy_of(it->second) : Tensor();
    }
  }
  not_served(t, std::string(path), "read", a);
}

void Session::Impl::write_at(const Target& t, std::string_view path, const Tensor& value) {
  if (t.site.value == Value::states)
    throw WriteError("'" + site_path(t.site) + "' is read-only (the per-token state stack); write one token's state ('" +
                     site_path({t.site.layer, Value::state}) + "@t<t>') or state_input / state_output instead");
  if (!derived_value_reason(t.site.value).empty())
    throw WriteError("'" + site_path(t.site) + "' is read-only (" + derived_value_reason(t.site.value) + ")");
  settle_handed(&t);
  std::unique_lock<std::mutex> lk(mu);
  kept_stack = {};
  const Arrival a = advance_to(lk, t);
  if (a != Arrival::at_target) {
    if (a == Arrival::passed && t.pos.step == pos.step && stash.count(t.site))
      throw OutOfOrderError("cannot write '" + std::string(path) + "' at step " + std::to_string(t.pos.step) +
                            ": the forward has moved on to " + where_locked() +
                            " (same moment): values of a moment can be read in any order, but write each one before "
                            "reading a later one");
    not_served(t, std::string(path), "write", a);
  }
  if (t.site.value == Value::state) touched.insert({t.pos.step, t.site.layer, static_cast<int>(Value::state)});
  // A per-token state's errors name its token as the caller wrote it ('...state@t-1').
  detail::check_write(t.site.value == Value::state ? std::string(path) : site_path(t.site), t.site.value, value,
                      live_shape);  // throws before any change
  Tensor& cur = *live;
  if (cur.defined() && cur.shape() == live_shape) std::copy(value.begin(), value.end(), cur.data());
  else cur = value.clone();
  live_written = true;
  // A write of the live value itself: what it holds now counts as unmodified (changes from here on
  // are still applied).
  if (handed && handed->target.pos == t.pos && handed->target.site == t.site) {
    handed->pristine = copy_of(handed->value);
    handed->at_live = false;
  }
}

void Session::settle() {
  impl_->check_caller("settle");
  impl_->settle_handed(nullptr);
}

Tensor Session::read_live(int step, std::string_view path) {
  Impl& s = *impl_;
  s.check_caller("read");
  const Impl::Target t = s.resolve(step, path, "read");
  s.settle_handed(nullptr);
  bool at_live = false;  // served from the forward's value, where it stays paused
  Tensor v = s.read_at(t, path, &at_live);
  if (v.defined() && t.site.value != Value::states) {
    s.handed = Impl::Handed{t, v, at_live ? Tensor() : copy_of(v), at_live};
    s.handed_path.assign(path);
  }
  return v;
}

Tensor Session::read(int step, std::string_view path) {
  Impl& s = *impl_;
  s.check_caller("read");
  const Impl::Target t = s.resolve(step, path, "read");
  s.settle_handed(nullptr);
  return s.read_at(t, path);
}

void Session::write(int step, std::string_view path, const Tensor& value) {
  Impl& s = *impl_;
  s.check_caller("write");
  s.write_at(s.resolve(step, path, "write"), path, value);
}

bool Session::reach_step(int step) {
  Impl& s = *impl_;
  s.check_caller("reach_step");
  if (step < s.first_step) throw InputError("reach_step(" + std::to_string(step) + "): the first step is " + std::to_string(s.first_step));
  s.settle_handed(nullptr);
  if (step > s.last_step) return false;
  std::unique_lock<std::mutex> lk(s.mu);
  const Impl::Target t{{step, kCallStart}, Site{}, false};
  if (s.advance_to(lk, t) == Impl::Arrival::ended) return s.step_ran(step);
  return true;  // paused at its start, or already inside or past it
}

SessionResult Session::finish() {
  Impl& s = *impl_;
  s.check_caller("finish");
  s.settle_handed(nullptr);
  std::unique_lock<std::mutex> lk(s.mu);
  s.rethrow_worker_error();
  if (!s.done) {
    s.started = true;
    s.finishing = true;
    s.wait_caller(lk, [&] { return s.done; });
  }
  s.rethrow_worker_error();
  return s.result;
}

void Session::set_interrupt_check(std::function<void()> check) {
  std::lock_guard<std::mutex> lk(impl_->mu);
  impl_->interrupt_check = std::move(check);
}

bool Session::in_forward() const { return tl_worker_of == impl_.get(); }

int Session::first_step() const { return impl_->first_step; }
int Session::last_step() const { return impl_->last_step; }

std::vector<CallRecord> Session::calls() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->calls;
}

std::string Session::where() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->where_locked();
}

}  // namespace mixlens
