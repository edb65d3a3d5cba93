// Trace::backward on whole models (issue 12): directional finite differences of a float32 forward
// on the tiny Mamba-2 fixtures (both kernel paths, a prompt from embeddings and a continuation
// from a cache), and the errors. Every value's gradient is checked against torch autograd in
// tests/python/test_grad_mamba2.py; each op's backward by double-precision finite differences in
// test_grad_ops.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <string>

#include "fixture_util.h"
#include "grad_check.h"
#include "mixlens/errors.h"
#include "mixlens/grad.h"
#include "mixlens/model.h"
#include "mixlens/trace.h"

using namespace mixlens;
using namespace mixlens::grad_check;

namespace {

const std::vector<int32_t> kIds{5, 9, 3, 17, 2, 8, 11, 4, 6, 21, 13, 7};

}  // namespace

// d/dh f(E + h v) at 0 == <grad(embed_tokens.output), v>, f = <W, logits>.
TEST(Grad, Mamba2EmbeddingsMatchDirectionalFiniteDifferences) {
  Model m = Model::load(test::fixture("mamba2/g1_chunks").string());
  Trace probe;
  probe.save("embed_tokens.output");
  m.run({kIds}, &probe);
  const Tensor E = probe.get("embed_tokens.output");
  for (const char* route : {"chunked", "recurrent"}) {
    RouteGuard guard("mamba2", route);
    Trace tr;
    tr.save("embed_tokens.output").save("layers.*.linear_attn.betas").enable_grad();
    const Tensor logits = m.run(Batch::from_embeddings(E), &tr);
    EXPECT_EQ(tr.calls().back().kernel, route);
    const Tensor W = random_like(logits.shape(), 3);
    tr.backward(W);
    const Tensor g = tr.grad("embed_tokens.output");
    ASSERT_EQ(g.shape(), E.shape());
    EXPECT_TRUE(tr.has_grad("layers.2.linear_attn.betas"));
    const Tensor v = random_like(E.shape(), 4);
    const float h = 1e-2f;
    const double fp = dot(W, m.run(Batch::from_embeddings(axpy(E, h, v))));
    const double fm = dot(W, m.run(Batch::from_embeddings(axpy(E, -h, v))));
    const double fd = (fp - fm) / (2.0 * h), an = dot(g, v);
    EXPECT_NEAR(an, fd, 1e-2 * std::abs(fd)) << route;
  }
}

// The forward keeps in_proj's output and the scan's y (after writes) for the backward; dropping them
// (the backward then recomputes both) changes no gradient, on both kernels and through an edit of y.
TEST(Grad, Mamba2KeptForwardProductsGiveTheRecomputedGradients) {
  Model m = Model::load(test::fixture("mamba2/g1_chunks").string());
  const std::vector<std::string> paths{"embed_tokens.output", "layers.*.layer_input", "layers.*.linear_attn.betas",
                                       "layers.*.linear_attn.attention_values", "layers.*.linear_attn.attention_head_outputs"};
  for (const char* route : {"chunked", "recurrent"}) {
    RouteGuard guard("mamba2", route);
    expect_kept_equals_recomputed(m, Batch::left_padded({kIds}, 0), paths, [](Trace& tr) {
      tr.edit("layers.1.linear_attn.attention_head_outputs", [](Tensor& y, const SiteContext&) {
        for (int64_t i = 0; i < y.numel(); i += 7) y[i] = 0.25f;
      });
    });
  }
}

// A continuation: the conv window and the state come from the cache (constants); the gradient of
// state_input against finite differences of a written state_input.
TEST(Grad, Mamba2ContinuationStateInputMatchesFiniteDifferences) {
  Model m = Model::load(test::fixture("mamba2/g1_chunks").string());
  Cache cache = m.new_cache(1);
  m.forward(Batch::left_padded({kIds}, 0), cache);
  const Batch cont = Batch::left_padded({{7, 3, 12, 5, 1}}, 0);
  const char* path = "layers.1.linear_attn.state_input";
  Cache c1 = cache.copy();
  Trace tr;
  tr.save(path).enable_grad();
  const Tensor logits = m.forward(cont, c1, &tr);
  const Tensor W = random_like(logits.shape(), 5);
  tr.backward(W);
  const Tensor g = tr.grad(path);
  const Tensor v = random_like(g.shape(), 6);
  auto f = [&](float h) {
    Cache c = cache.copy();
    Trace t;
    t.edit(path, [&](Tensor& s, const SiteContext&) { s = axpy(s, h, v); });
    return dot(W, m.forward(cont, c, &t));
  };
  const float h = 1e-2f;
  const double fd = (f(h) - f(-h)) / (2.0 * h), an = dot(g, v);
  EXPECT_NEAR(an, fd, 1e-2 * std::abs(fd));
  // state_output feeds only the next call: zero gradient for this call's metric.
  tr.backward(W, {"layers.1.linear_attn.state_output"});
  for (float x : tr.grad("layers.1.linear_attn.state_output")) EXPECT_EQ(x, 0.0f);
}

// A per-token state's gradient is dL/dS_t: token t of the layer's `states` gradient (both kernel
// paths), the stack itself kept only when it was asked for too.
TEST(Grad, PerTokenStateGradientIsThatTokenOfTheStatesGradient) {
  Model m = Model::load(test::fixture("mamba2/g1_chunks").string());
  for (const char* route : {"chunked", "recurrent"}) {
    route_kernels("mamba2", route);
    Trace tr;
    tr.enable_grad();
    const Tensor logits = m.run({kIds}, &tr);
    const int64_t T = logits.size(1);
    tr.backward(logits, {"layers.1.linear_attn.states"});
    const Tensor S = tr.grad("layers.1.linear_attn.states");
    tr.backward(logits, {"layers.1.linear_attn.state@t2", "layers.1.linear_attn.state@t-1"});
    EXPECT_FALSE(tr.has_grad("layers.1.linear_attn.states"));
    const Tensor g2 = tr.grad("layers.1.linear_attn.state@t2"), gl = tr.grad("layers.1.linear_attn.state@t-1");
    const int64_t per = S.numel() / T;  // batch 1
    ASSERT_EQ(g2.numel(), per);
    ASSERT_EQ(g2.size(0), 1);
    double norm = 0;
    for (int64_t i = 0; i < per; ++i) {
      EXPECT_EQ(g2[i], S[2 * per + i]) << route << " " << i;
      EXPECT_EQ(gl[i], S[(T - 1) * per + i]) << route << " " << i;
      norm += std::abs(g2[i]);
    }
    EXPECT_GT(norm, 0.0) << route;
  }
  route_kernels("mamba2", "default");
}

TEST(Grad, ErrorsNameTheProblem) {
  Model m = Model::load(test::fixture("mamba2/g1_chunks").string());
  Trace plain;
  const Tensor logits = m.run({kIds}, &plain);
  EXPECT_THROW(plain.backward(logits), InputError);  // not recorded
  Trace tr;
  tr.enable_grad();
  m.run({kIds}, &tr);
  EXPECT_THROW(tr.backward(Tensor({1, 2, 3})), InputError);
  EXPECT_THROW(tr.backward(logits, {"layers.0.linear_attn.betaz"}), UnknownValueError);
  EXPECT_THROW(tr.backward(logits, {"layers.0.linear_attn.betas@t1"}), UnknownValueError);  // '@t' is state's only
  EXPECT_THROW(tr.backward(logits, {"layers.0.linear_attn.state@t99"}), InputError);        // outside the call
  tr.backward(logits, {"layers.0.linear_attn.betas"});
  EXPECT_THROW(tr.grad("layers.1.linear_attn.betas"), UnknownValueError);
  // A call backward cannot differentiate (a per-token state write) says so instead of returning
  // wrong numbers.
  Model m1 = Model::load(test::fixture("mamba/basic").string());
  Trace t1;
  t1.edit("layers.0.linear_attn.state@t1", [](Tensor& s, const SiteContext&) { s[0] += 1.0f; }).enable_grad();
  const Tensor l1 = m1.run({{1, 2, 3}}, &t1);
  EXPECT_THROW(t1.backward(l1), UnsupportedError);
}

// The metric helpers' gradients against central differences of their own value (double softmax).
TEST(Grad, MetricHelpersMatchFiniteDifferences) {
  const Tensor z = random_like({2, 3, 5}, 9);
  const std::vector<std::function<metrics::MetricGrad(const Tensor&)>> ms = {
      [](const Tensor& x) { return metrics::log_prob(x, 3); },
      [](const Tensor& x) { return metrics::log_prob(x, 1, 0, 1); },
      [](const Tensor& x) { return metrics::logit_diff(x, 4, 2, -2); },
      [](const Tensor& x) { return metrics::sequence_log_prob(x, {{1, 2, -1}, {0, 4, 3}}); }};
  for (size_t k = 0; k < ms.size(); ++k) {
    const Tensor g = ms[k](z).dlogits;
    for (int64_t i = 0; i < z.numel(); ++i) {
      const float h = 1e-2f;
      Tensor p = z.clone(), m = z.clone();
      p[i] += h;
      m[i] -= h;
      EXPECT_NEAR(g[i], (ms[k](p).value - ms[k](m).value) / (2.0 * h), 2e-4) << "metric " << k << " element " << i;
    }
  }
  EXPECT_THROW(metrics::log_prob(z, 5), InputError);
  EXPECT_THROW(metrics::log_prob(z, 1, 3), InputError);
  EXPECT_THROW(metrics::sequence_log_prob(z, {{1, 2, 3}}), InputError);
}

// Mamba-1 (issue 12; every value against torch autograd in tests/python/test_grad_mamba.py): the
// committed fixture, both selective-scan algorithms (the chunked one with several chunks and with
// the default single chunk), directional finite differences on the embeddings.
namespace {
struct Mamba1Route {
  std::string family;
  Mamba1Route(const char* r, std::string f = "mamba") : family(std::move(f)) { route_kernels(family, r); }
  ~Mamba1Route() { route_kernels(family, "default"); }
};

class Mamba1Grad : public ::testing::TestWithParam<const char*> {};
}  // namespace

// Mamba-1 and FalconMamba (whose backward also differentiates the norms on dt_low, B and C).
TEST_P(Mamba1Grad, EmbeddingsMatchDirectionalFiniteDifferences) {
  const std::string family = GetParam();
  Model m = Model::load(test::fixture(family + "/basic").string());
  Trace probe;
  probe.save("embed_tokens.output");
  m.run({kIds}, &probe);
  const Tensor E = probe.get("embed_tokens.output");
  for (const char* route : {"chunked", "recurrent"})
    for (int64_t chunk : {int64_t{0}, int64_t{5}}) {
      Mamba1Route guard(route, family);
      m.set_chunk_size(chunk);
      Trace tr;
      tr.save("embed_tokens.output").save("layers.*.linear_attn.betas").enable_grad();
      const Tensor logits = m.run(Batch::from_embeddings(E), &tr);
      EXPECT_EQ(tr.calls().back().kernel, route);
      const Tensor W = random_like(logits.shape(), 13);
      tr.backward(W);
      const Tensor g = tr.grad("embed_tokens.output");
      ASSERT_EQ(g.shape(), E.shape());
      EXPECT_TRUE(tr.has_grad("layers.2.linear_attn.betas"));
      // Embeddings are ~0.1: a direction of that size keeps the central difference in its quadratic range.
      const Tensor v = random_like(E.shape(), 14, 0.1f);
      const float h = 1e-2f;
      const double fp = dot(W, m.run(Batch::from_embeddings(axpy(E, h, v))));
      const double fm = dot(W, m.run(Batch::from_embeddings(axpy(E, -h, v))));
      const double fd = (fp - fm) / (2.0 * h), an = dot(g, v);
      EXPECT_NEAR(an, fd, 1e-2 * std::abs(fd)) << route << " chunk " << chunk;
      // A wrong backward would not pass by luck: the directional derivative is not small.
      EXPECT_GT(std::abs(fd), 1e-3) << route;
    }
  m.set_chunk_size(0);
}

// Continuations (a multi-token call and a decode step): the conv window and the state come from the
// cache; state_input's gradient against finite differences of a written state_input, and (the
// multi-token call) the betas gradient against finite differences of a written betas.
TEST_P(Mamba1Grad, ContinuationStateInputMatchesFiniteDifferences) {
  Model m = Model::load(test::fixture(std::string(GetParam()) + "/basic").string());
  Cache cache = m.new_cache(1);
  m.forward(Batch::left_padded({kIds}, 0), cache);
  for (const std::vector<int32_t>& toks : {std::vector<int32_t>{7, 3, 12, 5, 1}, std::vector<int32_t>{9}}) {
    const Batch cont = Batch::left_padded({toks}, 0);
    for (const char* path : {"layers.1.linear_attn.state_input", "layers.0.linear_attn.betas"}) {
      // One decode step's dt moves the float32 metric too little for a clean difference (torch checks it).
      if (toks.size() == 1 && std::string(path).ends_with("betas")) continue;
      Cache c1 = cache.copy();
      Trace tr;
      tr.save(path).enable_grad();
      const Tensor logits = m.forward(cont, c1, &tr);
      const Tensor W = random_like(logits.shape(), 15);
      tr.backward(W);
      const Tensor g = tr.grad(path);
      // A relative direction for betas (dt > 0 stays > 0 on both sides).
      Tensor v = random_like(g.shape(), 16);
      if (std::string(path).ends_with("betas")) {
        const Tensor dt = tr.get(path, tr.calls().back().step);
        for (int64_t k = 0; k < v.numel(); ++k) v[k] *= dt[k];
      }
      auto f = [&](float h) {
        Cache c = cache.copy();
        Trace t;
        t.edit(path, [&](Tensor& s, const SiteContext&) { s = axpy(s, h, v); });
        return dot(W, m.forward(cont, c, &t));
      };
      const float h = 1e-2f;
      const double fd = (f(h) - f(-h)) / (2.0 * h), an = dot(g, v);
      EXPECT_NEAR(an, fd, 1e-2 * std::abs(fd)) << path << " tokens " << toks.size();
      EXPECT_GT(std::abs(fd), 1e-4) << path;
    }
    Cache c2 = cache.copy();
    Trace tr;
    tr.enable_grad();
    const Tensor W = random_like(m.forward(cont, c2, &tr).shape(), 17);
    tr.backward(W, {"layers.1.linear_attn.state_output"});
    for (float x : tr.grad("layers.1.linear_attn.state_output")) EXPECT_EQ(x, 0.0f);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, Mamba1Grad, ::testing::Values("mamba", "falcon_mamba"));
