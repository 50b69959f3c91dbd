// The op interface: argument validation (clear errors, never a crash) and dispatch on the
// device of the tensors to a backend.
#include "dflash2/ops.h"

#include "backend/cpu/cpu_ops.h"
#include "dflash2/error.h"
#ifdef DFLASH2_WITH_CUDA
#include "backend/cuda_api.h"
#endif

namespace dflash2::ops {

namespace {

void need(const Tensor& t, const char* op, const char* arg) {
  DFLASH2_CHECK_ARG(t.defined(), op, ": argument '", arg, "' is undefined");
}

void need_dtype(const Tensor& t, DType dt, const char* op, const char* arg) {
  need(t, op, arg);
  DFLASH2_CHECK_ARG(t.dtype() == dt, op, ": argument '", arg, "' must be ", dtype_name(dt), ", found ",
                    t.describe());
}

void need_float_weight(const Tensor& t, const char* op, const char* arg) {
  need(t, op, arg);
  DFLASH2_CHECK_ARG(t.dtype() == DType::F32 || t.dtype() == DType::BF16 || t.dtype() == DType::F16, op,
                    ": argument '", arg, "' must be F32, BF16 or F16, found ", t.describe());
}

void need_index(const Tensor& t, const char* op, const char* arg) {
  need(t, op, arg);
  DFLASH2_CHECK_ARG(t.dtype() == DType::I32 || t.dtype() == DType::I64, op, ": argument '", arg,
                    "' must be I32 or I64, found ", t.describe());
}

// Last dim contiguous (rows may be strided).
void need_rows(const Tensor& t, const char* op, const char* arg) {
  DFLASH2_CHECK_ARG(t.ndim() >= 1, op, ": argument '", arg, "' must have at least one dimension, found ",
                    t.describe());
  DFLASH2_CHECK_ARG(t.stride(-1) == 1 || t.shape(-1) == 1, op, ": argument '", arg,
                    "' must be contiguous in its last dimension, found strides ", shape_str(t.strides()));
}

void need_same_shape(const Tensor& a, const Tensor& b, const char* op, const char* an, const char* bn) {
  DFLASH2_CHECK_ARG(a.shape() == b.shape(), op, ": '", an, "' ", a.describe(), " and '", bn, "' ", b.describe(),
                    " must have the same shape");
}

// Collapses all leading dims into rows, given that each row is contiguous and rows are
// evenly strided. Returns the row stride (elements).
int64_t row_stride(const Tensor& t, const char* op, const char* arg) {
  if (t.ndim() == 1) return t.shape(0);
  int64_t s = t.stride(-2);
  int64_t expect = s;
  for (int i = t.ndim() - 2; i >= 0; --i) {
    DFLASH2_CHECK_ARG(t.shape(i) == 1 || t.stride(i) == expect, op, ": argument '", arg,
                      "' has leading dimensions that cannot be viewed as evenly strided rows (strides ",
                      shape_str(t.strides()), ")");
    expect *= t.shape(i);
  }
  return s;
}

void same_device(const Tensor& a, const Tensor& b, const char* op) {
  if (a.defined() && b.defined())
    DFLASH2_CHECK_ARG(a.device() == b.device(), op, ": tensors on different devices: ", a.describe(), " and ",
                      b.describe());
}

[[noreturn]] void not_on_device(const char* op, const Tensor& t) {
#ifdef DFLASH2_WITH_CUDA
  fail(ErrorKind::Unsupported, op, " is not implemented on the CUDA backend yet (tensor ", t.describe(),
       "); run it on the CPU");
#else
  fail(ErrorKind::Unsupported, op, ": tensor ", t.describe(), " is on ", t.device().str(),
       " but dflash2 was built without CUDA");
#endif
}

}  // namespace

void linear(const Tensor& x, const Weight& w, Tensor& y, bool accumulate) {
  const char* op = "linear";
  w.validate();
  need_dtype(x, DType::F32, op, "x");
  need_dtype(y, DType::F32, op, "y");
  DFLASH2_CHECK_ARG(x.ndim() == 2 && y.ndim() == 2, op, ": x and y must be 2-D, found x ", x.describe(), ", y ",
                    y.describe());
  need_rows(x, op, "x");
  need_rows(y, op, "y");
  DFLASH2_CHECK_ARG(x.shape(1) == w.in_features, op, "(", w.name, "): x has ", x.shape(1),
                    " features but the weight expects ", w.in_features);
  DFLASH2_CHECK_ARG(y.shape(0) == x.shape(0) && y.shape(1) == w.out_features, op, "(", w.name, "): y must be [",
                    x.shape(0), ", ", w.out_features, "], found ", y.describe());
  same_device(x, y, op);
  same_device(x, w.data, op);
  if (x.device().is_cpu()) return cpu::linear(x, w, y, accumulate);
  not_on_device(op, x);
}

void rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out) {
  const char* op = "rms_norm";
  need(x, op, "x");
  need(out, op, "out");
  need_float_weight(w, op, "w");
  need_rows(x, op, "x");
  need_rows(out, op, "out");
  need_same_shape(x, out, op, "x", "out");
  DFLASH2_CHECK_ARG(x.dtype() == out.dtype(), op, ": x ", x.describe(), " and out ", out.describe(),
                    " must have the same dtype");
  DFLASH2_CHECK_ARG(w.ndim() == 1 && w.shape(0) == x.shape(-1) && w.is_contiguous(), op, ": w must be [",
                    x.shape(-1), "] contiguous, found ", w.describe());
  DFLASH2_CHECK_ARG(eps >= 0, op, ": eps must be >= 0, found ", eps);
  row_stride(x, op, "x");
  row_stride(out, op, "out");
  same_device(x, w, op);
  same_device(x, out, op);
  if (x.device().is_cpu()) {
    DFLASH2_CHECK_ARG(x.dtype() == DType::F32, op, ": the CPU backend takes F32 activations, found ", x.describe());
    return cpu::rms_norm(x, w, eps, out);
  }
#ifdef DFLASH2_WITH_CUDA
  DFLASH2_CHECK_ARG(x.dtype() == DType::F32 || x.dtype() == DType::BF16, op,
                    ": the CUDA backend takes F32 or BF16 activations, found ", x.describe());
  return cuda::rms_norm(x, w, eps, out);
#else
  not_on_device(op, x);
#endif
}

void layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, float eps, Tensor& out) {
  const char* op = "layer_norm";
  need_dtype(x, DType::F32, op, "x");
  need_dtype(out, DType::F32, op, "out");
  need_float_weight(w, op, "w");
  need_rows(x, op, "x");
  need_rows(out, op, "out");
  need_same_shape(x, out, op, "x", "out");
  DFLASH2_CHECK_ARG(w.ndim() == 1 && w.shape(0) == x.shape(-1) && w.is_contiguous(), op, ": w must be [",
                    x.shape(-1), "] contiguous, found ", w.describe());
  if (b.defined()) {
    need_float_weight(b, op, "b");
    DFLASH2_CHECK_ARG(b.ndim() == 1 && b.shape(0) == x.shape(-1) && b.is_contiguous(), op, ": b must be [",
                      x.shape(-1), "] contiguous, found ", b.describe());
    same_device(x, b, op);
  }
  DFLASH2_CHECK_ARG(eps >= 0, op, ": eps must be >= 0, found ", eps);
  row_stride(x, op, "x");
  row_stride(out, op, "out");
  same_device(x, w, op);
  same_device(x, out, op);
  if (x.device().is_cpu()) return cpu::layer_norm(x, w, b, eps, out);
  not_on_device(op, x);
}

void rope(Tensor& x, const Tensor& positions, double theta, RopeStyle style) {
  const char* op = "rope";
  need_dtype(x, DType::F32, op, "x");
  need_index(positions, op, "positions");
  DFLASH2_CHECK_ARG(x.ndim() == 3, op, ": x must be [tokens, heads, dim], found ", x.describe());
  DFLASH2_CHECK_ARG(x.shape(2) % 2 == 0, op, ": the rotary dim must be even, found ", x.shape(2));
  DFLASH2_CHECK_ARG(positions.ndim() == 1 && positions.shape(0) == x.shape(0), op, ": positions must be [",
                    x.shape(0), "], found ", positions.describe());
  DFLASH2_CHECK_ARG(theta > 0, op, ": theta must be > 0, found ", theta);
  same_device(x, positions, op);
  if (x.device().is_cpu()) return cpu::rope(x, positions, theta, style);
  not_on_device(op, x);
}

void silu_mul(const Tensor& gate, const Tensor& up, Tensor& out) {
  const char* op = "silu_mul";
  need_dtype(gate, DType::F32, op, "gate");
  need_dtype(up, DType::F32, op, "up");
  need_dtype(out, DType::F32, op, "out");
  need_rows(gate, op, "gate");
  need_rows(up, op, "up");
  need_rows(out, op, "out");
  need_same_shape(gate, up, op, "gate", "up");
  need_same_shape(gate, out, op, "gate", "out");
  row_stride(gate, op, "gate");
  row_stride(up, op, "up");
  row_stride(out, op, "out");
  same_device(gate, up, op);
  same_device(gate, out, op);
  if (gate.device().is_cpu()) return cpu::silu_mul(gate, up, out);
  not_on_device(op, gate);
}

void gated_mlp(const Tensor& x, const Weight& gate, const Weight& up, const Weight& down, Tensor& out,
               Tensor& scratch) {
  const char* op = "gated_mlp";
  need_dtype(x, DType::F32, op, "x");
  DFLASH2_CHECK_ARG(x.ndim() == 2, op, ": x must be 2-D, found ", x.describe());
  const int64_t M = x.shape(0), F = gate.out_features;
  DFLASH2_CHECK_ARG(up.out_features == F && up.in_features == gate.in_features, op, ": gate [", gate.out_features,
                    ", ", gate.in_features, "] and up [", up.out_features, ", ", up.in_features,
                    "] must have the same shape");
  DFLASH2_CHECK_ARG(down.in_features == F, op, ": down takes ", down.in_features, " features but gate produces ", F);
  need_dtype(scratch, DType::F32, op, "scratch");
  DFLASH2_CHECK_ARG(scratch.is_contiguous() && scratch.numel() >= 2 * M * F, op, ": scratch must hold ", 2 * M * F,
                    " contiguous floats, found ", scratch.describe());
  Tensor flat = scratch.reshape({scratch.numel()});
  Tensor g = flat.slice(0, 0, M * F).reshape({M, F});
  Tensor u = flat.slice(0, M * F, 2 * M * F).reshape({M, F});
  linear(x, gate, g);
  linear(x, up, u);
  silu_mul(g, u, g);
  linear(g, down, out);
}

void softmax(const Tensor& x, Tensor& out, float scale) {
  const char* op = "softmax";
  need_dtype(x, DType::F32, op, "x");
  need_dtype(out, DType::F32, op, "out");
  need_rows(x, op, "x");
  need_rows(out, op, "out");
  need_same_shape(x, out, op, "x", "out");
  DFLASH2_CHECK_ARG(x.shape(-1) > 0, op, ": rows must not be empty, found ", x.describe());
  row_stride(x, op, "x");
  row_stride(out, op, "out");
  same_device(x, out, op);
  if (x.device().is_cpu()) return cpu::softmax(x, out, scale);
  not_on_device(op, x);
}

void topk(const Tensor& x, int64_t k, Tensor& values, Tensor& indices) {
  const char* op = "topk";
  need_dtype(x, DType::F32, op, "x");
  need_dtype(values, DType::F32, op, "values");
  need_dtype(indices, DType::I32, op, "indices");
  need_rows(x, op, "x");
  need_rows(values, op, "values");
  need_rows(indices, op, "indices");
  DFLASH2_CHECK_ARG(k >= 1, op, ": k must be >= 1, found ", k);
  DFLASH2_CHECK_ARG(k <= x.shape(-1), op, ": k = ", k, " exceeds the row length ", x.shape(-1));
  Tensor::Shape s = x.shape();
  s.back() = k;
  DFLASH2_CHECK_ARG(values.shape() == s && indices.shape() == s, op, ": values and indices must be ", shape_str(s),
                    ", found ", values.describe(), " and ", indices.describe());
  row_stride(x, op, "x");
  row_stride(values, op, "values");
  row_stride(indices, op, "indices");
  same_device(x, values, op);
  same_device(x, indices, op);
  if (x.device().is_cpu()) return cpu::topk(x, k, values, indices);
  not_on_device(op, x);
}

void embedding(const Tensor& table, const Tensor& ids, Tensor& out) {
  const char* op = "embedding";
  need_float_weight(table, op, "table");
  need_index(ids, op, "ids");
  need_dtype(out, DType::F32, op, "out");
  DFLASH2_CHECK_ARG(table.ndim() == 2 && table.stride(1) == 1, op, ": table must be [vocab, dim] with contiguous rows, found ",
                    table.describe());
  DFLASH2_CHECK_ARG(ids.ndim() == 1, op, ": ids must be 1-D, found ", ids.describe());
  DFLASH2_CHECK_ARG(out.ndim() == 2 && out.shape(0) == ids.shape(0) && out.shape(1) == table.shape(1), op,
                    ": out must be [", ids.shape(0), ", ", table.shape(1), "], found ", out.describe());
  need_rows(out, op, "out");
  same_device(table, ids, op);
  same_device(table, out, op);
  if (table.device().is_cpu()) return cpu::embedding(table, ids, out);
  not_on_device(op, table);
}

}  // namespace dflash2::ops
