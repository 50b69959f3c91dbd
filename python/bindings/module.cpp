// dflash2_rt._core: the thin binding. Errors raised by the C++ core are translated into
// Python exception classes that subclass both DFlash2Error and the matching builtin
// (ValueError, NotImplementedError, RuntimeError, MemoryError).
#include <pybind11/pybind11.h>

#include <atomic>
#include <new>

#include "bindings.h"
#include "dflash2/engine.h"
#include "dflash2/error.h"

namespace {
PyObject* g_exc[8] = {};
PyObject* make_exc(py::module_& m, const char* name, PyObject* base1, PyObject* base2, const char* doc) {
  py::object type = py::reinterpret_borrow<py::object>((PyObject*)&PyType_Type);
  py::tuple bases = base2 ? py::tuple(py::make_tuple(py::handle(base1), py::handle(base2)))
                          : py::tuple(py::make_tuple(py::handle(base1)));
  py::dict ns;
  ns["__module__"] = "dflash2_rt";
  ns["__doc__"] = doc;
  py::object cls = type(name, bases, ns);
  m.attr(name) = cls;
  return cls.release().ptr();
}
}  // namespace

namespace dflash2::py_bind {
namespace {
std::atomic<unsigned long> g_main_ident{0};
}  // namespace
void set_main_thread_ident(unsigned long ident) { g_main_ident.store(ident); }
bool finalizing_off_main_thread() {
#if PY_VERSION_HEX >= 0x030D0000
  const bool fin = Py_IsFinalizing() != 0;
#else
  const bool fin = _Py_IsFinalizing() != 0;
#endif
  return fin && PyThread_get_thread_ident() != g_main_ident.load();
}
}  // namespace dflash2::py_bind

PYBIND11_MODULE(_core, m) {
  m.doc() = "dflash2_rt native core";
  dflash2::py_bind::set_main_thread_ident(
      py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>());
  PyObject* base = make_exc(m, "DFlash2Error", PyExc_Exception, nullptr, "Base class of dflash2_rt errors.");
  using dflash2::ErrorKind;
  g_exc[int(ErrorKind::InvalidArgument)] =
      make_exc(m, "InvalidArgumentError", base, PyExc_ValueError, "A bad request or API argument.");
  g_exc[int(ErrorKind::Checkpoint)] =
      make_exc(m, "CheckpointError", base, PyExc_ValueError, "A malformed, truncated or inconsistent checkpoint.");
  g_exc[int(ErrorKind::Config)] =
      make_exc(m, "ConfigError", base, PyExc_ValueError, "An inconsistent or unsupported configuration value.");
  g_exc[int(ErrorKind::Unsupported)] =
      make_exc(m, "UnsupportedError", base, PyExc_NotImplementedError, "A path that is not implemented.");
  g_exc[int(ErrorKind::Backend)] = make_exc(m, "BackendError", base, PyExc_RuntimeError, "A device/backend failure.");
  g_exc[int(ErrorKind::OutOfMemory)] =
      make_exc(m, "OutOfMemoryError", base, PyExc_MemoryError, "An allocation that does not fit.");
  g_exc[int(ErrorKind::Internal)] =
      make_exc(m, "InternalError", base, PyExc_RuntimeError, "A broken invariant inside the runtime.");
  g_exc[int(ErrorKind::Numerical)] = make_exc(m, "NumericalError", base, PyExc_ArithmeticError,
                                              "Non-finite values where the model must produce finite ones (NaN logits).");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const dflash2::RequestError& e) {
      // a failed request: the typed error, with .request_id naming the request
      PyObject* cls = g_exc[int(e.kind())];
      PyObject* inst = PyObject_CallFunction(cls, "s", e.what());
      if (inst) {
        PyObject* id = PyLong_FromLongLong(e.id);
        if (id) {
          PyObject_SetAttrString(inst, "request_id", id);
          Py_DECREF(id);
        }
        PyErr_SetObject(cls, inst);
        Py_DECREF(inst);
      }
    } catch (const dflash2::Error& e) {
      PyErr_SetString(g_exc[int(e.kind())], e.what());
    } catch (const std::bad_alloc&) {
      // An allocation of the standard library (a std::vector, a std::string) that failed:
      // the same typed error as an arena or device allocation, still a MemoryError. The
      // message is a literal: building one could fail again.
      PyErr_SetString(g_exc[int(ErrorKind::OutOfMemory)],
                      "out of host memory: an allocation of the native core failed (std::bad_alloc)");
    }
  });
  dflash2::py_bind::bind_core(m);
  dflash2::py_bind::bind_io(m);
  dflash2::py_bind::bind_ops(m);
  dflash2::py_bind::bind_sampling(m);
  dflash2::py_bind::bind_engine(m);
}
