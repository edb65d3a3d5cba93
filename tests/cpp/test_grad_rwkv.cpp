// Trace::backward on RWKV-4 (issue 25): directional finite differences of the float32 forward on the
// committed tiny fixtures (tests/fixtures/rwkv): the embeddings (pre_ln, LayerNorms, WKV time mixing with
// the max-shifted state, token shifts, receptance, squared-relu channel mixing, the inference rescale),
// each time-mixing value through an additive edit on a prompt and a left-padded batch, and state_input
// (num | den | max and both shift states) on a continuation and a decode step; the LayerNorm backward
// against double central differences. Every value against torch autograd: tests/python/test_grad_rwkv.py.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "fixture_util.h"
#include "grad/ops_grad.h"
#include "grad_check.h"
#include "mixlens/model.h"
#include "mixlens/trace.h"

using namespace mixlens;
using namespace mixlens::grad_check;

namespace {

const std::vector<const char*> kOneKernel{"recurrent"};  // the WKV token loop (chunked is refused)
// Keys enter through exp: below ~1e-2 (relative to their RMS) float32 noise dominates the differences.
constexpr float kStep = 1e-2f;

}  // namespace

TEST(GradRwkv, EmbeddingsMatchFiniteDifferences) {
  embeddings_fd("rwkv/basic", "rwkv", 20, 1e-2, kOneKernel);           // rescale_every 2
  embeddings_fd("rwkv/batch_eps_tied", "rwkv", 12, 1e-2, kOneKernel);  // tied head, no rescale
  embeddings_fd("rwkv/short_prompt", "rwkv", 3, 1e-2, kOneKernel);     // rescale after every block
}

TEST(GradRwkv, TimeMixValuesMatchFiniteDifferencesOfAnEdit) {
  Model m = Model::load(test::fixture("rwkv/basic").string());
  for (const auto& batch : {Batch::left_padded({ids(20, 9)}, 0), Batch::left_padded({ids(12, 9), ids(5, 4)}, 0)})
    for (const std::string path : {"layers.0.linear_attn.attention_keys", "layers.1.linear_attn.attention_values",
                                   "layers.2.linear_attn.decays", "layers.1.linear_attn.attention_queries",
                                   "layers.0.linear_attn.attention_head_outputs", "layers.2.linear_attn.attention_output",
                                   "layers.1.mlp.output", "layers.1.layer_input"})
      edit_fd(m, batch, path, 1e-2, std::to_string(batch.batch) + " rows",
              path.find("keys") != std::string::npos ? kStep : 2e-3f);  // decays must stay <= 0
}

// The state the call starts from on a continuation and a one-token decode: num | den | max, the
// time-mix and channel-mix shift states (state_output's gradient is zero).
TEST(GradRwkv, ContinuationStateInputMatchesFiniteDifferences) {
  Model m = Model::load(test::fixture("rwkv/basic").string());
  const std::vector<std::string> paths{"layers.0.linear_attn.state_input", "layers.2.linear_attn.state_input",
                                       "layers.1.linear_attn.attention_keys"};
  // 4 * kStep: at kStep the keys' derivative on the one-token call (~0.09) is within float32 noise on an
  // AVX-512 host (off by 1.0%); at 4 * kStep every path is within 0.1% of the gradient.
  continuation_fd(m, ids(10, 1), ids(7, 2), paths, 1e-2, "recurrent", 4 * kStep);
  continuation_fd(m, ids(10, 1), ids(1, 2), paths, 1e-2, "recurrent", 4 * kStep);
}

TEST(GradRwkv, LayerNormBackwardMatchesDoubleFiniteDifferences) {
  const int64_t rows = 3, dim = 7;
  const std::vector<double> x = rnd(static_cast<size_t>(rows * dim), 1), w = rnd(static_cast<size_t>(dim), 2),
                            dy = rnd(static_cast<size_t>(rows * dim), 3);
  const double eps = 1e-5;
  auto s = [&](const std::vector<double>& xv) {
    double out = 0;
    for (int64_t r = 0; r < rows; ++r) {
      double m = 0, v = 0;
      for (int64_t i = 0; i < dim; ++i) m += xv[static_cast<size_t>(r * dim + i)] / dim;
      for (int64_t i = 0; i < dim; ++i) v += std::pow(xv[static_cast<size_t>(r * dim + i)] - m, 2) / dim;
      for (int64_t i = 0; i < dim; ++i)
        out += dy[static_cast<size_t>(r * dim + i)] * (xv[static_cast<size_t>(r * dim + i)] - m) / std::sqrt(v + eps) *
               w[static_cast<size_t>(i)];
    }
    return out;
  };
  const std::vector<float> xf = f32(x), wf = f32(w), dyf = f32(dy);
  std::vector<float> dx(xf.size(), 0.0f);
  grad::layernorm_backward(xf.data(), wf.data(), dyf.data(), dx.data(), rows, dim, static_cast<float>(eps), false);
  EXPECT_LE(rel_rms(dx, fd(x, s)), kTol);
}
