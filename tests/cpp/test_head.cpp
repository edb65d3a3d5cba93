// Issue 10: project_on_vocab (final norm + LM head on any hidden state), the head weights, and the
// attention probabilities of softmax-attention blocks, on the shipped Mamba-2 and Qwen3.5 hybrid.
// Invariants that need no Python: projecting the last block's output gives the model's logits;
// probabilities are a causal, normalised softmax over real keys, and asking for them changes nothing.
#include <gtest/gtest.h>

#include <cmath>

#include "fixture_util.h"
#include "mixlens/errors.h"
#include "mixlens/session.h"

using namespace mixlens;
using namespace mixlens::test;

namespace {

double head_max_diff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) m = std::max(m, static_cast<double>(std::fabs(a[i] - b[i])));
  return m;
}

void expect_projection_is_the_logits(const std::string& model_dir) {
  Model m = Model::load((source_dir() / model_dir).string());
  const int L = m.info().num_layers;
  Trace t;
  t.save("layers." + std::to_string(L - 1) + ".layer_output").save("logits");
  m.run({{5, 9, 2, 7}, {3, 1}}, &t);
  const Tensor h = t.get("layers." + std::to_string(L - 1) + ".layer_output");
  const Tensor logits = t.get("logits");
  EXPECT_LT(head_max_diff(m.project_on_vocab(h), logits), 1e-4) << model_dir;
  // Any leading shape: one row.
  const Tensor row = Tensor::from({m.info().hidden_size}, std::vector<float>(h.begin(), h.begin() + h.size(-1)));
  const Tensor one = m.project_on_vocab(row);
  ASSERT_EQ(one.shape(), Shape{m.info().vocab_size});
  for (int64_t v = 0; v < one.numel(); ++v) ASSERT_NEAR(one[v], logits[v], 1e-4);
  EXPECT_EQ(m.head_weight("lm_head").shape(), (Shape{m.info().vocab_size, m.info().hidden_size}));
  EXPECT_EQ(m.head_weight("ln_final").shape(), Shape{m.info().hidden_size});
  EXPECT_THROW(m.head_weight("wte"), InputError);
  EXPECT_THROW(m.project_on_vocab(Tensor({2, 3})), InputError);
  EXPECT_THROW(m.project_on_vocab(Tensor({1, m.info().hidden_size}, NAN)), InputError);
}

}  // namespace

TEST(Head, ProjectOnVocabOfTheLastBlockIsTheLogits) {
  expect_projection_is_the_logits("models/mamba2-tinystories");
  expect_projection_is_the_logits("models/qwen3_5-tinystories");  // (1 + w) RMSNorm
}

TEST(AttentionProbabilities, CausalNormalisedAndOnlyOnAttentionBlocks) {
  Model m = Model::load((source_dir() / "models/qwen3_5-tinystories").string());
  // Row 1 is left-padded by 3.
  Session s = Session::run(m, {{5, 9, 2, 7, 11}, {3, 1}});
  EXPECT_THROW(s.read(0, "layers.0.self_attn.attention_probabilities"), UnknownValueError);
  const Tensor p = s.read(0, "layers.2.self_attn.attention_probabilities");
  const int64_t B = 2, T = 5, H = p.size(1);
  ASSERT_EQ(p.shape(), (Shape{B, H, T, T}));
  EXPECT_THROW(s.write(0, "layers.2.self_attn.attention_probabilities", p), WriteError);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t q = 0; q < T; ++q) {
        const bool padded_query = b == 1 && q < 3;
        double sum = 0;
        for (int64_t k = 0; k < T; ++k) {
          const float w = p[((b * H + h) * T + q) * T + k];
          if (k > q || (b == 1 && k < 3)) {
            EXPECT_EQ(w, 0.0f) << "future or padded key";
          }
          sum += w;
        }
        EXPECT_NEAR(sum, padded_query ? 0.0 : 1.0, 1e-5);
      }
  // Values against transformers' eager weights: tests/python/test_hybrid_nnterp.py.
  const Tensor out = s.read(0, "layers.2.self_attn.attention_output");
  EXPECT_EQ(out.size(0), B);
  s.finish();
  // Not asked for: nothing is computed, the run is the same.
  Trace t;
  t.save("layers.2.self_attn.attention_output");
  m.run({{5, 9, 2, 7, 11}, {3, 1}}, &t);
  EXPECT_EQ(head_max_diff(t.get("layers.2.self_attn.attention_output"), out), 0.0);
}
