// What Qwen3.5's checkpoints and configs look like, shared by the families built on its block stack
// (qwen3_5.cpp: Qwen3.5; qwen3_5_moe.cpp: Qwen3.5-MoE).
#pragma once
#include <string>

#include "io/json.h"
#include "io/weights.h"
#include "mixers/gated_delta_mixer.h"

namespace mixlens::detail {

/// Layer `prefix`'s GDN input projections stored separately (in_proj_qkv [conv_dim, D], in_proj_z
/// [HV*Dv, D], in_proj_b [HV, D], in_proj_a [HV, D]) as the one [proj_rows, D] stack (views, no copy) the shared
/// block stack runs (rows q | k | v | z | b | a, GdnDims). CheckpointError on a missing tensor or a wrong shape.
ops::RowStack load_qwen3_5_gdn_in_proj(const io::WeightStore& w, const std::string& prefix, const GdnDims& g);

/// The text model's config: text_config of the published VLM config (Qwen3_5ForConditionalGeneration,
/// Qwen3_5MoeForConditionalGeneration; its errors name fields "text_config.X"), else the flat
/// text-only config itself.
io::Config qwen3_5_text_config(const io::Config& config);

}  // namespace mixlens::detail
