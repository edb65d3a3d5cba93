// Backward of the attention mixer (mixers/attention_mixer.*): recomputed from the normed input (in_dim wide:
// Zamba2's concatenated [h, embeddings]) with
// the recorded writes re-applied (or taken from what a recorded forward kept), then o_proj and
// out_multiplier, the sigmoid output gate, causal GQA attention at the mixer's scale (keys cached before the call are
// constants), RoPE, the q / k norms, key_multiplier, the q / k / v projections with their LoRA adapters
// (Zamba2, this depth's) and in_multiplier. MLA (Kimi-Linear's latent attention, AttentionMixerDims::mla):
// values v_hd wide (zero-padded to hd for the shared core), keys [k_nope | k_rope] through kv_b_proj,
// kv_a_layernorm and kv_a_proj_with_mqa (k_rope shared by the heads: its gradient summed over them), queries
// through q_proj or q_b_proj, q_a_layernorm and q_a_proj.
// The attention and RoPE backwards are the shared core (grad/attention_grad.cpp).
#include <cstring>
#include <utility>

#include "grad/families.h"
#include "grad/ops_grad.h"
#include "ops/ops.h"

namespace mixlens::grad {

namespace {
const float* opt(const Tensor& t) { return t.defined() ? t.data() : nullptr; }

void scale_by(Tensor& t, float s) {
  if (s == 1.0f) return;
  for (int64_t e = 0; e < t.numel(); ++e) t[e] *= s;
}
}  // namespace

AttentionMixerGrad::AttentionMixerGrad(const detail::AttentionMixer& mixer, const detail::AttentionMixerWeights& w,
                                       int li, const Tensor& n, const AttentionCallState& call, const Tape& tape)
    : d_(mixer.dims()), inv_freq_(mixer.inv_freq()), w_(w), li_(li), tape_(tape), call_(call) {
  const int64_t B = tape.batch.batch, T = tape.batch.seq, BT = B * T, d = d_.hd, H = d_.H, Hkv = d_.Hkv, D = d_.D,
                Din = d_.in_dim();
  const bool lora = d_.lora_rank > 0;
  const bool norm = d_.qk_norm != detail::AttentionQkNorm::none;
  const std::vector<int64_t>& pos = *call.pos;
  // A recorded call kept the projections, the attention output and the mixer output (Kept::attn_*):
  // then no product is run again; otherwise everything is recomputed from n.
  const Tensor* kqp = tape.kept_of(li, Kept::attn_q_gate);
  const Tensor* kk = tape.kept_of(li, Kept::attn_k);
  const Tensor* kv = tape.kept_of(li, Kept::attn_v);
  const Tensor* katt = tape.kept_of(li, Kept::attn_core);
  const Tensor* kout = tape.kept_of(li, Kept::attn_output);
  // MLA recomputes (its latent norms' backward reads their inputs; the forward keeps nothing for it).
  const bool mla = d_.mla();
  const bool kept = !mla && kqp && kk && kv && katt && kout;
  const int64_t dvh = d_.value_hd();
  Tensor x, qp;
  if (kept) {
    qp = *kqp;
  } else {
    x = n.clone();
    scale_by(x, d_.in_multiplier);
    qp = d_.gate ? Tensor::uninitialized({BT, d_.q_rows()}) : Tensor::uninitialized({B, T, H, d});
    if (mla) detail::latent_queries(d_, w, std::as_const(x).data(), BT, qp.data(), &qa_);
    else ops::linear(std::as_const(x).data(), BT, Din, w.q_proj, qp.data(), opt(w.q_bias));
    if (lora) detail::add_lora(std::as_const(x).data(), BT, w.q_lora_a, w.q_lora_b, qp);
  }
  if (d_.gate) {
    qpre_ = Tensor::uninitialized({B, T, H, d});
    gate_ = Tensor::uninitialized({B, T, H * d});
    for (int64_t row = 0; row < BT; ++row)
      for (int64_t h = 0; h < H; ++h) {  // per head [query | gate]
        const float* src = std::as_const(qp).data() + (row * H + h) * 2 * d;
        std::memcpy(qpre_.data() + (row * H + h) * d, src, sizeof(float) * static_cast<size_t>(d));
        std::memcpy(gate_.data() + (row * H + h) * d, src + d, sizeof(float) * static_cast<size_t>(d));
      }
  } else {
    qpre_ = qp.reshape({B, T, H, d});  // read only
  }
  if (kept) {
    kpre_ = *kk;
    v_ = *kv;  // as the forward used it (after writes)
  } else {
    kpre_ = Tensor::uninitialized({B, T, Hkv, d});
    v_ = Tensor::uninitialized({B, T, Hkv, dvh});
    if (mla) {
      detail::latent_keys_values(d_, w, std::as_const(x).data(), BT, kpre_.data(), v_.data(), &ckv_);
    } else {
      ops::linear(std::as_const(x).data(), BT, Din, w.k_proj, kpre_.data(), opt(w.k_bias));
      ops::linear(std::as_const(x).data(), BT, Din, w.v_proj, v_.data(), opt(w.v_bias));
    }
    if (lora) {
      detail::add_lora(std::as_const(x).data(), BT, w.k_lora_a, w.k_lora_b, kpre_);
      detail::add_lora(std::as_const(x).data(), BT, w.v_lora_a, w.v_lora_b, v_);
    }
    scale_by(kpre_, d_.key_multiplier);
    tape.apply(li, Value::attn_values, v_);
  }
  if (norm) {
    q_ = Tensor::uninitialized({B, T, H, d});
    k_ = Tensor::uninitialized({B, T, Hkv, d});
    const int64_t gq = d_.qk_norm == detail::AttentionQkNorm::whole ? H : 1, gk = gq == 1 ? 1 : Hkv;
    ops::rmsnorm(std::as_const(qpre_).data(), w.q_norm.data(), q_.data(), BT * H / gq, gq * d, d_.eps, d_.qk_norm_centred);
    ops::rmsnorm(std::as_const(kpre_).data(), w.k_norm.data(), k_.data(), BT * Hkv / gk, gk * d, d_.eps,
                 d_.qk_norm_centred);
  } else {
    q_ = qpre_.clone();
    k_ = kpre_.clone();
  }
  if (d_.rope) {
    detail::apply_rope(q_.data(), BT, H, d, d_.rot, pos.data(), inv_freq_);
    detail::apply_rope(k_.data(), BT, Hkv, d, d_.rot, pos.data(), inv_freq_);
  }
  tape.apply(li, Value::attn_queries, q_);
  tape.apply(li, Value::attn_keys, k_);
  kv_ = *call.kv;
  past_ = kv_.len;
  const Tensor vk = dvh == d ? v_ : detail::pad_heads(v_, d);  // the cache's one head width (as the forward)
  kv_.append(std::as_const(k_).data(), vk.data(), B, T, Hkv * d);
  if (d_.gate) tape.apply(li, Value::attn_gate, gate_);
  if (kept) {
    att_ = *katt;
    out_ = *kout;
    return;
  }
  att_ = Tensor::uninitialized({B, T, H, d});
  detail::causal_attention(std::as_const(q_).data(), B, T, H, Hkv, d, past_, kv_, *call.key_mask, att_.data(), nullptr,
                           d_.scale, d_.window);
  Tensor ag = att_;
  if (d_.gate) {
    ag = Tensor::uninitialized({BT, H * d});
    for (int64_t e = 0; e < ag.numel(); ++e) ag[e] = att_[e] * ops::sigmoid(gate_[e]);
  }
  if (dvh != d) ag = detail::unpad_heads(ag, dvh);
  out_ = Tensor::uninitialized({B, T, D});
  ops::linear(std::as_const(ag).data(), BT, H * dvh, w.o_proj, out_.data(), opt(w.o_bias));
  scale_by(out_, d_.out_multiplier);
  tape.apply(li, Value::attn_output, out_);
}

void AttentionMixerGrad::backward(const Tensor& dout_in, Tensor& dn, GradSink& sink) const {
  const int li = li_;
  const int64_t B = tape_.batch.batch, T = tape_.batch.seq, BT = B * T, d = d_.hd, H = d_.H, Hkv = d_.Hkv, D = d_.D;
  const bool norm = d_.qk_norm != detail::AttentionQkNorm::none;
  const std::vector<int64_t>& pos = *call_.pos;
  Tensor dout = dout_in.clone();
  sink.put(li, Value::attn_output, dout);
  tape_.block(li, Value::attn_output, dout);
  scale_by(dout, d_.out_multiplier);
  // Every buffer below is written whole (products, row passes, the attention backward): uninitialized.
  const int64_t dvh = d_.value_hd();
  Tensor dag = Tensor::uninitialized({B, T, H, dvh});
  linear_backward(dout.data(), BT, D, w_.o_proj, dag.data(), false);
  if (dvh != d) dag = detail::pad_heads(dag, d);  // the padding's outputs were dropped: zero gradient
  Tensor datt = dag, dgate;
  if (d_.gate) {
    dgate = Tensor::uninitialized({B, T, H * d});
    datt = Tensor::uninitialized({B, T, H, d});
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
  }
  Tensor dq = Tensor::uninitialized({B, T, H, d}), dk = Tensor::uninitialized({B, T, Hkv, d}),
         dv = Tensor::uninitialized({B, T, Hkv, d});
  causal_attention_backward(q_.data(), B, T, H, Hkv, d, past_, kv_, *call_.key_mask, datt.data(), dq.data(),
                            dk.data(), dv.data(), d_.scale, d_.window);
  if (dvh != d) dv = detail::unpad_heads(dv, dvh);
  sink.put(li, Value::attn_queries, dq);
  sink.put(li, Value::attn_keys, dk);
  sink.put(li, Value::attn_values, dv);
  tape_.block(li, Value::attn_queries, dq);
  tape_.block(li, Value::attn_keys, dk);
  tape_.block(li, Value::attn_values, dv);
  if (d_.rope) {
    apply_rope_backward(dq.data(), BT, H, d, d_.rot, pos.data(), inv_freq_);
    apply_rope_backward(dk.data(), BT, Hkv, d, d_.rot, pos.data(), inv_freq_);
  }
  if (d_.mla()) return latent_backward(dq, dk, dv, dn);  // no RoPE, norms, gate, biases or multipliers
  Tensor dqpre = dq, dkpre = dk;
  if (norm) {
    dqpre = Tensor::uninitialized({B, T, H, d});
    dkpre = Tensor::uninitialized({B, T, Hkv, d});
    const int64_t gq = d_.qk_norm == detail::AttentionQkNorm::whole ? H : 1, gk = gq == 1 ? 1 : Hkv;  // rows of g heads
    rmsnorm_backward(qpre_.data(), w_.q_norm.data(), dq.data(), dqpre.data(), BT * H / gq, gq * d, d_.eps,
                     d_.qk_norm_centred, false);
    rmsnorm_backward(kpre_.data(), w_.k_norm.data(), dk.data(), dkpre.data(), BT * Hkv / gk, gk * d, d_.eps,
                     d_.qk_norm_centred, false);
  }
  scale_by(dkpre, d_.key_multiplier);
  Tensor dqp = dqpre;  // the gradient of q_proj's output (per head [query | gate] with the gate)
  if (d_.gate) {
    Tensor dqg = dqp = Tensor::uninitialized({BT, H * 2 * d});
    for (int64_t row = 0; row < BT; ++row)
      for (int64_t h = 0; h < H; ++h) {
        float* dst = dqg.data() + (row * H + h) * 2 * d;
        std::memcpy(dst, dqpre.data() + (row * H + h) * d, sizeof(float) * static_cast<size_t>(d));
        std::memcpy(dst + d, dgate.data() + (row * H + h) * d, sizeof(float) * static_cast<size_t>(d));
      }
    linear_backward(dqg.data(), BT, H * 2 * d, w_.q_proj, dn.data(), false);
  } else {
    linear_backward(dqpre.data(), BT, H * d, w_.q_proj, dn.data(), false);
  }
  linear_backward(dkpre.data(), BT, Hkv * d, w_.k_proj, dn.data(), true);
  linear_backward(dv.data(), BT, Hkv * d, w_.v_proj, dn.data(), true);
  if (d_.lora_rank > 0) {  // Zamba2: each adapter adds up(down(x)) to its projection
    lora_backward(dqp.data(), BT, d_.q_rows(), w_.q_lora_a, w_.q_lora_b, dn.data());
    lora_backward(dkpre.data(), BT, Hkv * d, w_.k_lora_a, w_.k_lora_b, dn.data());
    lora_backward(dv.data(), BT, Hkv * d, w_.v_lora_a, w_.v_lora_b, dn.data());
  }
  scale_by(dn, d_.in_multiplier);
}

void AttentionMixerGrad::latent_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, Tensor& dn) const {
  const int64_t BT = tape_.batch.batch * tape_.batch.seq, H = d_.H, d = d_.hd, nope = d_.qk_nope, rope = d_.qk_rope,
                vh = d_.v_hd, r = d_.kv_lora_rank, ca = r + rope, nv = nope + vh, qr = d_.q_lora_rank;
  // Queries: q_proj, or q_b_proj(q_a_layernorm(q_a_proj(x))).
  if (qr == 0) {
    linear_backward(dq.data(), BT, H * d, w_.q_proj, dn.data(), false);
  } else {
    Tensor dqa_n = Tensor::uninitialized({BT, qr}), dqa = Tensor::uninitialized({BT, qr});
    linear_backward(dq.data(), BT, H * d, w_.q_b_proj, dqa_n.data(), false);
    rmsnorm_backward(qa_.data(), w_.q_a_norm.data(), dqa_n.data(), dqa.data(), BT, qr, d_.latent_eps, false, false);
    linear_backward(dqa.data(), BT, qr, w_.q_a_proj, dn.data(), false);
  }
  // Keys / values: kv_b_proj's output per head [k_nope | v]; k_rope (ckv's last columns) is every head's.
  Tensor dkvb = Tensor::uninitialized({BT, H * nv}), dckv({BT, ca}), lat = Tensor::uninitialized({BT, r}),
         dlat_n = Tensor::uninitialized({BT, r});
  for (int64_t row = 0; row < BT; ++row) {
    for (int64_t h = 0; h < H; ++h) {
      const float* dkh = dk.data() + (row * H + h) * d;
      float* dst = dkvb.data() + (row * H + h) * nv;
      std::memcpy(dst, dkh, sizeof(float) * static_cast<size_t>(nope));
      std::memcpy(dst + nope, dv.data() + (row * H + h) * vh, sizeof(float) * static_cast<size_t>(vh));
      for (int64_t e = 0; e < rope; ++e) dckv[row * ca + r + e] += dkh[nope + e];
    }
    std::memcpy(lat.data() + row * r, ckv_.data() + row * ca, sizeof(float) * static_cast<size_t>(r));
  }
  linear_backward(dkvb.data(), BT, H * nv, w_.kv_b_proj, dlat_n.data(), false);
  Tensor dlat = Tensor::uninitialized({BT, r});
  rmsnorm_backward(lat.data(), w_.kv_a_norm.data(), dlat_n.data(), dlat.data(), BT, r, d_.latent_eps, false, false);
  for (int64_t row = 0; row < BT; ++row)
    std::memcpy(dckv.data() + row * ca, dlat.data() + row * r, sizeof(float) * static_cast<size_t>(r));
  linear_backward(dckv.data(), BT, ca, w_.kv_a_proj, dn.data(), true);
}

}  // namespace mixlens::grad
