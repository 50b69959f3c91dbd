// cuda/cutlass/bf16_sm100.cu: the Blackwell (sm_100a / sm_103a) BF16 GEMM of bf16_gemm.h:
// TMA + tcgen05 with the accumulator in tensor memory, 1-SM MMA, 128x128x64 tiles, cluster
// 1x1, the persistent (CLC) tile scheduler, stage count from the shared memory left by the
// epilogue. Built for 100a / 103a only (the dflash2_cutlass_sm100 object library).
//
// Status: compiled, NOT yet run on a GPU.
#include "backend/cuda/cutlass/gemm_runner.cuh"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace dflash2::cuda::tc {

namespace {
using namespace cute;

using ElementA = cutlass::bfloat16_t;
using ElementB = cutlass::bfloat16_t;
using ElementC = float;
using ElementD = float;
using ElementAcc = float;
using LayoutA = cutlass::layout::RowMajor;     // x [M, K]
using LayoutB = cutlass::layout::ColumnMajor;  // W [N, K] is B (K x N) column-major
using LayoutC = cutlass::layout::RowMajor;     // y [M, N]
constexpr int kAlignA = 8, kAlignB = 8, kAlignC = 4;  // 16 bytes: TMA
using MmaTileShape = Shape<_128, _128, _64>;
using ClusterShape = Shape<_1, _1, _1>;

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm100, cutlass::arch::OpClassTensorOp, MmaTileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, float, ElementC, LayoutC, kAlignC, ElementD, LayoutC,
    kAlignC, cutlass::epilogue::TmaWarpSpecialized1Sm>::CollectiveOp;

using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm100, cutlass::arch::OpClassTensorOp, ElementA, LayoutA, kAlignA, ElementB, LayoutB, kAlignB,
    ElementAcc, MmaTileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecialized1SmSm100>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
}  // namespace

size_t bf16_gemm_sm100_workspace(const Bf16GemmArgs& a) { return detail::workspace_bytes<Gemm>(a); }

std::string bf16_gemm_sm100(const Bf16GemmArgs& a, void* workspace, CUstream_st* stream) {
  return detail::run<Gemm>(a, workspace, stream, "bf16_gemm_sm100");
}

}  // namespace dflash2::cuda::tc
