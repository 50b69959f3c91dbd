// dflash2_rt._core.ops: the op interface, for tests (the backend-parity harness), tools
// and benchmarks. Ops run on the device of their inputs; outputs are allocated on that
// device unless `out=` is given (then they write into it, e.g. a view into a guarded buffer).
#include <pybind11/stl.h>

#include "bindings.h"
#include "dflash2/error.h"
#include "dflash2/ops.h"
#include "dflash2/safetensors.h"

namespace dflash2::py_bind {

namespace {

Tensor opt_tensor(py::handle h, const char* arg) {
  if (h.is_none()) return Tensor();
  return tensor_from_python(h, arg);
}

Tensor out_or_new(py::handle out, DType dt, const Tensor::Shape& shape, Device dev, const char* arg = "out") {
  if (out.is_none()) return Tensor::empty(dt, shape, dev);
  return tensor_from_python(out, arg);
}

ops::RopeStyle parse_style(const std::string& s) {
  if (s == "interleaved" || s == "gptj") return ops::RopeStyle::Interleaved;
  if (s == "neox" || s == "half") return ops::RopeStyle::NeoX;
  fail(ErrorKind::InvalidArgument, "rope: style must be 'interleaved' or 'neox', found '", s, "'");
}

}  // namespace

void bind_ops(py::module_& m) {
  py::module_ o = m.def_submodule("ops", "The op interface (runs on the device of its inputs).");

  py::class_<ops::Weight>(o, "Weight", "A linear layer's weight: dense (F32/BF16/F16), fp8 block-128 or NVFP4.")
      .def_static(
          "dense", [](py::handle w, const std::string& name) { return ops::Weight::dense(tensor_from_python(w, "w"), name); },
          py::arg("w"), py::arg("name") = "")
      .def_static(
          "fp8_block128",
          [](py::handle w, py::handle s, const std::string& name) {
            return ops::Weight::fp8_block128(tensor_from_python(w, "w"), tensor_from_python(s, "scale_inv"), name);
          },
          py::arg("w"), py::arg("scale_inv"), py::arg("name") = "")
      .def_static(
          "nvfp4",
          [](py::handle w, py::handle s, float g, float in_scale, const std::string& name) {
            return ops::Weight::nvfp4(tensor_from_python(w, "w"), tensor_from_python(s, "weight_scale"), g, in_scale,
                                      -1, name);
          },
          py::arg("w"), py::arg("weight_scale"), py::arg("weight_scale_2"), py::arg("input_scale") = 0.0f,
          py::arg("name") = "")
      .def_static(
          "load",
          [](const Checkpoint& ck, const std::string& prefix, int64_t out_f, int64_t in_f) {
            return ops::Weight::load(ck, prefix, out_f, in_f);
          },
          py::arg("checkpoint"), py::arg("prefix"), py::arg("out_features") = -1, py::arg("in_features") = -1,
          "Reads <prefix>.weight and its scales from a Checkpoint, detecting the format.")
      .def_property_readonly("format", [](const ops::Weight& w) { return std::string(ops::weight_format_name(w.format)); })
      .def_readonly("out_features", &ops::Weight::out_features)
      .def_readonly("in_features", &ops::Weight::in_features)
      .def_readonly("global_scale", &ops::Weight::global_scale)
      .def_readonly("input_scale", &ops::Weight::input_scale)
      .def_readonly("name", &ops::Weight::name)
      .def("dequantize", [](const ops::Weight& w) {
        py::gil_scoped_release nogil;
        return w.dequantize();
      });

  o.def(
      "linear",
      [](py::handle x, const ops::Weight& w, py::handle out, bool accumulate) {
        Tensor xt = tensor_from_python(x, "x");
        Tensor y = out_or_new(out, DType::F32, {xt.ndim() == 2 ? xt.shape(0) : 0, w.out_features}, xt.device());
        {
          py::gil_scoped_release nogil;
          ops::linear(xt, w, y, accumulate);
        }
        return y;
      },
      py::arg("x"), py::arg("weight"), py::arg("out") = py::none(), py::arg("accumulate") = false,
      "y[M, N] = x[M, K] @ W^T (fp32 accumulation; W dequantized in registers).");

  o.def(
      "rms_norm",
      [](py::handle x, py::handle w, float eps, py::handle out) {
        Tensor xt = tensor_from_python(x, "x"), wt = tensor_from_python(w, "w");
        Tensor ot = out_or_new(out, xt.dtype(), xt.shape(), xt.device());
        {
          py::gil_scoped_release nogil;
          ops::rms_norm(xt, wt, eps, ot);
        }
        return ot;
      },
      py::arg("x"), py::arg("w"), py::arg("eps") = 1e-6f, py::arg("out") = py::none());

  o.def(
      "layer_norm",
      [](py::handle x, py::handle w, py::handle b, float eps, py::handle out) {
        Tensor xt = tensor_from_python(x, "x"), wt = tensor_from_python(w, "w"), bt = opt_tensor(b, "b");
        Tensor ot = out_or_new(out, DType::F32, xt.shape(), xt.device());
        {
          py::gil_scoped_release nogil;
          ops::layer_norm(xt, wt, bt, eps, ot);
        }
        return ot;
      },
      py::arg("x"), py::arg("w"), py::arg("b") = py::none(), py::arg("eps") = 1e-5f, py::arg("out") = py::none());

  o.def(
      "rope",
      [](py::handle x, py::handle positions, double theta, const std::string& style) {
        Tensor xt = tensor_from_python(x, "x"), pt = tensor_from_python(positions, "positions");
        ops::RopeStyle st = parse_style(style);
        {
          py::gil_scoped_release nogil;
          ops::rope(xt, pt, theta, st);
        }
        return xt;
      },
      py::arg("x"), py::arg("positions"), py::arg("theta"), py::arg("style") = "interleaved",
      "In place on x [tokens, heads, dim] (any strides); returns x.");

  o.def(
      "silu_mul",
      [](py::handle g, py::handle u, py::handle out) {
        Tensor gt = tensor_from_python(g, "gate"), ut = tensor_from_python(u, "up");
        Tensor ot = out_or_new(out, DType::F32, gt.shape(), gt.device());
        {
          py::gil_scoped_release nogil;
          ops::silu_mul(gt, ut, ot);
        }
        return ot;
      },
      py::arg("gate"), py::arg("up"), py::arg("out") = py::none());

  o.def(
      "gated_mlp",
      [](py::handle x, const ops::Weight& g, const ops::Weight& u, const ops::Weight& d, py::handle out) {
        Tensor xt = tensor_from_python(x, "x");
        DFLASH2_CHECK_ARG(xt.ndim() == 2, "gated_mlp: x must be 2-D, found ", xt.describe());
        Tensor ot = out_or_new(out, DType::F32, {xt.shape(0), d.out_features}, xt.device());
        Tensor scratch = Tensor::empty(DType::F32, {2 * xt.shape(0) * g.out_features}, xt.device());
        {
          py::gil_scoped_release nogil;
          ops::gated_mlp(xt, g, u, d, ot, scratch);
        }
        return ot;
      },
      py::arg("x"), py::arg("gate"), py::arg("up"), py::arg("down"), py::arg("out") = py::none());

  o.def(
      "softmax",
      [](py::handle x, float scale, py::handle out) {
        Tensor xt = tensor_from_python(x, "x");
        Tensor ot = out_or_new(out, DType::F32, xt.shape(), xt.device());
        {
          py::gil_scoped_release nogil;
          ops::softmax(xt, ot, scale);
        }
        return ot;
      },
      py::arg("x"), py::arg("scale") = 1.0f, py::arg("out") = py::none());

  o.def(
      "topk",
      [](py::handle x, int64_t k) {
        Tensor xt = tensor_from_python(x, "x");
        DFLASH2_CHECK_ARG(xt.ndim() >= 1, "topk: x must have at least one dimension");
        Tensor::Shape s = xt.shape();
        s.back() = k;
        DFLASH2_CHECK_ARG(k >= 1, "topk: k must be >= 1, found ", k);
        Tensor v = Tensor::empty(DType::F32, s, xt.device()), i = Tensor::empty(DType::I32, s, xt.device());
        {
          py::gil_scoped_release nogil;
          ops::topk(xt, k, v, i);
        }
        return py::make_tuple(v, i);
      },
      py::arg("x"), py::arg("k"), "(values F32, indices I32), sorted descending, ties to the lower index.");

  o.def(
      "embedding",
      [](py::handle table, py::handle ids, py::handle out) {
        Tensor tt = tensor_from_python(table, "table"), it = tensor_from_python(ids, "ids");
        DFLASH2_CHECK_ARG(tt.ndim() == 2 && it.ndim() == 1, "embedding: table must be 2-D and ids 1-D, found ",
                          tt.describe(), " and ", it.describe());
        Tensor ot = out_or_new(out, DType::F32, {it.shape(0), tt.shape(1)}, tt.device());
        {
          py::gil_scoped_release nogil;
          ops::embedding(tt, it, ot);
        }
        return ot;
      },
      py::arg("table"), py::arg("ids"), py::arg("out") = py::none());
}

}  // namespace dflash2::py_bind
