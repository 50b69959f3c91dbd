// cuda/cutlass/gemm_runner.cuh: runs a CUTLASS 3.x/4.x GemmUniversalAdapter on the plain
// arguments of bf16_gemm.h / fp8_gemm.h (strides from the row strides, alpha = 1, beta = 0
// or 1, the device's SM count cached once). Included only by the per-architecture files.
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "backend/cuda/cutlass/bf16_gemm.h"
#include "backend/cuda/cutlass/fp8_gemm.h"
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

// The device's hardware info for the persistent tile scheduler (SM count cached once).
inline cutlass::KernelHardwareInfo hw_info() {
  int device = 0;
  cudaGetDevice(&device);
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = ::dflash2::cuda::detail::sm_count(device);
  return hw;
}

// Packed strides for (rows, cols, batch = 1) with the real row stride in mode 0.
template <class Stride>
Stride row_stride(int rows, int cols, int64_t ld) {
  Stride s = cutlass::make_cute_packed_stride(Stride{}, cute::make_shape(rows, cols, 1));
  cute::get<0>(s) = ld;
  return s;
}

// The FP8 block-128 GEMM's arguments (fp8_gemm.h) for a blockwise-scaled Gemm of either
// architecture: E4M3 A / B with their real row strides, the scale layouts of ScaleConfig
// over (M, N, K), F32 D (also C: beta = 1 when accumulating).
template <class Gemm, class ScaleConfig>
typename Gemm::Arguments fp8_arguments(const Fp8GemmArgs& a) {
  using Kernel = typename Gemm::GemmKernel;
  using ElementAB = cutlass::float_e4m3_t;
  const auto shape = cute::make_shape(a.M, a.N, a.K, 1);
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {a.M, a.N, a.K, 1},
      {static_cast<const ElementAB*>(a.a), row_stride<typename Kernel::StrideA>(a.M, a.K, a.lda),
       static_cast<const ElementAB*>(a.b), row_stride<typename Kernel::StrideB>(a.N, a.K, a.ldb), a.sfa,
       ScaleConfig::tile_atom_to_shape_SFA(shape), a.sfb, ScaleConfig::tile_atom_to_shape_SFB(shape)},
      {{1.0f, a.accumulate ? 1.0f : 0.0f},
       a.d, row_stride<typename Kernel::StrideC>(a.M, a.N, a.ldd),
       a.d, row_stride<typename Kernel::StrideD>(a.M, a.N, a.ldd)},
      hw_info()};
  return args;
}

template <class Gemm>
typename Gemm::Arguments make_arguments(const Bf16GemmArgs& a) {
  using Kernel = typename Gemm::GemmKernel;
  using ElementA = typename Gemm::ElementA;
  using ElementB = typename Gemm::ElementB;
  using ElementC = typename Gemm::ElementC;
  using ElementD = typename Gemm::ElementD;
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {a.M, a.N, a.K, 1},
      {static_cast<const ElementA*>(a.a), row_stride<typename Kernel::StrideA>(a.M, a.K, a.lda),
       static_cast<const ElementB*>(a.b), row_stride<typename Kernel::StrideB>(a.N, a.K, a.ldb)},
      {{1.0f, a.accumulate ? 1.0f : 0.0f},
       static_cast<const ElementC*>(a.d), row_stride<typename Kernel::StrideC>(a.M, a.N, a.ldd),
       static_cast<ElementD*>(a.d), row_stride<typename Kernel::StrideD>(a.M, a.N, a.ldd)},
      hw_info()};
  return args;
}

template <class Gemm>
size_t workspace_bytes(const Bf16GemmArgs& a) {
  return Gemm::get_workspace_size(make_arguments<Gemm>(a));
}

// can_implement, initialize (workspace, stream), run: "" on success, else what failed.
template <class Gemm>
std::string launch(const typename Gemm::Arguments& args, void* workspace, cudaStream_t stream, const char* what, int M,
                   int N, int K) {
  Gemm gemm;
  cutlass::Status s = gemm.can_implement(args);
  if (s != cutlass::Status::kSuccess)
    return std::string(what) + ": CUTLASS cannot implement M=" + std::to_string(M) + " N=" + std::to_string(N) +
           " K=" + std::to_string(K) + " (" + cutlassGetStatusString(s) + ")";
  s = gemm.initialize(args, workspace, stream);
  if (s != cutlass::Status::kSuccess) return std::string(what) + ": initialize failed (" + cutlassGetStatusString(s) + ")";
  s = gemm.run(stream);
  if (s != cutlass::Status::kSuccess) return std::string(what) + ": launch failed (" + cutlassGetStatusString(s) + ")";
  return "";
}

template <class Gemm>
std::string run(const Bf16GemmArgs& a, void* workspace, cudaStream_t stream, const char* what) {
  return launch<Gemm>(make_arguments<Gemm>(a), workspace, stream, what, a.M, a.N, a.K);
}

}  // namespace dflash2::cuda::tc::detail
