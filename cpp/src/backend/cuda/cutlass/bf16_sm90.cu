// cuda/cutlass/bf16_sm90.cu: the Hopper (sm_90a) BF16 GEMM of bf16_gemm.h: a TMA +
// wgmma warp-specialized cooperative kernel (two consumer warpgroups, 64 rows each) with a
// persistent tile scheduler, 128x128x64 tiles, cluster 1x1, stage count from the shared
// memory left by the epilogue. Built for sm_90a only (the dflash2_cutlass_sm90 object library).
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
using TileShape = Shape<_128, _128, _64>;
using ClusterShape = Shape<_1, _1, _1>;

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, float, ElementC, LayoutC, kAlignC, ElementD, LayoutC,
    kAlignC, cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;

using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA, kAlignA, ElementB, LayoutB, kAlignB,
    ElementAcc, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
}  // namespace

size_t bf16_gemm_sm90_workspace(const Bf16GemmArgs& a) { return detail::workspace_bytes<Gemm>(a); }

std::string bf16_gemm_sm90(const Bf16GemmArgs& a, void* workspace, CUstream_st* stream) {
  return detail::run<Gemm>(a, workspace, stream, "bf16_gemm_sm90");
}

}  // namespace dflash2::cuda::tc
