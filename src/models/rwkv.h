// What RWKV-4's backward (src/grad/rwkv_grad.cpp) reads of a loaded model (models/rwkv.cpp).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "mixers/rwkv_mixer.h"
#include "models/family.h"

namespace mixlens::detail {

struct RwkvFeedForward {  // rwkv.blocks.{i}.feed_forward (RwkvFeedForward)
  Tensor mix_k, mix_r, key, receptance, value;  // value [D, I] rescaled as the mixer's output
};

/// Pointers into the loaded model: embeddings -> [pre_ln on block 0] -> blocks (ln1 -> time mixing,
/// ln2 -> channel mixing, halving after every rescale_every-th) -> ln_out (eps 1e-5) -> head.
struct RwkvParts : BackwardParts {
  int64_t D = 0, L = 0, I = 0, rescale_every = 6;
  float eps = 1e-5f;
  const RwkvMixer* mixer = nullptr;
  const Tensor *pre_ln_w = nullptr, *pre_ln_b = nullptr, *ln_out_w = nullptr, *lm_head = nullptr;
  const std::vector<Tensor>* ln_w = nullptr;  ///< per layer: ln1, ln2
  const std::vector<Tensor>* ln_b = nullptr;
  const std::vector<RwkvMixerWeights>* layers = nullptr;
  const std::vector<RwkvFeedForward>* ffn = nullptr;
};

}  // namespace mixlens::detail
