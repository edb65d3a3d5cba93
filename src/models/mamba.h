// The Mamba-1 language model (MambaForCausalLM's layout: backbone.embeddings, backbone.layers.{i}.norm
// / .mixer, backbone.norm_f, lm_head) on the SsmLm skeleton, shared by the families that differ only
// in mixer options (mamba.cpp: Mamba-1; falcon_mamba.cpp: FalconMamba's B/C/dt norms).
#pragma once
#include <memory>
#include <string>

#include "io/json.h"
#include "io/weights.h"
#include "mixers/mamba_mixer.h"
#include "models/family.h"

namespace mixlens::detail {

/// Reads the sizes every Mamba-1 config has (hidden_size, state_size, expand, time_step_rank,
/// conv_kernel, use_bias, use_conv_bias, ...) and loads the weights; `family` names the family
/// (route_kernels, messages) and `options` carries the mixer options the family sets (its size
/// fields are ignored). ConfigError / CheckpointError as the fields and tensors require.
std::unique_ptr<FamilyModel> make_mamba_lm(const io::Config& config, const io::WeightStore& weights,
                                           const std::string& family, const MambaMixerDims& options);

}  // namespace mixlens::detail
