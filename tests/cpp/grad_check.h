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

/// Forces a kernel route for a family while in scope (route_kernels), back to default after.
struct RouteGuard {
  std::string family;
  RouteGuard(std::string f, const char* route) : family(std::move(f)) { route_kernels(family, route); }
  ~RouteGuard() { route_kernels(family, "default"); }
};

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

}  // namespace mixlens::grad_check
