// Tiled (flash) causal attention vs the explicit per-query softmax and a double-precision
// reference: GQA, a KV cache (past > 0, decode T = 1), left padding (fully masked queries),
// several query / key tiles and odd head dims (issue 9 item 3).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "mixers/attention.h"
#include "ops/tile_kernels.h"

using namespace mixlens;
using namespace mixlens::detail;

namespace {

struct Case {
  int64_t B, T, H, Hkv, d, past;
};

// `scale` 0: SDPA's default 1/sqrt(d).
void reference(const std::vector<float>& q, const Case& c, const KvCache& kv, const std::vector<std::vector<uint8_t>>& mask,
               std::vector<double>& out, double scale = 0.0, int64_t window = 0) {
  const int64_t rep = c.H / c.Hkv, width = c.Hkv * c.d;
  out.assign(static_cast<size_t>(c.B * c.T * c.H * c.d), 0.0);
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t t = 0; t < c.T; ++t) {
        const float* qt = q.data() + ((b * c.T + t) * c.H + h) * c.d;
        std::vector<double> w;
        std::vector<int64_t> js;
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = window > 0 ? std::max<int64_t>(0, c.past + t + 1 - window) : 0; j <= c.past + t; ++j) {
          if (!mask[static_cast<size_t>(b)][static_cast<size_t>(j)]) continue;
          const float* kj = kv.k[static_cast<size_t>(b)].data() + j * width + (h / rep) * c.d;
          double s = 0;
          for (int64_t e = 0; e < c.d; ++e) s += static_cast<double>(qt[e]) * kj[e];
          if (scale > 0.0) s *= scale;
          else s /= std::sqrt(static_cast<double>(c.d));
          w.push_back(s);
          js.push_back(j);
          mx = std::max(mx, s);
        }
        double sum = 0;
        for (double& v : w) sum += (v = std::exp(v - mx));
        double* o = out.data() + ((b * c.T + t) * c.H + h) * c.d;
        for (size_t k = 0; k < w.size(); ++k) {
          const float* vj = kv.v[static_cast<size_t>(b)].data() + js[k] * width + (h / rep) * c.d;
          for (int64_t e = 0; e < c.d; ++e) o[e] += w[k] / sum * vj[e];
        }
      }
}

}  // namespace

// A query's output does not depend on how the prompt was split into calls (T, past) nor on the tile.
TEST(FlashAttention, SplitInvariant) {
  const int64_t H = 2, Hkv = 1, d = 12, Tall = 300, width = Hkv * d;
  std::mt19937 gen(11);
  std::normal_distribution<float> nd(0.0f, 1.5f);
  std::vector<float> q(static_cast<size_t>(Tall * H * d)), k(static_cast<size_t>(Tall * width)), v(k.size());
  for (float& x : q) x = nd(gen);
  for (float& x : k) x = nd(gen);
  for (float& x : v) x = nd(gen);
  KvCache kv;
  kv.append(k.data(), v.data(), 1, Tall, width);
  const std::vector<std::vector<uint8_t>> mask{std::vector<uint8_t>(Tall, 1)};
  std::vector<float> whole(q.size());
  flash_causal_attention(q.data(), 1, Tall, H, Hkv, d, 0, kv, mask, whole.data());
  for (int64_t past : {int64_t{1}, int64_t{37}, int64_t{129}, int64_t{299}}) {
    std::vector<float> part(static_cast<size_t>((Tall - past) * H * d));
    flash_causal_attention(q.data() + past * H * d, 1, Tall - past, H, Hkv, d, past, kv, mask, part.data());
    for (size_t i = 0; i < part.size(); ++i) ASSERT_EQ(part[i], whole[static_cast<size_t>(past * H * d) + i]) << past;
  }
}

TEST(FlashAttention, MatchesExplicitAndDoubleReference) {
  const Case cases[] = {{2, 150, 4, 2, 20, 0},  {2, 5, 4, 1, 17, 70}, {2, 1, 6, 3, 24, 200},
                        {1, 200, 2, 2, 8, 140}, {3, 64, 2, 1, 33, 0},  {1, 1, 1, 1, 5, 0}};
  std::mt19937 gen(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (const Case& c : cases) {
    const int64_t Tk = c.past + c.T, width = c.Hkv * c.d;
    std::vector<float> q(static_cast<size_t>(c.B * c.T * c.H * c.d));
    for (float& v : q) v = 2.0f * nd(gen);  // sharp softmaxes exercise the running-max rescale
    std::vector<float> k(static_cast<size_t>(c.B * Tk * width)), v(k.size());
    for (float& x : k) x = nd(gen);
    for (float& x : v) x = nd(gen);
    KvCache kv;
    kv.append(k.data(), v.data(), c.B, Tk, width);  // past + T tokens in the cache, as the models do
    std::vector<std::vector<uint8_t>> mask(static_cast<size_t>(c.B), std::vector<uint8_t>(static_cast<size_t>(Tk), 1));
    // Row 1 left-padded: its first queries (when T > 1, past == 0) see no key at all.
    if (c.B > 1)
      for (int64_t j = 0; j < std::min<int64_t>(Tk - 1, c.past + 3); ++j) mask[1][static_cast<size_t>(j)] = 0;
    std::vector<float> flash(q.size(), 99.0f), expl(q.size(), 99.0f),
        probs(static_cast<size_t>(c.B * c.H * c.T * Tk), 0.0f);
    flash_causal_attention(q.data(), c.B, c.T, c.H, c.Hkv, c.d, c.past, kv, mask, flash.data());
    causal_attention(q.data(), c.B, c.T, c.H, c.Hkv, c.d, c.past, kv, mask, expl.data(), probs.data());
    std::vector<float> dflt(q.size(), 99.0f);
    causal_attention(q.data(), c.B, c.T, c.H, c.Hkv, c.d, c.past, kv, mask, dflt.data());
    std::vector<double> ref;
    reference(q, c, kv, mask, ref);
    double worst_flash = 0;
    for (size_t i = 0; i < q.size(); ++i) {
      worst_flash = std::max(worst_flash, std::fabs(flash[i] - ref[i]));
      ASSERT_EQ(dflt[i], flash[i]) << "without probs, causal_attention must run the flash path";
      ASSERT_EQ(expl[i], flash[i]) << "asking for the probabilities must not change the output";
    }
    // Outputs are convex combinations of N(0,1) values: float32 rounding is ~1e-6 here.
    EXPECT_LT(worst_flash, 5e-6) << "B" << c.B << " T" << c.T << " past" << c.past << " d" << c.d;
    // The probabilities themselves: rows sum to 1 over visible keys (0 for fully masked queries).
    for (int64_t r = 0; r < c.B * c.H * c.T; ++r) {
      double s = 0;
      for (int64_t j = 0; j < Tk; ++j) s += probs[static_cast<size_t>(r * Tk + j)];
      EXPECT_TRUE(std::fabs(s - 1.0) < 1e-5 || s == 0.0) << s;
    }
    // Fully masked queries give exactly 0.
    if (c.B > 1 && c.past == 0 && c.T > 1) {
      for (int64_t e = 0; e < c.d; ++e) EXPECT_EQ(flash[static_cast<size_t>((1 * c.T + 0) * c.H * c.d + e)], 0.0f);
    }
  }
}

// A sliding window (RecurrentGemma's attention_window_size): each query sees its last `window` keys, on a
// prompt longer than the window (several query and key tiles), a continuation and decode steps over a
// cache, with left padding; the probabilities span only the window; and a cache trimmed to the last
// window - 1 keys before the call (KvCache::keep_last, its offset into the key mask) gives bitwise the
// same outputs as the whole cache.
TEST(FlashAttention, SlidingWindowMatchesReferenceAndTrimmedCache) {
  const Case cases[] = {{2, 300, 4, 2, 16, 0}, {2, 40, 2, 1, 8, 90}, {2, 1, 4, 2, 8, 200}, {1, 3, 2, 2, 5, 4}};
  std::mt19937 gen(9);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (const Case& c : cases)
    for (int64_t window : {int64_t{5}, int64_t{33}, int64_t{150}}) {
      const int64_t Tk = c.past + c.T, width = c.Hkv * c.d;
      std::vector<float> q(static_cast<size_t>(c.B * c.T * c.H * c.d));
      for (float& v : q) v = 2.0f * nd(gen);
      std::vector<float> k(static_cast<size_t>(c.B * Tk * width)), v(k.size());
      for (float& x : k) x = nd(gen);
      for (float& x : v) x = nd(gen);
      KvCache kv;
      kv.append(k.data(), v.data(), c.B, Tk, width);
      std::vector<std::vector<uint8_t>> mask(static_cast<size_t>(c.B), std::vector<uint8_t>(static_cast<size_t>(Tk), 1));
      if (c.B > 1)
        for (int64_t j = 0; j < std::min<int64_t>(Tk - 1, c.past + 3); ++j) mask[1][static_cast<size_t>(j)] = 0;
      std::vector<float> flash(q.size()), probs(static_cast<size_t>(c.B * c.H * c.T * Tk), 0.0f), expl(q.size());
      flash_causal_attention(q.data(), c.B, c.T, c.H, c.Hkv, c.d, c.past, kv, mask, flash.data(), 0.0f, window);
      causal_attention(q.data(), c.B, c.T, c.H, c.Hkv, c.d, c.past, kv, mask, expl.data(), probs.data(), 0.0f, window);
      std::vector<double> ref, causal;
      reference(q, c, kv, mask, ref, 0.0, window);
      reference(q, c, kv, mask, causal);
      double worst = 0, moved = 0;
      for (size_t i = 0; i < q.size(); ++i) {
        worst = std::max(worst, std::fabs(flash[i] - ref[i]));
        moved = std::max(moved, std::fabs(ref[i] - causal[i]));
        ASSERT_EQ(expl[i], flash[i]);
      }
      EXPECT_LT(worst, 5e-6) << "T" << c.T << " past" << c.past << " window" << window;
      if (Tk > window + 3) {
        EXPECT_GT(moved, 1e-3) << "the window must matter here";
      }
      for (int64_t r = 0; r < c.B * c.H * c.T; ++r) {
        const int64_t t = r % c.T;
        for (int64_t j = 0; j < Tk; ++j)
          if (j <= c.past + t - window) {
            EXPECT_EQ(probs[static_cast<size_t>(r * Tk + j)], 0.0f) << "outside the window";
          }
      }
      if (c.past < window) continue;
      KvCache trimmed;
      trimmed.append(k.data(), v.data(), c.B, c.past, width);  // the cache before the call
      for (int64_t b = 0; b < c.B; ++b)  // per-row layout [len, width]: rebuild it from the rows of each batch row
        for (int64_t side = 0; side < 2; ++side) {
          auto& dst = side == 0 ? trimmed.k[static_cast<size_t>(b)] : trimmed.v[static_cast<size_t>(b)];
          const auto& src = side == 0 ? k : v;
          dst.assign(src.begin() + b * Tk * width, src.begin() + (b * Tk + c.past) * width);
        }
      trimmed.keep_last(window - 1);
      EXPECT_EQ(trimmed.len, window - 1);
      EXPECT_EQ(trimmed.offset, c.past - (window - 1));
      std::vector<float> kn(static_cast<size_t>(c.B * c.T * width)), vn(kn.size());
      for (int64_t b = 0; b < c.B; ++b) {
        std::copy_n(k.begin() + (b * Tk + c.past) * width, c.T * width, kn.begin() + b * c.T * width);
        std::copy_n(v.begin() + (b * Tk + c.past) * width, c.T * width, vn.begin() + b * c.T * width);
      }
      trimmed.append(kn.data(), vn.data(), c.B, c.T, width);
      std::vector<float> out2(q.size());
      flash_causal_attention(q.data(), c.B, c.T, c.H, c.Hkv, c.d, window - 1, trimmed, mask, out2.data(), 0.0f, window);
      for (size_t i = 0; i < q.size(); ++i) ASSERT_EQ(out2[i], flash[i]) << "trimmed cache, window " << window;
    }
}

// The tile kernels compute each element in one order whatever the block shape: a tile equals the
// same elements computed one query (and one key) at a time, bitwise, and the vector level agrees
// with the scalar one to float32 rounding.
TEST(TileKernels, BlockingInvariantAndMatchScalar) {
  std::mt19937 gen(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t d : {int64_t{5}, int64_t{16}, int64_t{37}, int64_t{256}}) {
    const int64_t nq = 11, nk = 14, ld = d + 3;
    std::vector<float> Q(static_cast<size_t>(nq * ld)), K(static_cast<size_t>(nk * ld));
    for (float& x : Q) x = nd(gen);
    for (float& x : K) x = nd(gen);
    const ops::TileKernels& tk = ops::tile_kernels();
    std::vector<float> S(static_cast<size_t>(nq * nk)), one(S.size()), sc(S.size());
    tk.dots(Q.data(), ld, nq, K.data(), ld, nk, d, S.data(), nk);
    ops::kScalarTileKernels.dots(Q.data(), ld, nq, K.data(), ld, nk, d, sc.data(), nk);
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t j = 0; j < nk; ++j) tk.dots(Q.data() + i * ld, ld, 1, K.data() + j * ld, ld, 1, d, &one[static_cast<size_t>(i * nk + j)], 1);
    for (size_t i = 0; i < S.size(); ++i) {
      ASSERT_EQ(S[i], one[i]) << "d " << d << " element " << i;
      ASSERT_NEAR(S[i], sc[i], 1e-5 * std::sqrt(static_cast<double>(d)));
    }
    // O += P V for the tile, then one query at a time over the same start values.
    std::vector<float> V(static_cast<size_t>(nk * ld)), O0(static_cast<size_t>(nq * d));
    for (float& x : V) x = nd(gen);
    for (float& x : O0) x = nd(gen);
    std::vector<float> O = O0, Oone = O0, Osc = O0;
    tk.acc_tile(S.data(), nk, nq, V.data(), ld, nk, d, O.data(), d);
    ops::kScalarTileKernels.acc_tile(S.data(), nk, nq, V.data(), ld, nk, d, Osc.data(), d);
    for (int64_t i = 0; i < nq; ++i) tk.acc_tile(S.data() + i * nk, nk, 1, V.data(), ld, nk, d, Oone.data() + i * d, d);
    for (size_t i = 0; i < O.size(); ++i) {
      ASSERT_EQ(O[i], Oone[i]) << "d " << d << " element " << i;
      ASSERT_NEAR(O[i], Osc[i], 1e-4 * std::sqrt(static_cast<double>(d)));
    }
  }
}

// An explicit softmax scale (Granite's attention_multiplier, Zamba's (d/2)^-0.5) in both paths, and
// 0 as the default 1/sqrt(d), bitwise.
TEST(FlashAttention, ExplicitSoftmaxScale) {
  const Case c{2, 70, 4, 2, 16, 9};
  const int64_t Tk = c.past + c.T, width = c.Hkv * c.d;
  std::mt19937 gen(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(c.B * c.T * c.H * c.d)), k(static_cast<size_t>(c.B * Tk * width)), v(k.size());
  for (float& x : q) x = 2.0f * nd(gen);
  for (float& x : k) x = nd(gen);
  for (float& x : v) x = nd(gen);
  KvCache kv;
  kv.append(k.data(), v.data(), c.B, Tk, width);
  std::vector<std::vector<uint8_t>> mask(static_cast<size_t>(c.B), std::vector<uint8_t>(static_cast<size_t>(Tk), 1));
  for (int64_t j = 0; j < 12; ++j) mask[1][static_cast<size_t>(j)] = 0;
  std::vector<float> dflt(q.size()), same(q.size());
  flash_causal_attention(q.data(), c.B, c.T, c.H, c.Hkv, c.d, c.past, kv, mask, dflt.data());
  flash_causal_attention(q.data(), c.B, c.T, c.H, c.Hkv, c.d, c.past, kv, mask, same.data(), attention_scale(c.d, 0.0f));
  for (size_t i = 0; i < q.size(); ++i) ASSERT_EQ(same[i], dflt[i]);
  const float scale = 0.0078125f * 40.0f;  // not 1/sqrt(16) = 0.25
  std::vector<float> flash(q.size()), expl(q.size()), probs(static_cast<size_t>(c.B * c.H * c.T * Tk), 0.0f);
  flash_causal_attention(q.data(), c.B, c.T, c.H, c.Hkv, c.d, c.past, kv, mask, flash.data(), scale);
  causal_attention(q.data(), c.B, c.T, c.H, c.Hkv, c.d, c.past, kv, mask, expl.data(), probs.data(), scale);
  std::vector<double> ref;
  reference(q, c, kv, mask, ref, scale);
  double worst = 0, moved = 0;
  for (size_t i = 0; i < q.size(); ++i) {
    ASSERT_EQ(expl[i], flash[i]);
    worst = std::max(worst, std::fabs(flash[i] - ref[i]));
    moved = std::max(moved, static_cast<double>(std::fabs(flash[i] - dflt[i])));
  }
  EXPECT_LT(worst, 5e-6);
  EXPECT_GT(moved, 1e-3) << "the scale must change the output";
  // The probabilities at that scale: row 0, head 0, the last query, against the reference softmax.
  const int64_t t = c.T - 1, n = c.past + t + 1;
  std::vector<double> w(static_cast<size_t>(n));
  double mx = -1e300, sum = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    double s = 0.0;
    for (int64_t e = 0; e < c.d; ++e) s += static_cast<double>(q[static_cast<size_t>(t * c.H * c.d + e)]) * k[static_cast<size_t>(j * width + e)];
    w[static_cast<size_t>(j)] = s * scale;
    mx = std::max(mx, w[static_cast<size_t>(j)]);
  }
  for (double& x : w) sum += (x = std::exp(x - mx));
  for (int64_t j = 0; j < n; ++j)
    EXPECT_NEAR(probs[static_cast<size_t>(t * Tk + j)], w[static_cast<size_t>(j)] / sum, 1e-6) << j;
}
