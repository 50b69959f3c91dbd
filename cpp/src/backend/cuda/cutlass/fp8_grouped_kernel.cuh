// cuda/cutlass/fp8_grouped_kernel.cuh: the FP8 block-128 grouped GEMM of fp8_grouped_gemm.h,
// written once for both architectures: a CUTLASS ptr-array blockwise-scaled mainloop with
// the ptr-array epilogue, 128x128x128 tiles, cluster 1x1x1, the scale layouts of
// fp8_config.cuh (activations 1 x 128 MN-major per group, weights 128 x 128 K-major: the
// checkpoint's weight_scale_inv), F32 out (beta = 0). A setup kernel writes every group's
// problem size, pointers, strides and scale layouts from the device-side offsets; the GEMM
// reads them (no host synchronization). Included by exactly one .cu per architecture
// (fp8_grouped_sm90.cu, fp8_grouped_sm100.cu), which names the architecture, the two
// schedules and the scale configuration (Fp8GroupedGemm<Arch, EpilogueSchedule,
// MainloopSchedule, ScaleConfig>: MN-major activation scales per group on Hopper, K-major
// ones on Blackwell, fp8_config.cuh).
//
// Status: compiled, NOT yet run on a GPU.
#pragma once
#include <cstdint>
#include <string>
#include <type_traits>

#include "backend/cuda/cutlass/fp8_config.cuh"
#include "backend/cuda/cutlass/fp8_grouped_gemm.h"
#include "backend/cuda/cutlass/gemm_runner.cuh"
#include "backend/cuda/pdl.cuh"
#include "cutlass/gemm/group_array_problem_shape.hpp"

namespace dflash2::cuda::tc::grouped {

using ElementAB = cutlass::float_e4m3_t;
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using LayoutC = cutlass::layout::RowMajor;
using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using Shape3 = typename ProblemShape::UnderlyingProblemShape;

inline size_t align256(size_t v) { return (v + 255) / 256 * 256; }

template <class T>
void carve(uint8_t*& p, T*& out, int groups) {
  out = reinterpret_cast<T*>(p);
  p += align256(sizeof(T) * size_t(groups));
}

template <class Arch, class EpilogueSchedule, class MainloopSchedule, class ScaleConfig_>
struct Fp8GroupedGemm {
  using ScaleConfig = ScaleConfig_;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      Arch, cutlass::arch::OpClassTensorOp, Fp8TileShape, Fp8ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, float, LayoutC*, 4, float, LayoutC*, 4,
      EpilogueSchedule, cutlass::epilogue::fusion::LinearCombination<float, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      Arch, cutlass::arch::OpClassTensorOp, ElementAB, cute::tuple<LayoutA*, LayoutSFA*>, 16, ElementAB,
      cute::tuple<LayoutB*, LayoutSFB*>, 16, float, Fp8TileShape, Fp8ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // the scale layouts the setup kernel writes are the ones the mainloop reads
  static_assert(std::is_same_v<cute::remove_pointer_t<typename Mainloop::InternalLayoutSFA>, LayoutSFA> &&
                    std::is_same_v<cute::remove_pointer_t<typename Mainloop::InternalLayoutSFB>, LayoutSFB>,
                "the grouped mainloop's scale layouts differ from fp8_config.cuh's");

  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;

  // The per-group arrays in params, each 256-byte aligned.
  struct Params {
    Shape3* shapes;
    const ElementAB** pa;
    const ElementAB** pb;
    const float** psfa;
    const float** psfb;
    const float** pc;
    float** pd;
    StrideA* sa;
    StrideB* sb;
    StrideC* sc;
    StrideD* sd;
    LayoutSFA* lsfa;
    LayoutSFB* lsfb;
  };

  static Params carve_params(void* base, int groups) {
    Params q;
    uint8_t* p = static_cast<uint8_t*>(base);
    carve(p, q.shapes, groups);
    carve(p, q.pa, groups);
    carve(p, q.pb, groups);
    carve(p, q.psfa, groups);
    carve(p, q.psfb, groups);
    carve(p, q.pc, groups);
    carve(p, q.pd, groups);
    carve(p, q.sa, groups);
    carve(p, q.sb, groups);
    carve(p, q.sc, groups);
    carve(p, q.sd, groups);
    carve(p, q.lsfa, groups);
    carve(p, q.lsfb, groups);
    return q;
  }

  static size_t params_bytes(int groups) {
    const size_t g = size_t(groups);
    return align256(sizeof(Shape3) * g) + 6 * align256(sizeof(void*) * g) + align256(sizeof(StrideA) * g) +
           align256(sizeof(StrideB) * g) + align256(sizeof(StrideC) * g) + align256(sizeof(StrideD) * g) +
           align256(sizeof(LayoutSFA) * g) + align256(sizeof(LayoutSFB) * g);
  }

  static typename Gemm::Arguments make_arguments(const Fp8GroupedArgs& a, const Params& q) {
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                  {a.groups, q.shapes, nullptr},
                                  {q.pa, q.sa, q.pb, q.sb, q.psfa, q.lsfa, q.psfb, q.lsfb},
                                  {{}, q.pc, q.sc, q.pd, q.sd},
                                  detail::hw_info()};
    auto& f = args.epilogue.thread;
    f.alpha = 1.0f;
    f.beta = 0.0f;
    f.alpha_ptr = nullptr;
    f.beta_ptr = nullptr;
    f.alpha_ptr_array = nullptr;
    f.beta_ptr_array = nullptr;
    f.dAlpha = {cute::_0{}, cute::_0{}, 0};
    f.dBeta = {cute::_0{}, cute::_0{}, 0};
    return args;
  }

  static size_t workspace(const Fp8GroupedArgs& a) {
    Params q{};
    return Gemm::get_workspace_size(make_arguments(a, q));
  }

  static std::string run(const Fp8GroupedArgs& a, void* workspace, CUstream_st* stream, const char* what);
};

template <class G>
__global__ void setup_groups(typename G::Params q, int groups, int N, int K, const int32_t* __restrict__ off,
                             const uint8_t* __restrict__ a, const float* __restrict__ sfa,
                             const void* const* __restrict__ b, const float* const* __restrict__ sfb,
                             float* __restrict__ d) {
  ::dflash2::cuda::detail::pdl_enter();  // pdl.cuh: this folder's kernels begin so
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  const int64_t r0 = off[g];
  const int M = int(off[g + 1] - r0);
  const int nbk = (K + 127) / 128;
  q.shapes[g] = Shape3{M, N, K};
  q.pa[g] = reinterpret_cast<const ElementAB*>(a + r0 * K);
  q.pb[g] = static_cast<const ElementAB*>(b[g]);
  q.psfa[g] = sfa + int64_t(nbk) * r0;  // either major: the group's [nbk][M_g] or [M_g][nbk] block
  q.psfb[g] = sfb[g];
  q.pc[g] = d + r0 * N;
  q.pd[g] = d + r0 * N;
  q.sa[g] = cutlass::make_cute_packed_stride(typename G::StrideA{}, cute::make_shape(M, K, 1));
  q.sb[g] = cutlass::make_cute_packed_stride(typename G::StrideB{}, cute::make_shape(N, K, 1));
  q.sc[g] = cutlass::make_cute_packed_stride(typename G::StrideC{}, cute::make_shape(M, N, 1));
  q.sd[g] = cutlass::make_cute_packed_stride(typename G::StrideD{}, cute::make_shape(M, N, 1));
  // (the sm90 ptr-array collective rebuilds both scale layouts from the group's shape in
  // the kernel, but the sm100 one reads these per group: they are required there)
  q.lsfa[g] = G::ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(M, N, K, 1));
  q.lsfb[g] = G::ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(M, N, K, 1));
}

template <class Arch, class EpilogueSchedule, class MainloopSchedule, class ScaleConfig_>
std::string Fp8GroupedGemm<Arch, EpilogueSchedule, MainloopSchedule, ScaleConfig_>::run(const Fp8GroupedArgs& a, void* workspace,
                                                                           CUstream_st* stream, const char* what) {
  if (a.groups <= 0) return "";
  // with the group shapes on the device CUTLASS checks no group: what every group's TMA
  // descriptors need is checked here (each group's A / D start r0 rows in: 16-byte rows)
  if (a.K % 16 != 0 || a.N % 4 != 0 || reinterpret_cast<uintptr_t>(a.a) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(a.d) % 16 != 0 || reinterpret_cast<uintptr_t>(a.params) % 256 != 0)
    return std::string(what) + ": K must be a multiple of 16, N of 4, A and D 16-byte aligned and params 256-byte "
           "aligned (K " + std::to_string(a.K) + ", N " + std::to_string(a.N) + ")";
  const Params q = carve_params(a.params, a.groups);
  setup_groups<Fp8GroupedGemm><<<(a.groups + 127) / 128, 128, 0, stream>>>(
      q, a.groups, a.N, a.K, a.offsets, static_cast<const uint8_t*>(a.a), a.sfa, a.b, a.sfb, a.d);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return std::string(what) + ": the setup kernel did not launch (" + cudaGetErrorString(e) + ")";
  return detail::launch<Gemm>(make_arguments(a, q), workspace, stream, what, a.groups, a.N, a.K);
}

}  // namespace dflash2::cuda::tc::grouped
