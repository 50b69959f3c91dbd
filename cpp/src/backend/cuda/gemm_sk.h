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
#include "dflash2/tensor.h"

namespace dflash2::cuda::sk {

struct GemmArgs {
  // A: row m at a + m * lda, 16-byte aligned, lda >= a_width(fmt, K), zeros in [K, lda).
  const __nv_bfloat16* a = nullptr;
  int64_t lda = 0;
  // 0: A is bf16(x) (linear_bf16's numerics). Else the exact form (linear's numerics on the
  // tensor cores, ops::exact_tc): A's row m holds split_x3's three planes of x at a + m * lda
  // + p * plane (plane >= a_width(fmt, K), lda >= 3 * plane), W is BF16 / FP8 / NVFP4
  // (takes_x3), and d = sum_k x[m, k] W[n, k] with every product exact (below).
  int64_t plane = 0;
  detail::WeightView w{};  // 16-byte segment loads where detail::rows_aligned16(w)
  int64_t M = 0;
  // D: row m at d + m * ldd.
  float* d = nullptr;
  int64_t ldd = 0;
  bool accumulate = false;
  // splits(w) > 1: scratch of partial_floats(w, M) floats (16-byte aligned)
  float* partial = nullptr;
  // detail::zeroed_counters of the launching stream's device: each split's last CTA adds the
  // partial sums (no second kernel) where they cover the grid; nullptr: a reduction kernel
  uint32_t* arrivals = nullptr;
};

// Inputs per 16-byte segment of the weight's format (8 / 16 / 32), and the A width the
// kernel reads (K rounded up to whole k-stages).
int seg_elems(detail::WFmt f);
int64_t a_width(detail::WFmt f, int64_t K);

// The exact form (GemmArgs::plane != 0): linear's fp32 numerics on BF16 tensor cores. x is
// split into three BF16 planes whose sum is x exactly (hi = bf16(x), mid = bf16(x - hi), lo =
// bf16(x - hi - mid)); the weight operand is exact in BF16 (BF16 as stored; FP8 codes, each
// 128-input block's sums then times its scale with one fused multiply-add; NVFP4's E2M1 x
// E4M3 values, the sums times the global scale at the end), so every product is exact and
// only the fp32 sums round: the result agrees with the CPU's linear to fp32 summation order
// (not bitwise), and, as in the BF16 form, a row's result depends on its own x only (the
// tile, split and order are functions of N, K and the format). 8 tokens per CTA for FP8 /
// NVFP4 (layout::sk_tok), 16 for BF16 (the three planes' stage tiles in 24 KiB of shared
// memory): more rows are more CTAs reading the same weight slice (from L2 when they run
// together). F32 / F16 weights stay on linear's SIMT kernel.
bool takes_x3(detail::WFmt f);
// a's three planes of x F32 [M, K] (row stride ldx): plane p of row m at a + m * lda + p *
// plane, zeros for K <= k < plane (plane >= a_width, plane % 8 == 0, lda >= 3 * plane).
void split_x3(const float* x, int64_t ldx, int64_t M, int64_t K, __nv_bfloat16* a, int64_t lda, int64_t plane,
              cudaStream_t s);
// The same for gathered rows: row m of A is x row order[m] / div, rows m < *used (device;
// nullptr: all M), the others untouched (the grouped kernel's rows in expert order).
void split_x3_gather(const float* x, int64_t ldx, const int32_t* order, int div, const int32_t* used, int64_t M,
                     int64_t K, __nv_bfloat16* a, int64_t lda, int64_t plane, cudaStream_t s);
int splits(const detail::WeightView& w);
int64_t partial_floats(const detail::WeightView& w, int64_t M);

// Queues the GEMM on `s` (no host synchronization, no allocation: graph-safe). Throws
// InvalidArgument on arguments the kernel cannot take.
void gemm(const GemmArgs& g, cudaStream_t s);
// gs[0 .. n) (2 <= n <= 4: one format, one A and lda, M <= 256 rows) as one launch, each
// weight's results bitwise its own gemm's (a split weight's partial sums in its own scratch;
// the split weights share one arrival counter array, covering the whole grid). False (nothing
// queued) where they cannot: the caller runs gemm on each.
bool gemm_many(const GemmArgs* gs, int n, cudaStream_t s);

// A gated MLP's first half for generated tokens (ops::gated_mlp with BF16 numerics, decode):
//   h[m, n] = bf16(silu(sum_k a[m, k] bf16(W_gate[n, k])) * sum_k a[m, k] bf16(W_up[n, k]))
// (detail::silu_mul; zeros for N <= n < ldh): the gate and up products exactly as gemm()
// computes them (same split, same order), added and combined by up's last CTAs (or a reduction
// kernel), so h is bitwise what linear_bf16(decode) x 2, silu_mul and the down projection's BF16 rounding make.
// gate and up share format and shape [N, K]. Rows 256 at a time (the partial buffer's size).
struct GatedArgs {
  const __nv_bfloat16* a = nullptr;  // as GemmArgs::a
  int64_t lda = 0;
  detail::WeightView gate{}, up{};
  int64_t M = 0;
  __nv_bfloat16* h = nullptr;  // row m at h + m * ldh, ldh >= N
  int64_t ldh = 0;
  float* partial = nullptr;    // gated_partial_floats(gate, M) floats, 16-byte aligned
  uint32_t* arrivals = nullptr;  // as GemmArgs::arrivals: up's last CTAs write h
};
int64_t gated_partial_floats(const detail::WeightView& gate, int64_t M);
void gated(const GatedArgs& g, cudaStream_t s);

// Grouped (the routed experts of decode chunks, moe_experts with BF16 numerics and decode):
//   P = 1: d[row(p), n] = sum_k a[p, k] * bf16(W_e[n, k])
//   P = 2: silu[p, n] = bf16(silu(sum_k a[p, k] bf16(W_e,0[n, k])) * sum_k a[p, k] bf16(W_e,1[n, k]))
//          (the experts' gate and up in one launch, reduced straight into the down input:
//          detail::silu_mul, as dq::rows_bf16(SiluMul) makes it from the two sums; zeros for
//          N <= n < ld_silu)
// for p in group e's rows [start[e], start[e + 1]), over the active groups active[1 ..
// active[0]] (device data: the expert lists of moe.cu), every weight [N, K] in format `fmt`,
// W_e,j at table[e * table_stride + j * proj_stride] (device). One CTA per (projection, 64
// features, split, active group) runs its group's rows 32 at a time; the split over K is
// group_splits(fmt, N, K, P) (aimed at layout::kSkGroups groups of one token tile: a
// function of N, K, the format and P, never of the batch), the partial sums added in split
// order by a second kernel (rows p < start[groups]). Graph-safe, no host synchronization.
struct GroupedArgs {
  const __nv_bfloat16* a = nullptr;  // row p at a + p * lda, as GemmArgs::a
  int64_t lda = 0;
  int64_t plane = 0;  // as GemmArgs::plane: the exact form (linear's numerics) when != 0
  const detail::WeightView* table = nullptr;
  int64_t table_stride = 1;
  detail::WFmt fmt = detail::WFmt::BF16;
  bool vec = false;  // detail::rows_aligned16 holds for every group's weight (16-byte loads)
  int64_t N = 0, K = 0;
  int groups = 0;
  const int32_t* start = nullptr;   // [groups + 1], ascending
  const int32_t* active = nullptr;  // [1 + groups]: count, then the active groups
  int max_active = 0;               // a bound on active[0] the host knows (min(groups, M))
  int64_t M = 0;                    // >= start[groups]: the rows of all groups
  int projections = 1;              // P: 1 (d), or 2 (silu)
  float* d = nullptr;               // P = 1
  int64_t ldd = 0;
  const int32_t* d_rows = nullptr;  // P = 1; nullptr: row p of d
  int64_t proj_stride = 0;          // P = 2: projection 1's views at table + proj_stride
  __nv_bfloat16* silu = nullptr;    // P = 2: row p at silu + p * ld_silu, ld_silu >= N
  int64_t ld_silu = 0;
  // P = 2: 0, silu = bf16(silu(gate) * up); else its fp32 value as three planes (split_x3's
  // form: the next exact-form GEMM's A) at silu + p * ld_silu + q * silu_plane (silu_plane >=
  // N, a multiple of 8; ld_silu >= 3 x silu_plane), zeros for N <= n < silu_plane
  int64_t silu_plane = 0;
  float* partial = nullptr;         // grouped_partial_floats(fmt, N, K, M, P) floats, 16-byte aligned
  // detail::zeroed_counters of the launching stream's device, or nullptr: where M x the
  // feature blocks fit them, each tile's last CTA writes its results (no reduction kernel)
  uint32_t* arrivals = nullptr;
};
int group_splits(detail::WFmt f, int64_t N, int64_t K, int P);
int64_t grouped_partial_floats(detail::WFmt f, int64_t N, int64_t K, int64_t M, int P);
void grouped_gemm(const GroupedArgs& g, cudaStream_t s);

// ys[i] (+)= x W_i^T for n weights of one K (x F32 [M, K] on the current device and stream,
// contiguous rows; ys[i] F32 [M, N_i] with contiguous rows, checked by the caller): x staged
// once for all of them as A (x3: split_x3's three planes, the exact form; else bf16(x), the
// BF16 form), then each weight's gemm (its split's partial sums in its own part of the
// scratch), up to four of one format in one gemm_many launch where their outputs are
// disjoint. ops::linear_bf16's decode path (gemm_tc.cu) and linear's exact form (exact_tc).
void linears(const Tensor& x, const detail::WeightView* vs, Tensor* const* ys, size_t n, bool accumulate, bool x3);

// Whether linear_bf16(..., decode = true) and moe_experts' decode chunks (BF16 numerics) take
// these kernels (default on); the engine's load-time check turns them off in the process if
// either fails there (decode chunks then take the prompt chunks' kernels, whose rows are
// batch-invariant too).
bool enabled();
void set_enabled(bool on);

}  // namespace dflash2::cuda::sk
