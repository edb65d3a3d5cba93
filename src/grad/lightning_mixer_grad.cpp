// Backward of MiniMax's lightning attention mixer (LightningMixer::forward, transformers
// MiniMaxLightningAttention): recomputed from the normed input with the recorded writes re-applied, then
//   q | k | v = silu(qkv_proj(x)) per head (padding rows zero),
//   S_t = exp(da_t) S_{t-1} + k_t v_t^T,  o_t = q_t S_t   (the SSD scan with x = v, B = k, C = q, dt = 1),
//   out = out_proj(RMSNorm(o) * sigmoid(output_gate(x))),
// differentiated through out_proj, the output gate, the norm over all heads, the scan (ssd_backward with
// the per-token log decay SsdGradArgs::da: `decays` gets the derivative through the decay alone; the
// slope is a constant, so nothing flows further), the SiLU and qkv_proj.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "grad/ops_grad.h"
#include "grad/qwen_grad.h"
#include "hooks/serve.h"
#include "mixers/ssd.h"
#include "ops/ops.h"

namespace mixlens::grad {

LightningMixerGrad::LightningMixerGrad(const detail::LightningMixer& mixer, const detail::LightningMixerWeights& w,
                                       int li, const Tensor& n, const detail::HybridCache& before, const Tape& tape)
    : w_(w), li_(li), tape_(tape) {
  const auto& d = mixer.dims();
  D_ = d.D, H_ = d.H, Dh_ = d.Dh, eps_ = d.eps;
  const Batch& in = tape.batch;
  const int64_t B = in.batch, T = in.seq, BT = B * T, D = D_, H = H_, Dh = Dh_, E = H * Dh;
  masked_ = T > 1 && in.has_padding();  // as QwenHybrid::forward passes it
  has_state_ = before.has_state;
  first_ = detail::first_real_tokens(in);
  const Tensor nm = detail::masked_input(n, in, masked_);
  qkv_ = Tensor::uninitialized({BT, 3 * E});
  ops::linear(nm.data(), BT, D, w.qkv_proj, qkv_.data());
  q_ = Tensor::uninitialized({B, T, H, Dh});
  k_ = Tensor::uninitialized({B, T, H, Dh});
  v_ = Tensor::uninitialized({B, T, H, Dh});
  for (int64_t r = 0; r < BT; ++r)  // per head [q | k | v], as the forward splits them
    for (int64_t h = 0; h < H; ++h) {
      const float* src = qkv_.data() + r * 3 * E + h * 3 * Dh;
      float* dst[3] = {q_.data() + (r * H + h) * Dh, k_.data() + (r * H + h) * Dh, v_.data() + (r * H + h) * Dh};
      for (int part = 0; part < 3; ++part)
        for (int64_t e = 0; e < Dh; ++e) dst[part][e] = ops::silu(src[part * Dh + e]);
    }
  tape.apply(li, Value::attention_queries, q_);
  tape.apply(li, Value::attention_keys, k_);
  tape.apply(li, Value::attention_values, v_);
  da_ = Tensor::uninitialized({B, T, H});
  for (int64_t r = 0; r < BT; ++r) std::memcpy(da_.data() + r * H, w.neg_slope.data(), sizeof(float) * static_cast<size_t>(H));
  tape.apply(li, Value::decays, da_);
  // The state the call starts from (served [B,H,Dk,Dv], where a state_input write applies), kernel layout.
  Tensor served({B, H, Dh, Dh});
  if (has_state_) detail::ssd_serve_state(before.ssm[static_cast<size_t>(li)].data(), B * H, Dh, Dh, served.data());
  tape.apply(li, Value::state_input, served);
  S0_ = Tensor::uninitialized({B, H, Dh, Dh});
  detail::ssd_store_state(served.data(), B * H, Dh, Dh, S0_.data());
  // The scan as the forward ran it (ssd_row_scan: each row from its first real token, its own chunk grid).
  y_ = Tensor({B, T, H, Dh});
  Tensor ones({T, H}), zeros({H}), S = S0_.clone();
  std::fill(ones.data(), ones.data() + ones.numel(), 1.0f);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t f = std::min(first_[static_cast<size_t>(b)], T), o = b * T + f;
    if (f == T) continue;
    detail::SsdArgs a;
    a.T = T - f; a.H = H; a.P = Dh; a.G = H; a.N = Dh;
    a.x = v_.data() + o * E; a.B = k_.data() + o * E; a.C = q_.data() + o * E;
    a.dt = ones.data(); a.da = da_.data() + o * H; a.A = zeros.data(); a.D = zeros.data();
    a.S = S.data() + b * H * Dh * Dh;
    a.y = y_.data() + o * E;
    a.chunk = d.chunk;
    if (tape.kernel == "chunked") detail::ssd_chunked(a); else detail::ssd_recurrent(a);
  }
  tape.apply(li, Value::attention_head_outputs, y_);
  // out_proj(norm(o) * sigmoid(output_gate(x))); the gate reads the unmasked input.
  sg_ = Tensor::uninitialized({BT, E});
  ops::linear(n.data(), BT, D, w.output_gate, sg_.data());
  ops::sigmoid(sg_.data(), sg_.data(), BT * E);
  if (const Tensor* kept = tape.kept_of(li, Kept::mixer_output)) {
    out_ = *kept;  // as the forward added it (writes applied): no norm / gate / out_proj recompute
    return;
  }
  Tensor gn = Tensor::uninitialized({BT, E});
  ops::rmsnorm(y_.data(), w.norm.data(), gn.data(), BT, E, eps_);
  for (int64_t k = 0; k < BT * E; ++k) gn[k] = sg_[k] * gn[k];
  out_ = Tensor::uninitialized({B, T, D});
  ops::linear(gn.data(), BT, E, w.out_proj, out_.data());
  tape.apply(li, Value::attention_output, out_);
}

void LightningMixerGrad::backward(const Tensor& dout_in, Tensor& dn, GradSink& sink) const {
  const Batch& in = tape_.batch;
  const int li = li_;
  const int64_t B = in.batch, T = in.seq, BT = B * T, D = D_, H = H_, Dh = Dh_, E = H * Dh;
  Tensor dout = dout_in.clone();
  sink.put(li, Value::attention_output, dout);
  tape_.block(li, Value::attention_output, dout);
  // gn = sigmoid(g) * norm(y): the gate logits' and the norm's output gradients.
  Tensor dgn = Tensor::uninitialized({BT, E}), nrm = Tensor::uninitialized({BT, E}), dg = Tensor::uninitialized({BT, E});
  linear_backward(dout.data(), BT, D, w_.out_proj, dgn.data(), false);
  ops::rmsnorm(y_.data(), w_.norm.data(), nrm.data(), BT, E, eps_);
  for (int64_t k = 0; k < BT * E; ++k) {
    dg[k] = dgn[k] * nrm[k] * sigmoid_d(sg_[k]);
    dgn[k] *= sg_[k];
  }
  Tensor dy = Tensor::uninitialized({B, T, H, Dh});
  rmsnorm_backward(y_.data(), w_.norm.data(), dgn.data(), dy.data(), BT, E, eps_, false, false);
  sink.put(li, Value::attention_head_outputs, dy);
  tape_.block(li, Value::attention_head_outputs, dy);

  // The scan, per row from its first real token (the padding before it reads and writes nothing).
  Tensor dq({B, T, H, Dh}), dk({B, T, H, Dh}), dv({B, T, H, Dh}), dda({B, T, H}), ddt({T, H}),
      dS0 = Tensor::uninitialized({B, H, Dh, Dh});
  Tensor ones({T, H}), zeros({H});
  std::fill(ones.data(), ones.data() + ones.numel(), 1.0f);
  const bool want_states = sink.wants(li, Value::states);
  Tensor dstates;
  if (want_states) dstates = Tensor({B, T, H, Dh, Dh});
  for (int64_t b = 0; b < B; ++b) {
    const int64_t f = std::min(first_[static_cast<size_t>(b)], T), o = b * T + f;
    float* ds0 = dS0.data() + b * H * Dh * Dh;
    if (f == T) {
      std::fill(ds0, ds0 + H * Dh * Dh, 0.0f);
      continue;
    }
    SsdGradArgs a;
    a.T = T - f; a.H = H; a.P = Dh; a.G = H; a.N = Dh;
    a.x = v_.data() + o * E; a.B = k_.data() + o * E; a.C = q_.data() + o * E;
    a.dt = ones.data(); a.da = da_.data() + o * H; a.A = zeros.data(); a.D = zeros.data();
    a.S0 = S0_.data() + b * H * Dh * Dh;
    a.dy = dy.data() + o * E;
    a.dx = dv.data() + o * E; a.dB = dk.data() + o * E; a.dC = dq.data() + o * E;
    a.ddt = ddt.data();  // the write strength dt = 1 is no value: its gradient is dropped
    a.ddA = dda.data() + o * H;
    a.dS0 = ds0;
    a.dstates = want_states ? dstates.data() + o * E * Dh : nullptr;
    a.chunk = 64;  // the backward's own chunk (any gives the same gradient up to rounding)
    ssd_backward(a);
    if (!want_states || f == 0) continue;
    // The left padding's states (transformers' recurrence runs through them with k = v = 0: what the first real
    // token continues from, decayed back token by token): dL/dS_{f-1} is the scan's dS0, served layout.
    float* st = dstates.data() + b * T * E * Dh;
    detail::ssd_serve_state(ds0, H, Dh, Dh, st + (f - 1) * E * Dh);
    for (int64_t t = f - 2; t >= 0; --t)
      for (int64_t h = 0; h < H; ++h) {
        const float e = std::exp(da_[(b * T + t + 1) * H + h]);
        const float* nx = st + ((t + 1) * H + h) * Dh * Dh;
        float* cur = st + (t * H + h) * Dh * Dh;
        for (int64_t k = 0; k < Dh * Dh; ++k) cur[k] = e * nx[k];
      }
  }
  if (want_states) sink.put(li, Value::states, dstates);  // SSD's served [T,H,N,P] is the served [T,H,Dk,Dv]
  // state_output feeds only the next call: this call's metric does not depend on it.
  if (sink.wants(li, Value::state_output)) sink.put(li, Value::state_output, Tensor({B, H, Dh, Dh}));
  if (has_state_ || tape_.write(li, Value::state_input)) {
    Tensor served = Tensor::uninitialized({B, H, Dh, Dh});
    detail::ssd_serve_state(dS0.data(), B * H, Dh, Dh, served.data());
    sink.put(li, Value::state_input, served);
  }
  // decays: the derivative through the decay alone (the slope is a constant: nothing flows further).
  sink.put(li, Value::decays, dda);
  for (auto [v, t] : {std::pair<Value, Tensor*>{Value::attention_queries, &dq}, {Value::attention_keys, &dk},
                      {Value::attention_values, &dv}}) {
    sink.put(li, v, *t);
    tape_.block(li, v, *t);
  }
  // Back through the SiLU into qkv_proj's rows (per head [q | k | v]).
  Tensor dqkv = Tensor::uninitialized({BT, 3 * E});
  for (int64_t r = 0; r < BT; ++r)
    for (int64_t h = 0; h < H; ++h) {
      const float* pre = qkv_.data() + r * 3 * E + h * 3 * Dh;
      float* dst = dqkv.data() + r * 3 * E + h * 3 * Dh;
      const float* src[3] = {dq.data() + (r * H + h) * Dh, dk.data() + (r * H + h) * Dh, dv.data() + (r * H + h) * Dh};
      for (int part = 0; part < 3; ++part)
        for (int64_t e = 0; e < Dh; ++e) dst[part * Dh + e] = src[part][e] * silu_grad(pre[part * Dh + e]);
    }
  linear_backward(dqkv.data(), BT, 3 * E, w_.qkv_proj, dn.data(), false);
  if (masked_) detail::apply_row_mask(dn, in);
  linear_backward(dg.data(), BT, E, w_.output_gate, dn.data(), true);
}

}  // namespace mixlens::grad
