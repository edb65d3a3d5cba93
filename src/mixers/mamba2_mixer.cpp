#include "mixers/mamba2_mixer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "hooks/serve.h"
#include "mixers/ssd.h"
#include "mixlens/errors.h"
#include "ops/ops.h"

namespace mixlens::detail {

Mamba2Mixer::Mamba2Mixer(const Mamba2MixerDims& dims, const std::string& where) : d_(dims) {
  const std::pair<const char*, int64_t> sizes[] = {{"hidden_size", d_.D}, {"intermediate width", d_.E},
                                                   {"num_heads", d_.H},   {"head_dim", d_.P},
                                                   {"n_groups", d_.G},    {"state_size", d_.N},
                                                   {"conv_kernel", d_.K}, {"chunk_size", d_.chunk}};
  for (const auto& [name, v] : sizes)
    if (v <= 0 || v > (int64_t{1} << 32))
      throw ConfigError(where + ": Mamba-2 " + name + " = " + std::to_string(v) + " is out of range (must be a positive size)");
  if (d_.E != d_.H * d_.P)
    throw ConfigError(where + ": the Mamba-2 intermediate width (" + std::to_string(d_.E) +
                      ") must equal num_heads * head_dim (" + std::to_string(d_.H * d_.P) + ")");
  if (d_.H % d_.G != 0)
    throw ConfigError(where + ": num_heads (" + std::to_string(d_.H) + ") is not divisible by n_groups (" +
                      std::to_string(d_.G) + ")");
  if ((d_.norm == Mamba2Norm::gated_grouped || d_.norm == Mamba2Norm::grouped_then_gate) && d_.E % d_.G != 0)
    throw ConfigError(where + ": the intermediate width (" + std::to_string(d_.E) + ") is not divisible by n_groups (" +
                      std::to_string(d_.G) + ") for the grouped gated norm");
  if (!(d_.dt_lo >= 0.0f && d_.dt_lo <= d_.dt_hi))
    throw ConfigError(where + ": time step limit [" + std::to_string(d_.dt_lo) + ", " + std::to_string(d_.dt_hi) +
                      "] must satisfy 0 <= min <= max");
  if (!(d_.eps > 0.0f) || !std::isfinite(d_.eps))
    throw ConfigError(where + ": the Mamba-2 norm epsilon must be a finite number > 0");
}

Mamba2MixerWeights Mamba2Mixer::load(const io::WeightStore& w, const std::string& p) const {
  const int64_t proj = d_.proj_rows(), cd = d_.conv_dim();
  Mamba2MixerWeights l;
  l.in_proj = w.get_matmul(p + "in_proj.weight", {proj, d_.D});
  if (d_.in_proj_bias) l.in_proj_bias = w.get(p + "in_proj.bias", {proj});
  l.conv_wT = transpose_conv(w.get(p + "conv1d.weight", {cd, 1, d_.K}));
  l.conv_bias = d_.conv_bias ? w.get(p + "conv1d.bias", {cd}) : Tensor({cd});
  l.dt_bias = w.get(p + "dt_bias", {d_.H});
  const Tensor A_log = w.get(p + "A_log", {d_.H});
  l.A = Tensor({d_.H});
  for (int64_t h = 0; h < d_.H; ++h) l.A[h] = -std::exp(A_log[h]);
  l.D = w.get(p + "D", {d_.H});
  if (d_.norm != Mamba2Norm::none) l.gnorm = w.get(p + "norm.weight", {d_.E});
  l.out_proj = w.get_matmul(p + "out_proj.weight", {d_.D, d_.E});
  if (d_.out_proj_bias) l.out_proj_bias = w.get(p + "out_proj.bias", {d_.D});
  return l;
}

void Mamba2Mixer::values(int i, int64_t B, int64_t T, std::vector<ValueInfo>& v) const {
  const int64_t H = d_.H, P = d_.P, G = d_.G, N = d_.N;
  v.push_back(layer_value(i, Value::attention_queries, {B, T, G, N}, true, "C after conv+SiLU and padding mask, as mamba2_chunk_scan receives it"));
  v.push_back(layer_value(i, Value::attention_keys, {B, T, G, N}, true, "B after conv+SiLU and padding mask"));
  v.push_back(layer_value(i, Value::attention_values, {B, T, H, P}, true, "x after conv+SiLU and padding mask"));
  v.push_back(layer_value(i, Value::betas, {B, T, H}, true, "dt = softplus(dt + dt_bias), time_step_limit clamp on prompts; write >= 0"));
  v.push_back(layer_value(i, Value::decays, {B, T, H}, true, "A*dt (A = -exp(A_log)); writing it writes dt = decays / A"));
  v.push_back(layer_value(i, Value::state_input, {B, H, N, P}, true, "SSM state the call starts from, key side first; None on a fresh prompt"));
  auto s = layer_value(i, Value::states, {B, T, H, N, P}, false, "SSM state after every token, key side first (computed only when asked)");
  s.writable = false;
  v.push_back(s);
  v.push_back(layer_value(i, Value::state_output, {B, H, N, P}, true, "SSM state after the call's last token (goes to the cache)"));
  v.push_back(layer_value(i, Value::attention_head_outputs, {B, T, H, P}, true,
                          d_.norm == Mamba2Norm::none ? "y = C.S + D*x per head; on a decode step already * silu(z) (transformers gates inside the decode kernel when mamba_rms_norm is off)"
                                                      : "y = C.S + D*x per head, before the gated norm"));
  add_mixing_values(i, B, T, H, N,
                    d_.norm == Mamba2Norm::none ? "D x (per head; on a decode step the head outputs are also gated)" : "D x (per head)", v);
  v.push_back(layer_value(i, Value::attention_output, {B, T, d_.D}, true,
                          d_.out_multiplier != 1.0f ? "out_proj(gated norm(y, z)) * the µP output multiplier (Falcon-H1 ssm_out_multiplier, Granite residual_multiplier), added to the residual"
                                                    : "out_proj(gated RMSNorm(y, z)), added to the residual"));
}

Tensor Mamba2Mixer::forward(const Mamba2MixerWeights& lw, const Tensor& n_in, const Batch& in,
                            const Mamba2MixerCall& call) const {
  const int li = call.layer;
  Listener* ls = call.ls;
  const int64_t B = in.batch, T = in.seq, BT = B * T;
  const int64_t D = d_.D, E = d_.E, H = d_.H, P = d_.P, G = d_.G, N = d_.N, K = d_.K;
  const int64_t conv_dim = d_.conv_dim(), proj = d_.proj_rows();
  // transformers' create_recurrent_attention_mask: no mask for one-token calls or no padding.
  const bool masked = T > 1 && in.has_padding();
  const bool decode = call.has_state && T == 1;
  const float* n = n_in.data();
  Tensor nm;
  if (masked || d_.in_multiplier != 1.0f) {  // apply_mask_to_padding_states, then * ssm_in_multiplier
    nm = n_in.clone();
    if (masked) apply_row_mask(nm, in);
    if (d_.in_multiplier != 1.0f)
      for (int64_t k = 0; k < nm.numel(); ++k) nm[k] *= d_.in_multiplier;
    n = nm.data();
  }
  // Every activation below is written whole before it is read (no zero-fill pass: ~5 MiB a layer
  // of serial memset on a 128-token prompt).
  Tensor zxbcdt = Tensor::uninitialized({B, T, proj});
  ops::linear(n, BT, D, lw.in_proj, zxbcdt.data(), lw.in_proj_bias.defined() ? lw.in_proj_bias.data() : nullptr);
  const auto& m = d_.proj_multipliers;
  if (m[0] != 1.0f || m[1] != 1.0f || m[2] != 1.0f || m[3] != 1.0f || m[4] != 1.0f) {
    // Falcon-H1 mup_vector: z | x | B | C | dt sections of the projection.
    const int64_t ends[5] = {E, 2 * E, 2 * E + G * N, 2 * E + 2 * G * N, proj};
    for (int64_t r = 0; r < BT; ++r) {
      float* row = zxbcdt.data() + r * proj;
      int64_t c = 0;
      for (int s = 0; s < 5; ++s)
        for (; c < ends[s]; ++c) row[c] *= m[static_cast<size_t>(s)];
    }
  }
  if (call.tape) call.tape->keep(li, grad::Kept::in_proj, zxbcdt);  // read-only from here on

  // Causal depthwise conv over xBC with the cached K inputs as left context, then SiLU.
  Tensor xbc = Tensor::uninitialized({B, T, conv_dim});
  ops::causal_conv1d(zxbcdt.data() + E, proj, B, T, conv_dim, K, lw.conv_wT.data(), lw.conv_bias.data(),
                     call.conv->data(), xbc.data(), true);
  if (masked) apply_row_mask(xbc, in);

  // The x | B | C split of xbc and dt = softplus(dt_raw + dt_bias), per block of rows on the pool
  // (a serial pass between parallel ops before). The time-step clamp is applied on prompt /
  // continuation calls only: the reference decode update (selective_state_update) has none.
  Tensor x = Tensor::uninitialized({B, T, H, P}), Bm = Tensor::uninitialized({B, T, G, N}),
         Cm = Tensor::uninitialized({B, T, G, N}), dt = Tensor::uninitialized({B, T, H});
  const int64_t split_blocks = BT < 16 ? 1 : std::min<int64_t>(BT / 8, 4 * ops::num_threads());
  ops::parallel_for(split_blocks, [&](int64_t blk) {
    for (int64_t r = BT * blk / split_blocks, r1 = BT * (blk + 1) / split_blocks; r < r1; ++r) {
      const float* src = xbc.data() + r * conv_dim;
      std::memcpy(x.data() + r * E, src, sizeof(float) * static_cast<size_t>(E));
      std::memcpy(Bm.data() + r * G * N, src + E, sizeof(float) * static_cast<size_t>(G * N));
      std::memcpy(Cm.data() + r * G * N, src + E + G * N, sizeof(float) * static_cast<size_t>(G * N));
      const float* raw = zxbcdt.data() + r * proj + E + conv_dim;
      for (int64_t hh = 0; hh < H; ++hh) {
        float v = ops::softplus(raw[hh] + lw.dt_bias[hh]);
        if (!decode) v = std::min(std::max(v, d_.dt_lo), d_.dt_hi);
        dt[r * H + hh] = v;
      }
    }
  });
  visit_if(ls, li, Value::attention_queries, Cm);
  visit_if(ls, li, Value::attention_keys, Bm);
  visit_if(ls, li, Value::attention_values, x);
  visit_if(ls, li, Value::betas, dt);
  if (ls && ls->wants(li, Value::decays)) {
    // decays and betas are two views of one dt (values.md): a decays write sets dt = decays / A.
    Tensor dec({B, T, H});
    for (int64_t r = 0; r < BT; ++r)
      for (int64_t hh = 0; hh < H; ++hh) dec[r * H + hh] = lw.A[hh] * dt[r * H + hh];
    if (ls->visit(li, Value::decays, dec, dec.shape())) {
      dt = betas_for_decays(lw, dt, dec);
      ls->revised(li, Value::betas, dt);  // a save / copy of betas now holds the dt in use
    }
  }

  Tensor& S = *call.ssm;
  const auto serve = [this](const Tensor& s) { return served_state(s); };
  const auto store = [this](const Tensor& o, Tensor& s) { store_served_state(o, s); };
  visit_state_input(li, S, call.has_state, ls, served_state_shape(), serve, store);

  Tensor y = Tensor::uninitialized({B, T, H, P});
  // Row by row from the row's first real token (left padding: the chunk grid is the row's own, so
  // a row's values are the same alone and in a batch); padded tokens read nothing (x = C = 0).
  SsdBatch sb;
  sb.B = B; sb.T = T; sb.H = H; sb.P = P; sb.G = G; sb.N = N; sb.chunk = d_.chunk; sb.chunked = call.chunked;
  sb.x = x.data(); sb.Bm = Bm.data(); sb.C = Cm.data(); sb.dt = dt.data(); sb.A = lw.A.data(); sb.D = lw.D.data();
  sb.S = S.data(); sb.y = y.data();
  RowScan rs = ssd_row_scan(sb, first_real_tokens(in));
  Tensor states = scan_rows(ls, li, rs, {B, T, H, N, P});
  if (states.defined()) {
    ls->visit(li, Value::states, states, states.shape());
    ls->recycle_stack(std::move(states));
  }
  visit_state_output(li, S, ls, serve, store);

  // Falcon-H1 without mamba_rms_norm gates inside the decode kernel (z passed to
  // selective_state_update), so the decode step's head outputs are served gated.
  const bool gate_in_kernel = d_.norm == Mamba2Norm::none && decode;
  // z of row r is zxbcdt[r * proj, + E): gates go row by row (no divide / modulo per element).
  const auto gate_rows = [&](const float* src, float* dst, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) ops::mul_silu(src + r * E, zxbcdt.data() + r * proj, dst + r * E, E);
  };
  if (gate_in_kernel) gate_rows(y.data(), y.data(), 0, BT);
  visit_if(ls, li, Value::attention_head_outputs, y);
  // The mixing of the call's (possibly written) scan inputs: exact for the head outputs unless a
  // per-token state or the head outputs themselves were written.
  visit_mixing(ls, li, B, T, H, N, [&](const MixBlock& blk, float* M, float* Sin) { ssd_token_mixing(sb, rs.first, blk, M, Sin); });
  if (call.tape && !gate_in_kernel) call.tape->keep(li, grad::Kept::head_outputs, y);  // as written; read-only

  // The gate and the norm per block of rows on the pool (they were a serial pass per layer).
  Tensor g = Tensor::uninitialized({B, T, E});
  const int64_t row_blocks = BT < 16 ? 1 : std::min<int64_t>(BT / 8, 4 * ops::num_threads());
  ops::parallel_for(row_blocks, [&](int64_t blk) {
    const int64_t r0 = BT * blk / row_blocks, r1 = BT * (blk + 1) / row_blocks;
    float* gr = g.data() + r0 * E;
    switch (d_.norm) {
      case Mamba2Norm::gated_full:  // MambaRMSNormGated: gate before norm, over the full E width
        gate_rows(y.data(), g.data(), r0, r1);
        ops::rmsnorm(gr, lw.gnorm.data(), gr, r1 - r0, E, d_.eps);
        break;
      case Mamba2Norm::gated_grouped:
        gate_rows(y.data(), g.data(), r0, r1);
        group_rmsnorm_rows(gr, lw.gnorm.data(), r1 - r0);
        break;
      case Mamba2Norm::grouped_then_gate:
        std::copy(y.data() + r0 * E, y.data() + r1 * E, gr);
        group_rmsnorm_rows(gr, lw.gnorm.data(), r1 - r0);
        gate_rows(g.data(), g.data(), r0, r1);
        break;
      case Mamba2Norm::none:
        if (gate_in_kernel) std::copy(y.data() + r0 * E, y.data() + r1 * E, gr);
        else gate_rows(y.data(), g.data(), r0, r1);
        break;
    }
  });
  Tensor out = Tensor::uninitialized({B, T, D});
  ops::linear(g.data(), BT, E, lw.out_proj, out.data(), lw.out_proj_bias.defined() ? lw.out_proj_bias.data() : nullptr);
  if (d_.out_multiplier != 1.0f)
    for (int64_t k = 0; k < out.numel(); ++k) out[k] *= d_.out_multiplier;
  visit_if(ls, li, Value::attention_output, out);
  return out;
}

void Mamba2Mixer::group_rmsnorm_rows(float* g, const float* w, int64_t rows) const {
  // Per group of E/G channels, each with its slice of the weight (Zamba2RMSNormGated,
  // FalconH1RMSNormGated).
  const int64_t gs = d_.E / d_.G;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t gi = 0; gi < d_.G; ++gi) {
      float* p = g + r * d_.E + gi * gs;
      ops::rmsnorm(p, w + gi * gs, p, 1, gs, d_.eps);
    }
}

// [B,H,P,N] kernel layout <-> [B,H,N,P] served layout (key side first).
Tensor Mamba2Mixer::served_state(const Tensor& S) const {
  // Written whole, so not zero-filled; a per-token state read serves one per token.
  Tensor o = Tensor::uninitialized({S.size(0), d_.H, d_.N, d_.P});
  ssd_serve_state(S.data(), S.size(0) * d_.H, d_.P, d_.N, o.data());
  return o;
}

void Mamba2Mixer::store_served_state(const Tensor& o, Tensor& S) const {
  ssd_store_state(o.data(), S.size(0) * d_.H, d_.P, d_.N, S.data());
}

Tensor Mamba2Mixer::betas_for_decays(const Mamba2MixerWeights& w, const Tensor& betas_before,
                                     const Tensor& decays) const {
  const int64_t H = d_.H;
  Tensor dt(betas_before.shape());
  const int64_t rows = dt.numel() / H;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t hh = 0; hh < H; ++hh) dt[r * H + hh] = decays[r * H + hh] / w.A[hh];
  return dt;
}

}  // namespace mixlens::detail
