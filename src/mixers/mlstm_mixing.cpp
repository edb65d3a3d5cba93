// The mLSTM's token-to-token mixing (issue 26 item 1): the matrix memory read through a normaliser,
// so, as for RWKV-4, the map of v is exact given the call's own denominator (keys and gates fix it).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "mixers/mlstm_mixer.h"
#include "ops/ops.h"

namespace mixlens::detail {

namespace {

// One row and head: log i (as the kernels take it, float log of betas), F_t, m_t and the read's
// scaled q . k products, in double.
struct Head {
  std::vector<double> li, F, m;
  double m_in = 0.0;
};

Head head_gates(const MlstmMixArgs& a, int64_t b, int64_t h, int64_t f) {
  const int64_t T = a.T, NH = a.d.NH;
  Head g;
  g.li.assign(static_cast<size_t>(T), 0.0);
  g.F.assign(static_cast<size_t>(T), 0.0);
  g.m.assign(static_cast<size_t>(T), 0.0);
  g.m_in = a.m_in[b * a.stride + h];
  double F = 0.0, m = g.m_in;
  for (int64_t t = f; t < T; ++t) {
    const int64_t r = (b * T + t) * NH + h;
    const double li = std::log(a.betas[r]), lf = a.lf[r];
    F += lf;
    m = std::max(lf + m, li);
    g.li[static_cast<size_t>(t)] = li;
    g.F[static_cast<size_t>(t)] = F;
    g.m[static_cast<size_t>(t)] = m;
  }
  return g;
}

double dot(const float* x, const float* y, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * y[i];
  return s;
}

}  // namespace

void mlstm_token_mixing(const MlstmMixArgs& a, const std::vector<int64_t>& first, const MixBlock& blk, float* M,
                        float* Sin) {
  const int64_t T = a.T, Dqk = a.d.Dqk, QK = a.d.qk(), R = blk.rows(), Cn = blk.cols(), Hn = blk.heads();
  const double scale = 1.0 / std::sqrt(static_cast<double>(Dqk));
  ops::parallel_for(a.B * Hn, [&](int64_t bh) {
    const int64_t b = bh / Hn, h = blk.h0 + bh % Hn;
    const int64_t f = std::min(first[static_cast<size_t>(b)], T);
    const Head g = head_gates(a, b, h, f);
    const float* n_in = a.n_in + b * a.stride + h * Dqk;
    std::vector<double> w(static_cast<size_t>(T));
    for (int64_t i = 0; i < R; ++i) {
      const int64_t t = blk.r0 + i;
      float* row = M ? M + (bh * R + i) * Cn : nullptr;
      float* srow = Sin ? Sin + (bh * R + i) * Dqk : nullptr;
      if (row) std::fill(row, row + Cn, 0.0f);
      if (srow) std::fill(srow, srow + Dqk, 0.0f);
      if (t < f) continue;
      const double Ft = g.F[static_cast<size_t>(t)], mt = g.m[static_cast<size_t>(t)];
      const float* qt = a.q + (b * T + t) * QK + h * Dqk;
      // q_t . n_t / sqrt(Dqk): every source's weighted q.k plus the start state's n.
      const double carry = std::exp(Ft + g.m_in - mt);
      double qn = carry * scale * dot(qt, n_in, Dqk);
      for (int64_t s = f; s <= t; ++s) {
        const double e = std::exp(Ft - g.F[static_cast<size_t>(s)] + g.li[static_cast<size_t>(s)] - mt);
        w[static_cast<size_t>(s)] = e * scale * dot(qt, a.k + (b * T + s) * QK + h * Dqk, Dqk);
        qn += w[static_cast<size_t>(s)];
      }
      const double den = std::max(std::fabs(qn), std::exp(-mt)) + a.d.eps;
      if (row)
        for (int64_t s = std::max(f, blk.c0); s <= t && s < blk.c1; ++s) row[s - blk.c0] = static_cast<float>(w[static_cast<size_t>(s)] / den);
      if (srow)
        for (int64_t c = 0; c < Dqk; ++c) srow[c] = static_cast<float>(qt[c] * scale * carry / den);
    }
  });
}

void mlstm_state_contributions(const MlstmMixArgs& a, const std::vector<int64_t>& first, int64_t t,
                               const MixBlock& blk, float* out) {
  const int64_t T = a.T, Dqk = a.d.Dqk, Dv = a.d.Dv, QK = a.d.qk(), V = a.d.v(), Cn = blk.cols(), Hn = blk.heads();
  const int64_t per = Dqk * (Dv + 1);
  ops::parallel_for(a.B * Hn, [&](int64_t bh) {
    const int64_t b = bh / Hn, h = blk.h0 + bh % Hn;
    const int64_t f = std::min(first[static_cast<size_t>(b)], T);
    const Head g = head_gates(a, b, h, f);
    for (int64_t j = 0; j < Cn; ++j) {
      const int64_t s = blk.c0 + j;
      float* o = out + (bh * Cn + j) * per;
      if (s < f || s > t) {
        std::fill(o, o + per, 0.0f);
        continue;
      }
      const double e = std::exp(g.F[static_cast<size_t>(t)] - g.F[static_cast<size_t>(s)] + g.li[static_cast<size_t>(s)] -
                                g.m[static_cast<size_t>(t)]);
      const float* ks = a.k + (b * T + s) * QK + h * Dqk;
      const float* vs = a.v + (b * T + s) * V + h * Dv;
      for (int64_t c = 0; c < Dqk; ++c) {
        for (int64_t d = 0; d < Dv; ++d) o[c * (Dv + 1) + d] = static_cast<float>(e * ks[c] * vs[d]);
        o[c * (Dv + 1) + Dv] = static_cast<float>(e * ks[c]);
      }
    }
  });
}

}  // namespace mixlens::detail
