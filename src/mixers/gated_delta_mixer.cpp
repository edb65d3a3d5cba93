#include "mixers/gated_delta_mixer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "hooks/serve.h"
#include "mixers/gated_delta.h"
#include "mixlens/errors.h"
#include "ops/ops.h"

namespace mixlens::detail {

Tensor kda_latent_times(const Tensor& proj, int64_t rows, int64_t pr, int64_t c0, int64_t Dk, const Tensor& W) {
  Tensor lat = Tensor::uninitialized({rows, Dk}), out = Tensor::uninitialized({rows, W.size(0)});
  for (int64_t row = 0; row < rows; ++row)
    std::memcpy(lat.data() + row * Dk, proj.data() + row * pr + c0, sizeof(float) * static_cast<size_t>(Dk));
  ops::linear(lat.data(), rows, Dk, W, out.data());
  return out;
}

void gdn_beta_decay(const float* proj, int64_t rows, int64_t pr, int64_t b_col, int64_t HV, int64_t gw, float beta_scale,
                    const float* neg_A, const float* dt_bias, const float* fa, float* beta, float* g) {
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t j = 0; j < HV; ++j) {
      const float* pb = proj + row * pr + b_col;
      beta[row * HV + j] = beta_scale * ops::sigmoid(pb[j]);
      for (int64_t d = 0; d < gw; ++d) {
        const float a = fa ? fa[(row * HV + j) * gw + d] : pb[HV + j];
        g[(row * HV + j) * gw + d] = neg_A[j] * ops::softplus(a + dt_bias[j * gw + d]);
      }
    }
}

void GatedDeltaMixer::load(const io::WeightStore& w, const std::string& m, GatedDeltaMixerWeights& l) const {
  if (g_.kda) {  // KimiLinearDeltaAttention's checkpoint names (one conv per q / k / v, low-rank gates)
    Tensor conv({g_.conv_dim(), 1, K_});
    int64_t row = 0;
    for (const auto& [name, rows] : {std::pair{"q_conv1d", g_.key_dim()}, {"k_conv1d", g_.key_dim()}, {"v_conv1d", g_.value_dim()}}) {
      const Tensor c = w.get(m + name + ".weight", {rows, 1, K_});
      std::memcpy(conv.data() + row * K_, c.data(), sizeof(float) * static_cast<size_t>(rows * K_));
      row += rows;
    }
    l.conv_wT = transpose_conv(conv);
    const Tensor A_log = w.get(m + "A_log", {1, 1, g_.HV, 1});
    l.neg_A = Tensor({g_.HV});
    for (int64_t h = 0; h < g_.HV; ++h) l.neg_A[h] = -std::exp(A_log[h]);
    l.dt_bias = w.get(m + "dt_bias", {g_.HV * g_.Dk});
    l.f_b = w.get_matmul(m + "f_b_proj.weight", {g_.HV * g_.Dk, g_.Dk});
    l.g_b = w.get_matmul(m + "g_b_proj.weight", {g_.value_dim(), g_.Dk});
    l.gnorm = w.get(m + "o_norm.weight", {g_.Dv});
    l.out_proj = w.get_matmul(m + "o_proj.weight", {D_, g_.value_dim()});
    return;
  }
  if (opt_.split_conv && !w.has(m + "conv1d.weight")) {
    // q_conv1d | k_conv1d | v_conv1d stacked in that order, as transformers' Concatenate(dim=0) loads
    // them. Only the total is checked: transformers 5.18's save_pretrained splits conv1d back into three
    // near-equal parts (not key_dim / key_dim / value_dim), and its loader concatenates whatever it finds.
    std::vector<Tensor> parts;
    int64_t rows = 0;
    for (const char* part : {"q_conv1d", "k_conv1d", "v_conv1d"}) {
      parts.push_back(w.get(m + part + ".weight"));
      const Tensor& t = parts.back();
      if (t.shape().size() != 3 || t.size(1) != 1 || t.size(2) != K_)
        throw CheckpointError(m + part + ".weight has shape " + shape_str(t.shape()) + ", expected [n, 1, " +
                              std::to_string(K_) + "] (linear_conv_kernel_dim)");
      rows += t.size(0);
    }
    if (rows != g_.conv_dim())
      throw CheckpointError(m + "q_conv1d / k_conv1d / v_conv1d have " + std::to_string(rows) + " channels together, expected " +
                            std::to_string(g_.conv_dim()) + " (2 * key heads * key dim + value heads * value dim)");
    Tensor conv({rows, 1, K_});
    int64_t row = 0;
    for (const Tensor& t : parts) {
      std::memcpy(conv.data() + row * K_, t.data(), sizeof(float) * static_cast<size_t>(t.size(0) * K_));
      row += t.size(0);
    }
    l.conv_wT = transpose_conv(conv);
  } else {
    l.conv_wT = transpose_conv(w.get(m + "conv1d.weight", {g_.conv_dim(), 1, K_}));
  }
  const Tensor A_log = w.get(m + "A_log", {g_.HV});
  l.neg_A = Tensor({g_.HV});
  for (int64_t h = 0; h < g_.HV; ++h) l.neg_A[h] = -std::exp(A_log[h]);
  l.dt_bias = w.get(m + "dt_bias", {g_.HV});
  l.gnorm = w.get(m + opt_.norm_name + ".weight", {g_.Dv});
  l.out_proj = w.get_matmul(m + opt_.out_name + ".weight", {D_, g_.value_dim()});
}

// Qwen3_5GatedDeltaNet.forward (OlmoHybridGatedDeltaNet.forward with GdnOptions; KimiLinearDeltaAttention.forward with kda).
Tensor GatedDeltaMixer::forward(const GatedDeltaMixerWeights& l, const Tensor& n_in, const Batch& in, bool masked,
                                const GatedDeltaMixerCall& call) const {
  const int li = call.layer;
  Listener* ls = call.ls;
  const int64_t B = in.batch, T = in.seq, BT = B * T;
  const int64_t HK = g_.HK, HV = g_.HV, Dk = g_.Dk, Dv = g_.Dv, rep = HV / HK;
  const int64_t cd = g_.conv_dim(), vd = g_.value_dim(), pr = g_.proj_rows();
  const Tensor nm = masked_input(n_in, in, masked);
  const float* n = nm.data();
  Tensor proj = Tensor::uninitialized({B, T, pr});
  ops::linear(n, BT, D_, l.in_proj, proj.data());
  if (call.tape) call.tape->keep(li, grad::Kept::in_proj, proj);  // read-only from here on
  Tensor qkv = Tensor::uninitialized({B, T, cd});
  ops::causal_conv1d(proj.data(), pr, B, T, cd, K_, l.conv_wT.data(), nullptr,
                     call.conv->data(), qkv.data(), true);
  // Split, repeating q/k heads for value heads (value head j reads key head j / rep).
  Tensor q = Tensor::uninitialized({B, T, HV, Dk}), k = Tensor::uninitialized({B, T, HV, Dk}), v = Tensor::uninitialized({B, T, HV, Dv});
  ops::parallel_rows(BT, 2 * HV * Dk + vd, [&](int64_t row0, int64_t row1) {
    for (int64_t row = row0; row < row1; ++row) {
      const float* src = qkv.data() + row * cd;
      for (int64_t j = 0; j < HV; ++j) {
        std::memcpy(q.data() + (row * HV + j) * Dk, src + (j / rep) * Dk, sizeof(float) * static_cast<size_t>(Dk));
        std::memcpy(k.data() + (row * HV + j) * Dk, src + g_.key_dim() + (j / rep) * Dk, sizeof(float) * static_cast<size_t>(Dk));
      }
      std::memcpy(v.data() + row * vd, src + 2 * g_.key_dim(), sizeof(float) * static_cast<size_t>(vd));
    }
  });
  visit_if(ls, li, Value::attention_queries, q);
  visit_if(ls, li, Value::attention_keys, k);
  visit_if(ls, li, Value::attention_values, v);
  const int64_t zr = g_.z_rows(), gw = g_.decay_width();
  Tensor beta = Tensor::uninitialized({B, T, HV});
  Tensor g = g_.kda ? Tensor::uninitialized({B, T, HV, Dk}) : Tensor::uninitialized({B, T, HV});
  const Tensor fa = g_.kda ? kda_latent_times(proj, BT, pr, cd + zr + HV, Dk, l.f_b) : Tensor();  // f_b(f_a(x)) [BT, HV*Dk]
  gdn_beta_decay(proj.data(), BT, pr, cd + zr, HV, gw, opt_.beta_scale, l.neg_A.data(), l.dt_bias.data(),
                 g_.kda ? fa.data() : nullptr, beta.data(), g.data());
  visit_if(ls, li, Value::betas, beta);
  visit_if(ls, li, Value::decays, g);

  Tensor& S = *call.ssm;
  visit_state_input(li, S, call.has_state, ls, Shape{HV, Dk, Dv}, [](const Tensor& s) { return s.clone(); },
                    [](const Tensor& o, Tensor& s) {
                      std::memcpy(s.data(), o.data(), sizeof(float) * static_cast<size_t>(s.numel()));
                    });
  Tensor o = Tensor::uninitialized({B, T, HV, Dv});
  const int64_t SN = HV * Dk * Dv;  // one row's state
  GatedDeltaArgs a;
  a.B = 1; a.T = T; a.H = HV; a.Dk = Dk; a.Dv = Dv;
  // Row b's arguments: the kernel sees one row (its own chunk grid, from its first real token).
  const auto row_args = [&](int64_t b, float* S_row) {
    GatedDeltaArgs r = a;
    r.q = q.data() + b * T * HV * Dk; r.k = k.data() + b * T * HV * Dk; r.v = v.data() + b * T * vd;
    r.g = g.data() + b * T * HV * gw; r.beta = beta.data() + b * T * HV;
    r.g_per_key = g_.kda;
    r.S = S_row;
    return r;
  };
  RowScan rs;
  rs.B = B; rs.T = T; rs.row_numel = SN; rs.S = S.data(); rs.y_row_numel = T * vd;
  rs.first = first_real_tokens(in);
  const bool chunked = call.chunked;
  rs.chunk = chunked ? a.chunk : 0;
  // A gradient call keeps the state entering every chunk (with o below) when the scan runs whole on
  // the chunked kernel from token 0 (no per-token stops, no padding): the backward's checkpoints,
  // so it does not rerun the scan.
  Tensor entry;
  const bool unpadded = std::all_of(rs.first.begin(), rs.first.end(), [](int64_t f) { return f == 0; });
  if (call.tape && chunked && unpadded && !(ls && ls->wants(li, Value::state)))
    entry = Tensor::uninitialized({B, HV, (T + a.chunk - 1) / a.chunk, Dk, Dv});
  // The last chunk's keys and deltas per row, for a per-token read (gated_delta_state_at).
  std::vector<float> last_kn, last_delta;
  if (chunked && ls && ls->wants(li, Value::state)) {
    last_kn.resize(static_cast<size_t>(B * HV * a.chunk * Dk));
    last_delta.resize(static_cast<size_t>(B * HV * a.chunk * Dv));
  }
  rs.run = [&](int64_t b, int64_t t0, int64_t t1, float* S_row, float* y_scratch, float* states_row) {
    GatedDeltaArgs r = row_args(b, S_row);
    r.o = y_scratch ? y_scratch : o.data() + b * T * vd;
    r.states = states_row;
    r.t_begin = t0;
    r.t_end = t1;
    if (entry.defined()) r.chunk_entry = entry.data() + b * HV * ((T + a.chunk - 1) / a.chunk) * Dk * Dv;
    if (!last_kn.empty() && !y_scratch) {
      r.last_kn = last_kn.data() + b * HV * a.chunk * Dk;
      r.last_delta = last_delta.data() + b * HV * a.chunk * Dv;
    }
    if (chunked) gated_delta_chunked(r); else gated_delta_recurrent(r);
  };
  rs.serve = [&](const float* S_row, float* out) { std::memcpy(out, S_row, sizeof(float) * static_cast<size_t>(SN)); };
  rs.store = rs.serve;
  rs.state_at = [&](int64_t b, int64_t ck, const float* S_ck, int64_t t, float* out) {
    GatedDeltaArgs r = row_args(b, const_cast<float*>(S_ck));
    r.t_begin = ck;
    r.last_kn = last_kn.data() + b * HV * a.chunk * Dk;
    r.last_delta = last_delta.data() + b * HV * a.chunk * Dv;
    gated_delta_state_at(r, t, out);
  };
  for (int64_t b = 0; b < B; ++b)  // padded tokens read nothing (q = 0)
    std::fill(o.data() + b * T * vd, o.data() + (b * T + std::min(rs.first[static_cast<size_t>(b)], T)) * vd, 0.0f);
  Tensor states = scan_rows(ls, li, rs, {B, T, HV, Dk, Dv});
  if (states.defined()) {
    ls->visit(li, Value::states, states, states.shape());
    ls->recycle_stack(std::move(states));
  }
  visit_if(ls, li, Value::state_output, S);  // served layout is the cache layout: writes land in place
  visit_if(ls, li, Value::attention_head_outputs, o);
  visit_mixing(ls, li, B, T, HV, Dk, [&](const MixBlock& blk, float* M, float* Sin) {
    GatedDeltaArgs all = row_args(0, nullptr);
    all.B = B;
    gated_delta_token_mixing(all, rs.first, blk, M, Sin);
  });
  if (entry.defined()) {  // o as the gated norm reads it (after writes)
    call.tape->keep(li, grad::Kept::chunk_states, entry);
    call.tape->keep(li, grad::Kept::head_outputs, o);
  }

  // Qwen3_5RMSNormGated: norm first (plain weight), then * silu(z), per value head over Dv;
  // KimiLinearRMSNormGated: the same with * sigmoid(g_b(g_a(x))).
  const Tensor zk = g_.kda ? kda_latent_times(proj, BT, pr, cd, Dk, l.g_b) : Tensor();  // the gate g_b(g_a(x)) [BT, vd]
  Tensor y = Tensor::uninitialized({B, T, vd});
  ops::parallel_rows(BT, vd, [&](int64_t row0, int64_t row1) {
    for (int64_t row = row0; row < row1; ++row)
      for (int64_t j = 0; j < HV; ++j) {
        const float* oj = o.data() + (row * HV + j) * Dv;
        float* yj = y.data() + row * vd + j * Dv;
        float ss = 0.0f;
        for (int64_t e = 0; e < Dv; ++e) ss += oj[e] * oj[e];
        const float inv = ops::inv_rms(ss / static_cast<float>(Dv), eps_);
        for (int64_t e = 0; e < Dv; ++e) yj[e] = l.gnorm[e] * (oj[e] * inv);
        if (g_.kda) {
          const float* z = zk.data() + row * vd + j * Dv;
          for (int64_t e = 0; e < Dv; ++e) yj[e] *= ops::sigmoid(z[e]);
        } else {
          ops::mul_silu(yj, proj.data() + row * pr + cd + j * Dv, yj, Dv);  // * silu(z), vectorized
        }
      }
  });
  Tensor out = Tensor::uninitialized({B, T, D_});
  ops::linear(y.data(), BT, vd, l.out_proj, out.data());
  visit_if(ls, li, Value::attention_output, out);
  return out;
}

}  // namespace mixlens::detail
