// SSD's token-to-token mixing matrix and per-source state contributions (issue 26 item 1), from the
// inputs the scan itself reads (SsdBatch): the quadratic ("attention") form of state-space duality,
// Dao & Gu 2024 eq. (SSD: y = (L o C B^T) (dt x)), over any block of rows / columns / heads.
#include <algorithm>
#include <cmath>
#include <vector>

#include "mixers/ssd.h"
#include "ops/kernels.h"
#include "ops/ops.h"

namespace mixlens::detail {

namespace {

// Row b, head h: cum[t] = sum_{r=first..t} da_r for t >= first (double: long prompts subtract
// two large sums), 0 before. da as the kernel forms it (SsdBatch::da, else A dt in float).
std::vector<double> cum_decay(const SsdBatch& sb, int64_t b, int64_t h, int64_t first) {
  std::vector<double> cum(static_cast<size_t>(sb.T), 0.0);
  double acc = 0.0;
  for (int64_t t = first; t < sb.T; ++t) {
    const int64_t r = (b * sb.T + t) * sb.H + h;
    acc += sb.da ? sb.da[r] : static_cast<double>(sb.A[h] * sb.dt[r]);
    cum[static_cast<size_t>(t)] = acc;
  }
  return cum;
}

}  // namespace

void ssd_token_mixing(const SsdBatch& sb, const std::vector<int64_t>& first, const MixBlock& k, float* M, float* Sin) {
  const int64_t T = sb.T, H = sb.H, G = sb.G, N = sb.N, R = k.rows(), Cn = k.cols(), Hn = k.heads();
  const int64_t per_group = H / G;
  ops::parallel_for(sb.B * Hn, [&](int64_t bh) {
    const int64_t b = bh / Hn, h = k.h0 + bh % Hn, g = h / per_group;
    const int64_t f = std::min(first[static_cast<size_t>(b)], T);
    const std::vector<double> cum = cum_decay(sb, b, h, f);
    if (M) {
      float* out = M + bh * R * Cn;
      // C_t . B_s for the block, each one dot product in the matvec kernel's order: a block is
      // bitwise the slice of the whole matrix, whatever rows / columns were asked for.
      if (R > 0 && Cn > 0)
        ops::kernels().gemm_f32(sb.Bm + ((b * T + k.c0) * G + g) * N, G * N, sb.C + ((b * T + k.r0) * G + g) * N, G * N, R,
                                out, Cn, Cn, N);
      std::vector<float> e(static_cast<size_t>(Cn));
      for (int64_t i = 0; i < R; ++i) {
        const int64_t t = k.r0 + i;
        float* row = out + i * Cn;
        // Sources s in [lo, hi) mix into t: at or after the row's first real token, not after t.
        const int64_t lo = std::clamp(f, k.c0, k.c1), hi = std::clamp(t + 1, lo, k.c1);
        if (t < f || lo >= hi) {
          std::fill(row, row + Cn, 0.0f);
          continue;
        }
        for (int64_t s = lo; s < hi; ++s)
          e[static_cast<size_t>(s - lo)] = static_cast<float>(cum[static_cast<size_t>(t)] - cum[static_cast<size_t>(s)]);
        ops::exp(e.data(), e.data(), hi - lo);
        std::fill(row, row + (lo - k.c0), 0.0f);
        for (int64_t s = lo; s < hi; ++s) row[s - k.c0] *= e[static_cast<size_t>(s - lo)] * sb.dt[(b * T + s) * H + h];
        std::fill(row + (hi - k.c0), row + Cn, 0.0f);
      }
    }
    if (Sin) {
      float* out = Sin + bh * R * N;
      for (int64_t i = 0; i < R; ++i) {
        const int64_t t = k.r0 + i;
        const float* Ct = sb.C + ((b * T + t) * G + g) * N;
        const float w = t < f ? 0.0f : static_cast<float>(std::exp(cum[static_cast<size_t>(t)]));
        for (int64_t n = 0; n < N; ++n) out[i * N + n] = w * Ct[n];
      }
    }
  });
}

void ssd_state_contributions(const SsdBatch& sb, const std::vector<int64_t>& first, int64_t t, const MixBlock& k,
                             float* out) {
  const int64_t T = sb.T, H = sb.H, G = sb.G, N = sb.N, P = sb.P, Cn = k.cols(), Hn = k.heads();
  const int64_t per_group = H / G;
  ops::parallel_for(sb.B * Hn, [&](int64_t bh) {
    const int64_t b = bh / Hn, h = k.h0 + bh % Hn, g = h / per_group;
    const int64_t f = std::min(first[static_cast<size_t>(b)], T);
    const std::vector<double> cum = cum_decay(sb, b, h, f);
    for (int64_t j = 0; j < Cn; ++j) {
      const int64_t s = k.c0 + j;
      float* o = out + (bh * Cn + j) * N * P;
      if (s < f || s > t) {
        std::fill(o, o + N * P, 0.0f);
        continue;
      }
      const int64_t r = (b * T + s) * H + h;
      const float w = static_cast<float>(std::exp(cum[static_cast<size_t>(t)] - cum[static_cast<size_t>(s)])) * sb.dt[r];
      const float* Bs = sb.Bm + ((b * T + s) * G + g) * N;
      const float* xs = sb.x + r * P;
      for (int64_t n = 0; n < N; ++n) {
        const float wb = w * Bs[n];
        for (int64_t p = 0; p < P; ++p) o[n * P + p] = wb * xs[p];
      }
    }
  });
}

}  // namespace mixlens::detail
