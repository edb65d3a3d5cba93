// The gated delta rule's exact token-to-token mixing and per-source state contributions (issue 26
// item 1), chunk by chunk in float64: inside a chunk the UT (WY) form the chunked kernel solves
// (gated_delta.cpp; Yang et al. 2024, "Gated Delta Networks"), between chunks each chunk's state
// transition matrix carrying the earlier tokens' surviving keys.
#include <algorithm>
#include <cmath>
#include <vector>

#include <cblas.h>

#include "mixers/gated_delta.h"
#include "ops/ops.h"

namespace mixlens::detail {

namespace {

// One chunk [t0, t0 + L) of row b, head h, in float64, with S_e the state entering it:
//   o_i = Qe_i^T S_e + sum_m Mi[i,m] v_m,   S_end = F S_e + sum_m Kn[:,m] v_m^T.
struct ChunkParts {
  int64_t L = 0;
  std::vector<double> Mi;  // [L,L] mixing inside the chunk (lower triangle)
  std::vector<double> Qe;  // [L,Dk] each token's query against the entry state
  std::vector<double> F;   // [Dk,Dk] entry state -> end state
  std::vector<double> Kn;  // [Dk,L] each token's key column in the end state
};

// x / sqrt(sum(x^2) + 1e-6) * scale: the kernels' l2norm (fp32 there; here in double).
void l2norm(const float* x, int64_t n, double scale, double* out) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const double inv = scale / std::sqrt(ss + 1e-6);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv;
}

ChunkParts chunk_parts(const GatedDeltaArgs& a, int64_t b, int64_t h, int64_t t0, int64_t L) {
  const int64_t Dk = a.Dk, H = a.H, gn = a.g_per_key ? Dk : 1;
  const double scale = 1.0 / std::sqrt(static_cast<double>(static_cast<float>(Dk)));
  std::vector<double> q(static_cast<size_t>(L * Dk)), k(q.size()), beta(static_cast<size_t>(L)), G(static_cast<size_t>(L * gn));
  for (int64_t i = 0; i < L; ++i) {
    const int64_t r = (b * a.T + t0 + i) * H + h;
    l2norm(a.q + r * Dk, Dk, scale, q.data() + i * Dk);
    l2norm(a.k + r * Dk, Dk, 1.0, k.data() + i * Dk);
    beta[static_cast<size_t>(i)] = a.beta[r];
    for (int64_t d = 0; d < gn; ++d)
      G[static_cast<size_t>(i * gn + d)] = (i ? G[static_cast<size_t>((i - 1) * gn + d)] : 0.0) + a.g[r * gn + d];
  }
  const auto at = [](std::vector<double>& v, int64_t i, int64_t j, int64_t ld) -> double& { return v[static_cast<size_t>(i * ld + j)]; };
  const auto Gd = [&](int64_t i, int64_t d) { return G[static_cast<size_t>(i * gn + (a.g_per_key ? d : 0))]; };
  // P[i,j] = q_i . (k_j o e^{G_i - G_j}) (j <= i), A[i,j] = beta_i k_i . (k_j o e^{G_i - G_j}) (j < i).
  // One decay per head: e^{G_i - G_j} factors out of the dot products (one exp per pair).
  std::vector<double> P(static_cast<size_t>(L * L), 0.0), A(P.size(), 0.0);
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = 0; j <= i; ++j) {
      const double e = a.g_per_key ? 1.0 : std::exp(Gd(i, 0) - Gd(j, 0));
      double p = 0.0, m = 0.0;
      for (int64_t d = 0; d < Dk; ++d) {
        const double kj = k[static_cast<size_t>(j * Dk + d)] * (a.g_per_key ? std::exp(Gd(i, d) - Gd(j, d)) : 1.0);
        p += q[static_cast<size_t>(i * Dk + d)] * kj;
        m += k[static_cast<size_t>(i * Dk + d)] * kj;
      }
      at(P, i, j, L) = p * e;
      if (j < i) at(A, i, j, L) = beta[static_cast<size_t>(i)] * m * e;
    }
  // Tm = (I + A)^-1, unit lower triangular (forward substitution).
  std::vector<double> Tm(static_cast<size_t>(L * L), 0.0);
  for (int64_t i = 0; i < L; ++i) {
    at(Tm, i, i, L) = 1.0;
    for (int64_t j = 0; j < i; ++j) {
      const double aij = at(A, i, j, L);
      if (aij != 0.0)
        for (int64_t m = 0; m <= j; ++m) at(Tm, i, m, L) -= aij * at(Tm, j, m, L);
    }
  }
  ChunkParts c;
  c.L = L;
  // Mi = P Tm diag(beta); W = Tm (beta k o e^G) [L,Dk]; Qe = q o e^G - P W.
  c.Mi.assign(static_cast<size_t>(L * L), 0.0);
  for (int64_t i = 0; i < L; ++i)
    for (int64_t m = 0; m <= i; ++m) {
      double s = 0.0;
      for (int64_t j = m; j <= i; ++j) s += at(P, i, j, L) * at(Tm, j, m, L);
      at(c.Mi, i, m, L) = s * beta[static_cast<size_t>(m)];
    }
  std::vector<double> keg(static_cast<size_t>(L * Dk)), W(static_cast<size_t>(L * Dk), 0.0);  // keg = k o e^G
  for (int64_t m = 0; m < L; ++m)
    for (int64_t d = 0; d < Dk; ++d) at(keg, m, d, Dk) = k[static_cast<size_t>(m * Dk + d)] * std::exp(Gd(m, d));
  for (int64_t j = 0; j < L; ++j)
    for (int64_t m = 0; m <= j; ++m) {
      const double w = at(Tm, j, m, L) * beta[static_cast<size_t>(m)];
      for (int64_t d = 0; d < Dk; ++d) at(W, j, d, Dk) += w * at(keg, m, d, Dk);
    }
  c.Qe.assign(static_cast<size_t>(L * Dk), 0.0);
  for (int64_t i = 0; i < L; ++i)
    for (int64_t d = 0; d < Dk; ++d) {
      double s = q[static_cast<size_t>(i * Dk + d)] * std::exp(Gd(i, d));
      for (int64_t j = 0; j <= i; ++j) s -= at(P, i, j, L) * at(W, j, d, Dk);
      at(c.Qe, i, d, Dk) = s;
    }
  // Kd[j] = k_j o e^{G_last - G_j}; F = diag(e^{G_last}) - Kd^T W; Kn = Kd^T Tm diag(beta).
  std::vector<double> Kd(static_cast<size_t>(L * Dk));
  for (int64_t j = 0; j < L; ++j)
    for (int64_t d = 0; d < Dk; ++d) at(Kd, j, d, Dk) = k[static_cast<size_t>(j * Dk + d)] * std::exp(Gd(L - 1, d) - Gd(j, d));
  c.F.assign(static_cast<size_t>(Dk * Dk), 0.0);
  for (int64_t d = 0; d < Dk; ++d) at(c.F, d, d, Dk) = std::exp(Gd(L - 1, d));
  cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<blasint>(Dk), static_cast<blasint>(Dk),
              static_cast<blasint>(L), -1.0, Kd.data(), static_cast<blasint>(Dk), W.data(), static_cast<blasint>(Dk), 1.0,
              c.F.data(), static_cast<blasint>(Dk));
  c.Kn.assign(static_cast<size_t>(Dk * L), 0.0);
  for (int64_t m = 0; m < L; ++m)
    for (int64_t j = m; j < L; ++j) {
      const double w = at(Tm, j, m, L) * beta[static_cast<size_t>(m)];
      for (int64_t d = 0; d < Dk; ++d) at(c.Kn, d, m, L) += at(Kd, j, d, Dk) * w;
    }
  return c;
}

// Y [Dk, n] <- F [Dk, Dk] Y (the surviving keys, or the start state's map, carried over a chunk).
void carry(const std::vector<double>& F, int64_t Dk, std::vector<double>& Y, int64_t n, std::vector<double>& tmp) {
  if (n == 0) return;
  tmp.resize(Y.size());
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<blasint>(Dk), static_cast<blasint>(n),
              static_cast<blasint>(Dk), 1.0, F.data(), static_cast<blasint>(Dk), Y.data(), static_cast<blasint>(n), 0.0,
              tmp.data(), static_cast<blasint>(n));
  Y.swap(tmp);
}

int64_t chunk_len(const GatedDeltaArgs& a) { return a.chunk < 1 ? 1 : a.chunk; }

}  // namespace

void gated_delta_token_mixing(const GatedDeltaArgs& a, const std::vector<int64_t>& first, const MixBlock& k, float* M,
                              float* Sin) {
  const int64_t T = a.T, Dk = a.Dk, R = k.rows(), Cn = k.cols(), Hn = k.heads(), C = chunk_len(a);
  ops::parallel_for(a.B * Hn, [&](int64_t bh) {
    const int64_t b = bh / Hn, h = k.h0 + bh % Hn;
    const int64_t f = std::min(first[static_cast<size_t>(b)], T);
    float* Mo = M ? M + bh * R * Cn : nullptr;
    float* So = Sin ? Sin + bh * R * Dk : nullptr;
    if (Mo) std::fill(Mo, Mo + R * Cn, 0.0f);
    if (So) std::fill(So, So + R * Dk, 0.0f);
    // Kc [Dk, Cn]: column s - c0 = token s's key in the state entering the current chunk (0 until s
    // is scanned); Phi [Dk, Dk]: the start state's map to it.
    std::vector<double> Kc(static_cast<size_t>(Dk * Cn), 0.0), Phi(static_cast<size_t>(Dk * Dk), 0.0), tmp, rowbuf;
    for (int64_t d = 0; d < Dk; ++d) Phi[static_cast<size_t>(d * Dk + d)] = 1.0;
    for (int64_t t0 = f; t0 < T && t0 < k.r1; t0 += C) {
      const int64_t L = std::min(C, T - t0);
      const ChunkParts c = chunk_parts(a, b, h, t0, L);
      const int64_t i0 = std::max(k.r0, t0) - t0, i1 = std::min(k.r1, t0 + L) - t0;
      if (i0 < i1) {
        if (Mo && std::min(t0, k.c1) > k.c0) {  // earlier chunks' sources: Qe . Kc
          const int64_t n = std::min(t0, k.c1) - k.c0;
          rowbuf.assign(static_cast<size_t>((i1 - i0) * Cn), 0.0);
          cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<blasint>(i1 - i0), static_cast<blasint>(n),
                      static_cast<blasint>(Dk), 1.0, c.Qe.data() + i0 * Dk, static_cast<blasint>(Dk), Kc.data(),
                      static_cast<blasint>(Cn), 0.0, rowbuf.data(), static_cast<blasint>(Cn));
          for (int64_t i = i0; i < i1; ++i)
            for (int64_t j = 0; j < n; ++j)
              Mo[(t0 + i - k.r0) * Cn + j] = static_cast<float>(rowbuf[static_cast<size_t>((i - i0) * Cn + j)]);
        }
        for (int64_t i = i0; i < i1 && Mo; ++i)  // this chunk's sources up to the token itself
          for (int64_t s = std::max(t0, k.c0); s < std::min(t0 + i + 1, k.c1); ++s)
            Mo[(t0 + i - k.r0) * Cn + s - k.c0] = static_cast<float>(c.Mi[static_cast<size_t>(i * L + s - t0)]);
        for (int64_t i = i0; i < i1 && So; ++i)  // Sin_t = Phi^T Qe_t
          for (int64_t e = 0; e < Dk; ++e) {
            double s = 0.0;
            for (int64_t d = 0; d < Dk; ++d) s += c.Qe[static_cast<size_t>(i * Dk + d)] * Phi[static_cast<size_t>(d * Dk + e)];
            So[(t0 + i - k.r0) * Dk + e] = static_cast<float>(s);
          }
      }
      if (Mo) {
        carry(c.F, Dk, Kc, Cn, tmp);
        for (int64_t s = std::max(t0, k.c0); s < std::min(t0 + L, k.c1); ++s)
          for (int64_t d = 0; d < Dk; ++d) Kc[static_cast<size_t>(d * Cn + s - k.c0)] = c.Kn[static_cast<size_t>(d * L + s - t0)];
      }
      if (So) carry(c.F, Dk, Phi, Dk, tmp);
    }
  });
}

void gated_delta_state_contributions(const GatedDeltaArgs& a, const std::vector<int64_t>& first, int64_t t,
                                     const MixBlock& k, float* out) {
  const int64_t T = a.T, Dk = a.Dk, Dv = a.Dv, H = a.H, Cn = k.cols(), Hn = k.heads(), C = chunk_len(a);
  ops::parallel_for(a.B * Hn, [&](int64_t bh) {
    const int64_t b = bh / Hn, h = k.h0 + bh % Hn;
    const int64_t f = std::min(first[static_cast<size_t>(b)], T);
    std::vector<double> Kc(static_cast<size_t>(Dk * Cn), 0.0), tmp;
    // Chunks of the grid up to t, the last one cut after t: its end state is the state after t.
    for (int64_t t0 = f; t0 <= t; t0 += C) {
      const int64_t L = std::min(C, t + 1 - t0);
      const ChunkParts c = chunk_parts(a, b, h, t0, L);
      carry(c.F, Dk, Kc, Cn, tmp);
      for (int64_t s = std::max(t0, k.c0); s < std::min(t0 + L, k.c1); ++s)
        for (int64_t d = 0; d < Dk; ++d) Kc[static_cast<size_t>(d * Cn + s - k.c0)] = c.Kn[static_cast<size_t>(d * L + s - t0)];
    }
    for (int64_t j = 0; j < Cn; ++j) {
      const int64_t s = k.c0 + j;
      float* o = out + (bh * Cn + j) * Dk * Dv;
      const bool live = s >= f && s <= t;
      const float* v = a.v + ((b * T + s) * H + h) * Dv;
      for (int64_t d = 0; d < Dk; ++d)
        for (int64_t e = 0; e < Dv; ++e)
          o[d * Dv + e] = live ? static_cast<float>(Kc[static_cast<size_t>(d * Cn + j)] * v[e]) : 0.0f;
    }
  });
}

}  // namespace mixlens::detail
