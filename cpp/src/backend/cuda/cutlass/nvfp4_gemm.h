// cuda/cutlass/nvfp4_gemm.h: the NVFP4 W4A4 tensor-core GEMM behind ops::linear_nvfp4, from
// CUTLASS's block-scaled tcgen05 collective (CUTLASS examples 72a / 72b):
//   nvfp4_sm100.cu  Blackwell (sm_100a / sm_103a): TMA + block-scaled tcgen05 MMA (E2M1 x
//                   E2M1, one E4M3 scale per 16 inputs on each side), 1-SM, 128x128x256 tiles.
//   D[M, N] (F32) = alpha * sum_k (a_k sfa) (b_k sfb)   (+ D when accumulating)
// A: E2M1 [M, K] packed two per byte, row-major (the activation codes, quant.h); B: E2M1
// [N, K] packed, row-major (the checkpoint's weight); SFA / SFB: E4M3 bytes in the
// block-scaled layout (layout.h nvfp4_sf_offset; zero padding); alpha = input_scale x
// weight_scale_2. k-tiles in order, no split-K: a row's result depends only on K.
// Plain C++ (no CUTLASS types), included by gemm_tc.cu.
//
// Status: compiled for sm_100a / sm_103a, NOT yet run on a GPU.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

struct CUstream_st;

namespace dflash2::cuda::tc {

struct Nvfp4GemmArgs {
  int M = 0, N = 0, K = 0;      // N % 4 == 0, K % 32 == 0 (16-byte TMA rows)
  const void* a = nullptr;      // E2M1 [M, K] packed, row stride lda elements (lda % 32 == 0)
  int64_t lda = 0;
  const void* sfa = nullptr;    // E4M3 [nvfp4_sf_rows(M) x nvfp4_sf_cols(K)] swizzled
  const void* b = nullptr;      // E2M1 [N, K] packed, row stride ldb elements (ldb % 32 == 0)
  int64_t ldb = 0;
  const void* sfb = nullptr;    // E4M3 [nvfp4_sf_rows(N) x nvfp4_sf_cols(K)] swizzled
  float alpha = 1.0f;
  float* d = nullptr;           // F32 [M, N], row stride ldd (ldd % 4 == 0, 16-byte aligned)
  int64_t ldd = 0;
  bool accumulate = false;
};

bool nvfp4_gemm_built_for(int sm);
size_t nvfp4_gemm_workspace(int sm, const Nvfp4GemmArgs& a);
std::string nvfp4_gemm(int sm, const Nvfp4GemmArgs& a, void* workspace, CUstream_st* stream);

// Defined in nvfp4_sm100.cu when built.
size_t nvfp4_gemm_sm100_workspace(const Nvfp4GemmArgs& a);
std::string nvfp4_gemm_sm100(const Nvfp4GemmArgs& a, void* workspace, CUstream_st* stream);

}  // namespace dflash2::cuda::tc
