// RecurrentGemma (RG-LRU recurrent blocks + local MQA attention) parity with transformers 5.18 (golden
// fixtures from scripts/make_fixtures.py, dev/mixlens_dev/fixtures/recurrent_gemma.py): every value of
// every step, greedy tokens, edits, the values.md state invariants, the one kernel, per-token states
// and state writes against the RG-LRU recurrence and the depthwise conv written out here, and the
// writes the reset at a sequence's first token would discard refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "fixture_util.h"
#include "mixlens/errors.h"
#include "recurrent_checks.h"

using namespace mixlens;
using namespace mixlens::test;

namespace {

std::string mix(int layer, const std::string& v) { return "layers." + std::to_string(layer) + ".linear_attn." + v; }

std::vector<int> rg_layers(const Model& m) {
  std::vector<int> out;
  for (int l = 0; l < m.info().num_layers; ++l)
    if (has_mixer(m, l)) out.push_back(l);
  return out;
}

class RecurrentGemmaFixture : public ::testing::TestWithParam<std::string> {
 protected:
  std::unique_ptr<GoldenCase> load() const { return std::make_unique<GoldenCase>("recurrent_gemma", GetParam()); }
};

TEST_P(RecurrentGemmaFixture, EveryValueEveryStepAndTheGreedyTokensMatchTransformers) {
  const auto c = load();
  Trace t;
  save_all_values(c->model, t);
  run_recorded_steps(*c, &t);
  EXPECT_GT(expect_golden_values(c->golden, t, c->name), 50);
  const int l0 = rg_layers(c->model).at(0);
  EXPECT_FALSE(t.has(mix(l0, "state_input"), 0)) << "state_input is None on a fresh prompt";
  ASSERT_EQ(t.calls().size(), static_cast<size_t>(c->n_steps));
  for (const auto& call : t.calls()) EXPECT_EQ(call.kernel, "recurrent");  // the one kernel, prompts too
  const MixerIdentity id = mixer_identity(c->model, l0, 8);
  EXPECT_EQ(id.kind, "rg_lru");
  EXPECT_EQ(id.state_op, "rg_lru_step");
  expect_greedy_tokens(*c);
}

TEST_P(RecurrentGemmaFixture, StateInvariants) { expect_state_invariants(*load(), 0.0); }

TEST_P(RecurrentGemmaFixture, EditsMatchTransformersWithTheSameModification) {
  const auto c = load();
  if (c->spec["edits"].empty()) GTEST_SKIP() << "case has no edits";
  EXPECT_GT(expect_edits_match(*c, /*last_step_changes=*/true), 0);
}

// Every token's state [K, W] against the recurrence written out, from state_input (zeros on a fresh
// prompt) over the served attention_values u, betas i and decays log a: the window moves by one conv
// input (rows 0..K-2, oldest first), u is the depthwise conv (conv_1d of the fixture) over the K-1
// window rows before the token and its own input, and h_t = a_t h_{t-1} + sqrt(1 - a_t^2) i_t u_t, with
// a_t = 0 and the multiplier 1 at a row's first real token. Padding tokens leave the state zero.
TEST_P(RecurrentGemmaFixture, StatesFollowTheConvWindowAndTheRgLruRecurrence) {
  const auto cp = load();
  const GoldenCase& c = *cp;
  io::SafetensorsFile weights(c.dir / "model.safetensors");
  Trace t;
  for (const char* v : {"states", "state_input", "attention_values", "betas", "decays"}) t.save(std::string("layers.*.linear_attn.") + v);
  run_recorded_steps(c, &t);
  int64_t Tp = 0;
  for (const auto& p : c.prompts) Tp = std::max<int64_t>(Tp, static_cast<int64_t>(p.size()));
  int checked = 0;
  double worst = 0.0;
  for (int l : rg_layers(c.model)) {
    const std::string p = mix(l, "");
    const std::string wp = "model.layers." + std::to_string(l) + ".temporal_block.conv_1d.";
    const Tensor cw = weights.get_f32(wp + "weight"), cb = weights.get_f32(wp + "bias");  // [W, 1, K], [W]
    for (int s = 0; s < c.n_steps; ++s) {
      const Tensor& st = t.get(p + "states", s);  // [B, T, K, W]
      const Tensor &u = t.get(p + "attention_values", s), &ig = t.get(p + "betas", s), &la = t.get(p + "decays", s);
      const int64_t B = st.size(0), T = st.size(1), K = st.size(2), W = st.size(3);
      Tensor S({B, K, W});
      if (t.has(p + "state_input", s)) S = t.get(p + "state_input", s).clone();
      for (int64_t b = 0; b < B; ++b) {
        const int64_t pad = s == 0 ? Tp - static_cast<int64_t>(c.prompts[static_cast<size_t>(b)].size()) : 0;
        for (int64_t tt = 0; tt < T; ++tt) {
          const float* got = st.data() + (b * T + tt) * K * W;
          if (tt < pad) {
            for (int64_t i = 0; i < K * W; ++i) ASSERT_EQ(got[i], 0.0f) << p << " padding token " << tt;
            continue;
          }
          const bool reset = s == 0 && tt == pad;
          float* row = S.data() + b * K * W;
          const int64_t r = b * T + tt;
          for (int64_t ch = 0; ch < W; ++ch) {
            // The conv: the K-1 window rows before the token, then its own input (the new window's last row).
            double conv = cb[ch];
            for (int64_t j = 0; j + 1 < K; ++j) conv += static_cast<double>(cw[ch * K + j]) * row[j * W + ch];
            conv += static_cast<double>(cw[ch * K + K - 1]) * got[(K - 2) * W + ch];
            worst = std::max(worst, std::fabs(conv - u[r * W + ch]) / (1.0 + std::fabs(conv)));
            const double a = reset ? 0.0 : std::exp(static_cast<double>(la[r * W + ch]));
            const double mult = reset ? 1.0 : std::sqrt(1.0 - a * a);
            const double h = a * row[(K - 1) * W + ch] + mult * ig[r * W + ch] * u[r * W + ch];
            worst = std::max(worst, std::fabs(h - got[(K - 1) * W + ch]) / (1.0 + std::fabs(h)));
          }
          // The window shifted by one: rows 1..K-2 before are rows 0..K-3 after (copies: bit for bit).
          ASSERT_EQ(0, std::memcmp(got, row + W, sizeof(float) * static_cast<size_t>((K - 2) * W))) << p << " token " << tt;
          std::memcpy(row, got, sizeof(float) * static_cast<size_t>(K * W));
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 0);
  EXPECT_LE(worst, 2e-6) << "float32 rounding of one conv sum / one recurrence step";
}

INSTANTIATE_TEST_SUITE_P(Fixtures, RecurrentGemmaFixture, ::testing::ValuesIn(fixture_cases("recurrent_gemma")));

// One recurrent block's RG-LRU written out from the fixture's weights (transformers' RecurrentGemmaRglru
// and the conv_1d of RecurrentGemmaRecurrentBlock), in double: the conv of one token over the K-1
// window rows before it and its own input, the block-diagonal gates and one recurrence step.
struct ExplicitRgLru {
  int64_t W, K, H, bw;
  Tensor cw, cb, iw, ib, rw, rb, rp;  // conv [W,1,K], [W]; gates [H,bw,bw], [H,bw]; recurrent_param [W]
  ExplicitRgLru(const GoldenCase& c, int layer) {
    io::SafetensorsFile f(c.dir / "model.safetensors");
    const std::string p = "model.layers." + std::to_string(layer) + ".temporal_block.";
    cw = f.get_f32(p + "conv_1d.weight"), cb = f.get_f32(p + "conv_1d.bias");
    iw = f.get_f32(p + "rg_lru.input_gate_weight"), ib = f.get_f32(p + "rg_lru.input_gate_bias");
    rw = f.get_f32(p + "rg_lru.recurrent_gate_weight"), rb = f.get_f32(p + "rg_lru.recurrent_gate_bias");
    rp = f.get_f32(p + "rg_lru.recurrent_param");
    W = cb.numel(), K = cw.size(2), H = iw.size(0), bw = iw.size(1);
  }
  // u of a token: window [K-1, W] (the rows before it), x [W] its conv input.
  std::vector<double> conv(const float* window, const float* x) const {
    std::vector<double> u(static_cast<size_t>(W));
    for (int64_t ch = 0; ch < W; ++ch) {
      double s = cb[ch] + static_cast<double>(cw[ch * K + K - 1]) * x[ch];
      for (int64_t j = 0; j + 1 < K; ++j) s += static_cast<double>(cw[ch * K + j]) * window[j * W + ch];
      u[static_cast<size_t>(ch)] = s;
    }
    return u;
  }
  // h <- a h + sqrt(1 - a^2) i u, the gates from u (no reset: a token after a sequence's first).
  void step(const std::vector<double>& u, std::vector<double>& h) const {
    for (int64_t hh = 0; hh < H; ++hh)
      for (int64_t j = 0; j < bw; ++j) {
        double si = ib[hh * bw + j], sr = rb[hh * bw + j];
        for (int64_t k = 0; k < bw; ++k) {
          si += u[static_cast<size_t>(hh * bw + k)] * iw[(hh * bw + k) * bw + j];
          sr += u[static_cast<size_t>(hh * bw + k)] * rw[(hh * bw + k) * bw + j];
        }
        const int64_t ch = hh * bw + j;
        const double ig = 1.0 / (1.0 + std::exp(-si)), r = 1.0 / (1.0 + std::exp(-sr));
        const double la = -8.0 * r * std::log1p(std::exp(static_cast<double>(rp[ch])));
        const double a = std::exp(la);
        h[static_cast<size_t>(ch)] = a * h[static_cast<size_t>(ch)] + std::sqrt(1.0 - a * a) * ig * u[static_cast<size_t>(ch)];
      }
  }
};

// state@t is states[:, t] bit for bit. A write of state@t0 (h, or h and the conv window) continues, for
// the tokens after t0, as the RG-LRU written out (ExplicitRgLru) from the written state over the same conv
// inputs (the window rows the run's states carry): the head outputs and every later state follow it.
TEST(RecurrentGemma, PerTokenStateReadsAndWritesFollowTheRecurrence) {
  GoldenCase c("recurrent_gemma", "griffin");
  const int l = rg_layers(c.model).at(1);
  const ExplicitRgLru rg(c, l);
  const std::string p = mix(l, "");
  const int64_t t0 = 5;
  Trace base;
  base.save(p + "states").save(p + "state@t5");
  c.model.run(c.prompts, &base);
  const Tensor& st = base.get(p + "states");
  const int64_t T = st.size(1), K = st.size(2), W = st.size(3), n = K * W;
  ASSERT_EQ(0, std::memcmp(base.get(p + "state@t5").data(), st.data() + t0 * n, sizeof(float) * static_cast<size_t>(n)));

  for (const bool window_too : {false, true}) {
    Tensor written({1, K, W});
    std::memcpy(written.data(), st.data() + t0 * n, sizeof(float) * static_cast<size_t>(n));
    for (int64_t ch = 0; ch < W; ++ch) written[(K - 1) * W + ch] = written[(K - 1) * W + ch] * 3.0f + 0.25f;  // h
    if (window_too)
      for (int64_t i = 0; i < (K - 1) * W; ++i) written[i] = 0.5f - written[i];
    Trace edited;
    edited.set(p + "state@t5", written).save(p + "states").save(p + "attention_head_outputs");
    c.model.run(c.prompts, &edited);
    const Tensor &ho = edited.get(p + "attention_head_outputs"), &se = edited.get(p + "states");
    std::vector<double> h(written.data() + (K - 1) * W, written.data() + K * W);
    double worst = 0.0;
    for (int64_t tt = t0 + 1; tt < T; ++tt) {
      // The window before token tt: the written one, then the edited run's; x_tt is the new window's last row.
      const float* prev = tt == t0 + 1 ? written.data() : se.data() + (tt - 1) * n;
      rg.step(rg.conv(prev, st.data() + tt * n + (K - 2) * W), h);
      for (int64_t ch = 0; ch < W; ++ch) {
        const double want = h[static_cast<size_t>(ch)];
        worst = std::max(worst, std::fabs(ho[tt * W + ch] - want) / (1.0 + std::fabs(want)));
        worst = std::max(worst, std::fabs(se[tt * n + (K - 1) * W + ch] - want) / (1.0 + std::fabs(want)));
      }
    }
    EXPECT_LE(worst, 1e-5) << (window_too ? "h and window" : "h") << " write";
    EXPECT_GT(std::fabs(ho[(t0 + 1) * W] - base.get(p + "states")[(t0 + 1) * n + (K - 1) * W]), 1e-3) << "the write mattered";
  }
}

// A state_input write of the conv window is served before the conv reads it: the call's attention_values
// are the conv over the written window (the first K-1 tokens) and over the call's own inputs (later ones),
// and the head outputs follow the RG-LRU from the written state.
TEST(RecurrentGemma, AStateInputWindowWriteReachesTheServedConvOutput) {
  GoldenCase c("recurrent_gemma", "griffin");
  const int l = rg_layers(c.model).at(0);
  const ExplicitRgLru rg(c, l);
  const std::string p = mix(l, "");
  const auto& prompt = c.prompts[0];
  Cache cache = c.model.new_cache(1);
  Trace first;
  first.save(p + "state_output");
  c.model.forward(Batch::left_padded({{prompt.begin(), prompt.begin() + 6}}, 0), cache, &first);
  Tensor written = first.get(p + "state_output").clone();
  const int64_t K = written.size(1), W = written.size(2), n = K * W;
  for (int64_t i = 0; i < (K - 1) * W; ++i) written[i] = 0.5f - written[i];
  Trace t;
  t.set(p + "state_input", written).save(p + "attention_values").save(p + "states").save(p + "attention_head_outputs");
  c.model.forward(Batch::left_padded({{prompt.begin() + 6, prompt.end()}}, 0), cache, &t);
  // The cache's second call: step 1.
  const Tensor &u = t.get(p + "attention_values", 1), &st = t.get(p + "states", 1), &ho = t.get(p + "attention_head_outputs", 1);
  std::vector<double> h(written.data() + (K - 1) * W, written.data() + n);
  double worst_u = 0.0, worst_h = 0.0;
  for (int64_t tt = 0; tt < st.size(1); ++tt) {
    const std::vector<double> want = rg.conv(tt == 0 ? written.data() : st.data() + (tt - 1) * n, st.data() + tt * n + (K - 2) * W);
    rg.step(want, h);
    for (int64_t ch = 0; ch < W; ++ch) {
      worst_u = std::max(worst_u, std::fabs(u[tt * W + ch] - want[static_cast<size_t>(ch)]) / (1.0 + std::fabs(want[static_cast<size_t>(ch)])));
      worst_h = std::max(worst_h, std::fabs(ho[tt * W + ch] - h[static_cast<size_t>(ch)]) / (1.0 + std::fabs(h[static_cast<size_t>(ch)])));
    }
  }
  EXPECT_LE(worst_u, 1e-5);
  EXPECT_LE(worst_h, 1e-5);
}

// The reset (a_t = 0 at a sequence's first token) would discard a decays write there and an h written
// before it: both are WriteErrors, not silent no-ops; the same decays write one token later is taken.
TEST(RecurrentGemma, WritesTheResetDiscardsAreRefused) {
  GoldenCase c("recurrent_gemma", "griffin");
  const std::string p = mix(rg_layers(c.model).at(0), "");
  const auto decays_at = [](int64_t tok) {
    return [tok](Tensor& v, const SiteContext&) {
      const int64_t W = v.size(2);
      for (int64_t ch = 0; ch < W; ++ch) v[tok * W + ch] = -5.0f;
    };
  };
  Trace at0;
  at0.edit(p + "decays", decays_at(0));
  EXPECT_THROW(c.model.run(c.prompts, &at0), WriteError);
  Trace at1;
  at1.edit(p + "decays", decays_at(1));
  EXPECT_GT(max_abs_diff(c.model.run(c.prompts, &at1), c.model.run(c.prompts)), 0.0);
  // An h given to a fresh prompt (its state_input is None: set, not edited).
  Trace out;
  out.save(p + "state_output");
  c.model.run(c.prompts, &out);
  Tensor h_only(out.get(p + "state_output").shape());
  const int64_t K = h_only.size(1), W = h_only.size(2);
  for (int64_t ch = 0; ch < W; ++ch) h_only[(K - 1) * W + ch] = 0.5f;
  Trace h0;
  h0.set(p + "state_input", h_only);
  EXPECT_THROW(c.model.run(c.prompts, &h0), WriteError);
}

TEST(RecurrentGemma, ChunkedRouteAndChunkSizeAreRefusedWithTheReason) {
  Model m = Model::load(fixture("recurrent_gemma/griffin").string());
  try {
    route_kernels("recurrent_gemma", "chunked");
    ADD_FAILURE() << "a chunked route was accepted";
  } catch (const UnsupportedError& e) {
    EXPECT_NE(std::string(e.what()).find("no chunked kernel"), std::string::npos) << e.what();
  }
  route_kernels("recurrent_gemma", "recurrent");  // the one kernel: accepted
  route_kernels("recurrent_gemma", "default");
  EXPECT_THROW(m.set_chunk_size(8), UnsupportedError);
  const auto s = m.support();
  EXPECT_EQ(s.at("linear_attn.decays").at(0), "");
  EXPECT_NE(s.at("linear_attn.attention_queries").at(0), "");
  EXPECT_NE(s.at("linear_attn.decays").at(2).find("local attention block"), std::string::npos);
}

// values.md invariants on a random prompt of each case: one call equals a prefix then the rest from
// the cache; each row of a left-padded batch equals its unbatched run (the padded tokens' states
// exactly zero); writes that leave a value as served change nothing.
TEST(RecurrentGemma, InvariantTables) {
  for (const auto& name : fixture_cases("recurrent_gemma")) {
    Model m = Model::load(fixture("recurrent_gemma/" + name).string());
    const std::vector<int32_t> prompt = {5, 9, 14, 3, 77, 41, 8, 60, 12, 33, 2, 19};
    expect_continuation_equals_whole(m, prompt, {1, 2, 5, 11});
    expect_batched_equals_unbatched(m, {prompt, {7, 8, 9}, {40, 41, 42, 43, 44, 45, 46}});
    expect_unchanged_writes_change_nothing(m, {prompt, {7, 8, 9}});
  }
}

}  // namespace
