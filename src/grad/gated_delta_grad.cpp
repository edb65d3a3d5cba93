// Backward of the gated delta rule (mixers/gated_delta.*, Qwen3.5 / Qwen3-Next linear_attn): the
// reverse recurrence of the adjoint Lam_t = dL/dS_t over tokens. Per token, with S' = exp(g) S_{t-1},
// u = v - S'^T k^, S_t = S' + k^ (beta u)^T, o = S_t^T q^:
//   Lam += q^ do^T;  dk^ = Lam (beta u) + S' dmem;  dmem = -beta Lam^T k^;  dv = beta Lam^T k^;
//   dbeta = (Lam^T k^) . u;  dS' = Lam + k^ dmem^T;  dg = <dS', S'>;  Lam_{t-1} = exp(g) dS'.
// The states S_{t-1} are recomputed chunk by chunk from checkpoints (memory T/chunk + chunk states).
// Kimi Delta Attention (g_per_key): exp(g) is diag(exp(g[0..Dk))), so dg[d] = <dS'[d], S'[d]> per key row
// and Lam_{t-1} = diag(exp(g)) dS' (the recurrence only; equal channels sum to the per-head dg). It serves the
// chunked route too, exactly: chunk_kimi_delta_attention is an exact regrouping of this recurrence (the same
// function of q, k, v, g, beta, S0), so its derivative is this one; the states replayed here start from the
// chunked forward's own chunk-entry states, and only the rounding inside a chunk differs (~1e-7 relative).
// The chunked form (gated_delta_backward_chunked, the default) differentiates the chunk's matrix form
// (the WY / UT representation transformers' torch_chunk_gated_delta_rule runs forward) with BLAS products.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <cblas.h>

#include "grad/ops_grad.h"
#include "mixlens/errors.h"
#include "ops/kernels.h"
#include "ops/ops.h"

namespace mixlens::grad {

void l2norm_backward(const float* x, const float* dy, float* dx, int64_t n, float scale) {
  // The two sums on the vector kernels in float32 (as the forward's l2norm_row): the double scalar
  // loops they replace were ~2% of the Qwen3.5 backward.
  const ops::KernelTable& kt = ops::kernels();
  float ss = 0.0f, dot = 0.0f;
  kt.matvec_f32(x, n, x, &ss, 1, n);
  kt.matvec_f32(x, n, dy, &dot, 1, n);
  // y = s x / r, r = sqrt(ss + eps): dx = (s / r) (dy - x (x . dy) / r^2).
  const float r2 = ss + 1e-6f, inv = scale / std::sqrt(r2), c = dot / r2;
  for (int64_t i = 0; i < n; ++i) dx[i] = inv * (dy[i] - x[i] * c);
}

namespace {

// As the forward's l2norm_row (float32, eps inside the sqrt).
inline void l2n(const float* x, int64_t n, float scale, float* out) {
  float ss = 0.0f;
  ops::kernels().matvec_f32(x, n, x, &ss, 1, n);  // x . x on the vector kernels, as l2norm_row
  const float inv = scale / std::sqrt(ss + 1e-6f);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv;
}

// a . b on the dispatched matvec kernel (a one-row product): a plain loop is a serial float sum
// the compiler may not reorder, so it ran scalar.
inline float dot_n(const ops::KernelTable& kt, const float* a, const float* b, int64_t n) {
  float s = 0.0f;
  kt.matvec_f32(a, n, b, &s, 1, n);
  return s;
}

}  // namespace

void gated_delta_backward_recurrent(const GatedDeltaGradArgs& a) {
  const int64_t T = a.T, H = a.H, Dk = a.Dk, Dv = a.Dv, SN = Dk * Dv;
  const int64_t Q = std::max<int64_t>(1, a.chunk);
  const int64_t nchunks = (T + Q - 1) / Q;
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dk));
  const ops::KernelTable& kt = ops::kernels();
  ops::parallel_for(a.B * H, [&](int64_t bh) {
    const int64_t b = bh / H, h = bh % H;
    auto row = [&](int64_t t) { return (b * T + t) * H + h; };  // row of [B,T,H]
    auto buf = [](int64_t n) { return std::vector<float>(static_cast<size_t>(n)); };
    std::vector<float> qn = buf(T * Dk), kn = buf(T * Dk), S = buf((Q + 1) * SN), U = buf(Q * Dv), lam(static_cast<size_t>(SN), 0.0f),
                       dqn = buf(Dk), dkn = buf(Dk), tmp = buf(Dk), w1 = buf(Dv), dd = buf(Dv), dmem = buf(Dv), rdec = buf(Dk),
                       dec = buf(Dk), ckpt;
    for (int64_t t = 0; t < T; ++t) {
      l2n(a.q + row(t) * Dk, Dk, scale, qn.data() + t * Dk);
      l2n(a.k + row(t) * Dk, Dk, 1.0f, kn.data() + t * Dk);
    }
    // S_t = decay S_{t-1} + k^ (beta u)^T with u = v - decay S_{t-1}^T k^ (u kept per token of the chunk).
    // Per key channel d the decay dec[d] (one value over every d unless g_per_key).
    auto decays = [&](int64_t t, float* out) {
      if (a.g_per_key) {
        for (int64_t d = 0; d < Dk; ++d) out[d] = std::exp(a.g[row(t) * Dk + d]);
      } else {
        std::fill(out, out + Dk, std::exp(a.g[row(t)]));
      }
    };
    auto replay = [&](const float* prev, float* next, int64_t t, float* u) {
      const float be = a.beta[row(t)];
      decays(t, rdec.data());
      const float* k = kn.data() + t * Dk;
      const float* v = a.v + row(t) * Dv;
      for (int64_t d = 0; d < Dk; ++d) tmp[d] = rdec[d] * k[d];  // S'^T k^ = S_{t-1}^T (dec k^)
      std::fill(u, u + Dv, 0.0f);
      kt.acc_rows(tmp.data(), prev, Dv, Dk, Dv, u);
      for (int64_t e = 0; e < Dv; ++e) u[e] = v[e] - u[e];
      for (int64_t d = 0; d < Dk; ++d) {
        const float kd = k[d], dc = rdec[d];
        const float* pr = prev + d * Dv;
        float* nx = next + d * Dv;
        for (int64_t e = 0; e < Dv; ++e) nx[e] = pr[e] * dc + kd * (be * u[e]);
      }
    };
    const float* entry = nullptr;  // chunk-entry states [nchunks, Dk, Dv]
    if (a.ckpt) {
      entry = a.ckpt + bh * nchunks * SN;
    } else {  // no checkpoints from the caller: one forward pass keeps them
      ckpt = buf(nchunks * SN);
      std::copy(a.S0 + bh * SN, a.S0 + (bh + 1) * SN, S.begin());
      for (int64_t c = 0; c < nchunks; ++c) {
        std::copy(S.begin(), S.begin() + SN, ckpt.begin() + c * SN);
        for (int64_t t = c * Q; t < std::min(T, (c + 1) * Q); ++t) {
          replay(S.data(), S.data() + SN, t, U.data());
          std::copy(S.begin() + SN, S.begin() + 2 * SN, S.begin());
        }
      }
      entry = ckpt.data();
    }
    for (int64_t c = nchunks - 1; c >= 0; --c) {
      const int64_t t0 = c * Q, L = std::min(Q, T - t0);
      // S[0] = state entering the chunk, S[l+1] = state after token t0+l.
      std::copy(entry + c * SN, entry + (c + 1) * SN, S.begin());
      for (int64_t l = 0; l < L; ++l) replay(S.data() + l * SN, S.data() + (l + 1) * SN, t0 + l, U.data() + l * Dv);
      for (int64_t l = L - 1; l >= 0; --l) {
        const int64_t t = t0 + l, r = row(t);
        const float* St = S.data() + (l + 1) * SN;
        const float* Sprev = S.data() + l * SN;
        const float* q = qn.data() + t * Dk;
        const float* k = kn.data() + t * Dk;
        const float* u = U.data() + l * Dv;
        const float* dout = a.dout + r * Dv;
        const float be = a.beta[r];
        decays(t, dec.data());
        // o = S_t^T q^: dq^ = S_t do, Lam += q^ do^T.
        kt.matvec_f32(St, Dv, dout, dqn.data(), Dk, Dv);
        for (int64_t d = 0; d < Dk; ++d) {
          float* ld = lam.data() + d * Dv;
          const float qd = q[d];
          for (int64_t e = 0; e < Dv; ++e) ld[e] += qd * dout[e];
        }
        if (a.dstates) std::copy(lam.begin(), lam.end(), a.dstates + r * SN);
        // S_t = S' + k^ (beta u)^T, S' = decay S_{t-1}, u = v - S'^T k^.
        std::fill(dd.begin(), dd.end(), 0.0f);
        kt.acc_rows(k, lam.data(), Dv, Dk, Dv, dd.data());  // Lam^T k^
        double dbeta = 0.0;
        for (int64_t e = 0; e < Dv; ++e) {
          a.dv[r * Dv + e] = be * dd[e];
          dbeta += static_cast<double>(dd[e]) * u[e];
          dmem[e] = -be * dd[e];
          w1[e] = be * u[e];
        }
        a.dbeta[r] = static_cast<float>(dbeta);
        // dk^ = Lam (beta u) + S' dmem;  dg[d] = <(Lam + k^ dmem^T)[d], S'[d]>
        //   = dec[d] (<Lam[d], S_{t-1}[d]> + k^[d] (S_{t-1} dmem)[d]) (per head: the sum over d).
        kt.matvec_f32(lam.data(), Dv, w1.data(), dkn.data(), Dk, Dv);
        kt.matvec_f32(Sprev, Dv, dmem.data(), tmp.data(), Dk, Dv);
        double dg = 0.0;
        for (int64_t d = 0; d < Dk; ++d) {
          dkn[d] += dec[d] * tmp[d];
          const double gd = dec[d] * (static_cast<double>(dot_n(kt, lam.data() + d * Dv, Sprev + d * Dv, Dv)) +
                                      static_cast<double>(k[d]) * tmp[d]);
          if (a.g_per_key) a.dg[r * Dk + d] = static_cast<float>(gd);
          dg += gd;
        }
        if (!a.g_per_key) a.dg[r] = static_cast<float>(dg);
        // Lam_{t-1} = diag(dec) (Lam + k^ dmem^T).
        for (int64_t d = 0; d < Dk; ++d) {
          float* ld = lam.data() + d * Dv;
          const float kd = k[d], dc = dec[d];
          for (int64_t e = 0; e < Dv; ++e) ld[e] = dc * (ld[e] + kd * dmem[e]);
        }
        l2norm_backward(a.q + r * Dk, dqn.data(), a.dq + r * Dk, Dk, scale);
        l2norm_backward(a.k + r * Dk, dkn.data(), a.dk + r * Dk, Dk, 1.0f);
      }
    }
    std::copy(lam.begin(), lam.end(), a.dS0 + bh * SN);
  });
}

namespace {

// Row-major [n, m] helpers for the chunk matrices.
inline void scale_rows(float* x, int64_t n, int64_t m, int64_t ld, const float* s) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < m; ++j) x[i * ld + j] *= s[i];
}
// Unit-lower triangular solves with L = I + A (A strictly lower, [n, n] at stride ld; its diagonal is
// not read), in place on X [n, m]: L X = X (trans false) or L^T X = X (trans true). BLAS: the
// row-by-row substitutions they replace ran scalar and were the chunked backward's largest loop.
inline void unit_lower_solve(bool trans, int64_t n, int64_t m, const float* A, int64_t ld, float* X) {
  cblas_strsm(CblasRowMajor, CblasLeft, CblasLower, trans ? CblasTrans : CblasNoTrans, CblasUnit,
              static_cast<blasint>(n), static_cast<blasint>(m), 1.0f, A, static_cast<blasint>(ld), X,
              static_cast<blasint>(m));
}

}  // namespace

// Per chunk of L tokens (0-based t, entry state S0, G_t = g_0 + ... + g_t, gam_t = exp(G_t),
// Gam_tj = exp(G_t - G_j), r_j = exp(G_{L-1} - G_j)), with u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k^_t):
//   (I + A) U = R,  A_tj = beta_t Gam_tj k^_t.k^_j (j < t),  R_t = beta_t (v_t - gam_t S0^T k^_t),
//   O = diag(gam) Q^ S0 + M U,  M_tj = Gam_tj q^_t.k^_j (j <= t),  S_L = gam_{L-1} S0 + K^T diag(r) U.
// Reverse: dU = M^T dO + diag(r) K Lam; dR = (I + A)^-T dU; dA = -dR U^T; the rest are products.
void gated_delta_backward_chunked(const GatedDeltaGradArgs& a) {
  if (a.g_per_key)
    throw UnsupportedError("gated_delta_backward_chunked: a per-key-channel decay (Kimi Delta Attention) is "
                           "differentiated by the token recurrence (gated_delta_backward_recurrent)");
  const int64_t T = a.T, H = a.H, Dk = a.Dk, Dv = a.Dv, SN = Dk * Dv;
  const int64_t Q = std::max<int64_t>(1, a.chunk);
  const int64_t nchunks = (T + Q - 1) / Q;
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dk));
  const int64_t ldv = H * Dv;  // row stride of v / dout / dv over tokens
  const ops::KernelTable& kt = ops::kernels();
  ops::parallel_for(a.B * H, [&](int64_t bh) {
    const int64_t b = bh / H, h = bh % H;
    auto row = [&](int64_t t) { return (b * T + t) * H + h; };  // row of [B,T,H]
    auto buf = [](int64_t n) { return std::vector<float>(static_cast<size_t>(n)); };
    std::vector<float> qn = buf(T * Dk), kn = buf(T * Dk);
    for (int64_t t = 0; t < T; ++t) {
      l2n(a.q + row(t) * Dk, Dk, scale, qn.data() + t * Dk);
      l2n(a.k + row(t) * Dk, Dk, 1.0f, kn.data() + t * Dk);
    }
    std::vector<float> G = buf(Q), gam = buf(Q), rr = buf(Q), be = buf(Q), Gm = buf(Q * Q), KK = buf(Q * Q),
                       QK = buf(Q * Q), A = buf(Q * Q), M = buf(Q * Q), dM = buf(Q * Q), dA = buf(Q * Q),
                       R = buf(Q * Dv), U = buf(Q * Dv), dU = buf(Q * Dv), dR = buf(Q * Dv), KL = buf(Q * Dv),
                       X = buf(Q * Dk), dQn = buf(Q * Dk), dKn = buf(Q * Dk), lam(static_cast<size_t>(SN), 0.0f),
                       dS = buf(SN), dG = buf(Q), dgam = buf(Q), dr = buf(Q), dbe = buf(Q), ckpt;
    // The chunk's forward quantities (G, gam, r, beta, Gam, KK, A, R, U) from its entry state S0.
    auto chunk_forward = [&](int64_t t0, int64_t L, const float* S0) {
      const float* K = kn.data() + t0 * Dk;
      float acc = 0.0f;
      for (int64_t i = 0; i < L; ++i) {
        acc += a.g[row(t0 + i)];
        G[i] = acc;
        gam[i] = std::exp(acc);
        be[i] = a.beta[row(t0 + i)];
      }
      for (int64_t i = 0; i < L; ++i) rr[i] = std::exp(G[L - 1] - G[i]);
      ops::gemm(false, true, L, L, Dk, 1.0f, K, Dk, K, Dk, 0.0f, KK.data(), Q);
      for (int64_t t = 0; t < L; ++t) {  // Gam: one vectorized exp per row
        float* gt = Gm.data() + t * Q;
        for (int64_t j = 0; j <= t; ++j) gt[j] = G[t] - G[j];
        ops::exp(gt, gt, t + 1);
        std::fill(gt + t + 1, gt + L, 0.0f);
        float* at = A.data() + t * Q;
        const float* kk = KK.data() + t * Q;
        for (int64_t j = 0; j < t; ++j) at[j] = be[t] * gt[j] * kk[j];
        std::fill(at + t, at + L, 0.0f);
      }
      // R = beta (v - gam K S0), then forward substitution (I + A) U = R.
      ops::gemm(false, false, L, Dv, Dk, 1.0f, K, Dk, S0, Dv, 0.0f, R.data(), Dv);
      for (int64_t t = 0; t < L; ++t) {
        const float* v = a.v + row(t0 + t) * Dv;
        float* rt = R.data() + t * Dv;
        for (int64_t e = 0; e < Dv; ++e) rt[e] = be[t] * (v[e] - gam[t] * rt[e]);
      }
      std::copy(R.data(), R.data() + L * Dv, U.data());
      unit_lower_solve(false, L, Dv, A.data(), Q, U.data());
    };
    const float* entry = nullptr;  // chunk-entry states [nchunks, Dk, Dv]
    if (a.ckpt) {
      entry = a.ckpt + bh * nchunks * SN;
    } else {  // S_L = gam_{L-1} S0 + K^T diag(r) U, chunk by chunk
      ckpt = buf(nchunks * SN);
      std::copy(a.S0 + bh * SN, a.S0 + (bh + 1) * SN, ckpt.begin());
      for (int64_t c = 0; c + 1 < nchunks; ++c) {
        const int64_t t0 = c * Q, L = std::min(Q, T - t0);
        const float* S0 = ckpt.data() + c * SN;
        chunk_forward(t0, L, S0);
        float* S1 = ckpt.data() + (c + 1) * SN;
        for (int64_t k = 0; k < SN; ++k) S1[k] = gam[L - 1] * S0[k];
        scale_rows(U.data(), L, Dv, Dv, rr.data());
        ops::gemm(true, false, Dk, Dv, L, 1.0f, kn.data() + t0 * Dk, Dk, U.data(), Dv, 1.0f, S1, Dv);
      }
      entry = ckpt.data();
    }
    for (int64_t ci = nchunks - 1; ci >= 0; --ci) {
      const int64_t t0 = ci * Q, L = std::min(Q, T - t0);
      const float* S0 = entry + ci * SN;
      const float* K = kn.data() + t0 * Dk;
      const float* Qh = qn.data() + t0 * Dk;
      const float* dO = a.dout + row(t0) * Dv;
      chunk_forward(t0, L, S0);
      ops::gemm(false, true, L, L, Dk, 1.0f, Qh, Dk, K, Dk, 0.0f, QK.data(), Q);
      for (int64_t t = 0; t < L; ++t)
        for (int64_t j = 0; j < L; ++j) M[t * Q + j] = Gm[t * Q + j] * QK[t * Q + j];
      std::fill(dG.begin(), dG.end(), 0.0f);
      // dU = M^T dO + diag(r) K Lam; dr_j = (K Lam)_j . u_j.
      ops::gemm(false, false, L, Dv, Dk, 1.0f, K, Dk, lam.data(), Dv, 0.0f, KL.data(), Dv);
      ops::gemm(true, false, L, Dv, L, 1.0f, M.data(), Q, dO, ldv, 0.0f, dU.data(), Dv);
      for (int64_t j = 0; j < L; ++j) {
        dr[j] = dot_n(kt, KL.data() + j * Dv, U.data() + j * Dv, Dv);
        for (int64_t e = 0; e < Dv; ++e) dU[j * Dv + e] += rr[j] * KL[j * Dv + e];
      }
      // dM = dO U^T (j <= t): dQ^ = (dM Gam) K, dK^ = (dM Gam)^T Q^, dGam = dM QK.
      ops::gemm(false, true, L, L, Dv, 1.0f, dO, ldv, U.data(), Dv, 0.0f, dM.data(), Q);
      for (int64_t t = 0; t < L; ++t)
        for (int64_t j = 0; j < L; ++j) {
          const float d = j <= t ? dM[t * Q + j] : 0.0f;
          dM[t * Q + j] = d * Gm[t * Q + j];  // now d(QK) over the causal part
          dA[t * Q + j] = d * QK[t * Q + j];  // dGam (from M) for now
        }
      ops::gemm(false, false, L, Dk, L, 1.0f, dM.data(), Q, K, Dk, 0.0f, dQn.data(), Dk);
      ops::gemm(true, false, L, Dk, L, 1.0f, dM.data(), Q, Qh, Dk, 0.0f, dKn.data(), Dk);
      // O's S0 term: dQ^ += gam dO S0^T, dgam = q^ . (S0 dO); dS0 = Q^T diag(gam) dO + gam_{L-1} Lam.
      ops::gemm(false, true, L, Dk, Dv, 1.0f, dO, ldv, S0, Dv, 0.0f, X.data(), Dk);
      for (int64_t t = 0; t < L; ++t) {
        dgam[t] = dot_n(kt, Qh + t * Dk, X.data() + t * Dk, Dk);
        for (int64_t d = 0; d < Dk; ++d) dQn[t * Dk + d] += gam[t] * X[t * Dk + d];
      }
      for (int64_t t = 0; t < L; ++t)  // KL is free now: gam dO
        for (int64_t e = 0; e < Dv; ++e) KL[t * Dv + e] = gam[t] * dO[t * ldv + e];
      ops::gemm(true, false, Dk, Dv, L, 1.0f, Qh, Dk, KL.data(), Dv, 0.0f, dS.data(), Dv);
      const float dlast = gam[L - 1] * dot_n(kt, S0, lam.data(), SN);  // d G_{L-1} through gam_{L-1} S0
      for (int64_t k = 0; k < SN; ++k) dS[k] += gam[L - 1] * lam[k];
      // S_L's K term: dK^ += diag(r) U Lam^T.
      ops::gemm(false, true, L, Dk, Dv, 1.0f, U.data(), Dv, lam.data(), Dv, 0.0f, X.data(), Dk);
      for (int64_t t = 0; t < L; ++t)
        for (int64_t d = 0; d < Dk; ++d) dKn[t * Dk + d] += rr[t] * X[t * Dk + d];
      // dR = (I + A)^-T dU (back substitution).
      std::copy(dU.data(), dU.data() + L * Dv, dR.data());
      unit_lower_solve(true, L, Dv, A.data(), Q, dR.data());
      // R_t = beta_t (v_t - gam_t S0^T k^_t): dv, dbeta, dgam, dK^, dS0 (X = dR S0^T = -dKb / ...).
      ops::gemm(false, true, L, Dk, Dv, 1.0f, dR.data(), Dv, S0, Dv, 0.0f, X.data(), Dk);
      for (int64_t t = 0; t < L; ++t) {
        const float* v = a.v + row(t0 + t) * Dv;
        const float* drt = dR.data() + t * Dv;
        float* dv = a.dv + row(t0 + t) * Dv;
        for (int64_t e = 0; e < Dv; ++e) dv[e] = be[t] * drt[e];
        const float c = dot_n(kt, X.data() + t * Dk, K + t * Dk, Dk);  // dR_t . (S0^T k^_t)
        dbe[t] = dot_n(kt, drt, v, Dv) - gam[t] * c;
        dgam[t] -= be[t] * c;
        for (int64_t d = 0; d < Dk; ++d) dKn[t * Dk + d] -= be[t] * gam[t] * X[t * Dk + d];
        float* bg = KL.data() + t * Dv;  // beta gam dR, for dS0
        for (int64_t e = 0; e < Dv; ++e) bg[e] = be[t] * gam[t] * drt[e];
      }
      ops::gemm(true, false, Dk, Dv, L, -1.0f, K, Dk, KL.data(), Dv, 1.0f, dS.data(), Dv);
      // dA = -dR U^T (j < t): dKK = dA Gam beta_t, dbeta_t += sum_j dA Gam KK, dGam += dA beta_t KK.
      ops::gemm(false, true, L, L, Dv, -1.0f, dR.data(), Dv, U.data(), Dv, 0.0f, dM.data(), Q);
      for (int64_t t = 0; t < L; ++t) {
        float sb = 0.0f;
        for (int64_t j = 0; j < L; ++j) {
          const float d = j < t ? dM[t * Q + j] : 0.0f;
          sb += d * Gm[t * Q + j] * KK[t * Q + j];
          dA[t * Q + j] += d * be[t] * KK[t * Q + j];
          dM[t * Q + j] = d * Gm[t * Q + j] * be[t];  // dKK
        }
        dbe[t] += sb;
      }
      ops::gemm(false, false, L, Dk, L, 1.0f, dM.data(), Q, K, Dk, 1.0f, dKn.data(), Dk);
      ops::gemm(true, false, L, Dk, L, 1.0f, dM.data(), Q, K, Dk, 1.0f, dKn.data(), Dk);
      // G: through Gam (dA holds dGam), gam and r; dg = reverse cumulative sum of dG.
      for (int64_t t = 0; t < L; ++t) {
        dG[t] += dgam[t] * gam[t] - dr[t] * rr[t];
        for (int64_t j = 0; j <= t; ++j) {
          const float w = dA[t * Q + j] * Gm[t * Q + j];
          dG[t] += w;
          dG[j] -= w;
        }
      }
      float sr = dlast;
      for (int64_t j = 0; j < L; ++j) sr += dr[j] * rr[j];
      dG[L - 1] += sr;
      float run = 0.0f;
      for (int64_t t = L - 1; t >= 0; --t) {
        run += dG[t];
        const int64_t r = row(t0 + t);
        a.dg[r] = run;
        a.dbeta[r] = dbe[t];
        l2norm_backward(a.q + r * Dk, dQn.data() + t * Dk, a.dq + r * Dk, Dk, scale);
        l2norm_backward(a.k + r * Dk, dKn.data() + t * Dk, a.dk + r * Dk, Dk, 1.0f);
      }
      lam.swap(dS);
    }
    std::copy(lam.begin(), lam.end(), a.dS0 + bh * SN);
  });
}

void gated_delta_backward(const GatedDeltaGradArgs& a) {
  // The per-token adjoints (dstates) are the recurrence's own quantities; a per-key-channel decay
  // (Kimi Delta Attention) is differentiated by the recurrence on both routes (exact: see the file comment).
  if (a.dstates || a.g_per_key) gated_delta_backward_recurrent(a);
  else gated_delta_backward_chunked(a);
}

}  // namespace mixlens::grad
