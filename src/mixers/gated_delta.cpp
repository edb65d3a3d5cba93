#include "mixers/gated_delta.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "ops/ops.h"

namespace mixlens::detail {

namespace {

// x * rsqrt(sum(x^2) + 1e-6) * scale (transformers' l2norm; eps fixed, not the config's).
inline void l2norm_row(const float* x, int64_t n, float scale, float* out) {
  float ss = 0.0f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = scale / std::sqrt(ss + 1e-6f);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv;
}

// One token of the recurrence on S [Dk,Dv] with normalised q, k (model-math §3.3.5 order).
inline void step(float* S, const float* q, const float* k, const float* v, float g, float beta, int64_t Dk,
                 int64_t Dv, float* mem, float* o) {
  const float decay = std::exp(g);
  std::fill(mem, mem + Dv, 0.0f);
  for (int64_t d = 0; d < Dk; ++d) {
    float* Sd = S + d * Dv;
    const float kd = k[d];
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

}  // namespace

void gated_delta_recurrent(const GatedDeltaArgs& a) {
  const int64_t H = a.H, Dk = a.Dk, Dv = a.Dv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dk));
  ops::parallel_for(a.B * H, [&](int64_t bh) {
    const int64_t b = bh / H, h = bh % H;
    float* S = a.S + bh * Dk * Dv;
    std::vector<float> qn(static_cast<size_t>(Dk)), kn(static_cast<size_t>(Dk)), mem(static_cast<size_t>(Dv));
    const int64_t t_end = a.t_end < 0 ? a.T : a.t_end;
    for (int64_t t = a.t_begin; t < t_end; ++t) {
      const int64_t r = (b * a.T + t) * H + h;  // row of [B,T,H]
      l2norm_row(a.q + r * Dk, Dk, scale, qn.data());
      l2norm_row(a.k + r * Dk, Dk, 1.0f, kn.data());
      step(S, qn.data(), kn.data(), a.v + r * Dv, a.g[r], a.beta[r], Dk, Dv, mem.data(), a.o + r * Dv);
      if (a.states) std::memcpy(a.states + r * Dk * Dv, S, sizeof(float) * static_cast<size_t>(Dk * Dv));
    }
  });
}

void gated_delta_chunked(const GatedDeltaArgs& a) {
  const int64_t H = a.H, Dk = a.Dk, Dv = a.Dv, T = a.T;
  const int64_t C = a.chunk < 1 ? 1 : a.chunk;
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dk));
  ops::parallel_for(a.B * H, [&](int64_t bh) {
    const int64_t b = bh / H, h = bh % H;
    float* S = a.S + bh * Dk * Dv;
    auto buf = [](int64_t n) { return std::vector<float>(static_cast<size_t>(n)); };
    std::vector<float> qn = buf(C * Dk), kn = buf(C * Dk), kb = buf(C * Dk), vb = buf(C * Dv), gam = buf(C),
                       P = buf(C * C), Uf = buf(C * Dv), Wf = buf(C * Dk), tmp = buf(C * Dv), mem = buf(Dv), Sr;
    std::vector<double> U(static_cast<size_t>(C * Dv)), W(static_cast<size_t>(C * Dk));
    const int64_t t_end = a.t_end < 0 ? T : a.t_end;
    for (int64_t t0 = a.t_begin; t0 < t_end; t0 += C) {
      const int64_t L = std::min(C, t_end - t0);
      float run = 0.0f;
      for (int64_t i = 0; i < L; ++i) {
        const int64_t r = (b * T + t0 + i) * H + h;
        l2norm_row(a.q + r * Dk, Dk, scale, qn.data() + i * Dk);
        l2norm_row(a.k + r * Dk, Dk, 1.0f, kn.data() + i * Dk);
        const float be = a.beta[r];
        for (int64_t d = 0; d < Dk; ++d) kb[i * Dk + d] = kn[i * Dk + d] * be;
        for (int64_t e = 0; e < Dv; ++e) vb[i * Dv + e] = a.v[r * Dv + e] * be;
        run += a.g[r];
        gam[i] = run;  // inclusive cumulative log-decay within the chunk
      }
      // P = (Q K^T) * exp(Gi - Gj) on and below the diagonal (BLAS). Exponents of differences (never
      // of a lone cumsum) keep long chunks finite.
      ops::gemm(false, true, L, L, Dk, 1.0f, qn.data(), Dk, kn.data(), Dk, 0.0f, P.data(), C);
      for (int64_t i = 0; i < L; ++i)
        for (int64_t j = 0; j < L; ++j) P[i * C + j] *= j <= i ? std::exp(gam[i] - gam[j]) : 0.0f;
      // UT transform (I + A) U = Vb, (I + A) W = Kb exp(G), A[i,j] = (Kb_i . K_j) exp(Gi - Gj) for
      // j < i, by forward substitution in double: with many similar keys in a chunk (I + A) is
      // ill-conditioned, and float32 rounding here was the largest error against the reference.
      for (int64_t i = 0; i < L; ++i) {
        double* Ui = U.data() + i * Dv;
        double* Wi = W.data() + i * Dk;
        const double eg = std::exp(static_cast<double>(gam[i]));
        for (int64_t e = 0; e < Dv; ++e) Ui[e] = vb[i * Dv + e];
        for (int64_t d = 0; d < Dk; ++d) Wi[d] = kb[i * Dk + d] * eg;
        for (int64_t j = 0; j < i; ++j) {
          double dot = 0.0;
          for (int64_t d = 0; d < Dk; ++d) dot += static_cast<double>(kb[i * Dk + d]) * kn[j * Dk + d];
          const double c = dot * std::exp(static_cast<double>(gam[i]) - gam[j]);
          if (c == 0.0) continue;
          const double* Uj = U.data() + j * Dv;
          const double* Wj = W.data() + j * Dk;
          for (int64_t e = 0; e < Dv; ++e) Ui[e] -= c * Uj[e];
          for (int64_t d = 0; d < Dk; ++d) Wi[d] -= c * Wj[d];
        }
      }
      for (int64_t i = 0; i < L * Dv; ++i) Uf[i] = static_cast<float>(U[i]);
      for (int64_t i = 0; i < L * Dk; ++i) Wf[i] = static_cast<float>(W[i]);
      if (a.states) Sr.assign(S, S + Dk * Dv);  // chunk-entry state for the replay below
      // V_new = U - W S (in U);  O = (Q exp(G)) S + P V_new.
      ops::gemm(false, false, L, Dv, Dk, -1.0f, Wf.data(), Dk, S, Dv, 1.0f, Uf.data(), Dv);
      ops::gemm(false, false, L, Dv, Dk, 1.0f, qn.data(), Dk, S, Dv, 0.0f, tmp.data(), Dv);
      for (int64_t i = 0; i < L; ++i) {
        const float eg = std::exp(gam[i]);
        for (int64_t e = 0; e < Dv; ++e) tmp[i * Dv + e] *= eg;
      }
      ops::gemm(false, false, L, Dv, L, 1.0f, P.data(), C, Uf.data(), Dv, 1.0f, tmp.data(), Dv);
      for (int64_t i = 0; i < L; ++i)
        std::memcpy(a.o + ((b * T + t0 + i) * H + h) * Dv, tmp.data() + i * Dv, sizeof(float) * static_cast<size_t>(Dv));
      // S = exp(G_last) S + (K exp(G_last - G))^T V_new.
      const float last = gam[L - 1];
      for (int64_t i = 0; i < L; ++i) {
        const float e = std::exp(last - gam[i]);
        for (int64_t d = 0; d < Dk; ++d) Wf[i * Dk + d] = kn[i * Dk + d] * e;
      }
      ops::gemm(true, false, Dk, Dv, L, 1.0f, Wf.data(), Dk, Uf.data(), Dv, std::exp(last), S, Dv);
      if (a.states) {
        for (int64_t i = 0; i + 1 < L; ++i) {
          const int64_t r = (b * T + t0 + i) * H + h;
          step(Sr.data(), nullptr, kn.data() + i * Dk, a.v + r * Dv, a.g[r], a.beta[r], Dk, Dv, mem.data(), nullptr);
          std::memcpy(a.states + r * Dk * Dv, Sr.data(), sizeof(float) * static_cast<size_t>(Dk * Dv));
        }
        const int64_t r = (b * T + t0 + L - 1) * H + h;
        std::memcpy(a.states + r * Dk * Dv, S, sizeof(float) * static_cast<size_t>(Dk * Dv));
      }
    }
  });
}

}  // namespace mixlens::detail
