#include "runtime/fiber.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdint>
#include <new>
#include <system_error>

#if defined(__SANITIZE_ADDRESS__)
#define MIXLENS_FIBER_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__)
#define MIXLENS_FIBER_TSAN 1
#endif
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MIXLENS_FIBER_ASAN 1
#endif
#if __has_feature(thread_sanitizer)
#define MIXLENS_FIBER_TSAN 1
#endif
#endif
#ifdef MIXLENS_FIBER_ASAN
#include <sanitizer/common_interface_defs.h>
#endif
#ifdef MIXLENS_FIBER_TSAN
#include <sanitizer/tsan_interface.h>
#endif

namespace mixlens::detail {

namespace {

// One finished fiber's stack kept per thread for the next fiber: a trace per prompt otherwise pays
// an mmap, a munmap and a page fault per touched stack page every time. Not under ASan: a stack
// left by a fiber keeps the poisoned redzones of the frames it abandoned.
struct SpareStack {
  void* p = nullptr;
  size_t bytes = 0;
  ~SpareStack() {
    if (p != nullptr) munmap(p, bytes);
  }
};
thread_local SpareStack tl_spare;

}  // namespace

struct Fiber::Ctx {
  ucontext_t self{}, caller{};
  // ASan: each side's fake stack and the stack it switches to (the caller's is learnt on arrival).
  void* fake_self = nullptr;
  void* fake_caller = nullptr;
  const void* caller_bottom = nullptr;
  size_t caller_size = 0;
  // TSan: the fiber's own sanitizer context and the one of the thread that resumed it.
  void* tsan_self = nullptr;
  void* tsan_caller = nullptr;
};

Fiber::Fiber(std::function<void()> body, size_t stack_bytes) : ctx_(new Ctx), body_(std::move(body)) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  stack_bytes_ = (stack_bytes + page - 1) / page * page + page;  // + a guard page below the stack
  if (tl_spare.p != nullptr && tl_spare.bytes == stack_bytes_) {
    stack_ = tl_spare.p;
    tl_spare.p = nullptr;
  } else {
    void* p = mmap(nullptr, stack_bytes_, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
    if (p == MAP_FAILED) {
      delete ctx_;
      throw std::bad_alloc();
    }
    stack_ = p;
    mprotect(stack_, page, PROT_NONE);
  }
  if (getcontext(&ctx_->self) != 0) {
    munmap(stack_, stack_bytes_);
    delete ctx_;
    throw std::system_error(errno, std::generic_category(), "getcontext");
  }
  ctx_->self.uc_stack.ss_sp = static_cast<char*>(stack_) + page;
  ctx_->self.uc_stack.ss_size = stack_bytes_ - page;
  ctx_->self.uc_link = nullptr;  // the body never returns through the context: entry switches out
  const auto me = reinterpret_cast<uintptr_t>(this);
  makecontext(&ctx_->self, reinterpret_cast<void (*)()>(&Fiber::entry), 2, static_cast<unsigned>(me & 0xffffffffu),
              static_cast<unsigned>(static_cast<uint64_t>(me) >> 32));
#ifdef MIXLENS_FIBER_TSAN
  ctx_->tsan_self = __tsan_create_fiber(0);
#endif
}

Fiber::~Fiber() {
#ifdef MIXLENS_FIBER_TSAN
  __tsan_destroy_fiber(ctx_->tsan_self);
#endif
#ifndef MIXLENS_FIBER_ASAN
  if (tl_spare.p == nullptr) {
    tl_spare.p = stack_;
    tl_spare.bytes = stack_bytes_;
    stack_ = nullptr;
  }
#endif
  if (stack_ != nullptr) munmap(stack_, stack_bytes_);
  delete ctx_;
}

void Fiber::entry(unsigned lo, unsigned hi) {
  auto* f = reinterpret_cast<Fiber*>(static_cast<uintptr_t>(lo) | (static_cast<uintptr_t>(hi) << 32));
#ifdef MIXLENS_FIBER_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &f->ctx_->caller_bottom, &f->ctx_->caller_size);
#endif
  try {
    f->body_();
  } catch (...) {
    f->error_ = std::current_exception();
  }
  f->finished_ = true;
  f->switch_out(true);  // never comes back
}

void Fiber::resume() {
  if (finished_) return;
  started_ = true;
  switch_in();
  if (finished_ && error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

void Fiber::yield() { switch_out(false); }

void Fiber::switch_in() {
#ifdef MIXLENS_FIBER_TSAN
  ctx_->tsan_caller = __tsan_get_current_fiber();
  __tsan_switch_to_fiber(ctx_->tsan_self, 0);
#endif
#ifdef MIXLENS_FIBER_ASAN
  __sanitizer_start_switch_fiber(&ctx_->fake_caller, ctx_->self.uc_stack.ss_sp, ctx_->self.uc_stack.ss_size);
#endif
  swapcontext(&ctx_->caller, &ctx_->self);
#ifdef MIXLENS_FIBER_ASAN
  __sanitizer_finish_switch_fiber(ctx_->fake_caller, nullptr, nullptr);
#endif
}

void Fiber::switch_out(bool final) {
#ifdef MIXLENS_FIBER_ASAN
  // The last switch passes no fake-stack slot: ASan frees this fiber's fake stack.
  __sanitizer_start_switch_fiber(final ? nullptr : &ctx_->fake_self, ctx_->caller_bottom, ctx_->caller_size);
#endif
#ifdef MIXLENS_FIBER_TSAN
  __tsan_switch_to_fiber(ctx_->tsan_caller, 0);
#endif
  swapcontext(&ctx_->self, &ctx_->caller);
  // Resumed (not after the final switch).
#ifdef MIXLENS_FIBER_ASAN
  __sanitizer_finish_switch_fiber(ctx_->fake_self, &ctx_->caller_bottom, &ctx_->caller_size);
#endif
  (void)final;
}

}  // namespace mixlens::detail
