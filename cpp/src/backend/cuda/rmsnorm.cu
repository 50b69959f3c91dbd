// cuda/rmsnorm.cu: RMSNorm on the CUDA backend.
//
//   out[r, :] = w * (x[r, :] * inv_r),   inv_r = 1 / sqrt(sum_i(x[r, i]^2) / D + eps)
//
// everything in fp32 (x and w are converted to fp32 first, the result is rounded once to
// the dtype of out, round-to-nearest-even), the same formula and order of operations as the
// CPU backend (cpu/elementwise.cpp).
//
// Accepted dtypes: x F32 | BF16, out F32 | BF16 (independently), w F32 | BF16 | F16.
// Shapes: x, out [.., D] with contiguous rows; the leading dims must collapse into evenly
// strided rows (row strides may differ between x and out, e.g. a slice of a wider buffer);
// w [D] contiguous; out may be x itself (in place). Any D >= 1 (odd sizes included) up to
// INT32_MAX - 1024, any number of rows.
//
// One thread block per row (grid-strided when there are more rows than blocks): pass 1
// accumulates sum(x^2) per thread, reduced with warp shuffles and then across warps in
// shared memory; pass 2 re-reads the row (it is hot in L1/L2) and writes the output. When
// every pointer, D and the row strides allow it, rows are read and written with 16-byte
// vector accesses (4 x F32 or 8 x BF16); otherwise element by element.
//
// The block size depends only on D, so a row's reduction order, and therefore its result,
// does not depend on how many rows are normalised together (decode == verify).
//
// The kernel runs on the calling thread's stream (current_stream(), cuda_api.h) and is not
// synchronized; a failed launch is an error at once (detail::check_launch). (The stream
// and check_launch changes are compiled, not yet run on a GPU.)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/cuda_api.h"
#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/layout.h"
#include "dflash2/error.h"

namespace dflash2::cuda {

namespace {

constexpr int kMaxThreads = 1024;
constexpr int64_t kMaxBlocks = int64_t(1) << 20;

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

template <class T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// G consecutive elements, loaded / stored as one aligned access.
template <class T, int G>
struct alignas(sizeof(T) * G) Vec {
  T v[G];
};

// Sum over the block; the result is returned to every thread. `scratch` holds 33 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = (blockDim.x + 31) >> 5;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = lane < nwarps ? scratch[lane] : 0.0f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) scratch[32] = s;
  }
  __syncthreads();
  const float total = scratch[32];
  __syncthreads();  // scratch is reused by the next row
  return total;
}

// One row: thread t < threads takes vector indices t, t + threads, ...; threads past `threads`
// (rms_norm_many's block is the largest of its items') add zeros to the block sum and write
// nothing, so the row's sum, and its output, are bitwise those of a block of `threads`: the
// extra warps' totals are +0 (sums of squares are never -0) and warp 0 reads 0 for them as it
// does for lanes past a smaller block's warps.
template <class TX, class TW, class TO, int G>
__device__ __forceinline__ void norm_row(const TX* xrow, const TW* w, TO* outrow, int D, float eps, int threads,
                                         float* scratch) {
  const int nvec = D / G;
  const Vec<TX, G>* xr = reinterpret_cast<const Vec<TX, G>*>(xrow);
  Vec<TO, G>* orow = reinterpret_cast<Vec<TO, G>*>(outrow);
  const Vec<TW, G>* wv = reinterpret_cast<const Vec<TW, G>*>(w);
  const int t = int(threadIdx.x);
  const bool active = t < threads;

  float ss = 0.0f;
  if (active) {
    for (int i = t; i < nvec; i += threads) {
      const Vec<TX, G> xv = xr[i];
#pragma unroll
      for (int j = 0; j < G; ++j) {
        const float f = to_f32(xv.v[j]);
        ss = fmaf(f, f, ss);
      }
    }
  }
  const float total = block_sum(ss, scratch);
  const float inv = 1.0f / sqrtf(total / float(D) + eps);  // IEEE div/sqrt (no fast-math)
  if (!active) return;
  for (int i = t; i < nvec; i += threads) {
    const Vec<TX, G> xv = xr[i];
    const Vec<TW, G> wg = wv[i];
    Vec<TO, G> o;
#pragma unroll
    for (int j = 0; j < G; ++j) o.v[j] = from_f32<TO>(to_f32(wg.v[j]) * (to_f32(xv.v[j]) * inv));
    orow[i] = o;
  }
}

// G elements per access (G == 1: scalar path). Requires D % G == 0, row strides % G == 0 and
// pointers aligned to sizeof(Vec<T, G>) for each tensor (checked on the host).
template <class TX, class TW, class TO, int G>
__global__ void __launch_bounds__(kMaxThreads)
    rms_norm_kernel(const TX* x, int64_t x_stride, const TW* __restrict__ w, TO* out,
                    int64_t out_stride, int64_t rows, int D, float eps) {
  detail::pdl_enter();
  __shared__ float scratch[33];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x)
    norm_row<TX, TW, TO, G>(x + r * x_stride, w, out + r * out_stride, D, eps, int(blockDim.x), scratch);
}

// rms_norm_many: up to kNormMany (x, w, out) of one dtype triple and access width in one
// launch; item i owns blocks [i ? end[i - 1] : 0, end[i]) (one row each), with its own
// rms_norm launch's thread count (`threads`).
constexpr int kNormMany = 4;
struct NormItem {
  const void* x;
  const void* w;
  void* out;
  int64_t x_stride, out_stride;
  int D, threads;
  float eps;
};
struct NormMany {
  NormItem it[kNormMany];
  int64_t end[kNormMany];
};

template <class TX, class TW, class TO, int G>
__global__ void __launch_bounds__(kMaxThreads) rms_norm_many_kernel(const __grid_constant__ NormMany p) {
  detail::pdl_enter();
  __shared__ float scratch[33];
  int i = 0;
  while (int64_t(blockIdx.x) >= p.end[i]) ++i;  // grid x = the last item's end
  const NormItem& a = p.it[i];
  const int64_t r = int64_t(blockIdx.x) - (i ? p.end[i - 1] : 0);
  norm_row<TX, TW, TO, G>(static_cast<const TX*>(a.x) + r * a.x_stride, static_cast<const TW*>(a.w),
                          static_cast<TO*>(a.out) + r * a.out_stride, a.D, a.eps, a.threads, scratch);
}

using layout::RowLayout;

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

int pick_threads(int64_t work_items) {
  int64_t t = (work_items + 31) / 32 * 32;
  if (t < 32) t = 32;
  if (t > kMaxThreads) t = kMaxThreads;
  return int(t);
}

// The access width rms_norm's launch takes for these tensors (1: element by element).
int vector_width(const Tensor& x, const RowLayout& xl, const Tensor& w, const Tensor& out, const RowLayout& ol) {
  const int G = (x.itemsize() == 2 && out.itemsize() == 2) ? 8 : 4;
  const int64_t D = x.shape(-1);
  const bool vec = D % G == 0 && xl.stride % G == 0 && ol.stride % G == 0 && aligned(x.data(), x.itemsize() * G) &&
                   aligned(w.data(), w.itemsize() * G) && aligned(out.data(), out.itemsize() * G);
  return vec ? G : 1;
}

template <class TX, class TW, class TO>
void launch(const Tensor& x, const RowLayout& xl, const Tensor& w, Tensor& out, const RowLayout& ol, int D,
            float eps) {
  constexpr int G = (sizeof(TX) == 2 && sizeof(TO) == 2) ? 8 : 4;
  const TX* xp = x.data_as<const TX>();
  const TW* wp = w.data_as<const TW>();
  TO* op = out.data_as<TO>();
  const int64_t rows = xl.rows;
  const unsigned blocks = unsigned(rows < kMaxBlocks ? rows : kMaxBlocks);
  if (vector_width(x, xl, w, out, ol) == G) {
    rms_norm_kernel<TX, TW, TO, G>
        <<<blocks, pick_threads(D / G), 0, current_stream()>>>(xp, xl.stride, wp, op, ol.stride, rows, D, eps);
  } else {
    rms_norm_kernel<TX, TW, TO, 1>
        <<<blocks, pick_threads(D), 0, current_stream()>>>(xp, xl.stride, wp, op, ol.stride, rows, D, eps);
  }
}

template <class TX, class TO>
void dispatch_w(const Tensor& x, const RowLayout& xl, const Tensor& w, Tensor& out, const RowLayout& ol, int D,
                float eps) {
  switch (w.dtype()) {
    case DType::F32: return launch<TX, float, TO>(x, xl, w, out, ol, D, eps);
    case DType::BF16: return launch<TX, __nv_bfloat16, TO>(x, xl, w, out, ol, D, eps);
    case DType::F16: return launch<TX, __half, TO>(x, xl, w, out, ol, D, eps);
    default: break;
  }
  fail(ErrorKind::InvalidArgument, "cuda::rms_norm: w must be F32, BF16 or F16, found ", w.describe());
}

template <class TX>
void dispatch_out(const Tensor& x, const RowLayout& xl, const Tensor& w, Tensor& out, const RowLayout& ol, int D,
                  float eps) {
  if (out.dtype() == DType::F32) return dispatch_w<TX, float>(x, xl, w, out, ol, D, eps);
  return dispatch_w<TX, __nv_bfloat16>(x, xl, w, out, ol, D, eps);
}

}  // namespace

namespace {
// rms_norm's checks (ops.cpp validates; these keep direct callers -- tests, fused paths -- safe);
// the row layouts of x and out.
void check_args(const Tensor& x, const Tensor& w, float eps, const Tensor& out, RowLayout& xl, RowLayout& ol) {
  DFLASH2_CHECK_ARG(x.defined() && w.defined() && out.defined(), "cuda::rms_norm: undefined tensor argument");
  DFLASH2_CHECK_ARG(x.device().is_cuda() && out.device() == x.device() && w.device() == x.device(),
                    "cuda::rms_norm: x, w and out must be on the same CUDA device, found x ", x.describe(), ", w ",
                    w.describe(), ", out ", out.describe());
  DFLASH2_CHECK_ARG(x.dtype() == DType::F32 || x.dtype() == DType::BF16,
                    "cuda::rms_norm: x must be F32 or BF16, found ", x.describe());
  DFLASH2_CHECK_ARG(out.dtype() == DType::F32 || out.dtype() == DType::BF16,
                    "cuda::rms_norm: out must be F32 or BF16, found ", out.describe());
  DFLASH2_CHECK_ARG(w.dtype() == DType::F32 || w.dtype() == DType::BF16 || w.dtype() == DType::F16,
                    "cuda::rms_norm: w must be F32, BF16 or F16, found ", w.describe());
  DFLASH2_CHECK_ARG(x.ndim() >= 1 && x.shape() == out.shape(), "cuda::rms_norm: x ", x.describe(), " and out ",
                    out.describe(), " must have the same shape (at least 1-D)");
  const int64_t D = x.shape(-1);
  DFLASH2_CHECK_ARG(w.ndim() == 1 && w.shape(0) == D && w.is_contiguous(), "cuda::rms_norm: w must be [", D,
                    "] contiguous, found ", w.describe());
  // the kernels' int loops step by up to 1024 threads past the row's end: no signed overflow
  DFLASH2_CHECK_ARG(D <= int64_t(INT32_MAX) - 1024, "cuda::rms_norm: rows of ", D, " elements are too long");
  DFLASH2_CHECK_ARG(eps >= 0, "cuda::rms_norm: eps must be >= 0, found ", eps);
  xl = layout::row_layout(x, "rms_norm", "x");
  ol = layout::row_layout(out, "rms_norm", "out");
  DFLASH2_CHECK_ARG(xl.rows <= 1 || D == 0 || ol.stride >= D, "cuda::rms_norm: rows of out ", out.describe(),
                    " overlap (row stride ", ol.stride, " < ", D, ")");
}

template <class TX, class TW, class TO>
void launch_many(NormMany& p, unsigned blocks, int threads, int G) {
  if (G == 1)
    rms_norm_many_kernel<TX, TW, TO, 1><<<blocks, threads, 0, current_stream()>>>(p);
  else if constexpr (sizeof(TX) == 2 && sizeof(TO) == 2)
    rms_norm_many_kernel<TX, TW, TO, 8><<<blocks, threads, 0, current_stream()>>>(p);
  else
    rms_norm_many_kernel<TX, TW, TO, 4><<<blocks, threads, 0, current_stream()>>>(p);
}

template <class TX, class TO>
void many_w(NormMany& p, DType wt, unsigned blocks, int threads, int G) {
  if (wt == DType::F32) return launch_many<TX, float, TO>(p, blocks, threads, G);
  if (wt == DType::BF16) return launch_many<TX, __nv_bfloat16, TO>(p, blocks, threads, G);
  return launch_many<TX, __half, TO>(p, blocks, threads, G);
}
}  // namespace

void rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out) {
  RowLayout xl, ol;
  check_args(x, w, eps, out, xl, ol);
  const int64_t D = x.shape(-1);
  if (xl.rows == 0 || D == 0) return;

  detail::DeviceGuard guard(x.device().index);
  if (x.dtype() == DType::F32)
    dispatch_out<float>(x, xl, w, out, ol, int(D), eps);
  else
    dispatch_out<__nv_bfloat16>(x, xl, w, out, ol, int(D), eps);

  detail::check_launch("rms_norm kernel launch", x.describe());
}

void rms_norm_many(const std::vector<const Tensor*>& xs, const std::vector<const Tensor*>& ws,
                   const std::vector<float>& eps, const std::vector<Tensor*>& outs, bool& done) {
  done = false;
  const size_t n = xs.size();
  DFLASH2_CHECK_ARG(ws.size() == n && eps.size() == n && outs.size() == n, "cuda::rms_norm_many: ", n, " inputs, ",
                    ws.size(), " weights, ", eps.size(), " eps and ", outs.size(), " outputs");
  if (n < 2 || n > size_t(kNormMany)) return;  // ops::rms_norm_many: one by one
  NormMany p{};
  int64_t blocks = 0;
  int threads = 32, G = 0;
  for (size_t i = 0; i < n; ++i) {
    DFLASH2_CHECK_ARG(xs[i] && ws[i] && outs[i], "cuda::rms_norm_many: null tensor ", i);
    const Tensor &x = *xs[i], &w = *ws[i], &out = *outs[i];
    RowLayout xl, ol;
    check_args(x, w, eps[i], out, xl, ol);
    const int64_t D = x.shape(-1);
    if (xl.rows == 0 || D == 0) return;
    // one kernel instantiation: the dtypes, device and access width of the first item
    const Tensor& x0 = *xs[0];
    if (x.dtype() != x0.dtype() || w.dtype() != ws[0]->dtype() || out.dtype() != outs[0]->dtype() ||
        x.device() != x0.device())
      return;
    const int g = vector_width(x, xl, w, out, ol);
    if (G != 0 && g != G) return;
    G = g;
    // blocks of different items run at once: an output shares no element with another's x or out
    for (size_t j = 0; j < n; ++j)
      if (j != i && !(layout::views_disjoint(out, *xs[j]) && (j > i || layout::views_disjoint(out, *outs[j]))))
        return;
    NormItem& it = p.it[i];
    it.x = x.data();
    it.w = w.data();
    it.out = out.data();
    it.x_stride = xl.stride;
    it.out_stride = ol.stride;
    it.D = int(D);
    it.eps = eps[i];
    it.threads = pick_threads(D / G);
    threads = it.threads > threads ? it.threads : threads;
    blocks += xl.rows;
    p.end[i] = blocks;
  }
  if (blocks > kMaxBlocks) return;
  for (size_t i = n; i < size_t(kNormMany); ++i) p.end[i] = blocks;
  const Tensor &x0 = *xs[0], &o0 = *outs[0];
  detail::DeviceGuard guard(x0.device().index);
  const unsigned nb = unsigned(blocks);
  const DType wt = ws[0]->dtype();
  if (x0.dtype() == DType::F32) {
    if (o0.dtype() == DType::F32)
      many_w<float, float>(p, wt, nb, threads, G);
    else
      many_w<float, __nv_bfloat16>(p, wt, nb, threads, G);
  } else {
    if (o0.dtype() == DType::F32)
      many_w<__nv_bfloat16, float>(p, wt, nb, threads, G);
    else
      many_w<__nv_bfloat16, __nv_bfloat16>(p, wt, nb, threads, G);
  }
  detail::check_launch("rms_norm_many kernel launch", x0.describe());
  done = true;
}

}  // namespace dflash2::cuda
