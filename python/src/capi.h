// Python C-API pieces outside nanobind shared by the binding files: heap types (numpy_array.cpp,
// session.cpp), DLPack capsules over Tensors (dlpack.cpp, torch values of a `with` block) and the
// in-place edit watch of released values (edit_watch.cpp).
#pragma once
#include <nanobind/nanobind.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "mixlens/tensor.h"

namespace mixlens::py {

struct WatchState;

/// EditWatch's record of one value's storage, kept by the object that owns it (the DLPack owner of a
/// torch value, the base object of a numpy one) and handed to watch_record_freed() by that owner's
/// deleter. A value handed out in a `with` block has one.
struct WatchRecord {
  const Tensor* tensor = nullptr;  // the bytes (the owner's Tensor)
  // Set once, while the value is held (no deleter can run then); the rest under watch's mutex.
  std::shared_ptr<WatchState> watch;
  size_t slot = SIZE_MAX;                 // index in the watched list; SIZE_MAX: not watched
  std::unique_ptr<unsigned char[]> copy;  // the bytes at the release (small values), else `sum`
  uint64_t sum = 0;
  int step = 0;
  std::string path;
};

/// The storage behind `r` is about to be freed (any thread, GIL or not): a watched value edited since
/// its release is noted for EditWatch::take_freed_edit().
void watch_record_freed(WatchRecord& r);

/// A DLPack capsule ("dltensor", the protocol's unversioned form that torch._C._from_dlpack takes)
/// over `t`'s float32 CPU storage, which it keeps alive until the consumer's deleter runs (from any
/// thread, GIL or not: it never touches Python). Pass a tensor nobody else writes (a clone). None
/// for an undefined tensor. `record`: set to the storage's WatchRecord. Needs the GIL.
nanobind::object dlpack_over(Tensor t, WatchRecord** record = nullptr);

/// In-place edits of released values of one `with` block (issue 10 item 2, issue 9 item 5), caught
/// by the bytes rather than torch's version counter or numpy's read-only flag, so writes through
/// numpy views made before the release, `.numpy()`, `.data` or DLPack re-exports count too: the
/// value's bytes at its release (a copy up to 256 KiB by default, exact; above, a 64-bit checksum,
/// which always changes when the edit stays within one 8-byte word, e.g. any single-element edit, and
/// misses any other edit with probability ~2^-64), compared at check_alive() (the next step, the end
/// of the block) and, for a value freed before that, by the storage's deleter (any thread, no GIL).
/// O(1) per value read; O(bytes) per released value. edit_watch.cpp.
class EditWatch {
 public:
  EditWatch();
  ~EditWatch();
  EditWatch(const EditWatch&) = delete;
  EditWatch& operator=(const EditWatch&) = delete;
  /// Values up to `bytes` keep a copy (default 256 KiB), larger ones a checksum; for values watched
  /// from now on.
  void set_copy_limit(size_t bytes);
  /// `r` (just made, its value held) is the live value's storage: released by release_held().
  /// Its deleter forgets it (an in-place `set_` or `.data =` may free it while the value lives).
  void hold(WatchRecord* r);
  /// The live value is released: drops `v` (the value) first when `sole` (nobody else references
  /// it from Python), then watches the held storage from its bytes now if it is still alive (held
  /// by `v`, a view, a numpy view or a re-export of its memory); (step, path) name it in errors.
  void release_held(nanobind::object& v, bool sole, int step, std::string_view path);
  /// The (step, path) of a watched value edited and then freed since the last call (first one).
  std::optional<std::pair<int, std::string>> take_freed_edit();
  /// Compares every watched value still alive with its bytes at the release: the first edited one,
  /// unwatched.
  std::optional<std::pair<int, std::string>> check_alive();
  /// Stops watching every value (the block ends); forgets freed edits not taken.
  void clear();

 private:
  std::shared_ptr<WatchState> s_;
};

/// A heap type made once from `slots` (Py_TPFLAGS_DEFAULT); throws the Python error if it cannot be
/// made. Callers keep it for the life of the process (a function-local static).
inline PyTypeObject* new_heap_type(const char* name, int basicsize, PyType_Slot* slots) {
  PyType_Spec spec = {name, basicsize, 0, Py_TPFLAGS_DEFAULT, slots};
  PyObject* t = PyType_FromSpec(&spec);
  if (t == nullptr) throw nanobind::python_error();
  return reinterpret_cast<PyTypeObject*>(t);
}

/// tp_dealloc tail for those types' instances: free the object, drop the reference every instance of
/// a heap type holds to its type.
inline void free_heap_object(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);
}

}  // namespace mixlens::py
