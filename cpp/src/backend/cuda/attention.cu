// cuda/attention.cu: the attention ops of the CUDA backend: the DSA indexer (indexer_topk),
// sparse absorbed MLA over the paged latent cache (mla_attention) and the DFlash drafter's
// block attention (block_attention). Semantics: dflash2/ops.h; the oracle is the CPU
// backend (cpu/attention.cpp).
//
// Status: compiled for sm_90a/sm_100a/sm_103a, NOT yet run on a GPU. The index logic
// (attention_index.h: paged slots, the float -> ordered-key map, the radix-select walk and
// the emit rule) is unit-tested on the CPU by tests/cpp/test_cuda_attention.cpp; the
// kernels are checked against the CPU backend by that file's device cases and
// tests/test_ops.py when a GPU is present.
//
// indexer_topk (two kernels per chunk of tokens, the scores in detail::scratch):
//   score   grid (key tiles of 256) x (tokens), the token fastest (idx_block_order). A
//           block stages q[t] (nI x dI, rows padded to an odd stride) and w[t] / sqrt(nI)
//           in shared memory; each of its 4 warps takes
//           8 keys at a time (their rows staged in shared memory), lane h computes the
//           head-h dot products of the 8 keys (heads in chunks of 32), and lanes 0..7 add
//           the 8 keys' head terms in head order. The arithmetic is the CPU's, in the
//           CPU's order, with __fmul_rn / __fadd_rn (no FMA contraction): dot4's four
//           partial sums, (s0 + s1) + (s2 + s3), * (1 / sqrt(dI)), relu, * (w * (1 /
//           sqrt(nI))), the head terms summed in head order. The scores are therefore
//           bitwise the CPU's and the selection is exactly the CPU's, margins or not
//           (for the default CPU build; with DFLASH2_NATIVE=ON GCC may contract the CPU's
//           dot products into FMAs, and then only the tests' score margins keep the sets
//           equal).
//   select  one 1024-thread block per token: the radix select of attention_index.h over
//           the token's p + 1 scores (up to four 256-bin histogram passes in shared memory,
//           integer atomics, so the counts and the threshold are deterministic; 8 scores in
//           flight per thread), then one pass over the positions in tiles of 8192 (8
//           consecutive per thread) with a block-wide exclusive scan of the threads' summed
//           (above-threshold, threshold-class) flags that writes every selected position
//           to its slot in ascending order: keys above the threshold and the earliest keys
//           equal to it (ties to the earlier key). Tokens with p + 1 <= topk get
//           sel_len = -1 and an untouched sel row, as on the CPU.
//   The scratch holds (tokens of the chunk) x (block-table width * block size) floats; the
//   tokens are taken in chunks so that it stays under 512 MiB (1024 tokens at 128K). A
//   token's computation does not depend on the others (decode == verify).
//   Blocks take 256 keys (8 steps of 4 warps x 8 keys), fewer (idx_units_per_block) where the grid would
//   leave SMs idle: a decode token over 4096 keys runs 128 blocks of 32 keys, not 16 of 256.
//   Performance notes: the score kernel is fp32 SIMT, bound by shared-memory bandwidth and
//   the unfused multiply-adds kept for bitwise CPU parity (~2x an FMA version). A BF16 key
//   cache (kv_cache_dtype = "bf16") is scored on the tensor cores instead where the shape
//   allows (indexer_tc_kernel, ops::indexer_tc(): the dots on mma.sync with q as three BF16
//   planes, so only the MMAs' fp32 sums round; the head terms and their head-order sum as
//   here): not bitwise the CPU's scores, so a key within rounding of the top-k boundary may
//   be selected differently; a token's scores never depend on its batch. The first
//   histogram pass could be fused into the score kernel (global integer atomics stay
//   deterministic), and a 128K context reads its scores 5-6 times in select (L2-resident
//   per token).
//   indexer_scores (ops.h) runs the same score kernels into its output (for tests).
//
// mla_attention: one 256-thread block per (token, group of HG heads; HG = 16, or 4 when
//   nh <= 4). The latent row [c | k_pe] is shared by every head (the absorbed form), so a
//   block streams its token's keys once, in chunks of 32 rows staged in shared memory
//   (paged rows, gathered through sel or 0..pos), and every head of the group uses them:
//   warp w scores heads w, w + 8, ... (lane = key of the chunk; q rows broadcast, key rows
//   at an odd stride: no bank conflicts), updates that head's online softmax (running max
//   in fp32, the sum of exponentials in double, as the CPU sums in double), and the block
//   then accumulates P V with each thread owning DPT = kv_lora / 256 latent dims for all
//   HG heads (registers). Scores are (q_lat . c + q_pe . k_pe) * scale as on the CPU
//   (the dots with FMAs in 4 partial sums, so not bitwise); out = acc * float(1 / sum).
//   An empty selection gives zeros. Real shapes (kv_lora 512, rope 64, 16 heads) use 111
//   KiB of shared memory per block (opt-in); kv_lora <= 1024.
//   Segments and split-KV: the online softmax runs per segment of 64 keys (2 chunks), and
//   the segments' states (max, sum, P V) are folded in key order with correctly rounded
//   operations (mla_fold_scalars / mla_fold_value). When T * nh / 16 blocks would leave
//   most SMs idle (decode; verify at small batch) and the partial states fit in 64 MiB of
//   scratch, each segment gets its own block (grid z, 4-head groups) writing its state, and
//   mla_combine_kernel folds them in the same order with the same operations: bitwise the
//   unsplit result, so the launch shape (a function of T) never changes a row and decode
//   == verify holds. A decode token of GLM-5.3 (2048 selected keys, 64 heads) becomes
//   16 x 32 blocks instead of 4.
//   On an H200 (2026-12-04, before the staging below) a decode token over 2048 selected
//   keys took 106 us, far above its memory time: the chunk was staged one row at a time,
//   each thread's store waiting for its load (about 2 loads in flight per thread per
//   latency); now kMlaGatherILP loads are in flight per thread (float4 loads where the key
//   rows are 16-byte aligned: 32 KB per block in the split decode variant, 16 KB in the others;
//   the query rows 8 scalar loads) (not yet measured).
//   Follow-up: stage the chunks with cp.async / TMA double buffering.
//
// block_attention: one 256-thread block per (sequence block s, kv head, group of 8 query
//   rows of that kv head: (token i, head of the GQA group)); warp w owns one query row. The
//   block streams its rows' visible keys (the context from the earliest window start of
//   its rows, then the block's own B keys) in chunks of 32 K and V rows staged in shared
//   memory; each warp masks per row (window start, causal), scores with lane = key, keeps
//   an online softmax (fp32 max, double sum) and accumulates P V with hd / 32 dims per
//   lane. Scores are the CPU's sequential dot (unfused, in order) * scale. hd <= 128.
//   Follow-up: split-KV for long unwindowed contexts (one block walks the whole context).
//
// Device data that the CPU backend would reject (positions or block-table entries outside
// the table or the cache, selected keys outside 0..pos, sel_len > sel's columns, negative
// ctx_len) never faults here: such a key reads as a zero row, lengths are clamped to what
// the block table can address.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "backend/cuda/attention_index.h"
#include "backend/cuda/cuda_api.h"
#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/device_attr.cuh"
#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/mma_sm80.cuh"
#include "backend/cuda/quant_device.cuh"
#include "backend/cuda/scratch.h"
#include "dflash2/error.h"
#include "ops/kv_fp8.h"

namespace dflash2::cuda {

namespace {

using detail::allow_smem;

void need_cuda(const Tensor& t, const Tensor& ref, const char* op, const char* arg) {
  DFLASH2_CHECK_ARG(t.defined(), "cuda::", op, ": undefined tensor argument '", arg, "'");
  DFLASH2_CHECK_ARG(t.device().is_cuda() && t.device() == ref.device(), "cuda::", op, ": '", arg, "' ",
                    t.describe(), " must be on the same CUDA device as ", ref.describe());
}
void need_i32_vec(const Tensor& t, int64_t n, const char* op, const char* arg) {
  DFLASH2_CHECK_ARG(t.dtype() == DType::I32 && t.ndim() == 1 && t.shape(0) == n, "cuda::", op, ": '", arg,
                    "' must be I32 [", n, "], found ", t.describe());
}
void need_rows(const Tensor& t, DType dt, int nd, const char* op, const char* arg) {
  DFLASH2_CHECK_ARG(t.dtype() == dt && t.ndim() == nd && (t.stride(nd - 1) == 1 || t.shape(nd - 1) == 1), "cuda::",
                    op, ": '", arg, "' must be ", dtype_name(dt), " with ", nd,
                    " dimensions and contiguous rows, found ", t.describe(), " strides ", shape_str(t.strides()));
}
// The rows (i, j, :) of a 3-D output must not overlap: with the two outer dims ordered by
// stride, each must step past everything inside it.
void need_disjoint3(const Tensor& t, const char* op, const char* arg) {
  int64_t n[2] = {t.shape(0), t.shape(1)}, s[2] = {t.stride(0), t.stride(1)};
  if (s[0] < s[1]) {
    std::swap(n[0], n[1]);
    std::swap(s[0], s[1]);
  }
  const int64_t D = t.shape(2);
  const bool ok = (n[1] <= 1 || s[1] >= D) && (n[0] <= 1 || s[0] >= (n[1] <= 1 ? D : s[1] * n[1]));
  DFLASH2_CHECK_ARG(ok, "cuda::", op, ": the rows of '", arg, "' ", t.describe(), " (strides ",
                    shape_str(t.strides()), ") overlap");
}
void need_tokens(const ops::PagedTokens& tok, const Tensor& ref, int64_t T, const char* op) {
  need_cuda(tok.seq, ref, op, "tok.seq");
  need_cuda(tok.pos, ref, op, "tok.pos");
  need_cuda(tok.block_table, ref, op, "tok.block_table");
  need_i32_vec(tok.seq, T, op, "tok.seq");
  need_i32_vec(tok.pos, T, op, "tok.pos");
  need_rows(tok.block_table, DType::I32, 2, op, "tok.block_table");
  DFLASH2_CHECK_ARG(tok.block_size >= 1, "cuda::", op, ": block_size must be >= 1, found ", tok.block_size);
}

// The paged-token description as the kernels read it.
struct Tokens {
  const int32_t* seq;
  int64_t seq_stride;
  const int32_t* pos;
  int64_t pos_stride;
  const int32_t* bt;
  int64_t bt_stride, nseq, nb, bs;
};
Tokens tokens_of(const ops::PagedTokens& tok) {
  return Tokens{tok.seq.data_as<const int32_t>(),   tok.seq.stride(0),        tok.pos.data_as<const int32_t>(),
                tok.pos.stride(0),                  tok.block_table.data_as<const int32_t>(),
                tok.block_table.stride(0),          tok.block_table.shape(0), tok.block_table.shape(1),
                tok.block_size};
}
// Block-table row of token t, or nullptr when its sequence index is outside the table.
__device__ __forceinline__ const int32_t* bt_row(const Tokens& k, int64_t t) {
  const int64_t s = k.seq[t * k.seq_stride];
  return (s >= 0 && s < k.nseq) ? k.bt + s * k.bt_stride : nullptr;
}
__device__ __forceinline__ int64_t slot_of(const Tokens& k, const int32_t* row, int64_t rows, int64_t p) {
  return row ? attn::paged_slot(row, k.nb, k.bs, rows, p) : -1;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// One online-softmax update of a row over a chunk of 32 keys, lane = key: returns the
// lane's unnormalized weight and updates the running max m (fp32), the running sum l
// (double) and the rescale factor for the accumulator. Invalid lanes contribute 0.
__device__ __forceinline__ float softmax_update(float s, bool valid, float& m, double& l, float& alpha) {
  const float cmax = warp_max(valid ? s : -INFINITY);
  const float m_new = fmaxf(m, cmax);
  alpha = (m_new == -INFINITY) ? 1.0f : expf(__fsub_rn(m, m_new));  // m = -inf, m_new finite: 0
  const float p = (valid && m_new != -INFINITY) ? expf(__fsub_rn(s, m_new)) : 0.0f;
  // never contracted into an FMA: the same rounding in every instantiation (mla_kernel's
  // 4- and 16-head groups must agree bitwise, see mla_fold_scalars)
  l = __dadd_rn(__dmul_rn(l, double(alpha)), warp_sum(double(p)));
  m = m_new;
  return p;
}

// ================================================================== indexer_topk
constexpr int kIdxWarps = 4;
constexpr int kIdxThreads = kIdxWarps * 32;
constexpr int kIdxKW = 8;  // keys per warp step
constexpr int kIdxGroups = 8;  // warp steps per block, at most (fewer where the grid would leave SMs idle)
constexpr int kIdxGatherILP = 8;  // loads in flight per lane while a step's keys are staged
constexpr int64_t kIdxFillBlocks = 2 * 132;  // the blocks that keep an H100 / H200 busy twice over
// Units of `unit` keys per block (both score kernels) for nt tokens over `cap` keys: max_units,
// halved while the grid has fewer than kIdxFillBlocks blocks (a decode token over 4096 keys on
// the SIMT kernel: 128 blocks of 32 keys instead of 16 of 256). A key's score does not depend
// on its block, so neither do the results.
inline int idx_units_per_block(int64_t cap, int64_t nt, int64_t unit, int max_units) {
  int g = max_units;
  while (g > 1 && (cap + unit * g - 1) / (unit * g) * nt < kIdxFillBlocks) g /= 2;
  return g;
}
// idx_block_order: both score kernels run a 1-D grid of (key tile, token) blocks with the token
// fastest (block b: token b % nt, key tile b / nt), so the blocks resident together read the same
// key tiles for every token of the chunk: a sequence's verify tokens (adjacent rows) take each
// of its key rows from DRAM once and from L2 after that, where a grid of (key tiles, tokens)
// walked one token's whole context before the next token's (at 128K contexts, 32 MB of BF16
// index keys per layer and sequence: more than L2 holds, so read again by each of the block's
// 8 tokens). A key's score does not depend on its block, so neither do the results.
constexpr int kSelThreads = 1024;
constexpr int kSelILP = 8;  // scores per thread in flight (histogram passes) and per tile (emit)
static_assert(kSelILP * kSelThreads < 65536, "the emit scan packs a tile's counts in 16 bits");
constexpr size_t kIdxScratchCap = size_t(512) << 20;

struct IdxShape {
  int nI, dI, qstride, kstride;  // q rows padded to an odd stride, key rows to a multiple of 4
};
inline IdxShape idx_shape(int64_t nI, int64_t dI) {
  IdxShape s;
  s.nI = int(nI);
  s.dI = int(dI);
  s.qstride = int(dI % 2 == 0 ? dI + 1 : dI);
  s.kstride = int((dI + 3) / 4 * 4);
  return s;
}
inline size_t idx_smem(const IdxShape& s) {
  return sizeof(float) * (size_t(s.nI) * s.qstride + s.nI + size_t(kIdxWarps) * kIdxKW * s.kstride +
                          size_t(kIdxWarps) * kIdxKW * 32);
}

// ---- FP8 cache rows (ops/kv_fp8.h: D E4M3 codes, then one power-of-two float scale per
// group of kvfp8::group(D) values). A unit is 16 codes with their group's scale; its values
// code * scale are exact in F32 and in BF16, so every kernel over an FP8 cache computes what
// it computes over an F32 / BF16 cache holding the dequantized values.
struct Fp8Unit {
  uint4 c;
  float s;
};
// Unit u (values 16u .. 16u + 15) of an FP8 row of D quantized values (16-byte aligned).
__device__ __forceinline__ Fp8Unit fp8_load(const uint8_t* __restrict__ row, int D, int u) {
  Fp8Unit v;
  v.c = *reinterpret_cast<const uint4*>(row + 16 * u);
  v.s = *reinterpret_cast<const float*>(row + D + 4 * (16 * u / int(kvfp8::group(D))));
  return v;
}
__device__ __forceinline__ void fp8_widen16(const Fp8Unit& v, float (&f)[16]) {
  const uint32_t w[4] = {v.c.x, v.c.y, v.c.z, v.c.w};
#pragma unroll
  for (int q = 0; q < 4; ++q)
#pragma unroll
    for (int b = 0; b < 4; ++b) f[4 * q + b] = __fmul_rn(detail::e4m3_value(uint8_t(w[q] >> (8 * b))), v.s);
}
// The unit's 16 values as BF16 (exact) at dst (16-byte aligned): two 16-byte stores.
__device__ __forceinline__ void fp8_store_bf16x16(const Fp8Unit& v, __nv_bfloat16* dst) {
  float f[16];
  fp8_widen16(v, f);
  uint32_t p[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    p[i] = *reinterpret_cast<const uint32_t*>(&h);
  }
  reinterpret_cast<uint4*>(dst)[0] = make_uint4(p[0], p[1], p[2], p[3]);
  reinterpret_cast<uint4*>(dst)[1] = make_uint4(p[4], p[5], p[6], p[7]);
}

// A warp step's kIdxKW key rows (lane k holds key k's slot in my_slot; -1: a zero row) into
// ks (rows of kstride floats), W values per load: 16 bytes (W = 4 F32 values, or W = 8 BF16
// values widened exactly) where the rows are aligned, else one value (W = 1, F32 or BF16); W =
// 16: an FP8 cache's unit of 16 codes and its group's scale (E = uint8_t, rows of stride bytes,
// dI a multiple of 16), dequantized exactly. kIdxGatherILP loads in flight per lane before the
// first store (half as many FP8 units: a GLM-5.3 step's 8 keys of 128 are 2 units per lane).
template <int W, class E>
__device__ __forceinline__ void idx_stage_rows(const E* __restrict__ src, int64_t stride, int64_t my_slot,
                                               float* ks, int kstride, int dI, int lane) {
  using V = std::conditional_t<W == 1, float,
                               std::conditional_t<W == 4, float4, std::conditional_t<W == 8, uint4, Fp8Unit>>>;
  constexpr int kV = W == 16 ? kIdxGatherILP / 2 : kIdxGatherILP;
  const int dv = dI / W;
  for (int base = 0; base < kIdxKW * dv; base += 32 * kV) {  // warp-uniform trip count
    V v[kV];
    int at[kV];
#pragma unroll
    for (int u = 0; u < kV; ++u) {
      const int idx = base + 32 * u + lane;
      const int k = idx < kIdxKW * dv ? idx / dv : 0;
      const int64_t slot = __shfl_sync(0xffffffffu, my_slot, k);  // every lane takes part
      at[u] = -1;
      v[u] = V{};
      if (idx < kIdxKW * dv) {
        const int e = W * (idx - k * dv);
        at[u] = k * kstride + e;
        if (slot >= 0) {
          if constexpr (W == 1)
            v[u] = detail::to_f32(src[slot * stride + e]);
          else if constexpr (W == 16)
            v[u] = fp8_load(src + slot * stride, dI, e / 16);
          else
            v[u] = *reinterpret_cast<const V*>(src + slot * stride + e);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kV; ++u) {
      if (at[u] < 0) continue;
      if constexpr (W == 1) {
        ks[at[u]] = v[u];
      } else if constexpr (W == 4) {
        *reinterpret_cast<float4*>(ks + at[u]) = v[u];
      } else if constexpr (W == 16) {
        float f[16];
        fp8_widen16(v[u], f);
#pragma unroll
        for (int q = 0; q < 16; q += 4)
          *reinterpret_cast<float4*>(ks + at[u] + q) = make_float4(f[q], f[q + 1], f[q + 2], f[q + 3]);
      } else {
        float f[8];
        detail::widen_bf16x8(v[u], f);
        *reinterpret_cast<float4*>(ks + at[u]) = make_float4(f[0], f[1], f[2], f[3]);
        *reinterpret_cast<float4*>(ks + at[u] + 4) = make_float4(f[4], f[5], f[6], f[7]);
      }
    }
  }
}

__global__ void __launch_bounds__(kIdxThreads)
    indexer_score_kernel(const float* __restrict__ q, int64_t q_s0, int64_t q_s1, const float* __restrict__ w,
                         int64_t w_s0, const float* __restrict__ kc, const __nv_bfloat16* __restrict__ kc16,
                         const uint8_t* __restrict__ kc8, int64_t kc_stride, int64_t kc_rows, Tokens tk,
                         int64_t t0, int64_t topk, IdxShape sh, float sscale, float wscale, float* __restrict__ scores,
                         int64_t sc_stride, int64_t cap, int groups, int64_t nt) {
  detail::pdl_enter();
  extern __shared__ __align__(16) float smem[];
  const int64_t r = int64_t(blockIdx.x) % nt;  // see idx_block_order
  const int64_t t = t0 + r;
  const int64_t n = attn::causal_keys(tk.pos[t * tk.pos_stride], cap);
  const int64_t key0 = int64_t(blockIdx.x) / nt * kIdxWarps * kIdxKW * groups;
  if (n <= topk || key0 >= n) return;  // uniform over the block
  const int nI = sh.nI, dI = sh.dI;
  const bool vec4 = kc && (dI & 3) == 0 && (kc_stride & 3) == 0 && (reinterpret_cast<uintptr_t>(kc) & 15) == 0;
  const bool vec8 = kc16 && (dI & 7) == 0 && (kc_stride & 7) == 0 && (reinterpret_cast<uintptr_t>(kc16) & 15) == 0;
  float* ks_all = smem;                                              // [warps][KW][kstride], 16-byte rows
  float* cs_all = ks_all + size_t(kIdxWarps) * kIdxKW * sh.kstride;  // [warps][KW][32]
  float* qs = cs_all + kIdxWarps * kIdxKW * 32;                      // [nI][qstride]
  float* ws = qs + size_t(nI) * sh.qstride;                          // [nI]
  const float* qt = q + t * q_s0;
  // q[t] with kIdxGatherILP loads in flight per thread before the first store (the same values)
  for (int base = threadIdx.x; base < nI * dI; base += kIdxGatherILP * kIdxThreads) {
    float v[kIdxGatherILP];
#pragma unroll
    for (int u = 0; u < kIdxGatherILP; ++u) {
      const int i = base + u * kIdxThreads;
      if (i < nI * dI) {
        const int h = i / dI, e = i - h * dI;
        v[u] = qt[h * q_s1 + e];
      }
    }
#pragma unroll
    for (int u = 0; u < kIdxGatherILP; ++u) {
      const int i = base + u * kIdxThreads;
      if (i < nI * dI) {
        const int h = i / dI, e = i - h * dI;
        qs[h * sh.qstride + e] = v[u];
      }
    }
  }
  for (int h = threadIdx.x; h < nI; h += kIdxThreads) ws[h] = __fmul_rn(w[t * w_s0 + h], wscale);
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* ks = ks_all + size_t(warp) * kIdxKW * sh.kstride;
  float* cs = cs_all + warp * kIdxKW * 32;
  const int32_t* row = bt_row(tk, t);
  float* sc = scores + r * sc_stride;
  const int d4 = dI / 4 * 4;
  for (int g = 0; g < groups; ++g) {
    const int64_t j0 = key0 + (int64_t(g) * kIdxWarps + warp) * kIdxKW;
    if (j0 >= n) break;  // uniform over the warp
    // the step's KW key rows: every slot looked up at once (lane k: key j0 + k), then
    // kIdxGatherILP loads in flight per lane before the first store (one row at a time cost
    // two dependent global-memory latencies a row: a decode token's scoring over 4096 keys
    // took 111 us on an H200, 2026-12-04). The same values land in ks.
    const int64_t my_slot = lane < kIdxKW && j0 + lane < n ? slot_of(tk, row, kc_rows, j0 + lane) : -1;
    // 16-byte rows: 4 F32 or 8 BF16 values per load (a GLM-5.3 step's 8 keys of 128: 8 or 4
    // loads per lane, all in flight); otherwise one value per load. The same values land in ks.
    if (kc8)
      idx_stage_rows<16>(kc8, kc_stride, my_slot, ks, sh.kstride, dI, lane);
    else if (vec4)
      idx_stage_rows<4>(kc, kc_stride, my_slot, ks, sh.kstride, dI, lane);
    else if (vec8)
      idx_stage_rows<8>(kc16, kc_stride, my_slot, ks, sh.kstride, dI, lane);
    else if (kc16)
      idx_stage_rows<1>(kc16, kc_stride, my_slot, ks, sh.kstride, dI, lane);
    else
      idx_stage_rows<1>(kc, kc_stride, my_slot, ks, sh.kstride, dI, lane);
    __syncwarp();
    float acc = 0.0f;  // lanes 0..KW-1: key lane's score, summed in head order
    for (int hc = 0; hc < nI; hc += 32) {
      const int h = hc + lane;
      const bool active = h < nI;
      const float* qh = qs + (active ? h : 0) * sh.qstride;
      float s[kIdxKW][4];
#pragma unroll
      for (int k = 0; k < kIdxKW; ++k) s[k][0] = s[k][1] = s[k][2] = s[k][3] = 0.0f;
      for (int e = 0; e < d4; e += 4) {
        const float q0 = qh[e], q1 = qh[e + 1], q2 = qh[e + 2], q3 = qh[e + 3];
#pragma unroll
        for (int k = 0; k < kIdxKW; ++k) {
          const float4 kv = *reinterpret_cast<const float4*>(ks + k * sh.kstride + e);
          s[k][0] = __fadd_rn(s[k][0], __fmul_rn(q0, kv.x));
          s[k][1] = __fadd_rn(s[k][1], __fmul_rn(q1, kv.y));
          s[k][2] = __fadd_rn(s[k][2], __fmul_rn(q2, kv.z));
          s[k][3] = __fadd_rn(s[k][3], __fmul_rn(q3, kv.w));
        }
      }
      for (int e = d4; e < dI; ++e) {
        const float qe = qh[e];
#pragma unroll
        for (int k = 0; k < kIdxKW; ++k) s[k][0] = __fadd_rn(s[k][0], __fmul_rn(qe, ks[k * sh.kstride + e]));
      }
      const float wh = active ? ws[h] : 0.0f;
#pragma unroll
      for (int k = 0; k < kIdxKW; ++k) {
        const float dot = __fadd_rn(__fadd_rn(s[k][0], s[k][1]), __fadd_rn(s[k][2], s[k][3]));
        const float d = __fmul_rn(dot, sscale);
        cs[k * 32 + lane] = __fmul_rn(wh, d > 0.0f ? d : 0.0f);
      }
      __syncwarp();
      if (lane < kIdxKW) {
        const int nh = nI - hc < 32 ? nI - hc : 32;
        for (int i = 0; i < nh; ++i) acc = __fadd_rn(acc, cs[lane * 32 + i]);
      }
      __syncwarp();
    }
    if (lane < kIdxKW && j0 + lane < n) sc[j0 + lane] = acc;
    __syncwarp();  // ks is rewritten by the next step
  }
}

// The three BF16 planes of x (their sum is x for finite x in the normal range).
__device__ __forceinline__ void bf16_planes(float x, __nv_bfloat16& hi, __nv_bfloat16& mid, __nv_bfloat16& lo) {
  hi = __float2bfloat16_rn(x);
  const float r = __fsub_rn(x, __bfloat162float(hi));
  mid = __float2bfloat16_rn(r);
  lo = __float2bfloat16_rn(__fsub_rn(r, __bfloat162float(mid)));
}
// x's three planes at row h, column e of planes of R rows each (plane p's row h at (p R + h) LD):
// the query planes of both tensor-core kernels (mla_tc_kernel, indexer_tc_kernel) and MLA's
// softmax weights.
__device__ __forceinline__ void store_bf16_planes(__nv_bfloat16* qp, int R, int LD, int h, int e, float x) {
  __nv_bfloat16 hi, mid, lo;
  bf16_planes(x, hi, mid, lo);
  qp[h * LD + e] = hi;
  qp[(R + h) * LD + e] = mid;
  qp[(2 * R + h) * LD + e] = lo;
}
// The B fragments of the warp's 8 key rows (ks rows 8 warp .. + 7, LD bf16 each) for k-steps kk
// (bk[0], bk[1]) and kk + 1 (bk[2], bk[3]).
__device__ __forceinline__ void key_frags(const __nv_bfloat16* ks, int LD, int warp, int lane, int kk,
                                          uint32_t (&bk)[4]) {
  mma::ldmatrix_x4(mma::smem_u32(ks + (warp * 8 + (lane & 7)) * LD + kk * 16 + (lane >> 3) * 8), bk);
}
// acc += Q K^T over k-steps kk and kk + 1 for query rows r0 .. r0 + 15 of the three planes (R rows
// each), plane by plane: the same MMAs in the same order in both tensor-core kernels.
__device__ __forceinline__ void mma_planes(const __nv_bfloat16* qp, int R, int r0, int LD, int lane, int kk,
                                           const uint32_t (&bk)[4], float (&acc)[4]) {
#pragma unroll
  for (int pl = 0; pl < 3; ++pl) {
    const __nv_bfloat16* qb = qp + (pl * R + r0 + (lane & 15)) * LD + (lane >> 4) * 8 + kk * 16;
    uint32_t a0[4], a1[4];
    mma::ldmatrix_x4(mma::smem_u32(qb), a0);
    mma::ldmatrix_x4(mma::smem_u32(qb + 16), a1);
    mma::mma_bf16(acc, a0, bk[0], bk[1]);
    mma::mma_bf16(acc, a1, bk[2], bk[3]);
  }
}

// ------------------------------------------------------------------ indexer scores, tensor cores
// indexer_tc_kernel: the scores of a BF16 index-key cache (ops::indexer_tc()) with mma.sync
// m16n8k16. Grid (key tiles of 64 x tiles, tokens), 8 warps. A block puts q[t] (nI heads,
// padded with zero rows to MT m-tiles of 16, zero columns to DP) into shared memory as three
// BF16 planes whose sum is q (every product with an exact BF16 key is exact; the MMAs' fp32
// sums are the only rounding of the dot), then per tile of 64 keys: the key rows by cp.async
// (a key without a slot, or past the token's causal keys, a zero row), warp w the dots of
// keys 8w..8w+7 with every head (MT x 3 planes MMAs per k-step), and per (key, head) the
// SIMT kernel's terms, (dot * 1 / sqrt(dI)), relu, * (w * 1 / sqrt(nI)), into shared memory;
// a thread per key adds its heads' terms in head order. A key's score depends only on its
// row and the token's q and w (never on the tile, block or batch): decode == verify.
constexpr int kItThreads = 256, kItWarps = kItThreads / 32;
constexpr int kItKeys = 8 * kItWarps;  // keys per tile: one n-tile of 8 per warp
constexpr int kItMaxMT = 4;            // m-tiles of 16 heads: nI <= 64
constexpr int kItMaxTiles = 4;         // tiles per block, at most (fewer where the grid would leave SMs idle)
struct ItShape {
  int nI, dI, MT, DP, LD, CLD;  // DP: dI rounded up to 32; LD = DP + 8 (bf16 rows); CLD = nI + 1 (float rows)
};
inline bool indexer_tc_fits(int64_t nI, int64_t dI) { return nI >= 1 && nI <= 16 * kItMaxMT && dI % 8 == 0 && dI >= 8 && dI <= 256; }
inline ItShape it_shape(int64_t nI, int64_t dI) {
  ItShape s;
  s.nI = int(nI);
  s.dI = int(dI);
  s.MT = int((nI + 15) / 16);
  s.DP = int((dI + 31) / 32 * 32);
  s.LD = s.DP + 8;
  s.CLD = s.nI + 1;
  return s;
}
inline size_t it_smem(const ItShape& s) {
  return sizeof(float) * (size_t(16) * kItMaxMT + size_t(kItKeys) * s.CLD) +
         sizeof(__nv_bfloat16) * (size_t(kItKeys) * s.LD + 3 * size_t(16) * s.MT * s.LD);
}

__global__ void __launch_bounds__(kItThreads)
    indexer_tc_kernel(const float* __restrict__ q, int64_t q_s0, int64_t q_s1, const float* __restrict__ w,
                      int64_t w_s0, const __nv_bfloat16* __restrict__ kc, const uint8_t* __restrict__ kc8,
                      int64_t kc_stride, int64_t kc_rows,
                      Tokens tk, int64_t t0, int64_t topk, ItShape sh, float sscale, float wscale,
                      float* __restrict__ scores, int64_t sc_stride, int64_t cap, int tiles, int64_t nt) {
  detail::pdl_enter();
  const int64_t r = int64_t(blockIdx.x) % nt;  // see idx_block_order
  const int64_t t = t0 + r;
  const int64_t n = attn::causal_keys(tk.pos[t * tk.pos_stride], cap);
  const int64_t key0 = int64_t(blockIdx.x) / nt * kItKeys * tiles;
  if (n <= topk || key0 >= n) return;  // uniform over the block
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* ws = reinterpret_cast<float*>(smem_raw);        // [64] w * (1 / sqrt(nI))
  float* cs = ws + 16 * kItMaxMT;                        // [64 keys][CLD] head terms
  __nv_bfloat16* ks = reinterpret_cast<__nv_bfloat16*>(cs + kItKeys * sh.CLD);  // [64 keys][LD]
  __nv_bfloat16* qp = ks + kItKeys * sh.LD;              // [3 planes][MT * 16][LD]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  const int nI = sh.nI, dI = sh.dI, MT = sh.MT, DP = sh.DP, LD = sh.LD, CLD = sh.CLD, R = 16 * MT;
  const int32_t* row = bt_row(tk, t);
  float* sc = scores + r * sc_stride;
  // q[t] as three planes (heads past nI and columns past dI: zeros); the key tile's padding
  // columns [dI, DP) zero once (cp.async writes [0, dI) only)
  for (int i = tid; i < R * DP; i += kItThreads) {
    const int h = i / DP, e = i - h * DP;
    store_bf16_planes(qp, R, LD, h, e, h < nI && e < dI ? q[t * q_s0 + h * q_s1 + e] : 0.0f);
  }
  for (int i = tid; i < kItKeys * (DP - dI); i += kItThreads) {
    const int j = i / (DP - dI);
    ks[j * LD + dI + (i - j * (DP - dI))] = __float2bfloat16_rn(0.0f);
  }
  for (int h = tid; h < nI; h += kItThreads) ws[h] = __fmul_rn(w[t * w_s0 + h], wscale);
  const int C8 = dI / 8;
  for (int tile = 0; tile < tiles; ++tile) {
    const int64_t j0 = key0 + int64_t(tile) * kItKeys;
    if (j0 >= n) break;  // uniform
    // the tile's key rows: 4 threads per key (one slot lookup each), 16 bytes per cp.async; an
    // FP8 cache's rows 16 codes per load, dequantized into exact BF16 values (a zero row without
    // a slot)
    {
      const int jj = tid >> 2;
      const int64_t j = j0 + jj;
      const int64_t slot = j < n ? slot_of(tk, row, kc_rows, j) : -1;
      if (kc8) {
        const int du = dI / 16;
        Fp8Unit v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // dI <= 256: at most 4 units per thread
          v[i].c = make_uint4(0u, 0u, 0u, 0u);
          v[i].s = 0.0f;
          const int un = (tid & 3) + 4 * i;
          if (un < du && slot >= 0) v[i] = fp8_load(kc8 + slot * kc_stride, dI, un);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int un = (tid & 3) + 4 * i;
          if (un < du) fp8_store_bf16x16(v[i], ks + jj * LD + 16 * un);
        }
      } else {
        for (int e8 = tid & 3; e8 < C8; e8 += 4)
          mma::cp_async16(mma::smem_u32(ks + jj * LD + 8 * e8), slot >= 0 ? kc + slot * kc_stride + 8 * e8 : kc,
                          slot >= 0);
      }
    }
    mma::cp_async_commit();
    mma::cp_async_wait_all();
    __syncthreads();  // the tile (and, the first time, the planes, ws and padding) visible
    // S = Q K^T for the warp's keys 8 warp .. + 7: rows g, g + 8 of each m-tile (heads)
    float acc[kItMaxMT][4];
#pragma unroll
    for (int m = 0; m < kItMaxMT; ++m) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = 0.0f;
    for (int kk = 0; kk < DP / 16; kk += 2) {
      uint32_t bk[4];
      key_frags(ks, LD, warp, lane, kk, bk);
#pragma unroll
      for (int m = 0; m < kItMaxMT; ++m) {
        if (m >= MT) break;
        mma_planes(qp, R, m * 16, LD, lane, kk, bk, acc[m]);
      }
    }
    // the SIMT kernel's head terms: wh * relu(dot * sscale)
#pragma unroll
    for (int m = 0; m < kItMaxMT; ++m) {
      if (m >= MT) break;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int h = m * 16 + g + 8 * (c >> 1), key = warp * 8 + 2 * t4 + (c & 1);
        if (h < nI) {
          const float d = __fmul_rn(acc[m][c], sscale);
          cs[key * CLD + h] = __fmul_rn(ws[h], d > 0.0f ? d : 0.0f);
        }
      }
    }
    __syncthreads();  // every head term written; ks free for the next tile
    if (tid < kItKeys && j0 + tid < n) {
      float s = 0.0f;
      for (int h = 0; h < nI; ++h) s = __fadd_rn(s, cs[tid * CLD + h]);
      sc[j0 + tid] = s;
    }
    // cs is rewritten after the next tile's barrier, which these reads precede
  }
}

// Block-wide exclusive scan of one uint32 per thread (blockDim.x a multiple of 32);
// returns the exclusive prefix and sets *total. `wsum` holds 32 values. Ends with a
// barrier-free read of wsum: callers separate consecutive scans with __syncthreads.
__device__ __forceinline__ uint32_t block_exclusive_scan(uint32_t v, uint32_t* wsum, uint32_t* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  uint32_t inc = v;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const uint32_t o = __shfl_up_sync(0xffffffffu, inc, off);
    if (lane >= off) inc += o;
  }
  if (lane == 31) wsum[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    uint32_t x = lane < nw ? wsum[lane] : 0u;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const uint32_t o = __shfl_up_sync(0xffffffffu, x, off);
      if (lane >= off) x += o;
    }
    if (lane < nw) wsum[lane] = x;  // inclusive prefix over warps
  }
  __syncthreads();
  *total = wsum[nw - 1];
  return inc - v + (warp > 0 ? wsum[warp - 1] : 0u);
}

__global__ void __launch_bounds__(kSelThreads)
    indexer_select_kernel(const float* __restrict__ scores, int64_t cap, Tokens tk, int64_t t0, int64_t nt,
                          int64_t topk, int32_t* __restrict__ sel, int64_t sel_stride, int32_t* __restrict__ sel_len,
                          int64_t len_stride) {
  detail::pdl_enter();
  __shared__ uint32_t hist[attn::kRadixBins];
  __shared__ uint32_t wsum[32];
  __shared__ attn::RadixSelect st_sh;
  for (int64_t tl = blockIdx.x; tl < nt; tl += gridDim.x) {
    const int64_t t = t0 + tl;
    const int64_t n = attn::causal_keys(tk.pos[t * tk.pos_stride], cap);
    if (n <= topk) {
      if (threadIdx.x == 0) sel_len[t * len_stride] = -1;
      continue;  // uniform over the block
    }
    const float* sc = scores + tl * cap;
    attn::RadixSelect st = attn::radix_begin(uint32_t(topk));
    for (int pass = 0; pass < attn::kRadixPasses; ++pass) {
      for (int i = threadIdx.x; i < attn::kRadixBins; i += blockDim.x) hist[i] = 0u;
      __syncthreads();
      // kSelILP scores in flight per thread before the first is counted (one at a time, a
      // pass over a long context was a chain of dependent loads per thread: 128 at 128K keys)
      for (int64_t base = 0; base < n; base += int64_t(kSelILP) * blockDim.x) {
        float v[kSelILP];
#pragma unroll
        for (int u = 0; u < kSelILP; ++u) {
          const int64_t j = base + int64_t(u) * blockDim.x + threadIdx.x;
          v[u] = j < n ? sc[j] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < kSelILP; ++u) {
          const uint32_t key = attn::order_key(v[u]);
          if (base + int64_t(u) * blockDim.x + threadIdx.x < n && attn::radix_in_class(st, key))
            atomicAdd(&hist[attn::radix_digit(key, pass)], 1u);
        }
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        attn::radix_step(st, hist, pass);
        st_sh = st;
      }
      __syncthreads();
      st = st_sh;
      if (st.done) break;  // uniform
    }
    int32_t* out = sel + t * sel_stride;
    uint32_t above_tot = 0, class_tot = 0;
    // tiles of kSelILP positions per thread (thread i: the tile's positions kSelILP i .. + kSelILP
    // - 1, so the threads' runs are in position order): each thread's packed flag sum, one
    // block scan, then its positions in order; the counts before each position, so the slots,
    // are those of a scan over single positions (a tile's totals stay below 65536)
    const int64_t tile = int64_t(kSelILP) * blockDim.x;
    for (int64_t base = 0; base < n; base += tile) {
      const int64_t j0 = base + int64_t(kSelILP) * threadIdx.x;
      uint32_t keys[kSelILP], fsum = 0;
#pragma unroll
      for (int u = 0; u < kSelILP; ++u) keys[u] = j0 + u < n ? attn::order_key(sc[j0 + u]) : 0u;
#pragma unroll
      for (int u = 0; u < kSelILP; ++u) fsum += j0 + u < n ? attn::emit_flags(st, keys[u]) : 0u;
      uint32_t tile_total;
      const uint32_t ex = block_exclusive_scan(fsum, wsum, &tile_total);
      uint32_t above_before = above_tot + (ex & 0xffffu), class_before = class_tot + (ex >> 16);
#pragma unroll
      for (int u = 0; u < kSelILP; ++u) {
        if (j0 + u >= n) break;
        if (attn::radix_selected(st, keys[u], class_before))
          out[attn::emit_slot(st, above_before, class_before)] = int32_t(j0 + u);
        const uint32_t f = attn::emit_flags(st, keys[u]);
        above_before += f & 0xffffu;
        class_before += f >> 16;
      }
      above_tot += tile_total & 0xffffu;
      class_tot += tile_total >> 16;
      __syncthreads();  // wsum is reused by the next tile's scan
      if (above_tot + (class_tot < st.k_left ? class_tot : st.k_left) >= uint32_t(topk)) break;  // uniform
    }
    if (threadIdx.x == 0) sel_len[t * len_stride] = int32_t(topk);
  }
}

// ================================================================== mla_attention
constexpr int kMlaThreads = 256;
constexpr int kMlaWarps = kMlaThreads / 32;
constexpr int kMlaKC = 32;  // keys per chunk (= lanes)
constexpr int kMlaSeg = 64;  // keys per segment: the unit of the softmax fold and of split-KV
constexpr int kMlaGatherILP = 8;  // loads in flight per thread while a chunk is staged

struct MlaShape {
  int kvl, rope, D, kstride;  // D = kvl + rope, key rows at an odd stride
};
inline size_t mla_smem(int HG, const MlaShape& s) {
  return sizeof(float) * (size_t(HG) * s.D + size_t(kMlaKC) * s.kstride + size_t(HG) * kMlaKC + 5 * HG) +
         sizeof(double) * 2 * HG + sizeof(int64_t) * kMlaKC;
}

// Split-KV partial state of one (token, head, segment): written by mla_kernel with split = 1,
// folded by mla_combine_kernel. part_m / part_l: [T][nh][nseg]; part_acc: [T][nh][nseg][kvl].
struct MlaSplit {
  float* acc = nullptr;
  float* m = nullptr;
  double* l = nullptr;  // -1: the segment holds none of the token's keys
  int nseg = 0;         // segments per token in the grid (gridDim.z)
};

// The fold of one segment's softmax state (m_s, l_s, acc_s) into the running (M, L, tot),
// segment by segment in key order: mla_kernel (split = 0) and mla_combine_kernel (split-KV)
// run this same sequence of correctly rounded operations, so both give bitwise the same
// output and the split decision (a launch-shape choice made from T) never changes a row.
__device__ __forceinline__ void mla_fold_scalars(float& M, double& L, float m_s, double l_s, float& a, float& b) {
  const float Mn = M > m_s ? M : m_s;
  a = M == -INFINITY ? 0.0f : expf(__fsub_rn(M, Mn));
  b = m_s == -INFINITY ? 0.0f : expf(__fsub_rn(m_s, Mn));
  L = __dadd_rn(__dmul_rn(L, double(a)), __dmul_rn(l_s, double(b)));
  M = Mn;
}
__device__ __forceinline__ float mla_fold_value(float tot, float a, float acc, float b) {
  return __fadd_rn(__fmul_rn(tot, a), __fmul_rn(acc, b));
}
// Head h's fold in shared memory: the segment's (ms, ls) into the running (mt, lt), the
// factors left in (fa, fb) for mla_fold_value over the head's values. Both MLA kernels.
__device__ __forceinline__ void mla_fold_head(int h, float* mt, double* lt, const float* ms, const double* ls,
                                              float* fa, float* fb) {
  float M = mt[h], a, b;
  double L = lt[h];
  mla_fold_scalars(M, L, ms[h], ls[h], a, b);
  mt[h] = M;
  lt[h] = L;
  fa[h] = a;
  fb[h] = b;
}
// One output value of a split-KV row: the row's nseg segment states (l, m at base + z; acc
// at (base + z) * width + d; l < 0: no such segment) folded in order, as the unsplit kernels
// fold them; tot and L for the caller's finish. Shared by mla_combine_kernel and
// block_attention_combine.
__device__ __forceinline__ void fold_segments(const double* __restrict__ l, const float* __restrict__ m,
                                              const float* __restrict__ acc, int64_t base, int64_t nseg,
                                              int64_t width, int64_t d, float& tot, double& L) {
  float M = -INFINITY;
  tot = 0.0f;
  L = 0.0;
  for (int64_t z = 0; z < nseg; ++z) {
    const double l_s = l[base + z];
    if (l_s < 0.0) continue;
    float a, b;
    mla_fold_scalars(M, L, m[base + z], l_s, a, b);
    tot = mla_fold_value(tot, a, acc[(base + z) * width + d], b);
  }
}
__device__ __forceinline__ float mla_finish(float tot, double L) {
  return L > 0.0 ? __fmul_rn(tot, float(1.0 / L)) : 0.0f;
}

// Token t's keys for MLA: its position, block-table row, key count (sel_len[t] >= 0: that many
// of sel's columns, at most sel_cols; else every causal key) and selection (null: 0..nk-1),
// and the kMlaSeg-key segments this block walks ([seg0, seg1): all, or segment blockIdx.z
// with split-KV). Shared by mla_kernel and mla_tc_kernel.
struct MlaKeys {
  int64_t pos, nk, seg0, seg1;
  const int32_t* row;
  const int32_t* sl;
};
__device__ __forceinline__ MlaKeys mla_keys(const Tokens& tk, int64_t t, int64_t cap, const int32_t* sel,
                                            int64_t sel_stride, int64_t sel_cols, const int32_t* sel_len,
                                            int64_t len_stride, bool split) {
  MlaKeys k;
  k.pos = tk.pos[t * tk.pos_stride];
  k.row = bt_row(tk, t);
  k.nk = attn::causal_keys(k.pos, cap);
  k.sl = nullptr;
  if (sel_len) {
    const int64_t cnt = sel_len[t * len_stride];
    if (cnt >= 0) {
      k.nk = cnt < sel_cols ? cnt : sel_cols;
      k.sl = sel + t * sel_stride;
    }
  }
  const int64_t nseg = (k.nk + kMlaSeg - 1) / kMlaSeg;
  k.seg0 = 0;
  k.seg1 = nseg;
  if (split) {
    k.seg0 = blockIdx.z;
    k.seg1 = k.seg0 < nseg ? k.seg0 + 1 : k.seg0;
  }
  return k;
}

// mla_kernel's chunk of kMlaKC rows of an FP8 latent cache (ops/kv_fp8.h) into ks, dequantized
// exactly: per row kvl / 16 units of codes, then the rope's BF16 values 8 per 16-byte load; two
// units in flight per thread. Every thread of the block calls it (slots: the chunk's rows).
__device__ __forceinline__ void mla_stage_fp8(const uint8_t* __restrict__ cache8, int64_t c_stride,
                                           const int64_t* slots, float* ks, int kstride, int kvl, int D) {
  constexpr int kV = 2;
  const int UQ = kvl / 16, U = UQ + (D - kvl + 7) / 8;
  const int64_t qb = kvfp8::fp8_bytes(kvl);
  for (int base = threadIdx.x; base < kMlaKC * U; base += kV * kMlaThreads) {
    Fp8Unit v[kV];
    int at[kV], nv[kV];
#pragma unroll
    for (int u = 0; u < kV; ++u) {
      const int idx = base + u * kMlaThreads;
      at[u] = -1;
      nv[u] = 0;
      v[u].c = make_uint4(0u, 0u, 0u, 0u);
      v[u].s = 0.0f;
      if (idx < kMlaKC * U) {
        const int r = idx / U, un = idx - r * U;
        const int64_t slot = slots[r];
        const uint8_t* rp = cache8 + slot * c_stride;
        if (un < UQ) {
          at[u] = r * kstride + 16 * un;
          nv[u] = 16;
          if (slot >= 0) v[u] = fp8_load(rp, kvl, un);
        } else {
          const int e = kvl + 8 * (un - UQ);
          at[u] = r * kstride + e;
          nv[u] = D - e < 8 ? -(D - e) : -8;  // negative: that many BF16 values
          if (slot >= 0) v[u].c = *reinterpret_cast<const uint4*>(rp + qb + 16 * (un - UQ));
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kV; ++u) {
      if (at[u] < 0) continue;
      if (nv[u] > 0) {
        float f[16];
        fp8_widen16(v[u], f);
#pragma unroll
        for (int q = 0; q < 16; ++q) ks[at[u] + q] = f[q];
      } else {
        float f[8];
        detail::widen_bf16x8(v[u].c, f);
#pragma unroll
        for (int q = 0; q < 8; ++q)
          if (q < -nv[u]) ks[at[u] + q] = f[q];
      }
    }
  }
}

// split = 0: each block walks all of its token's keys, segment by segment (kMlaSeg keys,
// online softmax inside a segment), folding each segment into registers, and writes out.
// split = 1: block z handles segment z only (the last grid segment also takes any keys past
// the grid, which only a caller passing sel_len < 0 with more causal keys than sel's columns
// can cause) and writes its partial state for mla_combine_kernel.
template <int HG, int DPT, bool F8>
__global__ void __launch_bounds__(kMlaThreads)
    mla_kernel(const float* __restrict__ q_lat, int64_t ql_s0, int64_t ql_s1, const float* __restrict__ q_pe,
               int64_t qp_s0, int64_t qp_s1, const float* __restrict__ cache,
               const __nv_bfloat16* __restrict__ cache16, const uint8_t* __restrict__ cache8, int64_t c_stride,
               int64_t c_rows,
               Tokens tk, const int32_t* __restrict__ sel, int64_t sel_stride, int64_t sel_cols,
               const int32_t* __restrict__ sel_len, int64_t len_stride, float scale, float* __restrict__ out,
               int64_t o_s0, int64_t o_s1, int64_t T, int nh, MlaShape sh, int split, MlaSplit sp) {
  detail::pdl_enter();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  double* ls = reinterpret_cast<double*>(smem_raw);                   // [HG] running sums (segment)
  double* lt = ls + HG;                                                // [HG] folded sums
  int64_t* slots = reinterpret_cast<int64_t*>(lt + HG);                // [KC]
  float* qs = reinterpret_cast<float*>(slots + kMlaKC);                // [HG][D]
  float* ks = qs + size_t(HG) * sh.D;                                  // [KC][kstride]
  float* ps = ks + size_t(kMlaKC) * sh.kstride;                        // [HG][KC]
  float* ms = ps + HG * kMlaKC;                                        // [HG] running max (segment)
  float* as = ms + HG;                                                 // [HG] rescale
  float* mt = as + HG;                                                 // [HG] folded max
  float* fa = mt + HG;                                                 // [HG] fold factors
  float* fb = fa + HG;                                                 // [HG]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kvl = sh.kvl, D = sh.D;
  // 16-byte key rows: the chunks are staged with float4 loads (F32 cache) or 8 BF16 values per
  // 16-byte load (BF16 cache: cache16 set, cache null; widened exactly into ks, so everything
  // after the staging is the F32 kernel over the rounded values)
  // (an FP8 cache, cache8 set and the others null: 16-value units, dequantized exactly)
  const bool vec4 = cache && (D & 3) == 0 && (c_stride & 3) == 0 && (reinterpret_cast<uintptr_t>(cache) & 15) == 0;
  const bool vec8 = cache16 && (D & 7) == 0 && (c_stride & 7) == 0 && (reinterpret_cast<uintptr_t>(cache16) & 15) == 0;
  const int h0 = int(blockIdx.x) * HG;
  const int64_t cap = tk.nb * tk.bs;
  for (int64_t t = blockIdx.y; t < T; t += gridDim.y) {
    const MlaKeys mk = mla_keys(tk, t, cap, sel, sel_stride, sel_cols, sel_len, len_stride, split);
    const int64_t pos = mk.pos, nk = mk.nk, seg0 = mk.seg0, seg1 = mk.seg1;
    const int32_t *row = mk.row, *sl = mk.sl;
    // the group's query rows, kMlaGatherILP loads in flight per thread before the first store
    for (int base = threadIdx.x; base < HG * D; base += kMlaGatherILP * kMlaThreads) {
      float v[kMlaGatherILP];
#pragma unroll
      for (int u = 0; u < kMlaGatherILP; ++u) {
        const int i = base + u * kMlaThreads;
        const int hl = i / D, e = i - hl * D, h = h0 + hl;
        v[u] = 0.0f;
        if (i < HG * D && h < nh)
          v[u] = e < kvl ? q_lat[t * ql_s0 + h * ql_s1 + e] : q_pe[t * qp_s0 + h * qp_s1 + (e - kvl)];
      }
#pragma unroll
      for (int u = 0; u < kMlaGatherILP; ++u)
        if (base + u * kMlaThreads < HG * D) qs[base + u * kMlaThreads] = v[u];
    }
    for (int h = threadIdx.x; h < HG; h += kMlaThreads) {
      mt[h] = -INFINITY;
      lt[h] = 0.0;
    }
    float acc[HG][DPT], tot[HG][DPT];
#pragma unroll
    for (int h = 0; h < HG; ++h)
#pragma unroll
      for (int i = 0; i < DPT; ++i) tot[h][i] = acc[h][i] = 0.0f;
    for (int64_t seg = seg0; seg < seg1; ++seg) {
      const int64_t k0 = seg * kMlaSeg;
      int64_t k1 = k0 + kMlaSeg < nk ? k0 + kMlaSeg : nk;
      if (split && seg == int64_t(gridDim.z) - 1) k1 = nk;  // keys past the grid (see above)
      for (int h = threadIdx.x; h < HG; h += kMlaThreads) {
        ms[h] = -INFINITY;
        ls[h] = 0.0;
      }
#pragma unroll
      for (int h = 0; h < HG; ++h)
#pragma unroll
        for (int i = 0; i < DPT; ++i) acc[h][i] = 0.0f;
      for (int64_t c0 = k0; c0 < k1; c0 += kMlaKC) {
        if (threadIdx.x < kMlaKC) {
          const int64_t j = c0 + threadIdx.x;
          int64_t slot = -1;
          if (j < k1) {
            const int64_t key = sl ? int64_t(sl[j]) : j;
            if (key >= 0 && key <= pos) slot = slot_of(tk, row, c_rows, key);
          }
          slots[threadIdx.x] = slot;
        }
        __syncthreads();  // also: the previous chunk's P V is finished with ks / ps
        // The chunk's 32 x D floats, kMlaGatherILP loads in flight per thread before the first
        // store (each store waits for its load: one row at a time left a thread ~2 loads per
        // global-memory latency, 32 latencies a chunk). The same values land in ks.
        // Where the cache rows are 16-byte aligned: float4 loads, kMlaGatherILP in flight with
        // 4-head groups and kv_lora >= 512 (GLM-5.3's split decode variant mla_kernel<4, 2>:
        // 32 KB per block, a 32-key chunk of 576-float rows in ~2 rounds), half as many
        // otherwise (8 spilled 212 bytes in sm_100a's mla_kernel<16, 2>, 16 in its <4, 1>).
        if (!F8 && vec4) {
          constexpr int kV = HG > 4 || DPT < 2 ? kMlaGatherILP / 2 : kMlaGatherILP;
          const int D4 = D / 4;
          for (int base = threadIdx.x; base < kMlaKC * D4; base += kV * kMlaThreads) {
            float4 v[kV];
            int at[kV];
#pragma unroll
            for (int u = 0; u < kV; ++u) {
              const int idx = base + u * kMlaThreads;
              at[u] = -1;
              v[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
              if (idx < kMlaKC * D4) {
                const int r = idx / D4, e = 4 * (idx - r * D4);
                const int64_t slot = slots[r];
                at[u] = r * sh.kstride + e;
                if (slot >= 0) v[u] = *reinterpret_cast<const float4*>(cache + slot * c_stride + e);
              }
            }
#pragma unroll
            for (int u = 0; u < kV; ++u)
              if (at[u] >= 0) {
                ks[at[u]] = v[u].x;
                ks[at[u] + 1] = v[u].y;
                ks[at[u] + 2] = v[u].z;
                ks[at[u] + 3] = v[u].w;
              }
          }
        }
        if (!F8 && vec8) {
          constexpr int kV = HG > 4 || DPT < 2 ? kMlaGatherILP / 2 : kMlaGatherILP;
          const int D8 = D / 8;
          for (int base = threadIdx.x; base < kMlaKC * D8; base += kV * kMlaThreads) {
            uint4 v[kV];
            int at[kV];
#pragma unroll
            for (int u = 0; u < kV; ++u) {
              const int idx = base + u * kMlaThreads;
              at[u] = -1;
              v[u] = make_uint4(0u, 0u, 0u, 0u);
              if (idx < kMlaKC * D8) {
                const int r = idx / D8, e = 8 * (idx - r * D8);
                const int64_t slot = slots[r];
                at[u] = r * sh.kstride + e;
                if (slot >= 0) v[u] = *reinterpret_cast<const uint4*>(cache16 + slot * c_stride + e);
              }
            }
#pragma unroll
            for (int u = 0; u < kV; ++u)
              if (at[u] >= 0) {
                float f[8];
                detail::widen_bf16x8(v[u], f);
#pragma unroll
                for (int q = 0; q < 8; ++q) ks[at[u] + q] = f[q];
              }
          }
        }
        // an FP8 cache: its own instantiations (F8; in the F32 / BF16 kernels the FP8 staging
        // moved the register allocation: sm_100a's mla_kernel<4, 2> spilled)
        if constexpr (F8) mla_stage_fp8(cache8, c_stride, slots, ks, sh.kstride, kvl, D);
        for (int base = threadIdx.x; !F8 && !vec4 && !vec8 && base < kMlaKC * D; base += kMlaGatherILP * kMlaThreads) {
          float v[kMlaGatherILP];
          int at[kMlaGatherILP];
#pragma unroll
          for (int u = 0; u < kMlaGatherILP; ++u) {
            const int idx = base + u * kMlaThreads;
            at[u] = -1;
            v[u] = 0.0f;
            if (idx < kMlaKC * D) {
              const int r = idx / D, e = idx - r * D;
              const int64_t slot = slots[r];
              at[u] = r * sh.kstride + e;
              if (slot >= 0) v[u] = cache16 ? detail::to_f32(cache16[slot * c_stride + e]) : cache[slot * c_stride + e];
            }
          }
#pragma unroll
          for (int u = 0; u < kMlaGatherILP; ++u)
            if (at[u] >= 0) ks[at[u]] = v[u];
        }
        __syncthreads();
        const bool valid = c0 + lane < k1;
        for (int h = warp; h < HG; h += kMlaWarps) {
          const float* qh = qs + h * D;
          const float* kr = ks + lane * sh.kstride;
          float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
          int e = 0;
          for (; e + 4 <= kvl; e += 4) {
            a0 = fmaf(qh[e], kr[e], a0);
            a1 = fmaf(qh[e + 1], kr[e + 1], a1);
            a2 = fmaf(qh[e + 2], kr[e + 2], a2);
            a3 = fmaf(qh[e + 3], kr[e + 3], a3);
          }
          for (; e < kvl; ++e) a0 = fmaf(qh[e], kr[e], a0);
          float b0 = 0.0f, b1 = 0.0f, b2 = 0.0f, b3 = 0.0f;
          for (; e + 4 <= D; e += 4) {
            b0 = fmaf(qh[e], kr[e], b0);
            b1 = fmaf(qh[e + 1], kr[e + 1], b1);
            b2 = fmaf(qh[e + 2], kr[e + 2], b2);
            b3 = fmaf(qh[e + 3], kr[e + 3], b3);
          }
          for (; e < D; ++e) b0 = fmaf(qh[e], kr[e], b0);
          const float s = __fmul_rn((a0 + a1) + (a2 + a3) + ((b0 + b1) + (b2 + b3)), scale);  // never fused with the max
          float m = ms[h], alpha;
          double l = ls[h];
          const float p = softmax_update(s, valid, m, l, alpha);
          ps[h * kMlaKC + lane] = p;
          __syncwarp();  // every lane has read ms[h] / ls[h] before lane 0 overwrites them
          if (lane == 0) {
            ms[h] = m;
            ls[h] = l;
            as[h] = alpha;
          }
        }
        __syncthreads();
        const int nc = k1 - c0 < kMlaKC ? int(k1 - c0) : kMlaKC;
#pragma unroll
        for (int h = 0; h < HG; ++h) {
          const float a = as[h];
#pragma unroll
          for (int i = 0; i < DPT; ++i) acc[h][i] *= a;
        }
        for (int j = 0; j < nc; ++j) {
          float c[DPT];
#pragma unroll
          for (int i = 0; i < DPT; ++i) {
            const int d = threadIdx.x + i * kMlaThreads;
            c[i] = d < kvl ? ks[j * sh.kstride + d] : 0.0f;
          }
#pragma unroll
          for (int h = 0; h < HG; ++h) {
            const float p = ps[h * kMlaKC + j];
#pragma unroll
            for (int i = 0; i < DPT; ++i) acc[h][i] = fmaf(p, c[i], acc[h][i]);
          }
        }
      }
      __syncthreads();  // ms / ls final for the segment
      if (split) break;  // one segment: acc / ms / ls are its partial state
      for (int h = threadIdx.x; h < HG; h += kMlaThreads) mla_fold_head(h, mt, lt, ms, ls, fa, fb);
      __syncthreads();
#pragma unroll
      for (int h = 0; h < HG; ++h) {
        const float a = fa[h], b = fb[h];
#pragma unroll
        for (int i = 0; i < DPT; ++i) tot[h][i] = mla_fold_value(tot[h][i], a, acc[h][i], b);
      }
      __syncthreads();  // fa / fb / ms / ls are rewritten by the next segment
    }
    __syncthreads();  // mt / lt / ms / ls final (also when the token has no keys)
    if (split) {
      const bool have = seg0 < seg1;
#pragma unroll
      for (int h = 0; h < HG; ++h) {
        if (h0 + h >= nh) break;
        const int64_t ps_i = (t * nh + h0 + h) * int64_t(sp.nseg) + int64_t(blockIdx.z);
        if (threadIdx.x == 0) {
          sp.m[ps_i] = have ? ms[h] : -INFINITY;
          sp.l[ps_i] = have ? ls[h] : -1.0;
        }
        float* pa = sp.acc + ps_i * kvl;
#pragma unroll
        for (int i = 0; i < DPT; ++i) {
          const int d = threadIdx.x + i * kMlaThreads;
          if (d < kvl) pa[d] = have ? acc[h][i] : 0.0f;
        }
      }
    } else {
#pragma unroll
      for (int h = 0; h < HG; ++h) {
        if (h0 + h >= nh) break;
        const double L = lt[h];
        float* o = out + t * o_s0 + int64_t(h0 + h) * o_s1;
#pragma unroll
        for (int i = 0; i < DPT; ++i) {
          const int d = threadIdx.x + i * kMlaThreads;
          if (d < kvl) o[d] = mla_finish(tot[h][i], L);
        }
      }
    }
    __syncthreads();  // qs / mt / lt are rewritten for the next token
  }
}

// Split-KV: one block per (head, token) folds the token's segments in order, exactly as
// mla_kernel does with split = 0 (segments holding none of its keys are skipped).
__global__ void __launch_bounds__(kMlaThreads)
    mla_combine_kernel(MlaSplit sp, int64_t T, int nh, int kvl, float* __restrict__ out, int64_t o_s0,
                       int64_t o_s1) {
  detail::pdl_enter();
  const int h = blockIdx.x;
  for (int64_t t = blockIdx.y; t < T; t += gridDim.y) {
    const int64_t base = (t * nh + h) * int64_t(sp.nseg);
    float* o = out + t * o_s0 + int64_t(h) * o_s1;
    for (int d = threadIdx.x; d < kvl; d += kMlaThreads) {
      float tot;
      double L;
      fold_segments(sp.l, sp.m, sp.acc, base, sp.nseg, kvl, d, tot, L);
      o[d] = mla_finish(tot, L);
    }
  }
}

// ------------------------------------------------------------------ mla_attention, tensor cores
// A BF16 latent cache (kv_cache_dtype = "bf16", ops::mla_tc(), default on) on mma.sync
// m16n8k16 (mma_sm80.cuh). The keys are exact in BF16; each query row is split into three
// BF16 planes whose sum is its fp32 value (hi = bf16(q), mid = bf16(q - hi), lo = bf16(q - hi -
// mid)), and so are the softmax weights of P V: every product is exact and only the fp32 sums
// round (in the tensor cores' order: close to the SIMT kernel, not bitwise). A grid item is
// (token, 16 heads, segment of kMlaSeg = 64 keys) with 8 warps: the segment's latent rows land
// in shared memory by cp.async (16 bytes per copy, all in flight; rows padded by 8 values:
// conflict-free ldmatrix; a key without a slot reads as a zero row, as in mla_kernel);
// S = Q K^T, warp w taking keys 8w..8w+7 over all kv_lora + rope inputs (3 planes x D / 16
// MMAs); the scores scaled and masked through shared memory; per head row (2 per warp) the
// segment's max, the weights exp(s - m) in fp32 and their sum in double (as mla_kernel);
// P V, warp w taking latent dims [w kvl / 8, (w + 1) kvl / 8) over the 64 keys (V is the
// same shared rows, ldmatrix.trans). The segment's (m, l, acc) is folded in key order with
// mla_fold_scalars / mla_fold_value (the running total in shared memory), or written as its
// split-KV partial for mla_combine_kernel, which folds the same way: the split decision (a
// function of T) never changes a row, so decode == verify. Keys past the grid's last
// segment (see mla_kernel) are walked as more 64-key tiles of that segment, rescaled online.
// Shared memory for GLM-5.3 (kv_lora 512, rope 64): 176 KB unsplit, 143 KB split.
constexpr int kMtThreads = 256, kMtWarps = kMtThreads / 32;
constexpr int kMtHeads = 16;      // heads per item: the MMAs' M
constexpr int kMtKeys = kMlaSeg;  // keys per tile (a segment is one tile)
constexpr int kMtPLD = kMtKeys + 8;
constexpr int kMtMaxNT = 8;       // n-tiles of 8 latent dims per warp in P V: kv_lora <= 512
struct MtShape {
  int kvl, rope, D, LD;  // LD = D + 8: the padded row of the key tile and the query planes
};
inline bool mla_tc_fits(int64_t kvl, int64_t rope) {
  return kvl % 128 == 0 && kvl >= 128 && kvl <= 8 * kMtWarps * kMtMaxNT && rope >= 0 && (kvl + rope) % 32 == 0;
}
inline size_t mla_tc_smem(const MtShape& s, bool split) {
  return sizeof(double) * 2 * kMtHeads + sizeof(int64_t) * kMtKeys + sizeof(float) * 6 * kMtHeads +
         sizeof(float) * (size_t(kMtHeads) * kMtKeys + (split ? 0 : size_t(kMtHeads) * s.kvl)) +
         sizeof(__nv_bfloat16) * (size_t(kMtKeys) * s.LD + 3 * size_t(kMtHeads) * s.LD + 3 * size_t(kMtHeads) * kMtPLD);
}

template <bool SPLIT>
__global__ void __launch_bounds__(kMtThreads, 1)
    mla_tc_kernel(const float* __restrict__ q_lat, int64_t ql_s0, int64_t ql_s1, const float* __restrict__ q_pe,
                  int64_t qp_s0, int64_t qp_s1, const __nv_bfloat16* __restrict__ cache,
                  const uint8_t* __restrict__ cache8, int64_t c_stride, int64_t c_rows, Tokens tk, const int32_t* __restrict__ sel, int64_t sel_stride, int64_t sel_cols,
                  const int32_t* __restrict__ sel_len, int64_t len_stride, float scale, float* __restrict__ out,
                  int64_t o_s0, int64_t o_s1, int64_t T, int nh, MtShape sh, MlaSplit sp) {
  detail::pdl_enter();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  double* ls = reinterpret_cast<double*>(smem_raw);             // [16] the segment's sums
  double* lt = ls + kMtHeads;                                     // [16] folded sums
  int64_t* slots = reinterpret_cast<int64_t*>(lt + kMtHeads);     // [64]
  float* ms = reinterpret_cast<float*>(slots + kMtKeys);          // [16] the segment's max
  float* as = ms + kMtHeads;                                      // [16] rescale of the tile
  float* mt = as + kMtHeads;                                      // [16] folded max
  float* fa = mt + kMtHeads;                                      // [16] fold factors
  float* fb = fa + kMtHeads;                                      // [16]
  float* ss = fb + 2 * kMtHeads;                                  // [16][64] scores (after 16 floats of padding)
  float* tot = ss + kMtHeads * kMtKeys;                           // [16][kvl] folded P V (unsplit)
  __nv_bfloat16* ks = reinterpret_cast<__nv_bfloat16*>(tot + (SPLIT ? 0 : kMtHeads * sh.kvl));  // [64][LD]
  __nv_bfloat16* qp = ks + kMtKeys * sh.LD;                       // [3 planes][16][LD]
  __nv_bfloat16* pp = qp + 3 * kMtHeads * sh.LD;                  // [3 planes][16][PLD]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  const int kvl = sh.kvl, D = sh.D, LD = sh.LD;
  const int DW = kvl / kMtWarps, NT = DW / 8, d0 = warp * DW;
  const int h0 = int(blockIdx.x) * kMtHeads;
  const int64_t cap = tk.nb * tk.bs;
  for (int64_t t = blockIdx.y; t < T; t += gridDim.y) {
    const MlaKeys mk = mla_keys(tk, t, cap, sel, sel_stride, sel_cols, sel_len, len_stride, SPLIT);
    const int64_t pos = mk.pos, nk = mk.nk, seg0 = mk.seg0, seg1 = mk.seg1;
    const int32_t *row = mk.row, *sl = mk.sl;
    // the 16 heads' query rows [q_lat | q_pe] as three BF16 planes (heads past nh: zeros)
    for (int i = tid; i < kMtHeads * D; i += kMtThreads) {
      const int hl = i / D, e = i - hl * D, h = h0 + hl;
      float x = 0.0f;
      if (h < nh) x = e < kvl ? q_lat[t * ql_s0 + h * ql_s1 + e] : q_pe[t * qp_s0 + h * qp_s1 + (e - kvl)];
      store_bf16_planes(qp, kMtHeads, LD, hl, e, x);
    }
    if (tid < kMtHeads) {
      mt[tid] = -INFINITY;
      lt[tid] = 0.0;
    }
    if (!SPLIT)
      for (int i = tid; i < kMtHeads * kvl; i += kMtThreads) tot[i] = 0.0f;
    float acc[kMtMaxNT][4];
#pragma unroll
    for (int nt = 0; nt < kMtMaxNT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
    for (int64_t seg = seg0; seg < seg1; ++seg) {
      const int64_t k0 = seg * kMtKeys;
      int64_t k1 = k0 + kMtKeys < nk ? k0 + kMtKeys : nk;
      if (SPLIT && seg == int64_t(gridDim.z) - 1) k1 = nk;  // keys past the grid (see above)
      if (tid < kMtHeads) {
        ms[tid] = -INFINITY;
        ls[tid] = 0.0;
      }
#pragma unroll
      for (int nt = 0; nt < kMtMaxNT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
      for (int64_t c0 = k0; c0 < k1; c0 += kMtKeys) {
        __syncthreads();  // the previous tile's readers are done; the planes and inits are visible
        if (tid < kMtKeys) {
          const int64_t j = c0 + tid;
          int64_t slot = -1;
          if (j < k1) {
            const int64_t key = sl ? int64_t(sl[j]) : j;
            if (key >= 0 && key <= pos) slot = slot_of(tk, row, c_rows, key);
          }
          slots[tid] = slot;
        }
        __syncthreads();
        // the tile's rows by cp.async (a row without a slot: zeros); an FP8 cache's rows: the
        // codes 16 per load, dequantized into exact BF16 values, the rope's BF16 by cp.async
        if (cache8) {
          const int UQ = kvl / 16, UR = (D - kvl) / 8, U = UQ + UR;
          const int64_t qb = kvfp8::fp8_bytes(kvl);
          constexpr int kV = 10;  // a GLM-5.3 tile (64 rows x 40 units) in one round: every load in flight
          for (int base = tid; base < kMtKeys * U; base += kV * kMtThreads) {
            Fp8Unit v[kV];
            int at[kV];
#pragma unroll
            for (int u = 0; u < kV; ++u) {
              const int idx = base + u * kMtThreads;
              at[u] = -1;
              v[u].c = make_uint4(0u, 0u, 0u, 0u);
              v[u].s = 0.0f;
              if (idx < kMtKeys * U) {
                const int jj = idx / U, un = idx - jj * U;
                const int64_t slot = slots[jj];
                const uint8_t* rp = cache8 + slot * c_stride;
                if (un < UQ) {
                  at[u] = jj * LD + 16 * un;
                  if (slot >= 0) v[u] = fp8_load(rp, kvl, un);
                } else {
                  mma::cp_async16(mma::smem_u32(ks + jj * LD + kvl + 8 * (un - UQ)),
                                  slot >= 0 ? rp + qb + 16 * (un - UQ) : cache8, slot >= 0);
                }
              }
            }
#pragma unroll
            for (int u = 0; u < kV; ++u)
              if (at[u] >= 0) fp8_store_bf16x16(v[u], ks + at[u]);
          }
        } else {
          const int C8 = D / 8;
          for (int idx = tid; idx < kMtKeys * C8; idx += kMtThreads) {
            const int jj = idx / C8, e8 = idx - jj * C8;
            const int64_t slot = slots[jj];
            mma::cp_async16(mma::smem_u32(ks + jj * LD + 8 * e8), slot >= 0 ? cache + slot * c_stride + 8 * e8 : cache,
                            slot >= 0);
          }
        }
        mma::cp_async_commit();
        mma::cp_async_wait_all();
        __syncthreads();
        // S = Q K^T: rows g, g + 8 (heads) x keys 8 warp + 2 t4 + {0, 1}
        float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int kk = 0; kk < D / 16; kk += 2) {
          uint32_t bk[4];
          key_frags(ks, LD, warp, lane, kk, bk);
          mma_planes(qp, kMtHeads, 0, LD, lane, kk, bk, sc);
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int key = warp * 8 + 2 * t4 + (c & 1);
          ss[(g + 8 * (c >> 1)) * kMtKeys + key] = c0 + key < k1 ? __fmul_rn(sc[c], scale) : -INFINITY;
        }
        __syncthreads();
        // per head row: the tile's max, the weights (as BF16 planes) and the running sum
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int r = 2 * warp + rr;
          const float s0 = ss[r * kMtKeys + lane], s1 = ss[r * kMtKeys + 32 + lane];
          const float m = ms[r];
          const float mn = fmaxf(m, warp_max(fmaxf(s0, s1)));
          const float alpha = mn == -INFINITY ? 1.0f : expf(__fsub_rn(m, mn));  // m = -inf, mn finite: 0
          const float p0 = s0 == -INFINITY ? 0.0f : expf(__fsub_rn(s0, mn));
          const float p1 = s1 == -INFINITY ? 0.0f : expf(__fsub_rn(s1, mn));
          const double l = __dadd_rn(__dmul_rn(ls[r], double(alpha)), warp_sum(__dadd_rn(double(p0), double(p1))));
          store_bf16_planes(pp, kMtHeads, kMtPLD, r, lane, p0);
          store_bf16_planes(pp, kMtHeads, kMtPLD, r, 32 + lane, p1);
          __syncwarp();  // every lane has read ms[r] / ls[r]
          if (lane == 0) {
            ms[r] = mn;
            ls[r] = l;
            as[r] = alpha;
          }
        }
        __syncthreads();
        // acc = acc * alpha + P V over the warp's latent dims
        const float al0 = as[g], al1 = as[g + 8];
#pragma unroll
        for (int nt = 0; nt < kMtMaxNT; ++nt) {
          acc[nt][0] *= al0;
          acc[nt][1] *= al0;
          acc[nt][2] *= al1;
          acc[nt][3] *= al1;
        }
#pragma unroll
        for (int kc = 0; kc < kMtKeys / 16; ++kc) {
          uint32_t pa[3][4];
#pragma unroll
          for (int pl = 0; pl < 3; ++pl)
            mma::ldmatrix_x4(
                mma::smem_u32(pp + (pl * kMtHeads + (lane & 15)) * kMtPLD + kc * 16 + (lane >> 4) * 8), pa[pl]);
#pragma unroll
          for (int dp = 0; dp < kMtMaxNT / 2; ++dp) {
            if (2 * dp >= NT) break;
            uint32_t bv[4];
            mma::ldmatrix_x4_trans(
                mma::smem_u32(ks + (kc * 16 + (lane & 15)) * LD + d0 + dp * 16 + (lane >> 4) * 8), bv);
#pragma unroll
            for (int pl = 0; pl < 3; ++pl) {
              mma::mma_bf16(acc[2 * dp], pa[pl], bv[0], bv[1]);
              mma::mma_bf16(acc[2 * dp + 1], pa[pl], bv[2], bv[3]);
            }
          }
        }
      }
      if (SPLIT) break;  // one segment: acc / ms / ls are its partial state
      __syncthreads();   // ms / ls final for the segment (also read below by the fold)
      if (tid < kMtHeads) mla_fold_head(tid, mt, lt, ms, ls, fa, fb);
      __syncthreads();
#pragma unroll
      for (int nt = 0; nt < kMtMaxNT; ++nt) {
        if (nt >= NT) break;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int r = g + 8 * (c >> 1);
          float& x = tot[r * kvl + d0 + nt * 8 + 2 * t4 + (c & 1)];
          x = mla_fold_value(x, fa[r], acc[nt][c], fb[r]);
        }
      }
    }
    __syncthreads();  // ms / ls / mt / lt / tot final (also when the token has no keys)
    if (SPLIT) {
      const bool have = seg0 < seg1;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = g + 8 * hh, h = h0 + r;
        if (h >= nh) continue;
        const int64_t ps_i = (t * nh + h) * int64_t(sp.nseg) + int64_t(blockIdx.z);
        if (warp == 0 && t4 == 0) {
          sp.m[ps_i] = have ? ms[r] : -INFINITY;
          sp.l[ps_i] = have ? ls[r] : -1.0;
        }
        float* pa = sp.acc + ps_i * kvl + d0 + 2 * t4;
#pragma unroll
        for (int nt = 0; nt < kMtMaxNT; ++nt) {
          if (nt >= NT) break;
          pa[nt * 8] = have ? acc[nt][2 * hh] : 0.0f;
          pa[nt * 8 + 1] = have ? acc[nt][2 * hh + 1] : 0.0f;
        }
      }
    } else {
      for (int i = tid; i < kMtHeads * kvl; i += kMtThreads) {
        const int r = i / kvl, d = i - r * kvl, h = h0 + r;
        if (h < nh) out[t * o_s0 + int64_t(h) * o_s1 + d] = mla_finish(tot[i], lt[r]);
      }
    }
    __syncthreads();  // qp / tot / mt / lt are rewritten for the next token
  }
}

// ================================================================== block_attention
constexpr int kBaThreads = 256;
constexpr int kBaRows = kBaThreads / 32;  // one query row per warp
constexpr int kBaKC = 32;

struct BaArgs {
  const float* q;
  int64_t q_s0, q_s1;
  const float* k;
  int64_t k_s0, k_s1;
  const float* v;
  int64_t v_s0, v_s1;
  const float* kv;               // the context cache, F32 rows [k | v] ...
  const __nv_bfloat16* kv16;     // ... or BF16 ones (then kv is null)
  int64_t kv_stride, kv_rows;
  const int32_t* ctx_len;
  int64_t cl_stride;
  const int32_t* bt;
  int64_t bt_stride, nb, cbs;
  float* out;
  int64_t o_s0, o_s1;
  int64_t S, B, nh, kvh, hd, window;
  int causal;
  float scale;
  int64_t seg;  // keys per segment (attn::block_attn_segment)
  // split-KV (SPLIT = 1): nz segment slots per (query row, head), each block one segment;
  // partial states [row][head][z] (l < 0: no such segment), folded by block_attention_combine
  int64_t nz;
  float* part_acc;  // [.., hd]
  float* part_m;
  double* part_l;
};
inline size_t ba_smem(int64_t hd) {
  const int64_t kstride = hd % 2 == 0 ? hd + 1 : hd;
  return sizeof(float) * size_t(kBaRows * hd + kBaKC * kstride + kBaKC * hd + kBaRows * kBaKC) +
         sizeof(int64_t) * kBaKC;
}

// The end of a block-attention row: tot / L as the single-pass kernel did it (a NaN L gives
// NaN, as on the CPU; mla_finish would give 0).
__device__ __forceinline__ float ba_finish(float tot, double L) {
  const float inv = L > 0.0 ? float(1.0 / L) : 0.0f;
  return __fmul_rn(tot, inv);
}

// Each row's keys are folded in segments of a.seg keys (online softmax inside a segment,
// then mla_fold_scalars / mla_fold_value into the row's totals). SPLIT = 0: a block walks all
// its segments; SPLIT = 1: grid item (block, z) computes segment z alone and writes its
// state, which block_attention_combine folds in the same order with the same operations --
// bitwise what SPLIT = 0 writes, so the launch shape never changes a row.
template <int DPL, int SPLIT>
__global__ void __launch_bounds__(kBaThreads, 1) block_attention_kernel(const BaArgs a) {
  detail::pdl_enter();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int hd = int(a.hd), kstride = hd % 2 == 0 ? hd + 1 : hd;
  int64_t* slots = reinterpret_cast<int64_t*>(smem_raw);  // [KC]
  float* qs = reinterpret_cast<float*>(slots + kBaKC);      // [rows][hd]
  float* ks = qs + kBaRows * hd;                            // [KC][kstride]
  float* vs = ks + kBaKC * kstride;                         // [KC][hd]
  float* ps = vs + kBaKC * hd;                              // [rows][KC]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t grp = a.nh / a.kvh, M = a.B * grp, RG = (M + kBaRows - 1) / kBaRows;
  const int64_t kvdim = a.kvh * a.hd, cap = a.nb * a.cbs;
  const int64_t nz = SPLIT ? a.nz : 1;
  const int64_t total = a.S * a.kvh * RG * nz;
  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t z = SPLIT ? item % nz : 0, blk = SPLIT ? item / nz : item;
    const int64_t rg = blk % RG, kh = (blk / RG) % a.kvh, s = blk / (RG * a.kvh);
    int64_t L = a.ctx_len[s * a.cl_stride];
    L = L < 0 ? 0 : (L < cap ? L : cap);
    const int32_t* btr = a.bt + s * a.bt_stride;
    // this warp's row
    const int64_t r = rg * kBaRows + warp;
    const bool active = r < M;
    const int64_t i = active ? r / grp : 0, h = kh * grp + (active ? r % grp : 0);
    const int64_t c0_row = attn::window_first_key(L, i, a.window);
    const int64_t nblk_row = a.causal ? i + 1 : a.B;
    // the block's key range: the context from the earliest row's window start, then B own keys
    // (clamped to L: with window <= that row's i its window starts past the context, and a
    // negative nctx would shift the block's own keys)
    const int64_t cmin0 = attn::window_first_key(L, (rg * kBaRows) / grp, a.window);
    const int64_t cmin = cmin0 < L ? cmin0 : L;
    const int64_t nctx = L - cmin, nv = nctx + a.B;
    const int64_t qrow = s * a.B + i;
    // the keys this item walks: all of them, or segment z (SPLIT)
    const int64_t v0 = SPLIT ? z * a.seg : 0;
    const int64_t v1 = SPLIT ? (v0 + a.seg < nv ? v0 + a.seg : nv) : nv;
    if (SPLIT && v0 >= nv) {  // no such segment for this block (block-uniform)
      if (active && lane == 0) a.part_l[(qrow * a.nh + h) * nz + z] = -1.0;
      continue;
    }
    for (int e = lane; e < hd; e += 32) qs[warp * hd + e] = active ? a.q[qrow * a.q_s0 + h * a.q_s1 + e] : 0.0f;
    float m = -INFINITY;  // the segment's state
    double l = 0.0;
    float acc[DPL];
#pragma unroll
    for (int d = 0; d < DPL; ++d) acc[d] = 0.0f;
    float Mt = -INFINITY;  // the row's totals (SPLIT = 0)
    double Lt = 0.0;
    float tot[DPL];
#pragma unroll
    for (int d = 0; d < DPL; ++d) tot[d] = 0.0f;
    for (int64_t c0 = v0; c0 < v1; c0 += kBaKC) {
      if (!SPLIT && active && c0 > v0 && c0 % a.seg == 0) {  // a segment ends: fold it (warp-uniform)
        float fa, fb;
        mla_fold_scalars(Mt, Lt, m, l, fa, fb);
#pragma unroll
        for (int d = 0; d < DPL; ++d) {
          tot[d] = mla_fold_value(tot[d], fa, acc[d], fb);
          acc[d] = 0.0f;
        }
        m = -INFINITY;
        l = 0.0;
      }
      if (threadIdx.x < kBaKC) {
        const int64_t vi = c0 + threadIdx.x;
        slots[threadIdx.x] = vi < nctx ? attn::paged_slot(btr, a.nb, a.cbs, a.kv_rows, cmin + vi) : -1;
      }
      __syncthreads();  // also: the previous chunk is finished with ks / vs
      for (int idx = threadIdx.x; idx < kBaKC * hd; idx += kBaThreads) {
        const int jj = idx / hd, e = idx - jj * hd;
        const int64_t vi = c0 + jj;
        float kx = 0.0f, vx = 0.0f;
        if (vi < nctx) {
          const int64_t slot = slots[jj];
          if (slot >= 0) {
            const int64_t at = slot * a.kv_stride + kh * a.hd + e;
            kx = a.kv16 ? __bfloat162float(a.kv16[at]) : a.kv[at];
            vx = a.kv16 ? __bfloat162float(a.kv16[at + kvdim]) : a.kv[at + kvdim];
          }
        } else if (vi < v1) {
          const int64_t tr = s * a.B + (vi - nctx);
          kx = a.k[tr * a.k_s0 + kh * a.k_s1 + e];
          vx = a.v[tr * a.v_s0 + kh * a.v_s1 + e];
        }
        ks[jj * kstride + e] = kx;
        vs[jj * hd + e] = vx;
      }
      __syncthreads();
      if (active) {  // warp-uniform
        const int64_t vi = c0 + lane;
        const bool valid = vi < nctx ? (cmin + vi >= c0_row) : (vi < v1 && vi - nctx < nblk_row);
        const float* qh = qs + warp * hd;
        const float* kr = ks + lane * kstride;
        float dot = 0.0f;
        for (int e = 0; e < hd; ++e) dot = __fadd_rn(dot, __fmul_rn(qh[e], kr[e]));
        float alpha;
        const float p = softmax_update(__fmul_rn(dot, a.scale), valid, m, l, alpha);
        ps[warp * kBaKC + lane] = p;
        __syncwarp();
#pragma unroll
        for (int d = 0; d < DPL; ++d) acc[d] *= alpha;
        const int nc = v1 - c0 < kBaKC ? int(v1 - c0) : kBaKC;
        for (int j = 0; j < nc; ++j) {
          const float pj = ps[warp * kBaKC + j];
          if (pj == 0.0f) continue;  // masked keys (uniform): as the CPU, they never touch out
#pragma unroll
          for (int d = 0; d < DPL; ++d) {
            const int e = lane + 32 * d;
            if (e < hd) acc[d] = fmaf(pj, vs[j * hd + e], acc[d]);
          }
        }
      }
    }
    if (active) {
      if (SPLIT) {  // this segment's state
        const int64_t at = (qrow * a.nh + h) * nz + z;
        if (lane == 0) {
          a.part_m[at] = m;
          a.part_l[at] = l;
        }
#pragma unroll
        for (int d = 0; d < DPL; ++d) {
          const int e = lane + 32 * d;
          if (e < hd) a.part_acc[at * a.hd + e] = acc[d];
        }
      } else {  // the last segment, then out
        float fa, fb;
        mla_fold_scalars(Mt, Lt, m, l, fa, fb);
        float* o = a.out + qrow * a.o_s0 + h * a.o_s1;
#pragma unroll
        for (int d = 0; d < DPL; ++d) {
          const int e = lane + 32 * d;
          if (e < hd) o[e] = ba_finish(mla_fold_value(tot[d], fa, acc[d], fb), Lt);
        }
      }
    }
    __syncthreads();  // qs / slots are rewritten for the next block
  }
}

// Split-KV: one warp per (query row, head) folds the row's segment states in order, as
// block_attention_kernel<.., 0> does (slots of segments the row's block does not have are
// marked l < 0 and skipped).
__global__ void __launch_bounds__(kBaThreads) block_attention_combine(const BaArgs a) {
  detail::pdl_enter();
  const int lane = threadIdx.x & 31;
  const int64_t rows = a.S * a.B * a.nh;
  for (int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; w < rows;
       w += int64_t(gridDim.x) * (blockDim.x / 32)) {
    const int64_t qrow = w / a.nh, h = w - qrow * a.nh;
    const int64_t base = w * a.nz;
    float* o = a.out + qrow * a.o_s0 + h * a.o_s1;
    for (int64_t e = lane; e < a.hd; e += 32) {
      float tot;
      double L;
      fold_segments(a.part_l, a.part_m, a.part_acc, base, a.nz, a.hd, e, tot, L);
      o[e] = ba_finish(tot, L);
    }
  }
}

// ------------------------------------------------------------------ block attention, tensor cores
// BlockAttention::tensor_cores (the drafter under Engine draft_gemm): FlashAttention-2 style
// on mma.sync m16n8k16 (BF16 operands, fp32 accumulators; mma_sm80.cuh). A grid item is
// (block s, kv head, 64 query rows of its B x grp, key segment z): its 4 warps own 16 rows
// each; per 64-key tile the block's K and V rows (context rows through the block table, then
// the block's own k / v) land in shared memory as BF16 (rows padded by 8 elements:
// conflict-free ldmatrix): a BF16 cache's rows by cp.async (the whole tile in flight, no
// registers), fp32 rows through registers, rounded to nearest even; S = Q K^T (ldmatrix A from Q, B from K rows),
// scale, mask (window, causal, segment end), online softmax per row (running max over the
// quad that shares a row, fp32), P rounded to BF16 as the A fragment of P V (ldmatrix.trans
// of V), the row sums taken over the rounded P. One segment: out = O / l; several (keys past
// block_attn_tc_segment): each item writes its segment's (m, l, O) and
// block_attention_combine folds them in order. The segmentation depends on the capacity,
// the window and B only, so a row does not depend on the batch. Unlike the exact kernel, a
// key masked for one row but visible to another still enters that row's MMA with P = 0, so
// an Inf / NaN in such a key's V makes the row NaN (the exact kernel skips it).
constexpr int kTcThreads = 128;
constexpr int kTcRows = 64;  // query rows per item (4 warps x 16)
constexpr int kTcKeys = 64;  // keys per tile
constexpr int kTcAhead = 4;  // (k, v) float4 pairs in flight per thread when fp32 rows are staged
template <int HD>
constexpr size_t tc_smem() {
  return sizeof(__nv_bfloat16) * size_t(kTcRows + 2 * kTcKeys) * size_t(HD + 8) + sizeof(int64_t) * kTcKeys;
}
__device__ __forceinline__ void tc_store4(__nv_bfloat16* dst, float4 x) {
  *reinterpret_cast<uint2*>(dst) = make_uint2(mma::pack_bf16(x.x, x.y), mma::pack_bf16(x.z, x.w));
}

template <int HD>
__global__ void __launch_bounds__(kTcThreads, 3) block_attention_tc_kernel(const BaArgs a) {
  detail::pdl_enter();
  constexpr int LD = HD + 8, C4 = HD / 4, NT = kTcKeys / 8, DT = HD / 8;
  static_assert(HD % 16 == 0 && HD <= 128, "head_dim: a multiple of 16, at most 128");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // [64 rows][LD]
  __nv_bfloat16* ks = qs + kTcRows * LD;                           // [64 keys][LD]
  __nv_bfloat16* vs = ks + kTcKeys * LD;                           // [64 keys][LD]
  int64_t* slots = reinterpret_cast<int64_t*>(vs + kTcKeys * LD);  // [64]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  const int64_t grp = a.nh / a.kvh, M = a.B * grp, RT = (M + kTcRows - 1) / kTcRows;
  const int64_t kvdim = a.kvh * HD, cap = a.nb * a.cbs, nz = a.nz;
  const int64_t total = a.S * a.kvh * RT * nz;
  const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t z = item % nz, blk = item / nz;
    const int64_t rt = blk % RT, kh = (blk / RT) % a.kvh, s = blk / (RT * a.kvh);
    int64_t L = a.ctx_len[s * a.cl_stride];
    L = L < 0 ? 0 : (L < cap ? L : cap);
    const int32_t* btr = a.bt + s * a.bt_stride;
    // the item's keys: the context from the earliest row's window start, then the B own keys
    const int64_t cmin0 = attn::window_first_key(L, (rt * kTcRows) / grp, a.window);
    const int64_t cmin = cmin0 < L ? cmin0 : L;
    const int64_t nctx = L - cmin, nv = nctx + a.B;
    const int64_t v0 = z * a.seg, v1 = v0 + a.seg < nv ? v0 + a.seg : nv;
    // this thread's two query rows: g and g + 8 of its warp's 16
    bool act[2];
    int64_t qrow[2], head[2], cfirst[2], nblk[2];
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const int64_t r = rt * kTcRows + warp * 16 + g + 8 * h2;
      act[h2] = r < M;
      const int64_t i = act[h2] ? r / grp : 0;
      head[h2] = kh * grp + (act[h2] ? r % grp : 0);
      qrow[h2] = s * a.B + i;
      cfirst[h2] = attn::window_first_key(L, i, a.window);
      nblk[h2] = a.causal ? i + 1 : a.B;
    }
    if (v0 >= nv) {  // the segment holds none of the item's keys (item-uniform; nz > 1 only)
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2)
        if (act[h2] && t4 == 0) a.part_l[(qrow[h2] * a.nh + head[h2]) * nz + z] = -1.0;
      continue;
    }
    __syncthreads();  // the previous item is done with qs / ks / vs / slots
    for (int idx = tid; idx < kTcRows * C4; idx += kTcThreads) {
      const int rr = idx / C4, e4 = idx - rr * C4;
      const int64_t r = rt * kTcRows + rr;
      float4 x = zero4;
      if (r < M)
        x = *reinterpret_cast<const float4*>(a.q + (s * a.B + r / grp) * a.q_s0 + (kh * grp + r % grp) * a.q_s1 +
                                             4 * e4);
      tc_store4(qs + rr * LD + 4 * e4, x);
    }
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    float o[DT][4];
#pragma unroll
    for (int d = 0; d < DT; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
    for (int64_t c0 = v0; c0 < v1; c0 += kTcKeys) {
      if (c0 > v0) __syncthreads();  // every warp is done with the previous tile
      if (tid < kTcKeys) {
        const int64_t vi = c0 + tid;
        slots[tid] = vi < nctx ? attn::paged_slot(btr, a.nb, a.cbs, a.kv_rows, cmin + vi) : -1;
      }
      __syncthreads();
      if (a.kv16) {
        // a BF16 cache: the context rows' bits straight into shared memory by cp.async (16
        // bytes = 8 values per copy, all of the tile's in flight at once, no registers; a
        // row without a slot is zero-filled); the rows past the context below
        constexpr int C8 = HD / 8;
        for (int idx = tid; idx < kTcKeys * C8; idx += kTcThreads) {
          const int jj = idx / C8, e8 = idx - jj * C8;
          if (c0 + jj >= nctx) continue;
          const int64_t slot = slots[jj];
          const __nv_bfloat16* src = slot >= 0 ? a.kv16 + slot * a.kv_stride + kh * HD + 8 * e8 : a.kv16;
          mma::cp_async16(mma::smem_u32(ks + jj * LD + 8 * e8), src, slot >= 0);
          mma::cp_async16(mma::smem_u32(vs + jj * LD + 8 * e8), slot >= 0 ? src + kvdim : a.kv16, slot >= 0);
        }
        mma::cp_async_commit();
      }
      // fp32 rows (an F32 cache's context, and the block's own k / v): kTcAhead (k, v) pairs
      // of float4 loads in flight per thread before the first store (one pair at a time, each
      // store waiting for its loads, an F32 cache's 64-key tile of HD = 128 took 16 global
      // latencies: 70 us for a draft block over 2048 keys on an H200, 2026-12-04)
      for (int base = tid; base < kTcKeys * C4; base += kTcAhead * kTcThreads) {
        float4 kx[kTcAhead], vx[kTcAhead];
        bool st[kTcAhead];
#pragma unroll
        for (int u = 0; u < kTcAhead; ++u) {
          const int idx = base + u * kTcThreads;
          const int jj = idx / C4, e4 = idx - jj * C4;
          const int64_t vi = c0 + jj;
          kx[u] = vx[u] = zero4;
          st[u] = idx < kTcKeys * C4 && !(a.kv16 && vi < nctx);  // kv16 context rows: in flight (cp.async above)
          if (!st[u]) continue;
          if (vi < nctx) {
            const int64_t slot = slots[jj];
            if (slot >= 0) {
              const int64_t at = slot * a.kv_stride + kh * HD + 4 * e4;
              kx[u] = *reinterpret_cast<const float4*>(a.kv + at);
              vx[u] = *reinterpret_cast<const float4*>(a.kv + at + kvdim);
            }
          } else if (vi < v1) {
            const int64_t tr = s * a.B + (vi - nctx);
            kx[u] = *reinterpret_cast<const float4*>(a.k + tr * a.k_s0 + kh * a.k_s1 + 4 * e4);
            vx[u] = *reinterpret_cast<const float4*>(a.v + tr * a.v_s0 + kh * a.v_s1 + 4 * e4);
          }
        }
#pragma unroll
        for (int u = 0; u < kTcAhead; ++u) {
          if (!st[u]) continue;
          const int idx = base + u * kTcThreads;
          const int jj = idx / C4, e4 = idx - jj * C4;
          tc_store4(ks + jj * LD + 4 * e4, kx[u]);
          tc_store4(vs + jj * LD + 4 * e4, vx[u]);
        }
      }
      if (a.kv16) mma::cp_async_wait_all();  // this thread's copies; the barrier makes them everyone's
      __syncthreads();
      if (rt * kTcRows + warp * 16 >= M) continue;  // a warp without rows (warp-uniform; no barrier below)
      // S = Q K^T: the warp's 16 rows x the tile's 64 keys
      float sc[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        uint32_t af[4];
        mma::ldmatrix_x4(mma::smem_u32(qs + (warp * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8), af);
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          uint32_t bf[4];
          mma::ldmatrix_x4(
              mma::smem_u32(ks + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * LD + kk * 16 + ((lane >> 3) & 1) * 8),
              bf);
          mma::mma_bf16(sc[2 * np], af, bf[0], bf[1]);
          mma::mma_bf16(sc[2 * np + 1], af, bf[2], bf[3]);
        }
      }
      // scale and mask; the tile's row maxima over the quad that shares a row
      float tmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int h2 = c >> 1;
          const int64_t vi = c0 + nt * 8 + 2 * t4 + (c & 1);
          const bool valid =
              act[h2] && vi < v1 && (vi < nctx ? cmin + vi >= cfirst[h2] : vi - nctx < nblk[h2]);
          const float x = valid ? sc[nt][c] * a.scale : -INFINITY;
          sc[nt][c] = x;
          tmax[h2] = fmaxf(tmax[h2], x);
        }
      float alpha[2];
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        tmax[h2] = fmaxf(tmax[h2], __shfl_xor_sync(0xffffffffu, tmax[h2], 1));
        tmax[h2] = fmaxf(tmax[h2], __shfl_xor_sync(0xffffffffu, tmax[h2], 2));
        const float mn = fmaxf(m[h2], tmax[h2]);
        alpha[h2] = mn == -INFINITY ? 1.0f : __expf(m[h2] - mn);  // m = -inf, mn finite: 0
        m[h2] = mn;
      }
      // P in BF16, as the A fragments of P V (16-key chunk kc = n-tiles 2kc, 2kc + 1); the
      // row sums over the rounded weights the MMA uses
      uint32_t pa[NT / 2][4];
      float psum[2] = {0.0f, 0.0f};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        float p[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) p[c] = sc[nt][c] == -INFINITY ? 0.0f : __expf(sc[nt][c] - m[c >> 1]);
        const uint32_t lo = mma::pack_bf16(p[0], p[1]), hi = mma::pack_bf16(p[2], p[3]);
        psum[0] += detail::bf16_lo(lo) + detail::bf16_hi(lo);
        psum[1] += detail::bf16_lo(hi) + detail::bf16_hi(hi);
        pa[nt >> 1][(nt & 1) * 2] = lo;      // row g
        pa[nt >> 1][(nt & 1) * 2 + 1] = hi;  // row g + 8
      }
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) l[h2] = l[h2] * alpha[h2] + psum[h2];
#pragma unroll
      for (int d = 0; d < DT; ++d)
#pragma unroll
        for (int c = 0; c < 4; ++c) o[d][c] *= alpha[c >> 1];
      // O += P V
#pragma unroll
      for (int kc = 0; kc < NT / 2; ++kc)
#pragma unroll
        for (int dp = 0; dp < DT / 2; ++dp) {
          uint32_t bf[4];
          mma::ldmatrix_x4_trans(mma::smem_u32(vs + (kc * 16 + (lane & 15)) * LD + dp * 16 + (lane >> 4) * 8), bf);
          mma::mma_bf16(o[2 * dp], pa[kc], bf[0], bf[1]);
          mma::mma_bf16(o[2 * dp + 1], pa[kc], bf[2], bf[3]);
        }
    }
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {  // the row sums over the quad
      l[h2] += __shfl_xor_sync(0xffffffffu, l[h2], 1);
      l[h2] += __shfl_xor_sync(0xffffffffu, l[h2], 2);
    }
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      if (!act[h2]) continue;
      if (nz == 1) {
        const float inv = l[h2] > 0.0f ? 1.0f / l[h2] : 0.0f;
        float* op = a.out + qrow[h2] * a.o_s0 + head[h2] * a.o_s1;
#pragma unroll
        for (int d = 0; d < DT; ++d)
          *reinterpret_cast<float2*>(op + d * 8 + 2 * t4) = make_float2(o[d][2 * h2] * inv, o[d][2 * h2 + 1] * inv);
      } else {
        const int64_t at = (qrow[h2] * a.nh + head[h2]) * nz + z;
        if (t4 == 0) {
          a.part_m[at] = m[h2];
          a.part_l[at] = double(l[h2]);
        }
        float* pp = a.part_acc + at * HD;
#pragma unroll
        for (int d = 0; d < DT; ++d)
          *reinterpret_cast<float2*>(pp + d * 8 + 2 * t4) = make_float2(o[d][2 * h2], o[d][2 * h2 + 1]);
      }
    }
  }
}

}  // namespace

// ------------------------------------------------------------------ indexer_topk
namespace {
// A cache's element type as the attention kernels take it: F32, BF16, or U8 (FP8 rows).
DType cache_dtype(const Tensor& c) {
  if (c.defined() && (c.dtype() == DType::BF16 || c.dtype() == DType::U8)) return c.dtype();
  return DType::F32;
}
// An FP8 cache (ops/kv_fp8.h) of rows of `bytes` bytes for D quantized values (bytes < 0: D
// cannot be stored so), every row 16-byte aligned.
void need_fp8_rows(const Tensor& c, int64_t D, int64_t bytes, const char* op, const char* arg) {
  DFLASH2_CHECK_ARG(bytes > 0 && c.shape(1) == bytes, "cuda::", op, ": an FP8 '", arg, "' for ", D,
                    " quantized values (a multiple of 16, at most 128 or a multiple of 128) needs rows of ", bytes,
                    " bytes, found ", c.describe());
  DFLASH2_CHECK_ARG(c.stride(0) % 16 == 0 && detail::aligned(c.data(), 16), "cuda::", op, ": the FP8 '", arg,
                    "' rows must be 16-byte aligned, found ", c.describe());
}

// indexer_topk's / indexer_scores' arguments, checked; returns T.
int64_t need_indexer_args(const Tensor& q, const Tensor& w, const Tensor& key_cache, const ops::PagedTokens& tok,
                          const char* op) {
  DFLASH2_CHECK_ARG(q.defined() && q.device().is_cuda(), "cuda::", op, ": q must be a CUDA tensor, found ",
                    q.defined() ? q.describe() : std::string("undefined"));
  need_cuda(w, q, op, "w");
  need_cuda(key_cache, q, op, "key_cache");
  need_rows(q, DType::F32, 3, op, "q");
  const int64_t T = q.shape(0), nI = q.shape(1), dI = q.shape(2);
  need_rows(w, DType::F32, 2, op, "w");
  DFLASH2_CHECK_ARG(w.shape(0) == T && w.shape(1) == nI, "cuda::", op, ": w must be [", T, ", ", nI, "], found ",
                    w.describe());
  need_rows(key_cache, cache_dtype(key_cache), 2, op, "key_cache");
  if (key_cache.dtype() == DType::U8)
    need_fp8_rows(key_cache, dI, kvfp8::fits(dI) ? kvfp8::fp8_bytes(dI) : -1, op, "key_cache");
  else
    DFLASH2_CHECK_ARG(key_cache.shape(1) == dI, "cuda::", op, ": key_cache rows have ", key_cache.shape(1),
                      " values but q heads have ", dI);
  need_tokens(tok, q, T, op);
  DFLASH2_CHECK_ARG(T == 0 || (nI >= 1 && dI >= 1 && nI * dI <= (int64_t(1) << 24)), "cuda::", op,
                    ": unsupported q shape ", q.describe());
  return T;
}

// The scores of tokens t0 .. t0 + nt - 1 over keys < min(pos + 1, cap) into scores (row r of
// the chunk at scores + r * sc_stride); tokens with pos + 1 <= topk are skipped (topk 0: none).
// A BF16 cache takes the tensor-core kernel where ops::indexer_tc() and the shape allow.
void launch_indexer_scores(const Tensor& q, const Tensor& w, const Tensor& key_cache, const Tokens& tk, int64_t t0,
                           int64_t nt, int64_t topk, float* scores, int64_t sc_stride, int64_t cap, int device,
                           const char* op) {
  if (cap <= 0 || nt <= 0) return;
  const int64_t nI = q.shape(1), dI = q.shape(2);
  const float wscale = 1.0f / std::sqrt(float(nI)), sscale = 1.0f / std::sqrt(float(dI));
  const bool kbf16 = key_cache.dtype() == DType::BF16, kfp8 = key_cache.dtype() == DType::U8;
  const auto* k16 = kbf16 ? static_cast<const __nv_bfloat16*>(key_cache.data()) : nullptr;
  const auto* k8 = kfp8 ? key_cache.data_as<const uint8_t>() : nullptr;
  // an FP8 cache's values are exact BF16 ones: the tensor-core kernel takes them as it takes BF16
  if ((kbf16 || kfp8) && ops::indexer_tc() && indexer_tc_fits(nI, dI) &&
      (kfp8 || (key_cache.stride(0) % 8 == 0 && (reinterpret_cast<uintptr_t>(k16) & 15) == 0))) {
    const ItShape sh = it_shape(nI, dI);
    const size_t smem = it_smem(sh);
    allow_smem(indexer_tc_kernel, smem, device, op);
    const int tiles = idx_units_per_block(cap, nt, kItKeys, kItMaxTiles);
    const int64_t key_tiles = (cap + int64_t(kItKeys) * tiles - 1) / (int64_t(kItKeys) * tiles);
    DFLASH2_CHECK_ARG(key_tiles * nt <= INT32_MAX, "cuda::", op, ": ", nt, " tokens over ", cap,
                      " keys are too many for one launch");
    indexer_tc_kernel<<<unsigned(key_tiles * nt), kItThreads, smem, detail::stream()>>>(
        q.data_as<const float>(), q.stride(0), q.stride(1), w.data_as<const float>(), w.stride(0), k16, k8,
        key_cache.stride(0), key_cache.shape(0), tk, t0, topk, sh, sscale, wscale, scores, sc_stride, cap, tiles, nt);
    detail::check_launch("indexer tensor-core score kernel launch", q.describe());
    return;
  }
  const IdxShape sh = idx_shape(nI, dI);
  const size_t smem = idx_smem(sh);
  allow_smem(indexer_score_kernel, smem, device, op);
  const int groups = idx_units_per_block(cap, nt, int64_t(kIdxWarps) * kIdxKW, kIdxGroups);
  const int64_t key_tiles = (cap + int64_t(kIdxWarps) * kIdxKW * groups - 1) / (int64_t(kIdxWarps) * kIdxKW * groups);
  DFLASH2_CHECK_ARG(key_tiles * nt <= INT32_MAX, "cuda::", op, ": ", nt, " tokens over ", cap,
                    " keys are too many for one launch");
  indexer_score_kernel<<<unsigned(key_tiles * nt), kIdxThreads, smem, detail::stream()>>>(
      q.data_as<const float>(), q.stride(0), q.stride(1), w.data_as<const float>(), w.stride(0),
      kbf16 || kfp8 ? nullptr : key_cache.data_as<const float>(), k16, k8, key_cache.stride(0), key_cache.shape(0),
      tk, t0, topk,
      sh, sscale, wscale, scores, sc_stride, cap, groups, nt);
  detail::check_launch("indexer_topk score kernel launch", q.describe());
}
}  // namespace

void indexer_topk(const Tensor& q, const Tensor& w, const Tensor& key_cache, const ops::PagedTokens& tok,
                  int64_t topk, Tensor& sel, Tensor& sel_len) {
  const char* op = "indexer_topk";
  const int64_t T = need_indexer_args(q, w, key_cache, tok, op);
  need_cuda(sel, q, op, "sel");
  need_cuda(sel_len, q, op, "sel_len");
  DFLASH2_CHECK_ARG(topk >= 1 && topk <= INT32_MAX, "cuda::indexer_topk: topk must be in [1, 2^31), found ", topk);
  need_rows(sel, DType::I32, 2, op, "sel");
  DFLASH2_CHECK_ARG(sel.shape(0) == T && sel.shape(1) == topk, "cuda::indexer_topk: sel must be I32 [", T, ", ", topk,
                    "], found ", sel.describe());
  DFLASH2_CHECK_ARG(T <= 1 || sel.stride(0) >= topk, "cuda::indexer_topk: the rows of 'sel' overlap");
  need_i32_vec(sel_len, T, op, "sel_len");
  if (T == 0) return;
  const int64_t cap = tok.block_table.shape(1) * tok.block_size;  // the longest context a token can have
  DFLASH2_CHECK_ARG(cap <= (int64_t(1) << 31) - kSelThreads, "cuda::indexer_topk: contexts of ", cap,
                    " keys are not supported");
  const int device = q.device().index;
  detail::DeviceGuard guard(device);
  const Tokens tk = tokens_of(tok);
  // tokens per chunk: the scores of a chunk stay under the scratch cap (and its launch under
  // 65535 tokens)
  const int64_t row_bytes = (cap > 0 ? cap : 1) * int64_t(sizeof(float));
  int64_t chunk = int64_t(kIdxScratchCap) / row_bytes;
  chunk = chunk < 1 ? 1 : chunk;
  chunk = chunk < detail::kMaxGridY ? chunk : detail::kMaxGridY;
  chunk = chunk < T ? chunk : T;
  float* scores = static_cast<float*>(detail::scratch(device, size_t(chunk) * size_t(row_bytes)));
  for (int64_t t0 = 0; t0 < T; t0 += chunk) {
    const int64_t nt = T - t0 < chunk ? T - t0 : chunk;
    launch_indexer_scores(q, w, key_cache, tk, t0, nt, topk, scores, cap, cap, device, op);
    indexer_select_kernel<<<detail::row_blocks(nt), kSelThreads, 0, detail::stream()>>>(
        scores, cap, tk, t0, nt, topk, sel.data_as<int32_t>(), sel.stride(0), sel_len.data_as<int32_t>(),
        sel_len.stride(0));
    detail::check_launch("indexer_topk select kernel launch", q.describe());
  }
}

void indexer_scores(const Tensor& q, const Tensor& w, const Tensor& key_cache, const ops::PagedTokens& tok,
                    Tensor& scores) {
  const char* op = "indexer_scores";
  const int64_t T = need_indexer_args(q, w, key_cache, tok, op);
  need_cuda(scores, q, op, "scores");
  need_rows(scores, DType::F32, 2, op, "scores");
  DFLASH2_CHECK_ARG(scores.shape(0) == T && (T <= 1 || scores.stride(0) >= scores.shape(1)), "cuda::", op,
                    ": scores must be F32 [", T, ", C] with disjoint rows, found ", scores.describe());
  if (T == 0) return;
  const int64_t cap = std::min(tok.block_table.shape(1) * tok.block_size, scores.shape(1));
  DFLASH2_CHECK_ARG(cap < (int64_t(1) << 31), "cuda::", op, ": contexts of ", cap, " keys are not supported");
  const int device = q.device().index;
  detail::DeviceGuard guard(device);
  const Tokens tk = tokens_of(tok);
  for (int64_t t0 = 0; t0 < T; t0 += detail::kMaxGridY) {
    const int64_t nt = std::min<int64_t>(T - t0, detail::kMaxGridY);
    launch_indexer_scores(q, w, key_cache, tk, t0, nt, 0, scores.data_as<float>() + t0 * scores.stride(0),
                          scores.stride(0), cap, device, op);
  }
}

// ------------------------------------------------------------------ mla_attention
namespace {
template <int HG, int DPT, bool F8>
void launch_mla(const Tensor& q_lat, const Tensor& q_pe, const Tensor& cache, const Tokens& tk, const Tensor& sel,
                const Tensor& sel_len, float scale, Tensor& out, const MlaShape& sh, int device, const MlaSplit& sp) {
  const int64_t T = q_lat.shape(0), nh = q_lat.shape(1);
  const bool bf16 = cache.dtype() == DType::BF16, fp8 = cache.dtype() == DType::U8;
  const size_t smem = mla_smem(HG, sh);
  allow_smem(mla_kernel<HG, DPT, F8>, smem, device, "mla_attention");
  const bool has = sel_len.defined();
  const unsigned gy = unsigned(T < detail::kMaxGridY ? T : detail::kMaxGridY);
  const dim3 grid(unsigned((nh + HG - 1) / HG), gy, unsigned(sp.nseg > 0 ? sp.nseg : 1));
  mla_kernel<HG, DPT, F8><<<grid, kMlaThreads, smem, detail::stream()>>>(
      q_lat.data_as<const float>(), q_lat.stride(0), q_lat.stride(1), q_pe.data_as<const float>(), q_pe.stride(0),
      q_pe.stride(1), bf16 || fp8 ? nullptr : cache.data_as<const float>(),
      bf16 ? static_cast<const __nv_bfloat16*>(cache.data()) : nullptr,
      fp8 ? cache.data_as<const uint8_t>() : nullptr, cache.stride(0), cache.shape(0), tk,
      has ? sel.data_as<const int32_t>() : nullptr, has ? sel.stride(0) : 0, has ? sel.shape(1) : 0,
      has ? sel_len.data_as<const int32_t>() : nullptr, has ? sel_len.stride(0) : 0, scale, out.data_as<float>(),
      out.stride(0), out.stride(1), T, int(nh), sh, sp.nseg > 0 ? 1 : 0, sp);
  detail::check_launch("mla_attention kernel launch", q_lat.describe());
  if (sp.nseg > 0) {
    mla_combine_kernel<<<dim3(unsigned(nh), gy), kMlaThreads, 0, detail::stream()>>>(
        sp, T, int(nh), sh.kvl, out.data_as<float>(), out.stride(0), out.stride(1));
    detail::check_launch("mla_attention combine kernel launch", q_lat.describe());
  }
}

template <bool SPLIT>
void launch_mla_tc(const Tensor& q_lat, const Tensor& q_pe, const Tensor& cache, const Tokens& tk, const Tensor& sel,
                   const Tensor& sel_len, float scale, Tensor& out, const MtShape& sh, int device, const MlaSplit& sp) {
  const int64_t T = q_lat.shape(0), nh = q_lat.shape(1);
  const size_t smem = mla_tc_smem(sh, SPLIT);
  allow_smem(mla_tc_kernel<SPLIT>, smem, device, "mla_attention");
  const bool has = sel_len.defined();
  const unsigned gy = unsigned(T < detail::kMaxGridY ? T : detail::kMaxGridY);
  const dim3 grid(unsigned((nh + kMtHeads - 1) / kMtHeads), gy, unsigned(SPLIT ? sp.nseg : 1));
  mla_tc_kernel<SPLIT><<<grid, kMtThreads, smem, detail::stream()>>>(
      q_lat.data_as<const float>(), q_lat.stride(0), q_lat.stride(1), q_pe.data_as<const float>(), q_pe.stride(0),
      q_pe.stride(1), cache.dtype() == DType::U8 ? nullptr : static_cast<const __nv_bfloat16*>(cache.data()),
      cache.dtype() == DType::U8 ? cache.data_as<const uint8_t>() : nullptr, cache.stride(0), cache.shape(0), tk,
      has ? sel.data_as<const int32_t>() : nullptr, has ? sel.stride(0) : 0, has ? sel.shape(1) : 0,
      has ? sel_len.data_as<const int32_t>() : nullptr, has ? sel_len.stride(0) : 0, scale, out.data_as<float>(),
      out.stride(0), out.stride(1), T, int(nh), sh, sp);
  detail::check_launch("mla_attention (tensor cores) kernel launch", q_lat.describe());
  if (SPLIT) {
    mla_combine_kernel<<<dim3(unsigned(nh), gy), kMlaThreads, 0, detail::stream()>>>(
        sp, T, int(nh), sh.kvl, out.data_as<float>(), out.stride(0), out.stride(1));
    detail::check_launch("mla_attention combine kernel launch", q_lat.describe());
  }
}

template <int HG>
void launch_mla_dpt(int dpt, const Tensor& q_lat, const Tensor& q_pe, const Tensor& cache, const Tokens& tk,
                    const Tensor& sel, const Tensor& sel_len, float scale, Tensor& out, const MlaShape& sh, int device,
                    const MlaSplit& sp) {
  // an FP8 cache: its own instantiations, 4-head groups only (the tensor-core kernel takes
  // GLM-5.3's shapes; this is the fallback)
  if (cache.dtype() == DType::U8) {
    if (dpt == 1) launch_mla<4, 1, true>(q_lat, q_pe, cache, tk, sel, sel_len, scale, out, sh, device, sp);
    else if (dpt == 2) launch_mla<4, 2, true>(q_lat, q_pe, cache, tk, sel, sel_len, scale, out, sh, device, sp);
    else launch_mla<4, 4, true>(q_lat, q_pe, cache, tk, sel, sel_len, scale, out, sh, device, sp);
    return;
  }
  if (dpt == 1) launch_mla<HG, 1, false>(q_lat, q_pe, cache, tk, sel, sel_len, scale, out, sh, device, sp);
  else if (dpt == 2) launch_mla<HG, 2, false>(q_lat, q_pe, cache, tk, sel, sel_len, scale, out, sh, device, sp);
  else launch_mla<HG, 4, false>(q_lat, q_pe, cache, tk, sel, sel_len, scale, out, sh, device, sp);
}
}  // namespace

void mla_attention(const Tensor& q_lat, const Tensor& q_pe, const Tensor& cache, const ops::PagedTokens& tok,
                   const Tensor& sel, const Tensor& sel_len, float scale, Tensor& out) {
  const char* op = "mla_attention";
  DFLASH2_CHECK_ARG(q_lat.defined() && q_lat.device().is_cuda(),
                    "cuda::mla_attention: q_lat must be a CUDA tensor, found ",
                    q_lat.defined() ? q_lat.describe() : std::string("undefined"));
  need_cuda(q_pe, q_lat, op, "q_pe");
  need_cuda(cache, q_lat, op, "cache");
  need_cuda(out, q_lat, op, "out");
  need_rows(q_lat, DType::F32, 3, op, "q_lat");
  need_rows(q_pe, DType::F32, 3, op, "q_pe");
  need_rows(out, DType::F32, 3, op, "out");
  const int64_t T = q_lat.shape(0), nh = q_lat.shape(1), kvl = q_lat.shape(2), rope = q_pe.shape(2);
  DFLASH2_CHECK_ARG(q_pe.shape(0) == T && q_pe.shape(1) == nh, "cuda::mla_attention: q_pe ", q_pe.describe(),
                    " does not match q_lat ", q_lat.describe());
  DFLASH2_CHECK_ARG(out.shape(0) == T && out.shape(1) == nh && out.shape(2) == kvl, "cuda::mla_attention: out ",
                    out.describe(), " must have q_lat's shape ", q_lat.describe());
  need_disjoint3(out, op, "out");
  need_rows(cache, cache_dtype(cache), 2, op, "cache");
  if (cache.dtype() == DType::U8)
    need_fp8_rows(cache, kvl, kvfp8::fits(kvl) ? kvfp8::fp8_latent_bytes(kvl, rope) : -1, op, "cache");
  else
    DFLASH2_CHECK_ARG(cache.shape(1) == kvl + rope, "cuda::mla_attention: cache rows must hold kv_lora + rope = ",
                      kvl + rope, " values, found ", cache.describe());
  need_tokens(tok, q_lat, T, op);
  if (sel_len.defined()) {
    need_cuda(sel_len, q_lat, op, "sel_len");
    need_cuda(sel, q_lat, op, "sel");
    need_i32_vec(sel_len, T, op, "sel_len");
    need_rows(sel, DType::I32, 2, op, "sel");
    DFLASH2_CHECK_ARG(sel.shape(0) == T, "cuda::mla_attention: sel must have ", T, " rows, found ", sel.describe());
  }
  DFLASH2_CHECK(kvl >= 1 && kvl <= 4 * kMlaThreads && rope >= 0 && kvl + rope <= 4096, ErrorKind::Unsupported,
                "cuda::mla_attention: kv_lora must be in [1, ", 4 * kMlaThreads, "] and kv_lora + rope <= 4096, found ",
                q_lat.describe(), " and ", q_pe.describe());
  if (T == 0 || nh == 0) return;
  DFLASH2_CHECK_ARG(nh <= INT32_MAX, "cuda::mla_attention: too many heads");
  const int device = q_lat.device().index;
  detail::DeviceGuard guard(device);
  MlaShape sh;
  sh.kvl = int(kvl);
  sh.rope = int(rope);
  sh.D = int(kvl + rope);
  sh.kstride = sh.D % 2 == 0 ? sh.D + 1 : sh.D;
  const Tokens tk = tokens_of(tok);
  const int dpt = kvl <= kMlaThreads ? 1 : (kvl <= 2 * kMlaThreads ? 2 : 4);
  // Split-KV when (token, 16-head group) blocks would leave most SMs idle (decode, small
  // verify batches) and the partial states fit: segments of kMlaSeg keys over the largest
  // key count a token can have (sel's columns with a selection, else the block table's
  // capacity), 4-head groups, then the in-order combine. The result is bitwise the
  // unsplit kernel's (see mla_fold_scalars), so this choice never changes a row.
  const int64_t cap = tk.nb * tk.bs;
  const int64_t max_keys = sel_len.defined() ? std::min<int64_t>(sel.shape(1), cap) : cap;
  const int64_t nseg = (max_keys + kMlaSeg - 1) / kMlaSeg;
  const int64_t part_bytes = T * nh * nseg * (kvl * 4 + 4 + 8);
  const bool split = nseg >= 2 && T * ((nh + 15) / 16) < detail::sm_count(device) && nseg <= 65535 &&
                     part_bytes <= (int64_t(64) << 20);
  MlaSplit sp;
  if (split) {
    const int64_t n = T * nh * nseg;
    uint8_t* base = static_cast<uint8_t*>(detail::scratch(device, size_t(n) * (8 + 4 + 4 * kvl) + 256));
    sp.l = reinterpret_cast<double*>(base);
    sp.m = reinterpret_cast<float*>(base + n * 8);
    sp.acc = reinterpret_cast<float*>(base + n * 12);
    sp.nseg = int(nseg);
  }
  // a BF16 cache on the tensor cores (ops::mla_tc; a property of the cache and the shapes, never
  // of T: every token of an engine takes the same kernel)
  // (an FP8 cache's values are exact BF16 ones: the same kernel, its rows dequantized as staged)
  const bool tc_rows = cache.dtype() == DType::U8 ||
                       (cache.dtype() == DType::BF16 && cache.stride(0) % 8 == 0 && detail::aligned(cache.data(), 16));
  if (tc_rows && ops::mla_tc() && mla_tc_fits(kvl, rope)) {
    MtShape ts;
    ts.kvl = int(kvl);
    ts.rope = int(rope);
    ts.D = int(kvl + rope);
    ts.LD = ts.D + 8;
    if (split)
      launch_mla_tc<true>(q_lat, q_pe, cache, tk, sel, sel_len, scale, out, ts, device, sp);
    else
      launch_mla_tc<false>(q_lat, q_pe, cache, tk, sel, sel_len, scale, out, ts, device, sp);
    return;
  }
  if (nh <= 4 || split)
    launch_mla_dpt<4>(dpt, q_lat, q_pe, cache, tk, sel, sel_len, scale, out, sh, device, sp);
  else
    launch_mla_dpt<16>(dpt, q_lat, q_pe, cache, tk, sel, sel_len, scale, out, sh, device, sp);
}

// ------------------------------------------------------------------ block_attention
namespace {
// Whether block_attention_tc_kernel takes these tensors: head_dim 16 / 32 / 64 / 128 and
// every row it reads or writes 16-byte aligned (float4 loads, float2 stores).
bool block_attention_tc_applies(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& kv_cache,
                                const Tensor& out) {
  const int64_t hd = q.shape(2);
  if (hd != 16 && hd != 32 && hd != 64 && hd != 128) return false;
  for (const Tensor* t : {&q, &k, &v, &kv_cache, &out})
    if (!detail::aligned(t->data(), 16)) return false;
  for (const Tensor* t : {&q, &k, &v, &out})
    if (t->stride(0) % 4 != 0 || t->stride(1) % 4 != 0) return false;
  // F32 cache rows: float4 loads; BF16 ones: 16-byte cp.async chunks (8 values)
  return kv_cache.stride(0) % (kv_cache.dtype() == DType::BF16 ? 8 : 4) == 0;
}

// The tensor-core block attention (a.* filled by block_attention, the device current): the
// key segments of attn::block_attn_tc_segment; with several, each launch takes as many blocks
// as keep their segment states within kTcPartBytes of scratch (then the in-order combine).
constexpr int64_t kTcPartBytes = int64_t(64) << 20;
void block_attention_tc(BaArgs a, int device) {
  const int64_t S = a.S, B = a.B, hd = a.hd, nh = a.nh;
  const int64_t max_keys = attn::block_attn_tc_keys(a.nb * a.cbs, a.window, B);
  a.seg = attn::block_attn_tc_segment(max_keys);
  a.nz = attn::block_attn_segments(max_keys, a.seg);
  const int64_t M = B * (nh / a.kvh), RT = (M + kTcRows - 1) / kTcRows;
  const int64_t state_bytes = 8 + 4 + 4 * hd;  // l (double), m, O per (row, head, segment)
  const int64_t per_seq = a.nz > 1 ? B * nh * a.nz * state_bytes : 0;
  const int64_t chunk = per_seq > 0 ? std::min<int64_t>(S, std::max<int64_t>(1, kTcPartBytes / per_seq)) : S;
  a.part_l = nullptr;
  a.part_m = nullptr;
  a.part_acc = nullptr;
  if (a.nz > 1) {
    const int64_t n = chunk * B * nh * a.nz;
    const int64_t acc_off = (n * 12 + 15) / 16 * 16;  // float2 stores: 16-byte aligned
    uint8_t* base = static_cast<uint8_t*>(detail::scratch(device, size_t(acc_off + n * 4 * hd) + 256));
    a.part_l = reinterpret_cast<double*>(base);
    a.part_m = reinterpret_cast<float*>(base + n * 8);
    a.part_acc = reinterpret_cast<float*>(base + acc_off);
  }
  auto launch = [&](auto hdc) {
    constexpr int HD = decltype(hdc)::value;
    constexpr size_t smem = tc_smem<HD>();
    allow_smem(block_attention_tc_kernel<HD>, smem, device, "block_attention");
    for (int64_t s0 = 0; s0 < S; s0 += chunk) {
      BaArgs c = a;
      c.S = std::min(chunk, S - s0);
      c.q += s0 * B * a.q_s0;
      c.k += s0 * B * a.k_s0;
      c.v += s0 * B * a.v_s0;
      c.out += s0 * B * a.o_s0;
      c.ctx_len += s0 * a.cl_stride;
      c.bt += s0 * a.bt_stride;
      block_attention_tc_kernel<HD>
          <<<detail::row_blocks(c.S * a.kvh * RT * a.nz), kTcThreads, smem, detail::stream()>>>(c);
      detail::check_launch("block_attention tensor-core kernel launch", "");
      if (a.nz > 1) {
        const int64_t warps = c.S * B * nh;
        block_attention_combine<<<detail::row_blocks((warps + kBaRows - 1) / kBaRows), kBaThreads, 0,
                                  detail::stream()>>>(c);
        detail::check_launch("block_attention combine launch", "");
      }
    }
  };
  if (hd == 16)
    launch(std::integral_constant<int, 16>{});
  else if (hd == 32)
    launch(std::integral_constant<int, 32>{});
  else if (hd == 64)
    launch(std::integral_constant<int, 64>{});
  else
    launch(std::integral_constant<int, 128>{});
}
}  // namespace

void block_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& kv_cache, const Tensor& ctx_len,
                     const Tensor& block_table, const ops::BlockAttention& p, Tensor& out) {
  const char* op = "block_attention";
  DFLASH2_CHECK_ARG(q.defined() && q.device().is_cuda(), "cuda::block_attention: q must be a CUDA tensor, found ",
                    q.defined() ? q.describe() : std::string("undefined"));
  need_cuda(k, q, op, "k");
  need_cuda(v, q, op, "v");
  need_cuda(kv_cache, q, op, "kv_cache");
  need_cuda(ctx_len, q, op, "ctx_len");
  need_cuda(block_table, q, op, "block_table");
  need_cuda(out, q, op, "out");
  need_rows(q, DType::F32, 3, op, "q");
  need_rows(k, DType::F32, 3, op, "k");
  need_rows(v, DType::F32, 3, op, "v");
  need_rows(out, DType::F32, 3, op, "out");
  const int64_t T = q.shape(0), nh = q.shape(1), hd = q.shape(2), kvh = k.shape(1);
  DFLASH2_CHECK_ARG(p.block >= 1 && T % p.block == 0, "cuda::block_attention: ", T,
                    " query rows are not whole blocks of ", p.block);
  DFLASH2_CHECK_ARG(k.shape(0) == T && k.shape(2) == hd && kvh >= 1 && nh % kvh == 0, "cuda::block_attention: k ",
                    k.describe(), " does not match q ", q.describe(), " (kv heads must divide the query heads)");
  DFLASH2_CHECK_ARG(v.shape(0) == T && v.shape(1) == kvh && v.shape(2) == hd, "cuda::block_attention: v ",
                    v.describe(), " must have k's shape ", k.describe());
  DFLASH2_CHECK_ARG(out.shape(0) == T && out.shape(1) == nh && out.shape(2) == hd, "cuda::block_attention: out ",
                    out.describe(), " must have q's shape ", q.describe());
  need_disjoint3(out, op, "out");
  need_rows(kv_cache, kv_cache.dtype() == DType::BF16 ? DType::BF16 : DType::F32, 2, op, "kv_cache");
  DFLASH2_CHECK_ARG(kv_cache.shape(1) == 2 * kvh * hd, "cuda::block_attention: kv_cache rows must hold [k | v] = ",
                    2 * kvh * hd, " values, found ", kv_cache.describe());
  const int64_t S = T / p.block;
  need_i32_vec(ctx_len, S, op, "ctx_len");
  need_rows(block_table, DType::I32, 2, op, "block_table");
  DFLASH2_CHECK_ARG(block_table.shape(0) >= S, "cuda::block_attention: block_table needs a row per block (", S,
                    "), found ", block_table.describe());
  DFLASH2_CHECK_ARG(p.cache_block_size >= 1 && p.window >= 0,
                    "cuda::block_attention: cache_block_size must be >= 1 and window >= 0");
  DFLASH2_CHECK(hd >= 1 && hd <= 128, ErrorKind::Unsupported, "cuda::block_attention: head_dim must be in [1, 128], found ",
                hd);
  if (T == 0 || nh == 0) return;
  BaArgs a;
  a.q = q.data_as<const float>();
  a.q_s0 = q.stride(0);
  a.q_s1 = q.stride(1);
  a.k = k.data_as<const float>();
  a.k_s0 = k.stride(0);
  a.k_s1 = k.stride(1);
  a.v = v.data_as<const float>();
  a.v_s0 = v.stride(0);
  a.v_s1 = v.stride(1);
  const bool kv_bf16 = kv_cache.dtype() == DType::BF16;
  a.kv = kv_bf16 ? nullptr : kv_cache.data_as<const float>();
  a.kv16 = kv_bf16 ? static_cast<const __nv_bfloat16*>(kv_cache.data()) : nullptr;
  a.kv_stride = kv_cache.stride(0);
  a.kv_rows = kv_cache.shape(0);
  a.ctx_len = ctx_len.data_as<const int32_t>();
  a.cl_stride = ctx_len.stride(0);
  a.bt = block_table.data_as<const int32_t>();
  a.bt_stride = block_table.stride(0);
  a.nb = block_table.shape(1);
  a.cbs = p.cache_block_size;
  a.out = out.data_as<float>();
  a.o_s0 = out.stride(0);
  a.o_s1 = out.stride(1);
  a.S = S;
  a.B = p.block;
  a.nh = nh;
  a.kvh = kvh;
  a.hd = hd;
  a.window = p.window;
  a.causal = p.causal ? 1 : 0;
  a.scale = p.scale;
  const int64_t M = p.block * (nh / kvh), blocks = S * kvh * ((M + kBaRows - 1) / kBaRows);
  const int device = q.device().index;
  detail::DeviceGuard guard(device);
  if (p.tensor_cores && block_attention_tc_applies(q, k, v, kv_cache, out)) {
    block_attention_tc(a, device);
    return;
  }
  // Split-KV when the (block, kv head, row group) blocks would leave most SMs idle (a small
  // batch) and the segment states fit in 64 MiB of scratch: each of the (at most 33)
  // segments of the block table's capacity gets its own block, then the in-order combine.
  // Bitwise the unsplit result (see the kernel), so this choice never changes a row.
  const int64_t cap = a.nb * a.cbs;
  a.seg = attn::block_attn_segment(cap, p.block);
  const int64_t nz = attn::block_attn_segments(cap + p.block, a.seg);
  const int64_t part_bytes = T * nh * nz * (hd * 4 + 4 + 8);
  const bool split = nz >= 2 && blocks < detail::sm_count(device) && part_bytes <= (int64_t(64) << 20);
  a.nz = split ? nz : 1;
  a.part_acc = nullptr;
  a.part_m = nullptr;
  a.part_l = nullptr;
  if (split) {
    const int64_t n = T * nh * nz;
    uint8_t* base = static_cast<uint8_t*>(detail::scratch(device, size_t(n) * size_t(8 + 4 + 4 * hd) + 256));
    a.part_l = reinterpret_cast<double*>(base);
    a.part_m = reinterpret_cast<float*>(base + n * 8);
    a.part_acc = reinterpret_cast<float*>(base + n * 12);
  }
  const unsigned grid = detail::row_blocks(split ? blocks * nz : blocks);
  const size_t smem = ba_smem(hd);
  auto launch = [&](auto dpl) {
    constexpr int D = decltype(dpl)::value;
    if (split)
      block_attention_kernel<D, 1><<<grid, kBaThreads, smem, detail::stream()>>>(a);
    else
      block_attention_kernel<D, 0><<<grid, kBaThreads, smem, detail::stream()>>>(a);
  };
  if (hd <= 32)
    launch(std::integral_constant<int, 1>{});
  else if (hd <= 64)
    launch(std::integral_constant<int, 2>{});
  else
    launch(std::integral_constant<int, 4>{});
  if (split) {
    detail::check_launch("block_attention split kernel launch", q.describe());
    const int64_t warps = T * nh;
    block_attention_combine<<<detail::row_blocks((warps + kBaRows - 1) / kBaRows), kBaThreads, 0, detail::stream()>>>(a);
  }
  detail::check_launch("block_attention kernel launch", q.describe());
}

}  // namespace dflash2::cuda
