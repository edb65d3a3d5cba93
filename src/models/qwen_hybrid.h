// Shared implementation of the Qwen gated-DeltaNet hybrids (Qwen3.5, Qwen3-Next): decoder blocks
// whose mixer is either a gated DeltaNet (linear_attn) or gated softmax attention (self_attn), as
// config.layer_types says, followed by a dense SwiGLU MLP or a sparse MoE. The per-family files
// (qwen3_5.cpp, qwen3_next.cpp) only say how their checkpoints lay out the GDN input projections.
#pragma once
#include <functional>
#include <memory>
#include <string>

#include "io/json.h"
#include "io/weights.h"
#include "mixers/gated_delta_mixer.h"
#include "models/family.h"

namespace mixlens::detail {

struct QwenHybridSpec {
  std::string family;  ///< route_kernels family name ("qwen3_5", "qwen3_next")
  /// Returns layer `prefix`'s GDN input projections as one [proj_rows, D] matrix with rows in the
  /// order q (HK*Dk, head-major) | k | v (HV*Dv) | z (HV*Dv) | b (HV) | a (HV).
  std::function<Tensor(const io::WeightStore&, const std::string& prefix, const GdnDims&)> load_gdn_in_proj;
};

/// Builds the model. `text` is the text-model config (text_config of a VLM config, else the
/// config itself); `top` the file's top-level config (tie_word_embeddings fallback).
std::unique_ptr<FamilyModel> make_qwen_hybrid(const QwenHybridSpec& spec, const io::Config& top,
                                              const io::Config& text, const io::WeightStore& weights);

}  // namespace mixlens::detail
