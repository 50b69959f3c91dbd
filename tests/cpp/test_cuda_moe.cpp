// The CUDA MoE ops (cpp/src/backend/cuda/moe.cu) and their host/device logic
// (cpp/src/backend/cuda/moe_route.h).
//
// On the CPU, in every build: moe_route.h's per-token routing -- the phases the kernel
// runs, as serial loops -- against the CPU backend's ops::moe_route (the oracle), ids
// exactly and weights bitwise (the host runs the same fp32 operations and the same expf),
// on inputs full of exact ties, with and without groups; the rank order it relies on; and
// the workspace layout of moe_experts against ops::moe_workspace_floats.
// On a GPU (skipped without one): cuda::moe_route and cuda::moe_experts against the CPU
// ops on the same inputs (ids exactly; weights within a few ulp; experts within NMSE
// 1e-10) for dense F32 / BF16 / F16, FP8 block-128 and NVFP4 experts, tensor-parallel
// slices (strided rows), expert parallelism (ids of other ranks), repeated ids, an
// unaligned workspace; a token computed alone bitwise equal to the same token in a batch;
// and graph capture (the expert table refused while capturing, captured launches replay
// to the eager result).
//
// Status: the CPU cases run in every build; the GPU cases were compiled but have not yet
// run on a GPU.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/moe_route.h"
#include "dflash2/dflash2.h"
#include "testing.h"
#ifdef DFLASH2_WITH_CUDA
#include <cuda_runtime.h>

#include "backend/cuda/cuda_api.h"
#endif

using namespace dflash2;
namespace M = dflash2::cuda::moe;

namespace {

std::mt19937& gen() {
  static std::mt19937 r(20240611);
  return r;
}

int irand(int a, int b) { return std::uniform_int_distribution<int>(a, b)(gen()); }

struct RouteCase {
  int E, G, kg, K;
};
const RouteCase kRouteCases[] = {{8, 1, 1, 1},  {8, 1, 1, 2},  {13, 1, 1, 5}, {16, 4, 2, 4},  {12, 3, 1, 2},
                                 {12, 3, 3, 5}, {64, 8, 4, 8}, {8, 2, 1, 3},  {256, 8, 4, 8}, {256, 1, 1, 8},
                                 {160, 1, 1, 6}, {32, 32, 2, 2}};

// Logits [T, E]: continuous (kind 0) or drawn from a few values, so that exact ties are
// everywhere (kind 1), or all equal (kind 2); bias zero, small values or normal.
// The few values of the host tests are symmetric (sigmoid(-x) + sigmoid(x) = 1 = 2 *
// sigmoid(0): group top-2 sums equal in exact arithmetic, so the fp32 bits decide, which
// the host reproduces exactly); the device tests use values without such coincidences, as
// the device's expf may round those sums differently (a near-tie, not a tie).
std::vector<float> make_logits(int T, int E, int kind, bool device = false) {
  static const float few[] = {-1.0f, -0.5f, 0.0f, 0.5f, 1.0f, 2.0f};
  static const float few_dev[] = {0.1f, 0.4f, 0.7f, 1.3f, 2.2f, 3.1f};
  std::vector<float> v(size_t(T) * E);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (float& x : v) x = kind == 0 ? nd(gen()) : kind == 1 ? (device ? few_dev : few)[irand(0, 5)] : 0.75f;
  return v;
}
std::vector<float> make_bias(int E, int kind) {
  std::vector<float> b(size_t(E), 0.0f);
  std::normal_distribution<float> nd(0.0f, 0.3f);
  if (kind == 1)
    for (float& x : b) x = 0.25f * float(irand(-1, 1));
  if (kind == 2)
    for (float& x : b) x = nd(gen());
  return b;
}

ops::MoeRouting routing(const RouteCase& c, bool norm, float scale) {
  ops::MoeRouting r;
  r.top_k = c.K;
  r.n_group = c.G;
  r.topk_group = c.kg;
  r.norm_topk_prob = norm;
  r.routed_scaling_factor = scale;
  return r;
}

M::RouteParams params(const RouteCase& c, bool norm, float scale) {
  M::RouteParams p;
  p.E = c.E;
  p.G = c.G;
  p.topk_group = c.kg;
  p.K = c.K;
  p.norm = norm;
  p.scale = scale;
  return p;
}

// The CPU backend's routing of logits [T, E] into ids / weights [T, K].
void cpu_route(std::vector<float>& logits, std::vector<float>& bias, int T, const RouteCase& c, bool norm, float scale,
               std::vector<int32_t>& ids, std::vector<float>& w) {
  ids.assign(size_t(T) * c.K, -1);
  w.assign(size_t(T) * c.K, 0.0f);
  Tensor tl = Tensor::view(logits.data(), DType::F32, {T, c.E});
  Tensor tb = Tensor::view(bias.data(), DType::F32, {c.E});
  Tensor ti = Tensor::view(ids.data(), DType::I32, {T, c.K});
  Tensor tw = Tensor::view(w.data(), DType::F32, {T, c.K});
  ops::moe_route(tl, tb, routing(c, norm, scale), ti, tw);
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

}  // namespace

// ============================================================================ CPU
TEST(better_is_a_total_order_with_ties_to_the_lower_index) {
  const float nan = std::nanf("");
  const float v[] = {1.0f, 2.0f, 2.0f, nan, -INFINITY, 1.0f, nan, 0.0f, -0.0f};
  const int n = int(sizeof(v) / sizeof(v[0]));
  for (int a = 0; a < n; ++a) {
    CHECK(!M::better(v[a], a, v[a], a));
    for (int b = 0; b < n; ++b) {
      if (a == b) continue;
      CHECK(M::better(v[a], a, v[b], b) != M::better(v[b], b, v[a], a));  // exactly one ranks first
      for (int c = 0; c < n; ++c)                                          // transitive
        if (M::better(v[a], a, v[b], b) && M::better(v[b], b, v[c], c)) CHECK(M::better(v[a], a, v[c], c));
    }
  }
  CHECK(M::better(2.0f, 1, 2.0f, 2));   // tie: lower index
  CHECK(!M::better(2.0f, 2, 2.0f, 1));
  CHECK(M::better(-INFINITY, 5, nan, 0));  // NaN last
  CHECK(M::better(0.0f, 8, -0.0f, 7) == false && M::better(-0.0f, 7, 0.0f, 8));  // +0 == -0: index decides
  // ranks are a permutation of 0 .. n-1
  std::vector<int> seen(size_t(n), 0);
  for (int i = 0; i < n; ++i) ++seen[size_t(M::rank_of(v, n, i))];
  for (int i = 0; i < n; ++i) CHECK(seen[size_t(i)] == 1);
  CHECK(M::rank_of(v, n, 1) == 0 && M::rank_of(v, n, 2) == 1 && M::rank_of(v, n, 0) == 2 &&
        M::rank_of(v, n, 5) == 3);
  // the kernel's four-count rank equals rank_of: ties, NaNs, +-0, -inf, n not a multiple of 4
  for (int it = 0; it < 300; ++it) {
    const int m = irand(1, 41);
    std::vector<float> w(static_cast<size_t>(m));
    for (float& x : w) {
      const int k = irand(0, 9);
      x = k == 0 ? nan : k == 1 ? -INFINITY : k == 2 ? -0.0f : float(irand(-3, 3)) * 0.5f;
    }
    for (int i = 0; i < m; ++i) CHECK(M::rank_of4(w.data(), m, i) == M::rank_of(w.data(), m, i));
  }
}

TEST(top2_sum_is_the_sum_of_the_two_largest) {
  for (int it = 0; it < 2000; ++it) {
    const int n = irand(1, 12);
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = irand(0, 3) == 0 ? -INFINITY : float(irand(-4, 4)) * 0.5f;
    std::vector<float> s = v;
    std::partial_sort(s.begin(), s.begin() + std::min(2, n), s.end(), std::greater<float>());
    const float want = n >= 2 ? s[0] + s[1] : s[0];
    const float got = M::top2_sum(v.data(), n);
    CHECK(same_bits(got, want));
  }
  const int32_t flags[] = {0, 1, 1, 0, 1};
  CHECK(M::count_below(flags, 0) == 0 && M::count_below(flags, 2) == 1 && M::count_below(flags, 5) == 3);
}

TEST(route_token_equals_the_cpu_op) {
  for (const RouteCase& c : kRouteCases)
    for (int kind = 0; kind < 3; ++kind)
      for (int bkind = 0; bkind < 3; ++bkind)
        for (int v = 0; v < 2; ++v) {
          const bool norm = v == 0;
          const float scale = v == 0 ? 2.5f : 0.75f;
          const int T = 7;
          std::vector<float> logits = make_logits(T, c.E, kind), bias = make_bias(c.E, bkind);
          std::vector<int32_t> ids;
          std::vector<float> w;
          cpu_route(logits, bias, T, c, norm, scale, ids, w);
          const M::RouteParams p = params(c, norm, scale);
          std::vector<float> s(size_t(c.E)), choice(size_t(c.E)), gs(size_t(c.G));
          std::vector<int32_t> chosen(size_t(c.E)), sel(size_t(c.K)), gi(size_t(c.K));
          std::vector<float> gw(size_t(c.K));
          for (int t = 0; t < T; ++t) {
            M::route_token(logits.data() + size_t(t) * c.E, bias.data(), 1, p, s.data(), choice.data(), gs.data(),
                           chosen.data(), sel.data(), gi.data(), gw.data());
            bool ok = true;
            for (int j = 0; j < c.K; ++j) {
              ok = ok && gi[size_t(j)] == ids[size_t(t) * c.K + j];
              ok = ok && same_bits(gw[size_t(j)], w[size_t(t) * c.K + j]);
              if (j > 0) ok = ok && gi[size_t(j)] > gi[size_t(j) - 1];  // ascending expert order
            }
            if (!ok)
              std::printf("  E%d G%d kg%d K%d kind %d bias %d norm %d token %d: routing differs from the CPU op\n",
                          c.E, c.G, c.kg, c.K, kind, bkind, int(norm), t);
            CHECK(ok);
          }
        }
}

TEST(route_token_ties_and_groups_by_hand) {
  // the cases of tests/test_ops.py test_moe_route_ties_go_to_the_lower_expert
  const float rows[3][8] = {{0.5f, 2.0f, 1.0f, 2.0f, 2.0f, -1.0f, 2.0f, 0.0f},
                            {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f},
                            {0.0f, 3.0f, 0.0f, 1.5f, 0.0f, 1.5f, 0.0f, 1.5f}};
  const int want3[3][3] = {{1, 3, 4}, {0, 1, 2}, {1, 3, 5}};
  const float zero[8] = {};
  float s[8], choice[8], gs[8], w[8];
  int32_t chosen[8], sel[8], ids[8];
  for (int k = 1; k <= 3; ++k)
    for (int r = 0; r < 3; ++r) {
      M::RouteParams p;
      p.E = 8;
      p.K = k;
      M::route_token(rows[r], zero, 1, p, s, choice, gs, chosen, sel, ids, w);
      for (int j = 0; j < k; ++j) {
        // the top k of {1, 3, 4, 6 | ...} ascending: the first k of want3 (k <= 3)
        CHECK(ids[j] == want3[r][j]);
      }
    }
  const float bias2[8] = {0, 0, 0, 0, 0, 0, 0.25f, 0};
  M::RouteParams p;
  p.E = 8;
  p.K = 2;
  M::route_token(rows[0], bias2, 1, p, s, choice, gs, chosen, sel, ids, w);
  CHECK(ids[0] == 1 && ids[1] == 6);
  const float glog[8] = {1.0f, -2.0f, -2.0f, -2.0f, 1.0f, 1.0f, 1.0f, 0.5f};
  const struct {
    int kg, k, want[3];
  } gc[] = {{1, 2, {4, 5, 0}}, {1, 3, {4, 5, 6}}, {2, 3, {0, 4, 5}}};
  for (const auto& g : gc) {
    M::RouteParams q;
    q.E = 8;
    q.G = 2;
    q.topk_group = g.kg;
    q.K = g.k;
    q.norm = false;
    M::route_token(glog, zero, 1, q, s, choice, gs, chosen, sel, ids, w);
    for (int j = 0; j < g.k; ++j) {
      CHECK(ids[j] == g.want[j]);
      CHECK(same_bits(w[j], M::sigmoid(glog[g.want[j]])));
    }
  }
}

TEST(workspace_layout_fits_the_documented_size) {
  int checked = 0, padded = 0;
  for (int64_t n : {1, 2, 3, 8, 9, 64, 257})
    for (int64_t H : {1, 2, 3, 8, 33, 6144})
      for (int64_t F : {1, 3, 5, 17, 256})
        for (int64_t E : {1, 3, 8, 256, 1000})
          for (int64_t mod : {0, 1, 2, 3}) {
            const int64_t K = 1;  // the budget depends on T * top_k only through n
            const int64_t budget = ops::moe_workspace_floats(n, K, H, F, E);
            const M::MoeWsLayout L = M::moe_ws_layout(n, H, F, E, budget, mod);
            ++checked;
            CHECK(L.total <= budget);
            CHECK(L.y == 0 && L.h >= L.y + n * H && L.h_stride >= F);
            CHECK(L.start >= L.h + n * L.h_stride && L.cursor == L.start + E + 1 && L.active == L.cursor + E);
            CHECK(L.order == L.active + std::min(E, n) + 1 && L.total == L.order + n);
            if (L.h_stride != F) {
              ++padded;
              CHECK(L.h_stride % 4 == 0 && (mod + L.h) % 4 == 0 && L.h_stride < F + 4 && L.h < n * H + 4);
            }
          }
  CHECK(checked > 0 && padded > 0);
  // padding is used whenever it fits: H = F = 8 always has room
  const M::MoeWsLayout L = M::moe_ws_layout(3, 8, 6, 8, ops::moe_workspace_floats(3, 1, 8, 6, 8), 1);
  CHECK(L.h_stride == 8 && (1 + L.h) % 4 == 0);
}

// ============================================================================ GPU
#ifdef DFLASH2_WITH_CUDA
namespace {

float uniform(float a, float b) { return std::uniform_real_distribution<float>(a, b)(gen()); }

bool have_device(const char* test) {
  std::string why;
  if (cuda_available(&why)) return true;
  std::printf("  %s: skipped on this machine: %s\n", test, why.c_str());
  return false;
}

template <class T>
Tensor upload(std::vector<T>& v, DType dt, const Tensor::Shape& shape) {
  return Tensor::view(v.data(), dt, shape).to(Device::cuda(0));
}

template <class T>
std::vector<T> download(const Tensor& t) {
  Tensor h = t.to(Device::cpu());
  std::vector<T> v(size_t(h.numel()));
  std::memcpy(v.data(), h.data(), v.size() * sizeof(T));
  return v;
}

double nmse(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = double(got[i]) - double(want[i]);
    num += d * d;
    den += double(want[i]) * double(want[i]);
  }
  return den > 0 ? num / den : num;
}

enum class Fmt { F32, BF16, F16, FP8, NVFP4 };
const char* fmt_str(Fmt f) {
  switch (f) {
    case Fmt::F32: return "F32";
    case Fmt::BF16: return "BF16";
    case Fmt::F16: return "F16";
    case Fmt::FP8: return "FP8";
    case Fmt::NVFP4: return "NVFP4";
  }
  return "?";
}

// A random [N, K] weight on the CPU in format f (values ~ +-0.2 after dequantization).
ops::Weight random_weight(Fmt f, int64_t N, int64_t K, const std::string& name) {
  std::normal_distribution<float> nd(0.0f, 0.2f);
  switch (f) {
    case Fmt::F32:
    case Fmt::BF16:
    case Fmt::F16: {
      const DType dt = f == Fmt::F32 ? DType::F32 : f == Fmt::BF16 ? DType::BF16 : DType::F16;
      Tensor t = Tensor::empty(dt, {N, K});
      for (int64_t i = 0; i < N * K; ++i) {
        const float v = nd(gen());
        if (f == Fmt::F32) {
          t.data_as<float>()[i] = v;
        } else {
          t.data_as<uint16_t>()[i] = f == Fmt::BF16 ? f32_to_bf16(v) : f32_to_f16(v);
        }
      }
      return ops::Weight::dense(t, name);
    }
    case Fmt::FP8: {
      Tensor t = Tensor::empty(DType::F8_E4M3, {N, K});
      for (int64_t i = 0; i < N * K; ++i) {
        uint8_t b = uint8_t(irand(0, 255));
        if ((b & 0x7f) == 0x7f) b &= 0xf0;  // no NaN
        t.data_as<uint8_t>()[i] = b;
      }
      Tensor s = Tensor::empty(DType::F32, {(N + 127) / 128, (K + 127) / 128});
      for (int64_t i = 0; i < s.numel(); ++i) s.data_as<float>()[i] = uniform(0.0005f, 0.002f);
      return ops::Weight::fp8_block128(t, s, name);
    }
    case Fmt::NVFP4: {
      Tensor t = Tensor::empty(DType::U8, {N, K / 2});
      for (int64_t i = 0; i < t.numel(); ++i) t.data_as<uint8_t>()[i] = uint8_t(irand(0, 255));
      Tensor s = Tensor::empty(DType::F8_E4M3, {N, K / 16});
      for (int64_t i = 0; i < s.numel(); ++i) s.data_as<uint8_t>()[i] = uint8_t(irand(0x28, 0x40));  // ~0.03 .. 2
      return ops::Weight::nvfp4(t, s, 0.05f, 0.0f, K, name);
    }
  }
  return {};
}

ops::Weight weight_to(const ops::Weight& w, Device dev) {
  ops::Weight d = w;
  d.data = w.data.to(dev);
  if (w.scale.defined()) d.scale = w.scale.to(dev);
  return d;
}

struct ExpertSet {
  ops::ExpertWeights cpu, dev;
};

// E experts of hidden H and width F. slice: the experts are tensor-parallel slices (rows
// [F, 2F) of [2F, H] gate / up, columns [F, 2F) of [H, 2F] down: strided rows), made on the
// device from the full device weights, and on the CPU from the full CPU weights.
ExpertSet make_experts(Fmt gu, Fmt dn, int64_t E, int64_t H, int64_t F, bool slice, int64_t first,
                       int64_t num_global) {
  ExpertSet s;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t Ff = slice ? 2 * F : F;
    ops::Weight g = random_weight(gu, Ff, H, "g" + std::to_string(e));
    ops::Weight u = random_weight(gu, Ff, H, "u" + std::to_string(e));
    ops::Weight d = random_weight(dn, H, Ff, "d" + std::to_string(e));
    const Device dev = Device::cuda(0);
    ops::Weight gd = weight_to(g, dev), ud = weight_to(u, dev), dd = weight_to(d, dev);
    if (slice) {
      g = g.rows(F, 2 * F);
      u = u.rows(F, 2 * F);
      d = d.cols(F, 2 * F);
      gd = gd.rows(F, 2 * F);
      ud = ud.rows(F, 2 * F);
      dd = dd.cols(F, 2 * F);
    }
    s.cpu.gate.push_back(g);
    s.cpu.up.push_back(u);
    s.cpu.down.push_back(d);
    s.dev.gate.push_back(gd);
    s.dev.up.push_back(ud);
    s.dev.down.push_back(dd);
  }
  s.cpu.first = s.dev.first = first;
  s.cpu.num_global = s.dev.num_global = num_global;
  return s;
}

// Runs cuda::moe_experts on host inputs; the workspace is exactly the documented size,
// at `ws_offset` floats into a larger buffer (1: not 16-byte aligned).
std::vector<float> run_cuda_experts(const std::vector<float>& x, const std::vector<int32_t>& ids,
                                    const std::vector<float>& w, int64_t T, int64_t H, int64_t K,
                                    const ops::ExpertWeights& ex, int64_t ws_offset) {
  std::vector<float> xv = x, wv = w;
  std::vector<int32_t> iv = ids;
  Tensor dx = upload(xv, DType::F32, {T, H});
  Tensor di = upload(iv, DType::I32, {T, K});
  Tensor dw = upload(wv, DType::F32, {T, K});
  Tensor out = Tensor::zeros(DType::F32, {T, H}, Device::cuda(0));
  const int64_t need = ops::moe_workspace_floats(T, K, H, ex.gate[0].out_features, int64_t(ex.gate.size()));
  Tensor buf = Tensor::zeros(DType::F32, {need + ws_offset}, Device::cuda(0));
  Tensor ws = buf.slice(0, ws_offset, ws_offset + need);
  cuda::moe_experts(dx, di, dw, ex, out, ws);
  return download<float>(out);
}

std::vector<float> run_cpu_experts(std::vector<float> x, std::vector<int32_t> ids, std::vector<float> w, int64_t T,
                                   int64_t H, int64_t K, const ops::ExpertWeights& ex) {
  std::vector<float> out(size_t(T * H), 0.0f);
  const int64_t need = ops::moe_workspace_floats(T, K, H, ex.gate[0].out_features, int64_t(ex.gate.size()));
  std::vector<float> ws(static_cast<size_t>(need));
  Tensor tout = Tensor::view(out.data(), DType::F32, {T, H});
  Tensor tws = Tensor::view(ws.data(), DType::F32, {need});
  ops::moe_experts(Tensor::view(x.data(), DType::F32, {T, H}), Tensor::view(ids.data(), DType::I32, {T, K}),
                   Tensor::view(w.data(), DType::F32, {T, K}), ex, tout, tws);
  return out;
}

}  // namespace

TEST(cuda_moe_route_matches_cpu) {
  if (!have_device("cuda_moe_route_matches_cpu")) return;
  for (const RouteCase& c : kRouteCases)
    for (int kind = 0; kind < 3; ++kind)
      for (int v = 0; v < 2; ++v) {
        const bool norm = v == 0;
        const float scale = v == 0 ? 2.5f : 0.75f;
        const int T = 9;
        // ties only where they are exact for any sigmoid (equal logits, zero bias)
        std::vector<float> logits = make_logits(T, c.E, kind, true);
        std::vector<float> bias = make_bias(c.E, kind == 0 ? 2 : 0);
        std::vector<int32_t> ids;
        std::vector<float> w;
        cpu_route(logits, bias, T, c, norm, scale, ids, w);
        // device logits with a row stride (a view of wider rows)
        const int ld = c.E + 3;
        std::vector<float> wide(size_t(T) * ld, 0.0f);
        for (int t = 0; t < T; ++t)
          std::copy(logits.begin() + size_t(t) * c.E, logits.begin() + size_t(t + 1) * c.E,
                    wide.begin() + size_t(t) * ld);
        Tensor dwide = upload(wide, DType::F32, {T, ld});
        Tensor dl = dwide.slice(1, 0, c.E);
        Tensor db = upload(bias, DType::F32, {c.E});
        Tensor di = Tensor::zeros(DType::I32, {T, c.K}, Device::cuda(0));
        Tensor dw = Tensor::zeros(DType::F32, {T, c.K}, Device::cuda(0));
        cuda::moe_route(dl, db, routing(c, norm, scale), di, dw);
        const std::vector<int32_t> gi = download<int32_t>(di);
        const std::vector<float> gw = download<float>(dw);
        bool ok = gi == ids;
        for (size_t i = 0; i < w.size(); ++i)  // a few ulp (the device's expf)
          ok = ok && std::fabs(gw[i] - w[i]) <= 2e-6f * std::fabs(w[i]);
        if (!ok) std::printf("  E%d G%d kg%d K%d kind %d norm %d: device routing differs\n", c.E, c.G, c.kg, c.K, kind,
                             int(norm));
        CHECK(ok);
      }
  // argument errors before any launch
  std::vector<float> l(16, 0.0f), b(8, 0.0f);
  Tensor dl = upload(l, DType::F32, {2, 8}), db = upload(b, DType::F32, {8});
  Tensor di = Tensor::zeros(DType::I32, {2, 2}, Device::cuda(0));
  Tensor dw = Tensor::zeros(DType::F32, {2, 2}, Device::cuda(0));
  ops::MoeRouting r;
  r.top_k = 2;
  r.n_group = 3;
  CHECK_THROWS(cuda::moe_route(dl, db, r, di, dw), "n_group 3 must divide 8");
  r.n_group = 1;
  r.top_k = 3;
  CHECK_THROWS(cuda::moe_route(dl, db, r, di, dw), "ids and weights must be [2, 3]");
}

TEST(cuda_moe_experts_matches_cpu) {
  if (!have_device("cuda_moe_experts_matches_cpu")) return;
  struct Case {
    Fmt gu, dn;
    int64_t T, E, H, F, K;
    bool slice;
    int64_t first, num_global;
    int64_t ws_offset;
  };
  const Case cases[] = {
      {Fmt::F32, Fmt::F32, 1, 3, 8, 5, 1, false, 0, 0, 0},
      {Fmt::F32, Fmt::F32, 1, 6, 33, 17, 3, false, 0, 0, 1},
      {Fmt::BF16, Fmt::BF16, 6, 5, 24, 20, 2, false, 0, 0, 0},
      {Fmt::BF16, Fmt::BF16, 9, 8, 40, 31, 4, false, 0, 0, 1},
      {Fmt::F16, Fmt::F16, 13, 4, 16, 48, 2, false, 0, 0, 0},
      {Fmt::BF16, Fmt::F32, 5, 6, 256, 64, 3, true, 0, 0, 0},      // TP slices: strided rows
      {Fmt::FP8, Fmt::FP8, 4, 5, 256, 160, 2, false, 0, 0, 0},
      {Fmt::FP8, Fmt::FP8, 3, 4, 200, 96, 3, false, 2, 9, 1},       // EP: ids of other ranks
      {Fmt::NVFP4, Fmt::NVFP4, 4, 5, 256, 128, 2, false, 0, 0, 0},
      {Fmt::NVFP4, Fmt::FP8, 17, 6, 64, 48, 4, false, 1, 8, 0},
      {Fmt::BF16, Fmt::BF16, 40, 4, 64, 32, 2, false, 0, 0, 0},    // many tokens per expert (chunks)
  };
  for (const Case& c : cases) {
    const int64_t Eg = c.num_global > 0 ? c.num_global : c.E;
    ExpertSet ex = make_experts(c.gu, c.dn, c.E, c.H, c.F, c.slice, c.first, c.num_global);
    std::vector<float> x(size_t(c.T * c.H)), w(size_t(c.T * c.K));
    std::vector<int32_t> ids(size_t(c.T * c.K));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (float& v : x) v = nd(gen());
    for (float& v : w) v = uniform(0.05f, 1.0f);
    for (int64_t t = 0; t < c.T; ++t)
      for (int64_t j = 0; j < c.K; ++j) {
        // mostly local experts, some repeated within a token, some of other ranks (EP)
        int32_t e = int32_t(c.first + irand(0, int(c.E) - 1));
        if (Eg > c.E && irand(0, 3) == 0) e = int32_t(irand(0, int(Eg) - 1));
        if (j > 0 && irand(0, 5) == 0) e = ids[size_t(t * c.K + j - 1)];
        ids[size_t(t * c.K + j)] = e;
      }
    const std::vector<float> want = run_cpu_experts(x, ids, w, c.T, c.H, c.K, ex.cpu);
    const std::vector<float> got = run_cuda_experts(x, ids, w, c.T, c.H, c.K, ex.dev, c.ws_offset);
    const double err = nmse(got, want);
    if (!(err < 1e-10))
      std::printf("  %s/%s T%lld E%lld H%lld F%lld K%lld: NMSE %.3g\n", fmt_str(c.gu), fmt_str(c.dn),
                  (long long)c.T, (long long)c.E, (long long)c.H, (long long)c.F, (long long)c.K, err);
    CHECK(err < 1e-10);
    // deterministic, and a token alone equals the same token in the batch (bitwise)
    const std::vector<float> again = run_cuda_experts(x, ids, w, c.T, c.H, c.K, ex.dev, 0);
    CHECK(again == got);
    const int64_t t = c.T - 1;
    std::vector<float> x1(x.begin() + t * c.H, x.begin() + (t + 1) * c.H), w1(w.begin() + t * c.K, w.end());
    std::vector<int32_t> i1(ids.begin() + t * c.K, ids.end());
    const std::vector<float> one = run_cuda_experts(x1, i1, w1, 1, c.H, c.K, ex.dev, 0);
    CHECK(std::equal(one.begin(), one.end(), got.begin() + t * c.H));
  }
  // one format per layer for gate / up, and one for down
  ExpertSet a = make_experts(Fmt::BF16, Fmt::BF16, 2, 16, 8, false, 0, 0);
  ExpertSet b = make_experts(Fmt::F32, Fmt::BF16, 1, 16, 8, false, 0, 0);
  a.dev.up[1] = b.dev.up[0];
  std::vector<float> x(16, 1.0f), w(1, 1.0f);
  std::vector<int32_t> ids(1, 0);
  CHECK_THROWS(run_cuda_experts(x, ids, w, 1, 16, 1, a.dev, 0), "one format for every gate and up weight");
  a.dev.up[1] = a.dev.up[0];
  a.dev.down[1] = b.dev.gate[0];  // wrong shape [8, 16] for a down weight [16, 8]
  CHECK_THROWS(run_cuda_experts(x, ids, w, 1, 16, 1, a.dev, 0), "expert 1 has shapes");
}

TEST(cuda_moe_experts_under_graph_capture) {
  if (!have_device("cuda_moe_experts_under_graph_capture")) return;
  // E = 7: no earlier test builds a table of 7 experts. The table cache is keyed on the views
  // (pointers, strides, shapes), and a caching device allocator hands an earlier test's freed
  // addresses out again, so the same shapes would find that test's (still valid) table and
  // the first use below would not be a first use (seen on an H200; the emulator never reuses).
  const int64_t T = 3, E = 7, H = 64, F = 32, K = 2;
  ExpertSet ex = make_experts(Fmt::BF16, Fmt::BF16, E, H, F, false, 0, 0);
  std::vector<float> x(size_t(T * H)), w(size_t(T * K), 0.5f);
  std::vector<int32_t> ids = {0, 2, 1, 3, 2, 3};
  for (float& v : x) v = uniform(-1.0f, 1.0f);
  Tensor dx = upload(x, DType::F32, {T, H}), di = upload(ids, DType::I32, {T, K}), dw = upload(w, DType::F32, {T, K});
  Tensor out = Tensor::zeros(DType::F32, {T, H}, Device::cuda(0));
  Tensor ws = Tensor::zeros(DType::F32, {ops::moe_workspace_floats(T, K, H, F, E)}, Device::cuda(0));
  cudaStream_t s = nullptr;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  {
    cuda::StreamScope scope(s);
    // first use while capturing: the expert table cannot be built
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    CHECK_THROWS(cuda::moe_experts(dx, di, dw, ex.dev, out, ws), "being captured into a CUDA graph");
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(s, &g);
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();
    // eager warm-up, then a capture replays to the same bytes
    cuda::moe_experts(dx, di, dw, ex.dev, out, ws);
    CHECK(cudaStreamSynchronize(s) == cudaSuccess);
    const std::vector<float> eager = download<float>(out);
    CHECK(cudaMemsetAsync(out.data(), 0, size_t(T * H) * 4, s) == cudaSuccess);
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    cuda::moe_experts(dx, di, dw, ex.dev, out, ws);
    g = nullptr;
    CHECK(cudaStreamEndCapture(s, &g) == cudaSuccess && g != nullptr);
    cudaGraphExec_t exec = nullptr;
    CHECK(cudaGraphInstantiate(&exec, g, 0) == cudaSuccess);
    CHECK(cudaGraphLaunch(exec, s) == cudaSuccess);
    CHECK(cudaStreamSynchronize(s) == cudaSuccess);
    CHECK(download<float>(out) == eager);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(g);
  }
  cudaStreamDestroy(s);
}
#endif  // DFLASH2_WITH_CUDA

TEST_MAIN()
