// The Session's fiber (runtime/fiber.h): the forward's stack switch, x86-64's own switch in normal
// builds and ucontext under the sanitizers (this file runs in the TSan build too). What the
// forward relies on: its locals survive every yield, an exception thrown after a yield unwinds
// inside the fiber or reaches resume(), another thread may resume it (Session::abort), and the
// floating-point control state (rounding mode) belongs to each side.
#include <gtest/gtest.h>

#include <cfenv>
#include <cmath>
#include <stdexcept>
#include <thread>
#include <vector>

#include "runtime/fiber.h"

using mixlens::detail::Fiber;

TEST(Fiber, LocalsOfBothSidesSurviveEveryYield) {
  Fiber* self = nullptr;
  double fiber_sum = 0.0;
  Fiber f([&] {
    std::vector<double> mine(64);
    double acc = 0.5;
    for (int i = 0; i < 1000; ++i) {
      mine[static_cast<size_t>(i % 64)] += acc;
      acc = std::sqrt(acc + static_cast<double>(i));
      self->yield();
    }
    for (double v : mine) fiber_sum += v;
  });
  self = &f;
  double caller = 1.0;
  int resumes = 0;
  while (!f.finished()) {
    f.resume();
    caller = caller * 1.0000001 + 1.0;
    ++resumes;
  }
  // The same computation without a fiber.
  std::vector<double> mine(64);
  double acc = 0.5, want_caller = 1.0;
  for (int i = 0; i < 1000; ++i) {
    mine[static_cast<size_t>(i % 64)] += acc;
    acc = std::sqrt(acc + static_cast<double>(i));
  }
  double want = 0.0;
  for (double v : mine) want += v;
  for (int i = 0; i < resumes; ++i) want_caller = want_caller * 1.0000001 + 1.0;
  EXPECT_EQ(resumes, 1001);
  EXPECT_EQ(fiber_sum, want);
  EXPECT_EQ(caller, want_caller);
}

TEST(Fiber, AnExceptionAfterAYieldUnwindsInsideOrReachesResume) {
  struct Stop {};
  Fiber* self = nullptr;
  bool stop = false;
  int destroyed = 0;
  struct Guard {
    int& n;
    ~Guard() { ++n; }
  };
  Fiber caught([&] {
    try {
      Guard g{destroyed};
      for (;;) {
        self->yield();
        if (stop) throw Stop{};
      }
    } catch (const Stop&) {
    }
  });
  self = &caught;
  caught.resume();
  caught.resume();
  stop = true;
  caught.resume();
  EXPECT_TRUE(caught.finished());
  EXPECT_EQ(destroyed, 1);

  Fiber escapes([&] {
    self->yield();
    throw std::logic_error("after a yield");
  });
  self = &escapes;
  escapes.resume();
  EXPECT_THROW(escapes.resume(), std::logic_error);
  EXPECT_TRUE(escapes.finished());
}

TEST(Fiber, AnotherThreadMayResumeIt) {
  Fiber* self = nullptr;
  std::vector<std::thread::id> ran_on;
  // Asked through an opaque call: pthread_self() is declared const, so two direct calls in one
  // frame may be folded into one across the yield.
  static std::thread::id (*volatile thread_id)() = [] { return std::this_thread::get_id(); };
  Fiber f([&] {
    ran_on.push_back(thread_id());
    self->yield();
    ran_on.push_back(thread_id());
  });
  self = &f;
  f.resume();
  std::thread other([&] { f.resume(); });
  const std::thread::id other_id = other.get_id();
  other.join();
  ASSERT_TRUE(f.finished());
  ASSERT_EQ(ran_on.size(), 2u);
  EXPECT_EQ(ran_on[0], std::this_thread::get_id());
  EXPECT_EQ(ran_on[1], other_id);
}

TEST(Fiber, RoundingModeBelongsToEachSide) {
  const int before = std::fegetround();
  ASSERT_EQ(before, FE_TONEAREST);
  Fiber* self = nullptr;
  int seen_in_fiber = -1;
  Fiber f([&] {
    std::fesetround(FE_TOWARDZERO);
    self->yield();
    seen_in_fiber = std::fegetround();  // still its own after the caller ran
    std::fesetround(FE_TONEAREST);
  });
  self = &f;
  f.resume();
  EXPECT_EQ(std::fegetround(), FE_TONEAREST);  // the fiber's mode did not leak out
  f.resume();
  EXPECT_EQ(seen_in_fiber, FE_TOWARDZERO);
  EXPECT_EQ(std::fegetround(), FE_TONEAREST);
}

TEST(Fiber, ManyFibersReuseStacks) {
  int ran = 0;
  for (int i = 0; i < 200; ++i) {
    Fiber f([&] {
      volatile char buf[64 << 10];  // touches the stack well below its top
      buf[0] = static_cast<char>(i);
      ran += buf[0] == static_cast<char>(i) ? 1 : 0;
    });
    f.resume();
    EXPECT_TRUE(f.finished());
  }
  EXPECT_EQ(ran, 200);
}
