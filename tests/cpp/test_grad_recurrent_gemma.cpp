// Trace::backward on RecurrentGemma (issue 25): directional finite differences of the float32 forward on
// the committed tiny fixtures (tests/fixtures/recurrent_gemma): the embeddings (the soft-capped head,
// (1 + w) RMSNorms, the GeGLU MLP, RG-LRU blocks and local MQA with partial RoPE), each RG-LRU value and
// the attention / MLP values through an additive edit on a prompt and a left-padded batch, and state_input
// (window rows and h) on a continuation and a decode step. Every value against torch autograd:
// tests/python/test_grad_recurrent_gemma.py.
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

// <W, logits> sums ~2,000 soft-capped logits: its float32 rounding (~1e-4 absolute) swamps the differences
// of the smaller directional derivatives (~0.05) at steps below a few 1e-2 (relative to a value's RMS).
constexpr float kStep = 5e-2f;
constexpr float kDecayStep = 1e-2f;  // decays (log a, near 0 on these fixtures) must stay <= 0; fewer tokens

}  // namespace

// embed_tokens.output is served after the sqrt(hidden_size) scale (from_embeddings input is scaled
// again), so its gradient is checked through an additive edit of the served value.
TEST(GradRecurrentGemma, EmbeddingsMatchFiniteDifferences) {
  for (const auto& [fixture, n] : {std::pair<std::string, int>{"recurrent_gemma/griffin", 20},
                                   {"recurrent_gemma/attention_first", 12},  // biases, untied, cap 10, K 3
                                   {"recurrent_gemma/padded_batch", 9}}) {
    Model m = Model::load(test::fixture(fixture).string());
    edit_fd(m, Batch::left_padded({ids(n, 7)}, 0), "embed_tokens.output", 1e-2, fixture, kStep);
  }
}

// Each RG-LRU value (and the attention and MLP values) through an additive edit, on a prompt and on a
// left-padded batch (a padded row's conv starts at its first real token).
TEST(GradRecurrentGemma, ValuesMatchFiniteDifferencesOfAnEdit) {
  for (const auto& [fixture, batch] :
       {std::pair<std::string, Batch>{"recurrent_gemma/griffin", Batch::left_padded({ids(20, 9)}, 0)},
        {"recurrent_gemma/padded_batch", Batch::left_padded({ids(13, 9), ids(6, 10), ids(9, 11)}, 0)}}) {
    Model m = Model::load(test::fixture(fixture).string());
    // decays: a write at a reset token (each row's first) is refused; the continuation below checks them.
    for (const std::string path : {"layers.0.linear_attn.attention_values", "layers.1.linear_attn.betas",
                                   "layers.1.linear_attn.attention_head_outputs",
                                   "layers.0.linear_attn.attention_output", "layers.2.self_attn.attention_queries",
                                   "layers.2.self_attn.attention_keys", "layers.2.self_attn.attention_values",
                                   "layers.2.self_attn.attention_output", "layers.1.mlp.output", "layers.1.layer_input"})
      // 2 * kStep: at kStep layer 0's attention_values derivative (~0.07) is within float32 noise on an
      // AVX-512 host (off by 1.1%); at 2 * kStep every path is within 0.4% of the gradient.
      edit_fd(m, batch, path, 1e-2, fixture, 2 * kStep);
  }
}

// The state the call starts from (window rows and h: constants of the call) on a continuation and a
// one-token decode; state_output's gradient is zero.
TEST(GradRecurrentGemma, ContinuationStateInputMatchesFiniteDifferences) {
  Model m = Model::load(test::fixture("recurrent_gemma/griffin").string());
  const std::vector<std::string> paths{"layers.0.linear_attn.state_input", "layers.3.linear_attn.state_input",
                                       "layers.1.linear_attn.decays", "layers.2.self_attn.attention_keys"};
  continuation_fd(m, ids(10, 1), ids(7, 2), paths, 1e-2, "recurrent", kDecayStep);
  continuation_fd(m, ids(10, 1), ids(1, 2), paths, 1e-2, "recurrent", kDecayStep);
  Model a = Model::load(test::fixture("recurrent_gemma/attention_first").string());  // conv1d_width 3
  continuation_fd(a, ids(6, 1), ids(3, 2), {"layers.1.linear_attn.state_input", "layers.0.self_attn.attention_values"},
                  1e-2, "recurrent", kStep);
}
