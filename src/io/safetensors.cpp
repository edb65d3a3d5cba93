#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_set>

#include "io/json.h"

#include "mixlens/errors.h"

namespace mixlens::io {

// The format is little-endian and every reader below memcpy's raw bytes into native integers.
static_assert(std::endian::native == std::endian::little, "mixlens io assumes a little-endian host");

namespace {

// Same limit as the reference implementation: real headers are a few MB at most.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// Matches shape_numel's limit, so every accepted shape can become a Tensor.
constexpr uint64_t kMaxNumel = uint64_t{1} << 40;
// Entries per file: the largest real checkpoints hold under 100k tensors in all their shards.
constexpr size_t kMaxTensors = 1'000'000;

const char* json_type_name(const nlohmann::json& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::null: return "null";
    case nlohmann::json::value_t::boolean: return "a boolean";
    case nlohmann::json::value_t::string: return "a string";
    case nlohmann::json::value_t::array: return "an array";
    case nlohmann::json::value_t::object: return "an object";
    case nlohmann::json::value_t::number_float: return "a float";
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned: return "an integer";
    default: return "an unsupported value";
  }
}

[[noreturn]] void fail(const std::string& label, const std::string& problem) {
  throw CheckpointError("safetensors file '" + label + "': " + problem);
}

// Reads a JSON value as a non-negative integer, or fails with `what` describing the field.
uint64_t as_u64(const nlohmann::json& v, const std::string& label, const std::string& what) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer()) {
    fail(label, what + " is negative (" + std::to_string(v.get<int64_t>()) + ")");
  }
  fail(label, what + " is " + json_type_name(v) + ", expected a non-negative integer");
}

// The one allowed view of bytes inside a file image: bounds were checked at parse time.
template <class T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

struct Mapping {
  void* addr = nullptr;
  size_t size = 0;
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (addr) munmap(addr, size);
  }
  const uint8_t* data() const { return static_cast<const uint8_t*>(addr); }
};

std::string errno_text() { return std::strerror(errno); }

// Thrown by the key hook to stop a parse at kMaxTensors entries (turned into a CheckpointError).
struct TooManyEntries {};

// The header as a DOM (linear time, depth-bounded); depth errors name the file like every other.
nlohmann::json json_bounded(const char* begin, const char* end, const std::string& label,
                            const std::function<void(size_t, const std::string&)>& on_key) {
  try {
    return parse_json_bounded(begin, end, "header", ErrorKind::Checkpoint, on_key);
  } catch (const CheckpointError& e) {
    fail(label, e.what());
  }
}

}  // namespace

const char* dtype_name(DType d) {
  switch (d) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::F64: return "F64";
    case DType::I64: return "I64";
    case DType::I32: return "I32";
    case DType::I16: return "I16";
    case DType::I8: return "I8";
    case DType::U8: return "U8";
    case DType::BOOL: return "BOOL";
  }
  return "?";
}

size_t dtype_size(DType d) {
  switch (d) {
    case DType::F64:
    case DType::I64: return 8;
    case DType::F32:
    case DType::I32: return 4;
    case DType::F16:
    case DType::BF16:
    case DType::I16: return 2;
    case DType::I8:
    case DType::U8:
    case DType::BOOL: return 1;
  }
  return 1;
}

bool parse_dtype(std::string_view name, DType* out) {
  static const std::pair<std::string_view, DType> kNames[] = {
      {"F32", DType::F32}, {"F16", DType::F16}, {"BF16", DType::BF16}, {"F64", DType::F64},
      {"I64", DType::I64}, {"I32", DType::I32}, {"I16", DType::I16},   {"I8", DType::I8},
      {"U8", DType::U8},   {"BOOL", DType::BOOL}};
  for (const auto& [n, d] : kNames) {
    if (n == name) {
      *out = d;
      return true;
    }
  }
  return false;
}

float f64_to_f32(double v) {
  // FLT_MAX + half an ulp: at or beyond it round-to-nearest gives inf; casting there would be UB.
  constexpr double kOverflow = 0x1.ffffffp127;
  if (v >= kOverflow) return std::numeric_limits<float>::infinity();
  if (v <= -kOverflow) return -std::numeric_limits<float>::infinity();
  return static_cast<float>(v);
}

// ---------------------------------------------------------------------------------------------
// Header parsing

SafetensorsHeader SafetensorsFile::parse_header(const uint8_t* data, size_t size,
                                                const std::string& label) {
  if (size < 8)
    fail(label, "file is only " + std::to_string(size) +
                    " bytes; a safetensors file starts with an 8-byte header length");
  const uint64_t header_len = load<uint64_t>(data);
  if (header_len > kMaxHeaderBytes)
    fail(label, "header length " + std::to_string(header_len) + " is absurd (limit " +
                    std::to_string(kMaxHeaderBytes) + " bytes); the file is corrupt or not safetensors");
  if (header_len > size - 8)
    fail(label, "header length " + std::to_string(header_len) + " runs past the end of the file (" +
                    std::to_string(size) + " bytes); the file is truncated or corrupt");
  if (header_len == 0) fail(label, "header is empty (length 0)");

  const char* text = reinterpret_cast<const char*>(data + 8);
  // Duplicate top-level keys would silently shadow each other in nlohmann; catch them during the
  // parse (depth 1 = keys of the top-level object), and stop at kMaxTensors entries.
  std::string duplicate;
  bool have_duplicate = false;
  std::unordered_set<std::string> seen;
  auto on_key = [&](size_t depth, const std::string& k) {
    if (depth != 1) return;
    if (!seen.insert(k).second && !have_duplicate) {
      have_duplicate = true;
      duplicate = k;
    }
    if (seen.size() > kMaxTensors) throw TooManyEntries{};
  };
  nlohmann::json header;
  try {
    header = json_bounded(text, text + header_len, label, on_key);
  } catch (const nlohmann::json::exception& e) {
    fail(label, std::string("header is not valid JSON: ") + e.what());
  } catch (const TooManyEntries&) {
    fail(label, "header has more than " + std::to_string(kMaxTensors) + " entries (the limit per file)");
  }
  if (!header.is_object())
    fail(label, std::string("header is ") + json_type_name(header) + ", expected a JSON object");
  if (have_duplicate) fail(label, "header names tensor '" + duplicate + "' twice");

  SafetensorsHeader out;
  out.data_start = 8 + header_len;
  const uint64_t data_size = size - out.data_start;

  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object())
        fail(label, std::string("__metadata__ is ") + json_type_name(entry) +
                        ", expected an object of strings");
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string())
          fail(label, "__metadata__ value for '" + k + "' is " + json_type_name(v) +
                          ", expected a string");
        out.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    const std::string where = "tensor '" + name + "'";
    if (!entry.is_object())
      fail(label, where + " is " + json_type_name(entry) + ", expected an object");

    TensorInfo info;
    info.name = name;
    info.file = label;

    auto dt = entry.find("dtype");
    if (dt == entry.end()) fail(label, where + " has no 'dtype'");
    if (!dt->is_string()) fail(label, where + " has a 'dtype' that is " + json_type_name(*dt));
    if (!parse_dtype(dt->get_ref<const std::string&>(), &info.dtype))
      fail(label, where + " has unknown dtype '" + dt->get<std::string>() +
                      "' (mixlens reads F32, F16, BF16, F64, I64, I32, I16, I8, U8, BOOL)");

    auto sh = entry.find("shape");
    if (sh == entry.end()) fail(label, where + " has no 'shape'");
    if (!sh->is_array()) fail(label, where + " has a 'shape' that is " + json_type_name(*sh));
    uint64_t numel = 1;
    for (size_t i = 0; i < sh->size(); ++i) {
      const uint64_t d = as_u64((*sh)[i], label, where + " shape dimension " + std::to_string(i));
      if (d > kMaxNumel || (d != 0 && numel > kMaxNumel / d))
        fail(label, where + " has an absurd shape (over 2^40 elements)");
      numel *= d;
      info.shape.push_back(static_cast<int64_t>(d));
    }

    auto off = entry.find("data_offsets");
    if (off == entry.end()) fail(label, where + " has no 'data_offsets'");
    // Describe rather than dump the value: a hostile one may be huge or deeply nested.
    if (!off->is_array())
      fail(label, where + " has 'data_offsets' that is " + json_type_name(*off) + ", expected [begin, end]");
    if (off->size() != 2)
      fail(label, where + " has 'data_offsets' with " + std::to_string(off->size()) +
                      " elements, expected [begin, end]");
    const uint64_t begin = as_u64((*off)[0], label, where + " data_offsets[0]");
    const uint64_t end = as_u64((*off)[1], label, where + " data_offsets[1]");
    if (end < begin)
      fail(label, where + " has reversed data_offsets [" + std::to_string(begin) + ", " +
                      std::to_string(end) + "]");
    if (end > data_size)
      fail(label, where + " has data_offsets [" + std::to_string(begin) + ", " +
                      std::to_string(end) + "] past the end of the data section (" +
                      std::to_string(data_size) + " bytes); the file is truncated or corrupt");
    info.nbytes = end - begin;
    const uint64_t expected = numel * dtype_size(info.dtype);  // <= 2^43, no overflow
    if (info.nbytes != expected)
      fail(label, where + " holds " + std::to_string(info.nbytes) + " bytes but dtype " +
                      dtype_name(info.dtype) + " and shape " + shape_str(info.shape) + " need " +
                      std::to_string(expected));
    info.offset = out.data_start + begin;
    out.tensors.push_back(std::move(info));
  }

  // The data section must be tiled exactly: no overlap (aliasing), no gap, nothing left over.
  std::sort(out.tensors.begin(), out.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.offset != b.offset ? a.offset < b.offset : a.nbytes < b.nbytes;
  });
  uint64_t cursor = out.data_start;
  const TensorInfo* prev = nullptr;
  for (const TensorInfo& t : out.tensors) {
    if (t.offset < cursor)
      fail(label, "tensor '" + t.name + "' overlaps tensor '" + (prev ? prev->name : "") +
                      "' (data offset " + std::to_string(t.offset - out.data_start) +
                      " < previous end " + std::to_string(cursor - out.data_start) + ")");
    if (t.offset > cursor)
      fail(label, "gap in the data section before tensor '" + t.name + "' (data offset " +
                      std::to_string(t.offset - out.data_start) + ", expected " +
                      std::to_string(cursor - out.data_start) + ")");
    cursor = t.offset + t.nbytes;
    prev = &t;
  }
  if (cursor != size)
    fail(label, "data section has " + std::to_string(data_size) + " bytes but the tensors cover " +
                    std::to_string(cursor - out.data_start) + "; the file is corrupt");
  return out;
}

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

struct SafetensorsFile::State {
  std::string path;
  std::shared_ptr<const Mapping> mapping;
  SafetensorsHeader header;
  std::unordered_map<std::string, size_t> index;  // name -> position in header.tensors
};

SafetensorsFile::SafetensorsFile(const std::filesystem::path& path) {
  auto st = std::make_shared<State>();
  st->path = path.string();
  const std::string& label = st->path;

  // O_NONBLOCK: opening a FIFO would otherwise wait for a writer forever; fstat refuses it below.
  int fd = ::open(label.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    if (errno == ENOENT) throw CheckpointError("safetensors file '" + label + "' does not exist");
    throw CheckpointError("cannot open safetensors file '" + label + "': " + errno_text());
  }
  struct stat sb {};
  if (fstat(fd, &sb) != 0) {
    const std::string err = errno_text();
    ::close(fd);
    throw CheckpointError("cannot stat safetensors file '" + label + "': " + err);
  }
  if (!S_ISREG(sb.st_mode)) {
    ::close(fd);
    fail(label, "is not a regular file (a folder, FIFO, device or socket); refused");
  }
  const size_t size = static_cast<size_t>(sb.st_size);
  auto mapping = std::make_shared<Mapping>();
  if (size < 8) {
    ::close(fd);
    fail(label, "file is only " + std::to_string(size) +
                    " bytes; a safetensors file starts with an 8-byte header length");
  }
  void* addr = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const std::string mmap_err = addr == MAP_FAILED ? errno_text() : "";
  ::close(fd);  // the mapping stays valid without the descriptor
  if (addr == MAP_FAILED) throw CheckpointError("cannot mmap safetensors file '" + label + "': " + mmap_err);
#ifdef MADV_HUGEPAGE
  // 16-bit weights are multiplied from this mapping: pages the kernel reads in after this advice come
  // as 2 MiB folios (ext4, xfs), mapped by one TLB entry each; decode streams 25 -> 35 GB/s here.
  (void)madvise(addr, size, MADV_HUGEPAGE);  // advice only: failure is harmless
#endif
  mapping->addr = addr;
  mapping->size = size;
  st->mapping = mapping;

  st->header = parse_header(mapping->data(), size, label);
  for (size_t i = 0; i < st->header.tensors.size(); ++i) st->index.emplace(st->header.tensors[i].name, i);
  state_ = std::move(st);
}

const std::string& SafetensorsFile::path() const { return state_->path; }
const std::map<std::string, std::string>& SafetensorsFile::metadata() const {
  return state_->header.metadata;
}
const std::vector<TensorInfo>& SafetensorsFile::tensors() const { return state_->header.tensors; }
bool SafetensorsFile::has(const std::string& name) const { return state_->index.count(name) != 0; }

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  auto it = state_->index.find(name);
  if (it == state_->index.end())
    throw CheckpointError("tensor '" + name + "' is not in safetensors file '" + state_->path + "'");
  return state_->header.tensors[it->second];
}

std::span<const uint8_t> SafetensorsFile::bytes(const std::string& name) const {
  const TensorInfo& t = info(name);
  return {state_->mapping->data() + t.offset, static_cast<size_t>(t.nbytes)};
}

void SafetensorsFile::release(const std::string& name, bool borrowed_too) const {
  const TensorInfo& t = info(name);
  const uint8_t* src = state_->mapping->data() + t.offset;
  if (t.nbytes == 0) return;
  if (!borrowed_too && t.dtype == DType::F32 && reinterpret_cast<uintptr_t>(src) % alignof(float) == 0) return;
  // Whole pages around the tensor: a neighbour sharing an edge page just faults it in again.
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t lo = reinterpret_cast<uintptr_t>(src) & ~(page - 1);
  const uintptr_t hi = reinterpret_cast<uintptr_t>(src) + static_cast<uintptr_t>(t.nbytes);
  madvise(reinterpret_cast<void*>(lo), static_cast<size_t>(hi - lo), MADV_DONTNEED);  // advice: failure is harmless
}

Tensor SafetensorsFile::borrow16(const std::string& name) const {
  const TensorInfo& t = info(name);
  if (t.dtype != DType::BF16 && t.dtype != DType::F16)
    throw CheckpointError("tensor '" + name + "' in '" + state_->path + "' is " + dtype_name(t.dtype) +
                          ", not bfloat16 / float16");
  const uint8_t* src = state_->mapping->data() + t.offset;
  if (t.nbytes == 0 || reinterpret_cast<uintptr_t>(src) % alignof(uint16_t) != 0) return {};
  std::shared_ptr<const void> owner(state_->mapping, src);
  return Tensor::narrow(t.shape, t.dtype == DType::BF16 ? ScalarType::bfloat16 : ScalarType::float16, src,
                        std::move(owner));
}

Tensor SafetensorsFile::get_f32(const std::string& name) const {
  const TensorInfo& t = info(name);
  const uint8_t* src = state_->mapping->data() + t.offset;
  const size_t n = static_cast<size_t>(t.nbytes / dtype_size(t.dtype));
  if (t.dtype == DType::F32 && n > 0 &&
      reinterpret_cast<uintptr_t>(src) % alignof(float) == 0) {
    // Aliasing constructor: the tensor co-owns the mapping, so the file stays mapped.
    std::shared_ptr<const void> owner(state_->mapping, src);
    return Tensor::borrow(t.shape, reinterpret_cast<const float*>(src), std::move(owner));
  }
  // Every element is written below: no zero fill; weights live as long as the model, so they
  // bypass the activation arena (and get huge pages: Tensor::weight).
  Tensor out = Tensor::weight(t.shape);
  if (n == 0) return out;
  float* dst = out.data();
  switch (t.dtype) {
    case DType::F32:
      std::memcpy(dst, src, n * sizeof(float));
      break;
    case DType::BF16:
      for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(load<uint16_t>(src + 2 * i));
      break;
    case DType::F16:
      for (size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(load<uint16_t>(src + 2 * i));
      break;
    case DType::F64:
      for (size_t i = 0; i < n; ++i) dst[i] = f64_to_f32(load<double>(src + 8 * i));
      break;
    default:
      throw CheckpointError("tensor '" + name + "' in '" + state_->path + "' has dtype " +
                            dtype_name(t.dtype) + ", expected a float dtype (F32, BF16, F16, F64)");
  }
  return out;
}

std::vector<int64_t> SafetensorsFile::get_i64(const std::string& name) const {
  const TensorInfo& t = info(name);
  const uint8_t* src = state_->mapping->data() + t.offset;
  const size_t n = static_cast<size_t>(t.nbytes / dtype_size(t.dtype));
  std::vector<int64_t> out(n);
  switch (t.dtype) {
    case DType::I64:
      for (size_t i = 0; i < n; ++i) out[i] = load<int64_t>(src + 8 * i);
      break;
    case DType::I32:
      for (size_t i = 0; i < n; ++i) out[i] = load<int32_t>(src + 4 * i);
      break;
    case DType::I16:
      for (size_t i = 0; i < n; ++i) out[i] = load<int16_t>(src + 2 * i);
      break;
    case DType::I8:
      for (size_t i = 0; i < n; ++i) out[i] = load<int8_t>(src + i);
      break;
    case DType::U8:
    case DType::BOOL:
      for (size_t i = 0; i < n; ++i) out[i] = src[i];
      break;
    default:
      throw CheckpointError("tensor '" + name + "' in '" + state_->path + "' has dtype " +
                            dtype_name(t.dtype) + ", expected an integer dtype (I64, I32, ...)");
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Writing

void write_safetensors_streamed(const std::filesystem::path& path, const std::vector<StreamedTensor>& tensors,
                                const std::map<std::string, std::string>& metadata) {
  std::set<std::string> names;
  for (const auto& t : tensors) {
    if (t.name == "__metadata__") throw InputError("write_safetensors: '__metadata__' is a reserved name");
    if (!names.insert(t.name).second) throw InputError("write_safetensors: duplicate tensor name '" + t.name + "'");
  }
  std::vector<const StreamedTensor*> order;
  for (const auto& t : tensors) order.push_back(&t);
  std::stable_sort(order.begin(), order.end(), [](const StreamedTensor* a, const StreamedTensor* b) {
    return dtype_size(a->dtype) > dtype_size(b->dtype);
  });
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    auto& m = header["__metadata__"] = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
  }
  // Offsets in layout order; header entries in the order given.
  std::map<const StreamedTensor*, std::pair<uint64_t, uint64_t>> span;
  uint64_t pos = 0;
  for (const StreamedTensor* t : order) {
    const uint64_t nb = static_cast<uint64_t>(shape_numel(t->shape)) * dtype_size(t->dtype);
    span[t] = {pos, pos + nb};
    pos += nb;
  }
  for (const auto& t : tensors) {
    nlohmann::ordered_json e = nlohmann::ordered_json::object();
    e["dtype"] = dtype_name(t.dtype);
    e["shape"] = t.shape;
    e["data_offsets"] = {span[&t].first, span[&t].second};
    header[t.name] = std::move(e);
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    throw InputError(std::string("write_safetensors: names and metadata must be valid UTF-8: ") + e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');

  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) throw CheckpointError("cannot write safetensors file '" + path.string() + "': " + errno_text());
  const uint64_t len = text.size();
  f.write(reinterpret_cast<const char*>(&len), 8);
  f.write(text.data(), static_cast<std::streamsize>(text.size()));
  std::vector<uint8_t> buf;
  for (const StreamedTensor* t : order) {
    buf.resize(span[t].second - span[t].first);  // fill writes every byte
    t->fill(buf.data());
    f.write(reinterpret_cast<const char*>(buf.data()), static_cast<std::streamsize>(buf.size()));
  }
  f.close();
  if (!f) throw CheckpointError("error while writing safetensors file '" + path.string() + "'");
}

void write_safetensors(const std::filesystem::path& path,
                       const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata,
                       const std::vector<std::pair<std::string, I64Tensor>>& i64_tensors) {
  std::vector<StreamedTensor> all;
  for (const auto& [n, t] : tensors) {
    if (!t.defined()) throw InputError("write_safetensors: tensor '" + n + "' is undefined");
    all.push_back({n, DType::F32, t.shape(), [&t = t](uint8_t* dst) { std::memcpy(dst, t.data(), static_cast<size_t>(t.numel()) * 4); }});
  }
  for (const auto& [n, t] : i64_tensors) {
    if (static_cast<uint64_t>(shape_numel(t.shape)) != t.values.size())
      throw InputError("write_safetensors: I64 tensor '" + n + "' has " + std::to_string(t.values.size()) +
                       " values for shape " + shape_str(t.shape));
    all.push_back({n, DType::I64, t.shape, [&t = t](uint8_t* dst) { std::memcpy(dst, t.values.data(), t.values.size() * 8); }});
  }
  write_safetensors_streamed(path, all, metadata);
}

}  // namespace mixlens::io
