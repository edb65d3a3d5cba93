// A minimal dense float32 tensor: row-major, contiguous, shared storage.
// All mixlens activations, weights (widened at load) and served values are float32.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace mixlens {

using Shape = std::vector<int64_t>;

/// "[2, 3, 4]"
std::string shape_str(const Shape& s);
/// Product of the dimensions (1 for a scalar shape []).
int64_t shape_numel(const Shape& s);

/// Dense row-major float32 tensor. Copying a Tensor shares storage (like a torch tensor handle);
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
  /// Tensor of the given shape whose contents are left uninitialised: for buffers a kernel fills
  /// entirely (zeroing hundreds of MiB first would be a pass of its own).
  static Tensor uninitialized(Shape shape);

  bool defined() const { return storage_ != nullptr; }
  /// True when no other Tensor (a copy, a reshape, an array handed to Python) shares the storage.
  bool sole_owner() const { return storage_ != nullptr && storage_.use_count() == 1; }
  const Shape& shape() const { return shape_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  /// Size of dimension i (negative i counts from the end).
  int64_t size(int64_t i) const;
  int64_t numel() const { return numel_; }

  /// Mutable data. Throws Error if the tensor borrows read-only memory (call clone() first).
  float* data();
  const float* data() const { return data_; }
  const float* begin() const { return data_; }
  const float* end() const { return data_ + numel_; }
  float& operator[](int64_t i) { return data()[i]; }
  float operator[](int64_t i) const { return data_[i]; }

  Tensor clone() const;
  /// Same storage, new shape with the same element count (else InputError).
  Tensor reshape(Shape shape) const;
  /// True when any element is NaN.
  bool has_nan() const;
  /// True when any element is NaN or +-inf.
  bool has_non_finite() const;
  std::vector<float> to_vector() const { return std::vector<float>(data_, data_ + numel_); }

 private:
  Shape shape_;
  int64_t numel_ = 0;
  std::shared_ptr<const void> storage_;
  float* data_ = nullptr;
  bool writable_ = true;
};

}  // namespace mixlens
