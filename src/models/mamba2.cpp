// Mamba-2 (Mamba2ForCausalLM, model_type "mamba2"): pre-norm residual blocks around the SSD mixer.
// Reference: transformers models/mamba2/modeling_mamba2.py (Mamba2Mixer.torch_forward, Mamba2Block,
// Mamba2Model, Mamba2ForCausalLM); math in shared/spec/model-math.md §3.2.
#include <cmath>
#include <cstring>
#include <limits>

#include "mixers/ssd.h"
#include "mixlens/errors.h"
#include "models/common.h"
#include "models/family.h"
#include "models/ssm_lm.h"
#include "ops/ops.h"

namespace mixlens::detail {

namespace {

struct Mamba2Layer {
  Tensor in_proj;       // [E + conv_dim + H, D]
  Tensor in_proj_bias;  // optional
  Tensor conv_wT;       // [K, conv_dim] (transposed from [conv_dim, 1, K] for channel-vector loops)
  Tensor conv_bias;     // [conv_dim] (zeros when use_conv_bias is false)
  Tensor dt_bias, A, D; // [H]; A = -exp(A_log)
  Tensor gnorm;         // [E] gated RMSNorm weight
  Tensor out_proj;      // [D, E]
  Tensor out_proj_bias; // optional
};

// SSM state: kernel layout [B, H, P, N] (as transformers), served as [B, H, N, P].
class Mamba2Model final : public SsmLm {
 public:
  Mamba2Model(const io::Config& cfg, const io::WeightStore& w) {
    load_backbone(cfg, w, "mamba2", false);
    N_ = cfg.get<int64_t>("state_size");
    G_ = cfg.get<int64_t>("n_groups");
    H_ = cfg.get<int64_t>("num_heads");
    P_ = cfg.get<int64_t>("head_dim");
    const double expand = cfg.get_double("expand");
    E_ = static_cast<int64_t>(expand * static_cast<double>(D_));
    config_chunk_ = cfg.get_or<int64_t>("chunk_size", 256);
    chunk_ = config_chunk_;
    require_positive(cfg, {{"state_size", N_}, {"n_groups", G_}, {"num_heads", H_}, {"head_dim", P_},
                           {"chunk_size", chunk_}});
    if (E_ != H_ * P_)
      throw ConfigError(where(cfg) + ": hidden_size * expand (" + std::to_string(E_) +
                        ") must equal num_heads * head_dim (" + std::to_string(H_ * P_) + ")");
    if (H_ % G_ != 0)
      throw ConfigError(where(cfg) + ": num_heads (" + std::to_string(H_) + ") is not divisible by n_groups (" +
                        std::to_string(G_) + ")");
    conv_dim_ = E_ + 2 * G_ * N_;
    dt_lo_ = 0.0f;
    dt_hi_ = std::numeric_limits<float>::infinity();
    if (cfg.has("time_step_limit")) {
      auto lim = cfg.get<std::vector<double>>("time_step_limit");
      if (lim.size() != 2) throw ConfigError(where(cfg) + ": time_step_limit must have 2 entries");
      dt_lo_ = static_cast<float>(lim[0]);
      dt_hi_ = static_cast<float>(lim[1]);
      if (!(dt_lo_ >= 0.0f && dt_lo_ <= dt_hi_))
        throw ConfigError(where(cfg) + ": time_step_limit [" + std::to_string(lim[0]) + ", " + std::to_string(lim[1]) +
                          "] must satisfy 0 <= min <= max");
    }
    const bool use_bias = cfg.get_or<bool>("use_bias", false);
    const bool use_conv_bias = cfg.get_or<bool>("use_conv_bias", true);
    const int64_t proj = E_ + conv_dim_ + H_;
    layers_.resize(static_cast<size_t>(L_));
    for (int64_t i = 0; i < L_; ++i) {
      const std::string p = "backbone.layers." + std::to_string(i) + ".";
      Mamba2Layer& l = layers_[static_cast<size_t>(i)];
      l.in_proj = w.get(p + "mixer.in_proj.weight", {proj, D_});
      if (use_bias) l.in_proj_bias = w.get(p + "mixer.in_proj.bias", {proj});
      l.conv_wT = transpose_conv(w.get(p + "mixer.conv1d.weight", {conv_dim_, 1, K_}));
      l.conv_bias = use_conv_bias ? w.get(p + "mixer.conv1d.bias", {conv_dim_}) : Tensor({conv_dim_});
      l.dt_bias = w.get(p + "mixer.dt_bias", {H_});
      const Tensor A_log = w.get(p + "mixer.A_log", {H_});
      l.A = Tensor({H_});
      for (int64_t h = 0; h < H_; ++h) l.A[h] = -std::exp(A_log[h]);
      l.D = w.get(p + "mixer.D", {H_});
      l.gnorm = w.get(p + "mixer.norm.weight", {E_});
      l.out_proj = w.get(p + "mixer.out_proj.weight", {D_, E_});
      if (use_bias) l.out_proj_bias = w.get(p + "mixer.out_proj.bias", {D_});
    }
    info.layer_kinds.assign(static_cast<size_t>(L_), LayerKind::mamba2);
  }

  void set_chunk_size(int64_t c) override { chunk_ = c > 0 ? c : config_chunk_; }

 private:
  int64_t conv_channels() const override { return conv_dim_; }
  Shape ssm_state_shape() const override { return {H_, P_, N_}; }
  Shape served_state_shape() const override { return {H_, N_, P_}; }

  void mixer_values(int i, int64_t B, int64_t T, std::vector<ValueInfo>& v) const override {
    v.push_back(layer_value(i, Value::attention_queries, {B, T, G_, N_}, true, "C after conv+SiLU and padding mask, as mamba2_chunk_scan receives it"));
    v.push_back(layer_value(i, Value::attention_keys, {B, T, G_, N_}, true, "B after conv+SiLU and padding mask"));
    v.push_back(layer_value(i, Value::attention_values, {B, T, H_, P_}, true, "x after conv+SiLU and padding mask"));
    v.push_back(layer_value(i, Value::betas, {B, T, H_}, true, "dt = softplus(dt + dt_bias), time_step_limit clamp on prompts; write >= 0"));
    v.push_back(layer_value(i, Value::decays, {B, T, H_}, true, "A*dt (A = -exp(A_log)); writing it writes dt = decays / A"));
    v.push_back(layer_value(i, Value::state_input, {B, H_, N_, P_}, true, "SSM state the call starts from, key side first; None on a fresh prompt"));
    auto st = layer_value(i, Value::state, {B, H_, N_, P_}, true, "SSM state after token t (path suffix @t<t>); a write is where the scan resumes");
    st.per_token = false;
    v.push_back(st);
    auto s = layer_value(i, Value::states, {B, T, H_, N_, P_}, false, "SSM state after every token, key side first (computed only when asked)");
    s.writable = false;
    v.push_back(s);
    v.push_back(layer_value(i, Value::state_output, {B, H_, N_, P_}, true, "SSM state after the call's last token (goes to the cache)"));
    v.push_back(layer_value(i, Value::attention_head_outputs, {B, T, H_, P_}, true, "y = C.S + D*x per head, before the gated norm"));
    v.push_back(layer_value(i, Value::attention_output, {B, T, D_}, true, "out_proj(gated RMSNorm(y, z)), added to the residual"));
  }

  Tensor mixer(int li, const Tensor& n_in, const Batch& in, SsmCache& cache, Listener* ls,
               const CallCtx& ctx) const override {
    const Mamba2Layer& lw = layers_[static_cast<size_t>(li)];
    const int64_t B = in.batch, T = in.seq, BT = B * T;
    // transformers' create_recurrent_attention_mask: no mask for one-token calls or no padding.
    const bool masked = T > 1 && in.has_padding();
    const bool decode = cache.has_state && T == 1;
    const int64_t proj = E_ + conv_dim_ + H_;
    const float* n = n_in.data();
    Tensor nm;
    if (masked) {  // apply_mask_to_padding_states on the mixer input
      nm = n_in.clone();
      apply_row_mask(nm, in);
      n = nm.data();
    }
    Tensor zxbcdt({B, T, proj});
    ops::linear(n, BT, D_, lw.in_proj, zxbcdt.data(), lw.in_proj_bias.defined() ? lw.in_proj_bias.data() : nullptr);

    // Causal depthwise conv over xBC with the cached K inputs as left context, then SiLU.
    Tensor xbc({B, T, conv_dim_});
    Tensor& conv_state = cache.conv[static_cast<size_t>(li)];
    ops::causal_conv1d(zxbcdt.data() + E_, proj, B, T, conv_dim_, K_, lw.conv_wT.data(), lw.conv_bias.data(),
                       conv_state.data(), xbc.data(), true);
    if (masked) apply_row_mask(xbc, in);

    Tensor x({B, T, H_, P_}), Bm({B, T, G_, N_}), Cm({B, T, G_, N_});
    for (int64_t r = 0; r < BT; ++r) {
      const float* src = xbc.data() + r * conv_dim_;
      std::memcpy(x.data() + r * E_, src, sizeof(float) * static_cast<size_t>(E_));
      std::memcpy(Bm.data() + r * G_ * N_, src + E_, sizeof(float) * static_cast<size_t>(G_ * N_));
      std::memcpy(Cm.data() + r * G_ * N_, src + E_ + G_ * N_, sizeof(float) * static_cast<size_t>(G_ * N_));
    }
    visit_if(ls, li, Value::attention_queries, Cm);
    visit_if(ls, li, Value::attention_keys, Bm);
    visit_if(ls, li, Value::attention_values, x);

    // dt = softplus(dt_raw + dt_bias); the time_step_limit clamp is applied on prompt /
    // continuation calls only: the reference decode update (selective_state_update) has none.
    Tensor dt({B, T, H_});
    for (int64_t r = 0; r < BT; ++r)
      for (int64_t hh = 0; hh < H_; ++hh) {
        float v = ops::softplus(zxbcdt[r * proj + E_ + conv_dim_ + hh] + lw.dt_bias[hh]);
        if (!decode) v = std::min(std::max(v, dt_lo_), dt_hi_);
        dt[r * H_ + hh] = v;
      }
    visit_if(ls, li, Value::betas, dt);
    if (ls && ls->wants(li, Value::decays)) {
      // decays and betas are two views of one dt (values.md): a decays write sets dt = decays / A.
      Tensor dec({B, T, H_});
      for (int64_t r = 0; r < BT; ++r)
        for (int64_t hh = 0; hh < H_; ++hh) dec[r * H_ + hh] = lw.A[hh] * dt[r * H_ + hh];
      if (ls->visit(li, Value::decays, dec, dec.shape()))
        for (int64_t r = 0; r < BT; ++r)
          for (int64_t hh = 0; hh < H_; ++hh) dt[r * H_ + hh] = dec[r * H_ + hh] / lw.A[hh];
    }

    Tensor& S = begin_state(li, cache, ls);

    Tensor y({B, T, H_, P_});
    Tensor states;
    if (ls && ls->wants(li, Value::states)) states = Tensor({B, T, H_, N_, P_});
    const bool chunked = ctx.kernel == "chunked";
    // Tokens [t0, t1) of every row; the scan stops where the per-token state is wanted.
    auto run = [&](int64_t t0, int64_t t1) {
      for (int64_t b = 0; b < B; ++b) {
        SsdArgs a;
        a.T = t1 - t0; a.H = H_; a.P = P_; a.G = G_; a.N = N_;
        a.x = x.data() + (b * T + t0) * E_;
        a.B = Bm.data() + (b * T + t0) * G_ * N_;
        a.C = Cm.data() + (b * T + t0) * G_ * N_;
        a.dt = dt.data() + (b * T + t0) * H_;
        a.A = lw.A.data();
        a.D = lw.D.data();
        a.S = S.data() + b * H_ * P_ * N_;
        a.y = y.data() + (b * T + t0) * E_;
        a.states = states.defined() ? states.data() + (b * T + t0) * H_ * N_ * P_ : nullptr;
        a.chunk = chunk_;
        if (chunked) ssd_chunked(a); else ssd_recurrent(a);
      }
    };
    scan_with_stops(ls, li, T, run, [&](int64_t t) { serve_state_at(li, t, cache, ls, states); });
    if (states.defined()) ls->visit(li, Value::states, states, states.shape());
    end_state(li, cache, ls);
    visit_if(ls, li, Value::attention_head_outputs, y);

    // MambaRMSNormGated: gate before norm, over the full E width (transformers ignores n_groups).
    Tensor g({B, T, E_});
    for (int64_t k = 0; k < BT * E_; ++k) {
      const int64_t r = k / E_, e = k % E_;
      g[k] = y[k] * ops::silu(zxbcdt[r * proj + e]);
    }
    ops::rmsnorm(g.data(), lw.gnorm.data(), g.data(), BT, E_, eps_);
    Tensor out({B, T, D_});
    ops::linear(g.data(), BT, E_, lw.out_proj, out.data(), lw.out_proj_bias.defined() ? lw.out_proj_bias.data() : nullptr);
    visit_if(ls, li, Value::attention_output, out);
    return out;
  }

  // [B,H,P,N] kernel layout <-> [B,H,N,P] served layout (key side first).
  Tensor served_state(const Tensor& S) const override {
    Tensor o({S.size(0), H_, N_, P_});
    for (int64_t bh = 0; bh < S.size(0) * H_; ++bh)
      for (int64_t p = 0; p < P_; ++p)
        for (int64_t nn = 0; nn < N_; ++nn) o[(bh * N_ + nn) * P_ + p] = S[(bh * P_ + p) * N_ + nn];
    return o;
  }
  void store_served_state(const Tensor& o, Tensor& S) const override {
    for (int64_t bh = 0; bh < S.size(0) * H_; ++bh)
      for (int64_t p = 0; p < P_; ++p)
        for (int64_t nn = 0; nn < N_; ++nn) S[(bh * P_ + p) * N_ + nn] = o[(bh * N_ + nn) * P_ + p];
  }

  int64_t N_, G_, H_, P_, E_, conv_dim_, chunk_, config_chunk_;
  float dt_lo_, dt_hi_;
  std::vector<Mamba2Layer> layers_;
};

}  // namespace

std::unique_ptr<FamilyModel> make_mamba2(const io::Config& config, const io::WeightStore& weights) {
  return std::make_unique<Mamba2Model>(config, weights);
}

}  // namespace mixlens::detail
