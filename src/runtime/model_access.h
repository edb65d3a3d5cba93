// Internal entry points of Model used by the Session interleaver: the same forward and generation
// loop as the public Model::forward / generate, with an extra Listener chained after the Trace's.
#pragma once
#include <vector>

#include "hooks/listener.h"
#include "mixlens/model.h"

namespace mixlens::detail {

struct CacheState;

struct ModelAccess {
  static const FamilyModel& family(const Model& m);
  /// InputError when `cache` is broken (Cache::broken), worded for `verb` ("continue", "copy").
  static void check_cache(const Cache& cache, const char* verb);
  /// Model::forward with `extra` (may be null) served after `trace`'s listener.
  static Tensor forward(const Model& m, const Batch& batch, Cache& cache, Trace* trace, Listener* extra,
                        bool all_logits, const std::atomic<bool>* cancel = nullptr);
  /// The unobserved long call of forward() as pieces of `chunk` tokens carrying the cache
  /// (Model::set_prefill_chunk); advances cache.seen, not the step counter.
  static Tensor chunked_prefill(const Model& m, const Batch& batch, CacheState& cache, Listener* listener,
                                const CallCtx& ctx, bool all_logits, int64_t chunk);
  /// Model::generate with `extra` served at every step.
  static GenerationResult generate(const Model& m, Batch prompt, const GenerateOptions& options, Trace* trace,
                                   Listener* extra, const std::atomic<bool>* cancel = nullptr);
};

}  // namespace mixlens::detail
