// Trace::backward on MiniMax (minimax, issue 25): directional finite differences of the float32 forward on
// the committed tiny fixtures (tests/fixtures/minimax): lightning attention (silu(qkv_proj), the SSD scan
// with the per-head decay, the RMSNorm over all heads and the sigmoid output gate), GQA softmax attention,
// the softmax-routed MoE without shared expert and MiniMaxDecoderLayer's scaled residuals on the normed
// input (lightning_attn / padded_batch: every factor != 1), on both kernel routes (block form, token loop),
// a left-padded batch, a continuation and a decode step from a cache (state_input). Every value against
// torch autograd: tests/python/test_grad_qwen.py's minimax rows.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "fixture_util.h"
#include "grad_check.h"
#include "mixlens/model.h"
#include "mixlens/trace.h"

using namespace mixlens;
using namespace mixlens::grad_check;

namespace {

const std::vector<const char*> kRoutes{"chunked", "recurrent"};

// Every lightning value of block `lin` (and state_input on a call over a cache), the attention block
// `att`'s, the MoE outputs and a residual. `padded`: without attention_head_outputs, which is 0 on the
// padding rows, where the RMSNorm's 1 / sqrt(eps) curvature leaves no float32 step at which central
// differences converge (the h and h / 2 differences disagree by 40%); test_grad_qwen.py compares it there.
std::vector<std::string> minimax_paths(int lin, int att, bool cached, bool padded = false) {
  std::vector<std::string> p{"embed_tokens.output"};
  for (const char* v : {"attention_queries", "attention_keys", "attention_values", "decays", "attention_head_outputs",
                        "attention_output"})
    if (!padded || std::string(v) != "attention_head_outputs") p.push_back("layers." + std::to_string(lin) + ".linear_attn." + v);
  if (cached) p.push_back("layers." + std::to_string(lin) + ".linear_attn.state_input");
  for (const char* v : {"attention_queries", "attention_keys", "attention_values", "attention_output"})
    p.push_back("layers." + std::to_string(att) + ".self_attn." + v);
  for (int i : {lin, att}) p.push_back("layers." + std::to_string(i) + ".mlp.output");
  p.push_back("layers." + std::to_string(lin) + ".layer_output");
  return p;
}

// Steps of 1e-3 of each value's scale stay on one expert routing of these tiny models (as Kimi's test).
constexpr float kStep = 1e-3f;
constexpr double kAbsTol = 5e-2;

}  // namespace

// Prompts of 20 tokens: five blocks of block_size 4 (lightning_attn, padded_batch) or 2.5 of 8 (default_layout).
TEST(GradMinimax, EmbeddingsMatchFiniteDifferences) {
  embeddings_fd("minimax/lightning_attn", "minimax", 20, 1e-2, kRoutes);
  embeddings_fd("minimax/default_layout", "minimax", 20, 1e-2, kRoutes);  // attention first, top-1, tied
  embeddings_fd("minimax/continuation", "minimax", 20, 1e-2, kRoutes);    // factors 1
}

// Every value through an additive edit, on one prompt and on a left-padded batch (each row's scan starts at
// its first real token), on both kernels.
TEST(GradMinimax, PromptValuesMatchDirectionalFiniteDifferencesOnBothKernels) {
  const std::pair<const char*, Batch> cases[] = {
      {"minimax/lightning_attn", Batch::left_padded({ids(18, 1)}, 0)},
      {"minimax/padded_batch", Batch::left_padded({ids(13, 2), ids(6, 3), ids(9, 4)}, 0)}};
  for (const auto& [dir, in] : cases) {
    Model m = Model::load(test::fixture(dir).string());
    const bool padded = in.has_padding();
    for (const char* route : kRoutes) {
      RouteGuard guard("minimax", route);
      for (int lin : {0, 2})
        check_paths(m, in, nullptr, minimax_paths(lin, 1, false, padded), std::string(dir) + " " + route, kAbsTol, true,
                    kStep);
    }
  }
}

// A decode step and a four-token continuation over the cached kv state (state_input) and keys, on both
// kernel routes (the default takes the token loop over a cache); state_output's gradient is zero.
TEST(GradMinimax, DecodeAndContinuationMatchDirectionalFiniteDifferences) {
  Model m = Model::load(test::fixture("minimax/padded_batch").string());
  Cache cache = m.new_cache(2);
  m.forward(Batch::left_padded({ids(11, 5), ids(6, 6)}, 0), cache);
  for (const char* route : kRoutes) {
    RouteGuard guard("minimax", route);
    check_paths(m, Batch::left_padded({{7}, {3}}, 0), &cache, minimax_paths(2, 1, true),
                std::string("decode ") + route, kAbsTol, true, kStep);
    check_paths(m, Batch::left_padded({{7, 12, 4, 9}, {3, 8, 1, 2}}, 0), &cache, minimax_paths(0, 1, true),
                std::string("continuation ") + route, kAbsTol, true, kStep);
  }
  Model c = Model::load(test::fixture("minimax/continuation").string());
  // decays (|slope| down to 1e-3 here) are left to check_paths' absolute tolerance above and to torch autograd in
  // test_grad_qwen.py: a step relative to their scale is lost in float32 noise of the differences.
  const std::vector<std::string> paths{"layers.0.linear_attn.state_input", "layers.1.linear_attn.state_input",
                                       "layers.1.linear_attn.attention_keys", "layers.2.self_attn.attention_values"};
  continuation_fd(c, ids(9, 7), ids(7, 8), paths, 1e-2, "recurrent");
  continuation_fd(c, ids(9, 7), ids(1, 8), paths, 1e-2, "recurrent");
}

// The forward keeps each mixer's output (grad::Kept::mixer_output); dropping it (the lightning norm, gate and
// out_proj recomputed) changes no gradient, through an edit of the head outputs, on both kernels.
TEST(GradMinimax, KeptForwardProductsGiveTheRecomputedGradients) {
  Model m = Model::load(test::fixture("minimax/lightning_attn").string());
  const std::vector<std::string> paths{"embed_tokens.output", "layers.*.layer_input", "layers.0.linear_attn.decays",
                                       "layers.2.linear_attn.attention_output", "layers.1.self_attn.attention_values"};
  for (const char* route : kRoutes) {
    RouteGuard guard("minimax", route);
    expect_kept_equals_recomputed(m, Batch::left_padded({ids(18, 9)}, 0), paths, [](Trace& tr) {
      tr.edit("layers.0.linear_attn.attention_head_outputs", [](Tensor& v, const SiteContext&) {
        for (int64_t i = 0; i < v.numel(); i += 7) v[i] *= 0.5f;
      });
    });
  }
}
