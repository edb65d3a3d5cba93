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
#include "ops/kernels.h"
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

}  // namespace

void gated_delta_backward(const GatedDeltaGradArgs& a) {
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
                       dqn = buf(Dk), dkn = buf(Dk), tmp = buf(Dk), w1 = buf(Dv), dd = buf(Dv), dmem = buf(Dv), ckpt;
    for (int64_t t = 0; t < T; ++t) {
      l2n(a.q + row(t) * Dk, Dk, scale, qn.data() + t * Dk);
      l2n(a.k + row(t) * Dk, Dk, 1.0f, kn.data() + t * Dk);
    }
    // S_t = decay S_{t-1} + k^ (beta u)^T with u = v - decay S_{t-1}^T k^ (u kept per token of the chunk).
    auto replay = [&](const float* prev, float* next, int64_t t, float* u) {
      const float decay = std::exp(a.g[row(t)]), be = a.beta[row(t)];
      const float* k = kn.data() + t * Dk;
      const float* v = a.v + row(t) * Dv;
      std::fill(u, u + Dv, 0.0f);
      kt.acc_rows(k, prev, Dv, Dk, Dv, u);
      for (int64_t e = 0; e < Dv; ++e) u[e] = v[e] - decay * u[e];
      for (int64_t d = 0; d < Dk; ++d) {
        const float kd = k[d];
        const float* pr = prev + d * Dv;
        float* nx = next + d * Dv;
        for (int64_t e = 0; e < Dv; ++e) nx[e] = pr[e] * decay + kd * (be * u[e]);
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
        const float be = a.beta[r], decay = std::exp(a.g[r]);
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
        // dk^ = Lam (beta u) + S' dmem;  dg = <Lam + k^ dmem^T, S'> = decay (<Lam, S_{t-1}> + k^ . S_{t-1} dmem).
        kt.matvec_f32(lam.data(), Dv, w1.data(), dkn.data(), Dk, Dv);
        kt.matvec_f32(Sprev, Dv, dmem.data(), tmp.data(), Dk, Dv);
        float ls = 0.0f;
        kt.matvec_f32(lam.data(), SN, Sprev, &ls, 1, SN);
        double dg = ls;
        for (int64_t d = 0; d < Dk; ++d) {
          dkn[d] += decay * tmp[d];
          dg += static_cast<double>(k[d]) * tmp[d];
        }
        a.dg[r] = static_cast<float>(dg * decay);
        // Lam_{t-1} = decay (Lam + k^ dmem^T).
        for (int64_t d = 0; d < Dk; ++d) {
          float* ld = lam.data() + d * Dv;
          const float kd = k[d];
          for (int64_t e = 0; e < Dv; ++e) ld[e] = decay * (ld[e] + kd * dmem[e]);
        }
        l2norm_backward(a.q + r * Dk, dqn.data(), a.dq + r * Dk, Dk, scale);
        l2norm_backward(a.k + r * Dk, dkn.data(), a.dk + r * Dk, Dk, 1.0f);
      }
    }
    std::copy(lam.begin(), lam.end(), a.dS0 + bh * SN);
  });
}

}  // namespace mixlens::grad
