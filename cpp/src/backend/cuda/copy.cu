// cuda/copy.cu: copy (dst = src) on the CUDA backend.
//
// Status: compiled for sm_90a/sm_100a/sm_103a, NOT yet run on a GPU. The index walk
// (layout::collapse / pair_offsets) is unit-tested on the CPU (tests/cpp/test_cuda_layout);
// the kernel is checked against the CPU backend by tests/test_ops.py and
// tests/cpp/test_cuda_backend.cpp when a GPU is present (bench/device_check.sh).
//
// Semantics (ops.h): same shape (0-D to 6-D), any strides on either side (including the
// last dim, negative or zero source strides), same dtype of any element size (1, 2, 4 or 8
// bytes: the bits are moved, NaN payloads included), or BF16 / F16 widened into F32
// (exact). src and dst must not overlap (as on the CPU, an overlapping copy is undefined).
// A 0-D tensor copies its one element.
//
// Plan (host): drop size-1 dims and merge dims that are contiguous in both tensors
// (layout::collapse), so the common cases become 1-2 dims. A same-dtype copy that is one
// contiguous run on both sides is a cudaMemcpyAsync (device to device) on the current
// stream. Everything else is one kernel: each thread takes elements by row-major linear
// index (grid-stride), turns the index into coordinates of the collapsed shape with
// div/mod (32-bit when the element count is below 2^31, else 64-bit) and moves one element
// from src + src_off to dst + dst_off. Consecutive threads take consecutive elements of
// the innermost dim, so a contiguous inner dim gives coalesced accesses.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/cuda_api.h"
#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/layout.h"
#include "dflash2/error.h"

namespace dflash2::cuda {

namespace {

using layout::StridedPair;

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t(1) << 16;  // grid-stride beyond 2^24 threads

template <class TD, class TS>
__device__ __forceinline__ TD convert(TS v) {
  return v;  // same type: the bits
}
template <>
__device__ __forceinline__ float convert<float, __nv_bfloat16>(__nv_bfloat16 v) {
  return detail::to_f32(v);
}
template <>
__device__ __forceinline__ float convert<float, __half>(__half v) {
  return detail::to_f32(v);
}

// n < 2^31 when I is uint32_t (so i + stride cannot wrap: stride <= 2^24).
template <class TS, class TD, class I>
__global__ void __launch_bounds__(kThreads) copy_kernel(const TS* __restrict__ src, TD* __restrict__ dst,
                                                        StridedPair p, I n) {
  detail::pdl_enter();
  const I step = I(gridDim.x) * I(blockDim.x);
  for (I i = I(blockIdx.x) * I(blockDim.x) + I(threadIdx.x); i < n; i += step) {
    int64_t so, dof;
    layout::pair_offsets<I>(p, i, &so, &dof);
    dst[dof] = convert<TD, TS>(src[so]);
  }
}

template <class TS, class TD>
void launch(const void* src, void* dst, const StridedPair& p, int64_t n) {
  const unsigned blocks = detail::ceil_blocks(n, kThreads, kMaxBlocks);
  const TS* s = static_cast<const TS*>(src);
  TD* d = static_cast<TD*>(dst);
  if (n < (int64_t(1) << 31))
    copy_kernel<TS, TD, uint32_t><<<blocks, kThreads, 0, detail::stream()>>>(s, d, p, uint32_t(n));
  else
    copy_kernel<TS, TD, uint64_t><<<blocks, kThreads, 0, detail::stream()>>>(s, d, p, uint64_t(n));
}

}  // namespace

void copy(const Tensor& src, Tensor& dst) {
  DFLASH2_CHECK_ARG(src.defined() && dst.defined(), "cuda::copy: undefined tensor argument");
  DFLASH2_CHECK_ARG(src.device().is_cuda() && dst.device() == src.device(),
                    "cuda::copy: src and dst must be on the same CUDA device, found src ", src.describe(), ", dst ",
                    dst.describe());
  DFLASH2_CHECK_ARG(src.shape() == dst.shape(), "cuda::copy: src ", src.describe(), " and dst ", dst.describe(),
                    " must have the same shape");
  const bool widen = src.dtype() != dst.dtype();
  DFLASH2_CHECK_ARG(!widen || (dst.dtype() == DType::F32 && (src.dtype() == DType::BF16 || src.dtype() == DType::F16)),
                    "cuda::copy: src ", src.describe(), " and dst ", dst.describe(),
                    " must have the same dtype (or BF16/F16 into F32)");
  const int64_t n = src.numel();
  if (n == 0) return;

  const StridedPair p = layout::collapse(src.ndim(), src.shape().data(), src.strides().data(), dst.strides().data());
  detail::DeviceGuard guard(src.device().index);
  if (!widen && layout::is_one_run(p)) {
    DFLASH2_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), size_t(n) * src.itemsize(), cudaMemcpyDeviceToDevice,
                                       detail::stream()),
                       "cuda::copy ", src.describe());
    return;
  }
  if (widen) {
    if (src.dtype() == DType::BF16)
      launch<__nv_bfloat16, float>(src.data(), dst.data(), p, n);
    else
      launch<__half, float>(src.data(), dst.data(), p, n);
  } else {
    switch (src.itemsize()) {
      case 1: launch<uint8_t, uint8_t>(src.data(), dst.data(), p, n); break;
      case 2: launch<uint16_t, uint16_t>(src.data(), dst.data(), p, n); break;
      case 4: launch<uint32_t, uint32_t>(src.data(), dst.data(), p, n); break;
      case 8: launch<uint64_t, uint64_t>(src.data(), dst.data(), p, n); break;
      default:
        fail(ErrorKind::Unsupported, "cuda::copy: elements of ", src.itemsize(), " bytes (", src.describe(),
             ") are not supported");
    }
  }
  detail::check_launch("copy kernel launch", src.describe(), " -> ", dst.describe());
}

}  // namespace dflash2::cuda
