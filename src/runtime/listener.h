// Listener: how a forward hands values to whoever asked for them (DESIGN.md "Sites and listeners").
// A site nobody wants costs one bit test; a wanted value is visited in its served layout.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "mixlens/tensor.h"
#include "mixlens/values.h"

namespace mixlens::detail {

/// Facts about the forward call in progress.
struct CallCtx {
  int step = 0;
  int64_t batch = 0;
  int64_t seq = 0;
  bool fresh = true;           ///< no cached recurrent state before this call
  std::string kernel;          ///< "chunked" or "recurrent"
};

class Listener {
 public:
  virtual ~Listener() = default;
  /// Called before a forward call; must fill mask_ (num_layers + 1 entries, [0] = global).
  virtual void begin_call(const CallCtx& ctx, int num_layers) = 0;
  virtual void end_call() {}
  /// True when someone wants (layer, v) in this call. layer -1 = global values.
  bool wants(int layer, Value v) const {
    return (mask_[static_cast<size_t>(layer + 1)] >> static_cast<unsigned>(v)) & 1u;
  }
  /// Hands over `value` (served layout, shape `shape`; undefined for a None state_input).
  /// The listener may read it and may overwrite it in place or replace it (validated, same
  /// shape). Returns true when the value was written.
  virtual bool visit(int layer, Value v, Tensor& value, const Shape& shape) = 0;

 protected:
  std::vector<uint32_t> mask_;
};

/// Shorthand used by the forward code: visit only when wanted.
inline bool visit_if(Listener* l, int layer, Value v, Tensor& value) {
  return l && l->wants(layer, v) && l->visit(layer, v, value, value.shape());
}

}  // namespace mixlens::detail
