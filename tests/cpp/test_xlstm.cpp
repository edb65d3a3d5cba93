// xLSTM against the golden fixtures of scripts/make_fixtures.py --family xlstm (transformers 5.18
// xLSTMForCausalLM, pure torch, mode "inference": every value of a prompt and 7 decode steps, greedy tokens,
// edits), the state invariants, the chunked and recurrent kernels against each other, per-token state reads /
// writes against the mLSTM recurrence run explicitly, left padding against per-row runs (transformers takes no
// attention_mask for xLSTM), and the stabilised (C, n, m) on a 4,096-token prompt against a float64 reference
// where the naive exp form overflows.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "fixture_util.h"
#include "mixers/mlstm_mixer.h"
#include "mixlens/errors.h"
#include "mixlens/trace.h"
#include "recurrent_checks.h"

using namespace mixlens;
using namespace mixlens::test;

namespace {

class XlstmFixture : public ::testing::TestWithParam<std::string> {
 protected:
  GoldenCase make() const { return GoldenCase("xlstm", GetParam()); }
};

TEST_P(XlstmFixture, EveryValueEveryStepMatchesTransformers) {
  GoldenCase c = make();
  Trace t;
  save_all_values(c.model, t);
  run_recorded_steps(c, &t);
  expect_values_match(c, t, c.name);
  EXPECT_EQ(t.calls()[0].kernel, "chunked");  // transformers' inference: chunkwise prompt, recurrent steps
  for (size_t s = 1; s < t.calls().size(); ++s) EXPECT_EQ(t.calls()[s].kernel, "recurrent");
  EXPECT_FALSE(t.has("layers.0.linear_attn.state_input", 0)) << "state_input is None on a fresh prompt";
  const MixerIdentity id = mixer_identity(c.model, 0, 8);
  EXPECT_EQ(id.kind, "mlstm");
  EXPECT_EQ(id.state_op, "mlstm_recurrent_step");
  EXPECT_EQ(id.prompt_kernel, "chunked");
  EXPECT_EQ(id.step_kernel, "recurrent");
}

TEST_P(XlstmFixture, GreedyTokensMatch) { expect_greedy_tokens(make()); }

TEST_P(XlstmFixture, EditsMatchTransformersWithTheSameModification) {
  GoldenCase c = make();
  EXPECT_GT(expect_edits_match(c), 0);
}

TEST_P(XlstmFixture, StatesEndInStateOutputWhichTheNextStepStartsFrom) { expect_state_invariants(make(), 0.0); }

INSTANTIATE_TEST_SUITE_P(Fixtures, XlstmFixture, ::testing::ValuesIn(fixture_cases("xlstm")));

TEST(Xlstm, PrefixThenContinuationEqualsWholePrompt) {
  GoldenCase c("xlstm", "basic");
  expect_continuation_equals_whole(c.model, c.prompts[0], {1, 5, c.prompts[0].size() - 1});
}

// The chunkwise form and the recurrent step are the same recurrence (transformers runs both in one prompt):
// every value of a prompt agrees across routes within float rounding.
TEST(Xlstm, ChunkedAndRecurrentRoutesAgree) {
  GoldenCase c("xlstm", "basic");
  const auto run = [&](const std::string& route) {
    route_kernels("xlstm", route);
    Trace t;
    t.save("logits").save("layers.*.linear_attn.states").save("layers.*.linear_attn.attention_head_outputs");
    c.model.run(c.prompts, &t);
    route_kernels("xlstm", "default");
    EXPECT_EQ(t.calls().at(0).kernel, route);
    return t;
  };
  Trace a = run("chunked"), b = run("recurrent");
  for (const std::string p : {"logits", "layers.1.linear_attn.states", "layers.1.linear_attn.attention_head_outputs"}) {
    EXPECT_LE(rel_rms(a.get(p), b.get(p)), 3e-6) << p;
    EXPECT_GT(max_abs_diff(a.get(p), b.get(p)), 0.0) << p << ": the two routes should run different arithmetic";
  }
}

// transformers ignores padding on xLSTM; mixlens scans a row from its first real token, so a padded row is its
// own run on its real tokens (its chunk grid anchored there).
TEST(Xlstm, LeftPaddedRowsEqualTheirOwnRuns) {
  GoldenCase c("xlstm", "basic");
  const std::vector<int32_t> a = c.prompts[0], b(a.begin() + 5, a.end());
  Trace batched;
  batched.save("logits").save("layers.*.linear_attn.state_output");
  c.model.run({a, b}, &batched);
  Trace single;
  single.save("logits").save("layers.*.linear_attn.state_output");
  c.model.run({b}, &single);
  const int64_t T = static_cast<int64_t>(a.size()), n = static_cast<int64_t>(b.size());
  const Tensor& full = batched.get("logits");
  const int64_t W = full.size(2);
  Tensor row({1, n, W});
  std::memcpy(row.data(), full.data() + (T + T - n) * W, sizeof(float) * static_cast<size_t>(n * W));
  EXPECT_LE(rel_rms(row, single.get("logits")), 1e-5);
  for (int l = 0; l < 2; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".linear_attn.state_output";
    const Tensor& so = batched.get(p);
    const int64_t per = so.size(1);
    Tensor r({1, per});
    std::memcpy(r.data(), so.data() + per, sizeof(float) * static_cast<size_t>(per));
    EXPECT_LE(rel_rms(r, single.get(p)), 1e-5) << p;
  }
}

// state@t is states[:, t] bit for bit; a write of (C, n, m) at t continues, for the tokens after t, as the
// recurrence run explicitly from the written state over the same q, k, v and gates (bit for bit on the
// recurrent route; the chunked route restarts its chunk grid at t + 1 and agrees within rounding).
TEST(Xlstm, PerTokenStateReadsAndWritesFollowTheRecurrence) {
  GoldenCase c("xlstm", "basic");
  const std::string p = "layers.1.linear_attn.";
  const int64_t t0 = 5;
  detail::MlstmMixerDims d;
  d.D = 64, d.NH = 4, d.Dqk = 16, d.Dv = 16;  // the case's sizes (case.json); eps 1e-6
  for (const std::string route : {"recurrent", "chunked"}) {
    route_kernels("xlstm", route);
    Trace base;
    base.save(p + "states").save(p + "state@t5").save(p + "attention_queries").save(p + "attention_keys")
        .save(p + "attention_values").save(p + "betas").save(p + "decays");
    c.model.run(c.prompts, &base);
    std::vector<float> log_i(base.get(p + "betas").begin(), base.get(p + "betas").end());
    for (float& x : log_i) x = std::log(x);  // the log input gate the kernel takes from betas
    const Tensor& st = base.get(p + "states");
    const int64_t T = st.size(1), n = st.size(2);
    ASSERT_EQ(n, d.row_numel());
    EXPECT_EQ(0, std::memcmp(base.get(p + "state@t5").data(), st.data() + t0 * n, sizeof(float) * static_cast<size_t>(n)));

    Tensor written({1, n});
    std::memcpy(written.data(), st.data() + t0 * n, sizeof(float) * static_cast<size_t>(n));
    for (int64_t i = 0; i < d.n_off(); ++i) written[i] = written[i] * 3.0f + 0.5f;  // C
    written[d.m_off() + 1] += 2.0f;                                                  // m of head 1
    Trace edited;
    edited.set(p + "state@t5", written).save(p + "states").save(p + "attention_head_outputs");
    c.model.run(c.prompts, &edited);
    route_kernels("xlstm", "default");
    std::vector<float> s(written.data(), written.data() + n), y(static_cast<size_t>((T - t0 - 1) * d.v()));
    const int64_t o = t0 + 1;
    detail::mlstm_recurrent(d, T - o, base.get(p + "attention_queries").data() + o * d.qk(),
                            base.get(p + "attention_keys").data() + o * d.qk(),
                            base.get(p + "attention_values").data() + o * d.v(), log_i.data() + o * d.NH,
                            base.get(p + "decays").data() + o * d.NH, s.data(), y.data());
    const Tensor& yo = edited.get(p + "attention_head_outputs");
    const Tensor& se = edited.get(p + "states");
    double worst = 0;
    for (int64_t i = 0; i < (T - o) * d.v(); ++i)
      worst = std::max(worst, static_cast<double>(std::fabs(yo[o * d.v() + i] - y[static_cast<size_t>(i)])));
    for (int64_t i = 0; i < n; ++i)
      worst = std::max(worst, static_cast<double>(std::fabs(se[(T - 1) * n + i] - s[static_cast<size_t>(i)])) /
                                  (1.0 + std::fabs(s[static_cast<size_t>(i)])));
    if (route == "recurrent")
      EXPECT_EQ(worst, 0.0) << route;
    else
      EXPECT_LE(worst, 3e-5) << route;  // the chunk formula vs the step: rounding (kValueTolerance)
    // The write took effect: the outputs after t differ from the unwritten run's.
    Trace plain;
    plain.save(p + "attention_head_outputs");
    c.model.run(c.prompts, &plain);
    EXPECT_GT(max_abs_diff(plain.get(p + "attention_head_outputs"), yo), 1e-3);
  }
}

TEST(Xlstm, ServesEveryMixerValueAndRefusesTheHead) {
  GoldenCase c("xlstm", "short_prompt");
  for (const char* v : {"linear_attn.betas", "linear_attn.decays", "linear_attn.attention_queries", "mlp.output"})
    EXPECT_EQ(c.model.support().at(v).at(0), "") << v;
  EXPECT_NE(c.model.support().at("self_attn.attention_output").at(0), "");
}

// The float64 stabilised recurrence of one head (m the running max of the log gates, as the kernels keep).
struct Ref64 {
  int64_t Dqk, Dv;
  std::vector<double> C, n;
  double m = 0;
  Ref64(int64_t dq, int64_t dv) : Dqk(dq), Dv(dv), C(static_cast<size_t>(dq * dv)), n(static_cast<size_t>(dq)) {}
  void step(const float* q, const float* k, const float* v, double ig, double lf, double eps, double* h) {
    const double mn = std::max(lf + m, ig), fa = std::exp(lf + m - mn), ia = std::exp(ig - mn);
    const double sc = 1.0 / std::sqrt(static_cast<double>(Dqk));
    double qn = 0;
    for (int64_t a = 0; a < Dqk; ++a) {
      for (int64_t e = 0; e < Dv; ++e) C[a * Dv + e] = fa * C[a * Dv + e] + ia * k[a] * v[e];
      n[a] = fa * n[a] + ia * k[a];
      qn += q[a] * sc * n[a];
    }
    m = mn;
    const double den = std::max(std::fabs(qn), std::exp(-m)) + eps;
    for (int64_t e = 0; e < Dv; ++e) {
      double s = 0;
      for (int64_t a = 0; a < Dqk; ++a) s += q[a] * sc * C[a * Dv + e];
      h[e] = s / den;
    }
  }
};

// issue 25: 4,096 tokens whose log input gates (60..90, as an uncapped gate gives) overflow exp() in float32.
// Both kernels' stabilised (C, n, m) stay finite and their reads match the float64 recurrence; the naive
// float32 sums of exp(i) k v^T overflow.
TEST(XlstmMlstm, StabilisedStateStaysFiniteOnALongPrompt) {
  detail::MlstmMixerDims d;
  d.D = 8, d.NH = 2, d.Dqk = 4, d.Dv = 4, d.chunk = 64;
  const int64_t T = 4096, QK = d.qk(), V = d.v();
  std::mt19937 rng(11);
  // q, k > 0: the normaliser's q.n has no cancellation, so the read is well conditioned and the
  // comparison measures the stabilisation, not a near-zero denominator.
  std::uniform_real_distribution<float> id(60.0f, 90.0f), xd(0.1f, 1.0f), vd(-1.0f, 1.0f), fd(-0.05f, 0.0f);
  std::vector<float> q(T * QK), k(T * QK), v(T * V), ig(T * 2), lf(T * 2);
  for (auto& x : q) x = xd(rng);
  for (auto& x : k) x = xd(rng);
  for (auto& x : v) x = vd(rng);
  for (auto& x : ig) x = id(rng);
  for (auto& x : lf) x = fd(rng);  // forget gates close to 1: the sums keep growing
  std::vector<double> want(static_cast<size_t>(T * V));
  bool naive_overflow = false;
  for (int64_t hd = 0; hd < d.NH; ++hd) {
    Ref64 r(d.Dqk, d.Dv);
    float naive = 0.0f;
    for (int64_t t = 0; t < T; ++t) {
      r.step(q.data() + t * QK + hd * d.Dqk, k.data() + t * QK + hd * d.Dqk, v.data() + t * V + hd * d.Dv,
             ig[t * 2 + hd], lf[t * 2 + hd], d.eps, want.data() + t * V + hd * d.Dv);
      naive = std::exp(lf[t * 2 + hd]) * naive + std::exp(ig[t * 2 + hd]) * k[t * QK + hd * d.Dqk] * v[t * V + hd * d.Dv];
      naive_overflow = naive_overflow || !std::isfinite(naive);
    }
  }
  EXPECT_TRUE(naive_overflow) << "the gates should overflow the naive float32 sums";
  for (const bool chunked : {false, true}) {
    std::vector<float> st(static_cast<size_t>(d.row_numel()), 0.0f), h(static_cast<size_t>(T * V));
    if (chunked)
      for (int64_t t = 0; t < T; t += d.chunk)
        detail::mlstm_chunk(d, d.chunk, q.data() + t * QK, k.data() + t * QK, v.data() + t * V, ig.data() + t * 2,
                            lf.data() + t * 2, st.data(), h.data() + t * V);
    else
      detail::mlstm_recurrent(d, T, q.data(), k.data(), v.data(), ig.data(), lf.data(), st.data(), h.data());
    double worst = 0, scale = 0;
    for (int64_t i = 0; i < T * V; ++i) {
      ASSERT_TRUE(std::isfinite(h[static_cast<size_t>(i)])) << i;
      worst = std::max(worst, std::fabs(h[static_cast<size_t>(i)] - want[static_cast<size_t>(i)]));
      scale = std::max(scale, std::fabs(want[static_cast<size_t>(i)]));
    }
    for (float x : st) EXPECT_TRUE(std::isfinite(x));
    EXPECT_LE(worst / scale, 1e-4) << (chunked ? "chunked" : "recurrent");
  }
}

}  // namespace
