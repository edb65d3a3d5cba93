// EditWatch (capi.h): in-place edits of the released values of a `with` block, caught by their
// bytes (issue 10 item 2, issue 9 item 5). The objects that own a value's storage (dlpack.cpp's
// capsule owner, numpy_array.cpp's array base) keep a WatchRecord and report it here when freed.
#include <bit>
#include <cstring>
#include <mutex>
#include <vector>

#include "capi.h"

namespace mixlens::py {

namespace nb = nanobind;

namespace {
constexpr size_t kUnwatched = SIZE_MAX;
}  // namespace

struct WatchState {
  std::mutex mu;                      // everything below; the deleter may run on any thread
  std::vector<WatchRecord*> watched;  // records watched, each at its `slot`
  std::vector<std::pair<int, std::string>> freed_edits;
  WatchRecord* held = nullptr;  // the live value's storage (hold()); cleared by its deleter
  // Released values up to this size keep a copy of their bytes (memcpy and memcmp: several times
  // faster than the checksum, and exact); larger ones a checksum (no second copy of a big value).
  size_t copy_bytes = size_t{256} << 10;
};

namespace {

// 64-bit checksum of the value's bytes: four lanes of 8-byte words, each word through bijective
// steps (odd multiply, rotate) and the lanes summed, so an edit within one word always changes it;
// then a bijective finalizer. Written for speed (~1 pass at memory bandwidth).
uint64_t checksum(const WatchRecord& o) {
  constexpr uint64_t P1 = 0x9E3779B185EBCA87ULL, P2 = 0xC2B2AE3D27D4EB4FULL;
  const auto* b = reinterpret_cast<const unsigned char*>(o.tensor->data());
  const size_t bytes = sizeof(float) * static_cast<size_t>(o.tensor->numel());
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

size_t bytes_of(const WatchRecord& o) { return sizeof(float) * static_cast<size_t>(o.tensor->numel()); }

// Its bytes differ from those at the release.
bool edited(const WatchRecord& o) {
  if (o.copy) return std::memcmp(o.copy.get(), o.tensor->data(), bytes_of(o)) != 0;
  return checksum(o) != o.sum;
}

// Under w.mu.
void unwatch(WatchState& w, WatchRecord* o) {
  WatchRecord* last = w.watched.back();
  w.watched[o->slot] = last;
  last->slot = o->slot;
  w.watched.pop_back();
  o->slot = kUnwatched;
  o->copy.reset();
}

void watch_locked(WatchState& w, WatchRecord* o, int step, std::string_view path) {
  const size_t bytes = bytes_of(*o);
  if (bytes <= w.copy_bytes) {
    o->copy.reset(new unsigned char[bytes]);  // uninitialized: written next
    std::memcpy(o->copy.get(), o->tensor->data(), bytes);
  } else {
    o->sum = checksum(*o);
  }
  o->step = step;
  o->path.assign(path);
  o->slot = w.watched.size();
  w.watched.push_back(o);
}

}  // namespace

void watch_record_freed(WatchRecord& r) {
  if (!r.watch) return;
  WatchState& w = *r.watch;
  std::lock_guard<std::mutex> lk(w.mu);
  if (w.held == &r) w.held = nullptr;
  if (r.slot != kUnwatched) {
    if (edited(r)) w.freed_edits.emplace_back(r.step, std::move(r.path));
    unwatch(w, &r);
  }
}

EditWatch::EditWatch() : s_(std::make_shared<WatchState>()) {}

EditWatch::~EditWatch() { clear(); }

void EditWatch::set_copy_limit(size_t bytes) {
  std::lock_guard<std::mutex> lk(s_->mu);
  s_->copy_bytes = bytes;
}

void EditWatch::hold(WatchRecord* o) {
  o->watch = s_;
  std::lock_guard<std::mutex> lk(s_->mu);
  s_->held = o;
}

void EditWatch::release_held(nb::object& v, bool sole, int step, std::string_view path) {
  if (sole) v = nb::object();  // may run the storage's deleter (nothing else held it)
  std::lock_guard<std::mutex> lk(s_->mu);
  WatchRecord* o = s_->held;
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
  for (WatchRecord* o : s_->watched) {
    if (!edited(*o)) continue;
    std::pair<int, std::string> bad{o->step, o->path};
    unwatch(*s_, o);  // reported once
    return bad;
  }
  return std::nullopt;
}

void EditWatch::clear() {
  std::lock_guard<std::mutex> lk(s_->mu);
  for (WatchRecord* o : s_->watched) {
    o->slot = kUnwatched;
    o->copy.reset();
  }
  s_->watched.clear();
  s_->freed_edits.clear();
  s_->held = nullptr;
}

}  // namespace mixlens::py
