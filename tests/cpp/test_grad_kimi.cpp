// Trace::backward on Kimi-Linear (kimi_linear): directional finite differences of the float32 forward
// on the committed fixtures (tests/fixtures/kimi_linear): Kimi Delta Attention (per-key-channel decay
// through f_a / f_b, sigmoid(g_b g_a) output gate), latent attention (q_proj or q_a / q_b with its norm,
// kv_a / kv_b with the latent norm, k_rope shared by the heads, v_head_dim < head_dim) and KimiLinearMoE
// (sigmoid router with e_score_correction_bias, group-limited top-k, with and without renormalisation,
// routed_scaling_factor, ungated shared experts), on both kernel routes, a left-padded batch, a decode
// step and a continuation from a cache. Every value against torch autograd: tests/python/test_grad_qwen.py.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "fixture_util.h"
#include "grad_check.h"
#include "mixlens/model.h"
#include "mixlens/trace.h"

using namespace mixlens;
using namespace mixlens::grad_check;

namespace {

// Every value kind of the KDA block 0, the MLA block 1 and the MLP / MoE outputs (decode: state_input).
std::vector<std::string> kimi_paths(bool decode) {
  std::vector<std::string> p{"embed_tokens.output"};
  for (const char* v : {"attention_queries", "attention_keys", "attention_values", "betas", "decays",
                        "attention_head_outputs", "attention_output"})
    p.push_back(std::string("layers.0.linear_attn.") + v);
  if (decode) p.push_back("layers.0.linear_attn.state_input");
  for (const char* v : {"attention_queries", "attention_keys", "attention_values", "attention_output"})
    p.push_back(std::string("layers.1.self_attn.") + v);
  for (const char* v : {"layers.0.mlp.output", "layers.1.mlp.output", "layers.0.layer_output"}) p.push_back(v);
  return p;
}

// The tiny random fixtures are sharply curved (gradients up to ~1e3) and their routers flip within a
// step of 1e-3 of a value's own scale (the two central differences then disagree by 6x): steps of 6e-4
// of each value's scale stay on one routing; at that step the float32 forward's rounding leaves ~0.05 of
// noise in the differences (measured: the two central differences of one path differ by up to 0.09).
constexpr float kStep = 6e-4f;
constexpr double kAbsTol = 0.1;

std::vector<int32_t> tokens(int n, uint32_t seed) {
  std::vector<int32_t> v;
  for (int i = 0; i < n; ++i) v.push_back(static_cast<int32_t>(1 + (seed * 31 + i * 17) % 90));
  return v;
}

}  // namespace

// kda_mla_moe_chunks: 70 tokens (two chunks of 64), MoE renormalised; padded_batch: q_lora_rank, four
// expert groups of which two are kept, no renormalisation, a left-padded batch.
TEST(GradKimi, PromptMatchesDirectionalFiniteDifferencesOnBothKernels) {
  const std::pair<const char*, Batch> cases[] = {
      {"kimi_linear/kda_mla_moe_chunks", Batch::left_padded({tokens(70, 1)}, 0)},
      {"kimi_linear/padded_batch", Batch::left_padded({tokens(15, 2), tokens(6, 3)}, 0)}};
  for (const auto& [dir, in] : cases) {
    Model m = Model::load(test::fixture(dir).string());
    for (const char* route : {"chunked", "recurrent"}) {
      RouteGuard guard("kimi_linear", route);
      check_paths(m, in, nullptr, kimi_paths(false), std::string(dir) + " " + route, kAbsTol, true, kStep);
    }
  }
}

// A decode step over the latent attention's cache and the KDA state (state_input), then a three-token
// continuation (the chunked kernel from a cached state).
TEST(GradKimi, DecodeAndContinuationMatchDirectionalFiniteDifferences) {
  for (const char* dir : {"kimi_linear/continuation", "kimi_linear/padded_batch"}) {
    Model m = Model::load(test::fixture(dir).string());
    Cache cache = m.new_cache(2);
    m.forward(Batch::left_padded({tokens(12, 4), tokens(5, 5)}, 0), cache);
    check_paths(m, Batch::left_padded({{7}, {3}}, 0), &cache, kimi_paths(true), std::string(dir) + " decode", kAbsTol, true, kStep);
    check_paths(m, Batch::left_padded({{7, 12, 4}, {3, 8, 1}}, 0), &cache, kimi_paths(true),
                std::string(dir) + " continuation", kAbsTol, true, kStep);
  }
}

// The forward keeps the KDA in_proj output, chunk states and mixer outputs; dropping them (everything
// recomputed) changes no gradient, through an edit of the decays.
TEST(GradKimi, KeptForwardProductsGiveTheRecomputedGradients) {
  Model m = Model::load(test::fixture("kimi_linear/kda_mla_moe_chunks").string());
  const std::vector<std::string> paths{"embed_tokens.output", "layers.*.layer_input", "layers.0.linear_attn.decays",
                                       "layers.1.self_attn.attention_values", "layers.2.mlp.output"};
  for (const char* route : {"chunked", "recurrent"}) {
    RouteGuard guard("kimi_linear", route);
    expect_kept_equals_recomputed(m, Batch::left_padded({tokens(70, 6)}, 0), paths, [](Trace& tr) {
      tr.edit("layers.0.linear_attn.decays", [](Tensor& v, const SiteContext&) {
        for (int64_t i = 0; i < v.numel(); i += 5) v[i] *= 0.5f;
      });
    });
  }
}
