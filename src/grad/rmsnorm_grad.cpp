// Backward of RMSNorm (ops::rmsnorm; Mamba2RMSNorm, MambaRMSNormGated's norm, Qwen's (1 + w) form).
#include <cmath>

#include "grad/ops_grad.h"
#include "ops/ops.h"

namespace mixlens::grad {

void rmsnorm_backward(const float* x, const float* w, const float* dy, float* dx, int64_t rows, int64_t dim,
                      float eps, bool zero_centred, bool accumulate) {
  // Rows are independent: blocks of rows on the pool (the Qwen backward runs it on [T, D] twice a
  // layer and per head on q / k / the gated norm's input; serial, it left the other thread idle).
  ops::parallel_rows(rows, dim, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * dim;
      const float* gr = dy + r * dim;
      float* o = dx + r * dim;
      double ss = 0.0, dot = 0.0;
      for (int64_t i = 0; i < dim; ++i) {
        const double wg = static_cast<double>(zero_centred ? 1.0f + w[i] : w[i]) * gr[i];
        ss += static_cast<double>(xr[i]) * xr[i];
        dot += wg * xr[i];
      }
      const double inv = 1.0 / std::sqrt(ss / static_cast<double>(dim) + static_cast<double>(eps));
      const double k = inv * inv * inv * dot / static_cast<double>(dim);
      for (int64_t i = 0; i < dim; ++i) {
        const double wg = static_cast<double>(zero_centred ? 1.0f + w[i] : w[i]) * gr[i];
        const float v = static_cast<float>(inv * wg - k * xr[i]);
        o[i] = accumulate ? o[i] + v : v;
      }
    }
  });
}

}  // namespace mixlens::grad
