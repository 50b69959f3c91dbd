// cuda/gemm_dq.h: the mainloop-dequantizing tensor-core GEMM (gemm_dq.cu), grouped or not.
//
//   d[row(p), n] (F32) (+)= sum_k a[p, k] * bf16(W_g[n, k])   for p in group g's rows
//
// a: BF16 rows (the activations rounded once, by one of the producers below); W_g: group g's
// weight in its stored format (BF16 / F16 / F32 / FP8 block-128 / NVFP4), dequantized inside
// the k-loop exactly as the CPU dequantizes it (weight_view.cuh w_at: E2M1 x E4M3 x global
// for NVFP4, E4M3 x block scale for FP8) and rounded to BF16: the numerics of ops::linear_bf16
// (the CPU emulation is the oracle, up to fp32 summation order). BF16 tensor cores with fp32
// accumulators: on compute capability 9.0 wgmma (sm_90a's warpgroup MMA) unless
// ops::dq_wgmma() is off, elsewhere mma.sync m16n8k16, which every architecture the build
// targets has. The device, not M, picks the form: every row on one GPU takes one kernel.
// Used for the routed experts' prompt chunks (moe_experts with GemmNumerics::BF16: one group
// per expert, the groups' rows counted on the device) and for linear_bf16 over NVFP4 and FP8
// weights on every architecture, whatever M (the weight is read once, in its stored format,
// instead of being dequantized into a BF16 copy first).
//
// Status: compiled for sm_90a / sm_100a / sm_103a, NOT yet run on a GPU.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/weight_view.cuh"

namespace dflash2::cuda::dq {

struct GemmArgs {
  // A: row p at a + p * lda; 16-byte aligned, lda % 8 == 0, zeros in [K, round_up(K, 8)).
  const __nv_bfloat16* a = nullptr;
  int64_t lda = 0;
  // The weights: every group's has the format `fmt`, [N, K]. groups == 1 and table ==
  // nullptr: `one`; else group g's is the device-side table[g * table_stride].
  detail::WeightView one{};
  const detail::WeightView* table = nullptr;
  int64_t table_stride = 1;
  detail::WFmt fmt = detail::WFmt::BF16;
  bool vec = false;  // every group's rows allow the vector loads (detail::weight_rows_vectorizable)
  // Rows: start == nullptr: one group, rows [0, M); else group g holds rows [start[g],
  // start[g + 1]) (device, ascending, start[groups] <= M) and tile_start is device scratch
  // of groups + 1 ints.
  int groups = 1;
  const int32_t* start = nullptr;
  int32_t* tile_start = nullptr;
  int64_t M = 0, N = 0, K = 0;
  // D: row p of the product goes to d + row * ldd, row = d_rows ? d_rows[p] : p.
  float* d = nullptr;
  int64_t ldd = 0;
  const int32_t* d_rows = nullptr;
  bool accumulate = false;
};

// Queues the GEMM on `s` (no host synchronization, no allocation: graph-safe). Throws
// InvalidArgument on arguments the kernel cannot take (checked on the host: alignment,
// extents, K > 0).
void gemm(const GemmArgs& g, cudaStream_t s);

// Whether linear_bf16 takes this kernel for NVFP4 and FP8 weights (default on); the engine's
// load-time check turns it off in the process if the kernel fails there.
bool linear_enabled();

// The A producers: a[p, k] for p < rows, k < lda (zeros for K <= k < lda), rounded to BF16
// (round to nearest even), with rows p >= *used skipped when used != nullptr (device):
enum class RowsFrom : int {
  Plain = 0,   // x[p * ldx + k]
  Gather = 1,  // x[(order[p] / div) * ldx + k]   (the routed experts' gate / up input)
  SiluMul = 2, // silu(x[p * ldx + k]) * u[p * ldx + k], the CPU's silu_mul then rounded
};
void rows_bf16(RowsFrom from, const float* x, const float* u, int64_t ldx, const int32_t* order, int div,
               const int32_t* used, int64_t rows, int64_t K, int64_t lda, __nv_bfloat16* a, cudaStream_t s);

}  // namespace dflash2::cuda::dq
