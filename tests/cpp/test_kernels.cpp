// Kernels (issue 9 items 1-2): every ISA level this CPU runs vs a double-precision reference over
// odd sizes; the vectorized exp / silu / sigmoid error; narrow (bf16 / f16) weights through
// ops::linear and through whole models (LoadOptions::dtype).
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "fixture_util.h"
#include "grad/ops_grad.h"
#include "io/safetensors.h"
#include "io/weights.h"
#include "mixlens/errors.h"
#include "mixlens/model.h"
#include "mixlens/tools.h"
#include "mixlens/trace.h"
#include "ops/dtype.h"
#include "ops/kernels.h"
#include "ops/ops.h"
#include "kernel_test_util.h"

namespace fs = std::filesystem;
using namespace mixlens;
using namespace mixlens::test_util;

namespace {


}  // namespace

TEST(Kernels, IsaNamesAndForcing) {
  EXPECT_EQ(ops::parse_isa("avx2"), ops::Isa::avx2);
  EXPECT_THROW(ops::parse_isa("sse9"), InputError);
  EXPECT_TRUE(ops::isa_supported(ops::Isa::scalar));
  IsaGuard g;
  for (ops::Isa i : levels()) {
    ops::set_isa(i);
    EXPECT_EQ(ops::isa(), i);
  }
  for (ops::Isa i : {ops::Isa::avx2, ops::Isa::avx512, ops::Isa::avx512bf16})
    if (!ops::isa_supported(i)) {
      EXPECT_THROW(ops::set_isa(i), Error);
    }
}

TEST(Kernels, MatvecEveryDtypeAndLevelMatchesDouble) {
  const int64_t outs[] = {1, 3, 4, 5, 17, 33};
  const int64_t ins[] = {1, 7, 15, 16, 17, 31, 32, 33, 100, 773};
  for (ops::Isa isa : levels()) {
    const ops::KernelTable& kt = *ops::kernels_for(isa);
    for (int64_t n : outs)
      for (int64_t in : ins) {
        const int64_t ld = in + 3;  // a row stride wider than the row
        std::vector<float> W = randn(static_cast<size_t>(n * ld), 7u + static_cast<uint32_t>(n * 1000 + in));
        const std::vector<float> x = randn(static_cast<size_t>(in), 99u + static_cast<uint32_t>(in));
        std::vector<uint16_t> Wb(W.size()), Wh(W.size());
        for (size_t i = 0; i < W.size(); ++i) Wb[i] = ops::f32_to_bf16(W[i]), Wh[i] = ops::f32_to_f16(W[i]);
        for (int dt = 0; dt < 3; ++dt) {
          std::vector<float> y(static_cast<size_t>(n) + 1, 12345.0f);  // y[n] must stay untouched
          if (dt == 0) kt.matvec_f32(W.data(), ld, x.data(), y.data(), n, in);
          if (dt == 1) kt.matvec_bf16(Wb.data(), ld, x.data(), y.data(), n, in);
          if (dt == 2) kt.matvec_f16(Wh.data(), ld, x.data(), y.data(), n, in);
          for (int64_t o = 0; o < n; ++o) {
            double ref = 0, mag = 0;
            for (int64_t k = 0; k < in; ++k) {
              const size_t i = static_cast<size_t>(o * ld + k);
              const double w = dt == 0 ? W[i] : dt == 1 ? ops::bf16_to_f32(Wb[i]) : ops::f16_to_f32(Wh[i]);
              ref += w * x[static_cast<size_t>(k)];
              mag += std::fabs(w * x[static_cast<size_t>(k)]);
            }
            // float32 summation of `in` terms: error <= ~in * 2^-24 * sum|terms| (loose bound).
            const double tol = 1e-6 + 6e-8 * static_cast<double>(in) * mag;
            ASSERT_NEAR(y[static_cast<size_t>(o)], ref, tol)
                << ops::isa_name(isa) << " dtype " << dt << " n=" << n << " in=" << in << " row " << o;
          }
          ASSERT_EQ(y[static_cast<size_t>(n)], 12345.0f) << "wrote past the end";
        }
      }
  }
}

TEST(Kernels, WidenIsExact) {
  std::vector<uint16_t> b(1037), h(1037);
  const std::vector<float> v = randn(b.size(), 5, 100.0f);
  for (size_t i = 0; i < b.size(); ++i) b[i] = ops::f32_to_bf16(v[i]), h[i] = ops::f32_to_f16(v[i]);
  for (ops::Isa isa : levels()) {
    const ops::KernelTable& kt = *ops::kernels_for(isa);
    for (int64_t n : {int64_t{1}, int64_t{15}, int64_t{17}, int64_t{1037}}) {
      std::vector<float> ob(static_cast<size_t>(n)), oh(static_cast<size_t>(n));
      kt.widen_bf16(b.data(), ob.data(), n);
      kt.widen_f16(h.data(), oh.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(ob[static_cast<size_t>(i)], ops::bf16_to_f32(b[static_cast<size_t>(i)])) << ops::isa_name(isa);
        ASSERT_EQ(oh[static_cast<size_t>(i)], ops::f16_to_f32(h[static_cast<size_t>(i)])) << ops::isa_name(isa);
      }
    }
  }
}

TEST(Kernels, Half16ConversionsExactAndNearestEven) {
  // Every finite half bit pattern survives widening and narrowing (widening itself is checked
  // against the definition in IoDType.F16ExhaustiveAgainstDefinition).
  for (uint32_t h = 0; h < 65536; ++h) {
    const float b = ops::f16_to_f32(static_cast<uint16_t>(h));
    if (std::isfinite(b)) {
      ASSERT_EQ(ops::f32_to_f16(b), h) << "round trip " << h;
    }
  }
  // Narrowing picks the nearest half, ties to even, overflow to inf.
  std::mt19937 g(17);
  std::uniform_real_distribution<float> u(-70000.0f, 70000.0f);
  for (int i = 0; i < 200000; ++i) {
    const float x = i % 2 ? u(g) : u(g) * 1e-6f;
    const uint16_t h = ops::f32_to_f16(x);
    const double got = ops::f16_to_f32(h);
    if (std::fabs(x) >= 65520.0f) {
      ASSERT_TRUE(std::isinf(got)) << x;
      continue;
    }
    for (int dlt : {-1, 1}) {
      const uint16_t nb = static_cast<uint16_t>(h + dlt);
      const double other = ops::f16_to_f32(nb);
      if (std::isnan(other) || std::isinf(other) || (nb & 0x7fff) == 0x7fff) continue;
      const double dg = std::fabs(got - x), dn = std::fabs(other - x);
      ASSERT_TRUE(dg < dn || (dg == dn && (h & 1) == 0)) << x << " -> " << got << " but " << other << " is nearer";
    }
  }
  EXPECT_EQ(ops::f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(ops::f32_to_f16(-1e6f), 0xfc00);
  EXPECT_EQ(ops::f32_to_f16(0x1p-25f), 0x0000);             // half of the smallest subnormal: ties to even (0)
  EXPECT_EQ(ops::f32_to_f16(0x1p-25f + 0x1p-40f), 0x0001);
}

TEST(Kernels, Bf16RoundingIsNearestEven) {
  EXPECT_EQ(ops::f32_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 is exactly halfway between two bf16 values: ties to even (1.0).
  EXPECT_EQ(ops::f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);
  EXPECT_EQ(ops::f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);
  EXPECT_TRUE(std::isnan(ops::bf16_to_f32(ops::f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
}

// The vector exp is a polynomial, not libm: measure its error in float32 ulps over the whole range
// the mixers feed it (and the special values), for every level.
TEST(Kernels, ExpSiluSigmoidError) {
  std::vector<float> x;
  for (float v = -104.0f; v <= 89.0f; v += 0.00731f) x.push_back(v);
  for (float v : {0.0f, -0.0f, 1e-30f, -1e-30f, 88.7f, 88.73f, -87.3f, -103.9f, -200.0f, 200.0f}) x.push_back(v);
  const int64_t n = static_cast<int64_t>(x.size());
  for (ops::Isa isa : levels()) {
    const ops::KernelTable& kt = *ops::kernels_for(isa);
    std::vector<float> e(x.size()), s(x.size()), g(x.size()), ms(x.size()), half(x.size(), -0.5f);
    kt.exp(x.data(), e.data(), n);
    kt.mul_silu(nullptr, x.data(), s.data(), n);
    kt.mul_silu(half.data(), x.data(), ms.data(), n);
    kt.sigmoid(x.data(), g.data(), n);
    double worst = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      const double ref = std::exp(static_cast<double>(x[i]));
      if (ref > 3.4028234663852886e38) {
        EXPECT_TRUE(std::isinf(e[i])) << x[i];
        continue;
      }
      if (ref < 1.1754943508222875e-38) {  // subnormal results: absolute error below the smallest normal
        EXPECT_NEAR(e[i], ref, 1.2e-38) << x[i];
        continue;
      }
      const double ulp = std::ldexp(1.0, std::ilogb(ref) - 23);
      worst = std::max(worst, std::fabs(e[i] - ref) / ulp);
      const double sg = 1.0 / (1.0 + std::exp(-static_cast<double>(x[i])));
      ASSERT_NEAR(g[i], sg, 4e-7 * sg + 1e-38) << ops::isa_name(isa) << " sigmoid(" << x[i] << ")";
      ASSERT_NEAR(s[i], x[i] * sg, 4e-7 * std::fabs(x[i] * sg) + 1e-38) << ops::isa_name(isa) << " silu(" << x[i] << ")";
      ASSERT_NEAR(ms[i], -0.5 * x[i] * sg, 4e-7 * std::fabs(x[i] * sg) + 1e-38) << ops::isa_name(isa) << " -0.5 * silu(" << x[i] << ")";
    }
    EXPECT_LE(worst, 3.0) << ops::isa_name(isa) << " exp max error in ulps";
    RecordProperty(std::string("exp_max_ulp_") + ops::isa_name(isa), std::to_string(worst));
    std::printf("[ exp ] %s: max error %.2f ulp\n", ops::isa_name(isa), worst);
    // NaN stays NaN, -inf -> 0, +inf -> inf.
    const float sp[3] = {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity(),
                         std::numeric_limits<float>::infinity()};
    float out[3];
    kt.exp(sp, out, 3);
    EXPECT_TRUE(std::isnan(out[0])) << ops::isa_name(isa);
    EXPECT_EQ(out[1], 0.0f) << ops::isa_name(isa);
    EXPECT_TRUE(std::isinf(out[2])) << ops::isa_name(isa);
  }
}

// ops::linear with narrow weights equals ops::linear with the same weights widened, on the
// matvec path (rows <= 4), gemm16 (AVX2 level: 5..511 rows, or K <= 768) and the widen-then-sgemm
// path (other levels; 512+ rows with K > 768), at every level.
TEST(Kernels, LinearNarrowEqualsWidened) {
  IsaGuard guard;
  for (ops::Isa isa : levels()) {
    ops::set_isa(isa);
    for (int64_t rows : {int64_t{1}, int64_t{3}, int64_t{37}, int64_t{520}})
      for (auto [out, in] : {std::pair<int64_t, int64_t>{1, 5}, {300, 129}, {1029, 257}, {300, 1031}}) {
        const std::vector<float> w = randn(static_cast<size_t>(out * in), 3);
        const std::vector<float> x = randn(static_cast<size_t>(rows * in), 4);
        for (ScalarType t : {ScalarType::bfloat16, ScalarType::float16}) {
          std::vector<uint16_t> n(w.size());
          for (size_t i = 0; i < w.size(); ++i) n[i] = t == ScalarType::bfloat16 ? ops::f32_to_bf16(w[i]) : ops::f32_to_f16(w[i]);
          const Tensor Wn = Tensor::narrow({out, in}, t, n.data(), unowned(n.data()));
          const Tensor Ww = Wn.to_f32();
          ASSERT_EQ(Ww.dtype(), ScalarType::float32);
          std::vector<float> y1(static_cast<size_t>(rows * out)), y2(y1.size()), bias(static_cast<size_t>(out), 0.5f);
          ops::linear(x.data(), rows, in, Wn, y1.data(), bias.data());
          ops::linear(x.data(), rows, in, Ww, y2.data(), bias.data());
          // The kernels sum in different orders: rounding grows with sqrt(in) times sum |x w|.
          std::vector<float> ax(x.size()), aw(static_cast<size_t>(out * in)), mag(y1.size());
          for (size_t i = 0; i < ax.size(); ++i) ax[i] = std::fabs(x[i]);
          for (size_t i = 0; i < aw.size(); ++i) aw[i] = std::fabs(Ww.data()[i]);
          ops::linear(ax.data(), rows, in, Tensor::from({out, in}, aw), mag.data());
          for (size_t i = 0; i < y1.size(); ++i)
            ASSERT_NEAR(y1[i], y2[i], 2e-5 * (1.0 + std::fabs(y2[i])) + 5e-8 * std::sqrt(double(in)) * mag[i])
                << ops::isa_name(isa) << " rows " << rows << " [" << out << "," << in << "] " << dtype_str(t);
        }
      }
  }
}

// ops::RowStack: a weight kept as row views of its parts (no copy) gives what the one matrix gives,
// bitwise on the matvec and batch-invariant paths (each element one dot product in one order), within
// rounding on the BLAS path (its blocks differ); its backward likewise. Parts straddle the pool's blocks.
TEST(Kernels, RowStackEqualsTheStackedMatrix) {
  IsaGuard guard;
  const int64_t in = 257;
  const std::vector<int64_t> cuts = {5, 300, 1, 129, 64};
  int64_t out = 0;
  for (int64_t c : cuts) out += c;
  const std::vector<float> w = randn(static_cast<size_t>(out * in), 3);
  std::vector<uint16_t> wb(w.size());
  for (size_t i = 0; i < w.size(); ++i) wb[i] = ops::f32_to_bf16(w[i]);
  std::vector<uint8_t> wq(static_cast<size_t>(out * ops::q8_row_bytes(in)));
  for (int64_t r = 0; r < out; ++r) ops::quantize_q8_row(w.data() + r * in, in, wq.data() + r * ops::q8_row_bytes(in));
  const std::vector<Tensor> wholes = {Tensor::from({out, in}, w), Tensor::narrow({out, in}, ScalarType::bfloat16, wb.data(), unowned(wb.data())),
                                      Tensor::narrow({out, in}, ScalarType::int8, wq.data(), unowned(wq.data()))};
  for (const Tensor& whole : wholes) {
    std::vector<Tensor> parts;
    int64_t r0 = 0;
    for (int64_t c : cuts) {
      parts.push_back(detail::row_block(whole, r0, {c, in}));
      r0 += c;
    }
    const ops::RowStack stack(parts);
    ASSERT_EQ(stack.size(0), out);
    ASSERT_EQ(stack.size(1), in);
    ASSERT_EQ(stack.dtype(), whole.dtype());
    for (ops::Isa isa : levels()) {
      ops::set_isa(isa);
      for (bool det : {false, true})
        for (int64_t rows : {int64_t{1}, int64_t{3}, int64_t{37}, int64_t{520}}) {
          ops::DeterministicScope scope(det);
          const std::vector<float> x = randn(static_cast<size_t>(rows * in), 4);
          std::vector<float> y1(static_cast<size_t>(rows * out)), y2(y1.size()), bias(static_cast<size_t>(out), 0.25f);
          ops::linear(x.data(), rows, in, stack, y1.data(), bias.data());
          ops::linear(x.data(), rows, in, whole, y2.data(), bias.data());
          const bool bitwise = det || rows <= 4;
          for (size_t i = 0; i < y1.size(); ++i) {
            if (bitwise)
              ASSERT_EQ(y1[i], y2[i]) << ops::isa_name(isa) << " " << dtype_str(whole.dtype()) << " rows " << rows << " i " << i;
            else
              ASSERT_NEAR(y1[i], y2[i], 1e-5 * (1.0 + std::fabs(y2[i])) + 1e-5) << ops::isa_name(isa) << " rows " << rows;
          }
        }
    }
    // Backward: dx = dy W summed over the parts.
    for (int64_t rows : {int64_t{1}, int64_t{9}}) {
      const std::vector<float> dy = randn(static_cast<size_t>(rows * out), 5);
      std::vector<float> dx1(static_cast<size_t>(rows * in), 1.0f), dx2(dx1);
      grad::linear_backward(dy.data(), rows, out, stack, dx1.data(), true);
      grad::linear_backward(dy.data(), rows, out, whole, dx2.data(), true);
      for (size_t i = 0; i < dx1.size(); ++i) ASSERT_NEAR(dx1[i], dx2[i], 1e-4 * (1.0 + std::fabs(dx2[i])));
    }
  }
  // Parts that cannot stack are refused, naming what differs.
  const Tensor a({3, 4}), b({2, 5});
  EXPECT_THROW(ops::RowStack({a, b}), InputError);
  EXPECT_THROW(ops::RowStack({a, wholes[1]}), InputError);
  EXPECT_THROW(ops::RowStack(std::vector<Tensor>{}), InputError);
  EXPECT_THROW(ops::RowStack({Tensor({3})}), InputError);
  std::vector<float> y(8);
  EXPECT_THROW(ops::linear(y.data(), 1, 5, ops::RowStack({a, a}), y.data()), InputError);
}

TEST(Kernels, NarrowTensorRefusesFloatAccess) {
  std::vector<uint16_t> n(6, ops::f32_to_bf16(2.0f));
  const Tensor t = Tensor::narrow({2, 3}, ScalarType::bfloat16, n.data(), unowned(n.data()));
  EXPECT_EQ(t.dtype(), ScalarType::bfloat16);
  EXPECT_THROW((void)t.data(), Error);
  try {
    (void)t.data();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bfloat16"), std::string::npos) << e.what();
  }
  EXPECT_EQ(t.to_f32().to_vector(), std::vector<float>(6, 2.0f));
  EXPECT_EQ(t.clone().to_vector(), std::vector<float>(6, 2.0f));
  EXPECT_EQ(t.clone().dtype(), ScalarType::bfloat16);
}

TEST(Kernels, ParallelForManyCallsAndErrors) {
  // The spinning pool: many back-to-back ops (each sees every index exactly once), then an error.
  std::vector<std::atomic<int>> hits(64);
  for (int rep = 0; rep < 2000; ++rep)
    ops::parallel_for(64, [&](int64_t i) { hits[static_cast<size_t>(i)].fetch_add(1); });
  for (auto& h : hits) EXPECT_EQ(h.load(), 2000);
  EXPECT_THROW(ops::parallel_for(8, [](int64_t i) { if (i == 5) throw InputError("boom"); }), InputError);
  int64_t sum = 0;
  std::mutex mu;
  ops::parallel_for(100, [&](int64_t i) { std::lock_guard<std::mutex> lk(mu); sum += i; });
  EXPECT_EQ(sum, 4950);
}

TEST(Kernels, ParallelForOpsOfEverySizeNeverMix) {
  // The caller returns once the blocks are done, without waiting for the workers to check in, so a
  // late worker may arrive while the next op runs: every op of varying size (2 blocks: the decode
  // case, where the caller often does both) must see each of its indices exactly once, and a later
  // op's function never gets an earlier op's index. Also run under TSan (make test-tsan builds the
  // session tests, whose forwards use the pool).
  const int64_t sizes[] = {2, 3, 2, 7, 2, 64, 1, 5};
  std::vector<std::atomic<int>> hits(64);
  for (int rep = 0; rep < 4000; ++rep) {
    const int64_t n = sizes[rep % 8];
    std::atomic<int64_t> bad{0};
    ops::parallel_for(n, [&, n](int64_t i) {
      if (i < 0 || i >= n) bad.fetch_add(1);
      else hits[static_cast<size_t>(i)].fetch_add(1);
    });
    ASSERT_EQ(bad.load(), 0);
    for (int64_t i = 0; i < 64; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)].exchange(0), i < n ? 1 : 0) << rep;
    if (rep % 97 == 0) ops::park_threads();  // as a paused session does
  }
  // An error skips the remaining blocks, and the pool is usable after it.
  for (int rep = 0; rep < 50; ++rep) {
    EXPECT_THROW(ops::parallel_for(4, [](int64_t i) { if (i == 0) throw InputError("boom"); }), InputError);
    std::atomic<int> count{0};
    ops::parallel_for(3, [&](int64_t) { count.fetch_add(1); });
    ASSERT_EQ(count.load(), 3);
  }
}

// ---- whole models with narrow weights ------------------------------------------------------------

namespace {

// A copy of fixture `rel`'s checkpoint whose matmul weights are rounded to bf16 and stored as
// float32: a float32 load of it must equal a bfloat16 load of the original (to float32 rounding).
fs::path rounded_copy(const std::string& rel) {
  return test::weight_transformed_copy(rel, "bf16", [](const Tensor& w) {
    Tensor v = w.clone();
    for (int64_t i = 0; i < v.numel(); ++i) v[i] = ops::bf16_to_f32(ops::f32_to_bf16(v[i]));
    return v;
  });
}

std::vector<std::vector<int32_t>> prompts_for(const Model& m) {
  const int32_t V = static_cast<int32_t>(m.info().vocab_size);
  return {{1 % V, 5 % V, 9 % V, 2 % V, 7 % V, 3 % V, 11 % V}, {4 % V, 8 % V, 6 % V}};
}

}  // namespace

class NarrowModel : public ::testing::TestWithParam<const char*> {};

TEST_P(NarrowModel, Bf16LoadEqualsFloat32LoadOfRoundedWeights) {
  const std::string rel = GetParam();
  LoadOptions bf;
  bf.dtype = "bfloat16";
  const Model narrow = Model::load(test::fixture(rel).string(), bf);
  EXPECT_EQ(narrow.info().dtype, "bfloat16");
  const fs::path rounded = rounded_copy(rel);
  const Model ref = Model::load(rounded.string());
  const auto prompts = prompts_for(ref);
  const Tensor a = narrow.run(prompts), b = ref.run(prompts);
  ASSERT_EQ(a.shape(), b.shape());
  // Same weights, same float32 arithmetic but for summation order in the kernels.
  EXPECT_LT(test::rel_rms(a, b), 2e-5) << rel;
  // Generation (decode steps: the matvec path) agrees token for token.
  GenerateOptions g;
  g.max_new_tokens = 6;
  g.eos_token_id = -1;
  EXPECT_EQ(narrow.generate(prompts, g).new_tokens, ref.generate(prompts, g).new_tokens) << rel;
  fs::remove_all(rounded);
}

TEST_P(NarrowModel, AutoOnFloat32CheckpointIsFloat32AndBf16IsClose) {
  const std::string rel = GetParam();
  LoadOptions au;
  au.dtype = "auto";
  const Model f32 = Model::load(test::fixture(rel).string());
  const Model autom = Model::load(test::fixture(rel).string(), au);
  const auto prompts = prompts_for(f32);
  const Tensor a = f32.run(prompts), b = autom.run(prompts);
  EXPECT_EQ(a.to_vector(), b.to_vector()) << "auto on a float32 checkpoint must be the float32 path";
  LoadOptions bf;
  bf.dtype = "float16";
  const Tensor c = Model::load(test::fixture(rel).string(), bf).run(prompts);
  EXPECT_LT(test::rel_rms(c, a), 2e-2) << rel << ": float16 weights drift too far from float32";
  // Served weights stay float32.
  EXPECT_EQ(Model::load(test::fixture(rel).string(), bf).head_weight("lm_head").dtype(), ScalarType::float32);
}

// convert_checkpoint (issue 27): the folder it writes, loaded with "auto", is bitwise a load of the source
// with the target dtype (prompt logits and greedy decode), its matmul weights are stored narrow and
// nothing else is; loaded as float32 it widens those same rounded weights.
TEST_P(NarrowModel, ConvertedFolderLoadsBitwiseAsConvertingAtLoad) {
  const std::string rel = GetParam();
  std::string leaf = rel;
  for (char& c : leaf)
    if (c == '/') c = '_';
  const fs::path out = fs::temp_directory_path() / ("mixlens_convert_" + leaf + "_" + std::to_string(::getpid()));
  fs::remove_all(out);
  for (const char* dt : {"bfloat16", "float16"}) {
    const ConvertReport r = convert_checkpoint(test::fixture(rel).string(), out.string(), dt);
    LoadOptions want, au;
    want.dtype = dt;
    au.dtype = "auto";
    const Model src = Model::load(test::fixture(rel).string(), want), conv = Model::load(out.string(), au);
    EXPECT_EQ(conv.info().weight_dtypes, std::vector<std::string>{dt}) << rel;
    EXPECT_EQ(r.converted, static_cast<int64_t>(src.info().matmul_weights.size()));
    EXPECT_GT(r.kept, 0);
    const auto prompts = prompts_for(src);
    EXPECT_EQ(src.run(prompts).to_vector(), conv.run(prompts).to_vector()) << rel << " " << dt;
    GenerateOptions g;
    g.max_new_tokens = 4;
    g.eos_token_id = -1;
    EXPECT_EQ(src.generate(prompts, g).new_tokens, conv.generate(prompts, g).new_tokens) << rel;
    const io::WeightStore store = io::WeightStore::open(out);
    const auto& mm = src.info().matmul_weights;
    for (const std::string& n : store.names())
      EXPECT_EQ(store.dtype_name(n) == (std::string(dt) == "bfloat16" ? "BF16" : "F16"),
                std::binary_search(mm.begin(), mm.end(), n)) << n;
    EXPECT_TRUE(fs::exists(out / "config.json"));
    // A second convert into the same (now non-empty) folder is refused, the folder left as it was.
    EXPECT_THROW(convert_checkpoint(test::fixture(rel).string(), out.string(), dt), InputError);
    fs::remove_all(out);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, NarrowModel,
                         ::testing::Values("mamba2/short_prompt", "mamba/short_prompt", "falcon_mamba/short_prompt", "qwen3_5/short_prompt",
                                           "qwen3_next/moe_hv_2hk", "qwen3_next/padded_batch", "bamba/padded_batch",
                                           "nemotron_h/moe_latent", "falcon_h1/norm_before_gate"),
                         [](const auto& p) {
                           std::string s = p.param;
                           for (char& c : s)
                             if (c == '/') c = '_';
                           return s;
                         });

TEST(NarrowModelErrors, UnknownDtypeIsAnInputError) {
  LoadOptions o;
  o.dtype = "int4";
  try {
    (void)Model::load(test::fixture("mamba2/short_prompt").string(), o);
    FAIL() << "int4 accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("int4"), std::string::npos);
  }
}

// The CLI's --dtype: the values it writes are the library's for that dtype; a bad dtype is a usage error.
TEST(NarrowModelCli, DtypeFlag) {
  const fs::path dir = fs::temp_directory_path() / ("mixlens_cli_dtype_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string model = test::fixture("mamba2/short_prompt").string();
  auto cli = [&](const std::string& args) {
    const std::string cmd = std::string(MIXLENS_CLI_PATH) + " " + args + " > /dev/null 2> " + (dir / "err.txt").string();
    const int rc = std::system(cmd.c_str());
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
  };
  const fs::path out = dir / "v.safetensors";
  ASSERT_EQ(cli("run --model " + model + " 3,4,5 --ids --dtype bfloat16 --save logits --out " + out.string()), 0);
  const auto logits_of = [](const std::string& path, const char* dtype) {
    LoadOptions o;
    o.dtype = dtype;
    Trace t;
    t.save("logits");
    Model::load(path, o).run({{3, 4, 5}}, &t);
    return t.get("logits").to_vector();
  };
  const std::vector<float> bf16 = logits_of(model, "bfloat16");
  EXPECT_EQ(io::SafetensorsFile(out).get_f32("logits").to_vector(), bf16);
  EXPECT_NE(logits_of(model, "float32"), bf16) << "bfloat16 must not silently be float32";
  EXPECT_EQ(cli("run --model " + model + " 3,4,5 --ids --dtype int4 --save logits --out " + out.string()), 2);
  ASSERT_EQ(cli("run --model " + model + " 3,4,5 --ids --dtype int8 --save logits --out " + out.string()), 0);
  const std::vector<float> q8 = logits_of(model, "int8");
  EXPECT_EQ(io::SafetensorsFile(out).get_f32("logits").to_vector(), q8);
  EXPECT_NE(q8, bf16);
  // mixlens convert: bfloat16 by default; float32 is not a conversion (usage error, nothing written).
  const fs::path conv = dir / "bf16";
  ASSERT_EQ(cli("convert --model " + model + " --out " + conv.string()), 0);
  EXPECT_EQ(logits_of(conv.string(), "auto"), bf16);
  EXPECT_EQ(cli("convert --model " + model + " --dtype float32 --out " + (dir / "f32").string()), 2);
  EXPECT_FALSE(fs::exists(dir / "f32"));
  EXPECT_EQ(cli("convert --model " + model + " --out " + conv.string()), 1) << "a non-empty --out is refused";
  fs::remove_all(dir);
}

// A finite row whose mean of squares overflows float32 would normalise to zeros (transformers does the
// same in float32): the norms give NaN there instead, for FiniteWatch to raise on; 1e18 still works.
TEST(Kernels, NormsOfARowWhoseSquaresOverflowAreNaN) {
  const int64_t dim = 8;
  std::vector<float> w(dim, 1.0f), b(dim, 0.0f), y(dim);
  std::vector<float> huge(dim, 3e38f), big(dim, 1e18f);
  huge[3] = -1.0f;
  for (bool zc : {false, true}) {
    ops::rmsnorm(huge.data(), w.data(), y.data(), 1, dim, 1e-6f, zc);
    for (float v : y) EXPECT_TRUE(std::isnan(v));
    ops::rmsnorm(big.data(), w.data(), y.data(), 1, dim, 1e-6f, zc);
    for (float v : y) EXPECT_NEAR(v, zc ? 2.0f : 1.0f, 1e-6f);
  }
  ops::layernorm(huge.data(), w.data(), b.data(), y.data(), 1, dim, 1e-5f);
  for (float v : y) EXPECT_TRUE(std::isnan(v));
}
