// Backward of LayerNorm (ops::layernorm; nn.LayerNorm over the last dim, population variance) and of
// the squared-ReLU MLP (NemotronH's experts, RWKV's channel mixing).
#include <algorithm>
#include <cmath>

#include "grad/ops_grad.h"
#include "ops/ops.h"

namespace mixlens::grad {

void layernorm_backward(const float* x, const float* w, const float* dy, float* dx, int64_t rows, int64_t dim, float eps,
                        bool accumulate) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    const float* g = dy + r * dim;
    float* o = dx + r * dim;
    double ss = 0.0;
    const double mean = ops::mean_ss(xr, dim, ss);
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(dim) + eps);
    // dx = inv (gw - mean(gw) - xhat mean(gw xhat)), gw = dy * w.
    double mg = 0.0, mgx = 0.0;
    for (int64_t i = 0; i < dim; ++i) {
      const double gw = static_cast<double>(g[i]) * w[i];
      mg += gw;
      mgx += gw * (xr[i] - mean) * inv;
    }
    mg /= static_cast<double>(dim);
    mgx /= static_cast<double>(dim);
    for (int64_t i = 0; i < dim; ++i) {
      const double v = inv * (static_cast<double>(g[i]) * w[i] - mg - (xr[i] - mean) * inv * mgx);
      o[i] = accumulate ? o[i] + static_cast<float>(v) : static_cast<float>(v);
    }
  }
}

void relu2_mlp_backward(const Tensor& up_w, const Tensor& down_w, const float* x, const float* dy, int64_t rows,
                        int64_t in, int64_t I, float* dx, bool accumulate) {
  Tensor u({rows, I}), du({rows, I});
  ops::linear(x, rows, in, up_w, u.data());
  linear_backward(dy, rows, down_w.size(0), down_w, du.data(), false);
  for (int64_t k = 0; k < rows * I; ++k) du[k] *= 2.0f * std::max(u[k], 0.0f);
  linear_backward(du.data(), rows, I, up_w, dx, accumulate);
}

}  // namespace mixlens::grad
