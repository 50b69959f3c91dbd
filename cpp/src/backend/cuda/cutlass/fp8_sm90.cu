// cuda/cutlass/fp8_sm90.cu: the Hopper (sm_90a) FP8 block-128 W8A8 GEMM of fp8_gemm.h:
// CUTLASS's blockwise-scaled wgmma mainloop (KernelTmaWarpSpecializedCooperativeFP8Blockwise:
// two consumer warpgroups, a persistent tile scheduler), 128x128x128 tiles, scale
// granularity 1 x 128 for the activations (one scale per row and k-block, TMA-loaded) and
// 128 x 128 for the weights, fp32 epilogue (beta = 1 when accumulating). Built for sm_90a
// only (the dflash2_cutlass_fp8sm90 object library).
//
// Status: compiled, NOT yet run on a GPU.
#include "backend/cuda/cutlass/fp8_config.cuh"
#include "backend/cuda/cutlass/fp8_gemm.h"
#include "backend/cuda/cutlass/gemm_runner.cuh"

namespace dflash2::cuda::tc {

namespace {
using TileShape = Fp8TileShape;
using ClusterShape = Fp8ClusterShape;
using ScaleConfig = Fp8ScaleConfig;
using LayoutSFA = Fp8LayoutSFA;
using LayoutSFB = Fp8LayoutSFB;
using LayoutC = cutlass::layout::RowMajor;

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, float, LayoutC, 4, float, LayoutC, 4,
    cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::float_e4m3_t,
    cute::tuple<cutlass::layout::RowMajor, LayoutSFA>, 16, cutlass::float_e4m3_t,
    cute::tuple<cutlass::layout::ColumnMajor, LayoutSFB>, 16, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;
using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

}  // namespace

size_t fp8_gemm_sm90_workspace(const Fp8GemmArgs& a) {
  return Gemm::get_workspace_size(detail::fp8_arguments<Gemm, ScaleConfig>(a));
}

std::string fp8_gemm_sm90(const Fp8GemmArgs& a, void* workspace, CUstream_st* stream) {
  return detail::launch<Gemm>(detail::fp8_arguments<Gemm, ScaleConfig>(a), workspace, stream, "fp8_gemm_sm90", a.M, a.N,
                              a.K);
}

}  // namespace dflash2::cuda::tc
