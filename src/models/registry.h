// The one list of model families: config.json model_type -> factory. Model::load builds through it
// and every message or check that names the families (route_kernels, FamilyModel::backward) reads
// it, so a new family is one line in registry.cpp (docs/architecture.md).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "io/json.h"
#include "io/weights.h"
#include "models/family.h"

namespace mixlens::detail {

using FamilyFactory = std::function<std::unique_ptr<FamilyModel>(const io::Config&, const io::WeightStore&)>;

struct FamilyEntry {
  FamilyEntry(std::string type, std::string family_name, FamilyFactory factory, bool has_backward,
              std::string one_kernel_reason = "")
      : model_type(std::move(type)), family(std::move(family_name)), make(std::move(factory)),
        backward(has_backward), one_kernel(std::move(one_kernel_reason)) {}
  std::string model_type;  ///< config.json model_type
  std::string family;      ///< ModelInfo::family, the route_kernels name (several model_types may share one)
  FamilyFactory make;
  bool backward = false;   ///< has a backward: FamilyModel::backward runs its skeleton's (docs/gradients.md)
  /// Why route_kernels(family, "chunked") is refused, for a family whose mixer has one kernel (the
  /// token loop, "recurrent"); empty: both routes exist.
  std::string one_kernel;
};

/// Every supported model_type, in the order messages list them.
const std::vector<FamilyEntry>& family_registry();
/// The distinct family names, in registry order.
const std::vector<std::string>& family_names();
/// The family names with a backward, in registry order.
std::vector<std::string> backward_family_names();
/// "a, b, c" (for messages).
std::string join_names(const std::vector<std::string>& names);

/// Validates the config's ranges (validate_config), then builds the family of its model_type;
/// UnsupportedError listing the supported model_types otherwise.
std::unique_ptr<FamilyModel> build_family(const io::Config& config, const io::WeightStore& weights);

// Factories, one per family file (src/models/<family>.cpp).
std::unique_ptr<FamilyModel> make_mamba(const io::Config& config, const io::WeightStore& weights);
std::unique_ptr<FamilyModel> make_mamba2(const io::Config& config, const io::WeightStore& weights);
std::unique_ptr<FamilyModel> make_qwen3_5(const io::Config& config, const io::WeightStore& weights);
std::unique_ptr<FamilyModel> make_qwen3_next(const io::Config& config, const io::WeightStore& weights);
std::unique_ptr<FamilyModel> make_nemotron_h(const io::Config& config, const io::WeightStore& weights);
std::unique_ptr<FamilyModel> make_bamba(const io::Config& config, const io::WeightStore& weights);
std::unique_ptr<FamilyModel> make_falcon_h1(const io::Config& config, const io::WeightStore& weights);
std::unique_ptr<FamilyModel> make_falcon_mamba(const io::Config& config, const io::WeightStore& weights);
std::unique_ptr<FamilyModel> make_qwen3_5_moe(const io::Config& config, const io::WeightStore& weights);
std::unique_ptr<FamilyModel> make_jamba(const io::Config& config, const io::WeightStore& weights);
std::unique_ptr<FamilyModel> make_granitemoehybrid(const io::Config& config, const io::WeightStore& weights);
std::unique_ptr<FamilyModel> make_olmo_hybrid(const io::Config& config, const io::WeightStore& weights);
std::unique_ptr<FamilyModel> make_recurrent_gemma(const io::Config& config, const io::WeightStore& weights);
std::unique_ptr<FamilyModel> make_zamba2(const io::Config& config, const io::WeightStore& weights);
std::unique_ptr<FamilyModel> make_zamba(const io::Config& config, const io::WeightStore& weights);
std::unique_ptr<FamilyModel> make_kimi_linear(const io::Config& config, const io::WeightStore& weights);
std::unique_ptr<FamilyModel> make_rwkv(const io::Config& config, const io::WeightStore& weights);
std::unique_ptr<FamilyModel> make_xlstm(const io::Config& config, const io::WeightStore& weights);
std::unique_ptr<FamilyModel> make_lfm2(const io::Config& config, const io::WeightStore& weights);
std::unique_ptr<FamilyModel> make_lfm2_moe(const io::Config& config, const io::WeightStore& weights);
std::unique_ptr<FamilyModel> make_minimax(const io::Config& config, const io::WeightStore& weights);

}  // namespace mixlens::detail
