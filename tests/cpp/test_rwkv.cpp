// RWKV-4 against the golden fixtures of scripts/make_fixtures.py --family rwkv (transformers 5.18
// RwkvForCausalLM in eval mode: every value of a prompt and 7 decode steps, greedy tokens, edits), the
// state invariants, per-token state reads / writes against the WKV recurrence run explicitly, left padding
// against per-row runs (transformers ignores attention_mask for RWKV), and the max-shifted accumulators on
// a 4,096-token prompt against a float64 reference where the naive form overflows.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "fixture_util.h"
#include "mixers/rwkv_mixer.h"
#include "mixlens/errors.h"
#include "mixlens/trace.h"
#include "recurrent_checks.h"

using namespace mixlens;
using namespace mixlens::test;

namespace {

class RwkvFixture : public ::testing::TestWithParam<std::string> {
 protected:
  GoldenCase make() const { return GoldenCase("rwkv", GetParam()); }
};

TEST_P(RwkvFixture, EveryValueEveryStepMatchesTransformers) {
  GoldenCase c = make();
  Trace t;
  save_all_values(c.model, t);
  run_recorded_steps(c, &t);
  expect_values_match(c, t, c.name);
  for (size_t s = 0; s < t.calls().size(); ++s) EXPECT_EQ(t.calls()[s].kernel, "recurrent");
  EXPECT_FALSE(t.has("layers.0.linear_attn.state_input", 0)) << "state_input is None on a fresh prompt";
  const MixerIdentity id = mixer_identity(c.model, 0, 8);
  EXPECT_EQ(id.kind, "wkv");
  EXPECT_EQ(id.state_op, "rwkv_linear_attention");
  EXPECT_EQ(id.prompt_kernel, "recurrent");
}

TEST_P(RwkvFixture, GreedyTokensMatch) {
  GoldenCase c = make();
  GenerateOptions o;
  o.max_new_tokens = c.n_steps;
  o.eos_token_id = -1;
  auto res = c.model.generate(c.prompts, o);
  ASSERT_EQ(res.new_tokens.size(), c.tokens.size());
  for (size_t r = 0; r < c.tokens.size(); ++r) EXPECT_EQ(res.new_tokens[r], c.tokens[r]) << "row " << r;
}

TEST_P(RwkvFixture, EditsMatchTransformersWithTheSameModification) {
  GoldenCase c = make();
  EXPECT_GT(expect_edits_match(c), 0);
}

TEST_P(RwkvFixture, StatesEndInStateOutputWhichTheNextStepStartsFrom) { expect_state_invariants(make(), 0.0); }

INSTANTIATE_TEST_SUITE_P(Fixtures, RwkvFixture, ::testing::ValuesIn(fixture_cases("rwkv")));

TEST(Rwkv, PrefixThenContinuationEqualsWholePrompt) {
  GoldenCase c("rwkv", "basic");
  expect_continuation_equals_whole(c.model, c.prompts[0], {1, 5, c.prompts[0].size() - 1});
}

// transformers ignores attention_mask on RWKV; mixlens scans a row from its first real token with both
// token shifts starting from the cached (zero) last x, so a padded row is its own run on its real tokens.
TEST(Rwkv, LeftPaddedRowsEqualTheirOwnRuns) {
  GoldenCase c("rwkv", "basic");
  const std::vector<int32_t> a = c.prompts[0], b(a.begin() + 7, a.end());
  Trace batched;
  batched.save("logits").save("layers.*.linear_attn.state_output").save("layers.*.mlp.output");
  c.model.run({a, b}, &batched);
  Trace single;
  single.save("logits").save("layers.*.linear_attn.state_output").save("layers.*.mlp.output");
  c.model.run({b}, &single);
  const int64_t T = static_cast<int64_t>(a.size()), n = static_cast<int64_t>(b.size());
  for (const std::string p : {"logits", "layers.2.mlp.output"}) {
    const Tensor& full = batched.get(p);
    const int64_t W = full.size(2);
    Tensor row({1, n, W});
    std::memcpy(row.data(), full.data() + (T + T - n) * W, sizeof(float) * static_cast<size_t>(n * W));
    EXPECT_LE(rel_rms(row, single.get(p)), 1e-5) << p;
  }
  for (int l = 0; l < 3; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".linear_attn.state_output";
    const Tensor& so = batched.get(p);
    const int64_t per = so.size(1);
    Tensor row({1, per});
    std::memcpy(row.data(), so.data() + per, sizeof(float) * static_cast<size_t>(per));
    EXPECT_LE(rel_rms(row, single.get(p)), 1e-5) << p;
  }
}

// state@t is states[:, t] bit for bit; a write of num | den | max at t continues, for the tokens after t,
// as the WKV recurrence run explicitly from the written state over the same keys, values and decays.
TEST(Rwkv, PerTokenStateReadsAndWritesFollowTheRecurrence) {
  GoldenCase c("rwkv", "basic");
  const std::string p = "layers.1.linear_attn.";
  const int64_t t0 = 5;
  Trace base;
  base.save(p + "states").save(p + "state@t5").save(p + "attention_keys").save(p + "attention_values")
      .save(p + "decays");
  c.model.run(c.prompts, &base);
  const Tensor& st = base.get(p + "states");
  const int64_t T = st.size(1), n = st.size(2), A = base.get(p + "attention_keys").size(2);
  EXPECT_EQ(0, std::memcmp(base.get(p + "state@t5").data(), st.data() + t0 * n, sizeof(float) * static_cast<size_t>(n)));

  Tensor written({1, n});
  std::memcpy(written.data(), st.data() + t0 * n, sizeof(float) * static_cast<size_t>(n));
  for (int64_t a = 0; a < A; ++a) written[a] = written[a] * 3.0f + 0.5f;  // num
  Trace edited;
  edited.set(p + "state@t5", written).save(p + "states").save(p + "attention_head_outputs");
  c.model.run(c.prompts, &edited);
  // The recurrence from the written state over tokens t0+1.. (time_first read back from the fixture).
  io::SafetensorsFile model(c.dir / "model.safetensors");
  const Tensor u = model.get_f32("rwkv.blocks.1.attention.time_first");
  std::vector<float> s(written.data(), written.data() + 3 * A), y(static_cast<size_t>((T - t0 - 1) * A));
  const int64_t o = (t0 + 1) * A;
  detail::wkv_recurrent(T - t0 - 1, A, base.get(p + "attention_keys").data() + o,
                        base.get(p + "attention_values").data() + o, base.get(p + "decays").data() + o, u.data(),
                        s.data(), y.data());
  const Tensor& yo = edited.get(p + "attention_head_outputs");
  for (int64_t i = 0; i < (T - t0 - 1) * A; ++i) EXPECT_EQ(yo[o + i], y[static_cast<size_t>(i)]) << i;
  const Tensor& se = edited.get(p + "states");
  for (int64_t i = 0; i < 3 * A; ++i) EXPECT_EQ(se[(T - 1) * n + i], s[static_cast<size_t>(i)]) << i;
  // The token-shift parts are the tokens' own normed inputs inside a call: a write there is refused.
  written[3 * A] += 1.0f;
  Trace shift;
  shift.set(p + "state@t5", written);
  EXPECT_THROW(c.model.run(c.prompts, &shift), WriteError);
  // den is a sum of positive weights: a negative one is refused on each route a state is written by.
  written[3 * A] -= 1.0f;
  written[A + 2] = -0.5f;
  for (const std::string& site : {p + "state@t5", p + "state_output"}) {
    Trace neg;
    neg.set(site, written);
    try {
      c.model.run(c.prompts, &neg);
      ADD_FAILURE() << site << ": a negative den was accepted";
    } catch (const WriteError& e) {
      EXPECT_NE(std::string(e.what()).find("den (entries A..2A-1 of the state row) must be >= 0"), std::string::npos)
          << e.what();
    }
  }
  written[A + 2] = 0.0f;  // a zero den (a fresh state's) is a valid state
  Trace zero;
  zero.set(p + "state@t5", written);
  EXPECT_NO_THROW(c.model.run(c.prompts, &zero));
}

TEST(Rwkv, RefusesTheChunkedRouteAndServesNoBetas) {
  GoldenCase c("rwkv", "short_prompt");
  EXPECT_THROW(route_kernels("rwkv", "chunked"), UnsupportedError);  // refused, not set
  EXPECT_EQ(kernel_route("rwkv"), KernelRoute::default_route);
  EXPECT_NE(c.model.support().at("linear_attn.betas").at(0), "");
  EXPECT_EQ(c.model.support().at("mlp.output").at(0), "");
}

// issue 25: 4,096 tokens whose keys (60..90) overflow exp() in float32. The max-shifted (num, den, max)
// stays finite and its reads match the float64 sums; the naive float32 sums overflow.
TEST(RwkvWkv, MaxShiftedAccumulatorsStayFiniteOnALongPrompt) {
  const int64_t T = 4096, A = 4;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> kd(60.0f, 90.0f), vd(-1.0f, 1.0f);
  std::vector<float> k(T * A), v(T * A), w(T * A), u{0.5f, -1.0f, 0.0f, 2.0f}, y(T * A);
  const float decay[A] = {-1e-4f, -0.01f, -0.5f, -5.0f};
  for (int64_t i = 0; i < T * A; ++i) k[i] = kd(rng), v[i] = vd(rng), w[i] = decay[i % A];
  std::vector<float> st(3 * A, 0.0f);
  for (int64_t a = 0; a < A; ++a) st[2 * A + a] = detail::kRwkvFreshMax;
  detail::wkv_recurrent(T, A, k.data(), v.data(), w.data(), u.data(), st.data(), y.data());
  bool naive_overflow = false;
  double worst = 0;
  for (int64_t a = 0; a < A; ++a) {
    // float64 reference: the sums scaled by exp(-m), m the running max of the exponents (no overflow in double).
    double num = 0, den = 0, m = -1e300;
    float nnum = 0, nden = 0;  // the naive float32 form
    for (int64_t t = 0; t < T; ++t) {
      const double kk = k[t * A + a], vv = v[t * A + a], ku = kk + u[a];
      const double mo = std::max(m, ku);
      const double ref = (std::exp(m - mo) * num + std::exp(ku - mo) * vv) / (std::exp(m - mo) * den + std::exp(ku - mo));
      EXPECT_TRUE(std::isfinite(y[t * A + a]));
      worst = std::max(worst, std::fabs(y[t * A + a] - ref));
      const double md = m + w[t * A + a], ms = std::max(md, kk);
      num = std::exp(md - ms) * num + std::exp(kk - ms) * vv;
      den = std::exp(md - ms) * den + std::exp(kk - ms);
      m = ms;
      nnum = std::exp(w[t * A + a]) * nnum + std::exp(k[t * A + a]) * v[t * A + a];
      nden = std::exp(w[t * A + a]) * nden + std::exp(k[t * A + a]);
      naive_overflow = naive_overflow || !std::isfinite(nnum / nden);
    }
    EXPECT_TRUE(std::isfinite(st[a]) && std::isfinite(st[A + a]) && std::isfinite(st[2 * A + a]));
  }
  EXPECT_TRUE(naive_overflow) << "the keys should overflow the naive float32 sums";
  // float32 sums of up to 4,096 slowly decaying terms round by up to ~n * 6e-8 = 2.5e-4 of the average's range.
  EXPECT_LE(worst, 1e-3);
}

}  // namespace

// A constant 3e38 written into the residual stream: LayerNorm of a constant row is its bias, and
// 3e38 + x rounds back to 3e38, so no value ever turns non-finite and the logits came out finite and
// the same for every prompt. The watch treats |x| >= 2^64 as out of range and raises, naming the value.
TEST(Rwkv, HugeFiniteResidualWriteRaisesNumericError) {
  GoldenCase c("rwkv", "basic");
  Trace t;
  t.set("layers.1.layer_input", Tensor({1, static_cast<int64_t>(c.prompts[0].size()), c.model.info().hidden_size}, 3e38f));
  try {
    c.model.run({c.prompts[0]}, &t);
    ADD_FAILURE() << "a 3e38 residual was accepted";
  } catch (const NumericError& e) {
    EXPECT_NE(std::string(e.what()).find("the first non-finite value was layers.1.layer_output = 1.5e+38 at [0, 0, 0] "
                                         "(finite, but |x| >= 2^64"), std::string::npos) << e.what();  // halved: rescale
  }
  Trace ok;
  ok.set("layers.1.layer_input", Tensor({1, static_cast<int64_t>(c.prompts[0].size()), c.model.info().hidden_size}, 1e6f));
  EXPECT_NO_THROW(c.model.run({c.prompts[0]}, &ok));
}
