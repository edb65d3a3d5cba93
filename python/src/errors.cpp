// Maps every mixlens C++ exception type to its Python class (defined in mixlens/errors.py, where
// they can also inherit the matching builtin: LookupError, ValueError).
#include <Python.h>

#include <new>
#include <stdexcept>

#include "bindings.h"
#include "mixlens/errors.h"

namespace mixlens::py {

namespace {

struct Classes {
  nb::handle base, checkpoint, config, tokenizer, unknown_value, write, unsupported, input, out_of_order, resource,
      numeric, interrupted;
};
Classes g_classes;

// A message may quote bytes of a corrupt file (nlohmann's "last read: '\xff'"): decode it with
// backslashreplace, since PyErr_SetString would raise UnicodeDecodeError instead of the mixlens error.
void raise_text(nb::handle cls, const std::string& msg) {
  PyObject* text = PyUnicode_DecodeUTF8(msg.data(), static_cast<Py_ssize_t>(msg.size()), "backslashreplace");
  if (text == nullptr) return;  // the decode error is set (out of memory)
  PyErr_SetObject(cls.ptr(), text);
  Py_DECREF(text);
}
void raise(nb::handle cls, const std::exception& e) { raise_text(cls, e.what()); }

}  // namespace

void init_errors(nb::module_& m) {
  nb::module_ errors = nb::module_::import_("mixlens.errors");
  auto get = [&](const char* name) {
    nb::object cls = errors.attr(name);
    m.attr(name) = cls;
    return cls.release();  // kept for the life of the process, like the module
  };
  g_classes = {get("MixlensError"), get("CheckpointError"), get("ConfigError"),  get("TokenizerError"),
               get("UnknownValueError"), get("WriteError"), get("UnsupportedError"), get("InputError"),
               get("OutOfOrderError"), get("ResourceError"), get("NumericError"), get("InterruptedRunError")};
  // Most derived first; anything else propagates to nanobind's own translators.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) { set_python_error(p); });
}

void set_python_error(const std::exception_ptr& p) {
  try {
    std::rethrow_exception(p);
  } catch (const OutOfOrderError& e) {
    raise(g_classes.out_of_order, e);
  } catch (const InputError& e) {
    raise(g_classes.input, e);
  } catch (const CheckpointError& e) {
    raise(g_classes.checkpoint, e);
  } catch (const ConfigError& e) {
    raise(g_classes.config, e);
  } catch (const TokenizerError& e) {
    raise(g_classes.tokenizer, e);
  } catch (const UnknownValueError& e) {
    raise(g_classes.unknown_value, e);
  } catch (const WriteError& e) {
    raise(g_classes.write, e);
  } catch (const UnsupportedError& e) {
    raise(g_classes.unsupported, e);
  } catch (const ResourceError& e) {
    raise(g_classes.resource, e);
  } catch (const NumericError& e) {
    raise(g_classes.numeric, e);
  } catch (const InterruptedError& e) {
    raise(g_classes.interrupted, e);
  } catch (const Error& e) {
    raise(g_classes.base, e);
  } catch (const std::bad_alloc&) {
    // Out of memory inside the library: a mixlens error (a MemoryError too), never a bare one.
    PyErr_SetString(g_classes.resource.ptr(),
                    "out of memory: an allocation inside mixlens failed (std::bad_alloc); use a smaller batch, "
                    "prompt, or fewer saved values");
  } catch (const std::length_error& e) {
    raise_text(g_classes.resource, std::string("size limit exceeded inside mixlens: ") + e.what());
  }
}

}  // namespace mixlens::py
