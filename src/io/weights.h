// All the tensors of a checkpoint folder, by their HuggingFace names, across shards.
#pragma once
#include <cstdint>
#include <filesystem>
#include <set>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "io/safetensors.h"
#include "mixlens/tensor.h"

namespace mixlens::io {

/// The weights of a checkpoint folder. Files are memory-mapped once at open(); every header is
/// validated then, so later lookups fail only for names that are absent. Copies share the
/// mappings; read-only and thread-safe.
class WeightStore {
 public:
  /// Opens, in order of preference: `model.safetensors`; the shards listed by
  /// `model.safetensors.index.json` ("weight_map": tensor name -> shard file); else every
  /// `*.safetensors` file in the folder. Throws CheckpointError when the folder is missing or not a
  /// directory, holds no safetensors file, the index is not JSON / lacks weight_map / names a shard
  /// that does not exist or lies outside the folder / lists a tensor its shard does not hold,
  /// two files hold the same tensor, or any file fails SafetensorsFile's validation.
  static WeightStore open(const std::filesystem::path& folder);

  const std::filesystem::path& folder() const { return folder_; }
  /// The files opened, in the order they were read.
  const std::vector<SafetensorsFile>& files() const { return files_; }

  bool has(const std::string& name) const;
  /// CheckpointError "tensor 'X' not found in <folder> (...); did you mean 'Y'?" when absent.
  const TensorInfo& info(const std::string& name) const;
  /// "F32", "BF16", ... as stored in the file.
  std::string dtype_name(const std::string& name) const;
  /// The tensor as float32 (see SafetensorsFile::get_f32: F32 is zero-copy and read-only).
  Tensor get(const std::string& name) const;
  /// As get, but CheckpointError "tensor 'X' in <folder> has shape [..], expected [..] from
  /// config.json" unless the stored shape equals `expected` (checked before any conversion),
  /// and CheckpointError "... contains NaN" for a tensor with a NaN (model loading uses this form).
  Tensor get(const std::string& name, const Shape& expected) const;
  /// Which dtype get_matmul keeps matmul weights in: "float32" (widen, the default), "bfloat16",
  /// "float16", "int8" (quantized at load: ScalarType::int8, ops::quantize_q8_row), or "auto" (each
  /// tensor's checkpoint dtype; F64 -> float32). InputError otherwise.
  void set_matmul_dtype(const std::string& dtype);
  const std::string& matmul_dtype() const { return matmul_dtype_; }
  /// A weight only ever multiplied by ops::linear (or looked up row-wise as an embedding): as
  /// get(name, expected) under "float32", else a narrow (bf16 / f16) Tensor in the dtype chosen by
  /// set_matmul_dtype (float32 -> bf16 / f16 rounds to nearest even, as torch's .to()). The same
  /// shape and finiteness checks as get(name, expected).
  Tensor get_matmul(const std::string& name, const Shape& expected) const;
  /// The dtypes get_matmul has returned so far ("bfloat16", "float16", "float32", "int8"), sorted: what "auto"
  /// resolved to (ModelInfo::weight_dtypes).
  std::vector<std::string> matmul_dtypes_kept() const;
  /// The tensors get_matmul has served so far, sorted: the weights a LoadOptions::dtype applies to.
  std::vector<std::string> matmul_names() const { return {matmul_names_.begin(), matmul_names_.end()}; }
  /// The raw little-endian bytes of a tensor inside its file's mapping (SafetensorsFile::bytes).
  std::span<const uint8_t> bytes(const std::string& name) const;
  /// Gives a tensor's mapped pages back to the OS once its bytes were copied (SafetensorsFile::release).
  void release(const std::string& name) const;
  /// Integer tensors as int64 (see SafetensorsFile::get_i64).
  std::vector<int64_t> get_i64(const std::string& name) const;
  /// All tensor names, sorted.
  std::vector<std::string> names() const;

 private:
  struct Entry {
    size_t file;
    const TensorInfo* info;  // points into files_[file]'s shared, immutable header
  };
  const Entry& entry(const std::string& name) const;
  Tensor get_int8(const std::string& name, const Shape& expected) const;
  void add_file(const std::filesystem::path& path);

  std::filesystem::path folder_;
  std::vector<SafetensorsFile> files_;
  std::unordered_map<std::string, Entry> entries_;
  std::string matmul_dtype_ = "float32";
  mutable std::set<std::string> kept_;  // get_matmul's result dtypes (loading is one thread)
  mutable std::set<std::string> matmul_names_;  // the tensors get_matmul served
};

/// Levenshtein distance (for "did you mean" suggestions).
size_t edit_distance(const std::string& a, const std::string& b);
/// The candidate closest to `name` by edit distance, or "" when none is plausibly a typo of it.
std::string closest_name(const std::string& name, const std::vector<std::string>& candidates);

}  // namespace mixlens::io

namespace mixlens::detail {
/// conv1d.weight [C,1,K] -> [K,C].
Tensor transpose_conv(const Tensor& w);
/// Rows [first, first + shape[0]) of a loaded weight t [R, C] (or of one matrix of a stacked
/// [E, R, C] tensor) as a read-only Tensor sharing t's storage (fused expert and MLP weights are
/// split without a copy; float32 or the narrow matmul dtype alike).
Tensor row_block(const Tensor& t, int64_t first, Shape shape);
}  // namespace mixlens::detail
