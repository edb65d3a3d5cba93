// Backward of the causal depthwise conv1d (ops::causal_conv1d) with respect to the call's input;
// the cached window the call starts from is a constant here (its gradient is not served).
#include <algorithm>

#include "grad/ops_grad.h"
#include "ops/ops.h"

namespace mixlens::grad {

void causal_conv1d_backward(const float* du, int64_t B, int64_t T, int64_t C, int64_t K, const float* wT,
                            float* din, int64_t din_stride) {
  // u[t] reads ext[t+1+j] = input[t+1+j-K] for j >= K-1-t: input row s gets wT[j] du[s+K-1-j].
  // Channel blocks on the pool, as the forward (each element sums its taps in the same order).
  constexpr int64_t kBlockC = 256;
  const int64_t blocks = T * C < (int64_t{1} << 14) ? 1 : (C + kBlockC - 1) / kBlockC;
  for (int64_t b = 0; b < B; ++b)
    ops::parallel_for(blocks, [&](int64_t blk) {
      const int64_t c0 = blocks == 1 ? 0 : blk * kBlockC, c1 = blocks == 1 ? C : std::min(C, c0 + kBlockC);
      for (int64_t s = 0; s < T; ++s) {
        float* o = din + (b * T + s) * din_stride;
        std::fill(o + c0, o + c1, 0.0f);
        for (int64_t j = 0; j < K; ++j) {
          const int64_t t = s + K - 1 - j;
          if (t >= T) continue;
          const float* g = du + (b * T + t) * C;
          const float* w = wT + j * C;
          for (int64_t c = c0; c < c1; ++c) o[c] += w[c] * g[c];
        }
      }
    });
}

}  // namespace mixlens::grad
