// cuda/gemm_sk.cu: the skinny tensor-core GEMM of generated tokens (gemm_sk.h).
//
// Why: a decode step's projections have M = 1 .. 256 rows (batch x block) against weights of
// megabytes to gigabytes, so they are bound by reading the weight once. The prompt kernels
// (CUTLASS 128 x 128 tiles, gemm_dq.cu's 64 x 128) put the tokens on the MMA's M side: at
// M = 8 they use 1/16 .. 1/8 of each MMA, launch N / 128 CTAs (48 for N = 6144, 5 for
// GLM-5.3's kv_a) and cannot split K without making a row depend on its batch. Here the
// roles swap (y^T = W x^T, the classic "swap AB" of skinny GEMMs):
//   - A = the weight: 16 output features per warp, 4 warps per CTA (64 features). Each lane
//     loads 16-byte segments of its two rows (features g and g + 8, g = lane / 4) straight
//     into registers, one k-stage ahead of the MMAs (layout::sk_k: the four lanes of a row
//     read consecutive 16-byte pieces), and dequantizes them there exactly as the CPU does
//     (weight_view.cuh: E4M3 x block scale, E2M1 x E4M3 x global scale; F16 / F32 widened),
//     rounded to BF16 -- the operands of ops::linear_bf16, the CPU emulation its oracle.
//   - B = the tokens: up to kSkTok = 32 rows of bf16(x) per CTA (4 MMAs of n = 8), staged per
//     k-stage in shared memory by cp.async (double-buffered, swizzled: layout::sk_x_chunk),
//     read by each lane as the 8 inputs its weight group holds (the MMA sums over its 16
//     k-slots; which input fills which slot only has to agree between A and B).
//   - K is split over S = layout::sk_splits(N, K, E) CTAs (grid z, up to 32, contiguous runs
//     of k-stages) so that small-N projections still fill the GPU; with S > 1 each split
//     writes its partial sums and the last CTA of the tile to finish adds them in split
//     order (+ y; an arrival counter per tile, detail::zeroed_counters), or sk_reduce after
//     the launch where the counters do not cover the grid. S depends on N,
//     K and the format only, the k-stages run in order, and an MMA's column n depends on
//     token n alone: a token's result is the same in any batch (decode == verify, bitwise).
// The exact form (GemmArgs / GroupedArgs::plane != 0; ops::exact_tc): linear's fp32 numerics on
// the same kernels. A holds three BF16 planes per row (split_x3: hi, mid, lo, summing to x
// exactly), staged together (8 tokens per CTA for FP8 / NVFP4, 16 for BF16: 24 KiB of
// shared memory); the weight operand is exact in BF16 (dequant8_x3: no FP8 block scale, no
// NVFP4 global scale); per 16 x 16 weight block the MMAs take lo, mid, hi into a 128-input
// block's sums, which join the accumulators by one round-to-nearest add (FP8: an fma with the
// block scale); the NVFP4 global scale multiplies the sums at the store. The grouped gate /
// up reduction writes silu(gate) * up as three planes for the down projection's exact form.
// Grid: x = token tiles of this launch (fastest, so the CTAs reading one weight slice run
// together and share it through L2), y = 64-feature blocks, z = splits; at most 256 rows per
// launch (the partial buffer's size), more rows are more launches.
// Grouped (sk_grouped_kernel: the routed experts of decode chunks): x = 64-feature blocks,
// y = splits (layout::sk_splits with 8 groups: as many CTAs for a decode token's 8 experts as
// one weight gets alone), z = the active experts, each CTA running its expert's rows 32 at a
// time with the expert's view from the device table; the same tile code and numerics.
//
// Cost model (not measured): weight bytes once per 32 tokens; x from shared memory, 2 bytes
// per input per token per warp; per weight element one dequantization (BF16: none; FP8:
// convert + multiply; NVFP4: E2M1 codes turned into BF16 bits in pairs, two multiplies and a
// conversion, ~6 operations: dequant8) and M / 8 MMAs per 16 x 16 block. Known weak spots:
// (1) NVFP4's dequantization still needs ~2x the FP32 issue slots that reading 4-bit weights
// at HBM speed leaves on an H100 / H200 (Blackwell's cvt.e2m1x2 is not used yet);
// (2) at M > 32 the weight is re-read per token tile (from L2 when the tiles run together);
// (3) one k-stage of prefetch in registers: fewer bytes in flight per warp than a TMA
// pipeline would keep.
//
// Status: compiled for sm_90a / sm_100a / sm_103a, NOT yet run on a GPU.
#include "backend/cuda/gemm_sk.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/gemm_dq.h"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/layout.h"
#include "backend/cuda/mma_sm80.cuh"
#include "backend/cuda/scratch.h"
#include "backend/cuda/weight_view.cuh"
#include "dflash2/error.h"
#include "ops/backend.h"

namespace dflash2::cuda::sk {

namespace {

using detail::WeightView;
using detail::WFmt;
using layout::kSkFeat;
using layout::kSkFeatPerCta;
using layout::kSkTok;
using mma::cp_async16;
using mma::cp_async_commit;
using mma::cp_async_wait_all;
using mma::mma_bf16;
using mma::pack_bf16;
using mma::smem_u32;

constexpr int kThreads = 32 * layout::kSkWarps;
// 3 CTAs (12 warps) per SM: <= 170 registers, ~48 KiB of weight loads in flight per SM
constexpr int kMinCtas = 3;
constexpr int64_t kRowsPerLaunch = 256;

// Inputs per 16-byte weight segment (F32 is converted to BF16 on load: 8).
constexpr int seg_elems_of(WFmt f) { return f == WFmt::FP8 ? 16 : f == WFmt::NVFP4 ? 32 : 8; }
template <WFmt F>
constexpr int kE = seg_elems_of(F);

using detail::Fp4Global;
using detail::fp4_global;

struct Params {
  const __nv_bfloat16* a;
  int64_t lda;
  // 0: A is bf16(x); else the exact form (X3): plane p (0 hi, 1 mid, 2 lo) of row m at
  // a + m * lda + p * plane
  int64_t plane;
  WeightView w;  // one weight (grouped: each group's from the table)
  bool vec;       // 16-byte weight segment loads (detail::rows_aligned16)
  int64_t M, N, K;  // M: this launch's rows (grouped: the rows of all groups, a bound)
  float* d;
  int64_t ldd;
  bool accumulate;
  float* partial;  // S > 1: [S][M][N]
  int S;
  Fp4Global fp4;
  // grouped (table != nullptr): group e's weight is table[e * table_stride], its rows
  // [start[e], start[e + 1]); CTAs take the active groups active[1 ..] (active[0] of them,
  // at most max_active) by grid z; row p of the product goes to d row d_rows ? d_rows[p] : p
  const WeightView* table;
  int64_t table_stride;
  const int32_t* start;
  const int32_t* active;
  int max_active;
  const int32_t* d_rows;
  // grouped, P == 2: two projections of the same rows in one launch (the experts' gate and
  // up, for sk_reduce_silu): projection j's weight is table[e * table_stride + j *
  // proj_stride]; partial sums [S][M][P][N]
  int P;
  int proj;  // one weight: the projection this launch writes (sk::gated: 0 gate, 1 up)
  int64_t proj_stride;
  bool to_partial;  // S > 1 or P == 2: write the partial sums (else d)
  // One weight with to_partial: the last CTA of each (token tile, feature block) to finish
  // adds the partial sums in split order itself (arrivals: detail::zeroed_counters, one per
  // CTA of a split, left zero again); nullptr: a separate reduction kernel does. silu: the
  // sums are up's, and the last CTA writes silu[m, n] = bf16(silu(gate) * up) (partial
  // [S][M][2][N], gate's from the previous launch; zeros for N <= n < ld_silu) instead of d.
  uint32_t* arrivals;
  __nv_bfloat16* silu;
  int64_t ld_silu;
  // silu's form: 0, one BF16 plane (bf16(silu(gate) * up), zeros to ld_silu); else the exact
  // form's three planes of the fp32 value (split3) at silu + m * ld_silu + p * silu_plane,
  // zeros for N <= n < silu_plane: the next X3 GEMM's A
  int64_t silu_plane;
};

// Segment k0 (E inputs from k0) of a weight row as 16 raw bytes (F32: 8 inputs already
// rounded to BF16), element by element: zeros for k >= K and for no row (row == nullptr:
// past N). Not inlined: the edges and misaligned weights only (arguments by value, so the
// kernel's parameters stay in the constant bank).
template <WFmt F>
__device__ __noinline__ uint4 seg_slow(const uint8_t* row, int64_t K, int64_t k0) {
  uint32_t v[4] = {0u, 0u, 0u, 0u};
  if (row != nullptr) {
    if constexpr (F == WFmt::FP8) {
      for (int e = 0; e < 16; ++e)
        if (k0 + e < K) v[e / 4] |= uint32_t(row[k0 + e]) << (8 * (e % 4));
    } else if constexpr (F == WFmt::NVFP4) {
      for (int b = 0; b < 16; ++b)  // byte b: inputs k0 + 2b (low nibble), k0 + 2b + 1
        if (k0 + 2 * b < K) v[b / 4] |= uint32_t(row[(k0 + 2 * b) / 2]) << (8 * (b % 4));
    } else if constexpr (F == WFmt::F32) {
      float f[8];
      for (int e = 0; e < 8; ++e) f[e] = k0 + e < K ? reinterpret_cast<const float*>(row)[k0 + e] : 0.0f;
      for (int j = 0; j < 4; ++j) v[j] = pack_bf16(f[2 * j], f[2 * j + 1]);
    } else {  // BF16 / F16: the 16-bit patterns
      const uint16_t* h = reinterpret_cast<const uint16_t*>(row);
      for (int e = 0; e < 8; ++e)
        if (k0 + e < K) v[e / 2] |= uint32_t(h[k0 + e]) << (16 * (e % 2));
    }
  }
  return make_uint4(v[0], v[1], v[2], v[3]);
}

template <WFmt F>
__device__ __forceinline__ uint4 seg_load(const WeightView& w, bool vec, int64_t r, int64_t k0) {
  constexpr int E = kE<F>;
  if (vec && r < w.N && k0 + E <= w.K) {
    const uint8_t* row = w.data + r * w.row_bytes;
    if constexpr (F == WFmt::F32) {
      const float4* p = reinterpret_cast<const float4*>(row + 4 * k0);
      const float4 x = p[0], y = p[1];
      return make_uint4(pack_bf16(x.x, x.y), pack_bf16(x.z, x.w), pack_bf16(y.x, y.y), pack_bf16(y.z, y.w));
    } else if constexpr (F == WFmt::NVFP4) {
      return *reinterpret_cast<const uint4*>(row + k0 / 2);
    } else if constexpr (F == WFmt::FP8) {
      return *reinterpret_cast<const uint4*>(row + k0);
    } else {
      return *reinterpret_cast<const uint4*>(row + 2 * k0);
    }
  }
  return seg_slow<F>(r < w.N ? w.data + r * w.row_bytes : nullptr, w.K, k0);
}

// A segment's scale(s): FP8 the block scale of (rows f0.., k0) as float bits (one 128-row
// block holds all 16 features of a warp); NVFP4 the E4M3 bytes of inputs k0 .. k0 + 15 and
// k0 + 16 .. k0 + 31 of rows r_lo (bytes 0, 1) and r_hi (bytes 2, 3); zeros past the weight.
template <WFmt F>
__device__ __forceinline__ uint32_t seg_scale(const WeightView& w, int64_t f0, int64_t r_lo, int64_t r_hi,
                                              int64_t k0) {
  if constexpr (F == WFmt::FP8) {
    if (k0 >= w.K) return 0u;
    return __float_as_uint(static_cast<const float*>(w.scale)[(f0 / 128) * w.scale_stride + k0 / 128]);
  } else if constexpr (F == WFmt::NVFP4) {
    const uint8_t* s = static_cast<const uint8_t*>(w.scale);
    uint32_t v = 0;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (k0 + 16 * j >= w.K) continue;
      if (r_lo < w.N) v |= uint32_t(s[r_lo * w.scale_stride + k0 / 16 + j]) << (8 * j);
      if (r_hi < w.N) v |= uint32_t(s[r_hi * w.scale_stride + k0 / 16 + j]) << (8 * (j + 2));
    }
    return v;
  } else {
    (void)w, (void)f0, (void)r_lo, (void)r_hi, (void)k0;
    return 0u;
  }
}

// Group h (inputs 8h .. 8h + 7) of a segment as 8 BF16 (4 words, lower input in the lower
// half): w_at's operations on the raw bytes, then rounded. `hi` picks the row's scale bytes.
// NVFP4: detail::fp4_word_to_f32 (the pair decode where q.fast: bitwise w_at, fewer operations).
template <WFmt F>
__device__ __forceinline__ uint4 dequant8(const Fp4Global& q, const uint4& raw, uint32_t scale, int h, bool hi) {
  if constexpr (F == WFmt::BF16 || F == WFmt::F32) {
    (void)q, (void)scale, (void)h, (void)hi;
    return raw;
  } else {
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
    float f[8];
    if constexpr (F == WFmt::F16) {
#pragma unroll
      for (int i = 0; i < 8; ++i)
        f[i] = __half2float(__ushort_as_half(uint16_t(words[i / 2] >> (16 * (i % 2)))));
    } else if constexpr (F == WFmt::FP8) {
      const float s = __uint_as_float(scale);
#pragma unroll
      for (int i = 0; i < 8; ++i)
        f[i] = __fmul_rn(detail::e4m3_to_f32(uint8_t(words[2 * h + i / 4] >> (8 * (i % 4)))), s);
    } else {  // NVFP4: group h is word h; its scale is byte h / 2 of the row's pair
      const float s = detail::e4m3_to_f32(uint8_t(scale >> (8 * ((hi ? 2 : 0) + h / 2))));
      detail::fp4_word_to_f32(q, words[h], s, f);
    }
    return make_uint4(pack_bf16(f[0], f[1]), pack_bf16(f[2], f[3]), pack_bf16(f[4], f[5]), pack_bf16(f[6], f[7]));
  }
}

// The exact form's (X3) weight operand: values that BF16 holds exactly -- BF16 as stored, an
// FP8 code without its block scale (which multiplies the block's sums instead), NVFP4's
// E2M1 code x E4M3 scale (at most 2 x 4 significant bits) without the global scale (which
// multiplies the sums at the store). The pair decode's values are v * 2^-126: times 2^126
// first (exact), then the scale (exact).
template <WFmt F>
__device__ __forceinline__ uint4 dequant8_x3(const uint4& raw, uint32_t scale, int h, bool hi) {
  if constexpr (F == WFmt::BF16) {
    (void)scale, (void)h, (void)hi;
    return raw;
  } else {
    static_assert(F == WFmt::FP8 || F == WFmt::NVFP4, "the exact form takes BF16 / FP8 / NVFP4 weights");
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
    float f[8];
    if constexpr (F == WFmt::FP8) {
      (void)scale, (void)hi;
#pragma unroll
      for (int i = 0; i < 8; ++i) f[i] = detail::e4m3_to_f32(uint8_t(words[2 * h + i / 4] >> (8 * (i % 4))));
    } else {
      const float s = detail::e4m3_to_f32(uint8_t(scale >> (8 * ((hi ? 2 : 0) + h / 2))));
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t pair = detail::fp4_pair_bits((words[h] >> (8 * j)) & 0xffu);
        f[2 * j] = __fmul_rn(__fmul_rn(__uint_as_float(pair << 16), 0x1p126f), s);
        f[2 * j + 1] = __fmul_rn(__fmul_rn(__uint_as_float(pair & 0xffff0000u), 0x1p126f), s);
      }
    }
    return make_uint4(pack_bf16(f[0], f[1]), pack_bf16(f[2], f[3]), pack_bf16(f[4], f[5]), pack_bf16(f[6], f[7]));
  }
}

template <WFmt F>
struct Stage {
  static constexpr int kSegs = layout::sk_segs(kE<F>);
  uint4 lo[kSegs], hi[kSegs];
  uint32_t sc[kSegs];
};

// Tokens per CTA tile (layout::sk_tok) and x planes of the form (X3: hi, mid, lo).
template <WFmt F, bool X3>
constexpr int kTok = layout::sk_tok(kE<F>, X3);
template <bool X3>
constexpr int kPlanes = X3 ? 3 : 1;
// The x buffers of a CTA, in uint4: 2 stages x planes x tokens x the stage's 16-byte chunks.
template <WFmt F, bool X3>
constexpr int kXsChunks = 2 * kPlanes<X3> * kTok<F, X3> * int(layout::sk_stage_k(kE<F>) / 8);

// One tile: rows [m0, m0 + rows) of A (rows <= kTok) times the 16 features of this warp
// from f0 of weight w, over the k-stages [s0, s1), into acc (n-tile n: tokens 8n .. 8n + 7).
// Every thread of the CTA calls it (the barriers); warps with !active only stage x.
// X3 (the exact form): x is three BF16 planes (plane: their distance in A's rows) whose sum
// is x exactly, and the weight operand is exact in BF16 (dequant8_x3): per 16 x 16 weight
// block the MMAs take the lo, mid, then hi plane into the same fp32 accumulators, so every
// product is exact and only the fp32 sums round, as in linear's SIMT kernel. Each 128-input
// block's sums are formed in tmp and added to acc with one round-to-nearest operation (FP8:
// acc = fma(scale, tmp, acc), the block scale of rows f0 .. f0 + 15, one 128-row block).
template <WFmt F, bool X3>
__device__ __forceinline__ void tile_mma(const WeightView& w, bool vec, const Fp4Global& q, const __nv_bfloat16* a,
                                         int64_t lda, int64_t plane, int64_t m0, int64_t rows, int64_t f0, bool active,
                                         int64_t s0, int64_t s1, uint4* xs, float (&acc)[4][4]) {
  constexpr int E = kE<F>, G8 = E / 8, kSegs = layout::sk_segs(E), Tok = kTok<F, X3>, NP = kPlanes<X3>;
  constexpr int64_t SK = layout::sk_stage_k(E);
  constexpr int kChunks = int(SK / 8);               // 16-byte x chunks per token row per stage
  constexpr int kCopies = Tok * kChunks / kThreads;  // cp.async per thread per stage and plane
  constexpr int kBuf = Tok * kChunks;                // chunks per plane of a buffer
  // X3: each 128-input block's MMAs sum into tmp, added to acc with one rounding-to-nearest
  // operation (FP8: acc = fma(block scale, tmp, acc)), so an MMA's own accumulation (whose
  // rounding the PTX ISA leaves open) spans at most 128 inputs x 3 planes
  constexpr bool kFold = X3;
  constexpr int kSegsPerBlock = 32 / E;  // 128 inputs: BF16 4 segments, FP8 2, NVFP4 1
  static_assert(kCopies * kThreads == Tok * kChunks, "stage copy split");
  static_assert(!kFold || (kSegs % kSegsPerBlock == 0 && (F != WFmt::FP8 || kSegsPerBlock == 2)),
                "the exact form's 128-input blocks: whole segments of a stage");
  const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int64_t r_lo = f0 + g, r_hi = f0 + g + 8;
  const int ntiles = int((rows + 7) / 8);  // block-uniform
  (void)plane;

  auto stage_x = [&](int64_t s, int buf) {
#pragma unroll
    for (int pl = 0; pl < NP; ++pl)
#pragma unroll
      for (int i = 0; i < kCopies; ++i) {
        const int idx = tid + i * kThreads, row = idx / kChunks, c = idx % kChunks;
        const bool valid = row < rows;
        const __nv_bfloat16* src = valid ? a + (m0 + row) * lda + pl * plane + s * SK + c * 8 : a;
        cp_async16(smem_u32(&xs[(buf * NP + pl) * kBuf + layout::sk_x_chunk(row, c, E)]), src, valid);
      }
    cp_async_commit();
  };
  auto load_w = [&](int64_t s, Stage<F>& st) {
#pragma unroll
    for (int i = 0; i < kSegs; ++i) {
      const int64_t k0 = s * SK + layout::sk_k(E, t, i, 0);
      st.lo[i] = seg_load<F>(w, vec, r_lo, k0);
      st.hi[i] = seg_load<F>(w, vec, r_hi, k0);
      if constexpr (X3 && F == WFmt::FP8) {
        // the scale of the segment's 128-input block, the same for every lane of the warp
        // (a lane whose own segment lies past K still adds the block's other lanes' sums)
        const int64_t kb = s * SK + (i / 2) * 128;
        st.sc[i] = kb < w.K ? __float_as_uint(static_cast<const float*>(w.scale)[(f0 / 128) * w.scale_stride + kb / 128])
                            : 0u;
      } else {
        st.sc[i] = seg_scale<F>(w, f0, r_lo, r_hi, k0);
      }
    }
  };

#pragma unroll
  for (int n = 0; n < 4; ++n)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[n][j] = 0.0f;

  Stage<F> cur, nxt;
  if (s0 < s1) {
    stage_x(s0, 0);
    if (active) load_w(s0, cur);
  }
  for (int64_t s = s0; s < s1; ++s) {
    const int buf = int((s - s0) & 1);
    cp_async_wait_all();
    __syncthreads();  // stage s's x tile is in; the other buffer's readers (stage s - 1) are done
    const bool more = s + 1 < s1;
    if (more) {
      stage_x(s + 1, buf ^ 1);
      if (active) load_w(s + 1, nxt);
    }
    if (active) {
      float tmp[4][4];  // X3 only
#pragma unroll
      for (int i = 0; i < kSegs; ++i) {
        if constexpr (kFold) {
          if (i % kSegsPerBlock == 0) {
#pragma unroll
            for (int n = 0; n < 4; ++n)
#pragma unroll
              for (int j = 0; j < 4; ++j) tmp[n][j] = 0.0f;
          }
        }
#pragma unroll
        for (int h = 0; h < G8; ++h) {
          uint4 wl, wh;
          if constexpr (X3) {
            wl = dequant8_x3<F>(cur.lo[i], cur.sc[i], h, false);
            wh = dequant8_x3<F>(cur.hi[i], cur.sc[i], h, true);
          } else {
            wl = dequant8<F>(q, cur.lo[i], cur.sc[i], h, false);
            wh = dequant8<F>(q, cur.hi[i], cur.sc[i], h, true);
          }
          const uint32_t a0[4] = {wl.x, wh.x, wl.y, wh.y}, a1[4] = {wl.z, wh.z, wl.w, wh.w};
          const int c = layout::sk_lane_chunk(E, t, i, h);
#pragma unroll
          for (int n = 0; n < Tok / 8; ++n) {
            if (n >= ntiles) break;
            float(*const d)[4] = kFold ? tmp : acc;  // X3: the block's sums
#pragma unroll
            for (int pl = NP - 1; pl >= 0; --pl) {  // X3: lo, mid, hi
              const uint4 xv = xs[(buf * NP + pl) * kBuf + layout::sk_x_chunk(n * 8 + g, c, E)];
              mma_bf16(d[n], a0, xv.x, xv.y);
              mma_bf16(d[n], a1, xv.z, xv.w);
            }
          }
        }
        if constexpr (kFold) {
          if (i % kSegsPerBlock == kSegsPerBlock - 1) {
#pragma unroll
            for (int n = 0; n < Tok / 8; ++n)
#pragma unroll
              for (int j = 0; j < 4; ++j) {
                if constexpr (F == WFmt::FP8)
                  acc[n][j] = __fmaf_rn(__uint_as_float(cur.sc[i - 1]), tmp[n][j], acc[n][j]);
                else
                  acc[n][j] = __fadd_rn(acc[n][j], tmp[n][j]);
              }
          }
        }
      }
      (void)tmp;
    }
    if (more && active) cur = nxt;
  }
}

// The tile's results: row m0 + i (i < rows) of feature f of this warp, projection j;
// to_partial: the split's partial sums (partial[z][row][j][f], M rows, P projections); else
// d's row d_rows ? d_rows[row] : row.
// c0, c1: feature g, tokens 2t, 2t + 1 of n-tile n; c2, c3: feature g + 8. post: a factor
// of every sum (the exact form's NVFP4 global scale; 1: none).
__device__ __forceinline__ void tile_store(const Params& p, const float (&acc)[4][4], int64_t m0, int64_t rows,
                                           int64_t f0, int z, int j, float post = 1.0f) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int ntiles = int((rows + 7) / 8);
#pragma unroll
  for (int n = 0; n < 4; ++n) {
    if (n >= ntiles) break;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int64_t i = n * 8 + 2 * t + (c & 1), f = f0 + g + ((c < 2) ? 0 : 8);
      if (i >= rows || f >= p.N) continue;
      const int64_t m = m0 + i;
      const float v = post == 1.0f ? acc[n][c] : __fmul_rn(acc[n][c], post);
      if (p.to_partial) {
        p.partial[((int64_t(z) * p.M + m) * p.P + j) * p.N + f] = v;
      } else {
        float* out = p.d + (p.d_rows ? int64_t(p.d_rows[m]) : m) * p.ldd + f;
        *out = p.accumulate ? __fadd_rn(*out, v) : v;
      }
    }
  }
}

// The S partial sums at index i of partial [S][total], added in split order (read past L1:
// other CTAs wrote them).
__device__ __forceinline__ float split_sum(const float* partial, int S, int64_t total, int64_t i) {
  float v = __ldcg(partial + i);
  for (int z = 1; z < S; ++z) v = __fadd_rn(v, __ldcg(partial + int64_t(z) * total + i));
  return v;
}

// The down input of row m, feature n of a gated MLP / the experts' gate and up (partial
// [S][M][2][N], total = M * 2 * N): silu(gate) * up of the split sums, zero for n >= N.
__device__ __forceinline__ float silu_of_sums(const float* partial, int S, int64_t total, int64_t m, int64_t N,
                                              int64_t n) {
  if (n >= N) return 0.0f;
  const int64_t ig = m * 2 * N + n;
  return detail::silu_mul(split_sum(partial, S, total, ig), split_sum(partial, S, total, ig + N));
}

// v as the exact form's three BF16 planes: hi = bf16(v), mid = bf16(v - hi), lo = bf16(v -
// hi - mid) (both differences exact in fp32, so hi + mid + lo == v for finite v above the
// subnormals), at row[0], row[plane], row[2 * plane].
__device__ __forceinline__ void store_split3(__nv_bfloat16* row, int64_t plane, float v) {
  const __nv_bfloat16 hi = __float2bfloat16_rn(v);
  const float r1 = __fsub_rn(v, __bfloat162float(hi));
  const __nv_bfloat16 mid = __float2bfloat16_rn(r1);
  row[0] = hi;
  row[plane] = mid;
  row[2 * plane] = __float2bfloat16_rn(__fsub_rn(r1, __bfloat162float(mid)));
}

// Column n of silu row m: v in silu's form (Params::silu_plane).
__device__ __forceinline__ void store_silu(__nv_bfloat16* silu, int64_t ld_silu, int64_t silu_plane, int64_t m,
                                           int64_t n, float v) {
  if (silu_plane)
    store_split3(silu + m * ld_silu + n, silu_plane, v);
  else
    silu[m * ld_silu + n] = __float2bfloat16_rn(v);
}

// Tile rows [m0, m0 + rows) x feature block fb, whose partial sums `expected` CTAs write
// (S splits, x P projections in the grouped kernel): the CTA that counts itself in last adds
// them in split order (the same result whichever CTA that is, and the same as sk_reduce /
// sk_reduce_silu) into silu (bf16(silu(gate) * up), the last feature block also writing the
// zero padding to ld_silu) or d (row d_rows[m] where given, + d with accumulate), then zeroes
// the tile's counter for the next launch on this stream. Every CTA fences its partial sums
// before it counts itself in.
__device__ __forceinline__ void finish_tile(const Params& p, uint32_t slot, int expected, int64_t m0, int64_t rows,
                                            int fb) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = expected == 1 || atomicAdd(&p.arrivals[slot], 1u) == uint32_t(expected - 1);
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int64_t n0 = int64_t(fb) * kSkFeatPerCta, total = p.M * p.P * p.N;
  const int64_t silu_w = p.silu_plane ? p.silu_plane : p.ld_silu;  // the padding's end
  const int64_t width = p.silu && n0 + kSkFeatPerCta >= p.N ? silu_w - n0 : kSkFeatPerCta;
  for (int64_t i = threadIdx.x; i < rows * width; i += kThreads) {
    const int64_t m = m0 + i / width, n = n0 + i % width;
    if (p.silu) {
      store_silu(p.silu, p.ld_silu, p.silu_plane, m, n, silu_of_sums(p.partial, p.S, total, m, p.N, n));
    } else if (n < p.N) {
      const float v = split_sum(p.partial, p.S, total, m * p.N + n);
      float* out = p.d + (p.d_rows ? int64_t(p.d_rows[m]) : m) * p.ldd + n;
      *out = p.accumulate ? __fadd_rn(*out, v) : v;
    }
  }
  if (threadIdx.x == 0 && expected > 1) p.arrivals[slot] = 0u;
}

// A CTA of one weight's GEMM: token tile blockIdx.x (grid x = token tiles, fastest, so the
// CTAs reading one weight slice run together and share it through L2), feature block fb,
// split z; `slot`: its tile's arrival counter, which `expected` CTAs count up.
template <WFmt F, bool X3>
__device__ __forceinline__ void sk_cta(const Params& p, uint4* xs, int fb, int z, uint32_t slot, int expected) {
  constexpr int Tok = kTok<F, X3>;
  const int64_t m0 = int64_t(blockIdx.x) * Tok;
  const int64_t f0 = int64_t(fb) * kSkFeatPerCta + int64_t(threadIdx.x >> 5) * kSkFeat;
  const bool active = f0 < p.N;  // warp-uniform: warps past N only stage x and meet the barriers
  const int64_t rows = p.M - m0 < Tok ? p.M - m0 : Tok;
  const int64_t stages = (p.K + layout::sk_stage_k(kE<F>) - 1) / layout::sk_stage_k(kE<F>);
  float acc[4][4];
  tile_mma<F, X3>(p.w, p.vec, p.fp4, p.a, p.lda, p.plane, m0, rows, f0, active, layout::sk_split_begin(stages, p.S, z),
                  layout::sk_split_begin(stages, p.S, z + 1), xs, acc);
  if (active) tile_store(p, acc, m0, rows, f0, z, p.proj, X3 && F == WFmt::NVFP4 ? p.w.global_scale : 1.0f);
  if (p.arrivals == nullptr) return;
  finish_tile(p, slot, expected, m0, rows, fb);
}

// One weight: grid x = token tiles of this launch, y = 64-feature blocks, z = splits.
template <WFmt F, bool X3>
__global__ void __launch_bounds__(kThreads, kMinCtas) sk_kernel(const Params p) {
  detail::pdl_enter();
  __shared__ __align__(128) uint4 xs[kXsChunks<F, X3>];
  sk_cta<F, X3>(p, xs, int(blockIdx.y), int(blockIdx.z), blockIdx.y * gridDim.x + blockIdx.x, p.S);
}

// Up to kSkMany weights of one format over the same A (gemm_many): weight i owns the feature
// blocks [i ? yend[i - 1] : 0, yend[i]) of grid y; grid z is the largest split (a weight's
// CTAs past its own split return at once). Each CTA does what the same CTA of the weight's
// own sk_kernel launch does, its tile's counter at its place in the concatenated grid.
// shared (gated: gate and up, one shape and split, one partial buffer [S][M][2][N]): a
// (token tile, feature block)'s counter is shared by the n weights' n x S CTAs, and the last
// of them writes the tile (bf16(silu(gate) * up)), as up's last CTAs did after gate's launch.
constexpr int kSkMany = 4;
struct ManyParams {
  Params p[kSkMany];
  int64_t yend[kSkMany];
  int n;
  bool shared;
};

template <WFmt F, bool X3>
__global__ void __launch_bounds__(kThreads, kMinCtas) sk_many_kernel(const __grid_constant__ ManyParams mp) {
  detail::pdl_enter();
  __shared__ __align__(128) uint4 xs[kXsChunks<F, X3>];
  int i = 0;
  while (int64_t(blockIdx.y) >= mp.yend[i]) ++i;  // i < n: grid y = yend[n - 1]
  const Params& p = mp.p[i];
  if (int(blockIdx.z) >= p.S) return;  // the whole CTA, before any barrier
  const int fb = int(int64_t(blockIdx.y) - (i ? mp.yend[i - 1] : 0));
  const uint32_t slot = (mp.shared ? uint32_t(fb) : blockIdx.y) * gridDim.x + blockIdx.x;
  sk_cta<F, X3>(p, xs, fb, int(blockIdx.z), slot, mp.shared ? p.S * mp.n : p.S);
}

// Groups (the routed experts of decode chunks): grid x = P x 64-feature blocks (projection
// j = x / blocks), y = splits, z = the active groups (grid-stride over active[1 ..], whose
// length is device data); a CTA runs its group's rows 32 at a time. A row's sums depend on
// its group's weight and its own x only (the split is a function of N, K, the format and P),
// never on the other rows. With arrivals, each tile's last CTA writes its results
// (finish_tile); else a reduction kernel follows.
template <WFmt F, bool X3>
__global__ void __launch_bounds__(kThreads, kMinCtas) sk_grouped_kernel(const Params p) {
  detail::pdl_enter();
  constexpr int Tok = kTok<F, X3>;
  __shared__ __align__(128) uint4 xs[kXsChunks<F, X3>];
  const int fblocks = int(gridDim.x) / p.P, j = int(blockIdx.x) / fblocks;
  const int64_t f0 = int64_t(int(blockIdx.x) - j * fblocks) * kSkFeatPerCta + int64_t(threadIdx.x >> 5) * kSkFeat;
  const bool active = f0 < p.N;
  const int64_t stages = (p.K + layout::sk_stage_k(kE<F>) - 1) / layout::sk_stage_k(kE<F>);
  const int z = int(blockIdx.y);
  const int64_t s0 = layout::sk_split_begin(stages, p.S, z), s1 = layout::sk_split_begin(stages, p.S, z + 1);
  // the group's view and NVFP4 global scale in shared memory: registers stay with the k-loop
  __shared__ WeightView w;
  __shared__ Fp4Global q;
  int nact = p.active[0];
  if (nact > p.max_active) nact = p.max_active;
  for (int ai = int(blockIdx.z); ai < nact; ai += int(gridDim.z)) {
    const int e = p.active[1 + ai];
    __syncthreads();  // the previous group's tiles are done: x buffers, w and q are free
    if (threadIdx.x == 0) {
      w = p.table[int64_t(e) * p.table_stride + j * p.proj_stride];
      q = fp4_global(w);
    }
    __syncthreads();
    const int first = p.start[e], end = p.start[e + 1];  // rows < 2^31 (checked on the host)
    for (int m0 = first; m0 < end; m0 += Tok) {
      if (m0 > first) __syncthreads();  // the previous tile's readers of both x buffers are done
      const int rows = end - m0 < Tok ? end - m0 : Tok;
      float acc[4][4];
      tile_mma<F, X3>(w, p.vec, q, p.a, p.lda, p.plane, m0, rows, f0, active, s0, s1, xs, acc);
      if (active) tile_store(p, acc, m0, rows, f0, z, j, X3 && F == WFmt::NVFP4 ? w.global_scale : 1.0f);
      // the tile's last CTA of its P x S writes its results (one counter per first row and
      // feature block: the tiles' first rows are distinct)
      if (p.arrivals)
        finish_tile(p, uint32_t(m0) * uint32_t(fblocks) + uint32_t(int(blockIdx.x) - j * fblocks), p.P * p.S, m0, rows,
                    int(blockIdx.x) - j * fblocks);
    }
  }
}

// d[row(m), n] (+)= the S partial sums of row m, added in split order; rows m < *used when
// used != nullptr (device: the grouped kernel's row count), row(m) = d_rows ? d_rows[m] : m.
__global__ void __launch_bounds__(256) sk_reduce(const float* __restrict__ partial, int S, int64_t M, int64_t N,
                                                  float* __restrict__ d, int64_t ldd, bool accumulate,
                                                  const int32_t* __restrict__ used, const int32_t* __restrict__ d_rows) {
  detail::pdl_enter();
  const int64_t total = M * N;
  const int64_t limit = used ? (int64_t(*used) < M ? int64_t(*used) : M) * N : total;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < limit; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = split_sum(partial, S, total, i);
    const int64_t m = i / N, n = i - m * N;
    float* out = d + (d_rows ? int64_t(d_rows[m]) : m) * ldd + n;
    *out = accumulate ? __fadd_rn(*out, v) : v;
  }
}

// h[m, f] = silu(gate) * up of row m < *used (used == nullptr: every row) in silu's form
// (Params::silu_plane: bf16, zeros for N <= f < ldh; or three planes, zeros to the plane's
// width), gate / up = projection 0 / 1's sums (partial [S][M][2][N], added in split order):
// the experts' down projection input, as dq::rows_bf16(SiluMul) makes it from the summed
// gate and up.
__global__ void __launch_bounds__(256) sk_reduce_silu(const float* __restrict__ partial, int S, int64_t M, int64_t N,
                                                       const int32_t* __restrict__ used, __nv_bfloat16* __restrict__ h,
                                                       int64_t ldh, int64_t plane) {
  detail::pdl_enter();
  const int64_t width = plane ? plane : ldh;
  const int64_t total = M * 2 * N, rows = used && int64_t(*used) < M ? int64_t(*used) : M, limit = rows * width;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < limit; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t m = i / width, n = i - m * width;
    store_silu(h, ldh, plane, m, n, silu_of_sums(partial, S, total, m, N, n));
  }
}

// Whether the exact form (X3) has kernels for format F.
template <WFmt F>
constexpr bool kTakesX3 = F == WFmt::BF16 || F == WFmt::FP8 || F == WFmt::NVFP4;

template <WFmt F>
void launch(const Params& p, dim3 grid, bool grouped, cudaStream_t s) {
  if (grouped) {
    if (p.plane == 0)
      sk_grouped_kernel<F, false><<<grid, kThreads, 0, s>>>(p);
    else if constexpr (kTakesX3<F>)
      sk_grouped_kernel<F, true><<<grid, kThreads, 0, s>>>(p);
  } else if (p.plane != 0) {
    if constexpr (kTakesX3<F>) sk_kernel<F, true><<<grid, kThreads, 0, s>>>(p);
  } else {
    sk_kernel<F, false><<<grid, kThreads, 0, s>>>(p);
  }
}

// x F32 [M, K] (row stride ldx) as the exact form's three BF16 planes: hi = bf16(x),
// mid = bf16(x - hi), lo = bf16(x - hi - mid) (both differences exact in fp32, so hi + mid +
// lo == x for every finite x above the subnormals), zeros for K <= k < plane.
// Row m of A from x row order ? order[m] / div : m; rows m < *used when used != nullptr
// (device: the grouped kernel's row count; the rest untouched).
__global__ void __launch_bounds__(256) split_x3_kernel(const float* __restrict__ x, int64_t ldx, int64_t M, int64_t K,
                                                       const int32_t* __restrict__ order, int div,
                                                       const int32_t* __restrict__ used, __nv_bfloat16* __restrict__ a,
                                                       int64_t lda, int64_t plane) {
  detail::pdl_enter();
  const int64_t rows = used && int64_t(*used) < M ? int64_t(*used) : M, total = rows * plane;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t m = i / plane, k = i - m * plane;
    const int64_t src = order ? int64_t(order[m] / div) : m;
    store_split3(a + m * lda + k, plane, k < K ? x[src * ldx + k] : 0.0f);
  }
}

std::atomic<bool> g_enabled{true};

}  // namespace

int seg_elems(WFmt f) { return seg_elems_of(f); }

int64_t a_width(WFmt f, int64_t K) {
  const int64_t sk = layout::sk_stage_k(seg_elems(f));
  return (K + sk - 1) / sk * sk;
}

bool takes_x3(WFmt f) { return f == WFmt::BF16 || f == WFmt::FP8 || f == WFmt::NVFP4; }

void split_x3(const float* x, int64_t ldx, int64_t M, int64_t K, __nv_bfloat16* a, int64_t lda, int64_t plane,
              cudaStream_t s) {
  DFLASH2_CHECK_ARG(x && a && M >= 0 && K >= 0 && plane >= K && plane % 8 == 0 && lda >= 3 * plane &&
                        (M <= 1 || ldx >= K),
                    "cuda::sk::split_x3: bad arguments");
  if (M == 0 || plane == 0) return;
  const unsigned blocks = detail::ceil_blocks(M * plane, 256, detail::kMaxRowBlocks);
  split_x3_kernel<<<blocks, 256, 0, s>>>(x, ldx, M, K, nullptr, 1, nullptr, a, lda, plane);
  detail::check_launch("sk_gemm exact form: x as three BF16 planes", "[", M, ", ", K, "]");
}

void split_x3_gather(const float* x, int64_t ldx, const int32_t* order, int div, const int32_t* used, int64_t M,
                     int64_t K, __nv_bfloat16* a, int64_t lda, int64_t plane, cudaStream_t s) {
  DFLASH2_CHECK_ARG(x && a && order && div >= 1 && M >= 0 && K >= 0 && plane >= K && plane % 8 == 0 &&
                        lda >= 3 * plane,
                    "cuda::sk::split_x3_gather: bad arguments");
  if (M == 0 || plane == 0) return;
  const unsigned blocks = detail::ceil_blocks(M * plane, 256, detail::kMaxRowBlocks);
  split_x3_kernel<<<blocks, 256, 0, s>>>(x, ldx, M, K, order, div, used, a, lda, plane);
  detail::check_launch("sk_gemm exact form: gathered rows as three BF16 planes", "[", M, ", ", K, "]");
}

int splits(const WeightView& w) { return layout::sk_splits(w.N, w.K, seg_elems(w.fmt)); }

namespace {
// Whether one arrival counter per (token tile, feature block) of `grid` fits the counters.
bool counters_cover(dim3 grid, const uint32_t* arrivals) {
  return arrivals != nullptr && int64_t(grid.x) * grid.y <= detail::kCounterWords;
}
}  // namespace

int64_t partial_floats(const WeightView& w, int64_t M) {
  const int S = splits(w);
  return S > 1 ? int64_t(S) * (M < kRowsPerLaunch ? M : kRowsPerLaunch) * w.N : 0;
}

namespace {
// The kernel parameters of one weight's GEMM (a, d, M and arrivals: per launch).
Params one_weight(const GemmArgs& g) {
  Params p{};
  p.lda = g.lda;
  p.w = g.w;
  p.vec = detail::rows_aligned16(g.w);
  p.N = g.w.N;
  p.K = g.w.K;
  p.ldd = g.ldd;
  p.accumulate = g.accumulate;
  p.partial = g.partial;
  p.S = splits(g.w);
  p.fp4 = fp4_global(g.w);
  p.P = 1;
  p.to_partial = p.S > 1;
  p.plane = g.plane;
  return p;
}

// GemmArgs::plane's checks (the exact form): a format it takes, three planes per row of A.
void check_plane(const GemmArgs& g, const char* op) {
  if (g.plane == 0) return;
  DFLASH2_CHECK_ARG(takes_x3(g.w.fmt), op, ": the exact form (x as three BF16 planes) takes BF16, FP8 and NVFP4 "
                    "weights, not F32 / F16 ones");
  DFLASH2_CHECK_ARG(g.plane >= a_width(g.w.fmt, g.w.K) && g.plane % 8 == 0 && g.lda >= 3 * g.plane, op,
                    ": the exact form needs plane >= ", a_width(g.w.fmt, g.w.K), " (a multiple of 8) and lda >= 3 x plane, "
                    "found plane ", g.plane, ", lda ", g.lda);
}
}  // namespace

void gemm(const GemmArgs& g, cudaStream_t s) {
  const char* op = "cuda::sk::gemm";
  const WeightView& w = g.w;
  DFLASH2_CHECK_ARG(g.a && g.d && w.K > 0 && w.N >= 0 && g.M >= 0, op, ": bad arguments");
  DFLASH2_CHECK_ARG(detail::aligned(g.a, 16) && g.lda % 8 == 0 && g.lda >= a_width(w.fmt, w.K), op,
                    ": A must be 16-byte aligned with lda % 8 == 0 and lda >= ", a_width(w.fmt, w.K), ", found lda ",
                    g.lda);
  const int S = splits(w);
  DFLASH2_CHECK_ARG(S == 1 || (g.partial != nullptr && detail::aligned(g.partial, 16)), op,
                    ": a split GEMM needs its partial-sum scratch");
  DFLASH2_CHECK_ARG(w.N <= int64_t(kSkFeatPerCta) * detail::kMaxGridY, op, ": N = ", w.N, " is too large");
  check_plane(g, op);
  if (g.M == 0 || w.N == 0) return;
  Params p = one_weight(g);
  const unsigned fblocks = unsigned((w.N + kSkFeatPerCta - 1) / kSkFeatPerCta);
  const int tok = layout::sk_tok(seg_elems(w.fmt), g.plane != 0);
  for (int64_t r0 = 0; r0 < g.M; r0 += kRowsPerLaunch) {
    const int64_t m = g.M - r0 < kRowsPerLaunch ? g.M - r0 : kRowsPerLaunch;
    p.a = g.a + r0 * g.lda;
    p.d = g.d + r0 * g.ldd;
    p.M = m;
    const dim3 grid(unsigned((m + tok - 1) / tok), fblocks, unsigned(S));
    // the split's sums added by its last CTA where the counters cover the grid's tiles
    p.arrivals = S > 1 && counters_cover(grid, g.arrivals) ? g.arrivals : nullptr;
    detail::with_format(w.fmt, [&](auto f) { launch<decltype(f)::value>(p, grid, false, s); });
    detail::check_launch("sk_gemm kernel launch", "[", m, ", ", w.N, ", ", w.K, "]");
    if (S > 1 && !p.arrivals) {
      const unsigned blocks = detail::ceil_blocks(m * w.N, 256, detail::kMaxRowBlocks);
      sk_reduce<<<blocks, 256, 0, s>>>(g.partial, S, m, w.N, p.d, g.ldd, g.accumulate, nullptr, nullptr);
      detail::check_launch("sk_gemm split reduction", "[", m, ", ", w.N, "]");
    }
  }
}

bool gemm_many(const GemmArgs* gs, int n, cudaStream_t s) {
  if (n < 2 || n > kSkMany) return false;
  const GemmArgs& g0 = gs[0];
  const int64_t M = g0.M;
  if (M <= 0 || M > kRowsPerLaunch) return false;
  ManyParams mp{};
  mp.n = n;
  int64_t yblocks = 0;
  int max_s = 1;
  uint32_t* arrivals = nullptr;  // the split weights' counters: one array for the whole grid
  for (int i = 0; i < n; ++i) {
    const GemmArgs& g = gs[i];
    const WeightView& w = g.w;
    if (w.fmt != g0.w.fmt || g.a != g0.a || g.lda != g0.lda || g.plane != g0.plane || g.M != M || w.N <= 0 ||
        w.K <= 0)
      return false;
    if (g.plane != 0 && (!takes_x3(w.fmt) || g.plane < a_width(w.fmt, w.K) || g.lda < 3 * g.plane)) return false;
    if (!detail::aligned(g.a, 16) || g.lda % 8 != 0 || g.lda < a_width(w.fmt, w.K)) return false;
    const int S = splits(w);
    if (S > 1 && (g.partial == nullptr || !detail::aligned(g.partial, 16) || g.arrivals == nullptr ||
                  (arrivals != nullptr && g.arrivals != arrivals)))
      return false;
    if (S > 1) arrivals = g.arrivals;
    Params& p = mp.p[i];
    p = one_weight(g);
    p.a = g.a;
    p.d = g.d;
    p.M = M;
    p.arrivals = S > 1 ? g.arrivals : nullptr;  // each split tile's last CTA adds its sums
    yblocks += (w.N + kSkFeatPerCta - 1) / kSkFeatPerCta;
    mp.yend[i] = yblocks;
    max_s = S > max_s ? S : max_s;
  }
  const int tok = layout::sk_tok(seg_elems(g0.w.fmt), g0.plane != 0);
  const dim3 grid(unsigned((M + tok - 1) / tok), unsigned(yblocks), unsigned(max_s));
  if (yblocks > detail::kMaxGridY || (arrivals != nullptr && !counters_cover(grid, arrivals))) return false;
  detail::with_format(g0.w.fmt, [&](auto f) {
    constexpr WFmt F = decltype(f)::value;
    if (g0.plane == 0)
      sk_many_kernel<F, false><<<grid, kThreads, 0, s>>>(mp);
    else if constexpr (kTakesX3<F>)
      sk_many_kernel<F, true><<<grid, kThreads, 0, s>>>(mp);
  });
  detail::check_launch("sk_gemm many kernel launch", "[", M, ", ", n, " weights, ", g0.w.K, "]");
  return true;
}

int64_t gated_partial_floats(const WeightView& gate, int64_t M) {
  return int64_t(splits(gate)) * (M < kRowsPerLaunch ? M : kRowsPerLaunch) * 2 * gate.N;
}

void gated(const GatedArgs& g, cudaStream_t s) {
  const char* op = "cuda::sk::gated";
  const WeightView &wg = g.gate, &wu = g.up;
  DFLASH2_CHECK_ARG(g.a && g.h && g.partial && wg.K > 0 && wg.N >= 0 && g.M >= 0 && wu.fmt == wg.fmt &&
                        wu.N == wg.N && wu.K == wg.K && g.ldh >= wg.N && detail::aligned(g.partial, 16),
                    op, ": bad arguments (gate and up must share format and shape)");
  DFLASH2_CHECK_ARG(detail::aligned(g.a, 16) && g.lda % 8 == 0 && g.lda >= a_width(wg.fmt, wg.K), op,
                    ": A must be 16-byte aligned with lda % 8 == 0 and lda >= ", a_width(wg.fmt, wg.K), ", found lda ",
                    g.lda);
  DFLASH2_CHECK_ARG(wg.N <= int64_t(kSkFeatPerCta) * detail::kMaxGridY, op, ": N = ", wg.N, " is too large");
  if (g.M == 0 || wg.N == 0) return;
  const int S = splits(wg);
  Params p{};
  p.lda = g.lda;
  p.N = wg.N;
  p.K = wg.K;
  p.partial = g.partial;
  p.S = S;
  p.P = 2;
  p.to_partial = true;
  const unsigned fblocks = unsigned((wg.N + kSkFeatPerCta - 1) / kSkFeatPerCta);
  for (int64_t r0 = 0; r0 < g.M; r0 += kRowsPerLaunch) {
    const int64_t m = g.M - r0 < kRowsPerLaunch ? g.M - r0 : kRowsPerLaunch;
    p.a = g.a + r0 * g.lda;
    p.M = m;
    const dim3 grid(unsigned((m + kSkTok - 1) / kSkTok), fblocks, unsigned(S));
    // up's last CTAs write h (gate's partial sums are in: the launch before) where the
    // counters cover the grid; else a reduction kernel after both
    const bool fused = counters_cover(grid, g.arrivals);
    if (fused && ops::fused_launches() && 2 * int64_t(fblocks) <= detail::kMaxGridY) {
      // gate and up in one launch, each tile's last CTA of the 2 x S writing h
      ManyParams mp{};
      mp.n = 2;
      mp.shared = true;
      for (int j = 0; j < 2; ++j) {
        Params& q = mp.p[j];
        q = p;
        q.w = j ? wu : wg;
        q.vec = detail::rows_aligned16(q.w);
        q.fp4 = fp4_global(q.w);
        q.proj = j;
        q.arrivals = g.arrivals;
        q.silu = g.h + r0 * g.ldh;
        q.ld_silu = g.ldh;
        mp.yend[j] = int64_t(fblocks) * (j + 1);
      }
      const dim3 grid2(grid.x, 2 * fblocks, grid.z);
      detail::with_format(wg.fmt, [&](auto f) {
        constexpr WFmt F = decltype(f)::value;
        sk_many_kernel<F, false><<<grid2, kThreads, 0, s>>>(mp);
      });
      detail::check_launch("sk_gemm gated kernel launch (gate | up)", " [", m, ", ", wg.N, ", ", wg.K, "]");
      continue;
    }
    for (int j = 0; j < 2; ++j) {  // gate, then up: partial [S][m][2][N]
      p.w = j ? wu : wg;
      p.vec = detail::rows_aligned16(p.w);
      p.fp4 = fp4_global(p.w);
      p.proj = j;
      p.arrivals = j == 1 && fused ? g.arrivals : nullptr;
      p.silu = j == 1 && fused ? g.h + r0 * g.ldh : nullptr;
      p.ld_silu = g.ldh;
      detail::with_format(wg.fmt, [&](auto f) { launch<decltype(f)::value>(p, grid, false, s); });
      detail::check_launch("sk_gemm gated kernel launch", j ? "up" : "gate", " [", m, ", ", wg.N, ", ", wg.K, "]");
    }
    if (!fused) {
      const unsigned blocks = detail::ceil_blocks(m * g.ldh, 256, detail::kMaxRowBlocks);
      sk_reduce_silu<<<blocks, 256, 0, s>>>(g.partial, S, m, wg.N, nullptr, g.h + r0 * g.ldh, g.ldh, 0);
      detail::check_launch("sk_gemm gated reduction (silu * up)", "[", m, ", ", wg.N, "]");
    }
  }
}

int group_splits(WFmt f, int64_t N, int64_t K, int P) {
  return layout::sk_splits(N, K, seg_elems(f), layout::kSkGroups * P);
}

int64_t grouped_partial_floats(WFmt f, int64_t N, int64_t K, int64_t M, int P) {
  const int S = group_splits(f, N, K, P);
  return S > 1 || P > 1 ? int64_t(S) * M * P * N : 0;
}

void grouped_gemm(const GroupedArgs& g, cudaStream_t s) {
  const char* op = "cuda::sk::grouped_gemm";
  DFLASH2_CHECK_ARG(g.a && g.table && g.start && g.active && g.K > 0 && g.N >= 0 && g.M >= 0 &&
                        g.M <= int64_t(INT32_MAX) && g.groups >= 1 && g.table_stride >= 1 && g.max_active >= 0 &&
                        (g.projections == 1 ? g.d != nullptr
                                            : g.projections == 2 && g.silu && g.ld_silu >= g.N && !g.d_rows &&
                                                  (g.silu_plane == 0 || (g.silu_plane >= g.N && g.silu_plane % 8 == 0 &&
                                                                         g.ld_silu >= 3 * g.silu_plane))),
                    op, ": bad arguments");
  if (g.plane != 0)
    DFLASH2_CHECK_ARG(takes_x3(g.fmt) && g.plane >= a_width(g.fmt, g.K) && g.plane % 8 == 0 && g.lda >= 3 * g.plane, op,
                      ": the exact form (three planes of A) takes BF16 / FP8 / NVFP4 weights with plane >= ",
                      a_width(g.fmt, g.K), " and lda >= 3 x plane, found plane ", g.plane, ", lda ", g.lda);
  DFLASH2_CHECK_ARG(detail::aligned(g.a, 16) && g.lda % 8 == 0 && g.lda >= a_width(g.fmt, g.K), op,
                    ": A must be 16-byte aligned with lda % 8 == 0 and lda >= ", a_width(g.fmt, g.K), ", found lda ",
                    g.lda);
  const int P = g.projections, S = group_splits(g.fmt, g.N, g.K, P);
  DFLASH2_CHECK_ARG((S == 1 && P == 1) || (g.partial != nullptr && detail::aligned(g.partial, 16)), op,
                    ": a split GEMM (or gate and up together) needs its partial-sum scratch");
  const int64_t fblocks = (g.N + kSkFeatPerCta - 1) / kSkFeatPerCta;
  DFLASH2_CHECK_ARG(fblocks * P <= int64_t(INT32_MAX), op, ": N = ", g.N, " is too large");
  if (g.M == 0 || g.N == 0 || g.max_active == 0) return;
  Params p{};
  p.a = g.a;
  p.lda = g.lda;
  p.plane = g.plane;
  p.vec = g.vec;
  p.M = g.M;
  p.N = g.N;
  p.K = g.K;
  p.d = g.d;
  p.ldd = g.ldd;
  p.partial = g.partial;
  p.S = S;
  p.P = P;
  p.to_partial = S > 1 || P > 1;
  p.proj_stride = g.proj_stride;
  p.table = g.table;
  p.table_stride = g.table_stride;
  p.start = g.start;
  p.active = g.active;
  p.max_active = g.max_active < g.groups ? g.max_active : g.groups;
  p.d_rows = g.d_rows;
  // each tile's last CTA writes its results where one counter per (row, feature block) fits
  const bool fused = p.to_partial && g.arrivals && g.M * fblocks <= detail::kCounterWords;
  p.arrivals = fused ? g.arrivals : nullptr;
  if (fused && P == 2) {
    p.silu = g.silu;
    p.ld_silu = g.ld_silu;
    p.silu_plane = g.silu_plane;
  }
  const dim3 grid(unsigned(fblocks * P), unsigned(S),
                  unsigned(p.max_active < detail::kMaxGridY ? p.max_active : detail::kMaxGridY));
  detail::with_format(g.fmt, [&](auto f) { launch<decltype(f)::value>(p, grid, true, s); });
  detail::check_launch("sk_gemm grouped kernel launch", "[", g.M, ", ", P, " x ", g.N, ", ", g.K, "] x ", g.groups);
  if (fused) return;
  if (P == 2) {
    const unsigned blocks = detail::ceil_blocks(g.M * (g.silu_plane ? g.silu_plane : g.ld_silu), 256,
                                                detail::kMaxRowBlocks);
    sk_reduce_silu<<<blocks, 256, 0, s>>>(g.partial, S, g.M, g.N, g.start + g.groups, g.silu, g.ld_silu, g.silu_plane);
    detail::check_launch("sk_gemm grouped split reduction (silu * up)", "[", g.M, ", ", g.N, "]");
  } else if (S > 1) {
    const unsigned blocks = detail::ceil_blocks(g.M * g.N, 256, detail::kMaxRowBlocks);
    sk_reduce<<<blocks, 256, 0, s>>>(g.partial, S, g.M, g.N, g.d, g.ldd, false, g.start + g.groups, g.d_rows);
    detail::check_launch("sk_gemm grouped split reduction", "[", g.M, ", ", g.N, "]");
  }
}

bool enabled() { return g_enabled.load(std::memory_order_relaxed); }
void set_enabled(bool on) { g_enabled.store(on, std::memory_order_relaxed); }

void linears(const Tensor& x, const WeightView* vs, Tensor* const* ys, size_t n, bool accumulate, bool x3) {
  const int64_t M = x.shape(0), K = vs[0].K;
  if (M == 0 || n == 0) return;
  const int device = x.device().index;
  cudaStream_t st = detail::stream();
  auto up = [](int64_t v, int64_t m) { return (v + m - 1) / m * m; };
  int64_t width = 8, p_floats = 0;  // A's width (x3: each plane's)
  for (size_t i = 0; i < n; ++i) {
    DFLASH2_INTERNAL(vs[i].K == K, "cuda::sk::linears: weights of different K");
    width = std::max(width, a_width(vs[i].fmt, K));
    p_floats += up(partial_floats(vs[i], M), 4);  // each weight its own (16-byte aligned)
  }
  const int64_t lda = x3 ? 3 * width : width, a_bytes = up(M * lda * 2, 256);
  uint8_t* base = static_cast<uint8_t*>(detail::scratch(device, size_t(a_bytes + p_floats * 4)));
  __nv_bfloat16* a16 = reinterpret_cast<__nv_bfloat16*>(base);
  if (x3)
    split_x3(x.data_as<const float>(), M > 1 ? x.stride(0) : K, M, K, a16, lda, width, st);
  else
    dq::rows_bf16(dq::RowsFrom::Plain, x.data_as<const float>(), nullptr, x.stride(0), nullptr, 1, nullptr, M, K, lda,
                  a16, st);
  std::vector<GemmArgs> gs(n);
  float* partial = reinterpret_cast<float*>(base + a_bytes);
  for (size_t i = 0; i < n; ++i) {
    const int64_t pf = partial_floats(vs[i], M);
    GemmArgs& g = gs[i];
    g.a = a16;
    g.lda = lda;
    g.plane = x3 ? width : 0;
    g.w = vs[i];
    g.M = M;
    g.d = ys[i]->data_as<float>();
    g.ldd = M > 1 ? ys[i]->stride(0) : vs[i].N;
    g.accumulate = accumulate;
    g.partial = pf > 0 ? partial : nullptr;
    g.arrivals = pf > 0 ? detail::zeroed_counters(device) : nullptr;
    partial += up(pf, 4);
  }
  // up to 4 of one format in one launch where the skinny kernel can (one row chunk), in any
  // order: only where no output shares an element with another (else one by one, in order)
  bool disjoint = n > 1 && ops::fused_launches();
  for (size_t i = 0; i < n && disjoint; ++i)
    for (size_t j = 0; j < i && disjoint; ++j) disjoint = layout::views_disjoint(*ys[i], *ys[j]);
  std::vector<bool> done(n, false);
  for (size_t i = 0; i < n; ++i) {
    if (done[i]) continue;
    if (disjoint) {
      std::vector<GemmArgs> group;
      std::vector<size_t> idx;
      for (size_t j = i; j < n && group.size() < 4; ++j)
        if (!done[j] && gs[j].w.fmt == gs[i].w.fmt) {
          group.push_back(gs[j]);
          idx.push_back(j);
        }
      if (group.size() > 1 && gemm_many(group.data(), int(group.size()), st)) {
        for (size_t j : idx) done[j] = true;
        continue;
      }
    }
    gemm(gs[i], st);
    done[i] = true;
  }
}

}  // namespace dflash2::cuda::sk

namespace dflash2::cuda {
bool linear_sk_enabled() { return sk::enabled(); }
void set_linear_sk_enabled(bool on) { sk::set_enabled(on); }

bool exact_tc_takes(const detail::WeightView& w) {
  return ops::exact_tc() && sk::enabled() && sk::takes_x3(w.fmt) && w.K > 0 && w.N > 0 &&
         w.N <= int64_t(layout::kSkFeatPerCta) * detail::kMaxGridY;
}

void linear_exact_tc(const Tensor& x, const detail::WeightView* vs, Tensor* const* ys, size_t n, bool accumulate) {
  for (size_t i = 0; i < n; ++i)
    DFLASH2_INTERNAL(sk::takes_x3(vs[i].fmt), "cuda::linear_exact_tc: a weight the exact form does not take");
  sk::linears(x, vs, ys, n, accumulate, /*x3=*/true);
}
}  // namespace dflash2::cuda
