// cuda/cutlass/nvfp4_config.cuh: the scale-factor configuration of the NVFP4 W4A4 GEMM
// (nvfp4_sm100.cu: one E4M3 scale per 16 inputs, CUTLASS's block-scaled layout), apart so
// that tests/cpp/test_cutlass_layout.cu can check it on the CPU against layout.h's
// nvfp4_sf_offset (what quant.cu and the weight-scale swizzle in gemm_tc.cu write).
#pragma once
#include "cute/tensor.hpp"
#include "cutlass/detail/sm100_blockscaled_layout.hpp"

namespace dflash2::cuda::tc {

using Nvfp4SfConfig = cutlass::detail::Sm1xxBlockScaledConfig<16>;

}  // namespace dflash2::cuda::tc
