// The nanobind module mixlens._core: one init_* per area (DESIGN.md layout).
#pragma once
#include <optional>

#include "convert.h"
#include "mixlens/model.h"

namespace mixlens::py {

void init_errors(nb::module_& m);
void init_model(nb::module_& m);
void init_session(nb::module_& m);

GenerateOptions make_options(int max_new_tokens, bool greedy, float temperature, int top_k, float top_p,
                             uint64_t seed, std::optional<int32_t> eos_token_id);
/// Rows of equal length as one Batch (a continuation cannot be padded in the middle of a stream).
Batch continuation_batch(const std::vector<std::vector<int32_t>>& rows);

}  // namespace mixlens::py
