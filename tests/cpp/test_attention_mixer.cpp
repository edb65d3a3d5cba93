// The attention mixer's options (mixers/attention_mixer.h) against a double-precision reference
// written here from the transformers modules they stand for: the layouts the next families need
// (OLMo-Hybrid's whole-projection plain q / k norms, Granite 4.0-H's "nope" layout with
// attention_multiplier as the softmax scale) beside the Qwen gated layout the fixtures already cover.
// Left padding, GQA, partial RoPE and a prompt split into two calls (the KV cache) included.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "mixers/attention_mixer.h"
#include "mixlens/errors.h"

using namespace mixlens;
using namespace mixlens::detail;

namespace {

std::vector<float> randv(size_t n, std::mt19937& gen, float sd) {
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = nd(gen);
  return v;
}

struct Setup {
  AttentionMixerDims d;
  AttentionMixerWeights w;
  std::vector<float> wq, wk, wv, wo, bq, bk, bv, bo, nq, nk;
};

Setup make(const AttentionMixerDims& d, uint32_t seed) {
  std::mt19937 gen(seed);
  Setup s;
  s.d = d;
  const int64_t qr = d.q_rows(), kd = d.Hkv * d.hd, D = d.D;
  s.wq = randv(static_cast<size_t>(qr * D), gen, 0.3f);
  s.wk = randv(static_cast<size_t>(kd * D), gen, 0.3f);
  s.wv = randv(static_cast<size_t>(kd * D), gen, 0.3f);
  s.wo = randv(static_cast<size_t>(D * d.H * d.hd), gen, 0.3f);
  s.w.q_proj = Tensor::from({qr, D}, s.wq);
  s.w.k_proj = Tensor::from({kd, D}, s.wk);
  s.w.v_proj = Tensor::from({kd, D}, s.wv);
  s.w.o_proj = Tensor::from({D, d.H * d.hd}, s.wo);
  if (d.bias) {
    s.bq = randv(static_cast<size_t>(qr), gen, 0.2f);
    s.bk = randv(static_cast<size_t>(kd), gen, 0.2f);
    s.bv = randv(static_cast<size_t>(kd), gen, 0.2f);
    s.bo = randv(static_cast<size_t>(D), gen, 0.2f);
    s.w.q_bias = Tensor::from({qr}, s.bq);
    s.w.k_bias = Tensor::from({kd}, s.bk);
    s.w.v_bias = Tensor::from({kd}, s.bv);
    s.w.o_bias = Tensor::from({D}, s.bo);
  }
  if (d.qk_norm != AttentionQkNorm::none) {
    const bool whole = d.qk_norm == AttentionQkNorm::whole;
    s.nq = randv(static_cast<size_t>(whole ? d.H * d.hd : d.hd), gen, 0.5f);
    s.nk = randv(static_cast<size_t>(whole ? kd : d.hd), gen, 0.5f);
    for (float& x : s.nq) x += d.qk_norm_centred ? 0.0f : 1.0f;
    for (float& x : s.nk) x += d.qk_norm_centred ? 0.0f : 1.0f;
    s.w.q_norm = Tensor::from({static_cast<int64_t>(s.nq.size())}, s.nq);
    s.w.k_norm = Tensor::from({static_cast<int64_t>(s.nk.size())}, s.nk);
  }
  return s;
}

// y = W x + b for one row.
std::vector<double> lin(const std::vector<float>& W, const std::vector<float>& b, const std::vector<double>& x, int64_t out) {
  const int64_t in = static_cast<int64_t>(x.size());
  std::vector<double> y(static_cast<size_t>(out));
  for (int64_t o = 0; o < out; ++o) {
    double acc = b.empty() ? 0.0 : b[static_cast<size_t>(o)];
    for (int64_t i = 0; i < in; ++i) acc += static_cast<double>(W[static_cast<size_t>(o * in + i)]) * x[static_cast<size_t>(i)];
    y[static_cast<size_t>(o)] = acc;
  }
  return y;
}

// RMSNorm of consecutive groups of `g` entries: w x / sqrt(mean(x^2) + eps), (1 + w) when centred.
void ref_norm(std::vector<double>& x, const std::vector<float>& w, int64_t g, double eps, bool centred) {
  for (size_t s = 0; s < x.size(); s += static_cast<size_t>(g)) {
    double ss = 0.0;
    for (int64_t e = 0; e < g; ++e) ss += x[s + static_cast<size_t>(e)] * x[s + static_cast<size_t>(e)];
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(g) + eps);
    for (int64_t e = 0; e < g; ++e) {
      const double wt = w[static_cast<size_t>(e)] + (centred ? 1.0 : 0.0);
      x[s + static_cast<size_t>(e)] *= inv * wt;
    }
  }
}

// Rotate-half RoPE on the first `rot` dims of each head of width hd, at position p.
void rope(std::vector<double>& x, int64_t hd, int64_t rot, double theta, int64_t p) {
  const int64_t half = rot / 2;
  for (size_t h0 = 0; h0 < x.size(); h0 += static_cast<size_t>(hd))
    for (int64_t j = 0; j < half; ++j) {
      const double inv = 1.0 / std::pow(theta, static_cast<double>(2 * j) / static_cast<double>(rot));
      const double a = x[h0 + static_cast<size_t>(j)], b = x[h0 + static_cast<size_t>(j + half)];
      const double c = std::cos(static_cast<double>(p) * inv), s = std::sin(static_cast<double>(p) * inv);
      x[h0 + static_cast<size_t>(j)] = a * c - b * s;
      x[h0 + static_cast<size_t>(j + half)] = b * c + a * s;
    }
}

// The attention block on x [B,T,D] with left padding `mask`, positions cumsum(mask) - 1 (0 at pads).
std::vector<double> reference(const Setup& s, const std::vector<float>& x, int64_t B, int64_t T,
                              const std::vector<std::vector<uint8_t>>& mask) {
  const AttentionMixerDims& d = s.d;
  const int64_t H = d.H, Hkv = d.Hkv, hd = d.hd, D = d.D, kd = Hkv * hd;
  const double scale = d.scale > 0.0f ? d.scale : 1.0 / std::sqrt(static_cast<double>(hd));
  std::vector<double> out(static_cast<size_t>(B * T * D));
  for (int64_t b = 0; b < B; ++b) {
    std::vector<std::vector<double>> q(static_cast<size_t>(T)), gate(static_cast<size_t>(T)), k(static_cast<size_t>(T)),
        v(static_cast<size_t>(T));
    int64_t seen = 0;
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> xr(static_cast<size_t>(D));
      for (int64_t e = 0; e < D; ++e) xr[static_cast<size_t>(e)] = x[static_cast<size_t>((b * T + t) * D + e)] * static_cast<double>(d.in_multiplier);
      const std::vector<double> qp = lin(s.wq, s.bq, xr, d.q_rows());
      q[static_cast<size_t>(t)].resize(static_cast<size_t>(H * hd));
      if (d.gate) {
        gate[static_cast<size_t>(t)].resize(static_cast<size_t>(H * hd));
        for (int64_t h = 0; h < H; ++h)
          for (int64_t e = 0; e < hd; ++e) {
            q[static_cast<size_t>(t)][static_cast<size_t>(h * hd + e)] = qp[static_cast<size_t>(h * 2 * hd + e)];
            gate[static_cast<size_t>(t)][static_cast<size_t>(h * hd + e)] = qp[static_cast<size_t>(h * 2 * hd + hd + e)];
          }
      } else {
        q[static_cast<size_t>(t)] = qp;
      }
      k[static_cast<size_t>(t)] = lin(s.wk, s.bk, xr, kd);
      for (double& e : k[static_cast<size_t>(t)]) e *= d.key_multiplier;
      v[static_cast<size_t>(t)] = lin(s.wv, s.bv, xr, kd);
      if (d.qk_norm != AttentionQkNorm::none) {
        const bool whole = d.qk_norm == AttentionQkNorm::whole;
        ref_norm(q[static_cast<size_t>(t)], s.nq, whole ? H * hd : hd, d.eps, d.qk_norm_centred);
        ref_norm(k[static_cast<size_t>(t)], s.nk, whole ? kd : hd, d.eps, d.qk_norm_centred);
      }
      const int64_t p = mask[static_cast<size_t>(b)][static_cast<size_t>(t)] ? seen++ : 0;
      if (d.rope) {
        rope(q[static_cast<size_t>(t)], hd, d.rot, d.theta, p);
        rope(k[static_cast<size_t>(t)], hd, d.rot, d.theta, p);
      }
    }
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> att(static_cast<size_t>(H * hd), 0.0);
      for (int64_t h = 0; h < H; ++h) {
        const int64_t g = h / (H / Hkv);
        std::vector<double> w;
        std::vector<int64_t> js;
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j <= t; ++j) {
          if (!mask[static_cast<size_t>(b)][static_cast<size_t>(j)]) continue;
          double sc = 0.0;
          for (int64_t e = 0; e < hd; ++e)
            sc += q[static_cast<size_t>(t)][static_cast<size_t>(h * hd + e)] * k[static_cast<size_t>(j)][static_cast<size_t>(g * hd + e)];
          w.push_back(sc * scale);
          js.push_back(j);
          mx = std::max(mx, sc * scale);
        }
        double sum = 0.0;
        for (double& e : w) sum += (e = std::exp(e - mx));
        for (size_t i = 0; i < w.size(); ++i)
          for (int64_t e = 0; e < hd; ++e)
            att[static_cast<size_t>(h * hd + e)] += w[i] / sum * v[static_cast<size_t>(js[i])][static_cast<size_t>(g * hd + e)];
      }
      if (d.gate)
        for (size_t e = 0; e < att.size(); ++e) att[e] *= 1.0 / (1.0 + std::exp(-gate[static_cast<size_t>(t)][e]));
      const std::vector<double> o = lin(s.wo, s.bo, att, D);
      for (int64_t e = 0; e < D; ++e) out[static_cast<size_t>((b * T + t) * D + e)] = o[static_cast<size_t>(e)] * d.out_multiplier;
    }
  }
  return out;
}

// Runs the mixer on x in two calls (the first `split` tokens, then the rest) over one KV cache.
std::vector<float> run_mixer(const Setup& s, const std::vector<float>& x, int64_t B, int64_t T, int64_t split,
                             const std::vector<std::vector<uint8_t>>& mask) {
  const AttentionMixer mixer(s.d, "test");
  const int64_t D = s.d.D;
  KvCache kv;
  std::vector<std::vector<uint8_t>> key_mask(static_cast<size_t>(B));
  std::vector<int64_t> seen(static_cast<size_t>(B), 0);
  std::vector<float> out(static_cast<size_t>(B * T * D));
  for (const auto& [t0, t1] : std::vector<std::pair<int64_t, int64_t>>{{0, split}, {split, T}}) {
    const int64_t n = t1 - t0;
    Batch in;
    in.batch = B;
    in.seq = n;
    std::vector<float> xs(static_cast<size_t>(B * n * D));
    std::vector<int64_t> pos;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = t0; t < t1; ++t) {
        std::copy_n(x.begin() + (b * T + t) * D, D, xs.begin() + (b * n + t - t0) * D);
        const uint8_t m = mask[static_cast<size_t>(b)][static_cast<size_t>(t)];
        key_mask[static_cast<size_t>(b)].push_back(m);
        pos.push_back(m ? seen[static_cast<size_t>(b)]++ : 0);
      }
    AttentionMixerCall call;
    call.kv = &kv;
    call.key_mask = &key_mask;
    call.pos = &pos;
    const Tensor y = mixer.forward(s.w, Tensor::from({B, n, D}, xs), in, call);
    for (int64_t b = 0; b < B; ++b)
      std::copy_n(y.data() + b * n * D, n * D, out.begin() + (b * T + t0) * D);
  }
  return out;
}

void check(const AttentionMixerDims& d, uint32_t seed, const char* what) {
  const Setup s = make(d, seed);
  const int64_t B = 2, T = 9;
  std::mt19937 gen(seed + 1);
  const std::vector<float> x = randv(static_cast<size_t>(B * T * d.D), gen, 1.0f);
  std::vector<std::vector<uint8_t>> mask(2, std::vector<uint8_t>(static_cast<size_t>(T), 1));
  mask[1][0] = mask[1][1] = mask[1][2] = 0;  // row 1 left-padded by 3
  const std::vector<double> ref = reference(s, x, B, T, mask);
  const std::vector<float> got = run_mixer(s, x, B, T, 5, mask);
  double err = 0.0, mag = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    err = std::max(err, std::fabs(got[i] - ref[i]));
    mag = std::max(mag, std::fabs(ref[i]));
  }
  EXPECT_GT(mag, 0.1) << what;
  EXPECT_LT(err, 2e-5 * mag) << what;
}

}  // namespace

TEST(AttentionMixer, QwenGatedLayoutMatchesReference) {
  AttentionMixerDims d;
  d.D = 16; d.H = 4; d.Hkv = 2; d.hd = 8;
  d.rope = true; d.rot = 4; d.theta = 10000.0;
  d.gate = true;
  d.qk_norm = AttentionQkNorm::per_head; d.qk_norm_centred = true; d.eps = 1e-6f;
  check(d, 7, "qwen");
}

TEST(AttentionMixer, WholeProjectionPlainNormsWithBiasesMatchReference) {  // OLMo-Hybrid's layout
  AttentionMixerDims d;
  d.D = 12; d.H = 3; d.Hkv = 1; d.hd = 6;
  d.rope = true; d.rot = 6; d.theta = 500.0;
  d.qk_norm = AttentionQkNorm::whole; d.qk_norm_centred = false; d.eps = 1e-5f;
  d.bias = true;
  check(d, 11, "whole norm");
}

TEST(AttentionMixer, NoRopeExplicitScaleAndMultipliersMatchReference) {  // Granite "nope", Falcon-H1 µP
  AttentionMixerDims d;
  d.D = 10; d.H = 2; d.Hkv = 2; d.hd = 5;
  d.rope = false;
  d.scale = 0.0078125f * 30.0f;
  d.bias = true;
  d.in_multiplier = 0.8f; d.key_multiplier = 1.3f; d.out_multiplier = 0.7f;
  check(d, 13, "nope");
}

TEST(AttentionMixer, RefusesInconsistentOptions) {
  AttentionMixerDims d;
  d.D = 8; d.H = 3; d.Hkv = 2; d.hd = 4; d.rope = false;
  EXPECT_THROW(AttentionMixer(d, "cfg"), ConfigError);  // 3 heads over 2 kv heads
  d.H = 4;
  d.rope = true;
  d.rot = 3;
  EXPECT_THROW(AttentionMixer(d, "cfg"), ConfigError);  // odd rotary dim
  d.rot = 4;
  d.scale = -1.0f;
  EXPECT_THROW(AttentionMixer(d, "cfg"), ConfigError);
  d.scale = 0.0f;
  EXPECT_NO_THROW(AttentionMixer(d, "cfg"));
}
