// Backward of the Mamba-2 SSD scan (mixers/ssd.*), two forms with the same result (the chunked one
// serves; the recurrent one is the reference it is tested against):
// - recurrent: the reverse recurrence over tokens with the adjoint L_t = dL/dS_t,
//   L_t = dy_t C_t^T + exp(A dt_{t+1}) L_{t+1}; the forward states S_{t-1} it needs are recomputed
//   chunk by chunk from checkpoints kept every `chunk` tokens ((T/chunk + chunk) states per head).
// - chunked: the transpose of ssd_chunked's matmul form (intra-chunk L x L products and the
//   chunk-entering states, BLAS), with the adjoint passed between chunks only (T/chunk states).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "grad/ops_grad.h"
#include "ops/ops.h"

namespace mixlens::grad {

namespace {

// A group's heads share B and C: their per-head partials dBh / dCh [H,T,N] are summed into dB / dC.
void reduce_groups(const SsdGradArgs& a, const std::vector<float>& dBh, const std::vector<float>& dCh) {
  const int64_t T = a.T, H = a.H, G = a.G, N = a.N, hpg = H / G;
  std::fill(a.dB, a.dB + T * G * N, 0.0f);
  std::fill(a.dC, a.dC + T * G * N, 0.0f);
  for (int64_t h = 0; h < H; ++h) {
    const int64_t g = h / hpg;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < N; ++n) {
        a.dB[(t * G + g) * N + n] += dBh[(h * T + t) * N + n];
        a.dC[(t * G + g) * N + n] += dCh[(h * T + t) * N + n];
      }
  }
}

// Token t's log decay for head h: SsdGradArgs::da where given, else A dt (as the forward's log_decay).
inline float log_decay(const SsdGradArgs& a, int64_t t, int64_t h) {
  return a.da ? a.da[t * a.H + h] : a.A[h] * a.dt[t * a.H + h];
}

}  // namespace

void ssd_backward_recurrent(const SsdGradArgs& a) {
  const int64_t T = a.T, H = a.H, P = a.P, G = a.G, N = a.N, PN = P * N;
  const int64_t Q = std::max<int64_t>(1, a.chunk);
  const int64_t nchunks = (T + Q - 1) / Q;
  const int64_t hpg = H / G;
  // Per-head partial dB / dC (a group's heads share B and C), reduced after the parallel loop.
  std::vector<float> dBh(static_cast<size_t>(H * T * N), 0.0f), dCh(static_cast<size_t>(H * T * N), 0.0f);
  ops::parallel_for(H, [&](int64_t h) {
    const int64_t g = h / hpg;
    const float Dh = a.D[h];
    std::vector<float> ckpt(static_cast<size_t>(nchunks * PN)), S(static_cast<size_t>((Q + 1) * PN)),
        lam(static_cast<size_t>(PN), 0.0f), lb(static_cast<size_t>(P));
    // Forward: the state entering every chunk.
    std::vector<float> cur(a.S0 + h * PN, a.S0 + (h + 1) * PN);
    for (int64_t c = 0; c < nchunks; ++c) {
      std::copy(cur.begin(), cur.end(), ckpt.begin() + c * PN);
      for (int64_t t = c * Q; t < std::min(T, (c + 1) * Q); ++t) {
        const float dt = a.dt[t * H + h], e = std::exp(log_decay(a, t, h));
        const float* x = a.x + (t * H + h) * P;
        const float* Bv = a.B + (t * G + g) * N;
        for (int64_t p = 0; p < P; ++p)
          for (int64_t n = 0; n < N; ++n) cur[p * N + n] = cur[p * N + n] * e + (dt * Bv[n]) * x[p];
      }
    }
    for (int64_t c = nchunks - 1; c >= 0; --c) {
      const int64_t t0 = c * Q, L = std::min(Q, T - t0);
      // S[0] = state entering the chunk, S[l+1] = state after token t0+l.
      std::copy(ckpt.begin() + c * PN, ckpt.begin() + (c + 1) * PN, S.begin());
      for (int64_t l = 0; l < L; ++l) {
        const int64_t t = t0 + l;
        const float dt = a.dt[t * H + h], e = std::exp(log_decay(a, t, h));
        const float* x = a.x + (t * H + h) * P;
        const float* Bv = a.B + (t * G + g) * N;
        const float* prev = S.data() + l * PN;
        float* nx = S.data() + (l + 1) * PN;
        for (int64_t p = 0; p < P; ++p)
          for (int64_t n = 0; n < N; ++n) nx[p * N + n] = prev[p * N + n] * e + (dt * Bv[n]) * x[p];
      }
      for (int64_t l = L - 1; l >= 0; --l) {
        const int64_t t = t0 + l;
        const float dt = a.dt[t * H + h], e = std::exp(log_decay(a, t, h));
        const float* x = a.x + (t * H + h) * P;
        const float* Bv = a.B + (t * G + g) * N;
        const float* Cv = a.C + (t * G + g) * N;
        const float* dy = a.dy + (t * H + h) * P;
        const float* St = S.data() + (l + 1) * PN;
        const float* Sp = S.data() + l * PN;
        float* dC = dCh.data() + (h * T + t) * N;
        float* dB = dBh.data() + (h * T + t) * N;
        // y_t = S_t C_t + D x_t
        for (int64_t p = 0; p < P; ++p)
          for (int64_t n = 0; n < N; ++n) {
            lam[p * N + n] += dy[p] * Cv[n];
            dC[n] += St[p * N + n] * dy[p];
          }
        if (a.dstates) {
          float* o = a.dstates + (t * H + h) * N * P;
          for (int64_t p = 0; p < P; ++p)
            for (int64_t n = 0; n < N; ++n) o[n * P + p] = lam[p * N + n];
        }
        // S_t = e S_{t-1} + dt x B^T
        double ddt = 0.0, dde = 0.0;
        for (int64_t p = 0; p < P; ++p) {
          float s = 0.0f;
          for (int64_t n = 0; n < N; ++n) {
            s += lam[p * N + n] * Bv[n];
            dB[n] += dt * lam[p * N + n] * x[p];
            dde += static_cast<double>(lam[p * N + n]) * Sp[p * N + n];
          }
          lb[p] = s;
          ddt += static_cast<double>(s) * x[p];
          a.dx[(t * H + h) * P + p] = Dh * dy[p] + dt * s;
        }
        a.ddt[t * H + h] = static_cast<float>(ddt);
        a.ddA[t * H + h] = static_cast<float>(dde) * e;
        for (int64_t k = 0; k < PN; ++k) lam[k] *= e;
      }
    }
    std::copy(lam.begin(), lam.end(), a.dS0 + h * PN);
  });
  reduce_groups(a, dBh, dCh);
}

// Per chunk (tokens t0..t0+L-1, a_l = A dt_l (or da_l), acum_l = a_0 + .. + a_l, xdt_l = dt_l x_l, S_in the
// state entering the chunk, Lam the adjoint of the state leaving it from later tokens) the forward is
//   y_l = sum_{s<=l} M[l,s] xdt_s + exp(acum_l) S_in C_l + D x_l,   M = (C B^T) o Md,
//   S_out = exp(acum_last) S_in + sum_s exp(acum_last - acum_s) xdt_s B_s^T,
// with Md[l,s] = exp(acum_l - acum_s) for s <= l. Its transpose, with Gm = dY xdt^T and W = Gm o Md:
//   dC = W B + diag(exp(acum)) dY S_in,     dB = W^T C + diag(exp(acum_last - acum)) xdt Lam,
//   dxdt = M^T dY + diag(exp(acum_last - acum)) B Lam^T,
//   Lam_before = (diag(exp(acum)) dY)^T C + exp(acum_last) Lam,
// and d/d acum_l collects every exp() that acum_l enters; d/d a_k = sum_{l >= k} d/d acum_l.
void ssd_backward_chunked(const SsdGradArgs& a) {
  const int64_t T = a.T, H = a.H, P = a.P, G = a.G, N = a.N, PN = P * N;
  const int64_t Q = std::max<int64_t>(1, a.chunk);
  const int64_t nchunks = (T + Q - 1) / Q;
  const int64_t hpg = H / G, ldx = H * P, ldbc = G * N;
  // CB[g][c] = C_c B_c^T (Q x Q), shared by a group's heads (as ssd_chunked).
  std::vector<float> CB(static_cast<size_t>(G * nchunks * Q * Q), 0.0f);
  ops::parallel_for(G * nchunks, [&](int64_t gc) {
    const int64_t g = gc / nchunks, c = gc % nchunks;
    const int64_t t0 = c * Q, L = std::min(Q, T - t0);
    ops::gemm(false, true, L, L, N, 1.0f, a.C + t0 * ldbc + g * N, ldbc, a.B + t0 * ldbc + g * N, ldbc, 0.0f,
              CB.data() + gc * Q * Q, Q);
  });
  std::vector<float> dBh(static_cast<size_t>(H * T * N)), dCh(static_cast<size_t>(H * T * N));
  ops::parallel_for(H, [&](int64_t h) {
    const int64_t g = h / hpg;
    const float Dh = a.D[h];
    const auto sz = [](int64_t n) { return static_cast<size_t>(n); };
    std::vector<float> acum(sz(T)), Sin(sz(nchunks * PN)), lam(sz(PN), 0.0f), S(a.S0 + h * PN, a.S0 + (h + 1) * PN),
        Md(sz(Q * Q)), Gm(sz(Q * Q)), xdt(sz(Q * P)), tP(sz(Q * P)), dxdt(sz(Q * P)), tN(sz(Q * N)), segs(sz(Q)),
        el(sz(Q)), er(sz(Q));
    std::vector<double> dacum(sz(Q)), cols(sz(Q));
    const auto load_chunk = [&](int64_t t0, int64_t L) {
      for (int64_t l = 0; l < L; ++l) {
        const float dt = a.dt[(t0 + l) * H + h];
        const float* x = a.x + (t0 + l) * ldx + h * P;
        for (int64_t p = 0; p < P; ++p) xdt[sz(l * P + p)] = x[p] * dt;
      }
    };
    // Forward state passing: the state entering every chunk, and the in-chunk decay sums.
    for (int64_t c = 0; c < nchunks; ++c) {
      const int64_t t0 = c * Q, L = std::min(Q, T - t0);
      float run = 0.0f;
      for (int64_t l = 0; l < L; ++l) acum[sz(t0 + l)] = run += log_decay(a, t0 + l, h);
      std::copy(S.begin(), S.end(), Sin.begin() + c * PN);
      if (c == nchunks - 1) break;
      load_chunk(t0, L);
      const float last = acum[sz(t0 + L - 1)];
      for (int64_t l = 0; l < L; ++l) {
        const float e = std::exp(last - acum[sz(t0 + l)]);
        for (int64_t p = 0; p < P; ++p) tP[sz(l * P + p)] = xdt[sz(l * P + p)] * e;
      }
      ops::gemm(true, false, P, N, L, 1.0f, tP.data(), P, a.B + t0 * ldbc + g * N, ldbc, std::exp(last), S.data(), N);
    }
    for (int64_t c = nchunks - 1; c >= 0; --c) {
      const int64_t t0 = c * Q, L = std::min(Q, T - t0);
      const bool has_lam = c < nchunks - 1;  // the last chunk's state feeds nothing in this call
      const float* Bc = a.B + t0 * ldbc + g * N;
      const float* Cc = a.C + t0 * ldbc + g * N;
      const float* dyc = a.dy + t0 * ldx + h * P;
      const float* ac = acum.data() + t0;
      const float* S_in = Sin.data() + c * PN;
      float* dBc = dBh.data() + (h * T + t0) * N;
      float* dCc = dCh.data() + (h * T + t0) * N;
      load_chunk(t0, L);
      const float last = ac[L - 1];
      for (int64_t l = 0; l < L; ++l) {
        el[sz(l)] = std::exp(ac[l]);
        er[sz(l)] = std::exp(last - ac[l]);
      }
      // Md as ssd_chunked builds M: segment sums accumulated in increasing k, then exp.
      for (int64_t s = 0; s < L; ++s) {
        float seg = 0.0f;
        for (int64_t l = s + 1; l < L; ++l) segs[sz(l)] = seg += log_decay(a, t0 + l, h);
        ops::exp(segs.data() + s + 1, segs.data() + s + 1, L - s - 1);
        Md[sz(s * Q + s)] = 1.0f;
        for (int64_t l = s + 1; l < L; ++l) Md[sz(l * Q + s)] = segs[sz(l)];
      }
      // Gm[l,s] = dy_l . xdt_s; W = Gm o Md (into Gm), M = CB o Md (into Md); R = W o CB gives the
      // intra-chunk part of d/d acum: row sums (acum_l's +) minus column sums (acum_s's -).
      ops::gemm(false, true, L, L, P, 1.0f, dyc, ldx, xdt.data(), P, 0.0f, Gm.data(), Q);
      const float* cb = CB.data() + (g * nchunks + c) * Q * Q;
      std::fill(cols.begin(), cols.end(), 0.0);
      for (int64_t l = 0; l < L; ++l) {
        double row = 0.0;
        for (int64_t s = 0; s <= l; ++s) {
          const float w = Gm[sz(l * Q + s)] * Md[sz(l * Q + s)];
          const float r = w * cb[l * Q + s];
          Gm[sz(l * Q + s)] = w;
          Md[sz(l * Q + s)] *= cb[l * Q + s];
          row += r;
          cols[sz(s)] += r;
        }
        for (int64_t s = l + 1; s < L; ++s) Gm[sz(l * Q + s)] = Md[sz(l * Q + s)] = 0.0f;
        dacum[sz(l)] = row;
      }
      for (int64_t l = 0; l < L; ++l) dacum[sz(l)] -= cols[sz(l)];
      // dC = W B + diag(exp(acum)) dY S_in; the second term's d/d acum_l is exp(acum_l) C_l . (dY S_in)_l.
      ops::gemm(false, false, L, N, L, 1.0f, Gm.data(), Q, Bc, ldbc, 0.0f, dCc, N);
      ops::gemm(false, false, L, N, P, 1.0f, dyc, ldx, S_in, N, 0.0f, tN.data(), N);
      for (int64_t l = 0; l < L; ++l) {
        const float e = el[sz(l)];
        double dot = 0.0;
        for (int64_t n = 0; n < N; ++n) {
          const float v = tN[sz(l * N + n)];
          dot += static_cast<double>(v) * Cc[l * ldbc + n];
          dCc[l * N + n] += e * v;
        }
        dacum[sz(l)] += e * dot;
      }
      // dB = W^T C (+ the leaving state's term); dxdt = M^T dY (+ its term).
      ops::gemm(true, false, L, N, L, 1.0f, Gm.data(), Q, Cc, ldbc, 0.0f, dBc, N);
      ops::gemm(true, false, L, P, L, 1.0f, Md.data(), Q, dyc, ldx, 0.0f, dxdt.data(), P);
      if (has_lam) {
        ops::gemm(false, false, L, N, P, 1.0f, xdt.data(), P, lam.data(), N, 0.0f, tN.data(), N);
        double total = 0.0;
        for (int64_t s = 0; s < L; ++s) {
          const float e = er[sz(s)];
          double dot = 0.0;
          for (int64_t n = 0; n < N; ++n) {
            const float v = tN[sz(s * N + n)];
            dot += static_cast<double>(v) * Bc[s * ldbc + n];
            dBc[s * N + n] += e * v;
          }
          dacum[sz(s)] -= e * dot;
          total += e * dot;
        }
        double ls = 0.0;
        for (int64_t k = 0; k < PN; ++k) ls += static_cast<double>(lam[sz(k)]) * S_in[k];
        dacum[sz(L - 1)] += total + std::exp(static_cast<double>(last)) * ls;
        ops::gemm(false, true, L, P, N, 1.0f, Bc, ldbc, lam.data(), N, 0.0f, tP.data(), P);
        for (int64_t l = 0; l < L; ++l)
          for (int64_t p = 0; p < P; ++p) dxdt[sz(l * P + p)] += er[sz(l)] * tP[sz(l * P + p)];
      }
      if (a.dstates) {
        // dL/dS_l in the served layout [N,P]: lam_l = dy_l C_l^T + exp(a_{l+1}) lam_{l+1}, from Lam.
        float* next = nullptr;
        for (int64_t l = L - 1; l >= 0; --l) {
          float* o = a.dstates + ((t0 + l) * H + h) * N * P;
          const float* dy = dyc + l * ldx;
          const float* Cl = Cc + l * ldbc;
          if (next) {
            const float e = std::exp(log_decay(a, t0 + l + 1, h));
            for (int64_t n = 0; n < N; ++n)
              for (int64_t p = 0; p < P; ++p) o[n * P + p] = next[n * P + p] * e + dy[p] * Cl[n];
          } else {
            for (int64_t n = 0; n < N; ++n)
              for (int64_t p = 0; p < P; ++p) o[n * P + p] = lam[sz(p * N + n)] + dy[p] * Cl[n];
          }
          next = o;
        }
      }
      // dx = dt dxdt + D dy, d/d dt (write path) = x . dxdt, d/d a_k = sum_{l >= k} d/d acum_l.
      double run = 0.0;
      for (int64_t l = L - 1; l >= 0; --l) {
        const int64_t t = t0 + l;
        const float dt = a.dt[t * H + h];
        const float* x = a.x + t * ldx + h * P;
        const float* dy = dyc + l * ldx;
        float* dx = a.dx + t * ldx + h * P;
        double s = 0.0;
        for (int64_t p = 0; p < P; ++p) {
          s += static_cast<double>(x[p]) * dxdt[sz(l * P + p)];
          dx[p] = Dh * dy[p] + dt * dxdt[sz(l * P + p)];
        }
        a.ddt[t * H + h] = static_cast<float>(s);
        run += dacum[sz(l)];
        a.ddA[t * H + h] = static_cast<float>(run);
      }
      // Lam_before = (diag(exp(acum)) dY)^T C + exp(acum_last) Lam.
      for (int64_t l = 0; l < L; ++l)
        for (int64_t p = 0; p < P; ++p) tP[sz(l * P + p)] = el[sz(l)] * dyc[l * ldx + p];
      ops::gemm(true, false, P, N, L, 1.0f, tP.data(), P, Cc, ldbc, has_lam ? std::exp(last) : 0.0f, lam.data(), N);
    }
    std::copy(lam.begin(), lam.end(), a.dS0 + h * PN);
  });
  reduce_groups(a, dBh, dCh);
}

void ssd_backward(const SsdGradArgs& a) { ssd_backward_chunked(a); }

}  // namespace mixlens::grad
