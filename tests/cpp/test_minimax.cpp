// MiniMax (lightning attention + softmax attention hybrid, MoE on every block) parity with transformers
// (golden fixtures from scripts/make_fixtures.py, dev/mixlens_dev/fixtures/minimax.py): every value of
// every step on both kernel routes, greedy tokens, edits, the values.md state invariants, and the
// lightning kv state against an explicit recurrence written here (decays writes included).
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>

#include "fixture_util.h"
#include "recurrent_checks.h"
#include "mixlens/errors.h"

using namespace mixlens;
using namespace mixlens::test;

namespace {

class MinimaxFixture : public ::testing::TestWithParam<std::string> {
 protected:
  std::unique_ptr<GoldenCase> load() const { return std::make_unique<GoldenCase>("minimax", GetParam()); }
};

// Restores the default route when a test leaves (also on a failed assertion).
struct Route {
  explicit Route(const char* r) { route_kernels("minimax", r); }
  ~Route() { route_kernels("minimax", "default"); }
};

// Every value of every step of a recorded run (prompt + 7 steps) against the goldens.
Trace expect_every_golden_value(const GoldenCase& c, const std::string& label) {
  Trace t;
  save_all_values(c.model, t);
  run_recorded_steps(c, &t);
  EXPECT_GT(expect_golden_values(c.golden, t, label), 50);
  return t;
}

// transformers' routing (the block kernel on a fresh prompt, the token loop on every call over a cached
// state), then each route forced on every call (the block kernel on decode steps, the token loop on the
// prompt), then a block size other than block_size: the same values within tolerance; greedy tokens.
TEST_P(MinimaxFixture, EveryValueEveryStepOnBothRoutesAndTheGreedyTokensMatchTransformers) {
  const auto c = load();
  {
    const Trace t = expect_every_golden_value(*c, c->name);
    ASSERT_EQ(t.calls().size(), static_cast<size_t>(c->n_steps));
    EXPECT_EQ(t.calls()[0].kernel, "chunked");
    for (size_t k = 1; k < t.calls().size(); ++k) EXPECT_EQ(t.calls()[k].kernel, "recurrent") << "step " << k;
    expect_kernel_identity(c->model, t, "lightning");
  }
  for (const char* route : {"chunked", "recurrent"}) {
    Route r(route);
    const Trace t = expect_every_golden_value(*c, c->name + " " + route);
    for (const auto& call : t.calls()) EXPECT_EQ(call.kernel, route);
  }
  c->model.set_chunk_size(3);
  expect_every_golden_value(*c, c->name + " block 3");
  c->model.set_chunk_size(0);
  if (c->spec["greedy"].get<bool>()) expect_greedy_tokens(*c);
}

// The values.md state invariants (states[:, -1] vs state_output within 1e-5: the chunked prompt replays
// per-token states beside the block end; state_input@k+1 == state_output@k), and the case's edits
// against transformers running the same modification.
TEST_P(MinimaxFixture, StateInvariantsAndEditsMatchTransformers) {
  const auto c = load();
  expect_state_invariants(*c, 1e-5);
  if (!c->spec["edits"].empty()) {
    EXPECT_GT(expect_edits_match(*c, /*last_step_changes=*/true), 0);
  }
}

// The kv state after every token against the recurrence written out, S_t = exp(decays_t) S_{t-1} +
// k_t v_t^T per head ([Dk, Dv]), from state_input (zeros on a fresh prompt), on both routes; a
// decays write (token 2 of the prompt: -3 on every head) is followed.
TEST_P(MinimaxFixture, KvStateIsTheDecayedSumOfKeyValueProducts) {
  const auto c = load();
  const int64_t Tp = static_cast<int64_t>(c->prompts[0].size());
  for (const char* route : {"chunked", "recurrent"}) {
    Route r(route);
    Trace t;
    t.save("layers.*.linear_attn.states").save("layers.*.linear_attn.state_input").save("layers.*.linear_attn.decays")
        .save("layers.*.linear_attn.attention_keys").save("layers.*.linear_attn.attention_values");
    t.edit("layers.*.linear_attn.decays", [](Tensor& v, const SiteContext& ctx) {
      if (ctx.step != 0 || v.size(1) < 3) return;
      for (int64_t b = 0; b < v.size(0); ++b)
        for (int64_t h = 0; h < v.size(2); ++h) v[(b * v.size(1) + 2) * v.size(2) + h] = -3.0f;
    });
    run_recorded_steps(*c, &t);
    int checked = 0;
    for (int l = 0; l < c->model.info().num_layers; ++l) {
      if (!has_mixer(c->model, l)) continue;
      const std::string p = "layers." + std::to_string(l) + ".linear_attn.";
      for (int s = 0; s < c->n_steps; ++s) {
        const Tensor& st = t.get(p + "states", s);  // [B,T,H,Dk,Dv]
        const Tensor &k = t.get(p + "attention_keys", s), &v = t.get(p + "attention_values", s), &dec = t.get(p + "decays", s);
        const int64_t B = st.size(0), T = st.size(1), H = st.size(2), Dk = st.size(3), Dv = st.size(4);
        if (s == 0 && T >= 3) {
          EXPECT_EQ(dec[2 * H], -3.0f) << "the decays write is served back";
        }
        Tensor S({B, H, Dk, Dv});
        if (t.has(p + "state_input", s)) S = t.get(p + "state_input", s).clone();
        for (int64_t b = 0; b < B; ++b)
          for (int64_t tt = 0; tt < T; ++tt) {
            // Left padding (the prompt only): the scan starts at the row's first real token.
            if (s == 0 && tt < Tp - static_cast<int64_t>(c->prompts[static_cast<size_t>(b)].size())) continue;
            Tensor want({H, Dk, Dv}), got({H, Dk, Dv});
            for (int64_t h = 0; h < H; ++h) {
              const float a = std::exp(dec[(b * T + tt) * H + h]);
              for (int64_t i = 0; i < Dk; ++i)
                for (int64_t j = 0; j < Dv; ++j) {
                  float& x = S[((b * H + h) * Dk + i) * Dv + j];
                  x = a * x + k[((b * T + tt) * H + h) * Dk + i] * v[((b * T + tt) * H + h) * Dv + j];
                  want[(h * Dk + i) * Dv + j] = x;
                  got[(h * Dk + i) * Dv + j] = st[((b * T + tt) * H + h) * Dk * Dv + i * Dv + j];
                }
            }
            ASSERT_LE(rel_rms(got, want), 1e-5) << p << " " << route << " step " << s << " row " << b << " token " << tt;
            ++checked;
          }
      }
    }
    EXPECT_GT(checked, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, MinimaxFixture, ::testing::ValuesIn(fixture_cases("minimax")),
                         [](const auto& p) { return p.param; });

TEST(Minimax, SupportAndBackwardSayWhy) {
  Model m = Model::load(fixture("minimax/lightning_attn").string());
  const auto s = m.support();
  EXPECT_NE(s.at("linear_attn.betas").at(0).find("lightning"), std::string::npos);
  EXPECT_NE(s.at("linear_attn.state").at(1).find("no recurrent state"), std::string::npos);
  EXPECT_EQ(s.at("linear_attn.state").at(0), "");
  EXPECT_EQ(s.at("linear_attn.decays").at(0), "");
  EXPECT_EQ(m.info().layer_kinds[0], LayerKind::lightning);
  EXPECT_EQ(layer_kind_name(LayerKind::lightning), "lightning");
  EXPECT_THROW(m.set_chunk_size(-1), InputError);
  Trace t;
  t.save("layers.0.linear_attn.betas");
  EXPECT_THROW(m.run({{5, 6, 7}}, &t), UnknownValueError);
}

// values.md invariants on a random prompt: one call equals a prefix then the rest from the cache
// (logits, state_output, per-token states); each row of a left-padded batch equals its unbatched run;
// writes that leave a value as served change nothing.
TEST(Minimax, InvariantTables) {
  LoadOptions o;
  o.deterministic = true;  // routed experts: a row's rounding must not depend on the other rows
  Model m = Model::load(fixture("minimax/lightning_attn").string(), o);
  const std::vector<int32_t> prompt = {5, 9, 14, 3, 77, 41, 8, 60, 12, 33, 2, 19};
  expect_continuation_equals_whole(m, prompt, {1, 2, 5, 11});
  expect_batched_equals_unbatched(m, {prompt, {7, 8, 9}, {40, 41, 42, 43, 44, 45, 46}});
  expect_unchanged_writes_change_nothing(m, {prompt, {7, 8, 9}});
}

}  // namespace
