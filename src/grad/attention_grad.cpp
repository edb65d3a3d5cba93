// Backward of the softmax attention pieces (mixers/attention.h): the causal GQA attention core
// (detail::causal_attention / flash_causal_attention) and rotate-half RoPE (detail::apply_rope).
// The attention backward recomputes the softmax rows of a block of 64 queries from q and the cached
// keys (a 64 x (past + T) score matrix at a time, never [T, T]) and accumulates dk / dv of the call's
// new tokens with BLAS products; cached keys and values (positions < past) are constants of the call.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "grad/ops_grad.h"
#include "mixlens/errors.h"
#include "ops/kernels.h"
#include "ops/ops.h"

namespace mixlens::grad {

void causal_attention_backward(const float* q, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t d, int64_t past,
                               const detail::KvCache& kv, const std::vector<std::vector<uint8_t>>& key_mask,
                               const float* dout, float* dq, float* dk, float* dv, float scale_in, int64_t window) {
  if (Hkv <= 0 || H % Hkv != 0) throw InputError("causal_attention_backward: heads must be a multiple of kv heads");
  if (kv.len != past + T || static_cast<int64_t>(kv.k.size()) < B || static_cast<int64_t>(key_mask.size()) < B)
    throw InputError("causal_attention_backward: the KV cache must hold past + T tokens for every row (the call's "
                     "keys appended), got len " + std::to_string(kv.len) + " for past " + std::to_string(past) +
                     " + T " + std::to_string(T));
  const int64_t rep = H / Hkv, width = Hkv * d, ldq = H * d;
  const float scale = detail::attention_scale(d, scale_in);
  constexpr int64_t QB = 64;  // queries per block: the score matrices are QB x (past + T)
  std::fill(dk, dk + B * T * width, 0.0f);
  std::fill(dv, dv + B * T * width, 0.0f);
  // One job per (row, kv head): it owns that kv head's dk / dv (the rep query heads reading it are
  // summed inside the job), so no two jobs write the same element. Per block of queries, with
  // P = softmax(scale Q K^T) (causal, key mask) recomputed: dP = dO V^T, dS = P (dP - rowsum(P dP)),
  // dQ = scale dS K, dK += scale dS^T Q, dV += P^T dO (BLAS products; rows of cached keys dropped).
  ops::parallel_for(B * Hkv, [&](int64_t job) {
    const int64_t b = job / Hkv, g = job % Hkv;
    const float* K = kv.k[static_cast<size_t>(b)].data() + g * d;
    const float* V = kv.v[static_cast<size_t>(b)].data() + g * d;
    const uint8_t* m = key_mask[static_cast<size_t>(b)].data() + kv.offset;
    std::vector<float> P(static_cast<size_t>(QB * (past + T))), dP(P.size());
    for (int64_t h = g * rep; h < (g + 1) * rep; ++h)
      for (int64_t t0 = 0; t0 < T; t0 += QB) {
        const int64_t L = std::min(QB, T - t0), n = past + t0 + L;  // keys j < n are visible to some query
        const float* Qb = q + ((b * T + t0) * H + h) * d;
        const float* dOb = dout + ((b * T + t0) * H + h) * d;
        ops::gemm(false, true, L, n, d, scale, Qb, ldq, K, width, 0.0f, P.data(), n);
        ops::gemm(false, true, L, n, d, 1.0f, dOb, ldq, V, width, 0.0f, dP.data(), n);
        for (int64_t i = 0; i < L; ++i) {
          float* p = P.data() + i * n;
          float* dp = dP.data() + i * n;
          const int64_t lim = past + t0 + i + 1;  // causal: keys j < lim
          const int64_t lo = window > 0 ? std::max<int64_t>(0, lim - window) : 0;  // sliding window: j >= lo
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t j = lo; j < lim; ++j)
            if (m[j]) mx = std::max(mx, p[j]);
          if (mx == -std::numeric_limits<float>::infinity()) {  // no visible key: output 0, a constant
            std::fill(p, p + n, 0.0f);
            std::fill(dp, dp + n, 0.0f);
            continue;
          }
          double sum = 0.0;
          for (int64_t j = 0; j < n; ++j) {
            const float e = (j >= lo && j < lim && m[j]) ? std::exp(p[j] - mx) : 0.0f;
            p[j] = e;
            sum += e;
          }
          const float inv = static_cast<float>(1.0 / sum);
          double Dt = 0.0;  // dout . o = sum_j p_j dp_j
          for (int64_t j = 0; j < n; ++j) {
            p[j] *= inv;
            Dt += static_cast<double>(p[j]) * dp[j];
          }
          for (int64_t j = 0; j < n; ++j) dp[j] = p[j] * (dp[j] - static_cast<float>(Dt)) * scale;  // dS
        }
        float* dQb = dq + ((b * T + t0) * H + h) * d;
        ops::gemm(false, false, L, d, n, 1.0f, dP.data(), n, K, width, 0.0f, dQb, ldq);
        // Cached keys / values (j < past) are constants of this call: the call's keys 0..n-past-1 only.
        ops::gemm(true, false, n - past, d, L, 1.0f, dP.data() + past, n, Qb, ldq, 1.0f, dk + b * T * width + g * d,
                  width);
        ops::gemm(true, false, n - past, d, L, 1.0f, P.data() + past, n, dOb, ldq, 1.0f, dv + b * T * width + g * d,
                  width);
      }
  });
}

void apply_rope_backward(float* g, int64_t rows, int64_t heads, int64_t head_dim, int64_t rotary_dim,
                         const int64_t* pos, const std::vector<float>& inv_freq) {
  // The rotation by angle a is orthogonal: its transpose is the rotation by -a on each pair.
  const int64_t half = rotary_dim / 2;
  std::vector<float> c(static_cast<size_t>(half)), s(static_cast<size_t>(half));
  for (int64_t r = 0; r < rows; ++r) {
    const float p = static_cast<float>(pos[r]);
    for (int64_t j = 0; j < half; ++j) {
      const float fr = inv_freq[static_cast<size_t>(j)] * p;  // the forward's float32 angle
      c[static_cast<size_t>(j)] = std::cos(fr);
      s[static_cast<size_t>(j)] = std::sin(fr);
    }
    for (int64_t h = 0; h < heads; ++h) {
      float* v = g + (r * heads + h) * head_dim;
      for (int64_t j = 0; j < half; ++j) {
        const float a = v[j], b = v[j + half], cj = c[static_cast<size_t>(j)], sj = s[static_cast<size_t>(j)];
        v[j] = a * cj + b * sj;
        v[j + half] = b * cj - a * sj;
      }
    }
  }
}

}  // namespace mixlens::grad
