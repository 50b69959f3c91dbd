// cuda/argmax.cuh: the CPU's sequential argmax (layout.h: argmax_better orders candidates
// by (value, -index), so ties go to the lower index and +0 / -0 tie; NaN is skipped and
// argmax_finish maps "none" as the CPU does) as thread-, warp- and block-level pieces,
// shared by row_reduce.cu (argmax), sampling.cu (greedy rows) and selector.cu (the walk).
// argmax_better is a strict total order, so any merge tree gives the CPU's answer.
//
// Status: compiled for sm_90a/sm_100a/sm_103a, NOT yet run on a GPU.
#pragma once
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "backend/cuda/layout.h"

namespace dflash2::cuda::detail {

// One more candidate (v, i) into a thread's running best (bv, bi); NaN never wins.
__device__ __forceinline__ void argmax_take(float v, int32_t i, float& bv, int32_t& bi) {
  if (!isnan(v) && layout::argmax_better(v, i, bv, bi)) {
    bv = v;
    bi = i;
  }
}

// Every lane's (bv, bi) merged over the warp (all 32 lanes must call; all end with the best).
__device__ __forceinline__ void warp_argmax(float& bv, int32_t& bi) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
    const int32_t oi = __shfl_xor_sync(0xffffffffu, bi, off);
    if (layout::argmax_better(ov, oi, bv, bi)) {
      bv = ov;
      bi = oi;
    }
  }
}

// Every thread's (bv, bi) merged over the block (all threads must call; blockDim.x a
// multiple of 32, at most 1024): afterwards the lanes of warp 0 hold the block's best.
// sval / sidx: shared arrays of 32; the caller syncs before reusing them.
__device__ __forceinline__ void block_argmax_merge(float& bv, int32_t& bi, float* sval, int32_t* sidx) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  warp_argmax(bv, bi);
  if (lane == 0) {
    sval[warp] = bv;
    sidx[warp] = bi;
  }
  __syncthreads();
  if (warp == 0) {
    bv = lane < nw ? sval[lane] : -INFINITY;
    bi = lane < nw ? sidx[lane] : layout::kArgmaxNone;
    warp_argmax(bv, bi);
  }
}

}  // namespace dflash2::cuda::detail
