// Helpers shared by the gradient tests (test_grad*.cpp): random inputs, double-precision central
// differences for op backwards, and tensor algebra for directional checks of whole models.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "fixture_util.h"
#include "grad/tape.h"
#include "mixlens/model.h"
#include "mixlens/tensor.h"
#include "mixlens/trace.h"

namespace mixlens::grad_check {

/// n uniform doubles in [lo, hi).
inline std::vector<double> rnd(size_t n, uint32_t seed, double lo = -1.0, double hi = 1.0) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<double> v(n);
  for (auto& x : v) x = u(g);
  return v;
}
inline std::vector<float> f32(const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); }

/// Central differences of s(x) (a scalar, e.g. dy . f(x)) for every element of x.
inline std::vector<double> fd(std::vector<double> x, const std::function<double(const std::vector<double>&)>& s) {
  std::vector<double> g(x.size());
  const double h = 1e-6;
  for (size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double p = s(x);
    x[i] = x0 - h;
    const double m = s(x);
    x[i] = x0;
    g[i] = (p - m) / (2 * h);
  }
  return g;
}

/// ||got - ref|| / ||ref||.
inline double rel_rms(const std::vector<float>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) num += (got[i] - ref[i]) * (got[i] - ref[i]), den += ref[i] * ref[i];
  return std::sqrt(num / std::max(den, 1e-300));
}

constexpr double kTol = 1e-5;  ///< float32 op backward vs a double reference

/// The parts concatenated: one flat parameter vector for fd().
inline std::vector<double> concat(const std::vector<std::vector<double>*>& parts) {
  std::vector<double> all;
  for (const auto* p : parts) all.insert(all.end(), p->begin(), p->end());
  return all;
}
/// A flat vector split back into the parts' sizes.
inline std::vector<std::vector<double>> split(const std::vector<double>& v, const std::vector<std::vector<double>*>& parts) {
  std::vector<std::vector<double>> q;
  size_t o = 0;
  for (const auto* p : parts) q.emplace_back(v.begin() + o, v.begin() + o + p->size()), o += p->size();
  return q;
}
/// Each got[k] within kTol of its slice of ref (the gradients concatenated in the same order).
inline void expect_slices_match(const std::vector<std::vector<float>*>& got, const std::vector<double>& ref,
                                const std::vector<std::string>& names) {
  size_t o = 0;
  for (size_t k = 0; k < got.size(); ++k) {
    const std::vector<double> r(ref.begin() + o, ref.begin() + o + got[k]->size());
    o += got[k]->size();
    EXPECT_LT(rel_rms(*got[k], r), kTol) << names[k];
  }
}

/// A tensor of N(0, scale^2) floats.
inline Tensor random_like(const Shape& s, uint32_t seed, float scale = 1.0f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> n(0.0f, scale);
  Tensor t(s);
  for (int64_t i = 0; i < t.numel(); ++i) t[i] = n(g);
  return t;
}

inline double dot(const Tensor& a, const Tensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

/// x + h v.
inline Tensor axpy(const Tensor& x, float h, const Tensor& v) {
  Tensor o = x.clone();
  for (int64_t i = 0; i < o.numel(); ++i) o[i] += h * v[i];
  return o;
}

/// A random direction with the RMS of `like` (a step relative to the value's own scale).
inline Tensor direction(const Tensor& like, uint32_t seed) {
  double ss = 0;
  for (float x : like) ss += static_cast<double>(x) * x;
  return random_like(like.shape(), seed, static_cast<float>(std::sqrt(ss / static_cast<double>(like.numel()))));
}

/// Central differences with one Richardson step (error O(h^4)): the tiny random fixtures are sharply
/// curved, so a plain central difference needs steps so small that float32 noise dominates.
inline double richardson(const std::function<double(float)>& f, float h) {
  const double d1 = (f(h) - f(-h)) / (2.0 * h), d2 = (f(h / 2) - f(-h / 2)) / static_cast<double>(h);
  return (4.0 * d2 - d1) / 3.0;
}

/// n token ids in [1, 90] (every fixture's vocabulary holds them).
inline std::vector<int32_t> ids(int n, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<int32_t> v;
  for (int i = 0; i < n; ++i) v.push_back(static_cast<int32_t>(1 + g() % 90));
  return v;
}

/// Forces a kernel route for a family while in scope (route_kernels), back to default after.
struct RouteGuard {
  std::string family;
  RouteGuard(std::string f, const char* route) : family(std::move(f)) { route_kernels(family, route); }
  ~RouteGuard() { route_kernels(family, "default"); }
};

/// d/dh <W, logits(E + h v)> at 0 == <grad(embed_tokens.output), v> for a random direction v, on each
/// kernel route of `routes` (the call must run the route asked for).
inline void embeddings_fd(const std::string& fixture, const std::string& family, int n_tokens, double tol,
                          const std::vector<const char*>& routes, float step = 2e-3f) {
  Model m = Model::load(test::fixture(fixture).string());
  Trace probe;
  probe.save("embed_tokens.output");
  m.run({ids(n_tokens, 7)}, &probe);
  const Tensor E = probe.get("embed_tokens.output");
  for (const char* route : routes) {
    RouteGuard guard(family, route);
    Trace tr;
    tr.save("embed_tokens.output").enable_grad();
    const Tensor logits = m.run(Batch::from_embeddings(E), &tr);
    EXPECT_EQ(tr.calls().back().kernel, route);
    const Tensor W = random_like(logits.shape(), 3);
    tr.backward(W);
    const Tensor g = tr.grad("embed_tokens.output");
    const Tensor v = direction(E, 4);
    const double fd =
        richardson([&](float h) { return dot(W, m.run(Batch::from_embeddings(axpy(E, h, v)))); }, step);
    EXPECT_NEAR(dot(g, v), fd, tol * std::abs(fd)) << fixture << " " << route;
  }
}

/// The gradient of value `path` along a random direction v against differences of an additive edit
/// (value + h v) on the prompt `batch`; `label` names the case in failures; `step`: the largest h (a
/// value read through exp, RWKV's keys, needs a larger step than float32 noise).
inline void edit_fd(Model& m, const Batch& batch, const std::string& path, double tol, const std::string& label = "",
                    float step = 2e-3f) {
  Trace tr;
  tr.save(path).enable_grad();
  const Tensor logits = m.run(batch, &tr);
  const Tensor W = random_like(logits.shape(), 5);
  tr.backward(W);
  const Tensor g = tr.grad(path);
  const Tensor v = direction(tr.get(path), 6);
  auto f = [&](float h) {
    Trace t;
    t.edit(path, [&](Tensor& s, const SiteContext&) { s = axpy(s, h, v); });
    return dot(W, m.run(batch, &t));
  };
  const double fd = richardson(f, step);
  EXPECT_NEAR(dot(g, v), fd, tol * std::abs(fd)) << path << " " << label;
}

/// A call continuing a cached prompt (one row): each of `paths` (e.g. a state_input) along a random
/// direction against differences of an additive edit in that call; the call runs `kernel`. Every
/// state_output's gradient is zero (it feeds only the next call). `step` as edit_fd's. `direction_of`: the
/// direction for a path's value (default: random with the value's RMS).
inline void continuation_fd(Model& m, const std::vector<int32_t>& prompt, const std::vector<int32_t>& cont,
                            const std::vector<std::string>& paths, double tol, const std::string& kernel,
                            float step = 2e-3f, const std::function<Tensor(const Tensor&)>& direction_of = {}) {
  Cache cache = m.new_cache(1);
  m.forward(Batch::left_padded({prompt}, 0), cache);
  const Batch next = Batch::left_padded({cont}, 0);
  for (const std::string& path : paths) {
    Cache c1 = cache.copy();
    Trace tr;
    tr.save(path).enable_grad();
    const Tensor logits = m.forward(next, c1, &tr);
    EXPECT_EQ(tr.calls().back().kernel, kernel);
    const Tensor W = random_like(logits.shape(), 5);
    tr.backward(W);
    const Tensor g = tr.grad(path);
    const Tensor v = direction_of ? direction_of(tr.get(path, 1)) : direction(tr.get(path, 1), 6);  // the cache's second call
    auto f = [&](float h) {
      Cache c = cache.copy();
      Trace t;
      t.edit(path, [&](Tensor& s, const SiteContext&) { s = axpy(s, h, v); });
      return dot(W, m.forward(next, c, &t));
    };
    const double fd = richardson(f, step);
    EXPECT_NEAR(dot(g, v), fd, tol * std::abs(fd)) << path;
    const std::string layer = path.substr(0, path.rfind('.'));
    if (path.size() > 12 && path.compare(path.size() - 12, 12, ".state_input") == 0) {
      tr.backward(W, {layer + ".state_output"});
      for (float s : tr.grad(layer + ".state_output")) EXPECT_EQ(s, 0.0f) << layer;
    }
  }
}

/// The backward of one recorded call twice: with the products the forward kept on the tape
/// (grad::Kept), then with them dropped (recomputed from the block inputs). Both must give the same
/// gradient of every path (`tol`: float32 rounding of the recomputation). `prepare` adds saves /
/// edits to the trace.
inline void expect_kept_equals_recomputed(Model& m, const Batch& batch, const std::vector<std::string>& paths,
                                          const std::function<void(Trace&)>& prepare, double tol = 1e-5) {
  Trace tr;
  prepare(tr);
  tr.enable_grad();
  const Tensor logits = m.run(batch, &tr);
  const Tensor W = random_like(logits.shape(), 11);
  tr.backward(W, paths);
  std::map<std::string, Tensor> kept;
  for (const auto& [k, g] : tr.grads()) kept[k] = g.clone();
  grad::Tape* tape = detail::GradAccess::tape(tr);
  ASSERT_NE(tape, nullptr);
  ASSERT_FALSE(tape->kept.empty()) << "the forward kept nothing";
  tape->kept.clear();
  tr.backward(W, paths);
  ASSERT_EQ(tr.grads().size(), kept.size());
  for (const auto& [k, g] : kept) {
    const Tensor& r = tr.grad(k);
    ASSERT_EQ(r.shape(), g.shape()) << k;
    double num = 0, den = 0;
    for (int64_t i = 0; i < g.numel(); ++i) {
      const double e = static_cast<double>(g[i]) - r[i];
      num += e * e;
      den += static_cast<double>(r[i]) * r[i];
    }
    EXPECT_LE(std::sqrt(num / std::max(den, 1e-300)), tol) << k;
  }
}

// For each path: <grad, v> against central differences of <W, logits> along v (a write adding h v),
// within 1e-2 relative plus `abs_tol`. `value_scaled`: v has the RMS of the value itself (a step relative
// to its scale: values of very different sizes in one model), else 1. `h`: the step.
inline void check_paths(Model& m, const Batch& in, const Cache* prefix, const std::vector<std::string>& paths,
                        const std::string& label, double abs_tol = 5e-2, bool value_scaled = false, float h = 2e-3f) {
  auto run = [&](Trace* t) {
    if (!prefix) return m.run(in, t);
    Cache c = prefix->copy();
    return m.forward(in, c, t);
  };
  Trace tr;
  for (const auto& p : paths) tr.save(p);
  tr.enable_grad();
  const Tensor logits = run(&tr);
  const Tensor W = random_like(logits.shape(), 3);
  tr.backward(W);
  uint32_t seed = 10;
  for (const auto& p : paths) {
    const Tensor g = tr.grad(p);
    float scale = 1.0f;
    if (value_scaled) {
      const Tensor x = tr.get(p, tr.calls().back().step);
      scale = static_cast<float>(std::sqrt(dot(x, x) / static_cast<double>(x.numel())));
    }
    const Tensor v = random_like(g.shape(), seed++, scale);
    auto f = [&](float step) {
      Trace t;
      t.edit(p, [&](Tensor& s, const SiteContext&) {
        for (int64_t i = 0; i < s.numel(); ++i) s[i] += step * v[i];
      });
      return dot(W, run(&t));
    };
    // Richardson extrapolation of two central differences: the h^2 term of the error cancels. h is
    // small because the models have kinks (the dt clamp, relu2) and jumps (a MoE routing flip) that a
    // larger step crosses (h = 4e-3 crossed a routing flip on the MoE fixture's continuation; default 2e-3).
    const double d1 = (f(h) - f(-h)) / (2.0 * h), d2 = (f(h / 2) - f(-h / 2)) / h;
    const double fd = (4.0 * d2 - d1) / 3.0, an = dot(g, v);
    EXPECT_NEAR(an, fd, 1e-2 * std::abs(fd) + abs_tol) << label << " " << p << " (central differences " << d1 << ", " << d2 << ")";
    EXPECT_GT(std::abs(an), 1e-6) << label << " " << p << ": vacuous gradient";
  }
}

}  // namespace mixlens::grad_check
