// The nanobind module mixlens._core: one init_* per area (DESIGN.md layout).
#pragma once
#include <exception>
#include <optional>

#include "convert.h"
#include "mixlens/model.h"

namespace mixlens::py {

void init_errors(nb::module_& m);
/// Sets the Python error for a mixlens C++ exception (its class in mixlens.errors); rethrows any
/// other exception. What nanobind's translator does, for calls made outside nanobind (errors.cpp).
void set_python_error(const std::exception_ptr& p);
void init_model(nb::module_& m);
void init_session(nb::module_& m);
void init_extract(nb::module_& m);
void init_attribution(nb::module_& m);

GenerateOptions make_options(int max_new_tokens, bool greedy, float temperature, int top_k, float top_p,
                             uint64_t seed, std::optional<int32_t> eos_token_id);
/// Rows of equal length as one Batch (a continuation cannot be padded in the middle of a stream),
/// or the embeddings [B,T,hidden] when given (then `rows` must be empty).
Batch continuation_batch(const std::vector<std::vector<int32_t>>& rows,
                         const std::optional<FloatArray>& embeds = std::nullopt);
/// The first call's batch: left-padded `prompts`, or Batch::from_embeddings(embeds, mask).
Batch prompt_batch(const Model& model, const std::vector<std::vector<int32_t>>& prompts,
                   const std::optional<FloatArray>& embeds, const std::vector<uint8_t>& mask);

}  // namespace mixlens::py
