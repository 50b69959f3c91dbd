// dflash2_rt._core.ops: the op interface, for tests (the backend-parity harness), tools
// and benchmarks. Ops run on the device of their inputs; outputs are allocated on that
// device unless `out=` is given (then they write into it, e.g. a view into a guarded buffer).
#include <cmath>
#include <pybind11/stl.h>

#include <algorithm>
#include <string>
#include <vector>

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

// A GEMM numerics name (moe_experts, gated_mlp: numerics=...).
ops::GemmNumerics gemm_numerics(const char* op, const std::string& s) {
  if (s == "exact") return ops::GemmNumerics::Exact;
  if (s == "bf16") return ops::GemmNumerics::BF16;
  if (s == "fp8") return ops::GemmNumerics::FP8;
  if (s == "nvfp4") return ops::GemmNumerics::NVFP4;
  fail(ErrorKind::InvalidArgument, op, ": numerics must be 'exact', 'bf16', 'fp8' or 'nvfp4', found '", s, "'");
}

ops::RopeStyle parse_style(const std::string& s) {
  if (s == "interleaved" || s == "gptj") return ops::RopeStyle::Interleaved;
  if (s == "neox" || s == "half") return ops::RopeStyle::NeoX;
  fail(ErrorKind::InvalidArgument, "rope: style must be 'interleaved' or 'neox', found '", s, "'");
}

// Size of dim i of t (negative i counts from the end), or 0 when t has no such dim: the
// shape of a default output is only a guess when the inputs are malformed, and the op's
// own validation then names the bad argument.
int64_t dim_or0(const Tensor& t, int i) {
  if (!t.defined()) return 0;
  if (i < 0) i += t.ndim();
  return i >= 0 && i < t.ndim() ? t.shape(i) : 0;
}

ops::PagedTokens paged_tokens(py::handle seq, py::handle pos, py::handle block_table, int64_t block_size) {
  ops::PagedTokens tok;
  tok.seq = tensor_from_python(seq, "seq");
  tok.pos = tensor_from_python(pos, "pos");
  tok.block_table = tensor_from_python(block_table, "block_table");
  tok.block_size = block_size;
  return tok;
}

py::object none_or(const Tensor& t) { return t.defined() ? py::cast(t) : py::object(py::none()); }

}  // namespace

void bind_ops(py::module_& m) {
  py::module_ o = m.def_submodule("ops", "The op interface (runs on the device of its inputs).");
  // A process-wide switch of ops.h (DFLASH2_SWITCH): its getter and set_<name>(on).
  const auto def_switch = [&o](const char* name, bool (*get)(), void (*set)(bool), const char* doc,
                               const char* set_doc) {
    o.def(name, get, doc);
    o.def(("set_" + std::string(name)).c_str(), set, py::arg("on"), set_doc);
  };

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
        ReleaseGil nogil;
        return w.dequantize();
      })
      .def_property_readonly("device", [](const ops::Weight& w) { return w.data.device().str(); })
      .def("prepare_nvfp4_scales", [](ops::Weight& w) {
        ReleaseGil nogil;
        return ops::prepare_nvfp4_scales(w);
      }, "On a GPU whose linear_nvfp4 reads it (sm_100a / sm_103a), stores this W4A4 weight's scales in the "
         "tensor-core GEMMs' block-scaled layout once, so calls do not swizzle them; returns whether it did "
         "(False on the CPU, on Hopper, for other formats). The engine does this at load.")
      .def_property_readonly("nvfp4_scales_prepared", [](const ops::Weight& w) { return w.sf_blocked.defined(); })
      .def("rows", &ops::Weight::rows, py::arg("begin"), py::arg("end"),
           "A view of output rows [begin, end) (a quantization block may not be split).")
      .def("cols", &ops::Weight::cols, py::arg("begin"), py::arg("end"),
           "A view of input columns [begin, end) (a quantization block may not be split).")
      .def("to", [](const ops::Weight& w, const std::string& device) {
        const Device d = parse_device(device);
        ReleaseGil nogil;
        return w.to(d);
      }, py::arg("device"), "The weight with its data and scales copied (contiguous) to device ('cpu', 'cuda:N').");

  // linear, linear_bf16 and linear_fp8: the same signature, three numerics
  auto bind_linear = [&o](const char* name, void (*fn)(const Tensor&, const ops::Weight&, Tensor&, bool),
                          const char* doc) {
    o.def(
        name,
        [fn](py::handle x, const ops::Weight& w, py::handle out, bool accumulate) {
          Tensor xt = tensor_from_python(x, "x");
          Tensor y = out_or_new(out, DType::F32, {xt.ndim() == 2 ? xt.shape(0) : 0, w.out_features}, xt.device());
          {
            ReleaseGil nogil;
            fn(xt, w, y, accumulate);
          }
          return y;
        },
        py::arg("x"), py::arg("weight"), py::arg("out") = py::none(), py::arg("accumulate") = false, doc);
  };
  bind_linear("linear", &ops::linear, "y[M, N] = x[M, K] @ W^T (fp32 accumulation; W dequantized in registers).");
  o.def(
      "linear_bf16",
      [](py::handle x, const ops::Weight& w, py::handle out, bool accumulate, bool decode) {
        Tensor xt = tensor_from_python(x, "x");
        Tensor y = out_or_new(out, DType::F32, {xt.ndim() == 2 ? xt.shape(0) : 0, w.out_features}, xt.device());
        {
          ReleaseGil nogil;
          ops::linear_bf16(xt, w, y, accumulate, decode);
        }
        return y;
      },
      py::arg("x"), py::arg("weight"), py::arg("out") = py::none(), py::arg("accumulate") = false,
      py::arg("decode") = false,
      "y = bf16(x) @ bf16(W)^T, fp32 accumulation: the tensor-core numerics of prompt tokens (CUTLASS on sm_90a / "
      "sm_100a / sm_103a, emulated on the CPU); decode=True: the kernel of generated tokens' few rows (CUDA: the "
      "skinny split-K GEMM, same numerics; the CPU has one kernel).");
  def_switch("op_timing", &ops::op_timing, &ops::set_op_timing,
             "Whether every op dispatched from now on is timed (starts off unless DFLASH2_OP_TIMING=1): see "
             "set_op_timing.",
             "Per-op timing, for finding where a step's time goes: while on, each op adds one call and its time to "
             "op_times() -- the host's clock on the CPU, the device time between two events around it on a CUDA "
             "device (each op then waits for its end: slower runs, every op's own kernel time). Nested ops count in "
             "the outermost; ops captured into a CUDA graph are not timed (time an engine with cuda_graphs=False).");
  o.def(
      "op_times",
      [](bool reset) {
        py::list out;
        for (const ops::OpTime& t : ops::op_times(reset)) {
          py::dict d;
          d["op"] = t.op;
          d["device"] = t.device;
          d["calls"] = t.calls;
          d["seconds"] = t.seconds;
          out.append(d);
        }
        return out;
      },
      py::arg("reset") = false,
      "The op timing totals since the last reset, largest time first: [{op, device, calls, seconds}]; "
      "reset=True starts again from zero.");
  def_switch("fused_launches", &ops::fused_launches, &ops::set_fused_launches,
             "Whether ops that run several of one kind (rope_many, rms_norm_many, linear_many, ...) take one kernel "
             "for them on CUDA (starts on unless DFLASH2_FUSED_LAUNCHES=0).",
             "Sets fused_launches() for the ops issued from now on (engines built later capture their CUDA graphs with "
             "it): the same results either way; for an A/B of the kernel counts in one process.");
  def_switch("pdl", &ops::pdl, &ops::set_pdl,
             "Whether CUDA graphs captured from now on chain their kernels with programmatic dependent launch (each "
             "kernel's launch overlaps the one before it, which it still waits for; the same results). On unless "
             "DFLASH2_PDL=0 (an H200 ran the bundled pair x1.08 faster with it, the same tokens).",
             "Sets pdl() for the CUDA graphs captured from now on (engines built later capture theirs with it).");
  def_switch("dq_wgmma", &ops::dq_wgmma, &ops::set_dq_wgmma,
             "Whether the mainloop-dequantizing GEMM (NVFP4 / FP8 weights' linear_bf16, the grouped experts under "
             "\"bf16\") takes its wgmma form on Hopper rather than its mma.sync form (starts on unless "
             "DFLASH2_DQ_WGMMA=0; a failed load-time check turns it off). No effect on other devices.",
             "Sets dq_wgmma() for the GEMMs issued from now on (an A/B of the two forms in one process).");
  def_switch("exact_tc", &ops::exact_tc, &ops::set_exact_tc,
             "Whether linear of BF16 / FP8 / NVFP4 weights runs on the GPU's tensor cores in its exact form (x as three "
             "BF16 planes summing to x, every product exact, fp32 sums: linear's numerics up to summation order) rather "
             "than the SIMT kernel. Off unless DFLASH2_EXACT_TC=1: not yet measured on a GPU. No effect on the CPU.",
             "Sets exact_tc() for the linears issued from now on (set it before an engine loads, and leave it).");
  def_switch("wide_rows", &ops::wide_rows, &ops::set_wide_rows,
             "Whether the CUDA backend's sample / accept / topk / argmax / argmax_shard / check_finite split rows longer "
             "than 4096 ids over "
             "several thread blocks (one per 4096-id chunk) rather than one block per row (starts on unless "
             "DFLASH2_WIDE_ROWS=0). The same decisions as the CPU either way. No effect on the CPU.",
             "Sets wide_rows() for the calls issued from now on (an A/B of the two forms).");
  def_switch("mla_tc", &ops::mla_tc, &ops::set_mla_tc,
             "Whether the CUDA backend's mla_attention runs a BF16 latent cache on the tensor cores (exact products of "
             "BF16 keys and three-plane BF16 queries / weights, fp32 sums) rather than the SIMT kernel (starts on unless "
             "DFLASH2_MLA_TC=0). No effect on the CPU or on F32 caches.",
             "Sets mla_tc() for the calls issued from now on (it changes the numerics: set it before an engine loads).");
  def_switch("indexer_tc", &ops::indexer_tc, &ops::set_indexer_tc,
             "Whether the CUDA backend's indexer_topk / indexer_scores score a BF16 index-key cache on the tensor "
             "cores (exact products of BF16 keys and three-plane BF16 queries, fp32 sums; at most 64 heads, head_dim "
             "a multiple of 8 up to 256) rather than the SIMT kernel (starts on unless DFLASH2_INDEXER_TC=0). No "
             "effect on the CPU or on F32 caches.",
             "Sets indexer_tc() for the calls issued from now on (it changes the numerics: set it before an engine "
             "loads).");
  o.def("linear_bf16_available", [](const std::string& dev) { return ops::linear_bf16_available(Device::parse(dev)); },
        py::arg("device"), "Whether linear_bf16 runs on this device in this build.");
  bind_linear("linear_fp8", &ops::linear_fp8,
              "FP8 block-128 W8A8: x quantized per 128 inputs to E4M3 (scale amax / 448), per-block E4M3 dot "
              "products scaled by the activation and weight block scales, fp32 accumulation (CUTLASS wgmma on "
              "sm_90a, emulated on the CPU). The weight must be FP8 block-128.");
  o.def("linear_fp8_available", [](const std::string& dev) { return ops::linear_fp8_available(Device::parse(dev)); },
        py::arg("device"), "Whether linear_fp8 runs on this device in this build.");
  bind_linear("linear_nvfp4", &ops::linear_nvfp4,
              "NVFP4 W4A4: x quantized as nvfp4_quantize_act(x, weight.input_scale), times the NVFP4 weight (CUTLASS "
              "block-scaled tcgen05 on sm_100a / sm_103a, emulated on the CPU). The weight must be NVFP4 with an "
              "input_scale.");
  o.def("linear_nvfp4_available",
        [](const std::string& dev) { return ops::linear_nvfp4_available(Device::parse(dev)); }, py::arg("device"),
        "Whether linear_nvfp4 runs on this device in this build.");

  o.def(
      "rms_norm",
      [](py::handle x, py::handle w, float eps, py::handle out) {
        Tensor xt = tensor_from_python(x, "x"), wt = tensor_from_python(w, "w");
        Tensor ot = out_or_new(out, xt.dtype(), xt.shape(), xt.device());
        {
          ReleaseGil nogil;
          ops::rms_norm(xt, wt, eps, ot);
        }
        return ot;
      },
      py::arg("x"), py::arg("w"), py::arg("eps") = 1e-6f, py::arg("out") = py::none());

  o.def(
      "rms_norm_many",
      [](const py::list& xs, const py::list& ws, const std::vector<float>& eps, const py::list& outs) {
        std::vector<Tensor> xt, wt, ot;
        for (size_t i = 0; i < xs.size(); ++i) xt.push_back(tensor_from_python(xs[i], "xs[i]"));
        for (size_t i = 0; i < ws.size(); ++i) wt.push_back(tensor_from_python(ws[i], "ws[i]"));
        for (size_t i = 0; i < outs.size(); ++i) ot.push_back(tensor_from_python(outs[i], "outs[i]"));
        std::vector<const Tensor*> xp, wp;
        std::vector<Tensor*> op;
        for (Tensor& t : xt) xp.push_back(&t);
        for (Tensor& t : wt) wp.push_back(&t);
        for (Tensor& t : ot) op.push_back(&t);
        {
          ReleaseGil nogil;
          ops::rms_norm_many(xp, wp, eps, op);
        }
        return outs;
      },
      py::arg("xs"), py::arg("ws"), py::arg("eps"), py::arg("outs"),
      "rms_norm(xs[i], ws[i], eps[i], out=outs[i]) for every i (one kernel on CUDA where their dtypes agree and no "
      "output shares an element with another's input or output); returns outs.");

  o.def(
      "layer_norm",
      [](py::handle x, py::handle w, py::handle b, float eps, py::handle out) {
        Tensor xt = tensor_from_python(x, "x"), wt = tensor_from_python(w, "w"), bt = opt_tensor(b, "b");
        Tensor ot = out_or_new(out, DType::F32, xt.shape(), xt.device());
        {
          ReleaseGil nogil;
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
          ReleaseGil nogil;
          ops::rope(xt, pt, theta, st);
        }
        return xt;
      },
      py::arg("x"), py::arg("positions"), py::arg("theta"), py::arg("style") = "interleaved",
      "In place on x [tokens, heads, dim] (any strides); returns x.");

  o.def(
      "rope_many",
      [](const py::list& xs, py::handle positions, double theta, const std::string& style) {
        std::vector<Tensor> ts;
        for (size_t i = 0; i < xs.size(); ++i) ts.push_back(tensor_from_python(xs[i], "xs[i]"));
        std::vector<Tensor*> ps;
        for (Tensor& t : ts) ps.push_back(&t);
        Tensor pt = tensor_from_python(positions, "positions");
        ops::RopeStyle st = parse_style(style);
        {
          ReleaseGil nogil;
          ops::rope_many(ps, pt, theta, st);
        }
        return xs;
      },
      py::arg("xs"), py::arg("positions"), py::arg("theta"), py::arg("style") = "interleaved",
      "rope on every tensor of xs in place (one kernel on CUDA where their rotary dims agree and they share no "
      "element); returns xs.");

  o.def(
      "silu_mul",
      [](py::handle g, py::handle u, py::handle out) {
        Tensor gt = tensor_from_python(g, "gate"), ut = tensor_from_python(u, "up");
        Tensor ot = out_or_new(out, DType::F32, gt.shape(), gt.device());
        {
          ReleaseGil nogil;
          ops::silu_mul(gt, ut, ot);
        }
        return ot;
      },
      py::arg("gate"), py::arg("up"), py::arg("out") = py::none());

  o.def(
      "gated_mlp",
      [](py::handle x, const ops::Weight& g, const ops::Weight& u, const ops::Weight& d, py::handle out,
         const std::string& numerics, bool decode, bool accumulate) {
        const ops::GemmNumerics gn = gemm_numerics("gated_mlp", numerics);
        Tensor xt = tensor_from_python(x, "x");
        DFLASH2_CHECK_ARG(xt.ndim() == 2, "gated_mlp: x must be 2-D, found ", xt.describe());
        Tensor ot = out_or_new(out, DType::F32, {xt.shape(0), d.out_features}, xt.device());
        DFLASH2_CHECK_ARG(!accumulate || !out.is_none(), "gated_mlp: accumulate=True needs out (the tensor to add to)");
        Tensor scratch = Tensor::empty(DType::F32, {2 * xt.shape(0) * g.out_features}, xt.device());
        {
          ReleaseGil nogil;
          ops::gated_mlp(xt, g, u, d, ot, scratch, gn, decode, accumulate);
        }
        return ot;
      },
      py::arg("x"), py::arg("gate"), py::arg("up"), py::arg("down"), py::arg("out") = py::none(),
      py::arg("numerics") = "exact", py::arg("decode") = false, py::arg("accumulate") = false,
      "down(silu(gate(x)) * up(x)) (accumulate=True: added to out); numerics as moe_experts' (each projection linear_bf16 / linear_fp8 / "
      "linear_nvfp4); decode=True: the tokens of a decode / verify chunk (BF16 on CUDA: the three projections as "
      "one unit on the skinny kernels of generated tokens).");

  o.def(
      "linear_many",
      [](py::handle x, std::vector<ops::Weight> weights, const std::string& numerics, bool decode) {
        const ops::GemmNumerics gn = gemm_numerics("linear_many", numerics);
        Tensor xt = tensor_from_python(x, "x");
        std::vector<Tensor> outs;
        std::vector<const ops::Weight*> ws;
        std::vector<Tensor*> ys;
        outs.reserve(weights.size());
        for (const ops::Weight& w : weights) {
          outs.push_back(Tensor::empty(DType::F32, {dim_or0(xt, 0), w.out_features}, xt.device()));
          ws.push_back(&w);
          ys.push_back(&outs.back());
        }
        {
          ReleaseGil nogil;
          ops::linear_as_many(gn, xt, ws, ys, decode);
        }
        return outs;
      },
      py::arg("x"), py::arg("weights"), py::arg("numerics") = "exact", py::arg("decode") = false,
      "[x W^T for W in weights], each as linear_as(numerics) would compute it (a backend may share work: on CUDA, "
      "decode=True with BF16 numerics rounds x to BF16 once for all of them).");

  o.def(
      "softmax",
      [](py::handle x, float scale, py::handle out) {
        Tensor xt = tensor_from_python(x, "x");
        Tensor ot = out_or_new(out, DType::F32, xt.shape(), xt.device());
        {
          ReleaseGil nogil;
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
          ReleaseGil nogil;
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
          ReleaseGil nogil;
          ops::embedding(tt, it, ot);
        }
        return ot;
      },
      py::arg("table"), py::arg("ids"), py::arg("out") = py::none());

  o.def(
      "embedding_shard",
      [](py::handle table, py::handle ids, int64_t first, py::handle out) {
        Tensor tt = tensor_from_python(table, "table"), it = tensor_from_python(ids, "ids");
        DFLASH2_CHECK_ARG(tt.ndim() == 2 && it.ndim() == 1, "embedding_shard: table must be 2-D and ids 1-D, found ",
                          tt.describe(), " and ", it.describe());
        Tensor ot = out_or_new(out, DType::F32, {it.shape(0), tt.shape(1)}, tt.device());
        {
          ReleaseGil nogil;
          ops::embedding_shard(tt, it, first, ot);
        }
        return ot;
      },
      py::arg("table"), py::arg("ids"), py::arg("first"), py::arg("out") = py::none(),
      "Vocab-parallel embedding: table holds rows [first, first + rows) of the full table; "
      "out[t] = table[ids[t] - first], or zeros where ids[t] is another shard's. Summing the "
      "shards' outputs gives the full embedding.");

  // ---------------------------------------------------------------- data movement
  o.def(
      "copy",
      [](py::handle src, py::handle out) {
        Tensor st = tensor_from_python(src, "src");
        Tensor dt = out_or_new(out, st.dtype(), st.shape(), st.device());
        {
          ReleaseGil nogil;
          ops::copy(st, dt);
        }
        return dt;
      },
      py::arg("src"), py::arg("out") = py::none(),
      "out = src (any strides on either side; BF16/F16 src widens into an F32 out). Returns out.");

  o.def(
      "add",
      [](py::handle a, py::handle b, py::handle out) {
        Tensor at = tensor_from_python(a, "a"), bt = tensor_from_python(b, "b");
        Tensor ot = out_or_new(out, DType::F32, at.shape(), at.device());
        {
          ReleaseGil nogil;
          ops::add(at, bt, ot);
        }
        return ot;
      },
      py::arg("a"), py::arg("b"), py::arg("out") = py::none(), "out = a + b (out may be a or b).");

  o.def(
      "gather_rows",
      [](py::handle src, py::handle idx, py::handle out) {
        Tensor st = tensor_from_python(src, "src"), it = tensor_from_python(idx, "idx");
        Tensor ot = out_or_new(out, DType::F32, {dim_or0(it, 0), dim_or0(st, 1)}, st.device());
        {
          ReleaseGil nogil;
          ops::gather_rows(st, it, ot);
        }
        return ot;
      },
      py::arg("src"), py::arg("idx"), py::arg("out") = py::none(), "out[i, :] = src[idx[i], :] (F32).");

  o.def(
      "argmax",
      [](py::handle x, py::handle out) {
        Tensor xt = tensor_from_python(x, "x");
        Tensor ot = out_or_new(out, DType::I32, {dim_or0(xt, 0)}, xt.device());
        {
          ReleaseGil nogil;
          ops::argmax(xt, ot);
        }
        return ot;
      },
      py::arg("x"), py::arg("out") = py::none(), "I32 [R]: the first maximum of each row of x F32 [R, V].");

  o.def(
      "resolve_tokens",
      [](py::handle tokens, py::handle src) {
        Tensor tt = tensor_from_python(tokens, "tokens");
        Tensor st = tensor_from_python(src, "src");
        {
          ReleaseGil nogil;
          ops::resolve_tokens(tt, st);
        }
        return tt;
      },
      py::arg("tokens"), py::arg("src"),
      "In place: each entry t < 0 of tokens I32 [T] becomes src's flat element -t - 1 (src I32, contiguous).");

  o.def(
      "apply_penalties",
      [](py::handle logits, py::handle row0, py::handle draft, py::handle draft_row, py::handle draft_len,
         py::handle seq, py::handle params, py::handle state, py::handle bias) {
        Tensor lg = tensor_from_python(logits, "logits"), r0 = tensor_from_python(row0, "row0");
        Tensor dd = tensor_from_python(draft, "draft"), dr = tensor_from_python(draft_row, "draft_row");
        Tensor dl = tensor_from_python(draft_len, "draft_len"), sq = tensor_from_python(seq, "seq");
        Tensor pp = tensor_from_python(params, "params"), st = tensor_from_python(state, "state");
        Tensor bs = tensor_from_python(bias, "bias");
        {
          ReleaseGil nogil;
          ops::apply_penalties(lg, r0, dd, dr, dl, sq, pp, st, bs);
        }
        return lg;
      },
      py::arg("logits"), py::arg("row0"), py::arg("draft"), py::arg("draft_row"), py::arg("draft_len"),
      py::arg("seq"), py::arg("params"), py::arg("state"), py::arg("bias"),
      "In place: logits F32 [M, V] with presence / frequency / repetition penalties, logit bias and min_tokens' "
      "stop mask applied per verify row (seq I32 [S, 2] = (table row, min_left), params F32 [S, 3] = (presence, "
      "frequency, repetition), state I32 [B, V] counts | stop bit 29 | prompt bit 30, bias F32 [B, V]).");

  o.def(
      "mask_logits",
      [](py::handle logits, py::handle rows, py::handle masks) {
        Tensor lg = tensor_from_python(logits, "logits"), r = tensor_from_python(rows, "rows");
        Tensor m = tensor_from_python(masks, "masks");
        {
          ReleaseGil nogil;
          ops::mask_logits(lg, r, m);
        }
        return lg;
      },
      py::arg("logits"), py::arg("rows"), py::arg("masks"),
      "In place: logits F32 [M, V] row rows[r] (skipped when < 0) gets -FLT_MAX at every token v whose bit "
      "(bit v % 32 of word v / 32 of masks I32 [R, W >= ceil(V / 32)] row r) is 0 (structured output).");

  o.def(
      "count_tokens",
      [](py::handle state, py::handle rows, py::handle ids) {
        Tensor st = tensor_from_python(state, "state"), r = tensor_from_python(rows, "rows");
        Tensor i = tensor_from_python(ids, "ids");
        {
          ReleaseGil nogil;
          ops::count_tokens(st, r, i);
        }
        return st;
      },
      py::arg("state"), py::arg("rows"), py::arg("ids"),
      "In place: state[rows[i], ids[i]] += 1 for rows[i] >= 0 (state I32 [B, V]).");

  o.def(
      "next_after_accept",
      [](py::handle row0, py::handle draft_row, py::handle draft_len, py::handle accepted, py::handle bonus,
         py::handle drafts, py::handle next, py::handle last) {
        Tensor r0 = tensor_from_python(row0, "row0"), dr = tensor_from_python(draft_row, "draft_row");
        Tensor dl = tensor_from_python(draft_len, "draft_len"), ac = tensor_from_python(accepted, "accepted");
        Tensor bo = tensor_from_python(bonus, "bonus"), dd = tensor_from_python(drafts, "drafts");
        Tensor nx = tensor_from_python(next, "next"), ls = tensor_from_python(last, "last");
        {
          ReleaseGil nogil;
          ops::next_after_accept(r0, dr, dl, ac, bo, dd, nx, ls);
        }
        return py::make_tuple(nx, ls);
      },
      py::arg("row0"), py::arg("draft_row"), py::arg("draft_len"), py::arg("accepted"), py::arg("bonus"),
      py::arg("drafts"), py::arg("next"), py::arg("last"),
      "In place: next I32 [T] = the token after each verify row (accepted drafts, then the bonus), last I32 [S] = "
      "row0 + accepted.");

  o.def(
      "check_finite",
      [](py::handle x, py::handle out) {
        Tensor xt = tensor_from_python(x, "x");
        Tensor ot = out_or_new(out, DType::I32, {dim_or0(xt, 0)}, xt.device());
        {
          ReleaseGil nogil;
          ops::check_finite(xt, ot);
        }
        return ot;
      },
      py::arg("x"), py::arg("out") = py::none(), "I32 [R]: 1 where row r of x holds a NaN or an infinity.");

  o.def(
      "token_logprobs",
      [](py::handle x, py::handle ids, py::handle lp, py::handle lse) {
        Tensor xt = tensor_from_python(x, "x");
        Tensor it = tensor_from_python(ids, "ids");
        Tensor lt = out_or_new(lp, DType::F32, {dim_or0(xt, 0)}, xt.device());
        Tensor st = out_or_new(lse, DType::F32, {dim_or0(xt, 0)}, xt.device());
        {
          ReleaseGil nogil;
          ops::token_logprobs(xt, it, lt, st);
        }
        return py::make_tuple(lt, st);
      },
      py::arg("x"), py::arg("ids"), py::arg("lp") = py::none(), py::arg("lse") = py::none(),
      "(lp, lse) F32 [R]: lse[r] = log sum exp x[r], lp[r] = x[r, ids[r]] - lse[r] (NaN for a row with a NaN or "
      "an infinity).");

  o.def(
      "argmax_shard",
      [](py::handle x, int64_t first, py::handle out) {
        Tensor xt = tensor_from_python(x, "x");
        Tensor ot = out_or_new(out, DType::F32, {dim_or0(xt, 0), 2}, xt.device());
        {
          ReleaseGil nogil;
          ops::argmax_shard(xt, first, ot);
        }
        return ot;
      },
      py::arg("x"), py::arg("first"), py::arg("out") = py::none(),
      "F32 [R, 2]: (max, float(first + argmax)) per row of a vocabulary shard x F32 [R, Vs]; (NaN, first) for a "
      "row holding a NaN or an infinity.");

  o.def(
      "argmax_merge",
      [](py::handle pairs, py::handle ids, py::handle flags) {
        Tensor pt = tensor_from_python(pairs, "pairs");
        Tensor it = out_or_new(ids, DType::I32, {dim_or0(pt, 1)}, pt.device());
        Tensor ft = out_or_new(flags, DType::I32, {dim_or0(pt, 1)}, pt.device());
        {
          ReleaseGil nogil;
          ops::argmax_merge(pt, it, ft);
        }
        return py::make_tuple(it, ft);
      },
      py::arg("pairs"), py::arg("ids") = py::none(), py::arg("flags") = py::none(),
      "(ids, flags) I32 [R]: argmax_shard's pairs F32 [N, R, 2] of N shards in id order merged: the argmax over "
      "the whole rows and their non-finite flags.");

  o.def(
      "topk_merge",
      [](py::handle vals, py::handle idx, int64_t shard_size, py::handle values, py::handle indices) {
        Tensor vt = tensor_from_python(vals, "vals");
        Tensor it = tensor_from_python(idx, "idx");
        const int64_t R = dim_or0(vt, 1), k = vt.ndim() == 3 ? vt.shape(2) : 0;
        Tensor ot = out_or_new(values, DType::F32, {R, k}, vt.device());
        Tensor jt = out_or_new(indices, DType::I32, {R, k}, vt.device());
        {
          ReleaseGil nogil;
          ops::topk_merge(vt, it, shard_size, ot, jt);
        }
        return py::make_tuple(ot, jt);
      },
      py::arg("vals"), py::arg("idx"), py::arg("shard_size"), py::arg("values") = py::none(),
      py::arg("indices") = py::none(),
      "(values F32, indices I32) [R, k]: topk over whole rows from the N vocabulary shards' topk outputs vals F32 / "
      "idx I32 [N, R, k'] (shard s holds ids s * shard_size ..; idx are positions in the shard).");

  o.def(
      "accept_greedy",
      [](py::handle ids, py::handle row0, py::handle draft, py::handle draft_row, py::handle draft_len,
         py::handle accepted, py::handle bonus) {
        Tensor it = tensor_from_python(ids, "ids"), r0 = tensor_from_python(row0, "row0");
        Tensor dd = tensor_from_python(draft, "draft"), dr = tensor_from_python(draft_row, "draft_row");
        Tensor dl = tensor_from_python(draft_len, "draft_len");
        Tensor ac = out_or_new(accepted, DType::I32, {dim_or0(r0, 0)}, r0.device());
        Tensor bo = out_or_new(bonus, DType::I32, {dim_or0(r0, 0)}, r0.device());
        {
          ReleaseGil nogil;
          ops::accept_greedy(it, r0, dd, dr, dl, ac, bo);
        }
        return py::make_tuple(ac, bo);
      },
      py::arg("ids"), py::arg("row0"), py::arg("draft"), py::arg("draft_row"), py::arg("draft_len"),
      py::arg("accepted") = py::none(), py::arg("bonus") = py::none(),
      "(accepted, bonus) I32 [S]: greedy acceptance from the target's argmax ids I32 [M] (accept with every "
      "temperature 0, without the logits).");

  o.def(
      "nvfp4_quantize_act",
      [](py::handle x, float input_scale, py::handle out) {
        Tensor xt = tensor_from_python(x, "x");
        Tensor ot = out_or_new(out, DType::F32, {dim_or0(xt, 0), dim_or0(xt, 1)}, xt.device());
        {
          ReleaseGil nogil;
          ops::nvfp4_quantize_act(xt, input_scale, ot);
        }
        return ot;
      },
      py::arg("x"), py::arg("input_scale"), py::arg("out") = py::none(),
      "F32 [M, K]: x quantized to NVFP4 per 16 inputs (E4M3 block scale, E2M1 values, round to nearest even) "
      "and dequantized, as a Blackwell W4A4 GEMM sees its activations.");

  o.def(
      "fp8_quantize_act",
      [](py::handle x, py::handle out) {
        Tensor xt = tensor_from_python(x, "x");
        Tensor ot = out_or_new(out, DType::F32, {dim_or0(xt, 0), dim_or0(xt, 1)}, xt.device());
        {
          ReleaseGil nogil;
          ops::fp8_quantize_act(xt, ot);
        }
        return ot;
      },
      py::arg("x"), py::arg("out") = py::none(),
      "F32 [M, K]: x quantized per block of 128 inputs to E4M3 (scale amax / 448, round to nearest even) and "
      "dequantized: the activations linear_fp8 multiplies.");

  // ---------------------------------------------------------------- paged caches, attention
  o.def(
      "cache_write",
      [](py::handle src, py::handle slots, py::handle cache) {
        Tensor st = tensor_from_python(src, "src"), sl = tensor_from_python(slots, "slots");
        Tensor ct = tensor_from_python(cache, "cache");
        {
          ReleaseGil nogil;
          ops::cache_write(st, sl, ct);
        }
        return ct;
      },
      py::arg("src"), py::arg("slots"), py::arg("cache"),
      "In place: cache[slots[t], :] = src[t, :] (negative slots skip). Returns cache. A U8 cache holds FP8 rows "
      "(kv_cache_dtype='fp8'): E4M3 codes, then a power-of-two float32 scale per group of min(D, 128) values, "
      "padded to 16 bytes (fp8_cache_row_bytes(D) bytes a row).");
  o.def("fp8_cache_row_bytes", &ops::fp8_cache_row_bytes, py::arg("D"),
        "Bytes of an FP8 cache row of D quantized values (codes, then the group scales padded to 16 bytes); 0 where "
        "D cannot be stored so (D a multiple of 16, at most 128 or a multiple of 128).");
  o.def("fp8_latent_row_bytes", &ops::fp8_latent_row_bytes, py::arg("kv_lora"), py::arg("rope"),
        "Bytes of an FP8 MLA latent row: the quantized kv_lora values, then rope BF16 values, padded to 16 bytes "
        "(GLM-5.3: 656); 0 where kv_lora cannot be stored so.");

  o.def(
      "cache_write_many",
      [](const py::list& srcs, py::handle slots, const py::list& caches) {
        std::vector<Tensor> ss, cs;
        for (size_t i = 0; i < srcs.size(); ++i) ss.push_back(tensor_from_python(srcs[i], "srcs[i]"));
        for (size_t i = 0; i < caches.size(); ++i) cs.push_back(tensor_from_python(caches[i], "caches[i]"));
        std::vector<const Tensor*> sp;
        std::vector<Tensor*> cp;
        for (Tensor& t : ss) sp.push_back(&t);
        for (Tensor& t : cs) cp.push_back(&t);
        Tensor sl = tensor_from_python(slots, "slots");
        {
          ReleaseGil nogil;
          ops::cache_write_many(sp, sl, cp);
        }
        return caches;
      },
      py::arg("srcs"), py::arg("slots"), py::arg("caches"),
      "cache_write(srcs[i], slots, caches[i]) for every i (one kernel on CUDA where no cache shares an element "
      "with another cache or a source); returns caches.");

  o.def(
      "linear_heads",
      [](py::handle x, py::handle w, py::handle out) {
        Tensor xt = tensor_from_python(x, "x"), wt = tensor_from_python(w, "w");
        Tensor ot = out_or_new(out, DType::F32, {dim_or0(xt, 0), dim_or0(xt, 1), dim_or0(wt, 1)}, xt.device());
        {
          ReleaseGil nogil;
          ops::linear_heads(xt, wt, ot);
        }
        return ot;
      },
      py::arg("x"), py::arg("w"), py::arg("out") = py::none(), "y[t, g, :] = x[t, g, :] @ w[g]^T.");

  o.def(
      "indexer_topk",
      [](py::handle q, py::handle w, py::handle key_cache, py::handle seq, py::handle pos, py::handle block_table,
         int64_t block_size, int64_t topk, py::handle sel, py::handle sel_len) {
        Tensor qt = tensor_from_python(q, "q"), wt = tensor_from_python(w, "w");
        Tensor kt = tensor_from_python(key_cache, "key_cache");
        ops::PagedTokens tok = paged_tokens(seq, pos, block_table, block_size);
        const int64_t T = dim_or0(qt, 0);
        // a new sel starts zeroed: rows with sel_len -1 are left untouched by the op
        Tensor st = sel.is_none() ? Tensor::zeros(DType::I32, {T, std::max<int64_t>(topk, 0)}, qt.device())
                                  : tensor_from_python(sel, "sel");
        Tensor lt = out_or_new(sel_len, DType::I32, {T}, qt.device(), "sel_len");
        {
          ReleaseGil nogil;
          ops::indexer_topk(qt, wt, kt, tok, topk, st, lt);
        }
        return py::make_tuple(st, lt);
      },
      py::arg("q"), py::arg("w"), py::arg("key_cache"), py::arg("seq"), py::arg("pos"), py::arg("block_table"),
      py::arg("block_size"), py::arg("topk"), py::arg("sel") = py::none(), py::arg("sel_len") = py::none(),
      "DSA indexer over a paged key cache: (sel I32 [T, topk] ascending, sel_len I32 [T], -1 = every causal key).");
  o.def(
      "indexer_scores",
      [](py::handle q, py::handle w, py::handle key_cache, py::handle seq, py::handle pos, py::handle block_table,
         int64_t block_size, py::handle out) {
        Tensor qt = tensor_from_python(q, "q"), wt = tensor_from_python(w, "w");
        Tensor kt = tensor_from_python(key_cache, "key_cache");
        ops::PagedTokens tok = paged_tokens(seq, pos, block_table, block_size);
        // a new out starts zeroed: keys past a token's position are left untouched by the op
        Tensor ot = out.is_none() ? Tensor::zeros(DType::F32, {dim_or0(qt, 0), dim_or0(tok.block_table, 1) * block_size},
                                                  qt.device())
                                  : tensor_from_python(out, "out");
        {
          ReleaseGil nogil;
          ops::indexer_scores(qt, wt, kt, tok, ot);
        }
        return ot;
      },
      py::arg("q"), py::arg("w"), py::arg("key_cache"), py::arg("seq"), py::arg("pos"), py::arg("block_table"),
      py::arg("block_size"), py::arg("out") = py::none(),
      "The scores indexer_topk selects from: out F32 [T, C] (default C = the block table's capacity, zeros), "
      "out[t, j] for every key j <= pos[t] (j < C); the rest of a row untouched.");

  o.def(
      "mla_attention",
      [](py::handle q_lat, py::handle q_pe, py::handle cache, py::handle seq, py::handle pos, py::handle block_table,
         int64_t block_size, float scale, py::handle sel, py::handle sel_len, py::handle out) {
        Tensor ql = tensor_from_python(q_lat, "q_lat"), qp = tensor_from_python(q_pe, "q_pe");
        Tensor ct = tensor_from_python(cache, "cache");
        ops::PagedTokens tok = paged_tokens(seq, pos, block_table, block_size);
        Tensor st = opt_tensor(sel, "sel"), lt = opt_tensor(sel_len, "sel_len");
        Tensor ot = out_or_new(out, DType::F32, ql.shape(), ql.device());
        {
          ReleaseGil nogil;
          ops::mla_attention(ql, qp, ct, tok, st, lt, scale, ot);
        }
        return ot;
      },
      py::arg("q_lat"), py::arg("q_pe"), py::arg("cache"), py::arg("seq"), py::arg("pos"), py::arg("block_table"),
      py::arg("block_size"), py::arg("scale"), py::arg("sel") = py::none(), py::arg("sel_len") = py::none(),
      py::arg("out") = py::none(),
      "Sparse absorbed MLA over a paged latent cache; no sel_len = every causal key.");

  o.def(
      "block_attention",
      [](py::handle q, py::handle k, py::handle v, py::handle kv_cache, py::handle ctx_len, py::handle block_table,
         int64_t block, int64_t cache_block_size, int64_t window, bool causal, float scale, py::handle out,
         bool tensor_cores) {
        Tensor qt = tensor_from_python(q, "q"), kt = tensor_from_python(k, "k"), vt = tensor_from_python(v, "v");
        Tensor ct = tensor_from_python(kv_cache, "kv_cache"), lt = tensor_from_python(ctx_len, "ctx_len");
        Tensor bt = tensor_from_python(block_table, "block_table");
        ops::BlockAttention p;
        p.block = block;
        p.window = window;
        p.causal = causal;
        p.scale = scale;
        p.cache_block_size = cache_block_size;
        p.tensor_cores = tensor_cores;
        Tensor ot = out_or_new(out, DType::F32, qt.shape(), qt.device());
        {
          ReleaseGil nogil;
          ops::block_attention(qt, kt, vt, ct, lt, bt, p, ot);
        }
        return ot;
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("kv_cache"), py::arg("ctx_len"), py::arg("block_table"),
      py::arg("block"), py::arg("cache_block_size"), py::arg("window") = 0, py::arg("causal") = false,
      py::arg("scale") = 1.0f, py::arg("out") = py::none(), py::arg("tensor_cores") = false,
      "The DFlash drafter's block attention (tensor_cores: BF16 tensor cores on CUDA where they apply; exact "
      "elsewhere).");

  // ---------------------------------------------------------------- MoE
  o.def(
      "moe_route",
      [](py::handle logits, py::handle bias, int64_t top_k, int64_t n_group, int64_t topk_group, bool norm_topk_prob,
         float routed_scaling_factor, py::handle ids, py::handle weights) {
        Tensor lt = tensor_from_python(logits, "logits"), bt = tensor_from_python(bias, "bias");
        ops::MoeRouting r;
        r.top_k = top_k;
        r.n_group = n_group;
        r.topk_group = topk_group;
        r.norm_topk_prob = norm_topk_prob;
        r.routed_scaling_factor = routed_scaling_factor;
        const Tensor::Shape s = {dim_or0(lt, 0), std::max<int64_t>(top_k, 0)};
        Tensor it = out_or_new(ids, DType::I32, s, lt.device(), "ids");
        Tensor wt = out_or_new(weights, DType::F32, s, lt.device(), "weights");
        {
          ReleaseGil nogil;
          ops::moe_route(lt, bt, r, it, wt);
        }
        return py::make_tuple(it, wt);
      },
      py::arg("logits"), py::arg("bias"), py::arg("top_k"), py::arg("n_group") = 1, py::arg("topk_group") = 1,
      py::arg("norm_topk_prob") = true, py::arg("routed_scaling_factor") = 1.0f, py::arg("ids") = py::none(),
      py::arg("weights") = py::none(), "(ids I32 [T, top_k] ascending, weights F32 [T, top_k]).");

  o.def("moe_workspace_floats", &ops::moe_workspace_floats, py::arg("T"), py::arg("top_k"), py::arg("H"), py::arg("F"),
        py::arg("E"), "Floats of workspace moe_experts needs.");

  o.def(
      "moe_experts",
      [](py::handle x, py::handle ids, py::handle weights, std::vector<ops::Weight> gate, std::vector<ops::Weight> up,
         std::vector<ops::Weight> down, py::handle out, py::handle workspace, const std::string& numerics,
         bool decode, bool accumulate) {
        const ops::GemmNumerics g = gemm_numerics("moe_experts", numerics);
        Tensor xt = tensor_from_python(x, "x"), it = tensor_from_python(ids, "ids");
        Tensor wt = tensor_from_python(weights, "weights");
        ops::ExpertWeights ex{std::move(gate), std::move(up), std::move(down)};
        Tensor ot = out_or_new(out, DType::F32, xt.shape(), xt.device());
        const int64_t F = ex.gate.empty() ? 0 : ex.gate[0].out_features;
        const int64_t n = ops::moe_workspace_floats(dim_or0(xt, 0), dim_or0(it, 1), dim_or0(xt, 1), F,
                                                    int64_t(ex.gate.size()));
        Tensor ws = out_or_new(workspace, DType::F32, {n}, xt.device(), "workspace");
        DFLASH2_CHECK_ARG(!accumulate || !out.is_none(), "moe_experts: accumulate=True needs out (the tensor to add to)");
        {
          ReleaseGil nogil;
          ops::moe_experts(xt, it, wt, ex, ot, ws, g, decode, accumulate);
        }
        return ot;
      },
      py::arg("x"), py::arg("ids"), py::arg("weights"), py::arg("gate"), py::arg("up"), py::arg("down"),
      py::arg("out") = py::none(), py::arg("workspace") = py::none(), py::arg("numerics") = "exact",
      py::arg("decode") = false, py::arg("accumulate") = false,
      "out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) (accumulate=True: out[t] += that sum, formed first); "
      "gate/up/down: lists of Weight, one per expert. "
      "numerics='fp8': every projection W8A8 as linear_fp8 (FP8 experts; CUDA: the grouped GEMM, sm_90a / sm_100a / sm_103a). "
      "numerics='bf16': every projection as linear_bf16 (any expert format; CUDA: the grouped GEMM dequantizing in its "
      "main loop; with decode=True, the tokens of a decode / verify chunk: the skinny grouped GEMM of generated "
      "tokens). numerics='nvfp4': every projection W4A4 as linear_nvfp4 with its expert's input_scale (NVFP4 "
      "experts; CUDA: the grouped block-scaled GEMM, sm_100a / sm_103a).");
  // moe_experts_<numerics>_available(device, gate, up, down)
  auto def_available = [&o](const char* name, bool (*fn)(Device, const ops::ExpertWeights&), const char* doc) {
    o.def(
        name,
        [fn](const std::string& dev, std::vector<ops::Weight> gate, std::vector<ops::Weight> up,
             std::vector<ops::Weight> down) {
          ops::ExpertWeights ex{std::move(gate), std::move(up), std::move(down)};
          return fn(Device::parse(dev), ex);
        },
        py::arg("device"), py::arg("gate"), py::arg("up"), py::arg("down"), doc);
  };
  def_available("moe_experts_fp8_available", &ops::moe_experts_fp8_available,
                "Whether moe_experts(numerics='fp8') runs these experts on this device in this build.");
  def_available("moe_experts_bf16_available", &ops::moe_experts_bf16_available,
                "Whether moe_experts(numerics='bf16') runs these experts on this device in this build.");
  def_available("moe_experts_nvfp4_available", &ops::moe_experts_nvfp4_available,
                "Whether moe_experts(numerics='nvfp4') runs these experts on this device in this build.");

  // ---------------------------------------------------------------- DFlash drafter
  o.def(
      "dyn_conv",
      [](py::handle x, py::handle base, py::handle dyn, int64_t block, py::handle out) {
        Tensor xt = tensor_from_python(x, "x"), bt = tensor_from_python(base, "base");
        Tensor dt = tensor_from_python(dyn, "dyn");
        Tensor ot = out_or_new(out, DType::F32, xt.shape(), xt.device());
        {
          ReleaseGil nogil;
          ops::dyn_conv(xt, bt, dt, block, ot);
        }
        return ot;
      },
      py::arg("x"), py::arg("base"), py::arg("dyn"), py::arg("block"), py::arg("out") = py::none(),
      "Two-tap dynamic conv within blocks of `block` rows (out may be x).");

  o.def(
      "selector_walk",
      [](py::handle vals, py::handle cand, py::handle g, py::handle pred_book, py::handle succ_book,
         py::handle anchors, py::handle temperature, py::handle rng, py::handle tokens, py::handle q) {
        Tensor vt = tensor_from_python(vals, "vals"), ct = tensor_from_python(cand, "cand");
        Tensor gt = tensor_from_python(g, "g"), pb = tensor_from_python(pred_book, "pred_book");
        Tensor sb = tensor_from_python(succ_book, "succ_book"), at = tensor_from_python(anchors, "anchors");
        Tensor rt = opt_tensor(rng, "rng");
        // temperature: one number for every sequence, or F32 [S]
        Tensor temp;
        bool sampled = false;
        if (py::isinstance<py::float_>(temperature) || py::isinstance<py::int_>(temperature)) {
          const float t = temperature.cast<float>();
          // checked here too: on a device the op cannot read the temperatures it is given
          DFLASH2_CHECK_ARG(std::isfinite(t) && t >= 0.0f, "selector_walk: temperature[0] must be finite and >= 0, "
                            "found ", t);
          temp = Tensor::empty(DType::F32, {dim_or0(vt, 0)});
          for (int64_t s = 0; s < temp.shape(0); ++s) temp.data_as<float>()[s] = t;
          temp = temp.to(vt.device());
          sampled = t > 0.0f;
        } else {
          temp = tensor_from_python(temperature, "temperature");
          sampled = true;
        }
        Tensor tt = out_or_new(tokens, DType::I32, {dim_or0(vt, 0), dim_or0(vt, 1)}, vt.device(), "tokens");
        // q is written only when sampling (a temperature > 0)
        Tensor qt = !q.is_none() ? tensor_from_python(q, "q")
                    : sampled ? Tensor::empty(DType::F32, vt.shape(), vt.device())
                              : Tensor();
        {
          ReleaseGil nogil;
          ops::selector_walk(vt, ct, gt, pb, sb, at, temp, rt, tt, qt);
        }
        return py::make_tuple(tt, none_or(qt));
      },
      py::arg("vals"), py::arg("cand"), py::arg("g"), py::arg("pred_book"), py::arg("succ_book"), py::arg("anchors"),
      py::arg("temperature") = 0.0f, py::arg("rng") = py::none(), py::arg("tokens") = py::none(),
      py::arg("q") = py::none(),
      "The DFlash 2 selector's path walk: (tokens I32 [S, P], q F32 [S, P, K] when sampling, else None). "
      "temperature: a number or F32 [S]; rng: I64 [S, 2] (Philox key, counter), draw t at counter + t.");
}

}  // namespace dflash2::py_bind
