// cuda/cutlass/fp8_grouped_sm90.cu: the Hopper (sm_90a) FP8 block-128 grouped GEMM of
// fp8_grouped_gemm.h (fp8_grouped_kernel.cuh): CUTLASS's ptr-array blockwise-scaled wgmma
// mainloop (KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise, CUTLASS example 68
// style) with the cooperative ptr-array epilogue. Built for sm_90a only (the
// dflash2_cutlass_fp8grpsm90 object library).
//
// Status: compiled, NOT yet run on a GPU.
#include "backend/cuda/cutlass/fp8_grouped_kernel.cuh"

namespace dflash2::cuda::tc {

namespace {
using G = grouped::Fp8GroupedGemm<cutlass::arch::Sm90, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
                                  cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
                                  Fp8ScaleConfig>;
}  // namespace

size_t fp8_grouped_sm90_params_bytes(int groups) { return G::params_bytes(groups); }
size_t fp8_grouped_sm90_workspace(const Fp8GroupedArgs& a) { return G::workspace(a); }
std::string fp8_grouped_sm90(const Fp8GroupedArgs& a, void* workspace, CUstream_st* stream) {
  return G::run(a, workspace, stream, "fp8_grouped_sm90");
}

}  // namespace dflash2::cuda::tc
