// A minimal dense tensor: row-major, contiguous, shared storage.
// All mixlens activations and served values are float32; only matmul weights loaded with a
// narrow `dtype` load option (LoadOptions::dtype) hold bfloat16 / float16 / blocked int8.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace mixlens {

using Shape = std::vector<int64_t>;

/// Element type of a Tensor. Everything but narrow matmul weights is f32. int8 is blocked along the
/// last axis: each block of 32 weights is a float32 scale s then 32 int8 values q, weight = q * s
/// (ops/dtype.h; llama.cpp's Q8_0 with a float32 scale), a row padded with zeros to whole blocks.
enum class ScalarType : uint8_t { float32, bfloat16, float16, int8 };
/// "float32", "bfloat16", "float16", "int8" (torch's spelling).
const char* dtype_str(ScalarType d);

/// "[2, 3, 4]"
std::string shape_str(const Shape& s);
/// Product of the dimensions (1 for a scalar shape []).
int64_t shape_numel(const Shape& s);

/// Dense row-major tensor, float32 unless made by Tensor::narrow (bf16/f16 weights). Copying a Tensor shares storage (like a torch tensor handle);
/// clone() makes an independent copy. A default-constructed Tensor is "None" (defined() == false).
class Tensor {
 public:
  Tensor() = default;
  /// Zero-filled tensor of the given shape. Throws InputError on a negative dimension or an
  /// absurd size (more than 2^40 elements).
  explicit Tensor(Shape shape);
  /// Tensor of the given shape filled with `fill`.
  Tensor(Shape shape, float fill);
  /// Copies `values` (size must equal the shape's element count, else InputError).
  static Tensor from(Shape shape, const std::vector<float>& values);
  /// Non-owning view over external memory kept alive by `owner` (e.g. a memory-mapped file).
  static Tensor borrow(Shape shape, const float* data, std::shared_ptr<const void> owner);
  /// Read-only bf16 / f16 / int8 tensor over `data` (nbytes() bytes) kept alive by `owner`.
  /// Only matmul weights are narrow: data() / operator[] throw Error on them (use raw() in the
  /// kernels of ops::linear, or to_f32()).
  static Tensor narrow(Shape shape, ScalarType dtype, const void* data, std::shared_ptr<const void> owner);
  /// Tensor of the given shape whose contents are left uninitialised: for buffers a kernel fills
  /// entirely (zeroing hundreds of MiB first would be a pass of its own).
  static Tensor uninitialized(Shape shape);
  /// Uninitialised, writable storage for a weight the process keeps for its lifetime (a float32
  /// weight widened from a 16-bit file): outside the activation arena, and from 4 MiB up 2 MiB
  /// aligned and advised as transparent huge pages (a decode step streams every weight; 4 KiB pages
  /// cost TLB misses). Throws InputError on a bad shape, std::bad_alloc when memory is short.
  static Tensor weight(Shape shape);

  bool defined() const { return storage_ != nullptr; }
  /// True when no other Tensor (a copy, a reshape, an array handed to Python) shares the storage.
  bool sole_owner() const { return storage_ != nullptr && storage_.use_count() == 1; }
  const Shape& shape() const { return shape_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  /// Size of dimension i (negative i counts from the end).
  int64_t size(int64_t i) const;
  int64_t numel() const { return numel_; }
  ScalarType dtype() const { return dtype_; }
  /// The storage whatever the dtype (nbytes() bytes).
  const void* raw() const { return data_; }
  /// Bytes of the storage: numel x 4 or 2; int8: rows x whole blocks of 36 bytes.
  int64_t nbytes() const;

  /// Mutable data. Throws Error if the tensor borrows read-only memory (call clone() first) or is
  /// not float32.
  float* data() {
    // Inline: elementwise loops index through operator[], which called out of line per element.
    if (dtype_ != ScalarType::float32 || !writable_) [[unlikely]] not_writable_f32();
    return static_cast<float*>(data_);
  }
  /// Error unless float32.
  const float* data() const {
    if (dtype_ != ScalarType::float32) [[unlikely]] not_f32();
    return static_cast<const float*>(data_);
  }
  const float* begin() const { return data(); }
  const float* end() const { return data() + numel_; }
  float& operator[](int64_t i) { return data()[i]; }
  float operator[](int64_t i) const { return data()[i]; }

  /// An independent copy (same dtype).
  Tensor clone() const;
  /// float32 values: *this when already float32 (shared), else a widened copy (exact).
  Tensor to_f32() const;
  /// Same storage, new shape with the same element count (else InputError).
  Tensor reshape(Shape shape) const;
  /// True when any element is NaN.
  bool has_nan() const;
  /// True when any element is NaN or +-inf.
  bool has_non_finite() const;
  std::vector<float> to_vector() const;

 private:
  [[noreturn]] void not_f32() const;
  [[noreturn]] void not_writable_f32() const;
  /// borrow / narrow: a read-only view of `data` kept alive by `owner`.
  static Tensor read_only_view(Shape shape, ScalarType dtype, const void* data, std::shared_ptr<const void> owner);
  Shape shape_;
  int64_t numel_ = 0;
  std::shared_ptr<const void> storage_;
  void* data_ = nullptr;
  bool writable_ = true;
  ScalarType dtype_ = ScalarType::float32;
};

}  // namespace mixlens
