// cuda/cutlass/bf16_gemm.h: the tensor-core GEMM behind ops::linear_bf16, built from CUTLASS
// collective builders, one instantiation per architecture and per file, each compiled only
// for its own architectures (CMakeLists.txt: dflash2_cutlass_sm90 for 90a,
// dflash2_cutlass_sm100 for 100a / 103a):
//   bf16_sm90.cu   Hopper: TMA + wgmma, warp-specialized cooperative kernel, 128x128x64 tile.
//   bf16_sm100.cu  Blackwell: TMA + tcgen05 (1-SM MMA), 128x128x64 tile.
// Both compute D[M, N] (F32) = A[M, K] (BF16, row-major) @ B[N, K]^T (BF16, row-major)
// (+ D when accumulating), fp32 accumulation, k-tiles in ascending order and no split-K, so
// each output element's summation order is a function of K only: a row's result does not
// depend on M or on the other rows (the batch invariance ops.h promises).
// This header is plain C++ (no CUTLASS types), so gemm_tc.cu and the tests include it freely.
//
// Status: compiled for sm_90a / sm_100a / sm_103a, NOT yet run on a GPU.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

struct CUstream_st;

namespace dflash2::cuda::tc {

struct Bf16GemmArgs {
  int M = 0, N = 0, K = 0;   // K % 8 == 0 (TMA: 16-byte rows)
  const void* a = nullptr;   // BF16 [M, K], row stride lda elements (lda % 8 == 0, 16-byte aligned base)
  int64_t lda = 0;
  const void* b = nullptr;   // BF16 [N, K], row stride ldb elements (ldb % 8 == 0, 16-byte aligned base)
  int64_t ldb = 0;
  float* d = nullptr;        // F32 [M, N], row stride ldd elements (ldd % 4 == 0, N % 4 == 0, 16-byte aligned)
  int64_t ldd = 0;
  bool accumulate = false;   // D = D + A B^T (one rounding of the sum: fma(1, D, acc))
};

// Whether a kernel for this compute capability (major * 10 + minor: 90, 100, 103) was built.
bool bf16_gemm_built_for(int sm);
// The global-memory workspace the kernel for `sm` needs for these arguments (bytes).
size_t bf16_gemm_workspace(int sm, const Bf16GemmArgs& a);
// Launches on `stream`. Returns "" on success, else why it could not (CUTLASS's
// can_implement / initialize status, or no kernel for `sm`); the caller turns that into an error.
std::string bf16_gemm(int sm, const Bf16GemmArgs& a, void* workspace, CUstream_st* stream);

// Per architecture (defined in bf16_sm90.cu / bf16_sm100.cu when built).
size_t bf16_gemm_sm90_workspace(const Bf16GemmArgs& a);
std::string bf16_gemm_sm90(const Bf16GemmArgs& a, void* workspace, CUstream_st* stream);
size_t bf16_gemm_sm100_workspace(const Bf16GemmArgs& a);
std::string bf16_gemm_sm100(const Bf16GemmArgs& a, void* workspace, CUstream_st* stream);

}  // namespace dflash2::cuda::tc
