// The op interface: argument validation (clear errors, never a crash) and dispatch on the
// device of the tensors to a backend.
#include "dflash2/ops.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <initializer_list>
#include <limits>
#include <string>

#include "dflash2/error.h"
#include "ops/backend.h"
#include "ops/kv_fp8.h"
#if defined(DFLASH2_WITH_CUDA)
#include "backend/cuda/cuda_api.h"
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

// The dispatch-table entry of `op` for the device of `t`, or an Unsupported error.
template <class Fn>
Fn entry(Fn fn, const char* op, const Tensor& t) {
  if (!fn)
    fail(ErrorKind::Unsupported, op, " is not implemented on the ", backend_table(t.device()).name,
         " backend yet (tensor ", t.describe(), ")");
  return fn;
}
// Op timing (ops::set_op_timing): one scope per dispatched call while it is on.
std::atomic<bool>& op_timing_flag();  // below, with the other process-wide switches
struct OpTimeKey {
  const char* op;
  DeviceType dev;
  bool operator<(const OpTimeKey& o) const {
    const int c = std::strcmp(op, o.op);
    return c != 0 ? c < 0 : int(dev) < int(o.dev);
  }
};
struct OpTotals {
  std::mutex mu;
  std::map<OpTimeKey, std::pair<int64_t, double>> by_op;  // (calls, seconds)
};
OpTotals& op_totals() {
  static OpTotals t;
  return t;
}
thread_local int tl_op_depth = 0;  // dispatched ops running on this thread (nested: inner ones)

class TimedCall {
 public:
  TimedCall(const char* op, Device dev) : op_(op), dev_(dev.type) {
    if (tl_op_depth++ > 0 || !op_timing_flag().load(std::memory_order_relaxed)) return;
    const BackendTable& t = backend_table(dev);
    if (t.timer_begin) {
      end_ = t.timer_end;
      timer_ = t.timer_begin();
      on_ = timer_ != nullptr;
    } else {
      t0_ = std::chrono::steady_clock::now();
      on_ = true;
    }
  }
  ~TimedCall() {
    --tl_op_depth;
    if (!on_) return;
    double s = 0.0;
    if (timer_ != nullptr) {
      s = end_(timer_);
    } else {
      s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    }
    if (std::uncaught_exceptions() > 0) return;  // a failed call: not a time
    OpTotals& tot = op_totals();
    std::lock_guard<std::mutex> lk(tot.mu);
    auto& v = tot.by_op[OpTimeKey{op_, dev_}];
    v.first += 1;
    v.second += s;
  }
  TimedCall(const TimedCall&) = delete;
  TimedCall& operator=(const TimedCall&) = delete;

 private:
  const char* op_;
  DeviceType dev_;
  bool on_ = false;
  void* timer_ = nullptr;
  double (*end_)(void*) = nullptr;
  std::chrono::steady_clock::time_point t0_;
};

#define DFLASH2_DISPATCH(op, t, ...)                                   \
  {                                                                      \
    auto fn_ = entry(backend_table((t).device()).op, #op, (t));        \
    TimedCall timed_(#op, (t).device());                                 \
    return fn_(__VA_ARGS__);                                             \
  }

}  // namespace

std::vector<OpTime> op_times(bool reset) {
  OpTotals& tot = op_totals();
  std::vector<OpTime> out;
  {
    std::lock_guard<std::mutex> lk(tot.mu);
    for (const auto& kv : tot.by_op) {
      OpTime r;
      r.op = kv.first.op;
      r.device = kv.first.dev == DeviceType::CUDA ? "cuda" : "cpu";
      r.calls = kv.second.first;
      r.seconds = kv.second.second;
      out.push_back(std::move(r));
    }
    if (reset) tot.by_op.clear();
  }
  std::stable_sort(out.begin(), out.end(), [](const OpTime& a, const OpTime& b) { return a.seconds > b.seconds; });
  return out;
}

namespace {
// A process-wide switch's value at start: the environment variable `name` set to the opposite
// of `default_on` ("0" / "1") flips it; unset or any other value keeps the default.
bool env_switch(const char* name, bool default_on) {
  const char* e = std::getenv(name);
  if (!e) return default_on;
  return default_on ? std::string(e) != "0" : std::string(e) == "1";
}
}  // namespace

// A process-wide switch: its flag (set from the environment once, env_switch), getter and setter.
#define DFLASH2_SWITCH(getter, setter, env, default_on)                     \
  namespace {                                                               \
  std::atomic<bool>& getter##_flag() {                                      \
    static std::atomic<bool> on{env_switch(env, default_on)};               \
    return on;                                                              \
  }                                                                         \
  }                                                                         \
  bool getter() { return getter##_flag().load(std::memory_order_relaxed); } \
  void setter(bool on) { getter##_flag().store(on, std::memory_order_relaxed); }
DFLASH2_SWITCH(fused_launches, set_fused_launches, "DFLASH2_FUSED_LAUNCHES", true)
DFLASH2_SWITCH(pdl, set_pdl, "DFLASH2_PDL", true)
DFLASH2_SWITCH(dq_wgmma, set_dq_wgmma, "DFLASH2_DQ_WGMMA", true)
DFLASH2_SWITCH(exact_tc, set_exact_tc, "DFLASH2_EXACT_TC", false)
DFLASH2_SWITCH(wide_rows, set_wide_rows, "DFLASH2_WIDE_ROWS", true)
DFLASH2_SWITCH(mla_tc, set_mla_tc, "DFLASH2_MLA_TC", true)
DFLASH2_SWITCH(indexer_tc, set_indexer_tc, "DFLASH2_INDEXER_TC", true)
DFLASH2_SWITCH(op_timing, set_op_timing, "DFLASH2_OP_TIMING", false)
#undef DFLASH2_SWITCH

namespace {
void check_linear(const char* op, const Tensor& x, const Weight& w, const Tensor& y) {
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
}
}  // namespace

void linear(const Tensor& x, const Weight& w, Tensor& y, bool accumulate) {
  check_linear("linear", x, w, y);
  DFLASH2_DISPATCH(linear, x, x, w, y, accumulate);
}

void linear_bf16(const Tensor& x, const Weight& w, Tensor& y, bool accumulate, bool decode) {
  check_linear("linear_bf16", x, w, y);
  DFLASH2_DISPATCH(linear_bf16, x, x, w, y, accumulate, decode);
}

bool linear_bf16_available(Device dev) {
  if (dev.is_cpu()) return true;
#if defined(DFLASH2_WITH_CUDA) && defined(DFLASH2_WITH_CUTLASS)
  if (dev.is_cuda()) return cuda::linear_bf16_supported(dev.index);
#endif
  return false;
}

void linear_fp8(const Tensor& x, const Weight& w, Tensor& y, bool accumulate) {
  check_linear("linear_fp8", x, w, y);
  DFLASH2_CHECK_ARG(w.format == WeightFormat::FP8Block128, "linear_fp8(", w.name, "): the weight must be FP8 block-128 ",
                    "(W8A8), found ", weight_format_name(w.format), "; use linear or linear_bf16");
  DFLASH2_DISPATCH(linear_fp8, x, x, w, y, accumulate);
}

bool linear_fp8_available(Device dev) {
  if (dev.is_cpu()) return true;
#if defined(DFLASH2_WITH_CUDA) && defined(DFLASH2_WITH_CUTLASS)
  if (dev.is_cuda()) return cuda::linear_fp8_supported(dev.index);
#endif
  return false;
}

// >= FLT_MIN: 1 / input_scale must be finite (a subnormal scale would make it infinite)
bool takes_w4a4(const Weight& w) {
  return w.format == WeightFormat::NVFP4 && std::isfinite(w.input_scale) &&
         w.input_scale >= std::numeric_limits<float>::min();
}

void linear_nvfp4(const Tensor& x, const Weight& w, Tensor& y, bool accumulate) {
  check_linear("linear_nvfp4", x, w, y);
  DFLASH2_CHECK_ARG(w.format == WeightFormat::NVFP4, "linear_nvfp4(", w.name, "): the weight must be NVFP4 (W4A4), ",
                    "found ", weight_format_name(w.format), "; use linear or linear_bf16");
  DFLASH2_CHECK_ARG(takes_w4a4(w), "linear_nvfp4(",
                    w.name, "): W4A4 needs the checkpoint's activation scale (a normal input_scale > 0), found ",
                    w.input_scale);
  DFLASH2_DISPATCH(linear_nvfp4, x, x, w, y, accumulate);
}

bool linear_nvfp4_available(Device dev) {
  if (dev.is_cpu()) return true;
#if defined(DFLASH2_WITH_CUDA) && defined(DFLASH2_WITH_CUTLASS)
  if (dev.is_cuda()) return cuda::linear_nvfp4_supported(dev.index);
#endif
  return false;
}

bool prepare_nvfp4_scales(Weight& w) {
  if (!takes_w4a4(w) || !w.data.defined() || !w.data.device().is_cuda()) return false;
  if (w.sf_blocked.defined()) return true;  // already prepared
#if defined(DFLASH2_WITH_CUDA) && defined(DFLASH2_WITH_CUTLASS)
  if (!cuda::linear_nvfp4_supported(w.data.device().index)) return false;
  w.sf_blocked = cuda::nvfp4_blocked_scales(w);
  return true;
#else
  return false;
#endif
}

const char* gemm_numerics_name(GemmNumerics g) {
  switch (g) {
    case GemmNumerics::Exact: return "exact";
    case GemmNumerics::BF16: return "bf16";
    case GemmNumerics::FP8: return "fp8";
    case GemmNumerics::NVFP4: return "nvfp4";
  }
  return "?";
}

namespace {
// Whether linear_as(g, ..., w, ...) runs linear_bf16: BF16 numerics, and the weights FP8 /
// NVFP4 numerics have no W8A8 / W4A4 GEMM for.
bool as_bf16(GemmNumerics g, const Weight& w) {
  return g == GemmNumerics::BF16 || (g == GemmNumerics::FP8 && w.format != WeightFormat::FP8Block128) ||
         (g == GemmNumerics::NVFP4 && !takes_w4a4(w));
}
}  // namespace

void linear_as(GemmNumerics g, const Tensor& x, const Weight& w, Tensor& y, bool accumulate, bool decode) {
  if (g == GemmNumerics::Exact) return linear(x, w, y, accumulate);
  if (as_bf16(g, w)) return linear_bf16(x, w, y, accumulate, decode);
  if (g == GemmNumerics::FP8) return linear_fp8(x, w, y, accumulate);
  return linear_nvfp4(x, w, y, accumulate);
}

void linear_as_many(GemmNumerics g, const Tensor& x, const std::vector<const Weight*>& ws,
                    const std::vector<Tensor*>& ys, bool decode) {
  DFLASH2_CHECK_ARG(ws.size() == ys.size(), "linear_as_many: ", ws.size(), " weights but ", ys.size(), " outputs");
  if (g == GemmNumerics::Exact && ws.size() > 1 && fused_launches()) {  // one launch where the backend can
    if (auto fn = backend_table(x.device()).linear_many) {
      for (size_t i = 0; i < ws.size(); ++i) {
        DFLASH2_CHECK_ARG(ws[i] && ys[i], "linear_as_many: null weight or output ", i);
        check_linear("linear", x, *ws[i], *ys[i]);
      }
      bool done = false;
      fn(x, ws, ys, done);
      if (done) return;
    }
  }
  // the projections linear_as sends to linear_bf16: together where the backend can share x
  std::vector<const Weight*> bw;
  std::vector<Tensor*> by;
  for (size_t i = 0; i < ws.size(); ++i) {
    DFLASH2_CHECK_ARG(ws[i] && ys[i], "linear_as_many: null weight or output ", i);
    if (decode && as_bf16(g, *ws[i])) {
      bw.push_back(ws[i]);
      by.push_back(ys[i]);
    } else {
      linear_as(g, x, *ws[i], *ys[i], false, decode);
    }
  }
  if (bw.empty()) return;
  if (auto fn = backend_table(x.device()).linear_bf16_decode_many; fn && bw.size() > 1) {
    for (size_t i = 0; i < bw.size(); ++i) check_linear("linear_bf16", x, *bw[i], *by[i]);
    bool done = false;
    fn(x, bw, by, done);
    if (done) return;
  }
  for (size_t i = 0; i < bw.size(); ++i) linear_bf16(x, *bw[i], *by[i], false, true);
}

namespace {
void check_rms_norm(const Tensor& x, const Tensor& w, float eps, const Tensor& out, const char* op) {
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
  if (x.device().is_cpu())
    DFLASH2_CHECK_ARG(x.dtype() == DType::F32, op, ": the CPU backend takes F32 activations, found ", x.describe());
  else
    DFLASH2_CHECK_ARG(x.dtype() == DType::F32 || x.dtype() == DType::BF16, op,
                      ": the CUDA backend takes F32 or BF16 activations, found ", x.describe());
}
}  // namespace

void rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out) {
  check_rms_norm(x, w, eps, out, "rms_norm");
  DFLASH2_DISPATCH(rms_norm, x, x, w, eps, out);
}

void rms_norm_many(const std::vector<const Tensor*>& xs, const std::vector<const Tensor*>& ws,
                   const std::vector<float>& eps, const std::vector<Tensor*>& outs) {
  const char* op = "rms_norm_many";
  DFLASH2_CHECK_ARG(ws.size() == xs.size() && eps.size() == xs.size() && outs.size() == xs.size(), op, ": ",
                    xs.size(), " inputs, ", ws.size(), " weights, ", eps.size(), " eps and ", outs.size(), " outputs");
  for (size_t i = 0; i < xs.size(); ++i)
    DFLASH2_CHECK_ARG(xs[i] && ws[i] && outs[i] && xs[i]->defined() && ws[i]->defined() && outs[i]->defined(), op,
                      ": tensor ", i, " is undefined");
  if (xs.empty()) return;
  if (xs.size() > 1 && fused_launches()) {
    if (auto fn = backend_table(xs[0]->device()).rms_norm_many) {
      for (size_t i = 0; i < xs.size(); ++i) check_rms_norm(*xs[i], *ws[i], eps[i], *outs[i], op);
      bool done = false;
      fn(xs, ws, eps, outs, done);
      if (done) return;
    }
  }
  for (size_t i = 0; i < xs.size(); ++i) rms_norm(*xs[i], *ws[i], eps[i], *outs[i]);
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
  DFLASH2_DISPATCH(layer_norm, x, x, w, b, eps, out);
}

namespace {
void check_rope(const Tensor& x, const Tensor& positions, double theta, const char* op) {
  need_dtype(x, DType::F32, op, "x");
  need_index(positions, op, "positions");
  DFLASH2_CHECK_ARG(x.ndim() == 3, op, ": x must be [tokens, heads, dim], found ", x.describe());
  DFLASH2_CHECK_ARG(x.shape(2) % 2 == 0, op, ": the rotary dim must be even, found ", x.shape(2));
  DFLASH2_CHECK_ARG(positions.ndim() == 1 && positions.shape(0) == x.shape(0), op, ": positions must be [",
                    x.shape(0), "], found ", positions.describe());
  DFLASH2_CHECK_ARG(theta > 0, op, ": theta must be > 0, found ", theta);
  same_device(x, positions, op);
}
}  // namespace

void rope(Tensor& x, const Tensor& positions, double theta, RopeStyle style) {
  check_rope(x, positions, theta, "rope");
  DFLASH2_DISPATCH(rope, x, x, positions, theta, style);
}

void rope_many(const std::vector<Tensor*>& xs, const Tensor& positions, double theta, RopeStyle style) {
  for (size_t i = 0; i < xs.size(); ++i) DFLASH2_CHECK_ARG(xs[i] && xs[i]->defined(), "rope_many: tensor ", i, " is undefined");
  if (xs.empty()) return;
  if (xs.size() > 1 && fused_launches()) {
    if (auto fn = backend_table(xs[0]->device()).rope_many) {
      for (Tensor* x : xs) check_rope(*x, positions, theta, "rope_many");
      bool done = false;
      fn(xs, positions, theta, style, done);
      if (done) return;
    }
  }
  for (Tensor* x : xs) rope(*x, positions, theta, style);
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
  DFLASH2_DISPATCH(silu_mul, gate, gate, up, out);
}

void gated_mlp(const Tensor& x, const Weight& gate, const Weight& up, const Weight& down, Tensor& out,
               Tensor& scratch, GemmNumerics numerics, bool decode, bool accumulate) {
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
  if (numerics == GemmNumerics::BF16 && decode) {
    // generated tokens: a backend may run the three projections as one unit (CUDA: x rounded
    // once, gate and up reduced straight into the down input), bitwise the steps below
    if (auto fn = backend_table(x.device()).gated_mlp_decode) {
      check_linear(op, x, gate, g);
      check_linear(op, x, up, u);
      check_linear(op, g, down, out);
      bool done = false;
      fn(x, gate, up, down, out, accumulate, done);
      if (done) return;
    }
  }
  bool gated = false;  // gate, up and silu_mul in one launch where the backend can
  if (numerics == GemmNumerics::Exact && fused_launches()) {
    if (auto fn = backend_table(x.device()).linear_silu_mul) {
      check_linear(op, x, gate, g);
      check_linear(op, x, up, u);
      fn(x, gate, up, g, gated);
    }
  }
  if (!gated) {
    linear_as_many(numerics, x, {&gate, &up}, {&g, &u}, decode);
    silu_mul(g, u, g);
  }
  linear_as(numerics, g, down, out, accumulate, decode);
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
  DFLASH2_DISPATCH(softmax, x, x, out, scale);
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
  DFLASH2_DISPATCH(topk, x, x, k, values, indices);
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
  if (ids.device().is_cpu()) {
    const int64_t V = table.shape(0);
    for (int64_t t = 0; t < ids.shape(0); ++t) {
      const int64_t id = ids.dtype() == DType::I64 ? ids.data_as<const int64_t>()[t * ids.stride(0)]
                                                   : ids.data_as<const int32_t>()[t * ids.stride(0)];
      DFLASH2_CHECK_ARG(id >= 0 && id < V, "embedding: token id ", id, " at position ", t,
                        " is outside the vocabulary [0, ", V, ")");
    }
  }
  DFLASH2_DISPATCH(gather_rows, table, table, ids, out);
}

// ------------------------------------------------------------------ data movement
namespace {
void need_i32_vec(const Tensor& t, int64_t n, const char* op, const char* arg) {
  need_dtype(t, DType::I32, op, arg);
  DFLASH2_CHECK_ARG(t.ndim() == 1 && (n < 0 || t.shape(0) == n), op, ": argument '", arg, "' must be I32 [",
                    n < 0 ? std::string("n") : std::to_string(n), "], found ", t.describe());
}
void need_3d(const Tensor& t, DType dt, const char* op, const char* arg) {
  need_dtype(t, dt, op, arg);
  DFLASH2_CHECK_ARG(t.ndim() == 3 && (t.stride(2) == 1 || t.shape(2) == 1), op, ": argument '", arg, "' must be ",
                    dtype_name(dt), " [a, b, c] with contiguous rows, found ", t.describe(), " strides ",
                    shape_str(t.strides()));
}
void need_2d_rows(const Tensor& t, DType dt, const char* op, const char* arg) {
  need_dtype(t, dt, op, arg);
  DFLASH2_CHECK_ARG(t.ndim() == 2 && (t.stride(1) == 1 || t.shape(1) == 1), op, ": argument '", arg, "' must be ",
                    dtype_name(dt), " [rows, cols] with contiguous rows, found ", t.describe(), " strides ",
                    shape_str(t.strides()));
}
void need_tokens(const PagedTokens& tok, int64_t T, const char* op) {
  need_i32_vec(tok.seq, T, op, "tok.seq");
  need_i32_vec(tok.pos, T, op, "tok.pos");
  need_2d_rows(tok.block_table, DType::I32, op, "tok.block_table");
  DFLASH2_CHECK_ARG(tok.block_size >= 1, op, ": block_size must be >= 1, found ", tok.block_size);
}
// On the CPU, the planner's bookkeeping is checked against the cache: every (seq, pos) must
// name a block-table row and a block inside the cache (a bad plan is an error, not a read
// out of bounds).
void check_tokens_cpu(const PagedTokens& tok, const Tensor& cache, const char* op) {
  if (!tok.seq.device().is_cpu()) return;
  const int64_t S = tok.block_table.shape(0), NB = tok.block_table.shape(1), rows = cache.shape(0);
  for (int64_t i = 0; i < tok.seq.shape(0); ++i) {
    const int64_t s = tok.seq.data_as<const int32_t>()[i * tok.seq.stride(0)];
    const int64_t p = tok.pos.data_as<const int32_t>()[i * tok.pos.stride(0)];
    DFLASH2_CHECK_ARG(s >= 0 && s < S, op, ": token ", i, " names block-table row ", s, " outside [0, ", S, ")");
    DFLASH2_CHECK_ARG(p >= 0 && p / tok.block_size < NB, op, ": token ", i, " at position ", p,
                      " does not fit a block table of ", NB, " blocks of ", tok.block_size);
    for (int64_t b = 0; b <= p / tok.block_size; ++b) {
      const int64_t blk = tok.block_table.data_as<const int32_t>()[s * tok.block_table.stride(0) + b];
      DFLASH2_CHECK_ARG(blk >= 0 && (blk + 1) * tok.block_size <= rows, op, ": block-table row ", s, " entry ", b,
                        " = ", blk, " is outside the cache of ", rows / tok.block_size, " blocks");
    }
  }
}
}  // namespace

void copy(const Tensor& src, Tensor& dst) {
  const char* op = "copy";
  need(src, op, "src");
  need(dst, op, "dst");
  need_same_shape(src, dst, op, "src", "dst");
  DFLASH2_CHECK_ARG(src.dtype() == dst.dtype() || (dst.dtype() == DType::F32 && (src.dtype() == DType::BF16 ||
                                                                                   src.dtype() == DType::F16)),
                    op, ": src ", src.describe(), " and dst ", dst.describe(),
                    " must have the same dtype (or BF16/F16 into F32)");
  same_device(src, dst, op);
  DFLASH2_DISPATCH(copy, src, src, dst);
}

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  const char* op = "add";
  need_dtype(a, DType::F32, op, "a");
  need_dtype(b, DType::F32, op, "b");
  need_dtype(out, DType::F32, op, "out");
  need_rows(a, op, "a");
  need_rows(b, op, "b");
  need_rows(out, op, "out");
  need_same_shape(a, b, op, "a", "b");
  need_same_shape(a, out, op, "a", "out");
  row_stride(a, op, "a");
  row_stride(b, op, "b");
  row_stride(out, op, "out");
  same_device(a, b, op);
  same_device(a, out, op);
  DFLASH2_DISPATCH(add, a, a, b, out);
}

void gather_rows(const Tensor& src, const Tensor& idx, Tensor& out) {
  const char* op = "gather_rows";
  need_float_weight(src, op, "src");
  need_index(idx, op, "idx");
  need_dtype(out, DType::F32, op, "out");
  DFLASH2_CHECK_ARG(src.ndim() == 2 && src.stride(1) == 1, op, ": src must be [N, D] with contiguous rows, found ",
                    src.describe());
  DFLASH2_CHECK_ARG(idx.ndim() == 1, op, ": idx must be 1-D, found ", idx.describe());
  DFLASH2_CHECK_ARG(out.ndim() == 2 && out.shape(0) == idx.shape(0) && out.shape(1) == src.shape(1), op,
                    ": out must be [", idx.shape(0), ", ", src.shape(1), "], found ", out.describe());
  need_rows(out, op, "out");
  same_device(src, idx, op);
  same_device(src, out, op);
  DFLASH2_DISPATCH(gather_rows, src, src, idx, out);
}

void embedding_shard(const Tensor& table, const Tensor& ids, int64_t first, Tensor& out) {
  const char* op = "embedding_shard";
  need_float_weight(table, op, "table");
  need_index(ids, op, "ids");
  need_dtype(out, DType::F32, op, "out");
  DFLASH2_CHECK_ARG(table.ndim() == 2 && table.stride(1) == 1, op, ": table must be [rows, dim] with contiguous rows, found ",
                    table.describe());
  DFLASH2_CHECK_ARG(ids.ndim() == 1, op, ": ids must be 1-D, found ", ids.describe());
  DFLASH2_CHECK_ARG(out.ndim() == 2 && out.shape(0) == ids.shape(0) && out.shape(1) == table.shape(1), op,
                    ": out must be [", ids.shape(0), ", ", table.shape(1), "], found ", out.describe());
  DFLASH2_CHECK_ARG(first >= 0, op, ": first must be >= 0, found ", first);
  need_rows(out, op, "out");
  same_device(table, ids, op);
  same_device(table, out, op);
  DFLASH2_DISPATCH(embedding_shard, table, table, ids, first, out);
}

void argmax(const Tensor& x, Tensor& out) {
  const char* op = "argmax";
  need_dtype(x, DType::F32, op, "x");
  if (x.ndim() == 2) DFLASH2_CHECK_ARG(x.shape(1) >= 1, op, ": rows must not be empty, found ", x.describe());
  need_2d_rows(x, DType::F32, op, "x");
  need_i32_vec(out, x.shape(0), op, "out");
  same_device(x, out, op);
  DFLASH2_DISPATCH(argmax, x, x, out);
}

void check_finite(const Tensor& x, Tensor& flags) {
  const char* op = "check_finite";
  need_2d_rows(x, DType::F32, op, "x");
  need_i32_vec(flags, x.shape(0), op, "flags");
  same_device(x, flags, op);
  DFLASH2_DISPATCH(check_finite, x, x, flags);
}

void token_logprobs(const Tensor& x, const Tensor& ids, Tensor& lp, Tensor& lse) {
  const char* op = "token_logprobs";
  need_2d_rows(x, DType::F32, op, "x");
  DFLASH2_CHECK_ARG(x.shape(1) >= 1, op, ": rows must not be empty, found ", x.describe());
  DFLASH2_CHECK_ARG(x.shape(1) <= INT32_MAX, op, ": rows longer than 2^31 - 1, found ", x.describe());
  need_i32_vec(ids, x.shape(0), op, "ids");
  need_dtype(lp, DType::F32, op, "lp");
  need_dtype(lse, DType::F32, op, "lse");
  DFLASH2_CHECK_ARG(lp.ndim() == 1 && lp.shape(0) == x.shape(0) && lse.ndim() == 1 && lse.shape(0) == x.shape(0),
                    op, ": lp and lse must be F32 [", x.shape(0), "], found ", lp.describe(), " and ", lse.describe());
  same_device(x, ids, op);
  same_device(x, lp, op);
  same_device(x, lse, op);
  if (x.device().is_cpu()) {  // an id outside the row: a clear error (the CUDA kernel writes NaN there)
    const int32_t* id = ids.data_as<const int32_t>();
    for (int64_t r = 0; r < x.shape(0); ++r)
      DFLASH2_CHECK_ARG(id[r * ids.stride(0)] >= 0 && id[r * ids.stride(0)] < x.shape(1), op, ": ids[", r, "] = ",
                        id[r * ids.stride(0)], " is outside the row [0, ", x.shape(1), ")");
  }
  DFLASH2_DISPATCH(token_logprobs, x, x, ids, lp, lse);
}

void argmax_shard(const Tensor& x, int64_t first, Tensor& out) {
  const char* op = "argmax_shard";
  need_dtype(x, DType::F32, op, "x");
  if (x.ndim() == 2) DFLASH2_CHECK_ARG(x.shape(1) >= 1, op, ": rows must not be empty, found ", x.describe());
  need_2d_rows(x, DType::F32, op, "x");
  DFLASH2_CHECK_ARG(first >= 0 && first + x.shape(1) <= (int64_t(1) << 24), op, ": ids ", first, "..",
                    first + x.shape(1) - 1, " are not all exact in F32 (at most 2^24)");
  need_2d_rows(out, DType::F32, op, "out");
  DFLASH2_CHECK_ARG(out.shape(0) == x.shape(0) && out.shape(1) == 2, op, ": out must be F32 [", x.shape(0),
                    ", 2], found ", out.describe());
  same_device(x, out, op);
  DFLASH2_DISPATCH(argmax_shard, x, x, first, out);
}

void argmax_merge(const Tensor& pairs, Tensor& ids, Tensor& flags) {
  const char* op = "argmax_merge";
  need_3d(pairs, DType::F32, op, "pairs");
  DFLASH2_CHECK_ARG(pairs.shape(0) >= 1 && pairs.shape(2) == 2, op, ": pairs must be F32 [N >= 1, R, 2], found ",
                    pairs.describe());
  need_i32_vec(ids, pairs.shape(1), op, "ids");
  need_i32_vec(flags, pairs.shape(1), op, "flags");
  same_device(pairs, ids, op);
  same_device(pairs, flags, op);
  DFLASH2_DISPATCH(argmax_merge, pairs, pairs, ids, flags);
}

void topk_merge(const Tensor& vals, const Tensor& idx, int64_t shard_size, Tensor& values, Tensor& indices) {
  const char* op = "topk_merge";
  need_3d(vals, DType::F32, op, "vals");
  need_3d(idx, DType::I32, op, "idx");
  DFLASH2_CHECK_ARG(vals.shape() == idx.shape() && vals.shape(0) >= 1 && vals.shape(2) >= 1, op,
                    ": vals and idx must be [N >= 1, R, k >= 1] alike, found ", vals.describe(), " and ",
                    idx.describe());
  const int64_t N = vals.shape(0), R = vals.shape(1), kin = vals.shape(2);
  DFLASH2_CHECK_ARG(shard_size >= kin && shard_size * N <= (int64_t(1) << 31) - 1, op, ": shard_size ", shard_size,
                    " must be >= k (", kin, ") and N x shard_size ids must fit I32");
  need_2d_rows(values, DType::F32, op, "values");
  need_2d_rows(indices, DType::I32, op, "indices");
  DFLASH2_CHECK_ARG(values.shape() == indices.shape() && values.shape(0) == R && values.shape(1) >= 1 &&
                        values.shape(1) <= kin,
                    op, ": values and indices must be [", R, ", k <= ", kin, "] alike, found ", values.describe(),
                    " and ", indices.describe());
  same_device(vals, idx, op);
  same_device(vals, values, op);
  same_device(vals, indices, op);
  DFLASH2_DISPATCH(topk_merge, vals, vals, idx, shard_size, values, indices);
}

void resolve_tokens(Tensor& tokens, const Tensor& src) {
  const char* op = "resolve_tokens";
  need_i32_vec(tokens, -1, op, "tokens");
  DFLASH2_CHECK_ARG(tokens.stride(0) == 1 || tokens.shape(0) <= 1, op, ": tokens must be contiguous, found ",
                    tokens.describe());
  need_dtype(src, DType::I32, op, "src");
  DFLASH2_CHECK_ARG(src.is_contiguous(), op, ": src must be contiguous, found ", src.describe());
  same_device(tokens, src, op);
  DFLASH2_DISPATCH(resolve_tokens, tokens, tokens, src);
}

void next_after_accept(const Tensor& row0, const Tensor& draft_row, const Tensor& draft_len, const Tensor& accepted,
                       const Tensor& bonus, const Tensor& drafts, Tensor& next, Tensor& last) {
  const char* op = "next_after_accept";
  need_i32_vec(row0, -1, op, "row0");
  const int64_t S = row0.shape(0);
  need_i32_vec(draft_row, S, op, "draft_row");
  need_i32_vec(draft_len, S, op, "draft_len");
  need_i32_vec(accepted, S, op, "accepted");
  need_i32_vec(bonus, S, op, "bonus");
  need_i32_vec(last, S, op, "last");
  need_i32_vec(next, -1, op, "next");
  DFLASH2_CHECK_ARG(next.stride(0) == 1 || next.shape(0) <= 1, op, ": next must be contiguous, found ", next.describe());
  need_dtype(drafts, DType::I32, op, "drafts");
  DFLASH2_CHECK_ARG(drafts.ndim() == 2 && (drafts.stride(1) == 1 || drafts.shape(1) <= 1), op,
                    ": drafts must be I32 [N, K] with contiguous rows, found ", drafts.describe());
  for (const Tensor* t : std::initializer_list<const Tensor*>{&draft_row, &draft_len, &accepted, &bonus, &drafts, &next, &last}) same_device(row0, *t, op);
  DFLASH2_DISPATCH(next_after_accept, row0, row0, draft_row, draft_len, accepted, bonus, drafts, next, last);
}

void nvfp4_quantize_act(const Tensor& x, float input_scale, Tensor& out) {
  const char* op = "nvfp4_quantize_act";
  need_2d_rows(x, DType::F32, op, "x");
  need_2d_rows(out, DType::F32, op, "out");
  same_device(x, out, op);
  DFLASH2_CHECK_ARG(out.shape(0) == x.shape(0) && out.shape(1) == x.shape(1), op, ": out ", out.describe(),
                    " must have x's shape ", x.describe());
  DFLASH2_CHECK_ARG(x.shape(1) % 16 == 0, op, ": the row length ", x.shape(1),
                    " must be a multiple of 16 (NVFP4 quantizes blocks of 16 inputs)");
  DFLASH2_CHECK_ARG(std::isfinite(input_scale) && input_scale >= std::numeric_limits<float>::min(), op,
                    ": input_scale must be positive, normal and finite, found ", input_scale);
  DFLASH2_DISPATCH(nvfp4_quantize_act, x, x, input_scale, out);
}

void fp8_quantize_act(const Tensor& x, Tensor& out) {
  const char* op = "fp8_quantize_act";
  need_2d_rows(x, DType::F32, op, "x");
  need_2d_rows(out, DType::F32, op, "out");
  same_device(x, out, op);
  DFLASH2_CHECK_ARG(out.shape(0) == x.shape(0) && out.shape(1) == x.shape(1), op, ": out ", out.describe(),
                    " must have x's shape ", x.describe());
  DFLASH2_DISPATCH(fp8_quantize_act, x, x, out);
}

// ------------------------------------------------------------------ paged caches
namespace {
// A cache's element type as the attention ops take it: F32, BF16, or U8 (FP8 rows, kv_fp8.h).
DType cache_dtype(const Tensor& c) {
  if (c.defined() && (c.dtype() == DType::BF16 || c.dtype() == DType::U8)) return c.dtype();
  return DType::F32;
}
void check_cache_write(const Tensor& src, const Tensor& slots, const Tensor& cache, const char* op) {
  need_2d_rows(src, DType::F32, op, "src");
  need_2d_rows(cache, cache_dtype(cache), op, "cache");
  need_i32_vec(slots, src.shape(0), op, "slots");
  if (cache.dtype() == DType::U8) {
    DFLASH2_CHECK_ARG(kvfp8::fits(src.shape(1)), op, ": an FP8 cache quantizes rows of a multiple of 16 values, ",
                      "at most 128 or a multiple of 128; src rows have ", src.shape(1));
    DFLASH2_CHECK_ARG(cache.shape(1) == kvfp8::fp8_bytes(src.shape(1)), op, ": an FP8 cache row of ", src.shape(1),
                      " values takes ", kvfp8::fp8_bytes(src.shape(1)), " bytes (codes, then scales), found ",
                      cache.describe());
    DFLASH2_CHECK_ARG(cache.shape(0) <= 1 || cache.stride(0) % 16 == 0, op,
                      ": an FP8 cache's rows must be 16-byte strided, found ", cache.describe());
  } else {
    DFLASH2_CHECK_ARG(src.shape(1) == cache.shape(1), op, ": src rows have ", src.shape(1),
                      " values but cache rows have ", cache.shape(1));
  }
  same_device(src, slots, op);
  same_device(src, cache, op);
}
}  // namespace

int64_t fp8_cache_row_bytes(int64_t D) { return kvfp8::fits(D) ? kvfp8::fp8_bytes(D) : 0; }
int64_t fp8_latent_row_bytes(int64_t kv_lora, int64_t rope) {
  return kvfp8::fits(kv_lora) && rope >= 0 ? kvfp8::fp8_latent_bytes(kv_lora, rope) : 0;
}

void cache_write(const Tensor& src, const Tensor& slots, Tensor& cache) {
  check_cache_write(src, slots, cache, "cache_write");
  DFLASH2_DISPATCH(cache_write, src, src, slots, cache);
}

void cache_write_many(const std::vector<const Tensor*>& srcs, const Tensor& slots, const std::vector<Tensor*>& caches) {
  DFLASH2_CHECK_ARG(srcs.size() == caches.size(), "cache_write_many: ", srcs.size(), " sources but ", caches.size(),
                    " caches");
  for (size_t i = 0; i < srcs.size(); ++i)
    DFLASH2_CHECK_ARG(srcs[i] && caches[i] && srcs[i]->defined() && caches[i]->defined(),
                      "cache_write_many: pair ", i, " has an undefined tensor");
  if (srcs.empty()) return;
  if (srcs.size() > 1 && fused_launches()) {
    if (auto fn = backend_table(srcs[0]->device()).cache_write_many) {
      for (size_t i = 0; i < srcs.size(); ++i) check_cache_write(*srcs[i], slots, *caches[i], "cache_write_many");
      bool done = false;
      fn(srcs, slots, caches, done);
      if (done) return;
    }
  }
  for (size_t i = 0; i < srcs.size(); ++i) cache_write(*srcs[i], slots, *caches[i]);
}

// ------------------------------------------------------------------ attention
void linear_heads(const Tensor& x, const Tensor& w, Tensor& y) {
  const char* op = "linear_heads";
  need_3d(x, DType::F32, op, "x");
  need_3d(y, DType::F32, op, "y");
  need_float_weight(w, op, "w");
  DFLASH2_CHECK_ARG(w.ndim() == 3 && w.stride(2) == 1, op, ": w must be [G, N, K] with contiguous rows, found ",
                    w.describe());
  DFLASH2_CHECK_ARG(w.shape(0) == x.shape(1) && w.shape(2) == x.shape(2), op, ": x ", x.describe(),
                    " does not match w ", w.describe(), " ([T, G, K] and [G, N, K])");
  DFLASH2_CHECK_ARG(y.shape(0) == x.shape(0) && y.shape(1) == x.shape(1) && y.shape(2) == w.shape(1), op,
                    ": y must be [", x.shape(0), ", ", x.shape(1), ", ", w.shape(1), "], found ", y.describe());
  same_device(x, w, op);
  same_device(x, y, op);
  DFLASH2_DISPATCH(linear_heads, x, x, w, y);
}

namespace {
// indexer_topk's and indexer_scores' shared arguments.
void need_indexer_inputs(const Tensor& q, const Tensor& w, const Tensor& key_cache, const PagedTokens& tok,
                         const char* op) {
  need_3d(q, DType::F32, op, "q");
  const int64_t T = q.shape(0);
  need_2d_rows(w, DType::F32, op, "w");
  DFLASH2_CHECK_ARG(w.shape(0) == T && w.shape(1) == q.shape(1), op, ": w must be [", T, ", ", q.shape(1),
                    "], found ", w.describe());
  need_2d_rows(key_cache, cache_dtype(key_cache), op, "key_cache");
  if (key_cache.dtype() == DType::U8) {
    DFLASH2_CHECK_ARG(kvfp8::fits(q.shape(2)) && key_cache.shape(1) == kvfp8::fp8_bytes(q.shape(2)), op,
                      ": an FP8 key cache for heads of ", q.shape(2), " values needs rows of ",
                      kvfp8::fits(q.shape(2)) ? kvfp8::fp8_bytes(q.shape(2)) : 0,
                      " bytes (a multiple of 16 values, at most 128 or a multiple of 128), found ",
                      key_cache.describe());
  } else {
    DFLASH2_CHECK_ARG(key_cache.shape(1) == q.shape(2), op, ": key_cache rows have ", key_cache.shape(1),
                      " values but q heads have ", q.shape(2));
  }
  need_tokens(tok, T, op);
  for (const Tensor* t : std::initializer_list<const Tensor*>{&w, &key_cache, &tok.seq, &tok.pos, &tok.block_table})
    same_device(q, *t, op);
}
}  // namespace

void indexer_scores(const Tensor& q, const Tensor& w, const Tensor& key_cache, const PagedTokens& tok,
                    Tensor& scores) {
  const char* op = "indexer_scores";
  need_indexer_inputs(q, w, key_cache, tok, op);
  need_2d_rows(scores, DType::F32, op, "scores");
  DFLASH2_CHECK_ARG(scores.shape(0) == q.shape(0), op, ": scores must have ", q.shape(0), " rows, found ",
                    scores.describe());
  DFLASH2_CHECK_ARG(q.shape(0) <= 1 || scores.stride(0) >= scores.shape(1), op, ": the rows of 'scores' overlap");
  same_device(q, scores, op);
  check_tokens_cpu(tok, key_cache, op);
  DFLASH2_DISPATCH(indexer_scores, q, q, w, key_cache, tok, scores);
}

void indexer_topk(const Tensor& q, const Tensor& w, const Tensor& key_cache, const PagedTokens& tok, int64_t topk,
                  Tensor& sel, Tensor& sel_len) {
  const char* op = "indexer_topk";
  need_indexer_inputs(q, w, key_cache, tok, op);
  const int64_t T = q.shape(0);
  DFLASH2_CHECK_ARG(topk >= 1, op, ": topk must be >= 1, found ", topk);
  need_2d_rows(sel, DType::I32, op, "sel");
  DFLASH2_CHECK_ARG(sel.shape(0) == T && sel.shape(1) == topk, op, ": sel must be I32 [", T, ", ", topk, "], found ",
                    sel.describe());
  need_i32_vec(sel_len, T, op, "sel_len");
  same_device(q, sel, op);
  same_device(q, sel_len, op);
  check_tokens_cpu(tok, key_cache, op);
  DFLASH2_DISPATCH(indexer_topk, q, q, w, key_cache, tok, topk, sel, sel_len);
}

void mla_attention(const Tensor& q_lat, const Tensor& q_pe, const Tensor& cache, const PagedTokens& tok,
                   const Tensor& sel, const Tensor& sel_len, float scale, Tensor& out) {
  const char* op = "mla_attention";
  need_3d(q_lat, DType::F32, op, "q_lat");
  need_3d(q_pe, DType::F32, op, "q_pe");
  need_3d(out, DType::F32, op, "out");
  const int64_t T = q_lat.shape(0), nh = q_lat.shape(1), kvl = q_lat.shape(2);
  DFLASH2_CHECK_ARG(q_pe.shape(0) == T && q_pe.shape(1) == nh, op, ": q_pe ", q_pe.describe(), " does not match q_lat ",
                    q_lat.describe());
  need_same_shape(q_lat, out, op, "q_lat", "out");
  need_2d_rows(cache, cache_dtype(cache), op, "cache");
  if (cache.dtype() == DType::U8) {
    DFLASH2_CHECK_ARG(kvfp8::fits(kvl) && cache.shape(1) == kvfp8::fp8_latent_bytes(kvl, q_pe.shape(2)), op,
                      ": an FP8 latent cache (kv_lora ", kvl, ", rope ", q_pe.shape(2), ") needs rows of ",
                      kvfp8::fits(kvl) ? kvfp8::fp8_latent_bytes(kvl, q_pe.shape(2)) : 0,
                      " bytes (kv_lora a multiple of 16, at most 128 or a multiple of 128), found ", cache.describe());
  } else {
    DFLASH2_CHECK_ARG(cache.shape(1) == kvl + q_pe.shape(2), op, ": cache rows must hold kv_lora + rope = ",
                      kvl + q_pe.shape(2), " values, found ", cache.describe());
  }
  need_tokens(tok, T, op);
  if (sel_len.defined()) {
    need_i32_vec(sel_len, T, op, "sel_len");
    need_2d_rows(sel, DType::I32, op, "sel");
    DFLASH2_CHECK_ARG(sel.shape(0) == T, op, ": sel must have ", T, " rows, found ", sel.describe());
    if (sel_len.device().is_cpu())
      for (int64_t i = 0; i < T; ++i) {
        const int64_t n = sel_len.data_as<const int32_t>()[i * sel_len.stride(0)];
        const int64_t p = tok.pos.data_as<const int32_t>()[i * tok.pos.stride(0)];
        DFLASH2_CHECK_ARG(n <= sel.shape(1), op, ": sel_len[", i, "] = ", n, " exceeds the ", sel.shape(1),
                          " selection columns");
        for (int64_t j = 0; j < n; ++j) {
          const int64_t key = sel.data_as<const int32_t>()[i * sel.stride(0) + j];
          DFLASH2_CHECK_ARG(key >= 0 && key <= p, op, ": token ", i, " at position ", p, " selects key ", key,
                            " outside its causal range [0, ", p, "]");
        }
      }
    same_device(q_lat, sel, op);
    same_device(q_lat, sel_len, op);
  }
  for (const Tensor* t : std::initializer_list<const Tensor*>{&q_pe, &cache, &tok.seq, &tok.pos, &tok.block_table, &out}) same_device(q_lat, *t, op);
  check_tokens_cpu(tok, cache, op);
  DFLASH2_DISPATCH(mla_attention, q_lat, q_lat, q_pe, cache, tok, sel, sel_len, scale, out);
}

void block_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& kv_cache, const Tensor& ctx_len,
                     const Tensor& block_table, const BlockAttention& p, Tensor& out) {
  const char* op = "block_attention";
  need_3d(q, DType::F32, op, "q");
  need_3d(k, DType::F32, op, "k");
  need_3d(v, DType::F32, op, "v");
  need_3d(out, DType::F32, op, "out");
  const int64_t T = q.shape(0), nh = q.shape(1), hd = q.shape(2), kvh = k.shape(1);
  DFLASH2_CHECK_ARG(p.block >= 1 && T % p.block == 0, op, ": ", T, " query rows are not whole blocks of ", p.block);
  DFLASH2_CHECK_ARG(k.shape(0) == T && k.shape(2) == hd && kvh >= 1 && nh % kvh == 0, op, ": k ", k.describe(),
                    " does not match q ", q.describe(), " (kv heads must divide the query heads)");
  need_same_shape(k, v, op, "k", "v");
  need_same_shape(q, out, op, "q", "out");
  need_2d_rows(kv_cache, kv_cache.defined() && kv_cache.dtype() == DType::BF16 ? DType::BF16 : DType::F32, op,
               "kv_cache");
  DFLASH2_CHECK_ARG(kv_cache.shape(1) == 2 * kvh * hd, op, ": kv_cache rows must hold [k | v] = ", 2 * kvh * hd,
                    " values, found ", kv_cache.describe());
  const int64_t S = T / p.block;
  need_i32_vec(ctx_len, S, op, "ctx_len");
  need_2d_rows(block_table, DType::I32, op, "block_table");
  DFLASH2_CHECK_ARG(block_table.shape(0) >= S, op, ": block_table needs a row per block (", S, "), found ",
                    block_table.describe());
  DFLASH2_CHECK_ARG(p.cache_block_size >= 1 && p.window >= 0, op, ": cache_block_size must be >= 1 and window >= 0");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&k, &v, &kv_cache, &ctx_len, &block_table, &out}) same_device(q, *t, op);
  if (ctx_len.device().is_cpu())
    for (int64_t s = 0; s < S; ++s) {
      const int64_t L = ctx_len.data_as<const int32_t>()[s * ctx_len.stride(0)];
      DFLASH2_CHECK_ARG(L >= 0 && (L + p.cache_block_size - 1) / p.cache_block_size <= block_table.shape(1), op,
                        ": ctx_len[", s, "] = ", L, " does not fit the block table");
      for (int64_t b = 0; b < (L + p.cache_block_size - 1) / p.cache_block_size; ++b) {
        const int64_t blk = block_table.data_as<const int32_t>()[s * block_table.stride(0) + b];
        DFLASH2_CHECK_ARG(blk >= 0 && (blk + 1) * p.cache_block_size <= kv_cache.shape(0), op, ": block-table row ",
                          s, " entry ", b, " = ", blk, " is outside the cache");
      }
    }
  DFLASH2_DISPATCH(block_attention, q, q, k, v, kv_cache, ctx_len, block_table, p, out);
}

// ------------------------------------------------------------------ MoE
void moe_route(const Tensor& logits, const Tensor& bias, const MoeRouting& r, Tensor& ids, Tensor& weights) {
  const char* op = "moe_route";
  need_2d_rows(logits, DType::F32, op, "logits");
  const int64_t T = logits.shape(0), E = logits.shape(1);
  need_dtype(bias, DType::F32, op, "bias");
  DFLASH2_CHECK_ARG(bias.ndim() == 1 && bias.shape(0) == E, op, ": bias must be F32 [", E, "], found ", bias.describe());
  DFLASH2_CHECK_ARG(r.n_group >= 1 && E % r.n_group == 0, op, ": n_group ", r.n_group, " must divide ", E,
                    " experts");
  DFLASH2_CHECK_ARG(r.topk_group >= 1 && r.topk_group <= r.n_group, op, ": topk_group must be in [1, n_group = ",
                    r.n_group, "], found ", r.topk_group);
  DFLASH2_CHECK_ARG(r.top_k >= 1 && r.top_k <= E / r.n_group * r.topk_group, op, ": top_k = ", r.top_k,
                    " must be in [1, experts in the kept groups = ", E / r.n_group * r.topk_group, "]");
  need_2d_rows(ids, DType::I32, op, "ids");
  need_2d_rows(weights, DType::F32, op, "weights");
  DFLASH2_CHECK_ARG(ids.shape(0) == T && ids.shape(1) == r.top_k && weights.shape(0) == T &&
                        weights.shape(1) == r.top_k,
                    op, ": ids and weights must be [", T, ", ", r.top_k, "], found ", ids.describe(), " and ",
                    weights.describe());
  for (const Tensor* t : std::initializer_list<const Tensor*>{&bias, &ids, &weights}) same_device(logits, *t, op);
  DFLASH2_DISPATCH(moe_route, logits, logits, bias, r, ids, weights);
}

int64_t moe_workspace_floats(int64_t T, int64_t top_k, int64_t H, int64_t F, int64_t E) {
  return 3 * T * top_k * H + 2 * T * top_k * F + T * top_k + 2 * E + 1;
}

void moe_experts(const Tensor& x, const Tensor& ids, const Tensor& weights, const ExpertWeights& experts, Tensor& out,
                 Tensor& workspace, GemmNumerics numerics, bool decode, bool accumulate) {
  const char* op = "moe_experts";
  (void)numerics;  // every GemmNumerics is a mode of the experts
  need_2d_rows(x, DType::F32, op, "x");
  need_2d_rows(out, DType::F32, op, "out");
  need_same_shape(x, out, op, "x", "out");
  const int64_t T = x.shape(0), H = x.shape(1), E = int64_t(experts.gate.size());
  need_2d_rows(ids, DType::I32, op, "ids");
  need_2d_rows(weights, DType::F32, op, "weights");
  DFLASH2_CHECK_ARG(ids.shape(0) == T && weights.shape() == ids.shape(), op, ": ids and weights must be [", T,
                    ", top_k], found ", ids.describe(), " and ", weights.describe());
  DFLASH2_CHECK_ARG(E >= 1 && int64_t(experts.up.size()) == E && int64_t(experts.down.size()) == E, op,
                    ": expected the same number (>= 1) of gate, up and down weights");
  DFLASH2_CHECK_ARG(experts.first >= 0 && (experts.num_global == 0 || experts.first + E <= experts.num_global), op,
                    ": experts [", experts.first, ", ", experts.first + E, ") are not inside [0, ", experts.num_global,
                    ")");
  const int64_t F = experts.gate[0].out_features;
  for (int64_t e = 0; e < E; ++e) {
    const Weight &g = experts.gate[size_t(e)], &u = experts.up[size_t(e)], &d = experts.down[size_t(e)];
    DFLASH2_CHECK_ARG(g.in_features == H && u.in_features == H && g.out_features == F && u.out_features == F &&
                          d.in_features == F && d.out_features == H,
                      op, ": expert ", e, " has shapes gate [", g.out_features, ", ", g.in_features, "], up [",
                      u.out_features, ", ", u.in_features, "], down [", d.out_features, ", ", d.in_features,
                      "]; expected [", F, ", ", H, "], [", F, ", ", H, "], [", H, ", ", F, "]");
    same_device(x, g.data, op);
  }
  need_dtype(workspace, DType::F32, op, "workspace");
  const int64_t need_ws = moe_workspace_floats(T, ids.shape(1), H, F, E);
  DFLASH2_CHECK_ARG(workspace.is_contiguous() && workspace.numel() >= need_ws, op, ": workspace must hold ", need_ws,
                    " contiguous floats, found ", workspace.describe());
  for (const Tensor* t : std::initializer_list<const Tensor*>{&ids, &weights, &out, &workspace}) same_device(x, *t, op);
  if (numerics == GemmNumerics::FP8) {
    for (int64_t e = 0; e < E; ++e)
      for (const Weight* w : {&experts.gate[size_t(e)], &experts.up[size_t(e)], &experts.down[size_t(e)]})
        DFLASH2_CHECK_ARG(w->format == WeightFormat::FP8Block128, op, ": 'fp8' numerics need FP8 block-128 experts, ",
                          "expert ", e, "'s '", w->name, "' is ", weight_format_name(w->format));
    DFLASH2_DISPATCH(moe_experts_fp8, x, x, ids, weights, experts, out, workspace, accumulate);
  }
  if (numerics == GemmNumerics::NVFP4) {
    for (int64_t e = 0; e < E; ++e)
      for (const Weight* w : {&experts.gate[size_t(e)], &experts.up[size_t(e)], &experts.down[size_t(e)]})
        DFLASH2_CHECK_ARG(takes_w4a4(*w), op, ": 'nvfp4' numerics need NVFP4 experts with an input_scale, expert ", e, "'s '", w->name,
                          "' is ", weight_format_name(w->format), w->format == WeightFormat::NVFP4 ? " without a normal, finite one" : "");
    DFLASH2_DISPATCH(moe_experts_nvfp4, x, x, ids, weights, experts, out, workspace, accumulate);
  }
  if (numerics == GemmNumerics::BF16)
    DFLASH2_DISPATCH(moe_experts_bf16, x, x, ids, weights, experts, out, workspace, decode, accumulate);
  DFLASH2_DISPATCH(moe_experts, x, x, ids, weights, experts, out, workspace, accumulate);
}

bool moe_experts_nvfp4_available(Device dev, const ExpertWeights& experts) {
  if (experts.gate.empty()) return false;
  // the shapes the grouped kernel takes, on every device (so the CPU and a GPU choose the same
  // numerics for a checkpoint): K % 32 == 0 (16-byte rows of codes), N % 4 == 0
  for (size_t e = 0; e < experts.gate.size(); ++e)
    for (const Weight* w : {&experts.gate[e], &experts.up[e], &experts.down[e]})
      if (!takes_w4a4(*w) || w->in_features % 32 != 0 || w->out_features % 4 != 0)
        return false;
  if (dev.is_cpu()) return true;
#if defined(DFLASH2_WITH_CUDA) && defined(DFLASH2_WITH_CUTLASS)
  if (dev.is_cuda()) return cuda::moe_experts_nvfp4_supported(dev.index, experts);
#endif
  return false;
}

bool moe_experts_bf16_available(Device dev, const ExpertWeights& experts) {
  if (experts.gate.empty()) return false;
  if (dev.is_cpu()) return true;
#if defined(DFLASH2_WITH_CUDA)
  if (dev.is_cuda()) return cuda::moe_experts_bf16_supported(dev.index);
#endif
  return false;
}

bool moe_experts_fp8_available(Device dev, const ExpertWeights& experts) {
  if (experts.gate.empty()) return false;
  // the shapes the grouped kernel takes, on every device (K % 16 == 0, N % 4 == 0)
  for (size_t e = 0; e < experts.gate.size(); ++e)
    for (const Weight* w : {&experts.gate[e], &experts.up[e], &experts.down[e]})
      if (w->format != WeightFormat::FP8Block128 || w->in_features % 16 != 0 || w->out_features % 4 != 0) return false;
  if (dev.is_cpu()) return true;
#if defined(DFLASH2_WITH_CUDA) && defined(DFLASH2_WITH_CUTLASS)
  if (dev.is_cuda()) return cuda::moe_experts_fp8_supported(dev.index, experts);
#endif
  return false;
}

// ------------------------------------------------------------------ DFlash drafter
void dyn_conv(const Tensor& x, const Tensor& base, const Tensor& dyn, int64_t block, Tensor& out) {
  const char* op = "dyn_conv";
  need_2d_rows(x, DType::F32, op, "x");
  need_2d_rows(out, DType::F32, op, "out");
  need_same_shape(x, out, op, "x", "out");
  const int64_t R = x.shape(0), H = x.shape(1);
  DFLASH2_CHECK_ARG(block >= 1 && R % block == 0, op, ": ", R, " rows are not whole blocks of ", block);
  need_2d_rows(base, DType::F32, op, "base");
  DFLASH2_CHECK_ARG(base.shape(0) == 2 && base.shape(1) == H, op, ": base must be F32 [2, ", H, "], found ",
                    base.describe());
  need_2d_rows(dyn, DType::F32, op, "dyn");
  const int64_t G2 = dyn.shape(1);
  DFLASH2_CHECK_ARG(dyn.shape(0) == R && G2 >= 2 && G2 % 2 == 0 && H % (G2 / 2) == 0, op,
                    ": dyn must be [", R, ", 2G] with G dividing ", H, ", found ", dyn.describe());
  for (const Tensor* t : std::initializer_list<const Tensor*>{&base, &dyn, &out}) same_device(x, *t, op);
  DFLASH2_DISPATCH(dyn_conv, x, x, base, dyn, block, out);
}

namespace {
void need_rng(const Tensor& rng, int64_t R, const char* op) {
  need_dtype(rng, DType::I64, op, "rng");
  DFLASH2_CHECK_ARG(rng.ndim() == 2 && rng.shape(0) == R && rng.shape(1) == 2, op, ": rng must be I64 [", R,
                    ", 2] (key, counter), found ", rng.describe());
}
void need_sampling(const SamplingTensors& sp, int64_t R, const char* op) {
  need_dtype(sp.temperature, DType::F32, op, "temperature");
  need_dtype(sp.top_p, DType::F32, op, "top_p");
  need_i32_vec(sp.top_k, R, op, "top_k");
  DFLASH2_CHECK_ARG(sp.temperature.ndim() == 1 && sp.temperature.shape(0) == R && sp.top_p.ndim() == 1 &&
                        sp.top_p.shape(0) == R,
                    op, ": temperature and top_p must be F32 [", R, "], found ", sp.temperature.describe(), " and ",
                    sp.top_p.describe());
  if (sp.temperature.device().is_cpu())
    for (int64_t r = 0; r < R; ++r) {
      const float t = sp.temperature.data_as<const float>()[r * sp.temperature.stride(0)];
      const float p = sp.top_p.data_as<const float>()[r * sp.top_p.stride(0)];
      const int32_t k = sp.top_k.data_as<const int32_t>()[r * sp.top_k.stride(0)];
      DFLASH2_CHECK_ARG(std::isfinite(t) && t >= 0.0f, op, ": temperature[", r, "] must be finite and >= 0, found ", t);
      DFLASH2_CHECK_ARG(p > 0.0f && p <= 1.0f, op, ": top_p[", r, "] must be in (0, 1], found ", p);
      DFLASH2_CHECK_ARG(k >= 0, op, ": top_k[", r, "] must be >= 0, found ", k);
    }
}
}  // namespace

void selector_walk(const Tensor& vals, const Tensor& cand, const Tensor& g, const Tensor& pred_book,
                   const Tensor& succ_book, const Tensor& anchors, const Tensor& temperature, const Tensor& rng,
                   Tensor& tokens, Tensor& q) {
  const char* op = "selector_walk";
  need_3d(vals, DType::F32, op, "vals");
  need_3d(cand, DType::I32, op, "cand");
  need_3d(g, DType::F32, op, "g");
  const int64_t S = vals.shape(0), P = vals.shape(1), K = vals.shape(2), R = g.shape(2);
  need_same_shape(vals, cand, op, "vals", "cand");
  DFLASH2_CHECK_ARG(g.shape(0) == S && g.shape(1) == P, op, ": g must be [", S, ", ", P, ", rank], found ",
                    g.describe());
  for (const Tensor* b : {&pred_book, &succ_book}) {
    need_float_weight(*b, op, "book");
    DFLASH2_CHECK_ARG(b->ndim() == 2 && b->shape(1) == R && b->stride(1) == 1, op, ": codebooks must be [vocab, ", R,
                      "] with contiguous rows, found ", b->describe());
  }
  DFLASH2_CHECK_ARG(pred_book.shape(0) == succ_book.shape(0), op, ": the codebooks have different vocabularies");
  need_i32_vec(anchors, S, op, "anchors");
  need_2d_rows(tokens, DType::I32, op, "tokens");
  DFLASH2_CHECK_ARG(tokens.shape(0) == S && tokens.shape(1) == P, op, ": tokens must be I32 [", S, ", ", P,
                    "], found ", tokens.describe());
  need_dtype(temperature, DType::F32, op, "temperature");
  DFLASH2_CHECK_ARG(temperature.ndim() == 1 && temperature.shape(0) == S, op, ": temperature must be F32 [", S,
                    "], found ", temperature.describe());
  const int64_t V = pred_book.shape(0);
  // On a device the temperatures cannot be read here: a call with rng and q may sample;
  // one with neither is greedy for every sequence (the kernel then takes the best score).
  bool sampled = !temperature.device().is_cpu() && (rng.defined() || q.defined());
  if (cand.device().is_cpu()) {
    for (int64_t s = 0; s < S; ++s) {
      const int64_t a = anchors.data_as<const int32_t>()[s * anchors.stride(0)];
      DFLASH2_CHECK_ARG(a >= 0 && a < V, op, ": anchor ", a, " of sequence ", s, " is outside [0, ", V, ")");
      const float t = temperature.data_as<const float>()[s * temperature.stride(0)];
      DFLASH2_CHECK_ARG(std::isfinite(t) && t >= 0.0f, op, ": temperature[", s, "] must be finite and >= 0, found ", t);
      sampled = sampled || t > 0.0f;
      for (int64_t t2 = 0; t2 < P; ++t2)
        for (int64_t b = 0; b < K; ++b) {
          const int64_t c = cand.data_as<const int32_t>()[s * cand.stride(0) + t2 * cand.stride(1) + b];
          DFLASH2_CHECK_ARG(c >= 0 && c < V, op, ": candidate ", c, " at (", s, ", ", t2, ", ", b,
                            ") is outside [0, ", V, ")");
        }
    }
  }
  if (sampled) {
    need_rng(rng, S, op);
    need_3d(q, DType::F32, op, "q");
    need_same_shape(vals, q, op, "vals", "q");
    same_device(vals, rng, op);
    same_device(vals, q, op);
  }
  for (const Tensor* t : std::initializer_list<const Tensor*>{&cand, &g, &pred_book, &succ_book, &anchors, &tokens,
                                                              &temperature})
    same_device(vals, *t, op);
  DFLASH2_DISPATCH(selector_walk, vals, vals, cand, g, pred_book, succ_book, anchors, temperature, rng, tokens, q);
}

// ------------------------------------------------------------------ sampling and acceptance
void sample(const Tensor& logits, const SamplingTensors& sp, const Tensor& rng, Tensor& out) {
  const char* op = "sample";
  need_2d_rows(logits, DType::F32, op, "logits");
  const int64_t R = logits.shape(0);
  DFLASH2_CHECK_ARG(logits.shape(1) >= 1, op, ": rows must not be empty");
  need_sampling(sp, R, op);
  need_rng(rng, R, op);
  need_i32_vec(out, R, op, "out");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&sp.temperature, &sp.top_p, &sp.top_k, &rng, &out})
    same_device(logits, *t, op);
  DFLASH2_DISPATCH(sample, logits, logits, sp, rng, out);
}

namespace {
// The host-side plan of an acceptance (CPU tensors): each sequence's draft length within [0,
// K], its rows within the M target rows (`rows` names them), its draft row within the
// drafts and, with V >= 0, its drafted tokens within [0, V).
// The per-sequence plan of a verify pass's blocks (accept, accept_greedy, apply_penalties):
// row0 / draft_row / draft_len I32 [S], draft I32 [N, K] with contiguous rows (K may be 0).
// Returns S.
int64_t need_block_plan(const char* op, const Tensor& row0, const Tensor& draft_row, const Tensor& draft_len,
                        const Tensor& draft) {
  need(row0, op, "row0");
  const int64_t S = row0.shape(0);
  need_i32_vec(row0, S, op, "row0");
  need_i32_vec(draft_row, S, op, "draft_row");
  need_i32_vec(draft_len, S, op, "draft_len");
  need_dtype(draft, DType::I32, op, "draft");
  DFLASH2_CHECK_ARG(draft.ndim() == 2 && (draft.stride(1) == 1 || draft.shape(1) <= 1), op,
                    ": draft must be I32 [N, K] with contiguous rows, found ", draft.describe());
  return S;
}
void check_accept_plan(const char* op, const char* rows, const Tensor& row0, const Tensor& draft,
                       const Tensor& draft_row, const Tensor& draft_len, int64_t M, int64_t V) {
  const int64_t S = row0.shape(0), N = draft.shape(0), K = draft.shape(1);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t r0 = row0.data_as<const int32_t>()[s * row0.stride(0)];
    const int64_t L = draft_len.data_as<const int32_t>()[s * draft_len.stride(0)];
    const int64_t dr = draft_row.data_as<const int32_t>()[s * draft_row.stride(0)];
    DFLASH2_CHECK_ARG(L >= 0 && L <= K, op, ": draft_len[", s, "] = ", L, " outside [0, ", K, "]");
    DFLASH2_CHECK_ARG(r0 >= 0 && r0 + L < M, op, ": sequence ", s, " needs ", rows, " rows ", r0, "..", r0 + L, " of ",
                      M);
    DFLASH2_CHECK_ARG(L == 0 || (dr >= 0 && dr < N), op, ": draft_row[", s, "] = ", dr, " outside [0, ", N, ")");
    for (int64_t j = 0; j < L && V >= 0; ++j) {
      const int64_t t = draft.data_as<const int32_t>()[dr * draft.stride(0) + j];
      DFLASH2_CHECK_ARG(t >= 0 && t < V, op, ": drafted token ", t, " of sequence ", s, " is outside [0, ", V, ")");
    }
  }
}
}  // namespace

void accept(const Tensor& logits, const Tensor& row0, const Tensor& draft, const Tensor& draft_row,
            const Tensor& draft_len, const Tensor& cand, const Tensor& q, const SamplingTensors& sp, const Tensor& rng,
            Tensor& accepted, Tensor& bonus) {
  const char* op = "accept";
  need_2d_rows(logits, DType::F32, op, "logits");
  const int64_t S = need_block_plan(op, row0, draft_row, draft_len, draft), M = logits.shape(0), V = logits.shape(1);
  const int64_t N = draft.shape(0), K = draft.shape(1);
  if (q.defined()) {
    need_3d(q, DType::F32, op, "q");
    need_3d(cand, DType::I32, op, "cand");
    need_same_shape(q, cand, op, "q", "cand");
    DFLASH2_CHECK_ARG(q.shape(0) == N && q.shape(1) == K, op, ": q and cand must be [", N, ", ", K, ", C], found ",
                      q.describe());
    same_device(logits, q, op);
    same_device(logits, cand, op);
  }
  need_sampling(sp, S, op);
  need_rng(rng, S, op);
  need_i32_vec(accepted, S, op, "accepted");
  need_i32_vec(bonus, S, op, "bonus");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&row0, &draft, &draft_row, &draft_len, &sp.temperature,
                                                              &sp.top_p, &sp.top_k, &rng, &accepted, &bonus})
    same_device(logits, *t, op);
  if (row0.device().is_cpu()) check_accept_plan(op, "logits", row0, draft, draft_row, draft_len, M, V);
  DFLASH2_DISPATCH(accept, logits, logits, row0, draft, draft_row, draft_len, cand, q, sp, rng, accepted, bonus);
}

void accept_greedy(const Tensor& ids, const Tensor& row0, const Tensor& draft, const Tensor& draft_row,
                   const Tensor& draft_len, Tensor& accepted, Tensor& bonus) {
  const char* op = "accept_greedy";
  need_i32_vec(ids, -1, op, "ids");
  const int64_t S = need_block_plan(op, row0, draft_row, draft_len, draft), M = ids.shape(0);
  need_i32_vec(accepted, S, op, "accepted");
  need_i32_vec(bonus, S, op, "bonus");
  for (const Tensor* t :
       std::initializer_list<const Tensor*>{&row0, &draft, &draft_row, &draft_len, &accepted, &bonus})
    same_device(ids, *t, op);
  if (row0.device().is_cpu()) check_accept_plan(op, "ids", row0, draft, draft_row, draft_len, M, -1);
  DFLASH2_DISPATCH(accept_greedy, ids, ids, row0, draft, draft_row, draft_len, accepted, bonus);
}

void apply_penalties(Tensor& logits, const Tensor& row0, const Tensor& draft, const Tensor& draft_row,
                     const Tensor& draft_len, const Tensor& seq, const Tensor& params, const Tensor& state,
                     const Tensor& bias) {
  const char* op = "apply_penalties";
  need_2d_rows(logits, DType::F32, op, "logits");
  const int64_t S = need_block_plan(op, row0, draft_row, draft_len, draft), M = logits.shape(0), V = logits.shape(1);
  need_2d_rows(seq, DType::I32, op, "seq");
  need_2d_rows(params, DType::F32, op, "params");
  DFLASH2_CHECK_ARG(seq.shape(0) == S && seq.shape(1) == 2 && params.shape(0) == S && params.shape(1) == 3, op,
                    ": seq must be I32 [", S, ", 2] and params F32 [", S, ", 3], found ", seq.describe(), " and ",
                    params.describe());
  need_2d_rows(state, DType::I32, op, "state");
  need_2d_rows(bias, DType::F32, op, "bias");
  DFLASH2_CHECK_ARG(state.shape(1) == V && bias.shape() == state.shape(), op, ": state and bias must be [B, ", V,
                    "] alike (the logits' vocabulary), found ", state.describe(), " and ", bias.describe());
  for (const Tensor* t : std::initializer_list<const Tensor*>{&row0, &draft, &draft_row, &draft_len, &seq, &params,
                                                              &state, &bias})
    same_device(logits, *t, op);
  if (logits.device().is_cpu()) {
    check_accept_plan(op, "logits", row0, draft, draft_row, draft_len, M, V);
    for (int64_t s = 0; s < S; ++s) {
      const int64_t t = seq.data_as<const int32_t>()[s * seq.stride(0)];
      DFLASH2_CHECK_ARG(t < state.shape(0), op, ": seq[", s, "] names table row ", t, " of ", state.shape(0));
      const float* pp = params.data_as<const float>() + s * params.stride(0);
      DFLASH2_CHECK_ARG(t < 0 || (std::isfinite(pp[0]) && std::isfinite(pp[1]) && std::isfinite(pp[2]) && pp[2] > 0),
                        op, ": params[", s, "] = (", pp[0], ", ", pp[1], ", ", pp[2],
                        ") must be finite, the repetition penalty > 0");
    }
  }
  DFLASH2_DISPATCH(apply_penalties, logits, logits, row0, draft, draft_row, draft_len, seq, params, state, bias);
}

void count_tokens(Tensor& state, const Tensor& rows, const Tensor& ids) {
  const char* op = "count_tokens";
  need_2d_rows(state, DType::I32, op, "state");
  need_i32_vec(rows, -1, op, "rows");
  need_i32_vec(ids, rows.shape(0), op, "ids");
  same_device(state, rows, op);
  same_device(state, ids, op);
  if (state.device().is_cpu())
    for (int64_t i = 0; i < rows.shape(0); ++i) {
      const int64_t r = rows.data_as<const int32_t>()[i * rows.stride(0)];
      const int64_t v = ids.data_as<const int32_t>()[i * ids.stride(0)];
      DFLASH2_CHECK_ARG(r < state.shape(0) && (r < 0 || (v >= 0 && v < state.shape(1))), op, ": entry ", i,
                        " (row ", r, ", id ", v, ") is outside the table ", state.describe());
    }
  DFLASH2_DISPATCH(count_tokens, state, state, rows, ids);
}

void mask_logits(Tensor& logits, const Tensor& rows, const Tensor& masks) {
  const char* op = "mask_logits";
  need_2d_rows(logits, DType::F32, op, "logits");
  need_i32_vec(rows, -1, op, "rows");
  need_2d_rows(masks, DType::I32, op, "masks");
  const int64_t M = logits.shape(0), V = logits.shape(1), R = rows.shape(0);
  DFLASH2_CHECK_ARG(masks.shape(0) == R && masks.shape(1) * 32 >= V, op, ": masks must be I32 [", R, ", >= ",
                    (V + 31) / 32, "] (a bit per token of ", V, "), found ", masks.describe());
  same_device(logits, rows, op);
  same_device(logits, masks, op);
  if (logits.device().is_cpu())
    for (int64_t r = 0; r < R; ++r) {
      const int64_t row = rows.data_as<const int32_t>()[r * rows.stride(0)];
      DFLASH2_CHECK_ARG(row < M, op, ": rows[", r, "] = ", row, " is outside the logits' ", M, " rows");
    }
  DFLASH2_DISPATCH(mask_logits, logits, logits, rows, masks);
}

}  // namespace dflash2::ops
