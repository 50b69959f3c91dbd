// Internal to the Python extension: shared helpers of the bind_*.cpp files.
#pragma once
#include <pybind11/pybind11.h>

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

}  // namespace dflash2::py_bind
