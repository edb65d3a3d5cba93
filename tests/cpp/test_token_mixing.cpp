// token_mixing / state_input_mixing / state_contributions (issue 26 item 1): the SSD mixing
// against an explicit float64 recurrence driven one source token at a time, against the chunked
// and recurrent kernels' head outputs and per-token states, and the public block API against the
// trace values of the fixtures.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "fixture_util.h"
#include "hooks/mixing.h"
#include "mixers/gated_delta.h"
#include "mixers/mlstm_mixer.h"
#include "mixers/rg_lru_mixer.h"
#include "mixers/rwkv_mixer.h"
#include "mixers/selective_scan.h"
#include "mixers/short_conv_mixer.h"
#include "mixers/ssd.h"
#include "mixlens/errors.h"
#include "mixlens/mixing.h"
#include "mixlens/trace.h"

using namespace mixlens;

namespace {

struct SsdCase {
  int64_t T = 0, H = 4, G = 2, P = 3, N = 5, chunk = 4;
  std::vector<float> x, Bm, C, dt, A, D, S0;  // one row, served layouts; S0 kernel layout [H,P,N]
};

SsdCase random_case(int64_t T, uint32_t seed) {
  SsdCase c;
  c.T = T;
  std::mt19937 g(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(0.05f, 0.6f);
  auto fill = [&](std::vector<float>& v, size_t k, bool pos) {
    v.resize(k);
    for (float& e : v) e = pos ? u(g) : n(g);
  };
  fill(c.x, static_cast<size_t>(T * c.H * c.P), false);
  fill(c.Bm, static_cast<size_t>(T * c.G * c.N), false);
  fill(c.C, static_cast<size_t>(T * c.G * c.N), false);
  fill(c.dt, static_cast<size_t>(T * c.H), true);
  fill(c.A, static_cast<size_t>(c.H), true);
  for (float& a : c.A) a = -2.0f * a;
  fill(c.D, static_cast<size_t>(c.H), false);
  fill(c.S0, static_cast<size_t>(c.H * c.P * c.N), false);
  return c;
}

detail::SsdBatch batch_of(SsdCase& c, float* S, float* y, bool chunked) {
  detail::SsdBatch sb;
  sb.B = 1; sb.T = c.T; sb.H = c.H; sb.P = c.P; sb.G = c.G; sb.N = c.N; sb.chunk = c.chunk; sb.chunked = chunked;
  sb.x = c.x.data(); sb.Bm = c.Bm.data(); sb.C = c.C.data(); sb.dt = c.dt.data(); sb.A = c.A.data(); sb.D = c.D.data();
  sb.S = S; sb.y = y;
  return sb;
}

// M[h,t,s] by the recurrence itself, in double: feed token s alone (x_s = 1, every other x = 0,
// no skip, zero start) and read y_t, for every s.
std::vector<double> recurrence_mixing(const SsdCase& c) {
  const int64_t T = c.T, H = c.H, N = c.N, per = c.H / c.G;
  std::vector<double> M(static_cast<size_t>(H * T * T), 0.0);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t s = 0; s < T; ++s) {
      std::vector<double> S(static_cast<size_t>(N), 0.0);
      for (int64_t t = 0; t < T; ++t) {
        const double dt = c.dt[static_cast<size_t>(t * H + h)], dA = std::exp(static_cast<double>(c.A[static_cast<size_t>(h)] * c.dt[static_cast<size_t>(t * H + h)]));
        const float* Bt = c.Bm.data() + (t * c.G + h / per) * N;
        const float* Ct = c.C.data() + (t * c.G + h / per) * N;
        double y = 0;
        for (int64_t n = 0; n < N; ++n) {
          S[static_cast<size_t>(n)] = S[static_cast<size_t>(n)] * dA + (t == s ? dt * Bt[n] : 0.0);
          y += S[static_cast<size_t>(n)] * Ct[n];
        }
        M[static_cast<size_t>((h * T + t) * T + s)] = y;
      }
    }
  return M;
}

double rel(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) num += (a[i] - b[i]) * (a[i] - b[i]), den += b[i] * b[i];
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

}  // namespace

TEST(TokenMixing, SsdMatchesAFloat64RecurrenceAndBothKernels) {
  // Lengths 1 .. 2 * chunk + 1 (chunk 4), a state to start from, two groups of two heads.
  for (int64_t T = 1; T <= 9; ++T) {
    SsdCase c = random_case(T, static_cast<uint32_t>(100 + T));
    const int64_t H = c.H, P = c.P, N = c.N;
    std::vector<float> M(static_cast<size_t>(H * T * T)), Sin(static_cast<size_t>(H * T * N));
    std::vector<float> S(c.S0), y(static_cast<size_t>(T * H * P));
    const detail::SsdBatch sb = batch_of(c, S.data(), y.data(), true);
    detail::ssd_token_mixing(sb, {0}, detail::MixBlock::whole(T, H), M.data(), Sin.data());
    const std::vector<double> ref = recurrence_mixing(c);
    ASSERT_LE(rel(std::vector<double>(M.begin(), M.end()), ref), 1e-6) << "T=" << T;
    // Upper triangle exactly zero (the future mixes nothing in).
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t s = t + 1; s < T; ++s) ASSERT_EQ(M[static_cast<size_t>((h * T + t) * T + s)], 0.0f);
    // y = M x + D x + Sin . S0 (served [N,P]) against the chunked and the recurrent kernel.
    std::vector<float> S0_served(c.S0.size());
    detail::ssd_serve_state(c.S0.data(), H, P, N, S0_served.data());
    std::vector<double> mix(static_cast<size_t>(T * H * P), 0.0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t p = 0; p < P; ++p) {
          double acc = c.D[static_cast<size_t>(h)] * c.x[static_cast<size_t>((t * H + h) * P + p)];
          for (int64_t s = 0; s < T; ++s) acc += M[static_cast<size_t>((h * T + t) * T + s)] * c.x[static_cast<size_t>((s * H + h) * P + p)];
          for (int64_t n = 0; n < N; ++n) acc += Sin[static_cast<size_t>((h * T + t) * N + n)] * S0_served[static_cast<size_t>((h * N + n) * P + p)];
          mix[static_cast<size_t>((t * H + h) * P + p)] = acc;
        }
    for (bool chunked : {true, false}) {
      std::vector<float> S1(c.S0), y1(static_cast<size_t>(T * H * P));
      detail::SsdArgs a;
      a.T = T; a.H = H; a.P = P; a.G = c.G; a.N = N; a.x = c.x.data(); a.B = c.Bm.data(); a.C = c.C.data();
      a.dt = c.dt.data(); a.A = c.A.data(); a.D = c.D.data(); a.S = S1.data(); a.y = y1.data(); a.chunk = c.chunk;
      if (chunked) detail::ssd_chunked(a); else detail::ssd_recurrent(a);
      EXPECT_LE(rel(mix, std::vector<double>(y1.begin(), y1.end())), 1e-5) << "T=" << T << " chunked=" << chunked;
    }
  }
}

TEST(TokenMixing, SsdBlocksAreSlicesAndPaddingMixesNothing) {
  // Two rows, the second left-padded by 3: its padded rows and columns are 0, its real block equals
  // the row run alone; any block equals the slice of the whole matrix.
  const int64_t T = 9;
  SsdCase c = random_case(T, 7);
  const int64_t H = c.H, N = c.N, G = c.G;
  SsdCase two = c;
  auto dup = [&](std::vector<float>& v, int64_t per_tok, int64_t pad) {
    std::vector<float> r(v.size() * 2, 0.0f);
    std::copy(v.begin(), v.end(), r.begin());
    std::copy(v.begin(), v.end() - pad * per_tok, r.begin() + static_cast<std::ptrdiff_t>(v.size() + pad * per_tok));
    v = r;
  };
  dup(two.x, H * c.P, 3); dup(two.Bm, G * N, 3); dup(two.C, G * N, 3); dup(two.dt, H, 3);
  std::vector<float> S(2 * c.S0.size()), y(2 * c.x.size());
  detail::SsdBatch sb = batch_of(two, S.data(), y.data(), true);
  sb.B = 2;
  std::vector<float> M(static_cast<size_t>(2 * H * T * T));
  detail::ssd_token_mixing(sb, {0, 3}, detail::MixBlock::whole(T, H), M.data(), nullptr);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t s = 0; s < T; ++s) {
        const float padded = M[static_cast<size_t>(((H + h) * T + t) * T + s)];
        if (t < 3 || s < 3) ASSERT_EQ(padded, 0.0f);
        else ASSERT_NEAR(padded, M[static_cast<size_t>((h * T + t - 3) * T + s - 3)], 1e-6f);
      }
  const detail::MixBlock blk{2, 7, 1, 5, 1, 3};
  std::vector<float> part(static_cast<size_t>(2 * blk.heads() * blk.rows() * blk.cols()));
  detail::ssd_token_mixing(sb, {0, 3}, blk, part.data(), nullptr);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < blk.heads(); ++h)
      for (int64_t i = 0; i < blk.rows(); ++i)
        for (int64_t j = 0; j < blk.cols(); ++j)
          ASSERT_EQ(part[static_cast<size_t>(((b * blk.heads() + h) * blk.rows() + i) * blk.cols() + j)],
                    M[static_cast<size_t>(((b * H + blk.h0 + h) * T + blk.r0 + i) * T + blk.c0 + j)]);
}

TEST(TokenMixing, SsdContributionsSumToTheStates) {
  const int64_t T = 9;
  SsdCase c = random_case(T, 11);
  const int64_t H = c.H, P = c.P, N = c.N;
  std::vector<float> S(c.S0.size(), 0.0f), y(c.x.size()), states(static_cast<size_t>(T * H * N * P));
  detail::SsdArgs a;
  a.T = T; a.H = H; a.P = P; a.G = c.G; a.N = N; a.x = c.x.data(); a.B = c.Bm.data(); a.C = c.C.data();
  a.dt = c.dt.data(); a.A = c.A.data(); a.D = c.D.data(); a.S = S.data(); a.y = y.data(); a.chunk = c.chunk;
  a.states = states.data();
  detail::ssd_chunked(a);
  const detail::SsdBatch sb = batch_of(c, S.data(), y.data(), true);
  for (int64_t t : {int64_t{0}, int64_t{4}, T - 1}) {
    std::vector<float> contrib(static_cast<size_t>(H * T * N * P));
    detail::ssd_state_contributions(sb, {0}, t, {0, 0, 0, T, 0, H}, contrib.data());
    std::vector<double> sum(static_cast<size_t>(H * N * P), 0.0), want(sum.size());
    for (int64_t h = 0; h < H; ++h)
      for (int64_t s = 0; s < T; ++s)
        for (int64_t e = 0; e < N * P; ++e) {
          const float v = contrib[static_cast<size_t>((h * T + s) * N * P + e)];
          if (s > t) {
            ASSERT_EQ(v, 0.0f);
          }
          sum[static_cast<size_t>(h * N * P + e)] += v;
        }
    for (size_t e = 0; e < want.size(); ++e) want[e] = states[static_cast<size_t>(t * H * N * P) + e];
    EXPECT_LE(rel(sum, want), 1e-5) << "t=" << t;
  }
}

TEST(TokenMixing, ApiBlockEqualsTheTraceValueAndRebuildsTheHeadOutputs) {
  // Mamba-2 (with D), MiniMax lightning, Qwen3.5's gated DeltaNet and Kimi's KDA (no skip) fixtures: the block API against the trace's
  // token_mixing and the head outputs (rel RMS <= 1e-5), and a refused write.
  for (const char* fx : {"mamba2/g2_clamp", "minimax/lightning_attn", "qwen3_5/padded_batch", "kimi_linear/padded_batch",
                         "mamba/padded_bias", "zamba/padded_bias", "lfm2/bias_short_prompt", "recurrent_gemma/padded_batch",
                         "rwkv/batch_eps_tied", "xlstm/batch_eps_tied"}) {
    if (!std::filesystem::exists(test::fixture(fx) / "config.json")) continue;
    Model m = Model::load(test::fixture(fx).string());
    int layer = -1;
    for (const ValueInfo& v : m.values(1, 1))
      if (v.site.value == Value::token_mixing && layer < 0) layer = v.site.layer;
    ASSERT_GE(layer, 0) << fx;
    const std::string p = "layers." + std::to_string(layer) + ".linear_attn.";
    const std::vector<std::vector<int32_t>> prompts{{5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17}, {20, 21, 22, 23, 24}};
    Trace tr;
    tr.save(p + "token_mixing").save(p + "attention_values").save(p + "attention_head_outputs");
    m.run(prompts, &tr);
    const Tensor M = tr.get(p + "token_mixing"), x = tr.get(p + "attention_values"), y = tr.get(p + "attention_head_outputs");
    const Batch batch = Batch::left_padded(prompts, m.pad_token_id());
    const TokenMixing full = token_mixing(m, batch, {layer, {}, {}, {}});
    ASSERT_EQ(full.mixing.shape(), M.shape());
    EXPECT_LE(test::max_abs_diff(full.mixing, M), 0.0) << fx;
    // Per-channel kinds serve [B,T,channels] (one value per "head"), xLSTM [B,T,NH*Dv].
    const int64_t B = x.size(0), T = x.size(1), H = M.size(1), P = x.numel() / (B * T * H);
    Tensor rebuilt(y.shape());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t pp = 0; pp < P; ++pp) {
            double acc = full.skip[((b * T + t) * H + h) * P + pp];
            for (int64_t s = 0; s < T; ++s) acc += M[((b * H + h) * T + t) * T + s] * x[((b * T + s) * H + h) * P + pp];
            rebuilt[((b * T + t) * H + h) * P + pp] = static_cast<float>(acc);
          }
    EXPECT_LE(test::rel_rms(rebuilt, y), 1e-5) << fx;
    const TokenMixing part = token_mixing(m, batch, {layer, {3, -2}, {-5, kSpanEnd}, {1, 2}});
    ASSERT_EQ(part.mixing.shape(), (Shape{B, 1, T - 5, 5}));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < T - 5; ++i)
        for (int64_t j = 0; j < 5; ++j)
          ASSERT_EQ(part.mixing[(b * (T - 5) + i) * 5 + j], M[((b * H + 1) * T + 3 + i) * T + T - 5 + j]);
    EXPECT_THROW(token_mixing(m, batch, {layer, {0, T + 1}, {}, {}}), InputError);
    Trace w;
    w.set(p + "token_mixing", M);
    EXPECT_THROW(m.run(prompts, &w), WriteError);
  }
}

TEST(TokenMixing, BlocksWithoutARecurrentMixerAreRefusedWithTheReason) {
  Model m = Model::load(test::fixture("lfm2/conv_attn").string());
  int attn = -1;
  for (int i = 0; i < m.info().num_layers && attn < 0; ++i)
    if (m.info().layer_kinds[static_cast<size_t>(i)] == LayerKind::attention) attn = i;
  ASSERT_GE(attn, 0);
  const auto s = m.support();
  ASSERT_NE(s.at("linear_attn.token_mixing").at(attn).find("attention"), std::string::npos);
  const Batch batch = Batch::left_padded({{5, 6, 7}}, m.pad_token_id());
  EXPECT_THROW(token_mixing(m, batch, {attn, {}, {}, {}}), UnsupportedError);
  EXPECT_THROW(token_mixing(m, batch, {m.info().num_layers, {}, {}, {}}), InputError);
  Trace tr;
  tr.save("layers." + std::to_string(attn) + ".linear_attn.token_mixing");
  EXPECT_THROW(m.run({{5, 6, 7}}, &tr), UnknownValueError);
}

namespace {

struct GdnCase {
  int64_t T = 0, H = 2, Dk = 4, Dv = 3;
  bool per_key = false;
  std::vector<float> q, k, v, g, beta, S0;  // one row, served layouts; S0 [H,Dk,Dv]
};

GdnCase random_gdn(int64_t T, bool per_key, uint32_t seed) {
  GdnCase c;
  c.T = T;
  c.per_key = per_key;
  std::mt19937 gen(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  auto fill = [&](std::vector<float>& x, int64_t k, float lo, float hi, bool normal) {
    x.resize(static_cast<size_t>(k));
    for (float& e : x) e = normal ? n(gen) : lo + (hi - lo) * u(gen);
  };
  fill(c.q, T * c.H * c.Dk, 0, 0, true);
  fill(c.k, T * c.H * c.Dk, 0, 0, true);
  fill(c.v, T * c.H * c.Dv, 0, 0, true);
  fill(c.g, T * c.H * (per_key ? c.Dk : 1), -0.8f, -0.01f, false);
  fill(c.beta, T * c.H, 0.1f, 1.9f, false);  // OLMo's 2 sigmoid(b) reaches past 1
  fill(c.S0, c.H * c.Dk * c.Dv, 0, 0, true);
  return c;
}

detail::GatedDeltaArgs gdn_args(GdnCase& c) {
  detail::GatedDeltaArgs a;
  a.B = 1; a.T = c.T; a.H = c.H; a.Dk = c.Dk; a.Dv = c.Dv;
  a.q = c.q.data(); a.k = c.k.data(); a.v = c.v.data(); a.g = c.g.data(); a.beta = c.beta.data();
  a.g_per_key = c.per_key;
  a.chunk = 4;
  return a;
}

std::vector<double> unit(const float* x, int64_t n, double scale) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  std::vector<double> o(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) o[static_cast<size_t>(i)] = x[i] * scale / std::sqrt(ss + 1e-6);
  return o;
}

// M[h,t,s] by the delta rule itself in double: token s's key column w = beta_s k_s, carried by
// w <- (I - beta_r k_r k_r^T) (e^{g_r} o w) for r = s+1..t, read by q_t.
std::vector<double> delta_rule_mixing(const GdnCase& c) {
  const int64_t T = c.T, H = c.H, Dk = c.Dk, gn = c.per_key ? Dk : 1;
  const double scale = 1.0 / std::sqrt(static_cast<double>(static_cast<float>(Dk)));
  std::vector<double> M(static_cast<size_t>(H * T * T), 0.0);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t s = 0; s < T; ++s) {
      std::vector<double> w = unit(c.k.data() + (s * H + h) * Dk, Dk, 1.0);
      for (double& x : w) x *= c.beta[static_cast<size_t>(s * H + h)];
      for (int64_t t = s; t < T; ++t) {
        if (t > s) {
          const std::vector<double> kt = unit(c.k.data() + (t * H + h) * Dk, Dk, 1.0);
          double dot = 0;
          for (int64_t d = 0; d < Dk; ++d) {
            w[static_cast<size_t>(d)] *= std::exp(static_cast<double>(c.g[static_cast<size_t>((t * H + h) * gn + (c.per_key ? d : 0))]));
            dot += kt[static_cast<size_t>(d)] * w[static_cast<size_t>(d)];
          }
          for (int64_t d = 0; d < Dk; ++d) w[static_cast<size_t>(d)] -= c.beta[static_cast<size_t>(t * H + h)] * kt[static_cast<size_t>(d)] * dot;
        }
        const std::vector<double> qt = unit(c.q.data() + (t * H + h) * Dk, Dk, scale);
        double y = 0;
        for (int64_t d = 0; d < Dk; ++d) y += qt[static_cast<size_t>(d)] * w[static_cast<size_t>(d)];
        M[static_cast<size_t>((h * T + t) * T + s)] = y;
      }
    }
  return M;
}

}  // namespace

TEST(TokenMixing, DeltaRuleMatchesAFloat64RecurrenceAndBothKernels) {
  // Gated DeltaNet (one decay per head) and Kimi Delta Attention (per key channel), lengths
  // 1 .. 2 * chunk + 1 (chunk 4), from a start state: M against the delta rule run one source at a
  // time in double, o = M v + Sin^T S0 against the chunked and the recurrent kernel.
  for (bool per_key : {false, true})
    for (int64_t T = 1; T <= 9; ++T) {
      GdnCase c = random_gdn(T, per_key, static_cast<uint32_t>(200 + T + (per_key ? 50 : 0)));
      const int64_t H = c.H, Dk = c.Dk, Dv = c.Dv;
      const detail::GatedDeltaArgs a = gdn_args(c);
      std::vector<float> M(static_cast<size_t>(H * T * T)), Sin(static_cast<size_t>(H * T * Dk));
      detail::gated_delta_token_mixing(a, {0}, detail::MixBlock::whole(T, H), M.data(), Sin.data());
      const std::vector<double> ref = delta_rule_mixing(c);
      ASSERT_LE(rel(std::vector<double>(M.begin(), M.end()), ref), 1e-6) << "T=" << T << " per_key=" << per_key;
      std::vector<double> mix(static_cast<size_t>(T * H * Dv), 0.0);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t e = 0; e < Dv; ++e) {
            double acc = 0;
            for (int64_t s = 0; s < T; ++s) acc += M[static_cast<size_t>((h * T + t) * T + s)] * c.v[static_cast<size_t>((s * H + h) * Dv + e)];
            for (int64_t d = 0; d < Dk; ++d) acc += Sin[static_cast<size_t>((h * T + t) * Dk + d)] * c.S0[static_cast<size_t>((h * Dk + d) * Dv + e)];
            mix[static_cast<size_t>((t * H + h) * Dv + e)] = acc;
          }
      for (bool chunked : {true, false}) {
        std::vector<float> S(c.S0), o(static_cast<size_t>(T * H * Dv));
        detail::GatedDeltaArgs r = a;
        r.S = S.data();
        r.o = o.data();
        if (chunked) detail::gated_delta_chunked(r); else detail::gated_delta_recurrent(r);
        EXPECT_LE(rel(mix, std::vector<double>(o.begin(), o.end())), 1e-5) << "T=" << T << " chunked=" << chunked;
      }
    }
}

TEST(TokenMixing, DeltaRuleBlocksAndContributions) {
  const int64_t T = 9;
  for (bool per_key : {false, true}) {
    GdnCase c = random_gdn(T, per_key, per_key ? 31u : 30u);
    const int64_t H = c.H, Dk = c.Dk, Dv = c.Dv;
    detail::GatedDeltaArgs a = gdn_args(c);
    std::vector<float> M(static_cast<size_t>(H * T * T));
    detail::gated_delta_token_mixing(a, {0}, detail::MixBlock::whole(T, H), M.data(), nullptr);
    const detail::MixBlock blk{3, 8, 2, 7, 1, 2};
    std::vector<float> part(static_cast<size_t>(blk.rows() * blk.cols()));
    detail::gated_delta_token_mixing(a, {0}, blk, part.data(), nullptr);
    for (int64_t i = 0; i < blk.rows(); ++i)
      for (int64_t j = 0; j < blk.cols(); ++j)
        ASSERT_NEAR(part[static_cast<size_t>(i * blk.cols() + j)], M[static_cast<size_t>((1 * T + 3 + i) * T + 2 + j)], 1e-6f);
    // Contributions from a zero start sum to the kernel's per-token states.
    std::vector<float> S(c.S0.size(), 0.0f), o(static_cast<size_t>(T * H * Dv)), states(static_cast<size_t>(T * H * Dk * Dv));
    a.S = S.data(); a.o = o.data(); a.states = states.data();
    detail::gated_delta_chunked(a);
    for (int64_t t : {int64_t{0}, int64_t{5}, T - 1}) {
      std::vector<float> contrib(static_cast<size_t>(H * T * Dk * Dv));
      detail::gated_delta_state_contributions(a, {0}, t, {0, 0, 0, T, 0, H}, contrib.data());
      std::vector<double> sum(static_cast<size_t>(H * Dk * Dv), 0.0), want(sum.size());
      for (int64_t h = 0; h < H; ++h)
        for (int64_t s = 0; s < T; ++s)
          for (int64_t e = 0; e < Dk * Dv; ++e) sum[static_cast<size_t>(h * Dk * Dv + e)] += contrib[static_cast<size_t>((h * T + s) * Dk * Dv + e)];
      for (size_t e = 0; e < want.size(); ++e) want[e] = states[static_cast<size_t>(t * H * Dk * Dv) + e];
      EXPECT_LE(rel(sum, want), 1e-5) << "t=" << t << " per_key=" << per_key;
    }
  }
}

// ---- The per-channel kinds: Mamba-1, RG-LRU, the short conv, RWKV-4 ------------------------------

namespace {

std::vector<float> randn(std::mt19937& g, int64_t n, float lo = 0.0f, float hi = 0.0f) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& e : v) e = lo == hi ? nd(g) : ud(g);
  return v;
}

template <class F>
double rel_to(const std::vector<float>& got, int64_t n, F&& want) {
  std::vector<double> a(got.begin(), got.end()), b(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) b[static_cast<size_t>(i)] = want(i);
  return rel(a, b);
}

}  // namespace

TEST(TokenMixing, MambaOneMatchesAFloat64RecurrenceAndBothKernels) {
  // Per channel: M[e] against the selective scan run one source at a time in double; y = M u + Sin
  // S0 + D u against the token loop and the chunked scan (chunk 4) from a start state.
  const int64_t E = 3, N = 4;
  for (int64_t T = 1; T <= 9; ++T) {
    std::mt19937 g(static_cast<uint32_t>(300 + T));
    std::vector<float> u = randn(g, T * E), dt = randn(g, T * E, 0.05f, 0.8f), Bm = randn(g, T * N), C = randn(g, T * N);
    std::vector<float> A = randn(g, E * N, -1.5f, -0.1f), D = randn(g, E), S0 = randn(g, E * N), dec(static_cast<size_t>(T * E * N));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e)
        for (int64_t n = 0; n < N; ++n) dec[static_cast<size_t>((t * E + e) * N + n)] = A[static_cast<size_t>(e * N + n)] * dt[static_cast<size_t>(t * E + e)];
    detail::SelectiveMixArgs ma;
    ma.B = 1; ma.T = T; ma.E = E; ma.N = N; ma.u = u.data(); ma.dt = dt.data(); ma.Bm = Bm.data(); ma.C = C.data(); ma.decay = dec.data();
    ma.chunk = 4;  // blocks of 4: the factored path across blocks is covered from T = 5
    std::vector<float> M(static_cast<size_t>(E * T * T)), Sin(static_cast<size_t>(E * T * N));
    detail::mamba_token_mixing(ma, {0}, detail::MixBlock::whole(T, E), M.data(), Sin.data());
    if (T >= 7) {  // a block is the slice, whatever block boundaries it cuts
      const detail::MixBlock blk{3, 7, 1, 6, 1, 3};
      std::vector<float> part(static_cast<size_t>(blk.heads() * blk.rows() * blk.cols()));
      detail::mamba_token_mixing(ma, {0}, blk, part.data(), nullptr);
      for (int64_t h = 0; h < blk.heads(); ++h)
        for (int64_t i = 0; i < blk.rows(); ++i)
          for (int64_t j = 0; j < blk.cols(); ++j)
            ASSERT_EQ(part[static_cast<size_t>((h * blk.rows() + i) * blk.cols() + j)], M[static_cast<size_t>(((blk.h0 + h) * T + blk.r0 + i) * T + blk.c0 + j)]);
    }
    // The recurrence with only source s writing (u_s = 1), read at every t.
    std::vector<double> ref(M.size(), 0.0);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t s = 0; s < T; ++s) {
        std::vector<double> S(static_cast<size_t>(N), 0.0);
        for (int64_t t = 0; t < T; ++t) {
          double y = 0;
          for (int64_t n = 0; n < N; ++n) {
            double& x = S[static_cast<size_t>(n)];
            x = x * std::exp(static_cast<double>(dec[static_cast<size_t>((t * E + e) * N + n)])) + (t == s ? dt[static_cast<size_t>(t * E + e)] * static_cast<double>(Bm[static_cast<size_t>(t * N + n)]) : 0.0);
            y += x * C[static_cast<size_t>(t * N + n)];
          }
          ref[static_cast<size_t>((e * T + t) * T + s)] = y;
        }
      }
    ASSERT_LE(rel(std::vector<double>(M.begin(), M.end()), ref), 1e-6) << "T=" << T;
    for (bool chunked : {true, false}) {
      std::vector<float> S(S0), y(static_cast<size_t>(T * E));
      detail::SelectiveScanArgs a;
      a.T = T; a.E = E; a.N = N; a.u = u.data(); a.dt = dt.data(); a.B = Bm.data(); a.C = C.data(); a.A = A.data(); a.D = D.data();
      a.S = S.data(); a.y = y.data(); a.chunk = 4;
      if (chunked) detail::selective_scan_chunked(a); else detail::selective_scan_recurrent(a);
      const double err = rel_to(y, T * E, [&](int64_t i) {
        const int64_t t = i / E, e = i % E;
        double acc = D[static_cast<size_t>(e)] * static_cast<double>(u[static_cast<size_t>(i)]);
        for (int64_t s = 0; s < T; ++s) acc += M[static_cast<size_t>((e * T + t) * T + s)] * static_cast<double>(u[static_cast<size_t>(s * E + e)]);
        for (int64_t n = 0; n < N; ++n) acc += Sin[static_cast<size_t>((e * T + t) * N + n)] * static_cast<double>(S0[static_cast<size_t>(e * N + n)]);
        return acc;
      });
      EXPECT_LE(err, 1e-5) << "T=" << T << " chunked=" << chunked;
    }
    // From a zero start the contributions sum to the state after t (the token loop's states).
    std::vector<float> S(static_cast<size_t>(E * N), 0.0f), y(static_cast<size_t>(T * E)), states(static_cast<size_t>(T * E * N));
    detail::SelectiveScanArgs a;
    a.T = T; a.E = E; a.N = N; a.u = u.data(); a.dt = dt.data(); a.B = Bm.data(); a.C = C.data(); a.A = A.data(); a.D = D.data();
    a.S = S.data(); a.y = y.data(); a.states = states.data();
    detail::selective_scan_recurrent(a);
    const int64_t t = T / 2;
    std::vector<float> c(static_cast<size_t>(E * T * N));
    detail::mamba_state_contributions(ma, {0}, t, {0, 0, 0, T, 0, E}, c.data());
    std::vector<float> got(static_cast<size_t>(E * N), 0.0f);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t s = 0; s < T; ++s)
        for (int64_t n = 0; n < N; ++n) got[static_cast<size_t>(e * N + n)] += c[static_cast<size_t>((e * T + s) * N + n)];
    EXPECT_LE(rel_to(got, E * N, [&](int64_t i) { return states[static_cast<size_t>(t * E * N + i)]; }), 1e-5) << "T=" << T;
  }
}

TEST(TokenMixing, RgLruMatchesAFloat64Recurrence) {
  // h_t = a_t h_{t-1} + sqrt(1 - a_t^2) i_t u_t (a reset at position 0: a = 0, multiplier 1), in
  // double from a start h: M u + Sin h0, with and without a reset in the call; a block is a slice.
  const int64_t W = 3;
  for (bool reset : {true, false})
    for (int64_t T = 1; T <= 9; ++T) {
      std::mt19937 g(static_cast<uint32_t>(400 + T + (reset ? 50 : 0)));
      std::vector<float> u = randn(g, T * W), ig = randn(g, T * W, 0.05f, 0.95f), la = randn(g, T * W, -2.0f, -1e-4f), h0 = randn(g, W);
      std::vector<int64_t> pos(static_cast<size_t>(T));
      for (int64_t t = 0; t < T; ++t) pos[static_cast<size_t>(t)] = reset ? t : t + 5;
      detail::RgLruMixArgs ma;
      ma.B = 1; ma.T = T; ma.W = W; ma.u = u.data(); ma.ig = ig.data(); ma.la = la.data(); ma.pos = pos.data();
      std::vector<float> M(static_cast<size_t>(W * T * T)), Sin(static_cast<size_t>(W * T));
      detail::rg_lru_token_mixing(ma, {0}, detail::MixBlock::whole(T, W), M.data(), Sin.data());
      std::vector<double> y(static_cast<size_t>(T * W));
      for (int64_t c = 0; c < W; ++c) {
        double h = h0[static_cast<size_t>(c)];
        for (int64_t t = 0; t < T; ++t) {
          const double lg = la[static_cast<size_t>(t * W + c)];
          const bool r = pos[static_cast<size_t>(t)] == 0;
          h = (r ? 0.0 : std::exp(lg)) * h + (r ? 1.0 : std::sqrt(1.0 - std::exp(2.0 * lg))) * ig[static_cast<size_t>(t * W + c)] * u[static_cast<size_t>(t * W + c)];
          y[static_cast<size_t>(t * W + c)] = h;
        }
      }
      std::vector<float> mix(static_cast<size_t>(T * W));
      for (int64_t t = 0; t < T; ++t)
        for (int64_t c = 0; c < W; ++c) {
          double acc = Sin[static_cast<size_t>(c * T + t)] * static_cast<double>(h0[static_cast<size_t>(c)]);
          for (int64_t s = 0; s < T; ++s) acc += M[static_cast<size_t>((c * T + t) * T + s)] * static_cast<double>(u[static_cast<size_t>(s * W + c)]);
          mix[static_cast<size_t>(t * W + c)] = static_cast<float>(acc);
        }
      EXPECT_LE(rel_to(mix, T * W, [&](int64_t i) { return y[static_cast<size_t>(i)]; }), 1e-5) << "T=" << T << " reset=" << reset;
      if (T >= 5) {
        const detail::MixBlock blk{2, 5, 1, 4, 1, 2};
        std::vector<float> part(static_cast<size_t>(blk.rows() * blk.cols()));
        detail::rg_lru_token_mixing(ma, {0}, blk, part.data(), nullptr);
        for (int64_t i = 0; i < blk.rows(); ++i)
          for (int64_t j = 0; j < blk.cols(); ++j)
            ASSERT_EQ(part[static_cast<size_t>(i * blk.cols() + j)], M[static_cast<size_t>((1 * T + 2 + i) * T + 1 + j)]);
      }
    }
}

TEST(TokenMixing, ShortConvMatchesAFloat64ConvFromAWindow) {
  // y_t = C_t (sum_k w[k] u_{t-K+1+k}) with u = B x and the first K window values from a start
  // window (served [D, K], oldest first); M x + Sin . window against it in double.
  const int64_t D = 2, K = 3;
  for (int64_t T = 1; T <= 7; ++T) {
    std::mt19937 g(static_cast<uint32_t>(500 + T));
    std::vector<float> Bg = randn(g, T * D), Cg = randn(g, T * D), x = randn(g, T * D), w = randn(g, K * D), win = randn(g, D * K);
    detail::ShortConvMixArgs ma;
    ma.B = 1; ma.T = T; ma.D = D; ma.K = K; ma.Bg = Bg.data(); ma.Cg = Cg.data(); ma.x = x.data(); ma.conv_wT = w.data();
    std::vector<float> M(static_cast<size_t>(D * T * T)), Sin(static_cast<size_t>(D * T * K));
    detail::short_conv_token_mixing(ma, {0}, detail::MixBlock::whole(T, D), M.data(), Sin.data());
    std::vector<float> mix(static_cast<size_t>(T * D));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = 0; d < D; ++d) {
        double acc = 0;
        for (int64_t s = 0; s < T; ++s) acc += M[static_cast<size_t>((d * T + t) * T + s)] * static_cast<double>(x[static_cast<size_t>(s * D + d)]);
        for (int64_t j = 0; j < K; ++j) acc += Sin[static_cast<size_t>((d * T + t) * K + j)] * static_cast<double>(win[static_cast<size_t>(d * K + j)]);
        mix[static_cast<size_t>(t * D + d)] = static_cast<float>(acc);
      }
    const double err = rel_to(mix, T * D, [&](int64_t i) {
      const int64_t t = i / D, d = i % D;
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t p = t - K + 1 + k;  // position; < 0: the start window's column K + p
        const double uv = p >= 0 ? static_cast<double>(Bg[static_cast<size_t>(p * D + d)]) * x[static_cast<size_t>(p * D + d)] : win[static_cast<size_t>(d * K + K + p)];
        acc += w[static_cast<size_t>(k * D + d)] * uv;
      }
      return Cg[static_cast<size_t>(t * D + d)] * acc;
    });
    EXPECT_LE(err, 1e-6) << "T=" << T;
  }
}

TEST(TokenMixing, RwkvMatchesTheKernelFromAStateAndAFloat64Sum) {
  // wkv from a non-fresh (num, den, max) state with large keys (the max shift matters): M v + Sin
  // num_in against wkv_recurrent; contributions (num, den) from a fresh state against its states.
  const int64_t A = 3;
  for (int64_t T = 1; T <= 9; ++T) {
    std::mt19937 g(static_cast<uint32_t>(600 + T));
    std::vector<float> k = randn(g, T * A, -3.0f, 40.0f), v = randn(g, T * A), w = randn(g, T * A, -2.0f, -0.01f), u = randn(g, A);
    std::vector<float> st = {0.7f, -1.2f, 0.3f, 1.5f, 0.4f, 2.0f, 12.0f, -4.0f, 30.0f};  // num | den | max
    detail::RwkvMixArgs ma;
    ma.B = 1; ma.T = T; ma.A = A; ma.k = k.data(); ma.v = v.data(); ma.w = w.data(); ma.u = u.data(); ma.start = st.data(); ma.row_stride = 3 * A;
    std::vector<float> M(static_cast<size_t>(A * T * T)), Sin(static_cast<size_t>(A * T));
    detail::rwkv_token_mixing(ma, {0}, detail::MixBlock::whole(T, A), M.data(), Sin.data());
    std::vector<float> S(st), y(static_cast<size_t>(T * A));
    detail::wkv_recurrent(T, A, k.data(), v.data(), w.data(), u.data(), S.data(), y.data(), nullptr, 3 * A);
    std::vector<float> mix(static_cast<size_t>(T * A));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < A; ++c) {
        double acc = Sin[static_cast<size_t>(c * T + t)] * static_cast<double>(st[static_cast<size_t>(c)]);
        for (int64_t s = 0; s < T; ++s) acc += M[static_cast<size_t>((c * T + t) * T + s)] * static_cast<double>(v[static_cast<size_t>(s * A + c)]);
        mix[static_cast<size_t>(t * A + c)] = static_cast<float>(acc);
      }
    EXPECT_LE(rel_to(mix, T * A, [&](int64_t i) { return y[static_cast<size_t>(i)]; }), 1e-5) << "T=" << T;
    // The explicit float64 recurrence on the real (unshifted) num and den.
    std::vector<double> y64(static_cast<size_t>(T * A));
    for (int64_t c = 0; c < A; ++c) {
      const double mx = st[static_cast<size_t>(2 * A + c)];
      double num = st[static_cast<size_t>(c)] * std::exp(mx), den = st[static_cast<size_t>(A + c)] * std::exp(mx);
      for (int64_t t = 0; t < T; ++t) {
        const size_t r = static_cast<size_t>(t * A + c);
        const double bonus = std::exp(static_cast<double>(u[static_cast<size_t>(c)]) + k[r]);
        y64[r] = (num + bonus * v[r]) / (den + bonus);
        num = std::exp(static_cast<double>(w[r])) * num + std::exp(static_cast<double>(k[r])) * v[r];
        den = std::exp(static_cast<double>(w[r])) * den + std::exp(static_cast<double>(k[r]));
      }
    }
    EXPECT_LE(rel_to(mix, T * A, [&](int64_t i) { return y64[static_cast<size_t>(i)]; }), 1e-6) << "T=" << T;
    // A read's weights are a convex combination: its sources' plus the start state's (Sin den_in) sum to 1.
    for (int64_t c = 0; c < A; ++c)
      for (int64_t t = 0; t < T; ++t) {
        double sum = Sin[static_cast<size_t>(c * T + t)] * static_cast<double>(st[static_cast<size_t>(A + c)]);
        for (int64_t s = 0; s <= t; ++s) sum += M[static_cast<size_t>((c * T + t) * T + s)];
        EXPECT_NEAR(sum, 1.0, 1e-6) << "T=" << T << " t=" << t;
      }
    std::vector<float> fresh(static_cast<size_t>(3 * A), 0.0f), states(static_cast<size_t>(T * 3 * A));
    for (int64_t c = 0; c < A; ++c) fresh[static_cast<size_t>(2 * A + c)] = detail::kRwkvFreshMax;
    ma.start = fresh.data();
    std::vector<float> S2(fresh);
    detail::wkv_recurrent(T, A, k.data(), v.data(), w.data(), u.data(), S2.data(), y.data(), states.data(), 3 * A);
    const int64_t t = T - 1;
    std::vector<float> c(static_cast<size_t>(A * T * 2));
    detail::rwkv_state_contributions(ma, {0}, t, {0, 0, 0, T, 0, A}, c.data());
    std::vector<float> got(static_cast<size_t>(2 * A), 0.0f);
    for (int64_t ch = 0; ch < A; ++ch)
      for (int64_t s = 0; s < T; ++s)
        for (int64_t q = 0; q < 2; ++q) got[static_cast<size_t>(q * A + ch)] += c[static_cast<size_t>((ch * T + s) * 2 + q)];
    EXPECT_LE(rel_to(got, 2 * A, [&](int64_t i) { return states[static_cast<size_t>(t * 3 * A + i)]; }), 1e-5) << "T=" << T;
  }
}

TEST(TokenMixing, MlstmMatchesBothKernelsFromAStateAndSplitsTheMemory) {
  // h = M v + Sin C_in against the recurrent step and the chunkwise form (chunk 4, then the step for
  // the tail, as the mixer runs them) from a non-zero (C, n, m); large input gates so m matters; the
  // (C, n) contributions from a zero state sum to the recurrent step's states.
  detail::MlstmMixerDims d;
  d.D = 4; d.NH = 2; d.Dqk = 3; d.Dv = 2; d.chunk = 4; d.eps = 1e-6f;
  const int64_t NH = d.NH, QK = d.qk(), V = d.v(), n = d.row_numel();
  for (int64_t T = 1; T <= 9; ++T) {
    std::mt19937 g(static_cast<uint32_t>(700 + T));
    // q, k > 0: the read's q . n cannot cancel towards 0, where the float kernels' own rounding (divided
    // by eps) would dominate; the large input gates keep the stabiliser m in play.
    std::vector<float> q = randn(g, T * QK, 0.1f, 1.0f), k = randn(g, T * QK, 0.1f, 1.0f), v = randn(g, T * V), li = randn(g, T * NH, -3.0f, 25.0f);
    std::vector<float> lf = randn(g, T * NH, -1.5f, -0.01f), betas(li.size()), ig(li.size()), st = randn(g, n);
    for (size_t i = 0; i < li.size(); ++i) betas[i] = std::exp(li[i]), ig[i] = std::log(betas[i]);
    for (int64_t h = 0; h < NH; ++h) st[static_cast<size_t>(d.m_off() + h)] = 0.5f + static_cast<float>(h);
    detail::MlstmMixArgs ma;
    ma.d = d; ma.B = 1; ma.T = T; ma.q = q.data(); ma.k = k.data(); ma.v = v.data(); ma.betas = betas.data(); ma.lf = lf.data();
    ma.n_in = st.data() + d.n_off(); ma.m_in = st.data() + d.m_off(); ma.stride = n;
    std::vector<float> M(static_cast<size_t>(NH * T * T)), Sin(static_cast<size_t>(NH * T * d.Dqk));
    detail::mlstm_token_mixing(ma, {0}, detail::MixBlock::whole(T, NH), M.data(), Sin.data());
    std::vector<float> mix(static_cast<size_t>(T * V));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < NH; ++h)
        for (int64_t e = 0; e < d.Dv; ++e) {
          double acc = 0;
          for (int64_t s2 = 0; s2 < T; ++s2) acc += M[static_cast<size_t>((h * T + t) * T + s2)] * static_cast<double>(v[static_cast<size_t>(s2 * V + h * d.Dv + e)]);
          for (int64_t c = 0; c < d.Dqk; ++c)
            acc += Sin[static_cast<size_t>((h * T + t) * d.Dqk + c)] * static_cast<double>(st[static_cast<size_t>((h * d.Dqk + c) * d.Dv + e)]);
          mix[static_cast<size_t>(t * V + h * d.Dv + e)] = static_cast<float>(acc);
        }
    {  // The explicit float64 recurrence (the recurrent step's stabilised form, in double).
      std::vector<double> h64(static_cast<size_t>(T * V));
      const double scale = 1.0 / std::sqrt(static_cast<double>(d.Dqk));
      for (int64_t hd = 0; hd < NH; ++hd) {
        std::vector<double> C(st.begin() + hd * d.Dqk * d.Dv, st.begin() + (hd + 1) * d.Dqk * d.Dv);
        std::vector<double> nv(st.begin() + d.n_off() + hd * d.Dqk, st.begin() + d.n_off() + (hd + 1) * d.Dqk);
        double m = st[static_cast<size_t>(d.m_off() + hd)];
        for (int64_t t = 0; t < T; ++t) {
          const double fl = lf[static_cast<size_t>(t * NH + hd)], il = std::log(static_cast<double>(betas[static_cast<size_t>(t * NH + hd)]));
          const double mn = std::max(fl + m, il), fa = std::exp(fl + m - mn), ia = std::exp(il - mn);
          const float* kt = k.data() + t * QK + hd * d.Dqk;
          const float* vt = v.data() + t * V + hd * d.Dv;
          const float* qt = q.data() + t * QK + hd * d.Dqk;
          double qn = 0;
          for (int64_t a = 0; a < d.Dqk; ++a) {
            for (int64_t e = 0; e < d.Dv; ++e) C[static_cast<size_t>(a * d.Dv + e)] = fa * C[static_cast<size_t>(a * d.Dv + e)] + ia * kt[a] * vt[e];
            nv[static_cast<size_t>(a)] = fa * nv[static_cast<size_t>(a)] + ia * kt[a];
            qn += qt[a] * scale * nv[static_cast<size_t>(a)];
          }
          m = mn;
          const double den = std::max(std::fabs(qn), std::exp(-m)) + d.eps;
          for (int64_t e = 0; e < d.Dv; ++e) {
            double acc = 0;
            for (int64_t a = 0; a < d.Dqk; ++a) acc += qt[a] * scale * C[static_cast<size_t>(a * d.Dv + e)];
            h64[static_cast<size_t>(t * V + hd * d.Dv + e)] = acc / den;
          }
        }
      }
      EXPECT_LE(rel_to(mix, T * V, [&](int64_t i) { return h64[static_cast<size_t>(i)]; }), 1e-6) << "T=" << T;
    }
    for (bool chunked : {true, false}) {
      std::vector<float> S(st), h(static_cast<size_t>(T * V));
      int64_t t = 0;
      for (; chunked && t + d.chunk <= T; t += d.chunk)
        detail::mlstm_chunk(d, d.chunk, q.data() + t * QK, k.data() + t * QK, v.data() + t * V, ig.data() + t * NH, lf.data() + t * NH, S.data(), h.data() + t * V);
      if (t < T)
        detail::mlstm_recurrent(d, T - t, q.data() + t * QK, k.data() + t * QK, v.data() + t * V, ig.data() + t * NH, lf.data() + t * NH, S.data(), h.data() + t * V);
      EXPECT_LE(rel_to(mix, T * V, [&](int64_t i) { return h[static_cast<size_t>(i)]; }), 1e-5) << "T=" << T << " chunked=" << chunked;
    }
    std::vector<float> zero(static_cast<size_t>(n), 0.0f), S(zero), h(static_cast<size_t>(T * V)), states(static_cast<size_t>(T * n));
    detail::mlstm_recurrent(d, T, q.data(), k.data(), v.data(), ig.data(), lf.data(), S.data(), h.data(), states.data(), n);
    ma.n_in = zero.data() + d.n_off(); ma.m_in = zero.data() + d.m_off();
    const int64_t t = T - 1, per = d.Dqk * (d.Dv + 1);
    std::vector<float> c(static_cast<size_t>(NH * T * per));
    detail::mlstm_state_contributions(ma, {0}, t, {0, 0, 0, T, 0, NH}, c.data());
    std::vector<float> got(static_cast<size_t>(d.m_off()), 0.0f);  // C | n of every head, served order
    for (int64_t hd = 0; hd < NH; ++hd)
      for (int64_t s2 = 0; s2 < T; ++s2)
        for (int64_t a = 0; a < d.Dqk; ++a) {
          const float* o = c.data() + (hd * T + s2) * per + a * (d.Dv + 1);
          for (int64_t e = 0; e < d.Dv; ++e) got[static_cast<size_t>((hd * d.Dqk + a) * d.Dv + e)] += o[e];
          got[static_cast<size_t>(d.n_off() + hd * d.Dqk + a)] += o[d.Dv];
        }
    EXPECT_LE(rel_to(got, d.m_off(), [&](int64_t i) { return states[static_cast<size_t>(t * n + i)]; }), 1e-5) << "T=" << T;
  }
}
