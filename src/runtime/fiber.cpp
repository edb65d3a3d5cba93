#include "runtime/fiber.h"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdint>
#include <new>
#include <system_error>

#include "ops/ops.h"

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

// x86-64: the switch is a few instructions of our own (callee-saved registers, MXCSR and the x87
// control word, then the stack pointer), as Boost.Context does. glibc's swapcontext also saves and
// restores the signal mask, a system call each way: ~0.3-0.8 us of every value a `with` block reads
// (issue 9 item 5). Sanitizer builds keep ucontext (their fiber annotations are tested with it).
#if defined(__x86_64__) && defined(__linux__) && !defined(MIXLENS_FIBER_ASAN) && !defined(MIXLENS_FIBER_TSAN)
#define MIXLENS_FIBER_ASM 1
extern "C" {
// Saves the current context on its stack, stores its stack pointer in *save, resumes `load`'s.
void mixlens_fiber_switch(void** save, void* load);
// A new fiber's first frame: calls r13(r12) on a 16-byte aligned stack; the call never returns.
void mixlens_fiber_start();
}
asm(R"(
  .text
  .globl mixlens_fiber_switch
  .hidden mixlens_fiber_switch
  .type mixlens_fiber_switch, @function
  .p2align 4
mixlens_fiber_switch:
  .cfi_startproc
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  stmxcsr 8(%rsp)
  fnstcw 12(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr 8(%rsp)
  fldcw 12(%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .cfi_endproc
  .size mixlens_fiber_switch, .-mixlens_fiber_switch

  .globl mixlens_fiber_start
  .hidden mixlens_fiber_start
  .type mixlens_fiber_start, @function
  .p2align 4
mixlens_fiber_start:
  .cfi_startproc
  .cfi_undefined rip
  movq %r12, %rdi
  callq *%r13
  ud2
  .cfi_endproc
  .size mixlens_fiber_start, .-mixlens_fiber_start
)");
#endif

namespace mixlens::detail {

namespace {

#ifdef MIXLENS_FIBER_ASM
// A process running with a CET shadow stack would fault on the switch's `ret` into another stack:
// use ucontext there (glibc switches shadow stacks too). ARCH_SHSTK_STATUS is Linux >= 6.6; an
// older kernel has no user shadow stacks.
bool shadow_stack_active() {
  unsigned long features = 0;
  return syscall(SYS_arch_prctl, 0x5005 /* ARCH_SHSTK_STATUS */, &features) == 0 && (features & 1ul) != 0;
}
const bool kAsmSwitch = !shadow_stack_active();
#endif

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
  bool asm_switch = false;
  void* sp_self = nullptr;    // asm switch: the fiber's saved stack pointer
  void* sp_caller = nullptr;  // and the resumer's
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
#ifdef MIXLENS_FIBER_ASM
  if (kAsmSwitch) {
    // The first frame mixlens_fiber_switch pops: [16 bytes: MXCSR at +8, x87 control word at +12],
    // r15, r14, r13 = the entry, r12 = this, rbx, rbp, return address = mixlens_fiber_start; the
    // stack pointer is then 16-byte aligned for its call. 88 bytes below the 16-aligned top.
    ctx_->asm_switch = true;
    auto top = (reinterpret_cast<uintptr_t>(stack_) + stack_bytes_) & ~uintptr_t{15};
    auto* frame = reinterpret_cast<uint64_t*>(top - 88);
    uint32_t mxcsr = 0;
    uint16_t fpucw = 0;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(fpucw));
    frame[0] = 0;
    frame[1] = static_cast<uint64_t>(mxcsr) | (static_cast<uint64_t>(fpucw) << 32);
    frame[2] = 0;                                                         // r15
    frame[3] = 0;                                                         // r14
    frame[4] = reinterpret_cast<uint64_t>(&Fiber::entry_asm);             // r13
    frame[5] = reinterpret_cast<uint64_t>(this);                          // r12
    frame[6] = 0;                                                         // rbx
    frame[7] = 0;                                                         // rbp
    frame[8] = reinterpret_cast<uint64_t>(&mixlens_fiber_start);          // return address
    ctx_->sp_self = frame;
    return;
  }
#endif
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

void Fiber::entry_asm(Fiber* f) { entry(static_cast<unsigned>(reinterpret_cast<uintptr_t>(f) & 0xffffffffu),
                                        static_cast<unsigned>(static_cast<uint64_t>(reinterpret_cast<uintptr_t>(f)) >> 32)); }

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
  // The body's ops::deterministic() setting (a forward's LoadOptions::deterministic) is its own: the
  // caller's code between two resumes runs under the caller's setting, and vice versa.
  const int caller_state = ops::deterministic_state();
  ops::set_deterministic_state(ops_state_);
  switch_in();
  ops_state_ = ops::deterministic_state();
  ops::set_deterministic_state(caller_state);
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
#ifdef MIXLENS_FIBER_ASM
  if (ctx_->asm_switch)
    mixlens_fiber_switch(&ctx_->sp_caller, ctx_->sp_self);
  else
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
#ifdef MIXLENS_FIBER_ASM
  if (ctx_->asm_switch)
    mixlens_fiber_switch(&ctx_->sp_self, ctx_->sp_caller);
  else
#endif
    swapcontext(&ctx_->self, &ctx_->caller);
  // Resumed (not after the final switch).
#ifdef MIXLENS_FIBER_ASAN
  __sanitizer_finish_switch_fiber(ctx_->fake_self, &ctx_->caller_bottom, &ctx_->caller_size);
#endif
  (void)final;
}

}  // namespace mixlens::detail
