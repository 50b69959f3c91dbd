// Tensor <-> DLPack (zero copy both ways), devices, build info.
#include <pybind11/stl.h>

#include <cstring>

#include "bindings.h"
#include "dflash2/build_info.h"
#include "dflash2/error.h"
#include "dlpack_abi.h"

namespace dflash2::py_bind {

namespace {

bool to_dl_dtype(DType t, DLDataType* out) {
  switch (t) {
    case DType::F32: *out = {kDLFloat, 32, 1}; return true;
    case DType::F16: *out = {kDLFloat, 16, 1}; return true;
    case DType::BF16: *out = {kDLBfloat, 16, 1}; return true;
    case DType::F8_E4M3: *out = {kDLFloat8_e4m3fn, 8, 1}; return true;
    case DType::U8: *out = {kDLUInt, 8, 1}; return true;
    case DType::I32: *out = {kDLInt, 32, 1}; return true;
    case DType::I64: *out = {kDLInt, 64, 1}; return true;
  }
  return false;
}

DType from_dl_dtype(const DLDataType& d, const char* arg) {
  if (d.lanes == 1) {
    if (d.code == kDLFloat && d.bits == 32) return DType::F32;
    if (d.code == kDLFloat && d.bits == 16) return DType::F16;
    if (d.code == kDLBfloat && d.bits == 16) return DType::BF16;
    if (d.code == kDLFloat8_e4m3fn && d.bits == 8) return DType::F8_E4M3;
    if (d.code == kDLUInt && d.bits == 8) return DType::U8;
    if (d.code == kDLInt && d.bits == 32) return DType::I32;
    if (d.code == kDLInt && d.bits == 64) return DType::I64;
  }
  fail(ErrorKind::InvalidArgument, "argument '", arg, "': unsupported DLPack dtype (code ", int(d.code), ", bits ",
       int(d.bits), ", lanes ", d.lanes, "); supported: float32, float16, bfloat16, float8_e4m3fn, uint8, int32, int64");
}

// What a produced DLManagedTensor owns.
struct ExportCtx {
  Tensor t;
  int64_t shape[Tensor::kMaxDims];
  int64_t strides[Tensor::kMaxDims];
};

void export_deleter(DLManagedTensor* mt) {
  delete static_cast<ExportCtx*>(mt->manager_ctx);
  delete mt;
}
void export_deleter_v(DLManagedTensorVersioned* mt) {
  delete static_cast<ExportCtx*>(mt->manager_ctx);
  delete mt;
}

// Only an unconsumed capsule still owns its tensor.
void capsule_destructor(PyObject* cap) {
  if (PyCapsule_IsValid(cap, "dltensor")) {
    auto* mt = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
    if (mt && mt->deleter) mt->deleter(mt);
  } else {
    PyErr_Clear();
  }
}
void capsule_destructor_v(PyObject* cap) {
  if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
    auto* mt = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(cap, "dltensor_versioned"));
    if (mt && mt->deleter) mt->deleter(mt);
  } else {
    PyErr_Clear();
  }
}

void fill_dl(const Tensor& t, ExportCtx* ctx, DLTensor* dl) {
  for (int i = 0; i < t.ndim(); ++i) {
    ctx->shape[i] = t.shape(i);
    ctx->strides[i] = t.stride(i);
  }
  dl->data = t.data();
  dl->device = {t.device().is_cpu() ? kDLCPU : kDLCUDA, t.device().is_cpu() ? 0 : t.device().index};
  dl->ndim = t.ndim();
  to_dl_dtype(t.dtype(), &dl->dtype);
  dl->shape = ctx->shape;
  dl->strides = ctx->strides;
  dl->byte_offset = 0;
}

py::capsule to_capsule(const Tensor& t, bool versioned) {
  auto* ctx = new ExportCtx{t, {}, {}};
  PyObject* cap;
  if (versioned) {
    auto* mt = new DLManagedTensorVersioned{};
    mt->version = {1, 0};
    mt->manager_ctx = ctx;
    mt->deleter = export_deleter_v;
    mt->flags = 0;  // writable, not a copy
    fill_dl(t, ctx, &mt->dl_tensor);
    cap = PyCapsule_New(mt, "dltensor_versioned", capsule_destructor_v);
    if (!cap) export_deleter_v(mt);
  } else {
    auto* mt = new DLManagedTensor{};
    mt->manager_ctx = ctx;
    mt->deleter = export_deleter;
    fill_dl(t, ctx, &mt->dl_tensor);
    cap = PyCapsule_New(mt, "dltensor", capsule_destructor);
    if (!cap) export_deleter(mt);
  }
  if (!cap) throw py::error_already_set();
  return py::reinterpret_steal<py::capsule>(cap);
}

std::vector<int64_t> to_shape(py::handle h) {
  std::vector<int64_t> s;
  for (auto v : h) s.push_back(v.cast<int64_t>());
  return s;
}

DType parse_dtype(const std::string& s) {
  std::string u;
  for (char c : s) u += char(std::toupper(static_cast<unsigned char>(c)));
  static const std::pair<const char*, DType> aliases[] = {
      {"FLOAT32", DType::F32}, {"FLOAT16", DType::F16}, {"BFLOAT16", DType::BF16}, {"FLOAT8_E4M3FN", DType::F8_E4M3},
      {"UINT8", DType::U8},    {"INT32", DType::I32},   {"INT64", DType::I64}};
  DType t;
  if (dtype_from_name(u, &t)) return t;
  for (auto& a : aliases)
    if (u == a.first) return a.second;
  fail(ErrorKind::InvalidArgument, "unknown dtype '", s, "' (expected one of F32, F16, BF16, F8_E4M3, U8, I32, I64)");
}

}  // namespace

Device parse_device(const std::string& s) { return Device::parse(s); }

Tensor tensor_from_python(py::handle obj, const char* arg) {
  if (py::isinstance<Tensor>(obj)) return obj.cast<Tensor>();
  if (!py::hasattr(obj, "__dlpack__"))
    fail(ErrorKind::InvalidArgument, "argument '", arg, "': expected an array supporting DLPack (numpy, torch, "
         "dflash2_rt.Tensor), found ", std::string(py::str(py::type::of(obj).attr("__name__"))));
  py::object cap_obj = obj.attr("__dlpack__")();
  PyObject* cap = cap_obj.ptr();
  if (!PyCapsule_IsValid(cap, "dltensor"))
    fail(ErrorKind::InvalidArgument, "argument '", arg, "': __dlpack__ did not return a 'dltensor' capsule");
  auto* mt = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
  PyCapsule_SetName(cap, "used_dltensor");
  // From here on we own mt; its deleter may touch Python objects, so it runs under the GIL.
  std::shared_ptr<void> owner(mt, [](void* p) {
    auto* m = static_cast<DLManagedTensor*>(p);
    if (!m->deleter) return;
    // interpreter gone, or finalizing while this is another thread (which PyGILState_Ensure
    // would end by pthread_exit inside this noexcept deleter: an abort): leak rather than crash
    if (!Py_IsInitialized() || finalizing_off_main_thread()) return;
    PyGILState_STATE st = PyGILState_Ensure();
    m->deleter(m);
    PyGILState_Release(st);
  });
  const DLTensor& dl = mt->dl_tensor;
  DType dt = from_dl_dtype(dl.dtype, arg);
  Device dev;
  if (dl.device.device_type == kDLCPU || dl.device.device_type == kDLCUDAHost)
    dev = Device::cpu();
  else if (dl.device.device_type == kDLCUDA)
    dev = Device::cuda(dl.device.device_id);
  else
    fail(ErrorKind::InvalidArgument, "argument '", arg, "': unsupported DLPack device type ", dl.device.device_type);
  if (dl.ndim > Tensor::kMaxDims)
    fail(ErrorKind::InvalidArgument, "argument '", arg, "': rank ", dl.ndim, " exceeds ", Tensor::kMaxDims);
  Tensor::Shape shape(dl.shape, dl.shape + dl.ndim);
  Tensor::Shape strides;
  if (dl.strides) strides.assign(dl.strides, dl.strides + dl.ndim);
  return Tensor::view(static_cast<char*>(dl.data) + dl.byte_offset, dt, shape, strides, dev, owner);
}

py::object tensor_to_python(const Tensor& t) { return py::cast(t); }

void bind_core(py::module_& m) {
  m.attr("__version__") = build_info().version;

  py::class_<Tensor>(m, "Tensor",
                     "A strided tensor of the native core. Crosses to numpy/torch without copies through "
                     "DLPack: numpy.from_dlpack(t), torch.from_dlpack(t), dflash2_rt.from_dlpack(array).")
      .def_static(
          "empty", [](const std::string& dtype, py::handle shape, const std::string& device) {
            return Tensor::empty(parse_dtype(dtype), to_shape(shape), parse_device(device));
          },
          py::arg("dtype"), py::arg("shape"), py::arg("device") = "cpu")
      .def_static(
          "zeros", [](const std::string& dtype, py::handle shape, const std::string& device) {
            return Tensor::zeros(parse_dtype(dtype), to_shape(shape), parse_device(device));
          },
          py::arg("dtype"), py::arg("shape"), py::arg("device") = "cpu")
      .def_property_readonly("shape", [](const Tensor& t) { return py::tuple(py::cast(t.shape())); })
      .def_property_readonly("strides", [](const Tensor& t) { return py::tuple(py::cast(t.strides())); })
      .def_property_readonly("dtype", [](const Tensor& t) { return std::string(dtype_name(t.dtype())); })
      .def_property_readonly("device", [](const Tensor& t) { return t.device().str(); })
      .def_property_readonly("ndim", &Tensor::ndim)
      .def_property_readonly("numel", &Tensor::numel)
      .def_property_readonly("nbytes", &Tensor::nbytes)
      .def_property_readonly("data_ptr", [](const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data()); })
      .def("is_contiguous", &Tensor::is_contiguous)
      .def("contiguous", &Tensor::contiguous)
      .def("to", [](const Tensor& t, const std::string& dev) { return t.to(parse_device(dev)); }, py::arg("device"))
      .def("slice", &Tensor::slice, py::arg("dim"), py::arg("begin"), py::arg("end"))
      .def("reshape", [](const Tensor& t, py::handle shape) { return t.reshape(to_shape(shape)); })
      .def("copy_from", [](Tensor& t, py::handle src) { t.copy_from(tensor_from_python(src, "src")); })
      .def(
          "__dlpack__",
          [](const Tensor& t, py::object stream, py::object max_version, py::object dl_device, py::object copy) {
            bool versioned = false;
            if (!max_version.is_none()) versioned = py::cast<py::tuple>(max_version)[0].cast<int>() >= 1;
            return to_capsule(t, versioned);
          },
          py::arg("stream") = py::none(), py::arg("max_version") = py::none(), py::arg("dl_device") = py::none(),
          py::arg("copy") = py::none())
      .def("__dlpack_device__",
           [](const Tensor& t) {
             return py::make_tuple(t.device().is_cpu() ? int(kDLCPU) : int(kDLCUDA),
                                   t.device().is_cpu() ? 0 : t.device().index);
           })
      .def("numpy",
           [](py::object self) {
             return py::module_::import("numpy").attr("from_dlpack")(self);
           },
           "A numpy view (no copy) of a CPU tensor; numpy has no bfloat16/float8, convert those with torch.")
      .def("__repr__", [](const Tensor& t) { return "dflash2_rt.Tensor(" + t.describe() + ")"; });

  m.def("from_dlpack", [](py::handle obj) { return tensor_from_python(obj, "obj"); }, py::arg("obj"));
  m.def(
      "cuda_available",
      [](bool with_reason) -> py::object {
        std::string why;
        bool ok = cuda_available(&why);
        if (with_reason) return py::make_tuple(ok, why);
        return py::bool_(ok);
      },
      py::arg("with_reason") = false,
      "Whether the CUDA backend is compiled in and a device is usable; with_reason=True returns (ok, why).");
  m.def("cuda_device_count", &cuda_device_count);
  m.def("set_num_threads", &set_num_threads, py::arg("n"));
  m.def("build_info", []() {
    BuildInfo b = build_info();
    py::dict d;
    d["version"] = b.version;
    d["backends"] = b.backends;
    d["cuda_archs"] = b.cuda_archs;
    d["cuda_version"] = b.cuda_version;
    d["cuda_emulated"] = b.cuda_emulated;
    d["nccl"] = b.nccl;
    d["nccl_version"] = b.nccl_version;
    d["cutlass"] = b.cutlass;
    d["cutlass_version"] = b.cutlass_version;
    d["compiler"] = b.compiler;
    d["cpu_isa"] = b.cpu_isa;
    d["blas"] = b.blas;
    d["threading"] = b.threading;
    d["num_threads"] = b.num_threads;
    py::dict ops;
    for (const auto& e : b.ops) ops[py::str(e.first)] = e.second;
    d["ops"] = ops;
    return d;
  });
}

}  // namespace dflash2::py_bind
