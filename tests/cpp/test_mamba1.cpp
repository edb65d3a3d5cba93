// Mamba-1 parity with transformers (golden fixtures from scripts/make_fixtures.py --family mamba and
// --family falcon_mamba: FalconMamba is the same mixer with RMS norms on dt_low, B and C), both
// selective-scan algorithms, the values.md invariants, edits and the Mamba-1 decays write rule.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include <unistd.h>

#include "recurrent_checks.h"
#include "mixers/selective_scan.h"
#include "mixlens/errors.h"

using namespace mixlens;
using namespace mixlens::test;

namespace {

// A Mamba-1 golden case (tests/fixtures/<family>/<name>, family "mamba" unless named).
struct Case : GoldenCase {
  std::string family;
  explicit Case(const std::string& n, const std::string& f = "mamba") : GoldenCase(f, n), family(f) {}
};

// Forces a family's route for one scope.
struct Routed {
  std::string family;
  explicit Routed(const char* route, std::string f = "mamba") : family(std::move(f)) { route_kernels(family, route); }
  ~Routed() { route_kernels(family, "default"); }
};

struct Param {
  std::string family, name;
};
std::string param_name(const ::testing::TestParamInfo<Param>& p) { return p.param.family + "_" + p.param.name; }
std::vector<Param> all_cases() {
  std::vector<Param> out;
  for (const char* f : {"mamba", "falcon_mamba"})
    for (const auto& n : fixture_cases(f)) out.push_back({f, n});
  return out;
}

class Mamba1Fixture : public ::testing::TestWithParam<Param> {
 protected:
  Case make() const { return Case(GetParam().name, GetParam().family); }
};

TEST_P(Mamba1Fixture, EveryValueEveryStepMatchesTransformers) {
  Case c = make();
  Trace t;
  save_all_values(c.model, t);
  run_recorded_steps(c, &t);
  expect_values_match(c, t, c.name + " default kernels");
  ASSERT_EQ(t.calls().size(), static_cast<size_t>(c.n_steps));
  EXPECT_TRUE(t.calls()[0].fresh);
  for (int s = 1; s < c.n_steps; ++s) {
    EXPECT_EQ(t.calls()[static_cast<size_t>(s)].kernel, "recurrent") << "decode steps use the single-token update";
    EXPECT_EQ(t.calls()[static_cast<size_t>(s)].seq, 1);
  }
  expect_kernel_identity(c.model, t, "selective_scan");
  EXPECT_FALSE(t.has("layers.0.linear_attn.state_input", 0)) << "state_input is None on a fresh prompt";
}

TEST_P(Mamba1Fixture, BothScanAlgorithmsMatchTransformers) {
  Case c = make();
  for (const char* route : {"recurrent", "chunked"}) {
    Routed r(route, c.family);
    Trace t;
    save_all_values(c.model, t);
    run_recorded_steps(c, &t);
    expect_values_match(c, t, c.name + " route " + route);
    for (const auto& call : t.calls()) EXPECT_EQ(call.kernel, route);
    expect_kernel_identity(c.model, t, "selective_scan");
  }
  // Short chunks: the prompt spans several chunks, so the carry between chunks is exercised.
  for (int64_t chunk : {1, 3, 4}) {
    Routed r("chunked", c.family);
    c.model.set_chunk_size(chunk);
    Trace t;
    save_all_values(c.model, t);
    run_recorded_steps(c, &t);
    c.model.set_chunk_size(0);
    expect_values_match(c, t, c.name + " chunked, chunk " + std::to_string(chunk));
  }
}

TEST_P(Mamba1Fixture, GreedyTokensMatch) {
  Case c = make();
  GenerateOptions o;
  o.max_new_tokens = c.n_steps;
  o.eos_token_id = -1;  // fixtures record greedy tokens without an EOS stop
  auto res = c.model.generate(c.prompts, o);
  ASSERT_EQ(res.new_tokens.size(), c.tokens.size());
  for (size_t r = 0; r < c.tokens.size(); ++r) EXPECT_EQ(res.new_tokens[r], c.tokens[r]) << "row " << r;
}

TEST_P(Mamba1Fixture, Invariants) {
  {
    // The token loop stores the very state it carries: states[:, -1] == state_output exactly.
    Routed r("recurrent", GetParam().family);
    expect_state_invariants(make(), 0.0);
  }
  Routed r("chunked", GetParam().family);
  Case c = make();
  c.model.set_chunk_size(3);
  expect_state_invariants(c, 1e-6);
}

TEST_P(Mamba1Fixture, EditsMatchTransformersWithTheSameModification) {
  Case c = make();
  if (c.spec["edits"].empty()) GTEST_SKIP() << "case has no edits";
  EXPECT_GT(expect_edits_match(c), 0);
  Routed r("chunked", c.family);
  c.model.set_chunk_size(4);
  EXPECT_GT(expect_edits_match(c), 0);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Mamba1Fixture, ::testing::ValuesIn(all_cases()), param_name);

// ---- the two scan algorithms, directly -------------------------------------------------------

struct ScanData {
  int64_t T, E, N;
  std::vector<float> u, dt, B, C, A, D, S0;
  ScanData(int64_t t, int64_t e, int64_t n, uint32_t seed) : T(t), E(e), N(n) {
    std::mt19937 g(seed);
    std::normal_distribution<float> nd;
    std::uniform_real_distribution<float> ud(0.0f, 1.0f);
    auto fill = [&](std::vector<float>& v, int64_t size, auto f) {
      v.resize(static_cast<size_t>(size));
      for (auto& x : v) x = f();
    };
    fill(u, T * E, [&] { return nd(g); });
    fill(dt, T * E, [&] { return 0.5f * ud(g) * ud(g); });
    fill(B, T * N, [&] { return nd(g); });
    fill(C, T * N, [&] { return nd(g); });
    fill(A, E * N, [&] { return -std::exp(2.0f * ud(g) - 1.0f); });
    fill(D, E, [&] { return nd(g); });
    fill(S0, E * N, [&] { return nd(g); });
  }
  // Runs one algorithm; returns y, the final state and the per-token states.
  std::vector<std::vector<float>> run(bool chunked, int64_t chunk, bool from_zero) const {
    std::vector<float> S = from_zero ? std::vector<float>(S0.size(), 0.0f) : S0;
    std::vector<float> y(static_cast<size_t>(T * E)), states(static_cast<size_t>(T * E * N));
    detail::SelectiveScanArgs a;
    a.T = T; a.E = E; a.N = N;
    a.u = u.data(); a.dt = dt.data(); a.B = B.data(); a.C = C.data(); a.A = A.data(); a.D = D.data();
    a.S = S.data(); a.y = y.data(); a.states = states.data(); a.chunk = chunk;
    if (chunked) detail::selective_scan_chunked(a); else detail::selective_scan_recurrent(a);
    return {y, S, states};
  }
};

double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  return rel_rms(Tensor::from({static_cast<int64_t>(a.size())}, a), Tensor::from({static_cast<int64_t>(b.size())}, b));
}

TEST(Mamba1Scan, ChunkedParallelScanEqualsTokenLoop) {
  // E not a multiple of the channel block, N not a multiple of 8, T not a multiple of any chunk.
  for (auto [E, N] : {std::pair<int64_t, int64_t>{70, 16}, {33, 5}}) {
    ScanData d(37, E, N, static_cast<uint32_t>(E));
    for (bool from_zero : {true, false}) {
      const auto ref = d.run(false, 0, from_zero);
      for (int64_t chunk : {1, 4, 8, 37, 64}) {
        const auto got = d.run(true, chunk, from_zero);
        for (size_t k = 0; k < 3; ++k)
          EXPECT_LE(rel_err(got[k], ref[k]), 2e-6) << "E " << E << " N " << N << " chunk " << chunk << " output " << k
                                                   << (from_zero ? " zero state" : " initial state");
      }
    }
  }
}

TEST(Mamba1Scan, TokenLoopIsTheDefiningRecurrence) {
  // A double-precision transcription of model-math.md §9.1 for the first channels.
  ScanData d(9, 40, 16, 3);
  const auto got = d.run(false, 0, false);
  for (int64_t e = 0; e < 5; ++e) {
    std::vector<double> S(d.S0.begin() + e * d.N, d.S0.begin() + (e + 1) * d.N);
    for (int64_t t = 0; t < d.T; ++t) {
      const double dt = d.dt[static_cast<size_t>(t * d.E + e)], u = d.u[static_cast<size_t>(t * d.E + e)];
      double y = 0;
      for (int64_t n = 0; n < d.N; ++n) {
        S[static_cast<size_t>(n)] = std::exp(d.A[static_cast<size_t>(e * d.N + n)] * dt) * S[static_cast<size_t>(n)] +
                                    dt * d.B[static_cast<size_t>(t * d.N + n)] * u;
        y += S[static_cast<size_t>(n)] * d.C[static_cast<size_t>(t * d.N + n)];
      }
      y += d.D[static_cast<size_t>(e)] * u;
      EXPECT_NEAR(got[0][static_cast<size_t>(t * d.E + e)], y, 1e-5 * (1 + std::fabs(y))) << "t " << t << " e " << e;
    }
  }
}

// ---- values.md invariants and writes on a model ----------------------------------------------

TEST(Mamba1, ValueShapesFollowTheMamba1Column) {
  Case c("basic");  // E = 64, N = 16, hidden 32
  std::map<std::string, Shape> shapes;
  for (const auto& v : c.model.values(2, 5)) shapes[v.path] = v.shape;
  const std::string p = "layers.1.linear_attn.";
  EXPECT_EQ(shapes[p + "attention_queries"], (Shape{2, 5, 16}));
  EXPECT_EQ(shapes[p + "attention_keys"], (Shape{2, 5, 16}));
  EXPECT_EQ(shapes[p + "attention_values"], (Shape{2, 5, 64}));
  EXPECT_EQ(shapes[p + "betas"], (Shape{2, 5, 64}));
  EXPECT_EQ(shapes[p + "decays"], (Shape{2, 5, 64, 16}));
  EXPECT_EQ(shapes[p + "state_input"], (Shape{2, 64, 16}));
  EXPECT_EQ(shapes[p + "state_output"], (Shape{2, 64, 16}));
  EXPECT_EQ(shapes[p + "states"], (Shape{2, 5, 64, 16}));
  EXPECT_EQ(shapes[p + "attention_head_outputs"], (Shape{2, 5, 64}));
  EXPECT_EQ(shapes[p + "attention_output"], (Shape{2, 5, 32}));
  EXPECT_EQ(c.model.info().family, "mamba");
  EXPECT_EQ(c.model.info().layer_kinds[0], LayerKind::mamba);
}

TEST(Mamba1, PrefixThenContinuationEqualsWholePrompt) {
  Case c("basic");
  // Splits shorter than the conv kernel (1, 3) make the continuation's conv read cached inputs.
  const std::vector<size_t> splits{1, 3, 9, c.prompts[0].size() - 1};
  expect_continuation_equals_whole(c.model, c.prompts[0], splits);
  Routed r("chunked");
  c.model.set_chunk_size(4);
  expect_continuation_equals_whole(c.model, c.prompts[0], splits);
}

TEST(Mamba1, BatchedEqualsUnbatchedUnderLeftPadding) {
  Case c("padded_batch");
  expect_batched_equals_unbatched(c.model, c.prompts);
  Routed r("chunked");
  c.model.set_chunk_size(4);
  expect_batched_equals_unbatched(c.model, c.prompts);
}

TEST(Mamba1, SkipTokenWithZeroBetaKeepsStateBitExactOnRecurrentPath) {
  Case c("basic");
  expect_zero_beta_skips_token(c.model, "mamba", c.prompts[0], 1, 5);
}

TEST(Mamba1, DecaysWriteIsTheSameDtAsABetasWrite) {
  Case c("basic");
  Trace via_decays, via_betas;
  via_decays.edit("layers.0.linear_attn.decays", [](Tensor& v, const SiteContext&) {
    for (int64_t i = 0; i < v.numel(); ++i) v[i] *= 0.5f;
  });
  via_betas.edit("layers.0.linear_attn.betas", [](Tensor& v, const SiteContext&) {
    for (int64_t i = 0; i < v.numel(); ++i) v[i] *= 0.5f;
  });
  Tensor a = c.model.run(c.prompts, &via_decays), b = c.model.run(c.prompts, &via_betas);
  EXPECT_LE(rel_rms(a, b), 1e-6);
  EXPECT_GT(rel_rms(a, c.model.run(c.prompts)), 1e-4) << "the edit must matter";
}

TEST(Mamba1, DecaysWriteThatNoDtProducesIsRefused) {
  Case c("basic");
  auto run_with = [&](EditFn fn) {
    Trace t;
    t.edit("layers.2.linear_attn.decays", std::move(fn));
    c.model.run(c.prompts, &t);
  };
  try {
    // One state index of token 4, channel 7 changed alone: dt = decays / A disagrees across n.
    run_with([](Tensor& v, const SiteContext&) { v[((0 * v.size(1) + 4) * v.size(2) + 7) * v.size(3) + 3] *= 2.0f; });
    FAIL() << "inconsistent decays accepted";
  } catch (const WriteError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("layers.2.linear_attn.decays"), std::string::npos) << m;
    EXPECT_NE(m.find("token 4, channel 7"), std::string::npos) << m;
    EXPECT_NE(m.find("state axis"), std::string::npos) << m;
  }
  try {
    run_with([](Tensor& v, const SiteContext&) { v = Tensor({1, 17, 64}); });
    FAIL() << "wrong shape accepted";
  } catch (const WriteError& e) {
    EXPECT_NE(std::string(e.what()).find("expected shape [1, 17, 64, 16]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(run_with([](Tensor& v, const SiteContext&) { v[0] = 0.25f; }), WriteError);  // decays <= 0
  // A whole (token, channel) row scaled, or zeroed (dt = 0), is one dt: accepted.
  EXPECT_NO_THROW(run_with([](Tensor& v, const SiteContext&) {
    for (int64_t n = 0; n < v.size(3); ++n) v[(2 * v.size(2) + 5) * v.size(3) + n] *= 3.0f;
    for (int64_t n = 0; n < v.size(3); ++n) v[(6 * v.size(2) + 1) * v.size(3) + n] = 0.0f;
  }));
}

TEST(Mamba1, WritesAreValidated) {
  Case c("basic");
  auto run_with = [&](const std::string& path, EditFn fn) {
    Trace t;
    t.edit(path, std::move(fn));
    c.model.run(c.prompts, &t);
  };
  EXPECT_THROW(run_with("layers.0.linear_attn.betas", [](Tensor& v, const SiteContext&) { v[0] = -1.0f; }), WriteError);
  EXPECT_THROW(run_with("layers.0.linear_attn.attention_values",
                        [](Tensor& v, const SiteContext&) { v[3] = std::nanf(""); }),
               WriteError);
  EXPECT_THROW(run_with("layers.0.linear_attn.state_output", [](Tensor& v, const SiteContext&) { v = Tensor({1, 16, 64}); }),
               WriteError);
  EXPECT_THROW(run_with("layers.0.linear_attn.states", [](Tensor&, const SiteContext&) {}), WriteError);
}

TEST(Mamba1, StateInputWriteOnAFreshPromptStartsFromIt) {
  // A fresh prompt's state_input is None; assigning a state makes the scan start from it.
  Case c("basic");
  Trace prefix;
  prefix.save("layers.0.linear_attn.state_output");
  c.model.run({{c.prompts[0].begin(), c.prompts[0].begin() + 6}}, &prefix);
  const Tensor& S = prefix.get("layers.0.linear_attn.state_output");
  Trace fresh, zero;
  fresh.set("layers.0.linear_attn.state_input", S);
  fresh.save("layers.0.linear_attn.state_input").save("layers.0.linear_attn.states");
  zero.save("layers.0.linear_attn.states");
  c.model.run(c.prompts, &fresh);
  c.model.run(c.prompts, &zero);
  EXPECT_EQ(0, std::memcmp(fresh.get("layers.0.linear_attn.state_input").data(), S.data(),
                           sizeof(float) * static_cast<size_t>(S.numel())));
  EXPECT_GT(rel_rms(fresh.get("layers.0.linear_attn.states"), zero.get("layers.0.linear_attn.states")), 1e-3);
}

TEST(Mamba1, OriginalEmbeddingNameIsAccepted) {
  // Original state-spaces checkpoints store backbone.embedding.weight (transformers 5.18 itself
  // no longer renames it at load).
  Case c("short_prompt");
  const auto dir = std::filesystem::temp_directory_path() / ("mixlens_m1_embedding_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(c.dir / "config.json", dir / "config.json", std::filesystem::copy_options::overwrite_existing);
  io::SafetensorsFile src(c.dir / "model.safetensors");
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& info : src.tensors())
    tensors.emplace_back(info.name == "backbone.embeddings.weight" ? "backbone.embedding.weight" : info.name,
                         src.get_f32(info.name));
  io::write_safetensors(dir / "model.safetensors", tensors);
  Model m = Model::load(dir.string());
  EXPECT_LE(rel_rms(m.run(c.prompts), c.golden.get_f32("logits@step0")), 1e-4);
  std::filesystem::remove_all(dir);
}

TEST(Mamba1, BadTimeStepRankIsAConfigError) {
  Case c("short_prompt");
  const auto dir = std::filesystem::temp_directory_path() / ("mixlens_m1_rank_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(c.dir / "model.safetensors", dir / "model.safetensors",
                             std::filesystem::copy_options::overwrite_existing);
  nlohmann::json cfg = read_json(c.dir / "config.json");
  cfg["time_step_rank"] = "fast";
  std::ofstream(dir / "config.json") << cfg.dump();
  try {
    Model::load(dir.string());
    FAIL() << "time_step_rank 'fast' accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("time_step_rank"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

TEST(Mamba1, StoredIntermediateSizeWinsOverExpand) {
  // transformers 5.18 computes intermediate_size = expand * hidden_size, then sets the file's own
  // intermediate_size over it (falcon-mamba-7b: expand 16, intermediate_size 8192 = 2 * hidden).
  for (const char* f : {"mamba", "falcon_mamba"}) {
    Case c("short_prompt", f);
    const auto dir = std::filesystem::temp_directory_path() / ("mixlens_m1_inter_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    std::filesystem::copy_file(c.dir / "model.safetensors", dir / "model.safetensors",
                               std::filesystem::copy_options::overwrite_existing);
    nlohmann::json cfg = read_json(c.dir / "config.json");
    ASSERT_EQ(cfg["intermediate_size"].get<int64_t>(), 2 * cfg["hidden_size"].get<int64_t>()) << f;
    cfg["expand"] = 16;
    std::ofstream(dir / "config.json") << cfg.dump();
    EXPECT_LE(rel_rms(Model::load(dir.string()).run(c.prompts), c.golden.get_f32("logits@step0")), 1e-4) << f;
    // Without the stored size, expand decides (and the weights no longer fit).
    cfg.erase("intermediate_size");
    std::ofstream(dir / "config.json") << cfg.dump();
    EXPECT_THROW(Model::load(dir.string()), CheckpointError) << f;
    std::filesystem::remove_all(dir);
  }
}

TEST(Mamba1, UnknownValuePathsSuggestTheNearest) {
  Case c("basic");
  auto message = [&](const std::string& path) { return unknown_path_message(c.model, c.prompts, path); };
  EXPECT_NE(message("layers.1.linear_attn.decay").find("did you mean 'layers.1.linear_attn.decays'"), std::string::npos);
  EXPECT_NE(message("layers.3.linear_attn.betas").find("out of range"), std::string::npos);
  EXPECT_NE(message("layers.0.self_attn.attention_output").find("mamba block"), std::string::npos);
}

TEST(Mamba1, WritingBackUnchangedValuesChangesNothing) {
  for (const char* f : {"mamba", "falcon_mamba"}) {
    Case c("basic", f);
    expect_unchanged_writes_change_nothing(c.model, c.prompts);
  }
}

// ---- FalconMamba: the norms on dt_low, B and C ------------------------------------------------

TEST(FalconMamba, KeysAndQueriesAreServedAfterTheirRmsNorm) {
  Case c("basic", "falcon_mamba");
  EXPECT_EQ(c.model.info().family, "falcon_mamba");
  EXPECT_EQ(c.model.info().layer_kinds[0], LayerKind::mamba);
  Trace t;
  t.save("layers.*.linear_attn.attention_keys").save("layers.*.linear_attn.attention_queries");
  c.model.run(c.prompts, &t);
  // A weightless RMS norm leaves every token's row at mean square 1 / (1 + eps / ms(raw)); eps is 1e-6.
  for (const char* v : {"attention_keys", "attention_queries"}) {
    const Tensor x = t.get(std::string("layers.1.linear_attn.") + v);
    const int64_t N = x.size(2);
    for (int64_t r = 0; r < x.size(0) * x.size(1); ++r) {
      double ms = 0;
      for (int64_t n = 0; n < N; ++n) ms += static_cast<double>(x[r * N + n]) * x[r * N + n];
      EXPECT_NEAR(ms / static_cast<double>(N), 1.0, 1e-3) << v << " row " << r;
    }
  }
}

TEST(FalconMamba, MixerRmsEpsIsRead) {
  // The padded case sets mixer_rms_eps 0.05 (its goldens depend on it); another eps changes the logits.
  Case c("padded_untied_eps", "falcon_mamba");
  const auto dir = std::filesystem::temp_directory_path() / ("mixlens_fm_eps_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(c.dir / "model.safetensors", dir / "model.safetensors",
                             std::filesystem::copy_options::overwrite_existing);
  nlohmann::json cfg = read_json(c.dir / "config.json");
  ASSERT_EQ(cfg["mixer_rms_eps"].get<double>(), 0.05);
  EXPECT_LE(rel_rms(c.model.run(c.prompts), c.golden.get_f32("logits@step0")), 1e-4);
  cfg["mixer_rms_eps"] = 1e-6;
  std::ofstream(dir / "config.json") << cfg.dump();
  EXPECT_GT(rel_rms(Model::load(dir.string()).run(c.prompts), c.golden.get_f32("logits@step0")), 1e-3);
  cfg["mixer_rms_eps"] = -1.0;
  std::ofstream(dir / "config.json") << cfg.dump();
  EXPECT_THROW(Model::load(dir.string()), ConfigError);
  std::filesystem::remove_all(dir);
}

}  // namespace
