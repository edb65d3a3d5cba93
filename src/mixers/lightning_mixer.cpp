#include "mixers/lightning_mixer.h"

#include <cmath>
#include <cstring>

#include "hooks/serve.h"
#include "mixers/ssd.h"
#include "mixlens/errors.h"
#include "ops/ops.h"

namespace mixlens::detail {

LightningMixer::LightningMixer(const LightningMixerDims& dims, const std::string& where) : d_(dims) {
  const std::pair<const char*, int64_t> sizes[] = {{"hidden_size", d_.D}, {"num_attention_heads", d_.H},
                                                   {"head_dim", d_.Dh}, {"num_hidden_layers", d_.L},
                                                   {"block_size", d_.chunk}};
  for (const auto& [name, v] : sizes)
    if (v <= 0 || v > (int64_t{1} << 32))
      throw ConfigError(where + ": lightning attention " + name + " = " + std::to_string(v) +
                        " is out of range (must be a positive size)");
}

LightningMixerWeights LightningMixer::load(const io::WeightStore& w, const std::string& p, int layer) const {
  const int64_t E = d_.H * d_.Dh;
  LightningMixerWeights l;
  l.qkv_proj = w.get_matmul(p + "qkv_proj.weight", {3 * E, d_.D});
  l.output_gate = w.get_matmul(p + "output_gate.weight", {E, d_.D});
  l.out_proj = w.get_matmul(p + "out_proj.weight", {d_.D, E});
  l.norm = w.get(p + "norm.weight", {E});
  // get_slope_rate: base ** (h + 1) in float32 (a tensor power), times the layer factor (a Python
  // float, applied in float32).
  const float base = static_cast<float>(1.0 / std::pow(2.0, 8.0 / static_cast<double>(d_.H)));
  const float factor = static_cast<float>(1.0 - static_cast<double>(layer) / (static_cast<double>(d_.L) - 1.0 + 1e-5) + 1e-5);
  l.neg_slope = Tensor({d_.H});
  for (int64_t h = 0; h < d_.H; ++h) l.neg_slope[h] = -(std::pow(base, static_cast<float>(h + 1)) * factor);
  if (w.has(p + "slope_rate")) {  // a stored buffer (save_pretrained writes it) is what transformers loads
    const Tensor sr = w.get(p + "slope_rate", {d_.H, 1, 1});
    for (int64_t h = 0; h < d_.H; ++h) l.neg_slope[h] = -sr[h];
  }
  return l;
}

void LightningMixer::values(int i, int64_t B, int64_t T, std::vector<ValueInfo>& v) const {
  const int64_t H = d_.H, Dh = d_.Dh;
  v.push_back(layer_value(i, Value::attention_queries, {B, T, H, Dh}, true, "q = silu(qkv_proj(x)) per head (padding rows zero): reads the state"));
  v.push_back(layer_value(i, Value::attention_keys, {B, T, H, Dh}, true, "k = silu(qkv_proj(x)) per head (padding rows zero): where k v^T is written"));
  v.push_back(layer_value(i, Value::attention_values, {B, T, H, Dh}, true, "v = silu(qkv_proj(x)) per head (padding rows zero)"));
  v.push_back(layer_value(i, Value::decays, {B, T, H}, true,
                          "-slope_rate per head (the same at every token): log of the state's decay per token; a write decays that token only"));
  v.push_back(layer_value(i, Value::state_input, {B, H, Dh, Dh}, true, "kv state [key, value] the call starts from; None on a fresh prompt"));
  auto s = layer_value(i, Value::states, {B, T, H, Dh, Dh}, false, "kv state after every token, key side first (computed only when asked)");
  s.writable = false;
  v.push_back(s);
  v.push_back(layer_value(i, Value::state_output, {B, H, Dh, Dh}, true, "kv state after the call's last token (goes to the cache)"));
  v.push_back(layer_value(i, Value::attention_head_outputs, {B, T, H, Dh}, true, "o = q S per head, before the RMSNorm and output gate"));
  add_mixing_values(i, B, T, H, Dh, "nothing (no skip: D = 0)", v);
  v.push_back(layer_value(i, Value::attention_output, {B, T, d_.D}, true,
                          "out_proj(norm(o) * sigmoid(output_gate(x))), before the block's linear_attn_beta_factor"));
}

Tensor LightningMixer::forward(const LightningMixerWeights& lw, const Tensor& x_in, const Batch& in, bool masked,
                               const LightningMixerCall& call) const {
  const int li = call.layer;
  Listener* ls = call.ls;
  const int64_t B = in.batch, T = in.seq, BT = B * T, D = d_.D, H = d_.H, Dh = d_.Dh, E = H * Dh;
  const Tensor xm = masked_input(x_in, in, masked);
  Tensor qkv = Tensor::uninitialized({BT, 3 * E});
  ops::linear(xm.data(), BT, D, lw.qkv_proj, qkv.data());
  // act_fn on the whole projection, then per head [q | k | v] (reshape to [.., H, 3 Dh], split).
  Tensor q = Tensor::uninitialized({B, T, H, Dh}), k = Tensor::uninitialized({B, T, H, Dh}), v = Tensor::uninitialized({B, T, H, Dh});
  ops::parallel_rows(BT, 3 * E, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t h = 0; h < H; ++h) {
        const float* src = qkv.data() + r * 3 * E + h * 3 * Dh;
        float* dst[3] = {q.data() + (r * H + h) * Dh, k.data() + (r * H + h) * Dh, v.data() + (r * H + h) * Dh};
        for (int part = 0; part < 3; ++part)
          for (int64_t e = 0; e < Dh; ++e) dst[part][e] = ops::silu(src[part * Dh + e]);
      }
  });
  visit_if(ls, li, Value::attention_queries, q);
  visit_if(ls, li, Value::attention_keys, k);
  visit_if(ls, li, Value::attention_values, v);
  Tensor da = Tensor::uninitialized({B, T, H});
  for (int64_t r = 0; r < BT; ++r) std::memcpy(da.data() + r * H, lw.neg_slope.data(), sizeof(float) * static_cast<size_t>(H));
  visit_if(ls, li, Value::decays, da);

  Tensor& S = *call.ssm;
  const auto serve = [&](const Tensor& s) {
    Tensor o = Tensor::uninitialized({s.size(0), H, Dh, Dh});
    ssd_serve_state(s.data(), s.size(0) * H, Dh, Dh, o.data());
    return o;
  };
  const auto store = [&](const Tensor& o, Tensor& s) { ssd_store_state(o.data(), s.size(0) * H, Dh, Dh, s.data()); };
  visit_state_input(li, S, call.has_state, ls, Shape{H, Dh, Dh}, serve, store);

  // SSD with x = v, B = k, C = q (one group per head), dt = 1 (x unscaled), D = 0, da = the decays.
  Tensor ones({B, T, H}), zeros({H}), y = Tensor::uninitialized({B, T, H, Dh});
  for (int64_t e = 0; e < ones.numel(); ++e) ones[e] = 1.0f;
  SsdBatch sb;
  sb.B = B; sb.T = T; sb.H = H; sb.P = Dh; sb.G = H; sb.N = Dh; sb.chunk = d_.chunk; sb.chunked = call.chunked;
  sb.x = v.data(); sb.Bm = k.data(); sb.C = q.data(); sb.dt = ones.data(); sb.da = da.data();
  sb.A = zeros.data(); sb.D = zeros.data(); sb.S = S.data(); sb.y = y.data();
  RowScan rs = ssd_row_scan(sb, first_real_tokens(in));
  Tensor states = scan_rows(ls, li, rs, {B, T, H, Dh, Dh});
  if (states.defined()) {
    ls->visit(li, Value::states, states, states.shape());
    ls->recycle_stack(std::move(states));
  }
  visit_state_output(li, S, ls, serve, store);
  visit_if(ls, li, Value::attention_head_outputs, y);
  visit_mixing(ls, li, B, T, H, Dh, [&](const MixBlock& blk, float* M, float* Sin) { ssd_token_mixing(sb, rs.first, blk, M, Sin); });

  // norm (over all heads) * sigmoid(output_gate(x)), then out_proj.
  Tensor g = Tensor::uninitialized({BT, E}), out = Tensor::uninitialized({B, T, D});
  ops::linear(x_in.data(), BT, D, lw.output_gate, g.data());
  ops::parallel_rows(BT, E, [&](int64_t r0, int64_t r1) {
    Tensor nrm = Tensor::uninitialized({E});
    for (int64_t r = r0; r < r1; ++r) {
      ops::rmsnorm(y.data() + r * E, lw.norm.data(), nrm.data(), 1, E, d_.eps);
      float* gr = g.data() + r * E;
      for (int64_t e = 0; e < E; ++e) gr[e] = ops::sigmoid(gr[e]) * nrm[e];
    }
  });
  ops::linear(g.data(), BT, E, lw.out_proj, out.data());
  visit_if(ls, li, Value::attention_output, out);
  return out;
}

}  // namespace mixlens::detail
