// Backward of the Mamba-2 mixer (mixers/mamba2_mixer.cpp): the call is recomputed from its normed
// input with the recorded writes re-applied, then differentiated op by op: out_proj (and
// ssm_out_multiplier), the norm variant (gated full / gated grouped / grouped then gated / none),
// the SSD scan (grad/ssd_grad.cpp), dt's softplus and clamp, the causal conv + SiLU
// (grad/conv1d_grad.cpp), the µP section multipliers, in_proj, ssm_in_multiplier. Reference:
// transformers Mamba2Mixer / NemotronHMamba2Mixer / BambaMixer / FalconH1Mixer torch_forward.
#include <algorithm>
#include <cstring>

#include "grad/families.h"
#include "grad/ops_grad.h"
#include "hooks/serve.h"
#include "mixers/ssd.h"
#include "mixlens/errors.h"
#include "ops/ops.h"

namespace mixlens::grad {

static void mamba2_mixer_backward(const detail::Mamba2Mixer& mixer, const detail::Mamba2MixerWeights& lw, int li,
                                  const Tensor& n_in, const Mamba2CallState& call, const Tape& tape,
                                  const MixerDout& dout_of, Tensor& dn, GradSink& sink, const Tensor* dout_given);

void mamba2_mixer_backward(const detail::Mamba2Mixer& mixer, const detail::Mamba2MixerWeights& lw, int li,
                           const Tensor& n_in, const Mamba2CallState& call, const Tape& tape, const Tensor& dout_in,
                           Tensor& dn, GradSink& sink) {
  mamba2_mixer_backward(mixer, lw, li, n_in, call, tape, MixerDout(), dn, sink, &dout_in);
}

void mamba2_mixer_backward(const detail::Mamba2Mixer& mixer, const detail::Mamba2MixerWeights& lw, int li,
                           const Tensor& n_in, const Mamba2CallState& call, const Tape& tape, const MixerDout& dout_of,
                           Tensor& dn, GradSink& sink) {
  mamba2_mixer_backward(mixer, lw, li, n_in, call, tape, dout_of, dn, sink, nullptr);
}

// The one implementation: dout is *dout_given, or dout_of(the recomputed output).
static void mamba2_mixer_backward(const detail::Mamba2Mixer& mixer, const detail::Mamba2MixerWeights& lw, int li,
                                  const Tensor& n_in, const Mamba2CallState& call, const Tape& tape,
                                  const MixerDout& dout_of, Tensor& dn, GradSink& sink, const Tensor* dout_given) {
  const auto& d = mixer.dims();
  const auto& m = d.proj_multipliers;
  const Batch& in = tape.batch;
  const int64_t B = in.batch, T = in.seq, BT = B * T;
  const int64_t D = d.D, E = d.E, H = d.H, P = d.P, G = d.G, N = d.N, K = d.K;
  const int64_t cd = d.conv_dim(), proj = d.proj_rows();
  const bool masked = T > 1 && in.has_padding();
  const bool decode = call.has_state && T == 1;
  const bool mup = m[0] != 1.0f || m[1] != 1.0f || m[2] != 1.0f || m[3] != 1.0f || m[4] != 1.0f;
  // Falcon-H1 without the norm gates inside the decode kernel: head outputs are served gated.
  const bool gate_in_kernel = d.norm == detail::Mamba2Norm::none && decode;
  const int64_t gs = d.G > 0 ? E / G : E;  // grouped norms: channels per group
  const int64_t sec_end[5] = {E, 2 * E, 2 * E + G * N, 2 * E + 2 * G * N, proj};  // z | x | B | C | dt
  const auto scale_sections = [&](Tensor& t) {  // t [BT, proj] *= the µP section multipliers
    if (!mup) return;
    for (int64_t r = 0; r < BT; ++r) {
      float* row = t.data() + r * proj;
      int64_t c = 0;
      for (int sct = 0; sct < 5; ++sct)
        for (; c < sec_end[sct]; ++c) row[c] *= m[static_cast<size_t>(sct)];
    }
  };
  // RMSNorm of rows [r0, r1) of x [BT, E] into o: over the full width, or per group of E/G with its
  // weight slice.
  const bool grouped = d.norm == detail::Mamba2Norm::gated_grouped || d.norm == detail::Mamba2Norm::grouped_then_gate;
  const int64_t nd = grouped ? gs : E, per_row = E / nd;
  const auto norm_fwd = [&](const Tensor& x, Tensor& o, int64_t r0, int64_t r1) {
    for (int64_t r = r0 * per_row; r < r1 * per_row; ++r) {
      const int64_t gi = r % per_row;
      ops::rmsnorm(x.data() + r * nd, lw.gnorm.data() + gi * nd, o.data() + r * nd, 1, nd, d.eps);
    }
  };
  const auto norm_bwd = [&](const Tensor& x, const Tensor& dy, Tensor& dx, int64_t r0, int64_t r1) {
    if (!grouped) {
      rmsnorm_backward(x.data() + r0 * E, lw.gnorm.data(), dy.data() + r0 * E, dx.data() + r0 * E, r1 - r0, E, d.eps,
                       false, false);
      return;
    }
    for (int64_t r = r0 * per_row; r < r1 * per_row; ++r) {
      const int64_t gi = r % per_row;
      rmsnorm_backward(x.data() + r * nd, lw.gnorm.data() + gi * nd, dy.data() + r * nd, dx.data() + r * nd, 1, nd,
                       d.eps, false, false);
    }
  };

  // ---- recompute (as Mamba2Mixer::forward) -------------------------------------------------
  // A recorded call kept in_proj's output (after the µP multipliers) and the scan's output y (after
  // writes): the two costliest things to recompute (a [BT,D] x [D,proj] product and the scan).
  const Tensor* kept_zx = tape.kept_of(li, Kept::in_proj);
  Tensor zx_own;
  if (!kept_zx) {
    Tensor nm = n_in.clone();
    if (masked) detail::apply_row_mask(nm, in);
    if (d.in_multiplier != 1.0f)
      for (int64_t k = 0; k < nm.numel(); ++k) nm[k] *= d.in_multiplier;
    zx_own = Tensor::uninitialized({B, T, proj});
    ops::linear(nm.data(), BT, D, lw.in_proj, zx_own.data(),
                lw.in_proj_bias.defined() ? lw.in_proj_bias.data() : nullptr);
    scale_sections(zx_own);
  }
  const Tensor& zx = kept_zx ? *kept_zx : zx_own;  // as the conv / gate / dt read it; read-only
  Tensor window = call.conv->clone();
  Tensor u = Tensor::uninitialized({B, T, cd});
  ops::causal_conv1d(zx.data() + E, proj, B, T, cd, K, lw.conv_wT.data(), lw.conv_bias.data(), window.data(), u.data(),
                     false);
  // sigmoid(u) and sigmoid(z) once, vectorized: the SiLUs and their derivatives below use them.
  // z is copied out of the projection rows so that the elementwise loops run over contiguous memory.
  // Every elementwise pass runs in blocks of rows on the pool.
  Tensor su = Tensor::uninitialized({B, T, cd}), z = Tensor::uninitialized({B, T, E}),
         sz = Tensor::uninitialized({B, T, E});
  Tensor x = Tensor::uninitialized({B, T, H, P}), Bm = Tensor::uninitialized({B, T, G, N}),
         Cm = Tensor::uninitialized({B, T, G, N});
  Tensor dt_pre = Tensor::uninitialized({B, T, H}), dt = Tensor::uninitialized({B, T, H});
  std::vector<uint8_t> pass(static_cast<size_t>(BT * H), 1);  // the clamp passes the gradient
  ops::parallel_rows(BT, cd + E, [&](int64_t r0, int64_t r1) {
    ops::sigmoid(u.data() + r0 * cd, su.data() + r0 * cd, (r1 - r0) * cd);
    for (int64_t r = r0; r < r1; ++r)
      std::memcpy(z.data() + r * E, zx.data() + r * proj, sizeof(float) * static_cast<size_t>(E));
    ops::sigmoid(z.data() + r0 * E, sz.data() + r0 * E, (r1 - r0) * E);
    for (int64_t r = r0; r < r1; ++r) {
      const bool keep = !masked || in.mask[static_cast<size_t>(r)];
      const float* src = u.data() + r * cd;
      const float* sg = su.data() + r * cd;
      float* dst[3] = {x.data() + r * E, Bm.data() + r * G * N, Cm.data() + r * G * N};
      const int64_t off[3] = {0, E, E + G * N}, len[3] = {E, G * N, G * N};
      for (int sct = 0; sct < 3; ++sct) {
        const float* vs = src + off[sct];
        const float* ss = sg + off[sct];
        float* o = dst[sct];
        for (int64_t c = 0; c < len[sct]; ++c) o[c] = keep ? silu_s(vs[c], ss[c]) : 0.0f;
      }
      for (int64_t h = 0; h < H; ++h) {
        const float pre = zx[r * proj + E + cd + h] + lw.dt_bias[h];
        float v = ops::softplus(pre);
        if (!decode) {
          // torch.clamp's gradient is 1 inside [lo, hi] (bounds included), 0 outside.
          pass[static_cast<size_t>(r * H + h)] = v >= d.dt_lo && v <= d.dt_hi;
          v = std::min(std::max(v, d.dt_lo), d.dt_hi);
        }
        dt_pre[r * H + h] = pre;
        dt[r * H + h] = v;
      }
    }
  });
  tape.apply(li, Value::attention_queries, Cm);
  tape.apply(li, Value::attention_keys, Bm);
  tape.apply(li, Value::attention_values, x);
  tape.apply(li, Value::betas, dt);
  const Written* wdec = tape.write(li, Value::decays);
  if (wdec)  // a decays write sets dt = decays / A where it changed something
    for (int64_t k = 0; k < BT * H; ++k)
      if (wdec->changed[static_cast<size_t>(k)]) dt[k] = wdec->value[k] / lw.A[k % H];
  // The state the scan starts from (kernel layout), with a state_input write laid in.
  Tensor S0 = call.has_state ? call.ssm->clone() : Tensor({B, H, P, N});
  const Written* wsi = tape.write(li, Value::state_input);
  if (wsi) {
    Tensor served = mixer.served_state(S0);
    wsi->apply(served);
    mixer.store_served_state(served, S0);
  }
  // Batch row b's scan inputs, shared by the forward's SsdArgs and the backward's SsdGradArgs.
  const auto row_inputs = [&](auto& a, int64_t b) {
    a.T = T; a.H = H; a.P = P; a.G = G; a.N = N;
    a.x = x.data() + b * T * E;
    a.B = Bm.data() + b * T * G * N;
    a.C = Cm.data() + b * T * G * N;
    a.dt = dt.data() + b * T * H;
    a.A = lw.A.data();
    a.D = lw.D.data();
  };
  const auto zsilu = [&](int64_t k) { return silu_s(z[k], sz[k]); };
  // The forward's y is kept unless the decode kernel gated it (gate_in_kernel needs y before the gate).
  const Tensor* kept_y = gate_in_kernel ? nullptr : tape.kept_of(li, Kept::head_outputs);
  Tensor y_own, y_raw;  // y_raw: the scan's output before the decode kernel's gate (gate_in_kernel only)
  if (!kept_y) {
    y_own = Tensor::uninitialized({B, T, H, P});
    Tensor S = S0.clone();
    for (int64_t b = 0; b < B; ++b) {
      detail::SsdArgs a;
      row_inputs(a, b);
      a.S = S.data() + b * H * P * N;
      a.y = y_own.data() + b * T * E;
      a.chunk = d.chunk;
      if (call.chunked) detail::ssd_chunked(a); else detail::ssd_recurrent(a);
    }
    if (gate_in_kernel) {
      y_raw = y_own.clone();
      for (int64_t k = 0; k < BT * E; ++k) y_own[k] *= zsilu(k);
    }
    tape.apply(li, Value::attention_head_outputs, y_own);
  }
  const Tensor& y = kept_y ? *kept_y : y_own;  // read-only
  // g0: what the backward of the norm variant needs: the gated y the norm reads (gated_*), or
  // norm(y) which the gate multiplies (grouped_then_gate).
  Tensor g0 = Tensor::uninitialized({B, T, E});
  if (d.norm != detail::Mamba2Norm::none)
    ops::parallel_rows(BT, E, [&](int64_t r0, int64_t r1) {
      if (d.norm == detail::Mamba2Norm::grouped_then_gate) {
        norm_fwd(y, g0, r0, r1);
        return;
      }
      ops::mul_silu(y.data() + r0 * E, z.data() + r0 * E, g0.data() + r0 * E, (r1 - r0) * E);
    });

  Tensor dout_in;
  if (dout_given) {
    dout_in = *dout_given;
  } else {  // the mixer's output (Mamba2Mixer::forward's tail), for dout_of
    Tensor gn({B, T, E});
    switch (d.norm) {
      case detail::Mamba2Norm::gated_full:
      case detail::Mamba2Norm::gated_grouped:
        ops::parallel_rows(BT, E, [&](int64_t r0, int64_t r1) { norm_fwd(g0, gn, r0, r1); });
        break;
      case detail::Mamba2Norm::grouped_then_gate:
        for (int64_t k = 0; k < BT * E; ++k) gn[k] = g0[k] * zsilu(k);
        break;
      case detail::Mamba2Norm::none:
        for (int64_t k = 0; k < BT * E; ++k) gn[k] = gate_in_kernel ? y[k] : y[k] * zsilu(k);
        break;
    }
    Tensor out({B, T, D});
    ops::linear(gn.data(), BT, E, lw.out_proj, out.data(), lw.out_proj_bias.defined() ? lw.out_proj_bias.data() : nullptr);
    if (d.out_multiplier != 1.0f)
      for (int64_t k = 0; k < out.numel(); ++k) out[k] *= d.out_multiplier;
    tape.apply(li, Value::attention_output, out);
    dout_in = dout_of(out);
  }

  // ---- backward -----------------------------------------------------------------------------
  Tensor dout = dout_in.clone();
  sink.put(li, Value::attention_output, dout);
  tape.block(li, Value::attention_output, dout);
  if (d.out_multiplier != 1.0f)  // attention_output is served after ssm_out_multiplier
    for (int64_t k = 0; k < dout.numel(); ++k) dout[k] *= d.out_multiplier;
  Tensor dgn = Tensor::uninitialized({B, T, E});
  linear_backward(dout.data(), BT, D, lw.out_proj, dgn.data(), false);
  // dzx: d(the projection as the conv / gate / dt read it); the gate's gradient goes straight into
  // its first E columns, the conv's and dt's below.
  Tensor dy = Tensor::uninitialized({B, T, H, P}), dzx = Tensor::uninitialized({B, T, proj});
  Tensor dg0;
  if (d.norm != detail::Mamba2Norm::none) dg0 = Tensor::uninitialized({B, T, E});
  ops::parallel_rows(BT, 2 * E, [&](int64_t r0, int64_t r1) {
    switch (d.norm) {
      case detail::Mamba2Norm::gated_full:
      case detail::Mamba2Norm::gated_grouped:
        norm_bwd(g0, dgn, dg0, r0, r1);
        for (int64_t r = r0; r < r1; ++r) {
          float* dz = dzx.data() + r * proj;
          for (int64_t c = 0; c < E; ++c) {
            const int64_t k = r * E + c;
            dy[k] = dg0[k] * zsilu(k);
            dz[c] = dg0[k] * y[k] * silu_grad_s(z[k], sz[k]);
          }
        }
        break;
      case detail::Mamba2Norm::grouped_then_gate:
        for (int64_t r = r0; r < r1; ++r) {
          float* dz = dzx.data() + r * proj;
          for (int64_t c = 0; c < E; ++c) {
            const int64_t k = r * E + c;
            dg0[k] = dgn[k] * zsilu(k);
            dz[c] = dgn[k] * g0[k] * silu_grad_s(z[k], sz[k]);
          }
        }
        norm_bwd(y, dg0, dy, r0, r1);
        break;
      case detail::Mamba2Norm::none:
        for (int64_t r = r0; r < r1; ++r) {
          float* dz = dzx.data() + r * proj;
          for (int64_t c = 0; c < E; ++c) {
            const int64_t k = r * E + c;
            dy[k] = gate_in_kernel ? dgn[k] : dgn[k] * zsilu(k);
            dz[c] = gate_in_kernel ? 0.0f : dgn[k] * y[k] * silu_grad_s(z[k], sz[k]);
          }
        }
        break;
    }
  });
  sink.put(li, Value::attention_head_outputs, dy);
  tape.block(li, Value::attention_head_outputs, dy);
  if (gate_in_kernel)  // back through the decode kernel's gate y = y_raw * silu(z)
    for (int64_t r = 0; r < BT; ++r)
      for (int64_t c = 0; c < E; ++c) {
        const int64_t k = r * E + c;
        dzx[r * proj + c] = dy[k] * y_raw[k] * silu_grad_s(z[k], sz[k]);
        dy[k] *= zsilu(k);
      }

  Tensor dx = Tensor::uninitialized({B, T, H, P}), dB = Tensor::uninitialized({B, T, G, N}),
         dC = Tensor::uninitialized({B, T, G, N}), ddt = Tensor::uninitialized({B, T, H}),
         ddA = Tensor::uninitialized({B, T, H}), dS0 = Tensor::uninitialized({B, H, P, N});
  Tensor dstates;
  if (sink.wants(li, Value::states)) dstates = Tensor({B, T, H, N, P});
  for (int64_t b = 0; b < B; ++b) {
    SsdGradArgs a;
    row_inputs(a, b);
    a.S0 = S0.data() + b * H * P * N;
    a.dy = dy.data() + b * T * E;
    a.dx = dx.data() + b * T * E;
    a.dB = dB.data() + b * T * G * N;
    a.dC = dC.data() + b * T * G * N;
    a.ddt = ddt.data() + b * T * H;
    a.ddA = ddA.data() + b * T * H;
    a.dS0 = dS0.data() + b * H * P * N;
    a.dstates = dstates.defined() ? dstates.data() + b * T * H * N * P : nullptr;
    a.chunk = std::min<int64_t>(d.chunk, 64);
    ssd_backward(a);
  }
  if (dstates.defined()) sink.put(li, Value::states, dstates);
  // state_output feeds only the next call: this call's metric does not depend on it.
  if (sink.wants(li, Value::state_output)) sink.put(li, Value::state_output, Tensor({B, H, N, P}));
  if (call.has_state || wsi) sink.put(li, Value::state_input, mixer.served_state(dS0));

  // decays = A dt: the decay path's gradient; betas = dt: both paths (where no decays write replaced dt).
  Tensor ddec = Tensor::uninitialized({B, T, H}), dbet = Tensor::uninitialized({B, T, H});
  for (int64_t k = 0; k < BT * H; ++k) {
    const float A = lw.A[k % H];
    const bool replaced = wdec && wdec->changed[static_cast<size_t>(k)];
    ddec[k] = replaced ? ddA[k] + ddt[k] / A : ddA[k];
    dbet[k] = replaced ? 0.0f : ddt[k] + A * ddA[k];
  }
  sink.put(li, Value::decays, ddec);
  sink.put(li, Value::betas, dbet);
  tape.block(li, Value::betas, dbet);
  for (int64_t r = 0; r < BT; ++r)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t k = r * H + h;
      dzx[r * proj + E + cd + h] = pass[static_cast<size_t>(k)] ? dbet[k] * softplus_grad(dt_pre[k]) : 0.0f;
    }

  sink.put(li, Value::attention_values, dx);
  sink.put(li, Value::attention_keys, dB);
  sink.put(li, Value::attention_queries, dC);
  tape.block(li, Value::attention_values, dx);
  tape.block(li, Value::attention_keys, dB);
  tape.block(li, Value::attention_queries, dC);
  Tensor du = Tensor::uninitialized({B, T, cd});
  ops::parallel_rows(BT, cd, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* o = du.data() + r * cd;
      if (masked && !in.mask[static_cast<size_t>(r)]) {
        std::fill(o, o + cd, 0.0f);
        continue;
      }
      const float* src[3] = {dx.data() + r * E, dB.data() + r * G * N, dC.data() + r * G * N};
      const int64_t off[3] = {0, E, E + G * N}, len[3] = {E, G * N, G * N};
      for (int sct = 0; sct < 3; ++sct) {
        const float* g = src[sct];
        const float* uv = u.data() + r * cd + off[sct];
        const float* sg = su.data() + r * cd + off[sct];
        float* os = o + off[sct];
        for (int64_t c = 0; c < len[sct]; ++c) os[c] = g[c] * silu_grad_s(uv[c], sg[c]);
      }
    }
  });
  causal_conv1d_backward(du.data(), B, T, cd, K, lw.conv_wT.data(), dzx.data() + E, proj);
  scale_sections(dzx);  // d(raw projection) = multiplier * d(scaled projection)
  linear_backward(dzx.data(), BT, proj, lw.in_proj, dn.data(), false);
  if (d.in_multiplier != 1.0f)
    for (int64_t k = 0; k < dn.numel(); ++k) dn[k] *= d.in_multiplier;
  if (masked) detail::apply_row_mask(dn, in);
}

}  // namespace mixlens::grad
