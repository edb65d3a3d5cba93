// Torch values of a `with` block straight from a DLPack capsule (issue 9 item 5): torch._C._from_dlpack
// over a capsule made here, where torch.from_numpy needed a numpy array (and its owner object) made
// first and, when the tensor dies, a deleter that takes the GIL to drop that array. The capsule's
// owner also carries EditWatch's state: its deleter is where a released value freed after an
// in-place edit is caught.
#include <bit>
#include <cstring>
#include <limits>
#include <mutex>
#include <vector>

#include <nanobind/ndarray.h>

#include "capi.h"
#include "convert.h"

namespace mixlens::py {

namespace dl = nanobind::dlpack;

namespace {

// DLManagedTensor of dlpack.h (unversioned): the struct the "dltensor" capsule points to.
struct Managed {
  dl::dltensor tensor;
  void* manager_ctx;
  void (*deleter)(Managed*);
};

constexpr size_t kUnwatched = std::numeric_limits<size_t>::max();

}  // namespace

struct WatchState {
  std::mutex mu;                      // everything below; the deleter may run on any thread
  std::vector<DlpackOwner*> watched;  // owners watched, each at its `slot`
  std::vector<std::pair<int, std::string>> freed_edits;
  DlpackOwner* held = nullptr;  // the live value's storage (hold()); cleared by its deleter
  // Released values up to this size keep a copy of their bytes (memcpy and memcmp: several times
  // faster than the checksum, and exact); larger ones a checksum (no second copy of a big value).
  size_t copy_bytes = size_t{256} << 10;
};

// One allocation per value: the struct, the Tensor it points into, its shape and strides, and
// EditWatch's record of it.
struct DlpackOwner {
  Managed managed{};
  Tensor tensor;
  std::vector<int64_t> dims;  // shape, then strides (elements)
  // Set once, while the tensor is held (no deleter can run then); the rest under watch->mu.
  std::shared_ptr<WatchState> watch;
  size_t slot = kUnwatched;
  std::unique_ptr<unsigned char[]> copy;  // the bytes at the release (up to copy_bytes), else `sum`
  uint64_t sum = 0;
  int step = 0;
  std::string path;
};

namespace {

// 64-bit checksum of the value's bytes: four lanes of 8-byte words, each word through bijective
// steps (odd multiply, rotate) and the lanes summed, so an edit within one word always changes it;
// then a bijective finalizer. Written for speed (~1 pass at memory bandwidth).
uint64_t checksum(const DlpackOwner& o) {
  constexpr uint64_t P1 = 0x9E3779B185EBCA87ULL, P2 = 0xC2B2AE3D27D4EB4FULL;
  const auto* b = reinterpret_cast<const unsigned char*>(o.tensor.data());
  const size_t bytes = sizeof(float) * static_cast<size_t>(o.tensor.numel());
  uint64_t a[4] = {P1, P2, P1 ^ P2, ~P1};
  size_t i = 0;
  for (; i + 32 <= bytes; i += 32) {
    for (int k = 0; k < 4; ++k) {
      uint64_t w;
      std::memcpy(&w, b + i + 8 * k, 8);
      a[k] = std::rotl(a[k] + w * P2, 31) * P1;
    }
  }
  uint64_t h = bytes * P1 + a[0] + std::rotl(a[1], 7) + std::rotl(a[2], 12) + std::rotl(a[3], 18);
  for (; i + 8 <= bytes; i += 8) {
    uint64_t w;
    std::memcpy(&w, b + i, 8);
    h = std::rotl(h + w * P2, 27) * P1;
  }
  if (i < bytes) {
    uint32_t w;
    std::memcpy(&w, b + i, 4);
    h = std::rotl(h + w * P2, 23) * P1;
  }
  h ^= h >> 33;
  h *= P2;
  h ^= h >> 29;
  return h;
}

size_t bytes_of(const DlpackOwner& o) { return sizeof(float) * static_cast<size_t>(o.tensor.numel()); }

// Its bytes differ from those at the release.
bool edited(const DlpackOwner& o) {
  if (o.copy) return std::memcmp(o.copy.get(), o.tensor.data(), bytes_of(o)) != 0;
  return checksum(o) != o.sum;
}

// Under w.mu.
void unwatch(WatchState& w, DlpackOwner* o) {
  DlpackOwner* last = w.watched.back();
  w.watched[o->slot] = last;
  last->slot = o->slot;
  w.watched.pop_back();
  o->slot = kUnwatched;
  o->copy.reset();
}

void watch_locked(WatchState& w, DlpackOwner* o, int step, std::string_view path) {
  const size_t bytes = bytes_of(*o);
  if (bytes <= w.copy_bytes) {
    o->copy.reset(new unsigned char[bytes]);  // uninitialized: written next
    std::memcpy(o->copy.get(), o->tensor.data(), bytes);
  } else {
    o->sum = checksum(*o);
  }
  o->step = step;
  o->path.assign(path);
  o->slot = w.watched.size();
  w.watched.push_back(o);
}

void delete_owner(Managed* m) {
  auto* o = static_cast<DlpackOwner*>(m->manager_ctx);
  if (o->watch) {
    WatchState& w = *o->watch;
    std::lock_guard<std::mutex> lk(w.mu);
    if (w.held == o) w.held = nullptr;
    if (o->slot != kUnwatched) {
      if (edited(*o)) w.freed_edits.emplace_back(o->step, std::move(o->path));
      unwatch(w, o);
    }
  }
  delete o;
}

// The capsule dies: a consumer renames it ("used_dltensor") and owns the tensor from then on; one
// never consumed still owns it here.
void capsule_destructor(PyObject* cap) {
  if (!PyCapsule_IsValid(cap, "dltensor")) return;
  auto* m = static_cast<Managed*>(PyCapsule_GetPointer(cap, "dltensor"));
  if (m != nullptr && m->deleter != nullptr) m->deleter(m);
}

}  // namespace

nb::object dlpack_over(Tensor t, DlpackOwner** owner_out) {
  if (owner_out != nullptr) *owner_out = nullptr;
  if (!t.defined()) return nb::none();
  auto owner = std::make_unique<DlpackOwner>();
  const Shape& s = t.shape();
  const size_t nd = s.size();
  owner->dims.resize(2 * nd);
  int64_t stride = 1;
  for (size_t i = nd; i-- > 0;) {
    owner->dims[i] = s[i];
    owner->dims[nd + i] = stride;
    stride *= s[i];
  }
  owner->tensor = std::move(t);
  Managed& m = owner->managed;
  m.tensor.data = owner->tensor.data();
  m.tensor.device = {1, 0};  // kDLCPU
  m.tensor.ndim = static_cast<int32_t>(nd);
  m.tensor.dtype = {static_cast<uint8_t>(dl::dtype_code::Float), 32, 1};
  m.tensor.shape = owner->dims.data();
  m.tensor.strides = owner->dims.data() + nd;
  m.tensor.byte_offset = 0;
  m.manager_ctx = owner.get();
  m.deleter = &delete_owner;
  PyObject* cap = PyCapsule_New(&m, "dltensor", &capsule_destructor);
  if (cap == nullptr) throw nb::python_error();
  if (owner_out != nullptr) *owner_out = owner.get();
  owner.release();  // the capsule (then its consumer) owns it
  return nb::steal(cap);
}

EditWatch::EditWatch() : s_(std::make_shared<WatchState>()) {}

EditWatch::~EditWatch() { clear(); }

void EditWatch::set_copy_limit(size_t bytes) {
  std::lock_guard<std::mutex> lk(s_->mu);
  s_->copy_bytes = bytes;
}

void EditWatch::hold(DlpackOwner* o) {
  o->watch = s_;
  std::lock_guard<std::mutex> lk(s_->mu);
  s_->held = o;
}

void EditWatch::release_held(nb::object& v, bool sole, int step, std::string_view path) {
  if (sole) v = nb::object();  // may run the storage's deleter (nothing else held it)
  std::lock_guard<std::mutex> lk(s_->mu);
  DlpackOwner* o = s_->held;
  s_->held = nullptr;
  // Alive: its deleter, on any thread, waits for mu before it forgets it.
  if (o != nullptr && o->slot == kUnwatched) watch_locked(*s_, o, step, path);
}

std::optional<std::pair<int, std::string>> EditWatch::take_freed_edit() {
  std::lock_guard<std::mutex> lk(s_->mu);
  if (s_->freed_edits.empty()) return std::nullopt;
  std::pair<int, std::string> first = std::move(s_->freed_edits.front());
  s_->freed_edits.clear();
  return first;
}

std::optional<std::pair<int, std::string>> EditWatch::check_alive() {
  std::lock_guard<std::mutex> lk(s_->mu);
  for (DlpackOwner* o : s_->watched) {
    if (!edited(*o)) continue;
    std::pair<int, std::string> bad{o->step, o->path};
    unwatch(*s_, o);  // reported once
    return bad;
  }
  return std::nullopt;
}

void EditWatch::clear() {
  std::lock_guard<std::mutex> lk(s_->mu);
  for (DlpackOwner* o : s_->watched) {
    o->slot = kUnwatched;
    o->copy.reset();
  }
  s_->watched.clear();
  s_->freed_edits.clear();
  s_->held = nullptr;
}

}  // namespace mixlens::py
