// Backward of the Mamba-2 hybrid skeleton (models/mamba2_hybrid.cpp; Nemotron-H, Bamba,
// Falcon-H1, Granite 4.0-H; Jamba with the Mamba-1 mixer): LM head (* lm_head_multiplier), final RMSNorm, then each block from
// the last, recomputed from its recorded input with the recorded writes re-applied and
// differentiated: the second branch (pre_ff RMSNorm + SwiGLU MLP, Granite's routed experts + shared
// MLP, * residual_multiplier; Jamba's experts alone), then the first branch's Mamba-2 mixer
// (grad/mamba2_mixer_grad.cpp) or Mamba-1 mixer (grad/mamba_mixer_grad.cpp),
// the attention mixer (grad/attention_mixer_grad.cpp), relu2 MLP or MoE (straight-through of the
// chosen experts: the routing is a constant, the chosen experts' weights are differentiated), and
// the block's input norm. A Zamba2 hybrid layer: the Mamba-2 mixer, its input norm over h + the
// layer's linear of the shared block, the block's GeGLU MLP (with this depth's adapter), pre-ff norm,
// attention and the norm over [h, embeddings]; the embeddings' part of each depth adds to their gradient.
#include "grad/mamba2_hybrid_grad.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include "grad/families.h"
#include "grad/ops_grad.h"
#include "models/common.h"
#include "models/hybrid_cache.h"
#include "ops/ops.h"

namespace mixlens::grad {

namespace {

using detail::HybridBlock;
using detail::HybridBlockWeights;
using detail::Mamba2HybridSpec;

const float* opt(const Tensor& t) { return t.defined() ? t.data() : nullptr; }

void scale(Tensor& t, float s) {
  if (s == 1.0f) return;
  for (int64_t k = 0; k < t.numel(); ++k) t[k] *= s;
}

void add_into(Tensor& h, const Tensor& x) {
  for (int64_t k = 0; k < h.numel(); ++k) h[k] += x[k];
}

class HybridBackward {
 public:
  HybridBackward(const detail::Mamba2HybridParts& m, const Tape& tape, GradSink& sink)
      : m_(m), s_(*m.spec), tape_(tape), sink_(sink), in_(tape.batch), B_(in_.batch), T_(in_.seq), BT_(B_ * T_),
        cache_(static_cast<const detail::HybridCache&>(*tape.cache_before)) {
    // Positions and the key mask as the forward built them (the cache before the call, advanced).
    auto adv = cache_.clone();
    auto& hc = static_cast<detail::HybridCache&>(*adv);
    pos_ = hc.advance_positions(in_);
    key_mask_ = hc.key_mask;
  }

  void run(const Tensor& dlogits) {
    const int64_t D = s_.D, L = static_cast<int64_t>(s_.blocks.size());
    const Tensor dhf = head_backward(tape_, dlogits, *m_.lm_head, s_.lm_head_multiplier, sink_);
    Tensor dh({B_, T_, D});
    rmsnorm_backward(tape_.final_hidden.data(), m_.norm_f->data(), dhf.data(), dh.data(), BT_, D, s_.eps, false, false);
    for (int64_t i = L - 1; i >= 0; --i) {
      const int li = static_cast<int>(i);
      if (!sink_.needs_below(li)) {  // nothing asked for below this block's output: stop here
        sink_.put(li, Value::layer_output, dh);
        return;
      }
      block(li, dh);
    }
    if (dh0_.defined()) add_into(dh, dh0_);  // the shared blocks' reads of the embeddings
    sink_.put(-1, Value::embed_output, dh);
  }

 private:
  // A Zamba2 hybrid layer (models/mamba2_hybrid.cpp shared_block): h_out = h + Mamba2(RMSNorm(h + t)),
  // t = linear(MLP(RMSNorm(attn(RMSNorm([h, h0]))))) with h0 the embeddings. dh: dL/d(layer_output) in,
  // dL/d(layer_input) out; the h0 half of the concatenation's gradient adds into dh0_.
  void shared_layer(int li, Tensor& dh) {
    const HybridBlockWeights& w = (*m_.blocks)[static_cast<size_t>(li)];
    const int64_t D = s_.D, D2 = 2 * D;
    const size_t i = static_cast<size_t>(li);
    sink_.put(li, Value::layer_output, dh);
    tape_.block(li, Value::layer_output, dh);
    const Tensor& hin = tape_.layer_inputs[i];
    const Tensor* h0 = tape_.kept_of(-1, Kept::embeddings);
    if (!h0) {  // not kept: recomputed as the forward made them (lookup, multiplier, the write)
      if (!h0_.defined()) {
        h0_ = detail::hybrid_embeddings(s_, *m_.embed, in_);
        tape_.apply(-1, Value::embed_output, h0_);
      }
      h0 = &h0_;
    }
    // Recompute the block (the tape's writes re-applied) up to the mixer's input.
    Tensor c({B_, T_, D2}), cn({B_, T_, D2});
    for (int64_t r = 0; r < BT_; ++r) {
      std::memcpy(c.data() + r * D2, hin.data() + r * D, sizeof(float) * static_cast<size_t>(D));
      std::memcpy(c.data() + r * D2 + D, h0->data() + r * D, sizeof(float) * static_cast<size_t>(D));
    }
    ops::rmsnorm(c.data(), w.shared.in_norm.data(), cn.data(), BT_, D2, s_.eps);
    const AttentionMixerGrad att(*m_.attn, w.attn, li, cn, AttentionCallState{&cache_.kv[i], &key_mask_, &pos_}, tape_);
    const Tensor& a = att.output();
    Tensor n2({B_, T_, D});
    ops::rmsnorm(a.data(), w.shared.ff_norm.data(), n2.data(), BT_, D, s_.eps);
    Tensor mo = detail::hybrid_mlp(s_, w.mlp, n2.data(), BT_).reshape({B_, T_, D});
    tape_.apply(li, Value::mlp_output, mo);
    Tensor x({B_, T_, D}), n({B_, T_, D});
    ops::linear(mo.data(), BT_, D, w.shared.linear, x.data());
    add_into(x, hin);
    ops::rmsnorm(x.data(), w.in_norm.data(), n.data(), BT_, D, s_.eps);
    // Backward: the mixer, its input norm, the linear, the MLP, the pre-ff norm, attention, the input norm.
    Tensor dn({B_, T_, D}), dx({B_, T_, D}), dm({B_, T_, D}), dn2({B_, T_, D}), da({B_, T_, D});
    mixer_backward(li, w, n, &dh, MixerDout(), dn);
    rmsnorm_backward(x.data(), w.in_norm.data(), dn.data(), dx.data(), BT_, D, s_.eps, false, false);
    linear_backward(dx.data(), BT_, D, w.shared.linear, dm.data(), false);
    sink_.put(li, Value::mlp_output, dm);
    tape_.block(li, Value::mlp_output, dm);
    mlp_backward(w.mlp, n2, dm, dn2);
    rmsnorm_backward(a.data(), w.shared.ff_norm.data(), dn2.data(), da.data(), BT_, D, s_.eps, false, false);
    Tensor dcn({B_, T_, D2}), dc({B_, T_, D2});
    att.backward(da, dcn, sink_);
    rmsnorm_backward(c.data(), w.shared.in_norm.data(), dcn.data(), dc.data(), BT_, D2, s_.eps, false, false);
    if (!dh0_.defined()) dh0_ = Tensor({B_, T_, D});
    add_into(dh, dx);  // the residual, and h inside the mixer's input
    for (int64_t r = 0; r < BT_; ++r)
      for (int64_t k = 0; k < D; ++k) {
        dh[r * D + k] += dc[r * D2 + k];
        dh0_[r * D + k] += dc[r * D2 + D + k];
      }
    sink_.put(li, Value::layer_input, dh);
    tape_.block(li, Value::layer_input, dh);
  }

  // The recurrent mixer's backward on its normed input n (Mamba-1 or Mamba-2, as the spec says):
  // dout given, or dout_of(the recomputed output) when a second branch reads that output.
  void mixer_backward(int li, const HybridBlockWeights& w, const Tensor& n, const Tensor* dout, const MixerDout& dout_of,
                      Tensor& dn) {
    const size_t i = static_cast<size_t>(li);
    if (s_.mixer == detail::HybridMixer::mamba1) {
      const MambaMixerView mv = mamba_mixer_view(*m_.mixer1, w.mamba1);
      MambaCallState mc;
      mc.conv = &cache_.conv[i];
      mc.ssm = &cache_.ssm[i];
      mc.has_state = cache_.has_state;
      mc.chunked = tape_.kernel == "chunked";
      mc.betas_for_decays = [&](const Tensor& bet, const Tensor& dec) {
        return m_.mixer1->betas_for_decays(li, w.mamba1, bet, dec);
      };
      if (dout) mamba_mixer_backward(mv, li, n, mc, tape_, *dout, dn, sink_);
      else mamba_mixer_backward(mv, li, n, mc, tape_, dout_of, dn, sink_);
      return;
    }
    const Mamba2CallState call{&cache_.conv[i], &cache_.ssm[i], cache_.has_state, tape_.kernel == "chunked"};
    if (dout) mamba2_mixer_backward(*m_.mixer, w.mamba, li, n, call, tape_, *dout, dn, sink_);
    else mamba2_mixer_backward(*m_.mixer, w.mamba, li, n, call, tape_, dout_of, dn, sink_);
  }

  // dh: dL/d(layer_output) in, dL/d(layer_input) out.
  void block(int li, Tensor& dh) {
    const HybridBlock& b = s_.blocks[static_cast<size_t>(li)];
    if (b.shared) return shared_layer(li, dh);
    const HybridBlockWeights& w = (*m_.blocks)[static_cast<size_t>(li)];
    const int64_t D = s_.D;
    sink_.put(li, Value::layer_output, dh);
    tape_.block(li, Value::layer_output, dh);
    const Tensor& hin = tape_.layer_inputs[static_cast<size_t>(li)];
    Tensor n({B_, T_, D});
    ops::rmsnorm(hin.data(), w.in_norm.data(), n.data(), BT_, D, s_.eps);
    const size_t i = static_cast<size_t>(li);
    std::unique_ptr<AttentionMixerGrad> att;
    if (b.attn)
      att = std::make_unique<AttentionMixerGrad>(*m_.attn, w.attn, li, n, AttentionCallState{&cache_.kv[i], &key_mask_, &pos_},
                                                 tape_);

    // Second branch: h = h1 + MLP(RMSNorm(h1)), h1 = layer_input + first branch; gives dL/dh1.
    Tensor dh1 = dh;
    const auto second_branch = [&](const Tensor* mixer_out) {
      Tensor h1 = hin.clone();
      if (mixer_out) add_into(h1, *mixer_out);
      if (b.attn) add_into(h1, att->output());
      if (b.branch_mlp) add_into(h1, branch_mlp_forward(li, b, w, n));
      Tensor n2({B_, T_, D});
      ops::rmsnorm(h1.data(), w.ff_norm.data(), n2.data(), BT_, D, s_.eps);
      Tensor dm = dh.clone();
      sink_.put(li, Value::mlp_output, dm);
      tape_.block(li, Value::mlp_output, dm);
      scale(dm, s_.residual_multiplier);
      Tensor dn2({B_, T_, D});
      const bool moe_only = b.moe && s_.moe_kind == detail::HybridMoeKind::jamba;
      if (!moe_only) mlp_backward(w.mlp, n2, dm, dn2);
      if (moe_only) {
        moe_backward(w.moe, n2, dm, dn2);
      } else if (b.moe) {  // Granite: routed experts beside the shared MLP on the same input
        Tensor dmoe({B_, T_, D});
        moe_backward(w.moe, n2, dm, dmoe);
        add_into(dn2, dmoe);
      }
      dh1 = dh.clone();
      rmsnorm_backward(h1.data(), w.ff_norm.data(), dn2.data(), dh1.data(), BT_, D, s_.eps, false, true);
      return dh1;
    };
    if (b.ff && !b.mamba) second_branch(nullptr);
    // First branch: h1 = layer_input + sum of the branch outputs on n = RMSNorm(layer_input). With a
    // second branch, the mixer's recompute supplies its output to it before differentiating.
    Tensor dn({B_, T_, D}), part({B_, T_, D});
    if (b.mamba) {
      if (b.ff)
        mixer_backward(li, w, n, nullptr, [&](const Tensor& out) { return second_branch(&out); }, part);
      else
        mixer_backward(li, w, n, &dh1, MixerDout(), part);
      add_into(dn, part);
    }
    if (b.attn) {
      att->backward(dh1, part, sink_);
      add_into(dn, part);
    }
    if (b.branch_mlp) {
      Tensor dm = dh1.clone();
      sink_.put(li, Value::mlp_output, dm);
      tape_.block(li, Value::mlp_output, dm);
      scale(dm, s_.residual_multiplier);
      if (b.moe) moe_backward(w.moe, n, dm, part);
      else mlp_backward(w.mlp, n, dm, part);
      add_into(dn, part);
    }
    dh = dh1.clone();
    rmsnorm_backward(hin.data(), w.in_norm.data(), dn.data(), dh.data(), BT_, D, s_.eps, false, true);
    sink_.put(li, Value::layer_input, dh);
    tape_.block(li, Value::layer_input, dh);
  }

  // ---- MLPs (forwards: models/mamba2_hybrid.cpp) -------------------------------------------------
  void mlp_backward(const detail::HybridMlpWeights& m, const Tensor& x, const Tensor& dout_in, Tensor& dx) const {
    const int64_t I = s_.I, D = s_.D;
    Tensor dout = dout_in.clone();
    scale(dout, s_.mlp_down_multiplier);
    Tensor up({BT_, I}), da({BT_, I});
    ops::linear(x.data(), BT_, D, m.up, up.data(), opt(m.up_b));
    linear_backward(dout.data(), BT_, D, m.down, da.data(), false);
    if (s_.mlp == detail::HybridMlp::geglu) {  // Zamba2MLP: down(gelu(g) * u), g / u with this depth's adapter
      Tensor g({BT_, I});
      ops::linear(x.data(), BT_, D, m.gate, g.data(), opt(m.gate_b));
      if (m.lora_a.defined()) {
        detail::add_lora(x.data(), BT_, m.lora_a, m.lora_gate, g);
        detail::add_lora(x.data(), BT_, m.lora_a, m.lora_up, up);
      }
      for (int64_t k = 0; k < BT_ * I; ++k) {
        const float gg = g[k], a = da[k], cdf = 0.5f * (1.0f + std::erf(gg * 0.70710678118654752440f));
        g[k] = a * up[k] * (cdf + gg * 0.39894228040143267794f * std::exp(-0.5f * gg * gg));  // d gate (exact GELU')
        up[k] = a * gg * cdf;                                                                    // d up
      }
      linear_backward(up.data(), BT_, I, m.up, dx.data(), false);
      linear_backward(g.data(), BT_, I, m.gate, dx.data(), true);
      if (m.lora_a.defined()) {
        lora_backward(up.data(), BT_, I, m.lora_a, m.lora_up, dx.data());
        lora_backward(g.data(), BT_, I, m.lora_a, m.lora_gate, dx.data());
      }
    } else if (s_.mlp == detail::HybridMlp::swiglu) {
      Tensor g({BT_, I});
      ops::linear(x.data(), BT_, D, m.gate, g.data(), opt(m.gate_b));
      const float gm = s_.mlp_gate_multiplier;
      for (int64_t k = 0; k < BT_ * I; ++k) {
        const float gg = g[k] * gm, a = da[k];
        g[k] = a * up[k] * silu_grad(gg) * gm;  // d gate projection
        up[k] = a * ops::silu(gg);              // d up projection
      }
      linear_backward(up.data(), BT_, I, m.up, dx.data(), false);
      linear_backward(g.data(), BT_, I, m.gate, dx.data(), true);
    } else {
      for (int64_t k = 0; k < BT_ * I; ++k) up[k] = da[k] * 2.0f * std::max(up[k], 0.0f);
      linear_backward(up.data(), BT_, I, m.up, dx.data(), false);
    }
  }

  // SwiGLU with explicit weights (Granite experts): dx (+)= d/dx of dy . down(up x * silu(gate x)).
  static void swiglu_backward(const Tensor& gate_w, const Tensor& up_w, const Tensor& down_w, const float* x,
                              const float* dy, int64_t rows, int64_t in, int64_t I, float* dx, bool accumulate) {
    Tensor g({rows, I}), u({rows, I}), da({rows, I});
    ops::linear(x, rows, in, gate_w, g.data());
    ops::linear(x, rows, in, up_w, u.data());
    linear_backward(dy, rows, down_w.size(0), down_w, da.data(), false);
    for (int64_t k = 0; k < rows * I; ++k) {
      const float a = da[k], gg = g[k];
      g[k] = a * u[k] * silu_grad(gg);  // d gate projection
      u[k] = a * ops::silu(gg);         // d up projection
    }
    linear_backward(u.data(), rows, I, up_w, dx, accumulate);
    linear_backward(g.data(), rows, I, gate_w, dx, true);
  }

  // The MoE: the routing (which experts) is a constant; the chosen experts' weights and the experts
  // are differentiated, as torch autograd does through topk_weights. NemotronHMoE:
  // w_k = s_k / (sum_j s_j + 1e-20) * routed_scaling (s = sigmoid(router x)), relu2 experts, latent
  // projections and the shared expert; Granite: w = softmax of the chosen logits, SwiGLU experts (the
  // shared MLP is the block's MLP, differentiated by the caller).
  void moe_backward(const detail::HybridMoeWeights& m, const Tensor& x_in, const Tensor& dout_in, Tensor& dx) const {
    const int64_t E = s_.n_experts, D = s_.D, K = s_.topk, lat = s_.latent, in = lat > 0 ? lat : D, rows = BT_;
    const float* x = x_in.data();
    const float* dout = dout_in.data();
    const detail::HybridMoeRouting rt = detail::hybrid_moe_route(s_, m, x, rows);
    const Tensor xin = detail::hybrid_moe_input(s_, m, x, rows);
    const float* xe = xin.defined() ? xin.data() : x;
    // backward: dacc = d(fc2 input); per chosen (r, k): dw_k = dacc_r . y, dxe_r += w_k d relu2
    Tensor dacc({rows, in});
    if (lat > 0) linear_backward(dout, rows, D, m.fc2, dacc.data(), false);
    else std::memcpy(dacc.data(), dout, sizeof(float) * static_cast<size_t>(rows * D));
    std::vector<float> dw(static_cast<size_t>(rows * K), 0.0f);
    Tensor dxe({rows, in});
    for (int64_t e = 0; e < E; ++e) {
      const auto& toks = rt.routed[static_cast<size_t>(e)];
      if (toks.empty()) continue;
      const int64_t nt = static_cast<int64_t>(toks.size());
      const Tensor xs = detail::gather_routed_rows(xe, in, toks);
      Tensor dys({nt, in}), dxs({nt, in});
      const Tensor y = detail::hybrid_expert(s_, m, e, xs.data(), nt);
      for (int64_t j = 0; j < nt; ++j) {
        const auto [r, k] = toks[static_cast<size_t>(j)];
        const float wg = rt.weight(r, k);
        double dot = 0.0;
        for (int64_t c = 0; c < in; ++c) {
          dot += static_cast<double>(dacc[r * in + c]) * y[j * in + c];
          dys[j * in + c] = dacc[r * in + c] * wg;
        }
        dw[static_cast<size_t>(r * K + k)] = static_cast<float>(dot);
      }
      const size_t ei = static_cast<size_t>(e);
      if (s_.moe_kind != detail::HybridMoeKind::nemotron_h)
        swiglu_backward(m.gate[ei], m.up[ei], m.down[ei], xs.data(), dys.data(), nt, in, s_.moe_I, dxs.data(), false);
      else
        relu2_mlp_backward(m.up[ei], m.down[ei], xs.data(), dys.data(), nt, in, s_.moe_I, dxs.data(), false);
      for (int64_t j = 0; j < nt; ++j) {
        const int64_t r = toks[static_cast<size_t>(j)].first;
        for (int64_t c = 0; c < in; ++c) dxe[r * in + c] += dxs[j * in + c];
      }
    }
    Tensor dlog({rows, E});
    if (s_.moe_kind == detail::HybridMoeKind::jamba) {
      // w_k = p[e_k], p = softmax over all logits (rt.scores): dl_j = p_j ([j chosen] dw_j - sum_k w_k dw_k).
      for (int64_t r = 0; r < rows; ++r) {
        double wdw = 0.0;
        for (int64_t k = 0; k < K; ++k) wdw += static_cast<double>(rt.weight(r, k)) * dw[static_cast<size_t>(r * K + k)];
        for (int64_t e = 0; e < E; ++e) dlog[r * E + e] = -rt.scores[static_cast<size_t>(r * E + e)] * static_cast<float>(wdw);
        for (int64_t k = 0; k < K; ++k)
          dlog[r * E + rt.chosen[static_cast<size_t>(r * K + k)]] += rt.weight(r, k) * dw[static_cast<size_t>(r * K + k)];
      }
      linear_backward(dlog.data(), rows, E, m.router, dx.data(), false);
      add_into(dx, dxe);
      return;
    }
    if (s_.moe_kind == detail::HybridMoeKind::granite) {
      // dw -> the chosen logits through the softmax over them: dl_k = w_k (dw_k - sum_j w_j dw_j).
      for (int64_t r = 0; r < rows; ++r) {
        double wdw = 0.0;
        for (int64_t k = 0; k < K; ++k) wdw += static_cast<double>(rt.weight(r, k)) * dw[static_cast<size_t>(r * K + k)];
        for (int64_t k = 0; k < K; ++k)
          dlog[r * E + rt.chosen[static_cast<size_t>(r * K + k)]] +=
              rt.weight(r, k) * static_cast<float>(dw[static_cast<size_t>(r * K + k)] - wdw);
      }
      linear_backward(dlog.data(), rows, E, m.router, dx.data(), false);
      add_into(dx, dxe);
      return;
    }
    // dw -> the sigmoid scores of the chosen experts -> router logits -> x.
    for (int64_t r = 0; r < rows; ++r)
      sigmoid_topk_weights_backward(rt.scores.data() + r * E, rt.chosen.data() + r * K, K, dw.data() + r * K,
                                    s_.norm_topk, 1e-20f, s_.routed_scaling, dlog.data() + r * E);
    linear_backward(dlog.data(), rows, E, m.router, dx.data(), false);
    if (lat > 0) linear_backward(dxe.data(), rows, in, m.fc1, dx.data(), true);
    else add_into(dx, dxe);
    relu2_mlp_backward(m.shared_up, m.shared_down, x, dout, rows, D, s_.shared_I, dx.data(), true);
  }

  Tensor branch_mlp_forward(int li, const HybridBlock& b, const HybridBlockWeights& w, const Tensor& n) const {
    Tensor o = (b.moe ? detail::hybrid_moe(s_, w.moe, n.data(), BT_) : detail::hybrid_mlp(s_, w.mlp, n.data(), BT_)).reshape({B_, T_, s_.D});
    scale(o, s_.residual_multiplier);
    tape_.apply(li, Value::mlp_output, o);
    return o;
  }

  const detail::Mamba2HybridParts& m_;
  const Mamba2HybridSpec& s_;
  const Tape& tape_;
  GradSink& sink_;
  const Batch& in_;
  const int64_t B_, T_, BT_;
  const detail::HybridCache& cache_;
  std::vector<int64_t> pos_;
  std::vector<std::vector<uint8_t>> key_mask_;
  Tensor dh0_;  ///< Zamba2: dL/d(embeddings) through the shared blocks' concatenated input
  Tensor h0_;   ///< Zamba2: the embeddings recomputed when the call kept none
};

}  // namespace

void mamba2_hybrid_backward(const detail::Mamba2HybridParts& m, const Tape& tape, const Tensor& dlogits, GradSink& sink) {
  HybridBackward(m, tape, sink).run(dlogits);
}

}  // namespace mixlens::grad
