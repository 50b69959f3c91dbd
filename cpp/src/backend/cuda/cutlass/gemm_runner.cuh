// cuda/cutlass/gemm_runner.cuh: runs a CUTLASS 3.x/4.x GemmUniversalAdapter on the plain
// arguments of bf16_gemm.h (strides from the row strides, alpha = 1, beta = 0 or 1, the
// device's SM count cached once). Included only by the per-architecture files.
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "backend/cuda/cutlass/bf16_gemm.h"
#include "backend/cuda/device_attr.cuh"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"
#include "cutlass/util/packed_stride.hpp"

namespace dflash2::cuda::tc::detail {

// The BF16 GEMM of bf16_gemm.h from the collective builders: x [M, K] row-major (A), W [N, K]
// row-major = B (K x N) column-major, F32 C / D [M, N] row-major, fp32 accumulation, 16-byte
// (TMA) alignment, cluster 1x1x1, the stage count from the shared memory the epilogue leaves.
// Arch, tile shape and the two schedules are the per-architecture choices.
template <class Arch, class TileShape, class EpilogueSchedule, class MainloopSchedule>
struct Bf16GemmOf {
  using ElementAB = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutC = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 8, kAlignC = 4;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      Arch, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto,
      float, float, float, LayoutC, kAlignC, float, LayoutC, kAlignC, EpilogueSchedule>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      Arch, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA, kAlignAB, ElementAB, LayoutB, kAlignAB, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

template <class Gemm>
typename Gemm::Arguments make_arguments(const Bf16GemmArgs& a) {
  using Kernel = typename Gemm::GemmKernel;
  using StrideA = typename Kernel::StrideA;
  using StrideB = typename Kernel::StrideB;
  using StrideC = typename Kernel::StrideC;
  using StrideD = typename Kernel::StrideD;
  using ElementA = typename Gemm::ElementA;
  using ElementB = typename Gemm::ElementB;
  using ElementC = typename Gemm::ElementC;
  using ElementD = typename Gemm::ElementD;
  // Packed strides for (rows, K, batch = 1), then the real row strides.
  StrideA sa = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(a.M, a.K, 1));
  StrideB sb = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(a.N, a.K, 1));
  StrideC sc = cutlass::make_cute_packed_stride(StrideC{}, cute::make_shape(a.M, a.N, 1));
  StrideD sd = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(a.M, a.N, 1));
  cute::get<0>(sa) = a.lda;
  cute::get<0>(sb) = a.ldb;
  cute::get<0>(sc) = a.ldd;
  cute::get<0>(sd) = a.ldd;
  int device = 0;
  cudaGetDevice(&device);
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = ::dflash2::cuda::detail::sm_count(device);
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                {a.M, a.N, a.K, 1},
                                {static_cast<const ElementA*>(a.a), sa, static_cast<const ElementB*>(a.b), sb},
                                {{1.0f, a.accumulate ? 1.0f : 0.0f},
                                 static_cast<const ElementC*>(a.d), sc, static_cast<ElementD*>(a.d), sd},
                                hw};
  return args;
}

template <class Gemm>
size_t workspace_bytes(const Bf16GemmArgs& a) {
  return Gemm::get_workspace_size(make_arguments<Gemm>(a));
}

template <class Gemm>
std::string run(const Bf16GemmArgs& a, void* workspace, cudaStream_t stream, const char* what) {
  const typename Gemm::Arguments args = make_arguments<Gemm>(a);
  Gemm gemm;
  cutlass::Status s = gemm.can_implement(args);
  if (s != cutlass::Status::kSuccess)
    return std::string(what) + ": CUTLASS cannot implement M=" + std::to_string(a.M) + " N=" + std::to_string(a.N) +
           " K=" + std::to_string(a.K) + " (" + cutlassGetStatusString(s) + ")";
  s = gemm.initialize(args, workspace, stream);
  if (s != cutlass::Status::kSuccess) return std::string(what) + ": initialize failed (" + cutlassGetStatusString(s) + ")";
  s = gemm.run(stream);
  if (s != cutlass::Status::kSuccess) return std::string(what) + ": launch failed (" + cutlassGetStatusString(s) + ")";
  return "";
}

}  // namespace dflash2::cuda::tc::detail
