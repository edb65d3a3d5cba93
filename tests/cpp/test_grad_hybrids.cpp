// Trace::backward on the Mamba-2 hybrids (issue 12): directional finite differences of a float32
// forward on every committed Nemotron-H / Bamba / Falcon-H1 / Granite 4.0-H / Zamba2 fixture, through writes that add
// h * v to a value (embeddings, attention queries / keys / values, mixer values, MLP outputs, the
// state a decode step starts from): <grad(value), v> against (f(h) - f(-h)) / 2h, f = <W, logits>.
// Prompts on both kernel paths (left-padded batch) and a decode step over the KV cache. Every
// value's gradient is checked against torch autograd in tests/python/test_grad_hybrids.py.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "grad_check.h"
#include "fixture_util.h"
#include "mixlens/errors.h"
#include "mixlens/model.h"
#include "mixlens/trace.h"

using namespace mixlens;
using namespace mixlens::grad_check;

namespace {

struct Fixture {
  const char* dir;
  const char* family;
  /// Granite's softmax top-2 of 4 experts: a prompt-wide FD step flips some token's routing (the two
  /// central differences disagree), so its prompt is checked against torch autograd only
  /// (tests/python/test_grad_hybrids.py, routing held constant); its decode step is checked here.
  bool prompt_routing_flips = false;
  /// Jamba's top-k of a softmax over every router logit flips a routing within the step of the
  /// decode / continuation points along the embeddings' direction (measured on a grid: a jump at
  /// h = +4e-4 on padded_bias; the derivative at h -> 0, 2.0 / 313.7 / 131.7, agrees with the
  /// backward's 2.02 / 313.97 / 131.2), so those two checks skip embed_tokens.output there; every
  /// later value is checked, and torch autograd checks the prompt's (test_grad_hybrids.py).
  bool decode_embed_routing_flips = false;
};
const Fixture kFixtures[] = {{"nemotron_h/groups2_edits", "nemotron_h"}, {"nemotron_h/padded_batch", "nemotron_h"},
                             {"nemotron_h/moe_latent", "nemotron_h"},    {"bamba/groups2_edits", "bamba"},
                             {"bamba/padded_batch", "bamba"},            {"falcon_h1/norm_gate_first_edits", "falcon_h1"},
                             {"falcon_h1/no_rms_norm_padded", "falcon_h1"}, {"falcon_h1/norm_before_gate", "falcon_h1"},
                             {"granitemoehybrid/rope_moe_edits", "granitemoehybrid", true},
                             {"granitemoehybrid/nope_dense_padded", "granitemoehybrid"},
                             {"jamba/moe_edits", "jamba", true, true},
                             {"jamba/padded_bias", "jamba", false, true},
                             {"zamba2/shared_lora_edits", "zamba2"},   {"zamba2/nope_padded", "zamba2"},
                             {"zamba/shared_edits", "zamba"},          {"zamba/padded_bias", "zamba"}};

// The values a fixture's FD checks perturb: embeddings, and per kind the first layer's values.
std::vector<std::string> paths_of(const Model& m, bool decode) {
  std::vector<std::string> p{"embed_tokens.output"};
  const auto& kinds = m.info().layer_kinds;
  int attn = -1, mix = -1, mlp = -1;
  for (int i = 0; i < static_cast<int>(kinds.size()); ++i) {
    const std::string k(layer_kind_name(kinds[static_cast<size_t>(i)]));
    if (attn < 0 && (k == "attention" || k == "hybrid")) attn = i;
    if (mix < 0 && (k == "mamba2" || k == "mamba" || k == "hybrid")) mix = i;
    if (mlp < 0 && (k == "mlp" || k == "moe" || k == "hybrid" || m.info().family == "bamba" ||
                    m.info().family == "granitemoehybrid" || m.info().family == "jamba"))
      mlp = i;
  }
  const std::string a = "layers." + std::to_string(attn) + ".self_attn.", x = "layers." + std::to_string(mix) + ".linear_attn.";
  for (const char* v : {"attention_queries", "attention_keys", "attention_values"}) p.push_back(a + v);
  p.push_back(x + "attention_head_outputs");
  p.push_back(decode ? x + "state_input" : x + "attention_values");
  if (m.info().family == "zamba") p.push_back(x + "attention_keys");  // B per Mamba head
  p.push_back("layers." + std::to_string(mlp) + ".mlp.output");
  // Zamba2: the last depth of a shared block too (its weights' other use is the first depth).
  int last_shared = -1;
  for (int i = 0; i < static_cast<int>(kinds.size()); ++i)
    if (std::string(layer_kind_name(kinds[static_cast<size_t>(i)])) == "hybrid") last_shared = i;
  if (last_shared > attn) {
    p.push_back("layers." + std::to_string(last_shared) + ".self_attn.attention_values");
    p.push_back("layers." + std::to_string(last_shared) + ".mlp.output");
  }
  p.push_back("layers." + std::to_string(static_cast<int>(kinds.size()) / 2) + ".layer_output");
  return p;
}

const std::vector<int32_t> kLong{5, 9, 3, 17, 2, 8, 11, 4, 6, 21, 13, 7, 30, 12, 19};
const std::vector<int32_t> kShort{14, 6, 22, 9, 3};

}  // namespace

TEST(GradHybrids, PromptMatchesDirectionalFiniteDifferencesOnBothKernels) {
  for (const auto& fx : kFixtures) {
    if (fx.prompt_routing_flips) continue;
    Model m = Model::load(test::fixture(fx.dir).string());
    const Batch in = Batch::left_padded({kLong, kShort}, 0);
    for (const char* route : {"chunked", "recurrent"}) {
      RouteGuard guard(fx.family, route);
      check_paths(m, in, nullptr, paths_of(m, false), std::string(fx.dir) + " " + route);
    }
  }
}

// A decode step: one token per row over the KV cache (cached keys constant) and the SSM state the
// step starts from (state_input); Falcon-H1 without the norm gates inside the decode kernel. Then
// a three-token continuation from the same cache.
TEST(GradHybrids, DecodeAndContinuationMatchDirectionalFiniteDifferences) {
  for (const auto& fx : kFixtures) {
    Model m = Model::load(test::fixture(fx.dir).string());
    Cache cache = m.new_cache(2);
    m.forward(Batch::left_padded({kLong, kShort}, 0), cache);
    const Batch step = Batch::left_padded({{7}, {3}}, 0);
    std::vector<std::string> paths = paths_of(m, true);
    if (fx.decode_embed_routing_flips) paths.erase(paths.begin());  // embed_tokens.output (see Fixture)
    check_paths(m, step, &cache, paths, std::string(fx.dir) + " decode");
    // A multi-token continuation (chunked kernel from a cached state, attention over past keys).
    const Batch cont = Batch::left_padded({{7, 12, 4}, {3, 8, 1}}, 0);
    check_paths(m, cont, &cache, paths, std::string(fx.dir) + " continuation");
  }
}

// Zamba2's shared blocks read the embeddings a gradient call keeps (grad::Kept::embeddings); dropping
// what the forward kept (the backward then recomputes the embeddings, with a write to them, and the
// mixers' products) changes no gradient.
TEST(GradHybrids, Zamba2KeptEmbeddingsGiveTheRecomputedGradients) {
  Model m = Model::load(test::fixture("zamba2/shared_lora_edits").string());
  const std::vector<std::string> paths{"embed_tokens.output", "layers.*.layer_input", "layers.*.self_attn.attention_values",
                                       "layers.*.mlp.output"};
  expect_kept_equals_recomputed(m, Batch::left_padded({kLong, kShort}, 0), paths, [](Trace& tr) {
    tr.edit("embed_tokens.output", [](Tensor& e, const SiteContext&) {
      for (int64_t i = 0; i < e.numel(); i += 5) e[i] = 0.125f;
    });
  });
}
