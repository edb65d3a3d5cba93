// Trace::backward on the Qwen hybrids (issue 12): directional finite differences of the float32
// forward on the committed tiny fixtures (tests/fixtures/qwen3_5, qwen3_next): the embeddings on both
// kernel paths (gated DeltaNet + gated attention + SwiGLU / MoE), GDN values through an additive edit,
// and state_input on a continuation. Every value against torch autograd: tests/python/test_grad_qwen.py.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <tuple>
#include <string>

#include "fixture_util.h"
#include "grad_check.h"
#include "grad/ops_grad.h"
#include "mixlens/errors.h"
#include "mixlens/model.h"
#include "mixlens/trace.h"

using namespace mixlens;
using namespace mixlens::grad_check;

namespace {

// A random direction with the RMS of `like` (a step relative to the value's own scale).
Tensor direction(const Tensor& like, uint32_t seed) {
  double ss = 0;
  for (float x : like) ss += static_cast<double>(x) * x;
  return random_like(like.shape(), seed, static_cast<float>(std::sqrt(ss / static_cast<double>(like.numel()))));
}

// Central differences with one Richardson step (error O(h^4)): the tiny random fixtures are sharply
// curved, so a plain central difference needs steps so small that float32 noise dominates.
double richardson(const std::function<double(float)>& f, float h) {
  const double d1 = (f(h) - f(-h)) / (2.0 * h), d2 = (f(h / 2) - f(-h / 2)) / static_cast<double>(h);
  return (4.0 * d2 - d1) / 3.0;
}

using Route = grad_check::RouteGuard;

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
    const Tensor W = random_like(logits.shape(), 3);
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
      const Tensor W = random_like(logits.shape(), 5);
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
  const Tensor W = random_like(logits.shape(), 5);
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

// The gated delta rule's backward (grad::gated_delta_backward, its own checkpoint pass, several
// checkpoint chunk lengths) against central differences of a double-precision token recurrence
// written here (L2 norms with eps 1e-6 and the 1/sqrt(Dk) query scale), every input element.
TEST(GradQwen, GatedDeltaRuleMatchesDoubleFiniteDifferences) {
  const int64_t T = 7, H = 2, Dk = 3, Dv = 4;
  std::mt19937 gen(11);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  auto rnd = [&](int64_t n, double lo, double hi) {
    std::vector<double> v(static_cast<size_t>(n));
    for (auto& x : v) x = lo + (hi - lo) * (u(gen) + 1.0) / 2.0;
    return v;
  };
  // x = q | k | v | g | beta | S0
  const int64_t nq = T * H * Dk, nv = T * H * Dv, nh = T * H, ns = H * Dk * Dv;
  std::vector<double> x = rnd(nq, -1, 1), t;
  for (auto [n, lo, hi] : {std::tuple<int64_t, double, double>{nq, -1, 1}, {nv, -1, 1}, {nh, -1.0, -0.05}, {nh, 0.1, 0.9},
                           {ns, -0.5, 0.5}}) {
    t = rnd(n, lo, hi);
    x.insert(x.end(), t.begin(), t.end());
  }
  const std::vector<double> dout = rnd(nv, -1, 1);
  auto objective = [&](const std::vector<double>& p) {
    const double* q = p.data();
    const double* k = q + nq;
    const double* v = k + nq;
    const double* g = v + nv;
    const double* be = g + nh;
    const double* S0 = be + nh;
    double s = 0.0;
    for (int64_t h = 0; h < H; ++h) {
      std::vector<double> S(S0 + h * Dk * Dv, S0 + (h + 1) * Dk * Dv), qn(Dk), kn(Dk), mem(Dv);
      for (int64_t tt = 0; tt < T; ++tt) {
        const int64_t r = tt * H + h;
        double sq = 0, sk = 0;
        for (int64_t d = 0; d < Dk; ++d) {
          sq += q[r * Dk + d] * q[r * Dk + d];
          sk += k[r * Dk + d] * k[r * Dk + d];
        }
        for (int64_t d = 0; d < Dk; ++d) {
          qn[d] = q[r * Dk + d] / std::sqrt(sq + 1e-6) / std::sqrt(static_cast<double>(Dk));
          kn[d] = k[r * Dk + d] / std::sqrt(sk + 1e-6);
        }
        const double dec = std::exp(g[r]);
        for (auto& e : S) e *= dec;
        for (int64_t e = 0; e < Dv; ++e) {
          mem[e] = 0;
          for (int64_t d = 0; d < Dk; ++d) mem[e] += S[d * Dv + e] * kn[d];
        }
        for (int64_t d = 0; d < Dk; ++d)
          for (int64_t e = 0; e < Dv; ++e) S[d * Dv + e] += kn[d] * be[r] * (v[r * Dv + e] - mem[e]);
        for (int64_t e = 0; e < Dv; ++e) {
          double o = 0;
          for (int64_t d = 0; d < Dk; ++d) o += S[d * Dv + e] * qn[d];
          s += o * dout[r * Dv + e];
        }
      }
    }
    return s;
  };
  std::vector<double> ref(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    std::vector<double> p = x;
    p[i] += 1e-6;
    const double fp = objective(p);
    p[i] -= 2e-6;
    ref[i] = (fp - objective(p)) / 2e-6;
  }
  const std::vector<float> xf(x.begin(), x.end()), df(dout.begin(), dout.end());
  for (int64_t chunk : {1, 3, 64}) {
    std::vector<float> grad(x.size());
    grad::GatedDeltaGradArgs a;
    a.B = 1; a.T = T; a.H = H; a.Dk = Dk; a.Dv = Dv;
    a.q = xf.data(); a.k = a.q + nq; a.v = a.k + nq; a.g = a.v + nv; a.beta = a.g + nh; a.S0 = a.beta + nh;
    a.dout = df.data();
    a.dq = grad.data(); a.dk = a.dq + nq; a.dv = a.dk + nq; a.dg = a.dv + nv; a.dbeta = a.dg + nh; a.dS0 = a.dbeta + nh;
    a.chunk = chunk;
    grad::gated_delta_backward(a);
    for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(grad[i], ref[i], 2e-4 + 2e-4 * std::abs(ref[i])) << "element " << i << " chunk " << chunk;
  }
}
