// Mamba-2 (Mamba2ForCausalLM, model_type "mamba2"): pre-norm residual blocks around the SSD mixer
// (src/mixers/mamba2_mixer.*, shared with the Mamba-2 hybrids).
// Reference: transformers models/mamba2/modeling_mamba2.py (Mamba2Mixer.torch_forward, Mamba2Block,
// Mamba2Model, Mamba2ForCausalLM); math in shared/spec/model-math.md §3.2.
#include "mixers/mamba2_mixer.h"
#include "mixlens/errors.h"
#include "models/common.h"
#include "models/config.h"
#include "models/registry.h"
#include "models/ssm_lm.h"

namespace mixlens::detail {

namespace {

// SSM state: kernel layout [B, H, P, N] (as transformers), served as [B, H, N, P].
class Mamba2Model final : public SsmLm {
 public:
  Mamba2Model(const io::Config& cfg, const io::WeightStore& w) {
    load_backbone(cfg, w, "mamba2", false);
    Mamba2MixerDims d;
    d.D = D_;
    d.N = cfg.get<int64_t>("state_size");
    d.G = cfg.get<int64_t>("n_groups");
    d.H = cfg.get<int64_t>("num_heads");
    d.P = cfg.get<int64_t>("head_dim");
    d.K = K_;
    d.eps = eps_;
    const double expand = cfg.get_double("expand");
    d.E = static_cast<int64_t>(expand * static_cast<double>(D_));
    config_chunk_ = cfg.get_or<int64_t>("chunk_size", 256);
    d.chunk = config_chunk_;
    require_positive(cfg, {{"state_size", d.N}, {"n_groups", d.G}, {"num_heads", d.H}, {"head_dim", d.P},
                           {"chunk_size", d.chunk}});
    if (d.E != d.H * d.P)
      throw ConfigError(where(cfg) + ": hidden_size * expand (" + std::to_string(d.E) +
                        ") must equal num_heads * head_dim (" + std::to_string(d.H * d.P) + ")");
    // Absent: Mamba2Config's default (0, inf), no clamp; null is refused, as Mamba2Config's strict
    // field (a list or tuple, not Optional) refuses it.
    read_time_step_limit(cfg, d, false);
    d.norm = Mamba2Norm::gated_full;  // MambaRMSNormGated ignores n_groups
    d.in_proj_bias = d.out_proj_bias = cfg.get_or<bool>("use_bias", false);
    d.conv_bias = cfg.get_or<bool>("use_conv_bias", true);
    mixer_ = Mamba2Mixer(d, where(cfg));
    for (int64_t i = 0; i < L_; ++i)
      layers_.push_back(mixer_.load(w, "backbone.layers." + std::to_string(i) + ".mixer."));
    info.layer_kinds.assign(static_cast<size_t>(L_), LayerKind::mamba2);
  }

  void set_chunk_size(int64_t c) override { mixer_.set_chunk(c > 0 ? c : config_chunk_); }
  Tensor betas_for_decays(int li, const Tensor& betas_before, const Tensor& decays) const override {
    return mixer_.betas_for_decays(layers_[static_cast<size_t>(li)], betas_before, decays);
  }
  MixerConsts mixer_consts(int li) const override { return {layers_[static_cast<size_t>(li)].D, {}, {}, {}}; }

  // Gradients (src/grad/ssm_lm_grad.cpp and src/grad/mamba2_mixer_grad.cpp, docs/gradients.md).
  std::unique_ptr<BackwardParts> backward_parts() const override {
    auto p = backbone_parts();
    p->mamba2 = &mixer_;
    p->mamba2_layers = &layers_;
    return p;
  }

 private:
  int64_t conv_channels() const override { return mixer_.dims().conv_dim(); }
  Shape ssm_state_shape() const override { return mixer_.state_shape(); }
  Shape served_state_shape() const override { return mixer_.served_state_shape(); }
  Tensor served_state(const Tensor& S) const override { return mixer_.served_state(S); }
  void store_served_state(const Tensor& o, Tensor& S) const override { mixer_.store_served_state(o, S); }

  void mixer_values(int i, int64_t B, int64_t T, std::vector<ValueInfo>& v) const override { mixer_.values(i, B, T, v); }

  Tensor mixer(int li, const Tensor& n, const Batch& in, SsmCache& cache, Listener* ls,
               const CallCtx& ctx) const override {
    Mamba2MixerCall call;
    call.layer = li;
    call.conv = &cache.conv[static_cast<size_t>(li)];
    call.ssm = &cache.ssm[static_cast<size_t>(li)];
    call.has_state = cache.has_state;
    call.chunked = ctx.kernel == "chunked";
    call.ls = ls;
    call.tape = ctx.tape;
    return mixer_.forward(layers_[static_cast<size_t>(li)], n, in, call);
  }

  Mamba2Mixer mixer_;
  int64_t config_chunk_ = 256;
  std::vector<Mamba2MixerWeights> layers_;
};

}  // namespace

std::unique_ptr<FamilyModel> make_mamba2(const io::Config& config, const io::WeightStore& weights) {
  return std::make_unique<Mamba2Model>(config, weights);
}

}  // namespace mixlens::detail
