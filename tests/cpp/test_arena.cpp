// The big-block cache behind Tensor storage (ops/arena.h, big_alloc): freed blocks of 32 MiB and
// more (the `states` stacks) are reused whole, without page faults, within a byte and block cap, by
// one owner at a time, from any thread.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "mixlens/tensor.h"
#include "ops/arena.h"

using namespace mixlens;

namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

// Float count of a buffer of `mib` MiB.
int64_t floats(int64_t mib) { return mib * kMiB / 4; }

long minor_faults() {
  rusage r{};
  getrusage(RUSAGE_SELF, &r);
  return r.ru_minflt;
}

class BigArena : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!detail::arena_stats().enabled) GTEST_SKIP() << "the arena is off in sanitizer builds";
    if (detail::big_limit_bytes() == 0) GTEST_SKIP() << "MIXLENS_ARENA_BIG_MB=0";
    detail::arena_release();  // start from an empty cache
    old_limit_ = detail::set_big_limit_bytes(uint64_t{1} << 30);
  }
  void TearDown() override {
    if (old_limit_) detail::set_big_limit_bytes(old_limit_);
    detail::arena_release();
  }
  uint64_t old_limit_ = 0;
};

TEST_F(BigArena, AFreedStackIsReusedWithoutPageFaults) {
  const int64_t n = floats(64);
  const float* first = nullptr;
  {
    Tensor t = Tensor::uninitialized({n});
    first = t.data();
    for (int64_t i = 0; i < n; ++i) t[i] = 1.0f;  // faults every page in
  }
  auto s = detail::arena_stats();
  EXPECT_EQ(s.big_cached_blocks, 1u);
  EXPECT_GE(s.big_cached_bytes, static_cast<uint64_t>(n) * 4);
  const long f0 = minor_faults();
  Tensor u = Tensor::uninitialized({n});
  float* d = u.data();
  for (int64_t i = 0; i < n; ++i) d[i] = 2.0f;
  const long faults = minor_faults() - f0;
  EXPECT_EQ(u.data(), first) << "the freed block was not reused";
  EXPECT_EQ(detail::arena_stats().big_reused, s.big_reused + 1);
  EXPECT_EQ(detail::arena_stats().big_cached_blocks, 0u) << "a block in use must leave the cache";
  // 16,384 pages of 4 KiB: a reused block faults none (a few may come from the kernel reclaiming
  // MADV_FREE pages under memory pressure, or from unrelated allocations).
  EXPECT_LT(faults, 1000) << "writing a reused 64 MiB block page-faulted";
}

TEST_F(BigArena, BlocksAreAlignedAndSmallBuffersStayOnTheHeap) {
  Tensor big = Tensor::uninitialized({floats(33)});
  EXPECT_EQ(reinterpret_cast<uintptr_t>(big.data()) % 4096, 0u);
  const auto before = detail::arena_stats();
  Tensor small = Tensor::uninitialized({floats(1)});
  EXPECT_EQ(reinterpret_cast<uintptr_t>(small.data()) % 64, 0u);
  EXPECT_EQ(detail::arena_stats().big_fresh, before.big_fresh) << "a 1 MiB buffer is not big";
  // A big buffer with an odd element count is still whole: its last element is writable.
  Tensor odd = Tensor::uninitialized({floats(33) + 3});
  odd[odd.numel() - 1] = 5.0f;
  EXPECT_EQ(odd[odd.numel() - 1], 5.0f);
}

TEST_F(BigArena, ZeroFilledBigTensorsAreZeroOnReuse) {
  const int64_t n = floats(40);
  {
    Tensor t({n}, 1.5f);
    EXPECT_EQ(t[n - 1], 1.5f);
  }
  const auto before = detail::arena_stats();
  Tensor z({n});
  EXPECT_EQ(detail::arena_stats().big_reused, before.big_reused + 1);
  for (int64_t i = 0; i < n; i += 997) ASSERT_EQ(z[i], 0.0f) << i;
  EXPECT_EQ(z[n - 1], 0.0f);
}

TEST_F(BigArena, TheByteCapAndTheBlockCapBoundTheCache) {
  detail::set_big_limit_bytes(static_cast<uint64_t>(80 * kMiB));
  {
    Tensor a = Tensor::uninitialized({floats(40)}), b = Tensor::uninitialized({floats(40)}),
           c = Tensor::uninitialized({floats(40)});
  }
  auto s = detail::arena_stats();
  EXPECT_EQ(s.big_cached_blocks, 2u);
  EXPECT_LE(s.big_cached_bytes, static_cast<uint64_t>(80 * kMiB));
  // A block over the cap is never cached.
  { Tensor huge = Tensor::uninitialized({floats(96)}); }
  EXPECT_EQ(detail::arena_stats().big_cached_blocks, 2u);
  // Lowering the cap evicts down to it; 0 keeps nothing.
  detail::set_big_limit_bytes(static_cast<uint64_t>(40 * kMiB));
  EXPECT_EQ(detail::arena_stats().big_cached_blocks, 1u);
  detail::set_big_limit_bytes(0);
  EXPECT_EQ(detail::arena_stats().big_cached_bytes, 0u);
  { Tensor d = Tensor::uninitialized({floats(40)}); }
  EXPECT_EQ(detail::arena_stats().big_cached_blocks, 0u);
  // At most kBigMaxBlocks blocks, however much the byte cap allows.
  detail::set_big_limit_bytes(uint64_t{1} << 30);
  {
    std::vector<Tensor> many;
    for (size_t i = 0; i < detail::kBigMaxBlocks + 2; ++i) many.push_back(Tensor::uninitialized({floats(33)}));
  }
  EXPECT_EQ(detail::arena_stats().big_cached_blocks, detail::kBigMaxBlocks);
  detail::arena_release();
  s = detail::arena_stats();
  EXPECT_EQ(s.big_cached_blocks, 0u);
  EXPECT_EQ(s.big_cached_bytes, 0u);
}

TEST_F(BigArena, SizesPickTheClosestBlockAndNeverStealAMuchLargerOne) {
  { Tensor stack = Tensor::uninitialized({floats(128)}); }  // a freed `states` stack
  auto s = detail::arena_stats();
  {
    // A 34 MiB activation does not take (and shrink) the 128 MiB stack.
    Tensor act = Tensor::uninitialized({floats(34)});
    EXPECT_EQ(detail::arena_stats().big_fresh, s.big_fresh + 1);
  }
  s = detail::arena_stats();
  EXPECT_EQ(s.big_cached_blocks, 2u);
  {
    // A slightly smaller stack (1,000 tokens after 1,024) reuses it as it is; a slightly larger one
    // grows it (mremap keeps its pages).
    Tensor a = Tensor::uninitialized({floats(120)});
    EXPECT_EQ(detail::arena_stats().big_reused, s.big_reused + 1);
  }
  s = detail::arena_stats();
  {
    Tensor b = Tensor::uninitialized({floats(140)});
    EXPECT_EQ(detail::arena_stats().big_reused, s.big_reused + 1);
    b[b.numel() - 1] = 3.0f;  // the grown tail is mapped
    b[0] = 4.0f;
    EXPECT_EQ(b[b.numel() - 1], 3.0f);
    EXPECT_EQ(detail::arena_stats().big_cached_blocks, 1u) << "the 34 MiB block stays";
  }
}

TEST_F(BigArena, ThreadsNeverShareABlock) {
  // Each thread stamps its id on pages of the blocks it holds and checks them before freeing: a
  // block handed to two owners at once would show another thread's stamp (and TSan a race).
  constexpr int kThreads = 4, kRounds = 40;
  std::atomic<int> bad{0};
  std::vector<std::thread> ts;
  for (int id = 0; id < kThreads; ++id)
    ts.emplace_back([id, &bad] {
      const int64_t sizes[] = {floats(33), floats(36), floats(40)};
      for (int r = 0; r < kRounds; ++r) {
        Tensor t = Tensor::uninitialized({sizes[(id + r) % 3]});
        float* d = t.data();
        const float stamp = static_cast<float>(id * 1000 + r);
        for (int64_t i = 0; i < t.numel(); i += 1024) d[i] = stamp;  // one per 4 KiB page
        std::this_thread::yield();
        for (int64_t i = 0; i < t.numel(); i += 1024)
          if (d[i] != stamp) {
            ++bad;
            break;
          }
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(bad.load(), 0);
  const auto s = detail::arena_stats();
  EXPECT_GT(s.big_reused, 0u);
  EXPECT_LE(s.big_cached_blocks, detail::kBigMaxBlocks);
}

}  // namespace
