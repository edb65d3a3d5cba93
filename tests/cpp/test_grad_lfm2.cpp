// Trace::backward on LFM2 / LFM2-MoE (issue 25): directional finite differences of the float32 forward
// on the committed tiny fixtures (tests/fixtures/lfm2, lfm2_moe): the embeddings (gated short conv,
// GQA attention with q / k norms, SwiGLU MLP, the sigmoid-routed MoE), the short conv values through
// an additive edit, and state_input (the conv window) on a continuation and a decode step. Every value
// against torch autograd: tests/python/test_grad_lfm2.py.
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

const std::vector<const char*> kOneKernel{"recurrent"};  // the short conv's token loop (chunked is refused)

}  // namespace

TEST(GradLfm2, EmbeddingsMatchFiniteDifferences) {
  embeddings_fd("lfm2/conv_attn", "lfm2", 20, 1e-2, kOneKernel);
  embeddings_fd("lfm2/bias_short_prompt", "lfm2", 9, 1e-2, kOneKernel);  // conv_bias, L_cache 4
  embeddings_fd("lfm2_moe/moe_conv_attn", "lfm2_moe", 20, 1e-2, kOneKernel);  // sigmoid router, routed scale
  embeddings_fd("lfm2_moe/padded_batch", "lfm2_moe", 12, 1e-2, kOneKernel);   // no expert bias, no renormalisation
}

// The gradient of each short conv value (and an attention and MLP value) through an additive edit, on
// a prompt and on a left-padded batch (the padded rows' conv starts at their first real token).
TEST(GradLfm2, ShortConvValuesMatchFiniteDifferencesOfAnEdit) {
  for (const auto& [fixture, batch] :
       {std::pair<std::string, Batch>{"lfm2/conv_attn", Batch::left_padded({ids(20, 9)}, 0)},
        {"lfm2/padded_batch", Batch::left_padded({ids(13, 9), ids(6, 10), ids(9, 11)}, 0)},
        {"lfm2/bias_short_prompt", Batch::left_padded({ids(9, 3)}, 0)}}) {
    Model m = Model::load(test::fixture(fixture).string());
    for (const std::string path : {"layers.0.linear_attn.attention_queries", "layers.0.linear_attn.attention_keys",
                                   "layers.0.linear_attn.attention_values", "layers.0.linear_attn.attention_head_outputs",
                                   "layers.0.linear_attn.attention_output", "layers.1.self_attn.attention_keys",
                                   "layers.1.self_attn.attention_queries", "layers.0.mlp.output"})
      edit_fd(m, batch, path, 1e-2, fixture);
  }
  Model moe = Model::load(test::fixture("lfm2_moe/moe_conv_attn").string());
  for (const std::string path : {"layers.2.linear_attn.attention_keys", "layers.1.mlp.output"})
    edit_fd(moe, Batch::left_padded({ids(20, 9)}, 0), path, 1e-2, "lfm2_moe");
}

// The window the call starts from (a constant of the call) on a continuation and a one-token decode;
// state_output's gradient is zero.
TEST(GradLfm2, ContinuationStateInputMatchesFiniteDifferences) {
  Model m = Model::load(test::fixture("lfm2/continuation").string());
  const std::vector<std::string> paths{"layers.0.linear_attn.state_input", "layers.2.linear_attn.state_input",
                                       "layers.2.linear_attn.attention_values", "layers.1.self_attn.attention_values"};
  continuation_fd(m, ids(10, 1), ids(7, 2), paths, 1e-2, "recurrent");
  continuation_fd(m, ids(10, 1), ids(1, 2), paths, 1e-2, "recurrent");
  Model b = Model::load(test::fixture("lfm2/bias_short_prompt").string());  // L_cache 4, biases
  continuation_fd(b, ids(5, 1), ids(3, 2), {"layers.0.linear_attn.state_input"}, 1e-2, "recurrent");
}
