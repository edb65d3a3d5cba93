#include "models/registry.h"

#include <algorithm>

#include "mixlens/errors.h"
#include "models/config.h"

namespace mixlens::detail {

namespace {
const char* const kShortConvOneKernel =
    "the gated short conv has one kernel, the token loop ('recurrent'), for prompts and decode steps alike";
const char* const kWkvOneKernel =
    "RWKV-4's WKV has one kernel, the token recurrence ('recurrent'; no chunked form), for prompts and steps alike";
const char* const kRgLruOneKernel =
    "the RG-LRU has no chunked kernel: its diagonal recurrence runs as one token loop ('recurrent') for prompts and steps";
}  // namespace

const std::vector<FamilyEntry>& family_registry() {
  // One line per model_type (src/models/<family>.cpp).
  static const std::vector<FamilyEntry> registry = {
      {"mamba2", "mamba2", make_mamba2, true},
      {"mamba", "mamba", make_mamba, true},
      {"qwen3_5", "qwen3_5", make_qwen3_5, true},
      {"qwen3_5_text", "qwen3_5", make_qwen3_5, true},
      {"qwen3_next", "qwen3_next", make_qwen3_next, true},
      {"nemotron_h", "nemotron_h", make_nemotron_h, true},
      {"bamba", "bamba", make_bamba, true},
      {"falcon_h1", "falcon_h1", make_falcon_h1, true},
      {"granitemoehybrid", "granitemoehybrid", make_granitemoehybrid, true},
      {"falcon_mamba", "falcon_mamba", make_falcon_mamba, true},
      {"qwen3_5_moe", "qwen3_5_moe", make_qwen3_5_moe, true},
      {"qwen3_5_moe_text", "qwen3_5_moe", make_qwen3_5_moe, true},
      {"jamba", "jamba", make_jamba, true},
      {"olmo_hybrid", "olmo_hybrid", make_olmo_hybrid, true},
      {"zamba2", "zamba2", make_zamba2, true},
      {"zamba", "zamba", make_zamba, true},
      {"kimi_linear", "kimi_linear", make_kimi_linear, true},
      {"rwkv", "rwkv", make_rwkv, true, kWkvOneKernel},
      {"lfm2", "lfm2", make_lfm2, true, kShortConvOneKernel},
      {"lfm2_moe", "lfm2_moe", make_lfm2_moe, true, kShortConvOneKernel},
      {"recurrent_gemma", "recurrent_gemma", make_recurrent_gemma, true, kRgLruOneKernel},
      {"minimax", "minimax", make_minimax, true},  // two kernels: route_kernels takes either
      {"xlstm", "xlstm", make_xlstm, true},  // two kernels: route_kernels takes either
  };
  return registry;
}

const std::vector<std::string>& family_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (const FamilyEntry& e : family_registry())
      if (std::find(n.begin(), n.end(), e.family) == n.end()) n.push_back(e.family);
    return n;
  }();
  return names;
}

std::vector<std::string> backward_family_names() {
  std::vector<std::string> n;
  for (const FamilyEntry& e : family_registry())
    if (e.backward && std::find(n.begin(), n.end(), e.family) == n.end()) n.push_back(e.family);
  return n;
}

std::string join_names(const std::vector<std::string>& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

std::unique_ptr<FamilyModel> build_family(const io::Config& config, const io::WeightStore& weights) {
  const std::string type = config.get<std::string>("model_type");
  // Ranges first: no family computes with a wrapped, absurd or non-finite field.
  validate_config(config);
  std::vector<std::string> known;
  for (const FamilyEntry& e : family_registry()) {
    if (e.model_type == type) return e.make(config, weights);
    known.push_back(e.model_type);
  }
  throw UnsupportedError(where(config) + ": model_type '" + type + "' is not supported (supported: " + join_names(known) +
                         ")");
}

}  // namespace mixlens::detail
