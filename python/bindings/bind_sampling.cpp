// dflash2_rt._core.ops: sampling and acceptance (sample, accept), in their own file.
// Outputs are allocated on the logits' device; rng is I64 [R, 2] (key, counter) per row.
#include <pybind11/stl.h>

#include "bindings.h"
#include "dflash2/error.h"
#include "dflash2/ops.h"

namespace dflash2::py_bind {

namespace {
Tensor opt(py::handle h, const char* arg) { return h.is_none() ? Tensor() : tensor_from_python(h, arg); }
}  // namespace

void bind_sampling(py::module_& m) {
  py::module_ o = m.attr("ops").cast<py::module_>();
  o.def(
      "sample",
      [](py::handle logits, py::handle temperature, py::handle top_p, py::handle top_k, py::handle rng) {
        Tensor lg = tensor_from_python(logits, "logits");
        ops::SamplingTensors sp{tensor_from_python(temperature, "temperature"), tensor_from_python(top_p, "top_p"),
                                tensor_from_python(top_k, "top_k")};
        Tensor r = tensor_from_python(rng, "rng");
        DFLASH2_CHECK_ARG(lg.ndim() == 2, "sample: logits must be 2-D, found ", lg.describe());
        Tensor out = Tensor::empty(DType::I32, {lg.shape(0)}, lg.device());
        {
          ReleaseGil nogil;
          ops::sample(lg, sp, r, out);
        }
        return out;
      },
      py::arg("logits"), py::arg("temperature"), py::arg("top_p"), py::arg("top_k"), py::arg("rng"),
      "One token per row (argmax where temperature <= 0; else one draw of rng[r] from the "
      "temperature / top-k / top-p distribution).");
  o.def(
      "accept",
      [](py::handle logits, py::handle row0, py::handle draft, py::handle draft_row, py::handle draft_len,
         py::handle cand, py::handle q, py::handle temperature, py::handle top_p, py::handle top_k, py::handle rng) {
        Tensor lg = tensor_from_python(logits, "logits"), r0 = tensor_from_python(row0, "row0");
        ops::SamplingTensors sp{tensor_from_python(temperature, "temperature"), tensor_from_python(top_p, "top_p"),
                                tensor_from_python(top_k, "top_k")};
        DFLASH2_CHECK_ARG(r0.ndim() == 1, "accept: row0 must be 1-D, found ", r0.describe());
        Tensor acc = Tensor::empty(DType::I32, {r0.shape(0)}, lg.device());
        Tensor bon = Tensor::empty(DType::I32, {r0.shape(0)}, lg.device());
        Tensor d = tensor_from_python(draft, "draft"), dr = tensor_from_python(draft_row, "draft_row"),
               dl = tensor_from_python(draft_len, "draft_len"), c = opt(cand, "cand"), qq = opt(q, "q"),
               r = tensor_from_python(rng, "rng");
        {
          ReleaseGil nogil;
          ops::accept(lg, r0, d, dr, dl, c, qq, sp, r, acc, bon);
        }
        return py::make_tuple(acc, bon);
      },
      py::arg("logits"), py::arg("row0"), py::arg("draft"), py::arg("draft_row"), py::arg("draft_len"),
      py::arg("cand") = py::none(), py::arg("q") = py::none(), py::arg("temperature"), py::arg("top_p"),
      py::arg("top_k"), py::arg("rng"), "(accepted I32 [S], bonus I32 [S]): lossless acceptance of drafted blocks.");
}

}  // namespace dflash2::py_bind
