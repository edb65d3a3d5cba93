#include "mixers/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "ops/kernels.h"
#include "ops/ops.h"
#include "ops/tile_kernels.h"

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

void KvCache::keep_last(int64_t n) {
  const int64_t drop = len - n;
  if (drop <= 0) return;
  for (size_t b = 0; b < k.size(); ++b) {
    const auto w = static_cast<std::ptrdiff_t>(k[b].size() / static_cast<size_t>(len));  // floats per key
    k[b].erase(k[b].begin(), k[b].begin() + drop * w);
    v[b].erase(v[b].begin(), v[b].begin() + drop * w);
  }
  len = n;
  offset += drop;
}

void causal_attention(const float* q, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t d, int64_t past,
                      const KvCache& kv, const std::vector<std::vector<uint8_t>>& key_mask, float* out,
                      float* probs, float scale_in, int64_t window) {
  // The output always comes from the tiled kernel, so asking for the probabilities never changes
  // it; the explicit softmax below only materializes them.
  flash_causal_attention(q, B, T, H, Hkv, d, past, kv, key_mask, out, scale_in, window);
  if (!probs) return;
  const int64_t Tk = past + T;
  const int64_t rep = H / Hkv, width = Hkv * d;
  const float scale = attention_scale(d, scale_in);
  ops::parallel_for(B * H, [&](int64_t bh) {
    const int64_t b = bh / H, h = bh % H, g = h / rep;
    const float* K = kv.k[static_cast<size_t>(b)].data();
    const uint8_t* m = key_mask[static_cast<size_t>(b)].data() + kv.offset;
    std::vector<float> w(static_cast<size_t>(past + T));
    for (int64_t t = 0; t < T; ++t) {
      const float* qt = q + ((b * T + t) * H + h) * d;
      const int64_t n = past + t + 1, lo = window > 0 ? std::max<int64_t>(0, n - window) : 0;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = lo; j < n; ++j) {
        if (!m[j]) continue;
        const float* kj = K + j * width + g * d;
        float s = 0.0f;
        for (int64_t e = 0; e < d; ++e) s += qt[e] * kj[e];
        w[static_cast<size_t>(j)] = s * scale;
        mx = std::max(mx, w[static_cast<size_t>(j)]);
      }
      if (mx == -std::numeric_limits<float>::infinity()) continue;  // fully masked row -> 0
      float sum = 0.0f;
      for (int64_t j = lo; j < n; ++j) {
        if (!m[j]) continue;
        w[static_cast<size_t>(j)] = std::exp(w[static_cast<size_t>(j)] - mx);
        sum += w[static_cast<size_t>(j)];
      }
      float* prow = probs + ((b * H + h) * T + t) * Tk;  // zero-filled by the caller
      for (int64_t j = lo; j < n; ++j) {
        if (!m[j]) continue;
        prow[j] = w[static_cast<size_t>(j)] / sum;
      }
    }
  });
}

void flash_causal_attention(const float* q, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t d, int64_t past,
                            const KvCache& kv, const std::vector<std::vector<uint8_t>>& key_mask, float* out,
                            float scale_in, int64_t window) {
  // Per query tile and head: a [kBq, kBk] tile of scores (register-blocked dots, each in an order
  // that does not depend on the tile, so a prompt split into calls gives the same outputs), an
  // online softmax per query (running max and sum, rescaling the partial output) and O += P V for
  // the whole tile (V loaded once for several queries). No [T, T] matrix.
  constexpr int64_t kBq = 32, kBk = 128;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t rep = H / Hkv, width = Hkv * d;
  const float scale = attention_scale(d, scale_in);
  const int64_t qtiles = (T + kBq - 1) / kBq;
  const ops::KernelTable& kt = ops::kernels();
  const ops::TileKernels& tk = ops::tile_kernels();
  ops::parallel_for(B * H * qtiles, [&](int64_t job) {
    const int64_t qt = job % qtiles, bh = job / qtiles;  // once per tile, not per element
    const int64_t b = bh / H, h = bh % H, g = h / rep;
    const int64_t t0 = qt * kBq, nq = std::min(kBq, T - t0);
    const float* K = kv.k[static_cast<size_t>(b)].data() + g * d;
    const float* V = kv.v[static_cast<size_t>(b)].data() + g * d;
    const float* Q = q + ((b * T + t0) * H + h) * d;  // query i at Q + i * H * d
    const uint8_t* m = key_mask[static_cast<size_t>(b)].data() + kv.offset;
    thread_local std::vector<float> S, O, mx, sum;
    S.resize(static_cast<size_t>(kBq * kBk));
    O.assign(static_cast<size_t>(nq * d), 0.0f);
    mx.assign(static_cast<size_t>(nq), kNegInf);
    sum.assign(static_cast<size_t>(nq), 0.0f);
    const int64_t kend = past + t0 + nq;  // keys [0, kend) are visible to some query of the tile
    // Key tiles start at the row's first real key, not at key 0: the left padding of a batch then
    // moves no tile boundary (each boundary rescales the online softmax), so a row's outputs are
    // bitwise the same alone and in any batch (issue 23). The pads before it add nothing anyway.
    // A sliding window: query i sees keys j >= lo(i) = past + t0 + i + 1 - window; the tile's first query
    // the fewest.
    const auto lo = [&](int64_t i) { return window > 0 ? std::max<int64_t>(0, past + t0 + i + 1 - window) : 0; };
    int64_t first = lo(0);
    while (first < kend && !m[first]) ++first;
    for (int64_t k0 = first; k0 < kend; k0 += kBk) {
      const int64_t nk = std::min(kBk, kend - k0);
      // Queries before i0 see no key of this tile (it lies in their future).
      const int64_t i0 = std::max<int64_t>(0, k0 - past - t0);
      tk.dots(Q + i0 * H * d, H * d, nq - i0, K + k0 * width, width, nk, d, S.data() + i0 * kBk, kBk);
      for (int64_t i = i0; i < nq; ++i) {
        const int64_t limit = std::min(nk, past + t0 + i + 1 - k0);  // causal: keys j < limit
        const int64_t from = lo(i) - k0;                                // window: keys j >= from
        float* s = S.data() + i * kBk;
        float rmax = kNegInf;
        for (int64_t j = 0; j < limit; ++j) {
          s[j] = m[k0 + j] && j >= from ? s[j] * scale : kNegInf;
          rmax = std::max(rmax, s[j]);
        }
        if (rmax == kNegInf) {  // nothing visible in this tile: the row adds nothing
          std::fill(s, s + nk, 0.0f);
          continue;
        }
        float& mi = mx[static_cast<size_t>(i)];
        const float mnew = std::max(mi, rmax);
        const float alpha = std::exp(mi - mnew);  // exp(-inf) = 0 on the first visible tile
        for (int64_t j = 0; j < limit; ++j) s[j] -= mnew;
        kt.exp(s, s, limit);  // masked keys: exp(-inf) = 0
        std::fill(s + limit, s + nk, 0.0f);  // future keys: adding 0 * v leaves the sums as they are
        float rs = 0.0f;
        for (int64_t j = 0; j < limit; ++j) rs += s[j];
        sum[static_cast<size_t>(i)] = sum[static_cast<size_t>(i)] * alpha + rs;
        mi = mnew;
        float* o = O.data() + i * d;
        if (alpha != 1.0f)
          for (int64_t e = 0; e < d; ++e) o[e] *= alpha;
      }
      tk.acc_tile(S.data() + i0 * kBk, kBk, nq - i0, V + k0 * width, width, nk, d, O.data() + i0 * d, d);
    }
    for (int64_t i = 0; i < nq; ++i) {
      float* o = out + ((b * T + t0 + i) * H + h) * d;
      const float l = sum[static_cast<size_t>(i)];
      if (l == 0.0f) {  // a query with no visible key (left padding) gets 0, as SDPA
        std::fill(o, o + d, 0.0f);
        continue;
      }
      const float inv = 1.0f / l;
      for (int64_t e = 0; e < d; ++e) o[e] = O[static_cast<size_t>(i * d + e)] * inv;
    }
  });
}

}  // namespace mixlens::detail
