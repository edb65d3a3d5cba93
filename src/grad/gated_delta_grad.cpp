// Backward of the gated delta rule (mixers/gated_delta.*, Qwen3.5 / Qwen3-Next linear_attn): the
// reverse recurrence of the adjoint Lam_t = dL/dS_t over tokens. Per token, with S' = exp(g) S_{t-1},
// u = v - S'^T k^, S_t = S' + k^ (beta u)^T, o = S_t^T q^:
//   Lam += q^ do^T;  dk^ = Lam (beta u) + S' dmem;  dmem = -beta Lam^T k^;  dv = beta Lam^T k^;
//   dbeta = (Lam^T k^) . u;  dS' = Lam + k^ dmem^T;  dg = <dS', S'>;  Lam_{t-1} = exp(g) dS'.
// The states S_{t-1} are recomputed chunk by chunk from checkpoints (memory T/chunk + chunk states).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "grad/ops_grad.h"
#include "ops/ops.h"

namespace mixlens::grad {

void l2norm_backward(const float* x, const float* dy, float* dx, int64_t n, float scale) {
  double ss = 0.0, dot = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    ss += static_cast<double>(x[i]) * x[i];
    dot += static_cast<double>(x[i]) * dy[i];
  }
  // y = s x / r, r = sqrt(ss + eps): dx = (s / r) (dy - x (x . dy) / r^2).
  const double r2 = ss + 1e-6, inv = 1.0 / std::sqrt(r2);
  for (int64_t i = 0; i < n; ++i) dx[i] = static_cast<float>(scale * inv * (dy[i] - x[i] * dot / r2));
}

namespace {

// As the forward's l2norm_row (float32, eps inside the sqrt).
inline void l2n(const float* x, int64_t n, float scale, float* out) {
  float ss = 0.0f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = scale / std::sqrt(ss + 1e-6f);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv;
}

// The forward step on S [Dk,Dv] in the forward's order (S *= decay; mem = S^T k; S += k (beta (v - mem))^T).
inline void fwd_step(const float* prev, float* next, const float* k, const float* v, float g, float beta, int64_t Dk,
                     int64_t Dv, float* mem) {
  const float decay = std::exp(g);
  std::fill(mem, mem + Dv, 0.0f);
  for (int64_t d = 0; d < Dk; ++d)
    for (int64_t e = 0; e < Dv; ++e) {
      next[d * Dv + e] = prev[d * Dv + e] * decay;
      mem[e] += next[d * Dv + e] * k[d];
    }
  for (int64_t e = 0; e < Dv; ++e) mem[e] = (v[e] - mem[e]) * beta;
  for (int64_t d = 0; d < Dk; ++d)
    for (int64_t e = 0; e < Dv; ++e) next[d * Dv + e] += k[d] * mem[e];
}

}  // namespace

void gated_delta_backward(const GatedDeltaGradArgs& a) {
  const int64_t T = a.T, H = a.H, Dk = a.Dk, Dv = a.Dv, SN = Dk * Dv;
  const int64_t Q = std::max<int64_t>(1, a.chunk);
  const int64_t nchunks = (T + Q - 1) / Q;
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dk));
  ops::parallel_for(a.B * H, [&](int64_t bh) {
    const int64_t b = bh / H, h = bh % H;
    auto row = [&](int64_t t) { return (b * T + t) * H + h; };  // row of [B,T,H]
    std::vector<float> qn(static_cast<size_t>(T * Dk)), kn(static_cast<size_t>(T * Dk));
    for (int64_t t = 0; t < T; ++t) {
      l2n(a.q + row(t) * Dk, Dk, scale, qn.data() + t * Dk);
      l2n(a.k + row(t) * Dk, Dk, 1.0f, kn.data() + t * Dk);
    }
    std::vector<float> ckpt(static_cast<size_t>(std::max<int64_t>(nchunks, 1) * SN)), S(static_cast<size_t>((Q + 1) * SN)),
        lam(static_cast<size_t>(SN), 0.0f), mem(static_cast<size_t>(Dv)), Sp(static_cast<size_t>(SN)),
        dqn(static_cast<size_t>(Dk)), dkn(static_cast<size_t>(Dk)), u(static_cast<size_t>(Dv)),
        dd(static_cast<size_t>(Dv)), tmp(static_cast<size_t>(SN));
    // Forward: the state entering every chunk.
    std::copy(a.S0 + bh * SN, a.S0 + (bh + 1) * SN, tmp.begin());
    for (int64_t c = 0; c < nchunks; ++c) {
      std::copy(tmp.begin(), tmp.end(), ckpt.begin() + c * SN);
      for (int64_t t = c * Q; t < std::min(T, (c + 1) * Q); ++t) {
        fwd_step(tmp.data(), S.data(), kn.data() + t * Dk, a.v + row(t) * Dv, a.g[row(t)], a.beta[row(t)], Dk, Dv,
                 mem.data());
        std::copy(S.begin(), S.begin() + SN, tmp.begin());
      }
    }
    for (int64_t c = nchunks - 1; c >= 0; --c) {
      const int64_t t0 = c * Q, L = std::min(Q, T - t0);
      // S[0] = state entering the chunk, S[l+1] = state after token t0+l.
      std::copy(ckpt.begin() + c * SN, ckpt.begin() + (c + 1) * SN, S.begin());
      for (int64_t l = 0; l < L; ++l) {
        const int64_t t = t0 + l;
        fwd_step(S.data() + l * SN, S.data() + (l + 1) * SN, kn.data() + t * Dk, a.v + row(t) * Dv, a.g[row(t)],
                 a.beta[row(t)], Dk, Dv, mem.data());
      }
      for (int64_t l = L - 1; l >= 0; --l) {
        const int64_t t = t0 + l, r = row(t);
        const float* St = S.data() + (l + 1) * SN;
        const float* Sprev = S.data() + l * SN;
        const float* q = qn.data() + t * Dk;
        const float* k = kn.data() + t * Dk;
        const float* v = a.v + r * Dv;
        const float* dout = a.dout + r * Dv;
        const float gt = a.g[r], be = a.beta[r], decay = std::exp(gt);
        // o = S_t^T q^
        for (int64_t d = 0; d < Dk; ++d) {
          float s = 0.0f;
          for (int64_t e = 0; e < Dv; ++e) {
            s += St[d * Dv + e] * dout[e];
            lam[d * Dv + e] += q[d] * dout[e];
          }
          dqn[d] = s;
        }
        if (a.dstates) std::copy(lam.begin(), lam.end(), a.dstates + r * SN);
        // S' = decay S_{t-1}; u = v - S'^T k^
        std::fill(mem.begin(), mem.end(), 0.0f);
        for (int64_t d = 0; d < Dk; ++d)
          for (int64_t e = 0; e < Dv; ++e) {
            Sp[d * Dv + e] = Sprev[d * Dv + e] * decay;
            mem[e] += Sp[d * Dv + e] * k[d];
          }
        for (int64_t e = 0; e < Dv; ++e) u[e] = v[e] - mem[e];
        // S_t = S' + k^ (beta u)^T: ddelta = Lam^T k^
        double dbeta = 0.0;
        for (int64_t e = 0; e < Dv; ++e) {
          float s = 0.0f;
          for (int64_t d = 0; d < Dk; ++d) s += lam[d * Dv + e] * k[d];
          dd[e] = s;
          a.dv[r * Dv + e] = be * s;
          dbeta += static_cast<double>(s) * u[e];
        }
        a.dbeta[r] = static_cast<float>(dbeta);
        // dk^ = Lam (beta u) + S' dmem with dmem = -beta ddelta; dS' = Lam + k^ dmem^T.
        double dg = 0.0;
        for (int64_t d = 0; d < Dk; ++d) {
          float s = 0.0f;
          for (int64_t e = 0; e < Dv; ++e) {
            const float dmem = -be * dd[e];
            s += lam[d * Dv + e] * (be * u[e]) + Sp[d * Dv + e] * dmem;
            const float dsp = lam[d * Dv + e] + k[d] * dmem;
            dg += static_cast<double>(dsp) * Sp[d * Dv + e];
            lam[d * Dv + e] = dsp * decay;
          }
          dkn[d] = s;
        }
        a.dg[r] = static_cast<float>(dg);
        l2norm_backward(a.q + r * Dk, dqn.data(), a.dq + r * Dk, Dk, scale);
        l2norm_backward(a.k + r * Dk, dkn.data(), a.dk + r * Dk, Dk, 1.0f);
      }
    }
    std::copy(lam.begin(), lam.end(), a.dS0 + bh * SN);
  });
}

}  // namespace mixlens::grad
