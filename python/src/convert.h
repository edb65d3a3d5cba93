// Conversions shared by the binding files: mixlens::Tensor <-> numpy float32 (always copies, so
// Python never aliases memory the forward still uses), and the (path, steps, value) lists the
// Python layer passes for pre-registered saves and edits.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "mixlens/errors.h"
#include "mixlens/tensor.h"
#include "mixlens/trace.h"

namespace mixlens::py {

namespace nb = nanobind;

using FloatArray = nb::ndarray<const float, nb::c_contig, nb::device::cpu>;

struct WatchRecord;

/// A numpy float32 array of type `subtype` (a subclass of numpy.ndarray; null: ndarray itself)
/// over `t`'s storage, which it keeps alive: pass a tensor nobody else holds (a clone). None for an
/// undefined tensor. `record`: set to the storage's WatchRecord (capi.h). Needs the GIL. numpy's C
/// API, in one step (numpy_array.cpp).
nb::object numpy_over(Tensor t, PyTypeObject* subtype = nullptr, WatchRecord** record = nullptr);

/// Sets or clears an array's WRITEABLE flag directly (no flags object; setting it skips numpy's
/// check of the base, so only for arrays numpy_over made). False when `arr` is not an array.
bool set_writeable(PyObject* arr, bool on);

/// numpy_over(t) as a plain numpy.ndarray.
inline nb::object to_numpy(Tensor t) { return numpy_over(std::move(t)); }

/// A Tensor copy of a C-contiguous float32 array (the Python layer casts and checks dtypes first).
inline Tensor from_numpy(const FloatArray& a) {
  Shape shape;
  for (size_t i = 0; i < a.ndim(); ++i) shape.push_back(static_cast<int64_t>(a.shape(i)));
  Tensor t(shape);
  if (t.numel() > 0) std::memcpy(t.data(), a.data(), sizeof(float) * static_cast<size_t>(t.numel()));
  return t;
}

/// Saves as (path, first_step, last_step).
using SaveSpec = std::tuple<std::string, int, int>;
/// Edits as (path, first_step, last_step, value): value is a float32 array (replaces the value) or
/// a callable value -> new value (None keeps it), called with the GIL held.
using EditSpec = std::tuple<std::string, int, int, nb::object>;

inline void register_saves(Trace& trace, const std::vector<SaveSpec>& saves) {
  for (const auto& [path, first, last] : saves) trace.save(path, Steps::range(first, last));
}

inline void register_edits(Trace& trace, const std::vector<EditSpec>& edits) {
  for (const auto& [path, first, last, value] : edits) {
    if (PyCallable_Check(value.ptr())) {
      nb::object fn = value;
      // The forward may run on a worker thread with the GIL released: take it for the call.
      trace.edit(path,
                 [fn](Tensor& v, const SiteContext&) {
                   nb::gil_scoped_acquire gil;
                   // A copy: changing the array in place and returning None changes nothing.
                   nb::object out = fn(to_numpy(v.defined() ? v.clone() : Tensor()));
                   if (out.is_none()) return;
                   v = from_numpy(nb::cast<FloatArray>(out));
                 },
                 Steps::range(first, last));
    } else {
      trace.set(path, from_numpy(nb::cast<FloatArray>(value)), Steps::range(first, last));
    }
  }
}

/// Trace::saved() as {"path@step{k}": array}.
inline nb::dict saved_dict(const Trace& trace) {
  nb::dict d;
  for (const auto& [key, t] : trace.saved()) d[nb::str(key.c_str())] = to_numpy(t.clone());
  return d;
}

}  // namespace mixlens::py
