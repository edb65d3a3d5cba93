#include "mixers/gated_delta_mixer.h"

#include <cmath>
#include <cstring>

#include "hooks/serve.h"
#include "mixers/gated_delta.h"
#include "ops/ops.h"

namespace mixlens::detail {

void GatedDeltaMixer::load(const io::WeightStore& w, const std::string& m, GatedDeltaMixerWeights& l) const {
  l.conv_wT = transpose_conv(w.get(m + "conv1d.weight", {g_.conv_dim(), 1, K_}));
  const Tensor A_log = w.get(m + "A_log", {g_.HV});
  l.neg_A = Tensor({g_.HV});
  for (int64_t h = 0; h < g_.HV; ++h) l.neg_A[h] = -std::exp(A_log[h]);
  l.dt_bias = w.get(m + "dt_bias", {g_.HV});
  l.gnorm = w.get(m + "norm.weight", {g_.Dv});
  l.out_proj = w.get_matmul(m + "out_proj.weight", {D_, g_.value_dim()});
}

// Qwen3_5GatedDeltaNet.forward.
Tensor GatedDeltaMixer::forward(const GatedDeltaMixerWeights& l, const Tensor& n_in, const Batch& in, bool masked,
                                const GatedDeltaMixerCall& call) const {
  const int li = call.layer;
  Listener* ls = call.ls;
  const int64_t B = in.batch, T = in.seq, BT = B * T;
  const int64_t HK = g_.HK, HV = g_.HV, Dk = g_.Dk, Dv = g_.Dv, r = HV / HK;
  const int64_t cd = g_.conv_dim(), vd = g_.value_dim(), pr = g_.proj_rows();
  const float* n = n_in.data();
  Tensor nm;
  if (masked) {  // apply_mask_to_padding_states on the mixer input only
    nm = n_in.clone();
    apply_row_mask(nm, in);
    n = nm.data();
  }
  Tensor proj = Tensor::uninitialized({B, T, pr});
  ops::linear(n, BT, D_, l.in_proj, proj.data());
  if (call.tape) call.tape->keep(li, grad::Kept::in_proj, proj);  // read-only from here on
  Tensor qkv = Tensor::uninitialized({B, T, cd});
  ops::causal_conv1d(proj.data(), pr, B, T, cd, K_, l.conv_wT.data(), nullptr,
                     call.conv->data(), qkv.data(), true);
  // Split, repeating q/k heads for value heads (value head j reads key head j / r).
  Tensor q = Tensor::uninitialized({B, T, HV, Dk}), k = Tensor::uninitialized({B, T, HV, Dk}), v = Tensor::uninitialized({B, T, HV, Dv});
  ops::parallel_rows(BT, 2 * HV * Dk + vd, [&](int64_t row0, int64_t row1) {
    for (int64_t row = row0; row < row1; ++row) {
      const float* src = qkv.data() + row * cd;
      for (int64_t j = 0; j < HV; ++j) {
        std::memcpy(q.data() + (row * HV + j) * Dk, src + (j / r) * Dk, sizeof(float) * static_cast<size_t>(Dk));
        std::memcpy(k.data() + (row * HV + j) * Dk, src + g_.key_dim() + (j / r) * Dk, sizeof(float) * static_cast<size_t>(Dk));
      }
      std::memcpy(v.data() + row * vd, src + 2 * g_.key_dim(), sizeof(float) * static_cast<size_t>(vd));
    }
  });
  visit_if(ls, li, Value::attention_queries, q);
  visit_if(ls, li, Value::attention_keys, k);
  visit_if(ls, li, Value::attention_values, v);
  Tensor beta = Tensor::uninitialized({B, T, HV}), g = Tensor::uninitialized({B, T, HV});
  for (int64_t row = 0; row < BT; ++row)
    for (int64_t j = 0; j < HV; ++j) {
      const float* pb = proj.data() + row * pr + cd + vd;
      beta[row * HV + j] = ops::sigmoid(pb[j]);
      g[row * HV + j] = l.neg_A[j] * ops::softplus(pb[HV + j] + l.dt_bias[j]);
    }
  visit_if(ls, li, Value::betas, beta);
  visit_if(ls, li, Value::decays, g);

  Tensor& S = *call.ssm;
  visit_state_input(li, S, call.has_state, ls, Shape{HV, Dk, Dv}, [](const Tensor& s) { return s.clone(); },
                    [](const Tensor& o, Tensor& s) {
                      std::memcpy(s.data(), o.data(), sizeof(float) * static_cast<size_t>(s.numel()));
                    });
  Tensor o = Tensor::uninitialized({B, T, HV, Dv}), states;
  if (ls && ls->wants(li, Value::states)) states = ls->stack_buffer({B, T, HV, Dk, Dv});
  GatedDeltaArgs a;
  a.B = B; a.T = T; a.H = HV; a.Dk = Dk; a.Dv = Dv;
  a.q = q.data(); a.k = k.data(); a.v = v.data(); a.g = g.data(); a.beta = beta.data();
  a.S = S.data(); a.o = o.data();
  a.states = states.defined() ? states.data() : nullptr;
  // A gradient call keeps the state entering every chunk (with o below) when the scan runs whole on
  // the chunked kernel (no per-token stops): the backward's checkpoints, so it does not rerun the scan.
  Tensor entry;
  if (call.tape && call.chunked && !(ls && ls->wants(li, Value::state))) {
    entry = Tensor::uninitialized({B, HV, (T + a.chunk - 1) / a.chunk, Dk, Dv});
    a.chunk_entry = entry.data();
  }
  // The scan stops where the per-token state is wanted; the served layout is the cache's.
  scan_with_stops(
      ls, li, T,
      [&](int64_t t0, int64_t t1) {
        a.t_begin = t0;
        a.t_end = t1;
        if (call.chunked) gated_delta_chunked(a); else gated_delta_recurrent(a);
      },
      [&](int64_t t) {
        if (ls->visit_state(li, t, S, S.shape()) && states.defined()) copy_state_into(S, states, t);
        a.S = S.data();  // a write may have replaced the tensor
      });
  if (states.defined()) {
    ls->visit(li, Value::states, states, states.shape());
    ls->recycle_stack(std::move(states));
  }
  visit_if(ls, li, Value::state_output, S);  // served layout is the cache layout: writes land in place
  visit_if(ls, li, Value::attention_head_outputs, o);
  if (entry.defined()) {  // o as the gated norm reads it (after writes)
    call.tape->keep(li, grad::Kept::chunk_states, entry);
    call.tape->keep(li, grad::Kept::head_outputs, o);
  }

  // Qwen3_5RMSNormGated: norm first (plain weight), then * silu(z), per value head over Dv.
  Tensor y = Tensor::uninitialized({B, T, vd});
  ops::parallel_rows(BT, vd, [&](int64_t row0, int64_t row1) {
    for (int64_t row = row0; row < row1; ++row)
      for (int64_t j = 0; j < HV; ++j) {
        const float* oj = o.data() + (row * HV + j) * Dv;
        const float* z = proj.data() + row * pr + cd + j * Dv;
        float* yj = y.data() + row * vd + j * Dv;
        float ss = 0.0f;
        for (int64_t e = 0; e < Dv; ++e) ss += oj[e] * oj[e];
        const float inv = 1.0f / std::sqrt(ss / static_cast<float>(Dv) + eps_);
        for (int64_t e = 0; e < Dv; ++e) yj[e] = l.gnorm[e] * (oj[e] * inv);
        ops::mul_silu(yj, z, yj, Dv);  // * silu(z), vectorized
      }
  });
  Tensor out = Tensor::uninitialized({B, T, D_});
  ops::linear(y.data(), BT, vd, l.out_proj, out.data());
  visit_if(ls, li, Value::attention_output, out);
  return out;
}

}  // namespace mixlens::detail
