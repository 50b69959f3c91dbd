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

}  // namespace dflash2::cuda::tc
