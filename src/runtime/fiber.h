// Fiber: a function run on its own stack, on the thread that resumes it, until it yields or ends.
// The Session runs its forward this way (issue 9 item 5): the forward pauses at a value and the
// caller's code continues on the same thread, so a value read in a `with` block costs two stack
// switches (~1 us) instead of two thread wake-ups through the scheduler (~10-300 us on a loaded
// machine). A register-and-stack switch of its own on x86-64 Linux (fiber.cpp), ucontext elsewhere and
// under the sanitizers; annotated for AddressSanitizer and ThreadSanitizer.
// Why not Boost.Context's fcontext for the ~50 lines of switch: the sanitizers follow Boost's switches only
// in its ucontext build (Boost's "Support for sanitizers") and Debian ships the fcontext one, so this
// ucontext path stays for CI's ASan/TSan jobs either way, and the wheel would carry one more library.
#pragma once
#include <cstddef>
#include <exception>
#include <functional>

namespace mixlens::detail {

class Fiber {
 public:
  /// `body` runs at the first resume(); an exception escaping it is kept and rethrown by that
  /// resume(). The stack (mmap'd, pages committed as touched, a guard page below) is 8 MiB, as a
  /// thread's default.
  explicit Fiber(std::function<void()> body, size_t stack_bytes = size_t{8} << 20);
  /// The body must have ended or never started (a suspended body would leak what its frames own).
  ~Fiber();
  Fiber(const Fiber&) = delete;
  Fiber& operator=(const Fiber&) = delete;

  /// Runs the body until it calls yield() or returns; on any thread, one at a time (callers
  /// serialise), never from inside the body. No-op once finished.
  void resume();
  /// Inside the body: back to the resume() that ran it.
  void yield();
  bool started() const { return started_; }
  bool finished() const { return finished_; }

 private:
  static void entry(unsigned lo, unsigned hi);
  static void entry_asm(Fiber* f);  // the x86-64 switch's entry (fiber.cpp)
  void switch_in();
  void switch_out(bool final);

  struct Ctx;
  Ctx* ctx_;
  std::function<void()> body_;
  void* stack_ = nullptr;
  size_t stack_bytes_ = 0;
  bool started_ = false, finished_ = false;
  int ops_state_ = -1;  // ops::deterministic_state() of the body, kept while it is suspended
  std::exception_ptr error_;
};

}  // namespace mixlens::detail
