// Metrics with exact dMetric/dLogits for Trace::backward (mixlens/grad.h); log-softmax in double.
#include <cmath>
#include <string>

#include "mixlens/errors.h"
#include "mixlens/grad.h"

namespace mixlens::metrics {

namespace {

void check_logits(const Tensor& z) {
  if (!z.defined() || z.dim() != 3) throw InputError("metric: logits must be [B, T, vocab]");
}

int64_t resolve(int64_t i, int64_t n, const char* what) {
  const int64_t r = i < 0 ? i + n : i;
  if (r < 0 || r >= n)
    throw InputError(std::string("metric: ") + what + " " + std::to_string(i) + " is out of range for " +
                     std::to_string(n));
  return r;
}

// Adds log_softmax(row)[token] to value and onehot - softmax to g.
void add_log_prob(const float* z, float* g, int64_t V, int32_t token, double& value) {
  if (token < 0 || token >= V)
    throw InputError("metric: token " + std::to_string(token) + " is outside the vocabulary [0, " + std::to_string(V) + ")");
  double m = z[0];
  for (int64_t v = 1; v < V; ++v) m = std::max(m, static_cast<double>(z[v]));
  double s = 0.0;
  for (int64_t v = 0; v < V; ++v) s += std::exp(z[v] - m);
  const double lse = m + std::log(s);
  value += z[token] - lse;
  for (int64_t v = 0; v < V; ++v) g[v] -= static_cast<float>(std::exp(z[v] - lse));
  g[token] += 1.0f;
}

}  // namespace

MetricGrad log_prob(const Tensor& logits, int32_t token, int64_t pos, int64_t row) {
  check_logits(logits);
  const int64_t B = logits.size(0), T = logits.size(1), V = logits.size(2);
  MetricGrad out{0.0, Tensor(logits.shape())};
  const int64_t t = resolve(pos, T, "position");
  const int64_t r0 = row < 0 ? 0 : resolve(row, B, "row"), r1 = row < 0 ? B : r0 + 1;
  for (int64_t r = r0; r < r1; ++r)
    add_log_prob(logits.data() + (r * T + t) * V, out.dlogits.data() + (r * T + t) * V, V, token, out.value);
  return out;
}

MetricGrad logit_diff(const Tensor& logits, int32_t a, int32_t b, int64_t pos, int64_t row) {
  check_logits(logits);
  const int64_t B = logits.size(0), T = logits.size(1), V = logits.size(2);
  for (int32_t tok : {a, b})
    if (tok < 0 || tok >= V)
      throw InputError("metric: token " + std::to_string(tok) + " is outside the vocabulary [0, " + std::to_string(V) + ")");
  MetricGrad out{0.0, Tensor(logits.shape())};
  const int64_t t = resolve(pos, T, "position");
  const int64_t r0 = row < 0 ? 0 : resolve(row, B, "row"), r1 = row < 0 ? B : r0 + 1;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t o = (r * T + t) * V;
    out.value += static_cast<double>(logits[o + a]) - logits[o + b];
    out.dlogits[o + a] += 1.0f;
    out.dlogits[o + b] -= 1.0f;
  }
  return out;
}

MetricGrad sequence_log_prob(const Tensor& logits, const std::vector<std::vector<int32_t>>& targets) {
  check_logits(logits);
  const int64_t B = logits.size(0), T = logits.size(1), V = logits.size(2);
  if (static_cast<int64_t>(targets.size()) != B)
    throw InputError("metric: targets has " + std::to_string(targets.size()) + " rows, the logits " + std::to_string(B));
  MetricGrad out{0.0, Tensor(logits.shape())};
  for (int64_t r = 0; r < B; ++r) {
    const auto& row = targets[static_cast<size_t>(r)];
    if (static_cast<int64_t>(row.size()) != T)
      throw InputError("metric: targets row " + std::to_string(r) + " has " + std::to_string(row.size()) +
                       " entries, the call " + std::to_string(T) + " positions");
    for (int64_t t = 0; t < T; ++t)
      if (row[static_cast<size_t>(t)] >= 0)
        add_log_prob(logits.data() + (r * T + t) * V, out.dlogits.data() + (r * T + t) * V, V,
                     row[static_cast<size_t>(t)], out.value);
  }
  return out;
}

}  // namespace mixlens::metrics
