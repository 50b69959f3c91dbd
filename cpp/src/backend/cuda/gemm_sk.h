// cuda/gemm_sk.h: the skinny tensor-core GEMM of generated tokens (gemm_sk.cu), the kernel of
// ops::linear_bf16(..., decode = true): decode and verify chunks under decode_gemm = "bf16"
// (and the non-FP8 / non-W4A4 weights of "fp8" / "nvfp4"), and the DFlash drafter's small
// draft batches.
//
//   d[m, n] (F32) (+)= sum_k a[m, k] * bf16(W[n, k])
//
// The numerics of ops::linear_bf16 (BF16 operands, fp32 sums; the CPU emulation is the
// oracle up to fp32 summation order), for the few rows of a decode step: the weight (any
// format: BF16 / F16 / F32 / FP8 block-128 / NVFP4, dequantized in registers exactly as the
// CPU dequantizes it) is the MMA's A operand, 16 output features per warp, so its bytes are
// read once per 32 tokens straight from global memory, and K is split over up to 32 CTAs
// (layout::sk_splits: a function of N, K and the format, never of M) whose partial sums a
// second kernel adds in split order. A token's result depends on nothing but its own row:
// decode == verify, bitwise, which lossless speculation needs.
//
// Status: compiled for sm_90a / sm_100a / sm_103a, NOT yet run on a GPU.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/weight_view.cuh"

namespace dflash2::cuda::sk {

struct GemmArgs {
  // A: row m at a + m * lda, 16-byte aligned, lda >= a_width(fmt, K), zeros in [K, lda).
  const __nv_bfloat16* a = nullptr;
  int64_t lda = 0;
  detail::WeightView w{};
  bool vec = false;  // detail::weight_rows_vectorizable(w)
  int64_t M = 0;
  // D: row m at d + m * ldd.
  float* d = nullptr;
  int64_t ldd = 0;
  bool accumulate = false;
  // splits(w) > 1: scratch of partial_floats(w, M) floats (16-byte aligned)
  float* partial = nullptr;
};

// Inputs per 16-byte segment of the weight's format (8 / 16 / 32), and the A width the
// kernel reads (K rounded up to whole k-stages).
int seg_elems(detail::WFmt f);
int64_t a_width(detail::WFmt f, int64_t K);
int splits(const detail::WeightView& w);
int64_t partial_floats(const detail::WeightView& w, int64_t M);

// Queues the GEMM on `s` (no host synchronization, no allocation: graph-safe). Throws
// InvalidArgument on arguments the kernel cannot take.
void gemm(const GemmArgs& g, cudaStream_t s);

// Whether linear_bf16(..., decode = true) takes this kernel (default on); the engine's
// load-time check turns it off in the process if the kernel fails there (decode chunks then
// take the prompt chunks' kernels, whose rows are batch-invariant too).
bool enabled();
void set_enabled(bool on);

}  // namespace dflash2::cuda::sk
