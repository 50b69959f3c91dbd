// cuda/cutlass/fp8_gemm.h: the FP8 block-128 W8A8 tensor-core GEMM behind ops::linear_fp8,
// from CUTLASS's blockwise-scaled collective (CUTLASS example 67, groupwise variant):
//   fp8_sm90.cu  Hopper: TMA + wgmma FP8, warp-specialized cooperative kernel, 128x128x128
//                tiles; after each 128-deep k-tile the partial sums are promoted into the
//                fp32 accumulator: acc += P * (sfa * sfb).
//   fp8_sm100.cu Blackwell (sm_100a / sm_103a): TMA + tcgen05 FP8, 1-SM 128x128x128 tiles,
//                the same per-k-tile promotion (CUTLASS example 81), same scale layouts.
//   D[M, N] (F32) = sum_b P_b(A, B) * SFA[b][m] * SFB[n / 128][b]   (+ D when accumulating)
// A: E4M3 [M, K] row-major (the activation codes, quant.h), SFA: F32 per row and 128-input
// block, MN-major (sfa[b * M + m]); B: E4M3 [N, K] row-major (the checkpoint's weight codes),
// SFB: F32 [ceil(N / 128), ceil(K / 128)] row-major (the checkpoint's weight_scale_inv).
// k-tiles run in ascending order and there is no split-K, so a row's result depends only
// on K (batch invariance, as bf16_gemm.h).
// Plain C++ (no CUTLASS types), included by gemm_tc.cu.
//
// Status: compiled for sm_90a / sm_100a / sm_103a, NOT yet run on a GPU.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

struct CUstream_st;

namespace dflash2::cuda::tc {

struct Fp8GemmArgs {
  int M = 0, N = 0, K = 0;    // M % 4 == 0 (the SFA columns are loaded in 16-byte vectors), N % 4 == 0, K % 16 == 0
  const void* a = nullptr;    // E4M3 [M, K], row stride lda bytes (lda % 16 == 0, 16-byte aligned base)
  int64_t lda = 0;
  const float* sfa = nullptr; // F32 [ceil(K / 128), M] (16-byte aligned: checked by fp8_gemm)
  const void* b = nullptr;    // E4M3 [N, K], row stride ldb bytes (ldb % 16 == 0, 16-byte aligned base)
  int64_t ldb = 0;
  const float* sfb = nullptr; // F32 [ceil(N / 128), ceil(K / 128)], contiguous
  float* d = nullptr;         // F32 [M, N], row stride ldd (ldd % 4 == 0, 16-byte aligned)
  int64_t ldd = 0;
  bool accumulate = false;    // D = D + result (one rounding of the sum)
};

// Whether a kernel for this compute capability (major * 10 + minor) was built.
bool fp8_gemm_built_for(int sm);
size_t fp8_gemm_workspace(int sm, const Fp8GemmArgs& a);
// Launches on `stream`: "" on success, else why not.
std::string fp8_gemm(int sm, const Fp8GemmArgs& a, void* workspace, CUstream_st* stream);

// Defined in fp8_sm90.cu / fp8_sm100.cu when built.
size_t fp8_gemm_sm90_workspace(const Fp8GemmArgs& a);
std::string fp8_gemm_sm90(const Fp8GemmArgs& a, void* workspace, CUstream_st* stream);
size_t fp8_gemm_sm100_workspace(const Fp8GemmArgs& a);
std::string fp8_gemm_sm100(const Fp8GemmArgs& a, void* workspace, CUstream_st* stream);

}  // namespace dflash2::cuda::tc
