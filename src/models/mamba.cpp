// Mamba-1 (MambaForCausalLM, model_type "mamba"): pre-norm residual blocks around the selective
// scan mixer (src/mixers/mamba_mixer.*). Reference: transformers 5.18 models/mamba/modeling_mamba.py (MambaMixer.forward,
// mamba_selective_scan, mamba_selective_state_update); math in shared/spec/model-math.md §3.1.
//
// Where transformers 5.18 and model-math.md differ, this follows transformers:
// - the padding mask multiplies the mixer input (before in_proj) and the conv output; the spec
//   says "x before the conv", which differs only when in_proj has a bias;
// - the mask is applied whenever the batch has padding (no "batch > 1 and seq > 1" rule).
// One deliberate exception: a multi-token call over a cached state (continuation) scans from the
// cached SSM state. transformers 5.18 keeps the conv context there but restarts the scan from
// zero (mamba_selective_scan takes no initial state), which breaks values.md's invariant
// "prefix + continuation == whole prompt"; decode steps (one token) agree with it exactly.
#include <string>

#include "models/mamba.h"

#include "mixers/mamba_mixer.h"
#include "mixlens/errors.h"
#include "models/common.h"
#include "models/config.h"
#include "models/registry.h"
#include "models/ssm_lm.h"

namespace mixlens::detail {

namespace {

// SSM state: [B, E, N] in the kernel, the cache and the served values (values.md Mamba-1 column).
class MambaModel final : public SsmLm {
 public:
  MambaModel(const io::Config& cfg, const io::WeightStore& w, const std::string& family, const MambaMixerDims& opts) {
    load_backbone(cfg, w, family, true);
    N_ = cfg.get<int64_t>("state_size");
    // MambaConfig / FalconMambaConfig.__post_init__: intermediate_size = int(expand * hidden_size),
    // then PreTrainedConfig sets the file's other keys over it, so a stored intermediate_size wins
    // (falcon-mamba-7b stores expand 16 next to intermediate_size 8192 = 2 * hidden_size);
    // time_step_rank "auto" = ceil(hidden_size / 16).
    E_ = cfg.get_or<int64_t>("intermediate_size",
                             static_cast<int64_t>(cfg.get_double_or("expand", 2.0) * static_cast<double>(D_)));
    R_ = read_dt_rank(cfg, "time_step_rank", D_);
    require_positive(cfg, {{"state_size", N_}, {"intermediate_size (else expand * hidden_size)", E_}, {"time_step_rank", R_}});
    const bool use_bias = cfg.get_or<bool>("use_bias", false);
    const bool use_conv_bias = cfg.get_or<bool>("use_conv_bias", true);
    MambaMixerDims dims = opts;
    dims.D = D_, dims.E = E_, dims.N = N_, dims.R = R_, dims.K = K_;
    dims.use_bias = use_bias, dims.use_conv_bias = use_conv_bias;
    mixer_ = MambaMixer(dims);
    for (int64_t i = 0; i < L_; ++i)
      layers_.push_back(mixer_.load(w, "backbone.layers." + std::to_string(i) + ".mixer."));
    info.layer_kinds.assign(static_cast<size_t>(L_), LayerKind::mamba);
  }

  /// The chunked scan's chunk length (0 restores the default). It changes no value beyond float
  /// rounding; tests use short chunks to cover the carry between chunks.
  void set_chunk_size(int64_t c) override { mixer_.set_chunk(c); }

  // Gradients (src/grad/ssm_lm_grad.cpp and src/grad/mamba_mixer_grad.cpp, docs/gradients.md).
  std::unique_ptr<BackwardParts> backward_parts() const override {
    auto p = backbone_parts();
    p->mamba = &mixer_;
    p->mamba_layers = &layers_;
    return p;
  }

 private:
  int64_t conv_channels() const override { return E_; }
  Shape ssm_state_shape() const override { return {E_, N_}; }

  // The token loop parallelizes over channel blocks; the chunked scan adds parallelism over time
  // at about twice the exp work. It only pays off when channel blocks cannot occupy the threads
  // (small models) and the prompt spans several chunks.
  std::string prompt_kernel(int64_t seq) const override { return mixer_.prompt_kernel(seq); }

  void mixer_values(int i, int64_t B, int64_t T, std::vector<ValueInfo>& v) const override { mixer_.values(i, B, T, v); }

  Tensor mixer(int li, const Tensor& n, const Batch& in, SsmCache& cache, Listener* ls,
               const CallCtx& ctx) const override {
    MambaMixerCall call;
    call.layer = li;
    call.conv = &cache.conv[static_cast<size_t>(li)];
    call.chunked = ctx.kernel == "chunked";
    call.ls = ls;
    call.begin_state = [&]() -> Tensor& { return begin_state(li, cache, ls); };
    call.end_state = [&] { end_state(li, cache, ls); };
    return mixer_.forward(layers_[static_cast<size_t>(li)], n, in, call);
  }

  Tensor betas_for_decays(int li, const Tensor& betas_before, const Tensor& dec) const override {
    return mixer_.betas_for_decays(li, layers_[static_cast<size_t>(li)], betas_before, dec);
  }
  MixerConsts mixer_consts(int li) const override { return {layers_[static_cast<size_t>(li)].D, {}, {}, {}}; }

  int64_t N_ = 0, E_ = 0, R_ = 0;
  MambaMixer mixer_;
  std::vector<MambaMixerWeights> layers_;
};

}  // namespace

std::unique_ptr<FamilyModel> make_mamba_lm(const io::Config& config, const io::WeightStore& weights,
                                           const std::string& family, const MambaMixerDims& options) {
  return std::make_unique<MambaModel>(config, weights, family, options);
}

std::unique_ptr<FamilyModel> make_mamba(const io::Config& config, const io::WeightStore& weights) {
  return make_mamba_lm(config, weights, "mamba", MambaMixerDims{});
}

}  // namespace mixlens::detail
