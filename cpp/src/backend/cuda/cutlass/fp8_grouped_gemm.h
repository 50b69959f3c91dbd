// cuda/cutlass/fp8_grouped_gemm.h: the FP8 block-128 W8A8 grouped GEMM behind
// ops::moe_experts(..., GemmNumerics::FP8) (the routed experts of a prompt chunk on the
// tensor cores), from CUTLASS's ptr-array blockwise-scaled collective (CUTLASS example 68):
//   fp8_grouped_sm90.cu  Hopper: TMA + wgmma FP8, warp-specialized cooperative, 128x128x128
//                        tiles, a persistent scheduler over every group's tiles; the scales
//                        are loaded with cp.async (no alignment rule on a group's rows).
//   fp8_grouped_sm100.cu Blackwell (sm_100a / sm_103a): TMA + tcgen05 FP8, 1-SM 128x128x128
//                        tiles; the activation scales K-major (fp8_grouped_sfa_kmajor).
// (Both are fp8_grouped_kernel.cuh.)
// Group g (an expert) multiplies rows [off[g], off[g + 1]) of A (its tokens' activation
// codes, in the expert lists' order) by its own weight:
//   D[r, :] (F32) = sum_b P_b(A[r], B_g) * SFA_g[b][r - off[g]] * SFB_g[n / 128][b]
// with the same per-128-block promotion as fp8_gemm.h (each row's result a function of K
// only). The group sizes are device data: nothing here synchronizes with the host, so it
// can be captured in a CUDA graph; empty groups have no tiles.
// Plain C++ (no CUTLASS types), included by moe.cu.
//
// Status: compiled for sm_90a / sm_100a / sm_103a, NOT yet run on a GPU.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

struct CUstream_st;

namespace dflash2::cuda::tc {

struct Fp8GroupedArgs {
  int groups = 0;                       // G
  int N = 0, K = 0;                     // every group: [M_g, K] x [N, K]^T; K % 16 == 0, N % 4 == 0
  const int32_t* offsets = nullptr;     // device [G + 1], ascending: group g's rows [off[g], off[g + 1])
  const void* a = nullptr;              // E4M3 [rows, K], row stride K (16-byte aligned)
  const float* sfa = nullptr;           // F32: group g's scales at sfa + nbk * off[g]: [nbk][M_g] (MN-major),
                                        // or [M_g][nbk] where fp8_grouped_sfa_kmajor(sm)
  const void* const* b = nullptr;       // device [G]: E4M3 [N, K] row-major, row stride K (16-byte aligned)
  const float* const* sfb = nullptr;    // device [G]: F32 [ceil(N / 128), nbk] row-major
  float* d = nullptr;                   // F32 [rows, N], row stride N (16-byte aligned)
  void* params = nullptr;               // device scratch of fp8_grouped_params_bytes(G) bytes (256-aligned)
};

bool fp8_grouped_built_for(int sm);
// Whether sm's kernel reads the activation scales K-major ([rows][nbk], layout.h
// fp8_act_scale_offset_kmajor) rather than MN-major per group.
bool fp8_grouped_sfa_kmajor(int sm);
size_t fp8_grouped_params_bytes(int sm, int groups);
size_t fp8_grouped_workspace(int sm, const Fp8GroupedArgs& a);
// Fills the per-group argument arrays on the device (one small kernel), then launches the
// grouped GEMM on `stream`: "" on success, else why not.
std::string fp8_grouped_gemm(int sm, const Fp8GroupedArgs& a, void* workspace, CUstream_st* stream);

// Defined in fp8_grouped_sm90.cu / fp8_grouped_sm100.cu when built.
size_t fp8_grouped_sm90_params_bytes(int groups);
size_t fp8_grouped_sm90_workspace(const Fp8GroupedArgs& a);
std::string fp8_grouped_sm90(const Fp8GroupedArgs& a, void* workspace, CUstream_st* stream);
size_t fp8_grouped_sm100_params_bytes(int groups);
size_t fp8_grouped_sm100_workspace(const Fp8GroupedArgs& a);
std::string fp8_grouped_sm100(const Fp8GroupedArgs& a, void* workspace, CUstream_st* stream);

}  // namespace dflash2::cuda::tc
