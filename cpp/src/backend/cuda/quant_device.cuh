// cuda/quant_device.cuh: the device side of the FP8 block-128 activation quantization
// (quant.h), shared by quant.cu (linear_fp8's rows) and moe.cu (the experts' rows).
//
// Status: compiled for sm_90a / sm_100a / sm_103a, NOT yet run on a GPU.
#pragma once
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace dflash2::cuda::detail {

constexpr uint8_t kE4M3NaN = 0x7f;

__device__ __forceinline__ float e4m3_value(uint8_t code) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  return __half2float(__half(h));
}

// One warp quantizes one block of 128 inputs, lane l holding v[j] = input l + 32 j (0 for
// inputs past the row): the block's scale sa = amax / 448 (returned in every lane; NaN if
// any input is not finite) and the E4M3 codes q[j] = e4m3(v[j] / sa) (0 when sa = 0,
// E4M3's NaN for a non-finite block). Every lane of the warp must call it (shuffles).
__device__ __forceinline__ float fp8_warp_block(const float (&v)[4], uint8_t (&q)[4]) {
  bool bad = false;
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float a = fabsf(v[j]);
    bad = bad || !(a <= 3.4028235e38f);
    amax = a > amax ? a : amax;
  }
  bad = __any_sync(0xffffffffu, bad);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float o = __shfl_xor_sync(0xffffffffu, amax, off);
    amax = o > amax ? o : amax;
  }
  const float sa = bad ? __int_as_float(0x7fc00000) : __fdiv_rn(amax, 448.0f);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (bad)
      q[j] = kE4M3NaN;
    else if (sa != 0.0f)
      q[j] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fdiv_rn(v[j], sa), __NV_SATFINITE, __NV_E4M3));
    else
      q[j] = 0;
  }
  return sa;
}

}  // namespace dflash2::cuda::detail
