// cuda/moe_route.h: the discrete logic of the CUDA MoE ops (moe.cu), written once for the
// host and the device. Plain C++ (no CUDA header): the DFLASH2_HD functions compile as
// __host__ __device__ under nvcc and as inline host functions elsewhere, so
// tests/cpp/test_cuda_moe.cpp checks them on the CPU against the CPU backend (the oracle)
// in every build, with or without CUDA or a GPU.
//
//   Routing (ops::moe_route, cpu/moe.cpp). The kernel runs one block per token in phases;
//   every phase is a loop over independent items (experts, groups, chosen slots) calling
//   the per-item functions below, so route_token() -- the same phases as serial loops -- is
//   exactly what each block computes, given the same sigmoid values:
//     1 (per expert e)  s[e] = sigmoid(logit[e]), choice[e] = s[e] + bias[e]
//     2 (per group g)   gs[g] = top2_sum(choice of group g)            (only if n_group > 1)
//     3 (per expert e)  choice[e] = -inf unless rank(gs, group of e) < topk_group   (idem)
//     4 (per expert e)  chosen[e] = rank(choice, e) < top_k      (the device: rank_of4)
//     5 (per expert e)  if chosen[e]: sel[count of chosen experts below e] = e
//                       (the device: one warp, 32 experts a step, ballot + popc)
//     6 (serial)        denom = sum_j s[sel[j]] (j ascending, from 0) + 1e-20
//     7 (per slot j)    ids[j] = sel[j], weights[j] = route_weight(s[sel[j]], denom, ...)
//   rank(v, i) counts the items ranked before i by better(): the larger value, ties to the
//   lower index -- the CPU's Ranked comparator, made a total order by ranking NaN last
//   (the CPU's order is undefined with NaNs). Membership in the CPU's partial_sort top-k
//   of a total order is exactly rank < k, so the chosen set and the ascending-id output
//   equal the CPU's whenever the scores are equal. Each fp32 operation is the CPU's, in
//   the CPU's order (no multiply-add pairs, so FMA contraction cannot change a rounding);
//   the only difference on the device is expf (CUDA's is within 2 ulp of glibc's), which
//   can move a decision only when two experts' scores are within an ulp or two.
//
//   Workspace of moe_experts (moe_ws_layout): where the per-slot results and the
//   per-expert slot lists live inside the caller's ops::moe_workspace_floats(...) floats.
//
// Status: the host side is unit-tested on the CPU; the device side is compiled for
// sm_90a/sm_100a/sm_103a but has not yet run on a GPU.
#pragma once
#include <cmath>
#include <cstdint>

#ifndef DFLASH2_HD
#if defined(__CUDACC__)
#define DFLASH2_HD __host__ __device__ __forceinline__
#else
#define DFLASH2_HD inline
#endif
#endif

namespace dflash2::cuda::moe {

// ------------------------------------------------------------------ routing
// The CPU's 1.0f / (1.0f + std::exp(-v)) in fp32 (expf on the device).
DFLASH2_HD float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

// a (value va) ranks before b (value vb): larger value, ties to the lower index; NaN ranks
// after every number (ties among NaNs to the lower index). A strict total order for
// distinct indices.
DFLASH2_HD bool better(float va, int a, float vb, int b) {
  const bool na = va != va, nb = vb != vb;
  if (na || nb) return na == nb ? a < b : nb;
  return va != vb ? va > vb : a < b;
}

// The number of items of v[0, n) ranked before item i.
DFLASH2_HD int rank_of(const float* v, int n, int i) {
  const float vi = v[i];
  int r = 0;
  for (int j = 0; j < n; ++j) r += (j != i && better(v[j], j, vi, i)) ? 1 : 0;
  return r;
}

// rank_of with four independent counts, items j = 4 m + c in count c (the same integer):
// the device's rank loop (moe_route_kernel phase 4) then keeps several shared-memory loads
// in flight instead of one long dependent chain.
DFLASH2_HD int rank_of4(const float* v, int n, int i) {
  const float vi = v[i];
  int r[4] = {0, 0, 0, 0};
  int j = 0;
  for (; j + 4 <= n; j += 4) {
#pragma unroll
    for (int c = 0; c < 4; ++c) r[c] += (j + c != i && better(v[j + c], j + c, vi, i)) ? 1 : 0;
  }
  for (; j < n; ++j) r[0] += (j != i && better(v[j], j, vi, i)) ? 1 : 0;
  return (r[0] + r[1]) + (r[2] + r[3]);
}

// Sum of the two largest of v[0, n) (the CPU's partial_sort by std::greater, then v2[0] +
// v2[1]); the value itself when n == 1.
DFLASH2_HD float top2_sum(const float* v, int n) {
  float m1 = v[0], m2 = -INFINITY;
  for (int i = 1; i < n; ++i) {
    const float x = v[i];
    if (x > m1) {
      m2 = m1;
      m1 = x;
    } else if (x > m2) {
      m2 = x;
    }
  }
  return n >= 2 ? m1 + m2 : m1;
}

// The number of flagged items among [0, i).
DFLASH2_HD int count_below(const int32_t* flag, int i) {
  int c = 0;
  for (int j = 0; j < i; ++j) c += flag[j] != 0 ? 1 : 0;
  return c;
}

// The CPU's (norm ? s / denom : s) * scale, denom already holding its + 1e-20f.
DFLASH2_HD float route_weight(float s, float denom, bool norm, float scale) {
  const float v = norm ? s / denom : s;
  return v * scale;
}

struct RouteParams {
  int E = 0;           // experts
  int G = 1;           // n_group (divides E)
  int topk_group = 1;  // groups kept when G > 1
  int K = 1;           // top_k (<= E / G * topk_group)
  bool norm = true;
  float scale = 1.0f;
};

// Phase 3 for expert e: whether its group is among the topk_group best (always when G == 1).
DFLASH2_HD bool group_kept(const float* gs, const RouteParams& p, int e) {
  return p.G <= 1 || rank_of(gs, p.G, e / (p.E / p.G)) < p.topk_group;
}

// One token, serially: the phases above as plain loops. logits [E] contiguous; bias[e *
// bias_stride]; scratch s, choice [E], gs [G], chosen [E], sel [K]; outputs ids, w [K].
DFLASH2_HD void route_token(const float* logits, const float* bias, int64_t bias_stride, const RouteParams& p,
                            float* s, float* choice, float* gs, int32_t* chosen, int32_t* sel, int32_t* ids,
                            float* w) {
  const int E = p.E, per = p.E / p.G;
  for (int e = 0; e < E; ++e) {  // 1
    s[e] = sigmoid(logits[e]);
    choice[e] = s[e] + bias[e * bias_stride];
  }
  if (p.G > 1) {
    for (int g = 0; g < p.G; ++g) gs[g] = top2_sum(choice + g * per, per);  // 2
    for (int e = 0; e < E; ++e)                                              // 3
      if (!group_kept(gs, p, e)) choice[e] = -INFINITY;
  }
  for (int e = 0; e < E; ++e) chosen[e] = rank_of(choice, E, e) < p.K ? 1 : 0;  // 4
  for (int e = 0; e < E; ++e)                                                   // 5
    if (chosen[e]) sel[count_below(chosen, e)] = e;
  float denom = 0.0f;  // 6
  for (int j = 0; j < p.K; ++j) denom += s[sel[j]];
  denom += 1e-20f;
  for (int j = 0; j < p.K; ++j) {  // 7
    ids[j] = sel[j];
    w[j] = route_weight(s[sel[j]], denom, p.norm, p.scale);
  }
}

// ------------------------------------------------------------------ moe_experts workspace
// Offsets in 4-byte units from the start of the workspace, for n = T * top_k slots:
//   y       F32 [n, H]      the down projection of slot i = t * top_k + j (row stride H)
//   h       F32 [n, h_stride] silu(gate) * up of each slot
//   start   I32 [E + 1]     slots of local expert e: order[start[e] .. start[e + 1])
//   cursor  I32 [E]         counts, then fill positions (list kernel)
//   active  I32 [A + 1]     active[0] = number of local experts with a slot, then their
//                           indices ascending (A = min(E, n))
//   order   I32 [n]         slot indices grouped by expert, ascending within an expert
// h_stride is F rounded up to 4 and h starts 16-byte aligned (base_mod4 = the workspace
// pointer's offset in floats modulo 4) when that fits in `budget` floats; else h_stride = F
// right after y. Always fits: ops::moe_workspace_floats gives 3nH + 2nF + n + 2E + 1 and the
// unpadded layout needs nH + nF + 2n + 2E + 2 (<= since H, F >= 1).
struct MoeWsLayout {
  int64_t y = 0, h = 0, h_stride = 0, start = 0, cursor = 0, active = 0, order = 0, total = 0;
};

inline MoeWsLayout moe_ws_layout(int64_t n, int64_t H, int64_t F, int64_t E, int64_t budget, int64_t base_mod4) {
  auto build = [&](bool pad) {
    MoeWsLayout L;
    L.y = 0;
    L.h = n * H;
    L.h_stride = F;
    if (pad) {
      L.h += (4 - (base_mod4 + L.h) % 4) % 4;
      L.h_stride = (F + 3) / 4 * 4;
    }
    L.start = L.h + n * L.h_stride;
    L.cursor = L.start + E + 1;
    L.active = L.cursor + E;
    L.order = L.active + (E < n ? E : n) + 1;
    L.total = L.order + n;
    return L;
  };
  const MoeWsLayout padded = build(true);
  return padded.total <= budget ? padded : build(false);
}

}  // namespace dflash2::cuda::moe
