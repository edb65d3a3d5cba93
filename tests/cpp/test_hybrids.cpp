// The Mamba hybrids (Nemotron-H, Bamba, Falcon-H1, Granite 4.0-H, Jamba): parity with transformers through the golden
// fixtures (scripts/make_fixtures.py), the values.md invariants, support() / block kinds,
// and load-time errors.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <unistd.h>

#include "fixture_util.h"
#include "io/safetensors.h"
#include "io/weights.h"
#include "mixlens/errors.h"
#include "recurrent_checks.h"

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
  for (const char* f : {"nemotron_h", "bamba", "falcon_h1", "granitemoehybrid",
                        "jamba", "zamba2",
                        "zamba"})
    for (const auto& n : fixture_cases(f)) out.push_back({f, n});
  return out;
}

class HybridFixture : public ::testing::TestWithParam<Param> {};

TEST_P(HybridFixture, EveryValueEveryStepMatchesTransformers) {
  GoldenCase c(GetParam().family, GetParam().name);
  Trace t;
  save_all_values(c.model, t);
  run_recorded_steps(c, &t);
  EXPECT_GT(expect_golden_values(c.golden, t, c.name), 100);
  ASSERT_EQ(t.calls().size(), static_cast<size_t>(c.n_steps));
  // Jamba's and Zamba's Mamba-1 prompts run the token loop by default, as the Mamba-1 LMs' (values.md).
  const bool mamba1 = GetParam().family == "jamba" || GetParam().family == "zamba";
  EXPECT_EQ(t.calls()[0].kernel, mamba1 ? "recurrent" : "chunked");
  for (int s = 1; s < c.n_steps; ++s) EXPECT_EQ(t.calls()[static_cast<size_t>(s)].kernel, "recurrent");
}

TEST_P(HybridFixture, ForcedKernelPathsMatchTransformersToo) {
  GoldenCase c(GetParam().family, GetParam().name);
  for (const char* route : {"recurrent", "chunked"}) {
    route_kernels(GetParam().family, route);
    Trace t;
    save_all_values(c.model, t);
    run_recorded_steps(c, &t);
    route_kernels(GetParam().family, "default");
    EXPECT_GT(expect_golden_values(c.golden, t, c.name + " route " + route), 100);
    for (const auto& call : t.calls()) EXPECT_EQ(call.kernel, route);
  }
}

// The chunked scan with chunks shorter than the prompt (and not dividing it): the carry between
// chunks, against the goldens (Jamba's Mamba-1 has no config chunk size; the others' is 8).
TEST_P(HybridFixture, ShortChunksMatchTransformers) {
  GoldenCase c(GetParam().family, GetParam().name);
  route_kernels(GetParam().family, "chunked");
  c.model.set_chunk_size(3);
  Trace t;
  save_all_values(c.model, t);
  run_recorded_steps(c, &t);
  c.model.set_chunk_size(0);
  route_kernels(GetParam().family, "default");
  EXPECT_GT(expect_golden_values(c.golden, t, c.name + " chunk 3"), 100);
}

TEST_P(HybridFixture, GreedyTokensMatch) {
  GoldenCase c(GetParam().family, GetParam().name);
  GenerateOptions o;
  o.max_new_tokens = c.n_steps;
  o.eos_token_id = -1;
  auto res = c.model.generate(c.prompts, o);
  for (size_t r = 0; r < c.tokens.size(); ++r) EXPECT_EQ(res.new_tokens[r], c.tokens[r]) << "row " << r;
}

TEST_P(HybridFixture, StateInvariants) {
  GoldenCase c(GetParam().family, GetParam().name);
  expect_state_invariants(c, 1e-5);
}

TEST_P(HybridFixture, EditsMatchTransformersWithTheSameModification) {
  GoldenCase c(GetParam().family, GetParam().name);
  if (c.spec["edits"].empty()) GTEST_SKIP() << "case has no edits";
  EXPECT_GT(expect_edits_match(c), 0);
}

TEST_P(HybridFixture, PrefixThenContinuationEqualsWholePrompt) {
  GoldenCase c(GetParam().family, GetParam().name);
  const auto& p = c.prompts.back();  // the shortest row of a padded batch is unpadded in its own run
  if (p.size() < 5) GTEST_SKIP() << "prompt too short to split";
  // Tails of >= 2 tokens: a one-token continuation is a decode step, which (as in transformers)
  // skips the dt clamp these fixtures make bite, so it legitimately differs from the whole prompt.
  expect_continuation_equals_whole(c.model, p, {1, p.size() / 2, p.size() - 2});
}

TEST_P(HybridFixture, BatchedEqualsUnbatchedUnderLeftPadding) {
  GoldenCase c(GetParam().family, GetParam().name);
  if (c.prompts.size() < 2) GTEST_SKIP() << "single prompt";
  // JambaMambaMixer (as MambaMixer) masks padding before in_proj: with mamba_proj_bias the bias
  // reaches the conv window of a row's first real tokens, so transformers' padded rows differ from
  // their own runs; the goldens pin that mixlens does the same.
  if (c.spec["config"].value("mamba_proj_bias", false)) GTEST_SKIP() << "in_proj bias: padding is not invisible in transformers";
  expect_batched_equals_unbatched(c.model, c.prompts);
}

TEST_P(HybridFixture, ZeroBetaSkipsTokenBitExactOnRecurrentPath) {
  GoldenCase c(GetParam().family, GetParam().name);
  const int layer = c.spec["mixer_layers"][0].get<int>();
  expect_zero_beta_skips_token(c.model, GetParam().family, c.prompts.front(), layer, 3);
}

TEST_P(HybridFixture, WritingBackUnchangedValuesChangesNothing) {
  GoldenCase c(GetParam().family, GetParam().name);
  expect_unchanged_writes_change_nothing(c.model, c.prompts);
}

// values.md: asking a block for a mixer it does not have names the block's kind; support() agrees.
TEST_P(HybridFixture, MissingComponentsNameTheBlockKind) {
  GoldenCase c(GetParam().family, GetParam().name);
  const auto sup = c.model.support();
  const auto& kinds = c.model.info().layer_kinds;
  for (int l = 0; l < c.model.info().num_layers; ++l) {
    const std::string kind(layer_kind_name(kinds[static_cast<size_t>(l)]));
    const std::string block = "block " + std::to_string(l) + (kind[0] == 'a' ? " is an " : " is a ") + kind + " block";
    const std::string lp = "layers." + std::to_string(l) + ".";
    const bool mixer = has_mixer(c.model, l);
    EXPECT_EQ(sup.at("linear_attn.states").at(l).empty(), mixer) << l;
    if (!mixer) {
      EXPECT_NE(unknown_path_message(c.model, c.prompts, lp + "linear_attn.betas").find(block), std::string::npos) << l;
    }
    const bool attn = kinds[static_cast<size_t>(l)] == LayerKind::attention || kinds[static_cast<size_t>(l)] == LayerKind::hybrid;
    EXPECT_EQ(sup.at("self_attn.attention_output").at(l).empty(), attn) << l;
    if (!attn) {
      EXPECT_NE(unknown_path_message(c.model, c.prompts, lp + "self_attn.attention_keys").find(block), std::string::npos) << l;
    }
    // No hybrid here has an attention output gate.
    EXPECT_NE(unknown_path_message(c.model, c.prompts, lp + "self_attn.gate").find(block), std::string::npos) << l;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, HybridFixture, ::testing::ValuesIn(all_cases()), param_name);

// ---- loading ----------------------------------------------------------------------------------

fs::path patched_copy(const std::string& rel, const std::string& tag, const std::function<void(nlohmann::json&)>& patch) {
  const fs::path src = fixture(rel);
  const fs::path dst = fs::temp_directory_path() / ("mixlens_hybrid_" + tag + "_" + std::to_string(::getpid()));
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

#define EXPECT_LOAD_ERROR(E, dir, text) \
  EXPECT_NE(load_error<E>(dir).find(text), std::string::npos) << load_error<E>(dir)

TEST(Hybrids, BadConfigsGiveClearErrors) {
  // Nemotron-H: a pattern whose length does not match num_hidden_layers (transformers only warns).
  EXPECT_LOAD_ERROR(ConfigError, patched_copy("nemotron_h/groups2_edits", "len", [](nlohmann::json& c) { c["num_hidden_layers"] = 5; }),
                    "layers_block_type has 4 blocks but num_hidden_layers is 5");
  EXPECT_LOAD_ERROR(ConfigError, patched_copy("nemotron_h/groups2_edits", "pat", [](nlohmann::json& c) {
                      c.erase("layers_block_type");
                      c["hybrid_override_pattern"] = "M*M-";
                      c["num_hidden_layers"] = 3;
                    }), "hybrid_override_pattern has 4 blocks but num_hidden_layers is 3");
  EXPECT_LOAD_ERROR(ConfigError, patched_copy("nemotron_h/groups2_edits", "badtype", [](nlohmann::json& c) { c["layers_block_type"][1] = "conv"; }),
                    "block 1 has type 'conv'");
  // A MoE block where the checkpoint has an MLP: the router weight is missing.
  EXPECT_LOAD_ERROR(Error, patched_copy("nemotron_h/groups2_edits", "moe", [](nlohmann::json& c) { c["layers_block_type"][3] = "moe"; }),
                    "layers.3.mixer.gate.weight");
  EXPECT_LOAD_ERROR(ConfigError, patched_copy("nemotron_h/moe_latent", "route", [](nlohmann::json& c) { c["topk_group"] = 3; }),
                    "MoE routing sizes are inconsistent");
  // A missing block weight: the pattern says attention where the checkpoint has an MLP.
  EXPECT_LOAD_ERROR(Error, patched_copy("nemotron_h/groups2_edits", "missing", [](nlohmann::json& c) { c["layers_block_type"][3] = "full_attention"; }),
                    "layers.3.mixer.q_proj.weight");
  EXPECT_LOAD_ERROR(ConfigError, patched_copy("nemotron_h/groups2_edits", "groups", [](nlohmann::json& c) { c["n_groups"] = 3; }),
                    "num_heads (4) is not divisible by n_groups (3)");
  // Bamba: an attention index outside the layers; a missing attention weight.
  EXPECT_LOAD_ERROR(ConfigError, patched_copy("bamba/groups2_edits", "idx", [](nlohmann::json& c) { c["attn_layer_indices"] = {7}; }),
                    "attn_layer_indices entry 7 is outside 0..2");
  EXPECT_LOAD_ERROR(Error, patched_copy("bamba/groups2_edits", "bmiss", [](nlohmann::json& c) { c["attn_layer_indices"] = {0}; }),
                    "layers.0.self_attn.q_proj.weight");
  // Falcon-H1: multiplier lists of the wrong length, head sizes that do not multiply out.
  EXPECT_LOAD_ERROR(ConfigError, patched_copy("falcon_h1/norm_before_gate", "mult", [](nlohmann::json& c) { c["ssm_multipliers"] = {1.0, 2.0}; }),
                    "ssm_multipliers must have 5 entries (got 2)");
  EXPECT_LOAD_ERROR(ConfigError, patched_copy("falcon_h1/norm_before_gate", "dssm", [](nlohmann::json& c) { c["mamba_d_head"] = 16; }),
                    "intermediate width (48) must equal num_heads * head_dim (64)");
  // Granite: a layer type it does not have, a layer list of the wrong length, a positional
  // encoding it does not know, a µP multiplier that is not positive, more experts chosen than exist,
  // experts where the checkpoint has none.
  const std::string g = "granitemoehybrid/rope_moe_edits", gd = "granitemoehybrid/nope_dense_padded";
  EXPECT_LOAD_ERROR(ConfigError, patched_copy(g, "gtype", [](nlohmann::json& c) { c["layer_types"][1] = "conv"; }),
                    "layer_types[1] is 'conv'");
  EXPECT_LOAD_ERROR(ConfigError, patched_copy(g, "glen", [](nlohmann::json& c) { c["num_hidden_layers"] = 4; }),
                    "layer_types has 3 entries but num_hidden_layers is 4");
  EXPECT_LOAD_ERROR(UnsupportedError, patched_copy(g, "gpe", [](nlohmann::json& c) { c["position_embedding_type"] = "alibi"; }),
                    "position_embedding_type 'alibi' is not supported");
  EXPECT_LOAD_ERROR(ConfigError, patched_copy(g, "gmul", [](nlohmann::json& c) { c["residual_multiplier"] = 0.0; }),
                    "residual_multiplier must be a finite number > 0");
  EXPECT_LOAD_ERROR(ConfigError, patched_copy(g, "gtopk", [](nlohmann::json& c) { c["num_experts_per_tok"] = 5; }),
                    "num_experts_per_tok (5) exceeds num_local_experts (4)");
  EXPECT_LOAD_ERROR(Error, patched_copy(gd, "gexp", [](nlohmann::json& c) {
                      c["num_local_experts"] = 2;
                      c["num_experts_per_tok"] = 1;
                    }),
                    "layers.0.block_sparse_moe.router.weight");
  // Jamba: a layer offset outside its period (JambaConfig.validate_architecture), more experts chosen
  // than exist, a dt rank that is neither an integer nor "auto", an MLP where the checkpoint has experts.
  const std::string j = "jamba/moe_edits";
  EXPECT_LOAD_ERROR(ConfigError, patched_copy(j, "joff", [](nlohmann::json& c) { c["attn_layer_offset"] = 3; }),
                    "attn_layer_offset (3) must be in [0, attn_layer_period = 3)");
  EXPECT_LOAD_ERROR(ConfigError, patched_copy(j, "jtopk", [](nlohmann::json& c) { c["num_experts_per_tok"] = 5; }),
                    "num_experts_per_tok (5) exceeds num_experts (4)");
  EXPECT_LOAD_ERROR(ConfigError, patched_copy(j, "jrank", [](nlohmann::json& c) { c["mamba_dt_rank"] = "big"; }),
                    "field 'mamba_dt_rank' must be an integer or \"auto\"");
  EXPECT_LOAD_ERROR(Error, patched_copy(j, "jexp", [](nlohmann::json& c) { c["expert_layer_offset"] = 1; }),
                    "layers.0.feed_forward.gate_proj.weight");
  // Zamba: Mamba heads that do not divide the mixer width (ZambaConfig.validate_architecture), an
  // attention input other than [h, embeddings], an unknown layer type, a mixer activation it lacks,
  // and a hybrid layer where the checkpoint has a plain Mamba layer.
  const std::string z = "zamba/shared_edits";
  EXPECT_LOAD_ERROR(ConfigError, patched_copy(z, "zheads", [](nlohmann::json& c) { c["n_mamba_heads"] = 3; }),
                    "mamba_expand * hidden_size (64) must be divisible by n_mamba_heads (3)");
  EXPECT_LOAD_ERROR(ConfigError, patched_copy(z, "zwidth", [](nlohmann::json& c) { c["attention_hidden_size"] = 32; }),
                    "attention_hidden_size (32) must be 2 * hidden_size (64)");
  EXPECT_LOAD_ERROR(ConfigError, patched_copy(z, "ztype", [](nlohmann::json& c) { c["layers_block_type"][2] = "attention"; }),
                    "layers_block_type[2] is 'attention' (expected mamba / linear_attention or hybrid)");
  EXPECT_LOAD_ERROR(UnsupportedError, patched_copy(z, "zact", [](nlohmann::json& c) { c["hidden_mamba_act"] = "relu"; }),
                    "hidden_mamba_act 'relu' is not supported");
  EXPECT_LOAD_ERROR(Error, patched_copy(z, "zfirst", [](nlohmann::json& c) {
                      c["layers_block_type"][0] = "hybrid";
                    }),
                    "model.layers.0.mamba_decoder.input_layernorm.weight");
}

// Zamba: without layers_block_type, ZambaConfig's default list (hybrid at 2, then where
// i % attn_layer_period == attn_layer_offset) gives the same model as the list saved.
TEST(Hybrids, ZambaDefaultLayerListReadsAsTransformersBuildsIt) {
  GoldenCase c("zamba", "padded_bias");
  const fs::path dflt = patched_copy("zamba/padded_bias", "zdefault", [](nlohmann::json& j) { j.erase("layers_block_type"); });
  Model m = Model::load(dflt.string());
  EXPECT_EQ(m.info().layer_kinds, c.model.info().layer_kinds);
  const Tensor a = c.model.run(c.prompts), b = m.run(c.prompts);
  ASSERT_EQ(a.numel(), b.numel());
  for (int64_t k = 0; k < a.numel(); ++k) ASSERT_EQ(a[k], b[k]) << k;
  EXPECT_LOAD_ERROR(ConfigError, patched_copy("zamba/padded_bias", "zfew", [](nlohmann::json& j) {
                      j.erase("layers_block_type");
                      j["num_hidden_layers"] = 2;
                    }),
                    "num_hidden_layers (2) must be at least 3 when layers_block_type is not given");
}

// Granite: the published checkpoints spell layer_types with the legacy "mamba" / "attention" (which
// transformers 5.18 reads as linear_attention / full_attention); mixlens reads both alike.
TEST(Hybrids, GraniteLegacyLayerTypesReadAlike) {
  GoldenCase c("granitemoehybrid", "nope_dense_padded");
  const fs::path legacy = patched_copy("granitemoehybrid/nope_dense_padded", "glegacy", [](nlohmann::json& j) {
    for (auto& t : j["layer_types"]) t = t == "full_attention" ? "attention" : "mamba";
  });
  Model m = Model::load(legacy.string());
  EXPECT_EQ(m.info().layer_kinds, c.model.info().layer_kinds);
  const Tensor a = c.model.run(c.prompts), b = m.run(c.prompts);
  ASSERT_EQ(a.numel(), b.numel());
  for (int64_t k = 0; k < a.numel(); ++k) ASSERT_EQ(a[k], b[k]) << k;
}

// The case's checkpoint rewritten as `tensors` (same config) gives bitwise the case model's logits.
void expect_same_logits(GoldenCase& c, const std::vector<std::pair<std::string, Tensor>>& tensors, const std::string& tag) {
  const fs::path dst = fs::temp_directory_path() / ("mixlens_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(dst);
  fs::create_directories(dst);
  fs::copy_file(c.dir / "config.json", dst / "config.json");
  io::write_safetensors(dst / "model.safetensors", tensors);
  Model m = Model::load(dst.string());
  const Tensor a = c.model.run(c.prompts), b = m.run(c.prompts);
  ASSERT_EQ(a.numel(), b.numel());
  for (int64_t k = 0; k < a.numel(); ++k) ASSERT_EQ(a[k], b[k]) << k;
  fs::remove_all(dst);
}

// Granite: the published checkpoints spell the experts block_sparse_moe.input_linear /
// output_linear / router.layer, which transformers 5.18 renames on load (experts.gate_up_proj /
// experts.down_proj / router.weight); mixlens reads either spelling to the same logits.
TEST(Hybrids, GraniteReadsBothExpertWeightSpellings) {
  GoldenCase c("granitemoehybrid", "rope_moe_edits");
  const io::WeightStore w = io::WeightStore::open(c.dir);
  const std::pair<std::string, std::string> spellings[] = {
      {"block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.input_linear.weight"},
      {"block_sparse_moe.experts.down_proj", "block_sparse_moe.output_linear.weight"},
      {"block_sparse_moe.router.weight", "block_sparse_moe.router.layer.weight"}};
  std::vector<std::pair<std::string, Tensor>> tensors;
  int renamed = 0;
  for (const std::string& n : w.names()) {
    std::string m = n;
    for (const auto& [a, b] : spellings)
      for (const auto& [from, to] : {std::pair{a, b}, std::pair{b, a}})
        if (m.size() > from.size() && m.compare(m.size() - from.size(), from.size(), from) == 0) {
          m = m.substr(0, m.size() - from.size()) + to;
          ++renamed;
        }
    tensors.emplace_back(m, w.get(n));
  }
  EXPECT_EQ(renamed, 3 * 3);  // three MoE tensors in each of the three layers
  expect_same_logits(c, tensors, "granite_spelling");
}

// Jamba: transformers 5.18 saves (and the releases store) one gate_proj / up_proj / down_proj per
// expert; its in-memory JambaExperts are fused (experts.gate_up_proj [E, 2I, D], gate rows first,
// experts.down_proj [E, D, I]). mixlens reads either to the same logits.
TEST(Hybrids, JambaReadsPerExpertAndFusedExpertWeightsAlike) {
  GoldenCase c("jamba", "moe_edits");
  const io::WeightStore w = io::WeightStore::open(c.dir);
  std::vector<std::pair<std::string, Tensor>> tensors;
  int fused = 0;
  for (const std::string& n : w.names())
    if (n.find(".experts.") == std::string::npos) tensors.emplace_back(n, w.get(n));
  for (int l = 0; l < c.model.info().num_layers; ++l) {
    const std::string m = "model.layers." + std::to_string(l) + ".feed_forward.experts.";
    if (!w.has(m + "0.gate_proj.weight")) continue;
    const int64_t E = 4, I = w.get(m + "0.gate_proj.weight").size(0), D = w.get(m + "0.gate_proj.weight").size(1);
    Tensor gu({E, 2 * I, D}), dn({E, D, I});
    for (int64_t e = 0; e < E; ++e) {
      const std::string ep = m + std::to_string(e) + ".";
      const Tensor g = w.get(ep + "gate_proj.weight"), u = w.get(ep + "up_proj.weight"), d = w.get(ep + "down_proj.weight");
      std::copy(g.begin(), g.end(), gu.data() + e * 2 * I * D);
      std::copy(u.begin(), u.end(), gu.data() + e * 2 * I * D + I * D);
      std::copy(d.begin(), d.end(), dn.data() + e * D * I);
    }
    tensors.emplace_back(m + "gate_up_proj", gu);
    tensors.emplace_back(m + "down_proj", dn);
    ++fused;
  }
  EXPECT_EQ(fused, 3);  // the expert layers 0, 2, 4
  expect_same_logits(c, tensors, "jamba_fused");
}

TEST(Hybrids, ChunkSizeChangesNothingButTheAlgorithm) {
  GoldenCase c("nemotron_h", "groups2_edits");
  Trace a, b;
  a.save("layers.*.linear_attn.states").save("logits");
  b.save("layers.*.linear_attn.states").save("logits");
  c.model.run(c.prompts, &a);
  c.model.set_chunk_size(3);  // smaller than the prompt, not a divisor of it
  c.model.run(c.prompts, &b);
  c.model.set_chunk_size(0);
  EXPECT_LE(rel_rms(a.get("logits"), b.get("logits")), 1e-5);
  EXPECT_LE(rel_rms(a.get("layers.0.linear_attn.states"), b.get("layers.0.linear_attn.states")), 1e-5);
}

}  // namespace
