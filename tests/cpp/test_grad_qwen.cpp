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

using Route = grad_check::RouteGuard;

void embeddings_fd(const std::string& fixture, const std::string& family, int n_tokens, double tol) {
  grad_check::embeddings_fd(fixture, family, n_tokens, tol, {"chunked", "recurrent"});
}

}  // namespace

TEST(GradQwen, Qwen35EmbeddingsMatchFiniteDifferences) {
  embeddings_fd("qwen3_5/hv_eq_hk_chunks", "qwen3_5", 70, 1e-2);  // two chunks, attention, partial RoPE
  embeddings_fd("qwen3_5/hv_2hk", "qwen3_5", 20, 1e-2);           // q/k head repetition
}

// OLMo-Hybrid: post-norm attention blocks, plain norms, beta = 2 sigmoid(b) (hv_2hk_chunks) or
// sigmoid(b) with NoPE (padded_batch).
TEST(GradQwen, OlmoHybridEmbeddingsMatchFiniteDifferences) {
  embeddings_fd("olmo_hybrid/hv_2hk_chunks", "olmo_hybrid", 70, 1e-2);
  embeddings_fd("olmo_hybrid/padded_batch", "olmo_hybrid", 20, 1e-2);
}

TEST(GradQwen, Qwen3NextMoeEmbeddingsMatchFiniteDifferences) {
  // Small steps also keep the router's top-k choice (a constant of the backward) unchanged.
  embeddings_fd("qwen3_next/moe_hv_2hk", "qwen3_next", 30, 1e-2);
}

// The forward keeps the attention layers' projections, attention output and mixer output (and the
// GDN in_proj / output, the MLP gate|up); dropping them (everything recomputed from the block inputs)
// changes no gradient, on both kernels and through edits of the attention values, gate and output.
TEST(GradQwen, KeptForwardProductsGiveTheRecomputedGradients) {
  Model m = Model::load(test::fixture("qwen3_5/hv_2hk").string());
  const std::vector<std::string> paths{"embed_tokens.output", "layers.*.layer_input",
                                       "layers.1.self_attn.attention_queries", "layers.1.self_attn.attention_keys",
                                       "layers.1.self_attn.attention_values", "layers.1.self_attn.gate",
                                       "layers.1.self_attn.attention_output"};
  for (const char* route : {"chunked", "recurrent"}) {
    Route guard("qwen3_5", route);
    expect_kept_equals_recomputed(m, Batch::left_padded({ids(20, 9)}, 0), paths, [](Trace& tr) {
      for (const char* p : {"layers.1.self_attn.attention_values", "layers.1.self_attn.gate",
                            "layers.1.self_attn.attention_output"})
        tr.edit(p, [](Tensor& v, const SiteContext&) {
          for (int64_t i = 0; i < v.numel(); i += 5) v[i] *= 0.5f;
        });
    });
  }
}

// OLMo-Hybrid's post-norm attention block (layer 1): the kept MLP output and attention products give the
// gradients the recomputation gives, through edits of the attention output and the MLP output.
TEST(GradQwen, OlmoHybridKeptForwardProductsGiveTheRecomputedGradients) {
  Model m = Model::load(test::fixture("olmo_hybrid/hv_2hk_chunks").string());
  const std::vector<std::string> paths{"embed_tokens.output", "layers.*.layer_input", "layers.1.self_attn.attention_queries",
                                       "layers.1.self_attn.attention_values", "layers.1.self_attn.attention_output",
                                       "layers.1.mlp.output", "layers.0.linear_attn.betas"};
  for (const char* route : {"chunked", "recurrent"}) {
    Route guard("olmo_hybrid", route);
    expect_kept_equals_recomputed(m, Batch::left_padded({ids(20, 9)}, 0), paths, [](Trace& tr) {
      for (const char* p : {"layers.1.self_attn.attention_output", "layers.1.mlp.output"})
        tr.edit(p, [](Tensor& v, const SiteContext&) {
          for (int64_t i = 0; i < v.numel(); i += 5) v[i] *= 0.5f;
        });
    });
  }
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
                                   "layers.1.self_attn.gate"})
      edit_fd(m, Batch::left_padded({x}, 0), path, 1e-2, route);
  }
}

TEST(GradQwen, ContinuationStateInputMatchesFiniteDifferences) {
  Model m = Model::load(test::fixture("qwen3_5/continuation").string());
  continuation_fd(m, ids(10, 1), ids(7, 2), {"layers.2.linear_attn.state_input"}, 1e-2, "chunked");
}

// The gated delta rule's backward (grad::gated_delta_backward, its own checkpoint pass, several
// checkpoint chunk lengths) against central differences of a double-precision token recurrence
// written here (L2 norms with eps 1e-6 and the 1/sqrt(Dk) query scale), every input element.
namespace {

// Both backwards of the gated delta rule against central differences of a double recurrence written
// here; per_key: Kimi Delta Attention's decay per key channel (unequal channels), recurrence only.
void delta_rule_double_fd(bool per_key) {
  const int64_t T = 7, H = 2, Dk = 3, Dv = 4;
  std::mt19937 gen(11);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  auto rnd = [&](int64_t n, double lo, double hi) {
    std::vector<double> v(static_cast<size_t>(n));
    for (auto& x : v) x = lo + (hi - lo) * (u(gen) + 1.0) / 2.0;
    return v;
  };
  // x = q | k | v | g | beta | S0
  const int64_t nq = T * H * Dk, nv = T * H * Dv, nh = T * H, ng = per_key ? nh * Dk : nh, ns = H * Dk * Dv;
  std::vector<double> x = rnd(nq, -1, 1), t;
  for (auto [n, lo, hi] : {std::tuple<int64_t, double, double>{nq, -1, 1}, {nv, -1, 1}, {ng, -1.0, -0.05}, {nh, 0.1, 0.9},
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
    const double* be = g + ng;
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
        for (int64_t d = 0; d < Dk; ++d)
          for (int64_t e = 0; e < Dv; ++e) S[d * Dv + e] *= std::exp(per_key ? g[r * Dk + d] : g[r]);
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
  for (int64_t chunk : {1, 3, 64})
   for (auto bwd : {grad::gated_delta_backward_recurrent, grad::gated_delta_backward_chunked, grad::gated_delta_backward}) {
    if (per_key && bwd == grad::gated_delta_backward_chunked) continue;  // refused (its own test)
    std::vector<float> grad(x.size());
    grad::GatedDeltaGradArgs a;
    a.B = 1; a.T = T; a.H = H; a.Dk = Dk; a.Dv = Dv;
    a.q = xf.data(); a.k = a.q + nq; a.v = a.k + nq; a.g = a.v + nv; a.beta = a.g + ng; a.S0 = a.beta + nh;
    a.g_per_key = per_key;
    a.dout = df.data();
    a.dq = grad.data(); a.dk = a.dq + nq; a.dv = a.dk + nq; a.dg = a.dv + nv; a.dbeta = a.dg + ng; a.dS0 = a.dbeta + nh;
    a.chunk = chunk;
    bwd(a);
    for (size_t i = 0; i < x.size(); ++i)
      EXPECT_NEAR(grad[i], ref[i], 2e-4 + 2e-4 * std::abs(ref[i]))
          << "element " << i << " chunk " << chunk << (bwd == grad::gated_delta_backward_chunked ? " chunked" : " recurrent")
          << (per_key ? " per key" : "");
  }
}

}  // namespace

TEST(GradQwen, GatedDeltaRuleMatchesDoubleFiniteDifferences) { delta_rule_double_fd(false); }

TEST(GradQwen, PerKeyDecayDeltaRuleMatchesDoubleFiniteDifferences) { delta_rule_double_fd(true); }

// Kimi Delta Attention's per-key decay with every channel equal is Qwen's per-head decay: the same
// dq / dk / dv / dbeta / dS0, and the per-channel dg sums to the per-head one; the chunked backward
// refuses a per-key decay (the dispatcher routes it to the recurrence).
TEST(GradQwen, PerKeyDecayWithEqualChannelsReducesToThePerHeadBackward) {
  const int64_t B = 2, T = 70, H = 2, Dk = 8, Dv = 6;
  std::mt19937 gen(5);
  std::normal_distribution<float> nrm(0.0f, 1.0f);
  auto vec = [&](int64_t n, float s, float off) {
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& e : v) e = off + s * nrm(gen);
    return v;
  };
  const auto q = vec(B * T * H * Dk, 1, 0), k = vec(B * T * H * Dk, 1, 0), v = vec(B * T * H * Dv, 1, 0),
             dout = vec(B * T * H * Dv, 1, 0), be = vec(B * T * H, 0.1f, 0.5f), S0 = vec(B * H * Dk * Dv, 0.3f, 0);
  std::vector<float> g = vec(B * T * H, 0.2f, -0.5f), gk(g.size() * Dk);
  for (size_t i = 0; i < g.size(); ++i) std::fill(gk.begin() + i * Dk, gk.begin() + (i + 1) * Dk, g[i]);
  auto run = [&](bool per_key, void (*bwd)(const grad::GatedDeltaGradArgs&)) {
    std::vector<std::vector<float>> o{q, k, v, per_key ? gk : g, be, S0};
    grad::GatedDeltaGradArgs a;
    a.B = B; a.T = T; a.H = H; a.Dk = Dk; a.Dv = Dv;
    a.q = q.data(); a.k = k.data(); a.v = v.data(); a.g = per_key ? gk.data() : g.data(); a.beta = be.data(); a.S0 = S0.data();
    a.g_per_key = per_key;
    a.dout = dout.data();
    a.dq = o[0].data(); a.dk = o[1].data(); a.dv = o[2].data(); a.dg = o[3].data(); a.dbeta = o[4].data(); a.dS0 = o[5].data();
    bwd(a);
    return o;
  };
  const auto ref = run(false, grad::gated_delta_backward_recurrent), got = run(true, grad::gated_delta_backward);
  for (int i : {0, 1, 2, 4, 5})
    for (size_t j = 0; j < ref[i].size(); ++j) ASSERT_NEAR(got[i][j], ref[i][j], 1e-5 + 1e-5 * std::abs(ref[i][j])) << i << " " << j;
  for (size_t r = 0; r < g.size(); ++r) {
    double s = 0.0;
    for (int64_t d = 0; d < Dk; ++d) s += got[3][r * Dk + d];
    ASSERT_NEAR(s, ref[3][r], 1e-4 + 1e-5 * std::abs(ref[3][r])) << "dg row " << r;
  }
  EXPECT_THROW(run(true, grad::gated_delta_backward_chunked), UnsupportedError);
}

// The chunked (matmul) backward against the token recurrence (the reference) on random inputs of
// realistic size: chunk edges (T = 1, 63, 64, 65, 130), 2 batch rows, Dk != Dv, a non-zero S0.
TEST(GradQwen, ChunkedGatedDeltaBackwardMatchesTheRecurrence) {
  const int64_t B = 2, H = 3, Dk = 32, Dv = 24;
  for (int64_t T : {1, 63, 64, 65, 130}) {
    std::mt19937 gen(static_cast<uint32_t>(T));
    std::normal_distribution<float> nrm(0.0f, 1.0f);
    std::uniform_real_distribution<float> uni(0.0f, 1.0f);
    auto vec = [&](int64_t n, const std::function<float()>& f) {
      std::vector<float> v(static_cast<size_t>(n));
      for (auto& e : v) e = f();
      return v;
    };
    const auto q = vec(B * T * H * Dk, [&] { return nrm(gen); }), k = vec(B * T * H * Dk, [&] { return nrm(gen); }),
               v = vec(B * T * H * Dv, [&] { return nrm(gen); }), dout = vec(B * T * H * Dv, [&] { return nrm(gen); }),
               g = vec(B * T * H, [&] { return -0.01f - 1.5f * uni(gen); }), be = vec(B * T * H, [&] { return uni(gen); }),
               S0 = vec(B * H * Dk * Dv, [&] { return 0.3f * nrm(gen); });
    struct Out {
      std::vector<float> dq, dk, dv, dg, db, dS0;
    };
    auto run = [&](void (*bwd)(const grad::GatedDeltaGradArgs&)) {
      Out o{std::vector<float>(q.size()), std::vector<float>(k.size()), std::vector<float>(v.size()),
            std::vector<float>(g.size()), std::vector<float>(be.size()), std::vector<float>(S0.size())};
      grad::GatedDeltaGradArgs a;
      a.B = B; a.T = T; a.H = H; a.Dk = Dk; a.Dv = Dv;
      a.q = q.data(); a.k = k.data(); a.v = v.data(); a.g = g.data(); a.beta = be.data(); a.S0 = S0.data();
      a.dout = dout.data();
      a.dq = o.dq.data(); a.dk = o.dk.data(); a.dv = o.dv.data(); a.dg = o.dg.data(); a.dbeta = o.db.data();
      a.dS0 = o.dS0.data();
      bwd(a);
      return o;
    };
    const Out ref = run(grad::gated_delta_backward_recurrent), got = run(grad::gated_delta_backward_chunked);
    auto rel = [](const std::vector<float>& a, const std::vector<float>& r) {
      double num = 0, den = 0;
      for (size_t i = 0; i < r.size(); ++i) num += (a[i] - r[i]) * (a[i] - r[i]), den += static_cast<double>(r[i]) * r[i];
      return std::sqrt(num / std::max(den, 1e-300));
    };
    EXPECT_LE(rel(got.dq, ref.dq), 1e-5) << "dq T=" << T;
    EXPECT_LE(rel(got.dk, ref.dk), 1e-5) << "dk T=" << T;
    EXPECT_LE(rel(got.dv, ref.dv), 1e-5) << "dv T=" << T;
    EXPECT_LE(rel(got.dg, ref.dg), 1e-5) << "dg T=" << T;
    EXPECT_LE(rel(got.db, ref.db), 1e-5) << "dbeta T=" << T;
    EXPECT_LE(rel(got.dS0, ref.dS0), 1e-5) << "dS0 T=" << T;
  }
}

// A metric of a few positions (issue 12 speed): with all_logits false the recorded call returns the
// last position's logits only; logits_at forms any position's from the recorded LM-head input, and
// backward over those rows equals backward over every position with the other rows zero.
TEST(GradQwen, BackwardOverAFewPositionsEqualsTheFullBackward) {
  Model m = Model::load(test::fixture("qwen3_5/padded_batch").string());
  const std::vector<std::vector<int32_t>> x = {ids(9, 3), ids(6, 4)};
  const std::vector<std::string> paths = {"embed_tokens.output", "layers.0.layer_output", "ln_final.output",
                                          "layers.1.self_attn.attention_queries"};
  Trace full;
  full.enable_grad();
  const Tensor all = m.run(x, &full);  // every position's logits
  const int64_t B = all.size(0), T = all.size(1), V = all.size(2);
  Trace few;
  few.enable_grad();
  const Tensor last = m.run(Batch::left_padded(x, 0), &few, nullptr, false);
  ASSERT_EQ(last.shape(), (Shape{B, 1, V}));
  const std::vector<int64_t> pos = {2, T - 1};
  const Tensor z = few.logits_at(pos);
  ASSERT_EQ(z.shape(), (Shape{B, 2, V}));
  for (int64_t b = 0; b < B; ++b)
    for (size_t i = 0; i < pos.size(); ++i)
      for (int64_t v = 0; v < V; ++v)
        EXPECT_NEAR(z[(b * 2 + static_cast<int64_t>(i)) * V + v], all[(b * T + pos[i]) * V + v], 1e-4f);
  const Tensor W = random_like(z.shape(), 11);
  Tensor Wfull(all.shape());
  for (int64_t b = 0; b < B; ++b)
    for (size_t i = 0; i < pos.size(); ++i)
      for (int64_t v = 0; v < V; ++v) Wfull[(b * T + pos[i]) * V + v] = W[(b * 2 + static_cast<int64_t>(i)) * V + v];
  few.backward(W, paths, pos);
  full.backward(Wfull, paths);
  for (const std::string& p : paths) {
    const Tensor a = few.grad(p), r = full.grad(p);
    double num = 0, den = 0;
    for (int64_t k = 0; k < r.numel(); ++k) num += (a[k] - r[k]) * (a[k] - r[k]), den += static_cast<double>(r[k]) * r[k];
    EXPECT_GT(den, 0.0) << p;
    EXPECT_LE(std::sqrt(num / den), 1e-5) << p;
  }
  // The last position's dlogits alone, in the call's own logits shape.
  few.backward(random_like(last.shape(), 12), {"embed_tokens.output"});
  EXPECT_GT(dot(few.grad("embed_tokens.output"), few.grad("embed_tokens.output")), 0.0);
  EXPECT_THROW(few.backward(W, paths, {T - 1, 2}), InputError);  // not ascending
  EXPECT_THROW(few.backward(W, paths, {0, T}), InputError);      // outside the call
  EXPECT_THROW(few.logits_at({T}), InputError);
  EXPECT_THROW(few.backward(random_like({B, 3, V}, 1), paths, pos), InputError);  // rows != positions
}

// The backward stops below the lowest gradient asked for (GradSink::needs_below): asking for the
// upper layers' outputs alone gives exactly the gradients of a run that also asks for the
// embeddings (which runs every block), on the three backbones (Qwen hybrid, SSM LM, Mamba-2 hybrid).
TEST(GradQwen, StoppingBelowTheLowestAskedGradientChangesNoValue) {
  for (const char* fixture : {"qwen3_5/hv_2hk", "mamba2/g1_chunks", "nemotron_h/padded_batch"}) {
    Model m = Model::load(test::fixture(fixture).string());
    const int L = m.info().num_layers;
    ASSERT_GE(L, 2) << fixture;
    std::vector<std::string> upper;
    for (int i = 1; i < L; ++i) upper.push_back("layers." + std::to_string(i) + ".layer_output");
    Trace tr;
    tr.enable_grad();
    const Tensor logits = m.run({ids(12, 5)}, &tr);
    const Tensor W = random_like(logits.shape(), 21);
    tr.backward(W, upper);
    std::vector<Tensor> got;
    for (const std::string& p : upper) got.push_back(tr.grad(p));
    std::vector<std::string> all = upper;
    all.push_back("embed_tokens.output");
    tr.backward(W, all);
    EXPECT_GT(dot(tr.grad("embed_tokens.output"), tr.grad("embed_tokens.output")), 0.0) << fixture;
    for (size_t k = 0; k < upper.size(); ++k) {
      const Tensor r = tr.grad(upper[k]);
      ASSERT_EQ(got[k].shape(), r.shape()) << fixture << " " << upper[k];
      for (int64_t e = 0; e < r.numel(); ++e) ASSERT_EQ(got[k][e], r[e]) << fixture << " " << upper[k] << " " << e;
    }
  }
}
