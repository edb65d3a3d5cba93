// Session: the interleaver. A forward (one call, a generation, or teacher-forced steps) runs as a
// fiber (its own stack) on the caller's thread, only while the caller is inside read / write /
// reach_step / finish, and pauses only where the caller asks (a hand-off is a stack switch, not a
// thread wake-up: issue 9 item 5), so the caller's code reads real values,
// computes, and writes them back before the forward consumes them (DESIGN.md "Sites and
// listeners"). It is what the Python `with model.trace(...)` block runs on; C++ can use it too.
//
//   Session s = Session::run(model, {ids});
//   Tensor b = s.read(0, "layers.1.linear_attn.betas");   // blocks until the forward is there
//   for (int64_t i = 0; i < b.numel(); ++i) b[i] *= 0.5f;
//   s.write(0, "layers.1.linear_attn.betas", b);           // consumed by the rest of the forward
//   Tensor logits = s.finish().logits[0];
//
// Order. Values are served in forward order (Model::values(), step by step). Reading or writing a
// value the forward has already passed raises OutOfOrderError naming the value asked for and the
// one the forward is at. Exception: values of one *moment* (a mixer's queries/keys/values; its
// betas/decays; the outputs of one kernel call: states, state_output, attention_head_outputs)
// may be read in any order among themselves, because the session keeps copies of the earlier
// ones while it waits at a later one; writes to them still go in forward order. (The per-token
// `states` stack is kept that way only on a single-token call: on a prompt read it first.)
//
// Read-after-write. A read returns what the forward will use: after a write at (step, path), a
// read of it returns the written value; on Mamba, betas read after a decays write is the dt the
// write implies (dt = decays / A). Pre-registered Trace saves record the value after every
// pre-registered edit and every write of this session.
//
// Threads. read / write / reach_step / finish belong to the thread that created the session
// (another thread gets InputError, never this session's values); the forward runs only inside
// them, on that thread, so no Python code (GIL) runs in the forward unless an edit registered on
// the Trace calls it. Calling them from inside the forward (an edit function) would
// wait on itself: InputError. abort(), calls() and where() may be called from any thread. The Model, the Trace and, for
// Session::forward, the Cache must outlive the session. Destroying a session mid-run unwinds the
// paused forward (an aborted continuation leaves its Cache unspecified).
#pragma once
#include <climits>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "mixlens/model.h"
#include "mixlens/tensor.h"
#include "mixlens/trace.h"

namespace mixlens {

/// What a finished session produced.
struct SessionResult {
  /// run / forward: the call's logits [B,T,V]; teacher_forced: one entry per step ([B,T,V] for the
  /// prompt, [B,1,V] for decode steps); generate: empty (read "logits" per step instead).
  std::vector<Tensor> logits;
  /// generate: the new tokens per prompt (as Model::generate); teacher_forced: each step's greedy
  /// (argmax) prediction per prompt; run / forward: empty.
  std::vector<std::vector<int32_t>> new_tokens;
  int steps = 0;  ///< forward calls made
};

class Session {
 public:
  /// One forward call of left-padded `prompts` from a fresh cache (Model::run); its step is 0.
  static Session run(const Model& model, std::vector<std::vector<int32_t>> prompts, Trace* trace = nullptr);
  /// One forward call of a prepared batch (ids or Batch::from_embeddings) from a fresh cache;
  /// `all_logits` false: the result's logits are [B,1,V] (the last position, as Model::forward).
  static Session run(const Model& model, Batch batch, Trace* trace = nullptr, bool all_logits = true);
  /// Model::generate: step 0 is the prompt, steps 1.. single-token decode steps.
  static Session generate(const Model& model, std::vector<std::vector<int32_t>> prompts, GenerateOptions options,
                          Trace* trace = nullptr);
  /// Model::generate from a prepared first batch (ids or embeddings); later steps feed generated ids.
  static Session generate(const Model& model, Batch prompt, GenerateOptions options, Trace* trace = nullptr);
  /// The prompt, then one decode step per forced token: forced[row][k] is fed after step k, so the
  /// session makes forced[row].size() + 1 calls (every row must have the same count).
  static Session teacher_forced(const Model& model, std::vector<std::vector<int32_t>> prompts,
                                std::vector<std::vector<int32_t>> forced, Trace* trace = nullptr);
  /// One Model::forward call continuing `cache`; its step is cache.steps() at creation.
  static Session forward(const Model& model, Batch batch, Cache& cache, Trace* trace = nullptr,
                         bool all_logits = true);

  /// Aborts a run in progress (the paused forward unwinds).
  ~Session();
  Session(Session&&) noexcept;
  Session& operator=(Session&&) noexcept;

  /// Blocks until the forward reaches `path` (one canonical value, no "*") at `step` and returns a
  /// copy; an undefined Tensor for a None value (state_input of a fresh prompt). The forward stays
  /// paused there until the next request. Errors: UnknownValueError (bad path, with the nearest
  /// valid name), OutOfOrderError (already passed; or the value was not produced at that step),
  /// InputError (a step this session never runs), and any error the forward raised.
  Tensor read(int step, std::string_view path);
  /// read(), and the returned tensor is *live* (issue 10 item 2, issue 9 item 5): it shares its
  /// storage with the session until the next read / read_live / write / reach_step / finish, which
  /// first compares it bit for bit with the value as read and, if the caller changed it in place,
  /// applies it as write(step, path) (errors as write's, same type, the message prefixed "in-place
  /// edit of '<path>' (read at step k) could not be applied: "). A write of that same value
  /// supersedes the in-place changes made so far (later ones still count). `states` (read-only) and
  /// None values are never live. Costs one extra copy of the value per read.
  Tensor read_live(int step, std::string_view path);
  /// Applies pending in-place changes of the live value now (as the next request would) and ends
  /// its tracking; a no-op when there is none. Errors as read_live describes.
  void settle();
  /// Replaces the value at (step, path) before it is consumed: advances to it if needed, or applies
  /// at once when the forward is paused there. Checked like Trace::set (shape, NaN, betas >= 0,
  /// decays <= 0; `states` is read-only): WriteError, and nothing is applied then.
  void write(int step, std::string_view path, const Tensor& value);
  /// Blocks until forward call `step` begins (true), or the run ended before it (false, e.g. every
  /// row of a generation reached EOS). True at once for a step the forward is in or has passed.
  bool reach_step(int step);
  /// Runs to completion and returns the result; rethrows the forward's error if it failed.
  SessionResult finish();
  /// Stops the forward: a paused one unwinds now, a running one (on its owner's thread) at its next
  /// value, layer or call boundary, after which this returns (idempotent; the destructor calls it).
  /// Any thread may call it. Later read / write / reach_step / finish raise InputError.
  void abort();
  /// `check` runs about every 50 ms while the forward runs (between its layers, on the caller's
  /// thread, inside read / write / reach_step / finish). An exception it throws ends the run and
  /// propagates to the caller: the Python binding checks for signals (Ctrl-C) here.
  void set_interrupt_check(std::function<void()> check);
  /// True inside this session's forward (e.g. in a Trace edit function).
  bool in_forward() const;

  int first_step() const;
  /// The last step this session can run (generate: first + max_new_tokens - 1).
  int last_step() const;
  /// The forward calls started so far (kernel, length), as Trace::calls().
  std::vector<CallRecord> calls() const;
  /// Where the forward is, for messages: "'layers.1.linear_attn.betas' at step 0", "the start of
  /// step 2", "not started", "finished".
  std::string where() const;

 private:
  struct Impl;
  explicit Session(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace mixlens
