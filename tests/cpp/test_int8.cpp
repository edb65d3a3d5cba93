// int8 weights (issue 27 item 2): the block quantizer and every ISA level's int8 kernels against
// float64 references, batch invariance of the int8 gemm, ops::linear on each path, and whole models
// loaded with dtype "int8" against a float32 load of the same dequantized weights.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "fixture_util.h"
#include "io/safetensors.h"
#include "io/weights.h"
#include "kernel_test_util.h"
#include "mixlens/errors.h"
#include "mixlens/model.h"
#include "mixlens/tools.h"
#include "mixlens/trace.h"
#include "ops/dtype.h"
#include "ops/kernels.h"
#include "ops/ops.h"

namespace fs = std::filesystem;
using namespace mixlens;
using namespace mixlens::test_util;

namespace {

float scale_of(const uint8_t* row, int64_t block) {
  float s;
  std::memcpy(&s, row + block * ops::kQ8BlockBytes, 4);
  return s;
}
int q_of(const uint8_t* row, int64_t k) {
  return reinterpret_cast<const int8_t*>(row + k / ops::kQ8Block * ops::kQ8BlockBytes + 4)[k % ops::kQ8Block];
}

// Rows of `in` weights quantized one by one (the layout ops::linear reads).
std::vector<uint8_t> quantize(const std::vector<float>& w, int64_t rows, int64_t in) {
  std::vector<uint8_t> q(static_cast<size_t>(rows * ops::q8_row_bytes(in)));
  for (int64_t r = 0; r < rows; ++r) ops::quantize_q8_row(w.data() + r * in, in, q.data() + r * ops::q8_row_bytes(in));
  return q;
}

}  // namespace

// s = max|w| / 127 per block, |w - q s| <= s / 2 (nearest), |q| <= 127, padding and zero blocks 0.
TEST(Int8, QuantizerIsNearestWithMaxAbsScale) {
  for (int64_t in : {1, 5, 31, 32, 33, 64, 100, 257}) {
    std::vector<float> w = randn(static_cast<size_t>(in), 11u + static_cast<uint32_t>(in), 0.3f);
    if (in >= 64)
      for (int64_t k = 32; k < 64; ++k) w[static_cast<size_t>(k)] = 0.0f;  // a block of zeros
    std::vector<uint8_t> row(static_cast<size_t>(ops::q8_row_bytes(in)), 0xAB);
    ops::quantize_q8_row(w.data(), in, row.data());
    for (int64_t b = 0; b * ops::kQ8Block < in; ++b) {
      double amax = 0;
      for (int64_t k = b * ops::kQ8Block; k < std::min(in, (b + 1) * ops::kQ8Block); ++k)
        amax = std::max(amax, std::fabs(double(w[static_cast<size_t>(k)])));
      const float s = scale_of(row.data(), b);
      EXPECT_EQ(s, static_cast<float>(amax) / 127.0f) << "in " << in << " block " << b;
      for (int64_t k = b * ops::kQ8Block; k < (b + 1) * ops::kQ8Block; ++k) {
        const int q = q_of(row.data(), k);
        ASSERT_LE(std::abs(q), 127);
        if (k >= in || s == 0.0f) {
          ASSERT_EQ(q, 0) << "padding / zero block, in " << in << " k " << k;
          continue;
        }
        const double err = std::fabs(double(w[static_cast<size_t>(k)]) - double(q) * s);
        ASSERT_LE(err, 0.5 * s * (1 + 1e-6)) << "in " << in << " k " << k;
      }
    }
    // The block holding the largest weight reaches +-127.
    const auto big = std::max_element(w.begin(), w.end(), [](float a, float b) { return std::fabs(a) < std::fabs(b); });
    EXPECT_EQ(std::abs(q_of(row.data(), big - w.begin())), 127);
  }
}

// s = 127 / 127 = 1 exactly, so w / s lands on halves: they round to the even neighbour.
TEST(Int8, QuantizerRoundsTiesToEven) {
  const std::vector<float> w = {127.0f, 0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -2.5f, 126.5f, 3.4999998f, -0.0f};
  const std::vector<int> want = {127, 0, 2, 2, 0, -2, -2, 126, 3, 0};
  std::vector<uint8_t> row(static_cast<size_t>(ops::q8_row_bytes(static_cast<int64_t>(w.size()))));
  ops::quantize_q8_row(w.data(), static_cast<int64_t>(w.size()), row.data());
  EXPECT_EQ(scale_of(row.data(), 0), 1.0f);
  for (size_t k = 0; k < w.size(); ++k) EXPECT_EQ(q_of(row.data(), static_cast<int64_t>(k)), want[k]) << "w " << w[k];
}

// x as the int8 kernels round it (KernelTable::matvec_q8), computed here from the definition.
std::vector<double> rounded_x16(const std::vector<float>& x) {
  std::vector<double> r(x.size());
  for (size_t b0 = 0; b0 < x.size(); b0 += ops::kQ8Block) {
    const size_t b1 = std::min(x.size(), b0 + ops::kQ8Block);
    double m = 0;
    for (size_t k = b0; k < b1; ++k) m = std::max(m, std::fabs(double(x[k])));
    const float s = static_cast<float>(m / 32767.0);
    for (size_t k = b0; k < b1; ++k) r[k] = m == 0 ? 0.0 : std::nearbyint(double(x[k]) * 32767.0 / m) * double(s);
  }
  return r;
}

TEST(Int8, RoundX16FollowsItsDefinition) {
  const int64_t in = 77;  // two whole blocks and a partial one
  std::vector<float> x = randn(static_cast<size_t>(2 * in), 31);
  for (int64_t k = 32; k < 64; ++k) x[static_cast<size_t>(k)] = 0.0f;  // row 0's block 1: all zero
  x[static_cast<size_t>(in + 70)] = std::nanf("");                   // row 1's last block holds a NaN
  const ops::RoundedX16 rounded(x.data(), in, 2, in);
  const ops::X16& q = rounded.view();
  ASSERT_EQ(q.nb, 3);
  for (int64_t r = 0; r < 2; ++r)
    for (int64_t b = 0; b < 3; ++b) {
      const float s = q.s[r * q.nb + b];
      if (r == 1 && b == 2) {
        EXPECT_TRUE(std::isnan(s));
        continue;
      }
      double m = 0;
      for (int64_t k = b * 32; k < std::min(in, b * 32 + 32); ++k) m = std::max(m, std::fabs(double(x[static_cast<size_t>(r * in + k)])));
      EXPECT_EQ(s, static_cast<float>(m / 32767.0)) << r << " " << b;
      int peak = 0;
      for (int64_t k = b * 32; k < b * 32 + 32; ++k) {
        const int v = q.q[r * q.nb * 32 + k];
        peak = std::max(peak, std::abs(v));
        if (k >= in || m == 0) {
          ASSERT_EQ(v, 0) << "padding / zero block";
          continue;
        }
        ASSERT_LE(std::fabs(double(v) * m / 32767.0 - double(x[static_cast<size_t>(r * in + k)])), 0.5 * m / 32767.0 * (1 + 1e-9));
      }
      EXPECT_EQ(peak, m == 0 ? 0 : 32767) << "the block's largest magnitude maps to 32767";
    }
}

// Every level computes the int8 products bitwise the same (integer block sums, one lane order), a
// NaN in x reaches every output, and a NaN-free zero block adds nothing.
TEST(Int8, EveryLevelBitwiseTheSame) {
  // Odd and even block counts (the AVX-512 level sums blocks in pairs), odd and even row counts (rows
  // run in pairs far apart).
  for (const auto& [rows, width] : {std::pair<int64_t, int64_t>{23, 203}, {2, 256}, {6, 31}, {1, 1000}}) {
    const int64_t ldw = ops::q8_row_bytes(width);
    const std::vector<uint8_t> qw = quantize(randn(static_cast<size_t>(rows * width), 14), rows, width);
    const std::vector<float> xw = randn(static_cast<size_t>(width), 15);
    std::vector<float> first;
    for (ops::Isa isa : levels()) {
      std::vector<float> y(static_cast<size_t>(rows));
      ops::kernels_for(isa)->matvec_q8(qw.data(), ldw, ops::RoundedX16(xw.data(), width, 1, width).view(), y.data(), rows);
      if (first.empty()) first = y;
      for (int64_t o = 0; o < rows; ++o)
        ASSERT_EQ(y[static_cast<size_t>(o)], first[static_cast<size_t>(o)]) << ops::isa_name(isa) << " " << width << " " << o;
    }
  }
  const int64_t n = 23, in = 203, ld = ops::q8_row_bytes(in);
  const std::vector<uint8_t> q = quantize(randn(static_cast<size_t>(n * in), 12), n, in);
  std::vector<float> x = randn(static_cast<size_t>(in), 13);
  x[200] = std::numeric_limits<float>::infinity();
  for (ops::Isa isa : levels()) {
    std::vector<float> y(static_cast<size_t>(n));
    ops::kernels_for(isa)->matvec_q8(q.data(), ld, ops::RoundedX16(x.data(), in, 1, in).view(), y.data(), n);
    for (float v : y) ASSERT_TRUE(std::isnan(v)) << ops::isa_name(isa);
  }
}

// A row of tiny activations rounds as the same row scaled up by a power of two (its block scales
// would otherwise be subnormal floats and lose the rounding's precision): x * 2^-120, with x on a grid
// that keeps every bit, gives y * 2^-120 exactly at every level.
TEST(Int8, TinyActivationsRoundAsTheirScaledUpRow) {
  const int64_t n = 9, in = 100, ld = ops::q8_row_bytes(in);
  const std::vector<uint8_t> q = quantize(randn(static_cast<size_t>(n * in), 41), n, in);
  std::vector<float> x = randn(static_cast<size_t>(in), 42), tiny(x.size());
  for (size_t k = 0; k < x.size(); ++k) {
    x[k] = std::ldexp(std::nearbyint(std::ldexp(x[k], 20)), -20);
    tiny[k] = std::ldexp(x[k], -120);
  }
  for (ops::Isa isa : levels()) {
    std::vector<float> y(static_cast<size_t>(n)), yt(y.size());
    ops::kernels_for(isa)->matvec_q8(q.data(), ld, ops::RoundedX16(x.data(), in, 1, in).view(), y.data(), n);
    ops::kernels_for(isa)->matvec_q8(q.data(), ld, ops::RoundedX16(tiny.data(), in, 1, in).view(), yt.data(), n);
    for (int64_t o = 0; o < n; ++o)
      ASSERT_EQ(yt[static_cast<size_t>(o)], std::ldexp(y[static_cast<size_t>(o)], -120)) << ops::isa_name(isa) << " " << o;
  }
}

TEST(Int8, MatvecEveryLevelMatchesDouble) {
  for (ops::Isa isa : levels()) {
    const ops::KernelTable& kt = *ops::kernels_for(isa);
    for (int64_t n : {1, 3, 5, 17})
      for (int64_t in : {1, 7, 31, 32, 33, 64, 100, 773}) {
        const std::vector<float> w = randn(static_cast<size_t>(n * in), 7u + static_cast<uint32_t>(n * 1000 + in));
        const std::vector<float> x = randn(static_cast<size_t>(in), 99u + static_cast<uint32_t>(in));
        const std::vector<uint8_t> q = quantize(w, n, in);
        const int64_t ld = ops::q8_row_bytes(in);
        std::vector<float> y(static_cast<size_t>(n) + 1, 12345.0f);
        kt.matvec_q8(q.data(), ld, ops::RoundedX16(x.data(), in, 1, in).view(), y.data(), n);
        std::vector<float> deq(static_cast<size_t>(n * in));
        kt.widen_q8(q.data(), ld, deq.data(), n, in);
        const std::vector<double> xr = rounded_x16(x);
        for (int64_t o = 0; o < n; ++o) {
          double ref = 0, mag = 0;
          for (int64_t k = 0; k < in; ++k) {
            const double wk = double(q_of(q.data() + o * ld, k)) * double(scale_of(q.data() + o * ld, k / ops::kQ8Block));
            ASSERT_EQ(deq[static_cast<size_t>(o * in + k)], static_cast<float>(wk)) << ops::isa_name(isa) << " widen";
            ref += wk * xr[static_cast<size_t>(k)];
            mag += std::fabs(wk * xr[static_cast<size_t>(k)]);
          }
          ASSERT_NEAR(y[static_cast<size_t>(o)], ref, 1e-6 + 6e-8 * double(in) * mag)
              << ops::isa_name(isa) << " n=" << n << " in=" << in << " row " << o;
        }
        ASSERT_EQ(y[static_cast<size_t>(n)], 12345.0f) << "wrote past the end";
      }
  }
}

// gemm_q8 sums every element in matvec_q8's order: bitwise the same at any row count and position.
TEST(Int8, GemmIsBitwiseTheMatvecAtEveryRowCount) {
  for (ops::Isa isa : levels()) {
    const ops::KernelTable& kt = *ops::kernels_for(isa);
    const int64_t n = 70, in = 161, ld = ops::q8_row_bytes(in);
    const std::vector<uint8_t> q = quantize(randn(static_cast<size_t>(n * in), 5), n, in);
    const std::vector<float> X = randn(static_cast<size_t>(8 * in), 6);
    std::vector<float> ref(static_cast<size_t>(8 * n));
    for (int64_t r = 0; r < 8; ++r) kt.matvec_q8(q.data(), ld, ops::RoundedX16(X.data() + r * in, in, 1, in).view(), ref.data() + r * n, n);
    for (int64_t rows = 1; rows <= 8; ++rows) {
      std::vector<float> Y(static_cast<size_t>(rows * n));
      kt.gemm_q8(q.data(), ld, ops::RoundedX16(X.data() + (8 - rows) * in, in, rows, in).view(), rows, Y.data(), n, n);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t o = 0; o < n; ++o)
          ASSERT_EQ(Y[static_cast<size_t>(r * n + o)], ref[static_cast<size_t>((8 - rows + r) * n + o)])
              << ops::isa_name(isa) << " rows " << rows;
    }
  }
}

// ops::linear with an int8 tensor equals ops::linear with its dequantized float32 weights on the
// matvec (1-4 rows), the invariant gemm and the widen + sgemm (prompt) paths, at every level.
TEST(Int8, LinearEqualsDequantizedOnEveryPath) {
  IsaGuard guard;
  for (ops::Isa isa : levels()) {
    ops::set_isa(isa);
    for (bool det : {false, true})
      for (int64_t rows : {1, 3, 37, 520})
        for (auto [out, in] : {std::pair<int64_t, int64_t>{1, 5}, {300, 129}, {1029, 257}}) {
          ops::DeterministicScope scope(det);
          const std::vector<float> w = randn(static_cast<size_t>(out * in), 3);
          const std::vector<float> x = randn(static_cast<size_t>(rows * in), 4);
          const std::vector<uint8_t> q = quantize(w, out, in);
          const Tensor Wq = Tensor::narrow({out, in}, ScalarType::int8, q.data(), unowned(q.data()));
          ASSERT_EQ(Wq.nbytes(), static_cast<int64_t>(q.size()));
          const Tensor Wf = Wq.to_f32();
          std::vector<float> y1(static_cast<size_t>(rows * out)), y2(y1.size()), bias(static_cast<size_t>(out), 0.5f);
          ops::linear(x.data(), rows, in, Wq, y1.data(), bias.data());
          ops::linear(x.data(), rows, in, Wf, y2.data(), bias.data());
          // Plus what rounding x to int16 per block may move (the matvec and invariant gemm paths).
          std::vector<double> xmax(static_cast<size_t>(rows * in));
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t b0 = 0; b0 < in; b0 += ops::kQ8Block) {
              double m = 0;
              for (int64_t k = b0; k < std::min(in, b0 + ops::kQ8Block); ++k) m = std::max(m, std::fabs(double(x[static_cast<size_t>(r * in + k)])));
              for (int64_t k = b0; k < std::min(in, b0 + ops::kQ8Block); ++k) xmax[static_cast<size_t>(r * in + k)] = m;
            }
          for (size_t i = 0; i < y1.size(); ++i) {
            const int64_t r = static_cast<int64_t>(i) / out, o = static_cast<int64_t>(i) % out;
            double xr = 0;
            for (int64_t k = 0; k < in; ++k) xr += std::fabs(double(Wf.data()[o * in + k])) * xmax[static_cast<size_t>(r * in + k)] / 65534.0;
            ASSERT_NEAR(y1[i], y2[i], 2e-5 * (1.0 + std::fabs(y2[i])) + 2e-6 * std::sqrt(double(in)) + xr)
                << ops::isa_name(isa) << (det ? " deterministic" : "") << " rows " << rows << " [" << out << "," << in << "]";
          }
          // Row slices and row lookups keep whole blocks.
          std::vector<float> row(static_cast<size_t>(in));
          ops::copy_row(Wq, out - 1, row.data());
          ASSERT_TRUE(std::equal(row.begin(), row.end(), Wf.data() + (out - 1) * in));
          const Tensor last = detail::row_block(Wq, out - 1, {1, in});
          EXPECT_EQ(last.dtype(), ScalarType::int8);
          ASSERT_EQ(last.to_f32().to_vector(), row);
          EXPECT_EQ(Wq.clone().to_vector(), Wf.to_vector());
        }
  }
}

// ---- whole models -------------------------------------------------------------------------------

namespace {

// A copy of fixture `rel` whose matmul weights are replaced by their int8 dequantization q * s (or, with
// bf16_first, first rounded to bfloat16), stored as float32.
fs::path transformed_copy(const std::string& rel, bool to_int8, bool bf16_first) {
  return test::weight_transformed_copy(rel, std::string("int8") + (to_int8 ? "q" : "") + (bf16_first ? "b" : ""),
                                       [&](const Tensor& w) {
                                         Tensor v = w.clone();
                                         if (bf16_first)
                                           for (int64_t i = 0; i < v.numel(); ++i) v[i] = ops::bf16_to_f32(ops::f32_to_bf16(v[i]));
                                         if (!to_int8) return v;
                                         const int64_t in = v.shape().back(), rows = v.numel() / in;
                                         const std::vector<uint8_t> q = quantize(v.to_vector(), rows, in);
                                         return Tensor::narrow(v.shape(), ScalarType::int8, q.data(), unowned(q.data())).to_f32();
                                       });
}

std::vector<std::vector<int32_t>> prompts_for(const Model& m) {
  const int32_t V = static_cast<int32_t>(m.info().vocab_size);
  return {{1 % V, 5 % V, 9 % V, 2 % V, 7 % V, 3 % V, 11 % V}, {4 % V, 8 % V, 6 % V}};
}

}  // namespace

class Int8Model : public ::testing::TestWithParam<const char*> {};

// An int8 load is a float32 load of the dequantized weights but for summation order: logits, a
// per-token state and greedy decode agree; only matmul weights are int8; served weights are float32.
TEST_P(Int8Model, LoadEqualsFloat32LoadOfDequantizedWeights) {
  const std::string rel = GetParam();
  LoadOptions q8;
  q8.dtype = "int8";
  const Model m = Model::load(test::fixture(rel).string(), q8);
  EXPECT_EQ(m.info().dtype, "int8");
  EXPECT_EQ(m.info().weight_dtypes, std::vector<std::string>{"int8"});
  const fs::path deq = transformed_copy(rel, true, false);
  const Model ref = Model::load(deq.string());
  const auto prompts = prompts_for(ref);
  Trace ta, tb;
  for (Trace* t : {&ta, &tb}) t->save("logits");
  const Tensor a = m.run(prompts, &ta), b = ref.run(prompts, &tb);
  EXPECT_LT(test::rel_rms(a, b), 2e-5) << rel;
  GenerateOptions g;
  g.max_new_tokens = 6;
  g.eos_token_id = -1;
  EXPECT_EQ(m.generate(prompts, g).new_tokens, ref.generate(prompts, g).new_tokens) << rel;
  // Against float32 itself int8 moves the logits, by far less than they vary.
  const Tensor f = Model::load(test::fixture(rel).string()).run(prompts);
  const double drift = test::rel_rms(a, f);
  EXPECT_GT(drift, 0.0) << rel << ": int8 must not silently be float32";
  EXPECT_LT(drift, 5e-2) << rel;
  EXPECT_EQ(m.head_weight("lm_head").dtype(), ScalarType::float32);
  fs::remove_all(deq);
}

// Quantizing a bfloat16 checkpoint (read from the file a tile at a time) equals quantizing the same
// values stored as float32: bitwise.
TEST_P(Int8Model, FromBf16FolderEqualsFromFloat32) {
  const std::string rel = GetParam();
  std::string leaf = rel;
  std::replace(leaf.begin(), leaf.end(), '/', '_');
  const fs::path bf = fs::temp_directory_path() / ("mixlens_int8_bf16_" + leaf + "_" + std::to_string(::getpid()));
  fs::remove_all(bf);
  (void)convert_checkpoint(test::fixture(rel).string(), bf.string(), "bfloat16");
  const fs::path rounded = transformed_copy(rel, false, true);
  LoadOptions q8;
  q8.dtype = "int8";
  const Model a = Model::load(bf.string(), q8), b = Model::load(rounded.string(), q8);
  const auto prompts = prompts_for(a);
  EXPECT_EQ(a.run(prompts).to_vector(), b.run(prompts).to_vector()) << rel;
  fs::remove_all(bf);
  fs::remove_all(rounded);
}

INSTANTIATE_TEST_SUITE_P(Families, Int8Model,
                         ::testing::Values("mamba2/short_prompt", "mamba/short_prompt", "falcon_mamba/short_prompt",
                                           "qwen3_5/short_prompt", "qwen3_next/moe_hv_2hk", "bamba/padded_batch", "bamba/groups2_edits",
                                           "nemotron_h/moe_latent", "falcon_h1/norm_before_gate"),
                         [](const auto& p) {
                           std::string s = p.param;
                           std::replace(s.begin(), s.end(), '/', '_');
                           return s;
                         });

TEST(Int8Model, ConvertRefusesInt8WithTheReason) {
  try {
    (void)convert_checkpoint(test::fixture("mamba2/short_prompt").string(),
                             (fs::temp_directory_path() / "mixlens_int8_never").string(), "int8");
    FAIL() << "int8 convert accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("quantized at load"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(fs::temp_directory_path() / "mixlens_int8_never"));
}
