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
  const int64_t T = a.T, E = a.E, N = a.N, R = k.rows(), Cn = k.cols(), Hn = k.heads();
  ops::parallel_for(a.B * Hn, [&](int64_t bh) {
    const int64_t b = bh / Hn, e = k.h0 + bh % Hn;
    const int64_t f = std::min(first[static_cast<size_t>(b)], T);
    const std::vector<double> cum = cum_decay(a, b, e, f);
    for (int64_t i = 0; i < R; ++i) {
      const int64_t t = k.r0 + i;
      const float* Ct = row_of(a.C, a, b, t, e);
      if (M) {
        float* row = M + (bh * R + i) * Cn;
        for (int64_t j = 0; j < Cn; ++j) {
          const int64_t s = k.c0 + j;
          if (t < f || s < f || s > t) {
            row[j] = 0.0f;
            continue;
          }
          const float* Bs = row_of(a.Bm, a, b, s, e);
          double acc = 0.0;
          for (int64_t n = 0; n < N; ++n)
            acc += static_cast<double>(Ct[n]) * Bs[n] *
                   std::exp(cum[static_cast<size_t>(t * N + n)] - cum[static_cast<size_t>(s * N + n)]);
          row[j] = static_cast<float>(acc * a.dt[(b * T + s) * E + e]);
        }
      }
      if (Sin)
        for (int64_t n = 0; n < N; ++n)
          Sin[(bh * R + i) * N + n] = t < f ? 0.0f : static_cast<float>(Ct[n] * std::exp(cum[static_cast<size_t>(t * N + n)]));
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
