// Internal to the Python extension: shared helpers of the bind_*.cpp files.
#pragma once
#include <pybind11/pybind11.h>

#include <chrono>
#include <exception>
#include <thread>

#include "dflash2/tensor.h"

namespace py = pybind11;

namespace dflash2::py_bind {

void bind_core(py::module_& m);  // Tensor (DLPack in/out), Arena, build_info, devices
void bind_io(py::module_& m);    // checkpoints, safetensors, config
void bind_ops(py::module_& m);   // the op interface (submodule "ops")
void bind_sampling(py::module_& m);  // ops.sample, ops.accept (after bind_ops)
void bind_engine(py::module_& m);  // Engine, Sequence, GenerationResult

// Any object with __dlpack__ (numpy, torch, dflash2_rt.Tensor) -> a zero-copy view that
// keeps the producer alive. `arg` names the argument in error messages.
Tensor tensor_from_python(py::handle obj, const char* arg);
// "cpu", "cuda", "cuda:N".
Device parse_device(const std::string& s);
// Wraps a Tensor as a dflash2_rt._core.Tensor (which supports __dlpack__, .numpy()).
py::object tensor_to_python(const Tensor& t);

// Whether the interpreter is finalizing and this is not its main thread (the one that
// finalizes): a thread that takes the GIL then is ended by pthread_exit (CPython < 3.14).
// The main thread's ident is read once at import (module.cpp).
void set_main_thread_ident(unsigned long ident);
bool finalizing_off_main_thread();

// The GIL released for the scope, as py::gil_scoped_release, but safe in a daemon thread at
// interpreter exit. While the interpreter finalizes, CPython before 3.14 ends a thread that
// takes the GIL back by pthread_exit, a forced unwind from inside PyEval_RestoreThread;
// py::gil_scoped_release takes it back in its destructor, which is noexcept, so the unwind
// called std::terminate ("terminate called without an active exception") and the whole
// process aborted at exit (seen with a daemon thread polling a stream, a few exits in a
// hundred on a loaded machine). Here a thread other than the main one that finds the
// interpreter finalizing does not take the GIL back: it parks (a daemon thread of a process
// that is exiting). If finalization starts between that check and the call, the unwind
// leaves through this noexcept(false) destructor and pybind11's dispatcher (which rethrows
// abi::__forced_unwind) and ends only that thread.
class ReleaseGil {
 public:
  ReleaseGil() : ts_(PyEval_SaveThread()) {}
  ReleaseGil(const ReleaseGil&) = delete;
  ReleaseGil& operator=(const ReleaseGil&) = delete;
  ~ReleaseGil() noexcept(false) {
    if (finalizing_off_main_thread())
      for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
    PyEval_RestoreThread(ts_);
  }

 private:
  PyThreadState* ts_;
};

}  // namespace dflash2::py_bind
