// Backward of nn.Linear with respect to its input (ops::linear): one BLAS product.
#include "grad/ops_grad.h"
#include "ops/ops.h"

namespace mixlens::grad {

void linear_backward(const float* dy, int64_t rows, int64_t out, const Tensor& W, float* dx, bool accumulate) {
  const int64_t in = W.size(1);
  // Narrow (bf16/f16) weights are widened for the product: the gradient of the model as loaded.
  const Tensor w = W.to_f32();  // shares W when already float32
  // dx[rows,in] = dy[rows,out] @ W[out,in]
  ops::gemm(false, false, rows, in, out, 1.0f, dy, out, w.data(), in, accumulate ? 1.0f : 0.0f, dx, in);
}

}  // namespace mixlens::grad
