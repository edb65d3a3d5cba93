// Backward of the softmax attention pieces (mixers/attention.h): the causal GQA attention core
// (detail::causal_attention / flash_causal_attention) and rotate-half RoPE (detail::apply_rope).
// The attention backward recomputes each query's softmax row from q and the cached keys (one row
// of past + t + 1 scores at a time; no [T, T] matrix) and accumulates dk / dv of the call's new
// tokens; cached keys and values (positions < past) are constants of the call.
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
                               const float* dout, float* dq, float* dk, float* dv) {
  if (Hkv <= 0 || H % Hkv != 0) throw InputError("causal_attention_backward: heads must be a multiple of kv heads");
  if (kv.len != past + T || static_cast<int64_t>(kv.k.size()) < B || static_cast<int64_t>(key_mask.size()) < B)
    throw InputError("causal_attention_backward: the KV cache must hold past + T tokens for every row (the call's "
                     "keys appended), got len " + std::to_string(kv.len) + " for past " + std::to_string(past) +
                     " + T " + std::to_string(T));
  const int64_t rep = H / Hkv, width = Hkv * d, Tk = past + T;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const ops::KernelTable& kt = ops::kernels();
  std::fill(dk, dk + B * T * width, 0.0f);
  std::fill(dv, dv + B * T * width, 0.0f);
  // One job per (row, kv head): it owns that kv head's dk / dv (the rep query heads reading it are
  // summed inside the job), so no two jobs write the same element.
  ops::parallel_for(B * Hkv, [&](int64_t job) {
    const int64_t b = job / Hkv, g = job % Hkv;
    const float* K = kv.k[static_cast<size_t>(b)].data() + g * d;
    const float* V = kv.v[static_cast<size_t>(b)].data() + g * d;
    const uint8_t* m = key_mask[static_cast<size_t>(b)].data();
    std::vector<float> p(static_cast<size_t>(Tk)), dp(static_cast<size_t>(Tk)), o(static_cast<size_t>(d));
    for (int64_t h = g * rep; h < (g + 1) * rep; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t row = (b * T + t) * H + h;
        const float* qt = q + row * d;
        const float* go = dout + row * d;
        float* gq = dq + row * d;
        std::fill(gq, gq + d, 0.0f);
        const int64_t n = past + t + 1;  // causal: keys j < n
        kt.matvec_f32(K, width, qt, p.data(), n, d);
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) {
          p[static_cast<size_t>(j)] = m[j] ? p[static_cast<size_t>(j)] * scale : -std::numeric_limits<float>::infinity();
          mx = std::max(mx, p[static_cast<size_t>(j)]);
        }
        if (mx == -std::numeric_limits<float>::infinity()) continue;  // no visible key: output 0, constant
        double sum = 0.0;
        for (int64_t j = 0; j < n; ++j) {
          const float e = m[j] ? std::exp(p[static_cast<size_t>(j)] - mx) : 0.0f;
          p[static_cast<size_t>(j)] = e;
          sum += e;
        }
        const float inv = static_cast<float>(1.0 / sum);
        for (int64_t j = 0; j < n; ++j) p[static_cast<size_t>(j)] *= inv;
        // o = sum_j p_j v_j; dp_j = dout . v_j; ds_j = p_j (dp_j - dout . o)
        std::fill(o.begin(), o.end(), 0.0f);
        kt.acc_rows(p.data(), V, width, n, d, o.data());
        kt.matvec_f32(V, width, go, dp.data(), n, d);
        double Dt = 0.0;
        for (int64_t e = 0; e < d; ++e) Dt += static_cast<double>(go[e]) * o[static_cast<size_t>(e)];
        for (int64_t j = 0; j < n; ++j) {
          const float pj = p[static_cast<size_t>(j)];
          if (pj == 0.0f) continue;
          const float ds = pj * (dp[static_cast<size_t>(j)] - static_cast<float>(Dt)) * scale;
          const float* kj = K + j * width;
          for (int64_t e = 0; e < d; ++e) gq[e] += ds * kj[e];
          if (j < past) continue;  // cached keys / values are constants of this call
          float* gk = dk + (b * T + j - past) * width + g * d;
          float* gv = dv + (b * T + j - past) * width + g * d;
          for (int64_t e = 0; e < d; ++e) {
            gk[e] += ds * qt[e];
            gv[e] += pj * go[e];
          }
        }
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
