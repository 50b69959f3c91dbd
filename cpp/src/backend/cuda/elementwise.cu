// cuda/elementwise.cu: add, silu_mul and RoPE on the CUDA backend (F32 activations, as
// ops.cpp accepts them).
//
// Status: compiled for sm_90a/sm_100a/sm_103a, NOT yet run on a GPU. The RoPE pair
// mapping and exponent (layout.h) are unit-tested on the CPU; the kernels are checked
// against the CPU backend by tests/test_ops.py and tests/cpp/test_cuda_backend.cpp when
// a GPU is present (bench/device_check.sh).
//
// Numerics: every output element is computed by the CPU backend's fp32 operations in the
// CPU's order (cpu/elementwise.cpp), with the rounding intrinsics (__fadd_rn, __fmul_rn,
// __fdiv_rn) so nvcc cannot contract them into FMAs:
//   add       out = a + b                                     (bitwise equal to the CPU)
//   silu_mul  out = (g / (1 + expf(-g))) * u                  (equal but for expf: CUDA's
//             expf is within 2 ulp, glibc's within 1)
//   rope      inv_freq = 1 / powf(theta, float(2i) / float(D)), angle = float(pos) * inv_freq,
//             x0' = x0 cos - x1 sin, x1' = x1 cos + x0 sin   (cosf/sinf: CUDA's are within
//             2 ulp of the CPU's). inv_freq is computed on the host, by the same libm powf
//             as the CPU backend, and passed to the kernel as a parameter (D <= 512, every
//             RoPE in use): bitwise the CPU's values. Longer rotary dims compute it on the
//             device as float(pow(double, double)), the correctly rounded powf, which is
//             what glibc's powf returns for these exponents (see tests/refs.py rope()).
//
// Layouts:
//   add / silu_mul: [.., D] tensors with contiguous rows, each with its own row stride
//     (layout::row_layout). Grid x covers a row in 16-byte vectors (4 floats) when D, every
//     row stride and every pointer allow it, else single floats; grid y walks the rows
//     (grid-stride past 65535). Each thread reads its inputs and then writes the same
//     element positions of out, so out may be a or b (add: the residual add) or gate / up
//     (silu_mul: gated_mlp writes into gate) -- exactly the same view; a partial overlap
//     is undefined, as on the CPU.
//   rope: in place on x [T, H, D] with any strides (a slice of a wider projection, a
//     strided last dim), positions I32 or I64 [T] with any stride. One thread per
//     (t, h, pair i), i fastest; each thread reads its two elements and writes them back,
//     pairs are disjoint, so no two threads touch the same element (for a view that does
//     not map two indices to one address). Any position value is valid (negative too).
//     rope_many: up to 4 such tensors with one rotary dim and one positions vector in one
//     launch (their pairs' flat indices concatenated); tensors that may share an element
//     (layout::views_disjoint) are rotated one by one instead.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "backend/cuda/cuda_api.h"
#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/layout.h"
#include "dflash2/error.h"

namespace dflash2::cuda {

namespace {

using detail::Vec;

// ------------------------------------------------------------------ add, silu_mul
struct AddOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return __fadd_rn(a, b); }
};
struct SiluMulOp {
  __device__ __forceinline__ float operator()(float g, float u) const {
    return detail::silu_mul(g, u);
  }
};

constexpr int kRowThreads = 256;

// nvec = row length in units of G floats. Requires (host-checked for G > 1): D % G == 0,
// every row stride % G == 0, every pointer aligned to 4 * G bytes.
template <class Op, int G>
__global__ void __launch_bounds__(kRowThreads)
    binary_rows_kernel(const float* a, int64_t a_stride, const float* b, int64_t b_stride, float* out,
                       int64_t out_stride, int64_t rows, int64_t nvec, Op op) {
  detail::pdl_enter();
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= nvec) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const Vec<float, G> va = reinterpret_cast<const Vec<float, G>*>(a + r * a_stride)[j];
    const Vec<float, G> vb = reinterpret_cast<const Vec<float, G>*>(b + r * b_stride)[j];
    Vec<float, G> vo;
#pragma unroll
    for (int k = 0; k < G; ++k) vo.v[k] = op(va.v[k], vb.v[k]);
    reinterpret_cast<Vec<float, G>*>(out + r * out_stride)[j] = vo;
  }
}

template <class Op>
void binary_rows(const char* name, const Tensor& a, const char* an, const Tensor& b, const char* bn, Tensor& out,
                 Op op) {
  DFLASH2_CHECK_ARG(a.defined() && b.defined() && out.defined(), "cuda::", name, ": undefined tensor argument");
  DFLASH2_CHECK_ARG(a.device().is_cuda() && b.device() == a.device() && out.device() == a.device(), "cuda::", name,
                    ": ", an, ", ", bn, " and out must be on the same CUDA device, found ", a.describe(), ", ",
                    b.describe(), ", ", out.describe());
  DFLASH2_CHECK_ARG(a.dtype() == DType::F32 && b.dtype() == DType::F32 && out.dtype() == DType::F32, "cuda::", name,
                    ": ", an, ", ", bn, " and out must be F32, found ", a.describe(), ", ", b.describe(), ", ",
                    out.describe());
  DFLASH2_CHECK_ARG(a.shape() == b.shape() && a.shape() == out.shape(), "cuda::", name, ": ", a.describe(), ", ",
                    b.describe(), " and ", out.describe(), " must have the same shape");
  const layout::RowLayout la = layout::row_layout(a, name, an);
  const layout::RowLayout lb = layout::row_layout(b, name, bn);
  const layout::RowLayout lo = layout::row_layout(out, name, "out");
  layout::check_rows_disjoint(lo, name, "out");
  const int64_t rows = la.rows, D = la.cols;
  if (rows == 0 || D == 0) return;

  const float* ap = a.data_as<const float>();
  const float* bp = b.data_as<const float>();
  float* op_ = out.data_as<float>();
  detail::DeviceGuard guard(a.device().index);
  const bool vec = D % 4 == 0 && la.stride % 4 == 0 && lb.stride % 4 == 0 && lo.stride % 4 == 0 &&
                   detail::aligned(ap, 16) && detail::aligned(bp, 16) && detail::aligned(op_, 16);
  const int64_t nvec = vec ? D / 4 : D;
  const int threads = detail::pick_threads(nvec, kRowThreads);
  const dim3 grid(detail::ceil_blocks(nvec, threads, int64_t(INT32_MAX)),
                  unsigned(rows < detail::kMaxGridY ? rows : detail::kMaxGridY));
  if (vec)
    binary_rows_kernel<Op, 4><<<grid, threads, 0, detail::stream()>>>(ap, la.stride, bp, lb.stride, op_, lo.stride,
                                                                      rows, nvec, op);
  else
    binary_rows_kernel<Op, 1><<<grid, threads, 0, detail::stream()>>>(ap, la.stride, bp, lb.stride, op_, lo.stride,
                                                                      rows, nvec, op);
  detail::check_launch(name, " kernel launch ", a.describe());
}

// ------------------------------------------------------------------ rope
constexpr int kRopeTable = 256;  // pairs whose inv_freq comes from the host (D <= 512)
constexpr int kRopeThreads = 256;
constexpr int64_t kRopeMaxBlocks = int64_t(1) << 16;

struct RopeFreqs {
  float inv_freq[kRopeTable];
};

// The tensors of one launch (rope: one; rope_many: up to kRopeMany with one rotary dim):
// tensor k owns the flat indices [k ? end[k - 1] : 0, end[k]) of T * H_k * half pairs each.
constexpr int kRopeMany = 4;
struct RopeTarget {
  float* x;
  int64_t st, sh, sd, H, end;
};
struct RopeTargets {
  RopeTarget t[kRopeMany];
  int n;
};

template <class P>
__global__ void __launch_bounds__(kRopeThreads)
    rope_kernel(const __grid_constant__ RopeTargets tg, const P* __restrict__ pos, int64_t pos_stride,
                int64_t half, int64_t D, bool interleaved, bool use_table, float ftheta,
                const __grid_constant__ RopeFreqs freqs) {
  detail::pdl_enter();
  const int64_t total = tg.t[tg.n - 1].end;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t flat = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; flat < total; flat += step) {
    int k = 0;
    while (flat >= tg.t[k].end) ++k;  // k < n: flat < total = end[n - 1]
    const RopeTarget& x = tg.t[k];
    const int64_t idx = flat - (k ? tg.t[k - 1].end : 0);
    const int64_t i = idx % half;
    const int64_t th = idx / half;
    const int64_t h = th % x.H;
    const int64_t t = th / x.H;
    float inv_freq;
    if (use_table) {
      inv_freq = freqs.inv_freq[i];
    } else {
      const float p = float(pow(double(ftheta), double(layout::rope_exponent(i, D))));
      inv_freq = __fdiv_rn(1.0f, p);
    }
    const int64_t position = int64_t(pos[t * pos_stride]);
    const float ang = __fmul_rn(float(position), inv_freq);
    const float c = cosf(ang), s = sinf(ang);
    const layout::RopePair pr = layout::rope_pair(interleaved, i, half);
    float* p = x.x + t * x.st + h * x.sh;
    const float x0 = p[pr.a * x.sd], x1 = p[pr.b * x.sd];
    p[pr.a * x.sd] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    p[pr.b * x.sd] = __fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, s));
  }
}

void check_rope_args(const Tensor& x, const Tensor& positions, double theta, const char* op) {
  DFLASH2_CHECK_ARG(x.defined() && positions.defined(), "cuda::", op, ": undefined tensor argument");
  DFLASH2_CHECK_ARG(x.device().is_cuda() && positions.device() == x.device(), "cuda::", op,
                    ": x and positions must be on the same CUDA device, found ", x.describe(), " and ",
                    positions.describe());
  DFLASH2_CHECK_ARG(x.dtype() == DType::F32 && x.ndim() == 3, "cuda::", op,
                    ": x must be F32 [tokens, heads, dim], found ", x.describe());
  DFLASH2_CHECK_ARG(positions.dtype() == DType::I32 || positions.dtype() == DType::I64, "cuda::", op,
                    ": positions must be I32 or I64, found ", positions.describe());
  const int64_t T = x.shape(0);
  DFLASH2_CHECK_ARG(positions.ndim() == 1 && positions.shape(0) == T, "cuda::", op, ": positions must be [", T,
                    "], found ", positions.describe());
  DFLASH2_CHECK_ARG(x.shape(2) % 2 == 0, "cuda::", op, ": the rotary dim must be even, found ", x.shape(2));
  DFLASH2_CHECK_ARG(theta > 0, "cuda::", op, ": theta must be > 0, found ", theta);
}

// One launch over xs (1 .. kRopeMany checked tensors with one rotary dim D); empty ones skipped.
void launch_rope(const std::vector<Tensor*>& xs, int64_t D, const Tensor& positions, double theta,
                 ops::RopeStyle style) {
  const int64_t half = D / 2;
  RopeTargets tg{};
  int64_t total = 0;
  for (Tensor* x : xs) {
    const int64_t pairs = x->shape(0) * x->shape(1) * half;
    if (pairs == 0) continue;
    DFLASH2_CHECK_ARG(pairs <= INT64_MAX - total, "cuda::rope: too many elements");
    total += pairs;
    tg.t[tg.n++] = RopeTarget{x->data_as<float>(), x->stride(0), x->stride(1), x->stride(2), x->shape(1), total};
  }
  if (tg.n == 0) return;

  // inv_freq as the CPU backend computes it (same expression, same host libm)
  const float ftheta = float(theta);
  RopeFreqs freqs{};
  const bool use_table = half <= kRopeTable;
  if (use_table)
    for (int64_t i = 0; i < half; ++i) freqs.inv_freq[i] = 1.0f / std::pow(ftheta, layout::rope_exponent(i, D));

  const bool interleaved = style == ops::RopeStyle::Interleaved;
  const unsigned blocks = detail::ceil_blocks(total, kRopeThreads, kRopeMaxBlocks);
  detail::DeviceGuard guard(positions.device().index);
  if (positions.dtype() == DType::I64)
    rope_kernel<int64_t><<<blocks, kRopeThreads, 0, detail::stream()>>>(
        tg, positions.data_as<const int64_t>(), positions.stride(0), half, D, interleaved, use_table, ftheta, freqs);
  else
    rope_kernel<int32_t><<<blocks, kRopeThreads, 0, detail::stream()>>>(
        tg, positions.data_as<const int32_t>(), positions.stride(0), half, D, interleaved, use_table, ftheta, freqs);
  detail::check_launch("rope kernel launch", xs[0]->describe());
}

}  // namespace

void add(const Tensor& a, const Tensor& b, Tensor& out) { binary_rows("add", a, "a", b, "b", out, AddOp{}); }

void silu_mul(const Tensor& gate, const Tensor& up, Tensor& out) {
  binary_rows("silu_mul", gate, "gate", up, "up", out, SiluMulOp{});
}

void rope(Tensor& x, const Tensor& positions, double theta, ops::RopeStyle style) {
  check_rope_args(x, positions, theta, "rope");
  launch_rope({&x}, x.shape(2), positions, theta, style);
}

void rope_many(const std::vector<Tensor*>& xs, const Tensor& positions, double theta, ops::RopeStyle style,
               bool& done) {
  done = false;
  // one kernel for up to kRopeMany tensors of one rotary dim (else ops::rope_many runs rope on each)
  if (xs.empty() || xs.size() > size_t(kRopeMany)) return;
  for (Tensor* x : xs) {
    DFLASH2_CHECK_ARG(x != nullptr, "cuda::rope_many: null tensor");
    check_rope_args(*x, positions, theta, "rope_many");
    if (x->shape(2) != xs[0]->shape(2)) return;
  }
  for (size_t i = 0; i < xs.size(); ++i)  // rotated in any order: only views that share no element
    for (size_t j = 0; j < i; ++j)
      if (!layout::views_disjoint(*xs[i], *xs[j])) return;
  launch_rope(xs, xs[0]->shape(2), positions, theta, style);
  done = true;
}

}  // namespace dflash2::cuda
