// Mamba-1's token-to-token mixing and per-source state contributions (issue 26 item 1), per channel:
// the selective scan is diagonal with a decay per (channel, state index), so each channel has its
// own T x T matrix, the sum over state indices of SSD's rank-one form.
#include <algorithm>
#include <cmath>
#include <vector>

#include "mixers/selective_scan.h"
#include "ops/ops.h"

namespace mixlens::detail {

namespace {

// cum[t * N + n] = sum_{r=first..t} decay_r[e,n] of row b, channel e (double: long prompts subtract
// two large sums); 0 before first.
std::vector<double> cum_decay(const SelectiveMixArgs& a, int64_t b, int64_t e, int64_t first) {
  const int64_t T = a.T, N = a.N;
  std::vector<double> cum(static_cast<size_t>(T * N), 0.0), acc(static_cast<size_t>(N), 0.0);
  for (int64_t t = first; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) {
      acc[static_cast<size_t>(n)] += a.decay[((b * T + t) * a.E + e) * N + n];
      cum[static_cast<size_t>(t * N + n)] = acc[static_cast<size_t>(n)];
    }
  return cum;
}

const float* row_of(const float* X, const SelectiveMixArgs& a, int64_t b, int64_t t, int64_t e) {
  return X + ((b * a.T + t) * a.groups + e * a.groups / a.E) * a.N;
}

}  // namespace

void mamba_token_mixing(const SelectiveMixArgs& a, const std::vector<int64_t>& first, const MixBlock& k, float* M,
                        float* Sin) {
  const int64_t T = a.T, E = a.E, N = a.N, R = k.rows(), Cn = k.cols(), Hn = k.heads(), L = std::max<int64_t>(a.chunk, 1);
  ops::parallel_for(a.B * Hn, [&](int64_t bh) {
    const int64_t b = bh / Hn, e = k.h0 + bh % Hn;
    const int64_t f = std::min(first[static_cast<size_t>(b)], T);
    const std::vector<double> cum = cum_decay(a, b, e, f);
    const auto cm = [&](int64_t t, int64_t n) { return cum[static_cast<size_t>(t * N + n)]; };
    // Block of token t, its end (the anchor of its sources) and the anchor before it (cum before f: 0).
    const auto blk_of = [&](int64_t t) { return (t - f) / L; };
    const auto end_of = [&](int64_t j) { return std::min(f + (j + 1) * L, T) - 1; };
    const auto before = [&](int64_t j, int64_t n) { return j == 0 ? 0.0 : cm(f + j * L - 1, n); };
    if (M) {
      // Bs[s] = dt_s B_s[n] e^{cum(end of s's block) - cum_s} for the asked columns (every factor <= 1).
      std::vector<double> Bs(static_cast<size_t>(Cn * N), 0.0), Ct(static_cast<size_t>(N)), G(static_cast<size_t>(N));
      for (int64_t s = std::max(f, k.c0); s < k.c1; ++s) {
        const float* Bv = row_of(a.Bm, a, b, s, e);
        const int64_t pe = end_of(blk_of(s));
        const double dts = a.dt[(b * T + s) * E + e];
        for (int64_t n = 0; n < N; ++n) Bs[static_cast<size_t>((s - k.c0) * N + n)] = dts * Bv[n] * std::exp(cm(pe, n) - cm(s, n));
      }
      for (int64_t i = 0; i < R; ++i) {
        const int64_t t = k.r0 + i;
        float* row = M + (bh * R + i) * Cn;
        std::fill(row, row + Cn, 0.0f);
        if (t < f) continue;
        const float* Cv = row_of(a.C, a, b, t, e);
        const int64_t I = blk_of(t);
        // Sources of earlier blocks: C_t e^{cum_t - cum(before I)} . e^{cum(before I) - cum(end of J)} . Bs.
        for (int64_t n = 0; n < N; ++n) Ct[static_cast<size_t>(n)] = Cv[n] * std::exp(cm(t, n) - before(I, n));
        for (int64_t J = std::max<int64_t>(0, blk_of(std::max(f, k.c0))); J < I; ++J) {
          const int64_t s0 = std::max(f + J * L, k.c0), s1 = std::min(end_of(J) + 1, k.c1);
          if (s0 >= s1) continue;
          for (int64_t n = 0; n < N; ++n) G[static_cast<size_t>(n)] = Ct[static_cast<size_t>(n)] * std::exp(before(I, n) - cm(end_of(J), n));
          for (int64_t s = s0; s < s1; ++s) {
            const double* bs = Bs.data() + (s - k.c0) * N;
            double acc = 0.0;
            for (int64_t n = 0; n < N; ++n) acc += G[static_cast<size_t>(n)] * bs[n];
            row[s - k.c0] = static_cast<float>(acc);
          }
        }
        // Its own block up to t: the decays between s and t directly.
        for (int64_t s = std::max({f + I * L, k.c0}); s <= t && s < k.c1; ++s) {
          const float* Bv = row_of(a.Bm, a, b, s, e);
          double acc = 0.0;
          for (int64_t n = 0; n < N; ++n) acc += static_cast<double>(Cv[n]) * Bv[n] * std::exp(cm(t, n) - cm(s, n));
          row[s - k.c0] = static_cast<float>(acc * a.dt[(b * T + s) * E + e]);
        }
      }
    }
    if (Sin)
      for (int64_t i = 0; i < R; ++i) {
        const int64_t t = k.r0 + i;
        const float* Ct0 = row_of(a.C, a, b, t, e);
        for (int64_t n = 0; n < N; ++n)
          Sin[(bh * R + i) * N + n] = t < f ? 0.0f : static_cast<float>(Ct0[n] * std::exp(cm(t, n)));
      }
  });
}

void mamba_state_contributions(const SelectiveMixArgs& a, const std::vector<int64_t>& first, int64_t t,
                               const MixBlock& k, float* out) {
  const int64_t T = a.T, E = a.E, N = a.N, Cn = k.cols(), Hn = k.heads();
  ops::parallel_for(a.B * Hn, [&](int64_t bh) {
    const int64_t b = bh / Hn, e = k.h0 + bh % Hn;
    const int64_t f = std::min(first[static_cast<size_t>(b)], T);
    const std::vector<double> cum = cum_decay(a, b, e, f);
    for (int64_t j = 0; j < Cn; ++j) {
      const int64_t s = k.c0 + j;
      float* o = out + (bh * Cn + j) * N;
      if (s < f || s > t) {
        std::fill(o, o + N, 0.0f);
        continue;
      }
      const double w = static_cast<double>(a.dt[(b * T + s) * E + e]) * a.u[(b * T + s) * E + e];
      const float* Bs = row_of(a.Bm, a, b, s, e);
      for (int64_t n = 0; n < N; ++n)
        o[n] = static_cast<float>(w * Bs[n] * std::exp(cum[static_cast<size_t>(t * N + n)] - cum[static_cast<size_t>(s * N + n)]));
    }
  });
}

}  // namespace mixlens::detail
