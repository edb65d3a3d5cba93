// The SSM mixers' vector kernels (src/mixers/ssm_kernels.h) against double-precision references
// and against the portable loops they replace, on every ISA level this CPU runs.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "mixers/selective_scan.h"
#include "mixers/ssd.h"
#include "mixers/ssm_kernels.h"
#include "ops/kernels.h"
#include "ops/ops.h"

using namespace mixlens;

namespace {

std::vector<ops::Isa> levels() {
  std::vector<ops::Isa> out;
  for (ops::Isa i : {ops::Isa::scalar, ops::Isa::avx2, ops::Isa::avx512})
    if (ops::isa_supported(i)) out.push_back(i);
  return out;
}

struct IsaGuard {
  ops::Isa saved = ops::isa();
  ~IsaGuard() { ops::set_isa(saved); }
};

std::vector<float> randn(size_t n, std::mt19937& g, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(g);
  return v;
}

double rel_rms(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

}  // namespace

TEST(SsmKernels, SoftplusMatchesDoubleOnEveryLevel) {
  // Both sides of torch's threshold (20), the region where 1 + exp(x) rounds to 1, underflow,
  // and lengths that leave a tail after the 8-wide loop.
  std::vector<float> x;
  for (float v = -110.0f; v <= 40.0f; v += 0.0137f) x.push_back(v);
  for (float v : {0.0f, -0.0f, 20.0f, std::nextafter(20.0f, 21.0f), std::nextafter(20.0f, 0.0f), -16.6f, -17.0f, 1e-8f})
    x.push_back(v);
  std::vector<float> bias(x.size());
  std::mt19937 g(5);
  for (size_t i = 0; i < x.size(); ++i) {
    bias[i] = std::uniform_real_distribution<float>(-0.5f, 0.5f)(g);
    x[i] -= bias[i];
  }
  IsaGuard guard;
  for (ops::Isa isa : levels()) {
    ops::set_isa(isa);
    for (size_t n : {x.size(), size_t{13}, size_t{3}}) {
      std::vector<float> y(n);
      detail::softplus_bias(x.data(), bias.data(), y.data(), static_cast<int64_t>(n));
      for (size_t i = 0; i < n; ++i) {
        const float v = x[i] + bias[i];  // the input as the kernel sees it (one float rounding)
        const double ref = v > 20.0f ? static_cast<double>(v) : std::log1p(std::exp(static_cast<double>(v)));
        // Results below the smallest normal float (x < -87.3) may flush to 0.
        const double tol = 4 * std::numeric_limits<float>::epsilon() * ref + std::numeric_limits<float>::min();
        ASSERT_LE(std::fabs(y[i] - ref), tol) << ops::isa_name(isa) << " x " << v << " got " << y[i] << " want " << ref;
      }
    }
    // In place, and NaN stays NaN.
    std::vector<float> z = {1.0f, std::numeric_limits<float>::quiet_NaN(), -3.0f};
    const std::vector<float> zero(3, 0.0f);
    detail::softplus_bias(z.data(), zero.data(), z.data(), 3);
    EXPECT_NEAR(z[0], std::log1p(std::exp(1.0)), 1e-6);
    EXPECT_TRUE(std::isnan(z[1])) << ops::isa_name(isa);
  }
}

TEST(SsmKernels, Mamba1VectorTokenLoopEqualsPortableLoop) {
  // E not a multiple of 8 or of the 32-channel block; every state size the vector loop takes,
  // and one it does not (N = 12 falls back); per-token states on; a non-zero initial state.
  std::mt19937 g(11);
  for (int64_t N : {8, 16, 32, 64, 12}) {
    const int64_t T = 19, E = 45;
    const auto u = randn(static_cast<size_t>(T * E), g), B = randn(static_cast<size_t>(T * N), g),
               C = randn(static_cast<size_t>(T * N), g), D = randn(static_cast<size_t>(E), g),
               S0 = randn(static_cast<size_t>(E * N), g);
    std::vector<float> dt(static_cast<size_t>(T * E)), A(static_cast<size_t>(E * N));
    std::uniform_real_distribution<float> ud(0.0f, 1.0f);
    for (float& v : dt) v = 0.5f * ud(g) * ud(g);
    for (float& v : A) v = -std::exp(4.0f * ud(g) - 1.0f);
    dt[3] = 0.0f;  // dt = 0 keeps the state: exp(0) = 1 exactly
    std::vector<std::vector<float>> out[2];
    IsaGuard guard;
    int k = 0;
    for (ops::Isa isa : {ops::Isa::scalar, ops::best_isa()}) {
      ops::set_isa(isa);
      std::vector<float> S = S0, y(static_cast<size_t>(T * E)), st(static_cast<size_t>(T * E * N));
      detail::SelectiveScanArgs a;
      a.T = T; a.E = E; a.N = N;
      a.u = u.data(); a.dt = dt.data(); a.B = B.data(); a.C = C.data(); a.A = A.data(); a.D = D.data();
      a.S = S.data(); a.y = y.data(); a.states = st.data();
      EXPECT_EQ(detail::selective_scan_avx2_ok(a), isa != ops::Isa::scalar && N % 8 == 0) << N;
      detail::selective_scan_recurrent(a);
      out[k++] = {y, S, st};
    }
    for (size_t i = 0; i < 3; ++i) EXPECT_LE(rel_rms(out[1][i], out[0][i]), 1e-6) << "N " << N << " output " << i;
    // The last token's state is the final state, bit for bit.
    for (int64_t i = 0; i < E * N; ++i)
      ASSERT_EQ(out[1][2][static_cast<size_t>((T - 1) * E * N + i)], out[1][1][static_cast<size_t>(i)]);
  }
}

TEST(SsmKernels, Mamba2ChunkedStatesEqualPortableReplayAndTokenLoop) {
  // Chunks that do not divide T, a non-zero initial state, two groups.
  std::mt19937 g(7);
  const int64_t T = 23, H = 4, P = 16, G = 2, N = 8, Q = 8;
  const auto x = randn(static_cast<size_t>(T * H * P), g), B = randn(static_cast<size_t>(T * G * N), g),
             C = randn(static_cast<size_t>(T * G * N), g), D = randn(static_cast<size_t>(H), g),
             S0 = randn(static_cast<size_t>(H * P * N), g);
  std::vector<float> dt(static_cast<size_t>(T * H)), A(static_cast<size_t>(H));
  std::uniform_real_distribution<float> ud(0.0f, 1.0f);
  for (float& v : dt) v = ud(g);
  for (float& v : A) v = -std::exp(2.0f * ud(g) - 1.0f);
  auto run = [&](bool chunked, ops::Isa isa) {
    IsaGuard guard;
    ops::set_isa(isa);
    std::vector<float> S = S0, y(static_cast<size_t>(T * H * P)), st(static_cast<size_t>(T * H * N * P));
    detail::SsdArgs a;
    a.T = T; a.H = H; a.P = P; a.G = G; a.N = N;
    a.x = x.data(); a.B = B.data(); a.C = C.data(); a.dt = dt.data(); a.A = A.data(); a.D = D.data();
    a.S = S.data(); a.y = y.data(); a.states = st.data(); a.chunk = Q;
    if (chunked) detail::ssd_chunked(a); else detail::ssd_recurrent(a);
    return std::vector<std::vector<float>>{y, S, st};
  };
  const auto ref = run(false, ops::Isa::scalar);
  for (ops::Isa isa : levels()) {
    const auto got = run(true, isa);
    for (size_t i = 0; i < 3; ++i) EXPECT_LE(rel_rms(got[i], ref[i]), 2e-6) << ops::isa_name(isa) << " output " << i;
  }
  const auto portable = run(true, ops::Isa::scalar), vec = run(true, ops::best_isa());
  EXPECT_LE(rel_rms(vec[2], portable[2]), 1e-6);
}

TEST(SsdChunked, ShortPromptsMatchTokenLoopWithEveryOutputWritten) {
  // A fresh prompt shorter than the chunk (one chunk, CB in row blocks, scratch sized by T not Q,
  // the intra-chunk product in triangular row blocks)
  // and one of two uneven chunks, one group, y and S poisoned with NaN where the scan must write
  // them: every output entry is written (mamba2_mixer.cpp hands ssd_chunked uninitialised y).
  std::mt19937 g(11);
  const int64_t H = 6, P = 16, G = 1, N = 32;
  // (1100, 2048): a chunk whose scratch (> 1M floats) is not kept per thread.
  for (const auto& tq : {std::pair<int64_t, int64_t>{150, 128}, {100, 256}, {70, 256}, {5, 256}, {1100, 2048}}) {
    const int64_t T = tq.first, Q = tq.second;  // not a structured binding: clang < 16 cannot capture one
    const auto x = randn(static_cast<size_t>(T * H * P), g), B = randn(static_cast<size_t>(T * G * N), g),
               C = randn(static_cast<size_t>(T * G * N), g), D = randn(static_cast<size_t>(H), g);
    std::vector<float> dt(static_cast<size_t>(T * H)), A(static_cast<size_t>(H));
    std::uniform_real_distribution<float> ud(0.0f, 1.0f);
    for (float& v : dt) v = 0.2f * ud(g);
    for (float& v : A) v = -std::exp(2.0f * ud(g) - 1.0f);
    auto run = [&](bool chunked) {
      std::vector<float> S(static_cast<size_t>(H * P * N), 0.0f);
      std::vector<float> y(static_cast<size_t>(T * H * P), std::numeric_limits<float>::quiet_NaN());
      detail::SsdArgs a;
      a.T = T; a.H = H; a.P = P; a.G = G; a.N = N;
      a.x = x.data(); a.B = B.data(); a.C = C.data(); a.dt = dt.data(); a.A = A.data(); a.D = D.data();
      a.S = S.data(); a.y = y.data(); a.chunk = Q;
      if (chunked) detail::ssd_chunked(a); else detail::ssd_recurrent(a);
      return std::vector<std::vector<float>>{y, S};
    };
    const auto ref = run(false), got = run(true);
    for (size_t i = 0; i < 2; ++i) {
      for (float v : got[i]) ASSERT_TRUE(std::isfinite(v)) << "T " << T << " output " << i;
      // The final state sums T products in another order than the token loop: float32 rounding
      // grows with the chunk (6.8e-6 measured at 1,100 tokens); a wrong term would be O(1).
      EXPECT_LE(rel_rms(got[i], ref[i]), T > 512 ? 1e-5 : 2e-6) << "T " << T << " Q " << Q << " output " << i;
    }
  }
}

TEST(CausalConv1d, EveryKernelSizeMatchesDoubleReferenceAndKeepsTheWindow) {
  // K = 4 runs a one-pass loop, other sizes the general one: both against a double reference, with
  // a cached window, bias, SiLU, an input stride past C, and C x T large enough for channel blocks.
  std::mt19937 g(5);
  const int64_t B = 2, T = 40, C = 600, stride = C + 9;
  for (int64_t K : {2, 3, 4, 5}) {
    for (bool bias_on : {true, false}) {
      const auto in = randn(static_cast<size_t>(B * T * stride), g), wT = randn(static_cast<size_t>(K * C), g),
                 bias = randn(static_cast<size_t>(C), g), st0 = randn(static_cast<size_t>(B * K * C), g);
      std::vector<float> st = st0, out(static_cast<size_t>(B * T * C));
      ops::causal_conv1d(in.data(), stride, B, T, C, K, wT.data(), bias_on ? bias.data() : nullptr, st.data(),
                         out.data(), true);
      for (int64_t b = 0; b < B; ++b) {
        // ext row r: the window's K rows, then the T inputs.
        const auto ext = [&](int64_t r, int64_t c) {
          return r < K ? st0[static_cast<size_t>((b * K + r) * C + c)] : in[static_cast<size_t>((b * T + r - K) * stride + c)];
        };
        for (int64_t t = 0; t < T; ++t)
          for (int64_t c = 0; c < C; ++c) {
            double v = bias_on ? bias[static_cast<size_t>(c)] : 0.0;
            for (int64_t j = 0; j < K; ++j) v += static_cast<double>(wT[static_cast<size_t>(j * C + c)]) * ext(t + 1 + j, c);
            const double ref = v / (1.0 + std::exp(-v));
            ASSERT_NEAR(out[static_cast<size_t>((b * T + t) * C + c)], ref, 1e-5 * (1.0 + std::fabs(ref)))
                << "K " << K << " b " << b << " t " << t << " c " << c;
          }
        for (int64_t i = 0; i < K; ++i)
          for (int64_t c = 0; c < C; ++c)
            ASSERT_EQ(st[static_cast<size_t>((b * K + i) * C + c)], ext(T + i, c)) << "window row " << i;
      }
    }
  }
}
