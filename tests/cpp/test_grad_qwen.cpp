// Trace::backward on the Qwen hybrids (issue 12): directional finite differences of the float32
// forward on the committed tiny fixtures (tests/fixtures/qwen3_5, qwen3_next): the embeddings on both
// kernel paths (gated DeltaNet + gated attention + SwiGLU / MoE), GDN values through an additive edit,
// and state_input on a continuation. Every value against torch autograd: tests/python/test_grad_qwen.py.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <string>

#include "fixture_util.h"
#include "mixlens/errors.h"
#include "mixlens/model.h"
#include "mixlens/trace.h"

using namespace mixlens;

namespace {

Tensor randn(const Shape& s, uint32_t seed, float scale = 1.0f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> n(0.0f, scale);
  Tensor t(s);
  for (int64_t i = 0; i < t.numel(); ++i) t[i] = n(g);
  return t;
}

double dot(const Tensor& a, const Tensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

// A random direction with the RMS of `like` (a step relative to the value's own scale).
Tensor direction(const Tensor& like, uint32_t seed) {
  double ss = 0;
  for (float x : like) ss += static_cast<double>(x) * x;
  return randn(like.shape(), seed, static_cast<float>(std::sqrt(ss / static_cast<double>(like.numel()))));
}

Tensor axpy(const Tensor& x, float h, const Tensor& v) {
  Tensor o = x.clone();
  for (int64_t i = 0; i < o.numel(); ++i) o[i] += h * v[i];
  return o;
}

// Central differences with one Richardson step (error O(h^4)): the tiny random fixtures are sharply
// curved, so a plain central difference needs steps so small that float32 noise dominates.
double richardson(const std::function<double(float)>& f, float h) {
  const double d1 = (f(h) - f(-h)) / (2.0 * h), d2 = (f(h / 2) - f(-h / 2)) / static_cast<double>(h);
  return (4.0 * d2 - d1) / 3.0;
}

struct Route {
  std::string fam;
  Route(std::string f, const char* r) : fam(std::move(f)) { route_kernels(fam, r); }
  ~Route() { route_kernels(fam, "default"); }
};

std::vector<int32_t> ids(int n, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<int32_t> v;
  for (int i = 0; i < n; ++i) v.push_back(static_cast<int32_t>(1 + g() % 90));
  return v;
}

// d/dh <W, logits(E + h v)> at 0 == <grad(embed_tokens.output), v> on both kernel paths.
void embeddings_fd(const std::string& fixture, const std::string& family, int n_tokens, double tol) {
  Model m = Model::load(test::fixture(fixture).string());
  Trace probe;
  probe.save("embed_tokens.output");
  m.run({ids(n_tokens, 7)}, &probe);
  const Tensor E = probe.get("embed_tokens.output");
  for (const char* route : {"chunked", "recurrent"}) {
    Route guard(family, route);
    Trace tr;
    tr.save("embed_tokens.output").enable_grad();
    const Tensor logits = m.run(Batch::from_embeddings(E), &tr);
    EXPECT_EQ(tr.calls().back().kernel, route);
    const Tensor W = randn(logits.shape(), 3);
    tr.backward(W);
    const Tensor g = tr.grad("embed_tokens.output");
    const Tensor v = direction(E, 4);
    const double fd =
        richardson([&](float h) { return dot(W, m.run(Batch::from_embeddings(axpy(E, h, v)))); }, 2e-3f);
    EXPECT_NEAR(dot(g, v), fd, tol * std::abs(fd)) << fixture << " " << route;
  }
}

}  // namespace

TEST(GradQwen, Qwen35EmbeddingsMatchFiniteDifferences) {
  embeddings_fd("qwen3_5/hv_eq_hk_chunks", "qwen3_5", 70, 1e-2);  // two chunks, attention, partial RoPE
  embeddings_fd("qwen3_5/hv_2hk", "qwen3_5", 20, 1e-2);           // q/k head repetition
}

TEST(GradQwen, Qwen3NextMoeEmbeddingsMatchFiniteDifferences) {
  // Small steps also keep the router's top-k choice (a constant of the backward) unchanged.
  embeddings_fd("qwen3_next/moe_hv_2hk", "qwen3_next", 30, 1e-2);
}

// The gradient of a GDN value through an additive edit of it (betas, decays, keys, head outputs).
TEST(GradQwen, GatedDeltaValuesMatchFiniteDifferencesOfAnEdit) {
  Model m = Model::load(test::fixture("qwen3_5/hv_2hk").string());
  const std::vector<int32_t> x = ids(20, 9);
  for (const char* route : {"chunked", "recurrent"}) {
    Route guard("qwen3_5", route);
    for (const std::string path : {"layers.0.linear_attn.betas", "layers.0.linear_attn.decays",
                                   "layers.2.linear_attn.attention_keys", "layers.0.linear_attn.attention_queries",
                                   "layers.2.linear_attn.attention_head_outputs", "layers.1.self_attn.attention_keys",
                                   "layers.1.self_attn.gate"}) {
      Trace tr;
      tr.save(path).enable_grad();
      const Tensor logits = m.run({x}, &tr);
      const Tensor W = randn(logits.shape(), 5);
      tr.backward(W);
      const Tensor g = tr.grad(path);
      const Tensor v = direction(tr.get(path), 6);
      auto f = [&](float h) {
        Trace t;
        t.edit(path, [&](Tensor& s, const SiteContext&) { s = axpy(s, h, v); });
        return dot(W, m.run({x}, &t));
      };
      const double fd = richardson(f, 2e-3f);
      EXPECT_NEAR(dot(g, v), fd, 1e-2 * std::abs(fd)) << path << " " << route;
    }
  }
}

TEST(GradQwen, ContinuationStateInputMatchesFiniteDifferences) {
  Model m = Model::load(test::fixture("qwen3_5/continuation").string());
  Cache cache = m.new_cache(1);
  m.forward(Batch::left_padded({ids(10, 1)}, 0), cache);
  const Batch cont = Batch::left_padded({ids(7, 2)}, 0);
  const char* path = "layers.2.linear_attn.state_input";
  Cache c1 = cache.copy();
  Trace tr;
  tr.save(path).enable_grad();
  const Tensor logits = m.forward(cont, c1, &tr);
  EXPECT_EQ(tr.calls().back().kernel, "chunked");
  const Tensor W = randn(logits.shape(), 5);
  tr.backward(W);
  const Tensor g = tr.grad(path);
  const Tensor v = direction(tr.get(path, 1), 6);  // the cache's second call
  auto f = [&](float h) {
    Cache c = cache.copy();
    Trace t;
    t.edit(path, [&](Tensor& s, const SiteContext&) { s = axpy(s, h, v); });
    return dot(W, m.forward(cont, c, &t));
  };
  const double fd = richardson(f, 2e-3f);
  EXPECT_NEAR(dot(g, v), fd, 1e-2 * std::abs(fd));
  tr.backward(W, {"layers.2.linear_attn.state_output"});
  for (float s : tr.grad("layers.2.linear_attn.state_output")) EXPECT_EQ(s, 0.0f);
}
