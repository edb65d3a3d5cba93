// Mamba-2 parity with transformers (golden fixtures from scripts/make_fixtures.py), the
// values.md invariants, kernel-path agreement and writes.
#include <gtest/gtest.h>

#include <cstring>

#include "fixture_util.h"
#include "mixlens/errors.h"

using namespace mixlens;
using namespace mixlens::test;

namespace {

struct Case {
  std::string name;
  std::filesystem::path dir;
  nlohmann::json spec;
  io::SafetensorsFile golden;
  Model model;
  std::vector<std::vector<int32_t>> prompts;
  int n_steps;
  std::vector<std::vector<int32_t>> tokens;  // token fed after each step, per row

  explicit Case(const std::string& n)
      : name(n), dir(fixture("mamba2/" + n)), spec(read_json(dir / "case.json")),
        golden(dir / "golden.safetensors"), model(Model::load(dir.string())) {
    prompts = spec["prompts"].get<std::vector<std::vector<int32_t>>>();
    n_steps = spec["n_steps"].get<int>();
    tokens = rows_of(golden.get_i64("tokens"), static_cast<int64_t>(prompts.size()));
  }
};

// Runs the prompt then n_steps-1 decode steps fed with the golden tokens.
std::vector<Tensor> teacher_forced(const Case& c, Trace* trace) {
  Batch b = Batch::left_padded(c.prompts, c.model.pad_token_id());
  Cache cache = c.model.new_cache(b.batch);
  std::vector<Tensor> logits;
  for (int step = 0; step < c.n_steps; ++step) {
    logits.push_back(c.model.forward(b, cache, trace));
    b.seq = 1;
    b.ids.clear();
    for (const auto& row : c.tokens) b.ids.push_back(row[static_cast<size_t>(step)]);
    b.mask.assign(b.ids.size(), 1);
  }
  return logits;
}

void save_everything(const Model& m, Trace& t) {
  for (const auto& v : m.values(1, 1)) t.save(v.path);
}

// Every golden value key "path@stepK" (not edits, not ids) equals ours within tolerance.
void expect_values_match(const Case& c, const Trace& t, const std::string& label) {
  int compared = 0;
  for (const auto& info : c.golden.tensors()) {
    const std::string& key = info.name;
    if (key.rfind("edit/", 0) == 0 || key.find('@') == std::string::npos) continue;
    const std::string path = key.substr(0, key.find('@'));
    const int step = std::stoi(key.substr(key.find("@step") + 5));
    ASSERT_TRUE(t.has(path, step)) << label << ": " << key << " was not produced";
    const Tensor& ours = t.get(path, step);
    Tensor ref = c.golden.get_f32(key);
    ASSERT_EQ(ours.shape(), ref.shape()) << label << ": " << key;
    EXPECT_LE(rel_rms(ours, ref), tolerance_for(key)) << label << ": " << key << " max|diff| " << max_abs_diff(ours, ref);
    ++compared;
  }
  EXPECT_GT(compared, 50) << label;
}

class Mamba2Fixture : public ::testing::TestWithParam<std::string> {};

TEST_P(Mamba2Fixture, EveryValueEveryStepMatchesTransformers) {
  Case c(GetParam());
  Trace t;
  save_everything(c.model, t);
  teacher_forced(c, &t);
  expect_values_match(c, t, c.name + " default kernels");
  // Step 0 is a prompt (chunked), later steps single-token decodes (recurrent).
  ASSERT_EQ(t.calls().size(), static_cast<size_t>(c.n_steps));
  EXPECT_EQ(t.calls()[0].kernel, "chunked");
  EXPECT_TRUE(t.calls()[0].fresh);
  EXPECT_EQ(t.calls()[1].kernel, "recurrent");
  EXPECT_EQ(t.calls()[1].seq, 1);
  EXPECT_FALSE(t.has("layers.0.linear_attn.state_input", 0)) << "state_input is None on a fresh prompt";
}

TEST_P(Mamba2Fixture, ForcedKernelPathsMatchTransformersToo) {
  Case c(GetParam());
  for (const char* route : {"recurrent", "chunked"}) {
    route_kernels("mamba2", route);
    Trace t;
    save_everything(c.model, t);
    teacher_forced(c, &t);
    route_kernels("mamba2", "default");
    expect_values_match(c, t, c.name + " route " + route);
    for (const auto& call : t.calls()) EXPECT_EQ(call.kernel, route);
  }
  c.model.set_chunk_size(1);  // chunk_per_token
  Trace t;
  save_everything(c.model, t);
  teacher_forced(c, &t);
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
  Case c(GetParam());
  Trace t;
  t.save("layers.*.linear_attn.states").save("layers.*.linear_attn.state_output").save("layers.*.linear_attn.state_input");
  teacher_forced(c, &t);
  const int L = c.model.info().num_layers;
  for (int l = 0; l < L; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".linear_attn.";
    for (int s = 0; s < c.n_steps; ++s) {
      const Tensor& st = t.get(p + "states", s);      // [B,T,H,N,P]
      const Tensor& out = t.get(p + "state_output", s);  // [B,H,N,P]
      const int64_t B = st.size(0), T = st.size(1), per = out.numel() / B;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < per; ++i)
          ASSERT_NEAR(st[(b * T + T - 1) * per + i], out[b * per + i], 1e-6 * (1 + std::fabs(out[b * per + i])))
              << p << " step " << s;
      if (s + 1 < c.n_steps) {
        const Tensor& next_in = t.get(p + "state_input", s + 1);
        ASSERT_EQ(0, std::memcmp(next_in.data(), out.data(), sizeof(float) * out.numel())) << p << " step " << s;
      }
    }
  }
}

TEST_P(Mamba2Fixture, EditsMatchTransformersWithTheSameModification) {
  Case c(GetParam());
  int checked = 0;
  for (const auto& e : c.spec["edits"]) {
    Trace t;
    const std::string op = e["op"];
    const float factor = e.value("factor", 1.0f);
    const int64_t index = e.value("index", 0);
    const float value = e.value("value", 0.0f);
    t.edit(e["path"].get<std::string>(),
           [&](Tensor& v, const SiteContext&) {
             if (op == "scale") {
               for (int64_t i = 0; i < v.numel(); ++i) v[i] *= factor;
             } else {  // set_index along the token axis
               const int64_t B = v.size(0), T = v.size(1), inner = v.numel() / (B * T);
               for (int64_t b = 0; b < B; ++b)
                 for (int64_t i = 0; i < inner; ++i) v[(b * T + index) * inner + i] = value;
             }
           },
           Steps::only(e["step"].get<int>()));
    auto logits = teacher_forced(c, &t);
    for (int s = 0; s < c.n_steps; ++s) {
      const std::string key = "edit/" + e["name"].get<std::string>() + "/logits@step" + std::to_string(s);
      Tensor ref = c.golden.get_f32(key);
      EXPECT_LE(rel_rms(logits[static_cast<size_t>(s)], ref), 1e-4) << key;
    }
    ++checked;
  }
  if (c.spec["edits"].empty()) GTEST_SKIP() << "case has no edits";
  EXPECT_GT(checked, 0);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Mamba2Fixture, ::testing::ValuesIn(fixture_cases("mamba2")));

TEST(Mamba2, SkipTokenWithZeroBetaKeepsStateBitExactOnRecurrentPath) {
  Case c("g1_chunks");
  route_kernels("mamba2", "recurrent");
  Trace t;
  t.save("layers.1.linear_attn.states");
  t.edit("layers.1.linear_attn.betas", [](Tensor& v, const SiteContext&) {
    for (int64_t h = 0; h < v.size(2); ++h) v[5 * v.size(2) + h] = 0.0f;
  });
  c.model.run(c.prompts, &t);
  route_kernels("mamba2", "default");
  const Tensor& s = t.get("layers.1.linear_attn.states");
  const int64_t per = s.numel() / s.size(1);
  EXPECT_EQ(0, std::memcmp(s.data() + 5 * per, s.data() + 4 * per, sizeof(float) * per));
}

TEST(Mamba2, PrefixThenContinuationEqualsWholePrompt) {
  Case c("g1_chunks");
  const auto& prompt = c.prompts[0];
  for (size_t split : {size_t{1}, size_t{5}, size_t{9}, prompt.size() - 1}) {
    Trace whole;
    whole.save("layers.*.linear_attn.state_output").save("logits").save("layers.*.linear_attn.states");
    c.model.run({prompt}, &whole);

    Cache cache = c.model.new_cache(1);
    Trace parts;
    parts.save("layers.*.linear_attn.state_output").save("logits").save("layers.*.linear_attn.states")
        .save("layers.*.linear_attn.state_input");
    c.model.forward(Batch::left_padded({{prompt.begin(), prompt.begin() + split}}, 0), cache, &parts);
    c.model.forward(Batch::left_padded({{prompt.begin() + split, prompt.end()}}, 0), cache, &parts);
    EXPECT_EQ(parts.calls()[1].fresh, false);
    const Tensor& full = whole.get("logits");
    const Tensor& tail = parts.get("logits", 1);
    const int64_t V = full.size(2), n = tail.size(1);
    Tensor full_tail({1, n, V});
    std::memcpy(full_tail.data(), full.data() + (full.size(1) - n) * V, sizeof(float) * n * V);
    EXPECT_LE(rel_rms(tail, full_tail), 1e-5) << "split " << split;
    for (int l = 0; l < c.model.info().num_layers; ++l) {
      const std::string p = "layers." + std::to_string(l) + ".linear_attn.";
      EXPECT_LE(rel_rms(parts.get(p + "state_output", 1), whole.get(p + "state_output")), 1e-5) << p << split;
      EXPECT_EQ(0, std::memcmp(parts.get(p + "state_input", 1).data(), parts.get(p + "state_output", 0).data(),
                               sizeof(float) * parts.get(p + "state_output", 0).numel()));
    }
  }
}

TEST(Mamba2, BatchedEqualsUnbatchedUnderLeftPadding) {
  Case c("padded_batch");
  Trace batched;
  batched.save("logits").save("layers.*.linear_attn.states").save("layers.*.linear_attn.state_output");
  c.model.run(c.prompts, &batched);
  const int64_t T = batched.get("logits").size(1);
  for (size_t r = 0; r < c.prompts.size(); ++r) {
    Trace single;
    single.save("logits").save("layers.*.linear_attn.state_output");
    c.model.run({c.prompts[r]}, &single);
    const Tensor& lb = batched.get("logits");
    const Tensor& ls = single.get("logits");
    const int64_t n = ls.size(1), V = ls.size(2), pad = T - n;
    Tensor row({1, n, V});
    std::memcpy(row.data(), lb.data() + (static_cast<int64_t>(r) * T + pad) * V, sizeof(float) * n * V);
    EXPECT_LE(rel_rms(row, ls), 1e-5) << "row " << r;
    // Padded positions neither write nor decay the state: it is exactly zero there.
    const Tensor& st = batched.get("layers.0.linear_attn.states");
    const int64_t per = st.numel() / (st.size(0) * T);
    for (int64_t t = 0; t < pad; ++t)
      for (int64_t i = 0; i < per; ++i) ASSERT_EQ(st[(static_cast<int64_t>(r) * T + t) * per + i], 0.0f);
  }
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
  EXPECT_NE(message("layers.1.linear_attn.beta").find("did you mean 'layers.1.linear_attn.betas'"), std::string::npos);
  EXPECT_NE(message("layers.7.linear_attn.betas").find("out of range"), std::string::npos);
  EXPECT_NE(message("layers.0.self_attn.attention_output").find("mamba2"), std::string::npos);
  EXPECT_NE(message("logit").find("did you mean 'logits'"), std::string::npos);
}

TEST(Mamba2, WritingBackUnchangedValuesChangesNothing) {
  Case c("g1_chunks");
  Tensor base = c.model.run(c.prompts);
  Trace t;
  for (const char* p : {"layers.*.linear_attn.betas", "layers.*.linear_attn.decays", "layers.*.linear_attn.attention_values",
                        "layers.*.linear_attn.attention_keys", "layers.*.linear_attn.attention_queries"})
    t.edit(p, [](Tensor&, const SiteContext&) {});
  Tensor again = c.model.run(c.prompts, &t);
  EXPECT_LE(rel_rms(again, base), 1e-6);
}

}  // namespace
