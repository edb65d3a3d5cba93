// The activation arena: every Tensor buffer of at least kArenaMinBytes comes from a process-wide
// pool of freed buffers, so the activations of layer i+1 (and of the next call) reuse the pages
// of layer i instead of faulting in fresh ones (a forward allocates the same few shapes in every
// layer: on mamba2-130m a 1,024-token prompt spent 13% of its time in page faults before).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>

namespace mixlens::detail {

/// Buffers below this size come from malloc's own heap (reused without page faults there).
inline constexpr size_t kArenaMinBytes = size_t{64} << 10;

/// A buffer of at least `numel` floats (64-byte aligned, contents unspecified) owned by the
/// returned handle; when the last handle goes, the buffer returns to the pool (or to the system
/// when the pool holds arena_limit_bytes() already). `data` receives the buffer.
std::shared_ptr<const void> arena_alloc(int64_t numel, float** data);

struct ArenaStats {
  uint64_t reused = 0;        ///< allocations served from the pool
  uint64_t fresh = 0;         ///< allocations that went to the system
  uint64_t pooled_bytes = 0;  ///< bytes held free in the pool now
  uint64_t limit_bytes = 0;   ///< most bytes the pool keeps free
  bool enabled = true;        ///< false in sanitizer builds (plain new/delete keeps ASan's checks)
};
ArenaStats arena_stats();
/// Returns every pooled buffer to the system (RSS drops; the next forward faults its pages again).
void arena_release();
/// Bytes the pool may keep free: $MIXLENS_ARENA_MB MiB when set (0 disables pooling), else 256 MiB.
uint64_t arena_limit_bytes();

}  // namespace mixlens::detail
