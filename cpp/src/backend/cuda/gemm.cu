// cuda/gemm.cu: the skinny GEMMs of the CUDA backend, written for decode / verify batches
// (M = 1..64 activation rows), where reading the weight from HBM is the whole cost:
//
//   linear        y[M, N] (F32) = x[M, K] (F32) @ W^T, or y += x @ W^T (accumulate). W in
//                 any ops::Weight format (dense F32 / BF16 / F16, FP8 block-128, NVFP4),
//                 read through weight_view.cuh, which dequantizes exactly as the CPU does;
//                 W may be a column slice (row stride > K): rows are addressed by row_bytes.
//                 x and y: F32 2-D with contiguous rows (any row strides).
//   linear_heads  y[t, g, :] = x[t, g, :] @ w[g]^T per head g: the same kernel with the head
//                 in grid y (x F32 [T, G, K], w F32 / BF16 / F16 [G, N, K], y F32 [T, G, N],
//                 any strides with contiguous rows), so each head is bitwise the dense
//                 linear of that head's slices.
//
// Status: compiled for sm_90a/sm_100a/sm_103a, NOT yet run on a GPU. Checked against the
// CPU backend by tests/test_ops.py and tests/cpp/test_cuda_backend.cpp when a GPU is present.
// Before that, this file's kernel and launch logic were run on the CPU under an ad-hoc
// simulation (one host thread per CUDA thread, shuffles and barriers emulated; not part of
// the build): all 5 formats, K % 8 tails, K-splits 1 / 2 / 4, misaligned weights and x,
// accumulate and linear_heads matched a double reference (NMSE < 1e-13) and rows were
// bitwise independent of the batch.
// No CUTLASS here: a later change adds a CUTLASS / wgmma (tcgen05 on sm_100) path for large
// M (prefill), where this kernel becomes compute- and L2-bound (see Performance).
//
// Mapping. A block is 4 warps. Each warp owns kNC = 4 consecutive output columns n and a
// share of K; the K loop walks 8-element chunks (one w_load8 per column: a 32 / 16 / 8 / 4
// byte load per lane, consecutive lanes on consecutive chunks of the same weight row, so a
// warp reads whole rows coalesced). KS = 1, 2 or 4 warps split one column group's K (KS
// is chosen from K, larger for long rows so that each lane still has ~8+ chunks, and raised
// for a small N, whose 16 / KS-column blocks would leave most SMs idle, while each lane
// keeps >= 4 chunks: N = 576, K = 6144 (kv_a) runs 144 blocks instead of 72), so a block
// covers 16 / KS columns and grid x covers N. Where even KS = 4 leaves SMs idle (N below ~2000 at
// K >= 1024: GLM-5.3's kv_a, router and indexer projections), S blocks (grid z, block_split:
// 2, 4 or 8) share a column group's K, each taking a contiguous 1/S of its chunks, and the
// column group's last block to finish adds their partial sums (below). Thread tk (0 <= tk < 32 * KS) of
// a column group takes chunks tk, tk + 32 KS, tk + 64 KS, ... and keeps fp32 accumulators
// acc[RT][kNC] for a tile of RT activation rows: the 8 weights of a chunk are dequantized
// once into registers and used for all RT rows (x rows are read from global through L1:
// the 4 warps of a block, and blocks on the same SM, read the same x chunks). Row tiles:
// RT = 1 when M == 1 (plain decode, fewer registers), RT = 8 otherwise (and always for the
// element-load fallback used when weight rows are not aligned for w_load8); for M > 8 the
// block loops over row tiles itself, so a block's weights come from HBM once (the first
// tile) and from L1 / L2 for the next tiles (a block's weight footprint is 16 / KS rows of
// K, e.g. 8 x 7168 BF16 = 112 KiB), instead of one launch (or grid row) per tile that would
// re-stream a matrix larger than L2 from HBM. The next chunk's weights are loaded before
// the current chunk's FMAs (register double buffering) to keep loads in flight.
// Reduction: the RT x kNC partial sums of a warp are reduced across its 32 lanes by a
// "transposing" butterfly (xor offsets 16, 8, 4, 2, 1; at each step a lane keeps half of
// its values and receives the partner's copy of them, so 32 values cost 31 shuffles and
// lane L ends with value L); with KS > 1 the KS warp results are added through shared
// memory in warp order. Columns past N are clamped for loads (never stored); rows past M
// are skipped.
//
// Numerics: fp32 accumulation with fused multiply-adds; the order differs from the CPU's
// (8 lanes per row, cpu/gemm.cpp), so results agree to fp32 rounding (tests/test_ops.py
// NMSE threshold 1e-11), not bitwise. Per output element y[m, n] the order is: each thread
// chains fma(w[k], x[m, k], acc) over its chunks (k ascending, 8 per chunk), then the
// K % 8 tail element k = 8 * (K / 8) + tk if tk < K % 8 (dequantized by w_at, the reference
// path), then the fixed butterfly over the 32 lanes (the same pairing tree for RT = 1 and
// RT = 8: the transposing steps pair the same lanes as a plain butterfly, and fp32 addition
// is commutative), then the KS warps in order, then (with S > 1 blocks: each block's sum of
// its split of the chunks, the tail in the last split's) the S partial sums in split order,
// read back from scratch by the last block, then y + s when accumulating. This is a
// function of K and N only (KS, S): not of M, the row tile or the row's position in the batch,
// so a row computed inside a verify batch is bitwise equal to the same row decoded alone
// (decode == verify), as on the CPU; linear_heads' heads take the KS of one head's (N, K)
// and no block split (S = 1; the model's heads have K <= 512, which never splits), so each
// head is bitwise the dense linear of its slices where that (N, K) does not split either.
// The block split's last block: every block fences its partial sums and counts itself in on
// a per-column-block arrival counter (atomicAdd, detail::zeroed_counters: zero before and
// after each launch, the last block resets it); the block that brings it to S reads the
// partials back past L1 (__ldcg). Its scratch holds 256 rows: a larger M is several launches. Dequantization is weight_view.cuh's (bitwise the
// CPU's Weight::dequantize values).
//
// Performance notes (not measured yet): decode-shaped calls should run near HBM bandwidth
// when N / (16 / KS) blocks fill the GPU (N >= ~4096 on an H200), and for smaller N by the
// block split (4 blocks per SM where K allows; its cost: the partials' round trip through L2
// and one extra pass by the last block, a few percent of a small GEMV). Known weak spots, for
// later: (1) small N at small K (a split keeps >= 1 chunk per lane, so K = 2048 splits at
// most 2 ways); (2) M >= ~16: x is re-read from
// L2 by every block (x traffic ~ 4 M / (cols_per_block * weight bytes) times the weight
// traffic) and FMA issue dominates for FP8 / NVFP4: stage an x tile in shared memory for
// more columns per block, or hand over to the CUTLASS path; (3) NVFP4 / FP8 dequantize
// every element with fp32 multiplies (an 8-entry per-block table as on the CPU would save
// one multiply per element); (4) FP8 / NVFP4 could double-buffer the raw weight bytes
// instead of the dequantized floats (fewer registers, higher occupancy).
// Registers (ptxas, sm_90a): vector-load kernels 101-128 (dense), 127-160 (FP8 / NVFP4), no
// spills; the misaligned-row fallback 142-243 (FP8 spills 12 bytes on sm_100a / sm_103a).
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "backend/cuda/cuda_api.h"
#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/layout.h"
#include "backend/cuda/scratch.h"
#include "backend/cuda/weight_view.cuh"
#include "dflash2/error.h"

namespace dflash2::cuda {

namespace {

using detail::WeightView;
using detail::WFmt;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kNC = 4;  // output columns per warp
constexpr unsigned kFull = 0xffffffffu;

// Blocks that keep every SM of an H100 / H200 (132) busy twice over.
constexpr int64_t kFillBlocks = 2 * 132;
// The block split's target: the 4 blocks per SM the launch bounds allow (memory-bound
// decode shapes want every SM's loads in flight), at most kMaxSplits blocks per column group,
// and rows of at most kSplitRows per launch (a verify step of 32 x 8 rows is one launch; the
// partial sums' scratch, S x 256 x N floats, stays under 4.3 MB since S N < 4 x 528).
constexpr int64_t kSplitFillBlocks = 4 * 132;
constexpr int kMaxSplits = 8;
constexpr int64_t kSplitRows = 256;

// Warps splitting one column group's K: a function of K and N only, never of M (see
// Numerics). From K: each lane keeps ~8+ chunks; then, while N's blocks (16 / KS columns
// each) would not fill the GPU, more warps share a column group as long as each lane keeps
// >= 4 chunks.
inline int k_split(int64_t K, int64_t N) {
  const int64_t chunks = K / 8;
  int ks = chunks >= 4 * 32 * 8 ? 4 : chunks >= 2 * 32 * 8 ? 2 : 1;  // K >= 8192 / 4096
  auto blocks = [N](int k) { return (N + int64_t(kWarps / k) * kNC - 1) / (int64_t(kWarps / k) * kNC); };
  while (ks < kWarps && blocks(ks) < kFillBlocks && chunks >= int64_t(2 * ks) * 32 * 4) ks *= 2;
  return ks;
}

// Blocks splitting one column group's K after the warps have (KS = 4: the block holds one
// column group of kNC columns): a function of K and N only (see Numerics). While the grid
// would leave SMs short of kSplitFillBlocks, the split doubles as long as every lane of
// every split keeps at least one 8-element chunk. GLM-5.3's small-N decode projections at
// K = 6144: kv_a (N = 576) 144 -> 576 blocks, the router (256) 64 -> 256, the indexer's wk
// (128) 32 -> 128 and weights_proj (32) 8 -> 32.
inline int block_split(int64_t K, int64_t N, int ks) {
  if (ks < kWarps) return 1;
  const int64_t chunks = K / 8, bx = (N + kNC - 1) / kNC;
  int s = 1;
  while (s < kMaxSplits && bx * s < kSplitFillBlocks && chunks >= int64_t(2 * s) * 32 * kWarps) s *= 2;
  return s;
}

struct GemmArgs {
  WeightView w;          // head 0's weight; N, K
  int64_t w_head_bytes;  // byte step between heads' weights (linear: 0)
  const float* x;
  int64_t ldx, x_head;   // elements: row stride, head stride
  float* y;
  int64_t ldy, y_head;
  int64_t M, G;          // rows (tokens), heads
  int ks;                // k_split(K, N)
  int splits;            // block_split(K, N, ks) (heads: 1); grid z
  int64_t split_chunks;  // 8-element chunks per split (the last split takes what is left)
  float* part;           // splits > 1: the splits' partial sums [splits, M, N] (scratch)
  uint32_t* arrivals;    // splits > 1: per column block, its splits done so far (zeroed_counters)
  bool x_vec;            // x rows can be read as float4 at every 8-element chunk
  bool accumulate;
  // linear_many's gated pair (linear_silu_mul; else null): the gate's and the up projection's
  // partial sums [splits, M, N] each. Every block of either writes its sums there (one split
  // too), and the last of a column block's 2 x splits blocks (their shared counter: arrivals[bx]
  // of both) writes y = silu_mul(gate, up) from them.
  const float* gate_part;
  const float* up_part;
};

// x[k0 .. k0 + 7] of one row (k0 % 8 == 0, k0 + 8 <= K).
__device__ __forceinline__ void load_x8(const float* __restrict__ p, bool vec, float out[8]) {
  if (vec) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p));
    const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = __ldg(p + j);
  }
}

// Sum of v[0..V) over the 32 lanes of the warp (V a power of two <= 32). Returns, in every
// lane, the total of value index `reduced_index<V>(lane)` (lane L for V = 32; for V < 32
// lanes L and L' with the same bits at offsets >= 32 / V hold the same total); each total
// is formed by the butterfly over xor offsets 16, 8, 4, 2, 1 whatever V (the same pairing
// tree, so the same fp32 result for every V).
template <int OFF, int COUNT, int V>
__device__ __forceinline__ void transpose_step(float (&v)[V], int lane) {
  if constexpr (OFF > 0) {
    if constexpr (COUNT > 1) {
      constexpr int half = COUNT / 2;
      const bool up = (lane & OFF) != 0;
#pragma unroll
      for (int i = 0; i < half; ++i) {
        const float send = up ? v[i] : v[i + half];
        const float keep = up ? v[i + half] : v[i];
        v[i] = __fadd_rn(keep, __shfl_xor_sync(kFull, send, OFF));
      }
      transpose_step<OFF / 2, half, V>(v, lane);
    } else {
      v[0] = __fadd_rn(v[0], __shfl_xor_sync(kFull, v[0], OFF));
      transpose_step<OFF / 2, 1, V>(v, lane);
    }
  }
}
template <int V>
__device__ __forceinline__ float warp_transpose_sum(float (&v)[V], int lane) {
  static_assert(V >= 1 && V <= 32 && (V & (V - 1)) == 0, "V must be a power of two <= 32");
  transpose_step<16, V, V>(v, lane);
  return v[0];
}
// The value index whose total lane `lane` holds after warp_transpose_sum<V>: the offsets
// 16, 8, .. at which a lane kept the upper half, weighted by that half.
template <int V>
__device__ __forceinline__ int reduced_index(int lane) {
  int idx = 0, count = V;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    if (count > 1) {
      const int half = count / 2;
      if (lane & off) idx += half;
      count = half;
    }
  }
  return idx;
}

// Occupancy: the vector-load kernels of the dense formats are capped at 128 registers (4
// blocks = 16 warps per SM, no spills); FP8 / NVFP4 (dequantization in registers) at 168
// (3 blocks), where the 128 cap spilled on sm_100a; the element-load fallback for
// misaligned rows is left uncapped (rare).
template <WFmt F, bool kVec>
constexpr int min_blocks() {
  return !kVec ? 1 : (F == WFmt::FP8 || F == WFmt::NVFP4) ? 3 : 4;
}

// A block's work: column block `bx` of `a` (grid x), its heads (grid y) and split (grid z).
// kGated: whether `a` may be half of a gated pair (a.gate_part set; linear_many_kernel only).
template <WFmt F, bool kVec, int RT, bool kGated>
__device__ __forceinline__ void linear_block(const GemmArgs& a, const int64_t bx) {
  constexpr int V = RT * kNC;  // partial sums per thread
  __shared__ float part[kWarps][V];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int ks = a.ks, groups = kWarps / ks;
  const int cg = warp % groups, kp = warp / groups;
  const int tk = kp * 32 + lane, T = 32 * ks;
  const int64_t N = a.w.N, K = a.w.K, C = K / 8;
  const int tail = int(K - 8 * C);
  // this block's split of the chunks (one split: all of them); the K % 8 tail goes to the last
  const int z = int(blockIdx.z);
  const int64_t c_begin = int64_t(z) * a.split_chunks;
  const int64_t c_end = c_begin + a.split_chunks < C ? c_begin + a.split_chunks : C;
  const bool tail_here = z == a.splits - 1;
  const int64_t n_base = bx * (groups * kNC) + int64_t(cg) * kNC;
  const bool active = n_base < N;  // warp-uniform; inactive warps still join the barriers
  int64_t ncol[kNC];               // clamped for loads
#pragma unroll
  for (int c = 0; c < kNC; ++c) ncol[c] = n_base + c < N ? n_base + c : N - 1;
  const bool gated = kGated && a.gate_part != nullptr;
  const int ridx = reduced_index<V>(lane);
  // lanes whose bits below 32 / V are zero hold the V distinct totals (lane L holds value
  // reduced_index<V>(L); the other lanes hold copies)
  const bool writer = (lane & (32 / V - 1)) == 0;

  for (int64_t g = blockIdx.y; g < a.G; g += gridDim.y) {
    WeightView w = a.w;
    w.data += g * a.w_head_bytes;
    const float* __restrict__ xg = a.x + g * a.x_head;
    float* yg = a.y + g * a.y_head;

    for (int64_t m0 = 0; m0 < a.M; m0 += RT) {
      const int rows = a.M - m0 < RT ? int(a.M - m0) : RT;
      float acc[V];
#pragma unroll
      for (int i = 0; i < V; ++i) acc[i] = 0.0f;

      if (active) {
        float wn[kNC][8];
        int64_t c = c_begin + tk;
        if (c < c_end) {
#pragma unroll
          for (int j = 0; j < kNC; ++j) detail::w_load8<F, kVec>(w, ncol[j], 8 * c, wn[j]);
        }
        for (; c < c_end; c += T) {
          float wc[kNC][8];
#pragma unroll
          for (int j = 0; j < kNC; ++j)
#pragma unroll
            for (int e = 0; e < 8; ++e) wc[j][e] = wn[j][e];
          if (c + T < c_end) {
#pragma unroll
            for (int j = 0; j < kNC; ++j) detail::w_load8<F, kVec>(w, ncol[j], 8 * (c + T), wn[j]);
          }
#pragma unroll
          for (int r = 0; r < RT; ++r) {
            if (r < rows) {
              float xv[8];
              load_x8(xg + (m0 + r) * a.ldx + 8 * c, a.x_vec, xv);
#pragma unroll
              for (int j = 0; j < kNC; ++j)
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[r * kNC + j] = __fmaf_rn(wc[j][e], xv[e], acc[r * kNC + j]);
            }
          }
        }
        if (tail_here && tk < tail) {
          const int64_t k = 8 * C + tk;
          float wt[kNC];
#pragma unroll
          for (int j = 0; j < kNC; ++j) wt[j] = detail::w_at<F>(w, ncol[j], k);
#pragma unroll
          for (int r = 0; r < RT; ++r) {
            if (r < rows) {
              const float xv = __ldg(xg + (m0 + r) * a.ldx + k);
#pragma unroll
              for (int j = 0; j < kNC; ++j) acc[r * kNC + j] = __fmaf_rn(wt[j], xv, acc[r * kNC + j]);
            }
          }
        }
      }

      float s = warp_transpose_sum<V>(acc, lane);  // all lanes take part (active is warp-uniform)
      const int r = ridx / kNC, j = ridx % kNC;
      const int64_t n = n_base + j;
      if (ks > 1) {
        if (writer) part[warp][ridx] = s;
        __syncthreads();
        if (kp == 0 && writer) {
          for (int q = 1; q < ks; ++q) s = __fadd_rn(s, part[cg + q * groups][ridx]);
        }
        __syncthreads();  // part is rewritten by the next tile
      }
      if (kp == 0 && writer && r < rows && n < N) {
        if (a.splits == 1 && !gated) {
          float* out = yg + (m0 + r) * a.ldy + n;
          *out = a.accumulate ? __fadd_rn(*out, s) : s;
        } else {
          a.part[(int64_t(z) * a.M + m0 + r) * N + n] = s;  // G == 1 with splits / gated
        }
      }
    }
  }
  if (a.splits > 1 || gated) {
    // The block of a column group that finishes last adds the splits' partial sums in split
    // order (so the result is the same whichever block that is) and writes y; the others'
    // writes are visible to it: each block fences them before it counts itself in. A gated
    // pair's gate and up blocks of one column block count on one counter (2 x splits).
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    const uint32_t arrive = uint32_t(gated ? 2 * a.splits : a.splits);
    if (threadIdx.x == 0) last = atomicAdd(&a.arrivals[bx], 1u) == arrive - 1u;
    __syncthreads();
    if (!last) return;
    __threadfence();
    // the block's columns: one column group (kNC) with splits > 1, which only KS = kWarps takes
    const int64_t cols = int64_t(groups) * kNC, n0 = bx * cols;
    auto sum = [&](const float* p, int64_t m, int64_t n) {
      float s = __ldcg(p + m * N + n);
      for (int q = 1; q < a.splits; ++q) s = __fadd_rn(s, __ldcg(p + (int64_t(q) * a.M + m) * N + n));
      return s;
    };
    for (int64_t i = threadIdx.x; i < a.M * cols; i += kThreads) {
      const int64_t m = i / cols, n = n0 + i % cols;
      if (n >= N) continue;
      float* out = a.y + m * a.ldy + n;
      if (gated) {
        *out = detail::silu_mul(sum(a.gate_part, m, n), sum(a.up_part, m, n));
      } else {
        const float s = sum(a.part, m, n);
        *out = a.accumulate ? __fadd_rn(*out, s) : s;
      }
    }
    if (threadIdx.x == 0) a.arrivals[bx] = 0u;  // zero again for the next launch on this stream
  }
}

template <WFmt F, bool kVec, int RT>
__global__ void __launch_bounds__(kThreads, min_blocks<F, kVec>()) linear_kernel(const GemmArgs a) {
  detail::pdl_enter();
  linear_block<F, kVec, RT, false>(a, blockIdx.x);
}

// linear_many: up to kMany GEMMs of one x (one format, vector loads, G = 1) in one launch;
// GEMM i owns the column blocks [i ? end[i - 1] : 0, end[i]) of grid x, and grid z is the
// largest split (a GEMM's blocks past its own split return at once). Each GEMM's block does
// exactly what its own launch's block would: the same results, bit for bit.
constexpr int kMany = 4;
struct ManyArgs {
  GemmArgs g[kMany];
  int64_t end[kMany];
  int n;
};

template <WFmt F, int RT>
__global__ void __launch_bounds__(kThreads, min_blocks<F, true>()) linear_many_kernel(const __grid_constant__ ManyArgs m) {
  detail::pdl_enter();
  int i = 0;
  while (int64_t(blockIdx.x) >= m.end[i]) ++i;  // i < n: grid x = end[n - 1]
  const GemmArgs& a = m.g[i];
  if (int(blockIdx.z) >= a.splits) return;  // the whole block: before any barrier
  // (a is read through a generic pointer into the parameters, not as constant-bank operands
  // like linear_kernel's: sm_90a spills 12-16 bytes in the 8-row and F32 forms; a copy into
  // shared memory spilled 40-72 bytes in the dense 8-row forms instead)
  linear_block<F, true, RT, true>(a, int64_t(blockIdx.x) - (i ? m.end[i - 1] : 0));
}

template <WFmt F>
void launch_fmt(const GemmArgs& a, bool wvec, dim3 grid) {
  cudaStream_t st = detail::stream();
  if (wvec) {
    if (a.M == 1)
      linear_kernel<F, true, 1><<<grid, kThreads, 0, st>>>(a);
    else
      linear_kernel<F, true, 8><<<grid, kThreads, 0, st>>>(a);
  } else {
    linear_kernel<F, false, 8><<<grid, kThreads, 0, st>>>(a);  // misaligned rows: rare, one tile size
  }
}

// Fills the launch-shape fields of `a` (ks, splits, x_vec), picks the instantiation and
// launches (with splits, one launch per kSplitRows rows: each row's sums are the same in any).
// The launch shape of `a` as a function of K and N only (Numerics): ks, splits,
// split_chunks; returns its column blocks (grid x).
int64_t plan(GemmArgs& a, int64_t N, const char* what) {
  const int64_t K = a.w.K;
  a.ks = k_split(K, N);
  a.splits = a.G == 1 ? block_split(K, N, a.ks) : 1;
  a.split_chunks = (K / 8 + a.splits - 1) / a.splits;
  const int64_t cols_per_block = (kWarps / a.ks) * kNC;
  const int64_t bx = (N + cols_per_block - 1) / cols_per_block;
  DFLASH2_CHECK_ARG(bx <= int64_t(INT32_MAX), "cuda::", what, ": ", N, " output features are too many for one launch");
  return bx;
}

void run(GemmArgs& a, int64_t N, int device, const char* what) {
  const int64_t bx = plan(a, N, what);
  if (a.splits > 1) {
    DFLASH2_INTERNAL(bx <= detail::kCounterWords, "cuda::", what, ": ", bx, " column blocks split");
    const int64_t rows = a.M < kSplitRows ? a.M : kSplitRows;
    a.part = static_cast<float*>(detail::scratch(device, size_t(a.splits) * size_t(rows) * size_t(N) * 4));
    a.arrivals = detail::zeroed_counters(device);
  }
  a.x_vec = detail::aligned(a.x, 16) && (a.M == 1 || a.ldx % 4 == 0) && (a.G == 1 || a.x_head % 4 == 0);
  // every head's rows must take the vector load: check head 0 and the head step
  bool wvec = detail::weight_rows_vectorizable(a.w);
  if (wvec && a.G > 1) {
    WeightView next = a.w;
    next.data += a.w_head_bytes;
    wvec = detail::weight_rows_vectorizable(next);
  }
  const dim3 grid(unsigned(bx), unsigned(a.G < detail::kMaxGridY ? a.G : detail::kMaxGridY), unsigned(a.splits));
  auto launch = [&](const GemmArgs& b) {
    detail::with_format(b.w.fmt, [&](auto f) { launch_fmt<decltype(f)::value>(b, wvec, grid); });
  };
  if (a.splits == 1) return launch(a);
  for (int64_t m0 = 0; m0 < a.M; m0 += kSplitRows) {  // the scratch holds kSplitRows rows' partials
    GemmArgs b = a;
    b.M = a.M - m0 < kSplitRows ? a.M - m0 : kSplitRows;
    b.x = a.x + m0 * a.ldx;
    b.y = a.y + m0 * a.ldy;
    launch(b);
  }
}

// Rows of an output must not overlap (two threads would write one element): given the
// (size, stride) of its row dims, a sufficient condition is that, sorted by stride, each
// row dim steps past everything inside the previous one.
void check_out_rows(int n, const int64_t* size, const int64_t* stride, int64_t cols, const char* op) {
  int64_t span = cols;  // extent covered by the inner dims so far
  int order[2] = {0, 1};
  if (n == 2 && stride[1] < stride[0]) {
    order[0] = 1;
    order[1] = 0;
  }
  for (int i = 0; i < n; ++i) {
    const int d = order[i];
    if (size[d] <= 1) continue;
    DFLASH2_CHECK_ARG(stride[d] >= span, "cuda::", op, ": the rows of 'y' overlap (row stride ", stride[d],
                      " over an extent of ", span, " elements)");
    span = stride[d] * size[d];
  }
}

}  // namespace

namespace {
// linear's checks; the problem as GemmArgs (launch shape unset). Returns false for an empty one.
bool linear_args(const Tensor& x, const ops::Weight& w, Tensor& y, bool accumulate, const char* op, GemmArgs& a) {
  DFLASH2_CHECK_ARG(x.defined() && y.defined(), op, ": undefined tensor argument");
  DFLASH2_CHECK_ARG(x.device().is_cuda() && y.device() == x.device(), op,
                    ": x and y must be on the same CUDA device, found ", x.describe(), ", ", y.describe());
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
  const int64_t ysize[1] = {M}, ystride[1] = {y.stride(0)};
  check_out_rows(1, ysize, ystride, N, "linear");
  a = GemmArgs{};
  a.w = v;
  a.w_head_bytes = 0;
  a.x = x.data_as<const float>();
  a.ldx = x.stride(0);
  a.x_head = 0;
  a.y = y.data_as<float>();
  a.ldy = y.stride(0);
  a.y_head = 0;
  a.M = M;
  a.G = 1;
  a.accumulate = accumulate;
  return M != 0 && N != 0;
}
}  // namespace

void linear(const Tensor& x, const ops::Weight& w, Tensor& y, bool accumulate) {
  GemmArgs a;
  if (!linear_args(x, w, y, accumulate, "cuda::linear", a)) return;
  const int device = x.device().index;
  detail::DeviceGuard guard(device);
  if (exact_tc_takes(a.w)) {  // the exact form on the tensor cores (ops::exact_tc; gemm_sk.h)
    Tensor* const out = &y;
    linear_exact_tc(x, &a.w, &out, 1, accumulate);
    detail::check_launch("linear (exact form) launch", w.name, " ", x.describe(), " -> ", y.describe());
    return;
  }
  run(a, a.w.N, device, "linear");
  detail::check_launch("linear kernel launch", w.name, " ", x.describe(), " -> ", y.describe());
}

namespace {
// One launch of linear_many_kernel over gs[0 .. n) (2 <= n <= kMany GEMMs of one x, one format,
// vectorizable weights, M <= kSplitRows rows); false if their blocks do not fit one launch.
// gated: gs[0], gs[1] are a gate and an up projection of one shape whose y is silu_mul's out.
bool launch_many(const GemmArgs* gs, int n, int device, bool gated = false) {
  ManyArgs m{};
  m.n = n;
  const int64_t M = gs[0].M;
  int64_t blocks = 0, part_floats = 0;
  int max_splits = 1;
  for (int i = 0; i < n; ++i) {
    m.g[i] = gs[i];
    GemmArgs& a = m.g[i];
    blocks += plan(a, a.w.N, "linear_many");
    m.end[i] = blocks;
    if (a.splits > 1 || gated) part_floats += int64_t(a.splits) * M * a.w.N;
    max_splits = a.splits > max_splits ? a.splits : max_splits;
  }
  DFLASH2_INTERNAL(!gated || (n == 2 && m.g[0].w.N == m.g[1].w.N && m.g[0].splits == m.g[1].splits &&
                              m.end[0] * 2 == m.end[1]),
                   "cuda::linear_many: a gated pair of different shapes");
  const bool counted = max_splits > 1 || gated;
  if (blocks > int64_t(INT32_MAX) || (counted && (gated ? m.end[0] : blocks) > detail::kCounterWords)) return false;
  if (counted) {
    float* part = static_cast<float*>(detail::scratch(device, size_t(part_floats) * 4));
    uint32_t* counters = detail::zeroed_counters(device);
    for (int i = 0; i < n; ++i) {
      GemmArgs& a = m.g[i];
      if (a.splits == 1 && !gated) continue;
      a.part = part;
      part += int64_t(a.splits) * M * a.w.N;
      // the counters of its own column blocks; a gated pair's gate and up share theirs
      a.arrivals = counters + (i && !gated ? m.end[i - 1] : 0);
    }
    if (gated) {
      m.g[0].gate_part = m.g[1].gate_part = m.g[0].part;
      m.g[0].up_part = m.g[1].up_part = m.g[1].part;
    }
  }
  const bool x_vec = detail::aligned(m.g[0].x, 16) && (M == 1 || m.g[0].ldx % 4 == 0);
  for (int i = 0; i < n; ++i) m.g[i].x_vec = x_vec;
  const dim3 grid(unsigned(blocks), 1u, unsigned(max_splits));
  cudaStream_t st = detail::stream();
  detail::with_format(m.g[0].w.fmt, [&](auto f) {
    constexpr WFmt F = decltype(f)::value;
    if (M == 1)
      linear_many_kernel<F, 1><<<grid, kThreads, 0, st>>>(m);
    else
      linear_many_kernel<F, 8><<<grid, kThreads, 0, st>>>(m);
  });
  return true;
}
}  // namespace

void linear_many(const Tensor& x, const std::vector<const ops::Weight*>& ws, const std::vector<Tensor*>& ys,
                 bool& done) {
  done = false;
  const char* op = "cuda::linear_many";
  DFLASH2_CHECK_ARG(ws.size() == ys.size(), op, ": ", ws.size(), " weights but ", ys.size(), " outputs");
  const size_t n = ws.size();
  if (n < 2 || x.shape(0) > kSplitRows) return;  // ops::linear_as_many: one by one
  std::vector<GemmArgs> gs(n);
  for (size_t i = 0; i < n; ++i) {
    DFLASH2_CHECK_ARG(ws[i] && ys[i], op, ": null weight or output ", i);
    if (!linear_args(x, *ws[i], *ys[i], false, op, gs[i])) return;  // an empty one: one by one
  }
  // run in any order (grouped by format): no output may share an element with x or another
  for (size_t i = 0; i < n; ++i)
    for (size_t j = 0; j <= i; ++j)
      if ((j < i && !layout::views_disjoint(*ys[i], *ys[j])) || !layout::views_disjoint(*ys[i], x)) return;
  const int device = x.device().index;
  detail::DeviceGuard guard(device);
  // the weights the exact form on the tensor cores takes (as linear would: the same numerics
  // whichever way a weight comes), x split once for all of them; the others below
  std::vector<bool> taken(n, false);
  std::vector<WeightView> tc_w;
  std::vector<Tensor*> tc_y;
  for (size_t i = 0; i < n; ++i)
    if (exact_tc_takes(gs[i].w)) {
      taken[i] = true;
      tc_w.push_back(gs[i].w);
      tc_y.push_back(ys[i]);
    }
  if (!tc_w.empty()) {
    linear_exact_tc(x, tc_w.data(), tc_y.data(), tc_w.size(), false);
    detail::check_launch("linear_many (exact form) launch", ws[0]->name, " ", x.describe());
  }
  for (size_t i = 0; i < n; ++i) {
    if (taken[i]) continue;
    // the weights of i's format not yet run (vector loads: the fused kernel's only form)
    std::vector<GemmArgs> group;
    std::vector<size_t> idx;
    for (size_t j = i; j < n && group.size() < size_t(kMany); ++j)
      if (!taken[j] && gs[j].w.fmt == gs[i].w.fmt && detail::weight_rows_vectorizable(gs[j].w)) {
        group.push_back(gs[j]);
        idx.push_back(j);
      }
    if (group.size() >= 2 && launch_many(group.data(), int(group.size()), device)) {
      for (size_t j : idx) taken[j] = true;
      detail::check_launch("linear_many kernel launch", ws[i]->name, " ", x.describe());
      continue;
    }
    taken[i] = true;
    run(gs[i], gs[i].w.N, device, "linear");
    detail::check_launch("linear kernel launch", ws[i]->name, " ", x.describe(), " -> ", ys[i]->describe());
  }
  done = true;
}

void linear_silu_mul(const Tensor& x, const ops::Weight& gate, const ops::Weight& up, Tensor& out, bool& done) {
  done = false;
  const char* op = "cuda::linear_silu_mul";
  if (x.shape(0) > kSplitRows) return;  // ops::gated_mlp: one by one
  GemmArgs gs[2];
  if (!linear_args(x, gate, out, false, op, gs[0]) || !linear_args(x, up, out, false, op, gs[1])) return;
  if (gs[0].w.fmt != gs[1].w.fmt || gs[0].w.K != gs[1].w.K || !detail::weight_rows_vectorizable(gs[0].w) ||
      !detail::weight_rows_vectorizable(gs[1].w) || !layout::views_disjoint(out, x))
    return;
  // the exact form on the tensor cores takes them (ops::gated_mlp: linear_as_many, silu_mul)
  if (exact_tc_takes(gs[0].w) || exact_tc_takes(gs[1].w)) return;
  const int device = x.device().index;
  detail::DeviceGuard guard(device);
  if (!launch_many(gs, 2, device, /*gated=*/true)) return;
  detail::check_launch("linear_many kernel launch (gated)", gate.name, " ", x.describe(), " -> ", out.describe());
  done = true;
}

void linear_heads(const Tensor& x, const Tensor& w, Tensor& y) {
  DFLASH2_CHECK_ARG(x.defined() && w.defined() && y.defined(), "cuda::linear_heads: undefined tensor argument");
  DFLASH2_CHECK_ARG(x.device().is_cuda() && w.device() == x.device() && y.device() == x.device(),
                    "cuda::linear_heads: x, w and y must be on the same CUDA device, found ", x.describe(), ", ",
                    w.describe(), ", ", y.describe());
  DFLASH2_CHECK_ARG(x.dtype() == DType::F32 && y.dtype() == DType::F32 && x.ndim() == 3 && y.ndim() == 3 &&
                        w.ndim() == 3,
                    "cuda::linear_heads: x and y must be F32 3-D and w 3-D, found ", x.describe(), ", ", w.describe(),
                    ", ", y.describe());
  const int64_t T = x.shape(0), G = x.shape(1), K = x.shape(2), N = w.shape(1);
  DFLASH2_CHECK_ARG(w.shape(0) == G && w.shape(2) == K && y.shape(0) == T && y.shape(1) == G && y.shape(2) == N,
                    "cuda::linear_heads: x ", x.describe(), ", w ", w.describe(), " and y ", y.describe(),
                    " must be [T, G, K], [G, N, K] and [T, G, N]");
  DFLASH2_CHECK_ARG((x.stride(2) == 1 || K <= 1) && w.stride(2) == 1 && (y.stride(2) == 1 || N <= 1),
                    "cuda::linear_heads: rows must be contiguous, found strides ", shape_str(x.strides()), ", ",
                    shape_str(w.strides()), " and ", shape_str(y.strides()));
  WeightView v;
  switch (w.dtype()) {
    case DType::F32: v.fmt = WFmt::F32; break;
    case DType::BF16: v.fmt = WFmt::BF16; break;
    case DType::F16: v.fmt = WFmt::F16; break;
    default:
      fail(ErrorKind::InvalidArgument, "cuda::linear_heads: w must be F32, BF16 or F16, found ", w.describe());
  }
  const int64_t ysize[2] = {T, G}, ystride[2] = {y.stride(0), y.stride(1)};
  check_out_rows(2, ysize, ystride, N, "linear_heads");
  if (T == 0 || G == 0 || N == 0) return;
  const int64_t es = int64_t(w.itemsize());
  v.data = static_cast<const uint8_t*>(w.data());
  v.row_bytes = w.stride(1) * es;
  v.N = N;
  v.K = K;
  GemmArgs a{};
  a.w = v;
  a.w_head_bytes = w.stride(0) * es;
  a.x = x.data_as<const float>();
  a.ldx = x.stride(0);
  a.x_head = x.stride(1);
  a.y = y.data_as<float>();
  a.ldy = y.stride(0);
  a.y_head = y.stride(1);
  a.M = T;
  a.G = G;
  a.accumulate = false;
  const int device = x.device().index;
  detail::DeviceGuard guard(device);
  run(a, N, device, "linear_heads");
  detail::check_launch("linear_heads kernel launch", x.describe(), " by ", w.describe());
}

}  // namespace dflash2::cuda
