// Reading and writing safetensors files (https://github.com/huggingface/safetensors).
// Layout: 8-byte little-endian header length N, N bytes of JSON header, then the data section.
// Files are memory-mapped read-only; float32 tensors are served zero-copy from the mapping.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "mixlens/tensor.h"
#include "ops/dtype.h"

namespace mixlens::io {

/// Element types a safetensors header may name (the subset mixlens understands).
enum class DType { F32, F16, BF16, F64, I64, I32, I16, I8, U8, BOOL };

/// "F32", "BF16", ... (the spelling used in safetensors headers).
const char* dtype_name(DType d);
/// Bytes per element.
size_t dtype_size(DType d);
/// Parses a header dtype string; returns false for names mixlens does not know.
bool parse_dtype(std::string_view name, DType* out);

/// IEEE half / bfloat16 bits -> float, exact for every input (subnormals, +-inf, NaN payloads): the
/// kernels' own conversions, so the reader and the 16-bit matmuls widen identically.
using ops::bf16_to_f32;
using ops::f16_to_f32;
/// double -> float, rounding to nearest; out-of-range values become +-inf (never UB).
float f64_to_f32(double v);

/// One tensor entry of a safetensors header, validated.
struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  uint64_t offset = 0;  ///< absolute byte offset of the data within the file (not data-relative)
  uint64_t nbytes = 0;  ///< == numel(shape) * dtype_size(dtype)
  std::string file;     ///< the file's path (or the label given to parse_header)
};

/// Result of parsing a header: entries sorted by offset (= file order) and the metadata.
struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;
  std::map<std::string, std::string> metadata;  ///< "__metadata__"; empty when absent
  uint64_t data_start = 0;                      ///< 8 + header length
};

/// A memory-mapped safetensors file. Copies share the mapping; Tensors borrowed from it keep the
/// mapping alive on their own, so they may outlive the SafetensorsFile. Read-only and thread-safe.
/// (If another process truncates the file while it is mapped, reads may SIGBUS; nothing portable
/// prevents that.)
class SafetensorsFile {
 public:
  /// Maps and validates `path`. Throws CheckpointError naming the file for: file missing or not a
  /// regular file, shorter than 8 bytes, header length absurd (> 100 MB) or past the end of the
  /// file, header not JSON / not an object, duplicate tensor names, __metadata__ not string->string,
  /// entry missing or mistyping dtype/shape/data_offsets, unknown dtype, negative / non-integer /
  /// absurd (numel > 2^40) dims, reversed offsets, offsets past the data section,
  /// nbytes != numel * itemsize, and tensors that overlap, leave gaps, or do not cover the data
  /// section exactly (the same tiling rule the reference Rust implementation enforces).
  explicit SafetensorsFile(const std::filesystem::path& path);

  /// Validates a complete in-memory file image (8-byte length + header + data) and returns its
  /// entries, exactly as the constructor would; `label` names the source in error messages.
  /// Never reads outside [data, data + size). Throws CheckpointError only.
  static SafetensorsHeader parse_header(const uint8_t* data, size_t size, const std::string& label);

  const std::string& path() const;
  const std::map<std::string, std::string>& metadata() const;
  /// All entries, in file (offset) order.
  const std::vector<TensorInfo>& tensors() const;
  bool has(const std::string& name) const;
  /// CheckpointError "tensor 'X' is not in safetensors file F" when absent.
  const TensorInfo& info(const std::string& name) const;

  /// The tensor as float32 with its header shape. F32: zero-copy borrow of the mapping when the
  /// data is 4-byte aligned (read-only: Tensor::data() throws; clone() to modify), else a copy.
  /// BF16 / F16: widened copy. F64: narrowed copy (out-of-range -> +-inf).
  /// Integer / bool dtypes: CheckpointError.
  Tensor get_f32(const std::string& name) const;
  /// A BF16 / F16 tensor as a bfloat16 / float16 Tensor that borrows the mapping (zero copy: it
  /// keeps the file mapped; its pages are the file's page cache, read on first touch). Returns an
  /// undefined Tensor when the data is not 2-byte aligned (the caller copies). Other dtypes:
  /// CheckpointError.
  Tensor borrow16(const std::string& name) const;
  /// Integer tensors (I64, I32, I16, I8, U8, BOOL) as int64, flattened in row-major order.
  /// Float dtypes: CheckpointError.
  std::vector<int64_t> get_i64(const std::string& name) const;
  /// The raw little-endian bytes of a tensor, inside the mapping.
  std::span<const uint8_t> bytes(const std::string& name) const;
  /// Gives the mapped pages of a tensor that was copied out back to the OS (madvise DONTNEED), so
  /// a load never holds the file image and the converted copies at once (peak RSS). A no-op for
  /// tensors get_f32 borrows (F32, 4-byte aligned) unless `borrowed_too` (the borrow was converted
  /// and dropped); a later read faults the pages in again either way.
  void release(const std::string& name, bool borrowed_too = false) const;

 private:
  struct State;
  std::shared_ptr<const State> state_;
};

/// An int64 tensor to write next to float32 ones (e.g. token ids in golden fixtures).
struct I64Tensor {
  Shape shape;
  std::vector<int64_t> values;  ///< row-major; size must equal numel(shape)
};

/// One tensor for write_safetensors_streamed: its bytes are produced by `fill` (into a buffer of
/// numel(shape) * dtype_size(dtype) bytes) only when the writer reaches it, so a file larger than
/// memory is written one tensor at a time.
struct StreamedTensor {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  std::function<void(uint8_t* dst)> fill;
};

/// Writes `tensors` (any dtype) and `metadata` as one safetensors file, tensors laid out by element
/// size, largest first, each keeping its position among equals (every tensor naturally aligned, no
/// gaps, as the reference reader requires). InputError for a duplicate or reserved name or names /
/// metadata that are not valid UTF-8; CheckpointError if the file cannot be written.
void write_safetensors_streamed(const std::filesystem::path& path, const std::vector<StreamedTensor>& tensors,
                                const std::map<std::string, std::string>& metadata = {});

/// Writes a safetensors file readable by the Python `safetensors` package. float32 tensors are
/// written as F32 and `i64_tensors` as I64; header keys appear in the given order (__metadata__
/// first, omitted when empty), the header is padded with spaces to a multiple of 8 bytes, and the
/// data is laid out contiguously (I64 first so every tensor stays naturally aligned).
/// Throws InputError for an undefined tensor, a duplicate or reserved ("__metadata__") name, names
/// or metadata that are not valid UTF-8, or an I64Tensor whose value count mismatches its shape;
/// CheckpointError if the file cannot be written.
void write_safetensors(const std::filesystem::path& path,
                       const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {},
                       const std::vector<std::pair<std::string, I64Tensor>>& i64_tensors = {});

}  // namespace mixlens::io
