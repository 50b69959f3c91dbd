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
// Both FP8 kernels (fp8_sm90.cu, fp8_grouped_sm90.cu): 128x128x128 tiles (one k-tile per
// 128-input scale block), no clusters.
using Fp8TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;
using Fp8ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;

}  // namespace dflash2::cuda::tc
