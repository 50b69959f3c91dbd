// cuda/quant.cu: the activation quantization of quant.h, and ops::fp8_quantize_act (its
// dequantized form, bitwise equal to the CPU backend's: the same IEEE fp32 division, the
// hardware's round-to-nearest-even saturating E4M3 conversion, one fp32 multiply).
//
// One warp per (row, 128-input block): each lane holds 4 inputs; the block's amax is a
// warp max, and a non-finite input anywhere in the block (__any_sync) makes it NaN. x and
// deq may be the same rows (the ops run in place), so neither is __restrict__.
//
// Status: compiled for sm_90a / sm_100a / sm_103a, NOT yet run on a GPU.
#include <cuda_fp16.h>
#include <cuda_fp4.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/cuda_api.h"
#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/layout.h"
#include "backend/cuda/quant.h"
#include "backend/cuda/quant_device.cuh"
#include "dflash2/error.h"

namespace dflash2::cuda {

namespace detail {
namespace {

constexpr int kWarps = 8;  // warps per thread block

// E2M1 nibble -> f32, exact: exponent field e = bits 2..1, mantissa bit 0 (e > 0: 2^(e-1)
// (1 + m/2); e = 0: m/2), sign bit 3.
__device__ __forceinline__ float e2m1_value(uint32_t nib) {
  const uint32_t e = (nib >> 1) & 3u, mb = nib & 1u;
  uint32_t bits = e ? (((e + 126u) << 23) | (mb << 22)) : (mb ? 0x3f000000u : 0u);
  bits |= (nib & 8u) << 28;
  return __uint_as_float(bits);
}

__global__ void __launch_bounds__(kWarps * 32)
    fp8_quant_rows_kernel(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t Mp, int64_t Kp,
                          int64_t nb, uint8_t* __restrict__ codes, float* __restrict__ sf, float* deq,
                          int64_t ldd) {
  detail::pdl_enter();
  const int lane = threadIdx.x & 31;
  const int64_t units = Mp * nb;
  for (int64_t u = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5); u < units; u += int64_t(gridDim.x) * kWarps) {
    const int64_t m = u / nb, b = u - m * nb, k0 = b * 128;
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t k = k0 + lane + 32 * j;
      v[j] = (m < M && k < K) ? x[m * ldx + k] : 0.0f;
    }
    uint8_t q[4];
    const float sa = fp8_warp_block(v, q);
    const bool bad = !(sa == sa);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t k = k0 + lane + 32 * j;
      if (codes && k < Kp) codes[m * Kp + k] = m < M ? q[j] : uint8_t(0);
      if (deq && m < M && k < K) deq[m * ldd + k] = bad ? sa : __fmul_rn(e4m3_value(q[j]), sa);
    }
    if (sf && lane == 0) sf[layout::fp8_act_scale_offset(m, b, Mp)] = m < M ? sa : 0.0f;
  }
}

// One 16-input block of a row (src[k0 .. k0 + 15], zeros at k >= K) with g = 1 / input_scale:
// its 8 packed code bytes and its E4M3 scale byte (0x7f, E4M3's NaN -- never a saturated
// scale, which is 0x7e -- for a non-finite block, whose codes are 0).
__device__ __forceinline__ uint8_t nvfp4_block(const float* src, int64_t k0, int64_t K, float g, uint8_t (&packed)[8]) {
  const float sixth = 1.0f / 6.0f;
  float v[16];
  float amax = 0.0f;
  bool bad = false;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    v[i] = k0 + i < K ? src[k0 + i] : 0.0f;
    const float a = fabsf(v[i]);
    bad = bad || !(a <= 3.4028235e38f);
    amax = a > amax ? a : amax;
  }
  uint8_t sbyte = 0x7f;
  float sfv = 0.0f, inv = 0.0f;
  if (!bad) {
    sbyte = static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fmul_rn(g, __fmul_rn(amax, sixth)), __NV_SATFINITE, __NV_E4M3));
    sfv = e4m3_value(sbyte);
    if (sfv != 0.0f) inv = __fdiv_rn(1.0f, __fdiv_rn(sfv, g));
  }
#pragma unroll
  for (int i = 0; i < 16; i += 2) {
    uint32_t lo = 0, hi = 0;
    if (!bad && sfv != 0.0f) {
      lo = uint32_t(__nv_cvt_float_to_fp4(__fmul_rn(v[i], inv), __NV_E2M1, cudaRoundNearest)) & 15u;
      hi = uint32_t(__nv_cvt_float_to_fp4(__fmul_rn(v[i + 1], inv), __NV_E2M1, cudaRoundNearest)) & 15u;
    }
    packed[i / 2] = uint8_t(lo | (hi << 4));
  }
  return sbyte;
}

// One thread per (row, 16-input block).
__global__ void nvfp4_quant_rows_kernel(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t Kp,
                                        float input_scale, float g, uint8_t* __restrict__ codes,
                                        uint8_t* __restrict__ sf, float* deq, int64_t ldd) {
  detail::pdl_enter();
  const int64_t nbk = Kp / 16, units = M * nbk, sf_cols = layout::nvfp4_sf_cols(Kp);
  for (int64_t u = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < units; u += int64_t(gridDim.x) * blockDim.x) {
    const int64_t m = u / nbk, j = u - m * nbk, k0 = j * 16;
    uint8_t packed[8];
    const uint8_t sbyte = nvfp4_block(x + m * ldx, k0, K, g, packed);
    if (deq) {
      const bool bad = sbyte == 0x7f;
      const float sfv = e4m3_value(sbyte);
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const uint32_t nib = (packed[i / 2] >> (4 * (i & 1))) & 15u;
        if (k0 + i < K)
          deq[m * ldd + k0 + i] =
              bad ? __int_as_float(0x7fc00000) : __fmul_rn(__fmul_rn(e2m1_value(nib), sfv), input_scale);
      }
    }
    if (codes) {
      uint8_t* row = codes + m * (Kp / 2) + k0 / 2;
#pragma unroll
      for (int i = 0; i < 8; ++i) row[i] = packed[i];
    }
    if (sf) sf[layout::nvfp4_sf_offset(m, j, sf_cols)] = k0 < K ? sbyte : uint8_t(0);
  }
}

// The grouped rows (nvfp4_quantize_grouped_rows in quant.h), one thread per (row, block).
template <bool gathered>
__global__ void nvfp4_quant_grouped_kernel(const float* __restrict__ x, const float* __restrict__ u, int64_t ldx,
                                           const int32_t* __restrict__ order, int div,
                                           const int32_t* __restrict__ start, int E,
                                           const int64_t* __restrict__ sf_off, const float* __restrict__ scales,
                                           int64_t rows, int64_t K, uint8_t* __restrict__ codes,
                                           uint8_t* __restrict__ sf) {
  detail::pdl_enter();
  const int64_t nbk = K / 16, units = rows * nbk, sf_cols = layout::nvfp4_sf_cols(K), used = start[E];
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < units; t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t p = t / nbk, j = t - p * nbk, k0 = j * 16;
    if (p >= used) continue;
    const int lo = layout::group_of(start, E, p);  // the group holding p
    const float g = __fdiv_rn(1.0f, scales[lo]);
    uint8_t packed[8];
    uint8_t sbyte;
    if constexpr (gathered) {
      sbyte = nvfp4_block(x + int64_t(order[p] / div) * ldx, k0, K, g, packed);
    } else {
      float h[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        h[i] = detail::silu_mul(x[p * ldx + k0 + i], u[p * ldx + k0 + i]);
      }
      sbyte = nvfp4_block(h, 0, 16, g, packed);
    }
    uint8_t* row = codes + p * (K / 2) + k0 / 2;
#pragma unroll
    for (int i = 0; i < 8; ++i) row[i] = packed[i];
    sf[sf_off[lo] + layout::nvfp4_sf_offset(p - start[lo], j, sf_cols)] = sbyte;
  }
}

}  // namespace

void nvfp4_quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t Kp, float input_scale,
                         uint8_t* codes, uint8_t* sf, float* deq, int64_t ldd, cudaStream_t stream) {
  const int64_t units = M * (Kp / 16);
  if (units == 0) return;
  constexpr int kThreads = 128;
  const int64_t blocks = (units + kThreads - 1) / kThreads;
  const unsigned grid = unsigned(blocks < kMaxRowBlocks ? blocks : kMaxRowBlocks);
  nvfp4_quant_rows_kernel<<<grid, kThreads, 0, stream>>>(x, ldx, M, K, Kp, input_scale, 1.0f / input_scale, codes, sf,
                                                         deq, ldd);
}

void nvfp4_quantize_grouped_rows(bool gathered, const float* x, const float* u, int64_t ldx, const int32_t* order,
                                 int div, const int32_t* start, int E, const int64_t* sf_off, const float* scales,
                                 int64_t rows, int64_t K, uint8_t* codes, uint8_t* sf, cudaStream_t stream) {
  const int64_t units = rows * (K / 16);
  if (units == 0) return;
  constexpr int kThreads = 128;
  const int64_t blocks = (units + kThreads - 1) / kThreads;
  const unsigned grid = unsigned(blocks < kMaxRowBlocks ? blocks : kMaxRowBlocks);
  if (gathered)
    nvfp4_quant_grouped_kernel<true><<<grid, kThreads, 0, stream>>>(x, u, ldx, order, div, start, E, sf_off, scales,
                                                                     rows, K, codes, sf);
  else
    nvfp4_quant_grouped_kernel<false><<<grid, kThreads, 0, stream>>>(x, u, ldx, order, div, start, E, sf_off, scales,
                                                                      rows, K, codes, sf);
}

void fp8_quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t Mp, int64_t Kp, uint8_t* codes,
                       float* sf, float* deq, int64_t ldd, cudaStream_t stream) {
  const int64_t nb = (K + 127) / 128, units = Mp * nb;
  if (units == 0) return;
  const int64_t blocks = (units + kWarps - 1) / kWarps;
  const unsigned grid = unsigned(blocks < kMaxRowBlocks ? blocks : kMaxRowBlocks);
  fp8_quant_rows_kernel<<<grid, kWarps * 32, 0, stream>>>(x, ldx, M, K, Mp, Kp, nb, codes, sf, deq, ldd);
}

}  // namespace detail

void fp8_quantize_act(const Tensor& x, Tensor& out) {
  DFLASH2_CHECK_ARG(x.device().is_cuda() && out.device() == x.device(), "cuda::fp8_quantize_act: x and out must be on ",
                    "the same CUDA device, found ", x.describe(), ", ", out.describe());
  const int64_t M = x.shape(0), K = x.shape(1);
  DFLASH2_CHECK_ARG((x.stride(1) == 1 || K <= 1) && (out.stride(1) == 1 || K <= 1),
                    "cuda::fp8_quantize_act: x and out must be contiguous in their last dimension");
  if (M == 0 || K == 0) return;
  detail::DeviceGuard guard(x.device().index);
  detail::fp8_quantize_rows(x.data_as<const float>(), x.stride(0), M, K, M, K, nullptr, nullptr, out.data_as<float>(),
                            out.stride(0), detail::stream());
  detail::check_launch("fp8_quantize_act", x.describe());
}

void nvfp4_quantize_act(const Tensor& x, float input_scale, Tensor& out) {
  DFLASH2_CHECK_ARG(x.device().is_cuda() && out.device() == x.device(), "cuda::nvfp4_quantize_act: x and out must be ",
                    "on the same CUDA device, found ", x.describe(), ", ", out.describe());
  const int64_t M = x.shape(0), K = x.shape(1);
  DFLASH2_CHECK_ARG((x.stride(1) == 1 || K <= 1) && (out.stride(1) == 1 || K <= 1),
                    "cuda::nvfp4_quantize_act: x and out must be contiguous in their last dimension");
  if (M == 0 || K == 0) return;
  detail::DeviceGuard guard(x.device().index);
  detail::nvfp4_quantize_rows(x.data_as<const float>(), x.stride(0), M, K, K, input_scale, nullptr, nullptr,
                              out.data_as<float>(), out.stride(0), detail::stream());
  detail::check_launch("nvfp4_quantize_act", x.describe());
}

}  // namespace dflash2::cuda
