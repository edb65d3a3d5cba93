#include "mixers/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "ops/ops.h"

namespace mixlens::detail {

std::vector<float> rope_inv_freq(int64_t rotary_dim, double theta) {
  std::vector<float> f(static_cast<size_t>(rotary_dim / 2));
  // torch: 1.0 / (base ** (arange(0, dim, 2, float) / dim)) with the exponent in float32.
  for (int64_t j = 0; j < rotary_dim / 2; ++j) {
    const float ex = static_cast<float>(2 * j) / static_cast<float>(rotary_dim);
    f[static_cast<size_t>(j)] = 1.0f / static_cast<float>(std::pow(theta, static_cast<double>(ex)));
  }
  return f;
}

void apply_rope(float* x, int64_t rows, int64_t heads, int64_t head_dim, int64_t rotary_dim, const int64_t* pos,
                const std::vector<float>& inv_freq) {
  const int64_t half = rotary_dim / 2;
  std::vector<float> c(static_cast<size_t>(half)), s(static_cast<size_t>(half)), tmp(static_cast<size_t>(rotary_dim));
  for (int64_t r = 0; r < rows; ++r) {
    const float p = static_cast<float>(pos[r]);
    for (int64_t j = 0; j < half; ++j) {
      const float fr = inv_freq[static_cast<size_t>(j)] * p;  // float32 product as in the reference
      c[static_cast<size_t>(j)] = std::cos(fr);
      s[static_cast<size_t>(j)] = std::sin(fr);
    }
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + (r * heads + h) * head_dim;
      for (int64_t j = 0; j < half; ++j) {
        const float a = v[j], b = v[j + half];
        tmp[static_cast<size_t>(j)] = a * c[static_cast<size_t>(j)] - b * s[static_cast<size_t>(j)];
        tmp[static_cast<size_t>(j + half)] = b * c[static_cast<size_t>(j)] + a * s[static_cast<size_t>(j)];
      }
      std::copy(tmp.begin(), tmp.end(), v);
    }
  }
}

void KvCache::append(const float* kn, const float* vn, int64_t B, int64_t T, int64_t width) {
  k.resize(static_cast<size_t>(B));
  v.resize(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    k[static_cast<size_t>(b)].insert(k[static_cast<size_t>(b)].end(), kn + b * T * width, kn + (b + 1) * T * width);
    v[static_cast<size_t>(b)].insert(v[static_cast<size_t>(b)].end(), vn + b * T * width, vn + (b + 1) * T * width);
  }
  len += T;
}

void causal_attention(const float* q, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t d, int64_t past,
                      const KvCache& kv, const std::vector<std::vector<uint8_t>>& key_mask, float* out,
                      float* probs) {
  const int64_t Tk = past + T;
  const int64_t rep = H / Hkv, width = Hkv * d;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  ops::parallel_for(B * H, [&](int64_t bh) {
    const int64_t b = bh / H, h = bh % H, g = h / rep;
    const float* K = kv.k[static_cast<size_t>(b)].data();
    const float* V = kv.v[static_cast<size_t>(b)].data();
    const auto& m = key_mask[static_cast<size_t>(b)];
    std::vector<float> w(static_cast<size_t>(past + T));
    for (int64_t t = 0; t < T; ++t) {
      const float* qt = q + ((b * T + t) * H + h) * d;
      float* o = out + ((b * T + t) * H + h) * d;
      const int64_t n = past + t + 1;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        if (!m[static_cast<size_t>(j)]) continue;
        const float* kj = K + j * width + g * d;
        float s = 0.0f;
        for (int64_t e = 0; e < d; ++e) s += qt[e] * kj[e];
        w[static_cast<size_t>(j)] = s * scale;
        mx = std::max(mx, w[static_cast<size_t>(j)]);
      }
      std::fill(o, o + d, 0.0f);
      if (mx == -std::numeric_limits<float>::infinity()) continue;  // fully masked row -> 0
      float sum = 0.0f;
      for (int64_t j = 0; j < n; ++j) {
        if (!m[static_cast<size_t>(j)]) continue;
        w[static_cast<size_t>(j)] = std::exp(w[static_cast<size_t>(j)] - mx);
        sum += w[static_cast<size_t>(j)];
      }
      float* prow = probs ? probs + ((b * H + h) * T + t) * Tk : nullptr;  // zero-filled by the caller
      for (int64_t j = 0; j < n; ++j) {
        if (!m[static_cast<size_t>(j)]) continue;
        const float p = w[static_cast<size_t>(j)] / sum;
        if (prow) prow[j] = p;
        const float* vj = V + j * width + g * d;
        for (int64_t e = 0; e < d; ++e) o[e] += p * vj[e];
      }
    }
  });
}

}  // namespace mixlens::detail
