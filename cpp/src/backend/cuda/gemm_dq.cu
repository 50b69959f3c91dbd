// cuda/gemm_dq.cu: the mainloop-dequantizing BF16 tensor-core GEMM (gemm_dq.h), the W4A16 /
// W8A16 path of Hopper (which has no FP4 MMA) and the grouped GEMM of BF16 / NVFP4 / FP8
// experts in prompt chunks on every architecture. Two forms of one design: dq_gemm_kernel
// (mma.sync, below) and, on Hopper, dq_wg_kernel (wgmma, "the wgmma form" further down).
//
// One CTA (4 warps, 2 x 2) computes a tile of layout::kDqBM = 64 rows x kDqBN = 128 output
// features of one group, in k-tiles of kDqBK = 32 inputs, double-buffered in shared memory:
//   - A (BF16 rows) by cp.async, 16 bytes per copy, zero-filled past the group's rows;
//   - W: a BF16 weight whose rows allow 16-byte copies (and K % 8 == 0) by cp.async as well;
//     any other format in two halves around the math of the previous k-tile: its raw bytes
//     (NVFP4: 4 bytes + an E4M3 scale per 8 inputs, FP8: 8 bytes + the block scale) are
//     loaded into registers before the MMAs, and dequantized (weight_view.cuh's operations,
//     bitwise the CPU's Weight::dequantize), rounded to BF16 and stored after them. Tails
//     (rows >= N, k >= K) and formats without raw staging (F32 / F16 / misaligned rows) are
//     dequantized at the load.
// Each warp computes 32 x 64 with mma.sync.m16n8k16 (BF16 in, fp32 accumulators), operands
// through ldmatrix from rows XOR-swizzled by layout::dq_chunk (conflict-free phases). The
// k-tiles are summed in order, so a row's result does not depend on M, the group or the
// other rows (a prompt chunk's rows equal the same rows of any other chunk).
// Groups: a setup kernel turns the groups' row offsets (on the device: no host sync) into
// their first m-tiles; grid.y covers an upper bound of the m-tiles (layout::dq_max_m_tiles)
// and each CTA finds its group by binary search (layout::dq_tile_rows); CTAs past the last
// tile exit.
//
// Status: compiled for sm_90a / sm_100a / sm_103a, NOT yet run on a GPU.
#include "backend/cuda/gemm_dq.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "backend/cuda/cuda_api.h"
#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/device_attr.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/layout.h"
#include "backend/cuda/mma_sm80.cuh"
#include "backend/cuda/weight_view.cuh"
#include "backend/cuda/wgmma_sm90.cuh"
#include "dflash2/error.h"
#include "dflash2/ops.h"

namespace dflash2::cuda::dq {

namespace {

using detail::WeightView;
using detail::WFmt;
using layout::kDqBK;
using layout::kDqBM;
using layout::kDqBN;
using layout::kDqChunks;

constexpr int kThreads = 128;  // 4 warps: 2 (rows) x 2 (features), 32 x 64 each
constexpr int kBUnits = kDqBN * kDqChunks / kThreads;  // 8-input W units per thread per k-tile (4)
static_assert(kBUnits * kThreads == kDqBN * kDqChunks, "tile split");
static_assert(kDqBK == 32 && kDqChunks == 4, "the swizzle and the fragment loops assume 4 chunks per row");

// ------------------------------------------------------------------ PTX wrappers
using mma::cp_async16;
using mma::cp_async_commit;
using mma::cp_async_wait_all;
using mma::ldmatrix_x4;
using mma::mma_bf16;
using mma::pack_bf16;
using mma::smem_u32;
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  return make_uint4(pack_bf16(f[0], f[1]), pack_bf16(f[2], f[3]), pack_bf16(f[4], f[5]), pack_bf16(f[6], f[7]));
}

struct Params {
  const __nv_bfloat16* a;
  int64_t lda;
  WeightView one;
  const WeightView* table;
  int64_t table_stride;
  bool vec, async_b;
  int groups;
  const int32_t* start;
  const int32_t* tile_start;
  int64_t M, N, K, m_tiles;  // m_tiles: grid.y's extent (an upper bound with groups)
  float* d;
  int64_t ldd;
  const int32_t* d_rows;
  bool accumulate;
};

// One unit of W: 8 inputs of one row, either final BF16 (ready) or the raw bytes and the
// scale that make them (FP8 / NVFP4 with vector-aligned rows, inside the weight).
struct WUnit {
  uint4 v;
  float s;
  bool ready;
};

// 8 inputs of row r from k0 as BF16, element by element where the unit leaves the weight:
// the edges, and the formats without raw staging. Not inlined: it would hold the registers
// of every unit's slow path through the main loop.
template <WFmt F>
__device__ __noinline__ uint4 load_w_slow(const WeightView& w, bool vec, int64_t r, int64_t k0) {
  float f[8];
  if (r < w.N && k0 + 8 <= w.K) {
    if (vec)
      detail::w_load8<F, true>(w, r, k0, f);
    else
      detail::w_load8<F, false>(w, r, k0, f);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = (r < w.N && k0 + i < w.K) ? detail::w_at<F>(w, r, k0 + i) : 0.0f;
  }
  return pack8(f);
}

template <WFmt F>
__device__ __forceinline__ void fetch_w(const WeightView& w, bool vec, int64_t r, int64_t k0, WUnit& u) {
  const bool inside = r < w.N && k0 + 8 <= w.K;
  if constexpr (F == WFmt::NVFP4) {
    if (vec && inside) {
      u.v.x = *reinterpret_cast<const uint32_t*>(w.data + r * w.row_bytes + k0 / 2);
      u.s = detail::e4m3_to_f32(static_cast<const uint8_t*>(w.scale)[r * w.scale_stride + k0 / 16]);
      u.ready = false;
      return;
    }
  } else if constexpr (F == WFmt::FP8) {
    if (vec && inside) {
      const uint2 b = *reinterpret_cast<const uint2*>(w.data + r * w.row_bytes + k0);
      u.v.x = b.x;
      u.v.y = b.y;
      u.s = static_cast<const float*>(w.scale)[(r / 128) * w.scale_stride + k0 / 128];
      u.ready = false;
      return;
    }
  }
  u.v = load_w_slow<F>(w, vec, r, k0);
  u.ready = true;
}

// The unit's 8 BF16 values (w_load8's operations on the raw bytes, then rounded; NVFP4 by
// detail::fp4_word_to_f32 with the tile's weight's q = fp4_global(w): bitwise the same).
template <WFmt F>
__device__ __forceinline__ uint4 finish_w(const detail::Fp4Global& q, const WUnit& u) {
  if constexpr (F == WFmt::NVFP4 || F == WFmt::FP8) {
    if (!u.ready) {
      float f[8];
      if constexpr (F == WFmt::NVFP4) {
        detail::fp4_word_to_f32(q, u.v.x, u.s, f);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i)
          f[i] = __fmul_rn(detail::e4m3_to_f32(uint8_t((i < 4 ? u.v.x : u.v.y) >> (8 * (i & 3)))), u.s);
      }
      return pack8(f);
    }
  }
  (void)q;
  return u.v;
}

// The CTA's m-tile t: its rows [r0, r1) and its group's weight; false when it has no rows
// (block-uniform: no barrier is then skipped by part of the block).
__device__ __forceinline__ bool tile_of(const Params& p, int64_t t, int64_t& r0, int64_t& r1, WeightView& w) {
  int g = 0;
  if (p.start == nullptr) {
    r0 = t * kDqBM;
    r1 = r0 + kDqBM < p.M ? r0 + kDqBM : p.M;
  } else {
    const layout::DqRows rows = layout::dq_tile_rows(p.start, p.tile_start, p.groups, t);
    r0 = rows.first;
    r1 = rows.end;
    g = rows.group;
  }
  if (r0 >= r1) return false;
  w = p.table ? p.table[int64_t(g) * p.table_stride] : p.one;
  return true;
}

// k-tile kt (kBK inputs) of rows [first, first + kRows) of a 16-bit matrix (row i at
// base + i * row_bytes) into shared memory by cp.async, 16 bytes per copy, zeros for rows
// >= end and inputs >= kmax (kmax % 8 == 0); at(row, chunk) is a chunk's shared address.
template <int kBK, int kRows, class At>
__device__ __forceinline__ void copy_tile_async(const uint8_t* base, int64_t row_bytes, int64_t first, int64_t end,
                                                int64_t kmax, int kt, At at) {
  constexpr int kChunks = kBK / 8, kUnits = kRows * kChunks / kThreads;
  static_assert(kUnits * kThreads == kRows * kChunks, "tile split");
#pragma unroll
  for (int i = 0; i < kUnits; ++i) {
    const int idx = threadIdx.x + i * kThreads, row = idx / kChunks, ch = idx % kChunks;
    const int64_t k = int64_t(kt) * kBK + ch * 8, r = first + row;
    const bool valid = r < end && k < kmax;
    cp_async16(at(row, ch), valid ? base + r * row_bytes + 2 * k : base, valid);
  }
}

// k-tile kt of W's rows [n0, n0 + kDqBN) in units of 8 inputs: fetch_w for each of this
// thread's units, then (after the MMAs they overlap) their BF16 values stored at at(row, chunk).
template <WFmt F, int kBK, int kUnits>
__device__ __forceinline__ void fetch_tile(const WeightView& w, bool vec, int64_t n0, int kt, WUnit (&units)[kUnits]) {
  constexpr int kChunks = kBK / 8;
  static_assert(kUnits * kThreads == kDqBN * kChunks, "tile split");
#pragma unroll
  for (int i = 0; i < kUnits; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    fetch_w<F>(w, vec, n0 + idx / kChunks, int64_t(kt) * kBK + (idx % kChunks) * 8, units[i]);
  }
}
template <WFmt F, int kBK, int kUnits, class At>
__device__ __forceinline__ void store_tile(const detail::Fp4Global& q, const WUnit (&units)[kUnits], At at) {
  constexpr int kChunks = kBK / 8;
#pragma unroll
  for (int i = 0; i < kUnits; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    *at(idx / kChunks, idx % kChunks) = finish_w<F>(q, units[i]);
  }
}

template <WFmt F>
__global__ void __launch_bounds__(kThreads) dq_gemm_kernel(const Params p) {
  detail::pdl_enter();
  __shared__ __align__(128) uint4 As[2][kDqBM * kDqChunks];
  __shared__ __align__(128) uint4 Bs[2][kDqBN * kDqChunks];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp >> 1, wn = warp & 1;  // the warp's 32 rows and 64 features
  const int64_t n0 = int64_t(blockIdx.x) * kDqBN;
  const int nk = int((p.K + kDqBK - 1) / kDqBK);
  const int64_t kpad = (p.K + 7) / 8 * 8;  // A's zero-padded width

  for (int64_t t = blockIdx.y; t < p.m_tiles; t += gridDim.y) {
    int64_t r0, r1;
    WeightView w;
    if (!tile_of(p, t, r0, r1, w)) continue;
    const detail::Fp4Global q = detail::fp4_global(w);

    auto load_a = [&](int kt, int st) {
      copy_tile_async<kDqBK, kDqBM>(reinterpret_cast<const uint8_t*>(p.a), 2 * p.lda, r0, r1, kpad, kt,
                                    [&](int row, int ch) { return smem_u32(&As[st][layout::dq_chunk(row, ch)]); });
    };
    auto load_b_async = [&](int kt, int st) {  // K % 8 == 0 on this path: whole chunks
      copy_tile_async<kDqBK, kDqBN>(w.data, w.row_bytes, n0, w.N, w.K, kt,
                                    [&](int row, int ch) { return smem_u32(&Bs[st][layout::dq_chunk(row, ch)]); });
    };
    WUnit units[kBUnits];
    auto fetch_b = [&](int kt) { fetch_tile<F, kDqBK>(w, p.vec, n0, kt, units); };
    auto store_b = [&](int st) {
      store_tile<F, kDqBK>(q, units, [&](int row, int ch) { return &Bs[st][layout::dq_chunk(row, ch)]; });
    };
    const bool async_b = F == WFmt::BF16 && p.async_b;

    float acc[2][8][4];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int ni = 0; ni < 8; ++ni)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[mi][ni][j] = 0.0f;

    // k-tile 0 into stage 0
    load_a(0, 0);
    if (async_b) load_b_async(0, 0);
    cp_async_commit();
    if (!async_b) {
      fetch_b(0);
      store_b(0);
    }
    cp_async_wait_all();
    __syncthreads();

    for (int kt = 0; kt < nk; ++kt) {
      const int cur = kt & 1, nxt = cur ^ 1;
      const bool more = kt + 1 < nk;
      // stage nxt was last read in iteration kt - 1, which ended with a barrier
      if (more) {
        load_a(kt + 1, nxt);
        if (async_b) load_b_async(kt + 1, nxt);
        cp_async_commit();
        if (!async_b) fetch_b(kt + 1);
      }
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {  // two k16 steps per k-tile
        uint32_t af[2][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          const int row = wm * 32 + mi * 16 + layout::dq_a_lane_row(lane), ch = ks * 2 + layout::dq_a_lane_chunk(lane);
          ldmatrix_x4(smem_u32(&As[cur][layout::dq_chunk(row, ch)]), af[mi]);
        }
#pragma unroll
        for (int nj = 0; nj < 4; ++nj) {
          uint32_t bf[4];  // (b0, b1) of features 16 nj + 0..7, then of 16 nj + 8..15
          const int row = wn * 64 + nj * 16 + layout::dq_b_lane_row(lane), ch = ks * 2 + layout::dq_b_lane_chunk(lane);
          ldmatrix_x4(smem_u32(&Bs[cur][layout::dq_chunk(row, ch)]), bf);
#pragma unroll
          for (int mi = 0; mi < 2; ++mi) {
            mma_bf16(acc[mi][2 * nj], af[mi], bf[0], bf[1]);
            mma_bf16(acc[mi][2 * nj + 1], af[mi], bf[2], bf[3]);
          }
        }
      }
      if (more && !async_b) store_b(nxt);
      cp_async_wait_all();
      __syncthreads();
    }

    // epilogue: c0, c1 at (row lane / 4, features 2 (lane % 4) + 0, 1); c2, c3 at row + 8
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t pr = r0 + wm * 32 + mi * 16 + h * 8 + (lane >> 2);
        if (pr >= r1) continue;
        const int64_t drow = p.d_rows ? int64_t(p.d_rows[pr]) : pr;
        float* out = p.d + drow * p.ldd;
#pragma unroll
        for (int ni = 0; ni < 8; ++ni)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int64_t c = n0 + wn * 64 + ni * 8 + (lane & 3) * 2 + j;
            if (c >= p.N) continue;
            const float v = acc[mi][ni][2 * h + j];
            out[c] = p.accumulate ? __fadd_rn(out[c], v) : v;
          }
      }
  }
}

// ------------------------------------------------------------------ the wgmma form (sm_90a)
// The same tiles and operations with Hopper's warpgroup MMA: the CTA's 4 warps are one
// warpgroup, k-tiles of layout::kWgBK = 64 inputs (A 8 KiB + W 16 KiB per stage, two stages
// in dynamic shared memory aligned to 1024 bytes), both operands in the 128-byte swizzle
// (layout::wg_sw128_offset) read by 4 wgmma.m64n128k16 per k-tile through descriptors
// (layout::wg_desc_k_sw128). W's raw bytes for k-tile kt + 1 are loaded before k-tile kt's
// wgmmas are issued and dequantized into the other stage while they run. Every row's sums
// still go k-tile by k-tile in order: a row's result does not depend on M or the group.
using layout::kWgBK;
using layout::kWgChunks;
using layout::kWgATileBytes;
using layout::kWgBTileBytes;
constexpr int kWgStages = 2;
constexpr size_t kWgSmem = size_t(kWgStages) * (kWgATileBytes + kWgBTileBytes) + 1024;  // + alignment slack
constexpr int kWgBUnits = kDqBN * kWgChunks / kThreads;  // 8-input W units per thread per k-tile (8)
static_assert(kWgBUnits * kThreads == kDqBN * kWgChunks, "tile split");
static_assert(kDqBM == 64 && kDqBN == 128 && kThreads == 128, "one warpgroup, wgmma m64n128k16");

template <WFmt F>
__global__ void __launch_bounds__(kThreads) dq_wg_kernel(const Params p) {
  detail::pdl_enter();
  extern __shared__ __align__(128) unsigned char dq_wg_smem[];
  const uint32_t raw = smem_u32(dq_wg_smem), pad = (1024u - (raw & 1023u)) & 1023u;
  unsigned char* const base = dq_wg_smem + pad;
  const uint32_t base_u = raw + pad;
  auto a_at = [&](int st) { return base_u + uint32_t(st * kWgATileBytes); };
  auto b_at = [&](int st) { return base_u + uint32_t(kWgStages * kWgATileBytes + st * kWgBTileBytes); };
  const int tid = threadIdx.x;
  const int64_t n0 = int64_t(blockIdx.x) * kDqBN;
  const int nk = int((p.K + kWgBK - 1) / kWgBK);
  const int64_t kpad = (p.K + 7) / 8 * 8;  // A's zero-padded width

  for (int64_t t = blockIdx.y; t < p.m_tiles; t += gridDim.y) {
    int64_t r0, r1;
    WeightView w;
    if (!tile_of(p, t, r0, r1, w)) continue;
    const detail::Fp4Global q = detail::fp4_global(w);

    auto load_a = [&](int kt, int st) {
      copy_tile_async<kWgBK, kDqBM>(reinterpret_cast<const uint8_t*>(p.a), 2 * p.lda, r0, r1, kpad, kt,
                                    [&](int row, int ch) { return a_at(st) + uint32_t(layout::wg_sw128_offset(row, ch)); });
    };
    auto load_b_async = [&](int kt, int st) {  // K % 8 == 0 on this path: whole chunks
      copy_tile_async<kWgBK, kDqBN>(w.data, w.row_bytes, n0, w.N, w.K, kt,
                                    [&](int row, int ch) { return b_at(st) + uint32_t(layout::wg_sw128_offset(row, ch)); });
    };
    WUnit units[kWgBUnits];
    auto fetch_b = [&](int kt) { fetch_tile<F, kWgBK>(w, p.vec, n0, kt, units); };
    auto store_b = [&](int st) {
      store_tile<F, kWgBK>(q, units, [&](int row, int ch) {
        return reinterpret_cast<uint4*>(base + kWgStages * kWgATileBytes + st * kWgBTileBytes +
                                        layout::wg_sw128_offset(row, ch));
      });
    };
    const bool async_b = F == WFmt::BF16 && p.async_b;

    float acc[64];
#pragma unroll
    for (int v = 0; v < 64; ++v) acc[v] = 0.0f;

    // k-tile 0 into stage 0
    load_a(0, 0);
    if (async_b) load_b_async(0, 0);
    cp_async_commit();
    if (!async_b) {
      fetch_b(0);
      store_b(0);
    }
    cp_async_wait_all();
    wg::fence_proxy_async();  // the stores and copies above, before the tensor cores read them
    __syncthreads();

    for (int kt = 0; kt < nk; ++kt) {
      const int cur = kt & 1, nxt = cur ^ 1;
      const bool more = kt + 1 < nk;
      // stage nxt was last read by k-tile kt - 1's wgmmas, waited for before its barrier
      if (more) {
        load_a(kt + 1, nxt);
        if (async_b) load_b_async(kt + 1, nxt);
        cp_async_commit();
        if (!async_b) fetch_b(kt + 1);
      }
      wg::fence_operands(acc);
      wg::fence();
#pragma unroll
      for (int ks = 0; ks < kWgBK / 16; ++ks)  // k16 steps: 32 bytes further into every row
        wg::mma_64x128(acc, layout::wg_desc_k_sw128(a_at(cur) + 32u * ks),
                       layout::wg_desc_k_sw128(b_at(cur) + 32u * ks));
      wg::commit();
      if (more && !async_b) store_b(nxt);  // dequantized while the wgmmas run
      wg::wait<0>();
      wg::fence_operands(acc);
      cp_async_wait_all();
      wg::fence_proxy_async();
      __syncthreads();
    }

    // epilogue: register v holds (layout::wg_acc_row(tid, v), wg_acc_col(tid, v))
#pragma unroll
    for (int v = 0; v < 64; ++v) {
      const int64_t pr = r0 + layout::wg_acc_row(tid, v), c = n0 + layout::wg_acc_col(tid, v);
      if (pr >= r1 || c >= p.N) continue;
      const int64_t drow = p.d_rows ? int64_t(p.d_rows[pr]) : pr;
      float* out = p.d + drow * p.ldd + c;
      *out = p.accumulate ? __fadd_rn(*out, acc[v]) : acc[v];
    }
  }
}

// The groups' first m-tiles (layout::dq_tile_starts), one thread.
__global__ void dq_tile_starts(const int32_t* __restrict__ start, int groups, int32_t* __restrict__ tile_start) {
  detail::pdl_enter();
  if (blockIdx.x == 0 && threadIdx.x == 0) layout::dq_tile_starts(start, groups, tile_start);
}

template <RowsFrom From>
__global__ void rows_bf16_kernel(const float* __restrict__ x, const float* __restrict__ u, int64_t ldx,
                                 const int32_t* __restrict__ order, int div, const int32_t* __restrict__ used,
                                 int64_t rows, int64_t K, int64_t lda, __nv_bfloat16* __restrict__ a) {
  detail::pdl_enter();
  const int64_t n = rows * lda, limit = used ? int64_t(*used) : rows;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t pr = i / lda, k = i - pr * lda;
    if (pr >= limit) continue;
    float v = 0.0f;
    if (k < K) {
      if constexpr (From == RowsFrom::Plain) {
        v = x[pr * ldx + k];
      } else if constexpr (From == RowsFrom::Gather) {
        v = x[int64_t(order[pr] / div) * ldx + k];
      } else {
        v = detail::silu_mul(x[pr * ldx + k], u[pr * ldx + k]);
      }
    }
    a[i] = __float2bfloat16_rn(v);
  }
}

template <WFmt F>
void launch(const Params& p, dim3 grid, bool wgmma, int device, cudaStream_t s) {
  if (wgmma) {
    detail::allow_smem(dq_wg_kernel<F>, kWgSmem, device, "dq_gemm");
    dq_wg_kernel<F><<<grid, kThreads, kWgSmem, s>>>(p);
  } else {
    dq_gemm_kernel<F><<<grid, kThreads, 0, s>>>(p);
  }
}

}  // namespace

void gemm(const GemmArgs& g, cudaStream_t s) {
  const char* op = "cuda::dq::gemm";
  DFLASH2_CHECK_ARG(g.a && g.d && g.K > 0 && g.K <= int64_t(INT32_MAX) - 32 && g.N >= 0 && g.M >= 0, op,
                    ": bad arguments (K = ", g.K, "; the k-tile count is an int)");
  DFLASH2_CHECK_ARG(detail::aligned(g.a, 16) && g.lda % 8 == 0 && g.lda >= (g.K + 7) / 8 * 8, op,
                    ": A must be 16-byte aligned with lda % 8 == 0 and lda >= round_up(K, 8), found lda ", g.lda);
  DFLASH2_CHECK_ARG(g.groups >= 1 && (g.start != nullptr) == (g.tile_start != nullptr) &&
                        (g.start != nullptr || g.groups == 1) && (g.table != nullptr || g.groups == 1),
                    op, ": inconsistent groups (", g.groups, ")");
  if (g.M == 0 || g.N == 0) return;
  Params p{};
  p.a = g.a;
  p.lda = g.lda;
  p.one = g.one;
  p.table = g.table;
  p.table_stride = g.table_stride;
  p.vec = g.vec;
  // BF16 rows copied as they are: 16-byte rows, whole 8-input chunks
  p.async_b = g.fmt == WFmt::BF16 && g.vec && g.K % 8 == 0;
  p.groups = g.groups;
  p.start = g.start;
  p.tile_start = g.tile_start;
  p.M = g.M;
  p.N = g.N;
  p.K = g.K;
  p.m_tiles = g.start ? layout::dq_max_m_tiles(g.M, g.groups) : layout::dq_m_tiles(g.M);
  p.d = g.d;
  p.ldd = g.ldd;
  p.d_rows = g.d_rows;
  p.accumulate = g.accumulate;
  const int64_t nt = (g.N + kDqBN - 1) / kDqBN;
  DFLASH2_CHECK_ARG(nt <= int64_t(INT32_MAX), op, ": N = ", g.N, " is too large");
  if (g.start) {
    dq_tile_starts<<<1, 32, 0, s>>>(g.start, g.groups, g.tile_start);
    detail::check_launch("dq_gemm tile starts", "");
  }
  const dim3 grid(unsigned(nt), unsigned(p.m_tiles < detail::kMaxGridY ? p.m_tiles : detail::kMaxGridY));
  // Hopper takes the wgmma form (the device, not M, decides: every row of every call on one
  // GPU goes through one kernel)
  int device = 0;
  DFLASH2_CUDA_CHECK(cudaGetDevice(&device), op);
  const bool wgmma = ::dflash2::ops::dq_wgmma() && detail::compute_capability(device) == 90;
  detail::with_format(g.fmt, [&](auto f) { launch<decltype(f)::value>(p, grid, wgmma, device, s); });
  detail::check_launch("dq_gemm kernel launch", "[", g.M, ", ", g.N, ", ", g.K, "]");
}

namespace {
std::atomic<bool> g_linear_enabled{true};
}  // namespace

bool linear_enabled() { return g_linear_enabled.load(std::memory_order_relaxed); }

}  // namespace dflash2::cuda::dq

namespace dflash2::cuda {
bool linear_dq_enabled() { return dq::linear_enabled(); }
void set_linear_dq_enabled(bool on) { dq::g_linear_enabled.store(on, std::memory_order_relaxed); }
}  // namespace dflash2::cuda

namespace dflash2::cuda::dq {

void rows_bf16(RowsFrom from, const float* x, const float* u, int64_t ldx, const int32_t* order, int div,
               const int32_t* used, int64_t rows, int64_t K, int64_t lda, __nv_bfloat16* a, cudaStream_t s) {
  if (rows == 0 || lda == 0) return;
  const unsigned grid = detail::ceil_blocks(rows * lda, 256, detail::kMaxRowBlocks);
  switch (from) {
    case RowsFrom::Plain:
      rows_bf16_kernel<RowsFrom::Plain><<<grid, 256, 0, s>>>(x, u, ldx, order, div, used, rows, K, lda, a);
      break;
    case RowsFrom::Gather:
      rows_bf16_kernel<RowsFrom::Gather><<<grid, 256, 0, s>>>(x, u, ldx, order, div, used, rows, K, lda, a);
      break;
    case RowsFrom::SiluMul:
      rows_bf16_kernel<RowsFrom::SiluMul><<<grid, 256, 0, s>>>(x, u, ldx, order, div, used, rows, K, lda, a);
      break;
  }
  detail::check_launch("dq rows -> bf16", "");
}

}  // namespace dflash2::cuda::dq
