// LFM2 / LFM2-MoE (gated short conv + attention hybrids) parity with transformers (golden fixtures from
// scripts/make_fixtures.py, dev/mixlens_dev/fixtures/lfm2.py): every value of every step, greedy tokens,
// edits, the values.md state invariants, the one kernel, and the short conv's window against an
// explicit recurrence written here.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>

#include "fixture_util.h"
#include "recurrent_checks.h"
#include "mixlens/errors.h"
#include "mixlens/trace.h"

using namespace mixlens;
using namespace mixlens::test;

namespace {

using FamilyAndCase = std::pair<std::string, std::string>;

std::vector<FamilyAndCase> lfm2_cases() {
  std::vector<FamilyAndCase> out;
  for (const char* f : {"lfm2", "lfm2_moe"})
    for (const auto& n : fixture_cases(f)) out.emplace_back(f, n);
  return out;
}

class Lfm2Fixture : public ::testing::TestWithParam<FamilyAndCase> {
 protected:
  std::unique_ptr<GoldenCase> load() const { return std::make_unique<GoldenCase>(GetParam().first, GetParam().second); }
};

// Every golden value of every step (prompt + 7 steps), on the one kernel, and the greedy tokens.
TEST_P(Lfm2Fixture, EveryValueEveryStepAndTheGreedyTokensMatchTransformers) {
  const auto c = load();
  Trace t;
  save_all_values(c->model, t);
  run_recorded_steps(*c, &t);
  EXPECT_GT(expect_golden_values(c->golden, t, c->name), 50);
  EXPECT_FALSE(t.has("layers.0.linear_attn.state_input", 0)) << "state_input is None on a fresh prompt";
  ASSERT_EQ(t.calls().size(), static_cast<size_t>(c->n_steps));
  for (const auto& call : t.calls()) EXPECT_EQ(call.kernel, "recurrent");  // the one kernel, prompts too
  expect_kernel_identity(c->model, t, "short_conv");
  if (c->spec["greedy"].get<bool>()) expect_greedy_tokens(*c);
}

TEST_P(Lfm2Fixture, StateInvariants) {
  expect_state_invariants(*load(), 0.0);  // the window holds copies of B * x: bit for bit
}

TEST_P(Lfm2Fixture, EditsMatchTransformersWithTheSameModification) {
  const auto c = load();
  if (c->spec["edits"].empty()) GTEST_SKIP() << "case has no edits";
  EXPECT_GT(expect_edits_match(*c, /*last_step_changes=*/true), 0);
}

// The window after every token against the recurrence written out: S_t = [S_{t-1}[1:], B_t * x_t]
// per channel, from state_input (zeros on a fresh prompt); states[:, -1] is then state_output.
TEST_P(Lfm2Fixture, WindowIsTheShiftedProductOfKeysAndValues) {
  const auto cp = load();
  const GoldenCase& c = *cp;
  Trace t;
  t.save("layers.*.linear_attn.states").save("layers.*.linear_attn.state_input")
      .save("layers.*.linear_attn.attention_keys").save("layers.*.linear_attn.attention_values");
  run_recorded_steps(c, &t);
  const int64_t Tp = static_cast<int64_t>(std::max_element(c.prompts.begin(), c.prompts.end(), [](const auto& a, const auto& b) {
                                            return a.size() < b.size();
                                          })->size());
  int checked = 0;
  for (int l = 0; l < c.model.info().num_layers; ++l) {
    if (!has_mixer(c.model, l)) continue;
    const std::string p = "layers." + std::to_string(l) + ".linear_attn.";
    for (int s = 0; s < c.n_steps; ++s) {
      const Tensor& st = t.get(p + "states", s);  // [B,T,D,K]
      const Tensor& kb = t.get(p + "attention_keys", s), &xv = t.get(p + "attention_values", s);
      const int64_t B = st.size(0), T = st.size(1), D = st.size(2), K = st.size(3);
      Tensor S({B, D, K});
      if (t.has(p + "state_input", s)) S = t.get(p + "state_input", s).clone();
      for (int64_t b = 0; b < B; ++b)
        for (int64_t tt = 0; tt < T; ++tt) {
          // Left padding (the prompt only): padded tokens do not write.
          if (s == 0 && tt < Tp - static_cast<int64_t>(c.prompts[static_cast<size_t>(b)].size())) continue;
          for (int64_t d = 0; d < D; ++d) {
            float* w = S.data() + (b * D + d) * K;
            std::memmove(w, w + 1, sizeof(float) * static_cast<size_t>(K - 1));
            w[K - 1] = kb[(b * T + tt) * D + d] * xv[(b * T + tt) * D + d];
            ASSERT_EQ(0, std::memcmp(w, st.data() + ((b * T + tt) * D + d) * K, sizeof(float) * static_cast<size_t>(K)))
                << p << " step " << s << " row " << b << " token " << tt;
          }
          ++checked;
        }
    }
  }
  EXPECT_GT(checked, 0);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Lfm2Fixture, ::testing::ValuesIn(lfm2_cases()),
                         [](const auto& p) { return p.param.first + "_" + p.param.second; });

TEST(Lfm2, ChunkedRouteAndChunkSizeAreRefusedWithTheReason) {
  Model m = Model::load(fixture("lfm2/" + fixture_cases("lfm2")[0]).string());
  for (const char* f : {"lfm2", "lfm2_moe"}) {
    try {
      route_kernels(f, "chunked");
      ADD_FAILURE() << f << ": a chunked route was accepted";
    } catch (const UnsupportedError& e) {
      EXPECT_NE(std::string(e.what()).find("one kernel"), std::string::npos) << e.what();
    }
    route_kernels(f, "recurrent");  // the one kernel: accepted
    route_kernels(f, "default");
  }
  EXPECT_THROW(m.set_chunk_size(8), UnsupportedError);
  const auto s = m.support();
  EXPECT_NE(s.at("linear_attn.betas").at(0).find("short_conv"), std::string::npos);
  EXPECT_EQ(s.at("linear_attn.state").at(0), "");
}

// A misspelt name of a vocabulary entry this kind does not serve gives that entry's reason, not the
// nearest served path (which for `betaz` was `states`); a misspelt served name still suggests it.
TEST(Lfm2, MisspeltUnservedNameGivesItsReason) {
  Model m = Model::load(fixture("lfm2/" + fixture_cases("lfm2")[0]).string());
  const auto msg = [&](const std::string& path) -> std::string {
    Trace t;
    t.save(path);
    try {
      m.run({{1, 2, 3}}, &t);
    } catch (const UnknownValueError& e) {
      return e.what();
    }
    return "(accepted)";
  };
  const std::string betaz = msg("layers.0.linear_attn.betaz");
  EXPECT_NE(betaz.find("the nearest name, 'layers.0.linear_attn.betas', is not served here: block 0 is a short_conv"),
            std::string::npos) << betaz;
  const std::string keyz = msg("layers.0.linear_attn.attention_keyz");
  EXPECT_NE(keyz.find("did you mean 'layers.0.linear_attn.attention_keys'"), std::string::npos) << keyz;
}

// values.md invariants on a random prompt: one call equals a prefix then the rest from the cache
// (logits, state_output, per-token states); each row of a left-padded batch equals its unbatched run
// (the padded tokens' windows exactly zero); writes that leave a value as served change nothing.
TEST(Lfm2, InvariantTables) {
  for (const char* f : {"lfm2", "lfm2_moe"}) {
    Model m = Model::load(fixture(std::string(f) + "/" + fixture_cases(f)[0]).string());
    const std::vector<int32_t> prompt = {5, 9, 14, 3, 77, 41, 8, 60, 12, 33, 2, 19};
    expect_continuation_equals_whole(m, prompt, {1, 2, 5, 11});
    expect_batched_equals_unbatched(m, {prompt, {7, 8, 9}, {40, 41, 42, 43, 44, 45, 46}});
    expect_unchanged_writes_change_nothing(m, {prompt, {7, 8, 9}});
  }
}

}  // namespace
