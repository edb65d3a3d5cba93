// Backward of the Mamba-1 selective scan (mixers/selective_scan.*): the reverse recurrence over tokens
// with the adjoint L_t = dL/dS_t (per channel e, state index n),
//   L_t = dy_t C_t + exp(A dt_{t+1}) L_{t+1}.
// The forward states S_{t-1} it needs are recomputed chunk by chunk from checkpoints kept every
// `chunk` tokens, so memory is (T/chunk + chunk) states per channel instead of T. One backward
// serves both forward kernels (they compute the same function up to rounding).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "grad/ops_grad.h"
#include "mixers/selective_scan.h"
#include "ops/ops.h"

namespace mixlens::grad {

namespace {
// Channels per parallel task; B and C are shared by all channels (of a group), so each task keeps
// its own partial dB / dC, reduced into its group's after the parallel loop.
constexpr int64_t kBlock = 16;
}  // namespace

void selective_scan_backward(const SelectiveScanGradArgs& a) {
  const int64_t T = a.T, E = a.E, N = a.N;
  const int64_t Q = std::max<int64_t>(1, a.chunk);
  const int64_t nchunks = (T + Q - 1) / Q;
  const int64_t blocks = detail::channel_blocks(a, kBlock), G = a.groups;
  std::vector<float> dBp(static_cast<size_t>(blocks * T * N), 0.0f), dCp(dBp.size(), 0.0f);
  ops::parallel_for(blocks, [&](int64_t blk) {
    int64_t e0 = 0, e1 = 0;
    detail::channel_block(a, kBlock, blk, e0, e1);
    const int64_t W = (e1 - e0) * N;
    float* dBb = dBp.data() + blk * T * N;
    float* dCb = dCp.data() + blk * T * N;
    // S[l] (l = 0..Q): the states of the chunk being differentiated; dA[l]: exp(A dt) of its tokens,
    // computed once with the forward's exp (fast_exp) and reused by the adjoint.
    std::vector<float> ckpt(static_cast<size_t>(nchunks * W)), S(static_cast<size_t>((Q + 1) * W)),
        dA(static_cast<size_t>(Q * W)), lam(static_cast<size_t>(W), 0.0f);
    // One token of the forward for the block: da = exp(A dt), nx = da prev + (dt B) u.
    auto step = [&](int64_t t, const float* prev, float* nx, float* da) {
      for (int64_t e = e0; e < e1; ++e) {
        const float dt = a.dt[t * E + e], u = a.u[t * E + e];
        const float* A = a.A + e * N;
        const float* Bv = detail::group_row(a.B, a, t, e0);
        const int64_t o = (e - e0) * N;
        for (int64_t n = 0; n < N; ++n) da[o + n] = detail::fast_exp(A[n] * dt);
        for (int64_t n = 0; n < N; ++n) nx[o + n] = da[o + n] * prev[o + n] + (dt * Bv[n]) * u;
      }
    };
    // Forward: the state entering every chunk.
    std::vector<float> cur(a.S0 + e0 * N, a.S0 + e1 * N), nxt(static_cast<size_t>(W));
    for (int64_t c = 0; c < nchunks; ++c) {
      std::copy(cur.begin(), cur.end(), ckpt.begin() + c * W);
      for (int64_t t = c * Q; t < std::min(T, (c + 1) * Q); ++t) {
        step(t, cur.data(), nxt.data(), dA.data());
        cur.swap(nxt);
      }
    }
    for (int64_t c = nchunks - 1; c >= 0; --c) {
      const int64_t t0 = c * Q, L = std::min(Q, T - t0);
      // S[0] = state entering the chunk, S[l+1] = state after token t0+l.
      std::copy(ckpt.begin() + c * W, ckpt.begin() + (c + 1) * W, S.begin());
      for (int64_t l = 0; l < L; ++l) step(t0 + l, S.data() + l * W, S.data() + (l + 1) * W, dA.data() + l * W);
      for (int64_t l = L - 1; l >= 0; --l) {
        const int64_t t = t0 + l;
        const float* Bv = detail::group_row(a.B, a, t, e0);
        const float* Cv = detail::group_row(a.C, a, t, e0);
        const float* St = S.data() + (l + 1) * W;
        const float* Sp = S.data() + l * W;
        const float* da = dA.data() + l * W;
        float* dBt = dBb + t * N;
        float* dCt = dCb + t * N;
        for (int64_t e = e0; e < e1; ++e) {
          const int64_t o = (e - e0) * N;
          const float dt = a.dt[t * E + e], u = a.u[t * E + e], dy = a.dy[t * E + e];
          const float* A = a.A + e * N;
          float* lm = lam.data() + o;
          // y_t = S_t . C_t + D u_t
          for (int64_t n = 0; n < N; ++n) {
            lm[n] += dy * Cv[n];
            dCt[n] += St[o + n] * dy;
          }
          if (a.dstates) std::memcpy(a.dstates + (t * E + e) * N, lm, sizeof(float) * static_cast<size_t>(N));
          // S_t = exp(A dt) S_{t-1} + (dt B) u; then L_{t-1} gets exp(A dt) L_t.
          float s = 0.0f, dtA = 0.0f;
          const float dtu = dt * u;
          float* ddA = a.ddA ? a.ddA + (t * E + e) * N : nullptr;
          for (int64_t n = 0; n < N; ++n) {
            const float g = lm[n] * Sp[o + n] * da[o + n];  // d/d(A dt)
            s += lm[n] * Bv[n];
            dBt[n] += lm[n] * dtu;
            dtA += A[n] * g;
            if (ddA) ddA[n] = g;
            lm[n] *= da[o + n];
          }
          a.du[t * E + e] = a.D[e] * dy + dt * s;
          a.ddt[t * E + e] = s * u;
          a.ddtA[t * E + e] = dtA;
        }
      }
    }
    std::copy(lam.begin(), lam.end(), a.dS0 + e0 * N);
  });
  std::fill(a.dB, a.dB + T * G * N, 0.0f);
  std::fill(a.dC, a.dC + T * G * N, 0.0f);
  for (int64_t blk = 0; blk < blocks; ++blk) {  // each block's partials into its group's rows
    int64_t e0 = 0, e1 = 0;
    detail::channel_block(a, kBlock, blk, e0, e1);
    const int64_t g = e0 * G / E;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < N; ++n) {
        const size_t k = static_cast<size_t>(blk * T * N + t * N + n);
        a.dB[(t * G + g) * N + n] += dBp[k];
        a.dC[(t * G + g) * N + n] += dCp[k];
      }
  }
}

}  // namespace mixlens::grad
