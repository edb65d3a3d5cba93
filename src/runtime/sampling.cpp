#include "runtime/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "mixlens/errors.h"

namespace mixlens::detail {

namespace {
// NaN compares false with everything: argmax would answer id 0 and sampling garbage, silently.
[[noreturn]] void refuse_nan(const char* who, int64_t i) {
  throw NumericError(std::string(who) + ": logits contain NaN (first at vocabulary index " + std::to_string(i) +
                     "); no token can be chosen");
}
}  // namespace

int32_t argmax(const float* logits, int64_t V) {
  int64_t best = 0;
  if (V > 0 && std::isnan(logits[0])) refuse_nan("greedy decoding", 0);
  for (int64_t i = 1; i < V; ++i) {
    if (std::isnan(logits[i])) refuse_nan("greedy decoding", i);
    if (logits[i] > logits[best]) best = i;
  }
  return static_cast<int32_t>(best);
}

int32_t sample(const float* logits, int64_t V, const GenerateOptions& o, std::mt19937_64& rng) {
  const float ninf = -std::numeric_limits<float>::infinity();
  std::vector<float> s(logits, logits + V);
  for (int64_t i = 0; i < V; ++i)
    if (std::isnan(s[static_cast<size_t>(i)])) refuse_nan("sampling", i);
  for (float& x : s) x /= o.temperature;
  if (o.top_k > 0 && o.top_k < V) {
    // Keep every logit >= the k-th largest (ties at the threshold survive, as in torch.topk masking).
    std::vector<float> tmp(s);
    std::nth_element(tmp.begin(), tmp.begin() + (o.top_k - 1), tmp.end(), std::greater<float>());
    const float kth = tmp[static_cast<size_t>(o.top_k - 1)];
    for (float& x : s)
      if (x < kth) x = ninf;
  }
  if (o.top_p < 1.0f) {
    // Sort ascending; drop the low tail whose cumulative probability is <= 1 - top_p, keep >= 1 token.
    std::vector<int64_t> idx(static_cast<size_t>(V));
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return s[a] < s[b]; });
    const float mx = s[idx.back()];
    double z = 0.0;
    for (float x : s) z += std::exp(static_cast<double>(x - mx));
    double cum = 0.0;
    for (size_t i = 0; i + 1 < idx.size(); ++i) {
      cum += std::exp(static_cast<double>(s[idx[i]] - mx)) / z;
      if (cum <= 1.0 - static_cast<double>(o.top_p)) s[idx[i]] = ninf;
      else break;
    }
  }
  const float mx = *std::max_element(s.begin(), s.end());
  std::vector<double> p(static_cast<size_t>(V));
  double z = 0.0;
  for (int64_t i = 0; i < V; ++i) z += p[i] = std::exp(static_cast<double>(s[i] - mx));
  std::uniform_real_distribution<double> u(0.0, z);
  double r = u(rng), acc = 0.0;
  for (int64_t i = 0; i < V; ++i) {
    acc += p[i];
    if (r < acc && p[i] > 0.0) return static_cast<int32_t>(i);
  }
  return argmax(s.data(), V);
}

}  // namespace mixlens::detail
