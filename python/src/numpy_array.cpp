// numpy arrays over mixlens Tensors made through numpy's C API (issue 9 item 5): one
// PyArray_NewFromDescr of the wanted subtype whose base is a small object owning the Tensor. nanobind's
// ndarray export goes through a Python object with the buffer protocol and numpy.asarray, and the
// ValueArray subtype then took a .view() call: ~2-3 us of a value read together, ~0.3 us this way.
// The only file that includes numpy's headers (its C-API table is imported once, here).
#define PY_ARRAY_UNIQUE_SYMBOL mixlens_numpy_api
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <Python.h>
#include <numpy/arrayobject.h>

#include "convert.h"
#include "capi.h"

namespace mixlens::py {

namespace {

// The arrays' base object: owns the Tensor and exposes its memory as a writable buffer. numpy lets
// a released value (made read-only in its `with` block) be made writeable again only when its base
// has a writable buffer, which a capsule has not.
// Its deleter reports the WatchRecord (edit_watch.cpp): released values are watched by their bytes
// too, since a view made before the release stays writable.
struct Held {
  Tensor tensor;
  WatchRecord record;
};
struct TensorOwner {
  PyObject_HEAD
  Held* held;
};

void owner_dealloc(PyObject* self) {
  Held* h = reinterpret_cast<TensorOwner*>(self)->held;
  if (h != nullptr) watch_record_freed(h->record);
  delete h;
  free_heap_object(self);
}

int owner_getbuffer(PyObject* self, Py_buffer* view, int flags) {
  Tensor& t = reinterpret_cast<TensorOwner*>(self)->held->tensor;
  return PyBuffer_FillInfo(view, self, t.data(), static_cast<Py_ssize_t>(sizeof(float) * static_cast<size_t>(t.numel())),
                           0, flags);
}

PyTypeObject* owner_type() {
  static PyTypeObject* type = [] {
    PyType_Slot slots[] = {{Py_tp_dealloc, reinterpret_cast<void*>(&owner_dealloc)},
                           {Py_bf_getbuffer, reinterpret_cast<void*>(&owner_getbuffer)},
                           {0, nullptr}};
    return new_heap_type("mixlens._core.TensorOwner", static_cast<int>(sizeof(TensorOwner)), slots);
  }();
  return type;
}

// numpy's C-API table, imported on first use (numpy is imported then if nobody has yet).
void ensure_numpy() {
  if (PyArray_API == nullptr && _import_array() < 0) throw nb::python_error();
}

}  // namespace

nb::object numpy_over(Tensor t, PyTypeObject* subtype, WatchRecord** record) {
  if (record != nullptr) *record = nullptr;
  if (!t.defined()) return nb::none();
  ensure_numpy();
  const Shape& s = t.shape();
  const int nd = static_cast<int>(s.size());
  if (nd > NPY_MAXDIMS) throw InputError("a value of " + std::to_string(nd) + " dimensions has more than numpy's maximum");
  npy_intp dims[NPY_MAXDIMS];
  for (int i = 0; i < nd; ++i) dims[i] = static_cast<npy_intp>(s[static_cast<size_t>(i)]);
  TensorOwner* raw = PyObject_New(TensorOwner, owner_type());
  if (raw == nullptr) throw nb::python_error();
  raw->held = nullptr;
  nb::object owner = nb::steal(reinterpret_cast<PyObject*>(raw));
  raw->held = new Held{std::move(t), {}};  // `s` is gone from here on
  raw->held->record.tensor = &raw->held->tensor;
  Tensor* keep = &raw->held->tensor;
  PyArray_Descr* f32 = PyArray_DescrFromType(NPY_FLOAT32);  // a new reference, stolen by NewFromDescr
  PyObject* arr = PyArray_NewFromDescr(subtype != nullptr ? subtype : &PyArray_Type, f32, nd, dims, nullptr,
                                       keep->data(), NPY_ARRAY_CARRAY, nullptr);
  if (arr == nullptr) throw nb::python_error();
  nb::object out = nb::steal(arr);
  Held* held = raw->held;
  if (PyArray_SetBaseObject(reinterpret_cast<PyArrayObject*>(arr), owner.release().ptr()) < 0) throw nb::python_error();
  if (record != nullptr) *record = &held->record;
  return out;
}

bool set_writeable(PyObject* arr, bool on) {
  if (PyArray_API == nullptr || !PyArray_Check(arr)) return false;  // no array made yet: not one of ours
  auto* a = reinterpret_cast<PyArrayObject*>(arr);
  if (on)
    PyArray_ENABLEFLAGS(a, NPY_ARRAY_WRITEABLE);
  else
    PyArray_CLEARFLAGS(a, NPY_ARRAY_WRITEABLE);
  return true;
}

}  // namespace mixlens::py
