// Backward entry points shared by the families: the tape of a call and FamilyModel::backward, which
// runs the backward of the family's skeleton (models/ never includes grad/: docs/architecture.md).
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "grad/families.h"
#include "grad/mamba2_hybrid_grad.h"
#include "grad/qwen_grad.h"
#include "grad/recurrent_gemma_grad.h"
#include "grad/rwkv_grad.h"
#include "grad/tape.h"
#include "grad/xlstm_grad.h"
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

// The skeleton's backward, chosen by the type of the parts it exposes; the registry line is the one
// switch (a family it marks without a backward is refused, as its messages say).
void detail::FamilyModel::backward(const grad::Tape& tape, const Tensor& dlogits, grad::GradSink& sink) const {
  const std::vector<std::string> done = detail::backward_family_names();
  const std::unique_ptr<detail::BackwardParts> parts =
      std::find(done.begin(), done.end(), info.family) != done.end() ? backward_parts() : nullptr;
  if (const auto* p = dynamic_cast<const detail::SsmLmParts*>(parts.get()))
    return grad::ssm_lm_backward(*this, *p, tape, dlogits, sink);
  if (const auto* p = dynamic_cast<const detail::Mamba2HybridParts*>(parts.get()))
    return grad::mamba2_hybrid_backward(*p, tape, dlogits, sink);
  if (const auto* p = dynamic_cast<const detail::QwenHybridParts*>(parts.get()))
    return grad::qwen_hybrid_backward(*p, tape, dlogits, sink);
  if (const auto* p = dynamic_cast<const detail::RwkvParts*>(parts.get())) return grad::rwkv_backward(*p, tape, dlogits, sink);
  if (const auto* p = dynamic_cast<const detail::RecurrentGemmaParts*>(parts.get()))
    return grad::recurrent_gemma_backward(*p, tape, dlogits, sink);
  if (const auto* p = dynamic_cast<const detail::XlstmParts*>(parts.get())) return grad::xlstm_backward(*p, tape, dlogits, sink);
  throw UnsupportedError("backward: gradients are not implemented for the " + info.family + " family yet (done: " +
                         detail::join_names(done) + "; see docs/gradients.md)");
}

}  // namespace mixlens
