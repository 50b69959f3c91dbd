// cuda/drafter_ops.cu: the DFlash drafter's two-tap dynamic conv (dyn_conv) on the CUDA
// backend.
//
// Status: compiled for sm_90a/sm_100a/sm_103a, NOT yet run on a GPU. Checked against the
// CPU backend by tests/test_ops.py (including out == x) and
// tests/cpp/test_cuda_backend.cpp when a GPU is present (bench/device_check.sh).
//
//   out[r, c] = (base[0, c] + dyn[r, c / gs]) * x[r, c]
//             + (base[1, c] + dyn[r, G + c / gs]) * x[r - 1, c]   (second term dropped at
//                                                                  block position 0)
// x, out F32 [R, H]; base F32 [2, H]; dyn F32 [R, 2G] (each with contiguous rows and any row
// stride); gs = H / G; R is whole blocks of `block` rows.
//
// out may be x (the same view), as on the CPU. The CPU walks each block backwards; here one
// thread owns one (block s, channel c) column and walks it forwards, keeping x[r - 1, c] in
// a register: rows are loaded in chunks of 8 (x and the two dyn values), then the chunk's
// outputs are computed and stored. Every x element is loaded before the store that may
// overwrite it (its own row's, in the same chunk), x[r - 1, c] comes from the register, and
// no other thread touches column c of block s, so the in-place result equals the
// out-of-place one. Consecutive threads take consecutive channels (coalesced rows).
//
// Numerics: the CPU's fp32 operations in the CPU's order, written with __fadd_rn /
// __fmul_rn (no FMA contraction): bitwise equal to the CPU backend.
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/cuda_api.h"
#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/layout.h"
#include "dflash2/error.h"

namespace dflash2::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kChunk = 8;
constexpr int64_t kMaxBlocks = int64_t(1) << 16;

__global__ void __launch_bounds__(kThreads)
    dyn_conv_kernel(const float* x, int64_t x_stride, const float* __restrict__ b0, const float* __restrict__ b1,
                    const float* __restrict__ dyn, int64_t dyn_stride, int64_t G, int64_t gs, float* out,
                    int64_t out_stride, int64_t nblocks, int64_t B, int64_t H) {
  detail::pdl_enter();
  const int64_t total = nblocks * H;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += step) {
    const int64_t c = idx % H;
    const int64_t s = idx / H;
    const int64_t g = layout::conv_group(c, gs);
    const float base0 = b0[c], base1 = b1[c];
    float prev = 0.0f;  // x[r - 1, c]
    for (int64_t t0 = 0; t0 < B; t0 += kChunk) {
      const int64_t n = B - t0 < kChunk ? B - t0 : kChunk;
      float xv[kChunk], d0[kChunk], d1[kChunk];
#pragma unroll
      for (int k = 0; k < kChunk; ++k) {
        if (k < n) {
          const int64_t r = s * B + t0 + k;
          xv[k] = x[r * x_stride + c];
          d0[k] = dyn[r * dyn_stride + g];
          d1[k] = dyn[r * dyn_stride + G + g];
        }
      }
#pragma unroll
      for (int k = 0; k < kChunk; ++k) {
        if (k < n) {
          const int64_t r = s * B + t0 + k;
          float v = __fmul_rn(__fadd_rn(base0, d0[k]), xv[k]);
          if (t0 + k > 0) v = __fadd_rn(v, __fmul_rn(__fadd_rn(base1, d1[k]), prev));
          out[r * out_stride + c] = v;
          prev = xv[k];
        }
      }
    }
  }
}

void need_2d_f32(const Tensor& t, const char* arg) {
  DFLASH2_CHECK_ARG(t.defined() && t.dtype() == DType::F32 && t.ndim() == 2, "cuda::dyn_conv: '", arg,
                    "' must be F32 [rows, cols], found ", t.defined() ? t.describe() : std::string("<undefined>"));
}

}  // namespace

void dyn_conv(const Tensor& x, const Tensor& base, const Tensor& dyn, int64_t block, Tensor& out) {
  need_2d_f32(x, "x");
  need_2d_f32(base, "base");
  need_2d_f32(dyn, "dyn");
  need_2d_f32(out, "out");
  DFLASH2_CHECK_ARG(x.device().is_cuda() && base.device() == x.device() && dyn.device() == x.device() &&
                        out.device() == x.device(),
                    "cuda::dyn_conv: x, base, dyn and out must be on the same CUDA device, found ", x.describe(), ", ",
                    base.describe(), ", ", dyn.describe(), ", ", out.describe());
  DFLASH2_CHECK_ARG(x.shape() == out.shape(), "cuda::dyn_conv: x ", x.describe(), " and out ", out.describe(),
                    " must have the same shape");
  const int64_t R = x.shape(0), H = x.shape(1);
  DFLASH2_CHECK_ARG(block >= 1 && R % block == 0, "cuda::dyn_conv: ", R, " rows are not whole blocks of ", block);
  DFLASH2_CHECK_ARG(base.shape(0) == 2 && base.shape(1) == H, "cuda::dyn_conv: base must be F32 [2, ", H,
                    "], found ", base.describe());
  const int64_t G2 = dyn.shape(1);
  DFLASH2_CHECK_ARG(dyn.shape(0) == R && G2 >= 2 && G2 % 2 == 0 && H % (G2 / 2) == 0, "cuda::dyn_conv: dyn must be [",
                    R, ", 2G] with G dividing ", H, ", found ", dyn.describe());
  const layout::RowLayout lx = layout::row_layout(x, "dyn_conv", "x");
  const layout::RowLayout lo = layout::row_layout(out, "dyn_conv", "out");
  layout::check_rows_disjoint(lo, "dyn_conv", "out");
  const layout::RowLayout lb = layout::row_layout(base, "dyn_conv", "base");
  const layout::RowLayout ld = layout::row_layout(dyn, "dyn_conv", "dyn");
  if (R == 0 || H == 0) return;
  const int64_t G = G2 / 2, gs = H / G, nblocks = R / block;
  const float* b0 = base.data_as<const float>();
  const unsigned blocks = detail::ceil_blocks(nblocks * H, kThreads, kMaxBlocks);
  detail::DeviceGuard guard(x.device().index);
  dyn_conv_kernel<<<blocks, kThreads, 0, detail::stream()>>>(x.data_as<const float>(), lx.stride, b0, b0 + lb.stride,
                                                             dyn.data_as<const float>(), ld.stride, G, gs,
                                                             out.data_as<float>(), lo.stride, nblocks, block, H);
  detail::check_launch("dyn_conv kernel launch", x.describe());
}

}  // namespace dflash2::cuda
