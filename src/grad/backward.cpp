// Backward entry points shared by the families: the tape of a call and the default (unsupported)
// family backward.
#include "grad/tape.h"
#include "mixlens/errors.h"
#include "models/registry.h"

namespace mixlens {

namespace grad {

std::shared_ptr<Tape> begin_tape(const detail::FamilyModel& family, const Batch& in, const detail::CacheState& cache,
                                 const detail::CallCtx& ctx) {
  auto t = std::make_shared<Tape>();
  t->family = &family;
  t->batch = in;
  if (in.embeds.defined()) t->batch.embeds = in.embeds.clone();
  t->cache_before = cache.clone();
  t->kernel = ctx.kernel;
  t->step = ctx.step;
  return t;
}

}  // namespace grad

void detail::FamilyModel::backward(const grad::Tape&, const Tensor&, grad::GradSink&) const {
  throw UnsupportedError("backward: gradients are not implemented for the " + info.family + " family yet (done: " +
                         detail::join_names(detail::backward_family_names()) + "; see docs/gradients.md)");
}

}  // namespace mixlens
