// Backward of the Mamba-2 SSD scan (mixers/ssd.*): the reverse recurrence over tokens with the
// adjoint L_t = dL/dS_t,  L_t = dy_t C_t^T + exp(A dt_{t+1}) L_{t+1}. The forward states S_{t-1}
// it needs are recomputed chunk by chunk from checkpoints kept every `chunk` tokens, so memory is
// (T/chunk + chunk) states per head instead of T.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "grad/ops_grad.h"
#include "ops/ops.h"

namespace mixlens::grad {

void ssd_backward(const SsdGradArgs& a) {
  const int64_t T = a.T, H = a.H, P = a.P, G = a.G, N = a.N, PN = P * N;
  const int64_t Q = std::max<int64_t>(1, a.chunk);
  const int64_t nchunks = (T + Q - 1) / Q;
  const int64_t hpg = H / G;
  // Per-head partial dB / dC (a group's heads share B and C), reduced after the parallel loop.
  std::vector<float> dBh(static_cast<size_t>(H * T * N), 0.0f), dCh(static_cast<size_t>(H * T * N), 0.0f);
  ops::parallel_for(H, [&](int64_t h) {
    const int64_t g = h / hpg;
    const float A = a.A[h], Dh = a.D[h];
    std::vector<float> ckpt(static_cast<size_t>(nchunks * PN)), S(static_cast<size_t>((Q + 1) * PN)),
        lam(static_cast<size_t>(PN), 0.0f), lb(static_cast<size_t>(P));
    // Forward: the state entering every chunk.
    std::vector<float> cur(a.S0 + h * PN, a.S0 + (h + 1) * PN);
    for (int64_t c = 0; c < nchunks; ++c) {
      std::copy(cur.begin(), cur.end(), ckpt.begin() + c * PN);
      for (int64_t t = c * Q; t < std::min(T, (c + 1) * Q); ++t) {
        const float dt = a.dt[t * H + h], e = std::exp(A * dt);
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
        const float dt = a.dt[t * H + h], e = std::exp(A * dt);
        const float* x = a.x + (t * H + h) * P;
        const float* Bv = a.B + (t * G + g) * N;
        const float* prev = S.data() + l * PN;
        float* nx = S.data() + (l + 1) * PN;
        for (int64_t p = 0; p < P; ++p)
          for (int64_t n = 0; n < N; ++n) nx[p * N + n] = prev[p * N + n] * e + (dt * Bv[n]) * x[p];
      }
      for (int64_t l = L - 1; l >= 0; --l) {
        const int64_t t = t0 + l;
        const float dt = a.dt[t * H + h], e = std::exp(A * dt);
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

}  // namespace mixlens::grad
