// cuda/sampling.cu: topk, sorting-free sampling (temperature, top-k, top-p) and lossless
// acceptance of drafted blocks on the CUDA backend.
//
// Status: compiled for sm_90a/sm_100a/sm_103a; run on an H200 (2026-12-04: every CUDA
// sampling / accept / topk test equal to the CPU op there; the wide rows below came later
// and have run only in the CPU emulation of the CUDA backend). The decision rules
// (sampling_logic.h) are unit-tested on the CPU against the CPU backend's sequential rules
// (tests/cpp/test_cuda_sampling.cpp, which also compares these kernels with the CPU ops
// when a GPU is present).
//
// Semantics (ops.h; the CPU oracle is cpu/sampling.cpp and cpu/elementwise.cpp topk):
//   topk    x F32 [.., V] -> values F32 / indices I32 [.., k]: the k largest, sorted
//           descending, ties to the lower index, NaN last (below -inf), +0 == -0.
//   sample  logits F32 [R, V] -> out I32 [R]: argmax when temperature <= 0, else one draw
//           (draw 0 of rng[r]) from p = the logits / T restricted to the top_k largest
//           (ties to the lower id), then to the smallest set of the largest reaching top_p
//           of the rest's mass (ties to the lower id), renormalised.
//   accept  the greedy longest-argmax-prefix, or rejection sampling with the selector's
//           K-wide q (cand / q) or one-hot q; bonus from normalize(max(p - q, 0)) (p when
//           nothing is left) or from p of the last row; draw i for position i, draw K for
//           the bonus.
//
// Mapping (rows of at most kChunk ids; longer ones: "wide rows" below, the same steps split
// over chunks). One thread block per row (sample) or per sequence (accept), up to 512 threads;
// every pass reads the row from global memory (L2 after the first: a 155K-vocab row is
// 620 KB), nothing is written but the outputs (no row buffer). The CPU's procedure is
// followed step by step:
//   1. max of the logits (x * invT is monotone, so max(x) * invT is the CPU's double max);
//   2. top-k: a 4-pass radix selection over order-preserving keys (8 bits a pass) with
//      count histograms (warp-aggregated with __match_any_sync, then shared atomics: exact
//      integers), the bucket walk of sampling_logic.h done by one warp (lane l walks bins
//      255-8l .. 248-8l); the ties at the threshold key are taken in id order: when not all
//      are kept, the id of the last kept one is found by an ordered count scan (below);
//   3. z = sum of the kept masses exp(x * invT - mx) in double (block reduction);
//   4. top-p: the same radix selection with mass histograms (double; per-warp private
//      histograms filled by the leader of each __match_any_sync group, summing its group
//      in lane order, then summed over the warps in warp order: deterministic, no
//      floating-point atomics), target top_p * z; the number of ties kept at the threshold
//      by the CPU's own sequential loop (topp_ties_kept), then the id of the last one;
//   5. the draw: an inclusive scan of the kept masses in double over ids in ascending order
//      (warp w owns a contiguous id range; 32 ids at a time, Kogge-Stone across the lanes
//      plus a running carry; the warps' totals scanned in warp order), x = u * total, the
//      first id with mass whose cumulative mass exceeds x (the CPU's `x < cum`), re-walking
//      only the warp whose range holds the crossing.
// accept runs in two kernels: one block per (sequence, target row <= draft_len) builds the
// row's kept set (and z, and p of the drafted token) or its argmax into scratch memory
// (detail::scratch; rows of all sequences in parallel), then one block per sequence makes
// the sequential accept decisions (thread 0: u_i * q(d_i) < p(d_i)) and draws the bonus.
// No host synchronization; the only allocation is the scratch (grown, never per call).
//
// Numerics vs the CPU backend. Every discrete rule is the CPU's (the same keys, the same
// threshold walk, the same tie order, the same pick rule `x < cum` skipping massless ids,
// the same acceptance test and draw indices; Philox draws are bit-identical: philox.h).
// Masses exp(double(x) * invT - mx) are formed with the CPU's roundings (no FMA); CUDA's
// double exp is within 1 ulp of glibc's. Sums of masses (z, histogram bins, the draw's
// cumulative sums) are taken in a different order than the CPU's id-order loop, so they
// differ by ~1e-16 relative: a decision can differ from the CPU's only when the draw or
// the top-p target falls within that of a boundary (tests use inputs with margins).
// Counting decisions (top-k, ties, topk) are exact. Everything is deterministic run to run.
// Inputs are device data: draft lengths are clamped to [0, K], rows / draft rows to their
// ranges, and an out-of-range drafted token has p = 0 (rejected); nothing faults.
//
// Performance notes. A sampled row costs ~2 passes (no top-k/top-p) to ~12 (both, ties
// at the cut) over the row per block; with R rows in parallel the grid fills the GPU,
// a single row uses one SM. Measured on an H200 (bench_ops, one load per warp step):
// 1.06 ms for one row of 154880 (t 0.8, top-p 0.95, top-k 50), 1.17 ms for 32 rows, so
// latency-bound, not ~tens of us as first estimated. Rows longer than kChunk (4096) ids now
// run split over one block per chunk ("wide rows", below; ops::wide_rows()), so a single
// 154880-id row is 38 blocks per step instead of one SM (not yet measured on a GPU: bench_ops'
// sample / accept rows time both forms). Every walk over a row now loads
// 128-element groups per warp, 16 bytes per lane when the row is 16-byte aligned, several
// groups ahead (warp_walk_all / warp_walk_ordered: 64 KB / 32 KB in flight per block
// against 2 KB); not yet measured on a GPU. The order-free walks (max, counts, sums,
// argmax, topk's collection) give each thread other elements than before, so the per-thread
// double sums of z and of the top-p histograms round in another order (still deterministic;
// the ordered scans of the draw and the tie searches are unchanged, bitwise). Ideas: stop
// the radix early when the selected bucket is exactly the target; a cluster's distributed
// shared memory instead of the wide rows' per-step launches (the CPU emulator runs one
// block at a time, so it could not check that form).
//
// topk over rows longer than kChunk with k <= kWideTopk (ops::wide_rows()): the kernel below
// over each chunk as a row (its local top k), then topk_merge (row_reduce.cu) over the
// chunks' candidates: topk's order is strict, so a row's top k are among its chunks' top k.
// Otherwise: one block (up to 1024 threads) per row: the count radix selection of step 2 with
// the same tie rule, then the k kept (key, index) pairs are collected (warp-aggregated
// atomic slots) and bitonic-sorted as 64-bit keys (~key << 32 | index: descending value,
// ascending index); in shared memory for k <= 2048, else in scratch memory.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "backend/cuda/argmax.cuh"
#include "backend/cuda/cuda_api.h"
#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/layout.h"
#include "backend/cuda/sampling_logic.h"
#include "backend/cuda/scratch.h"
#include "dflash2/error.h"
#include "ops/philox.h"

namespace dflash2::cuda {

namespace {

namespace sl = sampling;

constexpr unsigned kFull = 0xffffffffu;
constexpr int kSelThreads = 512;  // sample / accept blocks
constexpr int kSelWarps = kSelThreads / 32;
constexpr int kTopkThreads = 1024;
constexpr int kTopkShared = 2048;  // topk sorts up to this many pairs in shared memory
constexpr int kSharedCand = 128;   // accept keeps up to this many candidates in shared memory
constexpr int32_t kAll = 0x7fffffff;
constexpr int64_t kMaxRowLen = int64_t(INT32_MAX) - 4096;

// ------------------------------------------------------------------ shared state
struct Bcast {
  double acc, x, total;
  int32_t d, warp, result, n;
  uint32_t cnt;
};

// What every helper below uses (sized for 32 warps).
struct Common {
  uint32_t chist[256];
  double wtot[32], wexcl[32];
  int32_t wlast[32];
  double dred[33];
  float fred[33];
  float sval[32];
  int32_t sidx[32];
  Bcast bc;
};

// sample / accept: + the mass histograms (per warp of W) and the candidates of a rejected
// position.
template <int W>
struct SelSharedW {
  Common cm;
  double whist[W * 256];
  double hist[256];
  double stage[W * 32];
  int32_t cid[kSharedCand];
  float cq[kSharedCand];
};
using SelShared = SelSharedW<kSelWarps>;

__device__ __forceinline__ int lane_id() { return int(threadIdx.x & 31); }
__device__ __forceinline__ int warp_id() { return int(threadIdx.x >> 5); }
__device__ __forceinline__ int num_warps() { return int(blockDim.x >> 5); }

// Inclusive Kogge-Stone scan across the warp (lane order), in double.
__device__ __forceinline__ double warp_incl_scan(double v) {
  const int lane = lane_id();
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const double o = __shfl_up_sync(kFull, v, off);
    if (lane >= off) v += o;
  }
  return v;
}

// The walks over a row. With one 4-byte load per warp step, a warp waited out a
// global-memory latency every 32 elements and a row's block (one SM) streamed about 5 GB/s:
// on an H200 one `sample` call over 154880 logits took 1.06 ms, about 11 passes over the row
// (bench_ops, 2026-12-04). Both walks below load 128-element groups, lane l the 4
// consecutive elements 4l .. 4l + 3 of a group (one 16-byte load when the row is 16-byte
// aligned, else 4 scalar loads of the same elements), and issue several groups' loads before
// the first is used: 64 KB in flight per 512-thread block in warp_walk_all, 32 KB in the
// ordered walk, against 2 KB before.
constexpr int kGroup = 128;           // elements per warp group (32 lanes x 4)
constexpr int kAheadAll = 8;          // groups in flight per warp, warp_walk_all
constexpr int kAheadOrdered = 4;      // groups in flight per warp, warp_walk_ordered

// Loads group g of row[.., end) into this lane's 4 elements (0 at or past end).
__device__ __forceinline__ float4 load_group(const float* row, int64_t g, int64_t end, bool vec) {
  const int64_t i = g + 4 * lane_id();
  if (vec && i + 3 < end) return *reinterpret_cast<const float4*>(row + i);
  float4 v;
  v.x = i < end ? row[i] : 0.0f;
  v.y = i + 1 < end ? row[i + 1] : 0.0f;
  v.z = i + 2 < end ? row[i + 2] : 0.0f;
  v.w = i + 3 < end ? row[i + 3] : 0.0f;
  return v;
}

// Every element of row[0, V) once, in no particular order across threads: warp w of nw takes
// the groups starting at 128 w, 128 (w + nw), ...; body(i, x) for each of the lane's 4
// elements i (ascending within a thread; i >= V: x = 0, to be ignored), called by all 32
// lanes together (bodies may hold warp collectives). For order-free reductions (max, counts,
// per-thread sums, argmax), whose results do not depend on which thread saw an element
// beyond the floating-point order of a thread's own sum.
template <class Body>
__device__ __forceinline__ void warp_walk_all(const float* row, int64_t V, Body body) {
  const int64_t gs = int64_t(num_warps()) * kGroup;
  const bool vec = (reinterpret_cast<uintptr_t>(row) & 15u) == 0;
  for (int64_t base = int64_t(warp_id()) * kGroup; base < V; base += kAheadAll * gs) {
    float4 v[kAheadAll];
#pragma unroll
    for (int u = 0; u < kAheadAll; ++u) v[u] = load_group(row, base + u * gs, V, vec);
#pragma unroll
    for (int u = 0; u < kAheadAll; ++u) {
      const int64_t g = base + u * gs;
      if (g >= V) return;  // warp-uniform; every later group is past it too
      const int32_t i = int32_t(g) + 4 * lane_id();
      body(i, v[u].x);
      body(i + 1, v[u].y);
      body(i + 2, v[u].z);
      body(i + 3, v[u].w);
    }
  }
}

// A warp's walk over its own segment row[begin, end) (begin a multiple of 32) in id order,
// 32 ids a step: body(i0, x) for i0 = begin, begin + 32, ... (< end), x = row[i0 + lane] (0
// at or past end, where the body must ignore it). Each group's 4 elements per lane are
// redistributed with 4 shuffles, so the steps are those of a walk 32 elements at a time.
// body returns true to stop the walk.
template <class Body>
__device__ __forceinline__ void warp_walk_ordered(const float* row, int64_t begin, int64_t end, Body body) {
  const int lane = lane_id();
  const bool vec = (reinterpret_cast<uintptr_t>(row + begin) & 15u) == 0;
  for (int64_t base = begin; base < end; base += kAheadOrdered * kGroup) {
    float4 v[kAheadOrdered];
#pragma unroll
    for (int u = 0; u < kAheadOrdered; ++u) v[u] = load_group(row, base + u * kGroup, end, vec);
#pragma unroll
    for (int u = 0; u < kAheadOrdered; ++u) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int64_t i0 = base + u * kGroup + 32 * c;
        if (i0 >= end) return;  // warp-uniform; every later step is past it too
        // element i0 + lane is component (lane & 3) of lane 8c + lane / 4's group load
        const int src = 8 * c + (lane >> 2);
        const float a0 = __shfl_sync(kFull, v[u].x, src), a1 = __shfl_sync(kFull, v[u].y, src);
        const float a2 = __shfl_sync(kFull, v[u].z, src), a3 = __shfl_sync(kFull, v[u].w, src);
        const int comp = lane & 3;
        const float x = comp == 0 ? a0 : (comp == 1 ? a1 : (comp == 2 ? a2 : a3));
        if (body(int32_t(i0), x)) return;
      }
    }
  }
}

// The mass of logit x: exp(x * invT - mx) with the CPU's roundings (no contraction).
__device__ __forceinline__ double mass_of(float x, const sl::RowSel& s) {
  return exp(__dsub_rn(__dmul_rn(double(x), s.invT), s.mx));
}

// ------------------------------------------------------------------ bucket walk (warp 0)
// hv: this lane's 8 bins in walking order. Writes the pick to bc.d / bc.acc.
__device__ void warp_bucket_pick(const double* hv, double acc0, double target, Bcast& bc) {
  const int lane = lane_id();
  const double s = sl::lane_sum(hv);
  const double incl = warp_incl_scan(s);
  double excl = __shfl_up_sync(kFull, incl, 1);
  if (lane == 0) excl = 0.0;
  const sl::LaneWalk w = sl::lane_walk(hv, lane, acc0 + excl, target);
  const unsigned found = __ballot_sync(kFull, w.found != 0);
  const unsigned nonempty = __ballot_sync(kFull, w.last_nonempty >= 0);
  int d;
  double acc;
  if (found) {
    const int src = __ffs(int(found)) - 1;
    d = __shfl_sync(kFull, w.d, src);
    acc = __shfl_sync(kFull, w.acc, src);
  } else if (nonempty) {
    const int src = 31 - __clz(int(nonempty));
    d = __shfl_sync(kFull, w.last_nonempty, src);
    acc = __shfl_sync(kFull, w.acc_end - w.last_h, src);
  } else {
    d = 0;
    acc = __shfl_sync(kFull, w.acc_end, 31);
  }
  if (lane == 0) {
    bc.d = d;
    bc.acc = acc;
  }
}

// One radix pass's decision from its 256-bin histogram (counts, or masses for top-p;
// cm.chist holds the counts either way): warp 0 walks the bins, then every thread takes the
// picked digit d into the running (prefix, mask) and the pick's (acc, cnt).
template <class H>
__device__ void radix_pass_pick(const H* hist, int shift, double target, Common& cm, uint32_t& prefix,
                                uint32_t& mask, double& acc, uint32_t& cnt) {
  if (warp_id() == 0) {
    double hv[sl::kBinsPerLane];
    sl::lane_bins(hist, lane_id(), hv);
    warp_bucket_pick(hv, acc, target, cm.bc);
    if (lane_id() == 0) cm.bc.cnt = cm.chist[cm.bc.d];
  }
  __syncthreads();
  const int d = cm.bc.d;
  acc = cm.bc.acc;
  cnt = cm.bc.cnt;
  prefix |= uint32_t(d) << shift;
  mask |= 255u << shift;
}

// ------------------------------------------------------------------ radix selection (counts)
// One count radix pass over row[c0, c1): the histogram (into cm.chist) of the keys with
// (key & mask) == prefix at `shift`.
template <class KeyF>
__device__ void count_hist_pass(const float* row, int32_t c0, int32_t c1, KeyF keyf, uint32_t prefix, uint32_t mask,
                                int shift, Common& cm) {
  const int lane = lane_id();
  for (int b = threadIdx.x; b < 256; b += blockDim.x) cm.chist[b] = 0;
  __syncthreads();
  const int32_t n = c1 - c0;
  warp_walk_all(row + c0, n, [&](int32_t i, float x) {
    int bin = 256;
    if (i < n) {
      const uint32_t k = keyf(x);
      if ((k & mask) == prefix) bin = int((k >> shift) & 255u);
    }
    const unsigned m = __match_any_sync(kFull, bin);
    if (bin < 256 && lane == __ffs(int(m)) - 1) atomicAdd(&cm.chist[bin], uint32_t(__popc(int(m))));
  });
  __syncthreads();
}

// The key k* such that fewer than `target` keys are > k* and at least `target` are >= k*
// (cpu radix_select with counts). *above: the count of keys > k*; *n_eq: the count == k*.
template <class KeyF>
__device__ uint32_t radix_count(const float* row, int32_t V, double target, KeyF keyf, Common& cm, double* above,
                                uint32_t* n_eq) {
  uint32_t prefix = 0, mask = 0;
  double acc = 0.0;
  uint32_t cnt = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    count_hist_pass(row, 0, V, keyf, prefix, mask, shift, cm);
    radix_pass_pick(cm.chist, shift, target, cm, prefix, mask, acc, cnt);
  }
  *above = acc;
  *n_eq = cnt;
  return prefix;
}

// ------------------------------------------------------------------ ordered pick
// The first id i (ascending) in [b0, e0) with mass wf(i) > 0 whose inclusive cumulative
// mass, counted from `base`, exceeds x, where x = u * (base + the range's total) when
// `scaled` (a draw) else u (a count search, or a draw whose x the caller formed); the
// fallbacks of sampling_logic.h when rounding leaves none (the range's last id with mass,
// else b0 -- 0 for a whole row). *total: base + the sum of every wf(i) in the range.
template <class WF>
__device__ int32_t block_pick_in(const WF& wf, int32_t b0, int32_t e0, double u, bool scaled, double base, Common& cm,
                                 double* total) {
  const int lane = lane_id(), warp = warp_id(), nw = num_warps();
  const int64_t n = int64_t(e0) - b0;
  const int32_t b = b0 + int32_t(sl::seg_begin(n, nw, warp)), e = b0 + int32_t(sl::seg_end(n, nw, warp));
  double carry = 0.0;
  int32_t last = -1;
  warp_walk_ordered(wf.src(), b, e, [&](int32_t i0, float xv) {
    const int32_t i = i0 + lane;
    const double v = i < e ? wf.at(xv, i) : 0.0;
    const double p = warp_incl_scan(v);
    carry = carry + __shfl_sync(kFull, p, 31);
    if (v > 0.0) last = i;
    return false;
  });
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) last = max(last, __shfl_xor_sync(kFull, last, off));
  if (lane == 0) {
    cm.wtot[warp] = carry;
    cm.wlast[warp] = last;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double ex = base;
    for (int w = 0; w < nw; ++w) {
      cm.wexcl[w] = ex;
      ex = ex + cm.wtot[w];
    }
    const double x = scaled ? u * ex : u;
    int pw = -1;
    for (int w = 0; w < nw; ++w)
      if (x < cm.wexcl[w] + cm.wtot[w]) {
        pw = w;
        break;
      }
    int32_t res = -1;
    if (pw < 0)
      for (int w = 0; w < nw; ++w) res = max(res, cm.wlast[w]);
    cm.bc.x = x;
    cm.bc.total = ex;
    cm.bc.warp = pw;
    cm.bc.result = res < 0 ? b0 : res;
  }
  __syncthreads();
  if (warp == cm.bc.warp) {
    const double x = cm.bc.x, ex = cm.wexcl[warp];
    int32_t found = -1;
    carry = 0.0;
    warp_walk_ordered(wf.src(), b, e, [&](int32_t i0, float xv) {
      const int32_t i = i0 + lane;
      const double v = i < e ? wf.at(xv, i) : 0.0;
      const double p = warp_incl_scan(v);
      const double cum = ex + (carry + p);
      const unsigned hit = __ballot_sync(kFull, sl::crosses(x, cum, v));
      if (hit) {
        found = i0 + __ffs(int(hit)) - 1;
        return true;
      }
      carry = carry + __shfl_sync(kFull, p, 31);
      return false;
    });
    if (found < 0) found = cm.wlast[warp] < 0 ? b0 : cm.wlast[warp];  // rounding: the warp's last with mass
    if (lane == 0) cm.bc.result = found;
  }
  __syncthreads();
  *total = cm.bc.total;
  return cm.bc.result;
}
template <class WF>
__device__ int32_t block_pick(const WF& wf, int32_t V, double u, bool scaled, Common& cm, double* total) {
  return block_pick_in(wf, 0, V, u, scaled, 0.0, cm, total);
}

// The id of the n-th (1-based) element in id order with pred(i).
template <class Pred>
struct CountW {
  Pred pred;
  __device__ const float* src() const { return pred.row; }
  __device__ double at(float x, int32_t i) const { return pred.at(x, i) ? 1.0 : 0.0; }
};
template <class Pred>
__device__ int32_t nth_index(Pred pred, int32_t V, int64_t n, Common& cm) {
  double total;
  return block_pick(CountW<Pred>{pred}, V, double(n - 1), false, cm, &total);
}

// ------------------------------------------------------------------ argmax
// The CPU's sequential argmax (layout.h argmax_better / argmax_finish).
__device__ int32_t block_argmax(const float* row, int32_t V, Common& cm) {
  float bv = -INFINITY;
  int32_t bi = layout::kArgmaxNone;
  warp_walk_all(row, V, [&](int32_t i, float x) {
    if (i < V) detail::argmax_take(x, i, bv, bi);  // each thread's ids in ascending order
  });
  detail::block_argmax_merge(bv, bi, cm.sval, cm.sidx);
  if (threadIdx.x == 0) cm.bc.result = layout::argmax_finish(isnan(row[0]), bi);
  __syncthreads();
  const int32_t r = cm.bc.result;
  __syncthreads();
  return r;
}

// ------------------------------------------------------------------ the kept set of a row
struct OrderKey {
  __device__ uint32_t operator()(float x) const { return sl::order_key(x); }
};
struct TopkKey {
  __device__ uint32_t operator()(float x) const { return sl::topk_key(x); }
};

// The kept masses of a row (0 outside the kept set).
// Each weight functor reads row[i] once, through at(row[i], i): the walks load ahead.
struct MassW {
  const float* row;
  sl::RowSel s;
  __device__ const float* src() const { return row; }
  __device__ double at(float x, int32_t i) const { return sl::keep(s, sl::order_key(x), i) ? mass_of(x, s) : 0.0; }
  __device__ double operator()(int32_t i) const { return at(row[i], i); }
};
// Top-k-kept masses (before top-p).
struct MassK {
  const float* row;
  sl::RowSel s;
  __device__ const float* src() const { return row; }
  __device__ double at(float x, int32_t i) const { return sl::keep_k(s, sl::order_key(x), i) ? mass_of(x, s) : 0.0; }
};

struct TieK {  // key == kth (sampler keys)
  const float* row;
  uint32_t kth;
  __device__ bool at(float x, int32_t) const { return sl::order_key(x) == kth; }
};
struct TieP {  // key == tau among the top-k-kept
  const float* row;
  sl::RowSel s;
  __device__ bool at(float x, int32_t i) const {
    const uint32_t k = sl::order_key(x);
    return k == s.tau && sl::keep_k(s, k, i);
  }
};
struct TieTopk {  // topk's keys
  const float* row;
  uint32_t kth;
  __device__ bool at(float x, int32_t) const { return sl::topk_key(x) == kth; }
};

template <class WF>
__device__ double block_sum(const WF& wf, int32_t V, Common& cm) {
  double s = 0.0;  // each thread's ids in ascending order
  warp_walk_all(wf.src(), V, [&](int32_t i, float x) {
    if (i < V) s += wf.at(x, i);
  });
  return detail::block_reduce(s, cm.dred, detail::SumOp{}, 0.0);
}

// One top-p radix pass over row[c0, c1): the mass histogram (hist, summed over the warps'
// private histograms whist in warp order) and counts (cm.chist) of the top-k-kept keys with
// (key & mask) == prefix and nonzero mass, at `shift`; returns the thread's sum of those
// masses (the first pass's, where every kept element qualifies, is z's share).
__device__ double mass_hist_pass(const float* row, int32_t c0, int32_t c1, const sl::RowSel& s, uint32_t prefix,
                                 uint32_t mask, int shift, double* whist, double* stage, double* hist, Common& cm) {
  const int lane = lane_id(), warp = warp_id(), nw = num_warps();
  double* wh = whist + warp * 256;
  double* st = stage + warp * 32;
  for (int b = lane; b < 256; b += 32) wh[b] = 0.0;
  for (int b = threadIdx.x; b < 256; b += blockDim.x) cm.chist[b] = 0;
  __syncthreads();
  double zs = 0.0;
  const int32_t n = c1 - c0;
  warp_walk_all(row + c0, n, [&](int32_t i, float x) {
    int bin = 256;
    double w = 0.0;
    if (i < n) {
      const uint32_t k = sl::order_key(x);
      if ((k & mask) == prefix && sl::keep_k(s, k, c0 + i)) {
        w = mass_of(x, s);
        zs += w;
        if (!(w == 0.0)) bin = int((k >> shift) & 255u);  // the CPU skips w == 0 (not NaN)
      }
    }
    const unsigned m = __match_any_sync(kFull, bin);
    st[lane] = w;
    __syncwarp();
    if (bin < 256 && lane == __ffs(int(m)) - 1) {
      double g = 0.0;
      for (unsigned mm = m; mm; mm &= mm - 1) g += st[__ffs(int(mm)) - 1];
      wh[bin] += g;  // the leaders of one warp hold distinct bins
      atomicAdd(&cm.chist[bin], uint32_t(__popc(int(m))));
    }
    __syncwarp();
  });
  __syncthreads();
  for (int b = threadIdx.x; b < 256; b += blockDim.x) {
    double h = 0.0;
    for (int w = 0; w < nw; ++w) h += whist[w * 256 + b];
    hist[b] = h;
  }
  __syncthreads();
  return zs;
}

// The top-p radix selection over the top-k-kept masses (cpu radix_select with masses):
// returns tau; *above: the mass of keys > tau; *n_tie: how many kept elements with
// nonzero mass have key tau.
__device__ uint32_t radix_mass(const float* row, int32_t V, const sl::RowSel& s, double target, SelShared& sm,
                               double* above, uint32_t* n_tie) {
  Common& cm = sm.cm;
  uint32_t prefix = 0, mask = 0;
  double acc = 0.0;
  uint32_t cnt = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    mass_hist_pass(row, 0, V, s, prefix, mask, shift, sm.whist, sm.stage, sm.hist, cm);
    radix_pass_pick(sm.hist, shift, target, cm, prefix, mask, acc, cnt);
  }
  *above = acc;
  *n_tie = cnt;
  return prefix;
}

// The kept set of one row (cpu row_masses); need_z: also the sum of the kept masses.
__device__ sl::RowSel select_row(const float* row, int32_t V, float temperature, float top_p, int32_t top_k,
                                 bool need_z, SelShared& sm) {
  Common& cm = sm.cm;
  sl::RowSel s;
  s.invT = 1.0 / double(temperature);
  float mxf = -INFINITY;
  warp_walk_all(row, V, [&](int32_t i, float v) {
    if (i < V) mxf = mxf < v ? v : mxf;  // NaN ignored, as the CPU's std::max
  });
  mxf = detail::block_reduce(mxf, cm.fred, detail::MaxOp{}, -INFINITY);
  s.mx = __dmul_rn(double(mxf), s.invT);
  s.use_k = sl::uses_top_k(top_k, V) ? 1 : 0;
  if (s.use_k) {
    double gt;
    uint32_t n_eq;
    s.kth = radix_count(row, V, double(top_k), OrderKey{}, cm, &gt, &n_eq);
    const int64_t ties_left = int64_t(top_k) - int64_t(gt);
    s.k_last = ties_left >= int64_t(n_eq) ? kAll : nth_index(TieK{row, s.kth}, V, ties_left, cm);
  }
  s.use_p = 0;
  double z = 0.0;
  const bool use_p = sl::uses_top_p(top_p);
  if (use_p || need_z) z = block_sum(MassK{row, s}, V, cm);
  if (use_p) {
    const double target = double(top_p) * z;
    double above;
    uint32_t n_tie;
    s.tau = radix_mass(row, V, s, target, sm, &above, &n_tie);
    if (threadIdx.x == 0) {
      const double wt = mass_of(sl::key_float(s.tau), s);
      cm.bc.n = int32_t(sl::topp_ties_kept(above, wt, target, int64_t(n_tie)));
    }
    __syncthreads();
    const int64_t n_keep = cm.bc.n;
    __syncthreads();
    s.use_p = 1;
    s.p_last = n_keep >= int64_t(n_tie) ? kAll : (n_keep == 0 ? -1 : nth_index(TieP{row, s}, V, n_keep, cm));
    if (need_z) z = block_sum(MassW{row, s}, V, cm);
  }
  s.z = z;
  return s;
}

__device__ __forceinline__ double draw_u(const int64_t* rng, int64_t rs0, int64_t rs1, int64_t r, uint64_t j) {
  const int64_t* st = rng + r * rs0;
  return philox::uniform(uint64_t(st[0]), uint64_t(st[rs1]) + j);
}

__device__ __forceinline__ int32_t clamp_i32(int64_t v, int64_t lo, int64_t hi) {
  return int32_t(v < lo ? lo : (v > hi ? hi : v));
}

// ------------------------------------------------------------------ sample
struct ParamPtrs {
  const float* temp;
  int64_t ts;
  const float* top_p;
  int64_t ps;
  const int32_t* top_k;
  int64_t ks;
  const int64_t* rng;
  int64_t rs0, rs1;
};

__global__ void __launch_bounds__(kSelThreads)
    sample_kernel(const float* __restrict__ lg, int64_t ls, int32_t V, int64_t R, ParamPtrs pp, int32_t* out,
                  int64_t os) {
  detail::pdl_enter();
  __shared__ SelShared sm;
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const float* row = lg + r * ls;
    const float temp = pp.temp[r * pp.ts];
    int32_t tok;
    if (temp <= 0.0f) {
      tok = block_argmax(row, V, sm.cm);
    } else {
      const sl::RowSel s = select_row(row, V, temp, pp.top_p[r * pp.ps], pp.top_k[r * pp.ks], false, sm);
      double total;
      tok = block_pick(MassW{row, s}, V, draw_u(pp.rng, pp.rs0, pp.rs1, r, 0), true, sm.cm, &total);
    }
    if (threadIdx.x == 0) out[r * os] = tok;
    __syncthreads();
  }
}

// ------------------------------------------------------------------ accept
struct RowInfo {
  sl::RowSel sel;
  double pd;       // p(d_j) of the drafted token (sampling)
  int32_t argmax;  // greedy
  int32_t pad;
};

struct AcceptArgs {
  const float* lg;
  int64_t ls, M;
  int32_t V;
  const int32_t* row0;
  int64_t r0s;
  const int32_t* draft;
  int64_t ds, N, K;
  const int32_t* draft_row;
  int64_t drs;
  const int32_t* draft_len;
  int64_t dls;
  const int32_t* cand;
  int64_t cs0, cs1;
  const float* q;
  int64_t qs0, qs1, C;
  ParamPtrs pp;
  RowInfo* info;
  int64_t S;
};

__device__ __forceinline__ int64_t draft_len_of(const AcceptArgs& a, int64_t s) {
  if (a.N <= 0) return 0;
  return clamp_i32(a.draft_len[s * a.dls], 0, a.K);
}
__device__ __forceinline__ const float* logits_row(const AcceptArgs& a, int64_t s, int64_t j) {
  const int64_t r = int64_t(a.row0[s * a.r0s]) + j;
  return a.lg + int64_t(clamp_i32(r, 0, a.M - 1)) * a.ls;
}
__device__ __forceinline__ const int32_t* draft_of(const AcceptArgs& a, int64_t s) {
  return a.draft + int64_t(clamp_i32(a.draft_row[s * a.drs], 0, a.N - 1)) * a.ds;
}
__device__ __forceinline__ int64_t drow_of(const AcceptArgs& a, int64_t s) {
  return clamp_i32(a.draft_row[s * a.drs], 0, a.N - 1);
}

// One block per (sequence s, target row j <= draft_len[s]): the row's kept set, z and
// p(d_j), or its argmax.
__global__ void __launch_bounds__(kSelThreads) accept_rows_kernel(AcceptArgs a) {
  detail::pdl_enter();
  __shared__ SelShared sm;
  const int64_t per = a.K + 1;
  for (int64_t idx = blockIdx.x; idx < a.S * per; idx += gridDim.x) {
    const int64_t s = idx / per, j = idx % per;
    const int64_t L = draft_len_of(a, s);
    if (j > L) continue;  // uniform over the block
    const float* row = logits_row(a, s, j);
    RowInfo* inf = a.info + idx;
    const float temp = a.pp.temp[s * a.pp.ts];
    if (temp <= 0.0f) {
      const int32_t am = block_argmax(row, a.V, sm.cm);
      if (threadIdx.x == 0) inf->argmax = am;
    } else {
      const sl::RowSel sel =
          select_row(row, a.V, temp, a.pp.top_p[s * a.pp.ps], a.pp.top_k[s * a.pp.ks], true, sm);
      if (threadIdx.x == 0) {
        double pd = 0.0;
        if (j < L) {
          const int32_t tok = draft_of(a, s)[j];
          if (tok >= 0 && tok < a.V) pd = MassW{row, sel}(tok) / sel.z;
        }
        inf->sel = sel;
        inf->pd = pd;
      }
    }
    __syncthreads();
  }
}

// The residual masses of a rejected position: p outside the candidates, max(p - q, 0) on
// them (the last duplicate of a candidate wins, as the CPU's overwrite order).
struct ResidualW {
  MassW p;
  const int32_t* cid;
  const float* cq;
  int32_t nc;
  __device__ const float* src() const { return p.row; }
  __device__ double at(float x, int32_t i) const {
    const double pi = p.at(x, i) / p.s.z;
    int32_t c = -1;
    for (int32_t k = 0; k < nc; ++k)
      if (cid[k] == i) c = k;
    return c < 0 ? pi : sl::residual(pi, double(cq[c]));
  }
};

// Sequence s's greedy acceptance (one thread): the longest prefix of its L drafts equal to
// the argmax of their rows (argmax_of(j)); *bonus: the argmax after it.
template <class AM>
__device__ int64_t greedy_accepted(const AcceptArgs& a, int64_t s, int64_t L, AM argmax_of, int32_t* bonus) {
  int64_t n = 0;
  const int32_t* d = L > 0 ? draft_of(a, s) : nullptr;
  while (n < L && d[n] == argmax_of(n)) ++n;
  *bonus = argmax_of(n);
  return n;
}

// Sequence s's sampled acceptance decisions (one thread), in order: draft j is accepted iff
// u_j * q(d_j) < p(d_j) (q from the K-wide candidates, or 1), p(d_j) = pd_of(j).
template <class PD>
__device__ int64_t sampled_accepted(const AcceptArgs& a, int64_t s, int64_t L, PD pd_of) {
  int64_t n = 0;
  if (L <= 0) return 0;
  const int32_t* d = draft_of(a, s);
  const int64_t dr = drow_of(a, s);
  for (; n < L; ++n) {
    const int32_t tok = d[n];
    double qd = 1.0;
    if (a.q) {
      const int32_t* cd = a.cand + dr * a.cs0 + n * a.cs1;
      const float* qr = a.q + dr * a.qs0 + n * a.qs1;
      for (int64_t c = 0; c < a.C; ++c)
        if (cd[c] == tok) {
          qd = qr[c];
          break;
        }
    }
    if (!sl::accept_draft(draw_u(a.pp.rng, a.pp.rs0, a.pp.rs1, s, uint64_t(n)), qd, pd_of(n))) break;
  }
  return n;
}

// The candidates of sequence s's rejected position n for the residual: the K-wide q's (in
// shared memory when they fit, else read in place), or the drafted token with q = 1. All
// threads call (a barrier when staging).
struct Cands {
  const int32_t* cid;
  const float* cq;
  int32_t nc;
};
__device__ Cands rejected_candidates(const AcceptArgs& a, int64_t s, int64_t n, int32_t* scid, float* scq) {
  const int64_t dr = drow_of(a, s);
  if (a.q && a.C > kSharedCand) return Cands{a.cand + dr * a.cs0 + n * a.cs1, a.q + dr * a.qs0 + n * a.qs1, int32_t(a.C)};
  int32_t nc;
  if (a.q) {
    for (int64_t c = threadIdx.x; c < a.C; c += blockDim.x) {
      scid[c] = a.cand[dr * a.cs0 + n * a.cs1 + c];
      scq[c] = a.q[dr * a.qs0 + n * a.qs1 + c];
    }
    nc = int32_t(a.C);
  } else {
    if (threadIdx.x == 0) {
      scid[0] = draft_of(a, s)[n];
      scq[0] = 1.0f;
    }
    nc = 1;
  }
  __syncthreads();
  return Cands{scid, scq, nc};
}

// One block per sequence: the sequential accept decisions, then the bonus draw.
// (minBlocks 1 spelled out: without it ptxas held this kernel to 64 registers and spilled)
__global__ void __launch_bounds__(kSelThreads, 1) accept_final_kernel(AcceptArgs a, int32_t* accepted, int64_t as,
                                                                   int32_t* bonus, int64_t bs) {
  detail::pdl_enter();
  __shared__ SelShared sm;
  Common& cm = sm.cm;
  const int64_t per = a.K + 1;
  for (int64_t s = blockIdx.x; s < a.S; s += gridDim.x) {
    const int64_t L = draft_len_of(a, s);
    const RowInfo* inf = a.info + s * per;
    const float temp = a.pp.temp[s * a.pp.ts];
    if (temp <= 0.0f) {
      if (threadIdx.x == 0) {
        int32_t b;
        accepted[s * as] = int32_t(greedy_accepted(a, s, L, [&](int64_t j) { return inf[j].argmax; }, &b));
        bonus[s * bs] = b;
      }
      continue;  // uniform over the block; nothing shared was touched
    }
    if (threadIdx.x == 0) cm.bc.n = int32_t(sampled_accepted(a, s, L, [&](int64_t j) { return inf[j].pd; }));
    __syncthreads();
    const int64_t n = cm.bc.n;
    __syncthreads();
    const double uK = draw_u(a.pp.rng, a.pp.rs0, a.pp.rs1, s, uint64_t(a.K));
    int32_t b;
    double total;
    if (n < L) {  // rejected at n: the residual
      const float* row = logits_row(a, s, n);
      const MassW p{row, inf[n].sel};
      const Cands cs = rejected_candidates(a, s, n, sm.cid, sm.cq);
      b = block_pick(ResidualW{p, cs.cid, cs.cq, cs.nc}, a.V, uK, true, cm, &total);
      if (!(total > 0.0)) b = block_pick(p, a.V, uK, true, cm, &total);  // no residual mass left
    } else {  // all accepted: from p of the last row
      b = block_pick(MassW{logits_row(a, s, L), inf[L].sel}, a.V, uK, true, cm, &total);
    }
    if (threadIdx.x == 0) {
      accepted[s * as] = int32_t(n);
      bonus[s * bs] = b;
    }
    __syncthreads();
  }
}

// ------------------------------------------------------------------ wide rows
// A row longer than kChunk is split over P = ceil(V / kChunk) blocks, one per chunk of
// kChunk ids, and each step of the procedure above becomes one launch over (chunk, task):
// every block reduces its chunk to a partial (a count / mass histogram, a sum, a max, an
// argmax, the last id with mass) in scratch, counts itself in on the task's arrival counter
// (detail::zeroed_counters; the last block resets it), and the task's last block combines
// the P partials in chunk order, makes the step's decision exactly as the one-block kernels
// do (radix_pass_pick, topp_ties_kept, the ordered picks, which it runs over the one chunk
// that holds the crossing) and writes the task's state for the next launch. A task is a
// sampled row (sample) or a (sequence, target row) of accept. The launches:
//   kStMax        max (argmax for greedy rows), and top-k's count pass at bits 24..31;
//   kStK2..kStK4  top-k's count passes at bits 16, 8, 0; the last resolves the ties (k_last);
//   kStZ          z over the top-k kept (top-p rows), and top-p's mass pass at bits 24..31;
//   kStP2..kStP4  top-p's mass passes; the last resolves the ties (p_last);
//   kStW          the kept masses' sum: z for accept (and p of the drafted token), the
//                 draw for sample;
//   accept_wide_final_kernel  per sequence: the accept decisions (every block redoes them:
//                 thread 0, at most K steps), the bonus draw's partial sums (residual and p),
//                 the last block's draw.
// A launch with nothing to do for a task (a greedy row past kStMax, a row without top-k /
// top-p in those passes) returns at once. Each chunk's reduction order depends on V only,
// the chunks combine in order, so results are deterministic and do not depend on how many
// rows run together; the sums round differently from the one-block kernels (which the op
// keeps for V <= kChunk and for more than kMaxWideTasks tasks).
constexpr int kWideThreads = 256;
constexpr int kWideWarps = kWideThreads / 32;
constexpr int32_t kChunk = 4096;
constexpr int32_t kMaxParts = 1024;        // chunks per row (rows up to 4M ids)
constexpr int64_t kMaxWideTasks = detail::kCounterWords;
constexpr int64_t kMaxWideParts = 16384;   // tasks x chunks (the partials' scratch: ~3 KB each)
constexpr int64_t kWideTopk = 64;          // topk over chunks up to this k (topk_merge's cost ~ k^2 P / 32)

enum WideStage : int { kStMax = 0, kStK2, kStK3, kStK4, kStZ, kStP2, kStP3, kStP4, kStW, kNumStages };

// A task's state between launches (written by its last block of each launch).
struct WideTask {
  const float* row;
  sl::RowSel sel;
  double acc, target;  // the running radix selection
  double pd;           // accept: p(d_j)
  uint32_t prefix, mask, cnt;
  int32_t kind;        // kInactive, kGreedy, kSampled
  int32_t want_k, want_p;
  int32_t argmax;      // greedy
  int32_t pad;
};
constexpr int32_t kInactive = 0, kGreedy = 1, kSampled = 2;

// One chunk's partial of one launch.
struct WidePart {
  double sum, sum2;
  float mx, amv;
  int32_t ami, last, last2, pad;
};

struct WideArgs {
  AcceptArgs a;  // sample: S = R tasks, K = 0, row0 == nullptr (task r is row r)
  int32_t* out;  // sample: the tokens
  int64_t os;
  int64_t T;     // tasks: S (sample) or S (K + 1) (accept)
  int32_t P;     // chunks per row
  WideTask* task;
  WidePart* part;   // [T][P]
  double* mhist;    // [T][P][256]
  uint32_t* chist;  // [T][P][256]
  uint32_t* arrivals;
};

struct WideShared : SelSharedW<kWideWarps> {
  double pv[kMaxParts];  // the chunks' partials, loaded by the whole block for thread 0's scans
  float pf[kMaxParts];
  int32_t pl[kMaxParts];
  int32_t last;
};

__device__ __forceinline__ int32_t chunk_end(int32_t c, int32_t V) {
  const int64_t e = int64_t(c + 1) * kChunk;
  return int32_t(e < V ? e : V);
}

// The task's row and parameters (every block of the first launch forms them alike).
struct TaskParams {
  const float* row;
  float temp, top_p;
  int32_t top_k;
  bool active;
};
__device__ TaskParams task_params(const WideArgs& w, int64_t t) {
  const AcceptArgs& a = w.a;
  TaskParams p;
  int64_t s = t;
  if (a.row0) {
    const int64_t per = a.K + 1;
    s = t / per;
    const int64_t j = t % per;
    p.active = j <= draft_len_of(a, s);
    p.row = logits_row(a, s, j);
  } else {
    p.active = true;
    p.row = a.lg + t * a.ls;
  }
  p.temp = a.pp.temp[s * a.pp.ts];
  p.top_p = a.pp.top_p[s * a.pp.ps];
  p.top_k = a.pp.top_k[s * a.pp.ks];
  return p;
}

// Counts this block in on task t's arrival counter; true in every thread of its last block
// (which then sees every block's partials through __ldcg).
__device__ bool wide_last_block(const WideArgs& w, int64_t t, WideShared& sh) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const bool last = atomicAdd(&w.arrivals[t], 1u) == uint32_t(w.P) - 1u;
    if (last) w.arrivals[t] = 0u;  // every later block of this launch has counted itself in
    sh.last = last ? 1 : 0;
  }
  __syncthreads();
  const bool last = sh.last != 0;
  if (last) __threadfence();
  return last;
}

// Block-wide max of an int32 (all threads call; every thread gets it).
__device__ int32_t block_max_i32(int32_t v, Common& cm) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = max(v, __shfl_xor_sync(kFull, v, off));
  if (lane_id() == 0) cm.wlast[warp_id()] = v;
  __syncthreads();
  int32_t r = -1;
  for (int i = 0; i < num_warps(); ++i) r = max(r, cm.wlast[i]);
  __syncthreads();
  return r;
}

// Sum and last id with mass of wf over the chunk [c0, c1) (each thread's ids ascending, then
// the block reduction: a function of the chunk only), stored as the chunk's partial (sum /
// last, or sum2 / last2 when `second`).
template <class WF>
__device__ void chunk_sum(const WF& wf, int32_t c0, int32_t c1, Common& cm, WidePart* part, bool second) {
  double s = 0.0;
  int32_t lst = -1;
  const int32_t n = c1 - c0;
  warp_walk_all(wf.src() + c0, n, [&](int32_t i, float x) {
    if (i < n) {
      const double v = wf.at(x, c0 + i);
      s += v;
      if (v > 0.0) lst = c0 + i;
    }
  });
  s = detail::block_reduce(s, cm.dred, detail::SumOp{}, 0.0);
  lst = block_max_i32(lst, cm);
  if (threadIdx.x == 0) {
    (second ? part->sum2 : part->sum) = s;
    (second ? part->last2 : part->last) = lst;
  }
}

// Stores this block's histograms (counts; masses when `masses`) as chunk c's partial.
__device__ void put_hists(const WideArgs& w, int64_t t, int32_t c, bool masses, const WideShared& sm) {
  const int64_t o = (t * w.P + c) * 256;
  for (int b = threadIdx.x; b < 256; b += blockDim.x) {
    w.chist[o + b] = sm.cm.chist[b];
    if (masses) w.mhist[o + b] = sm.hist[b];
  }
}

// Last block: the chunks' histograms summed in chunk order into cm.chist (and sm.hist).
__device__ void combine_hists(const WideArgs& w, int64_t t, bool masses, WideShared& sm) {
  for (int b = threadIdx.x; b < 256; b += blockDim.x) {
    uint32_t c = 0;
    double h = 0.0;
    const int64_t o = t * w.P * 256 + b;
#pragma unroll 8
    for (int32_t p = 0; p < w.P; ++p) {
      c += __ldcg(&w.chist[o + int64_t(p) * 256]);
      if (masses) h += __ldcg(&w.mhist[o + int64_t(p) * 256]);
    }
    sm.cm.chist[b] = c;
    sm.hist[b] = h;
  }
  __syncthreads();
}

// Last block: the chunk holding the n-th (1-based) of the counts chist[.][bin] in chunk
// order, and how many come before it (bc.d, bc.n). Thread 0 scans (counts are exact).
__device__ void chunk_of_nth(const WideArgs& w, int64_t t, int bin, int64_t nth, WideShared& sh) {
  Common& cm = sh.cm;
  for (int32_t p = threadIdx.x; p < w.P; p += blockDim.x) sh.pl[p] = int32_t(__ldcg(&w.chist[(t * w.P + p) * 256 + bin]));
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t before = 0;
    int32_t c = w.P - 1;
    for (int32_t p = 0; p < w.P; ++p) {
      const int64_t k = sh.pl[p];
      if (before + k >= nth) {
        c = p;
        break;
      }
      before += k;
    }
    cm.bc.d = c;
    cm.bc.n = int32_t(before);
  }
  __syncthreads();
}

// Last block: the chunks' sums (sum2 when `second`) in chunk order: the total and the last id
// with mass over the chunks; with `find`, also the first chunk with mass whose inclusive
// cumulative sum exceeds u * total (-1: none) with its exclusive prefix (else chunk -1,
// excl 0). Every thread gets them.
struct ChunkPick {
  double total, excl;
  int32_t chunk, last;
};
__device__ ChunkPick pick_chunk(const WideArgs& w, int64_t t, bool second, double u, WideShared& sh,
                                bool find = true) {
  Common& cm = sh.cm;
  for (int32_t p = threadIdx.x; p < w.P; p += blockDim.x) {
    const WidePart* q = &w.part[t * w.P + p];
    sh.pv[p] = __ldcg(second ? &q->sum2 : &q->sum);
    sh.pl[p] = __ldcg(second ? &q->last2 : &q->last);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double tot = 0.0;
    int32_t last = -1;
    for (int32_t p = 0; p < w.P; ++p) {
      tot = tot + sh.pv[p];
      last = max(last, sh.pl[p]);
    }
    const double x = u * tot;
    double ex = 0.0;
    int32_t c = -1;
    double cex = 0.0;
    for (int32_t p = 0; find && p < w.P; ++p) {
      const double v = sh.pv[p];
      if (v > 0.0 && x < ex + v) {
        c = p;
        cex = ex;
        break;
      }
      ex = ex + v;
    }
    cm.bc.total = tot;
    cm.bc.x = cex;
    cm.bc.d = c;
    cm.bc.result = last;
  }
  __syncthreads();
  const ChunkPick r{cm.bc.total, cm.bc.x, cm.bc.d, cm.bc.result};
  __syncthreads();
  return r;
}

// Last block: the draw x = u * total from the weights wf over the row (r from pick_chunk).
template <class WF>
__device__ int32_t wide_draw(const WF& wf, int32_t V, double u, const ChunkPick& r, Common& cm) {
  if (r.chunk < 0) return r.last < 0 ? 0 : r.last;  // rounding: the last id with mass
  double total;
  return block_pick_in(wf, r.chunk * kChunk, chunk_end(r.chunk, V), u * r.total, false, r.excl, cm, &total);
}

// Last block: the id of the nth element with pred in the row, given the chunk of it.
template <class Pred>
__device__ int32_t wide_nth(Pred pred, int32_t V, int64_t nth, const WideArgs& w, int64_t t, int bin, WideShared& sh) {
  Common& cm = sh.cm;
  chunk_of_nth(w, t, bin, nth, sh);
  const int32_t c = cm.bc.d;
  const int64_t before = cm.bc.n;
  __syncthreads();
  double total;
  return block_pick_in(CountW<Pred>{pred}, c * kChunk, chunk_end(c, V), double(nth - before - 1), false, 0.0, cm,
                       &total);
}

__device__ void put_task(WideTask* dst, const WideTask& t) {
  if (threadIdx.x == 0) *dst = t;
}

// (minBlocks 2: without it ptxas held sm_100a to 64 registers and spilled)
__global__ void __launch_bounds__(kWideThreads, 2) wide_rows_kernel(WideArgs w, int stage) {
  detail::pdl_enter();
  __shared__ WideShared sh;
  WideShared& sm = sh;
  Common& cm = sh.cm;
  const int32_t c = int32_t(blockIdx.x);
  const int64_t t = int64_t(blockIdx.y);
  const int32_t V = w.a.V;
  const int32_t c0 = c * kChunk, c1 = chunk_end(c, V);
  WidePart* part = &w.part[t * w.P + c];
  if (stage == kStMax) {
    const TaskParams tp = task_params(w, t);
    if (!tp.active) {
      if (c == 0 && threadIdx.x == 0) w.task[t].kind = kInactive;
      return;
    }
    const bool greedy = tp.temp <= 0.0f;
    const bool use_k = !greedy && sl::uses_top_k(tp.top_k, V);
    float mxf = -INFINITY, bv = -INFINITY;
    int32_t bi = layout::kArgmaxNone;
    warp_walk_all(tp.row + c0, c1 - c0, [&](int32_t i, float x) {
      if (i < c1 - c0) {
        mxf = mxf < x ? x : mxf;  // NaN ignored, as the CPU's std::max
        detail::argmax_take(x, c0 + i, bv, bi);
      }
    });
    mxf = detail::block_reduce(mxf, cm.fred, detail::MaxOp{}, -INFINITY);
    detail::block_argmax_merge(bv, bi, cm.sval, cm.sidx);
    if (threadIdx.x == 0) {
      part->mx = mxf;
      part->amv = bv;
      part->ami = bi;
    }
    __syncthreads();
    if (use_k) {
      count_hist_pass(tp.row, c0, c1, OrderKey{}, 0u, 0u, 24, cm);
      put_hists(w, t, c, false, sm);
    }
    if (!wide_last_block(w, t, sh)) return;
    WideTask tk{};
    tk.row = tp.row;
    tk.kind = greedy ? kGreedy : kSampled;
    for (int32_t p = threadIdx.x; p < w.P; p += blockDim.x) {
      const WidePart* q = &w.part[t * w.P + p];
      sh.pv[p] = __ldcg(&q->mx);
      sh.pf[p] = __ldcg(&q->amv);
      sh.pl[p] = __ldcg(&q->ami);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float m = -INFINITY, av = -INFINITY;
      int32_t ai = layout::kArgmaxNone;
      for (int32_t p = 0; p < w.P; ++p) {
        const float pm = float(sh.pv[p]);
        m = m < pm ? pm : m;
        const float qv = sh.pf[p];
        const int32_t qi = sh.pl[p];
        if (qi != layout::kArgmaxNone && layout::argmax_better(qv, qi, av, ai)) {
          av = qv;
          ai = qi;
        }
      }
      cm.fred[0] = m;
      cm.sidx[0] = layout::argmax_finish(isnan(tp.row[0]), ai);
    }
    __syncthreads();
    tk.argmax = cm.sidx[0];
    if (greedy) {
      if (!w.a.row0 && threadIdx.x == 0) w.out[t * w.os] = tk.argmax;
      put_task(&w.task[t], tk);
      return;
    }
    tk.sel.invT = 1.0 / double(tp.temp);
    tk.sel.mx = __dmul_rn(double(cm.fred[0]), tk.sel.invT);
    tk.sel.use_k = 0;
    tk.sel.use_p = 0;
    tk.want_k = use_k ? 1 : 0;
    tk.want_p = sl::uses_top_p(tp.top_p) ? 1 : 0;
    tk.target = double(tp.top_p);  // kStZ scales it by z
    if (use_k) {
      combine_hists(w, t, false, sm);
      double acc = 0.0;
      uint32_t prefix = 0, mask = 0, cnt = 0;
      radix_pass_pick(cm.chist, 24, double(tp.top_k), cm, prefix, mask, acc, cnt);
      tk.prefix = prefix;
      tk.mask = mask;
      tk.acc = acc;
      tk.cnt = cnt;
      tk.sel.kth = uint32_t(tp.top_k);  // the target until kStK4 (the top_k count)
    }
    put_task(&w.task[t], tk);
    return;
  }
  WideTask tk = w.task[t];
  if (tk.kind != kSampled) return;
  if (stage >= kStK2 && stage <= kStK4) {
    if (!tk.want_k) return;
    const int shift = 24 - 8 * (stage - kStMax);
    count_hist_pass(tk.row, c0, c1, OrderKey{}, tk.prefix, tk.mask, shift, cm);
    put_hists(w, t, c, false, sm);
    if (!wide_last_block(w, t, sh)) return;
    combine_hists(w, t, false, sm);
    const int64_t top_k = tk.sel.kth;
    radix_pass_pick(cm.chist, shift, double(top_k), cm, tk.prefix, tk.mask, tk.acc, tk.cnt);
    if (shift == 0) {  // kth = prefix: the ties
      tk.sel.kth = tk.prefix;
      tk.sel.use_k = 1;
      const int64_t ties_left = top_k - int64_t(tk.acc);
      tk.sel.k_last = ties_left >= int64_t(tk.cnt)
                          ? kAll
                          : wide_nth(TieK{tk.row, tk.sel.kth}, V, ties_left, w, t, int(tk.prefix & 255u), sh);
      tk.prefix = tk.mask = 0;
      tk.acc = 0.0;
    }
    put_task(&w.task[t], tk);
    return;
  }
  if (stage >= kStZ && stage <= kStP4) {
    if (!tk.want_p) return;
    const int shift = 24 - 8 * (stage - kStZ);
    const double zs = mass_hist_pass(tk.row, c0, c1, tk.sel, tk.prefix, tk.mask, shift, sm.whist, sm.stage, sm.hist, cm);
    put_hists(w, t, c, true, sm);
    if (stage == kStZ) {
      const double z = detail::block_reduce(zs, cm.dred, detail::SumOp{}, 0.0);
      if (threadIdx.x == 0) part->sum = z;
    }
    if (!wide_last_block(w, t, sh)) return;
    if (stage == kStZ) {
      for (int32_t p = threadIdx.x; p < w.P; p += blockDim.x) sh.pv[p] = __ldcg(&w.part[t * w.P + p].sum);
      __syncthreads();
      if (threadIdx.x == 0) {
        double z = 0.0;
        for (int32_t p = 0; p < w.P; ++p) z = z + sh.pv[p];
        cm.bc.total = z;
      }
      __syncthreads();
      tk.sel.z = cm.bc.total;
      tk.target = tk.target * tk.sel.z;  // top_p * z
      __syncthreads();
    }
    combine_hists(w, t, true, sm);
    radix_pass_pick(sm.hist, shift, tk.target, cm, tk.prefix, tk.mask, tk.acc, tk.cnt);
    if (shift == 0) {
      tk.sel.tau = tk.prefix;
      const int64_t n_tie = tk.cnt;
      const double wt = mass_of(sl::key_float(tk.sel.tau), tk.sel);
      const int64_t n_keep = sl::topp_ties_kept(tk.acc, wt, tk.target, n_tie);
      tk.sel.p_last = n_keep >= n_tie ? kAll
                      : n_keep == 0   ? -1
                                      : wide_nth(TieP{tk.row, tk.sel}, V, n_keep, w, t, int(tk.prefix & 255u), sh);
      tk.sel.use_p = 1;
    }
    put_task(&w.task[t], tk);
    return;
  }
  // kStW: the kept masses.
  const MassW mw{tk.row, tk.sel};
  chunk_sum(mw, c0, c1, cm, part, false);
  if (!wide_last_block(w, t, sh)) return;
  if (!w.a.row0) {  // sample: the draw
    const double u = draw_u(w.a.pp.rng, w.a.pp.rs0, w.a.pp.rs1, t, 0);
    const ChunkPick r = pick_chunk(w, t, false, u, sh);
    const int32_t tok = wide_draw(mw, V, u, r, cm);
    if (threadIdx.x == 0) w.out[t * w.os] = tok;
    return;
  }
  tk.sel.z = pick_chunk(w, t, false, 0.0, sh, /*find=*/false).total;  // accept: the total only
  if (threadIdx.x == 0) {
    const AcceptArgs& a = w.a;
    const int64_t per = a.K + 1, s = t / per, j = t % per;
    double pd = 0.0;
    if (j < draft_len_of(a, s)) {
      const int32_t tok = draft_of(a, s)[j];
      if (tok >= 0 && tok < V) pd = MassW{tk.row, tk.sel}(tok) / tk.sel.z;
    }
    tk.pd = pd;
    w.task[t] = tk;
  }
}

// accept, after the wide rows: grid (P, S).
__global__ void __launch_bounds__(kWideThreads, 1) accept_wide_final_kernel(WideArgs w, int32_t* accepted, int64_t as,
                                                                       int32_t* bonus, int64_t bs) {
  detail::pdl_enter();
  __shared__ WideShared sh;
  WideShared& sm = sh;
  Common& cm = sh.cm;
  const AcceptArgs& a = w.a;
  const int32_t c = int32_t(blockIdx.x);
  const int64_t s = int64_t(blockIdx.y);
  const int32_t V = a.V;
  const int32_t c0 = c * kChunk, c1 = chunk_end(c, V);
  const int64_t per = a.K + 1;
  const int64_t L = draft_len_of(a, s);
  const WideTask* tasks = w.task + s * per;
  const float temp = a.pp.temp[s * a.pp.ts];
  if (temp <= 0.0f) {
    if (c == 0 && threadIdx.x == 0) {
      int32_t b;
      accepted[s * as] = int32_t(greedy_accepted(a, s, L, [&](int64_t j) { return tasks[j].argmax; }, &b));
      bonus[s * bs] = b;
    }
    return;
  }
  if (threadIdx.x == 0) cm.bc.n = int32_t(sampled_accepted(a, s, L, [&](int64_t j) { return tasks[j].pd; }));
  __syncthreads();
  const int64_t n = cm.bc.n;
  __syncthreads();
  const int64_t t = s * per + (n < L ? n : L);
  const MassW p{tasks[n < L ? n : L].row, tasks[n < L ? n : L].sel};
  const double uK = draw_u(a.pp.rng, a.pp.rs0, a.pp.rs1, s, uint64_t(a.K));
  WidePart* part = &w.part[t * w.P + c];
  if (n < L) {  // rejected at n: the residual (and p, should no residual mass be left)
    const Cands cs = rejected_candidates(a, s, n, sm.cid, sm.cq);
    const ResidualW rw{p, cs.cid, cs.cq, cs.nc};
    chunk_sum(rw, c0, c1, cm, part, false);
    chunk_sum(p, c0, c1, cm, part, true);
    if (!wide_last_block(w, t, sh)) return;
    ChunkPick r = pick_chunk(w, t, false, uK, sh);
    int32_t b;
    if (r.total > 0.0) {
      b = wide_draw(rw, V, uK, r, cm);
    } else {  // no residual mass left
      r = pick_chunk(w, t, true, uK, sh);
      b = wide_draw(p, V, uK, r, cm);
    }
    if (threadIdx.x == 0) {
      accepted[s * as] = int32_t(n);
      bonus[s * bs] = b;
    }
    return;
  }
  // all accepted: from p of the last row
  chunk_sum(p, c0, c1, cm, part, false);
  if (!wide_last_block(w, t, sh)) return;
  const ChunkPick r = pick_chunk(w, t, false, uK, sh);
  const int32_t b = wide_draw(p, V, uK, r, cm);
  if (threadIdx.x == 0) {
    accepted[s * as] = int32_t(n);
    bonus[s * bs] = b;
  }
}

// ------------------------------------------------------------------ topk
__device__ void bitonic_sort(uint64_t* buf, int64_t n) {
  for (int64_t size = 2; size <= n; size <<= 1) {
    for (int64_t stride = size >> 1; stride > 0; stride >>= 1) {
      for (int64_t t = threadIdx.x; t < n / 2; t += blockDim.x) {
        const int64_t i = (t / stride) * stride * 2 + (t % stride);
        const int64_t j = i + stride;
        const bool up = (i & size) == 0;
        const uint64_t a = buf[i], b = buf[j];
        if ((a > b) == up) {
          buf[i] = b;
          buf[j] = a;
        }
      }
      __syncthreads();
    }
  }
}

__global__ void __launch_bounds__(kTopkThreads)
    topk_kernel(const float* __restrict__ x, int64_t xs, int32_t Vrow, int64_t rows, int32_t k, float* vals, int64_t vs,
                int32_t* idx, int64_t is, uint64_t* gbuf, int64_t npow2, int32_t P) {
  detail::pdl_enter();
  __shared__ Common cm;
  __shared__ uint64_t sbuf[kTopkShared];
  __shared__ uint32_t count;
  const int lane = lane_id();
  uint64_t* buf = gbuf ? gbuf + int64_t(blockIdx.x) * npow2 : sbuf;
  // P > 1: virtual row r is chunk r % P (kChunk ids; the last one what is left) of row r / P,
  // its ids local to the chunk (topk_merge adds the chunk's offset)
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* row = x + r * xs;
    int32_t V = Vrow;
    if (P > 1) {  // rows < 2^24 here (the host's check): 32-bit division
      const uint32_t q = uint32_t(r) / uint32_t(P), c = uint32_t(r) - q * uint32_t(P);
      row = x + int64_t(q) * xs + int64_t(c) * kChunk;
      V = min(kChunk, Vrow - int32_t(c) * kChunk);
    }
    uint32_t kth = 0;
    int32_t k_last = kAll;
    if (k < V) {
      double gt;
      uint32_t n_eq;
      kth = radix_count(row, V, double(k), TopkKey{}, cm, &gt, &n_eq);
      const int64_t ties_left = int64_t(k) - int64_t(gt);
      if (ties_left < int64_t(n_eq)) k_last = nth_index(TieTopk{row, kth}, V, ties_left, cm);
    }
    if (threadIdx.x == 0) count = 0;
    __syncthreads();
    warp_walk_all(row, V, [&](int32_t i, float x) {
      uint32_t key = 0;
      bool sel = false;
      if (i < V) {
        key = sl::topk_key(x);
        sel = key > kth || (key == kth && i <= k_last);
      }
      const unsigned bal = __ballot_sync(kFull, sel);
      if (bal == 0) return;
      uint32_t base = 0;
      if (lane == 0) base = atomicAdd(&count, uint32_t(__popc(int(bal))));
      base = __shfl_sync(kFull, base, 0);
      if (sel) {
        const uint32_t pos = base + uint32_t(__popc(int(bal & ((1u << lane) - 1u))));
        if (pos < uint64_t(npow2)) buf[pos] = sl::topk_sort_key(key, uint32_t(i));
      }
    });
    __syncthreads();
    const int64_t got = count;
    for (int64_t j = threadIdx.x; j < npow2; j += blockDim.x)
      if (j >= got) buf[j] = ~uint64_t(0);
    __syncthreads();
    bitonic_sort(buf, npow2);
    for (int64_t j = threadIdx.x; j < k; j += blockDim.x) {
      const uint32_t i = sl::topk_sort_index(buf[j]);
      const uint32_t ic = i < uint32_t(V) ? i : 0u;  // only if the kept count went wrong
      vals[r * vs + j] = row[ic];
      idx[r * is + j] = int32_t(ic);
    }
    __syncthreads();
  }
}

// ------------------------------------------------------------------ host checks
std::string desc(const Tensor& t) { return t.defined() ? t.describe() : std::string("<undefined>"); }

void need_on(const char* op, const Tensor& ref, const Tensor& t, const char* arg) {
  DFLASH2_CHECK_ARG(t.defined(), "cuda::", op, ": '", arg, "' is undefined");
  DFLASH2_CHECK_ARG(ref.device().is_cuda() && t.device() == ref.device(), "cuda::", op, ": '", arg,
                    "' must be on the CUDA device of the logits, found ", t.describe(), " and ", ref.describe());
}
void need_vec(const char* op, const Tensor& t, DType dt, int64_t n, const char* arg) {
  DFLASH2_CHECK_ARG(t.dtype() == dt && t.ndim() == 1 && t.shape(0) == n, "cuda::", op, ": '", arg, "' must be ",
                    dtype_name(dt), " [", n, "], found ", desc(t));
}
// logits F32 [rows, V] with contiguous rows.
layout::RowLayout need_logits(const char* op, const Tensor& x) {
  DFLASH2_CHECK_ARG(x.defined() && x.dtype() == DType::F32 && x.ndim() == 2, "cuda::", op,
                    ": logits must be F32 [rows, vocab], found ", desc(x));
  DFLASH2_CHECK_ARG(x.device().is_cuda(), "cuda::", op, ": logits must be on a CUDA device, found ", x.describe());
  const layout::RowLayout L = layout::row_layout(x, op, "logits");
  DFLASH2_CHECK_ARG(L.cols >= 1 && L.cols <= kMaxRowLen, "cuda::", op, ": rows of ", L.cols,
                    " elements are not supported (1 .. ", kMaxRowLen, ")");
  return L;
}
ParamPtrs params_of(const char* op, const Tensor& ref, const ops::SamplingTensors& sp, const Tensor& rng, int64_t R) {
  need_on(op, ref, sp.temperature, "temperature");
  need_on(op, ref, sp.top_p, "top_p");
  need_on(op, ref, sp.top_k, "top_k");
  need_on(op, ref, rng, "rng");
  need_vec(op, sp.temperature, DType::F32, R, "temperature");
  need_vec(op, sp.top_p, DType::F32, R, "top_p");
  need_vec(op, sp.top_k, DType::I32, R, "top_k");
  DFLASH2_CHECK_ARG(rng.dtype() == DType::I64 && rng.ndim() == 2 && rng.shape(0) == R && rng.shape(1) == 2, "cuda::",
                    op, ": rng must be I64 [", R, ", 2] (key, counter), found ", rng.describe());
  return ParamPtrs{sp.temperature.data_as<const float>(), sp.temperature.stride(0), sp.top_p.data_as<const float>(),
                   sp.top_p.stride(0), sp.top_k.data_as<const int32_t>(), sp.top_k.stride(0),
                   rng.data_as<const int64_t>(), rng.stride(0), rng.stride(1)};
}

// The wide-row path (above) for T tasks over rows of V ids: rows longer than a chunk, a
// chunk count and a partials' scratch within bounds; else the one-block kernels.
int32_t wide_parts(int64_t V, int64_t T) {
  if (!ops::wide_rows()) return 0;
  const int64_t P = (V + kChunk - 1) / kChunk;
  if (P < 2 || P > kMaxParts || T < 1 || T > kMaxWideTasks || T * P > kMaxWideParts) return 0;
  return int32_t(P);
}

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// The scratch (tasks, partials, histograms) and counters of a wide-row launch sequence.
WideArgs wide_args(const AcceptArgs& a, int64_t T, int32_t P, int device) {
  WideArgs w{};
  w.a = a;
  w.T = T;
  w.P = P;
  const size_t tp = size_t(T) * size_t(P);
  const size_t o_part = align256(size_t(T) * sizeof(WideTask));
  const size_t o_mh = o_part + align256(tp * sizeof(WidePart));
  const size_t o_ch = o_mh + align256(tp * 256 * sizeof(double));
  const size_t bytes = o_ch + tp * 256 * sizeof(uint32_t);
  char* base = static_cast<char*>(detail::scratch(device, bytes));
  w.task = reinterpret_cast<WideTask*>(base);
  w.part = reinterpret_cast<WidePart*>(base + o_part);
  w.mhist = reinterpret_cast<double*>(base + o_mh);
  w.chist = reinterpret_cast<uint32_t*>(base + o_ch);
  w.arrivals = detail::zeroed_counters(device);
  return w;
}

void launch_wide_rows(const WideArgs& w, const Tensor& logits) {
  const dim3 grid(unsigned(w.P), unsigned(w.T));
  for (int st = 0; st < kNumStages; ++st) {
    wide_rows_kernel<<<grid, kWideThreads, 0, detail::stream()>>>(w, st);
    detail::check_launch("sample / accept (wide rows) kernel launch", logits.describe(), " stage ", st);
  }
}

int64_t next_pow2(int64_t n) {
  int64_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

}  // namespace

void topk(const Tensor& x, int64_t k, Tensor& values, Tensor& indices) {
  const char* op = "topk";
  DFLASH2_CHECK_ARG(x.defined() && x.dtype() == DType::F32, "cuda::topk: x must be F32, found ", desc(x));
  DFLASH2_CHECK_ARG(values.defined() && values.dtype() == DType::F32, "cuda::topk: values must be F32, found ",
                    desc(values));
  DFLASH2_CHECK_ARG(indices.defined() && indices.dtype() == DType::I32, "cuda::topk: indices must be I32, found ",
                    desc(indices));
  DFLASH2_CHECK_ARG(x.device().is_cuda() && values.device() == x.device() && indices.device() == x.device(),
                    "cuda::topk: x, values and indices must be on the same CUDA device, found ", x.describe(), ", ",
                    values.describe(), ", ", indices.describe());
  const layout::RowLayout lx = layout::row_layout(x, op, "x");
  DFLASH2_CHECK_ARG(k >= 1 && k <= lx.cols, "cuda::topk: k = ", k, " must be in [1, ", lx.cols, "]");
  DFLASH2_CHECK_ARG(lx.cols <= kMaxRowLen, "cuda::topk: rows of ", lx.cols, " elements are too long");
  Tensor::Shape s = x.shape();
  s.back() = k;
  DFLASH2_CHECK_ARG(values.shape() == s && indices.shape() == s, "cuda::topk: values and indices must be ",
                    shape_str(s), ", found ", values.describe(), " and ", indices.describe());
  const layout::RowLayout lv = layout::row_layout(values, op, "values");
  const layout::RowLayout li = layout::row_layout(indices, op, "indices");
  layout::check_rows_disjoint(lv, op, "values");
  layout::check_rows_disjoint(li, op, "indices");
  if (lx.rows == 0) return;
  detail::DeviceGuard guard(x.device().index);
  const int dev = x.device().index;
  // Rows longer than a chunk, small k (ops::wide_rows()): each chunk's top k by the kernel
  // below (the chunks as rows), then topk_merge over the chunks' candidates (its order is
  // topk's: the top k of a row are among its chunks' top k, as that order is strict).
  const int64_t P = (lx.cols + kChunk - 1) / kChunk;
  if (ops::wide_rows() && P >= 2 && P <= kMaxParts && k <= kWideTopk && lx.cols - (P - 1) * kChunk >= k &&
      lx.rows * P <= (int64_t(1) << 24)) {
    const int64_t VR = lx.rows * P;
    char* base = static_cast<char*>(detail::scratch(dev, align256(size_t(VR * k) * 4) + size_t(VR * k) * 4));
    float* cv = reinterpret_cast<float*>(base);
    int32_t* ci = reinterpret_cast<int32_t*>(base + align256(size_t(VR * k) * 4));
    topk_kernel<<<detail::row_blocks(VR), detail::pick_threads(kChunk, kTopkThreads), 0, detail::stream()>>>(
        x.data_as<const float>(), lx.stride, int32_t(lx.cols), VR, int32_t(k), cv, k, ci, k, nullptr, next_pow2(k),
        int32_t(P));
    detail::check_launch("topk (chunks) kernel launch", x.describe(), " k = ", k);
    const Tensor::Shape cs{P, lx.rows, k}, cst{k, P * k, 1};
    const Tensor vals = Tensor::view(cv, DType::F32, cs, cst, x.device());
    const Tensor ids = Tensor::view(ci, DType::I32, cs, cst, x.device());
    Tensor v2 = Tensor::view(values.data(), DType::F32, {lx.rows, k}, {lv.stride, 1}, x.device());
    Tensor i2 = Tensor::view(indices.data(), DType::I32, {lx.rows, k}, {li.stride, 1}, x.device());
    topk_merge(vals, ids, kChunk, v2, i2);
    return;
  }
  const int64_t npow2 = next_pow2(k);
  uint64_t* gbuf = nullptr;
  unsigned blocks = detail::row_blocks(lx.rows);
  if (npow2 > kTopkShared) {
    const int64_t budget = int64_t(16) << 20;  // bytes of scratch for the sort buffers
    int64_t nb = budget / (npow2 * 8);
    nb = nb < 1 ? 1 : (nb > lx.rows ? lx.rows : nb);
    blocks = unsigned(nb);
    gbuf = static_cast<uint64_t*>(detail::scratch(x.device().index, size_t(nb * npow2 * 8)));
  }
  topk_kernel<<<blocks, detail::pick_threads(lx.cols, kTopkThreads), 0, detail::stream()>>>(
      x.data_as<const float>(), lx.stride, int32_t(lx.cols), lx.rows, int32_t(k), values.data_as<float>(), lv.stride,
      indices.data_as<int32_t>(), li.stride, gbuf, npow2, 1);
  detail::check_launch("topk kernel launch", x.describe(), " k = ", k);
}

void sample(const Tensor& logits, const ops::SamplingTensors& sp, const Tensor& rng, Tensor& out) {
  const char* op = "sample";
  const layout::RowLayout L = need_logits(op, logits);
  const int64_t R = logits.shape(0);
  const ParamPtrs pp = params_of(op, logits, sp, rng, R);
  need_on(op, logits, out, "out");
  need_vec(op, out, DType::I32, R, "out");
  if (R == 0) return;
  detail::DeviceGuard guard(logits.device().index);
  if (const int32_t P = wide_parts(L.cols, R)) {
    AcceptArgs a{};
    a.lg = logits.data_as<const float>();
    a.ls = L.stride;
    a.M = R;
    a.V = int32_t(L.cols);
    a.pp = pp;
    a.S = R;
    WideArgs w = wide_args(a, R, P, logits.device().index);
    w.out = out.data_as<int32_t>();
    w.os = out.stride(0);
    launch_wide_rows(w, logits);
    return;
  }
  sample_kernel<<<detail::row_blocks(R), detail::pick_threads(L.cols, kSelThreads), 0, detail::stream()>>>(
      logits.data_as<const float>(), L.stride, int32_t(L.cols), R, pp, out.data_as<int32_t>(), out.stride(0));
  detail::check_launch("sample kernel launch", logits.describe());
}

void accept(const Tensor& logits, const Tensor& row0, const Tensor& draft, const Tensor& draft_row,
            const Tensor& draft_len, const Tensor& cand, const Tensor& q, const ops::SamplingTensors& sp,
            const Tensor& rng, Tensor& accepted, Tensor& bonus) {
  const char* op = "accept";
  const layout::RowLayout L = need_logits(op, logits);
  DFLASH2_CHECK_ARG(row0.defined(), "cuda::accept: 'row0' is undefined");
  const int64_t S = row0.shape(0);
  need_on(op, logits, row0, "row0");
  need_on(op, logits, draft_row, "draft_row");
  need_on(op, logits, draft_len, "draft_len");
  need_on(op, logits, accepted, "accepted");
  need_on(op, logits, bonus, "bonus");
  need_vec(op, row0, DType::I32, S, "row0");
  need_vec(op, draft_row, DType::I32, S, "draft_row");
  need_vec(op, draft_len, DType::I32, S, "draft_len");
  need_vec(op, accepted, DType::I32, S, "accepted");
  need_vec(op, bonus, DType::I32, S, "bonus");
  need_on(op, logits, draft, "draft");
  DFLASH2_CHECK_ARG(draft.dtype() == DType::I32 && draft.ndim() == 2 && (draft.stride(1) == 1 || draft.shape(1) == 1),
                    "cuda::accept: draft must be I32 [N, K] with contiguous rows, found ", draft.describe());
  const int64_t N = draft.shape(0), K = draft.shape(1);
  const ParamPtrs pp = params_of(op, logits, sp, rng, S);
  AcceptArgs a{};
  if (q.defined()) {
    need_on(op, logits, q, "q");
    need_on(op, logits, cand, "cand");
    DFLASH2_CHECK_ARG(q.dtype() == DType::F32 && cand.dtype() == DType::I32 && q.ndim() == 3 && q.shape() == cand.shape() &&
                          q.shape(0) == N && q.shape(1) == K && (q.stride(2) == 1 || q.shape(2) == 1) &&
                          (cand.stride(2) == 1 || cand.shape(2) == 1),
                      "cuda::accept: q (F32) and cand (I32) must be [", N, ", ", K,
                      ", C] with contiguous rows, found ", q.describe(), " and ", desc(cand));
    DFLASH2_CHECK_ARG(q.shape(2) <= INT32_MAX, "cuda::accept: too many candidates, found ", q.describe());
    a.cand = cand.data_as<const int32_t>();
    a.cs0 = cand.stride(0);
    a.cs1 = cand.stride(1);
    a.q = q.data_as<const float>();
    a.qs0 = q.stride(0);
    a.qs1 = q.stride(1);
    a.C = q.shape(2);
  }
  if (S == 0) return;
  DFLASH2_CHECK_ARG(L.rows >= 1, "cuda::accept: logits has no rows for ", S, " sequences");
  DFLASH2_CHECK_ARG(K < (int64_t(1) << 20), "cuda::accept: drafts of ", K, " tokens are too long");
  detail::DeviceGuard guard(logits.device().index);
  a.lg = logits.data_as<const float>();
  a.ls = L.stride;
  a.M = L.rows;
  a.V = int32_t(L.cols);
  a.row0 = row0.data_as<const int32_t>();
  a.r0s = row0.stride(0);
  a.draft = draft.data_as<const int32_t>();
  a.ds = draft.stride(0);
  a.N = N;
  a.K = K;
  a.draft_row = draft_row.data_as<const int32_t>();
  a.drs = draft_row.stride(0);
  a.draft_len = draft_len.data_as<const int32_t>();
  a.dls = draft_len.stride(0);
  a.pp = pp;
  a.S = S;
  if (const int32_t P = wide_parts(L.cols, S * (K + 1))) {
    const WideArgs w = wide_args(a, S * (K + 1), P, logits.device().index);
    launch_wide_rows(w, logits);
    accept_wide_final_kernel<<<dim3(unsigned(P), unsigned(S)), kWideThreads, 0, detail::stream()>>>(
        w, accepted.data_as<int32_t>(), accepted.stride(0), bonus.data_as<int32_t>(), bonus.stride(0));
    detail::check_launch("accept (wide rows) kernel launch", logits.describe());
    return;
  }
  a.info = static_cast<RowInfo*>(
      detail::scratch(logits.device().index, size_t(S) * size_t(K + 1) * sizeof(RowInfo)));
  const int threads = detail::pick_threads(L.cols, kSelThreads);
  accept_rows_kernel<<<detail::row_blocks(S * (K + 1)), threads, 0, detail::stream()>>>(a);
  detail::check_launch("accept (rows) kernel launch", logits.describe());
  accept_final_kernel<<<detail::row_blocks(S), threads, 0, detail::stream()>>>(
      a, accepted.data_as<int32_t>(), accepted.stride(0), bonus.data_as<int32_t>(), bonus.stride(0));
  detail::check_launch("accept kernel launch", logits.describe());
}

}  // namespace dflash2::cuda
