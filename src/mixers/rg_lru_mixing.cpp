// The RG-LRU's token-to-token mixing and per-source contributions to h (issue 26 item 1): a diagonal
// gated recurrence, so per channel M[t,s] is the write weight of s times the decays between s and t.
#include <algorithm>
#include <cmath>
#include <vector>

#include "mixers/rg_lru_mixer.h"
#include "ops/ops.h"

namespace mixlens::detail {

namespace {

// Row b, channel c: a[t] (0 at a reset) and the write weight w[t] of every token. a and the
// normaliser in float as the kernel forms them: sqrt(1 - a^2) cancels near a = 1, where a double
// value would differ from the kernel's by far more than its rounding; the products in double.
void gates(const RgLruMixArgs& a, int64_t b, int64_t c, std::vector<double>& dec, std::vector<double>& w) {
  dec.assign(static_cast<size_t>(a.T), 0.0);
  w.assign(static_cast<size_t>(a.T), 0.0);
  for (int64_t t = 0; t < a.T; ++t) {
    const int64_t r = b * a.T + t;
    const float lg = a.la[r * a.W + c];
    const bool reset = a.pos[r] == 0;
    dec[static_cast<size_t>(t)] = reset ? 0.0 : static_cast<double>(std::exp(lg));
    const float mult = reset ? 1.0f : std::sqrt(1.0f - std::exp(2.0f * lg));
    w[static_cast<size_t>(t)] = static_cast<double>(a.ig[r * a.W + c]) * mult;
  }
}

}  // namespace

void rg_lru_token_mixing(const RgLruMixArgs& a, const std::vector<int64_t>& first, const MixBlock& k, float* M,
                         float* Sin) {
  const int64_t T = a.T, R = k.rows(), Cn = k.cols(), Hn = k.heads();
  ops::parallel_for(a.B * Hn, [&](int64_t bh) {
    const int64_t b = bh / Hn, c = k.h0 + bh % Hn;
    const int64_t f = std::min(first[static_cast<size_t>(b)], T);
    std::vector<double> dec, w;
    gates(a, b, c, dec, w);
    for (int64_t i = 0; i < R; ++i) {
      const int64_t t = k.r0 + i;
      if (M) {
        float* row = M + (bh * R + i) * Cn;
        std::fill(row, row + Cn, 0.0f);
        // Walk s from t down, carrying prod_{r=s+1..t} a_r (a reset makes every earlier source 0).
        double carried = 1.0;
        for (int64_t s = t; s >= f && carried != 0.0; --s) {
          if (s >= k.c0 && s < k.c1) row[s - k.c0] = static_cast<float>(w[static_cast<size_t>(s)] * carried);
          carried *= dec[static_cast<size_t>(s)];
        }
      }
      if (Sin) {
        double carried = t < f ? 0.0 : 1.0;
        for (int64_t s = t; s >= f; --s) carried *= dec[static_cast<size_t>(s)];
        Sin[bh * R + i] = static_cast<float>(carried);
      }
    }
  });
}

void rg_lru_state_contributions(const RgLruMixArgs& a, const std::vector<int64_t>& first, int64_t t, const MixBlock& k,
                                float* out) {
  const int64_t T = a.T, Cn = k.cols(), Hn = k.heads();
  ops::parallel_for(a.B * Hn, [&](int64_t bh) {
    const int64_t b = bh / Hn, c = k.h0 + bh % Hn;
    const int64_t f = std::min(first[static_cast<size_t>(b)], T);
    std::vector<double> dec, w;
    gates(a, b, c, dec, w);
    float* o = out + bh * Cn;
    std::fill(o, o + Cn, 0.0f);
    double carried = 1.0;
    for (int64_t s = t; s >= f && carried != 0.0; --s) {
      if (s >= k.c0 && s < k.c1)
        o[s - k.c0] = static_cast<float>(w[static_cast<size_t>(s)] * carried * a.u[(b * T + s) * a.W + c]);
      carried *= dec[static_cast<size_t>(s)];
    }
  });
}

}  // namespace mixlens::detail
