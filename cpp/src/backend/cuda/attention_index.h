// cuda/attention_index.h: the index logic of the CUDA attention ops (attention.cu), written
// once for the host and the device: the paged-cache slot of a position, the order-preserving
// map from a float score to a uint32 key, the MSB-first radix select over those keys (the
// threshold walk over a 256-bin histogram) and the output slot of a selected key. Plain
// C++ (no CUDA header): DFLASH2_HD functions compile as __host__ __device__ under nvcc and
// as inline host functions elsewhere, so tests/cpp/test_cuda_attention.cpp runs the whole
// selection on the CPU against a sort-based reference in every build.
//
// Status: unit-tested on the CPU; the device side is compiled for sm_90a/sm_100a/sm_103a
// but has not yet run on a GPU.
//
// The top-k rule being reproduced is the CPU backend's topk (cpu/elementwise.cpp): a key
// ranks before another when its value is larger, NaN ranks after every number, equal values
// (+0 and -0 included) rank by position, the earlier first. The topk best positions form a
// set; the indexer writes it in ascending position order.
//
// Radix select: order_key(v) maps the ranking by value to unsigned order (larger key = better;
// NaN -> 0, below every number; -0 -> the key of +0). The selection is then "the topk
// largest keys, ties to the earlier position". Four passes over the keys, 8 bits each from
// the most significant, narrow a class of keys sharing a prefix: each pass histograms the
// next digit of the keys still in the class and radix_step picks the digit holding the
// k_left-th best key. Afterwards a key is selected when it is above the class (a larger
// prefix: every such key beats the class) or it is in the class and among its first k_left
// members by position. The walk may stop early when a digit's whole bucket is exactly what
// is still needed (then every class member is taken). emit_slot gives a selected key's slot
// in the ascending-position output from the counts of above / class keys before it, so the
// kernel needs one exclusive prefix scan over positions.
#pragma once
#include <cstdint>
#include <cstring>

#include "backend/cuda/layout.h"

#ifndef DFLASH2_HD
#if defined(__CUDACC__)
#define DFLASH2_HD __host__ __device__ __forceinline__
#else
#define DFLASH2_HD inline
#endif
#endif

namespace dflash2::cuda::attn {

// ------------------------------------------------------------------ paged caches
// The cache row of position p of the sequence whose block-table row is `bt_row` (nb
// entries), with blocks of bs rows in a cache of `rows` rows: bt_row[p / bs] * bs + p % bs,
// or -1 when p is negative, past the table (p / bs >= nb) or its block lies outside the
// cache. Positions and block tables are device data, so the kernels cannot raise the CPU's
// InvalidArgument for them; they read a -1 row as zeros instead of faulting.
DFLASH2_HD int64_t paged_slot(const int32_t* bt_row, int64_t nb, int64_t bs, int64_t rows, int64_t p) {
  if (p < 0) return -1;
  const int64_t b = p / bs;
  if (b >= nb) return -1;
  const int64_t blk = bt_row[b];
  if (blk < 0 || (blk + 1) * bs > rows) return -1;
  return blk * bs + p % bs;
}

// The number of causal keys 0..pos of a token, clamped to what its block table can hold
// (nb * bs): memory safety for a corrupt position, identical to pos + 1 for a valid one.
DFLASH2_HD int64_t causal_keys(int64_t pos, int64_t capacity) {
  if (pos < 0) return 0;
  return pos + 1 < capacity ? pos + 1 : capacity;
}

// ------------------------------------------------------------------ float -> ordered key
using layout::float_bits;

// a ranks before b in the CPU's topk <=> order_key(a) > order_key(b), or the keys are equal
// (a and b equal values, or both NaN) and a is the earlier position.
DFLASH2_HD uint32_t order_key(float v) {
  uint32_t u = float_bits(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0u;  // NaN (any sign or payload): below -inf
  if (u == 0x80000000u) u = 0u;                      // -0 ties with +0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // -inf -> 0x007fffff > 0
}

// ------------------------------------------------------------------ radix select
constexpr int kRadixBits = 8;
constexpr int kRadixBins = 1 << kRadixBits;
constexpr int kRadixPasses = 32 / kRadixBits;

struct RadixSelect {
  uint32_t prefix;  // the class: keys with (key & mask) == prefix
  uint32_t mask;
  uint32_t k_left;  // how many class members are still to be selected (>= 1)
  int done;         // 1 when the class and k_left are final
};

DFLASH2_HD RadixSelect radix_begin(uint32_t k) { return RadixSelect{0u, 0u, k, 0}; }
DFLASH2_HD int radix_shift(int pass) { return 32 - kRadixBits * (pass + 1); }
DFLASH2_HD uint32_t radix_digit(uint32_t key, int pass) {
  return (key >> radix_shift(pass)) & uint32_t(kRadixBins - 1);
}
DFLASH2_HD bool radix_in_class(const RadixSelect& s, uint32_t key) { return (key & s.mask) == s.prefix; }
// Every key above the class beats every class member: it is selected.
DFLASH2_HD bool radix_above(const RadixSelect& s, uint32_t key) { return (key & s.mask) > s.prefix; }

// One pass: hist[d] counts the class members whose digit (of this pass) is d. Requires
// 1 <= k_left <= sum(hist). Picks the digit d holding the k_left-th best member: the keys
// with larger digits (`above` of them, all selected) leave the class, those with smaller
// digits drop out; the class narrows to digit d with k_left -= above. Done after the last
// pass, or as soon as the bucket of d holds exactly k_left keys (all of them selected).
DFLASH2_HD void radix_step(RadixSelect& s, const uint32_t* hist, int pass) {
  uint32_t above = 0;
  const int shift = radix_shift(pass);
  for (int d = kRadixBins - 1; d >= 0; --d) {
    const uint32_t c = hist[d];
    if (above + c >= s.k_left) {
      s.prefix |= uint32_t(d) << shift;
      s.mask |= uint32_t(kRadixBins - 1) << shift;
      s.k_left -= above;
      s.done = (c == s.k_left || pass == kRadixPasses - 1) ? 1 : 0;
      return;
    }
    above += c;
  }
  s.done = 1;  // unreachable when k_left <= sum(hist): keep the state usable anyway
}

// Whether the key at a position is selected, given the number of class members at earlier
// positions (class members are taken in position order, the first k_left of them).
DFLASH2_HD bool radix_selected(const RadixSelect& s, uint32_t key, uint32_t class_before) {
  return radix_above(s, key) || (radix_in_class(s, key) && class_before < s.k_left);
}
// The output slot (ascending position order) of a selected key: the selected keys before
// it are all the above-class keys before it plus the first min(class_before, k_left) class
// members.
DFLASH2_HD uint32_t emit_slot(const RadixSelect& s, uint32_t above_before, uint32_t class_before) {
  return above_before + (class_before < s.k_left ? class_before : s.k_left);
}

// Flags of one position for the emit scan, packed for a single 32-bit scan over a tile of
// up to 65535 positions: bit 0..15 count above-class keys, bits 16..31 class members.
DFLASH2_HD uint32_t emit_flags(const RadixSelect& s, uint32_t key) {
  return (radix_above(s, key) ? 1u : 0u) | (radix_in_class(s, key) ? (1u << 16) : 0u);
}

// ------------------------------------------------------------------ attention windows
// block_attention: the first context key of query i of a block whose context is L keys
// long (absolute query position L + i); keys j with j > L + i - window are visible when
// window > 0, every context key otherwise.
DFLASH2_HD int64_t window_first_key(int64_t L, int64_t i, int64_t window) {
  if (window <= 0) return 0;
  const int64_t c0 = L + i - window + 1;
  return c0 > 0 ? c0 : 0;
}

// block_attention's key segments (split-KV): a block's keys (its context keys from the
// earliest window start of its rows, then its B own keys: at most cap + B) are folded in
// segments of block_attn_segment(cap, B) keys -- a multiple of the kernel's 32-key chunk,
// at least 256, and few enough that at most 33 segments cover cap + B keys -- whether one
// block walks them all or each segment has a block of its own (then combined in order),
// so the split never changes a row. cap: the block table's capacity (nb x cache block).
DFLASH2_HD int64_t block_attn_segment(int64_t cap, int64_t B) {
  const int64_t n = cap + B;
  int64_t seg = (n + 31) / 32;        // 32 segments ...
  seg = (seg + 31) / 32 * 32;         // ... of whole 32-key chunks
  return seg < 256 ? 256 : seg;
}
DFLASH2_HD int64_t block_attn_segments(int64_t keys, int64_t seg) { return (keys + seg - 1) / seg; }

// block_attention's tensor-core path (BlockAttention::tensor_cores): a block's keys are at
// most block_attn_tc_keys = its context bound (the window when it is shorter than the block
// table's capacity: the earliest row's window holds window - 1 context keys; else the
// capacity) + B, walked in segments of block_attn_tc_segment keys -- whole 64-key tiles, at
// least 256, at most 64 segments -- one grid item each, folded in order by the combine when
// there are several. Functions of the capacity, the window and B only, never of the batch,
// so a sequence's rows are the same whatever the batch around it.
DFLASH2_HD int64_t block_attn_tc_keys(int64_t cap, int64_t window, int64_t B) {
  return (window > 0 && window < cap ? window : cap) + B;
}
DFLASH2_HD int64_t block_attn_tc_segment(int64_t max_keys) {
  int64_t seg = (max_keys + 63) / 64;  // 64 segments ...
  seg = (seg + 63) / 64 * 64;          // ... of whole 64-key tiles
  return seg < 256 ? 256 : seg;
}

}  // namespace dflash2::cuda::attn
