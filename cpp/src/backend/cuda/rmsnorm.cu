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

// G elements per access (G == 1: scalar path). Requires D % G == 0, row strides % G == 0 and
// pointers aligned to sizeof(Vec<T, G>) for each tensor (checked on the host).
template <class TX, class TW, class TO, int G>
__global__ void __launch_bounds__(kMaxThreads)
    rms_norm_kernel(const TX* x, int64_t x_stride, const TW* __restrict__ w, TO* out,
                    int64_t out_stride, int64_t rows, int D, float eps) {
  __shared__ float scratch[33];
  const int nvec = D / G;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const Vec<TX, G>* xr = reinterpret_cast<const Vec<TX, G>*>(x + r * x_stride);
    Vec<TO, G>* orow = reinterpret_cast<Vec<TO, G>*>(out + r * out_stride);
    const Vec<TW, G>* wv = reinterpret_cast<const Vec<TW, G>*>(w);

    float ss = 0.0f;
    for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
      const Vec<TX, G> xv = xr[i];
#pragma unroll
      for (int j = 0; j < G; ++j) {
        const float f = to_f32(xv.v[j]);
        ss = fmaf(f, f, ss);
      }
    }
    const float total = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(total / float(D) + eps);  // IEEE div/sqrt (no fast-math)

    for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
      const Vec<TX, G> xv = xr[i];
      const Vec<TW, G> wg = wv[i];
      Vec<TO, G> o;
#pragma unroll
      for (int j = 0; j < G; ++j) o.v[j] = from_f32<TO>(to_f32(wg.v[j]) * (to_f32(xv.v[j]) * inv));
      orow[i] = o;
    }
  }
}

using layout::RowLayout;

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

int pick_threads(int64_t work_items) {
  int64_t t = (work_items + 31) / 32 * 32;
  if (t < 32) t = 32;
  if (t > kMaxThreads) t = kMaxThreads;
  return int(t);
}

template <class TX, class TW, class TO>
void launch(const Tensor& x, const RowLayout& xl, const Tensor& w, Tensor& out, const RowLayout& ol, int D,
            float eps) {
  constexpr int G = (sizeof(TX) == 2 && sizeof(TO) == 2) ? 8 : 4;
  const TX* xp = x.data_as<const TX>();
  const TW* wp = w.data_as<const TW>();
  TO* op = out.data_as<TO>();
  const bool vec = D % G == 0 && xl.stride % G == 0 && ol.stride % G == 0 && aligned(xp, sizeof(Vec<TX, G>)) &&
                   aligned(wp, sizeof(Vec<TW, G>)) && aligned(op, sizeof(Vec<TO, G>));
  const int64_t rows = xl.rows;
  const unsigned blocks = unsigned(rows < kMaxBlocks ? rows : kMaxBlocks);
  if (vec) {
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

void rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out) {
  // ops.cpp validates; these checks keep direct callers (tests, future fused paths) safe.
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
  const RowLayout xl = layout::row_layout(x, "rms_norm", "x");
  const RowLayout ol = layout::row_layout(out, "rms_norm", "out");
  if (xl.rows == 0 || D == 0) return;
  DFLASH2_CHECK_ARG(xl.rows == 1 || ol.stride >= D, "cuda::rms_norm: rows of out ", out.describe(),
                    " overlap (row stride ", ol.stride, " < ", D, ")");

  detail::DeviceGuard guard(x.device().index);
  if (x.dtype() == DType::F32)
    dispatch_out<float>(x, xl, w, out, ol, int(D), eps);
  else
    dispatch_out<__nv_bfloat16>(x, xl, w, out, ol, int(D), eps);

  detail::check_launch("rms_norm kernel launch", x.describe());
}

}  // namespace dflash2::cuda
