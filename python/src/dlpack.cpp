// Torch values of a `with` block straight from a DLPack capsule (issue 9 item 5): torch._C._from_dlpack
// over a capsule made here, where torch.from_numpy needed a numpy array (and its owner object) made
// first and, when the tensor dies, a deleter that takes the GIL to drop that array. The capsule's
// owner also keeps the value's WatchRecord: its deleter is where a released value freed after an
// in-place edit is caught (edit_watch.cpp).
#include <memory>
#include <vector>

#include <nanobind/ndarray.h>

#include "capi.h"
#include "convert.h"

namespace mixlens::py {

namespace {

namespace dl = nanobind::dlpack;

// DLManagedTensor of dlpack.h (unversioned): the struct the "dltensor" capsule points to.
struct Managed {
  dl::dltensor tensor;
  void* manager_ctx;
  void (*deleter)(Managed*);
};

// One allocation per value: the struct, the Tensor it points into, its shape and strides, and
// EditWatch's record of it.
struct Owner {
  Managed managed{};
  Tensor tensor;
  std::vector<int64_t> dims;  // shape, then strides (elements)
  WatchRecord record;
};

void delete_owner(Managed* m) {
  auto* o = static_cast<Owner*>(m->manager_ctx);
  watch_record_freed(o->record);
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

nb::object dlpack_over(Tensor t, WatchRecord** record) {
  if (record != nullptr) *record = nullptr;
  if (!t.defined()) return nb::none();
  auto owner = std::make_unique<Owner>();
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
  owner->record.tensor = &owner->tensor;
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
  if (record != nullptr) *record = &owner->record;
  owner.release();  // the capsule (then its consumer) owns it
  return nb::steal(cap);
}

}  // namespace mixlens::py
