// Scalar kernels: the portable fallback level and the reference the vector levels are tested
// against (exp here is std::exp, so this level is bit-identical to the pre-dispatch code).
#include <cmath>
#include <cstring>

#include "ops/dtype.h"
#include "ops/kernels.h"

namespace mixlens::ops {
namespace {

template <class Load>
void matvec(const Load& w, int64_t ld, const float* x, float* y, int64_t n, int64_t in) {
  for (int64_t o = 0; o < n; ++o) {
    // Four partial sums: the dependency chain of one sum would limit a scalar core to 1 add / 4 cycles.
    float s[4] = {0, 0, 0, 0};
    int64_t k = 0;
    for (; k + 4 <= in; k += 4)
      for (int j = 0; j < 4; ++j) s[j] += w(o * ld + k + j) * x[k + j];
    for (; k < in; ++k) s[0] += w(o * ld + k) * x[k];
    y[o] = (s[0] + s[1]) + (s[2] + s[3]);
  }
}

void mv_f32(const float* W, int64_t ld, const float* x, float* y, int64_t n, int64_t in) {
  matvec([W](int64_t i) { return W[i]; }, ld, x, y, n, in);
}
void mv_bf16(const uint16_t* W, int64_t ld, const float* x, float* y, int64_t n, int64_t in) {
  matvec([W](int64_t i) { return bf16_to_f32(W[i]); }, ld, x, y, n, in);
}
void mv_f16(const uint16_t* W, int64_t ld, const float* x, float* y, int64_t n, int64_t in) {
  matvec([W](int64_t i) { return f16_to_f32(W[i]); }, ld, x, y, n, in);
}
// Many rows: the matvec per row (this level is the portable reference, not a speed path).
void gemm_f32(const float* W, int64_t ld, const float* X, int64_t ldx, int64_t rows, float* Y, int64_t ldy, int64_t n,
              int64_t in) {
  for (int64_t r = 0; r < rows; ++r) mv_f32(W, ld, X + r * ldx, Y + r * ldy, n, in);
}
void gemm_bf16(const uint16_t* W, int64_t ld, const float* X, int64_t ldx, int64_t rows, float* Y, int64_t ldy,
               int64_t n, int64_t in) {
  for (int64_t r = 0; r < rows; ++r) mv_bf16(W, ld, X + r * ldx, Y + r * ldy, n, in);
}
void gemm_f16(const uint16_t* W, int64_t ld, const float* X, int64_t ldx, int64_t rows, float* Y, int64_t ldy,
              int64_t n, int64_t in) {
  for (int64_t r = 0; r < rows; ++r) mv_f16(W, ld, X + r * ldx, Y + r * ldy, n, in);
}
void widen_bf16(const uint16_t* s, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = bf16_to_f32(s[i]);
}
void widen_f16(const uint16_t* s, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = f16_to_f32(s[i]);
}
void exp_(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = std::exp(x[i]);
}
void mul_silu(const float* x, const float* g, float* y, int64_t n) {
  if (!x)
    for (int64_t i = 0; i < n; ++i) y[i] = g[i] / (1.0f + std::exp(-g[i]));
  else
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * (g[i] / (1.0f + std::exp(-g[i])));
}
void sigmoid(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = 1.0f / (1.0f + std::exp(-x[i]));
}

void acc_rows(const float* p, const float* V, int64_t ld, int64_t n, int64_t d, float* o) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t e = 0; e < d; ++e) o[e] += p[j] * V[j * ld + e];
}

float q8_scale(const uint8_t* block) {
  float s;
  std::memcpy(&s, block, 4);
  return s;
}
// KernelTable::matvec_q8 lane by lane as the AVX2 kernel computes it (bitwise the same): lane i of a
// block sums the products at k = 2i, 2i+1, 16+2i, 16+2i+1 in integers; even and odd blocks
// accumulate apart; then the AVX2 horizontal sum's order.
float q8_dot(const uint8_t* row, const int16_t* xq, const float* xs, int64_t nb) {
  float acc[2][8] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * kQ8BlockBytes;
    const auto* q = reinterpret_cast<const int8_t*>(blk + 4);
    const int16_t* x = xq + b * kQ8Block;
    const float s = q8_scale(blk) * xs[b];
    for (int i = 0; i < 8; ++i) {
      const int32_t d = q[2 * i] * x[2 * i] + q[2 * i + 1] * x[2 * i + 1] + q[16 + 2 * i] * x[16 + 2 * i] +
                        q[17 + 2 * i] * x[17 + 2 * i];
      acc[b & 1][i] = std::fma(s, static_cast<float>(d), acc[b & 1][i]);
    }
  }
  float v[8], t[4];
  for (int i = 0; i < 8; ++i) v[i] = acc[0][i] + acc[1][i];
  for (int i = 0; i < 4; ++i) t[i] = v[i] + v[i + 4];
  return (t[0] + t[2]) + (t[1] + t[3]);
}
void mv_q8(const uint8_t* W, int64_t ld, const X16& x, float* y, int64_t n) {
  for (int64_t o = 0; o < n; ++o) y[o] = q8_dot(W + o * ld, x.q, x.s, x.nb) * x.f[0];
}
void gemm_q8(const uint8_t* W, int64_t ld, const X16& X, int64_t rows, float* Y, int64_t ldy, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) mv_q8(W, ld, X.row(r), Y + r * ldy, n);
}
void widen_q8(const uint8_t* W, int64_t ld, float* dst, int64_t rows, int64_t in) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < in; ++k) {
      const uint8_t* b = W + r * ld + k / kQ8Block * kQ8BlockBytes;
      dst[r * in + k] = static_cast<float>(reinterpret_cast<const int8_t*>(b + 4)[k % kQ8Block]) * q8_scale(b);
    }
}

}  // namespace

const KernelTable kScalarKernels = {mv_f32,     mv_bf16, mv_f16,   gemm_f32, gemm_bf16, gemm_f16, widen_bf16,
                                    widen_f16, exp_,    mul_silu, sigmoid,  acc_rows, mv_q8, gemm_q8, widen_q8};

}  // namespace mixlens::ops
