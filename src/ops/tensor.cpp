#include "mixlens/tensor.h"

#include <sys/mman.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>

#include "mixlens/errors.h"
#include "ops/arena.h"
#include "ops/dtype.h"

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
  // 64-byte aligned (whole cache lines): the scans write the `states` stacks with streaming stores,
  // which need aligned addresses (new float[] gives 16).
  const size_t bytes = (sizeof(float) * static_cast<size_t>(t.numel_ > 0 ? t.numel_ : 1) + 63) / 64 * 64;
  if (bytes >= detail::kBigMinBytes) {  // the `states` stacks: reuse freed blocks' pages (ops/arena.h)
    void* p = nullptr;
    t.storage_ = detail::big_alloc(bytes, &p);
    t.data_ = p;
    return t;
  }
#ifndef MIXLENS_ARENA_OFF
  if (bytes >= detail::kArenaMinBytes) {
    // The activation pool (64-byte aligned there too): a forward's buffers reuse the pages of the
    // previous layer / call, where malloc mapped and faulted fresh ones.
    float* p = nullptr;
    t.storage_ = detail::arena_alloc(t.numel_, &p);
    t.data_ = p;
    return t;
  }
#endif
  void* p = std::aligned_alloc(64, bytes);
  if (!p) throw std::bad_alloc();
  t.data_ = static_cast<float*>(p);
  t.storage_ = std::shared_ptr<const void>(p, [](const void* q) { std::free(const_cast<void*>(q)); });
  return t;
}

Tensor::Tensor(Shape shape, float fill) : shape_(std::move(shape)) {
  numel_ = shape_numel(shape_);
  float* buf = nullptr;
  storage_ = detail::arena_alloc(numel_, &buf);  // large buffers recycle pages (ops/arena.h)
  data_ = buf;
  if (fill == 0.0f)
    std::memset(buf, 0, sizeof(float) * static_cast<size_t>(numel_));
  else
    for (int64_t i = 0; i < numel_; ++i) buf[i] = fill;
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
  return read_only_view(std::move(shape), ScalarType::float32, data, std::move(owner));
}

Tensor Tensor::narrow(Shape shape, ScalarType dtype, const void* data, std::shared_ptr<const void> owner) {
  if (dtype == ScalarType::float32) throw InputError("Tensor::narrow: dtype must be bfloat16, float16 or int8");
  return read_only_view(std::move(shape), dtype, data, std::move(owner));
}

Tensor Tensor::read_only_view(Shape shape, ScalarType dtype, const void* data, std::shared_ptr<const void> owner) {
  Tensor t;
  t.shape_ = std::move(shape);
  t.numel_ = shape_numel(t.shape_);
  t.storage_ = std::move(owner);
  t.data_ = const_cast<void*>(data);  // guarded by writable_ = false
  t.writable_ = false;
  t.dtype_ = dtype;
  return t;
}

namespace ops {
void* alloc_weights(size_t bytes) {
  bytes = bytes > 0 ? bytes : 1;
  const size_t align = bytes >= (size_t{4} << 20) ? (size_t{2} << 20) : 64;
  const size_t total = (bytes + align - 1) / align * align;
  void* p = std::aligned_alloc(align, total);
  if (!p) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  if (align > 64) madvise(p, total, MADV_HUGEPAGE);  // advice only: failure is harmless
#endif
  return p;
}

std::shared_ptr<uint16_t> alloc_weights16(int64_t n) {
  void* p = alloc_weights(static_cast<size_t>(n > 0 ? n : 1) * 2);
  return std::shared_ptr<uint16_t>(static_cast<uint16_t*>(p), std::free);
}
}  // namespace ops

Tensor Tensor::weight(Shape shape) {
  Tensor t;
  t.shape_ = std::move(shape);
  t.numel_ = shape_numel(t.shape_);
  void* p = ops::alloc_weights(sizeof(float) * static_cast<size_t>(t.numel_));
  t.data_ = p;
  t.storage_ = std::shared_ptr<const void>(p, [](const void* q) { std::free(const_cast<void*>(q)); });
  return t;
}

const char* dtype_str(ScalarType d) {
  switch (d) {
    case ScalarType::float32: return "float32";
    case ScalarType::bfloat16: return "bfloat16";
    case ScalarType::float16: return "float16";
    case ScalarType::int8: return "int8";
  }
  return "?";
}

void Tensor::not_f32() const {
  throw Error(std::string("tensor ") + shape_str(shape_) + " holds " + dtype_str(dtype_) +
              " weights, not float32 (a narrow matmul weight; use to_f32())");
}

Tensor Tensor::to_f32() const {
  if (!defined() || dtype_ == ScalarType::float32) return *this;
  Tensor t(shape_);
  const int64_t cols = shape_.empty() ? 1 : shape_.back();
  if (numel_ > 0) ops::widen_rows(*this, 0, numel_ / cols, t.data());
  return t;
}

int64_t Tensor::nbytes() const {
  const int64_t cols = shape_.empty() ? 1 : shape_.back();
  return cols == 0 ? 0 : numel_ / cols * ops::row_bytes(dtype_, cols);
}

std::vector<float> Tensor::to_vector() const {
  const Tensor f = to_f32();
  return std::vector<float>(f.begin(), f.end());
}

int64_t Tensor::size(int64_t i) const {
  int64_t d = dim();
  if (i < 0) i += d;
  if (i < 0 || i >= d)
    throw InputError("dimension " + std::to_string(i) + " out of range for shape " + shape_str(shape_));
  return shape_[static_cast<size_t>(i)];
}

void Tensor::not_writable_f32() const {
  if (dtype_ != ScalarType::float32) not_f32();
  throw Error("tensor borrows read-only (memory-mapped) storage; clone() it first");
}

Tensor Tensor::clone() const {
  if (!defined()) return Tensor();
  if (dtype_ != ScalarType::float32) {
    const auto n = static_cast<size_t>(nbytes());
    auto buf = std::shared_ptr<uint8_t[]>(new uint8_t[n > 0 ? n : 1]);
    if (n) std::memcpy(buf.get(), data_, n);
    return narrow(shape_, dtype_, buf.get(), std::shared_ptr<const void>(buf, buf.get()));
  }
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
  const Tensor f = to_f32();
  for (float v : f)
    if (!std::isfinite(v)) return true;
  return false;
}

bool Tensor::has_nan() const {
  const Tensor f = to_f32();
  for (float v : f)
    if (std::isnan(v)) return true;
  return false;
}

}  // namespace mixlens
