// cuda/moe.cu: the MoE ops of the CUDA backend: moe_route (sigmoid routing with a
// correction bias, group-limited top-k) and moe_experts (the routed experts of one layer
// and their weighted combine). Semantics: dflash2/ops.h; oracle: cpu/moe.cpp.
//
// Status: compiled for sm_90a/sm_100a/sm_103a, NOT yet run on a GPU. The routing logic and
// the workspace layout (moe_route.h) are unit-tested on the CPU against the CPU backend by
// tests/cpp/test_cuda_moe.cpp; the kernels are checked against the CPU backend by that test
// and tests/test_ops.py when a GPU is present.
//
// moe_route: one block per token (grid-strided past 2^20 tokens), shared memory holding
//   the token's scores; the phases of moe_route.h (sigmoid, group top-2 sums, group rank,
//   expert rank by counting, ascending compaction, serial denominator, weights), each a loop
//   of the block's threads over independent items calling the __host__ __device__
//   functions the CPU test checks. Ranks are counted (O(E^2 / threads) comparisons of
//   shared values, ~256 per thread for E = 256, in four independent counts: rank_of4), which
//   gives exactly the CPU's partial_sort membership with ties to the lower id; the chosen
//   experts are compacted by one warp with ballots (E / 32 steps). On an H200 (2026-12-04)
//   the kernel took ~22 us per token, at T = 1 as at T = 256 (one block's latency: its rank
//   loop one dependent shared-memory load after another, and a count_below loop of up to E
//   steps per thread); not yet measured since. logits F32 [T, E] rows contiguous
//   (any row stride), bias F32 [E] (any stride), ids I32 / weights F32 [T, top_k] rows
//   contiguous (any row stride). E <= 2048.
//   Numerics: the CPU's fp32 operations in the CPU's order (sigmoid 1 / (1 + expf(-x)),
//   choice = s + bias, top-2 sum, denominator summed over the chosen experts in ascending
//   id order from 0, + 1e-20, s / denom, * routed_scaling_factor): no multiply-add pair
//   exists to be contracted into an FMA. expf is CUDA's (within 2 ulp of glibc's), so the
//   weights are equal to the CPU's or within a few ulp, and a discrete decision can differ
//   only between experts whose scores are within an ulp or two; bitwise-equal logits give
//   bitwise-equal scores, so exact ties are broken exactly as on the CPU.
//
// moe_experts: four launches, no host synchronization (the ids are device data):
//   1 list     one block: counts the slots (t, j) of each expert held here (integer
//              atomics: the counts are exact), a warp scans them into start[] and the
//              ascending list of active experts, then one warp fills order[] with
//              __match_any_sync so each expert's slots stay in ascending slot order
//              (deterministic). A slot whose id is outside [first, first + E) -- another
//              rank's expert, or an invalid id, which the CPU rejects with an error but a
//              kernel cannot -- is in no list and contributes nothing.
//   2 gate/up  grid (F / 8 row tiles, active experts): block y takes the y-th active expert
//              (grid-stride over the active list, whose length is device data), each warp
//              one output row r of gate and up, and walks the expert's slots in chunks of 4
//              tokens: the lanes stride over H in 8-element pieces (one 4-32 byte
//              dequantizing load of the weight, weight_view.cuh), accumulate in fp32 for
//              each token of the chunk, reduce by warp butterfly, and write
//              h[slot, r] = silu(g) * u with the CPU's (g / (1 + expf(-g))) * u.
//   3 down     the same kernel over the down weights: y[slot, :] = h[slot, :] @ W_down^T.
//   4 combine  out[t, d] = sum_j weights[t, j] * y[t * top_k + j, d] over the slots held
//              here, j ascending from 0.0f, with the CPU's fp32 rounding (__fmul_rn then
//              __fadd_rn): no atomics, deterministic; accumulating (the residual stream),
//              out[t, d] + that sum, one more __fadd_rn.
//   Each (slot, output row) dot product has a fixed order (lane partial sums, then the
//   butterfly) independent of how many tokens share the expert or the step: a token's
//   result does not depend on the batch (decode == verify). Against the CPU the sums are
//   in a different order (fp32 both), well inside the NMSE thresholds.
//   Workspace (moe_route.h moe_ws_layout): y [n, H], h [n, F(+pad)], then the I32 lists;
//   n = T * top_k; it fits in ops::moe_workspace_floats(T, top_k, H, F, E) floats.
//   x, out F32 [T, H] rows contiguous (any row stride); ids I32, weights F32 [T, top_k]
//   rows contiguous. Weights: any ops::Weight format (dense F32 / BF16 / F16, FP8
//   block-128, NVFP4) with any row stride (tensor-parallel row / column slices), but one
//   format for every gate and up weight of the layer and one for every down weight.
//
//   The experts' WeightViews live in a device array built on the first call with a given
//   set of expert weights (one cudaMalloc + a copy on the current stream, waited for) and
//   cached per device for the life of the process, keyed by the full content of the views
//   (every pointer, stride, format and scale of every expert, compared exactly). A call
//   first tries the table stored for its ExpertWeights object (address, device), verified
//   by an exact signature of every field the views are built from (expert_table); only a
//   mismatch rebuilds, hashes and looks up the views. Building is
//   refused while the current stream is being captured into a CUDA graph (Backend error):
//   run one eager step first, which builds every layer's array. A cached array is never
//   freed (3 * E * 64 bytes per layer: 49 KB for 256 experts), so a captured graph can
//   always read it; weights freed and reloaded at new addresses simply get a new entry.
//
// moe_experts_fp8 (ops.h moe_experts with GemmNumerics::FP8: prompt chunks of FP8
//   checkpoints; the CPU's emulation in cpu/moe.cpp is its oracle): after the list kernel, the
//   slots in the lists' order (position p = order[p]'s row) are the rows of three grouped
//   GEMMs with one group per expert, [start[e], start[e + 1]) (cutlass/fp8_grouped_gemm.h):
//   a warp per (p, 128 inputs) gathers x[order[p] / top_k] and quantizes it (quant_device.cuh:
//   scale amax / 448, E4M3 codes; the group's scales MN-major at sfa + nbk * start[e], or
//   K-major per row for the Blackwell kernel); gate
//   and up grouped GEMMs -> G, U [n, F] F32; silu(G) * U (the CPU's formula) quantized the same
//   way; the down grouped GEMM -> Y [n, H]; a scatter to slot order (y) and the combine above.
//   The operand buffers come from the per-stream scratch; nothing waits for the host.
//
// moe_experts_bf16 (ops.h moe_experts with GemmNumerics::BF16: prompt chunks in the other
//   tensor-core modes, any expert format; cpu/moe.cpp's emulation is its oracle): the same
//   positions are the rows of three grouped launches of gemm_dq.h's mainloop-dequantizing
//   BF16 GEMM (group g = expert g, weights from the expert table's views, NVFP4 / FP8
//   dequantized in the k-loop): x[order[p] / top_k] rounded to BF16 by a gather pass; gate
//   and up -> G, U [n, F] F32; silu(G) * U (the CPU's formula) rounded to BF16; down written
//   straight to y's slot rows (row map order[p]); then the combine above. Decode chunks
//   (decode = true, while sk::enabled()) run them on gemm_sk.h's skinny grouped kernel
//   instead (CTAs over the active list, 32-token tiles, K split by N and K only; gate and
//   up in one launch, whose reduction writes bf16(silu(gate) * up) straight).
//
// moe_experts_nvfp4 (ops.h moe_experts with GemmNumerics::NVFP4: prompt chunks of NVFP4
//   checkpoints on sm_100a / sm_103a; cpu/moe.cpp's emulation is its oracle): the same
//   positions are the rows of three CUTLASS block-scaled grouped GEMMs
//   (cutlass/nvfp4_grouped_gemm.h): a setup kernel writes each group's first scale row
//   (groups padded to 128 rows), alpha = input_scale x weight_scale_2 and the input scale per
//   expert; quant.h's grouped quantizer writes E2M1 codes and E4M3 scales with each row's own
//   expert's input scale; the weight scales in the block-scaled layout, prepared at load
//   (ops::prepare_nvfp4_scales; else swizzled into scratch per projection); down -> Y, a
//   scatter to slot order, the combine.
//
// Performance (decode, T * top_k small): each active expert's gate/up/down weights are
// read once per chunk of 4 tokens, by warps streaming rows with 8-element vector loads, each
// lane fetching gemv_ahead chunks (~128 bytes of weight) before it decodes the first
// (weight_view.cuh w_fetch8 / w_decode8; the sums bitwise as one chunk at a time). On an
// H200 (2026-12-04), one chunk at a time, a decode token's 8 FP8 experts took 241 us at
// 1251 GB/s (0.30 of copy); the prefetch is not yet measured. The expert list costs one
// tiny single-block launch. Ideas, roughly in order of value:
//   - prefill (many tokens per expert): done as grouped GEMMs for FP8 and NVFP4 W4A4
//     (CUTLASS) and BF16 numerics (gemm_dq.cu); left: silu * up fused into the gate/up
//     epilogue and the combine into the down epilogue. In exact mode weights are still re-read (from L2) once per 4
//     tokens and x rows once per output row.
//   - decode: 16-byte weight loads for FP8 / NVFP4 (16 / 32 elements per lane, which changes
//     the sums' order), two rows per warp, split-K for the down projection (K = F is short:
//     8 chunks per lane at F = 2048), and a cooperative
//     multi-warp list kernel for prefill-sized T (the fill is one warp, ~n / 32 steps);
//   - registers (ptxas, __launch_bounds__(256, 2): 2 blocks of 256 per SM): the prefetching
//     (aligned-row) variants take 112-128, with 4 bytes of spills in sm_90a's FP8 gate/up
//     and 12-16 in sm_100a's NVFP4 / BF16 / F16 gate/up; the element-load fallbacks 64-128.
//     Before the prefetch, 56-85 on sm_90a; __launch_bounds__(256, 3) capped them at 80
//     with 8-32 bytes of spills. Which occupancy is faster is for a GPU to measure.
//     (e2m1_to_f32 decodes from the bits now: no local-memory table, no stack frame);
//   - fuse the list into moe_route (it already knows each token's experts) and the
//     combine into the down kernel's epilogue when top_k slots of a token are in one CTA.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cfloat>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_api.h"
#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/gemm_dq.h"
#include "backend/cuda/gemm_sk.h"
#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/layout.h"
#include "backend/cuda/moe_route.h"
#include "backend/cuda/quant_device.cuh"
#include "backend/cuda/scratch.h"
#include "backend/cuda/weight_view.cuh"
#if defined(DFLASH2_WITH_CUTLASS)
#include "backend/cuda/cutlass/fp8_grouped_gemm.h"
#include "backend/cuda/cutlass/nvfp4_grouped_gemm.h"
#include "backend/cuda/quant.h"
#include "backend/cuda/device_attr.cuh"
#endif
#include "dflash2/error.h"

namespace dflash2::cuda {

namespace {

using detail::WeightView;
using detail::WFmt;

// ------------------------------------------------------------------ moe_route
constexpr int kRouteMaxE = 2048;

__global__ void __launch_bounds__(detail::kMaxThreads)
    moe_route_kernel(const float* __restrict__ logits, int64_t l_stride, const float* __restrict__ bias,
                     int64_t b_stride, moe::RouteParams p, int32_t* __restrict__ ids, int64_t i_stride,
                     float* __restrict__ weights, int64_t w_stride, int64_t T) {
  detail::pdl_enter();
  extern __shared__ float smem[];
  const int E = p.E, G = p.G, K = p.K, per = p.E / p.G;
  float* s = smem;                                           // [E]
  float* choice = s + E;                                     // [E]
  float* gs = choice + E;                                    // [G]
  int32_t* chosen = reinterpret_cast<int32_t*>(gs + G);      // [E]
  int32_t* sel = chosen + E;                                 // [K]
  float* denom_sh = reinterpret_cast<float*>(sel + K);       // [1]
  const int tid = threadIdx.x, nt = blockDim.x;
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const float* lg = logits + t * l_stride;
    for (int e = tid; e < E; e += nt) {  // 1
      s[e] = moe::sigmoid(lg[e]);
      choice[e] = s[e] + bias[int64_t(e) * b_stride];
    }
    __syncthreads();
    if (G > 1) {
      for (int g = tid; g < G; g += nt) gs[g] = moe::top2_sum(choice + g * per, per);  // 2
      __syncthreads();
      for (int e = tid; e < E; e += nt)  // 3
        if (!moe::group_kept(gs, p, e)) choice[e] = -INFINITY;
      __syncthreads();
    }
    for (int e = tid; e < E; e += nt) chosen[e] = moe::rank_of4(choice, E, e) < K ? 1 : 0;  // 4
    __syncthreads();
    if (tid < 32) {  // 5: the chosen experts in ascending order, 32 at a step (one warp)
      int below = 0;
      for (int base = 0; base < E; base += 32) {
        const int e = base + tid;
        const bool c = e < E && chosen[e] != 0;
        const unsigned b = __ballot_sync(0xffffffffu, c);
        if (c) sel[below + __popc(b & ((1u << tid) - 1u))] = e;
        below += __popc(b);
      }
    }
    __syncthreads();
    if (tid == 0) {  // 6
      float denom = 0.0f;
      for (int j = 0; j < K; ++j) denom = __fadd_rn(denom, s[sel[j]]);
      *denom_sh = __fadd_rn(denom, 1e-20f);
    }
    __syncthreads();
    const float denom = *denom_sh;
    for (int j = tid; j < K; j += nt) {  // 7
      const int e = sel[j];
      ids[t * i_stride + j] = e;
      weights[t * w_stride + j] = moe::route_weight(s[e], denom, p.norm, p.scale);
    }
    __syncthreads();  // the next token reuses the shared arrays
  }
}

// ------------------------------------------------------------------ moe_experts
struct ExpertView {
  WeightView gate, up, down;
};

constexpr int kListThreads = 1024;
constexpr int kGemvWarps = 8;  // output rows per block
constexpr int kGemvThreads = 32 * kGemvWarps;
constexpr int kTokChunk = 4;   // tokens per pass over a weight row

// The expert (index here) of slot i, or -1 when it is held elsewhere (or invalid).
__device__ __forceinline__ int local_expert(const int32_t* ids, int64_t i_stride, int K, int64_t i, int64_t first,
                                            int E) {
  const int64_t t = i / K, j = i - t * K;
  const int64_t e = int64_t(ids[t * i_stride + j]) - first;
  return e >= 0 && e < E ? int(e) : -1;
}

__global__ void __launch_bounds__(kListThreads)
    moe_list_kernel(const int32_t* __restrict__ ids, int64_t i_stride, int K, int64_t n, int64_t first, int E,
                    int32_t* start, int32_t* cursor, int32_t* active, int32_t* order) {
  detail::pdl_enter();
  const int tid = threadIdx.x, lane = tid & 31;
  for (int e = tid; e < E; e += blockDim.x) cursor[e] = 0;
  __syncthreads();
  for (int64_t i = tid; i < n; i += blockDim.x) {
    const int e = local_expert(ids, i_stride, K, i, first, E);
    if (e >= 0) atomicAdd(&cursor[e], 1);
  }
  __syncthreads();
  if (tid < 32) {  // exclusive scan of the counts, and the ascending list of active experts
    int run = 0, nact = 0;
    for (int base = 0; base < E; base += 32) {
      const int e = base + lane;
      const int c = e < E ? cursor[e] : 0;
      int incl = c;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += v;
      }
      const unsigned act = __ballot_sync(0xffffffffu, c > 0);
      if (e < E) {
        start[e] = run + incl - c;
        cursor[e] = run + incl - c;
        if (c > 0) active[1 + nact + __popc(act & ((1u << lane) - 1u))] = e;
      }
      nact += __popc(act);
      run += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) {
      start[E] = run;
      active[0] = nact;
    }
  }
  __syncthreads();
  if (tid < 32) {  // stable fill: slots in ascending order within each expert
    for (int64_t base = 0; base < n; base += 32) {
      const int64_t i = base + lane;
      const int e = i < n ? local_expert(ids, i_stride, K, i, first, E) : -1;
      const unsigned peers = __match_any_sync(0xffffffffu, e);
      if (e >= 0) order[cursor[e] + __popc(peers & ((1u << lane) - 1u))] = int32_t(i);
      __syncwarp();
      if (e >= 0 && lane == __ffs(peers) - 1) cursor[e] += __popc(peers);
      __syncwarp();
    }
  }
}

struct GemvArgs {
  const ExpertView* views;
  const int32_t* start;
  const int32_t* active;
  const int32_t* order;
  const float* in;   // gated: x rows by token (slot / in_div); else h rows by slot
  int64_t in_stride;
  int in_div;
  bool in_vec;       // in rows 16-byte aligned at every multiple of 8 elements
  float* out;        // out[slot * out_stride + r]
  int64_t out_stride;
  int64_t rows;      // output rows (F for gate/up, H for down)
  int64_t kdim;      // reduction length (H for gate/up, F for down)
  int max_active;    // bound on active[0] (min(E, n))
};

__device__ __forceinline__ void load8(const float* p, bool vec, float v[8]) {
  if (vec) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = p[i];
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Chunks of 8 weights whose loads a lane issues before using the first (moe_gemv_kernel):
// about 128 bytes of weight in flight per lane (gate and up count twice), at most 8 chunks.
// One chunk at a time kept 8-16 bytes per lane in flight (FP8): on an H200 the decode
// experts read their weights at 1251 GB/s, 0.30 of the copy bandwidth (bench_ops, 2026-12-04).
__host__ __device__ constexpr int gemv_ahead(WFmt f, bool gated) {
  const int u = 128 / (detail::chunk8_bytes(f) * (gated ? 2 : 1));
  return u < 1 ? 1 : (u > 8 ? 8 : u);
}

// gated: h[slot, r] = silu(x[token] . gate[r]) * (x[token] . up[r]); else y[slot, r] = h[slot] . down[r].
template <WFmt F, bool wvec, bool gated>
__global__ void __launch_bounds__(kGemvThreads, 2) moe_gemv_kernel(GemvArgs a) {
  detail::pdl_enter();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t r = int64_t(blockIdx.x) * kGemvWarps + warp;
  if (r >= a.rows) return;  // whole warps only; the kernel has no block barrier
  int nact = a.active[0];
  if (nact > a.max_active) nact = a.max_active;
  const int64_t K8 = a.kdim / 8 * 8;
  for (int ai = blockIdx.y; ai < nact; ai += gridDim.y) {
    const int e = a.active[1 + ai];
    const int beg = a.start[e], cnt = a.start[e + 1] - beg;
    const WeightView wa = gated ? a.views[e].gate : a.views[e].down;
    WeightView wb;
    if constexpr (gated) wb = a.views[e].up;
    for (int c0 = 0; c0 < cnt; c0 += kTokChunk) {
      const int nt = cnt - c0 < kTokChunk ? cnt - c0 : kTokChunk;
      int slot[kTokChunk];
      const float* in[kTokChunk];
#pragma unroll
      for (int j = 0; j < kTokChunk; ++j) {
        slot[j] = a.order[beg + c0 + (j < nt ? j : 0)];
        in[j] = a.in + int64_t(slot[j] / a.in_div) * a.in_stride;
      }
      float acc_a[kTokChunk], acc_b[kTokChunk];
#pragma unroll
      for (int j = 0; j < kTokChunk; ++j) acc_a[j] = acc_b[j] = 0.0f;
      // the lane's chunks k0 = 8 lane, 8 lane + 256, ... in order, U chunks' weight bytes
      // fetched before the first is decoded (the same operations in the same order as one
      // chunk at a time: bitwise the same sums)
      auto chunk = [&](int64_t k0, const float (&wa8)[8], const float (&wb8)[8]) {
#pragma unroll
        for (int j = 0; j < kTokChunk; ++j) {
          if (j < nt) {
            float xv[8];
            load8(in[j] + k0, a.in_vec, xv);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              acc_a[j] = fmaf(wa8[i], xv[i], acc_a[j]);
              if constexpr (gated) acc_b[j] = fmaf(wb8[i], xv[i], acc_b[j]);
            }
          }
        }
      };
      if constexpr (wvec) {
        constexpr int U = gemv_ahead(F, gated);
        for (int64_t kb = int64_t(lane) * 8; kb < K8; kb += 256 * U) {
          detail::WRaw8<F> ra[U], rb[U];
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int64_t k0 = kb + 256 * u;
            if (k0 < K8) {
              ra[u] = detail::w_fetch8<F>(wa, r, k0);
              if constexpr (gated) rb[u] = detail::w_fetch8<F>(wb, r, k0);
            }
          }
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int64_t k0 = kb + 256 * u;
            if (k0 < K8) {
              float wa8[8], wb8[8];
              detail::w_decode8<F>(ra[u], wa, wa8);
              if constexpr (gated) detail::w_decode8<F>(rb[u], wb, wb8);
              chunk(k0, wa8, wb8);
            }
          }
        }
      } else {
        for (int64_t k0 = int64_t(lane) * 8; k0 < K8; k0 += 256) {
          float wa8[8], wb8[8];
          detail::w_load8<F, false>(wa, r, k0, wa8);
          if constexpr (gated) detail::w_load8<F, false>(wb, r, k0, wb8);
          chunk(k0, wa8, wb8);
        }
      }
      for (int64_t k = K8 + lane; k < a.kdim; k += 32) {  // the last kdim % 8 elements
        const float wk = detail::w_at<F>(wa, r, k);
        float uk = 0.0f;
        if constexpr (gated) uk = detail::w_at<F>(wb, r, k);
#pragma unroll
        for (int j = 0; j < kTokChunk; ++j) {
          if (j < nt) {
            const float xk = in[j][k];
            acc_a[j] = fmaf(wk, xk, acc_a[j]);
            if constexpr (gated) acc_b[j] = fmaf(uk, xk, acc_b[j]);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kTokChunk; ++j) {
        if (j < nt) {  // nt is warp-uniform: every lane joins the shuffles
          const float g = warp_sum(acc_a[j]);
          float v = g;
          if constexpr (gated) {
            const float u = warp_sum(acc_b[j]);
            v = detail::silu_mul(g, u);
          }
          if (lane == j) a.out[int64_t(slot[j]) * a.out_stride + r] = v;
        }
      }
    }
  }
}

__global__ void __launch_bounds__(256)
    moe_combine_kernel(const float* __restrict__ y, const int32_t* __restrict__ ids, int64_t i_stride,
                       const float* __restrict__ w, int64_t w_stride, int K, int64_t first, int E,
                       float* __restrict__ out, int64_t o_stride, int64_t T, int64_t H, bool accumulate) {
  detail::pdl_enter();
  const int64_t d = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (d >= H) return;
  for (int64_t t = blockIdx.y; t < T; t += gridDim.y) {
    float o = 0.0f;
    for (int j = 0; j < K; ++j) {
      const int64_t e = int64_t(ids[t * i_stride + j]) - first;
      if (e < 0 || e >= E) continue;
      o = __fadd_rn(o, __fmul_rn(y[(t * K + j) * H + d], w[t * w_stride + j]));
    }
    float* dst = out + t * o_stride + d;
    *dst = accumulate ? __fadd_rn(*dst, o) : o;  // accumulate: the sum, then added once
  }
}

// ------------------------------------------------------------------ expert view cache
struct ExpertTable {
  int device = -1;
  std::vector<ExpertView> host;
  ExpertView* dev = nullptr;
  WFmt gu_fmt = WFmt::F32, down_fmt = WFmt::F32;
  bool gu_vec = false, down_vec = false;      // detail::weight_rows_vectorizable, every expert
  bool gu_vec16 = false, down_vec16 = false;  // detail::rows_aligned16, every expert (gemm_sk.h)
};

bool same_view(const WeightView& a, const WeightView& b) {
  return a.fmt == b.fmt && a.data == b.data && a.row_bytes == b.row_bytes && a.scale == b.scale &&
         a.scale_stride == b.scale_stride && std::memcmp(&a.global_scale, &b.global_scale, sizeof(float)) == 0 &&
         std::memcmp(&a.input_scale, &b.input_scale, sizeof(float)) == 0 && a.N == b.N && a.K == b.K &&
         a.sf_blocked == b.sf_blocked;
}

void mix(uint64_t& h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
}

uint64_t hash_views(int device, const std::vector<ExpertView>& v) {
  uint64_t h = uint64_t(device) * 0x100000001b3ull + v.size();
  for (const ExpertView& x : v)
    for (const WeightView* w : {&x.gate, &x.up, &x.down}) {
      uint32_t gsb = 0, isb = 0;
      std::memcpy(&gsb, &w->global_scale, sizeof(gsb));
      std::memcpy(&isb, &w->input_scale, sizeof(isb));
      mix(h, uint64_t(isb));
      mix(h, uint64_t(w->fmt));
      mix(h, uint64_t(reinterpret_cast<uintptr_t>(w->data)));
      mix(h, uint64_t(w->row_bytes));
      mix(h, uint64_t(reinterpret_cast<uintptr_t>(w->scale)));
      mix(h, uint64_t(w->scale_stride));
      mix(h, gsb);
      mix(h, uint64_t(w->N) * 0x10001ull + uint64_t(w->K));
      mix(h, uint64_t(reinterpret_cast<uintptr_t>(w->sf_blocked)));
    }
  return h;
}

const char* fmt_name(WFmt f) {
  switch (f) {
    case WFmt::F32: return "dense F32";
    case WFmt::BF16: return "dense BF16";
    case WFmt::F16: return "dense F16";
    case WFmt::FP8: return "FP8 block-128";
    case WFmt::NVFP4: return "NVFP4";
  }
  return "?";
}

std::mutex g_tables_mu;
std::unordered_map<uint64_t, std::vector<std::unique_ptr<ExpertTable>>>& tables() {
  static auto* m = new std::unordered_map<uint64_t, std::vector<std::unique_ptr<ExpertTable>>>();  // never destroyed
  return *m;
}

// The device array of the experts' views (see the file comment). Checks every weight's
// device, layout and shape ([F, H] gate / up, [H, F] down) and the per-layer formats.
const ExpertTable& build_expert_table(const ops::ExpertWeights& ex, int device, int64_t H, int64_t F) {
  const char* op = "cuda::moe_experts";
  const size_t E = ex.gate.size();
  std::vector<ExpertView> host(E);
  for (size_t e = 0; e < E; ++e) {
    ExpertView& v = host[e];
    v.gate = detail::weight_view(ex.gate[e], device, op);
    v.up = detail::weight_view(ex.up[e], device, op);
    v.down = detail::weight_view(ex.down[e], device, op);
    DFLASH2_CHECK_ARG(v.gate.N == F && v.gate.K == H && v.up.N == F && v.up.K == H && v.down.N == H &&
                          v.down.K == F,
                      op, ": expert ", e, " has shapes gate [", v.gate.N, ", ", v.gate.K, "], up [", v.up.N, ", ",
                      v.up.K, "], down [", v.down.N, ", ", v.down.K, "]; expected [", F, ", ", H, "], [", F, ", ", H,
                      "], [", H, ", ", F, "]");
    DFLASH2_CHECK_ARG(v.gate.fmt == host[0].gate.fmt && v.up.fmt == host[0].gate.fmt, op, ": expert ", e,
                      " has gate / up weights in ", fmt_name(v.gate.fmt), " / ", fmt_name(v.up.fmt),
                      " but expert 0's gate is ", fmt_name(host[0].gate.fmt),
                      "; the CUDA backend needs one format for every gate and up weight of a layer");
    DFLASH2_CHECK_ARG(v.down.fmt == host[0].down.fmt, op, ": expert ", e, " has its down weight in ",
                      fmt_name(v.down.fmt), " but expert 0's is ", fmt_name(host[0].down.fmt),
                      "; the CUDA backend needs one format for every down weight of a layer");
  }
  const uint64_t h = hash_views(device, host);
  std::lock_guard<std::mutex> lock(g_tables_mu);
  std::vector<std::unique_ptr<ExpertTable>>& bucket = tables()[h];
  for (const auto& t : bucket) {
    if (t->device != device || t->host.size() != E) continue;
    bool same = true;
    for (size_t e = 0; e < E && same; ++e)
      same = same_view(t->host[e].gate, host[e].gate) && same_view(t->host[e].up, host[e].up) &&
             same_view(t->host[e].down, host[e].down);
    if (same) return *t;
  }
  cudaStream_t s = detail::stream();
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  DFLASH2_CUDA_CHECK(cudaStreamIsCapturing(s, &cap), "moe_experts: cuda:", device);
  DFLASH2_CHECK(cap == cudaStreamCaptureStatusNone, ErrorKind::Backend, op,
                ": the device table of this layer's ", E, " expert weights on cuda:", device,
                " is built on first use, which cannot happen while the stream is being captured into a CUDA graph; "
                "run one eager step with these weights before capturing");
  auto t = std::make_unique<ExpertTable>();
  t->device = device;
  t->host = std::move(host);
  t->gu_fmt = t->host[0].gate.fmt;
  t->down_fmt = t->host[0].down.fmt;
  t->gu_vec = t->down_vec = t->gu_vec16 = t->down_vec16 = true;
  for (const ExpertView& v : t->host) {
    t->gu_vec = t->gu_vec && detail::weight_rows_vectorizable(v.gate) && detail::weight_rows_vectorizable(v.up);
    t->down_vec = t->down_vec && detail::weight_rows_vectorizable(v.down);
    t->gu_vec16 = t->gu_vec16 && detail::rows_aligned16(v.gate) && detail::rows_aligned16(v.up);
    t->down_vec16 = t->down_vec16 && detail::rows_aligned16(v.down);
  }
  const size_t bytes = E * sizeof(ExpertView);
  t->dev = static_cast<ExpertView*>(device_malloc(bytes, device));
  // Copied on the stream the kernels run on, then waited for: a plain cudaMemcpy runs on the
  // legacy default stream, which a non-blocking current stream is not ordered after, and a
  // pageable host -> device cudaMemcpy may return before its DMA has landed.
  cudaError_t err = cudaMemcpyAsync(t->dev, t->host.data(), bytes, cudaMemcpyHostToDevice, s);
  if (err == cudaSuccess) err = cudaStreamSynchronize(s);
  if (err != cudaSuccess) {
    device_free(t->dev, device);
    detail::raise(err, "cudaMemcpy", "moe_experts expert table, cuda:", device);
  }
  bucket.push_back(std::move(t));
  return *bucket.back();
}

// Fast lookup (the usual case: a layer passes the same ExpertWeights object every step).
// Per (ExpertWeights address, device) the table found last time, with a signature of every
// field weight_view() reads or checks, for every gate / up / down weight: data and scale
// pointers, row strides, contiguity, ndims, dtypes, devices, format, global and input scales,
// shape.
// weight_view() is a pure function of these, so an exactly equal signature (and H, F) gives
// exactly the views, and the checks, of the call that stored it: the same table. Anything
// else -- another object at a reused address, a weight replaced, re-sliced or moved --
// takes build_expert_table(). Cost: 9 words gathered and compared per weight, instead of
// building, hashing and comparing every view.
constexpr int kSigWords = 9;

void weight_sig(const ops::Weight& w, uint64_t* s) {
  const Tensor &d = w.data, &sc = w.scale;
  const bool d2 = d.defined() && d.ndim() == 2, s2 = sc.defined() && sc.ndim() == 2;
  uint32_t gsb = 0;
  std::memcpy(&gsb, &w.global_scale, sizeof(gsb));
  s[0] = uint64_t(reinterpret_cast<uintptr_t>(d.data()));
  s[1] = uint64_t(reinterpret_cast<uintptr_t>(sc.defined() ? sc.data() : nullptr));
  s[2] = d2 ? uint64_t(d.stride(0)) : ~uint64_t(0);
  s[3] = s2 ? uint64_t(sc.stride(0)) : ~uint64_t(0);
  s[4] = uint64_t(w.out_features);
  s[5] = uint64_t(w.in_features);
  s[6] = uint64_t(gsb) | uint64_t(w.format) << 32 | uint64_t(d.dtype()) << 40 | uint64_t(sc.dtype()) << 48 |
         uint64_t(d.defined()) << 56 | uint64_t(sc.defined()) << 57 | uint64_t(d2 && d.stride(1) == 1) << 58 |
         uint64_t(s2 && sc.stride(1) == 1) << 59;
  uint32_t isb = 0;
  std::memcpy(&isb, &w.input_scale, sizeof(isb));
  s[8] = uint64_t(isb);
  s[7] = uint64_t(uint32_t(d.device().index)) | uint64_t(d.device().type) << 32 | uint64_t(d.ndim()) << 40 |
         uint64_t(sc.ndim()) << 44 | uint64_t(sc.device().type) << 48 |
         uint64_t(sc.device().index == d.device().index) << 56;
}

struct FastEntry {
  int64_t H = 0, F = 0;
  std::vector<uint64_t> sig;
  const ExpertTable* table = nullptr;  // never freed (see tables())
};
std::mutex g_fast_mu;
std::map<std::pair<const void*, int>, FastEntry>& fast_tables() {
  static auto* m = new std::map<std::pair<const void*, int>, FastEntry>();  // never destroyed
  return *m;
}

const ExpertTable& expert_table(const ops::ExpertWeights& ex, int device, int64_t H, int64_t F) {
  const size_t E = ex.gate.size();  // == up.size() == down.size() (checked by the caller)
  thread_local std::vector<uint64_t> sig;
  sig.resize(3 * E * kSigWords);
  for (size_t e = 0; e < E; ++e) {
    weight_sig(ex.gate[e], &sig[(3 * e + 0) * kSigWords]);
    weight_sig(ex.up[e], &sig[(3 * e + 1) * kSigWords]);
    weight_sig(ex.down[e], &sig[(3 * e + 2) * kSigWords]);
  }
  const std::pair<const void*, int> key(static_cast<const void*>(&ex), device);
  {
    std::lock_guard<std::mutex> lock(g_fast_mu);
    const auto it = fast_tables().find(key);
    if (it != fast_tables().end() && it->second.H == H && it->second.F == F && it->second.sig == sig)
      return *it->second.table;
  }
  const ExpertTable& t = build_expert_table(ex, device, H, F);  // checks everything; may throw
  std::lock_guard<std::mutex> lock(g_fast_mu);
  if (fast_tables().size() >= 4096) fast_tables().clear();  // many short-lived objects (tests): bound the memory
  FastEntry& f = fast_tables()[key];
  f.H = H;
  f.F = F;
  f.sig = sig;
  f.table = &t;
  return t;
}

template <WFmt F, bool gated>
void launch_gemv_fmt(bool wvec, dim3 grid, const GemvArgs& a) {
  if (wvec)
    moe_gemv_kernel<F, true, gated><<<grid, kGemvThreads, 0, detail::stream()>>>(a);
  else
    moe_gemv_kernel<F, false, gated><<<grid, kGemvThreads, 0, detail::stream()>>>(a);
}

template <bool gated>
void launch_gemv(WFmt f, bool wvec, dim3 grid, const GemvArgs& a) {
  detail::with_format(f, [&](auto tag) { launch_gemv_fmt<decltype(tag)::value, gated>(wvec, grid, a); });
}

// Rows of a 2-D tensor with a contiguous last dim: the row stride (one row: its length).
int64_t row_stride_2d(const Tensor& t) { return t.shape(0) > 1 ? t.stride(0) : t.shape(1); }

// ------------------------------------------------------------------ FP8 grouped experts
// moe_experts(..., GemmNumerics::FP8) (prompt chunks of FP8 checkpoints): the slots in the
// expert lists' order (order[], start[]) are the rows of a grouped GEMM whose group g is
// expert g's slots [start[g], start[g + 1]) (cutlass/fp8_grouped_gemm.h).
#if defined(DFLASH2_WITH_CUTLASS)
// Quantizes rows of the grouped GEMM's A (one warp per (position p, 128-input block)):
// gathered == true: row p is x[order[p] / top_k] (the gate / up input); false: row p is
// silu(g[p]) * u[p] with the CPU's (v / (1 + expf(-v))) * u (the down input). Codes go to
// codes[p * K + k], the block scale to the group's MN-major scales (sfa + nbk * start[e],
// [nbk][M_e]) or, kmajor (the Blackwell kernel), to row p's K-major scales (sfa + p * nbk).
template <bool gathered>
__global__ void __launch_bounds__(256)
    moe_fp8_rows(const float* __restrict__ in, int64_t in_stride, const float* __restrict__ up,
                 const int32_t* __restrict__ start, const int32_t* __restrict__ order, int E, int top_k, int64_t n,
                 int64_t K, uint8_t* __restrict__ codes, float* __restrict__ sfa, bool kmajor) {
  detail::pdl_enter();
  const int lane = threadIdx.x & 31;
  const int64_t nbk = (K + 127) / 128, units = n * nbk;
  const int32_t used = start[E];
  for (int64_t u = int64_t(blockIdx.x) * 8 + (threadIdx.x >> 5); u < units; u += int64_t(gridDim.x) * 8) {
    const int64_t p = u / nbk, b = u - p * nbk, k0 = b * 128;
    if (p >= used) continue;  // the whole warp: p is the same in every lane
    float v[4];
    const float* row = gathered ? in + int64_t(order[p] / top_k) * in_stride : in + p * in_stride;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t k = k0 + lane + 32 * j;
      float a = 0.0f;
      if (k < K) {
        a = row[k];
        if (!gathered) {
          a = detail::silu_mul(a, up[p * in_stride + k]);
        }
      }
      v[j] = a;
    }
    uint8_t q[4];
    const float sa = detail::fp8_warp_block(v, q);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t k = k0 + lane + 32 * j;
      if (k < K) codes[p * K + k] = q[j];
    }
    if (lane == 0 && kmajor) {
      sfa[layout::fp8_act_scale_offset_kmajor(p, b, nbk)] = sa;
    } else if (lane == 0) {
      const int e = layout::group_of(start, E, p);  // the expert whose list holds p
      const int64_t m_e = start[e + 1] - start[e];
      sfa[nbk * start[e] + layout::fp8_act_scale_offset(p - start[e], b, m_e)] = sa;
    }
  }
}

// The experts' weight and scale pointers for the three grouped GEMMs.
__global__ void moe_fp8_pointers(const ExpertView* __restrict__ views, int E, const void** b, const float** s) {
  detail::pdl_enter();
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  const WeightView* w[3] = {&views[e].gate, &views[e].up, &views[e].down};
  for (int i = 0; i < 3; ++i) {
    b[i * E + e] = w[i]->data;
    s[i * E + e] = static_cast<const float*>(w[i]->scale);
  }
}

// y[order[p], :] = Y[p, :] (back to slot order for the combine).
__global__ void moe_fp8_scatter(const float* __restrict__ Y, const int32_t* __restrict__ start,
                                const int32_t* __restrict__ order, int E, int64_t n, int64_t H, float* __restrict__ y) {
  detail::pdl_enter();
  const int64_t used = start[E], total = n * H;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t p = i / H;
    if (p < used) y[int64_t(order[p]) * H + (i - p * H)] = Y[i];
  }
}

// Whether every expert weight can be read in place by the grouped GEMM: FP8 block-128,
// rows of exactly K bytes (contiguous) starting 16-byte aligned, K % 16 == 0, N % 4 == 0,
// contiguous scales.
bool fp8_grouped_views_ok(const std::vector<ExpertView>& host, std::string* why) {
  for (size_t e = 0; e < host.size(); ++e)
    for (const WeightView* w : {&host[e].gate, &host[e].up, &host[e].down}) {
      const char* bad = nullptr;
      if (w->fmt != WFmt::FP8) bad = "not FP8 block-128";
      else if (w->K % 16 != 0 || w->N % 4 != 0) bad = "K % 16 != 0 or N % 4 != 0";
      else if (w->row_bytes != w->K || !detail::aligned(w->data, 16)) bad = "rows not contiguous / 16-byte aligned";
      else if (w->scale_stride != (w->K + 127) / 128) bad = "block scales not contiguous (a column slice)";
      if (bad) {
        if (why) *why = "expert " + std::to_string(e) + ": " + bad;
        return false;
      }
    }
  return true;
}

// ------------------------------------------------------------------ NVFP4 grouped experts
// moe_experts(..., GemmNumerics::NVFP4) (prompt chunks of NVFP4 checkpoints on Blackwell):
// W4A4 as linear_nvfp4 per expert (nvfp4_grouped_gemm.h).

// Whether every expert weight can be read in place by the grouped W4A4 GEMM: NVFP4 with a
// positive finite input_scale, rows of exactly K / 2 bytes starting 16-byte aligned, K % 32
// == 0 (16-byte TMA rows), N % 4 == 0.
bool nvfp4_grouped_views_ok(const std::vector<ExpertView>& host, std::string* why) {
  for (size_t e = 0; e < host.size(); ++e)
    for (const WeightView* w : {&host[e].gate, &host[e].up, &host[e].down}) {
      const char* bad = nullptr;
      if (w->fmt != WFmt::NVFP4) bad = "not NVFP4";
      else if (!(w->input_scale >= FLT_MIN) || !std::isfinite(w->input_scale)) bad = "no usable input_scale (W4A16 only)";
      else if (w->K % 32 != 0 || w->N % 4 != 0) bad = "K % 32 != 0 or N % 4 != 0";
      else if (w->row_bytes != w->K / 2 || !detail::aligned(w->data, 16)) bad = "rows not contiguous / 16-byte aligned";
      if (bad) {
        if (why) *why = "expert " + std::to_string(e) + ": " + bad;
        return false;
      }
    }
  return true;
}

// Per expert e: the group's first scale row (its rows padded to 128, the groups back to back)
// as byte offsets into the gate / up input's scales (sfc_h columns) and the down input's
// (sfc_f); per projection i (gate, up, down): alpha = input_scale x weight_scale_2, the input
// scale, the weight's codes and its block-scaled scales: prepared at load (the weight's
// sf_blocked), else swizzled per call into sfb + e * sfb_stride (one projection at a time).
__global__ void moe_nvfp4_setup(const ExpertView* __restrict__ views, int E, const int32_t* __restrict__ start,
                                int64_t sfc_h, int64_t sfc_f, int64_t* __restrict__ off_h,
                                int64_t* __restrict__ off_f, float* __restrict__ alpha, float* __restrict__ inscale,
                                const void** bptr, const uint8_t** sfbptr, const uint8_t* sfb, int64_t sfb_stride) {
  detail::pdl_enter();
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    int64_t rows = 0;
    for (int e = 0; e < E; ++e) {
      off_h[e] = rows * sfc_h;
      off_f[e] = rows * sfc_f;
      rows += layout::nvfp4_sf_rows(int64_t(start[e + 1]) - start[e]);
    }
  }
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < E; e += gridDim.x * blockDim.x) {
    const WeightView* w[3] = {&views[e].gate, &views[e].up, &views[e].down};
    for (int i = 0; i < 3; ++i) {
      alpha[i * E + e] = __fmul_rn(w[i]->input_scale, w[i]->global_scale);
      inscale[i * E + e] = w[i]->input_scale;
      bptr[i * E + e] = w[i]->data;
      sfbptr[i * E + e] = w[i]->sf_blocked ? w[i]->sf_blocked : sfb + int64_t(e) * sfb_stride;
    }
  }
}

// Projection `which`'s per-16 E4M3 weight scales into the block-scaled layout (layout.h
// nvfp4_sf_offset), expert e at out + e * stride: every entry of the padded [nvfp4_sf_rows(N)
// x nvfp4_sf_cols(K)] extent, the padding as 0, for the experts with tokens only (the
// others' tiles do not exist) whose scales were not prepared at load.
__global__ void moe_nvfp4_swizzle(const ExpertView* __restrict__ views, const int32_t* __restrict__ start, int which,
                                  int E, int64_t N, int64_t K, int64_t stride, uint8_t* __restrict__ out) {
  detail::pdl_enter();
  const int64_t nb = K / 16, rows = layout::nvfp4_sf_rows(N), cols = layout::nvfp4_sf_cols(K), per = rows * cols,
                total = int64_t(E) * per;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = i / per, rc = i - e * per, r = rc / cols, c = rc - r * cols;
    if (start[e + 1] == start[e]) continue;
    const WeightView& w = which == 0 ? views[e].gate : which == 1 ? views[e].up : views[e].down;
    if (w.sf_blocked) continue;
    out[e * stride + layout::nvfp4_sf_offset(r, c, cols)] =
        r < N && c < nb ? static_cast<const uint8_t*>(w.scale)[r * w.scale_stride + c] : uint8_t(0);
  }
}
#endif  // DFLASH2_WITH_CUTLASS

void need_rows(const Tensor& t, DType dt, int device, const char* op, const char* arg) {
  DFLASH2_CHECK_ARG(t.defined(), op, ": undefined tensor '", arg, "'");
  DFLASH2_CHECK_ARG(t.device().is_cuda() && t.device().index == device, op, ": '", arg, "' must be on cuda:", device,
                    ", found ", t.describe());
  DFLASH2_CHECK_ARG(t.dtype() == dt && t.ndim() == 2 && (t.stride(1) == 1 || t.shape(1) <= 1), op, ": '", arg,
                    "' must be ", dtype_name(dt), " [rows, cols] with contiguous rows, found ", t.describe());
}

}  // namespace

void moe_route(const Tensor& logits, const Tensor& bias, const ops::MoeRouting& r, Tensor& ids, Tensor& weights) {
  const char* op = "cuda::moe_route";
  DFLASH2_CHECK_ARG(logits.defined() && logits.device().is_cuda(), op, ": logits must be a CUDA tensor, found ",
                    logits.describe());
  const int dev = logits.device().index;
  need_rows(logits, DType::F32, dev, op, "logits");
  need_rows(ids, DType::I32, dev, op, "ids");
  need_rows(weights, DType::F32, dev, op, "weights");
  const int64_t T = logits.shape(0), E = logits.shape(1);
  DFLASH2_CHECK_ARG(bias.defined() && bias.device() == logits.device() && bias.dtype() == DType::F32 &&
                        bias.ndim() == 1 && bias.shape(0) == E,
                    op, ": bias must be F32 [", E, "] on cuda:", dev, ", found ", bias.describe());
  DFLASH2_CHECK_ARG(E >= 1 && E <= kRouteMaxE, op, ": ", E, " experts; the CUDA kernel takes 1 to ", kRouteMaxE);
  DFLASH2_CHECK_ARG(r.n_group >= 1 && E % r.n_group == 0, op, ": n_group ", r.n_group, " must divide ", E,
                    " experts");
  DFLASH2_CHECK_ARG(r.topk_group >= 1 && r.topk_group <= r.n_group, op, ": topk_group must be in [1, n_group = ",
                    r.n_group, "], found ", r.topk_group);
  DFLASH2_CHECK_ARG(r.top_k >= 1 && r.top_k <= E / r.n_group * r.topk_group, op, ": top_k = ", r.top_k,
                    " must be in [1, experts in the kept groups = ", E / r.n_group * r.topk_group, "]");
  DFLASH2_CHECK_ARG(ids.shape(0) == T && ids.shape(1) == r.top_k && weights.shape(0) == T &&
                        weights.shape(1) == r.top_k,
                    op, ": ids and weights must be [", T, ", ", r.top_k, "], found ", ids.describe(), " and ",
                    weights.describe());
  if (T == 0) return;
  moe::RouteParams p;
  p.E = int(E);
  p.G = int(r.n_group);
  p.topk_group = int(r.topk_group);
  p.K = int(r.top_k);
  p.norm = r.norm_topk_prob;
  p.scale = r.routed_scaling_factor;
  const size_t smem = size_t(3 * E + r.n_group + r.top_k + 1) * sizeof(float);
  const int threads = detail::pick_threads(E, 512);
  detail::DeviceGuard guard(dev);
  moe_route_kernel<<<detail::row_blocks(T), threads, smem, detail::stream()>>>(
      logits.data_as<const float>(), row_stride_2d(logits), bias.data_as<const float>(), bias.stride(0), p,
      ids.data_as<int32_t>(), row_stride_2d(ids), weights.data_as<float>(), row_stride_2d(weights), T);
  detail::check_launch("moe_route kernel launch", logits.describe());
}

namespace {
enum class ExpertsMode { Exact, FP8, BF16, NVFP4 };

// The skinny grouped GEMM of projection `which` (0 gate, 1 up, 2 down: the expert table's
// views back to back) over the expert lists' n rows of A; the caller sets the output (d or
// silu), the numerics' form (plane) and, for gate and up together, the projections.
sk::GroupedArgs experts_sk_args(const WeightView* views, int which, WFmt f, bool vec16, int64_t N, int64_t K, int64_t E,
                                const int32_t* start, const int32_t* active, int64_t n, const __nv_bfloat16* a,
                                int64_t lda, float* partial, uint32_t* arrivals) {
  sk::GroupedArgs g;
  g.a = a;
  g.lda = lda;
  g.table = views + which;
  g.table_stride = 3;
  g.fmt = f;
  g.vec = vec16;
  g.N = N;
  g.K = K;
  g.groups = int(E);
  g.start = start;
  g.active = active;
  g.max_active = int(E < n ? E : n);
  g.M = n;
  g.partial = partial;
  g.arrivals = arrivals;
  return g;
}

void moe_experts_impl(const Tensor& x, const Tensor& ids, const Tensor& weights, const ops::ExpertWeights& experts,
                      Tensor& out, Tensor& workspace, ExpertsMode mode, bool decode, bool accumulate) {
  const bool fp8 = mode == ExpertsMode::FP8, bf16 = mode == ExpertsMode::BF16, nvfp4 = mode == ExpertsMode::NVFP4;
  const char* op = fp8 ? "cuda::moe_experts_fp8"
                   : bf16 ? "cuda::moe_experts_bf16"
                   : nvfp4 ? "cuda::moe_experts_nvfp4"
                           : "cuda::moe_experts";
  DFLASH2_CHECK_ARG(x.defined() && x.device().is_cuda(), op, ": x must be a CUDA tensor, found ", x.describe());
  const int dev = x.device().index;
  need_rows(x, DType::F32, dev, op, "x");
  need_rows(out, DType::F32, dev, op, "out");
  need_rows(ids, DType::I32, dev, op, "ids");
  need_rows(weights, DType::F32, dev, op, "weights");
  const int64_t T = x.shape(0), H = x.shape(1), K = ids.shape(1), E = int64_t(experts.gate.size());
  DFLASH2_CHECK_ARG(out.shape(0) == T && out.shape(1) == H, op, ": out must be [", T, ", ", H, "], found ",
                    out.describe());
  DFLASH2_CHECK_ARG(ids.shape(0) == T && weights.shape(0) == T && weights.shape(1) == K, op,
                    ": ids and weights must be [", T, ", top_k], found ", ids.describe(), " and ", weights.describe());
  DFLASH2_CHECK_ARG(E >= 1 && int64_t(experts.up.size()) == E && int64_t(experts.down.size()) == E, op,
                    ": expected the same number (>= 1) of gate, up and down weights");
  DFLASH2_CHECK_ARG(E <= int64_t(INT32_MAX) - 1 && experts.first >= 0, op, ": bad expert range: first ",
                    experts.first, ", ", E, " experts");
  DFLASH2_CHECK_ARG(out.shape(0) <= 1 || out.stride(0) >= H, op, ": out rows overlap, found ", out.describe());
  const int64_t F = experts.gate[0].out_features;
  const int64_t n = T * K;
  DFLASH2_CHECK_ARG(n <= int64_t(INT32_MAX), op, ": ", T, " tokens x top_k ", K, " slots exceed 2^31");
  DFLASH2_CHECK_ARG(workspace.defined() && workspace.device() == x.device() && workspace.dtype() == DType::F32 &&
                        workspace.is_contiguous() &&
                        workspace.numel() >= ops::moe_workspace_floats(T, K, H, F, E),
                    op, ": workspace must hold ", ops::moe_workspace_floats(T, K, H, F, E),
                    " contiguous F32 on cuda:", dev, ", found ", workspace.describe());
  if (T == 0 || H == 0) return;
  detail::DeviceGuard guard(dev);
  const ExpertTable& tab = expert_table(experts, dev, H, F);  // also checks every weight

  float* ws = workspace.data_as<float>();
  const moe::MoeWsLayout L = moe::moe_ws_layout(n, H, F, E, workspace.numel(),
                                                int64_t(reinterpret_cast<uintptr_t>(ws) / 4 % 4));
  float* y = ws + L.y;
  float* hbuf = ws + L.h;
  int32_t* start = reinterpret_cast<int32_t*>(ws + L.start);
  int32_t* cursor = reinterpret_cast<int32_t*>(ws + L.cursor);
  int32_t* active = reinterpret_cast<int32_t*>(ws + L.active);
  int32_t* order = reinterpret_cast<int32_t*>(ws + L.order);
  const int32_t* ip = ids.data_as<const int32_t>();
  const int64_t i_stride = row_stride_2d(ids);
  cudaStream_t s = detail::stream();

#if defined(DFLASH2_WITH_CUTLASS)
  const int sm = detail::compute_capability(dev);
  if (fp8) {
    DFLASH2_CHECK(tc::fp8_grouped_built_for(sm), ErrorKind::Unsupported, op, ": this build has no FP8 grouped ",
                  "tensor-core GEMM for sm_", sm, " (sm_90a / sm_100a / sm_103a); run the experts exact");
    std::string why;
    DFLASH2_CHECK(fp8_grouped_views_ok(tab.host, &why), ErrorKind::Unsupported, op, ": the grouped FP8 GEMM cannot ",
                  "read these expert weights in place (", why, "); run the experts exact");
  }
  if (nvfp4) {
    DFLASH2_CHECK(tc::nvfp4_grouped_built_for(sm), ErrorKind::Unsupported, op, ": this build has no NVFP4 grouped ",
                  "tensor-core GEMM for sm_", sm, " (sm_100a / sm_103a); run the experts with 'bf16' numerics");
    std::string why;
    DFLASH2_CHECK(nvfp4_grouped_views_ok(tab.host, &why), ErrorKind::Unsupported, op, ": the grouped NVFP4 GEMM ",
                  "cannot read these expert weights in place (", why, "); run the experts with 'bf16' numerics");
  }
#else
  DFLASH2_CHECK(!fp8 && !nvfp4, ErrorKind::Unsupported, op, ": this build has no CUTLASS (the grouped GEMMs)");
#endif
  if (n > 0 && F > 0) {
    moe_list_kernel<<<1, kListThreads, 0, s>>>(ip, i_stride, int(K), n, experts.first, int(E), start, cursor, active,
                                               order);
    detail::check_launch("moe_experts list kernel launch", ids.describe());
  }
#if defined(DFLASH2_WITH_CUTLASS)
  if (fp8 && n > 0 && F > 0) {
    // scratch: A codes [n, H] | sfa | G, U [n, F] F32 | h codes [n, F] | sfa_h | Y [n, H] F32 |
    // 3 E weight and 3 E scale pointers | 3 parameter blocks | the GEMM workspace
    auto up256 = [](int64_t v) { return (v + 255) / 256 * 256; };
    const int64_t nbh = (H + 127) / 128, nbf = (F + 127) / 128;
    const int64_t b_a = up256(n * H), b_sa = up256(n * nbh * 4), b_g = up256(n * F * 4), b_h = up256(n * F),
                  b_sh = up256(n * nbf * 4), b_y = up256(n * H * 4), b_p = up256(6 * E * int64_t(sizeof(void*))),
                  b_q = up256(int64_t(tc::fp8_grouped_params_bytes(sm, int(E))));
    const bool kmajor = tc::fp8_grouped_sfa_kmajor(sm);
    tc::Fp8GroupedArgs g{};
    g.groups = int(E);
    g.offsets = start;
    g.N = int(F);
    g.K = int(H);
    size_t gws_bytes = tc::fp8_grouped_workspace(sm, g);
    g.N = int(H);
    g.K = int(F);
    gws_bytes = std::max({gws_bytes, tc::fp8_grouped_workspace(sm, g), size_t(256)});
    uint8_t* base = static_cast<uint8_t*>(
        detail::scratch(dev, size_t(b_a + b_sa + 2 * b_g + b_h + b_sh + b_y + b_p + 3 * b_q) +
                                 gws_bytes));
    uint8_t* a8 = base;
    float* sfa = reinterpret_cast<float*>(a8 + b_a);
    float* G = reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(sfa) + b_sa);
    float* U = reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(G) + b_g);
    uint8_t* h8 = reinterpret_cast<uint8_t*>(U) + b_g;
    float* sfh = reinterpret_cast<float*>(h8 + b_h);
    float* Y = reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(sfh) + b_sh);
    const void** bptr = reinterpret_cast<const void**>(reinterpret_cast<uint8_t*>(Y) + b_y);
    const float** sptr = reinterpret_cast<const float**>(bptr + 3 * E);
    uint8_t* params = reinterpret_cast<uint8_t*>(bptr) + b_p;
    void* gws = params + 3 * b_q;

    moe_fp8_pointers<<<unsigned((E + 127) / 128), 128, 0, s>>>(tab.dev, int(E), bptr, sptr);
    const int64_t units_h = n * nbh, units_f = n * nbf;
    auto grid8 = [](int64_t units) {
      const int64_t b = (units + 7) / 8;
      return unsigned(b < detail::kMaxRowBlocks ? b : detail::kMaxRowBlocks);
    };
    moe_fp8_rows<true><<<grid8(units_h), 256, 0, s>>>(x.data_as<const float>(), row_stride_2d(x), nullptr, start,
                                                        order, int(E), int(K), n, H, a8, sfa, kmajor);
    detail::check_launch("moe_experts_fp8 gather / quantize", x.describe());
    auto grouped = [&](int which, const uint8_t* a, const float* sa, int64_t N, int64_t Kd, float* d,
                       const char* what) {
      tc::Fp8GroupedArgs ga{};
      ga.groups = int(E);
      ga.N = int(N);
      ga.K = int(Kd);
      ga.offsets = start;
      ga.a = a;
      ga.sfa = sa;
      ga.b = bptr + which * E;
      ga.sfb = sptr + which * E;
      ga.d = d;
      ga.params = params + which * b_q;
      const std::string err = tc::fp8_grouped_gemm(sm, ga, gws, s);
      if (!err.empty()) fail(ErrorKind::Backend, op, " (", what, "): ", err);
      detail::check_launch("moe_experts_fp8 grouped GEMM", what);
    };
    grouped(0, a8, sfa, F, H, G, "gate");
    grouped(1, a8, sfa, F, H, U, "up");
    moe_fp8_rows<false><<<grid8(units_f), 256, 0, s>>>(G, F, U, start, order, int(E), int(K), n, F, h8, sfh,
                                                         kmajor);
    detail::check_launch("moe_experts_fp8 silu * up / quantize", x.describe());
    grouped(2, h8, sfh, H, F, Y, "down");
    moe_fp8_scatter<<<detail::ceil_blocks(n * H, 256, detail::kMaxRowBlocks), 256, 0, s>>>(Y, start, order, int(E), n,
                                                                                             H, y);
    detail::check_launch("moe_experts_fp8 scatter", x.describe());
  }
  if (nvfp4 && n > 0 && F > 0) {
    // scratch: A codes [n, H / 2] (x2 when gate and up quantize with different input scales)
    // | SFA_h | G, U [n, F] F32 | h codes [n, F / 2] | SFA_f | Y [n, H] F32 | SFB (one
    // projection's, every expert; none when every expert's scales were prepared at load) |
    // sfa offsets 2 x [E] | alpha, input scales 2 x [3 E] | 3 E weight and 3 E scale
    // pointers | 3 parameter blocks | the GEMM workspace
    auto up256 = [](int64_t v) { return (v + 255) / 256 * 256; };
    bool same_gu = true;
    for (const ExpertView& v : tab.host)
      same_gu = same_gu && std::memcmp(&v.gate.input_scale, &v.up.input_scale, sizeof(float)) == 0;
    const int64_t sfc_h = layout::nvfp4_sf_cols(H), sfc_f = layout::nvfp4_sf_cols(F);
    const int64_t sf_rows_max = n + 128 * (E < n ? E : n);  // every non-empty group padded by < 128 rows
    const int64_t sfb_gu = layout::nvfp4_sf_rows(F) * sfc_h, sfb_d = layout::nvfp4_sf_rows(H) * sfc_f;
    bool all_ready = true;  // every expert's scales prepared (Weight::sf_blocked): no swizzle
    for (const ExpertView& v : tab.host)
      all_ready = all_ready && v.gate.sf_blocked && v.up.sf_blocked && v.down.sf_blocked;
    const int64_t sfb_stride = all_ready ? 0 : std::max(sfb_gu, sfb_d);
    const int64_t b_a = up256(n * H / 2), b_sah = up256(sf_rows_max * sfc_h), b_g = up256(n * F * 4),
                  b_h = up256(n * F / 2), b_saf = up256(sf_rows_max * sfc_f), b_y = up256(n * H * 4),
                  b_sfb = up256(E * sfb_stride), b_off = up256(E * 8), b_s = up256(3 * E * 4),
                  b_p = up256(6 * E * int64_t(sizeof(void*))),
                  b_q = up256(int64_t(tc::nvfp4_grouped_params_bytes(sm, int(E))));
    const int na = same_gu ? 1 : 2;
    tc::Nvfp4GroupedArgs g{};
    g.groups = int(E);
    g.offsets = start;
    g.N = int(F);
    g.K = int(H);
    size_t gws_bytes = tc::nvfp4_grouped_workspace(sm, g);
    g.N = int(H);
    g.K = int(F);
    gws_bytes = std::max({gws_bytes, tc::nvfp4_grouped_workspace(sm, g), size_t(256)});
    uint8_t* base = static_cast<uint8_t*>(detail::scratch(
        dev, size_t(na * (b_a + b_sah) + 2 * b_g + b_h + b_saf + b_y + b_sfb + 2 * b_off + 2 * b_s + b_p + 3 * b_q) +
                 gws_bytes));
    uint8_t* p = base;
    auto take = [&p](int64_t bytes) {
      uint8_t* q = p;
      p += bytes;
      return q;
    };
    uint8_t* a4[2] = {take(b_a), nullptr};
    uint8_t* sah[2] = {take(b_sah), nullptr};
    if (!same_gu) {
      a4[1] = take(b_a);
      sah[1] = take(b_sah);
    } else {
      a4[1] = a4[0];
      sah[1] = sah[0];
    }
    float* G = reinterpret_cast<float*>(take(b_g));
    float* U = reinterpret_cast<float*>(take(b_g));
    uint8_t* h4 = take(b_h);
    uint8_t* saf = take(b_saf);
    float* Y = reinterpret_cast<float*>(take(b_y));
    uint8_t* sfb = take(b_sfb);
    int64_t* off_h = reinterpret_cast<int64_t*>(take(b_off));
    int64_t* off_f = reinterpret_cast<int64_t*>(take(b_off));
    float* alpha = reinterpret_cast<float*>(take(b_s));
    float* inscale = reinterpret_cast<float*>(take(b_s));
    const void** bptr = reinterpret_cast<const void**>(p);
    const uint8_t** sfbptr = reinterpret_cast<const uint8_t**>(bptr + 3 * E);
    take(b_p);
    uint8_t* params = take(3 * b_q);
    void* gws = p;

    moe_nvfp4_setup<<<unsigned((E + 255) / 256), 256, 0, s>>>(tab.dev, int(E), start, sfc_h, sfc_f, off_h, off_f,
                                                               alpha, inscale, bptr, sfbptr, sfb, sfb_stride);
    detail::check_launch("moe_experts_nvfp4 setup", x.describe());
    // the scales' padding (rows past a group's, columns past K) must read as 0
    for (int i = 0; i < na; ++i) DFLASH2_CUDA_CHECK(cudaMemsetAsync(sah[i], 0, size_t(b_sah), s), op, " SFA");
    DFLASH2_CUDA_CHECK(cudaMemsetAsync(saf, 0, size_t(b_saf), s), op, " SFA");
    for (int i = 0; i < na; ++i) {
      detail::nvfp4_quantize_grouped_rows(true, x.data_as<const float>(), nullptr, row_stride_2d(x), order, int(K),
                                          start, int(E), off_h, inscale + i * E, n, H, a4[i], sah[i], s);
      detail::check_launch("moe_experts_nvfp4 gather / quantize", x.describe());
    }
    auto grouped = [&](int which, const uint8_t* a, const uint8_t* sa, const int64_t* off, int64_t N, int64_t Kd,
                       float* d, const char* what) {
      if (!all_ready) {
        moe_nvfp4_swizzle<<<detail::ceil_blocks(E * layout::nvfp4_sf_rows(N) * layout::nvfp4_sf_cols(Kd), 256,
                                                detail::kMaxRowBlocks),
                            256, 0, s>>>(tab.dev, start, which, int(E), N, Kd, sfb_stride, sfb);
        detail::check_launch("moe_experts_nvfp4 weight-scale swizzle", what);
      }
      tc::Nvfp4GroupedArgs ga{};
      ga.groups = int(E);
      ga.N = int(N);
      ga.K = int(Kd);
      ga.offsets = start;
      ga.a = a;
      ga.sfa = sa;
      ga.sfa_off = off;
      ga.b = bptr + which * E;
      ga.sfb = sfbptr + which * E;
      ga.alpha = alpha + which * E;
      ga.d = d;
      ga.params = params + which * b_q;
      const std::string err = tc::nvfp4_grouped_gemm(sm, ga, gws, s);
      if (!err.empty()) fail(ErrorKind::Backend, op, " (", what, "): ", err);
      detail::check_launch("moe_experts_nvfp4 grouped GEMM", what);
    };
    grouped(0, a4[0], sah[0], off_h, F, H, G, "gate");
    grouped(1, a4[1], sah[1], off_h, F, H, U, "up");
    detail::nvfp4_quantize_grouped_rows(false, G, U, F, nullptr, 1, start, int(E), off_f, inscale + 2 * E, n, F, h4,
                                        saf, s);
    detail::check_launch("moe_experts_nvfp4 silu * up / quantize", x.describe());
    grouped(2, h4, saf, off_f, H, F, Y, "down");
    moe_fp8_scatter<<<detail::ceil_blocks(n * H, 256, detail::kMaxRowBlocks), 256, 0, s>>>(Y, start, order, int(E), n,
                                                                                             H, y);
    detail::check_launch("moe_experts_nvfp4 scatter", x.describe());
  }
#endif
  if (bf16 && n > 0 && F > 0) {
    // The grouped BF16 tensor-core GEMMs, group g = expert g's positions [start[g],
    // start[g + 1]): gate and up over the gathered rows, silu(gate) * up rounded, down
    // written straight to slot order (y row order[p]). Prompt chunks: gemm_dq.h's
    // mainloop-dequantizing GEMM (64-row tiles); decode chunks: gemm_sk.h's skinny grouped
    // GEMM (the weight as the MMA's A operand, 32-token tiles, K split by N and K only), off
    // in the process if the load-time check turned the skinny kernels off.
    // scratch: A [n, Hp] BF16 | G, U [n, F] F32 | h [n, Fp] BF16 | tile starts [E + 1]
    //          | skinny split partials
    const bool skinny = decode && sk::enabled();
    auto up256 = [](int64_t v) { return (v + 255) / 256 * 256; };
    auto width = [&](int64_t k, WFmt f) {
      const int64_t w8 = (k + 7) / 8 * 8;
      return skinny ? std::max(w8, sk::a_width(f, k)) : w8;
    };
    const int64_t Hp = width(H, tab.gu_fmt), Fp = width(F, tab.down_fmt);
    const int64_t pf = skinny ? std::max(sk::grouped_partial_floats(tab.gu_fmt, F, H, n, 2),
                                         sk::grouped_partial_floats(tab.down_fmt, H, F, n, 1))
                              : 0;
    // (G, U: the prompt kernels only; the skinny one reduces gate and up straight into h)
    const int64_t b_a = up256(n * Hp * 2), b_g = skinny ? 0 : up256(n * F * 4), b_h = up256(n * Fp * 2),
                  b_t = up256((E + 1) * 4), b_p = up256(pf * 4);
    uint8_t* base = static_cast<uint8_t*>(detail::scratch(dev, size_t(b_a + 2 * b_g + b_h + b_t + b_p)));
    __nv_bfloat16* a16 = reinterpret_cast<__nv_bfloat16*>(base);
    float* G = reinterpret_cast<float*>(base + b_a);
    float* U = reinterpret_cast<float*>(base + b_a + b_g);
    __nv_bfloat16* h16 = reinterpret_cast<__nv_bfloat16*>(base + b_a + 2 * b_g);
    int32_t* tiles = reinterpret_cast<int32_t*>(base + b_a + 2 * b_g + b_h);
    float* partial = pf > 0 ? reinterpret_cast<float*>(base + b_a + 2 * b_g + b_h + b_t) : nullptr;
    static_assert(sizeof(ExpertView) == 3 * sizeof(WeightView) && offsetof(ExpertView, gate) == 0 &&
                      offsetof(ExpertView, up) == sizeof(WeightView) &&
                      offsetof(ExpertView, down) == 2 * sizeof(WeightView),
                  "ExpertView: gate, up, down views back to back");
    const WeightView* views = reinterpret_cast<const WeightView*>(tab.dev);
    dq::rows_bf16(dq::RowsFrom::Gather, x.data_as<const float>(), nullptr, row_stride_2d(x), order, int(K),
                  start + E, n, H, Hp, a16, s);
    // which: the projection (0 gate, 1 up, 2 down)
    auto grouped = [&](int which, const __nv_bfloat16* a, int64_t lda, int64_t N, int64_t Kd, WFmt f, bool vec,
                       bool vec16, float* d, int64_t ldd, const int32_t* d_rows) {
      if (skinny) {
        sk::GroupedArgs g = experts_sk_args(views, which, f, vec16, N, Kd, E, start, active, n, a, lda, partial,
                                            detail::zeroed_counters(dev));
        g.d = d;
        g.ldd = ldd;
        g.d_rows = d_rows;
        if (which == 0) {  // gate and up in one launch, reduced straight into h = bf16(silu(gate) * up)
          g.projections = 2;
          g.proj_stride = 1;  // ExpertView: gate, up, down back to back
          g.silu = h16;
          g.ld_silu = Fp;
        }
        sk::grouped_gemm(g, s);
        return;
      }
      dq::GemmArgs g;
      g.a = a;
      g.lda = lda;
      g.table = views + which;
      g.table_stride = 3;
      g.fmt = f;
      g.vec = vec;
      g.groups = int(E);
      g.start = start;
      g.tile_start = tiles;
      g.M = n;
      g.N = N;
      g.K = Kd;
      g.d = d;
      g.ldd = ldd;
      g.d_rows = d_rows;
      dq::gemm(g, s);
    };
    if (skinny) {  // gate and up, then h (the down input), in one launch and its reduction
      grouped(0, a16, Hp, F, H, tab.gu_fmt, tab.gu_vec, tab.gu_vec16, nullptr, F, nullptr);
    } else {
      grouped(0, a16, Hp, F, H, tab.gu_fmt, tab.gu_vec, tab.gu_vec16, G, F, nullptr);
      grouped(1, a16, Hp, F, H, tab.gu_fmt, tab.gu_vec, tab.gu_vec16, U, F, nullptr);
      dq::rows_bf16(dq::RowsFrom::SiluMul, G, U, F, nullptr, 1, start + E, n, F, Fp, h16, s);
    }
    grouped(2, h16, Fp, H, F, tab.down_fmt, tab.down_vec, tab.down_vec16, y, H, order);
  }
  // linear's exact numerics on the tensor cores (ops::exact_tc; gemm_sk.h's exact form) where
  // both formats take it: chosen by the switch and the formats only, never by the batch
  const bool exact_tc = mode == ExpertsMode::Exact && ops::exact_tc() && sk::enabled() &&
                        sk::takes_x3(tab.gu_fmt) && sk::takes_x3(tab.down_fmt);
  if (exact_tc && n > 0 && F > 0) {
    // x's rows gathered in expert order as three BF16 planes; gate and up in one skinny
    // grouped launch whose reduction writes silu(gate) * up (the CPU's formula, fp32) as three
    // planes; down straight to y's slot rows (row map order[p]); then the combine below.
    // scratch: A [n, 3 Hp] BF16 | h [n, 3 Fp] BF16 | split partials
    auto up256 = [](int64_t v) { return (v + 255) / 256 * 256; };
    const int64_t Hp = sk::a_width(tab.gu_fmt, H), Fp = std::max((F + 7) / 8 * 8, sk::a_width(tab.down_fmt, F));
    const int64_t pf = std::max(sk::grouped_partial_floats(tab.gu_fmt, F, H, n, 2),
                                sk::grouped_partial_floats(tab.down_fmt, H, F, n, 1));
    const int64_t b_a = up256(n * 3 * Hp * 2), b_h = up256(n * 3 * Fp * 2), b_p = up256(pf * 4);
    uint8_t* base = static_cast<uint8_t*>(detail::scratch(dev, size_t(b_a + b_h + b_p)));
    __nv_bfloat16* a3 = reinterpret_cast<__nv_bfloat16*>(base);
    __nv_bfloat16* h3 = reinterpret_cast<__nv_bfloat16*>(base + b_a);
    float* partial = pf > 0 ? reinterpret_cast<float*>(base + b_a + b_h) : nullptr;
    const WeightView* views = reinterpret_cast<const WeightView*>(tab.dev);
    sk::split_x3_gather(x.data_as<const float>(), row_stride_2d(x), order, int(K), start + E, n, H, a3, 3 * Hp, Hp, s);
    uint32_t* arrivals = detail::zeroed_counters(dev);
    sk::GroupedArgs g = experts_sk_args(views, 0, tab.gu_fmt, tab.gu_vec16, F, H, E, start, active, n, a3, 3 * Hp,
                                        partial, arrivals);
    g.plane = Hp;
    g.projections = 2;  // gate and up together, reduced into h's planes
    g.proj_stride = 1;
    g.silu = h3;
    g.ld_silu = 3 * Fp;
    g.silu_plane = Fp;
    sk::grouped_gemm(g, s);
    sk::GroupedArgs d = experts_sk_args(views, 2, tab.down_fmt, tab.down_vec16, H, F, E, start, active, n, h3, 3 * Fp,
                                        partial, arrivals);
    d.plane = Fp;
    d.d = y;
    d.ldd = H;
    d.d_rows = order;
    sk::grouped_gemm(d, s);
  }
  if (mode == ExpertsMode::Exact && !exact_tc && n > 0 && F > 0) {
    const int max_active = int(E < n ? E : n);
    const unsigned gy = unsigned(max_active < detail::kMaxGridY ? max_active : detail::kMaxGridY);

    GemvArgs a{};
    a.views = tab.dev;
    a.start = start;
    a.active = active;
    a.order = order;
    a.max_active = max_active;
    // gate / up: x rows by token -> h [n, F]
    a.in = x.data_as<const float>();
    a.in_stride = row_stride_2d(x);
    a.in_div = int(K);
    a.in_vec = detail::aligned(a.in, 16) && a.in_stride % 4 == 0;
    a.out = hbuf;
    a.out_stride = L.h_stride;
    a.rows = F;
    a.kdim = H;
    launch_gemv<true>(tab.gu_fmt, tab.gu_vec, dim3(detail::ceil_blocks(F, kGemvWarps, INT32_MAX), gy), a);
    detail::check_launch("moe_experts gate/up kernel launch", fmt_name(tab.gu_fmt), " [", F, ", ", H, "]");
    // down: h rows by slot -> y [n, H]
    a.in = hbuf;
    a.in_stride = L.h_stride;
    a.in_div = 1;
    a.in_vec = detail::aligned(hbuf, 16) && L.h_stride % 4 == 0;
    a.out = y;
    a.out_stride = H;
    a.rows = H;
    a.kdim = F;
    launch_gemv<false>(tab.down_fmt, tab.down_vec, dim3(detail::ceil_blocks(H, kGemvWarps, INT32_MAX), gy), a);
    detail::check_launch("moe_experts down kernel launch", fmt_name(tab.down_fmt), " [", H, ", ", F, "]");
  }
  const int ct = detail::pick_threads(H, 256);
  const dim3 cgrid(detail::ceil_blocks(H, ct, INT32_MAX), unsigned(T < detail::kMaxGridY ? T : detail::kMaxGridY));
  // F == 0 (no expert width): every held slot's y would be zero; combine reads y only for
  // n > 0 && F > 0, so fall back to K = 0 (zeros) there.
  moe_combine_kernel<<<cgrid, ct, 0, s>>>(y, ip, i_stride, weights.data_as<const float>(), row_stride_2d(weights),
                                          F > 0 ? int(K) : 0, experts.first, int(E), out.data_as<float>(),
                                          row_stride_2d(out), T, H, accumulate);
  detail::check_launch("moe_experts combine kernel launch", x.describe());
}
}  // namespace

void moe_experts(const Tensor& x, const Tensor& ids, const Tensor& weights, const ops::ExpertWeights& experts,
                 Tensor& out, Tensor& workspace, bool accumulate) {
  moe_experts_impl(x, ids, weights, experts, out, workspace, ExpertsMode::Exact, false, accumulate);
}

void moe_experts_bf16(const Tensor& x, const Tensor& ids, const Tensor& weights, const ops::ExpertWeights& experts,
                      Tensor& out, Tensor& workspace, bool decode, bool accumulate) {
  moe_experts_impl(x, ids, weights, experts, out, workspace, ExpertsMode::BF16, decode, accumulate);
}

void moe_experts_nvfp4(const Tensor& x, const Tensor& ids, const Tensor& weights, const ops::ExpertWeights& experts,
                       Tensor& out, Tensor& workspace, bool accumulate) {
  moe_experts_impl(x, ids, weights, experts, out, workspace, ExpertsMode::NVFP4, false, accumulate);
}

#if defined(DFLASH2_WITH_CUTLASS)
namespace {
// Whether `device` exists and every gate / up / down weight of `ex` is a 2-D tensor that
// `ok(weight, N, K)` accepts.
template <class Ok>
bool every_expert_weight(int device, const ops::ExpertWeights& ex, Ok ok) {
  if (device < 0 || device >= device_count()) return false;
  for (size_t e = 0; e < ex.gate.size(); ++e)
    for (const ops::Weight* w : {&ex.gate[e], &ex.up[e], &ex.down[e]})
      if (!w->data.defined() || w->data.ndim() != 2 || !ok(*w, w->out_features, w->in_features)) return false;
  return true;
}
}  // namespace
#endif

bool moe_experts_nvfp4_supported(int device, const ops::ExpertWeights& experts) {
#if defined(DFLASH2_WITH_CUTLASS)
  return every_expert_weight(device, experts, [&](const ops::Weight& w, int64_t N, int64_t K) {
    return tc::nvfp4_grouped_built_for(detail::compute_capability(device)) && w.format == ops::WeightFormat::NVFP4 &&
           w.input_scale >= FLT_MIN && std::isfinite(w.input_scale) && K % 32 == 0 && N % 4 == 0 &&
           w.data.stride(0) == K / 2 && detail::aligned(w.data.data(), 16);
  });
#else
  (void)device;
  (void)experts;
  return false;
#endif
}

bool moe_experts_bf16_supported(int device) {
  if (device < 0 || device >= device_count()) return false;
  try {
    check_arch(device);  // the kernel exists only for the architectures the build targets
    return true;
  } catch (const Error&) {
    return false;
  }
}

void moe_experts_fp8(const Tensor& x, const Tensor& ids, const Tensor& weights, const ops::ExpertWeights& experts,
                     Tensor& out, Tensor& workspace, bool accumulate) {
  moe_experts_impl(x, ids, weights, experts, out, workspace, ExpertsMode::FP8, false, accumulate);
}

bool moe_experts_fp8_supported(int device, const ops::ExpertWeights& experts) {
#if defined(DFLASH2_WITH_CUTLASS)
  return every_expert_weight(device, experts, [&](const ops::Weight& w, int64_t N, int64_t K) {
    return tc::fp8_grouped_built_for(detail::compute_capability(device)) &&
           w.format == ops::WeightFormat::FP8Block128 && K % 16 == 0 && N % 4 == 0 && w.data.stride(0) == K &&
           detail::aligned(w.data.data(), 16) && w.scale.defined() && w.scale.ndim() == 2 &&
           w.scale.stride(0) == (K + 127) / 128 && w.scale.stride(1) == 1;
  });
#else
  (void)device;
  (void)experts;
  return false;
#endif
}

}  // namespace dflash2::cuda
