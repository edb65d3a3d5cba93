// Qwen3.5 (model_type "qwen3_5": the published Qwen3_5ForConditionalGeneration checkpoints, text
// weights under model.language_model.*, vision tower and mtp.* ignored; "qwen3_5_text": text-only
// Qwen3_5ForCausalLM, model.*). The block stack is shared with Qwen3-Next (qwen_hybrid.cpp);
// this file only reads the separate GDN projections in_proj_qkv / in_proj_z / in_proj_b / in_proj_a.
#include "models/qwen3_5.h"

#include "models/common.h"
#include "models/qwen_hybrid.h"
#include "models/registry.h"
#include "ops/ops.h"

namespace mixlens::detail {

ops::RowStack load_qwen3_5_gdn_in_proj(const io::WeightStore& w, const std::string& p, const GdnDims& g) {
  return ops::RowStack({w.get_matmul(p + "in_proj_qkv.weight", {g.conv_dim(), g.D}), w.get_matmul(p + "in_proj_z.weight", {g.value_dim(), g.D}),
                   w.get_matmul(p + "in_proj_b.weight", {g.HV, g.D}), w.get_matmul(p + "in_proj_a.weight", {g.HV, g.D})});
}

io::Config qwen3_5_text_config(const io::Config& config) {
  // The VLM config nests the text model in text_config; the text-only config is flat.
  if (config.has("text_config") && !config.is_null("text_config")) return config.sub("text_config");
  return config;
}

std::unique_ptr<FamilyModel> make_qwen3_5(const io::Config& config, const io::WeightStore& weights) {
  return make_qwen_hybrid(QwenHybridSpec{"qwen3_5", load_qwen3_5_gdn_in_proj}, config, qwen3_5_text_config(config),
                          weights);
}

}  // namespace mixlens::detail
