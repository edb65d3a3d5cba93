// FalconMamba (FalconMambaForCausalLM, model_type "falcon_mamba"): Mamba-1 (models/mamba.cpp, the
// same layout, config fields and weight names) with weightless RMS norms on x_proj's outputs
// dt_low, B and C inside the mixer, eps mixer_rms_eps (default 1e-6). Reference: transformers 5.18
// models/falcon_mamba/modeling_falcon_mamba.py (FalconMambaMixer.forward, FalconMambaWeightlessRMSNorm).
// The norms' weights are non-persistent buffers of ones in transformers: no checkpoint stores them.
// attention_keys / attention_queries are B / C after the norm (what the scan reads); betas is
// softplus(dt_proj(rmsnorm(dt_low)) + bias).
#include "models/mamba.h"
#include "models/registry.h"

namespace mixlens::detail {

std::unique_ptr<FamilyModel> make_falcon_mamba(const io::Config& config, const io::WeightStore& weights) {
  MambaMixerDims options;
  options.bcdt_rms_norm = true;
  // validate_config has checked every *eps* field: finite and > 0.
  options.mixer_rms_eps = static_cast<float>(config.get_double_or("mixer_rms_eps", 1e-6));
  return make_mamba_lm(config, weights, "falcon_mamba", options);
}

}  // namespace mixlens::detail
