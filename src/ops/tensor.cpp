#include "mixlens/tensor.h"

#include <cmath>
#include <cstring>

#include "mixlens/errors.h"

namespace mixlens {

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(s[i]);
  }
  return out + "]";
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) {
    if (d < 0) throw InputError("negative dimension in shape " + shape_str(s));
    if (d != 0 && n > (int64_t{1} << 40) / d)
      throw InputError("shape " + shape_str(s) + " is absurdly large (over 2^40 elements)");
    n *= d;
  }
  return n;
}

Tensor::Tensor(Shape shape) : Tensor(std::move(shape), 0.0f) {}

Tensor Tensor::uninitialized(Shape shape) {
  Tensor t;
  t.shape_ = std::move(shape);
  t.numel_ = shape_numel(t.shape_);
  auto buf = std::shared_ptr<float[]>(new float[static_cast<size_t>(t.numel_ > 0 ? t.numel_ : 1)]);
  t.data_ = buf.get();
  t.storage_ = std::shared_ptr<const void>(buf, buf.get());
  return t;
}

Tensor::Tensor(Shape shape, float fill) : shape_(std::move(shape)) {
  numel_ = shape_numel(shape_);
  auto buf = std::shared_ptr<float[]>(new float[static_cast<size_t>(numel_ > 0 ? numel_ : 1)]);
  data_ = buf.get();
  storage_ = std::shared_ptr<const void>(buf, buf.get());
  if (fill == 0.0f)
    std::memset(data_, 0, sizeof(float) * static_cast<size_t>(numel_));
  else
    for (int64_t i = 0; i < numel_; ++i) data_[i] = fill;
}

Tensor Tensor::from(Shape shape, const std::vector<float>& values) {
  Tensor t(std::move(shape));
  if (static_cast<int64_t>(values.size()) != t.numel())
    throw InputError("Tensor::from: " + std::to_string(values.size()) + " values for shape " +
                     shape_str(t.shape()));
  if (!values.empty()) std::memcpy(t.data_, values.data(), values.size() * sizeof(float));
  return t;
}

Tensor Tensor::borrow(Shape shape, const float* data, std::shared_ptr<const void> owner) {
  Tensor t;
  t.shape_ = std::move(shape);
  t.numel_ = shape_numel(t.shape_);
  t.storage_ = std::move(owner);
  t.data_ = const_cast<float*>(data);  // guarded by writable_ = false
  t.writable_ = false;
  return t;
}

int64_t Tensor::size(int64_t i) const {
  int64_t d = dim();
  if (i < 0) i += d;
  if (i < 0 || i >= d)
    throw InputError("dimension " + std::to_string(i) + " out of range for shape " + shape_str(shape_));
  return shape_[static_cast<size_t>(i)];
}

float* Tensor::data() {
  if (!writable_) throw Error("tensor borrows read-only (memory-mapped) storage; clone() it first");
  return data_;
}

Tensor Tensor::clone() const {
  if (!defined()) return Tensor();
  Tensor t(shape_);
  if (numel_) std::memcpy(t.data_, data_, sizeof(float) * static_cast<size_t>(numel_));
  return t;
}

Tensor Tensor::reshape(Shape shape) const {
  if (shape_numel(shape) != numel_)
    throw InputError("cannot reshape " + shape_str(shape_) + " to " + shape_str(shape));
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

bool Tensor::has_non_finite() const {
  for (int64_t i = 0; i < numel_; ++i)
    if (!std::isfinite(data_[i])) return true;
  return false;
}

bool Tensor::has_nan() const {
  for (int64_t i = 0; i < numel_; ++i)
    if (std::isnan(data_[i])) return true;
  return false;
}

}  // namespace mixlens
