// cuda/quant.h: activation quantization for the low-precision tensor-core GEMMs.
//
// FP8 block-128 (ops.h fp8_quantize_act / linear_fp8): per row m < M and per block b of 128
// inputs, with amax the block's largest |x| (fp32):
//   sa = amax / 448,  code_k = e4m3(x_k / sa)  (IEEE division, round to nearest even,
//   saturating at 448; amax = 0: codes 0; a non-finite input: sa = NaN, codes NaN)
// Outputs (each optional, null = not wanted):
//   codes  E4M3 [Mp, Kp] row-major: rows >= M and inputs K <= k < Kp are 0 (the GEMM's padding)
//   sf     F32 [nb, Mp], sf[b * Mp + m] = sa (the MN-major layout of CUTLASS's blockwise
//          scales, granularity 1 x 128); rows >= M get 0
//   deq    F32 [M, K] with row stride ldd: code * sa (what the GEMM multiplies)
// nb = ceil(K / 128); requires M <= Mp, K <= Kp <= nb * 128.
//
// Status: compiled for sm_90a / sm_100a / sm_103a, NOT yet run on a GPU.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace dflash2::cuda::detail {

void fp8_quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t Mp, int64_t Kp, uint8_t* codes,
                       float* sf, float* deq, int64_t ldd, cudaStream_t stream);

// NVFP4 (ops.h nvfp4_quantize_act / linear_nvfp4): per row m < M and block j of 16 inputs
// (K % 16 == 0), with g = 1 / input_scale and amax the block's largest |x| (the CPU
// reference's operations, bitwise):
//   sf = e4m3(g * (amax * (1/6))),  q_i = e2m1(x_i * (1 / (sf / g)))  (round to nearest even,
//   saturating; sf = 0: codes 0; a non-finite input: codes 0 and the scale byte 0x7f, E4M3's NaN)
// Outputs (each optional):
//   codes  E2M1 [M, Kp / 2] bytes (low nibble = even k); K <= k < Kp (Kp % 16 == 0) are 0
//   sf     E4M3 bytes at layout.h nvfp4_sf_offset(m, j, nvfp4_sf_cols(Kp)); the caller zeroes
//          the buffer first (its padding rows / columns must be 0)
//   deq    F32 [M, K] with row stride ldd: q * sf * input_scale (NaN for a non-finite block)
void nvfp4_quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t Kp, float input_scale,
                         uint8_t* codes, uint8_t* sf, float* deq, int64_t ldd, cudaStream_t stream);
// The same per block, for the A operand of the routed experts' grouped W4A4 GEMM (K % 16
// == 0): row p < start[E] (device) is
//   gathered:  x[(order[p] / div) * ldx + k]                 (the gate / up input)
//   otherwise: silu(x[p ldx + k]) * u[p ldx + k]            (the CPU's silu_mul: the down input)
// quantized with the input scale of its group e (start[e] <= p < start[e + 1]): scales[e];
// codes at codes + p * K / 2, the scale byte at sf + sf_off[e] + nvfp4_sf_offset(p -
// start[e], j, nvfp4_sf_cols(K)) (each group's rows padded to 128; the caller zeroes sf).
void nvfp4_quantize_grouped_rows(bool gathered, const float* x, const float* u, int64_t ldx, const int32_t* order,
                                 int div, const int32_t* start, int E, const int64_t* sf_off, const float* scales,
                                 int64_t rows, int64_t K, uint8_t* codes, uint8_t* sf, cudaStream_t stream);

}  // namespace dflash2::cuda::detail
