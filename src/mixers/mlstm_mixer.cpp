#include "mixers/mlstm_mixer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "hooks/mixing.h"
#include "hooks/serve.h"
#include "mixlens/errors.h"
#include "ops/ops.h"

namespace mixlens::detail {

namespace {

/// torch.nn.functional.logsigmoid: min(x, 0) - log1p(exp(-|x|)), finite for every finite x.
float log_sigmoid(float x) { return std::min(x, 0.0f) - std::log1p(std::exp(-std::fabs(x))); }

/// The read of one head: h = (qs C) / (max(|qs . n|, exp(-m)) + eps), qs the scaled query.
void read_head(const MlstmMixerDims& d, const float* qs, const float* C, const float* n, float m, float* h) {
  float qn = 0.0f;
  for (int64_t a = 0; a < d.Dqk; ++a) qn += qs[a] * n[a];
  const float den = std::max(std::fabs(qn), std::exp(-m)) + d.eps;
  for (int64_t e = 0; e < d.Dv; ++e) h[e] = 0.0f;
  for (int64_t a = 0; a < d.Dqk; ++a)
    for (int64_t e = 0; e < d.Dv; ++e) h[e] += qs[a] * C[a * d.Dv + e];
  for (int64_t e = 0; e < d.Dv; ++e) h[e] /= den;
}

}  // namespace

void mlstm_recurrent(const MlstmMixerDims& d, int64_t T, const float* q, const float* k, const float* v,
                     const float* ig, const float* lf, float* st, float* h, float* states, int64_t stride) {
  const int64_t QK = d.qk(), V = d.v(), NH = d.NH, Dqk = d.Dqk, Dv = d.Dv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dqk));
  // Heads are independent: one worker per head, each head's arithmetic the same on any thread count.
  ops::parallel_for(NH, [&](int64_t hd) {
    std::vector<float> qs(static_cast<size_t>(Dqk));
    float* C = st + hd * Dqk * Dv;
    float* n = st + d.n_off() + hd * Dqk;
    float& m = st[d.m_off() + hd];
    for (int64_t t = 0; t < T; ++t) {
      const float* kt = k + t * QK + hd * Dqk;
      const float* vt = v + t * V + hd * Dv;
      // m' = max(log f + m, log i): both gates' exponents shifted by m' (mlstm_recurrent_step_native).
      const float fl = lf[t * NH + hd], il = ig[t * NH + hd];
      const float m_new = std::max(fl + m, il);
      const float fa = std::exp(fl + m - m_new), ia = std::exp(il - m_new);
      for (int64_t a = 0; a < Dqk; ++a) {
        for (int64_t e = 0; e < Dv; ++e) C[a * Dv + e] = fa * C[a * Dv + e] + ia * (kt[a] * vt[e]);
        n[a] = fa * n[a] + ia * kt[a];
      }
      m = m_new;
      for (int64_t a = 0; a < Dqk; ++a) qs[static_cast<size_t>(a)] = q[t * QK + hd * Dqk + a] * scale;
      read_head(d, qs.data(), C, n, m, h + t * V + hd * Dv);
      if (!states) continue;
      float* s = states + t * stride;  // this head's C, n and m after token t
      std::copy(C, C + Dqk * Dv, s + hd * Dqk * Dv);
      std::copy(n, n + Dqk, s + d.n_off() + hd * Dqk);
      s[d.m_off() + hd] = m;
    }
  });
}

namespace {

/// b_t = log f_0 + ... + log f_t of head hd over a chunk's L tokens (torch's CPU cumsum: double sums).
std::vector<float> cum_log_forget(const MlstmMixerDims& d, int64_t L, const float* lf, int64_t hd) {
  std::vector<float> b(static_cast<size_t>(L));
  double acc = 0.0;
  for (int64_t t = 0; t < L; ++t) b[static_cast<size_t>(t)] = static_cast<float>(acc += lf[t * d.NH + hd]);
  return b;
}

}  // namespace

void mlstm_chunk_state(const MlstmMixerDims& d, int64_t L, const float* k, const float* v, const float* ig,
                       const float* lf, const float* s0, float* out) {
  const int64_t QK = d.qk(), V = d.v(), NH = d.NH, Dqk = d.Dqk, Dv = d.Dv;
  ops::parallel_for(NH, [&](int64_t hd) {
    std::vector<float> a(static_cast<size_t>(L)), kg(static_cast<size_t>(L * Dqk));
    const std::vector<float> b = cum_log_forget(d, L, lf, hd);
    const float g = b[static_cast<size_t>(L - 1)], m0 = s0[d.m_off() + hd];
    // a_j = b_L - b_j + i_j: token j's log write weight at the chunk's end (mlstm_chunkwise_recurrent_fw_C).
    float amax = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < L; ++j) {
      a[static_cast<size_t>(j)] = (g - b[static_cast<size_t>(j)]) + ig[j * NH + hd];
      amax = std::max(amax, a[static_cast<size_t>(j)]);
    }
    const float m_next = std::max(g + m0, amax);
    const float gbar = std::exp(g + m0 - m_next);
    for (int64_t j = 0; j < L; ++j) {
      const float w = std::exp(a[static_cast<size_t>(j)] - m_next);
      for (int64_t c = 0; c < Dqk; ++c) kg[static_cast<size_t>(j * Dqk + c)] = k[j * QK + hd * Dqk + c] * w;
    }
    const float* C0 = s0 + hd * Dqk * Dv;
    const float* n0 = s0 + d.n_off() + hd * Dqk;
    float* C = out + hd * Dqk * Dv;
    float* n = out + d.n_off() + hd * Dqk;
    std::vector<float> acc(static_cast<size_t>(Dv));
    for (int64_t c = 0; c < Dqk; ++c) {
      // sum_j kg_j[c] v_j, j ascending; rows of v walked contiguously.
      std::fill(acc.begin(), acc.end(), 0.0f);
      float ns = 0.0f;
      for (int64_t j = 0; j < L; ++j) {
        const float w = kg[static_cast<size_t>(j * Dqk + c)];
        const float* vj = v + j * V + hd * Dv;
        for (int64_t e = 0; e < Dv; ++e) acc[static_cast<size_t>(e)] += w * vj[e];
        ns += w;
      }
      for (int64_t e = 0; e < Dv; ++e) C[c * Dv + e] = gbar * C0[c * Dv + e] + acc[static_cast<size_t>(e)];
      n[c] = gbar * n0[c] + ns;
    }
    out[d.m_off() + hd] = m_next;
  });
}

void mlstm_chunk(const MlstmMixerDims& d, int64_t L, const float* q, const float* k, const float* v,
                 const float* ig, const float* lf, float* st, float* h, float* states, int64_t stride) {
  const int64_t QK = d.qk(), V = d.v(), NH = d.NH, Dqk = d.Dqk, Dv = d.Dv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dqk));
  ops::parallel_for(NH, [&](int64_t hd) {
    std::vector<float> M(static_cast<size_t>(L)), qg(static_cast<size_t>(Dqk)), num(static_cast<size_t>(Dv)),
        intra(static_cast<size_t>(Dv));
    const std::vector<float> b = cum_log_forget(d, L, lf, hd);
    const float* C0 = st + hd * Dqk * Dv;
    const float* n0 = st + d.n_off() + hd * Dqk;
    const float m0 = st[d.m_off() + hd];
    for (int64_t t = 0; t < L; ++t) {
      // log D_tj = b_t - b_j + i_j (j <= t); the row's stabiliser m_t = max(b_t + m0, max_j log D_tj)
      // (mlstm_chunkwise_parallel_fw_H).
      const float bt = b[static_cast<size_t>(t)];
      float m_intra = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j <= t; ++j) {
        M[static_cast<size_t>(j)] = (bt - b[static_cast<size_t>(j)]) + ig[j * NH + hd];
        m_intra = std::max(m_intra, M[static_cast<size_t>(j)]);
      }
      const float m_inter = bt + m0, mc = std::max(m_inter, m_intra);
      const float* qt = q + t * QK + hd * Dqk;
      float den = 0.0f;
      for (int64_t j = 0; j <= t; ++j) {
        float s = 0.0f;
        for (int64_t c = 0; c < Dqk; ++c) s += qt[c] * k[j * QK + hd * Dqk + c];
        M[static_cast<size_t>(j)] = (s * scale) * std::exp(M[static_cast<size_t>(j)] - mc);
        den += M[static_cast<size_t>(j)];
      }
      const float bbar = std::exp(m_inter - mc);
      float qn = 0.0f;
      for (int64_t c = 0; c < Dqk; ++c) {
        qg[static_cast<size_t>(c)] = qt[c] * bbar * scale;
        qn += qg[static_cast<size_t>(c)] * n0[c];
      }
      den += qn;
      const float dd = std::max(std::fabs(den), std::exp(-mc)) + d.eps;
      // (qg C0 + sum_j M_tj v_j) / dd, rows of C0 and v walked contiguously.
      float* ht = h + t * V + hd * Dv;
      std::fill(num.begin(), num.end(), 0.0f);
      std::fill(intra.begin(), intra.end(), 0.0f);
      for (int64_t c = 0; c < Dqk; ++c) {
        const float g = qg[static_cast<size_t>(c)];
        for (int64_t e = 0; e < Dv; ++e) num[static_cast<size_t>(e)] += g * C0[c * Dv + e];
      }
      for (int64_t j = 0; j <= t; ++j) {
        const float w = M[static_cast<size_t>(j)];
        const float* vj = v + j * V + hd * Dv;
        for (int64_t e = 0; e < Dv; ++e) intra[static_cast<size_t>(e)] += w * vj[e];
      }
      for (int64_t e = 0; e < Dv; ++e) ht[e] = (num[static_cast<size_t>(e)] + intra[static_cast<size_t>(e)]) / dd;
    }
  });
  if (states)
    for (int64_t t = 0; t < L; ++t) mlstm_chunk_state(d, t + 1, k, v, ig, lf, st, states + t * stride);
  std::vector<float> end(static_cast<size_t>(d.row_numel()));
  mlstm_chunk_state(d, L, k, v, ig, lf, st, end.data());
  std::copy(end.begin(), end.end(), st);
}

MlstmMixerWeights MlstmMixer::load(const io::WeightStore& w, const std::string& p, bool fused) const {
  const int64_t D = d_.D, QK = d_.qk(), V = d_.v(), NH = d_.NH;
  MlstmMixerWeights l;
  if (fused) {
    l.qkvo = w.get_matmul(p + "qkv_opreact.weight", {2 * QK + 2 * V, D});
    l.gates = w.get_matmul(p + "ifgate_preact.weight", {2 * NH, D});
    l.gate_bias = w.get(p + "ifgate_preact.bias", {2 * NH});
  } else {
    const Tensor q = w.get_matmul(p + "q.weight", {QK, D}), k = w.get_matmul(p + "k.weight", {QK, D});
    const Tensor v = w.get_matmul(p + "v.weight", {V, D}), o = w.get_matmul(p + "ogate_preact.weight", {V, D});
    l.qkvo = ops::RowStack({q, k, v, o});
    const Tensor i = w.get_matmul(p + "igate_preact.weight", {NH, D}), f = w.get_matmul(p + "fgate_preact.weight", {NH, D});
    l.gates = ops::RowStack({i, f});
    const Tensor ib = w.get(p + "igate_preact.bias", {NH}), fb = w.get(p + "fgate_preact.bias", {NH});
    l.gate_bias = Tensor({2 * NH});
    std::copy_n(ib.data(), NH, l.gate_bias.data());
    std::copy_n(fb.data(), NH, l.gate_bias.data() + NH);
  }
  l.norm_w = w.get(p + "multihead_norm.weight", {V});
  l.out = w.get_matmul(p + "out_proj.weight", {D, V});
  return l;
}

void MlstmMixer::project(const MlstmMixerWeights& lw, const float* x, int64_t rows, float* q, float* k, float* v,
                         float* og, float* gp, float* ig, float* lf) const {
  const int64_t D = d_.D, QK = d_.qk(), V = d_.v(), NH = d_.NH, W = 2 * QK + 2 * V;
  Tensor proj({rows, W});
  ops::linear(x, rows, D, lw.qkvo, proj.data());
  ops::linear(x, rows, D, lw.gates, gp, lw.gate_bias.data());
  const float cap = d_.gate_cap;
  const auto soft_cap = [cap](float a) { return cap > 0.0f ? cap * std::tanh(a / cap) : a; };
  for (int64_t r = 0; r < rows; ++r) {
    const float* p = proj.data() + r * W;
    std::copy_n(p, QK, q + r * QK);
    std::copy_n(p + QK, QK, k + r * QK);
    std::copy_n(p + 2 * QK, V, v + r * V);
    std::copy_n(p + 2 * QK + V, V, og + r * V);
    for (int64_t hd = 0; hd < NH; ++hd) {
      ig[r * NH + hd] = soft_cap(gp[r * 2 * NH + hd]);
      lf[r * NH + hd] = log_sigmoid(soft_cap(gp[r * 2 * NH + NH + hd]));
    }
  }
}

void MlstmMixer::head_norm(const MlstmMixerWeights& lw, const float* y, int64_t rows, float* out) const {
  const int64_t V = d_.v(), NH = d_.NH, Dv = d_.Dv;
  const std::vector<float> zero(static_cast<size_t>(Dv), 0.0f);
  ops::parallel_rows(rows, V, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t hd = 0; hd < NH; ++hd) {
        const int64_t o = r * V + hd * Dv;
        ops::layernorm(y + o, lw.norm_w.data() + hd * Dv, zero.data(), out + o, 1, Dv, d_.norm_eps);
      }
  });
}

void MlstmMixer::values(int i, int64_t B, int64_t T, std::vector<ValueInfo>& v) const {
  const int64_t QK = d_.qk(), V = d_.v(), NH = d_.NH, n = d_.row_numel();
  v.push_back(layer_value(i, Value::state_input, {B, n}, true,
                          "state the call starts from, C [NH,Dqk,Dv] | n [NH,Dqk] | m [NH] flat; None on a fresh prompt"));
  v.push_back(layer_value(i, Value::attention_queries, {B, T, QK}, true, "q = q(norm_mlstm output), heads of Dqk"));
  v.push_back(layer_value(i, Value::attention_keys, {B, T, QK}, true, "k = k(...): where a token writes (k v^T)"));
  v.push_back(layer_value(i, Value::attention_values, {B, T, V}, true, "v = v(...): what a token writes"));
  v.push_back(layer_value(i, Value::betas, {B, T, NH}, true,
                          "input gate exp(i), i the soft-capped igate_preact: a token writes exp(i) k v^T (stabilised by m)"));
  v.push_back(layer_value(i, Value::decays, {B, T, NH}, true,
                          "log forget gate: logsigmoid(soft-capped fgate_preact) (<= 0)"));
  auto s = layer_value(i, Value::states, {B, T, n}, false, "state after every token (computed only when asked)");
  s.writable = false;
  v.push_back(s);
  v.push_back(layer_value(i, Value::attention_head_outputs, {B, T, V}, true,
                          "h = (q C / sqrt(Dqk)) / (max(|q n| / sqrt(Dqk), exp(-m)) + eps) per head, before multihead_norm"));
  add_mixing_values(i, B, T, d_.NH, d_.Dqk, "nothing (no skip); state_input_mixing reads state_input's C per head", v);
  v.push_back(layer_value(i, Value::attention_output, {B, T, d_.D}, true,
                          "out_proj(sigmoid(ogate_preact) * multihead_norm(h)), added to the residual"));
  v.push_back(layer_value(i, Value::state_output, {B, n}, true, "state after the call's last token (goes to the cache)"));
}

Tensor MlstmMixer::forward(const MlstmMixerWeights& lw, const Tensor& n_in, const Batch& in,
                           const MlstmMixerCall& call) const {
  const int li = call.layer;
  Listener* ls = call.ls;
  const int64_t B = in.batch, T = in.seq, BT = B * T, D = d_.D, QK = d_.qk(), V = d_.v(), NH = d_.NH;
  const int64_t n = d_.row_numel();
  Tensor& S = call.begin_state();  // state_input first: values() order, which a streaming read follows
  Tensor q({B, T, QK}), k({B, T, QK}), v({B, T, V}), og({B, T, V}), gp({BT, 2 * NH}), ig({B, T, NH}), lf({B, T, NH});
  project(lw, n_in.data(), BT, q.data(), k.data(), v.data(), og.data(), gp.data(), ig.data(), lf.data());
  visit_if(ls, li, Value::attention_queries, q);
  visit_if(ls, li, Value::attention_keys, k);
  visit_if(ls, li, Value::attention_values, v);
  // betas is the input gate exp(i) (a write strength, >= 0, as every family's betas); the kernels take its
  // log, always, so a write of the value read changes nothing (log(exp(i)) is i within an ulp).
  Tensor gate_i({B, T, NH});
  for (int64_t r = 0; r < BT * NH; ++r) gate_i[r] = std::exp(ig[r]);
  visit_if(ls, li, Value::betas, gate_i);
  for (int64_t r = 0; r < BT * NH; ++r) ig[r] = std::log(gate_i[r]);
  visit_if(ls, li, Value::decays, lf);

  Tensor y({B, T, V});  // zeros: padded tokens read nothing
  const int64_t Q = d_.chunk;
  // The n and m the call starts from, kept for the mixing (the scan overwrites S in place). Always: an
  // interleaved reader may first want token_mixing after the scan; C (the large part) is not needed.
  const int64_t nm = NH * d_.Dqk + NH;
  Tensor start_nm = Tensor::uninitialized({B, nm});
  for (int64_t b = 0; b < B; ++b) std::copy_n(S.data() + b * n + d_.n_off(), nm, start_nm.data() + b * nm);
  RowScan rs;
  rs.B = B, rs.T = T, rs.row_numel = n, rs.S = S.data(), rs.y_row_numel = T * V;
  rs.first = first_real_tokens(in);
  rs.chunk = call.chunked ? Q : 0;
  // transformers' inference wrapper: whole chunks in the chunkwise form, the rest (< chunk_size tokens,
  // always at the call's end) by the recurrent step.
  rs.run = [&](int64_t b, int64_t t0, int64_t t1, float* S_row, float* y_scratch, float* states_row) {
    float* yb = y_scratch ? y_scratch : y.data() + b * T * V;  // the row's [T, V], absolute token index
    const auto at = [&](int64_t t) { return b * T + t; };
    int64_t t = t0;
    for (; call.chunked && t + Q <= t1; t += Q)
      mlstm_chunk(d_, Q, q.data() + at(t) * QK, k.data() + at(t) * QK, v.data() + at(t) * V, ig.data() + at(t) * NH,
                  lf.data() + at(t) * NH, S_row, yb + t * V, states_row ? states_row + t * n : nullptr, n);
    if (t < t1)
      mlstm_recurrent(d_, t1 - t, q.data() + at(t) * QK, k.data() + at(t) * QK, v.data() + at(t) * V,
                      ig.data() + at(t) * NH, lf.data() + at(t) * NH, S_row, yb + t * V,
                      states_row ? states_row + t * n : nullptr, n);
  };
  rs.serve = [n](const float* S_row, float* out) { std::copy(S_row, S_row + n, out); };
  rs.store = [n](const float* served, float* S_row) { std::copy(served, served + n, S_row); };
  rs.state_at = [&](int64_t b, int64_t ck, const float* S_ck, int64_t t, float* out) {
    const int64_t o = b * T + ck;
    if (ck + Q <= T) {  // a whole chunk: its update cut at t
      mlstm_chunk_state(d_, t - ck + 1, k.data() + o * QK, v.data() + o * V, ig.data() + o * NH, lf.data() + o * NH,
                        S_ck, out);
      return;
    }
    std::copy(S_ck, S_ck + n, out);  // the call's tail ran the recurrent step
    std::vector<float> scratch(static_cast<size_t>((t - ck + 1) * V));
    mlstm_recurrent(d_, t - ck + 1, q.data() + o * QK, k.data() + o * QK, v.data() + o * V, ig.data() + o * NH,
                    lf.data() + o * NH, out, scratch.data());
  };
  Tensor states = scan_rows(ls, li, rs, {B, T, n});
  if (states.defined()) {
    ls->visit(li, Value::states, states, states.shape());
    ls->recycle_stack(std::move(states));
  }
  visit_if(ls, li, Value::attention_head_outputs, y);
  visit_mixing(ls, li, B, T, NH, d_.Dqk, [&](const MixBlock& blk, float* M, float* Sin) {
    MlstmMixArgs ma;
    ma.d = d_; ma.B = B; ma.T = T; ma.q = q.data(); ma.k = k.data(); ma.v = v.data(); ma.betas = gate_i.data();
    ma.lf = lf.data(); ma.n_in = start_nm.data(); ma.m_in = start_nm.data() + NH * d_.Dqk; ma.stride = nm;
    mlstm_token_mixing(ma, rs.first, blk, M, Sin);
  });
  // multihead_norm, then the sigmoid output gate.
  Tensor g({BT, V}), out({B, T, D});
  head_norm(lw, y.data(), BT, g.data());
  for (int64_t e = 0; e < BT * V; ++e) g[e] *= ops::sigmoid(og[e]);
  ops::linear(g.data(), BT, V, lw.out, out.data());
  visit_if(ls, li, Value::attention_output, out);
  call.end_state();
  return out;
}

}  // namespace mixlens::detail
