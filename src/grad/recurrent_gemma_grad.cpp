// Backward of RecurrentGemma (RecurrentGemma::forward, transformers RecurrentGemmaForCausalLM): the soft-capped
// LM head (c tanh(z / c)), final_norm ((1 + w) RMSNorm), then each residual block from last to first,
// recomputed from its recorded input:
//   h1 = h + temporal_block(temporal_pre_norm(h)),  out = h1 + mlp(channel_pre_norm(h1)),
//   mlp(x) = down(gelu_tanh(gate x + b_g) * (up x + b_u)) + b_d  (RecurrentGemmaMlp),
// with the RG-LRU mixer's backward (grad/rg_lru_mixer_grad.cpp) or the attention mixer's (local MQA with
// partial RoPE: grad/attention_mixer_grad.cpp; every key lies inside attention_window_size, the forward
// refuses calls past it). embed_tokens.output is served after the sqrt(hidden_size) scale: its gradient
// is layer 0's input's.
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "grad/families.h"
#include "grad/ops_grad.h"
#include "grad/recurrent_gemma_grad.h"
#include "grad/rg_lru_grad.h"
#include "models/hybrid_cache.h"
#include "ops/ops.h"

namespace mixlens::grad {

namespace {

// dx [rows,D] (overwritten) of the GeGLU MLP at its input x from dL/d(output) dy [rows,D].
void geglu_backward(const detail::RecurrentGemmaLayer& l, int64_t I, int64_t D, const Tensor& x, const Tensor& dy,
                    Tensor& dx) {
  const int64_t rows = x.numel() / D;
  Tensor g = Tensor::uninitialized({rows, I}), u = Tensor::uninitialized({rows, I}), da = Tensor::uninitialized({rows, I});
  ops::linear(x.data(), rows, D, l.gate, g.data(), l.gate_b.data());
  ops::linear(x.data(), rows, D, l.up, u.data(), l.up_b.data());
  linear_backward(dy.data(), rows, D, l.down, da.data(), false);  // dL/d(gelu_tanh(g) * u)
  for (int64_t e = 0; e < rows * I; ++e) {
    const float a = da[e];
    da[e] = a * u[e] * gelu_tanh_grad(g[e]);  // d gate
    u[e] = a * ops::gelu_tanh(g[e]);           // d up
  }
  linear_backward(da.data(), rows, I, l.gate, dx.data(), false);
  linear_backward(u.data(), rows, I, l.up, dx.data(), true);
}

}  // namespace

void recurrent_gemma_backward(const detail::RecurrentGemmaParts& p, const Tape& tape, const Tensor& dlogits,
                              GradSink& sink) {
  const int64_t B = tape.batch.batch, T = tape.batch.seq, D = p.D, BT = B * T;
  const Tensor dhf = head_backward(tape, dlogits, *p.lm_head, 1.0f, sink, p.cap);
  Tensor dh = Tensor::uninitialized({B, T, D});
  rmsnorm_backward(tape.final_hidden.data(), p.norm->data(), dhf.data(), dh.data(), BT, D, p.eps, true, false);
  // Positions and key masks as the call computed them, from a copy of the cache it started from.
  auto before_ptr = tape.cache_before->clone();
  auto& before = static_cast<detail::HybridCache&>(*before_ptr);
  const bool had_state = before.has_state;
  const std::vector<int64_t> pos = before.advance_positions(tape.batch);
  Tensor n = Tensor::uninitialized({B, T, D}), h1 = Tensor::uninitialized({B, T, D}), dn = Tensor::uninitialized({B, T, D}),
         dm = Tensor::uninitialized({B, T, D});
  for (int64_t i = p.L - 1; i >= 0; --i) {
    const int li = static_cast<int>(i);
    const size_t si = static_cast<size_t>(i);
    const detail::RecurrentGemmaLayer& l = (*p.layers)[si];
    sink.put(li, Value::layer_output, dh);
    if (!sink.needs_below(li)) return;  // every wanted gradient lies above this block
    tape.block(li, Value::layer_output, dh);
    const Tensor& h0 = tape.layer_inputs[si];
    ops::rmsnorm(h0.data(), l.temporal_norm.data(), n.data(), BT, D, p.eps, true);
    std::unique_ptr<RgLruMixerGrad> rg;
    std::unique_ptr<AttentionMixerGrad> att;
    if (l.recurrent)
      rg = std::make_unique<RgLruMixerGrad>(*p.rg, l.rg, li, n, RgLruCallState{&before.ssm[si], had_state, &pos}, tape);
    else
      att = std::make_unique<AttentionMixerGrad>(*p.attn, l.attn, li, n,
                                                 AttentionCallState{&before.kv[si], &before.key_mask, &pos}, tape);
    const Tensor& out = rg ? rg->output() : att->output();
    for (int64_t k = 0; k < h1.numel(); ++k) h1[k] = h0[k] + out[k];
    // MLP: out = h1 + mlp(channel_pre_norm(h1)).
    std::memcpy(dm.data(), dh.data(), sizeof(float) * static_cast<size_t>(dh.numel()));
    sink.put(li, Value::mlp_output, dm);
    tape.block(li, Value::mlp_output, dm);
    ops::rmsnorm(h1.data(), l.channel_norm.data(), n.data(), BT, D, p.eps, true);
    geglu_backward(l, p.I, D, n, dm, dn);
    rmsnorm_backward(h1.data(), l.channel_norm.data(), dn.data(), dh.data(), BT, D, p.eps, true, true);  // dL/dh1
    // Temporal block: h1 = h0 + mixer(temporal_pre_norm(h0)).
    if (rg) rg->backward(dh, dn, sink);
    else att->backward(dh, dn, sink);
    rmsnorm_backward(h0.data(), l.temporal_norm.data(), dn.data(), dh.data(), BT, D, p.eps, true, true);
    sink.put(li, Value::layer_input, dh);
    tape.block(li, Value::layer_input, dh);
  }
  sink.put(-1, Value::embed_output, dh);
}

}  // namespace mixlens::grad
