// cuda/cutlass/bf16_sm100.cu: the Blackwell (sm_100a / sm_103a) BF16 GEMM of bf16_gemm.h:
// TMA + tcgen05 with the accumulator in tensor memory, 1-SM MMA, 128x128x64 tiles, the
// persistent (CLC) tile scheduler (gemm_runner.cuh Bf16GemmOf). Built for 100a / 103a only
// (the dflash2_cutlass_sm100 object library).
//
// Status: compiled, NOT yet run on a GPU.
#include "backend/cuda/cutlass/gemm_runner.cuh"

namespace dflash2::cuda::tc {

namespace {
using Gemm = detail::Bf16GemmOf<cutlass::arch::Sm100, cute::Shape<cute::_128, cute::_128, cute::_64>,
                                cutlass::epilogue::TmaWarpSpecialized1Sm,
                                cutlass::gemm::KernelTmaWarpSpecialized1SmSm100>::Gemm;
}  // namespace

size_t bf16_gemm_sm100_workspace(const Bf16GemmArgs& a) { return detail::workspace_bytes<Gemm>(a); }

std::string bf16_gemm_sm100(const Bf16GemmArgs& a, void* workspace, CUstream_st* stream) {
  return detail::run<Gemm>(a, workspace, stream, "bf16_gemm_sm100");
}

}  // namespace dflash2::cuda::tc
