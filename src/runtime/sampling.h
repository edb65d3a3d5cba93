// Next-token choice as transformers' generate does it: greedy argmax, or temperature -> top-k ->
// top-p warpers (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper) then a multinomial draw.
#pragma once
#include <cstdint>
#include <random>

#include "mixlens/model.h"

namespace mixlens::detail {

/// Index of the first maximum (torch.argmax). NumericError when a logit is NaN (both functions).
int32_t argmax(const float* logits, int64_t V);
/// Samples from `logits` (length V) with the options' temperature / top_k / top_p.
int32_t sample(const float* logits, int64_t V, const GenerateOptions& o, std::mt19937_64& rng);

}  // namespace mixlens::detail
