// The activation arena: every Tensor buffer of at least kArenaMinBytes comes from a process-wide
// pool of freed buffers, so the activations of layer i+1 (and of the next call) reuse the pages
// of layer i instead of faulting in fresh ones (a forward allocates the same few shapes in every
// layer: on mamba2-130m a 1,024-token prompt spent 13% of its time in page faults before).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>

// ASan builds run without the pools (plain allocations keep its bounds checks); code that picks
// an arena path itself (Tensor::uninitialized) tests this too.
#if defined(__SANITIZE_ADDRESS__)
#define MIXLENS_ARENA_OFF 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MIXLENS_ARENA_OFF 1
#endif
#endif

namespace mixlens::detail {

/// Buffers below this size come from malloc's own heap (reused without page faults there).
inline constexpr size_t kArenaMinBytes = size_t{64} << 10;
/// Buffers of this size and more are "big" (a `states` stack is 0.1-4 GiB): mapped directly and, once
/// freed, kept whole in a small cache (big_alloc). glibc maps every block from 32 MiB up afresh, so
/// without it each one cost a page fault and a kernel zeroing per 4 KiB before its first write.
inline constexpr size_t kBigMinBytes = size_t{32} << 20;

/// A buffer of at least `numel` floats (64-byte aligned, contents unspecified) owned by the
/// returned handle; when the last handle goes, the buffer returns to the pool (or to the system
/// when the pool holds arena_limit_bytes() already). `data` receives the buffer.
std::shared_ptr<const void> arena_alloc(int64_t numel, float** data);

/// A buffer of at least `bytes` bytes (>= kBigMinBytes), 4096-byte aligned, contents unspecified (a
/// reused block holds what its last owner wrote), owned by the returned handle. When the last handle
/// goes, the whole block enters the big-block cache (at most big_limit_bytes() and kBigMaxBlocks
/// blocks, the least recently freed leaving first) marked MADV_FREE: the kernel may take its pages
/// back under memory pressure, else the next big_alloc of a similar size reuses them without faults.
/// A block is handed out only after it left the cache, so it never has two owners. Thread-safe.
/// Throws std::bad_alloc when the system has no memory. Sanitizer builds: plain aligned_alloc.
std::shared_ptr<const void> big_alloc(size_t bytes, void** data);
/// Most freed big blocks the cache keeps.
inline constexpr size_t kBigMaxBlocks = 4;

struct ArenaStats {
  uint64_t reused = 0;        ///< allocations served from the pool
  uint64_t fresh = 0;         ///< allocations that went to the system
  uint64_t pooled_bytes = 0;  ///< bytes held free in the pool now
  uint64_t limit_bytes = 0;   ///< most bytes the pool keeps free
  uint64_t big_reused = 0;    ///< big_alloc calls served from the big-block cache
  uint64_t big_fresh = 0;     ///< big_alloc calls that mapped a new block
  uint64_t big_cached_bytes = 0;   ///< bytes of freed big blocks cached now (resident unless reclaimed)
  uint64_t big_cached_blocks = 0;  ///< freed big blocks cached now
  uint64_t big_limit_bytes = 0;    ///< most bytes the big-block cache keeps
  bool enabled = true;        ///< false in sanitizer builds (plain new/delete keeps ASan's checks)
};
ArenaStats arena_stats();
/// Returns every pooled buffer and cached big block to the system (RSS drops; the next forward
/// faults its pages again).
void arena_release();
/// Bytes the pool may keep free: $MIXLENS_ARENA_MB MiB when set (0 disables pooling), else 256 MiB.
uint64_t arena_limit_bytes();
/// Bytes of freed big blocks the cache may keep: $MIXLENS_ARENA_BIG_MB MiB when set (0: every freed
/// big block is unmapped at once), else 2048 MiB (one 1 GiB Qwen3.5-0.8B `states` stack at 1,024
/// tokens and change).
uint64_t big_limit_bytes();
/// Tests: sets the big-block cache's byte limit (evicting down to it) and returns the old one.
uint64_t set_big_limit_bytes(uint64_t bytes);

}  // namespace mixlens::detail
