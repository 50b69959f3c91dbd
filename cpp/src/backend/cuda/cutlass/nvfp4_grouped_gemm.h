// cuda/cutlass/nvfp4_grouped_gemm.h: the NVFP4 W4A4 grouped GEMM behind
// ops::moe_experts(..., GemmNumerics::NVFP4) (the routed experts of a prompt chunk on
// Blackwell's FP4 tensor cores), from CUTLASS's ptr-array block-scaled collective (CUTLASS
// example 75 style):
//   nvfp4_grouped_sm100.cu  sm_100a / sm_103a: TMA + block-scaled tcgen05 MMA (E2M1 x E2M1,
//                           one E4M3 scale per 16 inputs on each side), 1-SM, 128x128x256
//                           tiles, the ptr-array 1-SM epilogue with one alpha per group.
// Group g (an expert) multiplies rows [off[g], off[g + 1]) of A (its tokens' activation
// codes, in the expert lists' order) by its own weight:
//   D[r, :] (F32) = alpha[g] * sum_k (a_k sfa_k) (b_k sfb_k),   alpha[g] = input_scale x weight_scale_2
// The group sizes are device data: nothing here synchronizes with the host (graph-safe);
// empty groups have no tiles. Plain C++ (no CUTLASS types), included by moe.cu.
//
// Status: compiled for sm_100a / sm_103a, NOT yet run on a GPU.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

struct CUstream_st;

namespace dflash2::cuda::tc {

struct Nvfp4GroupedArgs {
  int groups = 0;                      // G
  int N = 0, K = 0;                    // every group: [M_g, K] x [N, K]^T; K % 32 == 0, N % 4 == 0
  const int32_t* offsets = nullptr;    // device [G + 1], ascending: group g's rows [off[g], off[g + 1])
  const void* a = nullptr;             // E2M1 [rows, K] packed two per byte, row stride K / 2 bytes (16-byte aligned)
  const uint8_t* sfa = nullptr;        // E4M3: group g's block-scaled scales (layout.h nvfp4_sf_offset over its
  const int64_t* sfa_off = nullptr;    //   rows, padded to 128) at sfa + sfa_off[g] (device [G], 512-byte multiples)
  const void* const* b = nullptr;      // device [G]: E2M1 [N, K] packed, row stride K / 2 bytes (16-byte aligned)
  const uint8_t* const* sfb = nullptr; // device [G]: E4M3 [nvfp4_sf_rows(N) x nvfp4_sf_cols(K)] block-scaled
  const float* alpha = nullptr;        // device [G]
  float* d = nullptr;                  // F32 [rows, N], row stride N (16-byte aligned)
  void* params = nullptr;              // device scratch of nvfp4_grouped_params_bytes(G) bytes (256-aligned)
};

bool nvfp4_grouped_built_for(int sm);
size_t nvfp4_grouped_params_bytes(int sm, int groups);
size_t nvfp4_grouped_workspace(int sm, const Nvfp4GroupedArgs& a);
// Fills the per-group argument arrays on the device (one small kernel), then launches the
// grouped GEMM on `stream`: "" on success, else why not.
std::string nvfp4_grouped_gemm(int sm, const Nvfp4GroupedArgs& a, void* workspace, CUstream_st* stream);

// Defined in nvfp4_grouped_sm100.cu when built.
size_t nvfp4_grouped_sm100_params_bytes(int groups);
size_t nvfp4_grouped_sm100_workspace(const Nvfp4GroupedArgs& a);
std::string nvfp4_grouped_sm100(const Nvfp4GroupedArgs& a, void* workspace, CUstream_st* stream);

}  // namespace dflash2::cuda::tc
