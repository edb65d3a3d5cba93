// The 16-bit-weight GEMM (src/ops/gemm16_avx2.cpp) against a double-precision reference of the
// widened weights: odd shapes (K and N not multiples of the 8 / 16 / 128 / 768 blocks, one row,
// rows not a multiple of the 6-row panel, several k blocks), strides larger than the sizes, bf16
// and f16, output overwritten; and its dispatch from ops::linear.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "ops/dtype.h"
#include "ops/gemm16.h"
#include "ops/kernels.h"
#include "kernel_test_util.h"

using namespace mixlens;
using namespace mixlens::test_util;

namespace {

struct GemmShape {
  int64_t rows, n, K;
};

void check(ops::Gemm16Fn fn, GemmShape s, bool f16) {
  const int64_t ldx = s.K + 3, ldw = s.K + 5, ldc = s.n + 7;  // strides past the used part
  const std::vector<float> x = randn(static_cast<size_t>(s.rows * ldx), 1);
  const std::vector<float> wf = randn(static_cast<size_t>(s.n * ldw), 2);
  std::vector<uint16_t> w(wf.size());
  for (size_t i = 0; i < w.size(); ++i) w[i] = f16 ? ops::f32_to_f16(wf[i]) : ops::f32_to_bf16(wf[i]);
  std::vector<float> c(static_cast<size_t>(s.rows * ldc), 1e30f);  // garbage to be overwritten
  fn(x.data(), ldx, s.rows, w.data(), ldw, f16, s.n, s.K, c.data(), ldc);
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t o = 0; o < ldc; ++o) {
      const float got = c[static_cast<size_t>(r * ldc + o)];
      if (o >= s.n) {  // past the n outputs: untouched
        ASSERT_EQ(got, 1e30f) << "wrote past n at row " << r << " col " << o;
        continue;
      }
      double ref = 0.0, mag = 0.0;
      for (int64_t k = 0; k < s.K; ++k) {
        const uint16_t b = w[static_cast<size_t>(o * ldw + k)];
        const double p = static_cast<double>(x[static_cast<size_t>(r * ldx + k)]) *
                         static_cast<double>(f16 ? ops::f16_to_f32(b) : ops::bf16_to_f32(b));
        ref += p;
        mag += std::fabs(p);
      }
      // float32 sums of K products: error within a few ulp of the magnitude sum per term.
      ASSERT_NEAR(got, ref, 1e-6 * mag * std::sqrt(static_cast<double>(s.K) + 1.0) + 1e-30)
          << (f16 ? "f16" : "bf16") << " rows " << s.rows << " n " << s.n << " K " << s.K << " at (" << r << ", "
          << o << ")";
    }
}

}  // namespace

TEST(Gemm16, Avx2MatchesDoubleOnOddShapes) {
  if (!ops::isa_supported(ops::Isa::avx2)) GTEST_SKIP() << "no AVX2 + FMA + F16C on this CPU";
  for (GemmShape s : {GemmShape{1, 1, 1}, GemmShape{1, 17, 9}, GemmShape{5, 15, 7}, GemmShape{6, 16, 8}, GemmShape{7, 33, 31},
                  GemmShape{13, 129, 257}, GemmShape{37, 300, 769}, GemmShape{130, 131, 1537}, GemmShape{8, 40, 2305}})
    for (bool f16 : {false, true}) check(ops::kGemm16Avx2, s, f16);
}

TEST(Gemm16, Avx2ZeroKWritesZeros) {
  if (!ops::isa_supported(ops::Isa::avx2)) GTEST_SKIP() << "no AVX2 + FMA + F16C on this CPU";
  std::vector<float> c(12, 5.0f);
  const float x = 1.0f;
  const uint16_t w = 0;
  ops::kGemm16Avx2(&x, 0, 3, &w, 0, false, 4, 0, c.data(), 4);
  for (float v : c) EXPECT_EQ(v, 0.0f);
}

TEST(Gemm16, DispatchedOnlyAtTheAvx2Level) {
  const ops::Isa saved = ops::isa();
  for (ops::Isa i : {ops::Isa::scalar, ops::Isa::avx2, ops::Isa::avx512, ops::Isa::avx512bf16}) {
    if (!ops::isa_supported(i)) continue;
    ops::set_isa(i);
    EXPECT_EQ(ops::gemm16() != nullptr, i == ops::Isa::avx2) << ops::isa_name(i);
  }
  ops::set_isa(saved);
}
