#include "runtime/arena.h"

#include <cstdlib>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <vector>

#include "mixlens/errors.h"

#if defined(__SANITIZE_ADDRESS__)
#define MIXLENS_ARENA_OFF 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MIXLENS_ARENA_OFF 1
#endif
#endif

namespace mixlens::detail {

namespace {

// Size classes: 8 per power of two (a buffer is at most 12.5% larger than asked), so the same
// activation shape lands in the same class layer after layer.
size_t size_class(size_t bytes) {
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

  Pool() {
    limit = uint64_t{256} << 20;
    if (const char* env = std::getenv("MIXLENS_ARENA_MB")) {
      char* end = nullptr;
      const unsigned long long mb = std::strtoull(env, &end, 10);
      if (end == env || *end != '\0' || mb > (uint64_t{1} << 30))
        throw InputError(std::string("MIXLENS_ARENA_MB='") + env + "' must be a whole number of MiB");
      limit = static_cast<uint64_t>(mb) << 20;
    }
  }

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
Pool& pool() {
  static Pool* p = new Pool();
  return *p;
}

}  // namespace

std::shared_ptr<const void> arena_alloc(int64_t numel, float** data) {
  const size_t bytes = sizeof(float) * static_cast<size_t>(numel > 0 ? numel : 1);
#ifndef MIXLENS_ARENA_OFF
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
#endif
  return s;
}

void arena_release() {
#ifndef MIXLENS_ARENA_OFF
  pool().release();
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
