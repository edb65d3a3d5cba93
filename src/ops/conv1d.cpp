#include <algorithm>
#include <cstring>
#include <vector>

#include "ops/ops.h"

namespace mixlens::ops {

void causal_conv1d(const float* in, int64_t in_stride, int64_t B, int64_t T, int64_t C, int64_t K,
                   const float* wT, const float* bias, float* state, float* out, bool use_silu) {
  // Row r of ext = [state (K rows) | input (T rows)], read in place (no copy of the input).
  // Channel blocks run on the pool: a prompt's conv was a serial pass between parallel GEMMs.
  // Every element is computed as before (bias, then the K taps in order, then SiLU), so the
  // blocking changes no value.
  constexpr int64_t kBlockC = 256;
  const int64_t blocks = T * C < (int64_t{1} << 14) ? 1 : (C + kBlockC - 1) / kBlockC;
  for (int64_t b = 0; b < B; ++b) {
    float* st = state + b * K * C;
    const auto row = [&](int64_t r) { return r < K ? st + r * C : in + (b * T + r - K) * in_stride; };
    parallel_for(blocks, [&](int64_t blk) {
      const int64_t c0 = blocks == 1 ? 0 : blk * kBlockC, c1 = blocks == 1 ? C : std::min(C, c0 + kBlockC);
      for (int64_t t = 0; t < T; ++t) {
        float* o = out + (b * T + t) * C;
        if (K == 4) {
          // The usual window in one pass over o (the general loop below makes five), same order of
          // operations: bias, then the taps oldest first.
          const float *__restrict e0 = row(t + 1), *__restrict e1 = row(t + 2), *__restrict e2 = row(t + 3),
                                  *__restrict e3 = row(t + 4);
          const float *__restrict w0 = wT, *__restrict w1 = wT + C, *__restrict w2 = wT + 2 * C, *__restrict w3 = wT + 3 * C;
          float* __restrict oc = o;
          for (int64_t c = c0; c < c1; ++c) {
            float v = bias ? bias[c] : 0.0f;
            v += w0[c] * e0[c];
            v += w1[c] * e1[c];
            v += w2[c] * e2[c];
            v += w3[c] * e3[c];
            oc[c] = v;
          }
        } else {
          for (int64_t c = c0; c < c1; ++c) o[c] = bias ? bias[c] : 0.0f;
          for (int64_t j = 0; j < K; ++j) {
            const float* e = row(t + 1 + j);
            const float* w = wT + j * C;
            for (int64_t c = c0; c < c1; ++c) o[c] += w[c] * e[c];
          }
        }
        if (use_silu) silu(o + c0, o + c0, c1 - c0);  // vectorized
      }
    });
    // The window keeps the last K rows of ext; row T + i >= i, so copying in increasing i reads
    // each old state row before it is overwritten.
    for (int64_t i = 0; i < K; ++i) {
      const float* src = row(T + i);
      if (src != st + i * C) std::memmove(st + i * C, src, sizeof(float) * static_cast<size_t>(C));
    }
  }
}

}  // namespace mixlens::ops
