// Backward of the Qwen hybrid skeleton (QwenHybrid::forward): LM head, the final RMSNorm,
// then each decoder block from last to first, recomputed from its recorded input:
//   h1 = h0 + mixer(norm1(h0)),  h2 = h1 + mlp(norm2(h1))  (pre-norm blocks), or
//   h1 = h0 + norm1(mixer(h0)),  h2 = h1 + norm2(mlp(h1))  (OLMo-Hybrid's post-norm attention blocks),
// with the SwiGLU MLP or the sparse MoE (the router's top-k choice is a constant; the gradient flows
// through the chosen experts, their routing weights (softmax over all experts, optionally renormalised
// over the chosen; Kimi, LFM2-MoE: the chosen experts' sigmoid scores, renormalised and scaled) and the
// shared expert (sigmoid-gated; Kimi: ungated; LFM2-MoE, MiniMax: none). LFM2's short conv blocks are
// differentiated where a GDN would be (ShortConvMixerGrad), MiniMax's lightning blocks likewise
// (LightningMixerGrad), with MiniMaxDecoderLayer's residual: h1 = a1 n1 + b1 mixer(n1),
// h2 = a2 n2 + b2 moe(n2) (QwenHybridParts::normed_residual).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <utility>

#include "grad/families.h"
#include "grad/ops_grad.h"
#include "grad/qwen_grad.h"
#include "ops/ops.h"

namespace mixlens::grad {

namespace {

// The SwiGLU output y [rows, D] from its gate|up product gu [rows, 2I].
void swiglu_out(const Tensor& gu, const Tensor& down, int64_t I, int64_t rows, float* y) {
  Tensor act({rows, I});
  for (int64_t r = 0; r < rows; ++r)
    ops::mul_silu(gu.data() + r * 2 * I + I, gu.data() + r * 2 * I, act.data() + r * I, I);
  ops::linear(act.data(), rows, I, down, y);
}

// SwiGLU down(silu(gate x) * up x) with gate | up fused: dx (+)= from dy [rows, D].
// `gu_kept`: the forward's gate|up product (x is then not read).
void swiglu_backward(const ops::RowStack& gate_up, const Tensor& down, int64_t I, int64_t D, const float* x, int64_t rows,
                     const float* dy, float* dx, bool accumulate, float* y_out = nullptr,
                     const Tensor* gu_kept = nullptr) {
  // Written whole below (by the products and the row pass): no zero-fill pass over fresh pages.
  Tensor gu, dact = Tensor::uninitialized({rows, I}), dgu = Tensor::uninitialized({rows, 2 * I});
  if (gu_kept) {
    gu = *gu_kept;
  } else {
    gu = Tensor::uninitialized({rows, 2 * I});
    ops::linear(x, rows, D, gate_up, gu.data());
  }
  if (y_out) swiglu_out(gu, down, I, rows, y_out);  // the forward output too (the MoE: routing weights' gradient)
  linear_backward(dy, rows, D, down, dact.data(), false);
  // act = silu(g) u: dg = da u silu'(g), du = da silu(g), from one vectorized sigmoid per row (in the
  // row's dgu half, overwritten) on the pool: two scalar exp per element were ~4% of the backward.
  const Tensor& guc = gu;
  ops::parallel_rows(rows, 2 * I, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = guc.data() + r * 2 * I;
      const float* u = g + I;
      const float* da = dact.data() + r * I;
      float* dg = dgu.data() + r * 2 * I;
      float* du = dg + I;
      ops::sigmoid(g, du, I);
      for (int64_t i = 0; i < I; ++i) {
        const float s = du[i];
        dg[i] = da[i] * u[i] * silu_grad_s(g[i], s);
        du[i] = da[i] * silu_s(g[i], s);
      }
    }
  });
  linear_backward(dgu.data(), rows, 2 * I, gate_up, dx, accumulate);
}

// The shared expert sigmoid(x . w_gate) * SwiGLU(x) (Qwen3-Next): dx (overwritten) from dout.
void gated_shared_expert_backward(const MlpView& m, const Tensor& x, const Tensor& dout, Tensor& dx) {
  const int64_t D = m.D, rows = x.numel() / D;
  Tensor ys({rows, D}), sg({rows, 1}), dys({rows, D});
  ops::linear(x.data(), rows, D, *m.shared_gate, sg.data());
  std::vector<float> dsg(static_cast<size_t>(rows));
  {
    Tensor gu({rows, 2 * m.Is}), act({rows, m.Is});
    ops::linear(x.data(), rows, D, *m.shared_gate_up, gu.data());
    for (int64_t r = 0; r < rows; ++r)
      ops::mul_silu(gu.data() + r * 2 * m.Is + m.Is, gu.data() + r * 2 * m.Is, act.data() + r * m.Is, m.Is);
    ops::linear(act.data(), rows, m.Is, *m.shared_down, ys.data());
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float s = ops::sigmoid(sg[r]);
    double dot = 0.0;
    for (int64_t d = 0; d < D; ++d) {
      dys[r * D + d] = s * dout[r * D + d];
      dot += static_cast<double>(dout[r * D + d]) * ys[r * D + d];
    }
    dsg[static_cast<size_t>(r)] = static_cast<float>(dot) * sigmoid_d(s);
  }
  swiglu_backward(*m.shared_gate_up, *m.shared_down, m.Is, D, x.data(), rows, dys.data(), dx.data(), false);
  linear_backward(dsg.data(), rows, 1, *m.shared_gate, dx.data(), true);
}

void moe_backward(const MlpView& m, const Tensor& x, const Tensor& dout, Tensor& dx) {
  const int64_t D = m.D, rows = x.numel() / D, E = m.router->size(0), K = m.topk;
  const bool sigmoid_router = m.router_bias && m.router_bias->defined();  // KimiLinearTopkRouter
  if (m.Is == 0)  // Lfm2MoeSparseMoeBlock: no shared expert
    std::memset(dx.data(), 0, sizeof(float) * static_cast<size_t>(dx.numel()));
  else if (m.shared_gate->defined())
    gated_shared_expert_backward(m, x, dout, dx);
  else  // KimiLinearMoE: the shared experts are added ungated
    swiglu_backward(*m.shared_gate_up, *m.shared_down, m.Is, D, x.data(), rows, dout.data(), dx.data(), false);
  // Routing as the forward computes it (the top-k choice is a constant of the backward).
  Tensor logits({rows, E}), probs({rows, E}), wts({rows, K});  // probs: Kimi's sigmoid scores
  ops::linear(x.data(), rows, D, *m.router, logits.data());
  std::vector<std::vector<int64_t>> chosen(static_cast<size_t>(rows));
  std::vector<float> tot(static_cast<size_t>(rows));
  std::vector<std::vector<std::pair<int64_t, int64_t>>> routed(static_cast<size_t>(E));  // (row, slot)
  std::vector<int64_t> idx(static_cast<size_t>(E));
  for (int64_t r = 0; r < rows && sigmoid_router; ++r) {
    chosen[static_cast<size_t>(r)] =
        detail::sigmoid_topk_route(logits.data() + r * E, m.router_bias->data(), E, m.n_group, m.topk_group, K,
                                   m.norm_topk, m.topk_eps, m.routed_scale, probs.data() + r * E, wts.data() + r * K);
    for (int64_t k = 0; k < K; ++k) routed[static_cast<size_t>(chosen[static_cast<size_t>(r)][static_cast<size_t>(k)])].push_back({r, k});
  }
  for (int64_t r = 0; r < rows && !sigmoid_router; ++r) {
    const float* lg = logits.data() + r * E;
    float* p = probs.data() + r * E;
    const float mx = *std::max_element(lg, lg + E);
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(lg[e] - mx));
    for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + K, idx.end(),
                      [&](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    float t = 0.0f;
    for (int64_t k = 0; k < K; ++k) t += p[idx[static_cast<size_t>(k)]];
    tot[static_cast<size_t>(r)] = t;
    chosen[static_cast<size_t>(r)].assign(idx.begin(), idx.begin() + K);
    for (int64_t k = 0; k < K; ++k) {
      routed[static_cast<size_t>(idx[static_cast<size_t>(k)])].push_back({r, k});
      wts[r * K + k] = m.norm_topk ? p[idx[static_cast<size_t>(k)]] / t : p[idx[static_cast<size_t>(k)]];
    }
  }
  // Experts: dx += expert backward of w dout; dw = dout . expert output.
  Tensor dw({rows, K});
  for (int64_t e = 0; e < E; ++e) {
    const auto& toks = routed[static_cast<size_t>(e)];
    if (toks.empty()) continue;
    const int64_t nt = static_cast<int64_t>(toks.size());
    Tensor xs({nt, D}), dy({nt, D}), y({nt, D}), dxs({nt, D});
    for (int64_t i = 0; i < nt; ++i) {
      const auto [r, k] = toks[static_cast<size_t>(i)];
      const float w = wts[r * K + k];
      std::memcpy(xs.data() + i * D, x.data() + r * D, sizeof(float) * static_cast<size_t>(D));
      for (int64_t d = 0; d < D; ++d) dy[i * D + d] = w * dout[r * D + d];
    }
    swiglu_backward((*m.expert_gate_up)[static_cast<size_t>(e)], (*m.expert_down)[static_cast<size_t>(e)], m.I, D,
                    xs.data(), nt, dy.data(), dxs.data(), false, y.data());
    for (int64_t i = 0; i < nt; ++i) {
      const auto [r, k] = toks[static_cast<size_t>(i)];
      double dot = 0.0;
      for (int64_t d = 0; d < D; ++d) {
        dx[r * D + d] += dxs[i * D + d];
        dot += static_cast<double>(dout[r * D + d]) * y[i * D + d];
      }
      dw[r * K + k] = static_cast<float>(dot);
    }
  }
  Tensor dlogits({rows, E});
  if (sigmoid_router) {  // routing weights -> the chosen experts' sigmoid scores (the bias only chose them)
    for (int64_t r = 0; r < rows; ++r)
      sigmoid_topk_weights_backward(probs.data() + r * E, chosen[static_cast<size_t>(r)].data(), K, dw.data() + r * K,
                                    m.norm_topk, m.topk_eps, m.routed_scale, dlogits.data() + r * E);
    linear_backward(dlogits.data(), rows, E, *m.router, dx.data(), true);
    return;
  }
  // Routing weights -> probabilities (renormalised over the chosen) -> softmax over every expert.
  for (int64_t r = 0; r < rows; ++r) {
    const float* p = probs.data() + r * E;
    const auto& ch = chosen[static_cast<size_t>(r)];
    std::vector<double> dp(static_cast<size_t>(E), 0.0);
    double c = 0.0;  // sum_k dw_k p_k / tot^2 (the renormalisation's shared term)
    const double t = tot[static_cast<size_t>(r)];
    if (m.norm_topk)
      for (int64_t k = 0; k < K; ++k) c += static_cast<double>(dw[r * K + k]) * p[ch[static_cast<size_t>(k)]] / (t * t);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = ch[static_cast<size_t>(k)];
      dp[static_cast<size_t>(e)] = m.norm_topk ? dw[r * K + k] / t - c : dw[r * K + k];
    }
    double pdp = 0.0;
    for (int64_t e = 0; e < E; ++e) pdp += p[e] * dp[static_cast<size_t>(e)];
    for (int64_t e = 0; e < E; ++e) dlogits[r * E + e] = static_cast<float>(p[e] * (dp[static_cast<size_t>(e)] - pdp));
  }
  linear_backward(dlogits.data(), rows, E, *m.router, dx.data(), true);
}

// An attention block with post-norms (QwenLayerView::post_norms): h1 = h0 + norm1(attn(h0)),
// h2 = h1 + norm2(mlp(h1)); dh: dL/dh2 in, dL/dh0 out. attn_output and mlp.output are the module
// outputs before their norms, so their gradients are taken there.
void post_norm_block_backward(const detail::QwenHybridParts& bb, const QwenLayerView& l, int li, const Tensor& h0,
                              const detail::HybridCache& before, const std::vector<int64_t>& pos, const Tape& tape,
                              Tensor& dh, GradSink& sink) {
  const int64_t D = bb.D, rows = h0.numel() / D;
  const bool c = bb.centred;
  AttentionMixerGrad att(*bb.attn, *l.attn, li, h0,
                         AttentionCallState{&before.kv[static_cast<size_t>(li)], &before.key_mask, &pos}, tape);
  const Tensor& out = att.output();  // before post_attention_layernorm, writes applied
  Tensor h1 = Tensor::uninitialized(h0.shape());
  ops::rmsnorm(out.data(), l.post_norm->data(), h1.data(), rows, D, bb.eps, c);
  for (int64_t k = 0; k < h1.numel(); ++k) h1[k] += h0[k];
  // mlp(h1) after writes, which norm2's backward reads: as the forward kept it, else recomputed (a
  // post-norm block's MLP is dense: the skeleton refuses MoE there).
  const Tensor* gu = tape.kept_of(li, Kept::mlp_gate_up);
  Tensor m;
  if (const Tensor* kept = tape.kept_of(li, Kept::mlp_output)) {
    m = *kept;
  } else {
    Tensor gu_new;
    if (!gu) {
      gu_new = Tensor::uninitialized({rows, 2 * l.mlp.I});
      ops::linear(h1.data(), rows, D, *l.mlp.gate_up, gu_new.data());
    }
    m = Tensor::uninitialized(h0.shape());
    swiglu_out(gu ? *gu : gu_new, *l.mlp.down, l.mlp.I, rows, m.data());
    tape.apply(li, Value::mlp_output, m);
  }
  Tensor dm = Tensor::uninitialized(h0.shape()), dn = Tensor::uninitialized(h0.shape());
  rmsnorm_backward(m.data(), l.ff_norm->data(), dh.data(), dm.data(), rows, D, bb.eps, c, false);
  sink.put(li, Value::mlp_output, dm);
  tape.block(li, Value::mlp_output, dm);
  mlp_backward(l.mlp, h1, dm, dn, gu);
  for (int64_t k = 0; k < dh.numel(); ++k) dh[k] += dn[k];  // dL/dh1
  Tensor da = Tensor::uninitialized(h0.shape());
  rmsnorm_backward(out.data(), l.post_norm->data(), dh.data(), da.data(), rows, D, bb.eps, c, false);
  att.backward(da, dn, sink);
  for (int64_t k = 0; k < dh.numel(); ++k) dh[k] += dn[k];  // dL/dh0
  sink.put(li, Value::layer_input, dh);
  tape.block(li, Value::layer_input, dh);
}

}  // namespace

void mlp_backward(const MlpView& m, const Tensor& x, const Tensor& dout, Tensor& dx, const Tensor* gu_kept) {
  if (m.moe) return moe_backward(m, x, dout, dx);
  swiglu_backward(*m.gate_up, *m.down, m.I, m.D, x.data(), x.numel() / m.D, dout.data(), dx.data(), false, nullptr,
                  gu_kept);
}

void qwen_hybrid_backward(const detail::QwenHybridParts& bb, const Tape& tape, const Tensor& dlogits, GradSink& sink) {
  const int64_t B = tape.batch.batch, T = tape.batch.seq, D = bb.D, BT = B * T;
  const Tensor dhf = head_backward(tape, dlogits, *bb.lm_head, 1.0f, sink);
  // Written whole before read (norms, row passes, the backwards): uninitialized.
  Tensor dh = Tensor::uninitialized({B, T, D});
  const bool c = bb.centred;
  rmsnorm_backward(tape.final_hidden.data(), bb.norm->data(), dhf.data(), dh.data(), BT, D, bb.eps, c, false);
  // Positions and key masks as the call computed them, from a copy of the cache it started from.
  auto before_ptr = tape.cache_before->clone();
  auto& before = static_cast<detail::HybridCache&>(*before_ptr);
  const std::vector<int64_t> pos = before.advance_positions(tape.batch);
  Tensor n1 = Tensor::uninitialized({B, T, D}), n2 = Tensor::uninitialized({B, T, D}),
         h1 = Tensor::uninitialized({B, T, D}), dn = Tensor::uninitialized({B, T, D}),
         dm = Tensor::uninitialized({B, T, D});
  for (int64_t i = bb.L - 1; i >= 0; --i) {
    const int li = static_cast<int>(i);
    const QwenLayerView& l = bb.layers[static_cast<size_t>(i)];
    sink.put(li, Value::layer_output, dh);
    if (!sink.needs_below(li)) return;  // e.g. every layer_output asked for: block 0's backward serves nothing
    tape.block(li, Value::layer_output, dh);
    const Tensor& h0 = tape.layer_inputs[static_cast<size_t>(i)];
    if (l.post_norms) {
      post_norm_block_backward(bb, l, li, h0, before, pos, tape, dh, sink);
      continue;
    }
    ops::rmsnorm(h0.data(), l.in_norm->data(), n1.data(), BT, D, bb.eps, c);
    std::unique_ptr<GdnMixerGrad> gdn;
    std::unique_ptr<ShortConvMixerGrad> sc;
    std::unique_ptr<LightningMixerGrad> lt;
    std::unique_ptr<AttentionMixerGrad> att;
    if (l.sc) sc = std::make_unique<ShortConvMixerGrad>(*bb.conv, *l.sc, li, n1, before, tape);
    else if (l.lightning) lt = std::make_unique<LightningMixerGrad>(*bb.lightning, *l.lightning, li, n1, before, tape);
    else if (l.linear) gdn = std::make_unique<GdnMixerGrad>(l.gdn, li, n1, before, tape);
    else att = std::make_unique<AttentionMixerGrad>(*bb.attn, *l.attn, li, n1,
                                                    AttentionCallState{&before.kv[static_cast<size_t>(i)], &before.key_mask, &pos}, tape);
    const Tensor& out = sc ? sc->output() : lt ? lt->output() : l.linear ? gdn->output() : att->output();
    const bool sr = bb.normed_residual;  // MiniMax: h1 = a n1 + b out, h2 = a' n2 + b' mlp(n2)
    if (sr) for (int64_t k = 0; k < h1.numel(); ++k) h1[k] = n1[k] * l.mix_alpha + out[k] * l.mix_beta;
    else for (int64_t k = 0; k < h1.numel(); ++k) h1[k] = h0[k] + out[k];
    // MLP: h2 = h1 + mlp(norm2(h1)).
    std::memcpy(dm.data(), dh.data(), sizeof(float) * static_cast<size_t>(dh.numel()));
    if (sr) for (int64_t k = 0; k < dm.numel(); ++k) dm[k] *= l.mlp_beta;
    sink.put(li, Value::mlp_output, dm);
    tape.block(li, Value::mlp_output, dm);
    const Tensor* gu = l.mlp.moe ? nullptr : tape.kept_of(li, Kept::mlp_gate_up);
    if (!gu) ops::rmsnorm(h1.data(), l.post_norm->data(), n2.data(), BT, D, bb.eps, c);  // the MLP's input
    mlp_backward(l.mlp, n2, dm, dn, gu);
    if (sr) for (int64_t k = 0; k < dn.numel(); ++k) dn[k] += l.mlp_alpha * dh[k];  // the residual n2
    rmsnorm_backward(h1.data(), l.post_norm->data(), dn.data(), dh.data(), BT, D, bb.eps, c, !sr);
    // Mixer: h1 = h0 + mixer(norm1(h0)) (MiniMax: the scaled branch and residual n1).
    const Tensor* dmix = &dh;
    if (sr) {
      for (int64_t k = 0; k < dm.numel(); ++k) dm[k] = l.mix_beta * dh[k];
      dmix = &dm;
    }
    if (sc) sc->backward(*dmix, dn, sink);
    else if (lt) lt->backward(*dmix, dn, sink);
    else if (l.linear) gdn->backward(*dmix, dn, sink);
    else att->backward(*dmix, dn, sink);
    if (sr) for (int64_t k = 0; k < dn.numel(); ++k) dn[k] += l.mix_alpha * dh[k];
    rmsnorm_backward(h0.data(), l.in_norm->data(), dn.data(), dh.data(), BT, D, bb.eps, c, !sr);
    sink.put(li, Value::layer_input, dh);
    tape.block(li, Value::layer_input, dh);
  }
  sink.put(-1, Value::embed_output, dh);
}

}  // namespace mixlens::grad
