#include "io/weights.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <cmath>
#include <map>
#include <system_error>

#include "io/json.h"
#include "mixlens/errors.h"
#include "ops/dtype.h"
#include "ops/ops.h"

namespace fs = std::filesystem;

namespace mixlens::io {

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0u : 1u)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string closest_name(const std::string& name, const std::vector<std::string>& candidates) {
  // Beyond half the name's length a "suggestion" is just noise.
  const size_t limit = std::max<size_t>(3, name.size() / 2);
  std::string best;
  size_t best_d = limit + 1;
  for (const std::string& c : candidates) {
    // |len difference| is a lower bound on the distance: skip hopeless candidates cheaply.
    const size_t diff = c.size() > name.size() ? c.size() - name.size() : name.size() - c.size();
    if (diff >= best_d) continue;
    const size_t d = edit_distance(name, c);
    if (d < best_d || (d == best_d && c < best)) {
      best_d = d;
      best = c;
    }
  }
  return best;
}

void WeightStore::add_file(const fs::path& path) {
  files_.emplace_back(path);
  const size_t idx = files_.size() - 1;
  for (const TensorInfo& t : files_[idx].tensors()) {
    auto [it, inserted] = entries_.emplace(t.name, Entry{idx, &t});
    if (!inserted)
      throw CheckpointError("checkpoint " + folder_.string() + ": tensor '" + t.name +
                            "' is in both " + files_[it->second.file].path() + " and " + path.string());
  }
}

WeightStore WeightStore::open(const fs::path& folder) {
  std::error_code ec;
  if (!fs::exists(folder, ec))
    throw CheckpointError("model folder '" + folder.string() + "' does not exist");
  if (!fs::is_directory(folder, ec))
    throw CheckpointError("model folder '" + folder.string() + "' is not a directory");

  WeightStore ws;
  ws.folder_ = folder;
  const fs::path single = folder / "model.safetensors";
  const fs::path index = folder / "model.safetensors.index.json";

  if (fs::exists(single, ec) || fs::is_symlink(single, ec)) {
    ws.add_file(single);  // a dangling symlink (partial download) fails here with its name
    return ws;
  }

  if (fs::exists(index, ec)) {
    const nlohmann::json j = read_json_file(index, "model.safetensors.index.json", ErrorKind::Checkpoint);
    const std::string label = "model.safetensors.index.json (" + index.string() + ")";
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      throw CheckpointError(label + ": expected an object with a \"weight_map\" object");
    // shard file -> tensors the index says it holds
    std::vector<std::string> shard_order;
    std::map<std::string, std::vector<std::string>> listed;
    for (const auto& [name, shard] : j["weight_map"].items()) {
      if (!shard.is_string())
        throw CheckpointError(label + ": weight_map entry for '" + name + "' is not a file name");
      const std::string s = shard.get<std::string>();
      const fs::path rel(s);
      bool escapes = s.empty() || rel.is_absolute();
      for (const auto& part : rel)
        if (part == "..") escapes = true;
      if (escapes)
        throw CheckpointError(label + ": weight_map names shard '" + s + "' outside the folder");
      auto [it, fresh] = listed.try_emplace(s);
      if (fresh) shard_order.push_back(s);
      it->second.push_back(name);
    }
    if (shard_order.empty()) throw CheckpointError(label + ": weight_map is empty");
    std::sort(shard_order.begin(), shard_order.end());
    for (const std::string& s : shard_order) {
      const fs::path p = folder / s;
      if (!fs::exists(p, ec))
        throw CheckpointError(label + ": shard '" + s + "' does not exist (expected " + p.string() + ")");
      ws.add_file(p);
      for (const std::string& name : listed[s])
        if (!ws.files_.back().has(name))
          throw CheckpointError(label + ": lists tensor '" + name + "' in shard '" + s +
                                "', but that shard does not hold it");
    }
    return ws;
  }

  // No index: take every *.safetensors file (e.g. hand-made or older exports), in name order.
  std::vector<fs::path> found;
  for (fs::directory_iterator it(folder, ec), end; !ec && it != end; it.increment(ec)) {
    const fs::path& p = it->path();
    if (p.extension() == ".safetensors" && !it->is_directory(ec)) found.push_back(p);
  }
  if (ec) throw CheckpointError("cannot list model folder '" + folder.string() + "': " + ec.message());
  if (found.empty())
    throw CheckpointError("model folder '" + folder.string() +
                          "' has no safetensors weights (looked for model.safetensors, "
                          "model.safetensors.index.json, *.safetensors)");
  std::sort(found.begin(), found.end());
  for (const fs::path& p : found) ws.add_file(p);
  return ws;
}

bool WeightStore::has(const std::string& name) const { return entries_.count(name) != 0; }

const WeightStore::Entry& WeightStore::entry(const std::string& name) const {
  auto it = entries_.find(name);
  if (it != entries_.end()) return it->second;
  std::string msg = "tensor '" + name + "' not found in " + folder_.string() + " (" +
                    std::to_string(entries_.size()) + " tensors)";
  const std::string near = closest_name(name, names());
  if (!near.empty()) msg += "; did you mean '" + near + "'?";
  throw CheckpointError(msg);
}

const TensorInfo& WeightStore::info(const std::string& name) const { return *entry(name).info; }

std::string WeightStore::dtype_name(const std::string& name) const {
  return io::dtype_name(entry(name).info->dtype);
}

Tensor WeightStore::get(const std::string& name) const {
  return files_[entry(name).file].get_f32(name);
}

namespace {
// A NaN / inf weight poisons every output silently, and so does one whose square overflows
// float32 (|w| >= 2^64 ~ 1.8e19: any dot product or norm through it is inf).
constexpr float kMaxWeight = 0x1p64f;
void check_weight(const std::string& name, const fs::path& folder, int64_t i, float x) {
  if (std::fabs(x) < kMaxWeight) return;  // false for NaN too
  char mag[32];  // |x| in %g: a magnitude, never negative, without std::to_string's 20 digits
  std::snprintf(mag, sizeof mag, "%g", static_cast<double>(std::fabs(x)));
  const std::string what = std::isnan(x) ? "NaN" : std::isinf(x) ? (x > 0 ? "inf" : "-inf") : "a weight of magnitude " + std::string(mag);
  throw CheckpointError("tensor '" + name + "' in " + folder.string() + " contains " + what +
                        " at flat index " + std::to_string(i) +
                        " (weights must be finite with |w| < 2^64, else every value through them overflows)");
}
// Flat index of the first weight failing check_weight's bound in p[0, n), or -1. The whole-range
// test first: a loop without an early exit vectorizes, and a 9B checkpoint has 9e9 weights.
int64_t first_unbounded(const float* p, int64_t n) {
  int bad = 0;  // an int, not a bool: the loop then vectorizes
  for (int64_t i = 0; i < n; ++i) bad |= !(std::fabs(p[i]) < kMaxWeight);
  if (bad)
    for (int64_t i = 0; i < n; ++i)
      if (!(std::fabs(p[i]) < kMaxWeight)) return i;
  return -1;
}
// The same on 16-bit weights, on their bits: |w| >= 2^64 (bf16: biased exponent >= 191), inf or
// NaN. float16 tops out at 65504, so there only inf / NaN.
int64_t first_unbounded16(const uint16_t* w, int64_t n, DType t) {
  const uint16_t limit = t == DType::BF16 ? uint16_t{191 << 7} : uint16_t{0x7c00};
  int bad = 0;  // an int, not a bool: the loop then vectorizes
  for (int64_t i = 0; i < n; ++i) bad |= (w[i] & 0x7fff) >= limit;
  if (bad)
    for (int64_t i = 0; i < n; ++i)
      if ((w[i] & 0x7fff) >= limit) return i;
  return -1;
}
float widen16(uint16_t h, DType t) { return t == DType::BF16 ? ops::bf16_to_f32(h) : ops::f16_to_f32(h); }
}  // namespace

Tensor WeightStore::get(const std::string& name, const Shape& expected) const {
  const Entry& e = entry(name);
  if (e.info->shape != expected)
    throw CheckpointError("tensor '" + name + "' in " + folder_.string() + " has shape " +
                          shape_str(e.info->shape) + ", expected " + shape_str(expected) +
                          " from config.json");
  Tensor t = files_[e.file].get_f32(name);
  files_[e.file].release(name);  // copied out (or borrowed: then a no-op)
  if (const int64_t i = first_unbounded(t.begin(), t.numel()); i >= 0) check_weight(name, folder_, i, t.begin()[i]);
  return t;
}

void WeightStore::set_matmul_dtype(const std::string& dtype) {
  if (dtype != "float32" && dtype != "bfloat16" && dtype != "float16" && dtype != "int8" && dtype != "auto")
    throw InputError("dtype '" + dtype + "' is not one of float32, bfloat16, float16, int8, auto");
  matmul_dtype_ = dtype;
}

std::vector<std::string> WeightStore::matmul_dtypes_kept() const { return {kept_.begin(), kept_.end()}; }

Tensor WeightStore::get_matmul(const std::string& name, const Shape& expected) const {
  matmul_names_.insert(name);
  if (matmul_dtype_ == "float32") {
    kept_.insert("float32");
    return get(name, expected);
  }
  const Entry& e = entry(name);
  if (matmul_dtype_ == "int8") return get_int8(name, expected);
  DType target = DType::BF16;
  if (matmul_dtype_ == "float16") target = DType::F16;
  else if (matmul_dtype_ == "auto") target = e.info->dtype;
  if (target != DType::BF16 && target != DType::F16) {  // auto on F32 / F64
    kept_.insert("float32");
    return get(name, expected);
  }
  kept_.insert(target == DType::BF16 ? "bfloat16" : "float16");
  if (e.info->shape != expected) return get(name, expected);  // raises the shape error
  const mixlens::ScalarType out = target == DType::BF16 ? mixlens::ScalarType::bfloat16 : mixlens::ScalarType::float16;
  const int64_t n = shape_numel(expected);
  const auto check16 = [&](const uint16_t* w) {
    if (const int64_t i = first_unbounded16(w, n, target); i >= 0) check_weight(name, folder_, i, widen16(w[i], target));
  };
  if (e.info->dtype == target) {
    // Served from the file's mapping: no copy, the pages are the page cache's (issue 27). The check
    // below is their first touch.
    Tensor t = files_[e.file].borrow16(name);
    if (t.defined()) {  // its shape is the header's, equal to `expected` (checked above)
      check16(static_cast<const uint16_t*>(t.raw()));
      return t;
    }
  }
  std::shared_ptr<uint16_t> buf = ops::alloc_weights16(n);
  uint16_t* dst = buf.get();
  if (e.info->dtype == target) {  // not 2-byte aligned in the file: copied
    const std::span<const uint8_t> src = files_[e.file].bytes(name);
    std::memcpy(dst, src.data(), static_cast<size_t>(n) * 2);
    files_[e.file].release(name);
    check16(dst);
  } else {  // convert through float32 (checked there), rounding to nearest even
    const Tensor f = get(name, expected);
    const float* p = f.data();
    for (int64_t i = 0; i < n; ++i) dst[i] = target == DType::BF16 ? ops::f32_to_bf16(p[i]) : ops::f32_to_f16(p[i]);
    if (target == DType::F16)  // float16 overflows at 65504: a weight beyond it would be inf
      for (int64_t i = 0; i < n; ++i)
        if (!std::isfinite(ops::f16_to_f32(dst[i])))
          throw CheckpointError("tensor '" + name + "' in " + folder_.string() + " has a weight of " +
                                std::to_string(p[i]) + " at flat index " + std::to_string(i) +
                                ", beyond float16's range (load with dtype bfloat16 or float32)");
    files_[e.file].release(name, true);  // the float32 view is not kept: its file pages need not stay
  }
  return Tensor::narrow(expected, out, dst, std::shared_ptr<const void>(buf, dst));
}

Tensor WeightStore::get_int8(const std::string& name, const Shape& expected) const {
  kept_.insert("int8");
  const Entry& e = entry(name);
  if (e.info->shape != expected || expected.empty()) return get(name, expected);  // raises the shape error
  // Through float32 (the finiteness checks of get), a tile of rows at a time when the file is 16-bit
  // so a 9B checkpoint never holds a widened copy of a whole weight.
  const int64_t cols = expected.back(), rows = shape_numel(expected) / std::max<int64_t>(cols, 1);
  const auto rb = static_cast<size_t>(ops::q8_row_bytes(cols));
  auto* dst = static_cast<uint8_t*>(ops::alloc_weights(static_cast<size_t>(rows) * rb));
  std::shared_ptr<uint8_t> owner(dst, std::free);
  if (e.info->dtype == DType::BF16 || e.info->dtype == DType::F16) {
    const std::span<const uint8_t> src = files_[e.file].bytes(name);
    const DType t = e.info->dtype;
    // Tasks of ~64k weights on the pool (a 7B checkpoint quantized on one thread took 46 s). The
    // weight named in an error is the first bad one in flat order, whatever order the tasks ran in.
    const int64_t chunk = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(cols, 1));
    std::atomic<int64_t> bad{std::numeric_limits<int64_t>::max()};
    ops::parallel_for((rows + chunk - 1) / chunk, [&](int64_t task) {
      std::vector<uint16_t> h(static_cast<size_t>(cols));
      std::vector<float> row(static_cast<size_t>(cols));
      for (int64_t r = task * chunk; r < std::min(rows, (task + 1) * chunk); ++r) {
        std::memcpy(h.data(), src.data() + 2 * static_cast<size_t>(r * cols), 2 * static_cast<size_t>(cols));  // may be unaligned in the file
        if (const int64_t i = first_unbounded16(h.data(), cols, t); i >= 0) {
          int64_t seen = bad.load();
          while (r * cols + i < seen && !bad.compare_exchange_weak(seen, r * cols + i)) {
          }
          return;
        }
        for (int64_t c = 0; c < cols; ++c) row[static_cast<size_t>(c)] = widen16(h[static_cast<size_t>(c)], t);
        ops::quantize_q8_row(row.data(), cols, dst + static_cast<size_t>(r) * rb);
      }
    });
    if (const int64_t i = bad.load(); i != std::numeric_limits<int64_t>::max()) {
      uint16_t h;
      std::memcpy(&h, src.data() + 2 * static_cast<size_t>(i), 2);
      check_weight(name, folder_, i, widen16(h, t));
    }
    files_[e.file].release(name, true);
  } else {
    const Tensor f = get(name, expected);
    ops::parallel_for(rows, [&](int64_t r) {
      ops::quantize_q8_row(f.data() + r * cols, cols, dst + static_cast<size_t>(r) * rb);
    });
    files_[e.file].release(name, true);
  }
  return Tensor::narrow(expected, ScalarType::int8, dst, std::shared_ptr<const void>(owner, dst));
}

std::span<const uint8_t> WeightStore::bytes(const std::string& name) const { return files_[entry(name).file].bytes(name); }

void WeightStore::release(const std::string& name) const { files_[entry(name).file].release(name); }

std::vector<int64_t> WeightStore::get_i64(const std::string& name) const {
  return files_[entry(name).file].get_i64(name);
}

std::vector<std::string> WeightStore::names() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const auto& [k, v] : entries_) out.push_back(k);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace mixlens::io

namespace mixlens::detail {

Tensor row_block(const Tensor& t, int64_t first, Shape shape) {
  const int64_t cols = shape.back();
  auto owner = std::make_shared<const Tensor>(t);
  const void* p = static_cast<const char*>(t.raw()) + static_cast<size_t>(first * ops::row_bytes(t.dtype(), cols));
  return t.dtype() == ScalarType::float32 ? Tensor::borrow(std::move(shape), static_cast<const float*>(p), owner)
                                          : Tensor::narrow(std::move(shape), t.dtype(), p, owner);
}

Tensor transpose_conv(const Tensor& w) {
  const int64_t C = w.size(0), K = w.size(2);
  Tensor t({K, C});
  for (int64_t c = 0; c < C; ++c)
    for (int64_t k = 0; k < K; ++k) t[k * C + c] = w[c * K + k];
  return t;
}

}  // namespace mixlens::detail
