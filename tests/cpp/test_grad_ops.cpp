// Finite-difference checks of every op backward in src/grad (issue 12): each float32 backward
// against central differences of a double-precision forward written here (so the reference has
// no float rounding), on small random inputs. A vector-Jacobian product dy . f(x) is
// differentiated, so one scalar per input element is compared.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "grad/ops_grad.h"
#include "grad_check.h"
#include "ops/ops.h"

using namespace mixlens;
using namespace mixlens::grad_check;


TEST(GradOps, LinearMatchesFiniteDifferences) {
  const int64_t R = 3, I = 5, O = 4;
  auto x = rnd(R * I, 1), w = rnd(O * I, 2), dy = rnd(R * O, 3);
  auto s = [&](const std::vector<double>& xx) {
    double acc = 0;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t o = 0; o < O; ++o) {
        double y = 0;
        for (int64_t i = 0; i < I; ++i) y += xx[r * I + i] * w[o * I + i];
        acc += dy[r * O + o] * y;
      }
    return acc;
  };
  std::vector<float> dx(R * I);
  grad::linear_backward(f32(dy).data(), R, O, Tensor::from({O, I}, f32(w)), dx.data(), false);
  EXPECT_LT(rel_rms(dx, fd(x, s)), kTol);
}

// linear_backward's two paths: all-zero rows of dy (a metric on some positions) are skipped, the rest
// multiplied on the thread pool in column blocks; a product large enough to be split, with and
// without zero rows, overwriting and accumulating, against a double-precision reference.
TEST(GradOps, LinearBackwardSkipsZeroRowsAndSplitsColumns) {
  const int64_t R = 40, I = 200, O = 300;  // R*I*O > 2^20: split over the pool
  const auto w = rnd(O * I, 21), base = rnd(R * I, 22);
  for (int zero_rows : {0, 1, 39, 40}) {  // none, few, all but one, all zero
    auto dy = rnd(R * O, 23);
    for (int64_t r = 0; r < zero_rows; ++r)
      for (int64_t o = 0; o < O; ++o) dy[static_cast<size_t>(((r * 7) % R) * O + o)] = 0.0;  // rows spread out
    for (bool acc : {false, true}) {
      std::vector<double> ref(R * I);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t i = 0; i < I; ++i) {
          double v = acc ? static_cast<double>(static_cast<float>(base[r * I + i])) : 0.0;
          for (int64_t o = 0; o < O; ++o) v += static_cast<double>(static_cast<float>(dy[r * O + o])) *
                                               static_cast<float>(w[o * I + i]);
          ref[r * I + i] = v;
        }
      std::vector<float> dx = f32(base);
      grad::linear_backward(f32(dy).data(), R, O, Tensor::from({O, I}, f32(w)), dx.data(), acc);
      EXPECT_LT(rel_rms(dx, ref), kTol) << zero_rows << " zero rows, accumulate " << acc;
    }
  }
}

TEST(GradOps, RmsnormMatchesFiniteDifferences) {
  for (bool zc : {false, true}) {
    const int64_t R = 3, Dm = 7;
    const double eps = 1e-5;
    auto x = rnd(R * Dm, 4), w = rnd(Dm, 5), dy = rnd(R * Dm, 6);
    auto s = [&](const std::vector<double>& xx) {
      double acc = 0;
      for (int64_t r = 0; r < R; ++r) {
        double ss = 0;
        for (int64_t i = 0; i < Dm; ++i) ss += xx[r * Dm + i] * xx[r * Dm + i];
        const double inv = 1 / std::sqrt(ss / Dm + eps);
        for (int64_t i = 0; i < Dm; ++i) acc += dy[r * Dm + i] * (zc ? 1 + w[i] : w[i]) * xx[r * Dm + i] * inv;
      }
      return acc;
    };
    std::vector<float> dx(R * Dm);
    grad::rmsnorm_backward(f32(x).data(), f32(w).data(), f32(dy).data(), dx.data(), R, Dm, 1e-5f, zc, false);
    EXPECT_LT(rel_rms(dx, fd(x, s)), kTol) << "zero_centred " << zc;
  }
}

TEST(GradOps, CausalConvWithWindowMatchesFiniteDifferences) {
  const int64_t B = 2, T = 5, C = 3, K = 4;
  auto in = rnd(B * T * C, 7), wT = rnd(K * C, 8), win = rnd(B * K * C, 9), du = rnd(B * T * C, 10);
  auto s = [&](const std::vector<double>& xx) {
    double acc = 0;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t c = 0; c < C; ++c) {
          double u = 0;
          for (int64_t j = 0; j < K; ++j) {
            const int64_t e = t + 1 + j;  // ext = window (K rows) ++ input
            u += wT[j * C + c] * (e < K ? win[(b * K + e) * C + c] : xx[(b * T + e - K) * C + c]);
          }
          acc += du[(b * T + t) * C + c] * u;
        }
    return acc;
  };
  std::vector<float> din(B * T * C);
  grad::causal_conv1d_backward(f32(du).data(), B, T, C, K, f32(wT).data(), din.data(), C);
  EXPECT_LT(rel_rms(din, fd(in, s)), kTol);
  // The forward it inverts: ops::causal_conv1d (pre-activation) is linear in the input, so
  // du . conv(in) == din . in + du . conv(0 input).
  std::vector<float> st = f32(win), out(B * T * C), st0 = f32(win), out0(B * T * C), zeros(B * T * C, 0.0f);
  ops::causal_conv1d(f32(in).data(), C, B, T, C, K, f32(wT).data(), nullptr, st.data(), out.data(), false);
  ops::causal_conv1d(zeros.data(), C, B, T, C, K, f32(wT).data(), nullptr, st0.data(), out0.data(), false);
  double lhs = 0, rhs = 0;
  for (size_t i = 0; i < out.size(); ++i) lhs += du[i] * (out[i] - out0[i]), rhs += din[i] * in[i];
  EXPECT_NEAR(lhs, rhs, 1e-4 * std::abs(lhs) + 1e-5);
}

// Large enough for the channel blocks on the pool (C > 256, T * C >= 2^14), written with a row
// stride wider than C (the mixers write into their projection's gradient rows).
TEST(GradOps, CausalConvBackwardOverChannelBlocksMatchesItsSum) {
  const int64_t B = 2, T = 40, C = 600, K = 4, stride = C + 37;
  const auto du = rnd(B * T * C, 21), wT = rnd(K * C, 22);
  std::vector<float> din(B * T * stride, -7.0f);
  grad::causal_conv1d_backward(f32(du).data(), B, T, C, K, f32(wT).data(), din.data(), stride);
  std::vector<float> got;
  std::vector<double> ref;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < T; ++s)
      for (int64_t c = 0; c < C; ++c) {
        double r = 0;  // input row s feeds u[s + K - 1 - j] through tap j
        for (int64_t j = 0; j < K; ++j)
          if (s + K - 1 - j < T) r += wT[j * C + c] * du[(b * T + s + K - 1 - j) * C + c];
        ref.push_back(r);
        got.push_back(din[(b * T + s) * stride + c]);
      }
  EXPECT_LT(rel_rms(got, ref), kTol);
  for (int64_t r = 0; r < B * T; ++r) EXPECT_EQ(din[r * stride + C], -7.0f);  // the gap is not written
}

TEST(GradOps, ActivationsMatchFiniteDifferences) {
  for (double v : {-25.0, -3.0, -0.4, 0.0, 0.7, 4.0, 19.9, 21.0}) {
    const double h = 1e-6;
    auto silu = [](double z) { return z / (1 + std::exp(-z)); };
    auto softplus = [](double z) { return z > 20 ? z : std::log1p(std::exp(z)); };
    EXPECT_NEAR(grad::silu_grad(static_cast<float>(v)), (silu(v + h) - silu(v - h)) / (2 * h), 1e-5) << v;
    if (std::abs(v - 20) > 1e-3) {
      EXPECT_NEAR(grad::softplus_grad(static_cast<float>(v)), (softplus(v + h) - softplus(v - h)) / (2 * h), 1e-5) << v;
    }
  }
}

// S_t = exp(a_t) S_{t-1} + dt_t x_t B_t^T, y_t = S_t C_t + D x_t, per head; a = A dt is an input of
// its own here so the decay path (ddA) and the write path (ddt) are checked separately. With
// SsdGradArgs::da (lightning attention's per-token decays) the backward reads a itself, with an A that
// does not give a (so a backward that ignored da would fail).
TEST(GradOps, SsdScanMatchesFiniteDifferences) {
  const int64_t T = 9, H = 4, P = 3, G = 2, N = 2, hpg = H / G;
  auto x = rnd(T * H * P, 11), Bv = rnd(T * G * N, 12), Cv = rnd(T * G * N, 13), dt = rnd(T * H, 14, 0.05, 0.8),
       A = rnd(H, 15, -2.0, -0.2), D = rnd(H, 16), S0 = rnd(H * P * N, 17), dy = rnd(T * H * P, 18);
  std::vector<double> a(T * H);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) a[t * H + h] = A[h] * dt[t * H + h];
  // One flat parameter vector: x | B | C | dt | a | S0.
  std::vector<std::vector<double>*> parts{&x, &Bv, &Cv, &dt, &a, &S0};
  std::vector<double> all;
  for (auto* p : parts) all.insert(all.end(), p->begin(), p->end());
  auto s = [&](const std::vector<double>& v) {
    size_t o = 0;
    std::vector<std::vector<double>> q;
    for (auto* p : parts) q.emplace_back(v.begin() + o, v.begin() + o + p->size()), o += p->size();
    const auto &xx = q[0], &bb = q[1], &cc = q[2], &dd = q[3], &aa = q[4], &s0 = q[5];
    double acc = 0;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / hpg;
      std::vector<double> S(s0.begin() + h * P * N, s0.begin() + (h + 1) * P * N);
      for (int64_t t = 0; t < T; ++t) {
        const double e = std::exp(aa[t * H + h]), d = dd[t * H + h];
        for (int64_t p = 0; p < P; ++p) {
          double y = D[h] * xx[(t * H + h) * P + p];
          for (int64_t n = 0; n < N; ++n) {
            double& sv = S[p * N + n];
            sv = sv * e + d * xx[(t * H + h) * P + p] * bb[(t * G + g) * N + n];
            y += sv * cc[(t * G + g) * N + n];
          }
          acc += dy[(t * H + h) * P + p] * y;
        }
      }
    }
    return acc;
  };
  const auto ref = fd(all, s);
  const auto af = f32(a), A_other = f32(rnd(H, 19, -2.0, -0.2));
  for (bool use_da : {false, true})
  for (int64_t chunk : {1, 4, 64})
  for (bool chunked : {false, true}) {
    std::vector<float> dx(x.size()), dB(Bv.size()), dC(Cv.size()), ddt(dt.size()), ddA(a.size()), dS0(S0.size());
    auto xf = f32(x), Bf = f32(Bv), Cf = f32(Cv), dtf = f32(dt), Af = f32(A), Df = f32(D), S0f = f32(S0), dyf = f32(dy);
    grad::SsdGradArgs g;
    g.T = T; g.H = H; g.P = P; g.G = G; g.N = N;
    g.x = xf.data(); g.B = Bf.data(); g.C = Cf.data(); g.dt = dtf.data(); g.A = Af.data(); g.D = Df.data();
    if (use_da) g.da = af.data(), g.A = A_other.data();
    g.S0 = S0f.data(); g.dy = dyf.data();
    g.dx = dx.data(); g.dB = dB.data(); g.dC = dC.data(); g.ddt = ddt.data(); g.ddA = ddA.data(); g.dS0 = dS0.data();
    g.chunk = chunk;
    if (chunked) grad::ssd_backward_chunked(g); else grad::ssd_backward_recurrent(g);
    std::vector<std::vector<float>*> got{&dx, &dB, &dC, &ddt, &ddA, &dS0};
    const char* names[] = {"dx", "dB", "dC", "ddt", "ddA", "dS0"};
    size_t o = 0;
    for (size_t k = 0; k < got.size(); ++k) {
      std::vector<double> r(ref.begin() + o, ref.begin() + o + got[k]->size());
      o += got[k]->size();
      EXPECT_LT(rel_rms(*got[k], r), kTol) << names[k] << " chunk " << chunk << (chunked ? " chunked" : " recurrent")
                                           << (use_da ? " da" : "");
    }
  }
}

// The Mamba-1 selective scan (grad/selective_scan_grad.cpp) with the decay path a = A dt [T,E,N] a
// separate input (so ddA is checked per element) and the write path dt separate; more channels than
// one parallel block (17 > 16), several checkpoint chunk lengths; dstates against perturbing S_t.
TEST(GradOps, SelectiveScanMatchesFiniteDifferences) {
  const int64_t T = 7, E = 17, N = 3;
  auto u = rnd(T * E, 21), Bv = rnd(T * N, 22), Cv = rnd(T * N, 23), dt = rnd(T * E, 24, 0.05, 0.8),
       A = rnd(E * N, 25, -2.0, -0.2), D = rnd(E, 26), S0 = rnd(E * N, 27), dy = rnd(T * E, 28);
  std::vector<double> a(T * E * N);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e)
      for (int64_t n = 0; n < N; ++n) a[(t * E + e) * N + n] = A[e * N + n] * dt[t * E + e];
  // One flat parameter vector: u | B | C | dt | a | S0, plus a perturbation added to S_t (dstates).
  std::vector<double> bump(T * E * N, 0.0);
  std::vector<std::vector<double>*> parts{&u, &Bv, &Cv, &dt, &a, &S0, &bump};
  std::vector<double> all;
  for (auto* p : parts) all.insert(all.end(), p->begin(), p->end());
  auto s = [&](const std::vector<double>& v) {
    size_t o = 0;
    std::vector<std::vector<double>> q;
    for (auto* p : parts) q.emplace_back(v.begin() + o, v.begin() + o + p->size()), o += p->size();
    const auto &uu = q[0], &bb = q[1], &cc = q[2], &dd = q[3], &aa = q[4], &s0 = q[5], &bp = q[6];
    double acc = 0;
    for (int64_t e = 0; e < E; ++e) {
      std::vector<double> S(s0.begin() + e * N, s0.begin() + (e + 1) * N);
      for (int64_t t = 0; t < T; ++t) {
        double y = D[e] * uu[t * E + e];
        for (int64_t n = 0; n < N; ++n) {
          double& sv = S[n];
          sv = sv * std::exp(aa[(t * E + e) * N + n]) + dd[t * E + e] * bb[t * N + n] * uu[t * E + e] +
               bp[(t * E + e) * N + n];
          y += sv * cc[t * N + n];
        }
        acc += dy[t * E + e] * y;
      }
    }
    return acc;
  };
  const auto ref = fd(all, s);
  for (int64_t chunk : {1, 3, 64}) {
    std::vector<float> du(u.size()), dB(Bv.size()), dC(Cv.size()), ddt(dt.size()), ddtA(dt.size()), ddA(a.size()),
        dS0(S0.size()), dst(bump.size());
    auto uf = f32(u), Bf = f32(Bv), Cf = f32(Cv), dtf = f32(dt), Af = f32(A), Df = f32(D), S0f = f32(S0), dyf = f32(dy);
    grad::SelectiveScanGradArgs g;
    g.T = T; g.E = E; g.N = N;
    g.u = uf.data(); g.B = Bf.data(); g.C = Cf.data(); g.dt = dtf.data(); g.A = Af.data(); g.D = Df.data();
    g.S0 = S0f.data(); g.dy = dyf.data();
    g.du = du.data(); g.dB = dB.data(); g.dC = dC.data(); g.ddt = ddt.data(); g.ddtA = ddtA.data();
    g.ddA = ddA.data(); g.dS0 = dS0.data(); g.dstates = dst.data();
    g.chunk = chunk;
    grad::selective_scan_backward(g);
    std::vector<std::vector<float>*> got{&du, &dB, &dC, &ddt, &ddA, &dS0, &dst};
    const char* names[] = {"du", "dB", "dC", "ddt", "ddA", "dS0", "dstates"};
    size_t o = 0;
    for (size_t k = 0; k < got.size(); ++k) {
      std::vector<double> r(ref.begin() + o, ref.begin() + o + got[k]->size());
      o += got[k]->size();
      EXPECT_LT(rel_rms(*got[k], r), kTol) << names[k] << " chunk " << chunk;
    }
    // ddtA is the decay path folded onto dt: sum_n A[e,n] ddA[t,e,n].
    const size_t off_a = u.size() + Bv.size() + Cv.size() + dt.size();
    std::vector<double> fold(dt.size(), 0.0);
    for (int64_t k = 0; k < T * E; ++k)
      for (int64_t n = 0; n < N; ++n) fold[k] += A[(k % E) * N + n] * ref[off_a + k * N + n];
    EXPECT_LT(rel_rms(ddtA, fold), kTol) << "ddtA chunk " << chunk;
  }
}

namespace {

double rel_rms_f(const std::vector<float>& got, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = static_cast<double>(got[i]) - ref[i];
    num += d * d, den += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

}  // namespace

// The chunked (matmul) SSD backward against the recurrent one on model-like sizes and magnitudes
// (a = A dt in about [-2, 0), unit-scale x / B / C): every output, dL/dS_t included, at lengths
// around the chunk (chunk-1, chunk, chunk+1, several chunks with a short last one) and with / without
// an initial state. Both are float32; they differ by rounding only.
TEST(GradOps, SsdChunkedBackwardMatchesRecurrent) {
  const int64_t H = 4, P = 8, G = 2, N = 16, Q = 16;
  for (int64_t T : {int64_t{1}, Q - 1, Q, Q + 1, 3 * Q + 5})
    for (bool with_state : {false, true}) {
      const uint32_t seed = static_cast<uint32_t>(T * 10 + with_state);
      auto x = f32(rnd(T * H * P, seed + 1)), Bv = f32(rnd(T * G * N, seed + 2)), Cv = f32(rnd(T * G * N, seed + 3)),
           dt = f32(rnd(T * H, seed + 4, 0.005, 0.3)), A = f32(rnd(H, seed + 5, -6.0, -0.5)), D = f32(rnd(H, seed + 6)),
           dy = f32(rnd(T * H * P, seed + 7)), S0 = f32(rnd(H * P * N, seed + 8));
      if (!with_state) std::fill(S0.begin(), S0.end(), 0.0f);
      struct Out {
        std::vector<float> dx, dB, dC, ddt, ddA, dS0, dstates;
      };
      auto run = [&](bool chunked) {
        Out o{std::vector<float>(x.size()), std::vector<float>(Bv.size()), std::vector<float>(Cv.size()),
              std::vector<float>(dt.size()), std::vector<float>(dt.size()), std::vector<float>(S0.size()),
              std::vector<float>(static_cast<size_t>(T * H * N * P))};
        grad::SsdGradArgs g;
        g.T = T; g.H = H; g.P = P; g.G = G; g.N = N;
        g.x = x.data(); g.B = Bv.data(); g.C = Cv.data(); g.dt = dt.data(); g.A = A.data(); g.D = D.data();
        g.S0 = S0.data(); g.dy = dy.data();
        g.dx = o.dx.data(); g.dB = o.dB.data(); g.dC = o.dC.data(); g.ddt = o.ddt.data(); g.ddA = o.ddA.data();
        g.dS0 = o.dS0.data(); g.dstates = o.dstates.data();
        g.chunk = Q;
        if (chunked) grad::ssd_backward_chunked(g); else grad::ssd_backward_recurrent(g);
        return o;
      };
      const Out r = run(false), c = run(true);
      const std::pair<const char*, std::pair<const std::vector<float>*, const std::vector<float>*>> cmp[] = {
          {"dx", {&c.dx, &r.dx}},   {"dB", {&c.dB, &r.dB}},    {"dC", {&c.dC, &r.dC}},
          {"ddt", {&c.ddt, &r.ddt}}, {"ddA", {&c.ddA, &r.ddA}}, {"dS0", {&c.dS0, &r.dS0}},
          {"dstates", {&c.dstates, &r.dstates}}};
      for (const auto& [name, pr] : cmp) {
        EXPECT_LT(rel_rms_f(*pr.first, *pr.second), 1e-5) << name << " T=" << T << " state=" << with_state;
      }
    }
}

// The RG-LRU recurrence (grad/rg_lru_grad.cpp): u, i, log a and h0 against central differences of
// h_t = a_t h_{t-1} + sqrt(1 - a_t^2) i_t u_t in double, with a reset inside the row (a_t = 0, the
// multiplier 1: no gradient to log a there, none through it to earlier tokens); dstates against a
// perturbation added to h_t.
TEST(GradOps, RgLruMatchesFiniteDifferences) {
  const int64_t T = 7, W = 5;
  auto u = rnd(T * W, 41), ig = rnd(T * W, 42, 0.05, 0.95), la = rnd(T * W, 43, -3.0, -0.05), h0 = rnd(W, 44),
       dy = rnd(T * W, 45);
  std::vector<uint8_t> reset(T, 0);
  reset[3] = 1;
  std::vector<double> bump(T * W, 0.0);
  std::vector<std::vector<double>*> parts{&u, &ig, &la, &h0, &bump};
  auto s = [&](const std::vector<double>& v) {
    const auto q = split(v, parts);
    std::vector<double> h(q[3]);
    double acc = 0;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < W; ++c) {
        const int64_t e = t * W + c;
        const double a = reset[t] ? 0.0 : std::exp(q[2][e]), m = reset[t] ? 1.0 : std::sqrt(1.0 - a * a);
        h[c] = a * h[c] + m * q[1][e] * q[0][e] + q[4][e];
        acc += dy[e] * h[c];
      }
    return acc;
  };
  const auto ref = fd(concat(parts), s);
  auto uf = f32(u), igf = f32(ig), laf = f32(la), h0f = f32(h0), dyf = f32(dy);
  std::vector<float> du(u.size()), dig(ig.size()), dla(la.size()), dh0(h0.size()), dst(bump.size());
  grad::RgLruGradArgs g;
  g.T = T; g.W = W;
  g.u = uf.data(); g.ig = igf.data(); g.la = laf.data(); g.reset = reset.data(); g.h0 = h0f.data(); g.dy = dyf.data();
  g.du = du.data(); g.dig = dig.data(); g.dla = dla.data(); g.dh0 = dh0.data(); g.dstates = dst.data();
  grad::rg_lru_backward(g);
  expect_slices_match({&du, &dig, &dla, &dh0, &dst}, ref, {"du", "dig", "dla", "dh0", "dstates"});
  for (int64_t c = 0; c < W; ++c) EXPECT_EQ(dla[3 * W + c], 0.0f) << "the reset token's decay is unused";
}
