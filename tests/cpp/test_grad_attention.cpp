// Finite-difference checks of the attention backwards in src/grad/attention_grad.cpp (issue 12):
// the causal GQA attention core over a KV cache and rotate-half RoPE, each float32 backward against
// central differences of a double-precision forward written here (as test_grad_ops.cpp does for
// the other ops).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include "grad/ops_grad.h"
#include "grad_check.h"
#include "mixlens/errors.h"

using namespace mixlens;
using namespace mixlens::grad_check;


// Causal GQA attention over a cache: the past keys / values are constants, the call's q, k, v are
// the inputs. Row 1's padding hides its whole cache and first new token: that query sees no key
// (output 0, gradient 0) and the masked keys get no gradient. window 3: a sliding window of 3 keys
// (RecurrentGemma's attention_window_size), shorter than the call.
TEST(GradAttention, CausalAttentionMatchesFiniteDifferences) {
  // scale 0: the default 1/sqrt(d); 0.7: an explicit softmax scale (the attention mixer's `scale`).
  for (int64_t window : {0, 3})
  for (double scale : {0.0, 0.7})
  for (int64_t past : {0, 3}) {
    const int64_t B = 2, T = 5, H = 4, Hkv = 2, d = 3, rep = H / Hkv, Tk = past + T, W = Hkv * d;
    auto q = rnd(B * T * H * d, 21, -1.5, 1.5), kn = rnd(B * T * W, 22, -1.5, 1.5), vn = rnd(B * T * W, 23),
         kp = rnd(B * past * W, 24), vp = rnd(B * past * W, 25), dout = rnd(B * T * H * d, 26);
    std::vector<std::vector<uint8_t>> mask(B, std::vector<uint8_t>(Tk, 1));
    for (int64_t j = 0; j <= past; ++j) mask[1][j] = 0;  // row 1: cache and first new token padding
    mask[0][past + 2] = 0;                                // a masked key in the middle of row 0
    // flat parameters: q | k new | v new
    std::vector<double> all(q);
    all.insert(all.end(), kn.begin(), kn.end());
    all.insert(all.end(), vn.begin(), vn.end());
    auto s = [&](const std::vector<double>& v) {
      const double* qq = v.data();
      const double* kk = qq + q.size();
      const double* vv = kk + kn.size();
      auto key = [&](int64_t b, int64_t j, int64_t g, int64_t e) {
        return j < past ? kp[(b * past + j) * W + g * d + e] : kk[(b * T + j - past) * W + g * d + e];
      };
      auto val = [&](int64_t b, int64_t j, int64_t g, int64_t e) {
        return j < past ? vp[(b * past + j) * W + g * d + e] : vv[(b * T + j - past) * W + g * d + e];
      };
      double acc = 0;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t t = 0; t < T; ++t) {
            const int64_t g = h / rep, n = past + t + 1;
            const auto seen = [&](int64_t j) { return mask[b][j] && (window == 0 || j >= n - window); };
            std::vector<double> w(n, 0.0);
            double mx = -1e300, sum = 0;
            for (int64_t j = 0; j < n; ++j) {
              if (!seen(j)) continue;
              double sc = 0;
              for (int64_t e = 0; e < d; ++e) sc += qq[((b * T + t) * H + h) * d + e] * key(b, j, g, e);
              w[j] = scale > 0.0 ? sc * scale : sc / std::sqrt(static_cast<double>(d));
              mx = std::max(mx, w[j]);
            }
            if (mx == -1e300) continue;
            for (int64_t j = 0; j < n; ++j) sum += seen(j) ? (w[j] = std::exp(w[j] - mx)) : (w[j] = 0);
            for (int64_t e = 0; e < d; ++e) {
              double o = 0;
              for (int64_t j = 0; j < n; ++j) o += w[j] / sum * val(b, j, g, e);
              acc += dout[((b * T + t) * H + h) * d + e] * o;
            }
          }
      return acc;
    };
    const auto ref = fd(all, s);
    detail::KvCache kv;
    if (past > 0) kv.append(f32(kp).data(), f32(vp).data(), B, past, W);
    kv.append(f32(kn).data(), f32(vn).data(), B, T, W);
    std::vector<float> dq(q.size()), dk(kn.size()), dv(vn.size());
    grad::causal_attention_backward(f32(q).data(), B, T, H, Hkv, d, past, kv, mask, f32(dout).data(), dq.data(),
                                    dk.data(), dv.data(), static_cast<float>(scale), window);
    EXPECT_LT(rel_rms(dq, std::vector<double>(ref.begin(), ref.begin() + q.size())), kTol) << "dq past " << past << " window " << window;
    EXPECT_LT(rel_rms(dk, std::vector<double>(ref.begin() + q.size(), ref.begin() + q.size() + kn.size())), kTol)
        << "dk past " << past;
    EXPECT_LT(rel_rms(dv, std::vector<double>(ref.begin() + q.size() + kn.size(), ref.end())), kTol) << "dv past " << past;
    for (int64_t e = 0; e < H * d; ++e) EXPECT_EQ(dq[T * H * d + e], 0.0f) << "row 1's fully masked query";
    // The forward it inverts: flash_causal_attention's output matches the double reference.
    std::vector<float> out(q.size());
    detail::causal_attention(f32(q).data(), B, T, H, Hkv, d, past, kv, mask, out.data(), nullptr,
                             static_cast<float>(scale), window);
    double lhs = 0;
    for (size_t i = 0; i < out.size(); ++i) lhs += dout[i] * out[i];
    EXPECT_NEAR(lhs, s(all), 1e-4 * std::abs(lhs) + 1e-5);
  }
  detail::KvCache bad;
  std::vector<float> z(2 * 4 * 3, 0.0f), g(z.size());
  EXPECT_THROW(grad::causal_attention_backward(z.data(), 1, 2, 4, 2, 3, 0, bad, {{1, 1}}, z.data(), g.data(), g.data(),
                                               g.data()),
               InputError);
}

// Partial rotate-half RoPE: the gradient of dy . rope(x) is rope's transpose applied to dy.
TEST(GradAttention, RopeMatchesFiniteDifferences) {
  const int64_t R = 3, Hh = 2, hd = 6, rot = 4;
  const std::vector<int64_t> pos{0, 5, 17};
  const auto inv = detail::rope_inv_freq(rot, 10000.0);
  auto x = rnd(R * Hh * hd, 31), dy = rnd(R * Hh * hd, 32);
  auto s = [&](const std::vector<double>& xx) {
    double acc = 0;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t h = 0; h < Hh; ++h) {
        const double* v = xx.data() + (r * Hh + h) * hd;
        const double* g = dy.data() + (r * Hh + h) * hd;
        for (int64_t j = 0; j < rot / 2; ++j) {
          const double a = static_cast<double>(inv[j] * static_cast<float>(pos[r]));
          acc += g[j] * (v[j] * std::cos(a) - v[j + rot / 2] * std::sin(a)) +
                 g[j + rot / 2] * (v[j + rot / 2] * std::cos(a) + v[j] * std::sin(a));
        }
        for (int64_t j = rot; j < hd; ++j) acc += g[j] * v[j];
      }
    return acc;
  };
  std::vector<float> g = f32(dy);
  grad::apply_rope_backward(g.data(), R, Hh, hd, rot, pos.data(), inv);
  EXPECT_LT(rel_rms(g, fd(x, s)), kTol);
  // And it undoes the forward rotation (an orthogonal map): rope^T(rope(x)) == x.
  std::vector<float> xf = f32(x), y = xf;
  detail::apply_rope(y.data(), R, Hh, hd, rot, pos.data(), inv);
  grad::apply_rope_backward(y.data(), R, Hh, hd, rot, pos.data(), inv);
  for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(y[i], xf[i], 1e-5);
}
