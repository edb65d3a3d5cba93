// Backward of the Mamba-2 hybrid skeleton (models/mamba2_hybrid.cpp: Nemotron-H, Bamba, Falcon-H1).
#pragma once
#include <vector>

#include "grad/tape.h"
#include "models/mamba2_hybrid.h"

namespace mixlens::grad {

/// LM head (and lm_head_multiplier), final norm, then every block from the last: recomputed from
/// its recorded input with the tape's writes re-applied, differentiated (second branch MLP, then
/// the first branch's Mamba-2 mixer / attention / MLP / MoE), down to the embeddings. Puts the
/// gradient of every wanted value into `sink`.
void mamba2_hybrid_backward(const detail::Mamba2HybridParts& m, const Tape& tape, const Tensor& dlogits, GradSink& sink);

}  // namespace mixlens::grad
