// Backward of the Mamba-1 mixer (models/mamba.cpp MambaModel::mixer): the call is recomputed from its
// normed input with the recorded writes re-applied, then differentiated op by op: out_proj, the
// silu(z) gate, the selective scan with its D skip (grad/selective_scan_grad.cpp), dt's softplus and
// dt_proj, FalconMamba's RMS norms on dt_low / B / C (grad/rmsnorm_grad.cpp), x_proj, the causal
// conv + SiLU (grad/conv1d_grad.cpp), in_proj.
// Reference: transformers MambaMixer.forward and FalconMambaMixer.forward (pure-torch paths).
#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "grad/families.h"
#include "grad/ops_grad.h"
#include "hooks/serve.h"
#include "mixers/mamba_mixer.h"
#include "mixlens/errors.h"
#include "mixers/selective_scan.h"
#include "ops/ops.h"

namespace mixlens::grad {

MambaMixerView mamba_mixer_view(const detail::MambaMixer& mixer, const detail::MambaMixerWeights& l) {
  const detail::MambaMixerDims& d = mixer.dims();
  const auto opt = [](const Tensor& t) { return t.defined() ? t.data() : nullptr; };
  MambaMixerView w;
  w.D = d.D; w.E = d.E; w.N = d.N; w.R = d.R; w.K = d.K; w.chunk = mixer.chunk();
  w.in_proj = &l.in_proj; w.in_proj_bias = &l.in_proj_bias; w.conv_wT = &l.conv_wT; w.conv_bias = &l.conv_bias;
  w.x_proj = &l.x_proj; w.dt_proj = &l.dt_proj; w.dt_proj_bias = &l.dt_proj_bias; w.A = &l.A; w.Dskip = &l.D;
  w.out_proj = &l.out_proj; w.out_proj_bias = &l.out_proj_bias;
  w.bcdt_rms_norm = d.bcdt_rms_norm; w.mixer_rms_eps = d.mixer_rms_eps;
  w.dt_norm = opt(l.dt_norm); w.b_norm = opt(l.b_norm); w.c_norm = opt(l.c_norm);
  w.per_head = d.per_head; w.heads = d.heads;
  return w;
}

// The backward of detail::linear_heads: dx's columns [h xstep, h xstep + in) (rows ldx apart) +=
// head h's columns of dy [rows, H, out] times W's rows of head h.
static void linear_heads_backward(const Tensor& W, const float* dy, int64_t rows, int64_t H, int64_t in, float* dx,
                                  int64_t ldx, int64_t xstep) {
  const int64_t out = W.size(0) / H;
  if (H == 1 && ldx == in) return linear_backward(dy, rows, out, W, dx, true);
  std::vector<float> dyh(static_cast<size_t>(H > 1 ? rows * out : 0));
  Tensor dxh({rows, in});
  for (int64_t h = 0; h < H; ++h) {
    const float* d = dy;
    if (H > 1) {
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(dyh.data() + r * out, dy + (r * H + h) * out, sizeof(float) * static_cast<size_t>(out));
      d = dyh.data();
    }
    linear_backward(d, rows, out, H == 1 ? W : detail::row_block(W, h * out, {out, in}), dxh.data(), false);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < in; ++k) dx[r * ldx + h * xstep + k] += dxh[r * in + k];
  }
}

static void mamba_mixer_backward(const MambaMixerView& w, int li, const Tensor& n_in, const MambaCallState& call,
                                 const Tape& tape, const MixerDout& dout_of, const Tensor* dout_given, Tensor& dn,
                                 GradSink& sink);

void mamba_mixer_backward(const MambaMixerView& w, int li, const Tensor& n_in, const MambaCallState& call,
                          const Tape& tape, const Tensor& dout_in, Tensor& dn, GradSink& sink) {
  mamba_mixer_backward(w, li, n_in, call, tape, MixerDout(), &dout_in, dn, sink);
}

void mamba_mixer_backward(const MambaMixerView& w, int li, const Tensor& n_in, const MambaCallState& call,
                          const Tape& tape, const MixerDout& dout_of, Tensor& dn, GradSink& sink) {
  mamba_mixer_backward(w, li, n_in, call, tape, dout_of, nullptr, dn, sink);
}

// The one implementation: dout is *dout_given, or dout_of(the recomputed output).
static void mamba_mixer_backward(const MambaMixerView& w, int li, const Tensor& n_in, const MambaCallState& call,
                                 const Tape& tape, const MixerDout& dout_of, const Tensor* dout_given, Tensor& dn,
                                 GradSink& sink) {
  const Batch& in = tape.batch;
  const int64_t B = in.batch, T = in.seq, BT = B * T;
  const int64_t D = w.D, E = w.E, N = w.N, R = w.R, K = w.K, XR = R + 2 * N;
  const int64_t H = w.heads, P = E / H, BH = BT * H;  // Zamba's Mamba heads (1 elsewhere); BH rows of x_proj output
  // As the forward: the mask applies whenever the batch has padding (transformers 5.18).
  const bool masked = in.has_padding();

  // ---- recompute (as MambaModel::mixer) -----------------------------------------------------
  Tensor nm = n_in.clone();
  if (masked) detail::apply_row_mask(nm, in);
  Tensor xz({B, T, 2 * E});
  ops::linear(nm.data(), BT, D, *w.in_proj, xz.data(), w.in_proj_bias->defined() ? w.in_proj_bias->data() : nullptr);
  if (w.per_head) detail::deinterleave_xz(xz.data(), BT, E);
  Tensor window = call.conv->clone();
  Tensor c({B, T, E});  // conv output before its SiLU
  ops::causal_conv1d(xz.data(), 2 * E, B, T, E, K, w.conv_wT->data(), w.conv_bias->data(), window.data(), c.data(),
                     false);
  // sigmoid(c) and sigmoid(z) once, vectorized (z copied out of the xz rows): every SiLU and SiLU
  // derivative below reads them.
  Tensor sc({B, T, E}), z({B, T, E}), sz({B, T, E});
  ops::sigmoid(c.data(), sc.data(), BT * E);
  for (int64_t r = 0; r < BT; ++r)
    std::memcpy(z.data() + r * E, xz.data() + r * 2 * E + E, sizeof(float) * static_cast<size_t>(E));
  ops::sigmoid(z.data(), sz.data(), BT * E);
  Tensor u({B, T, E});  // what x_proj reads (before any attention_values write)
  for (int64_t r = 0; r < BT; ++r) {
    const bool keep = !masked || in.mask[static_cast<size_t>(r)];
    for (int64_t e = 0; e < E; ++e) u[r * E + e] = keep ? silu_s(c[r * E + e], sc[r * E + e]) : 0.0f;
  }
  Tensor dbc({B, T, H * XR});
  detail::linear_heads(*w.x_proj, u.data(), BT, E, P, P, H, dbc.data());
  Tensor dbc_raw;  // x_proj's output before FalconMamba's norms (their backward reads it)
  if (w.bcdt_rms_norm) {
    dbc_raw = dbc.clone();
    detail::norm_dt_b_c(dbc.data(), BH, R, N, w.mixer_rms_eps, w.dt_norm, w.b_norm, w.c_norm);
  }
  const Shape bc_shape = w.per_head ? Shape{B, T, H, N} : Shape{B, T, N};  // as served
  Tensor Bm(bc_shape), Cm(bc_shape), dt_pre({B, T, E}), dt({B, T, E});
  for (int64_t r = 0; r < BH; ++r) {
    std::memcpy(Bm.data() + r * N, dbc.data() + r * XR + R, sizeof(float) * static_cast<size_t>(N));
    std::memcpy(Cm.data() + r * N, dbc.data() + r * XR + R + N, sizeof(float) * static_cast<size_t>(N));
  }
  detail::linear_heads(*w.dt_proj, dbc.data(), BT, H * XR, XR, R, H, dt_pre.data());  // as the forward
  for (int64_t r = 0; r < BT; ++r)
    for (int64_t e = 0; e < E; ++e) {
      dt_pre[r * E + e] += (*w.dt_proj_bias)[e];
      dt[r * E + e] = ops::softplus(dt_pre[r * E + e]);
    }
  tape.apply(li, Value::attention_queries, Cm);
  tape.apply(li, Value::attention_keys, Bm);
  Tensor us = u.clone();  // what the scan reads
  tape.apply(li, Value::attention_values, us);
  tape.apply(li, Value::betas, dt);
  // A decays write replaces the dt of every (token, channel) row it changed (the family's rule).
  const Written* wdec = tape.write(li, Value::decays);
  std::vector<uint8_t> row_changed;
  if (wdec) {
    dt = call.betas_for_decays(dt, wdec->value);
    row_changed.assign(static_cast<size_t>(BT * E), 0);
    for (int64_t k = 0; k < BT * E * N; ++k)
      if (wdec->changed[static_cast<size_t>(k)]) row_changed[static_cast<size_t>(k / N)] = 1;
  }
  // The state the scan starts from, with a state_input write laid in (served layout = kernel layout).
  Tensor S0 = call.has_state ? call.ssm->clone() : Tensor({B, E, N});
  const Written* wsi = tape.write(li, Value::state_input);
  if (wsi) wsi->apply(S0);
  // Batch row b's scan inputs, shared by the forward's SelectiveScanArgs and the backward's args.
  const auto row_inputs = [&](auto& a, int64_t b) {
    a.T = T; a.E = E; a.N = N; a.groups = H;
    a.u = us.data() + b * T * E;
    a.dt = dt.data() + b * T * E;
    a.B = Bm.data() + b * T * H * N;
    a.C = Cm.data() + b * T * H * N;
    a.A = w.A->data();
    a.D = w.Dskip->data();
  };
  Tensor y({B, T, E});
  {
    Tensor S = S0.clone();
    for (int64_t b = 0; b < B; ++b) {
      detail::SelectiveScanArgs a;
      row_inputs(a, b);
      a.S = S.data() + b * E * N;
      a.y = y.data() + b * T * E;
      a.chunk = w.chunk;
      if (call.chunked) detail::selective_scan_chunked(a); else detail::selective_scan_recurrent(a);
    }
  }
  tape.apply(li, Value::attention_head_outputs, y);

  Tensor dout;
  if (dout_given) {
    dout = dout_given->clone();
  } else {  // the mixer's output (MambaMixer::forward's tail), for dout_of
    Tensor g({B, T, E}), out({B, T, D});
    for (int64_t k = 0; k < BT * E; ++k) g[k] = y[k] * silu_s(z[k], sz[k]);
    ops::linear(g.data(), BT, E, *w.out_proj, out.data(), w.out_proj_bias && w.out_proj_bias->defined() ? w.out_proj_bias->data() : nullptr);
    tape.apply(li, Value::attention_output, out);
    dout = dout_of(out).clone();  // the caller keeps its tensor: the blocks below must not reach it
  }

  // ---- backward -----------------------------------------------------------------------------
  sink.put(li, Value::attention_output, dout);
  tape.block(li, Value::attention_output, dout);
  Tensor dg({B, T, E});
  linear_backward(dout.data(), BT, D, *w.out_proj, dg.data(), false);
  Tensor dxz({B, T, 2 * E});
  Tensor dy({B, T, E});
  for (int64_t r = 0; r < BT; ++r)
    for (int64_t e = 0; e < E; ++e) {
      const int64_t k = r * E + e;
      dy[k] = dg[k] * silu_s(z[k], sz[k]);
      dxz[r * 2 * E + E + e] = dg[k] * y[k] * silu_grad_s(z[k], sz[k]);
    }
  sink.put(li, Value::attention_head_outputs, dy);
  tape.block(li, Value::attention_head_outputs, dy);

  const bool want_ddA = wdec || sink.wants(li, Value::decays);
  Tensor du({B, T, E}), dB(bc_shape), dC(bc_shape), ddt({B, T, E}), ddtA({B, T, E}), dS0({B, E, N});
  Tensor ddA = want_ddA ? Tensor({B, T, E, N}) : Tensor();
  Tensor dstates = sink.wants(li, Value::states) ? Tensor({B, T, E, N}) : Tensor();
  for (int64_t b = 0; b < B; ++b) {
    SelectiveScanGradArgs a;
    row_inputs(a, b);
    a.S0 = S0.data() + b * E * N;
    a.dy = dy.data() + b * T * E;
    a.du = du.data() + b * T * E;
    a.dB = dB.data() + b * T * H * N;
    a.dC = dC.data() + b * T * H * N;
    a.ddt = ddt.data() + b * T * E;
    a.ddtA = ddtA.data() + b * T * E;
    a.ddA = want_ddA ? ddA.data() + b * T * E * N : nullptr;
    a.dS0 = dS0.data() + b * E * N;
    a.dstates = dstates.defined() ? dstates.data() + b * T * E * N : nullptr;
    a.chunk = std::min<int64_t>(w.chunk, 64);
    selective_scan_backward(a);
  }
  if (dstates.defined()) sink.put(li, Value::states, dstates);
  // state_output feeds only the next call: this call's metric does not depend on it.
  if (sink.wants(li, Value::state_output)) sink.put(li, Value::state_output, Tensor({B, E, N}));
  if (call.has_state || wsi) sink.put(li, Value::state_input, dS0);

  // decays = A dt feeds exp() only; betas = dt is the total derivative through both uses. Where a
  // decays write changed a (token, channel) row, dt = mean_n(decays[n] / A[e,n]) feeds both uses:
  // each written element gets its 1/(N A) share, and dt flows only through elements left unchanged.
  Tensor dbet({B, T, E});
  Tensor ddec = want_ddA ? Tensor({B, T, E, N}) : Tensor();
  for (int64_t k = 0; k < BT * E; ++k) {
    const float* A = w.A->data() + (k % E) * N;
    const float total = ddt[k] + ddtA[k];
    if (!wdec || !row_changed[static_cast<size_t>(k)]) {
      dbet[k] = total;
      if (want_ddA) std::memcpy(ddec.data() + k * N, ddA.data() + k * N, sizeof(float) * static_cast<size_t>(N));
      continue;
    }
    float through = 0.0f;
    for (int64_t m = 0; m < N; ++m) {
      const float g = total / (static_cast<float>(N) * A[m]);
      ddec[k * N + m] = g;
      if (!wdec->changed[static_cast<size_t>(k * N + m)]) through += A[m] * g;
    }
    dbet[k] = through;
  }
  if (want_ddA) sink.put(li, Value::decays, ddec);
  sink.put(li, Value::betas, dbet);
  tape.block(li, Value::betas, dbet);

  // dt = softplus(dt_proj(dt_low) + bias); B, C, dt_low come from x_proj(u).
  Tensor ddbc({B, T, H * XR});
  Tensor ddt_pre({B, T, E});
  // softplus' = sigmoid, vectorized (above 20, where torch's softplus is linear, sigmoid is 1.0f exactly).
  ops::sigmoid(dt_pre.data(), ddt_pre.data(), BT * E);
  for (int64_t k = 0; k < BT * E; ++k) ddt_pre[k] *= dbet[k];
  // ddt_low = ddt_pre @ dt_proj per head, into ddbc's first R columns of each head (zeros until here).
  linear_heads_backward(*w.dt_proj, ddt_pre.data(), BT, H, R, ddbc.data(), H * XR, XR);
  sink.put(li, Value::attention_keys, dB);
  sink.put(li, Value::attention_queries, dC);
  sink.put(li, Value::attention_values, du);
  tape.block(li, Value::attention_keys, dB);
  tape.block(li, Value::attention_queries, dC);
  tape.block(li, Value::attention_values, du);
  for (int64_t r = 0; r < BH; ++r) {
    std::memcpy(ddbc.data() + r * XR + R, dB.data() + r * N, sizeof(float) * static_cast<size_t>(N));
    std::memcpy(ddbc.data() + r * XR + R + N, dC.data() + r * N, sizeof(float) * static_cast<size_t>(N));
  }
  if (w.bcdt_rms_norm) {
    // Each section of a row is normed on its own: gather it, differentiate, lay it back.
    const std::vector<float> ones(static_cast<size_t>(std::max(R, N)), 1.0f);
    struct Section { int64_t off, dim; const float* weight; };
    const Section sections[] = {{0, R, w.dt_norm ? w.dt_norm : ones.data()},
                                {R, N, w.b_norm ? w.b_norm : ones.data()},
                                {R + N, N, w.c_norm ? w.c_norm : ones.data()}};
    for (const auto& [off, dim, weight] : sections) {
      Tensor x({BH, dim}), dnormed({BH, dim}), dx({BH, dim});
      for (int64_t r = 0; r < BH; ++r) {
        std::memcpy(x.data() + r * dim, dbc_raw.data() + r * XR + off, sizeof(float) * static_cast<size_t>(dim));
        std::memcpy(dnormed.data() + r * dim, ddbc.data() + r * XR + off, sizeof(float) * static_cast<size_t>(dim));
      }
      rmsnorm_backward(x.data(), weight, dnormed.data(), dx.data(), BH, dim, w.mixer_rms_eps, false, false);
      for (int64_t r = 0; r < BH; ++r)
        std::memcpy(ddbc.data() + r * XR + off, dx.data() + r * dim, sizeof(float) * static_cast<size_t>(dim));
    }
  }
  // u feeds both x_proj and (unless a write replaced it) the scan.
  linear_heads_backward(*w.x_proj, ddbc.data(), BT, H, P, du.data(), E, P);  // head h read channels [h P, (h+1) P)
  Tensor dc({B, T, E});
  for (int64_t r = 0; r < BT; ++r) {
    const bool keep = !masked || in.mask[static_cast<size_t>(r)];
    for (int64_t e = 0; e < E; ++e) dc[r * E + e] = keep ? du[r * E + e] * silu_grad_s(c[r * E + e], sc[r * E + e]) : 0.0f;
  }
  causal_conv1d_backward(dc.data(), B, T, E, K, w.conv_wT->data(), dxz.data(), 2 * E);
  if (w.per_head) detail::interleave_xz(dxz.data(), BT, E);  // back into in_proj's row order
  linear_backward(dxz.data(), BT, 2 * E, *w.in_proj, dn.data(), false);
  if (masked) detail::apply_row_mask(dn, in);
}

}  // namespace mixlens::grad
