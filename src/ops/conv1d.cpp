#include <algorithm>
#include <cstring>
#include <vector>

#include "ops/ops.h"

namespace mixlens::ops {

void causal_conv1d(const float* in, int64_t in_stride, int64_t B, int64_t T, int64_t C, int64_t K,
                   const float* wT, const float* bias, float* state, float* out, bool use_silu) {
  // ext = [state (K rows) | input (T rows)], time-major so the channel loop vectorizes.
  std::vector<float> ext(static_cast<size_t>((K + T) * C));
  for (int64_t b = 0; b < B; ++b) {
    float* st = state + b * K * C;
    std::memcpy(ext.data(), st, sizeof(float) * static_cast<size_t>(K * C));
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(ext.data() + (K + t) * C, in + (b * T + t) * in_stride, sizeof(float) * static_cast<size_t>(C));
    for (int64_t t = 0; t < T; ++t) {
      float* o = out + (b * T + t) * C;
      for (int64_t c = 0; c < C; ++c) o[c] = bias ? bias[c] : 0.0f;
      for (int64_t j = 0; j < K; ++j) {
        const float* e = ext.data() + (t + 1 + j) * C;
        const float* w = wT + j * C;
        for (int64_t c = 0; c < C; ++c) o[c] += w[c] * e[c];
      }
      if (use_silu) silu(o, o, C);  // vectorized
    }
    std::memcpy(st, ext.data() + T * C, sizeof(float) * static_cast<size_t>(K * C));
  }
}

}  // namespace mixlens::ops
