// Python C-API pieces outside nanobind shared by the binding files: heap types (numpy_array.cpp,
// session.cpp) and DLPack capsules over Tensors (dlpack.cpp, torch values of a `with` block).
#pragma once
#include <nanobind/nanobind.h>

#include "mixlens/tensor.h"

namespace mixlens::py {

/// A DLPack capsule ("dltensor", the protocol's unversioned form that torch._C._from_dlpack takes)
/// over `t`'s float32 CPU storage, which it keeps alive until the consumer's deleter runs (from any
/// thread, GIL or not: it only drops the Tensor). Pass a tensor nobody else writes (a clone). None
/// for an undefined tensor. Needs the GIL.
nanobind::object dlpack_over(Tensor t);

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
