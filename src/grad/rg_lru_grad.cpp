// Backward of the RG-LRU recurrence (grad/ops_grad.h RgLruGradArgs): the reverse sweep over tokens with
// the adjoint G_t = dL/dh_t = dy_t + a_{t+1} G_{t+1}. The recurrence is diagonal, so the forward
// states are one [T,W] pass (no checkpoints needed at the lengths one call holds).
#include <algorithm>
#include <cmath>
#include <vector>

#include "grad/ops_grad.h"

namespace mixlens::grad {

void rg_lru_backward(const RgLruGradArgs& a) {
  const int64_t T = a.T, W = a.W;
  // Forward states h_{t-1} (what token t decays), recomputed.
  std::vector<float> hprev(static_cast<size_t>(T * W));
  std::vector<float> h(a.h0, a.h0 + W);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < W; ++c) {
      const int64_t e = t * W + c;
      hprev[static_cast<size_t>(e)] = h[static_cast<size_t>(c)];
      const bool r = a.reset[t] != 0;
      const float at = r ? 0.0f : std::exp(a.la[e]);
      const float m = r ? 1.0f : std::sqrt(1.0f - std::exp(2.0f * a.la[e]));
      h[static_cast<size_t>(c)] = at * h[static_cast<size_t>(c)] + m * a.ig[e] * a.u[e];
    }
  std::vector<float> G(static_cast<size_t>(W), 0.0f);  // dL/dh_t, carried backwards
  for (int64_t t = T - 1; t >= 0; --t)
    for (int64_t c = 0; c < W; ++c) {
      const int64_t e = t * W + c;
      float& g = G[static_cast<size_t>(c)];
      g += a.dy[e];
      if (a.dstates) a.dstates[e] = g;
      const bool r = a.reset[t] != 0;
      const float a2 = r ? 0.0f : std::exp(2.0f * a.la[e]);
      const float at = r ? 0.0f : std::exp(a.la[e]);
      const float m = r ? 1.0f : std::sqrt(1.0f - a2);
      a.du[e] = g * m * a.ig[e];
      a.dig[e] = g * m * a.u[e];
      // d/d(log a): a_t h_{t-1} through the decay, -2 a^2 dm/dx (x = 1 - a^2) through the normaliser.
      const float dm_dx = 1.0f / std::sqrt(std::max(4.0f * (1.0f - a2), 1e-6f));
      a.dla[e] = r ? 0.0f : g * (at * hprev[static_cast<size_t>(e)] - 2.0f * a2 * dm_dx * a.ig[e] * a.u[e]);
      g *= at;  // what h_{t-1} receives (0 across a reset)
    }
  std::copy(G.begin(), G.end(), a.dh0);
}

}  // namespace mixlens::grad
