// TransformerLens 4 hook names as aliases (docs/transformer_lens.md): every alias of each family kind
// reads the canonical value bit for bit and is stored under the name asked for; every TL name
// without an exact alias is refused with a message that says why and what to read instead.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "fixture_util.h"
#include "mixlens/errors.h"

using namespace mixlens;
using namespace mixlens::test;

namespace {

struct Loaded {
  Model model;
  std::vector<std::vector<int32_t>> prompts;
};

Loaded load_case(const std::string& rel) {
  const auto spec = read_json(fixture(rel) / "case.json");
  return {Model::load(fixture(rel).string()), spec["prompts"].get<std::vector<std::vector<int32_t>>>()};
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && std::memcmp(a.data(), b.data(), sizeof(float) * static_cast<size_t>(a.numel())) == 0;
}

// Saves every (TL name, canonical path) pair in one run; each TL name is stored under itself and
// equals the canonical value bit for bit.
void expect_aliases(const std::string& rel, const std::vector<std::pair<std::string, std::string>>& pairs) {
  SCOPED_TRACE(rel);
  Loaded c = load_case(rel);
  Trace t;
  for (const auto& [tl, canonical] : pairs) t.save(tl).save(canonical);
  c.model.run(c.prompts, &t);
  for (const auto& [tl, canonical] : pairs) {
    SCOPED_TRACE(tl);
    ASSERT_TRUE(t.has(tl, 0)) << "not stored under the TransformerLens name";
    ASSERT_TRUE(t.has(canonical, 0));
    EXPECT_TRUE(bitwise_equal(t.get(tl, 0), t.get(canonical, 0))) << "differs from " << canonical;
  }
}

std::string tl_error(const std::string& rel, const std::string& path) {
  Loaded c = load_case(rel);
  Trace t;
  t.save(path);
  try {
    c.model.run(c.prompts, &t);
  } catch (const UnknownValueError& e) {
    return e.what();
  }
  return "no UnknownValueError";
}

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << (msg)

TEST(TlNames, Mamba1) {
  expect_aliases("mamba/basic", {{"hook_embed", "embed_tokens.output"},
                                 {"blocks.0.hook_resid_pre", "layers.0.layer_input"},
                                 {"blocks.2.hook_resid_post", "layers.2.layer_output"},
                                 {"blocks.1.mixer.hook_ssm_out", "layers.1.linear_attn.attention_output"},
                                 {"blocks.1.mixer.hook_out", "layers.1.linear_attn.attention_output"},
                                 {"blocks.1.hook_mixer_out", "layers.1.linear_attn.attention_output"},
                                 {"ln_final.hook_out", "ln_final.output"},
                                 {"hook_unembed", "logits"}});
  EXPECT_HAS(tl_error("mamba/basic", "blocks.0.mixer.hook_ssm_dt"), "softplus(hook_ssm_dt)");
  EXPECT_HAS(tl_error("mamba/basic", "blocks.0.mixer.hook_ssm_state"), "states.permute(0, 2, 1, 3)");
  EXPECT_HAS(tl_error("mamba/basic", "blocks.0.mixer.hook_ssm_write"), "not a mixlens value");
  EXPECT_HAS(tl_error("mamba/basic", "blocks.0.mixer.hook_ssm_B"), "attention_keys");
}

TEST(TlNames, Mamba2) {
  expect_aliases("mamba2/short_prompt", {{"embed.hook_out", "embed_tokens.output"},
                                         {"blocks.1.hook_in", "layers.1.layer_input"},
                                         {"blocks.1.hook_out", "layers.1.layer_output"},
                                         {"blocks.0.mixer.hook_ssm_out", "layers.0.linear_attn.attention_output"},
                                         {"unembed.hook_out", "logits"}});
  const std::string st = tl_error("mamba2/short_prompt", "blocks.0.mixer.hook_ssm_state");
  EXPECT_HAS(st, "states.transpose(-1, -2)");
  EXPECT_HAS(st, "TransformerLens name 'blocks.0.mixer.hook_ssm_state' has no mixlens alias on this mamba2 model");
  for (const char* h : {"hook_ssm_B", "hook_ssm_C", "hook_ssm_dt", "hook_ssm_decay"})
    EXPECT_HAS(tl_error("mamba2/short_prompt", std::string("blocks.0.mixer.") + h), "has no " + std::string(h) + " on a Mamba-2");
  EXPECT_HAS(tl_error("mamba2/short_prompt", "blocks.0.mixer.hook_ssm_write"), "betas * attention_values");
  EXPECT_HAS(tl_error("mamba2/short_prompt", "ln_final.hook_normalized"), "before the norm's weight");
  EXPECT_HAS(tl_error("mamba2/short_prompt", "blocks.0.hook_resid_mid"), "layer_input plus");
  EXPECT_HAS(tl_error("mamba2/short_prompt", "blocks.0.hook_mlp_out"), "without an MLP");
  EXPECT_HAS(tl_error("mamba2/short_prompt", "blocks.0.linear_attn.hook_beta"), "its components: mixer");
  EXPECT_HAS(tl_error("mamba2/short_prompt", "blocks.7.hook_resid_post"), "out of range (the model has 2 blocks");
  EXPECT_HAS(tl_error("mamba2/short_prompt", "blocks.x.hook_resid_post"), "not a number or '*'");
  EXPECT_HAS(tl_error("mamba2/short_prompt", "blocks.0.hook_resid_poast"), "no hook 'hook_resid_poast'");
  EXPECT_HAS(tl_error("mamba2/short_prompt", "hook_pos_embed"), "is not a mixlens value");
}

TEST(TlNames, GatedDeltaNet) {
  // HV == HK: q and k are TL's hook_q / hook_k exactly.
  expect_aliases("qwen3_5/hv_eq_hk_chunks",
                 {{"blocks.0.linear_attn.hook_q", "layers.0.linear_attn.attention_queries"},
                  {"blocks.0.linear_attn.hook_ssm_C", "layers.0.linear_attn.attention_queries"},
                  {"blocks.0.linear_attn.hook_k", "layers.0.linear_attn.attention_keys"},
                  {"blocks.0.linear_attn.hook_ssm_B", "layers.0.linear_attn.attention_keys"},
                  {"blocks.1.linear_attn.hook_v", "layers.1.linear_attn.attention_values"},
                  {"blocks.1.linear_attn.hook_beta", "layers.1.linear_attn.betas"},
                  {"blocks.1.linear_attn.hook_ssm_write", "layers.1.linear_attn.betas"},
                  {"blocks.3.linear_attn.hook_log_decay", "layers.3.linear_attn.decays"},
                  {"blocks.3.linear_attn.hook_ssm_decay", "layers.3.linear_attn.decays"},
                  {"blocks.3.linear_attn.hook_recurrence_out", "layers.3.linear_attn.attention_head_outputs"},
                  {"blocks.3.linear_attn.hook_ssm_state", "layers.3.linear_attn.states"},
                  {"blocks.3.linear_attn.hook_ssm_out", "layers.3.linear_attn.attention_output"},
                  {"blocks.3.linear_attn.hook_linear_attn_out", "layers.3.linear_attn.attention_output"},
                  {"blocks.2.attn.hook_pattern", "layers.2.self_attn.attention_probabilities"},
                  {"blocks.2.attn.hook_out", "layers.2.self_attn.attention_output"},
                  {"blocks.2.hook_attn_out", "layers.2.self_attn.attention_output"},
                  {"blocks.0.mlp.hook_out", "layers.0.mlp.output"},
                  {"blocks.2.hook_mlp_out", "layers.2.mlp.output"},
                  {"hook_embed", "embed_tokens.output"}});
  // HV = 2 HK: TL's q / k have one head per key head; mixlens's are repeated to the value heads.
  const std::string q = tl_error("qwen3_5/hv_2hk", "blocks.0.linear_attn.hook_q");
  EXPECT_HAS(q, "attention_queries[:, :, ::2] equals hook_q");
  EXPECT_HAS(tl_error("qwen3_5/hv_2hk", "blocks.0.linear_attn.hook_ssm_B"), "attention_keys[:, :, ::2]");
  expect_aliases("qwen3_5/hv_2hk", {{"blocks.0.linear_attn.hook_v", "layers.0.linear_attn.attention_values"}});
  expect_aliases("qwen3_next/padded_batch", {{"blocks.0.linear_attn.hook_beta", "layers.0.linear_attn.betas"},
                                             {"blocks.0.linear_attn.hook_ssm_state", "layers.0.linear_attn.states"},
                                             {"blocks.1.attn.hook_pattern", "layers.1.self_attn.attention_probabilities"},
                                             {"blocks.1.mlp.hook_out", "layers.1.mlp.output"}});
  EXPECT_HAS(tl_error("qwen3_5/hv_eq_hk_chunks", "blocks.2.attn.hook_q"), "before the q/k norms and RoPE");
  EXPECT_HAS(tl_error("qwen3_5/hv_eq_hk_chunks", "blocks.2.attn.hook_z"), "before o_proj");
  EXPECT_HAS(tl_error("qwen3_5/hv_eq_hk_chunks", "blocks.0.attn.hook_pattern"), "block 0 is a gated_deltanet block");
  EXPECT_HAS(tl_error("qwen3_5/hv_eq_hk_chunks", "blocks.2.linear_attn.hook_beta"), "block 2 is an attention block");
  EXPECT_HAS(tl_error("qwen3_5/hv_eq_hk_chunks", "blocks.0.hook_attn_out"), "without softmax attention");
  EXPECT_HAS(tl_error("qwen3_5/hv_eq_hk_chunks", "blocks.0.linear_attn.hook_beta_logit"), "sigmoid(b)");
}

TEST(TlNames, Mamba2Hybrids) {
  // Nemotron-H: one `mixer` slot per block, whatever its kind (M, -, *, M here).
  expect_aliases("nemotron_h/padded_batch", {{"blocks.0.mixer.hook_ssm_out", "layers.0.linear_attn.attention_output"},
                                             {"blocks.1.mixer.hook_out", "layers.1.mlp.output"},
                                             {"blocks.1.hook_mlp_out", "layers.1.mlp.output"},
                                             {"blocks.2.mixer.hook_out", "layers.2.self_attn.attention_output"},
                                             {"blocks.2.mixer.hook_pattern", "layers.2.self_attn.attention_probabilities"},
                                             {"blocks.3.hook_resid_post", "layers.3.layer_output"}});
  EXPECT_HAS(tl_error("nemotron_h/padded_batch", "blocks.3.mixer.hook_ssm_state"), "states.transpose(-1, -2)");
  expect_aliases("bamba/padded_batch", {{"blocks.0.mixer.hook_ssm_out", "layers.0.linear_attn.attention_output"},
                                        {"blocks.1.attn.hook_out", "layers.1.self_attn.attention_output"},
                                        {"blocks.0.mlp.hook_out", "layers.0.mlp.output"},
                                        {"hook_embed", "embed_tokens.output"}});
  EXPECT_HAS(tl_error("bamba/padded_batch", "blocks.1.mixer.hook_out"), "its components: attn,mlp");
  // Falcon-H1: TL hooks the modules before the µP multipliers that mixlens's values include.
  expect_aliases("falcon_h1/no_rms_norm_padded", {{"blocks.0.hook_resid_pre", "layers.0.layer_input"},
                                                  {"blocks.1.hook_mlp_out", "layers.1.mlp.output"},
                                                  {"ln_final.hook_out", "ln_final.output"}});
  for (const char* p : {"hook_embed", "blocks.0.mamba.hook_ssm_out", "blocks.0.attn.hook_out", "blocks.0.hook_attn_out"})
    EXPECT_HAS(tl_error("falcon_h1/no_rms_norm_padded", p), "multiplier");
  EXPECT_HAS(tl_error("falcon_h1/no_rms_norm_padded", "hook_unembed"), "lm_head_multiplier");
  EXPECT_HAS(tl_error("falcon_h1/no_rms_norm_padded", "blocks.0.mixer.hook_out"), "its components: mamba,attn,mlp");
  // Granite 4.0-H: mixer / attn slots; residual_multiplier (and embedding / logits scaling) sit
  // outside TL's hooks, so the branch outputs, embeddings and logits are refused with the reason.
  expect_aliases("granitemoehybrid/rope_moe_edits",
                 {{"blocks.1.attn.hook_pattern", "layers.1.self_attn.attention_probabilities"},
                  {"blocks.2.hook_resid_post", "layers.2.layer_output"},
                  {"ln_final.hook_out", "ln_final.output"}});
  for (const char* p : {"hook_embed", "blocks.0.mixer.hook_ssm_out", "blocks.1.attn.hook_out", "blocks.1.hook_attn_out",
                        "blocks.0.hook_mlp_out", "blocks.0.shared_mlp.hook_out", "blocks.2.hook_mixer_out"})
    EXPECT_HAS(tl_error("granitemoehybrid/rope_moe_edits", p), "residual_multiplier");
  EXPECT_HAS(tl_error("granitemoehybrid/rope_moe_edits", "hook_unembed"), "logits_scaling");
  EXPECT_HAS(tl_error("granitemoehybrid/rope_moe_edits", "blocks.1.mixer.hook_out"), "its components: attn");
}

TEST(TlNames, NewFamiliesUseTheirTlComponents) {
  // Qwen3.5-MoE is Qwen3.5's stack: linear_attn / attn / mlp (the sparse MoE) in every block.
  expect_aliases("qwen3_5_moe/padded_batch", {{"blocks.0.linear_attn.hook_beta", "layers.0.linear_attn.betas"},
                                              {"blocks.0.hook_mlp_out", "layers.0.mlp.output"},
                                              {"blocks.1.attn.hook_pattern", "layers.1.self_attn.attention_probabilities"},
                                              {"blocks.1.mlp.hook_out", "layers.1.mlp.output"}});
  // OLMo-Hybrid's blocks are the Qwen hybrids' kinds: linear_attn / attn / mlp (hv_2hk_chunks: block 1 attention).
  expect_aliases("olmo_hybrid/hv_2hk_chunks", {{"blocks.0.linear_attn.hook_beta", "layers.0.linear_attn.betas"},
                                               {"blocks.1.hook_attn_out", "layers.1.self_attn.attention_output"},
                                               {"blocks.1.hook_mlp_out", "layers.1.mlp.output"},
                                               {"blocks.2.linear_attn.hook_ssm_state", "layers.2.linear_attn.states"}});
  // FalconMamba is a Mamba-1 model to TL (its `mixer`).
  expect_aliases("falcon_mamba/basic", {{"blocks.0.mixer.hook_ssm_out", "layers.0.linear_attn.attention_output"},
                                        {"blocks.1.hook_resid_pre", "layers.1.layer_input"}});
}

TEST(TlNames, JambaZamba2AndKimiLinearFollowTheirTlAdapters) {
  // Jamba: TL's BlockBridge with the Mamba-1 `mixer`, `attn` and `mlp` (moe_edits: blocks 1 and 4 attention, an MLP
  // or the experts in every block).
  expect_aliases("jamba/moe_edits", {{"blocks.0.mixer.hook_ssm_out", "layers.0.linear_attn.attention_output"},
                                     {"blocks.1.hook_attn_out", "layers.1.self_attn.attention_output"},
                                     {"blocks.1.attn.hook_pattern", "layers.1.self_attn.attention_probabilities"},
                                     {"blocks.0.hook_mlp_out", "layers.0.mlp.output"},
                                     {"blocks.1.mlp.hook_out", "layers.1.mlp.output"}});
  EXPECT_HAS(tl_error("jamba/moe_edits", "blocks.0.attn.hook_out"), "its components: mixer,mlp");
  EXPECT_HAS(tl_error("jamba/moe_edits", "blocks.0.mixer.hook_ssm_dt"), "softplus");
  // Zamba2 (nope_padded: hybrid, mamba, hybrid): SSMBlockBridge blocks, `mixer` on the Mamba layers only; the
  // shared block's values are refused for the reason TL has none, not as "no MLP".
  expect_aliases("zamba2/nope_padded", {{"blocks.1.mixer.hook_out", "layers.1.linear_attn.attention_output"},
                                        {"blocks.1.hook_mixer_out", "layers.1.linear_attn.attention_output"},
                                        {"blocks.0.hook_resid_post", "layers.0.layer_output"},
                                        {"hook_embed", "embed_tokens.output"}});
  const std::string mlp = tl_error("zamba2/nope_padded", "blocks.0.hook_mlp_out");
  EXPECT_HAS(mlp, "SSMBlockBridge) have no hook_mlp_out");
  EXPECT_HAS(mlp, "mlp.output");
  EXPECT_EQ(mlp.find("without an MLP"), std::string::npos) << mlp;
  EXPECT_HAS(tl_error("zamba2/nope_padded", "blocks.0.hook_attn_out"), "have no hook_attn_out");
  EXPECT_HAS(tl_error("zamba2/nope_padded", "blocks.0.mixer.hook_out"), ".mamba_decoder.mamba");
  EXPECT_HAS(tl_error("zamba2/nope_padded", "blocks.0.attn.hook_pattern"), "norm and mixer");
  EXPECT_HAS(tl_error("zamba2/nope_padded", "blocks.1.hook_mlp_out"), "have no hook_mlp_out");
  // Kimi-Linear: TL has no adapter, so no name is an alias.
  for (const char* p : {"hook_embed", "blocks.0.hook_resid_post", "blocks.0.linear_attn.hook_beta"})
    EXPECT_HAS(tl_error("kimi_linear/padded_batch", p), "no Kimi-Linear adapter");
}

TEST(TlNames, WildcardKeysWritesAndSessions) {
  Loaded c = load_case("qwen3_5/hv_eq_hk_chunks");
  const int L = c.model.info().num_layers;
  Trace t;
  t.save("blocks.*.hook_resid_post").save("blocks.*.attn.hook_pattern").save("layers.*.layer_output");
  c.model.run(c.prompts, &t);
  for (int i = 0; i < L; ++i) {
    const std::string tl = "blocks." + std::to_string(i) + ".hook_resid_post";
    ASSERT_TRUE(t.has(tl, 0)) << tl;
    EXPECT_TRUE(bitwise_equal(t.get(tl, 0), t.get("layers." + std::to_string(i) + ".layer_output", 0)));
    EXPECT_EQ(t.has("blocks." + std::to_string(i) + ".attn.hook_pattern", 0), i == 2) << "only block 2 has attention";
  }
  // No block has it: an error, not an empty save.
  Trace none;
  none.save("blocks.*.mixer.hook_ssm_out");
  EXPECT_THROW(c.model.run(c.prompts, &none), UnknownValueError);

  // A write through a TL name is the canonical write: same logits, and read back under the TL name.
  const auto zero_beta = [](Tensor& v, const SiteContext&) { std::fill(v.data(), v.data() + v.numel(), 0.0f); };
  Trace tl_edit, canon_edit;
  tl_edit.edit("blocks.1.linear_attn.hook_beta", zero_beta).save("blocks.1.linear_attn.hook_beta");
  canon_edit.edit("layers.1.linear_attn.betas", zero_beta);
  const Tensor a = c.model.run(c.prompts, &tl_edit), b = c.model.run(c.prompts, &canon_edit);
  EXPECT_TRUE(bitwise_equal(a, b));
  const Tensor saved = tl_edit.get("blocks.1.linear_attn.hook_beta", 0);
  EXPECT_TRUE(std::all_of(saved.begin(), saved.end(), [](float x) { return x == 0.0f; }));
  // Read-only stays read-only under its TL name.
  Trace w;
  w.edit("blocks.0.linear_attn.hook_ssm_state", zero_beta);
  EXPECT_THROW(c.model.run(c.prompts, &w), WriteError);
}

}  // namespace
