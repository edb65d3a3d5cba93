// What RecurrentGemma's backward (src/grad/recurrent_gemma_grad.cpp) reads of a loaded model
// (models/recurrent_gemma.cpp).
#pragma once
#include <cstdint>
#include <vector>

#include "mixers/attention_mixer.h"
#include "mixers/rg_lru_mixer.h"
#include "models/family.h"

namespace mixlens::detail {

/// One residual block (RecurrentGemmaDecoderLayer): temporal_pre_norm -> RG-LRU or local attention,
/// channel_pre_norm -> the GeGLU MLP down(gelu_tanh(gate x + b) * (up x + b)) + b.
struct RecurrentGemmaLayer {
  bool recurrent = true;
  Tensor temporal_norm, channel_norm;
  RgLruMixerWeights rg;
  AttentionMixerWeights attn;
  Tensor gate, up, down, gate_b, up_b, down_b;  // [I, D], [I, D], [D, I], [I], [I], [D]
};

/// Pointers into the loaded model: embeddings * scale -> blocks -> final_norm ((1 + w), eps) -> lm_head
/// -> cap * tanh(logits / cap).
struct RecurrentGemmaParts : BackwardParts {
  int64_t D = 0, L = 0, I = 0;
  float eps = 1e-6f, cap = 30.0f;
  const RgLruMixer* rg = nullptr;
  const AttentionMixer* attn = nullptr;
  const Tensor *norm = nullptr, *lm_head = nullptr;
  const std::vector<RecurrentGemmaLayer>* layers = nullptr;
};

}  // namespace mixlens::detail
