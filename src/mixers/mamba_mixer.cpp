#include "mixers/mamba_mixer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "hooks/mixing.h"
#include "hooks/serve.h"
#include "mixers/selective_scan.h"
#include "mixers/ssm_kernels.h"
#include "mixlens/errors.h"
#include "ops/ops.h"

namespace mixlens::detail {

namespace {

// f(r) for every token row r < rows, on the worker pool: the mixer's elementwise passes
// (softplus, gate) cost as much as a GEMM's share when run on one thread.
void for_rows(int64_t rows, const std::function<void(int64_t)>& f) {
  constexpr int64_t kRows = 8;
  ops::parallel_for((rows + kRows - 1) / kRows, [&](int64_t blk) {
    for (int64_t r = blk * kRows; r < std::min(rows, (blk + 1) * kRows); ++r) f(r);
  });
}

const float* opt(const Tensor& t) { return t.defined() ? t.data() : nullptr; }

}  // namespace

void norm_dt_b_c(float* dbc, int64_t rows, int64_t R, int64_t N, float eps, const float* dt_w, const float* b_w,
                 const float* c_w) {
  const int64_t XR = R + 2 * N;
  const std::vector<float> ones(static_cast<size_t>(std::max(R, N)), 1.0f);  // a norm without weight
  const float* wd = dt_w ? dt_w : ones.data();
  const float* wb = b_w ? b_w : ones.data();
  const float* wc = c_w ? c_w : ones.data();
  ops::parallel_rows(rows, XR, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* row = dbc + r * XR;
      ops::rmsnorm(row, wd, row, 1, R, eps);
      ops::rmsnorm(row + R, wb, row + R, 1, N, eps);
      ops::rmsnorm(row + R + N, wc, row + R + N, 1, N, eps);
    }
  });
}

void deinterleave_xz(float* xz, int64_t rows, int64_t E) {
  for_rows(rows, [&](int64_t r) {
    float* row = xz + r * 2 * E;
    const std::vector<float> tmp(row, row + 2 * E);
    for (int64_t c = 0; c < E; ++c) row[c] = tmp[static_cast<size_t>(2 * c)], row[E + c] = tmp[static_cast<size_t>(2 * c + 1)];
  });
}

void interleave_xz(float* xz, int64_t rows, int64_t E) {
  for_rows(rows, [&](int64_t r) {
    float* row = xz + r * 2 * E;
    const std::vector<float> tmp(row, row + 2 * E);
    for (int64_t c = 0; c < E; ++c) row[2 * c] = tmp[static_cast<size_t>(c)], row[2 * c + 1] = tmp[static_cast<size_t>(E + c)];
  });
}

void linear_heads(const Tensor& W, const float* x, int64_t rows, int64_t ldx, int64_t xstep, int64_t in, int64_t H,
                  float* y) {
  if (H == 1 && ldx == in) return ops::linear(x, rows, in, W, y);
  const int64_t out = W.size(0) / H;
  Tensor xh({rows, in});
  auto gather = [&](int64_t h) {
    for (int64_t r = 0; r < rows; ++r) std::memcpy(xh.data() + r * in, x + r * ldx + h * xstep, sizeof(float) * static_cast<size_t>(in));
  };
  if (H == 1) {
    gather(0);
    return ops::linear(xh.data(), rows, in, W, y);
  }
  Tensor yh({rows, out});
  for (int64_t h = 0; h < H; ++h) {
    gather(h);
    ops::linear(xh.data(), rows, in, row_block(W, h * out, {out, in}), yh.data());
    for (int64_t r = 0; r < rows; ++r) std::memcpy(y + (r * H + h) * out, yh.data() + r * out, sizeof(float) * static_cast<size_t>(out));
  }
}

MambaMixerWeights MambaMixer::load(const io::WeightStore& w, const std::string& p) const {
  MambaMixerWeights l;
  const int64_t H = dims_.heads, P = E_ / H, XR = R_ + 2 * N_;
  l.in_proj = w.get_matmul(p + "in_proj.weight", {2 * E_, D_});
  if (use_bias_) l.in_proj_bias = w.get(p + "in_proj.bias", {2 * E_});
  l.conv_wT = transpose_conv(w.get(p + "conv1d.weight", {E_, 1, K_}));
  l.conv_bias = use_conv_bias_ ? w.get(p + "conv1d.bias", {E_}) : Tensor({E_});
  const Tensor A_log = dims_.per_head ? w.get(p + "A_log", {H, P, N_}) : w.get(p + "A_log", {E_, N_});
  if (dims_.per_head) {  // ZambaMambaMixer's per-head tensors: the same rows, head-major
    l.x_proj = w.get_matmul(p + "x_proj_weight", {H, XR, P}).reshape({H * XR, P});
    l.dt_proj = w.get_matmul(p + "dt_proj_weight", {H, P, R_}).reshape({E_, R_});
    l.dt_proj_bias = w.get(p + "dt_proj_bias", {H, P}).reshape({E_});
    l.D = w.get(p + "D", {H, P}).reshape({E_});
  } else {
    l.x_proj = w.get_matmul(p + "x_proj.weight", {XR, E_});
    l.dt_proj = w.get_matmul(p + "dt_proj.weight", {E_, R_});
    l.dt_proj_bias = w.get(p + "dt_proj.bias", {E_});
    l.D = w.get(p + "D", {E_});
  }
  l.A = Tensor({E_, N_});
  for (int64_t k = 0; k < E_ * N_; ++k) l.A[k] = -std::exp(A_log[k]);
  l.out_proj = w.get_matmul(p + "out_proj.weight", {D_, E_});
  if (use_bias_) l.out_proj_bias = w.get(p + "out_proj.bias", {D_});
  if (dims_.bcdt_norm_weights) {
    l.dt_norm = w.get(p + "dt_layernorm.weight", {R_});
    l.b_norm = w.get(p + "b_layernorm.weight", {N_});
    l.c_norm = w.get(p + "c_layernorm.weight", {N_});
  }
  return l;
}

std::string MambaMixer::prompt_kernel(int64_t seq) const {
  // The token loop by default whatever the thread count and the batch (a row's values must not
  // depend on either, and the two algorithms round differently); route_kernels("mamba",
  // "chunked") selects the chunked scan.
  (void)seq;
  return "recurrent";
}

void MambaMixer::values(int i, int64_t B, int64_t T, std::vector<ValueInfo>& v) const {
  const std::string normed = !dims_.bcdt_rms_norm ? "" : dims_.bcdt_norm_weights ? " after its RMS norm (b_layernorm / c_layernorm)" : " after its weightless RMS norm";
  if (dims_.per_head) {
    const Shape bc{B, T, dims_.heads, N_};
    v.push_back(layer_value(i, Value::attention_queries, bc, true, "C from the head's x_proj (shared by the head's E/H channels), as the scan reads the state"));
    v.push_back(layer_value(i, Value::attention_keys, bc, true, "B from the head's x_proj (shared by the head's E/H channels), where each token writes"));
  } else {
    v.push_back(layer_value(i, Value::attention_queries, {B, T, N_}, true, "C from x_proj" + normed + " (shared by all channels), as the scan reads the state"));
    v.push_back(layer_value(i, Value::attention_keys, {B, T, N_}, true, "B from x_proj" + normed + " (shared by all channels), where each token writes"));
  }
  v.push_back(layer_value(i, Value::attention_values, {B, T, E_}, true, "u = silu(conv1d(x)) after the padding mask, as the scan receives it (x_proj has already read it: writes change what tokens write and the D skip, not dt/B/C)"));
  v.push_back(layer_value(i, Value::betas, {B, T, E_}, true, dims_.bcdt_rms_norm ? "dt = softplus(dt_proj(rmsnorm(dt_low))); write >= 0" : "dt = softplus(dt_proj(dt_low)); write >= 0"));
  v.push_back(layer_value(i, Value::decays, {B, T, E_, N_}, true, "A*dt (A = -exp(A_log)) per channel and state index; a write sets dt = decays / A and must imply one dt per (token, channel) across the state axis"));
  v.push_back(layer_value(i, Value::state_input, {B, E_, N_}, true, "SSM state the call starts from; None on a fresh prompt"));
  auto s = layer_value(i, Value::states, {B, T, E_, N_}, false, "SSM state after every token (computed only when asked)");
  s.writable = false;
  v.push_back(s);
  v.push_back(layer_value(i, Value::state_output, {B, E_, N_}, true, "SSM state after the call's last token (goes to the cache)"));
  v.push_back(layer_value(i, Value::attention_head_outputs, {B, T, E_}, true, "y = C.S + D*u per channel, before the silu(z) gate"));
  // Per channel (A is [E,N]): the mixing's "heads" are the d_inner channels, its state rows [N].
  add_mixing_values(i, B, T, E_, N_, "D u (per channel)", v);
  v.push_back(layer_value(i, Value::attention_output, {B, T, D_}, true, "out_proj(y * silu(z)), added to the residual"));
}

Tensor MambaMixer::forward(const MambaMixerWeights& lw, const Tensor& n_in, const Batch& in,
                           const MambaMixerCall& call) const {
  const int li = call.layer;
  Listener* ls = call.ls;
  const int64_t B = in.batch, T = in.seq, BT = B * T, XR = R_ + 2 * N_;
  // transformers applies the 2-D mask whenever one is given (generate gives it on the prompt
  // only); an all-ones mask is a no-op, so "has padding" is the same condition.
  const bool masked = in.has_padding();
  const float* n = n_in.data();
  Tensor nm;
  if (masked) {
    nm = n_in.clone();
    apply_row_mask(nm, in);
    n = nm.data();
  }
  Tensor xz({B, T, 2 * E_});
  ops::linear(n, BT, D_, lw.in_proj, xz.data(), lw.in_proj_bias.defined() ? lw.in_proj_bias.data() : nullptr);
  if (dims_.per_head) deinterleave_xz(xz.data(), BT, E_);

  // Causal depthwise conv over x with the cached K inputs as left context (zeros on a fresh
  // prompt, so a prompt shorter than K sees zero padding), then SiLU and the mask again.
  Tensor u({B, T, E_});
  ops::causal_conv1d(xz.data(), 2 * E_, B, T, E_, K_, lw.conv_wT.data(), lw.conv_bias.data(),
                     call.conv->data(), u.data(), true);
  if (masked) apply_row_mask(u, in);

  // x_proj -> dt_low | B | C (FalconMamba: each RMS-normed); dt = softplus(dt_proj.weight @ dt_low +
  // dt_proj.bias). B and C are served as the scan reads them, after any norm.
  const int64_t H = dims_.heads;
  Tensor dbc({B, T, H * XR});  // per head: dt_low | B | C
  linear_heads(lw.x_proj, u.data(), BT, E_, E_ / H, E_ / H, H, dbc.data());
  if (dims_.bcdt_rms_norm)
    norm_dt_b_c(dbc.data(), BT * H, R_, N_, dims_.mixer_rms_eps, opt(lw.dt_norm), opt(lw.b_norm), opt(lw.c_norm));
  Tensor Bm({B, T, H, N_}), Cm({B, T, H, N_}), dt({B, T, E_});
  if (!dims_.per_head) Bm = Bm.reshape({B, T, N_}), Cm = Cm.reshape({B, T, N_});
  for (int64_t r = 0; r < BT * H; ++r) {
    std::memcpy(Bm.data() + r * N_, dbc.data() + r * XR + R_, sizeof(float) * static_cast<size_t>(N_));
    std::memcpy(Cm.data() + r * N_, dbc.data() + r * XR + R_ + N_, sizeof(float) * static_cast<size_t>(N_));
  }
  // dt_proj through ops::linear (decode: the pool's matvec; 16-bit / int8 weights stay narrow), then
  // the softplus per block of rows on the pool.
  linear_heads(lw.dt_proj, dbc.data(), BT, H * XR, XR, R_, H, dt.data());  // each head's dt_low
  const int64_t dt_blocks = BT < 16 ? 1 : std::min<int64_t>(BT / 8, 2 * ops::num_threads());
  ops::parallel_for(dt_blocks, [&](int64_t blk) {
    const int64_t r0 = BT * blk / dt_blocks, r1 = BT * (blk + 1) / dt_blocks;
    for (int64_t r = r0; r < r1; ++r) softplus_bias(dt.data() + r * E_, lw.dt_proj_bias.data(), dt.data() + r * E_, E_);
  });

  visit_if(ls, li, Value::attention_queries, Cm);
  visit_if(ls, li, Value::attention_keys, Bm);
  visit_if(ls, li, Value::attention_values, u);
  visit_if(ls, li, Value::betas, dt);
  if (ls && ls->wants(li, Value::decays)) visit_decays(li, lw, dt, ls);

  Tensor& S = call.begin_state();
  Tensor y({B, T, E_});  // zeros: padded tokens read nothing (u = 0, C = 0 there)
  const bool chunked = call.chunked;
  // Row by row from the row's first real token (values.md "One number per value"); the scan
  // pauses where the per-token state is wanted (scan_rows: a read on the side, a write splits).
  const auto args = [&](int64_t b, int64_t t0, int64_t t1, float* S_row) {
    SelectiveScanArgs a;
    a.T = t1 - t0; a.E = E_; a.N = N_;
    a.u = u.data() + (b * T + t0) * E_;
    a.dt = dt.data() + (b * T + t0) * E_;
    a.groups = H;
    a.B = Bm.data() + (b * T + t0) * H * N_;
    a.C = Cm.data() + (b * T + t0) * H * N_;
    a.A = lw.A.data();
    a.D = lw.D.data();
    a.S = S_row;
    a.chunk = chunk_;
    return a;
  };
  RowScan rs;
  rs.B = B; rs.T = T; rs.row_numel = E_ * N_; rs.S = S.data(); rs.y_row_numel = T * E_;
  rs.first = first_real_tokens(in);
  rs.chunk = chunked ? chunk_ : 0;
  rs.run = [&](int64_t b, int64_t t0, int64_t t1, float* S_row, float* y_scratch, float* states_row) {
    SelectiveScanArgs a = args(b, t0, t1, S_row);
    a.y = y_scratch ? y_scratch + t0 * E_ : y.data() + (b * T + t0) * E_;
    a.states = states_row ? states_row + t0 * E_ * N_ : nullptr;
    if (chunked) selective_scan_chunked(a); else selective_scan_recurrent(a);
  };
  rs.serve = [&](const float* S_row, float* out) { std::copy(S_row, S_row + E_ * N_, out); };
  rs.store = rs.serve;
  rs.state_at = [&](int64_t b, int64_t ck, const float* S_ck, int64_t t, float* out) {
    selective_scan_state_at(args(b, ck, t + 1, const_cast<float*>(S_ck)), t - ck + 1, out);
  };
  Tensor states = scan_rows(ls, li, rs, {B, T, E_, N_});
  if (states.defined()) {
    ls->visit(li, Value::states, states, states.shape());
    ls->recycle_stack(std::move(states));
  }
  // Left padding: transformers' scan runs through it, where the state stays 0 (u = 0 and B = 0
  // there) and y = D*u, zero unless attention_values was written there (the backward's recompute
  // scans it whole too).
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = b * T; r < b * T + rs.first[static_cast<size_t>(b)]; ++r)
      for (int64_t e = 0; e < E_; ++e)
        if (u[r * E_ + e] != 0.0f) y[r * E_ + e] = lw.D[e] * u[r * E_ + e];
  call.end_state();
  visit_if(ls, li, Value::attention_head_outputs, y);
  // The mixing of the scan inputs as the scan read them (after writes): decays = A dt as served.
  visit_mixing(ls, li, B, T, E_, N_, [&](const MixBlock& blk, float* M, float* Sin) {
    const Tensor dec = decays_of(lw, dt);
    SelectiveMixArgs ma;
    ma.B = B; ma.T = T; ma.E = E_; ma.N = N_; ma.groups = H;
    ma.u = u.data(); ma.dt = dt.data(); ma.Bm = Bm.data(); ma.C = Cm.data(); ma.decay = dec.data();
    mamba_token_mixing(ma, rs.first, blk, M, Sin);
  });

  Tensor g({B, T, E_});
  for_rows(BT, [&](int64_t r) { ops::mul_silu(y.data() + r * E_, xz.data() + r * 2 * E_ + E_, g.data() + r * E_, E_); });
  Tensor out({B, T, D_});
  ops::linear(g.data(), BT, E_, lw.out_proj, out.data(), lw.out_proj_bias.defined() ? lw.out_proj_bias.data() : nullptr);
  visit_if(ls, li, Value::attention_output, out);
  return out;
}

// decays = A*dt has a state axis that dt lacks. A write is mapped back to the one dt per
// (token, channel): rows left bit-identical keep their dt exactly; a changed row must imply the
// same dt = decays[n] / A[e, n] for every n (within kDecayAgreement, relative), and dt is their
// mean. Anything else has no dt that produces it, so it is refused rather than approximated.
Tensor MambaMixer::decays_of(const MambaMixerWeights& lw, const Tensor& dt) const {
  const int64_t B = dt.size(0), T = dt.size(1);
  Tensor dec({B, T, E_, N_});
  for (int64_t r = 0; r < B * T; ++r)
    for (int64_t e = 0; e < E_; ++e)
      for (int64_t k = 0; k < N_; ++k) dec[(r * E_ + e) * N_ + k] = lw.A[e * N_ + k] * dt[r * E_ + e];
  return dec;
}

void MambaMixer::visit_decays(int li, const MambaMixerWeights& lw, Tensor& dt, Listener* ls) const {
  Tensor dec = decays_of(lw, dt);
  if (!ls->visit(li, Value::decays, dec, dec.shape())) return;
  dt = betas_for_decays(li, lw, dt, dec);
  ls->revised(li, Value::betas, dt);  // a save / copy of betas now holds the dt in use
}

Tensor MambaMixer::betas_for_decays(int li, const MambaMixerWeights& lw, const Tensor& betas_before,
                                    const Tensor& dec) const {
  constexpr double kDecayAgreement = 1e-5;
  const int64_t B = betas_before.size(0), T = betas_before.size(1);
  const Tensor before = decays_of(lw, betas_before);
  Tensor dt = betas_before.clone();
  for (int64_t r = 0; r < B * T; ++r)
    for (int64_t e = 0; e < E_; ++e) {
      const float* d = dec.data() + (r * E_ + e) * N_;
      if (std::memcmp(d, before.data() + (r * E_ + e) * N_, sizeof(float) * static_cast<size_t>(N_)) == 0) continue;
      double lo = std::numeric_limits<double>::infinity(), hi = -lo, sum = 0;
      for (int64_t k = 0; k < N_; ++k) {
        const double v = static_cast<double>(d[k]) / lw.A[e * N_ + k];
        lo = std::min(lo, v), hi = std::max(hi, v), sum += v;
      }
      auto where_at = [&] {
        return "write to 'layers." + std::to_string(li) + ".linear_attn.decays': at batch " + std::to_string(r / T) +
               ", token " + std::to_string(r % T) + ", channel " + std::to_string(e);
      };
      if (!std::isfinite(lo) || !std::isfinite(hi))
        throw WriteError(where_at() + " the written decays give a non-finite dt = decays / A");
      if (hi - lo > kDecayAgreement * std::max(std::fabs(hi), std::fabs(lo)))
        throw WriteError(where_at() + ": Mamba-1 decays [B,T,d_inner,state] is A*dt with one dt per (token, "
                         "channel), but the written values imply dt = decays/A from " +
                         std::to_string(lo) + " to " + std::to_string(hi) +
                         " across the state axis; change whole (token, channel) rows consistently (e.g. scale them) "
                         "or write betas instead");
      dt[r * E_ + e] = static_cast<float>(sum / static_cast<double>(N_));
    }
  return dt;
}

}  // namespace mixlens::detail
