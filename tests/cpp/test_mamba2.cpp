// Mamba-2 parity with transformers (golden fixtures from scripts/make_fixtures.py), the
// values.md invariants, kernel-path agreement and writes.
#include <gtest/gtest.h>

#include <cstring>

#include "recurrent_checks.h"
#include "mixlens/errors.h"

using namespace mixlens;
using namespace mixlens::test;

namespace {

// A Mamba-2 golden case (tests/fixtures/mamba2/<name>).
struct Case : GoldenCase {
  explicit Case(const std::string& n) : GoldenCase("mamba2", n) {}
};

class Mamba2Fixture : public ::testing::TestWithParam<std::string> {};

TEST_P(Mamba2Fixture, EveryValueEveryStepMatchesTransformers) {
  Case c(GetParam());
  Trace t;
  save_all_values(c.model, t);
  run_recorded_steps(c, &t);
  expect_values_match(c, t, c.name + " default kernels");
  // Step 0 is a prompt (chunked), later steps single-token decodes (recurrent).
  ASSERT_EQ(t.calls().size(), static_cast<size_t>(c.n_steps));
  EXPECT_EQ(t.calls()[0].kernel, "chunked");
  EXPECT_TRUE(t.calls()[0].fresh);
  EXPECT_EQ(t.calls()[1].kernel, "recurrent");
  EXPECT_EQ(t.calls()[1].seq, 1);
  expect_kernel_identity(c.model, t, "ssd");
  EXPECT_FALSE(t.has("layers.0.linear_attn.state_input", 0)) << "state_input is None on a fresh prompt";
}

TEST_P(Mamba2Fixture, ForcedKernelPathsMatchTransformersToo) {
  Case c(GetParam());
  for (const char* route : {"recurrent", "chunked"}) {
    route_kernels("mamba2", route);
    Trace t;
    save_all_values(c.model, t);
    run_recorded_steps(c, &t);
    expect_kernel_identity(c.model, t, "ssd");
    route_kernels("mamba2", "default");
    expect_values_match(c, t, c.name + " route " + route);
    for (const auto& call : t.calls()) EXPECT_EQ(call.kernel, route);
  }
  c.model.set_chunk_size(1);  // chunk_per_token
  Trace t;
  save_all_values(c.model, t);
  run_recorded_steps(c, &t);
  expect_values_match(c, t, c.name + " chunk_size 1");
}

TEST_P(Mamba2Fixture, GreedyTokensMatch) {
  Case c(GetParam());
  GenerateOptions o;
  o.max_new_tokens = c.n_steps;
  o.eos_token_id = -1;  // fixtures record greedy tokens without an EOS stop
  auto res = c.model.generate(c.prompts, o);
  ASSERT_EQ(res.new_tokens.size(), c.tokens.size());
  for (size_t r = 0; r < c.tokens.size(); ++r) EXPECT_EQ(res.new_tokens[r], c.tokens[r]) << "row " << r;
}

TEST_P(Mamba2Fixture, Invariants) {
  // states come from a token replay inside each chunk, state_output from the chunked SSD.
  expect_state_invariants(Case(GetParam()), 1e-6);
}

TEST_P(Mamba2Fixture, EditsMatchTransformersWithTheSameModification) {
  Case c(GetParam());
  if (c.spec["edits"].empty()) GTEST_SKIP() << "case has no edits";
  EXPECT_GT(expect_edits_match(c), 0);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Mamba2Fixture, ::testing::ValuesIn(fixture_cases("mamba2")));

TEST(Mamba2, SkipTokenWithZeroBetaKeepsStateBitExactOnRecurrentPath) {
  Case c("g1_chunks");
  expect_zero_beta_skips_token(c.model, "mamba2", c.prompts[0], 1, 5);
}

TEST(Mamba2, PrefixThenContinuationEqualsWholePrompt) {
  Case c("g1_chunks");
  expect_continuation_equals_whole(c.model, c.prompts[0], {1, 5, 9, c.prompts[0].size() - 1});
}

TEST(Mamba2, BatchedEqualsUnbatchedUnderLeftPadding) {
  Case c("padded_batch");
  expect_batched_equals_unbatched(c.model, c.prompts);
}

TEST(Mamba2, WritesAreValidated) {
  Case c("g1_chunks");
  auto run_with = [&](const std::string& path, EditFn fn) {
    Trace t;
    t.edit(path, std::move(fn));
    c.model.run(c.prompts, &t);
  };
  try {
    run_with("layers.0.linear_attn.betas", [](Tensor& v, const SiteContext&) { v = Tensor({1, 2, 3}); });
    FAIL() << "wrong shape accepted";
  } catch (const WriteError& e) {
    EXPECT_NE(std::string(e.what()).find("expected shape [1, 21, 4]"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("layers.0.linear_attn.betas"), std::string::npos) << e.what();
  }
  EXPECT_THROW(run_with("layers.0.linear_attn.betas", [](Tensor& v, const SiteContext&) { v[0] = -1.0f; }), WriteError);
  EXPECT_THROW(run_with("layers.0.linear_attn.decays", [](Tensor& v, const SiteContext&) { v[0] = 0.5f; }), WriteError);
  EXPECT_THROW(run_with("layers.0.linear_attn.attention_values",
                        [](Tensor& v, const SiteContext&) { v[3] = std::nanf(""); }),
               WriteError);
  EXPECT_THROW(run_with("layers.0.linear_attn.states", [](Tensor&, const SiteContext&) {}), WriteError);
}

TEST(Mamba2, UnknownValuePathsSuggestTheNearest) {
  Case c("g1_chunks");
  auto message = [&](const std::string& path) { return unknown_path_message(c.model, c.prompts, path); };
  EXPECT_NE(message("layers.1.linear_attn.beta").find("did you mean 'layers.1.linear_attn.betas'"), std::string::npos);
  EXPECT_NE(message("layers.7.linear_attn.betas").find("out of range"), std::string::npos);
  EXPECT_NE(message("layers.0.self_attn.attention_output").find("mamba2"), std::string::npos);
  EXPECT_NE(message("logit").find("did you mean 'logits'"), std::string::npos);
}

TEST(Mamba2, WritingBackUnchangedValuesChangesNothing) {
  Case c("g1_chunks");
  expect_unchanged_writes_change_nothing(c.model, c.prompts);
}

}  // namespace
