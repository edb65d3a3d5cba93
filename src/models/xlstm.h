// What xLSTM's backward (src/grad/xlstm_grad.cpp) reads of a loaded model (models/xlstm.cpp).
#pragma once
#include <cstdint>
#include <vector>

#include "mixers/mlstm_mixer.h"
#include "models/family.h"
#include "ops/ops.h"

namespace mixlens::detail {

struct XlstmBlock {             // backbone.blocks.{i} (xLSTMBlock)
  Tensor norm_mlstm, norm_ffn;  // [D] RMSNorm weights
  MlstmMixerWeights mlstm;      // mlstm_layer
  ops::RowStack up_gate;        // [2 I, D] ffn.proj_up_gate | ffn.proj_up (xLSTMFeedForward), used fused
  Tensor down;                  // [D, I] ffn.proj_down
};

/// Pointers into the loaded model: embeddings -> blocks (h += mlstm(norm_mlstm(h)), h += ffn(norm_ffn(h)))
/// -> out_norm -> lm_head -> cap * tanh(logits / cap) (cap 0: none).
struct XlstmParts : BackwardParts {
  int64_t D = 0, L = 0, I = 0;
  float eps = 1e-6f, cap = 0.0f;  ///< norm_eps, output_logit_soft_cap
  const MlstmMixer* mixer = nullptr;
  const std::vector<XlstmBlock>* blocks = nullptr;
  const Tensor *out_norm = nullptr, *lm_head = nullptr;
};

}  // namespace mixlens::detail
