// CPU backend: MoE routing (sigmoid + correction bias, group-limited top-k, normalized,
// scaled) and the routed experts (each expert runs once on the tokens routed to it:
// gather, gated MLP, scatter, weighted combine in a fixed order).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "dflash2/error.h"

namespace dflash2::cpu {

namespace {
// better(a, b): a ranks before b (larger value, ties to the lower index)
struct Ranked {
  const float* v;
  bool operator()(int32_t a, int32_t b) const { return v[a] != v[b] ? v[a] > v[b] : a < b; }
};
}  // namespace

void moe_route(const Tensor& logits, const Tensor& bias, const ops::MoeRouting& r, Tensor& ids, Tensor& weights) {
  const int64_t T = logits.shape(0), E = logits.shape(1), K = r.top_k, G = r.n_group, per = E / G;
  // per-call scratch: s, choice, order (E), group sums and order (G), a pair buffer (per)
  float* s = thread_scratch(0, size_t(2 * E + 2 * G + per + 2));
  float* choice = s + E;
  float* gs = choice + E;
  float* v2 = gs + G;
  int32_t* order = thread_iscratch(0, size_t(E));
  int32_t* go = thread_iscratch(1, size_t(G));
  const float* bs = bias.data_as<const float>();
  for (int64_t i = 0; i < T; ++i) {
    const float* lg = logits.data_as<const float>() + i * logits.stride(0);
    for (int64_t e = 0; e < E; ++e) {
      s[e] = 1.0f / (1.0f + std::exp(-lg[e]));
      choice[e] = s[e] + bs[e * bias.stride(0)];
    }
    if (G > 1) {  // group-limited routing: keep the topk_group groups with the best top-2 sums
      for (int64_t g = 0; g < G; ++g) {
        std::copy(choice + g * per, choice + (g + 1) * per, v2);
        std::partial_sort(v2, v2 + std::min<int64_t>(2, per), v2 + per, std::greater<float>());
        gs[g] = per >= 2 ? v2[0] + v2[1] : v2[0];
      }
      for (int64_t g = 0; g < G; ++g) go[g] = int32_t(g);
      std::sort(go, go + G, Ranked{gs});
      for (int64_t g = r.topk_group; g < G; ++g) {
        const int64_t dropped = go[g];
        for (int64_t e = dropped * per; e < (dropped + 1) * per; ++e) choice[e] = -INFINITY;
      }
    }
    for (int64_t e = 0; e < E; ++e) order[e] = int32_t(e);
    std::partial_sort(order, order + K, order + E, Ranked{choice});
    std::sort(order, order + K);  // sum in expert order, as transformers does
    float denom = 0;
    for (int64_t j = 0; j < K; ++j) denom += s[order[j]];
    denom += 1e-20f;
    int32_t* io = ids.data_as<int32_t>() + i * ids.stride(0);
    float* wo = weights.data_as<float>() + i * weights.stride(0);
    for (int64_t j = 0; j < K; ++j) {
      const int32_t e = order[j];
      io[j] = e;
      wo[j] = (r.norm_topk_prob ? s[e] / denom : s[e]) * r.routed_scaling_factor;
    }
  }
}

namespace {
// lin: every projection as linear (Exact), linear_bf16 (BF16: x, silu(gate) * up and the
// weights rounded to BF16), linear_fp8 (FP8: W8A8) or linear_nvfp4 (NVFP4: W4A4, each
// expert's activations quantized with its own input_scale) (ops.h moe_experts)
using LinearFn = void (*)(const Tensor&, const ops::Weight&, Tensor&, bool);
void experts_impl(const Tensor& x, const Tensor& ids, const Tensor& weights, const ops::ExpertWeights& ex, Tensor& out,
                  Tensor& workspace, bool accumulate, LinearFn lin) {
  const int64_t T = x.shape(0), H = x.shape(1), K = ids.shape(1), E = int64_t(ex.gate.size());
  const int64_t first = ex.first, Eg = ex.num_global > 0 ? ex.num_global : E;
  const int64_t F = ex.gate.empty() ? 0 : ex.gate[0].out_features;
  // workspace: xe [T K, H] | ye [T K, H] | mlp scratch [2 T K F] | slot_out [T K, H] | order I32 [T K] |
  // start I32 [E + 1] | cursor I32 [E]  (ops::moe_workspace_floats); an expert gets at most T K
  // rows (T if a token's ids are distinct, as moe_route's are)
  float* w = workspace.data_as<float>();
  float* xe_p = w;
  float* ye_p = xe_p + T * K * H;
  float* mlp_p = ye_p + T * K * H;
  float* slot_p = mlp_p + 2 * T * K * F;
  int32_t* order = reinterpret_cast<int32_t*>(slot_p + T * K * H);
  int32_t* start = order + T * K;
  int32_t* cursor = start + E + 1;
  // counting sort of the (token, j) slots by expert, ascending slot within an expert
  std::fill(start, start + E + 1, 0);
  auto local = [&](int64_t t, int64_t j) {  // the expert's index here, or -1 (another rank's)
    const int64_t e = ids.data_as<const int32_t>()[t * ids.stride(0) + j] - first;
    return e >= 0 && e < E ? e : int64_t(-1);
  };
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < K; ++j) {
      const int32_t e = ids.data_as<const int32_t>()[t * ids.stride(0) + j];
      DFLASH2_CHECK_ARG(e >= 0 && e < Eg, "moe_experts: expert id ", e, " of token ", t, " is outside [0, ", Eg, ")");
      if (local(t, j) >= 0) ++start[local(t, j) + 1];
    }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::copy(start, start + E, cursor);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < K; ++j) {
      const int64_t e = local(t, j);
      if (e >= 0) order[cursor[e]++] = int32_t(t * K + j);
    }
  Tensor xe_all = Tensor::view(xe_p, DType::F32, {T * K, H});
  Tensor ye_all = Tensor::view(ye_p, DType::F32, {T * K, H});
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) continue;
    const int32_t* sl = order + start[e];
    for (int64_t r = 0; r < n; ++r)
      std::memcpy(xe_p + r * H, x.data_as<const float>() + (sl[r] / K) * x.stride(0), size_t(H) * 4);
    Tensor xe = xe_all.slice(0, 0, n), ye = ye_all.slice(0, 0, n);
    Tensor g = Tensor::view(mlp_p, DType::F32, {n, F});
    Tensor u = Tensor::view(mlp_p + n * F, DType::F32, {n, F});
    lin(xe, ex.gate[size_t(e)], g, false);
    lin(xe, ex.up[size_t(e)], u, false);
    cpu::silu_mul(g, u, g);
    lin(g, ex.down[size_t(e)], ye, false);
    for (int64_t r = 0; r < n; ++r) std::memcpy(slot_p + int64_t(sl[r]) * H, ye_p + r * H, size_t(H) * 4);
  }
  std::vector<float> sum(accumulate ? size_t(H) : 0);  // accumulate: the sum, then out += it
  for (int64_t t = 0; t < T; ++t) {
    float* row = out.data_as<float>() + t * out.stride(0);
    float* o = accumulate ? sum.data() : row;
    std::fill(o, o + H, 0.0f);
    for (int64_t j = 0; j < K; ++j) {
      if (local(t, j) < 0) continue;
      const float wj = weights.data_as<const float>()[t * weights.stride(0) + j];
      const float* y = slot_p + (t * K + j) * H;
      for (int64_t d = 0; d < H; ++d) o[d] += y[d] * wj;
    }
    if (accumulate)
      for (int64_t d = 0; d < H; ++d) row[d] += o[d];
  }
}
}  // namespace

void moe_experts(const Tensor& x, const Tensor& ids, const Tensor& weights, const ops::ExpertWeights& ex, Tensor& out,
                 Tensor& workspace, bool accumulate) {
  experts_impl(x, ids, weights, ex, out, workspace, accumulate, &cpu::linear);
}

void moe_experts_bf16(const Tensor& x, const Tensor& ids, const Tensor& weights, const ops::ExpertWeights& ex,
                      Tensor& out, Tensor& workspace, bool /*decode: one kernel on the CPU*/, bool accumulate) {
  experts_impl(x, ids, weights, ex, out, workspace, accumulate, [](const Tensor& xs, const ops::Weight& w, Tensor& y, bool acc) {
    cpu::linear_bf16(xs, w, y, acc, false);
  });
}

void moe_experts_nvfp4(const Tensor& x, const Tensor& ids, const Tensor& weights, const ops::ExpertWeights& ex,
                       Tensor& out, Tensor& workspace, bool accumulate) {
  experts_impl(x, ids, weights, ex, out, workspace, accumulate, &cpu::linear_nvfp4);
}

void moe_experts_fp8(const Tensor& x, const Tensor& ids, const Tensor& weights, const ops::ExpertWeights& ex,
                     Tensor& out, Tensor& workspace, bool accumulate) {
  experts_impl(x, ids, weights, ex, out, workspace, accumulate, &cpu::linear_fp8);
}

}  // namespace dflash2::cpu
