// cuda/cutlass/nvfp4_sm100.cu: the Blackwell (sm_100a / sm_103a) NVFP4 W4A4 GEMM of
// nvfp4_gemm.h: CUTLASS's block-scaled tcgen05 collective (OpClassBlockScaledTensorOp,
// nv_float4_t<e2m1> on both sides, scale vector 16), 1-SM, 128x128x256 tiles, the kernel
// and epilogue schedules the builders pick for them, F32 C / D with alpha = the two global
// scales' product. Built for 100a / 103a only (the dflash2_cutlass_nvfp4sm100 object library).
//
// Status: compiled, NOT yet run on a GPU.
#include "backend/cuda/cutlass/gemm_runner.cuh"
#include "backend/cuda/cutlass/nvfp4_config.cuh"
#include "backend/cuda/cutlass/nvfp4_gemm.h"

namespace dflash2::cuda::tc {

namespace {
using ElementAB = cutlass::nv_float4_t<cutlass::float_e2m1_t>;
using TileShape = cute::Shape<cute::_128, cute::_128, cute::_256>;
using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
using LayoutC = cutlass::layout::RowMajor;

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm100, cutlass::arch::OpClassBlockScaledTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, float, LayoutC, 4, float, LayoutC, 4,
    cutlass::epilogue::collective::EpilogueScheduleAuto>::CollectiveOp;
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm100, cutlass::arch::OpClassBlockScaledTensorOp, ElementAB, cutlass::layout::RowMajor, 32,
    ElementAB, cutlass::layout::ColumnMajor, 32, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::collective::KernelScheduleAuto>::CollectiveOp;
using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue, void>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

// layout.h's nvfp4_sf_offset (checked against Nvfp4SfConfig on the CPU) is the layout the
// collective reads.
static_assert(cute::is_same_v<typename Mainloop::Sm1xxBlkScaledConfig, Nvfp4SfConfig>,
              "the collective's scale-factor configuration is not nvfp4_config.cuh's");

Gemm::Arguments make_arguments(const Nvfp4GemmArgs& a) {
  using DataAB = typename ElementAB::DataType;
  using SF = typename ElementAB::ScaleFactorType;
  const auto shape = cute::make_shape(a.M, a.N, a.K, 1);
  Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {a.M, a.N, a.K, 1},
      {static_cast<const DataAB*>(a.a), detail::row_stride<Kernel::StrideA>(a.M, a.K, a.lda),
       static_cast<const DataAB*>(a.b), detail::row_stride<Kernel::StrideB>(a.N, a.K, a.ldb),
       static_cast<const SF*>(a.sfa), Nvfp4SfConfig::tile_atom_to_shape_SFA(shape), static_cast<const SF*>(a.sfb),
       Nvfp4SfConfig::tile_atom_to_shape_SFB(shape)},
      {{a.alpha, a.accumulate ? 1.0f : 0.0f},
       a.d, detail::row_stride<Kernel::StrideC>(a.M, a.N, a.ldd),
       a.d, detail::row_stride<Kernel::StrideD>(a.M, a.N, a.ldd)},
      detail::hw_info()};
  return args;
}
}  // namespace

size_t nvfp4_gemm_sm100_workspace(const Nvfp4GemmArgs& a) { return Gemm::get_workspace_size(make_arguments(a)); }

std::string nvfp4_gemm_sm100(const Nvfp4GemmArgs& a, void* workspace, CUstream_st* stream) {
  return detail::launch<Gemm>(make_arguments(a), workspace, stream, "nvfp4_gemm_sm100", a.M, a.N, a.K);
}

}  // namespace dflash2::cuda::tc
