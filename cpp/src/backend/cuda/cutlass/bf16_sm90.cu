// cuda/cutlass/bf16_sm90.cu: the Hopper (sm_90a) BF16 GEMM of bf16_gemm.h: a TMA +
// wgmma warp-specialized cooperative kernel (two consumer warpgroups, 64 rows each) with a
// persistent tile scheduler, 128x128x64 tiles (gemm_runner.cuh Bf16GemmOf). Built for
// sm_90a only (the dflash2_cutlass_sm90 object library).
//
// Status: compiled, NOT yet run on a GPU.
#include "backend/cuda/cutlass/gemm_runner.cuh"

namespace dflash2::cuda::tc {

namespace {
using Gemm = detail::Bf16GemmOf<cutlass::arch::Sm90, cute::Shape<cute::_128, cute::_128, cute::_64>,
                                cutlass::epilogue::TmaWarpSpecializedCooperative,
                                cutlass::gemm::KernelTmaWarpSpecializedCooperative>::Gemm;
}  // namespace

size_t bf16_gemm_sm90_workspace(const Bf16GemmArgs& a) { return detail::workspace_bytes<Gemm>(a); }

std::string bf16_gemm_sm90(const Bf16GemmArgs& a, void* workspace, CUstream_st* stream) {
  return detail::run<Gemm>(a, workspace, stream, "bf16_gemm_sm90");
}

}  // namespace dflash2::cuda::tc
