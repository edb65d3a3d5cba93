// Backward of the sigmoid MoE routers' weights (the Nemotron-H and Kimi-Linear MoE backwards share it).
#include "grad/ops_grad.h"

namespace mixlens::grad {

void sigmoid_topk_weights_backward(const float* s, const int64_t* chosen, int64_t K, const float* dw, bool norm,
                                   float eps, float scale, float* dlog) {
  double tot = 0.0, sdw = 0.0;  // sum_k s_k (as the forward's float sum) and sum_k dw_k s_k
  float totf = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    totf += s[chosen[k]];
    sdw += static_cast<double>(dw[k]) * s[chosen[k]];
  }
  tot = static_cast<double>(totf + eps);
  for (int64_t k = 0; k < K; ++k) {
    const int64_t e = chosen[k];
    // d(s_k / S)/ds_j = [j = k] / S - s_k / S^2
    const float ds = norm ? static_cast<float>(dw[k] / tot - sdw / (tot * tot)) : dw[k];
    dlog[e] += ds * scale * sigmoid_d(s[e]);
  }
}

}  // namespace mixlens::grad
