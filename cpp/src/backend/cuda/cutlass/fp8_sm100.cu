// cuda/cutlass/fp8_sm100.cu: the Blackwell (sm_100a / sm_103a) FP8 block-128 W8A8 GEMM of
// fp8_gemm.h: CUTLASS's blockwise-scaled tcgen05 mainloop (KernelScheduleSm100Blockwise,
// CUTLASS example 81 style: TMA for A / B, the scales by cp.async, the accumulator in tensor
// memory), 1-SM 128x128x128 tiles (one k-tile per 128-input scale block), no clusters, the
// persistent (CLC) tile scheduler, fp32 epilogue (beta = 1 when accumulating). The scale
// layouts are fp8_config.cuh's (Sm90BlockwiseScaleConfig is the same Sm1xxBlockwiseScaleConfig
// type as Sm100BlockwiseScaleConfig with these majors), so the sm_90a kernel's callers and
// test_cutlass_layout's CPU check cover this kernel's scale placement too. Built for
// 100a / 103a only (the dflash2_cutlass_fp8sm100 object library).
//
// Status: compiled, NOT yet run on a GPU.
#include <type_traits>

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
    cutlass::arch::Sm100, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, float, LayoutC, 4, float, LayoutC, 4,
    cutlass::epilogue::collective::EpilogueScheduleAuto>::CollectiveOp;
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm100, cutlass::arch::OpClassTensorOp, cutlass::float_e4m3_t,
    cute::tuple<cutlass::layout::RowMajor, LayoutSFA>, 16, cutlass::float_e4m3_t,
    cute::tuple<cutlass::layout::ColumnMajor, LayoutSFB>, 16, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelScheduleSm100Blockwise>::CollectiveOp;
using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue, void>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

// The mainloop derives its scale configuration from the layouts it is given: it must be
// the one detail::fp8_arguments builds them with.
static_assert(std::is_same_v<typename Mainloop::ScaleConfig, ScaleConfig>,
              "the sm100 blockwise mainloop's scale configuration differs from fp8_config.cuh's");

}  // namespace

size_t fp8_gemm_sm100_workspace(const Fp8GemmArgs& a) {
  return Gemm::get_workspace_size(detail::fp8_arguments<Gemm, ScaleConfig>(a));
}

std::string fp8_gemm_sm100(const Fp8GemmArgs& a, void* workspace, CUstream_st* stream) {
  return detail::launch<Gemm>(detail::fp8_arguments<Gemm, ScaleConfig>(a), workspace, stream, "fp8_gemm_sm100", a.M, a.N,
                              a.K);
}

}  // namespace dflash2::cuda::tc
