// cuda/cutlass/nvfp4_grouped_sm100.cu: the Blackwell (sm_100a / sm_103a) NVFP4 W4A4 grouped
// GEMM of nvfp4_grouped_gemm.h: CUTLASS's ptr-array block-scaled tcgen05 mainloop
// (KernelPtrArrayTmaWarpSpecialized1SmNvf4Sm100: nv_float4_t<e2m1> on both sides, one E4M3
// scale per 16 inputs, 1-SM MMA, 128x128x256 tiles, accumulator in tensor memory) with the
// ptr-array 1-SM epilogue, F32 D (beta = 0) and one alpha per group (a pointer per group, as
// CUTLASS example 75 passes them). A setup kernel writes every group's problem size,
// pointers, strides, scale layouts and alpha pointer from the device-side offsets (no host
// synchronization). Built for 100a / 103a only (the dflash2_cutlass_nvfp4grpsm100 object
// library).
//
// Status: compiled, NOT yet run on a GPU.
#include <cstdint>
#include <string>
#include <type_traits>

#include "backend/cuda/cutlass/gemm_runner.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/cutlass/nvfp4_config.cuh"
#include "backend/cuda/cutlass/nvfp4_grouped_gemm.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"

namespace dflash2::cuda::tc {

namespace {
using ElementAB = cutlass::nv_float4_t<cutlass::float_e2m1_t>;
using DataAB = typename ElementAB::DataType;
using SF = typename ElementAB::ScaleFactorType;
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using LayoutC = cutlass::layout::RowMajor;
using TileShape = cute::Shape<cute::_128, cute::_128, cute::_256>;
using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using Shape3 = typename ProblemShape::UnderlyingProblemShape;

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm100, cutlass::arch::OpClassBlockScaledTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, float, LayoutC*, 4, float, LayoutC*, 4,
    cutlass::epilogue::PtrArrayTmaWarpSpecialized1Sm>::CollectiveOp;
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm100, cutlass::arch::OpClassBlockScaledTensorOp, ElementAB, LayoutA*, 32, ElementAB, LayoutB*, 32,
    float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecialized1SmNvf4Sm100>::CollectiveOp;
using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

// the per-group scale layouts are nvfp4_config.cuh's (layout.h nvfp4_sf_offset, checked
// against CuTe on the CPU): what the quantizer and the weight-scale swizzle write
static_assert(std::is_same_v<typename Mainloop::Sm1xxBlkScaledConfig, Nvfp4SfConfig>,
              "the grouped collective's scale-factor configuration is not nvfp4_config.cuh's");
using LayoutSFA = typename Mainloop::InternalLayoutSFA;
using LayoutSFB = typename Mainloop::InternalLayoutSFB;
using StrideA = typename Kernel::InternalStrideA;
using StrideB = typename Kernel::InternalStrideB;
using StrideC = typename Kernel::InternalStrideC;
using StrideD = typename Kernel::InternalStrideD;

size_t align256(size_t v) { return (v + 255) / 256 * 256; }

struct Params {
  Shape3* shapes;
  const DataAB** pa;
  const DataAB** pb;
  const SF** psfa;
  const SF** psfb;
  const float** pc;
  float** pd;
  const float** palpha;
  StrideA* sa;
  StrideB* sb;
  StrideC* sc;
  StrideD* sd;
  LayoutSFA* lsfa;
  LayoutSFB* lsfb;
};

template <class T>
void carve(uint8_t*& p, T*& out, int groups) {
  out = reinterpret_cast<T*>(p);
  p += align256(sizeof(T) * size_t(groups));
}

Params carve_params(void* base, int groups) {
  Params q;
  uint8_t* p = static_cast<uint8_t*>(base);
  carve(p, q.shapes, groups);
  carve(p, q.pa, groups);
  carve(p, q.pb, groups);
  carve(p, q.psfa, groups);
  carve(p, q.psfb, groups);
  carve(p, q.pc, groups);
  carve(p, q.pd, groups);
  carve(p, q.palpha, groups);
  carve(p, q.sa, groups);
  carve(p, q.sb, groups);
  carve(p, q.sc, groups);
  carve(p, q.sd, groups);
  carve(p, q.lsfa, groups);
  carve(p, q.lsfb, groups);
  return q;
}

size_t params_bytes(int groups) {
  const size_t g = size_t(groups);
  return align256(sizeof(Shape3) * g) + 7 * align256(sizeof(void*) * g) + align256(sizeof(StrideA) * g) +
         align256(sizeof(StrideB) * g) + align256(sizeof(StrideC) * g) + align256(sizeof(StrideD) * g) +
         align256(sizeof(LayoutSFA) * g) + align256(sizeof(LayoutSFB) * g);
}

Gemm::Arguments make_arguments(const Nvfp4GroupedArgs& a, const Params& q) {
  Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                       {a.groups, q.shapes, nullptr},
                       {q.pa, q.sa, q.pb, q.sb, q.psfa, q.lsfa, q.psfb, q.lsfb},
                       {{}, q.pc, q.sc, q.pd, q.sd},
                       detail::hw_info()};
  auto& f = args.epilogue.thread;
  f.alpha = 0.0f;
  f.beta = 0.0f;
  f.alpha_ptr = nullptr;
  f.beta_ptr = nullptr;
  f.alpha_ptr_array = q.palpha;  // group g: *palpha[g]
  f.beta_ptr_array = nullptr;
  f.dAlpha = {cute::_0{}, cute::_0{}, 1};
  f.dBeta = {cute::_0{}, cute::_0{}, 0};
  return args;
}

__global__ void setup_groups(Params q, int groups, int N, int K, const int32_t* __restrict__ off,
                             const uint8_t* __restrict__ a, const uint8_t* __restrict__ sfa,
                             const int64_t* __restrict__ sfa_off, const void* const* __restrict__ b,
                             const uint8_t* const* __restrict__ sfb, const float* __restrict__ alpha,
                             float* __restrict__ d) {
  ::dflash2::cuda::detail::pdl_enter();  // pdl.cuh: this folder's kernels begin so
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  const int64_t r0 = off[g];
  const int M = int(off[g + 1] - r0);
  q.shapes[g] = Shape3{M, N, K};
  q.pa[g] = reinterpret_cast<const DataAB*>(a + r0 * (K / 2));
  q.pb[g] = static_cast<const DataAB*>(b[g]);
  q.psfa[g] = reinterpret_cast<const SF*>(sfa + sfa_off[g]);
  q.psfb[g] = reinterpret_cast<const SF*>(sfb[g]);
  q.pc[g] = d + r0 * N;
  q.pd[g] = d + r0 * N;
  q.palpha[g] = alpha + g;
  q.sa[g] = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(M, K, 1));
  q.sb[g] = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(N, K, 1));
  q.sc[g] = cutlass::make_cute_packed_stride(StrideC{}, cute::make_shape(M, N, 1));
  q.sd[g] = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(M, N, 1));
  q.lsfa[g] = Nvfp4SfConfig::tile_atom_to_shape_SFA(cute::make_shape(M, N, K, 1));
  q.lsfb[g] = Nvfp4SfConfig::tile_atom_to_shape_SFB(cute::make_shape(M, N, K, 1));
}
}  // namespace

size_t nvfp4_grouped_sm100_params_bytes(int groups) { return params_bytes(groups); }

size_t nvfp4_grouped_sm100_workspace(const Nvfp4GroupedArgs& a) {
  Params q{};
  return Gemm::get_workspace_size(make_arguments(a, q));
}

std::string nvfp4_grouped_sm100(const Nvfp4GroupedArgs& a, void* workspace, CUstream_st* stream) {
  const char* what = "nvfp4_grouped_sm100";
  if (a.groups <= 0) return "";
  // with the group shapes on the device CUTLASS checks no group: what every group's TMA
  // descriptors need is checked here (each group's A / D start r0 rows in: 16-byte rows)
  if (a.K % 32 != 0 || a.N % 4 != 0 || reinterpret_cast<uintptr_t>(a.a) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(a.d) % 16 != 0 || reinterpret_cast<uintptr_t>(a.sfa) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(a.params) % 256 != 0)
    return std::string(what) + ": K must be a multiple of 32, N of 4, A, D and the scales 16-byte aligned and "
           "params 256-byte aligned (K " + std::to_string(a.K) + ", N " + std::to_string(a.N) + ")";
  const Params q = carve_params(a.params, a.groups);
  setup_groups<<<(a.groups + 127) / 128, 128, 0, stream>>>(q, a.groups, a.N, a.K, a.offsets,
                                                           static_cast<const uint8_t*>(a.a), a.sfa, a.sfa_off, a.b,
                                                           a.sfb, a.alpha, a.d);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return std::string(what) + ": the setup kernel did not launch (" + cudaGetErrorString(e) + ")";
  return detail::launch<Gemm>(make_arguments(a, q), workspace, stream, what, a.groups, a.N, a.K);
}

}  // namespace dflash2::cuda::tc
