// RgLruMixerGrad (grad/rg_lru_grad.h): the recompute mirrors RgLruMixer::forward (values in its serve
// order: state_input, attention_values, betas, decays, attention_head_outputs, attention_output).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "grad/ops_grad.h"
#include "grad/rg_lru_grad.h"
#include "hooks/serve.h"
#include "mixlens/errors.h"
#include "ops/ops.h"

namespace mixlens::grad {

RgLruMixerGrad::RgLruMixerGrad(const detail::RgLruMixer& mixer, const detail::RgLruMixerWeights& w, int layer,
                               const Tensor& n, const RgLruCallState& call, const Tape& tape)
    : d_(mixer.dims()), w_(w), li_(layer), tape_(tape), call_(call) {
  if (!tape.unsupported.empty()) throw UnsupportedError("backward: " + tape.unsupported);
  const Batch& in = tape.batch;
  const int64_t B = in.batch, T = in.seq, BT = B * T, D = d_.D, W = d_.W, H = d_.H, bw = W / H, K = d_.K;
  first_ = detail::first_real_tokens(in);
  Tensor xb({B, T, W});
  yl_ = Tensor({B, T, W});
  y_ = Tensor({B, T, W});
  ops::linear(n.data(), BT, D, w.linear_x, xb.data(), w.x_bias.data());
  ops::linear(n.data(), BT, D, w.linear_y, yl_.data(), w.y_bias.data());
  for (int64_t e = 0; e < BT * W; ++e) y_[e] = ops::gelu_tanh(yl_[e]);
  if (in.has_padding()) detail::apply_row_mask(xb, in);
  S0_ = Tensor({B, K, W});
  if (call.has_state) S0_ = call.S0->clone();
  tape.apply(li_, Value::state_input, S0_);
  u_ = Tensor({B, T, W});
  ig0_ = Tensor({B, T, W});
  r_ = Tensor({B, T, W});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t r = b * T + t;
      // ext = window (K-1 rows) ++ the row's inputs from its first real token (the scan's window: padding
      // pushes nothing), so a window written on a padded row reaches the first real tokens as in the forward.
      const int64_t f = std::min(first_[static_cast<size_t>(b)], t);
      for (int64_t c = 0; c < W; ++c) {
        float s = 0.0f;
        for (int64_t j = 0; j < K; ++j) {
          const int64_t e = t - f + j;
          const float v = e < K - 1 ? S0_[(b * K + e) * W + c] : xb[(b * T + f + e - (K - 1)) * W + c];
          s += w.conv_wT[j * W + c] * v;
        }
        u_[r * W + c] = s + w.conv_bias[c];
      }
      for (int64_t h = 0; h < H; ++h)
        for (int64_t j = 0; j < bw; ++j) {
          float si = w.in_gate_b[h * bw + j], sr = w.rec_gate_b[h * bw + j];
          for (int64_t k = 0; k < bw; ++k) {
            const float uk = u_[r * W + h * bw + k];
            si += uk * w.in_gate_w[(h * bw + k) * bw + j];
            sr += uk * w.rec_gate_w[(h * bw + k) * bw + j];
          }
          ig0_[r * W + h * bw + j] = ops::sigmoid(si);
          r_[r * W + h * bw + j] = ops::sigmoid(sr);
        }
    }
  uw_ = u_.clone();
  tape.apply(li_, Value::attention_values, uw_);
  ig_ = ig0_.clone();
  tape.apply(li_, Value::betas, ig_);
  la_ = Tensor({B, T, W});
  for (int64_t e = 0; e < BT * W; ++e) la_[e] = w.log_a_scale[e % W] * r_[e];
  tape.apply(li_, Value::decays, la_);
  hs_ = Tensor({B, T, W});
  for (int64_t b = 0; b < B; ++b) {
    std::vector<float> h(S0_.data() + (b * K + K - 1) * W, S0_.data() + (b * K + K) * W);
    for (int64_t t = first_[static_cast<size_t>(b)]; t < T; ++t) {
      const int64_t r = b * T + t;
      const bool reset = (*call.pos)[static_cast<size_t>(r)] == 0;
      for (int64_t c = 0; c < W; ++c) {
        const float lg = la_[r * W + c];
        const float a = reset ? 0.0f : std::exp(lg), m = reset ? 1.0f : std::sqrt(1.0f - std::exp(2.0f * lg));
        h[static_cast<size_t>(c)] = a * h[static_cast<size_t>(c)] + uw_[r * W + c] * ig_[r * W + c] * m;
        hs_[r * W + c] = h[static_cast<size_t>(c)];
      }
    }
  }
  tape.apply(li_, Value::attention_head_outputs, hs_);
  Tensor g({B, T, W});
  for (int64_t e = 0; e < BT * W; ++e) g[e] = hs_[e] * y_[e];
  out_ = Tensor({B, T, D});
  ops::linear(g.data(), BT, W, w.linear_out, out_.data(), w.out_bias.data());
  tape.apply(li_, Value::attention_output, out_);
}

void RgLruMixerGrad::backward(const Tensor& dout_in, Tensor& dn, GradSink& sink) const {
  const Batch& in = tape_.batch;
  const int64_t B = in.batch, T = in.seq, BT = B * T, D = d_.D, W = d_.W, H = d_.H, bw = W / H, K = d_.K;
  // A value's gradient as served, then cut where a write replaced the value (upstream of it: constants).
  const auto serve = [&](Value v, Tensor& g) {
    sink.put(li_, v, g);
    tape_.block(li_, v, g);
  };
  Tensor dout = dout_in.clone();
  serve(Value::attention_output, dout);
  Tensor dg({B, T, W});
  linear_backward(dout.data(), BT, D, w_.linear_out, dg.data(), false);
  Tensor dhs({B, T, W}), dyl({B, T, W});
  for (int64_t e = 0; e < BT * W; ++e) {
    dhs[e] = dg[e] * y_[e];
    dyl[e] = dg[e] * hs_[e] * gelu_tanh_grad(yl_[e]);
  }
  serve(Value::attention_head_outputs, dhs);
  Tensor du({B, T, W}), dig({B, T, W}), dla({B, T, W}), dS0({B, K, W});
  const bool want_states = sink.wants(li_, Value::states);
  Tensor dstates;  // [B,T,K,W]: the window rows' adjoint is filled after the conv's, the h row here
  Tensor dh;       // [B,T,W] dL/dh_t
  if (want_states) dstates = Tensor({B, T, K, W}), dh = Tensor({B, T, W});
  for (int64_t b = 0; b < B; ++b) {
    const int64_t t0 = first_[static_cast<size_t>(b)], n = T - t0, o = (b * T + t0) * W;
    if (n <= 0) continue;
    std::vector<uint8_t> reset(static_cast<size_t>(n));
    for (int64_t t = 0; t < n; ++t) reset[static_cast<size_t>(t)] = (*call_.pos)[static_cast<size_t>(b * T + t0 + t)] == 0;
    RgLruGradArgs a;
    a.T = n; a.W = W;
    a.u = uw_.data() + o; a.ig = ig_.data() + o; a.la = la_.data() + o; a.reset = reset.data();
    a.h0 = S0_.data() + (b * K + K - 1) * W; a.dy = dhs.data() + o;
    a.du = du.data() + o; a.dig = dig.data() + o; a.dla = dla.data() + o; a.dh0 = dS0.data() + (b * K + K - 1) * W;
    if (want_states) a.dstates = dh.data() + o;
    rg_lru_backward(a);
  }
  serve(Value::attention_values, du);
  serve(Value::betas, dig);
  serve(Value::decays, dla);
  // The gates read u before any write: their gradient joins the write path's at the conv output.
  for (int64_t r = 0; r < BT; ++r)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = 0; j < bw; ++j) {
        const int64_t e = r * W + h * bw + j;
        const float dsi = dig[e] * sigmoid_d(ig0_[e]), dsr = dla[e] * w_.log_a_scale[h * bw + j] * sigmoid_d(r_[e]);
        for (int64_t k = 0; k < bw; ++k)
          du[r * W + h * bw + k] += dsi * w_.in_gate_w[(h * bw + k) * bw + j] + dsr * w_.rec_gate_w[(h * bw + k) * bw + j];
      }
  Tensor dxb({B, T, W});
  causal_conv1d_backward(du.data(), B, T, W, K, w_.conv_wT.data(), dxb.data(), W);
  // The window after token t (rows 0..K-2), read by token t + 1 through taps 0..K-2 and shifted one row
  // up into the next window: lam_{t-1}[j] = w_j du_t + lam_t[j - 1], from lam_{T-1} = 0 back to the
  // window the row started from (state_input's; padding tokens read and push nothing).
  std::vector<float> lam(static_cast<size_t>((K - 1) * W));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t f = first_[static_cast<size_t>(b)];
    std::fill(lam.begin(), lam.end(), 0.0f);
    for (int64_t t = T - 1; t >= f; --t) {
      if (want_states)
        std::copy(lam.begin(), lam.end(), dstates.data() + (b * T + t) * K * W);
      for (int64_t j = K - 2; j >= 0; --j)  // descending: lam[j - 1] is still token t's
        for (int64_t c = 0; c < W; ++c)
          lam[static_cast<size_t>(j * W + c)] =
              w_.conv_wT[j * W + c] * du[(b * T + t) * W + c] + (j > 0 ? lam[static_cast<size_t>((j - 1) * W + c)] : 0.0f);
    }
    std::copy(lam.begin(), lam.end(), dS0.data() + b * K * W);
  }
  if (want_states) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t f = first_[static_cast<size_t>(b)];
      for (int64_t t = 0; t < T; ++t) {
        float* st = dstates.data() + (b * T + t) * K * W;
        if (t < f) std::copy_n(dS0.data() + b * K * W, K * W, st);  // padding: the state the row starts from
        else std::copy_n(dh.data() + (b * T + t) * W, W, st + (K - 1) * W);
      }
    }
    sink.put(li_, Value::states, dstates);
  }
  // state_output feeds only the next call: this call's metric does not depend on it.
  if (sink.wants(li_, Value::state_output)) sink.put(li_, Value::state_output, Tensor({B, K, W}));
  if (call_.has_state || tape_.write(li_, Value::state_input)) {
    sink.put(li_, Value::state_input, dS0);
  }
  if (in.has_padding()) detail::apply_row_mask(dxb, in);  // padding inputs are zeroed: no gradient
  linear_backward(dxb.data(), BT, W, w_.linear_x, dn.data(), false);
  linear_backward(dyl.data(), BT, W, w_.linear_y, dn.data(), true);
}

}  // namespace mixlens::grad
