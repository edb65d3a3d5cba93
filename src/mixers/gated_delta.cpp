#include "mixers/gated_delta.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <cblas.h>

#include "mixers/ssm_kernels.h"
#include "ops/kernels.h"
#include "ops/ops.h"

namespace mixlens::detail {

namespace {

// x * rsqrt(sum(x^2) + 1e-6) * scale (transformers' l2norm; eps fixed, not the config's).
inline void l2norm_row(const float* x, int64_t n, float scale, float* out) {
  float ss = 0.0f;
  ops::kernels().matvec_f32(x, n, x, &ss, 1, n);  // sum of squares: x . x on the vector kernels
  // NaN when the sum of squares overflowed (ops::inv_rms: transformers' 0 would be silently wrong).
  const float inv = std::isinf(ss) ? std::numeric_limits<float>::quiet_NaN() : scale / std::sqrt(ss + 1e-6f);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv;
}

// One token of the recurrence on S [Dk,Dv] with normalised q, k (model-math §3.3.5 order); `dec`
// [Dk]: exp of each key row's decay (all equal but on Kimi Delta Attention).
inline void step(float* S, const float* q, const float* k, const float* v, const float* dec, float beta, int64_t Dk,
                 int64_t Dv, float* mem, float* o) {
  std::fill(mem, mem + Dv, 0.0f);
  for (int64_t d = 0; d < Dk; ++d) {
    float* Sd = S + d * Dv;
    const float kd = k[d], decay = dec[d];
    for (int64_t e = 0; e < Dv; ++e) {
      Sd[e] *= decay;
      mem[e] += Sd[e] * kd;
    }
  }
  for (int64_t e = 0; e < Dv; ++e) mem[e] = (v[e] - mem[e]) * beta;  // delta
  if (o) std::fill(o, o + Dv, 0.0f);
  for (int64_t d = 0; d < Dk; ++d) {
    float* Sd = S + d * Dv;
    const float kd = k[d];
    for (int64_t e = 0; e < Dv; ++e) Sd[e] += kd * mem[e];
    if (o) {
      const float qd = q[d];
      for (int64_t e = 0; e < Dv; ++e) o[e] += Sd[e] * qd;
    }
  }
}

// exp of the decays of tokens [t0, t0 + L) of row b, head h: [L], or [L,Dk] per key channel.
void token_decays(const GatedDeltaArgs& a, int64_t b, int64_t h, int64_t t0, int64_t L, float* out) {
  const int64_t gn = a.g_per_key ? a.Dk : 1;
  for (int64_t i = 0; i < L; ++i) {
    const float* g = a.g + ((b * a.T + t0 + i) * a.H + h) * gn;
    for (int64_t d = 0; d < gn; ++d) out[i * gn + d] = std::exp(g[d]);
  }
}

bool use_avx2() {
#if defined(__x86_64__)
  return ops::isa() != ops::Isa::scalar;
#else
  return false;
#endif
}

}  // namespace

void gated_delta_state_at(const GatedDeltaArgs& a, int64_t t, float* out) {
  const int64_t H = a.H, Dk = a.Dk, Dv = a.Dv, C = a.chunk < 1 ? 1 : a.chunk;
  const int64_t L = t - a.t_begin + 1;
  const bool avx2 = use_avx2();
  ops::parallel_for(a.B * H, [&](int64_t bh) {
    const int64_t b = bh / H, h = bh % H;
    std::vector<float> dec(static_cast<size_t>(L * (a.g_per_key ? Dk : 1)));
    token_decays(a, b, h, a.t_begin, L, dec.data());
    float* o = out + bh * Dk * Dv;
    std::memcpy(o, a.S + bh * Dk * Dv, sizeof(float) * static_cast<size_t>(Dk * Dv));
    states_replay(o, dec.data(), a.last_kn + bh * C * Dk, Dk, a.last_delta + bh * C * Dv, L, Dk, Dv, o, nullptr, 0, avx2,
                  a.g_per_key);
  });
}

void gated_delta_recurrent(const GatedDeltaArgs& a) {
  const int64_t H = a.H, Dk = a.Dk, Dv = a.Dv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dk));
  ops::parallel_for(a.B * H, [&](int64_t bh) {
    const int64_t b = bh / H, h = bh % H;
    float* S = a.S + bh * Dk * Dv;
    std::vector<float> qn(static_cast<size_t>(Dk)), kn(static_cast<size_t>(Dk)), mem(static_cast<size_t>(Dv)),
        dec(static_cast<size_t>(Dk));
    const int64_t t_end = a.t_end < 0 ? a.T : a.t_end;
    for (int64_t t = a.t_begin; t < t_end; ++t) {
      const int64_t r = (b * a.T + t) * H + h;  // row of [B,T,H]
      l2norm_row(a.q + r * Dk, Dk, scale, qn.data());
      l2norm_row(a.k + r * Dk, Dk, 1.0f, kn.data());
      token_decays(a, b, h, t, 1, dec.data());
      if (!a.g_per_key) std::fill(dec.begin() + 1, dec.end(), dec[0]);
      step(S, qn.data(), kn.data(), a.v + r * Dv, dec.data(), a.beta[r], Dk, Dv, mem.data(), a.o + r * Dv);
      if (a.states) std::memcpy(a.states + r * Dk * Dv, S, sizeof(float) * static_cast<size_t>(Dk * Dv));
    }
  });
}

void gated_delta_chunked(const GatedDeltaArgs& a) {
  const int64_t H = a.H, Dk = a.Dk, Dv = a.Dv, T = a.T;
  const int64_t C = a.chunk < 1 ? 1 : a.chunk;
  const int64_t R = Dv + Dk;  // right-hand sides of the UT solve: [Vb | Kb exp(G)]
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dk));
  const bool avx2 = use_avx2();
  ops::parallel_for(a.B * H, [&](int64_t bh) {
    const int64_t b = bh / H, h = bh % H;
    float* S = a.S + bh * Dk * Dv;
    auto buf = [](int64_t n) { return std::vector<float>(static_cast<size_t>(n)); };
    const bool pk = a.g_per_key;
    const int64_t gn = pk ? Dk : 1;  // decays per token
    std::vector<float> qn = buf(C * Dk), kn = buf(C * Dk), kb = buf(C * Dk), vb = buf(C * Dv), gam = buf(C * gn),
                       P = buf(C * C), Dm = buf(C * C), Uf = buf(C * Dv), Wf = buf(C * Dk), tmp = buf(C * Dv),
                       dec = buf(C * gn), E = buf(pk ? C * Dk : 0), qe = buf(pk ? C * Dk : 0);
    std::vector<double> Kd(static_cast<size_t>(C * Dk)), M(static_cast<size_t>(C * C)), Rd(static_cast<size_t>(C * R));
    const int64_t t_end = a.t_end < 0 ? T : a.t_end;
    const int64_t nch = (t_end - a.t_begin + C - 1) / C;
    for (int64_t t0 = a.t_begin; t0 < t_end; t0 += C) {
      const int64_t L = std::min(C, t_end - t0);
      if (a.chunk_entry)
        std::memcpy(a.chunk_entry + (bh * nch + (t0 - a.t_begin) / C) * Dk * Dv, S,
                    sizeof(float) * static_cast<size_t>(Dk * Dv));
      for (int64_t i = 0; i < L; ++i) {
        const int64_t r = (b * T + t0 + i) * H + h;
        l2norm_row(a.q + r * Dk, Dk, scale, qn.data() + i * Dk);
        l2norm_row(a.k + r * Dk, Dk, 1.0f, kn.data() + i * Dk);
        const float be = a.beta[r];
        for (int64_t d = 0; d < Dk; ++d) kb[i * Dk + d] = kn[i * Dk + d] * be;
        for (int64_t e = 0; e < Dv; ++e) vb[i * Dv + e] = a.v[r * Dv + e] * be;
        for (int64_t d = 0; d < gn; ++d)  // inclusive cumulative log-decay within the chunk
          gam[i * gn + d] = (i ? gam[(i - 1) * gn + d] : 0.0f) + a.g[r * gn + d];
      }
      if (pk) {
        // Per key channel the decay does not factor out of k_i . k_j: E[j] = k_j * exp(G_i - G_j)
        // (exponents of differences, finite on long chunks), then P[i,j] = q_i . E[j] for j <= i and
        // A[i,j] = k_i . E[j] for j < i (before beta_i, in double as the scalar path's dsyrk).
        for (int64_t i = 0; i < L; ++i) {
          const float* Gi = gam.data() + i * Dk;
          for (int64_t j = 0; j <= i; ++j)
            for (int64_t d = 0; d < Dk; ++d) E[j * Dk + d] = Gi[d] - gam[j * Dk + d];
          ops::exp(E.data(), E.data(), (i + 1) * Dk);
          for (int64_t j = 0; j <= i; ++j) {
            float* Ej = E.data() + j * Dk;
            const float* kj = kn.data() + j * Dk;
            float pij = 0.0f;
            double mij = 0.0;
            for (int64_t d = 0; d < Dk; ++d) {
              Ej[d] *= kj[d];
              pij += qn[i * Dk + d] * Ej[d];
              mij += static_cast<double>(kn[i * Dk + d]) * Ej[d];
            }
            P[i * C + j] = pij;
            M[static_cast<size_t>(i * C + j)] = mij;
          }
          std::fill(P.begin() + i * C + i + 1, P.begin() + i * C + L, 0.0f);
          for (int64_t d = 0; d < Dk; ++d) qe[i * Dk + d] = qn[i * Dk + d] * std::exp(Gi[d]);
        }
      } else {
        // Decay matrix Dm[i,j] = exp(Gi - Gj) on and below the diagonal, 0 above, one vectorized exp
        // per row. Exponents of differences (never of a lone cumsum) keep long chunks finite.
        for (int64_t i = 0; i < L; ++i) {
          float* row = Dm.data() + i * C;
          for (int64_t j = 0; j <= i; ++j) row[j] = gam[i] - gam[j];
          ops::exp(row, row, i + 1);
          std::fill(row + i + 1, row + L, 0.0f);
        }
        // P = (Q K^T) * Dm (BLAS).
        ops::gemm(false, true, L, L, Dk, 1.0f, qn.data(), Dk, kn.data(), Dk, 0.0f, P.data(), C);
        for (int64_t i = 0; i < L; ++i)
          for (int64_t j = 0; j < L; ++j) P[i * C + j] *= Dm[i * C + j];
        // K K^T is symmetric: one dsyrk makes its lower half (scaled by beta_i and Dm below).
        for (int64_t i = 0; i < L * Dk; ++i) Kd[static_cast<size_t>(i)] = kn[static_cast<size_t>(i)];
        cblas_dsyrk(CblasRowMajor, CblasLower, CblasNoTrans, static_cast<blasint>(L), static_cast<blasint>(Dk), 1.0,
                    Kd.data(), static_cast<blasint>(Dk), 0.0, M.data(), static_cast<blasint>(C));
      }
      // UT transform (I + A) [U | W] = [Vb | Kb exp(G)], A[i,j] = beta_i (K_i . K_j) exp(Gi - Gj) for
      // j < i, solved in double: with many similar keys in a chunk (I + A) is ill-conditioned, and
      // float32 rounding here was the largest error against the reference; one unit-lower dtrsm does
      // the forward substitution.
      for (int64_t i = 0; i < L; ++i) {
        const double be = a.beta[(b * T + t0 + i) * H + h];
        double* Mi = M.data() + i * C;
        for (int64_t j = 0; j < i; ++j) Mi[j] *= be * (pk ? 1.0 : static_cast<double>(Dm[i * C + j]));
        double* Ri = Rd.data() + i * R;
        for (int64_t e = 0; e < Dv; ++e) Ri[e] = vb[i * Dv + e];
        for (int64_t d = 0; d < Dk; ++d)
          Ri[Dv + d] = kb[i * Dk + d] * std::exp(static_cast<double>(gam[i * gn + (pk ? d : 0)]));
      }
      cblas_dtrsm(CblasRowMajor, CblasLeft, CblasLower, CblasNoTrans, CblasUnit, static_cast<blasint>(L),
                  static_cast<blasint>(R), 1.0, M.data(), static_cast<blasint>(C), Rd.data(), static_cast<blasint>(R));
      for (int64_t i = 0; i < L; ++i) {
        const double* Ri = Rd.data() + i * R;
        for (int64_t e = 0; e < Dv; ++e) Uf[i * Dv + e] = static_cast<float>(Ri[e]);
        for (int64_t d = 0; d < Dk; ++d) Wf[i * Dk + d] = static_cast<float>(Ri[Dv + d]);
      }
      // V_new = U - W S (in U);  O = (Q exp(G)) S + P V_new.
      ops::gemm(false, false, L, Dv, Dk, -1.0f, Wf.data(), Dk, S, Dv, 1.0f, Uf.data(), Dv);
      ops::gemm(false, false, L, Dv, Dk, 1.0f, pk ? qe.data() : qn.data(), Dk, S, Dv, 0.0f, tmp.data(), Dv);
      for (int64_t i = 0; i < L && !pk; ++i) {  // per key channel, exp(G) is already in qe
        const float eg = std::exp(gam[i]);
        for (int64_t e = 0; e < Dv; ++e) tmp[i * Dv + e] *= eg;
      }
      ops::gemm(false, false, L, Dv, L, 1.0f, P.data(), C, Uf.data(), Dv, 1.0f, tmp.data(), Dv);
      for (int64_t i = 0; i < L; ++i)
        std::memcpy(a.o + ((b * T + t0 + i) * H + h) * Dv, tmp.data() + i * Dv, sizeof(float) * static_cast<size_t>(Dv));
      // S_end by the token recurrence with the chunk's deltas (V_new, the rows of U above), not
      // exp(G_last) S + (K exp(G_last - G))^T V_new: the per-token states (one rank-1 update each) and
      // a per-token read (gated_delta_state_at) use the same arithmetic, so states[:, t],
      // state_after(t) and state_output are one number, and a token with beta = g = 0 keeps the state.
      const int64_t r0 = (b * T + t0) * H + h;  // row of the chunk's first token
      token_decays(a, b, h, t0, L, dec.data());
      states_replay(S, dec.data(), kn.data(), Dk, Uf.data(), L, Dk, Dv, S, a.states ? a.states + r0 * Dk * Dv : nullptr,
             H * Dk * Dv, avx2, pk);
      if (a.last_kn) {  // what gated_delta_state_at needs of this (the last) chunk
        std::memcpy(a.last_kn + bh * C * Dk, kn.data(), sizeof(float) * static_cast<size_t>(L * Dk));
        std::memcpy(a.last_delta + bh * C * Dv, Uf.data(), sizeof(float) * static_cast<size_t>(L * Dv));
      }
    }
  });
}

}  // namespace mixlens::detail
