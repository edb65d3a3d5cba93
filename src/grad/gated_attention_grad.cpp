// Backward of the Qwen gated softmax attention (QwenHybrid::attention, transformers
// Qwen3_5Attention): recomputed from the normed input with the recorded writes re-applied, then
// o_proj, the sigmoid output gate, causal GQA attention (keys cached before the call are
// constants), RoPE, q_norm / k_norm ((1 + w)) and the q / k / v projections. The attention and RoPE
// backwards are the shared core (grad/attention_grad.cpp).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "grad/ops_grad.h"
#include "grad/qwen_grad.h"
#include "mixers/attention.h"
#include "ops/ops.h"

namespace mixlens::grad {

AttnMixerGrad::AttnMixerGrad(const AttnView& w, int li, const Tensor& n, const detail::HybridCache& before,
                             const std::vector<int64_t>& pos, const Tape& tape)
    : w_(w), li_(li), tape_(tape), before_(before), pos_(pos) {
  const int64_t B = tape.batch.batch, T = tape.batch.seq, BT = B * T, d = w.hd, H = w.H, Hkv = w.Hkv;
  // A recorded call kept the projections, the attention output and the mixer output (Kept::attn_*,
  // mixer_output): then no product is run again; otherwise everything is recomputed from n.
  const Tensor* kqg = tape.kept_of(li, Kept::attn_q_gate);
  const Tensor* kk = tape.kept_of(li, Kept::attn_k);
  const Tensor* kv = tape.kept_of(li, Kept::attn_v);
  const Tensor* katt = tape.kept_of(li, Kept::attn_core);
  const Tensor* kout = tape.kept_of(li, Kept::mixer_output);
  const bool kept = kqg && kk && kv && katt && kout;
  Tensor qg;
  if (kept) {
    qg = *kqg;
  } else {
    n_ = n.clone();
    qg = Tensor::uninitialized({BT, H * 2 * d});
    ops::linear(n_.data(), BT, w.D, *w.q_proj, qg.data());
  }
  qpre_ = Tensor::uninitialized({B, T, H, d});
  gate_ = Tensor::uninitialized({B, T, H * d});
  for (int64_t row = 0; row < BT; ++row)
    for (int64_t h = 0; h < H; ++h) {  // per head [query | gate]
      const float* src = std::as_const(qg).data() + (row * H + h) * 2 * d;
      std::memcpy(qpre_.data() + (row * H + h) * d, src, sizeof(float) * static_cast<size_t>(d));
      std::memcpy(gate_.data() + (row * H + h) * d, src + d, sizeof(float) * static_cast<size_t>(d));
    }
  if (kept) {
    kpre_ = *kk;
    v_ = *kv;  // as the forward used it (after writes)
  } else {
    kpre_ = Tensor::uninitialized({B, T, Hkv, d});
    v_ = Tensor::uninitialized({B, T, Hkv, d});
    ops::linear(n_.data(), BT, w.D, *w.k_proj, kpre_.data());
    ops::linear(n_.data(), BT, w.D, *w.v_proj, v_.data());
    tape.apply(li, Value::attn_values, v_);
  }
  q_ = Tensor::uninitialized({B, T, H, d});
  k_ = Tensor::uninitialized({B, T, Hkv, d});
  ops::rmsnorm(qpre_.data(), w.q_norm->data(), q_.data(), BT * H, d, w.eps, true);
  ops::rmsnorm(std::as_const(kpre_).data(), w.k_norm->data(), k_.data(), BT * Hkv, d, w.eps, true);
  detail::apply_rope(q_.data(), BT, H, d, w.rot, pos.data(), *w.inv_freq);
  detail::apply_rope(k_.data(), BT, Hkv, d, w.rot, pos.data(), *w.inv_freq);
  tape.apply(li, Value::attn_queries, q_);
  tape.apply(li, Value::attn_keys, k_);
  kv_ = before.kv[static_cast<size_t>(li)];
  past_ = kv_.len;
  kv_.append(k_.data(), std::as_const(v_).data(), B, T, Hkv * d);
  tape.apply(li, Value::attn_gate, gate_);
  if (kept) {
    att_ = *katt;
    out_ = *kout;
    return;
  }
  att_ = Tensor::uninitialized({B, T, H, d});
  detail::causal_attention(q_.data(), B, T, H, Hkv, d, past_, kv_, before.key_mask, att_.data());
  Tensor ag = Tensor::uninitialized({BT, H * d});
  for (int64_t e = 0; e < ag.numel(); ++e) ag[e] = att_[e] * ops::sigmoid(gate_[e]);
  out_ = Tensor::uninitialized({B, T, w.D});
  ops::linear(ag.data(), BT, H * d, *w.o_proj, out_.data());
  tape.apply(li, Value::attn_output, out_);
}

void AttnMixerGrad::backward(const Tensor& dout_in, Tensor& dn, GradSink& sink) const {
  const int li = li_;
  const int64_t B = tape_.batch.batch, T = tape_.batch.seq, BT = B * T, d = w_.hd, H = w_.H, Hkv = w_.Hkv;
  Tensor dout = dout_in.clone();
  sink.put(li, Value::attn_output, dout);
  tape_.block(li, Value::attn_output, dout);
  // Every buffer below is written whole (products, row passes, the attention backward): uninitialized.
  Tensor dag = Tensor::uninitialized({B, T, H * d});
  linear_backward(dout.data(), BT, w_.D, *w_.o_proj, dag.data(), false);
  Tensor dgate = Tensor::uninitialized({B, T, H * d}), datt = Tensor::uninitialized({B, T, H, d});
  ops::parallel_rows(BT, H * d, [&](int64_t r0, int64_t r1) {  // vectorized sigmoid, rows on the pool
    const int64_t e0 = r0 * H * d, e1 = r1 * H * d;
    ops::sigmoid(gate_.data() + e0, datt.data() + e0, e1 - e0);
    for (int64_t e = e0; e < e1; ++e) {
      const float s = datt[e];
      dgate[e] = dag[e] * att_[e] * sigmoid_d(s);
      datt[e] = dag[e] * s;
    }
  });
  sink.put(li, Value::attn_gate, dgate);
  tape_.block(li, Value::attn_gate, dgate);
  Tensor dq = Tensor::uninitialized({B, T, H, d}), dk = Tensor::uninitialized({B, T, Hkv, d}),
         dv = Tensor::uninitialized({B, T, Hkv, d});
  causal_attention_backward(q_.data(), B, T, H, Hkv, d, past_, kv_, before_.key_mask, datt.data(), dq.data(),
                            dk.data(), dv.data());
  sink.put(li, Value::attn_queries, dq);
  sink.put(li, Value::attn_keys, dk);
  sink.put(li, Value::attn_values, dv);
  tape_.block(li, Value::attn_queries, dq);
  tape_.block(li, Value::attn_keys, dk);
  tape_.block(li, Value::attn_values, dv);
  apply_rope_backward(dq.data(), BT, H, d, w_.rot, pos_.data(), *w_.inv_freq);
  apply_rope_backward(dk.data(), BT, Hkv, d, w_.rot, pos_.data(), *w_.inv_freq);
  Tensor dqpre = Tensor::uninitialized({B, T, H, d}), dkpre = Tensor::uninitialized({B, T, Hkv, d});
  rmsnorm_backward(qpre_.data(), w_.q_norm->data(), dq.data(), dqpre.data(), BT * H, d, w_.eps, true, false);
  rmsnorm_backward(kpre_.data(), w_.k_norm->data(), dk.data(), dkpre.data(), BT * Hkv, d, w_.eps, true, false);
  Tensor dqg = Tensor::uninitialized({BT, H * 2 * d});
  for (int64_t row = 0; row < BT; ++row)
    for (int64_t h = 0; h < H; ++h) {
      float* dst = dqg.data() + (row * H + h) * 2 * d;
      std::memcpy(dst, dqpre.data() + (row * H + h) * d, sizeof(float) * static_cast<size_t>(d));
      std::memcpy(dst + d, dgate.data() + (row * H + h) * d, sizeof(float) * static_cast<size_t>(d));
    }
  linear_backward(dqg.data(), BT, H * 2 * d, *w_.q_proj, dn.data(), false);
  linear_backward(dkpre.data(), BT, Hkv * d, *w_.k_proj, dn.data(), true);
  linear_backward(dv.data(), BT, Hkv * d, *w_.v_proj, dn.data(), true);
}

}  // namespace mixlens::grad
