// Backward of the gated DeltaNet mixer (QwenHybrid::gdn, transformers Qwen3_5GatedDeltaNet /
// Qwen3NextGatedDeltaNet): recomputed from the normed input with the recorded writes re-applied
// (kernel as the forward ran it), then out_proj, the gated RMSNorm (norm, then * silu(z)), the delta
// rule (grad/gated_delta_grad.cpp), beta = beta_scale * sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), the
// q/k head repetition, the causal conv + SiLU and in_proj. Kimi Delta Attention (GdnView::kda,
// KimiLinearDeltaAttention): the gate is sigmoid(g_b(g_a(x))), the decay per key channel
// -exp(A_log) softplus(f_b(f_a(x)) + dt_bias), both second stages differentiated into in_proj's latent columns.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>

#include "grad/ops_grad.h"
#include "grad/qwen_grad.h"
#include "hooks/serve.h"
#include "mixers/gated_delta.h"
#include "ops/ops.h"

namespace mixlens::grad {

const float* GdnMixerGrad::gate_logits(int64_t row, int64_t j) const {
  const int64_t vd = w_.HV * w_.Dv;
  if (w_.kda) return zk_.data() + row * vd + j * w_.Dv;
  return proj_.data() + row * proj_.size(-1) + 2 * w_.HK * w_.Dk + vd + j * w_.Dv;
}

GdnMixerGrad::GdnMixerGrad(const GdnView& w, int li, const Tensor& n_in, const detail::HybridCache& before,
                           const Tape& tape)
    : w_(w), li_(li), tape_(tape) {
  const Batch& in = tape.batch;
  const int64_t B = in.batch, T = in.seq, BT = B * T;
  const int64_t HK = w.HK, HV = w.HV, Dk = w.Dk, Dv = w.Dv, r = HV / HK, kd = HK * Dk, vd = HV * Dv;
  const int64_t zr = w.kda ? Dk : vd, gw = w.kda ? Dk : 1, cd = 2 * kd + vd, pr = cd + zr + HV + (w.kda ? Dk : HV);
  masked_ = T > 1 && in.has_padding();
  has_state_ = before.has_state;
  if (const Tensor* kept = tape.kept_of(li, Kept::in_proj)) {
    proj_ = *kept;  // the forward's own in_proj output (read only)
  } else {
    Tensor nm = n_in.clone();
    if (masked_) detail::apply_row_mask(nm, in);
    proj_ = Tensor({B, T, pr});
    ops::linear(nm.data(), BT, w.D, *w.in_proj, proj_.data());
  }
  // Every buffer below is written whole: uninitialized (no zero-fill pass over fresh pages).
  Tensor window = before.conv[static_cast<size_t>(li)].clone();
  u_ = Tensor::uninitialized({B, T, cd});  // conv output before the SiLU
  ops::causal_conv1d(proj_.data(), pr, B, T, cd, w.K, w.conv_wT->data(), nullptr, window.data(), u_.data(), false);
  // sigmoid(u) and sigmoid(z) once, vectorized: every SiLU and SiLU derivative below reads them.
  su_ = Tensor::uninitialized({B, T, cd});
  sz_ = Tensor::uninitialized({B, T, vd});
  if (w.kda) zk_ = detail::kda_latent_times(proj_, BT, pr, cd, Dk, *w.g_b);
  q_ = Tensor::uninitialized({B, T, HV, Dk});
  k_ = Tensor::uninitialized({B, T, HV, Dk});
  v_ = Tensor::uninitialized({B, T, HV, Dv});
  ops::parallel_rows(BT, cd + vd, [&](int64_t row0, int64_t row1) {
    ops::sigmoid(u_.data() + row0 * cd, su_.data() + row0 * cd, (row1 - row0) * cd);
    for (int64_t row = row0; row < row1; ++row) {
      ops::sigmoid(gate_logits(row, 0), sz_.data() + row * vd, vd);
      const float* src = u_.data() + row * cd;
      const float* sg = su_.data() + row * cd;
      for (int64_t j = 0; j < HV; ++j) {
        const int64_t qo = (j / r) * Dk, ko = kd + (j / r) * Dk;
        float* qd = q_.data() + (row * HV + j) * Dk;
        float* kdst = k_.data() + (row * HV + j) * Dk;
        for (int64_t d = 0; d < Dk; ++d) {
          qd[d] = silu_s(src[qo + d], sg[qo + d]);
          kdst[d] = silu_s(src[ko + d], sg[ko + d]);
        }
      }
      float* vrow = v_.data() + row * vd;
      for (int64_t c = 0; c < vd; ++c) vrow[c] = silu_s(src[2 * kd + c], sg[2 * kd + c]);
    }
  });
  tape.apply(li, Value::attention_queries, q_);
  tape.apply(li, Value::attention_keys, k_);
  tape.apply(li, Value::attention_values, v_);
  beta_ = Tensor::uninitialized({B, T, HV});
  g_ = w.kda ? Tensor::uninitialized({B, T, HV, Dk}) : Tensor::uninitialized({B, T, HV});
  if (w.kda) fa_ = detail::kda_latent_times(proj_, BT, pr, cd + zr + HV, Dk, *w.f_b);
  detail::gdn_beta_decay(proj_.data(), BT, pr, cd + zr, HV, gw, w.beta_scale, w.neg_A->data(), w.dt_bias->data(),
                         w.kda ? fa_.data() : nullptr, beta_.data(), g_.data());
  tape.apply(li, Value::betas, beta_);
  tape.apply(li, Value::decays, g_);
  S0_ = has_state_ ? before.ssm[static_cast<size_t>(li)].clone() : Tensor({B, HV, Dk, Dv});
  tape.apply(li, Value::state_input, S0_);
  const int64_t nch = (T + kChunk - 1) / kChunk;
  const Tensor* kept_entry = tape.kept_of(li, Kept::chunk_states);
  const Tensor* kept_o = tape.kept_of(li, Kept::head_outputs);
  if (kept_entry && kept_o && kept_entry->shape() == Shape{B, HV, nch, Dk, Dv}) {
    // The forward's chunk-entry states and o (after writes): no scan here.
    ckpt_ = *kept_entry;
    o_ = *kept_o;
  } else {
    o_ = Tensor::uninitialized({B, T, HV, Dv});
    // Run chunk by chunk (the forward kernel's own chunks: the same results) and keep the state
    // entering every chunk as the backward's checkpoints.
    const int64_t SN = Dk * Dv;
    ckpt_ = Tensor::uninitialized({B, HV, nch, Dk, Dv});
    Tensor S = S0_.clone();
    detail::GatedDeltaArgs a;
    a.B = B; a.T = T; a.H = HV; a.Dk = Dk; a.Dv = Dv;
    a.q = q_.data(); a.k = k_.data(); a.v = v_.data(); a.g = g_.data(); a.beta = beta_.data();
    a.g_per_key = w.kda;
    a.S = S.data(); a.o = o_.data();
    a.chunk = kChunk;
    for (int64_t c = 0; c < nch; ++c) {
      for (int64_t bh = 0; bh < B * HV; ++bh)
        std::memcpy(ckpt_.data() + (bh * nch + c) * SN, S.data() + bh * SN, sizeof(float) * static_cast<size_t>(SN));
      a.t_begin = c * kChunk;
      a.t_end = std::min(T, (c + 1) * kChunk);
      if (tape.kernel == "chunked") detail::gated_delta_chunked(a); else detail::gated_delta_recurrent(a);
    }
    tape.apply(li, Value::attention_head_outputs, o_);
  }
  if (const Tensor* kept = tape.kept_of(li, Kept::mixer_output)) {
    out_ = *kept;  // as the forward added it (writes applied): no gated norm / out_proj recompute
    return;
  }
  Tensor y = Tensor::uninitialized({B, T, vd});
  ops::parallel_rows(BT, vd, [&](int64_t row0, int64_t row1) {
    for (int64_t row = row0; row < row1; ++row)
      for (int64_t j = 0; j < HV; ++j) {
        const float* oj = o_.data() + (row * HV + j) * Dv;
        const float* z = gate_logits(row, j);
        const float* sg = sz_.data() + row * vd + j * Dv;
        const float* gn = w.gnorm->data();
        float* yj = y.data() + row * vd + j * Dv;
        float ss = 0.0f;
        for (int64_t e = 0; e < Dv; ++e) ss += oj[e] * oj[e];
        const float inv = 1.0f / std::sqrt(ss / static_cast<float>(Dv) + w.eps);
        for (int64_t e = 0; e < Dv; ++e) yj[e] = gn[e] * (oj[e] * inv) * (w.kda ? sg[e] : silu_s(z[e], sg[e]));
      }
  });
  out_ = Tensor::uninitialized({B, T, w.D});
  ops::linear(y.data(), BT, vd, *w.out_proj, out_.data());
  tape.apply(li, Value::attention_output, out_);
}

void GdnMixerGrad::backward(const Tensor& dout_in, Tensor& dn, GradSink& sink) const {
  const Batch& in = tape_.batch;
  const int li = li_;
  const int64_t B = in.batch, T = in.seq, BT = B * T;
  const int64_t HK = w_.HK, HV = w_.HV, Dk = w_.Dk, Dv = w_.Dv, r = HV / HK, kd = HK * Dk, vd = HV * Dv;
  const bool kda = w_.kda;
  const int64_t zr = kda ? Dk : vd, gw = kda ? Dk : 1, cd = 2 * kd + vd, pr = cd + zr + HV + (kda ? Dk : HV);
  Tensor dout = dout_in.clone();
  sink.put(li, Value::attention_output, dout);
  tape_.block(li, Value::attention_output, dout);
  // Buffers written whole below (products, row passes, the delta-rule backward): uninitialized.
  Tensor dy = Tensor::uninitialized({B, T, vd});
  linear_backward(dout.data(), BT, w_.D, *w_.out_proj, dy.data(), false);
  // y = gnorm * rmsnorm(o) * silu(z) (kda: * sigmoid(zk)) per value head. dproj: z's columns here (kda:
  // dzk, taken through g_b below), b / a's and the conv input's below.
  Tensor dproj = Tensor::uninitialized({B, T, pr});
  Tensor dzk = kda ? Tensor::uninitialized({BT, vd}) : Tensor();
  Tensor dyn = Tensor::uninitialized({B, T, vd}), dO = Tensor::uninitialized({B, T, HV, Dv});
  ops::parallel_rows(BT, vd, [&](int64_t row0, int64_t row1) {
    for (int64_t row = row0; row < row1; ++row)
      for (int64_t j = 0; j < HV; ++j) {
        const float* oj = o_.data() + (row * HV + j) * Dv;
        const float* z = gate_logits(row, j);
        const float* sg = sz_.data() + row * vd + j * Dv;
        const float* gn = w_.gnorm->data();
        const float* dyj = dy.data() + row * vd + j * Dv;
        float* dynj = dyn.data() + row * vd + j * Dv;
        float* dz = kda ? dzk.data() + row * vd + j * Dv : dproj.data() + row * pr + cd + j * Dv;
        float ss = 0.0f;
        for (int64_t e = 0; e < Dv; ++e) ss += oj[e] * oj[e];
        const float inv = 1.0f / std::sqrt(ss / static_cast<float>(Dv) + w_.eps);
        for (int64_t e = 0; e < Dv; ++e) {
          dynj[e] = dyj[e] * (kda ? sg[e] : silu_s(z[e], sg[e]));
          dz[e] = dyj[e] * gn[e] * (oj[e] * inv) * (kda ? sigmoid_d(sg[e]) : silu_grad_s(z[e], sg[e]));
        }
      }
  });
  rmsnorm_backward(o_.data(), w_.gnorm->data(), dyn.data(), dO.data(), BT * HV, Dv, w_.eps, false, false);
  sink.put(li, Value::attention_head_outputs, dO);
  tape_.block(li, Value::attention_head_outputs, dO);

  Tensor dq = Tensor::uninitialized({B, T, HV, Dk}), dk = Tensor::uninitialized({B, T, HV, Dk}),
         dv = Tensor::uninitialized({B, T, HV, Dv}), dg = Tensor::uninitialized(g_.shape()),
         dbeta = Tensor::uninitialized({B, T, HV}), dS0 = Tensor::uninitialized({B, HV, Dk, Dv}), dstates;
  if (sink.wants(li, Value::states)) dstates = Tensor({B, T, HV, Dk, Dv});
  GatedDeltaGradArgs a;
  a.B = B; a.T = T; a.H = HV; a.Dk = Dk; a.Dv = Dv;
  a.q = q_.data(); a.k = k_.data(); a.v = v_.data(); a.g = g_.data(); a.beta = beta_.data(); a.S0 = S0_.data();
  a.g_per_key = kda;
  a.dout = dO.data();
  a.dq = dq.data(); a.dk = dk.data(); a.dv = dv.data(); a.dg = dg.data(); a.dbeta = dbeta.data(); a.dS0 = dS0.data();
  a.dstates = dstates.defined() ? dstates.data() : nullptr;
  a.chunk = kChunk;
  a.ckpt = ckpt_.data();
  gated_delta_backward(a);
  if (dstates.defined()) sink.put(li, Value::states, dstates);
  // state_output feeds only the next call: this call's metric does not depend on it.
  if (sink.wants(li, Value::state_output)) sink.put(li, Value::state_output, Tensor({B, HV, Dk, Dv}));
  if (has_state_ || tape_.write(li, Value::state_input)) sink.put(li, Value::state_input, dS0);

  for (auto [v, t] : {std::pair<Value, Tensor*>{Value::attention_queries, &dq}, {Value::attention_keys, &dk},
                      {Value::attention_values, &dv}, {Value::betas, &dbeta}, {Value::decays, &dg}}) {
    sink.put(li, v, *t);
    tape_.block(li, v, *t);
  }
  // kda: the decay's pre-softplus gradient per key channel, taken through f_b below.
  Tensor dfa = kda ? Tensor::uninitialized({BT, HV * Dk}) : Tensor();
  for (int64_t row = 0; row < BT; ++row)
    for (int64_t j = 0; j < HV; ++j) {
      const float* pb = proj_.data() + row * pr + cd + zr;
      dproj[row * pr + cd + zr + j] = dbeta[row * HV + j] * w_.beta_scale * sigmoid_d(ops::sigmoid(pb[j]));
      for (int64_t d = 0; d < gw; ++d) {
        const int64_t i = (row * HV + j) * gw + d;
        const float dpre = dg[i] * (*w_.neg_A)[j] * softplus_grad((kda ? fa_[i] : pb[HV + j]) + (*w_.dt_bias)[j * gw + d]);
        if (kda) dfa[i] = dpre; else dproj[row * pr + cd + zr + HV + j] = dpre;
      }
    }
  if (kda) {  // the latents g_a(x), f_a(x): in_proj's columns [cd, cd + Dk) and [cd + Dk + HV, pr)
    Tensor dlat = Tensor::uninitialized({BT, Dk});
    for (auto [dsec, W, c0] : {std::tuple<const Tensor*, const Tensor*, int64_t>{&dzk, w_.g_b, cd}, {&dfa, w_.f_b, cd + zr + HV}}) {
      linear_backward(dsec->data(), BT, W->size(0), *W, dlat.data(), false);
      for (int64_t row = 0; row < BT; ++row)
        std::memcpy(dproj.data() + row * pr + c0, dlat.data() + row * Dk, sizeof(float) * static_cast<size_t>(Dk));
    }
  }
  // Conv + SiLU: q / k of value head j came from key head j / r.
  Tensor du = Tensor::uninitialized({B, T, cd});
  ops::parallel_rows(BT, cd, [&](int64_t row0, int64_t row1) {
    for (int64_t row = row0; row < row1; ++row) {
      float* d = du.data() + row * cd;
      std::memset(d, 0, sizeof(float) * static_cast<size_t>(2 * kd));
      for (int64_t j = 0; j < HV; ++j)
        for (int64_t e = 0; e < Dk; ++e) {
          d[(j / r) * Dk + e] += dq[(row * HV + j) * Dk + e];
          d[kd + (j / r) * Dk + e] += dk[(row * HV + j) * Dk + e];
        }
      for (int64_t c = 0; c < vd; ++c) d[2 * kd + c] = dv[row * vd + c];
      const float* uv = u_.data() + row * cd;
      const float* sg = su_.data() + row * cd;
      for (int64_t c = 0; c < cd; ++c) d[c] *= silu_grad_s(uv[c], sg[c]);
    }
  });
  causal_conv1d_backward(du.data(), B, T, cd, w_.K, w_.conv_wT->data(), dproj.data(), pr);
  linear_backward(dproj.data(), BT, pr, *w_.in_proj, dn.data(), false);
  if (masked_) detail::apply_row_mask(dn, in);
}

}  // namespace mixlens::grad
