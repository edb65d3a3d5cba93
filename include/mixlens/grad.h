// Metrics for Trace::backward (issue 12, docs/gradients.md): scalar functions of a call's logits
// [B,T,vocab] with their exact gradient dMetric/dLogits, the input of Trace::backward.
//
//   Trace tr;  tr.save("layers.*.layer_output").enable_grad();
//   Tensor logits = model.run({ids}, &tr);
//   tr.backward(metrics::log_prob(logits, target).dlogits);
//
// A metric of a few positions need not form every position's logits: run with all_logits false and
// pass the positions it reads (Trace::logits_at, Trace::backward(dlogits, paths, positions)):
//   model.run(batch, &tr, nullptr, false);
//   tr.backward(metrics::log_prob(tr.logits_at({t}), target, 0).dlogits, {}, {t});
#pragma once
#include <cstdint>
#include <vector>

#include "mixlens/tensor.h"

namespace mixlens::metrics {

struct MetricGrad {
  double value = 0.0;  ///< the metric
  Tensor dlogits;      ///< dMetric/dLogits, the shape of the logits
};

/// Sum over rows (`row` -1: every row) of log_softmax(logits)[row, pos, token] (`pos` negative
/// counts from the end). InputError on a bad shape, token, row or position.
MetricGrad log_prob(const Tensor& logits, int32_t token, int64_t pos = -1, int64_t row = -1);
/// Sum over rows of logits[row, pos, a] - logits[row, pos, b].
MetricGrad logit_diff(const Tensor& logits, int32_t a, int32_t b, int64_t pos = -1, int64_t row = -1);
/// Sum over every (row, position) of log_softmax(logits)[row, t, targets[row][t]]; a target < 0
/// skips that position (e.g. padding, or the last position of next-token targets).
MetricGrad sequence_log_prob(const Tensor& logits, const std::vector<std::vector<int32_t>>& targets);

}  // namespace mixlens::metrics
