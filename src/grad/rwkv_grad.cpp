// Backward of RWKV-4's block stack (RwkvModel::forward, transformers RwkvModel in eval mode): ln_out,
// then each block from last to first, recomputed from its recorded input:
//   h0 = pre_ln(h) (block 0 only), h1 = h0 + time_mix(ln1(h0)),
//   h2 = h1 + sigmoid(receptance(xr)) * value(relu(key(xk))^2)  (xr, xk: token shifts of ln2(h1)),
//   out = h2 / 2 after every rescale_every-th block.
// The state the call starts from (num | den | max, both shift states) is a constant of the call; its
// gradient is served as state_input's.
#include <algorithm>
#include <cstring>

#include "grad/families.h"
#include "grad/ops_grad.h"
#include "grad/rwkv_grad.h"
#include "hooks/serve.h"
#include "models/common.h"
#include "models/mamba2_hybrid.h"
#include "ops/ops.h"

namespace mixlens::grad {

namespace {

void layernorm_rows(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y, int64_t D, float eps) {
  ops::layernorm(x.data(), w.data(), b.data(), y.data(), x.numel() / D, D, eps);
}

}  // namespace

void rwkv_backward(const detail::RwkvParts& p, const Tape& tape, const Tensor& dlogits, GradSink& sink) {
  const int64_t B = tape.batch.batch, T = tape.batch.seq, D = p.D, BT = B * T, I = p.I;
  const detail::RwkvMixerDims& dims = p.mixer->dims();
  const int64_t rn = dims.row_numel();
  const Tensor dhf = head_backward(tape, dlogits, *p.lm_head, 1.0f, sink);
  Tensor dh({B, T, D});
  layernorm_backward(tape.final_hidden.data(), p.ln_out_w->data(), dhf.data(), dh.data(), BT, D, 1e-5f, false);
  const auto& before = static_cast<const detail::RowStateCache&>(*tape.cache_before);
  const std::vector<int64_t> first = detail::first_real_tokens(tape.batch);
  Tensor h0({B, T, D}), n1({B, T, D}), h1({B, T, D}), n2({B, T, D}), dn({B, T, D}), dn2({B, T, D});
  for (int64_t i = p.L - 1; i >= 0; --i) {
    const int li = static_cast<int>(i);
    const size_t si = static_cast<size_t>(i);
    sink.put(li, Value::layer_output, dh);
    if (!sink.needs_below(li)) return;
    tape.block(li, Value::layer_output, dh);
    if (p.rescale_every > 0 && (i + 1) % p.rescale_every == 0)
      for (int64_t k = 0; k < dh.numel(); ++k) dh[k] *= 0.5f;
    const Tensor& hin = tape.layer_inputs[si];
    if (i == 0) layernorm_rows(hin, *p.pre_ln_w, *p.pre_ln_b, h0, D, p.eps);
    else std::memcpy(h0.data(), hin.data(), sizeof(float) * static_cast<size_t>(hin.numel()));
    const Tensor& ln1w = (*p.ln_w)[2 * si], &ln1b = (*p.ln_b)[2 * si];
    const Tensor& ln2w = (*p.ln_w)[2 * si + 1], &ln2b = (*p.ln_b)[2 * si + 1];
    layernorm_rows(h0, ln1w, ln1b, n1, D, p.eps);
    // The state the call started from, with a state_input write applied (a constant of the call).
    Tensor S0 = before.state[si].clone();
    tape.apply(li, Value::state_input, S0);
    RwkvMixerGrad mix(*p.mixer, (*p.layers)[si], li, n1, S0, tape);
    const Tensor& att = mix.output();
    for (int64_t k = 0; k < h1.numel(); ++k) h1[k] = h0[k] + att[k];
    layernorm_rows(h1, ln2w, ln2b, n2, D, p.eps);
    // Channel mixing: m = r * value(relu(key(xk))^2), r = sigmoid(receptance(xr)).
    const detail::RwkvFeedForward& ff = (*p.ffn)[si];
    Tensor fstart({B, D}), xr({B, T, D}), xk({B, T, D}), r({B, T, D}), vv({B, T, D});
    for (int64_t b = 0; b < B; ++b) std::copy_n(S0.data() + b * rn + dims.ffn_shift(), D, fstart.data() + b * D);
    detail::token_shift_mix(n2, fstart.data(), first, ff.mix_r.data(), xr);
    detail::token_shift_mix(n2, fstart.data(), first, ff.mix_k.data(), xk);
    ops::linear(xr.data(), BT, D, ff.receptance, r.data());
    ops::sigmoid(r.data(), r.data(), BT * D);
    const Tensor kv = detail::relu2_mlp(ff.key, ff.value, xk.data(), BT, D, I);
    Tensor dm = dh.clone();
    sink.put(li, Value::mlp_output, dm);
    tape.block(li, Value::mlp_output, dm);
    Tensor dvv({B, T, D}), drr({B, T, D});
    for (int64_t k = 0; k < BT * D; ++k) {
      dvv[k] = dm[k] * r[k];
      drr[k] = dm[k] * kv[k] * sigmoid_d(r[k]);
    }
    Tensor dx({B, T, D}), dfstart({B, D}), dfprev({B, T, D});
    std::fill_n(dn2.data(), dn2.numel(), 0.0f);
    relu2_mlp_backward(ff.key, ff.value, xk.data(), dvv.data(), BT, D, I, dx.data(), false);
    token_shift_mix_backward(dx, first, ff.mix_k.data(), dn2, dfstart.data(), &dfprev);
    linear_backward(drr.data(), BT, D, ff.receptance, dx.data(), false);
    token_shift_mix_backward(dx, first, ff.mix_r.data(), dn2, dfstart.data(), &dfprev);
    layernorm_backward(h1.data(), ln2w.data(), dn2.data(), dh.data(), BT, D, p.eps, true);  // dL/dh1
    // Time mixing.
    Tensor dS0({B, rn}), dstates;
    if (sink.wants(li, Value::states)) dstates = Tensor({B, T, rn});
    mix.backward(dh, dn, dS0, dstates, sink);
    layernorm_backward(h0.data(), ln1w.data(), dn.data(), dh.data(), BT, D, p.eps, true);  // dL/dh0
    for (int64_t b = 0; b < B; ++b) std::copy_n(dfstart.data() + b * D, D, dS0.data() + b * rn + dims.ffn_shift());
    if (dstates.defined()) {  // the channel-mix shift part
      shift_state_adjoint(dfprev, dfstart, first, dims.ffn_shift(), dstates);
      sink.put(li, Value::states, dstates);
    }
    if (sink.wants(li, Value::state_output)) sink.put(li, Value::state_output, Tensor({B, rn}));
    if (before.has_state || tape.write(li, Value::state_input)) sink.put(li, Value::state_input, dS0);
    if (i == 0) {
      Tensor d0 = dh.clone();
      layernorm_backward(hin.data(), p.pre_ln_w->data(), d0.data(), dh.data(), BT, D, p.eps, false);
    }
    sink.put(li, Value::layer_input, dh);
    tape.block(li, Value::layer_input, dh);
  }
  sink.put(-1, Value::embed_output, dh);
}

}  // namespace mixlens::grad
