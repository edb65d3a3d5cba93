// RWKV-4's token-to-token mixing (issue 26 item 1): WKV is a ratio of two decayed sums per channel,
// so the mixing of v is exact given the call's own denominator (which the keys and decays fix).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "mixers/rwkv_mixer.h"
#include "ops/ops.h"

namespace mixlens::detail {

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

double log_add(double x, double y) {
  if (x == kNegInf) return y;
  if (y == kNegInf) return x;
  const double m = std::max(x, y);
  return m + std::log(std::exp(x - m) + std::exp(y - m));
}

}  // namespace

void rwkv_token_mixing(const RwkvMixArgs& a, const std::vector<int64_t>& first, const MixBlock& blk, float* M,
                       float* Sin) {
  const int64_t T = a.T, A = a.A, R = blk.rows(), Cn = blk.cols(), Hn = blk.heads();
  ops::parallel_for(a.B * Hn, [&](int64_t bh) {
    const int64_t b = bh / Hn, c = blk.h0 + bh % Hn;
    const int64_t f = std::min(first[static_cast<size_t>(b)], T);
    const float* st = a.start + b * a.row_stride;
    const double den_in = st[A + c], m_in = st[2 * A + c];
    // cw[t] = W(f..t); logS = log of the state's real denominator before token t's read.
    std::vector<double> cw(static_cast<size_t>(T), 0.0), logden(static_cast<size_t>(T), 0.0);
    double acc = 0.0, logS = den_in > 0.0 ? m_in + std::log(den_in) : kNegInf;
    for (int64_t t = f; t < T; ++t) {
      const double kt = a.k[(b * T + t) * A + c];
      logden[static_cast<size_t>(t)] = log_add(logS, a.u[c] + kt);
      const double w = a.w[(b * T + t) * A + c];
      logS = log_add(logS == kNegInf ? kNegInf : logS + w, kt);
      acc += w;
      cw[static_cast<size_t>(t)] = acc;
    }
    const auto cw_before = [&](int64_t t) { return t > f ? cw[static_cast<size_t>(t - 1)] : 0.0; };  // W(f..t-1)
    for (int64_t i = 0; i < R; ++i) {
      const int64_t t = blk.r0 + i;
      const double L = t < f ? 0.0 : logden[static_cast<size_t>(t)];
      if (M) {
        float* row = M + (bh * R + i) * Cn;
        for (int64_t j = 0; j < Cn; ++j) {
          const int64_t s = blk.c0 + j;
          double e = 0.0;
          if (t >= f && s >= f && s < t)
            e = std::exp(static_cast<double>(a.k[(b * T + s) * A + c]) + cw_before(t) - cw[static_cast<size_t>(s)] - L);
          else if (t >= f && s == t)
            e = std::exp(static_cast<double>(a.u[c]) + a.k[(b * T + t) * A + c] - L);
          row[j] = static_cast<float>(e);
        }
      }
      if (Sin) Sin[bh * R + i] = t < f || den_in <= 0.0 ? 0.0f : static_cast<float>(std::exp(m_in + cw_before(t) - L));
    }
  });
}

void rwkv_state_contributions(const RwkvMixArgs& a, const std::vector<int64_t>& first, int64_t t, const MixBlock& blk,
                              float* out) {
  const int64_t T = a.T, A = a.A, Cn = blk.cols(), Hn = blk.heads();
  ops::parallel_for(a.B * Hn, [&](int64_t bh) {
    const int64_t b = bh / Hn, c = blk.h0 + bh % Hn;
    const int64_t f = std::min(first[static_cast<size_t>(b)], T);
    // The served max after t, by wkv_recurrent's own float steps; cw[s] = W(f..s) in double.
    float mx = a.start[b * a.row_stride + 2 * A + c];
    std::vector<double> cw(static_cast<size_t>(T), 0.0);
    double acc = 0.0;
    for (int64_t r = f; r <= t; ++r) {
      const float wr = a.w[(b * T + r) * A + c];
      mx = std::max(mx + wr, a.k[(b * T + r) * A + c]);
      acc += wr;
      cw[static_cast<size_t>(r)] = acc;
    }
    float* o = out + bh * Cn * 2;
    for (int64_t j = 0; j < Cn; ++j) {
      const int64_t s = blk.c0 + j;
      double e = 0.0;
      if (s >= f && s <= t)
        e = std::exp(static_cast<double>(a.k[(b * T + s) * A + c]) + cw[static_cast<size_t>(t)] - cw[static_cast<size_t>(s)] - mx);
      o[2 * j] = static_cast<float>(e * a.v[(b * T + s) * A + c]);
      o[2 * j + 1] = static_cast<float>(e);
    }
  });
}

}  // namespace mixlens::detail
