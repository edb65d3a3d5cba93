// Backward of nn.Linear with respect to its input (ops::linear): BLAS products on the thread pool.
#include <algorithm>
#include <cstring>
#include <vector>

#include <cblas.h>

#include "grad/ops_grad.h"
#include "ops/ops.h"

namespace mixlens::grad {

namespace {

// dx[rows,in] (+)= dy[rows,out] @ W[out,in], split over blocks of `in` columns on the pool (BLAS is
// single-threaded inside our pool, as in ops::linear, so one call would use one core).
void product(const float* dy, int64_t ldy, int64_t rows, int64_t out, const float* w, int64_t in, float beta, float* dx,
             int64_t ldx) {
  const int64_t work = rows * out * in;
  const int64_t nblocks = work < (int64_t{1} << 20) ? 1 : std::min<int64_t>(ops::num_threads(), (in + 63) / 64);
  const int64_t per = ((in + nblocks - 1) / nblocks + 15) / 16 * 16;  // whole SIMD widths per block
  ops::parallel_for(nblocks, [&](int64_t blk) {
    const int64_t i0 = blk * per, n = std::min(per, in - i0);
    if (n <= 0) return;
    if (rows == 1) {  // one row (a metric at the last position through the LM head): no packing of W
      // beta 0 by zeroing here: a BLAS may scale an uninitialized y by 0 (NaN * 0) instead of clearing it.
      if (beta == 0.0f) std::fill(dx + i0, dx + i0 + n, 0.0f);
      cblas_sgemv(CblasRowMajor, CblasTrans, static_cast<blasint>(out), static_cast<blasint>(n), 1.0f, w + i0,
                  static_cast<blasint>(in), dy, 1, 1.0f, dx + i0, 1);
    } else {
      ops::gemm(false, false, rows, n, out, 1.0f, dy, ldy, w + i0, in, beta, dx + i0, ldx);
    }
  });
}

// linear_backward for dy's columns [0, out) in rows of ldy floats.
void backward(const float* dy, int64_t ldy, int64_t rows, int64_t out, const Tensor& W, float* dx, bool accumulate) {
  const int64_t in = W.size(1);
  // Narrow (bf16/f16) weights are widened for the product: the gradient of the model as loaded.
  const Tensor w = W.to_f32();  // shares W when already float32
  const float beta = accumulate ? 1.0f : 0.0f;
  // Rows of dy that are all zero (a metric on some positions only: the LM head's dlogits) give zero
  // rows of dx; only the others go through the product.
  std::vector<int64_t> live;
  live.reserve(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = dy + r * ldy;
    if (std::any_of(g, g + out, [](float v) { return v != 0.0f; })) live.push_back(r);
  }
  const int64_t nl = static_cast<int64_t>(live.size());
  if (nl == rows || nl * 2 > rows) {  // dense enough: one product over every row
    product(dy, ldy, rows, out, w.data(), in, beta, dx, in);
    return;
  }
  if (!accumulate) std::fill(dx, dx + rows * in, 0.0f);
  if (nl == 0) return;
  std::vector<float> gdy(static_cast<size_t>(nl * out)), gdx(static_cast<size_t>(nl * in));
  for (int64_t k = 0; k < nl; ++k) std::memcpy(gdy.data() + k * out, dy + live[static_cast<size_t>(k)] * ldy,
                                               sizeof(float) * static_cast<size_t>(out));
  product(gdy.data(), out, nl, out, w.data(), in, 0.0f, gdx.data(), in);
  for (int64_t k = 0; k < nl; ++k) {
    float* o = dx + live[static_cast<size_t>(k)] * in;
    const float* s = gdx.data() + k * in;
    for (int64_t i = 0; i < in; ++i) o[i] += s[i];
  }
}

}  // namespace

void linear_backward(const float* dy, int64_t rows, int64_t out, const Tensor& W, float* dx, bool accumulate) {
  backward(dy, out, rows, out, W, dx, accumulate);
}

void linear_backward(const float* dy, int64_t rows, int64_t out, const ops::RowStack& W, float* dx, bool accumulate) {
  // One part at a time (dx summed over them): no widened or stacked copy of the whole weight.
  const auto& parts = W.parts();
  for (size_t p = 0; p < parts.size(); ++p)
    backward(dy + W.starts()[p], out, rows, parts[p].size(0), parts[p], dx, accumulate || p > 0);
}

void lora_backward(const float* dy, int64_t rows, int64_t out, const Tensor& down, const Tensor& up, float* dx) {
  const int64_t r = down.size(0);
  Tensor dt = Tensor::uninitialized({rows, r});
  linear_backward(dy, rows, out, up, dt.data(), false);
  linear_backward(dt.data(), rows, r, down, dx, true);
}

}  // namespace mixlens::grad
