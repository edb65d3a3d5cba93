// Internal entry points of Model used by the Session interleaver: the same forward and generation
// loop as the public Model::forward / generate, with an extra Listener chained after the Trace's.
#pragma once
#include <vector>

#include "mixlens/model.h"
#include "runtime/listener.h"

namespace mixlens::detail {

struct ModelAccess {
  static const FamilyModel& family(const Model& m);
  /// Model::forward with `extra` (may be null) served after `trace`'s listener.
  static Tensor forward(const Model& m, const Batch& batch, Cache& cache, Trace* trace, Listener* extra,
                        bool all_logits);
  /// Model::generate with `extra` served at every step.
  static GenerationResult generate(const Model& m, const std::vector<std::vector<int32_t>>& prompts,
                                   const GenerateOptions& options, Trace* trace, Listener* extra);
};

}  // namespace mixlens::detail
