// cuda/gemm_tc.cu: ops::linear_bf16 on the tensor cores, the GEMM of prompt tokens
// (Engine prefill_gemm="bf16"), where a chunk of up to max_step_tokens rows makes the GEMM
// compute-bound and the skinny kernel of gemm.cu (fp32 FMAs) would run at a fraction of
// the tensor cores' rate.
//
//   y[M, N] (F32) = bf16(x)[M, K] @ bf16(W)[N, K]^T   (+ y when accumulating)
//
// 1. x (F32) is rounded to BF16 (round to nearest even) into scratch, K padded with zeros to
//    a multiple of 8 (TMA moves 16-byte rows).
// 2. W: a dense BF16 weight whose rows are 16-byte aligned is read in place; an NVFP4 weight
//    on sm_90a (no FP4 MMA) goes to the mainloop-dequantizing kernel instead (gemm_dq.h:
//    W4A16, the 4-bit weight read in place; the same operands, so the same oracle); any other
//    format (F32 / F16 / FP8 block-128 / NVFP4, or misaligned BF16 rows) is dequantized with
//    weight_view.cuh's w_at (bitwise the CPU's Weight::dequantize values) and rounded to
//    BF16 into scratch. That is the numerics the CPU backend emulates
//    (cpu/gemm.cpp linear_bf16), so the CPU is this op's oracle up to fp32 summation order.
// 3. The CUTLASS kernel of the device's architecture (cutlass/bf16_gemm.h: wgmma on sm_90a,
//    tcgen05 on sm_100a / sm_103a) writes F32 straight into y (accumulating in its
//    epilogue: one rounding of y + sum); when y's rows are not 16-byte aligned (or N % 4 != 0)
//    it writes a scratch tile and a small kernel stores / adds it into y.
// ops::linear_fp8 (FP8 block-128 W8A8, Engine prefill_gemm="fp8") is the same pattern over
// FP8 operands: the activation rows quantized per 128 inputs (quant.cu), the checkpoint's
// E4M3 codes and block scales read in place, CUTLASS's blockwise-scaled wgmma kernel
// (cutlass/fp8_gemm.h, sm_90a / sm_100a / sm_103a). See linear_fp8 below.
// No host synchronization and no allocation beyond the per-stream scratch, so it can be
// captured in a CUDA graph (the scratch refuses to grow during capture).
//
// Status: compiled for sm_90a / sm_100a / sm_103a, NOT yet run on a GPU.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "backend/cuda/cuda_api.h"
#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/cutlass/bf16_gemm.h"
#include "backend/cuda/cutlass/fp8_gemm.h"
#include "backend/cuda/cutlass/fp8_grouped_gemm.h"
#include "backend/cuda/cutlass/nvfp4_gemm.h"
#include "backend/cuda/cutlass/nvfp4_grouped_gemm.h"
#include "backend/cuda/device_attr.cuh"
#include "backend/cuda/gemm_dq.h"
#include "backend/cuda/gemm_sk.h"
#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/layout.h"
#include "backend/cuda/quant.h"
#include "backend/cuda/scratch.h"
#include "backend/cuda/weight_view.cuh"
#include "dflash2/error.h"
#include "ops/backend.h"

namespace dflash2::cuda {

namespace tc {

bool bf16_gemm_built_for(int sm) {
#if defined(DFLASH2_CUTLASS_SM90)
  if (sm == 90) return true;
#endif
#if defined(DFLASH2_CUTLASS_SM100)
  if (sm == 100 || sm == 103) return true;
#endif
  (void)sm;
  return false;
}

size_t bf16_gemm_workspace(int sm, const Bf16GemmArgs& a) {
#if defined(DFLASH2_CUTLASS_SM90)
  if (sm == 90) return bf16_gemm_sm90_workspace(a);
#endif
#if defined(DFLASH2_CUTLASS_SM100)
  if (sm == 100 || sm == 103) return bf16_gemm_sm100_workspace(a);
#endif
  (void)a;
  return 0;
}

std::string bf16_gemm(int sm, const Bf16GemmArgs& a, void* workspace, CUstream_st* stream) {
#if defined(DFLASH2_CUTLASS_SM90)
  if (sm == 90) return bf16_gemm_sm90(a, workspace, stream);
#endif
#if defined(DFLASH2_CUTLASS_SM100)
  if (sm == 100 || sm == 103) return bf16_gemm_sm100(a, workspace, stream);
#endif
  (void)a;
  (void)workspace;
  (void)stream;
  return "no tensor-core GEMM was built for sm_" + std::to_string(sm);
}

bool fp8_gemm_built_for(int sm) {
#if defined(DFLASH2_CUTLASS_FP8SM90)
  if (sm == 90) return true;
#endif
#if defined(DFLASH2_CUTLASS_FP8SM100)
  if (sm == 100 || sm == 103) return true;
#endif
  (void)sm;
  return false;
}

size_t fp8_gemm_workspace(int sm, const Fp8GemmArgs& a) {
#if defined(DFLASH2_CUTLASS_FP8SM90)
  if (sm == 90) return fp8_gemm_sm90_workspace(a);
#endif
#if defined(DFLASH2_CUTLASS_FP8SM100)
  if (sm == 100 || sm == 103) return fp8_gemm_sm100_workspace(a);
#endif
  (void)a;
  return 0;
}

std::string fp8_gemm(int sm, const Fp8GemmArgs& a, void* workspace, CUstream_st* stream) {
  // CUTLASS's can_implement checks M % 4 through the scale layout, not the scales' base
  if (reinterpret_cast<uintptr_t>(a.sfa) % 16 != 0) return "the activation scales must be 16-byte aligned";
#if defined(DFLASH2_CUTLASS_FP8SM90)
  if (sm == 90) return fp8_gemm_sm90(a, workspace, stream);
#endif
#if defined(DFLASH2_CUTLASS_FP8SM100)
  if (sm == 100 || sm == 103) return fp8_gemm_sm100(a, workspace, stream);
#endif
  (void)a;
  (void)workspace;
  (void)stream;
  return "no FP8 block-128 tensor-core GEMM was built for sm_" + std::to_string(sm);
}

bool fp8_grouped_built_for(int sm) {
#if defined(DFLASH2_CUTLASS_FP8GRPSM90)
  if (sm == 90) return true;
#endif
#if defined(DFLASH2_CUTLASS_FP8GRPSM100)
  if (sm == 100 || sm == 103) return true;
#endif
  (void)sm;
  return false;
}

bool fp8_grouped_sfa_kmajor(int sm) { return sm == 100 || sm == 103; }

size_t fp8_grouped_params_bytes(int sm, int groups) {
#if defined(DFLASH2_CUTLASS_FP8GRPSM90)
  if (sm == 90) return fp8_grouped_sm90_params_bytes(groups);
#endif
#if defined(DFLASH2_CUTLASS_FP8GRPSM100)
  if (sm == 100 || sm == 103) return fp8_grouped_sm100_params_bytes(groups);
#endif
  (void)sm;
  (void)groups;
  return 0;
}

size_t fp8_grouped_workspace(int sm, const Fp8GroupedArgs& a) {
#if defined(DFLASH2_CUTLASS_FP8GRPSM90)
  if (sm == 90) return fp8_grouped_sm90_workspace(a);
#endif
#if defined(DFLASH2_CUTLASS_FP8GRPSM100)
  if (sm == 100 || sm == 103) return fp8_grouped_sm100_workspace(a);
#endif
  (void)a;
  return 0;
}

std::string fp8_grouped_gemm(int sm, const Fp8GroupedArgs& a, void* workspace, CUstream_st* stream) {
#if defined(DFLASH2_CUTLASS_FP8GRPSM90)
  if (sm == 90) return fp8_grouped_sm90(a, workspace, stream);
#endif
#if defined(DFLASH2_CUTLASS_FP8GRPSM100)
  if (sm == 100 || sm == 103) return fp8_grouped_sm100(a, workspace, stream);
#endif
  (void)a;
  (void)workspace;
  (void)stream;
  return "no FP8 grouped tensor-core GEMM was built for sm_" + std::to_string(sm);
}

bool nvfp4_grouped_built_for(int sm) {
#if defined(DFLASH2_CUTLASS_NVFP4GRPSM100)
  if (sm == 100 || sm == 103) return true;
#endif
  (void)sm;
  return false;
}

size_t nvfp4_grouped_params_bytes(int sm, int groups) {
#if defined(DFLASH2_CUTLASS_NVFP4GRPSM100)
  if (sm == 100 || sm == 103) return nvfp4_grouped_sm100_params_bytes(groups);
#endif
  (void)sm;
  (void)groups;
  return 0;
}

size_t nvfp4_grouped_workspace(int sm, const Nvfp4GroupedArgs& a) {
#if defined(DFLASH2_CUTLASS_NVFP4GRPSM100)
  if (sm == 100 || sm == 103) return nvfp4_grouped_sm100_workspace(a);
#endif
  (void)sm;
  (void)a;
  return 0;
}

std::string nvfp4_grouped_gemm(int sm, const Nvfp4GroupedArgs& a, void* workspace, CUstream_st* stream) {
#if defined(DFLASH2_CUTLASS_NVFP4GRPSM100)
  if (sm == 100 || sm == 103) return nvfp4_grouped_sm100(a, workspace, stream);
#endif
  (void)a;
  (void)workspace;
  (void)stream;
  return "no NVFP4 grouped tensor-core GEMM was built for sm_" + std::to_string(sm);
}

bool nvfp4_gemm_built_for(int sm) {
#if defined(DFLASH2_CUTLASS_NVFP4SM100)
  if (sm == 100 || sm == 103) return true;
#endif
  (void)sm;
  return false;
}

size_t nvfp4_gemm_workspace(int sm, const Nvfp4GemmArgs& a) {
#if defined(DFLASH2_CUTLASS_NVFP4SM100)
  if (sm == 100 || sm == 103) return nvfp4_gemm_sm100_workspace(a);
#endif
  (void)a;
  return 0;
}

std::string nvfp4_gemm(int sm, const Nvfp4GemmArgs& a, void* workspace, CUstream_st* stream) {
#if defined(DFLASH2_CUTLASS_NVFP4SM100)
  if (sm == 100 || sm == 103) return nvfp4_gemm_sm100(a, workspace, stream);
#endif
  (void)a;
  (void)workspace;
  (void)stream;
  return "no NVFP4 W4A4 tensor-core GEMM was built for sm_" + std::to_string(sm);
}

}  // namespace tc

namespace {

using detail::WeightView;
using detail::WFmt;

constexpr int kThreads = 256;

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

unsigned grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return unsigned(blocks < detail::kMaxRowBlocks ? (blocks > 0 ? blocks : 1) : detail::kMaxRowBlocks);
}

// out[r, k] = bf16(W[r, k]) (W dequantized as the CPU does) for r < N, k < K; 0 in the
// padding (K <= k < Kp, N <= r < Np).
template <WFmt F>
__global__ void weight_to_bf16(WeightView w, int64_t Np, int64_t Kp, __nv_bfloat16* __restrict__ out) {
  detail::pdl_enter();
  const int64_t n = Np * Kp;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / Kp, k = i - r * Kp;
    out[i] = (k < w.K && r < w.N) ? __float2bfloat16_rn(detail::w_at<F>(w, r, k)) : __float2bfloat16_rn(0.0f);
  }
}

// y[m, n] = d[m, n] (+ y[m, n] when accumulating: the same single rounding as the epilogue).
__global__ void store_rows(const float* __restrict__ d, int64_t ldd, int64_t M, int64_t N, float* __restrict__ y,
                           int64_t ldy, bool accumulate) {
  detail::pdl_enter();
  const int64_t n = M * N;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t m = i / N, c = i - m * N;
    const float v = d[m * ldd + c];
    float* p = y + m * ldy + c;
    *p = accumulate ? __fadd_rn(*p, v) : v;
  }
}

// FP8 weight codes into a padded copy: out[r, k] = W[r, k] for r < N, k < K, else 0.
__global__ void pad_fp8_codes(WeightView w, int64_t Np, int64_t Kp, uint8_t* __restrict__ out) {
  detail::pdl_enter();
  const int64_t n = Np * Kp;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / Kp, k = i - r * Kp;
    out[i] = (k < w.K && r < w.N) ? w.data[r * w.row_bytes + k] : uint8_t(0);
  }
}

// The weight's block scales [rows, cols] (row stride ld) packed contiguously.
__global__ void pack_scales(const float* __restrict__ s, int64_t ld, int64_t rows, int64_t cols,
                            float* __restrict__ out) {
  detail::pdl_enter();
  const int64_t n = rows * cols;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i - r * cols;
    out[i] = s[r * ld + c];
  }
}

// y[m, n] = 0 (a GEMM over K = 0 inputs, which the CUTLASS kernels cannot take).
__global__ void zero_rows(int64_t M, int64_t N, float* __restrict__ y, int64_t ldy) {
  detail::pdl_enter();
  const int64_t n = M * N;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t m = i / N;
    y[m * ldy + (i - m * N)] = 0.0f;
  }
}

// x @ W^T over K = 0 inputs: zeros, or y unchanged when accumulating.
void empty_k(Tensor& y, int64_t M, int64_t N, bool accumulate, const char* op) {
  if (accumulate) return;
  zero_rows<<<grid_for(M * N), kThreads, 0, detail::stream()>>>(M, N, y.data_as<float>(), y.stride(0));
  detail::check_launch(op, " (K = 0)");
}

// NVFP4 weight codes (packed bytes) into a padded copy [Np, Kp / 2].
__global__ void pad_fp4_codes(WeightView w, int64_t Np, int64_t Kp, uint8_t* __restrict__ out) {
  detail::pdl_enter();
  const int64_t kb = Kp / 2, n = Np * kb, wkb = w.K / 2;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / kb, c = i - r * kb;
    out[i] = (c < wkb && r < w.N) ? w.data[r * w.row_bytes + c] : uint8_t(0);
  }
}

// The checkpoint's per-16 E4M3 weight scales [N, K / 16] (row stride w.scale_stride) into the
// block-scaled layout of layout.h (the buffer zeroed before).
__global__ void swizzle_fp4_scales(WeightView w, int64_t sf_cols, uint8_t* __restrict__ out) {
  detail::pdl_enter();
  const int64_t nb = w.K / 16, n = w.N * nb;
  const uint8_t* s = static_cast<const uint8_t*>(w.scale);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / nb, c = i - r * nb;
    out[layout::nvfp4_sf_offset(r, c, sf_cols)] = s[r * w.scale_stride + c];
  }
}

void convert_weight(const WeightView& v, int64_t Np, int64_t Kp, __nv_bfloat16* out, cudaStream_t st) {
  const unsigned g = grid_for(Np * Kp);
  switch (v.fmt) {
    case WFmt::F32: weight_to_bf16<WFmt::F32><<<g, kThreads, 0, st>>>(v, Np, Kp, out); break;
    case WFmt::BF16: weight_to_bf16<WFmt::BF16><<<g, kThreads, 0, st>>>(v, Np, Kp, out); break;
    case WFmt::F16: weight_to_bf16<WFmt::F16><<<g, kThreads, 0, st>>>(v, Np, Kp, out); break;
    case WFmt::FP8: weight_to_bf16<WFmt::FP8><<<g, kThreads, 0, st>>>(v, Np, Kp, out); break;
    case WFmt::NVFP4: weight_to_bf16<WFmt::NVFP4><<<g, kThreads, 0, st>>>(v, Np, Kp, out); break;
  }
}

// The arguments every tensor-core linear takes (x, y F32 2-D on one CUDA device, rows
// contiguous and y's not overlapping, shapes matching the weight), and the 32-bit extents
// of the GEMM it runs, whose M, N and K are padded by at most m_pad, 4 and k_pad: the
// weight's view on x's device.
WeightView check_tc_args(const Tensor& x, const ops::Weight& w, const Tensor& y, const char* op, int64_t m_pad,
                         int64_t k_pad) {
  DFLASH2_CHECK_ARG(x.defined() && y.defined(), op, ": undefined tensor argument");
  DFLASH2_CHECK_ARG(x.device().is_cuda() && y.device() == x.device(), op, ": x and y must be on the same CUDA ",
                    "device, found ", x.describe(), ", ", y.describe());
  DFLASH2_CHECK_ARG(x.dtype() == DType::F32 && y.dtype() == DType::F32 && x.ndim() == 2 && y.ndim() == 2, op,
                    ": x and y must be F32 2-D, found ", x.describe(), ", ", y.describe());
  w.validate();
  const WeightView v = detail::weight_view(w, x.device().index, op);
  const int64_t M = x.shape(0), K = v.K, N = v.N;
  DFLASH2_CHECK_ARG(x.shape(1) == K && y.shape(0) == M && y.shape(1) == N, op, "(", w.name, "): x ", x.describe(),
                    " and y ", y.describe(), " do not match the weight [", N, ", ", K, "]");
  DFLASH2_CHECK_ARG((x.stride(1) == 1 || K <= 1) && (y.stride(1) == 1 || N <= 1), op,
                    ": x and y must be contiguous in their last dimension, found strides ", shape_str(x.strides()),
                    " and ", shape_str(y.strides()));
  DFLASH2_CHECK_ARG(M + m_pad <= int64_t(INT32_MAX) && N + 4 <= int64_t(INT32_MAX) && K + k_pad <= int64_t(INT32_MAX),
                    op, ": [", M, ", ", N, ", ", K, "] exceeds the GEMM's 32-bit extents");
  DFLASH2_CHECK_ARG(M <= 1 || y.stride(0) >= N, op, ": the rows of 'y' overlap (row stride ", y.stride(0), " < ", N,
                    ")");
  return v;
}

}  // namespace


bool linear_bf16_supported(int device) {
  if (device < 0 || device >= device_count()) return false;  // no such GPU (or no driver)
  return tc::bf16_gemm_built_for(detail::compute_capability(device));
}

void linear_bf16(const Tensor& x, const ops::Weight& w, Tensor& y, bool accumulate, bool decode) {
  const WeightView v = check_tc_args(x, w, y, "cuda::linear_bf16", 0, 8);
  const int device = x.device().index;
  const int64_t M = x.shape(0), K = v.K, N = v.N;
  detail::DeviceGuard guard(device);
  const int sm = detail::compute_capability(device);
  if (!tc::bf16_gemm_built_for(sm))
    fail(ErrorKind::Unsupported, "cuda::linear_bf16: this build has no tensor-core GEMM for sm_", sm, " on cuda:",
         device, " (CUTLASS kernels are built for sm_90a and sm_100a / sm_103a when those are in DFLASH2_CUDA_ARCHS "
         "and CUTLASS is found); use prefill_gemm='exact'");
  if (M == 0 || N == 0) return;
  if (K == 0) return empty_k(y, M, N, accumulate, "linear_bf16");
  cudaStream_t st = detail::stream();
  if (decode && sk::enabled()) {
    // Generated tokens (few rows): the skinny kernel, any weight format read in place, K
    // split over CTAs by (N, K, format) only (gemm_sk.h). Chosen by the caller's chunk kind,
    // never by M.
    Tensor* const out = &y;
    sk::linears(x, &v, &out, 1, accumulate, /*x3=*/false);
    return;
  }
  if ((v.fmt == WFmt::NVFP4 || v.fmt == WFmt::FP8) && dq::linear_enabled()) {
    // A quantized weight (NVFP4: W4A16, Hopper has no FP4 MMA; FP8 block-128; on every
    // architecture) is dequantized in the GEMM's main loop (gemm_dq.h) and so read once in
    // its stored format, instead of dequantized into a BF16 copy (2x / 4x the weight's bytes
    // written, then read again) on every call. Chosen by the weight's format, never by M: a
    // row's result does not depend on M.
    const int64_t lda = round_up(K, 8);
    __nv_bfloat16* a16 = static_cast<__nv_bfloat16*>(detail::scratch(device, size_t(M * lda * 2)));
    dq::rows_bf16(dq::RowsFrom::Plain, x.data_as<const float>(), nullptr, x.stride(0), nullptr, 1, nullptr, M, K,
                  lda, a16, st);
    dq::GemmArgs g;
    g.a = a16;
    g.lda = lda;
    g.one = v;
    g.fmt = v.fmt;
    g.vec = detail::weight_rows_vectorizable(v);
    g.M = M;
    g.N = N;
    g.K = K;
    g.d = y.data_as<float>();
    g.ldd = M > 1 ? y.stride(0) : N;
    g.accumulate = accumulate;
    dq::gemm(g, st);
    return;
  }

  // The GEMM runs N padded to Np (a multiple of 4: the epilogue's 16-byte alignment of D's
  // rows is checked on the problem's N), over a padded weight copy when N % 4 != 0.
  const int64_t Kp = round_up(K, 8), Np = round_up(N, 4);
  const bool direct_w = v.fmt == WFmt::BF16 && K % 8 == 0 && N == Np && detail::aligned(v.data, 16) &&
                        v.row_bytes % 16 == 0;
  const bool direct_y = N == Np && detail::aligned(y.data(), 16) && (M == 1 || y.stride(0) % 4 == 0);
  constexpr int64_t kAlign = 256;
  const int64_t a_bytes = round_up(M * Kp * 2, kAlign);
  const int64_t w_bytes = direct_w ? 0 : round_up(Np * Kp * 2, kAlign);
  const int64_t d_bytes = direct_y ? 0 : round_up(M * Np * 4, kAlign);

  tc::Bf16GemmArgs g;
  g.M = int(M);
  g.N = int(Np);
  g.K = int(Kp);
  g.lda = Kp;
  g.ldb = direct_w ? v.row_bytes / 2 : Kp;
  g.ldd = direct_y ? (M == 1 ? Np : y.stride(0)) : Np;
  g.accumulate = direct_y && accumulate;
  const size_t ws_bytes = size_t(round_up(int64_t(tc::bf16_gemm_workspace(sm, g)), kAlign));
  uint8_t* base = static_cast<uint8_t*>(
      detail::scratch(device, size_t(a_bytes + w_bytes + d_bytes) + ws_bytes));
  __nv_bfloat16* a16 = reinterpret_cast<__nv_bfloat16*>(base);
  __nv_bfloat16* w16 = direct_w ? nullptr : reinterpret_cast<__nv_bfloat16*>(base + a_bytes);
  float* dtmp = direct_y ? nullptr : reinterpret_cast<float*>(base + a_bytes + w_bytes);
  void* ws = ws_bytes ? static_cast<void*>(base + a_bytes + w_bytes + d_bytes) : nullptr;

  dq::rows_bf16(dq::RowsFrom::Plain, x.data_as<const float>(), nullptr, x.stride(0), nullptr, 1, nullptr, M, K, Kp,
                a16, st);
  if (!direct_w) convert_weight(v, Np, Kp, w16, st);
  detail::check_launch("linear_bf16 operand conversion", w.name, " ", x.describe());
  g.a = a16;
  g.b = direct_w ? static_cast<const void*>(v.data) : static_cast<const void*>(w16);
  g.d = direct_y ? y.data_as<float>() : dtmp;
  const std::string err = tc::bf16_gemm(sm, g, ws, st);
  if (!err.empty()) fail(ErrorKind::Backend, "cuda::linear_bf16(", w.name, "): ", err);
  detail::check_launch("linear_bf16 CUTLASS GEMM", w.name, " ", x.describe(), " -> ", y.describe());
  if (!direct_y) {
    store_rows<<<grid_for(M * N), kThreads, 0, st>>>(dtmp, Np, M, N, y.data_as<float>(), y.stride(0), accumulate);
    detail::check_launch("linear_bf16 store", w.name, " -> ", y.describe());
  }
}

void linear_bf16_decode_many(const Tensor& x, const std::vector<const ops::Weight*>& ws, const std::vector<Tensor*>& ys,
                             bool& done) {
  done = false;
  const char* op = "cuda::linear_bf16_decode_many";
  DFLASH2_CHECK_ARG(ws.size() == ys.size() && x.defined() && x.device().is_cuda(), op, ": bad arguments");
  const int device = x.device().index;
  if (!sk::enabled() || ws.empty()) return;
  detail::DeviceGuard guard(device);
  if (!tc::bf16_gemm_built_for(detail::compute_capability(device))) return;  // linear_bf16 says why
  std::vector<WeightView> vs;
  for (size_t i = 0; i < ws.size(); ++i) {
    vs.push_back(check_tc_args(x, *ws[i], *ys[i], op, 0, 8));
    if (vs.back().K == 0 || vs.back().N == 0) return;  // the steps one by one
  }
  if (x.shape(0) > 0) sk::linears(x, vs.data(), ys.data(), vs.size(), false, /*x3=*/false);
  done = true;
}

void gated_mlp_decode(const Tensor& x, const ops::Weight& gate, const ops::Weight& up, const ops::Weight& down,
                      Tensor& out, bool accumulate, bool& done) {
  done = false;
  const char* op = "cuda::gated_mlp_decode";
  DFLASH2_CHECK_ARG(x.defined() && out.defined() && x.device().is_cuda() && out.device() == x.device() &&
                        x.dtype() == DType::F32 && out.dtype() == DType::F32 && x.ndim() == 2 && out.ndim() == 2,
                    op, ": x and out must be F32 2-D on one CUDA device, found ", x.describe(), ", ", out.describe());
  const int device = x.device().index;
  if (!sk::enabled()) return;
  detail::DeviceGuard guard(device);
  if (!tc::bf16_gemm_built_for(detail::compute_capability(device))) return;  // linear_bf16 says why
  const WeightView vg = detail::weight_view(gate, device, op), vu = detail::weight_view(up, device, op),
                   vd = detail::weight_view(down, device, op);
  const int64_t M = x.shape(0), K = vg.K, F = vg.N, H = vd.N;
  if (vu.fmt != vg.fmt || M == 0 || K == 0 || F == 0 || H == 0) return;  // the steps one by one
  DFLASH2_CHECK_ARG(vu.N == F && vu.K == K && vd.K == F && x.shape(1) == K && out.shape(0) == M &&
                        out.shape(1) == H,
                    op, ": x ", x.describe(), ", gate / up [", F, ", ", K, "], down [", H, ", ", vd.K, "] and out ",
                    out.describe(), " do not match");
  DFLASH2_CHECK_ARG((x.stride(1) == 1 || K <= 1) && (out.stride(1) == 1 || H <= 1) && (M <= 1 || out.stride(0) >= H),
                    op, ": x and out must be contiguous in their last dimension (out's rows apart), found strides ",
                    shape_str(x.strides()), " and ", shape_str(out.strides()));
  cudaStream_t st = detail::stream();
  // scratch: x rounded [M, lda] BF16 | h [M, ldh] BF16 | partial sums (gate and up, then down)
  const int64_t lda = sk::a_width(vg.fmt, K), ldh = sk::a_width(vd.fmt, F);
  const int64_t a_bytes = round_up(M * lda * 2, 256), h_bytes = round_up(M * ldh * 2, 256);
  const int64_t p_floats = std::max(sk::gated_partial_floats(vg, M), sk::partial_floats(vd, M));
  uint8_t* base = static_cast<uint8_t*>(detail::scratch(device, size_t(a_bytes + h_bytes + p_floats * 4)));
  __nv_bfloat16* a16 = reinterpret_cast<__nv_bfloat16*>(base);
  __nv_bfloat16* h16 = reinterpret_cast<__nv_bfloat16*>(base + a_bytes);
  float* partial = reinterpret_cast<float*>(base + a_bytes + h_bytes);
  dq::rows_bf16(dq::RowsFrom::Plain, x.data_as<const float>(), nullptr, x.stride(0), nullptr, 1, nullptr, M, K, lda,
                a16, st);
  sk::GatedArgs ga;
  ga.a = a16;
  ga.lda = lda;
  ga.gate = vg;
  ga.up = vu;
  ga.M = M;
  ga.h = h16;
  ga.ldh = ldh;
  ga.partial = partial;
  ga.arrivals = detail::zeroed_counters(device);
  sk::gated(ga, st);
  sk::GemmArgs gd;
  gd.a = h16;
  gd.lda = ldh;
  gd.w = vd;
  gd.M = M;
  gd.d = out.data_as<float>();
  gd.ldd = M > 1 ? out.stride(0) : H;
  gd.accumulate = accumulate;
  gd.partial = sk::partial_floats(vd, M) ? partial : nullptr;
  gd.arrivals = ga.arrivals;
  sk::gemm(gd, st);
  done = true;
}

bool linear_fp8_supported(int device) {
  if (device < 0 || device >= device_count()) return false;
  return tc::fp8_gemm_built_for(detail::compute_capability(device));
}

// ops::linear_fp8 (ops.h): the activation rows quantized per 128 inputs (quant.h), then
// CUTLASS's blockwise-scaled FP8 GEMM (cutlass/fp8_gemm.h) over the checkpoint's E4M3 codes
// and block scales, read in place when their layout allows (16-byte aligned rows, K % 16 ==
// 0, N % 4 == 0, contiguous scales), else from padded copies in scratch. M is padded to a
// multiple of 4 (the scales' TMA rows); the rows past M and the staged store as linear_bf16.
void linear_fp8(const Tensor& x, const ops::Weight& w, Tensor& y, bool accumulate) {
  const WeightView v = check_tc_args(x, w, y, "cuda::linear_fp8", 4, 16);
  DFLASH2_CHECK_ARG(v.fmt == WFmt::FP8, "cuda::linear_fp8(", w.name, "): the weight must be FP8 block-128");
  const int device = x.device().index;
  const int64_t M = x.shape(0), K = v.K, N = v.N;
  detail::DeviceGuard guard(device);
  const int sm = detail::compute_capability(device);
  if (!tc::fp8_gemm_built_for(sm))
    fail(ErrorKind::Unsupported, "cuda::linear_fp8: this build has no FP8 block-128 tensor-core GEMM for sm_", sm,
         " on cuda:", device, " (the CUTLASS kernels are built for sm_90a / sm_100a / sm_103a when they are in "
         "DFLASH2_CUDA_ARCHS and CUTLASS is found); use prefill_gemm='bf16' or 'exact'");
  if (M == 0 || N == 0) return;
  if (K == 0) return empty_k(y, M, N, accumulate, "linear_fp8");

  const int64_t Mp = round_up(M, 4), Kp = round_up(K, 16), Np = round_up(N, 4);
  const int64_t nbk = (K + 127) / 128, nbn = (N + 127) / 128;
  const bool direct_w = K % 16 == 0 && N == Np && detail::aligned(v.data, 16) && v.row_bytes % 16 == 0;
  const bool direct_s = v.scale_stride == nbk;
  const bool direct_y = M == Mp && N == Np && detail::aligned(y.data(), 16) && (M == 1 || y.stride(0) % 4 == 0);
  constexpr int64_t kAlign = 256;
  const int64_t a_bytes = round_up(Mp * Kp, kAlign);
  const int64_t sa_bytes = round_up(nbk * Mp * 4, kAlign);
  const int64_t w_bytes = direct_w ? 0 : round_up(Np * Kp, kAlign);
  const int64_t s_bytes = direct_s ? 0 : round_up(nbn * nbk * 4, kAlign);
  const int64_t d_bytes = direct_y ? 0 : round_up(Mp * Np * 4, kAlign);

  tc::Fp8GemmArgs g;
  g.M = int(Mp);
  g.N = int(Np);
  g.K = int(Kp);
  g.lda = Kp;
  g.ldb = direct_w ? v.row_bytes : Kp;
  g.ldd = direct_y ? (M == 1 ? Np : y.stride(0)) : Np;
  g.accumulate = direct_y && accumulate;
  const size_t ws_bytes = size_t(round_up(int64_t(tc::fp8_gemm_workspace(sm, g)), kAlign));
  uint8_t* base = static_cast<uint8_t*>(
      detail::scratch(device, size_t(a_bytes + sa_bytes + w_bytes + s_bytes + d_bytes) + ws_bytes));
  uint8_t* a8 = base;
  float* sfa = reinterpret_cast<float*>(base + a_bytes);
  uint8_t* w8 = direct_w ? nullptr : base + a_bytes + sa_bytes;
  float* sfb = direct_s ? nullptr : reinterpret_cast<float*>(base + a_bytes + sa_bytes + w_bytes);
  float* dtmp = direct_y ? nullptr : reinterpret_cast<float*>(base + a_bytes + sa_bytes + w_bytes + s_bytes);
  void* ws = ws_bytes ? static_cast<void*>(base + a_bytes + sa_bytes + w_bytes + s_bytes + d_bytes) : nullptr;

  cudaStream_t st = detail::stream();
  detail::fp8_quantize_rows(x.data_as<const float>(), x.stride(0), M, K, Mp, Kp, a8, sfa, nullptr, 0, st);
  if (!direct_w) pad_fp8_codes<<<grid_for(Np * Kp), kThreads, 0, st>>>(v, Np, Kp, w8);
  if (!direct_s)
    pack_scales<<<grid_for(nbn * nbk), kThreads, 0, st>>>(static_cast<const float*>(v.scale), v.scale_stride, nbn, nbk,
                                                          sfb);
  detail::check_launch("linear_fp8 operand quantization", w.name, " ", x.describe());
  g.a = a8;
  g.sfa = sfa;
  g.b = direct_w ? static_cast<const void*>(v.data) : static_cast<const void*>(w8);
  g.sfb = direct_s ? static_cast<const float*>(v.scale) : sfb;
  g.d = direct_y ? y.data_as<float>() : dtmp;
  const std::string err = tc::fp8_gemm(sm, g, ws, st);
  if (!err.empty()) fail(ErrorKind::Backend, "cuda::linear_fp8(", w.name, "): ", err);
  detail::check_launch("linear_fp8 CUTLASS GEMM", w.name, " ", x.describe(), " -> ", y.describe());
  if (!direct_y) {
    store_rows<<<grid_for(M * N), kThreads, 0, st>>>(dtmp, Np, M, N, y.data_as<float>(), y.stride(0), accumulate);
    detail::check_launch("linear_fp8 store", w.name, " -> ", y.describe());
  }
}

bool linear_nvfp4_supported(int device) {
  if (device < 0 || device >= device_count()) return false;
  return tc::nvfp4_gemm_built_for(detail::compute_capability(device));
}

// ops::linear_nvfp4 (ops.h): the activation rows quantized to E2M1 with per-16 E4M3 scales
// (quant.h, the swizzled scale layout), the weight's scales in the same layout (prepared at
// load: Weight::sf_blocked; else swizzled per call, N x K / 16 bytes), its packed codes read in place when 16-byte aligned with K %
// 32 == 0 and N % 4 == 0 (else a padded copy), then CUTLASS's block-scaled tcgen05 GEMM with
// alpha = input_scale x weight_scale_2; the staged store as linear_bf16.
void linear_nvfp4(const Tensor& x, const ops::Weight& w, Tensor& y, bool accumulate) {
  const WeightView v = check_tc_args(x, w, y, "cuda::linear_nvfp4", 0, 32);
  DFLASH2_CHECK_ARG(v.fmt == WFmt::NVFP4, "cuda::linear_nvfp4(", w.name, "): the weight must be NVFP4");
  const int device = x.device().index;
  const int64_t M = x.shape(0), K = v.K, N = v.N;
  detail::DeviceGuard guard(device);
  const int sm = detail::compute_capability(device);
  if (!tc::nvfp4_gemm_built_for(sm))
    fail(ErrorKind::Unsupported, "cuda::linear_nvfp4: this build has no NVFP4 W4A4 tensor-core GEMM for sm_", sm,
         " on cuda:", device, " (the CUTLASS kernel is built for sm_100a / sm_103a when they are in "
         "DFLASH2_CUDA_ARCHS and CUTLASS is found; Hopper has no FP4 MMA); use prefill_gemm='bf16' or 'exact'");
  if (M == 0 || N == 0) return;
  if (K == 0) return empty_k(y, M, N, accumulate, "linear_nvfp4");

  const int64_t Kp = round_up(K, 32), Np = round_up(N, 4), sf_cols = layout::nvfp4_sf_cols(Kp);
  const bool direct_w = K % 32 == 0 && N == Np && detail::aligned(v.data, 16) && v.row_bytes % 16 == 0;
  const bool direct_y = N == Np && detail::aligned(y.data(), 16) && (M == 1 || y.stride(0) % 4 == 0);
  constexpr int64_t kAlign = 256;
  const int64_t a_bytes = round_up(M * Kp / 2, kAlign);
  const int64_t sfa_bytes = round_up(layout::nvfp4_sf_rows(M) * sf_cols, kAlign);
  const int64_t w_bytes = direct_w ? 0 : round_up(Np * Kp / 2, kAlign);
  // the weight's scales in the block-scaled layout: prepared at load (Weight::sf_blocked; the
  // same extent: nvfp4_sf_rows(Np) == _rows(N), nvfp4_sf_cols(Kp) == _cols(K)), else per call
  const bool sfb_ready = v.sf_blocked != nullptr;
  const int64_t sfb_bytes = sfb_ready ? 0 : round_up(layout::nvfp4_sf_rows(Np) * sf_cols, kAlign);
  const int64_t d_bytes = direct_y ? 0 : round_up(M * Np * 4, kAlign);

  tc::Nvfp4GemmArgs g;
  g.M = int(M);
  g.N = int(Np);
  g.K = int(Kp);
  g.lda = Kp;
  g.ldb = direct_w ? v.row_bytes * 2 : Kp;
  g.alpha = w.input_scale * w.global_scale;
  g.ldd = direct_y ? (M == 1 ? Np : y.stride(0)) : Np;
  g.accumulate = direct_y && accumulate;
  const size_t ws_bytes = size_t(round_up(int64_t(tc::nvfp4_gemm_workspace(sm, g)), kAlign));
  uint8_t* base = static_cast<uint8_t*>(
      detail::scratch(device, size_t(a_bytes + sfa_bytes + w_bytes + sfb_bytes + d_bytes) + ws_bytes));
  uint8_t* a4 = base;
  uint8_t* sfa = base + a_bytes;
  uint8_t* w4 = direct_w ? nullptr : base + a_bytes + sfa_bytes;
  uint8_t* sfb = base + a_bytes + sfa_bytes + w_bytes;
  float* dtmp = direct_y ? nullptr : reinterpret_cast<float*>(base + a_bytes + sfa_bytes + w_bytes + sfb_bytes);
  void* ws = ws_bytes ? static_cast<void*>(base + a_bytes + sfa_bytes + w_bytes + sfb_bytes + d_bytes) : nullptr;

  cudaStream_t st = detail::stream();
  DFLASH2_CUDA_CHECK(cudaMemsetAsync(sfa, 0, size_t(sfa_bytes + w_bytes + sfb_bytes), st));
  detail::nvfp4_quantize_rows(x.data_as<const float>(), x.stride(0), M, K, Kp, w.input_scale, a4, sfa, nullptr, 0, st);
  if (!direct_w) pad_fp4_codes<<<grid_for(Np * Kp / 2), kThreads, 0, st>>>(v, Np, Kp, w4);
  if (!sfb_ready) swizzle_fp4_scales<<<grid_for(N * (K / 16)), kThreads, 0, st>>>(v, sf_cols, sfb);
  detail::check_launch("linear_nvfp4 operand quantization", w.name, " ", x.describe());
  g.a = a4;
  g.sfa = sfa;
  g.b = direct_w ? static_cast<const void*>(v.data) : static_cast<const void*>(w4);
  g.sfb = sfb_ready ? v.sf_blocked : sfb;
  g.d = direct_y ? y.data_as<float>() : dtmp;
  const std::string err = tc::nvfp4_gemm(sm, g, ws, st);
  if (!err.empty()) fail(ErrorKind::Backend, "cuda::linear_nvfp4(", w.name, "): ", err);
  detail::check_launch("linear_nvfp4 CUTLASS GEMM", w.name, " ", x.describe(), " -> ", y.describe());
  if (!direct_y) {
    store_rows<<<grid_for(M * N), kThreads, 0, st>>>(dtmp, Np, M, N, y.data_as<float>(), y.stride(0), accumulate);
    detail::check_launch("linear_nvfp4 store", w.name, " -> ", y.describe());
  }
}

Tensor nvfp4_blocked_scales(const ops::Weight& w) {
  DFLASH2_CHECK_ARG(w.data.defined() && w.data.device().is_cuda(), "cuda::nvfp4_blocked_scales(", w.name,
                    "): the weight must be on a GPU, found ", w.data.describe());
  const int device = w.data.device().index;
  ops::Weight plain = w;
  plain.sf_blocked = Tensor();
  const WeightView v = detail::weight_view(plain, device, "cuda::nvfp4_blocked_scales");
  DFLASH2_CHECK_ARG(v.fmt == WFmt::NVFP4 && v.K % 16 == 0, "cuda::nvfp4_blocked_scales(", w.name,
                    "): the weight must be NVFP4");
  detail::DeviceGuard guard(device);
  const int64_t cols = layout::nvfp4_sf_cols(v.K);
  Tensor out = Tensor::empty(DType::U8, {layout::nvfp4_sf_rows(v.N) * cols}, w.data.device());
  cudaStream_t st = detail::stream();
  DFLASH2_CUDA_CHECK(cudaMemsetAsync(out.data(), 0, size_t(out.numel()), st));
  if (v.N > 0 && v.K > 0) {
    swizzle_fp4_scales<<<grid_for(v.N * (v.K / 16)), kThreads, 0, st>>>(v, cols, out.data_as<uint8_t>());
    detail::check_launch("nvfp4_blocked_scales", w.name);
  }
  DFLASH2_CUDA_CHECK(cudaStreamSynchronize(st));  // read by other threads' streams afterwards
  return out;
}

}  // namespace dflash2::cuda
