// cuda/layout.h: the index and layout arithmetic of the CUDA ops, written once for the host
// and the device. Plain C++ (no CUDA header): the DFLASH2_HD functions compile as
// __host__ __device__ under nvcc and as inline host functions elsewhere, so
// tests/cpp/test_cuda_layout.cpp checks them on the CPU in every build, with or without a
// GPU. The host-only part (RowLayout, collapse of a strided pair) is what the .cu files
// use to plan a launch.
//
// Status: the host side is unit-tested on the CPU; the device side is compiled for
// sm_90a/sm_100a/sm_103a but has not yet run on a GPU.
#pragma once
#include <cstdint>
#include <cstring>

#include "dflash2/error.h"
#include "dflash2/tensor.h"

#ifndef DFLASH2_HD
#if defined(__CUDACC__)
#define DFLASH2_HD __host__ __device__ __forceinline__
#else
#define DFLASH2_HD inline
#endif
#endif

namespace dflash2::cuda::layout {

constexpr int kMaxDims = Tensor::kMaxDims;  // 6

// ------------------------------------------------------------------ float <-> bits
DFLASH2_HD uint32_t float_bits(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#else
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return u;
#endif
}
DFLASH2_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float v;
  std::memcpy(&v, &u, 4);
  return v;
#endif
}

// ------------------------------------------------------------------ strided pairs (copy)
// Two tensors of one shape with their own strides (elements), after collapse(): ndim
// dims (0 = a single element), outermost first, the last dim fastest.
struct StridedPair {
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t src_stride[kMaxDims] = {};
  int64_t dst_stride[kMaxDims] = {};
};

// Element offsets in src and dst of the element with row-major linear index i (0 <= i <
// product of the shape). I is the index type used for the div/mod walk: uint32_t when the
// element count fits (cheaper on the GPU), else uint64_t.
template <class I>
DFLASH2_HD void pair_offsets(const StridedPair& p, I i, int64_t* src_off, int64_t* dst_off) {
  int64_t s = 0, d = 0;
  for (int k = p.ndim - 1; k >= 0; --k) {
    const I n = I(p.shape[k]);
    const I c = i % n;
    i /= n;
    s += int64_t(c) * p.src_stride[k];
    d += int64_t(c) * p.dst_stride[k];
  }
  *src_off = s;
  *dst_off = d;
}

// The same walk over a shape whose dims are given in any form: drops size-1 dims and merges
// a dim into the next inner one when both tensors step over it contiguously
// (stride[k] == stride[k+1] * shape[k+1] on both sides). The element order (row-major
// over the original shape) and every element's pair of offsets are unchanged. ndim <= 6;
// a shape holding a 0 must be handled by the caller (nothing to copy).
inline StridedPair collapse(int ndim, const int64_t* shape, const int64_t* src_stride, const int64_t* dst_stride) {
  StridedPair out;
  // built innermost-first in tmp, reversed at the end
  int64_t sh[kMaxDims], ss[kMaxDims], ds[kMaxDims];
  int n = 0;
  for (int k = ndim - 1; k >= 0; --k) {
    if (shape[k] == 1) continue;
    if (n > 0 && src_stride[k] == ss[n - 1] * sh[n - 1] && dst_stride[k] == ds[n - 1] * sh[n - 1]) {
      sh[n - 1] *= shape[k];
      continue;
    }
    sh[n] = shape[k];
    ss[n] = src_stride[k];
    ds[n] = dst_stride[k];
    ++n;
  }
  out.ndim = n;
  for (int k = 0; k < n; ++k) {
    out.shape[k] = sh[n - 1 - k];
    out.src_stride[k] = ss[n - 1 - k];
    out.dst_stride[k] = ds[n - 1 - k];
  }
  return out;
}

// True when the collapsed pair is one run of consecutive elements on both sides (a plain
// memcpy of numel elements), including the single-element case.
inline bool is_one_run(const StridedPair& p) {
  return p.ndim == 0 || (p.ndim == 1 && p.src_stride[0] == 1 && p.dst_stride[0] == 1);
}

inline int64_t numel(const StridedPair& p) {
  int64_t n = 1;
  for (int k = 0; k < p.ndim; ++k) n *= p.shape[k];
  return n;
}

// ------------------------------------------------------------------ rows
// Rows of a [.., D] tensor whose last dim is contiguous: their count and the stride between
// consecutive rows (elements) after collapsing the leading dims (size-1 dims ignored; a
// tensor with a single row gets stride D). Throws InvalidArgument naming `op` and `arg`
// when the last dim is strided or the leading dims are not evenly strided (ops.cpp has
// already checked this for calls through the op interface; direct callers get the same).
struct RowLayout {
  int64_t rows = 0;
  int64_t stride = 0;
  int64_t cols = 0;
};

inline RowLayout row_layout(const Tensor& t, const char* op, const char* arg) {
  const int nd = t.ndim();
  DFLASH2_CHECK_ARG(nd >= 1, "cuda::", op, ": '", arg, "' must have at least one dimension, found ", t.describe());
  const int64_t D = t.shape(-1);
  DFLASH2_CHECK_ARG(t.stride(-1) == 1 || D == 1, "cuda::", op, ": '", arg,
                    "' must be contiguous in its last dimension, found ", t.describe(), " with strides ",
                    shape_str(t.strides()));
  RowLayout L;
  L.cols = D;
  L.rows = D > 0 ? t.numel() / D : 0;
  L.stride = D;
  bool have = false;
  int64_t expect = 0;
  for (int i = nd - 2; i >= 0; --i) {
    if (t.shape(i) == 1) continue;
    if (!have) {
      L.stride = t.stride(i);
      expect = L.stride * t.shape(i);
      have = true;
    } else {
      DFLASH2_CHECK_ARG(t.stride(i) == expect, "cuda::", op, ": the leading dimensions of '", arg, "' ",
                        t.describe(), " (strides ", shape_str(t.strides()),
                        ") cannot be viewed as evenly strided rows");
      expect *= t.shape(i);
    }
  }
  return L;
}

// An output's rows must not overlap each other (row stride >= row length), or threads
// writing different rows would race.
inline void check_rows_disjoint(const RowLayout& L, const char* op, const char* arg) {
  DFLASH2_CHECK_ARG(L.rows <= 1 || L.stride >= L.cols, "cuda::", op, ": the rows of '", arg, "' overlap (row stride ",
                    L.stride, " < ", L.cols, ")");
}

// Whether two views share no element (so one kernel may write both, or write one while it
// reads the other, in any order). Sufficient conditions only (false = "maybe shared"): their
// byte extents are disjoint, or both are row views with one row stride and element size
// whose column byte ranges within a row do not meet (a cache's column slices: latent c and
// k_pe). Views with negative strides are never called disjoint.
inline bool byte_extent(const Tensor& t, uintptr_t& lo, uintptr_t& hi) {
  int64_t span = 0;
  for (int d = 0; d < t.ndim(); ++d) {
    if (t.shape(d) == 0) return lo = hi = 0, true;
    if (t.stride(d) < 0) return false;
    span += (t.shape(d) - 1) * t.stride(d);
  }
  lo = reinterpret_cast<uintptr_t>(t.data());
  hi = lo + uintptr_t(span + 1) * dtype_size(t.dtype());
  return true;
}
inline bool views_disjoint(const Tensor& a, const Tensor& b) {
  uintptr_t a0, a1, b0, b1;
  if (!byte_extent(a, a0, a1) || !byte_extent(b, b0, b1)) return false;
  if (a0 == a1 || b0 == b1 || a1 <= b0 || b1 <= a0) return true;
  if (a.ndim() != 2 || b.ndim() != 2 || a.dtype() != b.dtype() || a.stride(1) != 1 || b.stride(1) != 1) return false;
  const int64_t e = int64_t(dtype_size(a.dtype()));
  int64_t S = a.shape(0) > 1 ? a.stride(0) * e : 0;  // the row stride in bytes (of the views with rows > 1)
  if (b.shape(0) > 1) {
    if (S != 0 && b.stride(0) * e != S) return false;
    S = b.stride(0) * e;
  }
  if (S <= 0) return false;
  const uintptr_t origin = a0 < b0 ? a0 : b0;  // column offsets within a row of S bytes from there
  const int64_t ca = int64_t((a0 - origin) % uintptr_t(S)), cb = int64_t((b0 - origin) % uintptr_t(S));
  const int64_t wa = a.shape(1) * e, wb = b.shape(1) * e;
  if (ca + wa > S || cb + wb > S) return false;  // a row wraps into the next: not this case
  return ca + wa <= cb || cb + wb <= ca;
}

// ------------------------------------------------------------------ RoPE
// The two elements rotated together by pair i < D/2 (positions along the rotary dim):
// interleaved (GPT-J) rotates (2i, 2i + 1), NeoX rotates (i, i + D/2).
struct RopePair {
  int64_t a, b;
};
DFLASH2_HD RopePair rope_pair(bool interleaved, int64_t i, int64_t half) {
  return interleaved ? RopePair{2 * i, 2 * i + 1} : RopePair{i, i + half};
}
// The exponent 2i/D of theta^(-2i/D), formed in fp32 exactly as the CPU backend does.
DFLASH2_HD float rope_exponent(int64_t i, int64_t D) { return float(2 * i) / float(D); }

// ------------------------------------------------------------------ argmax
// The CPU's argmax is sequential: best = 0, then best = i whenever x[i] > x[best]. A NaN
// never compares greater and nothing compares greater than a NaN, so the result is:
//   0 if x[0] is NaN; otherwise the lowest index of the maximum over the non-NaN elements
//   (+0 and -0 compare equal, so they tie and the lower index wins).
// A parallel reduction gets the same answer by never forming a candidate from a NaN,
// ordering candidates by (value, -index) with argmax_better (a strict total order on
// non-NaN values with distinct indices, hence associative and commutative: any reduction
// tree gives the same winner), and applying argmax_finish with x[0]'s NaN-ness.
// The empty candidate (value -inf, index kArgmaxNone) loses to every real candidate.
constexpr int32_t kArgmaxNone = 0x7fffffff;

DFLASH2_HD bool argmax_better(float va, int32_t ia, float vb, int32_t ib) {
  return va > vb || (va == vb && ia < ib);
}
DFLASH2_HD int32_t argmax_finish(bool first_is_nan, int32_t best) {
  return (first_is_nan || best == kArgmaxNone) ? 0 : best;
}

// ------------------------------------------------------------------ index tensors on the device
// gather_rows ids and cache_write slots are device data: a kernel cannot throw. A row index
// is used only when 0 <= r < n (see index_rows.cu for what happens otherwise).
DFLASH2_HD bool row_in_range(int64_t r, int64_t n) { return r >= 0 && r < n; }

// dyn_conv: the dynamic-weight group of channel c when H channels are split in G groups of
// gs = H / G channels.
DFLASH2_HD int64_t conv_group(int64_t c, int64_t gs) { return c / gs; }

// ------------------------------------------------------------------ FP8 block-128 GEMM scales
// ops::linear_fp8 (cutlass/fp8_gemm.h, sm_90a and sm_100a / sm_103a): where CUTLASS's
// blockwise-scaled mainloops (cutlass/fp8_config.cuh) read the scale of activation row m, k-block kb (granularity
// 1 x 128, MN-major over Mp rows: what quant.cu writes) and of weight block (nb, kb)
// (granularity 128 x 128, K-major: the checkpoint's weight_scale_inv [ceil(N/128), nbk]).
// tests/cpp/test_cutlass_layout.cu checks both against the CuTe layouts the kernel uses.
DFLASH2_HD int64_t fp8_act_scale_offset(int64_t m, int64_t kb, int64_t Mp) { return kb * Mp + m; }
DFLASH2_HD int64_t fp8_weight_scale_offset(int64_t nb, int64_t kb, int64_t nbk) { return nb * nbk + kb; }
// The Blackwell grouped GEMM's activation scales (cutlass/fp8_config.cuh
// Fp8GroupedKMajorScaleConfig): K-major, row m's nbk scales contiguous, so a group whose
// rows start at r0 has its scales at r0 * nbk, [M_g][nbk].
DFLASH2_HD int64_t fp8_act_scale_offset_kmajor(int64_t m, int64_t kb, int64_t nbk) { return m * nbk + kb; }

// ------------------------------------------------------------------ NVFP4 W4A4 GEMM scales
// ops::linear_nvfp4 on sm_100a / sm_103a (cutlass/nvfp4_gemm.h): the block-scaled tcgen05
// MMA reads one E4M3 scale per 16 inputs in CUTLASS's Sm1xxBlockScaledConfig<16> layout
// (cutlass/nvfp4_config.cuh): atoms of 128 rows x 4 scales (512 bytes), row r of an atom at
// (r % 32) * 16 + (r / 32) * 4, scale c at c % 4; atoms K-fastest. A buffer for R rows and
// K inputs (K % 16 == 0) holds nvfp4_sf_rows(R) x nvfp4_sf_cols(K) bytes; the padding must be
// zero. tests/cpp/test_cutlass_layout.cu checks this against the CuTe layout.
DFLASH2_HD int64_t nvfp4_sf_cols(int64_t K) { return (K / 16 + 3) / 4 * 4; }
DFLASH2_HD int64_t nvfp4_sf_rows(int64_t R) { return (R + 127) / 128 * 128; }
DFLASH2_HD int64_t nvfp4_sf_offset(int64_t r, int64_t c, int64_t sf_cols) {
  return ((r / 128) * (sf_cols / 4) + c / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + c % 4;
}

// ------------------------------------------------------------------ gemm_dq.cu
// The mainloop-dequantizing tensor-core GEMM (gemm_dq.cu): CTA tiles of kDqBM rows x kDqBN
// output features, kDqBK inputs per k-tile, in shared memory as rows of kDqBK BF16 (four
// 16-byte chunks). A row's chunk c is stored at chunk c ^ ((row >> 1) & 3) of that row, so
// the 8 row addresses of one ldmatrix phase (8 consecutive rows, one logical chunk) fall in 8
// distinct groups of 4 banks (rows are 64 bytes: without the XOR, rows r and r + 2 collide).
constexpr int kDqBM = 64, kDqBN = 128, kDqBK = 32, kDqChunks = kDqBK / 8;
DFLASH2_HD int dq_chunk(int row, int chunk) { return row * kDqChunks + (chunk ^ ((row >> 1) & 3)); }
// The row (relative to the fragment's first) and 16-byte chunk (relative to the k16 step's
// first) whose address `lane` gives ldmatrix.x4: for an A fragment (16 rows x 16 inputs:
// matrices rows 0-7 / 8-15 at inputs 0-7, then at 8-15 = registers a0..a3 of mma.m16n8k16)
// and for two B fragments (features 0-7 at inputs 0-7 / 8-15, then features 8-15: b0, b1 of
// the first 8 features, b0, b1 of the next 8).
DFLASH2_HD int dq_a_lane_row(int lane) { return lane & 15; }
DFLASH2_HD int dq_a_lane_chunk(int lane) { return lane >> 4; }
DFLASH2_HD int dq_b_lane_row(int lane) { return (lane & 7) + ((lane >> 4) << 3); }
DFLASH2_HD int dq_b_lane_chunk(int lane) { return (lane >> 3) & 1; }
// The wgmma form of the kernel (sm_90a, gemm_dq.cu's dq_wg_kernel): the same CTA tiles with
// k-tiles of kWgBK = 64 inputs, each operand row of 64 BF16 = 128 bytes in the 128-byte swizzle
// that wgmma's K-major operands read (CuTe's GMMA::Layout_K_SW128_Atom): 16-byte chunk c of
// row r at byte r * 128 + (c ^ (r % 8)) * 16 from a 1024-byte aligned base.
constexpr int kWgBK = 64, kWgChunks = kWgBK / 8;
constexpr int kWgATileBytes = kDqBM * kWgBK * 2, kWgBTileBytes = kDqBN * kWgBK * 2;  // one stage
DFLASH2_HD int wg_sw128_offset(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }
// wgmma's shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format") of a K-major
// BF16 operand in that swizzle whose rows start at shared address `addr` (1024-byte aligned,
// plus 32 bytes per k16 step inside the row: the swizzle is applied to the address the unit
// forms, so the step is a plain offset): start address >> 4 in bits 0-13, the leading byte
// offset (unused for swizzled K-major operands; 1 as CUTLASS sets it) in bits 16-29, the
// stride byte offset between 8-row groups (1024 >> 4) in bits 32-45, base offset 0 (bits
// 49-51), swizzle mode 1 = 128 bytes in bits 62-63.
DFLASH2_HD uint64_t wg_desc_k_sw128(uint32_t addr) {
  return uint64_t((addr & 0x3FFFFu) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}
// The accumulator element that register v (of n / 2: wgmma m64nNk16 with F32 accumulators)
// of thread t (0..127 of the warpgroup) holds: row 16 (t / 32) + (t % 32) / 4 + 8 ((v / 2) % 2),
// column 8 (v / 4) + 2 (t % 4) + v % 2 (PTX ISA, "Register Fragments and Shared Memory Matrix
// Layouts" for wgmma .m64nNk16 D; checked against CuTe's CLayout_64xN by test_cutlass_layout).
DFLASH2_HD int wg_acc_row(int t, int v) { return 16 * (t >> 5) + ((t & 31) >> 2) + 8 * ((v >> 1) & 1); }
DFLASH2_HD int wg_acc_col(int t, int v) { return 8 * (v >> 2) + 2 * (t & 3) + (v & 1); }
// The m-tiles of a group of m rows, and an upper bound of those of groups of `rows` rows in
// all: every non-empty group adds at most one partial tile.
DFLASH2_HD int64_t dq_m_tiles(int64_t m) { return (m + kDqBM - 1) / kDqBM; }
DFLASH2_HD int64_t dq_max_m_tiles(int64_t rows, int64_t groups) {
  return dq_m_tiles(rows) + (groups < rows ? groups : rows);
}
// tile_start[g] = the m-tiles of the groups before g, g = 0 .. G (one thread on the device:
// groups are few).
DFLASH2_HD void dq_tile_starts(const int32_t* start, int G, int32_t* tile_start) {
  int32_t acc = 0;
  tile_start[0] = 0;
  for (int g = 0; g < G; ++g) {
    acc += int32_t(dq_m_tiles(int64_t(start[g + 1]) - start[g]));
    tile_start[g + 1] = acc;
  }
}
// The group holding item i of groups laid out back to back: first[0 .. G] are the groups'
// first items (ascending, first[0] = 0), i < first[G]; the last g with first[g] <= i (an
// empty group g has first[g] == first[g + 1] and is skipped). For m-tiles (tile_start) and
// for the routed experts' positions (the lists' start[]).
DFLASH2_HD int group_of(const int32_t* first, int G, int64_t i) {
  int lo = 0, hi = G;  // first[lo] <= i < first[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (first[mid] <= i) lo = mid; else hi = mid;
  }
  return lo;
}
// m-tile t's rows [first, end) of the grouped problem whose group g holds rows
// [start[g], start[g + 1]) (start ascending), and its group; first >= end: no tile (t past
// the last one).
struct DqRows {
  int64_t first, end;
  int group;
};
DFLASH2_HD DqRows dq_tile_rows(const int32_t* start, const int32_t* tile_start, int G, int64_t t) {
  if (t >= tile_start[G]) return {0, 0, 0};
  const int g = group_of(tile_start, G, t);
  const int64_t first = start[g] + (t - tile_start[g]) * kDqBM, end = start[g + 1];
  return {first, first + kDqBM < end ? first + kDqBM : end, g};
}

// ------------------------------------------------------------------ gemm_sk.cu
// The skinny tensor-core GEMM of generated tokens (gemm_sk.cu): y^T = W x^T on mma.m16n8k16
// with the weight as the A operand (16 output features per warp, read straight from global
// memory into registers and dequantized there) and the tokens as B (n = 8 per MMA, up to
// kSkTok per CTA, staged in shared memory). A lane (g = lane / 4, t = lane % 4) loads 16-byte
// segments of its two rows (features g and g + 8): in each k-stage, segment i of lane t holds
// the stage's inputs sk_k(E, t, i, e), e < E (E inputs per 16 bytes: 8 for BF16 / F16 / F32
// (F32 converted on load), 16 for FP8, 32 for NVFP4), so the four lanes of a row read
// 4 x 16 consecutive bytes per segment index (coalesced). An MMA sums over its 16 k-slots,
// so which physical input sits in which slot is free as long as A and B agree: lane t's
// group of 8 inputs (e = 8h .. 8h + 7 of a segment) feeds two MMAs, inputs 0-1 / 2-3 in
// slots 2t, 2t+1 / 2t+8, 2t+9 of the first, 4-5 / 6-7 of the second, and the B fragment
// reads the same 8 inputs of the token's row.
constexpr int kSkWarps = 4, kSkFeat = 16, kSkTok = 32;
constexpr int kSkFeatPerCta = kSkWarps * kSkFeat;  // 64
constexpr int kSkFill = 528;                       // CTAs the split aims for (4 per SM of an H100 / H200)
constexpr int kSkMaxSplits = 32;
// 16-byte segments per lane per stage: 4 (E = 8, 16), 2 (NVFP4: the stage's x tile stays
// at 256 inputs, 16 KiB per buffer).
DFLASH2_HD constexpr int sk_segs(int E) { return E >= 32 ? 2 : 4; }
DFLASH2_HD constexpr int64_t sk_stage_k(int E) { return int64_t(4) * sk_segs(E) * E; }  // 128 / 256 / 256
DFLASH2_HD int64_t sk_k(int E, int t, int i, int e) { return int64_t(i * 4 + t) * E + e; }
// The split of K over S CTAs, a function of (N, K, E) only (never of M: a token's sums must
// not depend on its batch): doubled while the CTAs of one token tile stay under kSkFill and
// every split keeps at least one stage. The grouped kernel (the routed experts of decode
// chunks) aims at kSkGroups groups of one token tile (a decode token's top-8 experts) times
// its projections per launch (2: gate and up together): a function of (N, K, E) and that
// launch's shape too, never of how many experts a batch happens to hit.
constexpr int kSkGroups = 8;
DFLASH2_HD int sk_splits(int64_t N, int64_t K, int E, int groups = 1) {
  const int64_t stages = (K + sk_stage_k(E) - 1) / sk_stage_k(E);
  const int64_t blocks = (N + kSkFeatPerCta - 1) / kSkFeatPerCta * groups;
  int s = 1;
  while (s * 2 <= kSkMaxSplits && s * 2 <= stages && blocks * s < kSkFill) s *= 2;
  return s;
}
// Tokens per CTA tile: kSkTok, or in the exact form (x as three BF16 planes, gemm_sk.h's
// GemmArgs::plane) 8 for FP8 / NVFP4 and 16 for BF16, so that the three planes' double-buffered
// stage tiles stay at 24 KiB of static shared memory (3 x 2 x 8 tokens x 256 inputs x 2 bytes;
// BF16: 16 tokens x 128 inputs), under the 48 KiB a kernel may declare statically.
DFLASH2_HD constexpr int sk_tok(int E, bool x3) { return !x3 ? kSkTok : E >= 16 ? kSkTok / 4 : kSkTok / 2; }
// Split z's stages [sk_split_begin(z), sk_split_begin(z + 1)).
DFLASH2_HD int64_t sk_split_begin(int64_t stages, int S, int z) { return stages * z / S; }
// x's stage tile in shared memory: kSkTok rows of sk_stage_k(E) BF16 inputs, as 16-byte
// chunks (8 inputs); chunk c of row r sits at slot (c & 7) ^ sw within its aligned group of
// 8, where sw flips bit 2 (E = 8) or bit 0 (E = 16, 32) on odd rows and, for NVFP4, bit 1
// with bit 3 of c. So each phase of a B-fragment load (8 lanes: rows 2p, 2p + 1 x t = 0..3,
// one segment and group) touches 8 distinct 16-byte bank groups (test_cuda_layout).
DFLASH2_HD int sk_x_chunk(int row, int c, int E) {
  const int chunks = int(sk_stage_k(E) / 8);
  const int sw = ((row & 1) ? (E == 8 ? 4 : 1) : 0) ^ (E == 32 ? ((c >> 3) & 1) << 1 : 0);
  return row * chunks + (c & ~7) + ((c & 7) ^ sw);
}
// The chunk of segment i, group h (8 inputs) of lane t: (i * 4 + t) * (E / 8) + h.
DFLASH2_HD int sk_lane_chunk(int E, int t, int i, int h) { return (i * 4 + t) * (E / 8) + h; }

}  // namespace dflash2::cuda::layout
