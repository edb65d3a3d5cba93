// Backward of RecurrentGemma (issue 25, docs/gradients.md): the skeleton's (grad/recurrent_gemma_grad.cpp)
// over the RG-LRU mixer's (grad/rg_lru_grad.h) and the attention mixer's (grad/families.h).
#pragma once
#include "grad/tape.h"
#include "models/recurrent_gemma.h"

namespace mixlens::grad {

/// Backward of RecurrentGemma::forward: the soft-capped head, final_norm, the blocks from last to first
/// (GeGLU MLP, (1 + w) RMSNorms, RG-LRU or local attention), into the scaled embeddings.
void recurrent_gemma_backward(const detail::RecurrentGemmaParts& p, const Tape& tape, const Tensor& dlogits,
                              GradSink& sink);

}  // namespace mixlens::grad
