// cuda/cutlass/fp8_grouped_sm100.cu: the Blackwell (sm_100a / sm_103a) FP8 block-128 grouped
// GEMM of fp8_grouped_gemm.h (fp8_grouped_kernel.cuh): CUTLASS's ptr-array blockwise-scaled
// tcgen05 mainloop (KernelPtrArrayTmaWarpSpecializedBlockwise1SmSm100, CUTLASS example 81
// grouped style: 1-SM MMA, accumulator in tensor memory, the scales by cp.async) with the
// 1-SM ptr-array epilogue; the activation scales K-major (fp8_config.cuh: the sm100
// mainloop's MN-major scale loads are 16-byte vectors, which groups starting at any row
// would misalign). Built for 100a / 103a only (the dflash2_cutlass_fp8grpsm100
// object library).
//
// Status: compiled, NOT yet run on a GPU.
#include "backend/cuda/cutlass/fp8_grouped_kernel.cuh"

namespace dflash2::cuda::tc {

namespace {
using G = grouped::Fp8GroupedGemm<cutlass::arch::Sm100, cutlass::epilogue::PtrArrayTmaWarpSpecialized1Sm,
                                  cutlass::gemm::KernelPtrArrayTmaWarpSpecializedBlockwise1SmSm100,
                                  Fp8GroupedKMajorScaleConfig>;
}  // namespace

size_t fp8_grouped_sm100_params_bytes(int groups) { return G::params_bytes(groups); }
size_t fp8_grouped_sm100_workspace(const Fp8GroupedArgs& a) { return G::workspace(a); }
std::string fp8_grouped_sm100(const Fp8GroupedArgs& a, void* workspace, CUstream_st* stream) {
  return G::run(a, workspace, stream, "fp8_grouped_sm100");
}

}  // namespace dflash2::cuda::tc
