// Backward of RWKV-4's time mixing (RwkvMixer::forward, transformers RwkvSelfAttention with
// rwkv_linear_attention_cpu): recomputed with the recorded writes re-applied, then output, the receptance
// gate, the WKV recurrence and the token shifts. The WKV backward is the exact derivative of the
// max-shifted forward: a (num, den, max) state stands for (num e^max, den e^max), which the shift max
// does not change, so every path through a max sums to zero and the max is held constant; the max
// entry's own gradient then follows from that invariance, g_max = g_num num + g_den den.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <utility>

#include "grad/ops_grad.h"
#include "grad/rwkv_grad.h"
#include "hooks/serve.h"
#include "ops/ops.h"

namespace mixlens::grad {

void token_shift_mix_backward(const Tensor& dout, const std::vector<int64_t>& first, const float* mix, Tensor& dx,
                              float* dstart, Tensor* dprev) {
  const int64_t B = dout.size(0), T = dout.size(1), D = dout.size(2);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const float* g = dout.data() + (b * T + t) * D;
      float* o = dx.data() + (b * T + t) * D;
      float* prev = t <= first[static_cast<size_t>(b)] ? dstart + b * D : o - D;
      for (int64_t d = 0; d < D; ++d) {
        o[d] += mix[d] * g[d];
        const float p = (1.0f - mix[d]) * g[d];
        prev[d] += p;
        if (dprev) (*dprev)[(b * T + t) * D + d] += p;
      }
    }
}

void shift_state_adjoint(const Tensor& dprev, const Tensor& dstart, const std::vector<int64_t>& first,
                         int64_t offset, Tensor& dstates) {
  const int64_t B = dprev.size(0), T = dprev.size(1), D = dprev.size(2), rn = dstates.size(2);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      float* s = dstates.data() + (b * T + t) * rn + offset;
      const int64_t f = first[static_cast<size_t>(b)];
      if (t < f) std::copy_n(dstart.data() + b * D, D, s);
      else if (t + 1 < T) std::copy_n(dprev.data() + (b * T + t + 1) * D, D, s);
    }
}

RwkvMixerGrad::RwkvMixerGrad(const detail::RwkvMixer& mixer, const detail::RwkvMixerWeights& w, int li,
                             const Tensor& n, const Tensor& S0, const Tape& tape)
    : d_(mixer.dims()), w_(w), li_(li), tape_(tape) {
  const Batch& in = tape.batch;
  const int64_t B = in.batch, T = in.seq, BT = B * T, D = d_.D, A = d_.A, rn = d_.row_numel();
  first_ = detail::first_real_tokens(in);
  Tensor start({B, D}), xm({B, T, D});
  for (int64_t b = 0; b < B; ++b) std::copy_n(S0.data() + b * rn + d_.att_shift(), D, start.data() + b * D);
  k_ = Tensor({B, T, A});
  v_ = Tensor({B, T, A});
  r_ = Tensor({B, T, A});
  detail::token_shift_mix(n, start.data(), first_, w.mix_k.data(), xm);
  ops::linear(xm.data(), BT, D, w.key, k_.data());
  detail::token_shift_mix(n, start.data(), first_, w.mix_v.data(), xm);
  ops::linear(xm.data(), BT, D, w.value, v_.data());
  detail::token_shift_mix(n, start.data(), first_, w.mix_r.data(), xm);
  ops::linear(xm.data(), BT, D, w.receptance, r_.data());
  ops::sigmoid(r_.data(), r_.data(), BT * A);
  w_dec_ = Tensor({B, T, A});
  for (int64_t q = 0; q < BT; ++q) std::copy_n(w.decay.data(), A, w_dec_.data() + q * A);
  tape.apply(li, Value::attention_keys, k_);
  tape.apply(li, Value::attention_values, v_);
  tape.apply(li, Value::decays, w_dec_);
  tape.apply(li, Value::attention_queries, r_);
  y_ = Tensor({B, T, A});
  before_ = Tensor({B, T, 3 * A});
  std::vector<float> st(static_cast<size_t>(3 * A));
  for (int64_t b = 0; b < B; ++b) {
    std::copy_n(S0.data() + b * rn, 3 * A, st.data());
    for (int64_t t = first_[static_cast<size_t>(b)]; t < T; ++t) {
      const int64_t o = (b * T + t) * A;
      std::copy(st.begin(), st.end(), before_.data() + (b * T + t) * 3 * A);
      detail::wkv_recurrent(1, A, k_.data() + o, v_.data() + o, w_dec_.data() + o, w.time_first.data(), st.data(),
                            y_.data() + o);
    }
  }
  tape.apply(li, Value::attention_head_outputs, y_);
  Tensor g({B, T, A});
  for (int64_t q = 0; q < BT * A; ++q) g[q] = r_[q] * y_[q];
  out_ = Tensor({B, T, D});
  ops::linear(g.data(), BT, A, w.output, out_.data());
  tape.apply(li, Value::attention_output, out_);
}

void RwkvMixerGrad::backward(const Tensor& dout_in, Tensor& dn, Tensor& dS0, Tensor& dstates, GradSink& sink) const {
  const Batch& in = tape_.batch;
  const int li = li_;
  const int64_t B = in.batch, T = in.seq, BT = B * T, D = d_.D, A = d_.A, rn = d_.row_numel();
  Tensor dout = dout_in.clone();
  sink.put(li, Value::attention_output, dout);
  tape_.block(li, Value::attention_output, dout);
  Tensor dg({B, T, A});
  linear_backward(dout.data(), BT, D, w_.output, dg.data(), false);
  Tensor dy({B, T, A}), dr({B, T, A});
  for (int64_t q = 0; q < BT * A; ++q) {
    dy[q] = dg[q] * r_[q];
    dr[q] = dg[q] * y_[q];
  }
  sink.put(li, Value::attention_head_outputs, dy);
  tape_.block(li, Value::attention_head_outputs, dy);
  // WKV, token by token backwards; gp / gq / gm: dL/d(num, den, max) of the state after the token.
  Tensor dk({B, T, A}), dv({B, T, A}), dw({B, T, A});
  std::fill_n(dS0.data(), dS0.numel(), 0.0f);
  if (dstates.defined()) std::fill_n(dstates.data(), dstates.numel(), 0.0f);
  const float* u = w_.time_first.data();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t f = first_[static_cast<size_t>(b)];
    for (int64_t a = 0; a < A; ++a) {
      double gp = 0.0, gq = 0.0, gm = 0.0;  // the last state feeds only the next call
      for (int64_t t = T - 1; t >= f; --t) {
        const int64_t q = (b * T + t) * A + a;
        if (dstates.defined()) {
          float* s = dstates.data() + (b * T + t) * rn;
          s[a] = static_cast<float>(gp);
          s[A + a] = static_cast<float>(gq);
          s[2 * A + a] = static_cast<float>(gm);
        }
        const float* bs = before_.data() + (b * T + t) * 3 * A;
        const double p = bs[a], qd = bs[A + a], o = bs[2 * A + a];
        const double k = k_[q], v = v_[q], w = w_dec_[q];
        // The read: y = (a1 p + b1 v) / (a1 q + b1), a1 = e^(o - mo), b1 = e^(k + u - mo).
        const double ku = k + u[a], mo = std::max(o, ku), a1 = std::exp(o - mo), b1 = std::exp(ku - mo);
        const double N = a1 * p + b1 * v, Dn = a1 * qd + b1, y = N / Dn;
        const double dN = dy[q] / Dn, dD = -dy[q] * y / Dn;
        // The update: p' = a2 p + b2 v, q' = a2 q + b2, a2 = e^(o + w - ms), b2 = e^(k - ms).
        const double md = o + w, ms = std::max(md, k), a2 = std::exp(md - ms), b2 = std::exp(k - ms);
        const double dw_ = (gp * p + gq * qd) * a2;
        dk[q] = static_cast<float>((dN * v + dD) * b1 + (gp * v + gq) * b2);
        dv[q] = static_cast<float>(dN * b1 + gp * b2);
        dw[q] = static_cast<float>(dw_);
        const double np = dN * a1 + gp * a2, nq = dD * a1 + gq * a2;
        gm = (dN * p + dD * qd) * a1 + dw_;
        gp = np;
        gq = nq;
      }
      float* s0 = dS0.data() + b * rn;
      s0[a] = static_cast<float>(gp);
      s0[A + a] = static_cast<float>(gq);
      s0[2 * A + a] = static_cast<float>(gm);
      if (dstates.defined())  // padded tokens keep the state the row starts from
        for (int64_t t = 0; t < f; ++t) {
          float* s = dstates.data() + (b * T + t) * rn;
          s[a] = s0[a];
          s[A + a] = s0[A + a];
          s[2 * A + a] = s0[2 * A + a];
        }
    }
  }
  for (auto [val, t] : {std::pair<Value, Tensor*>{Value::attention_keys, &dk}, {Value::attention_values, &dv},
                        {Value::decays, &dw}, {Value::attention_queries, &dr}}) {
    sink.put(li, val, *t);
    tape_.block(li, val, *t);
  }
  for (int64_t q = 0; q < BT * A; ++q) dr[q] *= sigmoid_d(r_[q]);
  // k / v / r from the token-shifted input: each projection's gradient through its mix.
  std::fill_n(dn.data(), dn.numel(), 0.0f);
  Tensor dxm({B, T, D}), dstart({B, D}), dprev({B, T, D});
  for (auto [dproj, W, mix] : {std::tuple<const Tensor*, const Tensor*, const Tensor*>{&dk, &w_.key, &w_.mix_k},
                               {&dv, &w_.value, &w_.mix_v}, {&dr, &w_.receptance, &w_.mix_r}}) {
    linear_backward(dproj->data(), BT, A, *W, dxm.data(), false);
    token_shift_mix_backward(dxm, first_, mix->data(), dn, dstart.data(), &dprev);
  }
  for (int64_t b = 0; b < B; ++b) std::copy_n(dstart.data() + b * D, D, dS0.data() + b * rn + d_.att_shift());
  if (dstates.defined()) shift_state_adjoint(dprev, dstart, first_, d_.att_shift(), dstates);
}

}  // namespace mixlens::grad
