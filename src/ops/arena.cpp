#include "ops/arena.h"

#include <sys/mman.h>

#include <cstdlib>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <vector>

#include "mixlens/errors.h"
#include "ops/env.h"

namespace mixlens::detail {

namespace {

// Size classes: 8 per power of two (a buffer is at most 12.5% larger than asked), so the same
// activation shape lands in the same class layer after layer.
[[maybe_unused]] size_t size_class(size_t bytes) {
  size_t p = 1;
  while (p < bytes / 8) p <<= 1;
  const size_t step = p;  // bytes/16 < step <= bytes/8
  return (bytes + step - 1) / step * step;
}

struct Pool {
  std::mutex mu;
  std::unordered_map<size_t, std::vector<void*>> free;  // class bytes -> buffers
  uint64_t pooled = 0, reused = 0, fresh = 0;
  uint64_t limit = 0;

  Pool() : limit(env_mib("MIXLENS_ARENA_MB", 256, true)) {}

  void* get(size_t bytes) {
    {
      std::lock_guard<std::mutex> lk(mu);
      auto it = free.find(bytes);
      if (it != free.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        pooled -= bytes;
        ++reused;
        return p;
      }
      ++fresh;
    }
    void* p = std::aligned_alloc(64, bytes);
    if (!p) throw std::bad_alloc();
    return p;
  }

  void put(void* p, size_t bytes) {
    {
      std::lock_guard<std::mutex> lk(mu);
      if (pooled + bytes <= limit) {
        free[bytes].push_back(p);
        pooled += bytes;
        return;
      }
    }
    std::free(p);
  }

  void release() {
    std::unordered_map<size_t, std::vector<void*>> out;
    {
      std::lock_guard<std::mutex> lk(mu);
      out.swap(free);
      pooled = 0;
    }
    for (auto& [bytes, v] : out)
      for (void* p : v) std::free(p);
  }
};

// Never destroyed: tensors with static storage may be released after every other static.
[[maybe_unused]] Pool& pool() {
  static Pool* p = new Pool();
  return *p;
}

// Freed big blocks (big_alloc), kept whole: reusing one costs no page fault and no kernel zeroing
// (a fresh 1 GiB block took 0.9 s of CPU here before its first write, a reused one 0.06 s).
struct BigCache {
  struct Block {
    void* p;
    size_t bytes;
  };
  std::mutex mu;
  std::vector<Block> free;  // least recently freed first
  uint64_t cached = 0, reused = 0, fresh = 0;
  uint64_t limit = 0;

  BigCache() {
    free.reserve(kBigMaxBlocks + 1);  // put() runs in deleters: it must not allocate
    limit = env_mib("MIXLENS_ARENA_BIG_MB", 2048, true);
  }

  static size_t pages(size_t bytes) { return (bytes + 4095) / 4096 * 4096; }

  static void* map(size_t bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    return p;
  }

  // A block of `bytes` (page multiple): a cached one up to 25% larger as it is, else one up to 25%
  // smaller grown in place by mremap (its pages kept, only the tail is new), else a new mapping.
  // A much larger cached block is left alone: a 33 MiB activation must not take the 1 GiB stack.
  void* get(size_t bytes, size_t* got) {
    Block b{nullptr, 0};
    {
      std::lock_guard<std::mutex> lk(mu);
      size_t best = free.size(), best_cost = 0;
      for (size_t i = 0; i < free.size(); ++i) {
        const size_t s = free[i].bytes;
        // Cost: the slack of a block that fits; one that must grow ranks after every fitting one.
        const size_t cost = s >= bytes ? s - bytes : bytes - s + bytes;
        if ((s >= bytes ? s - bytes : bytes - s) > bytes / 4) continue;
        if (best == free.size() || cost < best_cost) best = i, best_cost = cost;
      }
      if (best < free.size()) {
        b = free[best];
        free.erase(free.begin() + static_cast<std::ptrdiff_t>(best));
        cached -= b.bytes;
        ++reused;
      } else {
        ++fresh;
      }
    }
    if (b.p == nullptr) {
      *got = bytes;
      return map(bytes);
    }
    if (b.bytes < bytes) {
      void* q = mremap(b.p, b.bytes, bytes, MREMAP_MAYMOVE);
      if (q == MAP_FAILED) {
        munmap(b.p, b.bytes);
        *got = bytes;
        return map(bytes);
      }
      b = {q, bytes};
    }
    *got = b.bytes;
    return b.p;
  }

  void put(void* p, size_t bytes) noexcept {
    if (bytes > limit) {
      munmap(p, bytes);
      return;
    }
    // Before it is visible to get(): advice given after a new owner wrote could drop its data.
    (void)madvise(p, bytes, MADV_FREE);
    Block out[kBigMaxBlocks + 1];
    size_t n_out = 0;
    {
      std::lock_guard<std::mutex> lk(mu);
      free.push_back({p, bytes});  // capacity reserved: no allocation
      cached += bytes;
      while (!free.empty() && (cached > limit || free.size() > kBigMaxBlocks)) {
        out[n_out++] = free.front();
        cached -= free.front().bytes;
        free.erase(free.begin());
      }
    }
    for (size_t i = 0; i < n_out; ++i) munmap(out[i].p, out[i].bytes);
  }

  // Unmaps every cached block beyond `keep` bytes (all of them for 0).
  void trim(uint64_t keep) {
    std::vector<Block> out;
    {
      std::lock_guard<std::mutex> lk(mu);
      while (!free.empty() && cached > keep) {
        out.push_back(free.front());
        cached -= free.front().bytes;
        free.erase(free.begin());
      }
    }
    for (const Block& b : out) munmap(b.p, b.bytes);
  }
};

[[maybe_unused]] BigCache& big_cache() {
  static BigCache* c = new BigCache();
  return *c;
}

}  // namespace

std::shared_ptr<const void> big_alloc(size_t bytes, void** data) {
#ifndef MIXLENS_ARENA_OFF
  BigCache& bc = big_cache();
  size_t got = 0;
  void* p = bc.get(BigCache::pages(bytes), &got);
  *data = p;
  // Should the control block's allocation fail, shared_ptr calls the deleter: the block is cached.
  return std::shared_ptr<const void>(p, [got](const void* q) { big_cache().put(const_cast<void*>(q), got); });
#else
  void* p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  if (!p) throw std::bad_alloc();
  *data = p;
  return std::shared_ptr<const void>(p, [](const void* q) { std::free(const_cast<void*>(q)); });
#endif
}

std::shared_ptr<const void> arena_alloc(int64_t numel, float** data) {
  const size_t bytes = sizeof(float) * static_cast<size_t>(numel > 0 ? numel : 1);
#ifndef MIXLENS_ARENA_OFF
  if (bytes >= kBigMinBytes) {
    void* p = nullptr;
    auto h = big_alloc(bytes, &p);
    *data = static_cast<float*>(p);
    return h;
  }
  if (bytes >= kArenaMinBytes) {
    Pool& pl = pool();
    const size_t cls = size_class(bytes);
    void* p = pl.get(cls);
    *data = static_cast<float*>(p);
    return std::shared_ptr<const void>(p, [cls](const void* q) { pool().put(const_cast<void*>(q), cls); });
  }
#endif
  auto buf = std::shared_ptr<float[]>(new float[bytes / sizeof(float)]);
  *data = buf.get();
  return std::shared_ptr<const void>(buf, buf.get());
}

ArenaStats arena_stats() {
  ArenaStats s;
#ifdef MIXLENS_ARENA_OFF
  s.enabled = false;
#else
  Pool& pl = pool();
  std::lock_guard<std::mutex> lk(pl.mu);
  s.reused = pl.reused;
  s.fresh = pl.fresh;
  s.pooled_bytes = pl.pooled;
  s.limit_bytes = pl.limit;
  BigCache& bc = big_cache();
  std::lock_guard<std::mutex> lk2(bc.mu);
  s.big_reused = bc.reused;
  s.big_fresh = bc.fresh;
  s.big_cached_bytes = bc.cached;
  s.big_cached_blocks = bc.free.size();
  s.big_limit_bytes = bc.limit;
#endif
  return s;
}

void arena_release() {
#ifndef MIXLENS_ARENA_OFF
  pool().release();
  big_cache().trim(0);
#endif
}

uint64_t big_limit_bytes() {
#ifdef MIXLENS_ARENA_OFF
  return 0;
#else
  BigCache& bc = big_cache();
  std::lock_guard<std::mutex> lk(bc.mu);
  return bc.limit;
#endif
}

uint64_t set_big_limit_bytes(uint64_t bytes) {
#ifdef MIXLENS_ARENA_OFF
  (void)bytes;
  return 0;
#else
  BigCache& bc = big_cache();
  uint64_t old = 0;
  {
    std::lock_guard<std::mutex> lk(bc.mu);
    old = bc.limit;
    bc.limit = bytes;
  }
  bc.trim(bytes);
  return old;
#endif
}

uint64_t arena_limit_bytes() {
#ifdef MIXLENS_ARENA_OFF
  return 0;
#else
  return pool().limit;
#endif
}

}  // namespace mixlens::detail
