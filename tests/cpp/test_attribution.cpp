// Issue 26 items 2 and 3 (mixlens/attribution.h) through the C++ API alone, on the shipped Mamba-2 and
// Qwen3.5 hybrid: the decomposition sums to the residual the forward saved, frozen-norm DLA sums to the
// logit difference, the logit lens of the last accumulated piece is the logits, and AtP's bookkeeping
// (shapes, ranking, states after the metric's position, errors). tests/python/test_attribution.py
// compares the numbers with transformers and with real activation patching.
#include <gtest/gtest.h>

#include <cmath>

#include "fixture_util.h"
#include "mixlens/attribution.h"
#include "mixlens/errors.h"

using namespace mixlens;
using namespace mixlens::test;

namespace {

const std::vector<std::vector<int32_t>> kRows = {{5, 9, 2, 7, 11, 3}, {3, 1, 8}};

void expect_decomposition_sums(const std::string& model_dir) {
  Model m = Model::load((source_dir() / model_dir).string());
  const int L = m.info().num_layers;
  const Batch batch = Batch::left_padded(kRows, m.pad_token_id());
  const ResidStack st = decompose_resid(m, batch, {2, -1});
  Trace t;
  t.save("layers." + std::to_string(L - 1) + ".layer_output");
  const Tensor logits = m.run(batch, &t);
  const Tensor h = t.get("layers." + std::to_string(L - 1) + ".layer_output");
  const int64_t C = st.components.size(0), B = 2, P = 2, D = m.info().hidden_size, V = m.info().vocab_size, T = 6;
  ASSERT_EQ(st.components.shape(), (Shape{C, B, P, D}));
  ASSERT_EQ(st.labels.size(), static_cast<size_t>(C));
  EXPECT_EQ(st.labels[0], "embed");
  EXPECT_EQ(st.positions, (std::vector<int64_t>{2, 5}));
  EXPECT_LT(st.max_rel_error, 1e-5);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t p = 0; p < P; ++p)
      for (int64_t d = 0; d < D; ++d) {
        double sum = 0;
        for (int64_t c = 0; c < C; ++c) sum += st.components[((c * B + b) * P + p) * D + d];
        EXPECT_NEAR(sum, h[(b * T + st.positions[static_cast<size_t>(p)]) * D + d], 1e-4);
      }
  const Tensor attrs = logit_attrs(m, st, {4, 6}, {1, 2});
  ASSERT_EQ(attrs.shape(), (Shape{C, B, P}));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t p = 0; p < P; ++p) {
      double sum = 0;
      for (int64_t c = 0; c < C; ++c) sum += attrs[(c * B + b) * P + p];
      const int64_t o = (b * T + st.positions[static_cast<size_t>(p)]) * V;
      const double want = logits[o + (b == 0 ? 4 : 6)] - logits[o + (b == 0 ? 1 : 2)];
      EXPECT_NEAR(sum, want, 1e-4 * std::max(1.0, std::fabs(want)));
    }
  const ResidStack acc = accumulated_resid(m, batch, {-1});
  ASSERT_EQ(acc.components.size(0), L + 1);
  const Tensor lens = logit_attrs(m, acc, {4}, {}, LnMode::exact);
  for (int64_t b = 0; b < B; ++b) EXPECT_NEAR(lens[(L * B + b) * 1], logits[(b * T + T - 1) * V + 4], 1e-4);
  EXPECT_THROW(logit_attrs(m, st, {static_cast<int32_t>(V)}), InputError);
  EXPECT_THROW(logit_attrs(m, st, {1, 2, 3}), InputError);
  EXPECT_THROW(decompose_resid(m, batch, {6}), InputError);
}

}  // namespace

TEST(Attribution, DecompositionSumsOnMamba2) { expect_decomposition_sums("models/mamba2-tinystories"); }
TEST(Attribution, DecompositionSumsOnQwen35Hybrid) { expect_decomposition_sums("models/qwen3_5-tinystories"); }

TEST(Attribution, AtpShapesRankingAndErrors) {
  Model m = Model::load((source_dir() / "models/mamba2-tinystories").string());
  const int L = m.info().num_layers;
  const Batch clean = Batch::left_padded({{5, 9, 2, 7, 11, 3}}, 0), corrupt = Batch::left_padded({{5, 9, 8, 7, 11, 3}}, 0);
  const LogitsMetric metric = [](const Tensor& logits) { return metrics::logit_diff(logits, 4, 1); };
  AtpOptions o;
  o.nodes = {"layer_output", "linear_attn.state"};
  const AtpResult r = attribution_patching(m, clean, corrupt, metric, o);
  ASSERT_EQ(r.nodes.size(), static_cast<size_t>(2 * L));
  ASSERT_EQ(r.estimates.shape(), (Shape{2 * L, 1, 6}));
  EXPECT_EQ(r.nodes[0], "layers.0.layer_output");
  EXPECT_EQ(r.nodes[1], "layers.0.linear_attn.state");
  // Before the changed token nothing differs; the state after the metric's position changes nothing it reads.
  for (int64_t n = 0; n < 2 * L; ++n) {
    EXPECT_EQ(r.estimates[n * 6 + 0], 0.0f);
    EXPECT_EQ(r.estimates[n * 6 + 1], 0.0f);
    if (n % 2 == 1) {
      EXPECT_EQ(r.estimates[n * 6 + 5], 0.0f);
    }
  }
  const auto rows = r.ranked();
  ASSERT_EQ(rows.size(), static_cast<size_t>(2 * L * 6));
  for (size_t k = 1; k < rows.size(); ++k) EXPECT_GE(std::fabs(rows[k - 1].estimate), std::fabs(rows[k].estimate));
  EXPECT_NE(rows[0].estimate, 0.0);
  AtpOptions bad;
  bad.nodes = {"resid_mid"};
  EXPECT_THROW(attribution_patching(m, clean, corrupt, metric, bad), InputError);
  EXPECT_THROW(attribution_patching(m, clean, Batch::left_padded({{5, 9}}, 0), metric), InputError);
}
