// The gated short conv's token-to-token mixing (issue 26 item 1): a depthwise causal conv of width
// K between two gates, so per channel the mixing of x is a band of K diagonals, C_t w B_s.
#include <algorithm>
#include <vector>

#include "mixers/short_conv_mixer.h"
#include "ops/ops.h"

namespace mixlens::detail {

void short_conv_token_mixing(const ShortConvMixArgs& a, const std::vector<int64_t>& first, const MixBlock& k, float* M,
                             float* Sin) {
  const int64_t T = a.T, D = a.D, K = a.K, R = k.rows(), Cn = k.cols(), Hn = k.heads();
  ops::parallel_for(a.B * Hn, [&](int64_t bh) {
    const int64_t b = bh / Hn, d = k.h0 + bh % Hn;
    const int64_t f = std::min(first[static_cast<size_t>(b)], T);
    for (int64_t i = 0; i < R; ++i) {
      const int64_t t = k.r0 + i;
      const double c = t < f ? 0.0 : static_cast<double>(a.Cg[(b * T + t) * D + d]);
      if (M) {
        float* row = M + (bh * R + i) * Cn;
        std::fill(row, row + Cn, 0.0f);
        for (int64_t s = std::max({f, t - K + 1, k.c0}); s <= t && s < k.c1; ++s)
          row[s - k.c0] = static_cast<float>(c * a.conv_wT[(K - 1 - (t - s)) * D + d] * a.Bg[(b * T + s) * D + d]);
      }
      if (Sin) {
        float* o = Sin + (bh * R + i) * K;
        for (int64_t j = 0; j < K; ++j)
          o[j] = t >= f && j >= t - f + 1 ? static_cast<float>(c * a.conv_wT[(j - 1 - (t - f)) * D + d]) : 0.0f;
      }
    }
  });
}

void short_conv_state_contributions(const ShortConvMixArgs& a, const std::vector<int64_t>& first, int64_t t,
                                    const MixBlock& k, float* out) {
  const int64_t T = a.T, D = a.D, K = a.K, Cn = k.cols(), Hn = k.heads();
  ops::parallel_for(a.B * Hn, [&](int64_t bh) {
    const int64_t b = bh / Hn, d = k.h0 + bh % Hn;
    const int64_t f = std::min(first[static_cast<size_t>(b)], T);
    float* o = out + bh * Cn * K;
    std::fill(o, o + Cn * K, 0.0f);
    for (int64_t s = std::max({f, t - K + 1, k.c0}); s <= t && s < k.c1; ++s)
      o[(s - k.c0) * K + s - t + K - 1] = a.Bg[(b * T + s) * D + d] * a.x[(b * T + s) * D + d];  // u as the kernel forms it
  });
}

}  // namespace mixlens::detail
