// Session: the interleaver behind `with model.trace(...)`. Every call that runs the forward releases
// the GIL; the forward (a fiber on this thread) takes it only to run a pre-registered Python edit.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <climits>
#include <memory>
#include <optional>
#include <vector>

#include "bindings.h"
#include "capi.h"
#include "interrupt.h"
#include "mixlens/session.h"

namespace mixlens::py {

namespace {

using Rows = std::vector<std::vector<int32_t>>;

// The Python side of in-place edits (python/mixlens/_inplace.py describes the rules): the session
// (Session::read_live) applies in-place changes of the value read last; this tracks the Python
// objects. A value the forward has moved past is *released*: a numpy one becomes read-only (editing
// raises at once; its bytes are watched as below too, since a view made before the release stays
// writable). A torch one has no read-only mode: up to `watch_limit` bytes, EditWatch
// (edit_watch.cpp) keeps its bytes (a copy, or a checksum of a large one), compared at the next step and at the end of the block,
// or when its storage is freed (raised at the next move), which catches writes that bypass torch's
// version counter (numpy views, `.data`, DLPack re-exports) and costs no Python call per value
// (swapping classes and reading version counters cost ~5 us a held value: issue 9 item 5). A larger
// one (a `states` stack of hundreds of MiB, where a pass over its bytes costs more than its read)
// keeps the version-counter check: it takes the class `released_cls`, whose __del__ notes an edit
// made since (its version counter moved) in `pending`, raised at the next move, and the values still
// alive are checked at the next step and at the end of the block. Either way a read is O(1) however
// many values the block holds. Kept here rather than in Python: it runs for every value read.
struct HandedValues {
  nb::object cls;           // ValueArray / ValueTensor
  nb::object from_dlpack;   // torch: DLPack capsule -> tensor (torch._C._from_dlpack); None for numpy
  nb::object released_cls;  // torch: ValueTensor's subclass with the __del__ above (or None)
  nb::object error;         // (step, path) -> the WriteError to raise for an edit of a released value
  nb::object pending;       // torch: list of (step, path) the released values' __del__ appends to
  // torch: a tensor from from_dlpack takes cls by __class__ assignment (cls adds methods, no state,
  // and disables __torch_function__), ~0.1 us where as_subclass builds a second tensor and Python
  // object (~3 us a value); as_subclass when the assignment is refused.
  bool assign_class = true;
  nb::object last;        // the live value (None when there is none)
  int last_step = 0;
  std::string last_path;
  std::vector<nb::object> released_np;  // weak references
  struct Torch {
    nb::object ref;  // weak reference
    long long version;
    int step;
    std::string path;
    bool swapped;  // took released_cls (else: checked at every move, as before it existed)
  };
  std::vector<Torch> released_torch;
  EditWatch watch;                 // values up to watch_limit bytes (larger torch ones: released_torch)
  size_t watch_limit = 16u << 20;
  WatchRecord* fresh = nullptr;    // wrap(): the storage of the value it made last
  bool fresh_watched = false;      // wrap(): that value is small enough for `watch`
  bool last_watched = false;       // `last` is held by `watch` (up to watch_limit bytes)
  size_t unswapped = 0;  // entries of released_torch without released_cls
  size_t prune_at = 64;  // drop the entries of collected values when the lists reach this size

  bool torch() const { return from_dlpack.is_valid() && !from_dlpack.is_none(); }

  // Interned attribute names (method calls without a bound-method object: this runs per value).
  static PyObject* name(const char* s) { return PyUnicode_InternFromString(s); }
  static PyObject* marker() {
    static PyObject* const m = name("_mixlens_released");  // read by mixlens._convert._frozen_path / _inplace
    return m;
  }
  static PyObject* klass() {
    static PyObject* const k = name("__class__");
    return k;
  }
  // obj._version (torch's in-place counter), or nullopt (inference-mode tensors have none).
  static std::optional<long long> version_of(PyObject* obj) {
    static PyObject* const version = name("_version");
    PyObject* v = PyObject_GetAttr(obj, version);
    if (v == nullptr) {
      PyErr_Clear();
      return std::nullopt;
    }
    const long long n = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (n == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      return std::nullopt;
    }
    return n;
  }
  // The object behind a weak reference (a new reference), or null once it is gone.
  static PyObject* referent(PyObject* ref) {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject* obj = nullptr;
    if (PyWeakref_GetRef(ref, &obj) < 0) PyErr_Clear();
    return obj;
#else
    PyObject* obj = PyWeakref_GetObject(ref);  // borrowed; None once gone
    if (obj == nullptr) PyErr_Clear();
    return obj == nullptr || obj == Py_None ? nullptr : Py_NewRef(obj);
#endif
  }
  static nb::object call_method(nb::handle obj, PyObject* method, nb::handle arg) {
    PyObject* r = PyObject_CallMethodOneArg(obj.ptr(), method, arg.ptr());
    if (!r) throw nb::python_error();
    return nb::steal(r);
  }
  [[noreturn]] void raise_released(int step, const std::string& path) {
    nb::object e = error(step, path);
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(e.ptr())), e.ptr());
    throw nb::python_error();
  }

  nb::object wrap(Tensor t) {
    static PyObject* const as_subclass = name("as_subclass");
    fresh = nullptr;
    fresh_watched = t.defined() && sizeof(float) * static_cast<size_t>(t.numel()) <= watch_limit;
    if (!cls.is_valid()) return to_numpy(std::move(t));
    if (!torch()) return numpy_over(std::move(t), reinterpret_cast<PyTypeObject*>(cls.ptr()), &fresh);
    nb::object cap = dlpack_over(std::move(t), &fresh);
    if (cap.is_none()) return cap;
    PyObject* r = PyObject_CallOneArg(from_dlpack.ptr(), cap.ptr());
    if (r == nullptr) throw nb::python_error();
    nb::object v = nb::steal(r);
    if (assign_class) {
      if (PyObject_SetAttr(v.ptr(), klass(), cls.ptr()) == 0) return v;
      PyErr_Clear();
      assign_class = false;
    }
    return call_method(v, as_subclass, cls);
  }
  // torch: v._version read as a plain torch.Tensor (cls's base), then v's class is `then`: torch's
  // getter on a subclass first looks its __torch_function__ up by name (~0.2 us of the ~0.3), which a
  // released value paid twice (at its release and at the end of the block).
  std::optional<long long> version_as_plain(PyObject* v, PyObject* then) {
    nb::object own = nb::borrow(reinterpret_cast<PyObject*>(Py_TYPE(v)));
    auto* plain = reinterpret_cast<PyObject*>(reinterpret_cast<PyTypeObject*>(cls.ptr())->tp_base);
    const bool as_plain = plain != nullptr && PyObject_SetAttr(v, klass(), plain) == 0;
    if (!as_plain) PyErr_Clear();
    const std::optional<long long> n = version_of(v);
    if (PyObject_SetAttr(v, klass(), then) != 0) {
      PyErr_Clear();
      if (as_plain && PyObject_SetAttr(v, klass(), own.ptr()) != 0) PyErr_Clear();
    }
    return n;
  }
  // torch: v (already of class released_cls) notes (version, step, path, pending) for its __del__;
  // false (v back to cls) when it cannot.
  bool note_released(PyObject* v, long long version, int step, const std::string& path) {
    nb::object info = nb::make_tuple(version, step, path, pending);
    if (PyObject_SetAttr(v, marker(), info.ptr()) == 0) return true;
    PyErr_Clear();
    if (PyObject_SetAttr(v, klass(), cls.ptr()) != 0) PyErr_Clear();
    return false;
  }
  // Entries of values collected since: dropped when the lists double (O(1) a release amortized).
  void prune() {
    if (released_torch.size() + released_np.size() < prune_at) return;
    std::erase_if(released_np, [](const nb::object& ref) { return !alive(ref.ptr()); });
    std::erase_if(released_torch, [this](const Torch& r) {
      if (alive(r.ref.ptr())) return false;
      if (!r.swapped) --unswapped;
      return true;
    });
    prune_at = std::max<size_t>(64, 2 * (released_torch.size() + released_np.size()));
  }
  static bool alive(PyObject* ref) {
    PyObject* v = referent(ref);
    Py_XDECREF(v);
    return v != nullptr;
  }
  void release(nb::object v, int step, const std::string& path) {
    prune();
    if (torch()) {
      nb::object own = nb::borrow(reinterpret_cast<PyObject*>(Py_TYPE(v.ptr())));
      const bool swap = released_cls.is_valid() && !released_cls.is_none();
      const std::optional<long long> version = version_as_plain(v.ptr(), swap ? released_cls.ptr() : own.ptr());
      const bool took = swap && reinterpret_cast<PyObject*>(Py_TYPE(v.ptr())) == released_cls.ptr();
      if (!version) {  // inference-mode tensors have no version counter
        if (took && PyObject_SetAttr(v.ptr(), klass(), own.ptr()) != 0) PyErr_Clear();
        return;
      }
      const bool swapped = took && note_released(v.ptr(), *version, step, path);
      released_torch.push_back({nb::weakref(v), *version, step, path, swapped});
      if (!swapped) ++unswapped;
    } else if (nb::isinstance(v, cls)) {
      if (PyObject_SetAttr(v.ptr(), marker(), nb::make_tuple(step, path).ptr()) != 0) throw nb::python_error();
      set_writeable(v.ptr(), false);
      released_np.push_back(nb::weakref(v));
    }
  }
  void release_last() {
    if (!last.is_valid() || last.is_none()) return;
    nb::object v = std::move(last);
    last = nb::none();
    if (last_watched) {
      last_watched = false;
      // Dropped first when nobody else holds it: a view or a re-export of its memory may still hold
      // the storage, which is then watched (nothing else could edit it). A numpy value still held
      // also becomes read-only (an edit raises at once); its bytes are watched all the same, since a
      // view made before the release stays writable.
      const bool sole = Py_REFCNT(v.ptr()) == 1;
      if (!sole && !torch()) release(v, last_step, last_path);
      watch.release_held(v, sole, last_step, last_path);
      return;
    }
    // Nobody else holds it (a value read and dropped, as `model.layers[i].x.shape` does): nothing can
    // edit it any more, so no marker, flag or weak reference (~0.3-0.5 us a read).
    if (Py_REFCNT(v.ptr()) == 1) return;
    release(std::move(v), last_step, last_path);
  }
  // A released torch value edited and then collected (its storage's deleter or its __del__ noted it):
  // raise its WriteError.
  void raise_pending() {
    if (std::optional<std::pair<int, std::string>> e = watch.take_freed_edit()) raise_released(e->first, e->second);
    if (!pending.is_valid() || pending.is_none() || PyList_GET_SIZE(pending.ptr()) == 0) return;
    nb::object first = nb::borrow(PyList_GET_ITEM(pending.ptr(), 0));
    if (PyList_SetSlice(pending.ptr(), 0, PyList_GET_SIZE(pending.ptr()), nullptr) != 0) throw nb::python_error();
    raise_released(nb::cast<int>(first[0]), nb::cast<std::string>(first[1]));
  }
  // Released torch values still alive edited since their release: raise the first one's WriteError.
  // all = false: only those without released_cls (then it runs at every move: ~0.2 us a value).
  void check_released(bool all) {
    if (all) {
      if (std::optional<std::pair<int, std::string>> e = watch.check_alive()) raise_released(e->first, e->second);
    }
    if (released_torch.empty() || (!all && unswapped == 0)) return;
    size_t keep = 0;
    std::optional<std::pair<int, std::string>> bad;
    for (size_t i = 0; i < released_torch.size(); ++i) {
      Torch& r = released_torch[i];
      if (all || !r.swapped) {
        PyObject* v = referent(r.ref.ptr());
        if (v == nullptr) {
          if (!r.swapped) --unswapped;
          continue;
        }
        const std::optional<long long> now =
            bad ? std::nullopt : r.swapped ? version_as_plain(v, released_cls.ptr()) : version_of(v);
        Py_DECREF(v);
        if (now && *now != r.version) {
          bad = {r.step, r.path};
          if (!r.swapped) --unswapped;
          else restore(r);  // reported once: an ordinary value again
          continue;
        }
      }
      if (keep != i) released_torch[keep] = std::move(r);
      ++keep;
    }
    released_torch.resize(keep);
    if (bad) raise_released(bad->first, bad->second);
  }
  // A released torch value alive again as cls, without its note (errors cleared: this also runs in
  // destructors).
  void restore(const Torch& r) {
    if (!r.swapped) return;
    PyObject* v = referent(r.ref.ptr());
    if (v == nullptr) return;
    if (PyObject_SetAttr(v, klass(), cls.ptr()) != 0) PyErr_Clear();
    if (PyObject_DelAttr(v, marker()) != 0) PyErr_Clear();
    Py_DECREF(v);
  }
  // The block moves on (any request but a write of the live value itself).
  void move_on() {
    release_last();
    raise_pending();
    check_released(false);
  }
  // The block moves to another step of the forward (or its end): held torch values are checked too.
  void move_to_step() {
    move_on();
    check_released(true);
  }
  void keep(nb::object v, int step, std::string_view path, bool read_only) {
    if (v.is_none()) return;
    const bool watched = fresh != nullptr && fresh_watched;
    if (watched) watch.hold(fresh);
    fresh = nullptr;
    if (read_only) {
      if (!watched || !torch()) release(v, step, std::string(path));
      if (watched) watch.release_held(v, false, step, path);
      return;
    }
    last_watched = watched;
    last = std::move(v);
    last_step = step;
    last_path.assign(path);  // reuses the buffer: no allocation per read
  }
  // The block ends: optionally check the released torch values, then every value is ordinary again.
  void close(bool check) {
    last = nb::none();
    last_watched = false;
    struct Restore {
      HandedValues& h;
      ~Restore() {
        h.watch.clear();
        for (nb::object& ref : h.released_np) {
          PyObject* v = referent(ref.ptr());
          if (v == nullptr) continue;
          if (PyObject_DelAttr(v, marker()) != 0) PyErr_Clear();
          set_writeable(v, true);  // made by numpy_over over a Tensor of its own: writable memory
          Py_DECREF(v);
        }
        h.released_np.clear();
        for (const Torch& r : h.released_torch) h.restore(r);
        h.released_torch.clear();
        h.unswapped = 0;
        if (h.pending.is_valid() && !h.pending.is_none() && PyList_SetSlice(h.pending.ptr(), 0, PY_SSIZE_T_MAX, nullptr) != 0)
          PyErr_Clear();
      }
    } restore{*this};
    if (check) {
      raise_pending();
      check_released(true);
    }
  }
};

// Owns the pre-registered trace and the session; the session is declared after the trace so it
// is destroyed (its paused forward unwound) first.
struct PySession {
  std::unique_ptr<Trace> trace = std::make_unique<Trace>();
  std::optional<Session> session;
  HandedValues handed;
  // What value_attr_fast checks, kept here by the Tracer (set_reader) rather than read as three
  // attributes of it per value: _OPENED's value in the context that entered the block (None: no
  // fast reads, e.g. a grad trace, whose reads the Python path notes) and the current step.
  nb::object reader_ctx = nb::none();
  int reader_step = 0;

  PySession(const std::vector<SaveSpec>& saves, const std::vector<EditSpec>& edits) {
    register_saves(*trace, saves);
    register_edits(*trace, edits);
  }
  ~PySession() {
    try {
      handed.close(false);  // no value keeps released_cls or read-only past its session
    } catch (...) {
    }
    close();
  }
  void close() {
    if (!session) return;
    nb::gil_scoped_release r;
    session->abort();
  }
  Session& s() {
    if (!session) throw InputError("this session was closed");
    return *session;
  }
  // Ctrl-C while the caller waits in read / write / reach_step / finish aborts the run.
  PySession* start(Session&& s) {
    session.emplace(std::move(s));
    session->set_interrupt_check(check_signals);
    return this;
  }
};

nb::dict result_dict(const SessionResult& r, const Trace& trace) {
  nb::dict d;
  nb::list logits;
  for (const Tensor& t : r.logits) logits.append(to_numpy(t.clone()));
  d["logits"] = logits;
  d["new_tokens"] = nb::cast(r.new_tokens);
  d["steps"] = r.steps;
  d["saved"] = saved_dict(trace);
  return d;
}

// Session.read_value: the per-value path of a `with` block (issue 9 item 5): the in-place edit
// bookkeeping of python/mixlens/_inplace.py, then Session::read_live, returning the output type.
nb::object read_value(PySession& p, int step, std::string_view path) {
  p.handed.move_on();
  Tensor t;
  {
    nb::gil_scoped_release r;
    t = p.s().read_live(step, path);
  }
  nb::object v = p.handed.wrap(std::move(t));
  const bool read_only = path.ends_with(".states");
  p.handed.keep(v, step, path, read_only);
  return v;
}

// ValueAttr: `envoy.<value>` (python/mixlens/_envoy.py _envoy_class) as a descriptor in C, so a read
// in a `with` block runs no Python frame: it checks what _Envoy's property did (the model's open
// tracer, entered in this very context, running, no grad record to keep) and calls read_value; any
// other case calls `fallback(envoy, name)`, the Python path (which raises or routes it).
struct ValueAttr {
  PyObject_HEAD
  PyObject* name;      // the value's name under the envoy's prefix
  PyObject* fallback;  // (envoy, name) -> value
};

struct ValueAttrEnv {
  PyObject* opened = nullptr;         // mixlens._tracer._OPENED (ContextVar)
  PyObject* unknown_value = nullptr;  // UnknownValueError
  PyObject* unknown_attr = nullptr;   // UnknownAttributeError
} g_attr_env;

PyObject* interned(const char* s) { return PyUnicode_InternFromString(s); }

// A new reference to obj.<name>, or null (error cleared) when it is missing.
PyObject* get_attr(PyObject* obj, PyObject* name) {
  PyObject* v = PyObject_GetAttr(obj, name);
  if (v == nullptr) PyErr_Clear();
  return v;
}

// The fast read; `handled` false: not the fast case (nothing done, no error set).
PyObject* value_attr_fast(ValueAttr* self, PyObject* envoy, bool& handled) {
  static PyObject* const s_model = interned("_model");
  static PyObject* const s_open = interned("_open");
  static PyObject* const s_session = interned("_session");
  static PyObject* const s_paths = interned("_paths");
  handled = false;
  if (g_attr_env.opened == nullptr) return nullptr;
  nb::object model = nb::steal(get_attr(envoy, s_model));
  if (!model.is_valid()) return nullptr;
  nb::object ref = nb::steal(get_attr(model.ptr(), s_open));
  if (!ref.is_valid() || ref.is_none() || !PyWeakref_Check(ref.ptr())) return nullptr;
  nb::object tracer = nb::steal(HandedValues::referent(ref.ptr()));
  if (!tracer.is_valid()) return nullptr;
  nb::object sess = nb::steal(get_attr(tracer.ptr(), s_session));
  if (!sess.is_valid() || !nb::isinstance<PySession>(sess)) return nullptr;
  PySession& p = *nb::inst_ptr<PySession>(sess);
  if (p.reader_ctx.is_none()) return nullptr;  // not set, or a grad trace: the Python path notes the read
  PyObject* cur = nullptr;
  if (PyContextVar_Get(g_attr_env.opened, nullptr, &cur) < 0) {
    PyErr_Clear();
    return nullptr;
  }
  nb::object current = nb::steal(cur);
  if (current.ptr() != p.reader_ctx.ptr()) return nullptr;  // entered in another thread / asyncio context
  nb::object paths = nb::steal(get_attr(envoy, s_paths));
  if (!paths.is_valid() || !PyDict_Check(paths.ptr())) return nullptr;
  PyObject* path = PyDict_GetItemWithError(paths.ptr(), self->name);  // borrowed
  if (path == nullptr || !PyUnicode_Check(path)) {
    PyErr_Clear();
    return nullptr;
  }
  Py_ssize_t len = 0;
  const char* utf8 = PyUnicode_AsUTF8AndSize(path, &len);
  if (utf8 == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  handled = true;
  // read_value called here rather than through the bound method (nanobind's dispatch: ~0.2 us a
  // read); C++ exceptions become mixlens' Python ones as nanobind's translator makes them.
  PyObject* r = nullptr;
  try {
    r = read_value(p, p.reader_step, std::string_view(utf8, static_cast<size_t>(len))).release().ptr();
  } catch (nb::python_error& e) {
    e.restore();
  } catch (...) {
    try {
      set_python_error(std::current_exception());
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    } catch (...) {
      PyErr_SetString(PyExc_RuntimeError, "unknown C++ exception in a value read");
    }
  }
  if (r != nullptr) return r;
  // UnknownValueError is also an AttributeError: as the property did, it reaches the user as
  // UnknownAttributeError so hasattr() answers False.
  if (PyErr_ExceptionMatches(g_attr_env.unknown_value) && !PyErr_ExceptionMatches(g_attr_env.unknown_attr)) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    PyObject* msg = value ? PyObject_Str(value) : nullptr;
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    if (msg != nullptr) {
      PyErr_SetObject(g_attr_env.unknown_attr, msg);
      Py_DECREF(msg);
    }
  }
  return nullptr;
}

PyObject* value_attr_get(PyObject* self, PyObject* obj, PyObject* /*type*/) {
  if (obj == nullptr || obj == Py_None) return Py_NewRef(self);
  auto* a = reinterpret_cast<ValueAttr*>(self);
  bool handled = false;
  PyObject* r = value_attr_fast(a, obj, handled);
  if (handled) return r;
  return PyObject_CallFunctionObjArgs(a->fallback, obj, a->name, nullptr);
}

void value_attr_dealloc(PyObject* self) {
  auto* a = reinterpret_cast<ValueAttr*>(self);
  Py_XDECREF(a->name);
  Py_XDECREF(a->fallback);
  free_heap_object(self);
}

PyTypeObject* value_attr_type() {
  static PyTypeObject* type = [] {
    PyType_Slot slots[] = {{Py_tp_descr_get, reinterpret_cast<void*>(&value_attr_get)},
                           {Py_tp_dealloc, reinterpret_cast<void*>(&value_attr_dealloc)},
                           {0, nullptr}};
    return new_heap_type("mixlens._core.ValueAttr", static_cast<int>(sizeof(ValueAttr)), slots);
  }();
  return type;
}

nb::list calls_list(const std::vector<CallRecord>& calls) {
  nb::list out;
  for (const CallRecord& c : calls) {
    nb::dict d;
    d["step"] = c.step;
    d["batch"] = c.batch;
    d["seq"] = c.seq;
    d["fresh"] = c.fresh;
    d["kernel"] = c.kernel;
    d["first"] = c.first;
    out.append(d);
  }
  return out;
}

}  // namespace

void init_session(nb::module_& m) {
  nb::class_<PySession>(m, "Session",
                        "A forward run as a fiber on the caller's thread, paused where read()/write() ask (mixlens/session.h).")
      .def("read",
           [](PySession& p, int step, const std::string& path) {
             Tensor t;
             {
               nb::gil_scoped_release r;
               t = p.s().read(step, path);
             }
             return to_numpy(std::move(t));
           },
           nb::arg("step"), nb::arg("path"))
      // The per-value path of a `with` block (issue 9 item 5): the in-place edit bookkeeping of
      // python/mixlens/_inplace.py, then Session::read_live, returning the output type.
      .def("set_output",
           [](PySession& p, nb::object cls, nb::object from_dlpack, nb::object error, nb::object released_cls,
              size_t watch_limit, size_t watch_copy_limit) {
             if (from_dlpack.is_none()) {
               nb::object ndarray = nb::module_::import_("numpy").attr("ndarray");
               if (!PyType_Check(cls.ptr()) || PyObject_IsSubclass(cls.ptr(), ndarray.ptr()) != 1)
                 throw nb::type_error("set_output: cls must be a numpy.ndarray subclass for numpy output");
             }
             HandedValues& h = p.handed;
             h.close(false);
             h.cls = std::move(cls);
             h.assign_class = true;
             h.from_dlpack = std::move(from_dlpack);
             h.released_cls = std::move(released_cls);
             h.watch_limit = watch_limit;
             h.watch.set_copy_limit(watch_copy_limit);
             h.error = std::move(error);
             h.pending = nb::list();
           },
           nb::arg("cls"), nb::arg("from_dlpack").none(), nb::arg("error"), nb::arg("released_cls").none() = nb::none(),
           nb::arg("watch_limit") = size_t{16} << 20, nb::arg("watch_copy_limit") = size_t{256} << 10,
           "Output type for read_value: cls (ValueArray / ValueTensor), a DLPack capsule -> torch tensor function "
           "(torch._C._from_dlpack) or None for numpy, error(step, path) -> the WriteError for an edit of a released "
           "value, released_cls: the class a released torch value over watch_limit bytes takes (mixlens._inplace; "
           "None: checked at every move instead); torch values up to watch_limit bytes are checked by their bytes "
           "instead (a copy up to watch_copy_limit bytes, a checksum above).")
      .def("read_value", &read_value, nb::arg("step"), nb::arg("path"),
           "read() whose value is live (Session::read_live): in-place edits reach the forward when the block "
           "moves on; values the forward has passed are released (numpy: read-only; torch: checked).")
      .def("write_value",
           [](PySession& p, int step, const std::string& path, const FloatArray& value) {
             // A write of the live value itself keeps it live (the write supersedes its edits so far).
             if (!(step == p.handed.last_step && path == p.handed.last_path)) p.handed.release_last();
             p.handed.raise_pending();
             p.handed.check_released(false);
             Tensor t = from_numpy(value);
             nb::gil_scoped_release r;
             p.s().write(step, path, t);
           },
           nb::arg("step"), nb::arg("path"), nb::arg("value"))
      .def("settle",
           [](PySession& p) {
             p.handed.move_on();
             nb::gil_scoped_release r;
             p.s().settle();
           },
           "Apply in-place edits of the live value now and release it (the block moves on).")
      .def("close_values", [](PySession& p, bool check) { p.handed.close(check); }, nb::arg("check") = false,
           "The block ends: values read become ordinary arrays again (check: raise for released torch edits first).")
      .def("write",
           [](PySession& p, int step, const std::string& path, const FloatArray& value) {
             Tensor t = from_numpy(value);
             nb::gil_scoped_release r;
             p.s().write(step, path, t);
           },
           nb::arg("step"), nb::arg("path"), nb::arg("value"))
      .def("reach_step",
           [](PySession& p, int step) {
             p.handed.move_to_step();
             nb::gil_scoped_release r;
             return p.s().reach_step(step);
           },
           nb::arg("step"))
      .def("finish",
           [](PySession& p) {
             p.handed.move_to_step();
             SessionResult res;
             {
               nb::gil_scoped_release r;
               res = p.s().finish();
             }
             return result_dict(res, *p.trace);
           })
      .def("close", &PySession::close, "Abort the run if it is still going (idempotent).")
      .def(
          "set_reader",
          [](PySession& p, nb::object ctx, int step) {
            p.reader_ctx = std::move(ctx);
            p.reader_step = step;
          },
          nb::arg("ctx").none(), nb::arg("step"),
          "The open tracer's state for envoy reads in C (value_attr): ctx is _OPENED's value in the context that "
          "entered the block (None: envoy reads take the Python path), step the step they read at.")
      .def_prop_ro("in_forward", [](PySession& p) { return p.session && p.session->in_forward(); },
                   "True inside this session's forward (a pre-registered edit function).")
      .def_prop_ro("first_step", [](PySession& p) { return p.s().first_step(); })
      .def_prop_ro("last_step", [](PySession& p) { return p.s().last_step(); })
      .def_prop_ro("calls", [](PySession& p) { return calls_list(p.s().calls()); })
      .def_prop_ro("where", [](PySession& p) { return p.s().where(); })
      // Gradients (issue 12, docs/gradients.md): after the run, through the trace's record.
      .def("backward",
           [](PySession& p, const FloatArray& dlogits, const std::vector<std::string>& paths,
              const std::vector<int64_t>& positions) {
             Tensor d = from_numpy(dlogits);
             nb::gil_scoped_release r;
             p.trace->backward(d, paths, positions);
           },
           nb::arg("dlogits"), nb::arg("paths") = std::vector<std::string>{},
           nb::arg("positions") = std::vector<int64_t>{})
      .def("logits_at",
           [](PySession& p, const std::vector<int64_t>& positions) {
             Tensor out;
             {
               nb::gil_scoped_release r;
               out = p.trace->logits_at(positions);
             }
             return to_numpy(out);
           },
           nb::arg("positions"))
      .def("grad", [](PySession& p, const std::string& path) { return to_numpy(p.trace->grad(path).clone()); },
           nb::arg("path"))
      .def("grad_paths",
           [](PySession& p) {
             std::vector<std::string> out;
             for (const auto& [k, v] : p.trace->grads()) out.push_back(k);
             return out;
           });

  m.def(
      "value_attr",
      [](nb::str name, nb::object fallback) {
        auto* a = PyObject_New(ValueAttr, value_attr_type());
        if (a == nullptr) throw nb::python_error();
        a->name = Py_NewRef(name.ptr());
        a->fallback = Py_NewRef(fallback.ptr());
        return nb::steal(reinterpret_cast<PyObject*>(a));
      },
      nb::arg("name"), nb::arg("fallback"),
      "A descriptor reading envoy.<name> through the open tracer's session in C (issue 9 item 5); other cases "
      "call fallback(envoy, name). Needs value_attr_env first.");
  m.def(
      "value_attr_env",
      [](nb::object opened, nb::object unknown_value, nb::object unknown_attr) {
        g_attr_env = {Py_NewRef(opened.ptr()), Py_NewRef(unknown_value.ptr()), Py_NewRef(unknown_attr.ptr())};
      },
      nb::arg("opened"), nb::arg("unknown_value"), nb::arg("unknown_attr"),
      "value_attr's context: the ContextVar of the tracers a context opened, UnknownValueError, UnknownAttributeError.");

  // Factories: the session keeps the model (and a continued cache) alive.
  m.def(
      "session_run",
      [](const Model& mo, const Rows& prompts, const std::vector<SaveSpec>& saves, const std::vector<EditSpec>& edits,
         const std::optional<FloatArray>& embeds, const std::vector<uint8_t>& mask, bool all_logits, bool grad) {
        auto p = std::make_unique<PySession>(saves, edits);
        p->trace->enable_grad(grad);
        p->start(Session::run(mo, prompt_batch(mo, prompts, embeds, mask), p->trace.get(), all_logits));
        return p.release();
      },
      nb::arg("model"), nb::arg("prompts"), nb::arg("saves") = std::vector<SaveSpec>{},
      nb::arg("edits") = std::vector<EditSpec>{}, nb::arg("embeds") = nb::none(), nb::arg("mask") = std::vector<uint8_t>{},
      nb::arg("all_logits") = true, nb::arg("grad") = false, nb::rv_policy::take_ownership, nb::keep_alive<0, 1>());
  m.def(
      "session_generate",
      [](const Model& mo, const Rows& prompts, int max_new_tokens, bool greedy, float temperature, int top_k,
         float top_p, uint64_t seed, std::optional<int32_t> eos, const std::vector<SaveSpec>& saves,
         const std::vector<EditSpec>& edits, const std::optional<FloatArray>& embeds, const std::vector<uint8_t>& mask) {
        auto p = std::make_unique<PySession>(saves, edits);
        p->start(Session::generate(mo, prompt_batch(mo, prompts, embeds, mask),
                                   make_options(max_new_tokens, greedy, temperature, top_k, top_p, seed, eos),
                                   p->trace.get()));
        return p.release();
      },
      nb::arg("model"), nb::arg("prompts"), nb::arg("max_new_tokens"), nb::arg("greedy") = true,
      nb::arg("temperature") = 1.0f, nb::arg("top_k") = 0, nb::arg("top_p") = 1.0f, nb::arg("seed") = 0,
      nb::arg("eos_token_id") = nb::none(), nb::arg("saves") = std::vector<SaveSpec>{},
      nb::arg("edits") = std::vector<EditSpec>{}, nb::arg("embeds") = nb::none(), nb::arg("mask") = std::vector<uint8_t>{},
      nb::rv_policy::take_ownership, nb::keep_alive<0, 1>());
  m.def(
      "session_teacher_forced",
      [](const Model& mo, const Rows& prompts, const Rows& forced, const std::vector<SaveSpec>& saves,
         const std::vector<EditSpec>& edits) {
        auto p = std::make_unique<PySession>(saves, edits);
        p->start(Session::teacher_forced(mo, prompts, forced, p->trace.get()));
        return p.release();
      },
      nb::arg("model"), nb::arg("prompts"), nb::arg("forced"), nb::arg("saves") = std::vector<SaveSpec>{},
      nb::arg("edits") = std::vector<EditSpec>{}, nb::rv_policy::take_ownership, nb::keep_alive<0, 1>());
  m.def(
      "session_forward",
      [](const Model& mo, const Rows& rows, Cache& cache, const std::vector<SaveSpec>& saves,
         const std::vector<EditSpec>& edits, bool all_logits, const std::optional<FloatArray>& embeds, bool grad) {
        auto p = std::make_unique<PySession>(saves, edits);
        p->trace->enable_grad(grad);
        p->start(Session::forward(mo, continuation_batch(rows, embeds), cache, p->trace.get(), all_logits));
        return p.release();
      },
      nb::arg("model"), nb::arg("rows"), nb::arg("cache"), nb::arg("saves") = std::vector<SaveSpec>{},
      nb::arg("edits") = std::vector<EditSpec>{}, nb::arg("all_logits") = true, nb::arg("embeds") = nb::none(),
      nb::arg("grad") = false, nb::rv_policy::take_ownership,
      nb::keep_alive<0, 1>(), nb::keep_alive<0, 3>());
}

}  // namespace mixlens::py
