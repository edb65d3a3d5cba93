// Backward of xLSTM's mLSTM mixer (MlstmMixer::forward, transformers xLSTMLayer in mode "inference"):
// recomputed with the recorded writes re-applied, then out_proj, the sigmoid output gate, multihead_norm,
// the matrix-memory recurrence (grad/xlstm_grad.h says which derivative), the soft-capped gates and the
// q / k / v / gate projections.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "grad/ops_grad.h"
#include "grad/xlstm_grad.h"
#include "hooks/serve.h"
#include "ops/ops.h"

namespace mixlens::grad {

namespace {

/// torch.maximum's backward: the larger side takes the gradient, a tie splits it.
std::pair<double, double> max_split(float a, float b, double g) {
  if (a > b) return {g, 0.0};
  if (b > a) return {0.0, g};
  return {0.5 * g, 0.5 * g};
}

/// d soft_cap(x) / dx for cap * tanh(x / cap) (cap <= 0: none).
float soft_cap_d(float x, float cap) {
  if (!(cap > 0.0f)) return 1.0f;
  const float t = std::tanh(x / cap);
  return 1.0f - t * t;
}

}  // namespace

MlstmMixerGrad::MlstmMixerGrad(const detail::MlstmMixer& mixer, const detail::MlstmMixerWeights& w, int li,
                               const Tensor& n, const Tensor& S0, bool chunked, const Tape& tape)
    : d_(mixer.dims()), w_(w), li_(li), tape_(tape), chunked_(chunked) {
  const Batch& in = tape.batch;
  const int64_t B = in.batch, T = in.seq, BT = B * T, D = d_.D, QK = d_.qk(), V = d_.v(), NH = d_.NH,
                rn = d_.row_numel();
  first_ = detail::first_real_tokens(in);
  G_ = chunked ? d_.chunk : 64;
  q_ = Tensor({B, T, QK}), k_ = Tensor({B, T, QK}), v_ = Tensor({B, T, V}), og_ = Tensor({B, T, V});
  gp_ = Tensor({BT, 2 * NH}), ig_ = Tensor({B, T, NH}), lf_ = Tensor({B, T, NH}), gi_ = Tensor({B, T, NH});
  mixer.project(w, n.data(), BT, q_.data(), k_.data(), v_.data(), og_.data(), gp_.data(), ig_.data(), lf_.data());
  tape.apply(li, Value::attention_queries, q_);
  tape.apply(li, Value::attention_keys, k_);
  tape.apply(li, Value::attention_values, v_);
  for (int64_t r = 0; r < BT * NH; ++r) gi_[r] = std::exp(ig_[r]);
  tape.apply(li, Value::betas, gi_);
  for (int64_t r = 0; r < BT * NH; ++r) ig_[r] = std::log(gi_[r]);  // the kernels take log betas, as the forward
  tape.apply(li, Value::decays, lf_);
  S0_ = S0.clone();
  // The forward's kernels from each row's first token, the state entering every G-token segment kept:
  // whole chunks in the chunkwise form on the chunked route, the rest (and every token on the recurrent
  // route) by the recurrent step, which runs the same per-token arithmetic however the tokens are grouped.
  const int64_t nseg = (T + G_ - 1) / G_;
  ckpt_ = Tensor({B, std::max<int64_t>(nseg, 1), rn});
  y_ = Tensor({B, T, V});
  std::vector<float> S(static_cast<size_t>(rn));
  for (int64_t b = 0; b < B; ++b) {
    std::copy_n(S0_.data() + b * rn, rn, S.data());
    for (int64_t t = first_[static_cast<size_t>(b)], s = 0; t < T; t += G_, ++s) {
      const int64_t L = std::min(G_, T - t), o = b * T + t;
      std::copy(S.begin(), S.end(), ckpt_.data() + (b * ckpt_.size(1) + s) * rn);
      const auto kernel = chunked && L == G_ ? detail::mlstm_chunk : detail::mlstm_recurrent;
      kernel(d_, L, q_.data() + o * QK, k_.data() + o * QK, v_.data() + o * V, ig_.data() + o * NH,
             lf_.data() + o * NH, S.data(), y_.data() + o * V, nullptr, 0);
    }
  }
  tape.apply(li, Value::attention_head_outputs, y_);
  ln_ = Tensor({B, T, V});
  mixer.head_norm(w, y_.data(), BT, ln_.data());
  Tensor g({BT, V});
  for (int64_t e = 0; e < BT * V; ++e) g[e] = ln_[e] * ops::sigmoid(og_[e]);
  out_ = Tensor({B, T, D});
  ops::linear(g.data(), BT, V, w.out, out_.data());
  tape.apply(li, Value::attention_output, out_);
}

void MlstmMixerGrad::scan_backward(int64_t b, const Tensor& dy, Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dig,
                                   Tensor& dlf, Tensor& dS0, Tensor& dstates) const {
  const int64_t T = tape_.batch.seq, QK = d_.qk(), V = d_.v(), NH = d_.NH, Dqk = d_.Dqk, Dv = d_.Dv,
                rn = d_.row_numel(), f = first_[static_cast<size_t>(b)];
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dqk));
  // Per head: the adjoint (dL/dC, dL/dn, dL/dm) of the state after the token being differentiated; the last
  // state feeds only the next call.
  std::vector<std::vector<double>> gC(static_cast<size_t>(NH), std::vector<double>(static_cast<size_t>(Dqk * Dv))),
      gn(static_cast<size_t>(NH), std::vector<double>(static_cast<size_t>(Dqk)));
  std::vector<double> gm(static_cast<size_t>(NH), 0.0);
  std::vector<float> after(static_cast<size_t>(G_ * rn)), hs(static_cast<size_t>(G_ * V)), S(static_cast<size_t>(rn));
  const int64_t nseg = f < T ? (T - f + G_ - 1) / G_ : 0;
  for (int64_t s = nseg - 1; s >= 0; --s) {
    const int64_t t0 = f + s * G_, L = std::min(G_, T - t0), o = b * T + t0;
    const float* entry = ckpt_.data() + (b * ckpt_.size(1) + s) * rn;
    // The segment's token states replayed from its entry state by the recurrent step.
    std::copy_n(entry, rn, S.data());
    detail::mlstm_recurrent(d_, L, q_.data() + o * QK, k_.data() + o * QK, v_.data() + o * V, ig_.data() + o * NH,
                            lf_.data() + o * NH, S.data(), hs.data(), after.data(), rn);
    ops::parallel_for(NH, [&](int64_t hd) {
      std::vector<double>& G = gC[static_cast<size_t>(hd)];
      std::vector<double>& N = gn[static_cast<size_t>(hd)];
      double& M = gm[static_cast<size_t>(hd)];
      std::vector<double> qs(static_cast<size_t>(Dqk)), Gv(static_cast<size_t>(Dqk));
      for (int64_t j = L - 1; j >= 0; --j) {
        const int64_t t = t0 + j, r = b * T + t;
        const float* cur = after.data() + j * rn;
        const float* prev = j > 0 ? after.data() + (j - 1) * rn : entry;
        const float* C1 = cur + hd * Dqk * Dv;
        const float* n1 = cur + d_.n_off() + hd * Dqk;
        const float m1 = cur[d_.m_off() + hd];
        const float* C0 = prev + hd * Dqk * Dv;
        const float* n0 = prev + d_.n_off() + hd * Dqk;
        const float m0 = prev[d_.m_off() + hd];
        const float* qt = q_.data() + r * QK + hd * Dqk;
        const float* kt = k_.data() + r * QK + hd * Dqk;
        const float* vt = v_.data() + r * V + hd * Dv;
        const float* dh = dy.data() + r * V + hd * Dv;
        // The read h = hnum / den, den = max(|qs n'|, e^(-m')) + eps.
        double qn = 0.0, dhh = 0.0;
        for (int64_t a = 0; a < Dqk; ++a) {
          qs[static_cast<size_t>(a)] = static_cast<double>(qt[a] * scale);
          qn += qs[static_cast<size_t>(a)] * n1[a];
        }
        for (int64_t a = 0; a < Dqk; ++a) {
          double row = 0.0;
          for (int64_t e = 0; e < Dv; ++e) row += static_cast<double>(C1[a * Dv + e]) * dh[e];
          dhh += qs[static_cast<size_t>(a)] * row;  // dh . hnum
          Gv[static_cast<size_t>(a)] = row;         // (C' dh) for dq below
        }
        const float E = std::exp(-m1), aq = static_cast<float>(std::fabs(qn));
        const double den = static_cast<double>(std::max(aq, E)) + d_.eps, dden = -dhh / (den * den);
        const auto [daq, dE] = max_split(aq, E, dden);
        const double dqn = qn > 0.0 ? daq : qn < 0.0 ? -daq : 0.0;
        M += -static_cast<double>(E) * dE;
        float* dqt = dq.data() + r * QK + hd * Dqk;
        for (int64_t a = 0; a < Dqk; ++a) {
          const double qa = qs[static_cast<size_t>(a)];
          dqt[a] = static_cast<float>(scale * (Gv[static_cast<size_t>(a)] / den + dqn * n1[a]));
          for (int64_t e = 0; e < Dv; ++e) G[static_cast<size_t>(a * Dv + e)] += qa * dh[e] / den;
          N[static_cast<size_t>(a)] += dqn * qa;
        }
        if (dstates.defined()) {  // dL/dS_t: what later tokens and this token's read take
          float* st = dstates.data() + r * rn;
          for (int64_t a = 0; a < Dqk * Dv; ++a) st[hd * Dqk * Dv + a] = static_cast<float>(G[static_cast<size_t>(a)]);
          for (int64_t a = 0; a < Dqk; ++a) st[d_.n_off() + hd * Dqk + a] = static_cast<float>(N[static_cast<size_t>(a)]);
          st[d_.m_off() + hd] = static_cast<float>(M);
        }
        // The update C' = fa C + ia k v^T, n' = fa n + ia k, fa = e^(lf + m - m'), ia = e^(ig - m').
        const float fl = lf_[r * NH + hd], il = ig_[r * NH + hd], a1 = fl + m0;
        const double fa = std::exp(static_cast<double>(a1 - m1)), ia = std::exp(static_cast<double>(il - m1));
        double dfa = 0.0, dia = 0.0;
        float* dkt = dk.data() + r * QK + hd * Dqk;
        float* dvt = dv.data() + r * V + hd * Dv;
        std::fill_n(dvt, Dv, 0.0f);
        for (int64_t a = 0; a < Dqk; ++a) {
          double gv = 0.0;
          const double* Ga = G.data() + a * Dv;
          for (int64_t e = 0; e < Dv; ++e) {
            dfa += Ga[e] * C0[a * Dv + e];
            gv += Ga[e] * vt[e];
            dvt[e] += static_cast<float>(ia * Ga[e] * kt[a]);
          }
          dfa += N[static_cast<size_t>(a)] * n0[a];
          dia += (gv + N[static_cast<size_t>(a)]) * kt[a];
          dkt[a] = static_cast<float>(ia * (gv + N[static_cast<size_t>(a)]));
        }
        // m' = max(lf + m, ig) feeds fa, ia and (M) the reads after it.
        const double dm1 = M - fa * dfa - ia * dia;
        const auto [da1, dil] = max_split(a1, il, dm1);
        const double d_a1 = fa * dfa + da1;
        dlf[r * NH + hd] = static_cast<float>(d_a1);
        dig[r * NH + hd] = static_cast<float>(ia * dia + dil);
        M = d_a1;
        for (double& x : G) x *= fa;
        for (double& x : N) x *= fa;
      }
    });
  }
  float* s0 = dS0.data() + b * rn;
  for (int64_t hd = 0; hd < NH; ++hd) {
    for (int64_t a = 0; a < Dqk * Dv; ++a) s0[hd * Dqk * Dv + a] = static_cast<float>(gC[static_cast<size_t>(hd)][static_cast<size_t>(a)]);
    for (int64_t a = 0; a < Dqk; ++a) s0[d_.n_off() + hd * Dqk + a] = static_cast<float>(gn[static_cast<size_t>(hd)][static_cast<size_t>(a)]);
    s0[d_.m_off() + hd] = static_cast<float>(gm[static_cast<size_t>(hd)]);
  }
  if (dstates.defined())  // padded tokens hold the state the row starts from
    for (int64_t t = 0; t < std::min(f, T); ++t) std::copy_n(s0, rn, dstates.data() + (b * T + t) * rn);
}

void MlstmMixerGrad::backward(const Tensor& dout_in, Tensor& dn, Tensor& dS0, Tensor& dstates, GradSink& sink) const {
  const int li = li_;
  const int64_t B = tape_.batch.batch, T = tape_.batch.seq, BT = B * T, D = d_.D, QK = d_.qk(), V = d_.v(),
                NH = d_.NH, Dv = d_.Dv, W = 2 * QK + 2 * V;
  Tensor dout = dout_in.clone();
  sink.put(li, Value::attention_output, dout);
  tape_.block(li, Value::attention_output, dout);
  // out = out_proj(sigmoid(og) * multihead_norm(y)).
  Tensor dg({BT, V}), dln({BT, V}), dproj({BT, W}), dy({B, T, V});
  linear_backward(dout.data(), BT, D, w_.out, dg.data(), false);
  for (int64_t r = 0; r < BT; ++r)
    for (int64_t e = 0; e < V; ++e) {
      const int64_t k = r * V + e;
      const float s = ops::sigmoid(og_[k]);
      dln[k] = dg[k] * s;
      dproj[r * W + 2 * QK + V + e] = dg[k] * ln_[k] * sigmoid_d(s);
    }
  for (int64_t r = 0; r < BT; ++r)
    for (int64_t hd = 0; hd < NH; ++hd) {
      const int64_t o = r * V + hd * Dv;
      layernorm_backward(y_.data() + o, w_.norm_w.data() + hd * Dv, dln.data() + o, dy.data() + o, 1, Dv, d_.norm_eps,
                         false);
    }
  sink.put(li, Value::attention_head_outputs, dy);
  tape_.block(li, Value::attention_head_outputs, dy);
  // The recurrence, row by row (padded tokens neither read nor write: their q / k / v / gates get 0).
  Tensor dq({B, T, QK}), dk({B, T, QK}), dv({B, T, V}), dig({B, T, NH}), dlf({B, T, NH});
  if (dstates.defined()) std::fill_n(dstates.data(), dstates.numel(), 0.0f);
  for (int64_t b = 0; b < B; ++b) scan_backward(b, dy, dq, dk, dv, dig, dlf, dS0, dstates);
  // betas = exp(i): the recurrence reads log betas.
  Tensor dbeta({B, T, NH});
  for (int64_t r = 0; r < BT * NH; ++r) dbeta[r] = dig[r] / gi_[r];
  for (auto [val, t] : {std::pair<Value, Tensor*>{Value::attention_queries, &dq}, {Value::attention_keys, &dk},
                        {Value::attention_values, &dv}, {Value::betas, &dbeta}, {Value::decays, &dlf}}) {
    sink.put(li, val, *t);
    tape_.block(li, val, *t);
  }
  // Into the pre-activations: i = soft_cap(ip) (d exp(i) = exp(i) di), log f = logsigmoid(soft_cap(fp)).
  Tensor dgp({BT, 2 * NH});
  const float cap = d_.gate_cap;
  for (int64_t r = 0; r < BT; ++r) {
    for (int64_t hd = 0; hd < NH; ++hd) {
      const int64_t k = r * NH + hd;
      const float ip = gp_[r * 2 * NH + hd], fp = gp_[r * 2 * NH + NH + hd];
      const float fc = cap > 0.0f ? cap * std::tanh(fp / cap) : fp;
      dgp[r * 2 * NH + hd] = dbeta[k] * gi_[k] * soft_cap_d(ip, cap);
      dgp[r * 2 * NH + NH + hd] = dlf[k] * ops::sigmoid(-fc) * soft_cap_d(fp, cap);
    }
    std::copy_n(dq.data() + r * QK, QK, dproj.data() + r * W);
    std::copy_n(dk.data() + r * QK, QK, dproj.data() + r * W + QK);
    std::copy_n(dv.data() + r * V, V, dproj.data() + r * W + 2 * QK);
  }
  linear_backward(dproj.data(), BT, W, w_.qkvo, dn.data(), false);
  linear_backward(dgp.data(), BT, 2 * NH, w_.gates, dn.data(), true);
}

}  // namespace mixlens::grad
