// cuda/sampling_logic.h: the decision rules of the CUDA sampling ops (sampling.cu: topk,
// sample, accept; selector.cu: selector_walk), written once for the host and the device.
// Plain C++ (no CUDA header): the DFLASH2_HD functions compile as __host__ __device__
// under nvcc and as inline host functions elsewhere, so tests/cpp/test_cuda_sampling.cpp
// runs them on the CPU (against the CPU backend's sequential rules, cpu/sampling.cpp) in
// every build, with or without a GPU.
//
// What lives here (each mirrors the CPU backend's rule; see the comments):
//   order_key / topk_key      float -> order-preserving 32-bit key (larger float, larger key)
//   bucket walk               the radix selection's threshold walk over a 256-bin histogram,
//                             split into 32 lanes of 8 bins (one warp) + the combine rule
//   RowSel / keep             the kept set of a row after the top-k and top-p selections
//   topp_ties_kept            how many of the elements tied at the top-p threshold are kept
//   seg_*                     the split of a row into per-warp id ranges for the ordered scans
//   accept_draft / residual   the acceptance test and the residual mass of rejection sampling
//
// Status: the host side is unit-tested on the CPU; the device side is compiled for
// sm_90a/sm_100a/sm_103a but has not yet run on a GPU.
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

namespace dflash2::cuda::sampling {

// ------------------------------------------------------------------ keys
using layout::bits_float;  // layout.h
using layout::float_bits;

// The CPU sampler's key (cpu/sampling.cpp order_key): a larger float gets a larger key;
// -0.0 < +0.0 and NaNs land at the ends, exactly as on the CPU (the sampler mirrors it).
DFLASH2_HD uint32_t order_key(float x) {
  const uint32_t u = float_bits(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
// The float whose order_key is k (the inverse map).
DFLASH2_HD float key_float(uint32_t k) { return bits_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k); }

// topk's key: the CPU topk (cpu/elementwise.cpp) ranks by value with NaN last and +0 ==
// -0 (a tie, to the lower index). So -0 is keyed as +0 and every NaN gets key 0, below
// -inf (0x007fffff): no other float maps to 0 (only the NaN 0xffffffff would).
DFLASH2_HD uint32_t topk_key(float x) {
  if (x != x) return 0u;
  if (x == 0.0f) x = 0.0f;  // -0 -> +0
  return order_key(x);
}
// Sort key for topk's kept elements: ascending order = larger key first, then lower index.
DFLASH2_HD uint64_t topk_sort_key(uint32_t key, uint32_t index) { return (uint64_t(~key) << 32) | index; }
DFLASH2_HD uint32_t topk_sort_index(uint64_t sk) { return uint32_t(sk & 0xffffffffu); }
DFLASH2_HD uint32_t topk_sort_keyval(uint64_t sk) { return ~uint32_t(sk >> 32); }

// ------------------------------------------------------------------ radix bucket walk
// The CPU's radix_select: 4 passes of 8 bits, most significant first. In a pass, among the
// elements whose key matches the prefix so far, hist[d] is the count (or mass) of those
// whose next byte is d; acc is the count/mass of keys above the prefix's range. Walking d
// from 255 down, the first non-empty d with acc + hist[d] >= target is the byte (acc then
// excludes it); if none reaches the target (rounding of masses), the smallest non-empty d
// is taken with acc = (acc after every bin) - hist[d].
//
// The device walks with one warp: lane l owns bins 255 - 8l .. 248 - 8l (in that order),
// starts from acc0 + the sum of the lanes before it (an exclusive scan of the lane sums),
// and walks its bins as the CPU does; the first lane that reaches the target wins, else
// the last lane with a non-empty bin supplies the fallback. For count histograms (exact
// integers in double) this is exactly the CPU's answer; for masses it differs only by the
// summation order of the bin sums (the scan), i.e. only when the target lies within
// rounding of a bin boundary.
constexpr int kBins = 256;
constexpr int kBinsPerLane = 8;
DFLASH2_HD int lane_bin(int lane, int j) { return kBins - 1 - kBinsPerLane * lane - j; }

// A lane's 8 bins in its walking order: h[j] = hist[lane_bin(lane, j)].
template <class T>
DFLASH2_HD void lane_bins(const T* hist, int lane, double* h) {
  for (int j = 0; j < kBinsPerLane; ++j) h[j] = double(hist[lane_bin(lane, j)]);
}
// Sum of a lane's bins, in the lane's walking order.
DFLASH2_HD double lane_sum(const double* h) {
  double s = 0;
  for (int j = 0; j < kBinsPerLane; ++j) s += h[j];
  return s;
}

struct LaneWalk {
  int found = 0;           // the target was reached in this lane's bins
  int d = -1;              // that bin
  double acc = 0;          // the count/mass above bin d (excluding it)
  int last_nonempty = -1;  // the lane's smallest non-empty bin (the walk's last)
  double last_h = 0;       // its count/mass
  double acc_end = 0;      // acc after all the lane's bins (when not found)
};

// The CPU loop over one lane's bins h (walking order), starting from acc = excl.
DFLASH2_HD LaneWalk lane_walk(const double* h, int lane, double excl, double target) {
  LaneWalk w;
  double acc = excl;
  for (int j = 0; j < kBinsPerLane; ++j) {
    if (h[j] == 0.0) continue;
    w.last_nonempty = lane_bin(lane, j);
    w.last_h = h[j];
    if (acc + h[j] >= target) {
      w.found = 1;
      w.d = lane_bin(lane, j);
      w.acc = acc;
      return w;
    }
    acc += h[j];
  }
  w.acc_end = acc;
  return w;
}

struct BucketPick {
  int d = 0;
  double above = 0;  // acc for the next pass: the count/mass of keys above the new prefix
};

// The combine rule over the lanes' walks (lane order): the first lane that reached the
// target; else the last lane with a non-empty bin (its smallest non-empty bin, with acc =
// the running total - that bin, as the CPU's fallback); else bin 0. The device does the
// same with ballots and shuffles.
DFLASH2_HD BucketPick combine_lanes(const LaneWalk* w, int nlanes) {
  for (int l = 0; l < nlanes; ++l)
    if (w[l].found) return BucketPick{w[l].d, w[l].acc};
  for (int l = nlanes - 1; l >= 0; --l)
    if (w[l].last_nonempty >= 0) return BucketPick{w[l].last_nonempty, w[l].acc_end - w[l].last_h};
  return BucketPick{0, w[nlanes - 1].acc_end};  // an empty histogram: bin 0, as on the CPU
}

// The CPU's serial walk (the reference the lane split is tested against).
DFLASH2_HD BucketPick serial_walk(const double* hist, double acc, double target) {
  int d = kBins - 1, last_nonempty = -1;
  for (; d >= 0; --d) {
    if (hist[d] == 0.0) continue;
    last_nonempty = d;
    if (acc + hist[d] >= target) break;
    acc += hist[d];
  }
  if (d < 0) {
    d = last_nonempty < 0 ? 0 : last_nonempty;
    acc -= hist[d];
  }
  return BucketPick{d, acc};
}

// ------------------------------------------------------------------ the kept set of a row
// A row's sampling distribution (cpu/sampling.cpp row_masses): w(i) = exp(x_i / T - max)
// on the kept set, 0 elsewhere. kept(i) = top-k(i) && top-p(i) where
//   top-k(i): key > kth, or key == kth and i <= k_last (the first ties in id order)
//   top-p(i): key > tau, or key == tau and i <= p_last
// (k_last / p_last = INT32_MAX: every tie kept).
struct RowSel {
  double invT = 1.0;  // 1 / temperature
  double mx = 0.0;    // max_i x_i * invT (double)
  double z = 0.0;     // sum of the kept masses (only where an op needs it)
  uint32_t kth = 0, tau = 0;
  int32_t k_last = 0x7fffffff, p_last = 0x7fffffff;
  int32_t use_k = 0, use_p = 0;
};

DFLASH2_HD bool keep_k(const RowSel& s, uint32_t key, int64_t i) {
  return !s.use_k || key > s.kth || (key == s.kth && i <= s.k_last);
}
DFLASH2_HD bool keep_p(const RowSel& s, uint32_t key, int64_t i) {
  return !s.use_p || key > s.tau || (key == s.tau && i <= s.p_last);
}
DFLASH2_HD bool keep(const RowSel& s, uint32_t key, int64_t i) { return keep_k(s, key, i) && keep_p(s, key, i); }

// top-k is on when 0 < top_k < V; top-p when top_p < 1 (a NaN top_p: off), as on the CPU.
DFLASH2_HD bool uses_top_k(int64_t top_k, int64_t V) { return top_k > 0 && top_k < V; }
DFLASH2_HD bool uses_top_p(float top_p) { return top_p < 1.0f; }

// How many of the n_ties elements tied at the top-p threshold (each of mass w; in id
// order) the CPU keeps: cum = above; keep while cum < target, adding w for each kept one.
DFLASH2_HD int64_t topp_ties_kept(double above, double w, double target, int64_t n_ties) {
  double cum = above;
  int64_t n = 0;
  while (n < n_ties && cum < target) {
    cum += w;
    ++n;
  }
  return n;
}

// ------------------------------------------------------------------ ordered scans
// The draw (and the search for the n-th tie) walks ids in ascending order. On the device
// warp w of nw owns ids [seg_begin(w), seg_end(w)) (a multiple of 32 long), scans them 32 at
// a time (a Kogge-Stone inclusive scan across the lanes, plus a running carry), and the
// warps' totals are scanned in warp order by one thread. The element picked is the first
// id whose inclusive cumulative mass exceeds x and whose own mass is > 0 (the CPU skips
// massless ids); when rounding leaves none, the last id with mass (in the chosen warp, or
// in the row when x >= the total); 0 when nothing has mass (the CPU's `last = 0`).
DFLASH2_HD int64_t seg_len(int64_t V, int nwarps) {
  const int64_t per = (V + nwarps - 1) / nwarps;
  return (per + 31) / 32 * 32;
}
DFLASH2_HD int64_t seg_begin(int64_t V, int nwarps, int w) {
  const int64_t b = int64_t(w) * seg_len(V, nwarps);
  return b < V ? b : V;
}
DFLASH2_HD int64_t seg_end(int64_t V, int nwarps, int w) { return seg_begin(V, nwarps, w + 1); }

// The pick rule at one element: cum = its inclusive cumulative mass.
DFLASH2_HD bool crosses(double x, double cum, double w) { return w > 0.0 && x < cum; }

// ------------------------------------------------------------------ acceptance
// d_i is accepted iff u_i * q(d_i) < p(d_i) (u_i: draw i), as on the CPU.
DFLASH2_HD bool accept_draft(double u, double qd, double pd) { return u * qd < pd; }
// The residual mass of a candidate: max(p - q, 0), p = w / z in double.
DFLASH2_HD double residual(double p, double qc) {
  const double r = p - qc;
  return r > 0.0 ? r : 0.0;
}

// ------------------------------------------------------------------ selector
// The selector's sampled pick: the first candidate b with u < cum_b (cum: the running sum
// of the fp32 q in double), else the last one (K - 1), as on the CPU.
DFLASH2_HD bool selector_crosses(double u, double cum) { return u < cum; }

}  // namespace dflash2::cuda::sampling
