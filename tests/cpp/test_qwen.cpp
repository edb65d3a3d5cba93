// Qwen3.5 / Qwen3-Next (gated DeltaNet hybrids) parity with transformers (golden fixtures from
// scripts/make_fixtures.py, dev/mixlens_dev/fixtures/qwen.py), the values.md invariants, the two
// delta-rule kernels agreeing, and load-time errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "fixture_util.h"
#include "recurrent_checks.h"
#include "io/json.h"
#include "mixers/gated_delta.h"
#include "mixlens/errors.h"
#include "ops/kernels.h"

using namespace mixlens;
using namespace mixlens::test;
namespace fs = std::filesystem;

namespace {

struct Param {
  std::string family, name;
};
std::string param_name(const ::testing::TestParamInfo<Param>& p) { return p.param.family + "_" + p.param.name; }

std::vector<Param> all_cases() {
  std::vector<Param> out;
  for (const char* f : {"qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "kimi_linear"})
    for (const auto& n : fixture_cases(f)) out.push_back({f, n});
  return out;
}

class QwenFixture : public ::testing::TestWithParam<Param> {};

// Kimi Delta Attention decays each key channel: its mixer says so (docs/values.md, kernel identity).
std::string gdn_kind(const std::string& family) { return family == "kimi_linear" ? "kimi_delta" : "gated_delta"; }

TEST_P(QwenFixture, EveryValueEveryStepMatchesTransformers) {
  GoldenCase c(GetParam().family, GetParam().name);
  Trace t;
  save_all_values(c.model, t);
  run_recorded_steps(c, &t);
  EXPECT_GT(expect_golden_values(c.golden, t, c.name), 100);
  ASSERT_EQ(t.calls().size(), static_cast<size_t>(c.n_steps));
  EXPECT_EQ(t.calls()[0].kernel, "chunked");
  // A multi-token continuation runs the chunked kernel from the cached state; one token decodes.
  EXPECT_EQ(t.calls()[1].kernel, t.calls()[1].seq > 1 ? "chunked" : "recurrent");
  EXPECT_FALSE(t.calls()[1].fresh);
  expect_kernel_identity(c.model, t, gdn_kind(GetParam().family));
  EXPECT_FALSE(t.has("layers.0.linear_attn.state_input", 0)) << "state_input is None on a fresh prompt";
}

TEST_P(QwenFixture, ForcedKernelPathsMatchTransformersToo) {
  GoldenCase c(GetParam().family, GetParam().name);
  for (const char* route : {"recurrent", "chunked"}) {
    route_kernels(GetParam().family, route);
    Trace t;
    save_all_values(c.model, t);
    run_recorded_steps(c, &t);
    expect_kernel_identity(c.model, t, gdn_kind(GetParam().family));
    route_kernels(GetParam().family, "default");
    EXPECT_GT(expect_golden_values(c.golden, t, c.name + " route " + route), 100);
    for (const auto& call : t.calls()) EXPECT_EQ(call.kernel, route);
  }
}

TEST_P(QwenFixture, GreedyTokensMatch) {
  GoldenCase c(GetParam().family, GetParam().name);
  if (!c.spec["greedy"].get<bool>()) GTEST_SKIP() << "case feeds a continuation, not greedy tokens";
  GenerateOptions o;
  o.max_new_tokens = c.n_steps;
  o.eos_token_id = -1;
  auto res = c.model.generate(c.prompts, o);
  for (size_t r = 0; r < c.tokens.size(); ++r) EXPECT_EQ(res.new_tokens[r], c.tokens[r]) << "row " << r;
}

TEST_P(QwenFixture, StateInvariants) {
  GoldenCase c(GetParam().family, GetParam().name);
  Trace t;
  t.save("layers.*.linear_attn.states").save("layers.*.linear_attn.state_output").save("layers.*.linear_attn.state_input");
  run_recorded_steps(c, &t);
  int checked = 0;
  for (int l = 0; l < c.model.info().num_layers; ++l) {
    if (c.model.info().layer_kinds[static_cast<size_t>(l)] != LayerKind::gated_deltanet) continue;
    const std::string p = "layers." + std::to_string(l) + ".linear_attn.";
    for (int s = 0; s < c.n_steps; ++s) {
      const Tensor& st = t.get(p + "states", s);
      const Tensor& out = t.get(p + "state_output", s);
      const int64_t B = st.size(0), T = st.size(1), per = out.numel() / B;
      for (int64_t b = 0; b < B; ++b)  // bit-exact: the chunked kernel stores its own chunk-end state
        ASSERT_EQ(0, std::memcmp(st.data() + (b * T + T - 1) * per, out.data() + b * per, sizeof(float) * per)) << p << s;
      if (s + 1 < c.n_steps) {
        ASSERT_EQ(0, std::memcmp(t.get(p + "state_input", s + 1).data(), out.data(), sizeof(float) * out.numel()));
      }
      ++checked;
    }
  }
  EXPECT_GT(checked, 0);
}

TEST_P(QwenFixture, EditsMatchTransformersWithTheSameModification) {
  GoldenCase c(GetParam().family, GetParam().name);
  if (c.spec["edits"].empty()) GTEST_SKIP() << "case has no edits";
  EXPECT_GT(expect_edits_match(c, /*last_step_changes=*/true), 0);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, QwenFixture, ::testing::ValuesIn(all_cases()), param_name);

// ---- the two kernels -------------------------------------------------------------------------

struct KernelInputs {
  int64_t B, T, H, Dk, Dv;
  std::vector<float> q, k, v, g, beta, S0;
  bool per_key = false;  // g is [B,T,H,Dk] (Kimi Delta Attention)
};

KernelInputs random_inputs(int64_t B, int64_t T, int64_t H, int64_t Dk, int64_t Dv, float g_lo, float g_hi, uint32_t seed,
                           bool per_key = false) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  KernelInputs x{B, T, H, Dk, Dv, {}, {}, {}, {}, {}, {}, per_key};
  auto fill = [&](std::vector<float>& a, int64_t size, auto gen) {
    a.resize(static_cast<size_t>(size));
    for (auto& e : a) e = gen();
  };
  fill(x.q, B * T * H * Dk, [&] { return n(rng); });
  fill(x.k, B * T * H * Dk, [&] { return n(rng); });
  fill(x.v, B * T * H * Dv, [&] { return n(rng); });
  fill(x.g, B * T * H * (per_key ? Dk : 1), [&] { return g_lo + (g_hi - g_lo) * u(rng); });
  fill(x.beta, B * T * H, [&] { return u(rng); });
  fill(x.S0, B * H * Dk * Dv, [&] { return 0.3f * n(rng); });
  return x;
}

struct KernelOut {
  Tensor o, S, states;
};

detail::GatedDeltaArgs kernel_args(const KernelInputs& x) {
  detail::GatedDeltaArgs a;
  a.B = x.B; a.T = x.T; a.H = x.H; a.Dk = x.Dk; a.Dv = x.Dv;
  a.q = x.q.data(); a.k = x.k.data(); a.v = x.v.data(); a.g = x.g.data(); a.beta = x.beta.data();
  a.g_per_key = x.per_key;
  return a;
}

// `splits`: the scan runs as calls over [0, s0), [s0, s1), ..., [s_last, T), each from the state the
// previous one left (a continuation).
KernelOut run_kernel(const KernelInputs& x, bool chunked, bool with_states, const std::vector<int64_t>& splits = {}) {
  KernelOut r{Tensor({x.B, x.T, x.H, x.Dv}), Tensor::from({x.B, x.H, x.Dk, x.Dv}, x.S0),
              with_states ? Tensor({x.B, x.T, x.H, x.Dk, x.Dv}) : Tensor()};
  detail::GatedDeltaArgs a = kernel_args(x);
  a.S = r.S.data(); a.o = r.o.data(); a.states = with_states ? r.states.data() : nullptr;
  std::vector<int64_t> ends = splits;
  ends.push_back(x.T);
  for (int64_t t0 = 0; int64_t t1 : ends) {
    a.t_begin = t0;
    a.t_end = t1;
    if (chunked) detail::gated_delta_chunked(a); else detail::gated_delta_recurrent(a);
    t0 = t1;
  }
  return r;
}

// The delta rule token by token in double, from the model-math order: S = diag(exp(g)) S (g per head
// or per key channel), delta = beta (v - S^T k), S += k delta^T, o = S^T q; q, k L2-normed (eps 1e-6
// under the sqrt), q / sqrt(Dk). Returns o [B,T,H,Dv] and the final state [B,H,Dk,Dv].
std::pair<std::vector<double>, std::vector<double>> double_recurrence(const KernelInputs& x) {
  const int64_t H = x.H, Dk = x.Dk, Dv = x.Dv, gn = x.per_key ? Dk : 1;
  std::vector<double> ref_o(static_cast<size_t>(x.B * x.T * H * Dv)), ref_S(x.S0.begin(), x.S0.end());
  for (int64_t b = 0; b < x.B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      double* S = ref_S.data() + (b * H + h) * Dk * Dv;
      for (int64_t t = 0; t < x.T; ++t) {
        const int64_t r = (b * x.T + t) * H + h;
        std::vector<double> q(static_cast<size_t>(Dk)), k(static_cast<size_t>(Dk));
        double qs = 0, ks = 0;
        for (int64_t d = 0; d < Dk; ++d) {
          q[static_cast<size_t>(d)] = x.q[static_cast<size_t>(r * Dk + d)];
          k[static_cast<size_t>(d)] = x.k[static_cast<size_t>(r * Dk + d)];
          qs += q[static_cast<size_t>(d)] * q[static_cast<size_t>(d)];
          ks += k[static_cast<size_t>(d)] * k[static_cast<size_t>(d)];
        }
        for (int64_t d = 0; d < Dk; ++d) {
          q[static_cast<size_t>(d)] /= std::sqrt(qs + 1e-6) * std::sqrt(static_cast<double>(Dk));
          k[static_cast<size_t>(d)] /= std::sqrt(ks + 1e-6);
          const double decay = std::exp(static_cast<double>(x.g[static_cast<size_t>(r * gn + (gn > 1 ? d : 0))]));
          for (int64_t e = 0; e < Dv; ++e) S[d * Dv + e] *= decay;
        }
        const double be = x.beta[static_cast<size_t>(r)];
        for (int64_t e = 0; e < Dv; ++e) {
          double kS = 0;
          for (int64_t d = 0; d < Dk; ++d) kS += k[static_cast<size_t>(d)] * S[d * Dv + e];
          const double delta = (x.v[static_cast<size_t>(r * Dv + e)] - kS) * be;
          double o = 0;
          for (int64_t d = 0; d < Dk; ++d) {
            S[d * Dv + e] += k[static_cast<size_t>(d)] * delta;
            o += S[d * Dv + e] * q[static_cast<size_t>(d)];
          }
          ref_o[static_cast<size_t>(r * Dv + e)] = o;
        }
      }
    }
  return {ref_o, ref_S};
}

double rel_rms_vs(const Tensor& ours, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = ours[static_cast<int64_t>(i)] - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

TEST(GatedDelta, ChunkedAndRecurrentAgreeOnEveryValue) {
  // 150 tokens = 2 full chunks + a ragged one; g = 0 is the no-decay edge (exp(0) = 1 everywhere).
  for (auto [lo, hi] : {std::pair{-2.0f, 0.0f}, std::pair{0.0f, 0.0f}, std::pair{-30.0f, -10.0f}}) {
    KernelInputs x = random_inputs(2, 150, 3, 8, 6, lo, hi, 7);
    KernelOut c = run_kernel(x, true, true), r = run_kernel(x, false, true);
    EXPECT_LE(rel_rms(c.o, r.o), 1e-5) << "g in [" << lo << ", " << hi << "]";
    EXPECT_LE(rel_rms(c.S, r.S), 1e-5);
    EXPECT_LE(rel_rms(c.states, r.states), 1e-5);
    KernelOut quiet = run_kernel(x, true, false);  // asking for states changes nothing else
    EXPECT_EQ(0, std::memcmp(quiet.o.data(), c.o.data(), sizeof(float) * c.o.numel()));
    EXPECT_EQ(0, std::memcmp(quiet.S.data(), c.S.data(), sizeof(float) * c.S.numel()));
  }
}

// The per-token states replay at the published head size (128 x 128: the AVX2 replay's 32-column
// blocks) and at sizes with a ragged column tail, on every ISA level this CPU has: each token's
// state equals the token recurrence's, and the last token's is the final state exactly.
TEST(GatedDelta, StatesReplayMatchesTheRecurrenceOnEveryIsa) {
  struct Restore {
    ops::Isa isa = ops::isa();
    ~Restore() { ops::set_isa(isa); }
  } restore;
  struct Size {
    int64_t H, Dk, Dv;
  };
  for (ops::Isa isa : {ops::Isa::scalar, ops::best_isa()}) {
    ops::set_isa(isa);
    for (const Size z : {Size{2, 128, 128}, Size{3, 24, 40}, Size{1, 8, 70}}) {
      KernelInputs x = random_inputs(1, 130, z.H, z.Dk, z.Dv, -1.0f, 0.0f, 11);
      KernelOut c = run_kernel(x, true, true), r = run_kernel(x, false, true);
      const std::string what = std::string(ops::isa_name(isa)) + " H=" + std::to_string(z.H) +
                               " Dk=" + std::to_string(z.Dk) + " Dv=" + std::to_string(z.Dv);
      EXPECT_LE(rel_rms(c.states, r.states), 1e-5) << what;
      const int64_t per = z.H * z.Dk * z.Dv;
      // Token by token (a wrong stride or column block shows in one token only).
      for (int64_t t = 0; t < x.T; ++t) {
        Tensor ct({per}), rt({per});
        std::memcpy(ct.data(), c.states.data() + t * per, sizeof(float) * per);
        std::memcpy(rt.data(), r.states.data() + t * per, sizeof(float) * per);
        ASSERT_LE(rel_rms(ct, rt), 1e-5) << what << " token " << t;
      }
      EXPECT_EQ(0, std::memcmp(c.states.data() + (x.T - 1) * per, c.S.data(), sizeof(float) * per)) << what;
    }
  }
}

TEST(GatedDelta, LongPromptStaysFinite) {
  // 2,048 tokens, strong decays: a cumulative log-decay of ~-4000 inside a chunk must not overflow.
  KernelInputs x = random_inputs(1, 2048, 2, 16, 16, -8.0f, 0.0f, 3);
  KernelOut c = run_kernel(x, true, true), r = run_kernel(x, false, false);
  EXPECT_FALSE(c.o.has_nan());
  EXPECT_FALSE(c.S.has_nan());
  EXPECT_FALSE(c.states.has_nan());
  EXPECT_LE(rel_rms(c.o, r.o), 1e-5);
  EXPECT_LE(rel_rms(c.S, r.S), 1e-5);
}

// Keys that are nearly the same within a chunk make (I + A) of the UT transform ill-conditioned: the
// chunked kernel (double-precision solve) must still match a double-precision token recurrence.
TEST(GatedDelta, NearlyEqualKeysMatchADoubleRecurrence) {
  const int64_t T = 130, H = 2, Dk = 16, Dv = 8;
  KernelInputs x = random_inputs(1, T, H, Dk, Dv, -0.05f, 0.0f, 5);
  std::mt19937 rng(9);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> common(static_cast<size_t>(Dk));
  for (float& c : common) c = n(rng);
  for (int64_t r = 0; r < T * H; ++r) {
    for (int64_t d = 0; d < Dk; ++d) x.k[static_cast<size_t>(r * Dk + d)] = common[static_cast<size_t>(d)] + 1e-2f * n(rng);
    x.beta[static_cast<size_t>(r)] = 0.9f + 0.1f * x.beta[static_cast<size_t>(r)];
  }
  KernelOut c = run_kernel(x, true, false);
  EXPECT_LE(rel_rms_vs(c.o, double_recurrence(x).first), 1e-5);
}

// Kimi Delta Attention (g_per_key): both kernels against the double recurrence, with decays that
// differ per key channel (no decay, mild, strong, and a spread where channels keep from ~all to
// ~nothing of their row), 150 tokens = 2 whole chunks + a ragged one, on every ISA level.
TEST(KimiDelta, BothKernelsMatchADoubleRecurrence) {
  struct Restore {
    ops::Isa isa = ops::isa();
    ~Restore() { ops::set_isa(isa); }
  } restore;
  for (ops::Isa isa : {ops::Isa::scalar, ops::best_isa()}) {
    ops::set_isa(isa);
    for (auto [lo, hi] : {std::pair{0.0f, 0.0f}, std::pair{-0.5f, 0.0f}, std::pair{-30.0f, -10.0f}, std::pair{-8.0f, 0.0f}}) {
      KernelInputs x = random_inputs(2, 150, 3, 16, 8, lo, hi, 21, true);
      const auto [ref_o, ref_S] = double_recurrence(x);
      const std::string what = std::string(ops::isa_name(isa)) + " g in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
      for (bool chunked : {true, false}) {
        KernelOut c = run_kernel(x, chunked, true);
        EXPECT_LE(rel_rms_vs(c.o, ref_o), 1e-5) << what << (chunked ? " chunked" : " recurrent");
        EXPECT_LE(rel_rms_vs(c.S, ref_S), 1e-5) << what << (chunked ? " chunked" : " recurrent");
        const int64_t per = x.H * x.Dk * x.Dv;
        for (int64_t b = 0; b < x.B; ++b)  // the last token's state is the final state, bit for bit
          EXPECT_EQ(0, std::memcmp(c.states.data() + ((b + 1) * x.T - 1) * per, c.S.data() + b * per, sizeof(float) * per))
              << what;
      }
      KernelOut c = run_kernel(x, true, true), r = run_kernel(x, false, true);
      EXPECT_LE(rel_rms(c.states, r.states), 1e-5) << what;
    }
  }
}

// A scan split over calls (continuations from the state the last call left) equals one call: bit for
// bit on the recurrence and on chunk-aligned splits of the chunked kernel, within rounding on ragged
// ones (the chunk grid moves); and the same double recurrence on either.
TEST(KimiDelta, SplitOverCallsEqualsOneCall) {
  KernelInputs x = random_inputs(1, 150, 2, 16, 8, -2.0f, 0.0f, 23, true);
  const auto [ref_o, ref_S] = double_recurrence(x);
  for (bool chunked : {true, false}) {
    KernelOut whole = run_kernel(x, chunked, true);
    KernelOut aligned = run_kernel(x, chunked, true, {64, 128});
    EXPECT_EQ(0, std::memcmp(whole.o.data(), aligned.o.data(), sizeof(float) * whole.o.numel())) << chunked;
    EXPECT_EQ(0, std::memcmp(whole.S.data(), aligned.S.data(), sizeof(float) * whole.S.numel())) << chunked;
    KernelOut ragged = run_kernel(x, chunked, true, {1, 37, 149});
    EXPECT_LE(rel_rms(ragged.o, whole.o), 1e-5) << chunked;
    EXPECT_LE(rel_rms(ragged.states, whole.states), 1e-5) << chunked;
    EXPECT_LE(rel_rms_vs(ragged.o, ref_o), 1e-5) << chunked;
    EXPECT_LE(rel_rms_vs(ragged.S, ref_S), 1e-5) << chunked;
  }
}

// With every channel's decay equal to the head's, the per-key option is the gated DeltaNet: bit for
// bit on the recurrence (the same exp per row), within rounding on the chunked kernel (a different
// order of products).
TEST(KimiDelta, EqualChannelDecaysAreTheGatedDeltaNet) {
  KernelInputs head = random_inputs(1, 150, 2, 16, 8, -1.0f, 0.0f, 25);
  KernelInputs key = head;
  key.per_key = true;
  key.g.clear();
  for (float g : head.g) key.g.insert(key.g.end(), static_cast<size_t>(head.Dk), g);
  KernelOut hr = run_kernel(head, false, true), kr = run_kernel(key, false, true);
  EXPECT_EQ(0, std::memcmp(hr.o.data(), kr.o.data(), sizeof(float) * hr.o.numel()));
  EXPECT_EQ(0, std::memcmp(hr.states.data(), kr.states.data(), sizeof(float) * hr.states.numel()));
  KernelOut hc = run_kernel(head, true, true), kc = run_kernel(key, true, true);
  EXPECT_LE(rel_rms(hc.o, kc.o), 1e-6);
  EXPECT_LE(rel_rms(hc.S, kc.S), 1e-6);
}

// gated_delta_state_at on a per-key chunk is the chunked kernel's own per-token state, bit for bit.
TEST(KimiDelta, StateAtIsTheKernelsPerTokenState) {
  KernelInputs x = random_inputs(1, 150, 2, 16, 8, -3.0f, 0.0f, 27, true);
  KernelOut c = run_kernel(x, true, true);
  const int64_t C = 64, per = x.H * x.Dk * x.Dv;
  Tensor S = Tensor::from({1, x.H, x.Dk, x.Dv}, x.S0), o({1, x.T, x.H, x.Dv}), entry({1, x.H, x.Dk, x.Dv});
  std::vector<float> kn(static_cast<size_t>(x.H * C * x.Dk)), delta(static_cast<size_t>(x.H * C * x.Dv));
  detail::GatedDeltaArgs a = kernel_args(x);
  a.S = S.data(); a.o = o.data();
  a.t_end = 128;
  detail::gated_delta_chunked(a);
  std::memcpy(entry.data(), S.data(), sizeof(float) * per);
  a.t_begin = 128; a.t_end = -1; a.last_kn = kn.data(); a.last_delta = delta.data();
  detail::gated_delta_chunked(a);
  a.S = entry.data();
  for (int64_t t = 128; t < x.T; ++t) {
    Tensor at({per});
    detail::gated_delta_state_at(a, t, at.data());
    EXPECT_EQ(0, std::memcmp(at.data(), c.states.data() + t * per, sizeof(float) * per)) << "token " << t;
  }
}

TEST(Qwen, LongPromptThroughTheModelStaysFinite) {
  GoldenCase c("qwen3_5", "hv_eq_hk_chunks");
  std::vector<int32_t> prompt(2048);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(1 + (i * 37) % 96);
  Trace t;
  t.save("layers.0.linear_attn.states").save("layers.3.linear_attn.state_output");
  Tensor logits = c.model.run({prompt}, &t);
  EXPECT_FALSE(logits.has_nan());
  EXPECT_FALSE(t.get("layers.0.linear_attn.states").has_nan());
  EXPECT_EQ(t.get("layers.0.linear_attn.states").shape(), (Shape{1, 2048, 2, 8, 8}));
}

// ---- invariants on the model ------------------------------------------------------------------

TEST(Qwen, PrefixThenContinuationEqualsWholePrompt) {
  GoldenCase c("qwen3_5", "hv_eq_hk_chunks");  // 70 tokens: splits inside and across a chunk
  const auto& prompt = c.prompts[0];
  Trace whole;
  whole.save("logits").save("layers.*.linear_attn.states").save("layers.*.linear_attn.state_output");
  c.model.run({prompt}, &whole);
  for (size_t split : {size_t{1}, size_t{3}, size_t{30}, size_t{64}, prompt.size() - 1}) {
    Cache cache = c.model.new_cache(1);
    Trace parts;
    parts.save("logits").save("layers.*.linear_attn.states").save("layers.*.linear_attn.state_output");
    c.model.forward(Batch::left_padded({{prompt.begin(), prompt.begin() + static_cast<long>(split)}}, 0), cache, &parts);
    c.model.forward(Batch::left_padded({{prompt.begin() + static_cast<long>(split), prompt.end()}}, 0), cache, &parts);
    const Tensor& full = whole.get("logits");
    const Tensor& tail = parts.get("logits", 1);
    const int64_t V = full.size(2), n = tail.size(1);
    Tensor full_tail({1, n, V});
    std::memcpy(full_tail.data(), full.data() + (full.size(1) - n) * V, sizeof(float) * n * V);
    EXPECT_LE(rel_rms(tail, full_tail), 1e-5) << "split " << split;
    for (int l : {0, 1, 3}) {
      const std::string p = "layers." + std::to_string(l) + ".linear_attn.";
      EXPECT_LE(rel_rms(parts.get(p + "state_output", 1), whole.get(p + "state_output")), 1e-5) << p << split;
      const Tensor& ws = whole.get(p + "states");
      const Tensor& ps = parts.get(p + "states", 1);
      const int64_t per = ps.numel() / n;
      Tensor w_tail({ps.shape()});
      std::memcpy(w_tail.data(), ws.data() + (ws.size(1) - n) * per, sizeof(float) * ps.numel());
      EXPECT_LE(rel_rms(ps, w_tail), 1e-5) << p << split;
    }
  }
}

// With only the last position's logits returned and nothing observed, the last block runs its
// queries / attention / o_proj (attention block) and its MLP on the last row of each sequence only.
// Its logits equal the last row of the full forward's, and the cache it leaves is the same: the next
// decode step gives bitwise the same logits. Cases: the last block a GDN (qwen3_5 padded_batch,
// qwen3_next moe_hv_2hk) or softmax attention (qwen3_5 short_prompt, qwen3_next padded_batch).
TEST(Qwen, LastPositionLogitsRunTheLastBlockOnLastRowsAndLeaveTheSameCache) {
  struct Case {
    const char *family, *name;
  };
  for (const Case k : {Case{"qwen3_5", "padded_batch"}, Case{"qwen3_5", "short_prompt"},
                       Case{"qwen3_next", "padded_batch"}, Case{"qwen3_next", "moe_hv_2hk"},
                       Case{"qwen3_5_moe", "moe_hv_2hk"},
                       Case{"olmo_hybrid", "hv_2hk_chunks"}, Case{"olmo_hybrid", "padded_batch"}}) {
    const std::string what = std::string(k.family) + "/" + k.name;
    GoldenCase c(k.family, k.name);
    const Batch in = Batch::left_padded(c.prompts, 0);
    const int64_t B = in.batch, T = in.seq;
    Cache full_cache = c.model.new_cache(B), last_cache = c.model.new_cache(B);
    const Tensor full = c.model.forward(in, full_cache, nullptr, /*all_logits=*/true);
    const Tensor last = c.model.forward(in, last_cache, nullptr, /*all_logits=*/false);
    const int64_t V = full.size(2);
    ASSERT_EQ(last.shape(), (Shape{B, 1, V})) << what;
    Tensor full_last({B, 1, V});
    for (int64_t b = 0; b < B; ++b)
      std::memcpy(full_last.data() + b * V, full.data() + (b * T + T - 1) * V, sizeof(float) * V);
    EXPECT_LE(rel_rms(last, full_last), 1e-6) << what;
    // An observed call runs every row (here: the last block's output is saved) and agrees too.
    Trace t;
    t.save("layers." + std::to_string(c.model.info().num_layers - 1) + ".layer_output");
    Cache seen_cache = c.model.new_cache(B);
    const Tensor seen = c.model.forward(in, seen_cache, &t, /*all_logits=*/false);
    EXPECT_EQ(t.get("layers." + std::to_string(c.model.info().num_layers - 1) + ".layer_output").size(1), T) << what;
    EXPECT_LE(rel_rms(seen, full_last), 1e-6) << what;
    const Batch step = Batch::left_padded(std::vector<std::vector<int32_t>>(static_cast<size_t>(B), {5}), 0);
    const Tensor a = c.model.forward(step, full_cache), b = c.model.forward(step, last_cache);
    ASSERT_EQ(a.shape(), b.shape()) << what;
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), sizeof(float) * static_cast<size_t>(a.numel()))) << what;
  }
}

TEST(Qwen, BatchedEqualsUnbatchedUnderLeftPadding) {
  for (const char* family : {"qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid"}) {
    GoldenCase c(family, "padded_batch");
    Trace batched;
    batched.save("logits").save("layers.0.linear_attn.states");
    c.model.run(c.prompts, &batched);
    const int64_t T = batched.get("logits").size(1);
    for (size_t r = 0; r < c.prompts.size(); ++r) {
      Trace single;
      single.save("logits");
      c.model.run({c.prompts[r]}, &single);
      const Tensor& lb = batched.get("logits");
      const Tensor& ls = single.get("logits");
      const int64_t n = ls.size(1), V = ls.size(2), pad = T - n;
      Tensor row({1, n, V});
      std::memcpy(row.data(), lb.data() + (static_cast<int64_t>(r) * T + pad) * V, sizeof(float) * n * V);
      EXPECT_LE(rel_rms(row, ls), 1e-5) << family << " row " << r;
      const Tensor& st = batched.get("layers.0.linear_attn.states");  // zero while only padding was seen
      const int64_t per = st.numel() / (st.size(0) * T);
      for (int64_t t = 0; t < pad * per; ++t) ASSERT_EQ(st[static_cast<int64_t>(r) * T * per + t], 0.0f) << family;
    }
  }
}

TEST(Qwen, BetasAndDecaysAreIndependentWrites) {
  GoldenCase c("qwen3_5", "hv_2hk");
  Trace t;
  t.save("layers.0.linear_attn.betas").save("layers.0.linear_attn.decays");
  t.edit("layers.0.linear_attn.betas", [](Tensor& v, const SiteContext&) { v[0] = 0.0f; });
  Trace base;
  base.save("layers.0.linear_attn.decays");
  c.model.run(c.prompts, &base);
  c.model.run(c.prompts, &t);
  EXPECT_EQ(0, std::memcmp(t.get("layers.0.linear_attn.decays").data(), base.get("layers.0.linear_attn.decays").data(),
                           sizeof(float) * base.get("layers.0.linear_attn.decays").numel()));
}

TEST(Qwen, ValuesAndSupportFollowTheLayerKind) {
  GoldenCase c("qwen3_5", "hv_2hk");  // layer_types [linear, full, linear], HK 2, HV 4
  const auto& kinds = c.model.info().layer_kinds;
  ASSERT_EQ(kinds, (std::vector<LayerKind>{LayerKind::gated_deltanet, LayerKind::attention, LayerKind::gated_deltanet}));
  auto sup = c.model.support();
  EXPECT_EQ(sup["linear_attn.states"][0], "");
  EXPECT_NE(sup["linear_attn.states"][1].find("attention"), std::string::npos);
  EXPECT_EQ(sup["self_attn.attention_output"][1], "");
  EXPECT_NE(sup["self_attn.attention_output"][0].find("gated_deltanet"), std::string::npos);
  EXPECT_EQ(sup["mlp.output"][1], "");
  for (const auto& v : c.model.values(2, 5)) {
    if (v.path == "layers.0.linear_attn.attention_queries") {
      EXPECT_EQ(v.shape, (Shape{2, 5, 4, 8}));
    } else if (v.path == "layers.0.linear_attn.states") {
      EXPECT_EQ(v.shape, (Shape{2, 5, 4, 8, 8}));
    } else if (v.path == "layers.1.self_attn.attention_keys") {
      EXPECT_EQ(v.shape, (Shape{2, 5, 2, 16}));
    }
  }
  auto message = [&](const std::string& path) {
    Trace t;
    t.save(path);
    try {
      c.model.run(c.prompts, &t);
    } catch (const UnknownValueError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message("layers.1.linear_attn.betas").find("attention block"), std::string::npos);
  EXPECT_NE(message("layers.0.self_attn.gate").find("gated_deltanet block"), std::string::npos);
}

// OLMo-Hybrid's attention blocks are post-norm and ungated: no gate value, and support() says why.
TEST(Qwen, OlmoHybridAttentionHasNoGateAndSaysSo) {
  GoldenCase c("olmo_hybrid", "hv_2hk_chunks");
  for (const ValueInfo& v : c.model.values(1, 3)) EXPECT_NE(v.path, "layers.1.self_attn.gate");
  Trace t;
  t.save("layers.1.self_attn.gate");
  try {
    c.model.run(c.prompts, &t);
    ADD_FAILURE() << "saving an ungated attention's gate did not raise";
  } catch (const UnknownValueError& e) {
    EXPECT_NE(std::string(e.what()).find("no output gate"), std::string::npos) << e.what();
  }
}

TEST(Qwen, WritesAreValidated) {
  GoldenCase c("qwen3_5", "hv_2hk");
  auto run_with = [&](const std::string& path, EditFn fn) {
    Trace t;
    t.edit(path, std::move(fn));
    c.model.run(c.prompts, &t);
  };
  EXPECT_THROW(run_with("layers.0.linear_attn.attention_keys", [](Tensor& v, const SiteContext&) { v = Tensor({1, 20, 2, 8}); }),
               WriteError);  // keys are served per value head (4), not per key head (2)
  EXPECT_THROW(run_with("layers.0.linear_attn.decays", [](Tensor& v, const SiteContext&) { v[0] = 0.5f; }), WriteError);
  EXPECT_THROW(run_with("layers.0.linear_attn.states", [](Tensor&, const SiteContext&) {}), WriteError);
}

// ---- loading ----------------------------------------------------------------------------------

// A copy of a fixture checkpoint with config.json edited by `patch` (and optionally other files).
fs::path patched_copy(const std::string& rel, const std::string& tag, const std::function<void(nlohmann::json&)>& patch) {
  const fs::path src = fixture(rel);
  const fs::path dst = fs::temp_directory_path() / ("mixlens_qwen_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(dst);
  fs::create_directories(dst);
  fs::copy_file(src / "model.safetensors", dst / "model.safetensors");
  nlohmann::json cfg = read_json(src / "config.json");
  patch(cfg);
  std::ofstream(dst / "config.json") << cfg.dump();
  return dst;
}

template <class E>
std::string load_error(const fs::path& dir) {
  try {
    Model::load(dir.string());
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong error type: ") + e.what();
  }
  return "no error";
}

TEST(QwenLoad, BadConfigsAreClearErrors) {
  auto d1 = patched_copy("qwen3_5/hv_2hk", "heads", [](nlohmann::json& c) { c["linear_num_value_heads"] = 3; });
  EXPECT_NE(load_error<ConfigError>(d1).find("linear_num_value_heads (3) is not divisible by linear_num_key_heads (2)"),
            std::string::npos) << load_error<ConfigError>(d1);
  auto d2 = patched_copy("qwen3_5/hv_2hk", "types", [](nlohmann::json& c) { c["layer_types"].erase(0); });
  EXPECT_NE(load_error<ConfigError>(d2).find("layer_types has 2 entries but num_hidden_layers is 3"), std::string::npos)
      << load_error<ConfigError>(d2);
  auto d3 = patched_copy("qwen3_5/hv_2hk", "kv", [](nlohmann::json& c) { c["num_key_value_heads"] = 3; });
  EXPECT_NE(load_error<ConfigError>(d3).find("num_attention_heads (4) is not divisible by num_key_value_heads (3)"),
            std::string::npos);
  // A layer declared full_attention whose checkpoint has no attention weights (a GDN layer there).
  auto d4 = patched_copy("qwen3_5/hv_2hk", "missing", [](nlohmann::json& c) { c["layer_types"][0] = "full_attention"; });
  EXPECT_NE(load_error<CheckpointError>(d4).find("model.layers.0.self_attn.q_proj.weight"), std::string::npos)
      << load_error<CheckpointError>(d4);
  for (const auto& d : {d1, d2, d3, d4}) fs::remove_all(d);
}

TEST(QwenLoad, TokenizerJsonGoesThroughTheByteLevelBpe) {
  auto dir = patched_copy("qwen3_5/short_prompt", "tok", [](nlohmann::json&) {});
  fs::create_symlink(fixture("tokenizer/qwen3/tokenizer.json"), dir / "tokenizer.json");
  Model m = Model::load(dir.string());
  ASSERT_TRUE(m.has_tokenizer());
  EXPECT_EQ(m.tokenizer().encode("Hello world"), (std::vector<int32_t>{9707, 1879}));
  fs::remove(dir / "tokenizer.json");
  std::ofstream(dir / "tokenizer.json") << R"({"version":"1.0","model":{"type":"WordPiece","vocab":{"a":0}}})";
  EXPECT_THROW(Model::load(dir.string()), TokenizerError);
  fs::remove_all(dir);
}

}  // namespace
