// cuda/cutlass/fp8_config.cuh: the scale-factor configuration of the FP8 block-128 GEMM
// (fp8_sm90.cu), apart so that tests/cpp/test_cutlass_layout.cu can check, on the CPU, that
// the CuTe layouts it produces put every scale where layout.h's fp8_*_scale_offset (what
// quant.cu writes and the checkpoint stores) says.
#pragma once
#include "cute/tensor.hpp"
#include "cutlass/detail/blockwise_scale_layout.hpp"

namespace dflash2::cuda::tc {

// Activations: one scale per row and 128-input block, MN-major; weights: one per 128 x 128
// block, K-major (row-major [ceil(N/128), ceil(K/128)]).
using Fp8ScaleConfig =
    cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::MN, cute::GMMA::Major::K>;
using Fp8LayoutSFA = decltype(Fp8ScaleConfig::deduce_layoutSFA());
using Fp8LayoutSFB = decltype(Fp8ScaleConfig::deduce_layoutSFB());
// The Blackwell grouped kernel (fp8_grouped_sm100.cu): the activation scales K-major
// instead (row m's scales contiguous: [rows][nbk] over all the groups' rows), because the
// sm100 mainloop loads MN-major activation scales in 16-byte vectors, which a group
// starting at an arbitrary row would misalign; K-major ones are loaded one by one.
using Fp8GroupedKMajorScaleConfig =
    cutlass::detail::Sm100BlockwiseScaleConfig<1, 128, 128, cute::UMMA::Major::K, cute::UMMA::Major::K>;
// Every FP8 kernel (fp8_sm90.cu, fp8_sm100.cu, fp8_grouped_*.cu): 128x128x128 tiles (one k-tile per
// 128-input scale block), no clusters.
using Fp8TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;
// One weight scale per tile (N and K tile = the 128 x 128 block): what the kernels' scale
// loads assume (and what keeps CUTLASS 4.2's smem_atom_layoutSFB, which reads majorSFA
// where it means majorSFB, harmless: a one-scale tile has no major).
static_assert(cute::size<1>(Fp8TileShape{}) == 128 && cute::size<2>(Fp8TileShape{}) == 128,
              "the FP8 kernels assume one 128 x 128 weight-scale block per tile");
using Fp8ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;

}  // namespace dflash2::cuda::tc
