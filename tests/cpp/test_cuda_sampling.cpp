// The CUDA sampling ops' decision rules (cpp/src/backend/cuda/sampling_logic.h) checked on
// the CPU, and the CUDA kernels (sampling.cu: topk, sample, accept; selector.cu:
// selector_walk) against the CPU backend when a GPU is present.
//
// Host part: the header's functions are plain C++ (__host__ __device__ under nvcc), so the
// kernels' procedures are replayed here step by step (the 32-lane bucket walk with its
// Kogge-Stone scan, the radix passes, the tie searches, the per-warp ordered draw) and
// compared with the CPU backend's ops (sample, accept, topk) on random rows with ties and
// with an independent sort-based definition of the kept set. These run in every build.
// Device part: the CUDA ops on the same inputs must give the CPU's tokens / accepted
// counts / bonus tokens / indices exactly (inputs with margins) and selector q within
// 1e-10 NMSE; skipped without a usable GPU.
//
// Compiling with -DDFLASH2_SAMPLING_LOGIC_ONLY keeps only the parts that need nothing but
// the headers (no library): g++ -std=c++17 -DDFLASH2_SAMPLING_LOGIC_ONLY -Icpp/include
// -Icpp/src -Itests/cpp tests/cpp/test_cuda_sampling.cpp.
//
// Status: the host part runs; the device part was compiled but has not yet run on a GPU.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/sampling_logic.h"
#include "ops/philox.h"
#include "testing.h"
#ifndef DFLASH2_SAMPLING_LOGIC_ONLY
#include "dflash2/dflash2.h"
#include "dflash2/ops.h"
#ifdef DFLASH2_WITH_CUDA
#include "backend/cuda/cuda_api.h"
#endif
#endif

namespace sl = dflash2::cuda::sampling;

namespace {

std::mt19937_64& gen() {
  static std::mt19937_64 r(20240611);
  return r;
}
double unif() { return std::uniform_real_distribution<double>(0.0, 1.0)(gen()); }
int64_t irand(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(gen()); }

// ============================================================================ emulation
// The device procedures of sampling.cu, replayed on the host with the header's functions.

// Warp 0's bucket pick: lane bins, lane sums, the Kogge-Stone inclusive scan (v += up(v)),
// the exclusive start of each lane, the lane walks, the combine rule.
sl::BucketPick warp_pick(const double* hist, double acc0, double target) {
  double h[32][sl::kBinsPerLane], v[32];
  for (int l = 0; l < 32; ++l) {
    sl::lane_bins(hist, l, h[l]);
    v[l] = sl::lane_sum(h[l]);
  }
  for (int off = 1; off < 32; off <<= 1) {
    double nv[32];
    for (int l = 0; l < 32; ++l) nv[l] = l >= off ? v[l] + v[l - off] : v[l];
    std::copy(nv, nv + 32, v);
  }
  sl::LaneWalk w[32];
  for (int l = 0; l < 32; ++l) w[l] = sl::lane_walk(h[l], l, acc0 + (l ? v[l - 1] : 0.0), target);
  return sl::combine_lanes(w, 32);
}

// A radix selection over keys with weights (w[i] == 0: not a participant; counts: all 1).
// Returns the key; *above, *n_eq (participants with the key).
uint32_t radix(const std::vector<uint32_t>& keys, const std::vector<double>& w, double target, double* above,
               int64_t* n_eq) {
  uint32_t prefix = 0, mask = 0;
  double acc = 0;
  int64_t cnt = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    double hist[256] = {};
    int64_t chist[256] = {};
    for (size_t i = 0; i < keys.size(); ++i) {
      if (w[i] == 0.0 || (keys[i] & mask) != prefix) continue;
      hist[(keys[i] >> shift) & 255u] += w[i];
      ++chist[(keys[i] >> shift) & 255u];
    }
    const sl::BucketPick p = warp_pick(hist, acc, target);
    acc = p.above;
    cnt = chist[p.d];
    prefix |= uint32_t(p.d) << shift;
    mask |= 255u << shift;
  }
  *above = acc;
  *n_eq = cnt;
  return prefix;
}

// The id of the n-th (1-based) element with pred, in id order (exact on the device too).
template <class P>
int32_t nth(int64_t V, int64_t n, P pred) {
  int64_t c = 0;
  for (int64_t i = 0; i < V; ++i)
    if (pred(i) && ++c == n) return int32_t(i);
  return 0;
}

double mass_of(float x, const sl::RowSel& s) { return std::exp(double(x) * s.invT - s.mx); }

sl::RowSel select_row(const float* x, int64_t V, float T, float top_p, int32_t top_k, bool need_z) {
  sl::RowSel s;
  s.invT = 1.0 / double(T);
  float mxf = -INFINITY;
  for (int64_t i = 0; i < V; ++i) mxf = mxf < x[i] ? x[i] : mxf;
  s.mx = double(mxf) * s.invT;
  std::vector<uint32_t> keys(static_cast<size_t>(V));
  for (int64_t i = 0; i < V; ++i) keys[size_t(i)] = sl::order_key(x[i]);
  s.use_k = sl::uses_top_k(top_k, V);
  if (s.use_k) {
    double gt;
    int64_t n_eq;
    s.kth = radix(keys, std::vector<double>(size_t(V), 1.0), double(top_k), &gt, &n_eq);
    const int64_t ties_left = top_k - int64_t(gt);
    s.k_last = ties_left >= n_eq ? 0x7fffffff : nth(V, ties_left, [&](int64_t i) { return keys[size_t(i)] == s.kth; });
  }
  std::vector<double> wk(static_cast<size_t>(V));
  double z = 0;
  for (int64_t i = 0; i < V; ++i) {
    wk[size_t(i)] = sl::keep_k(s, keys[size_t(i)], i) ? mass_of(x[i], s) : 0.0;
    z += wk[size_t(i)];
  }
  if (sl::uses_top_p(top_p)) {
    const double target = double(top_p) * z;
    double above;
    int64_t n_tie;
    s.tau = radix(keys, wk, target, &above, &n_tie);
    const int64_t n_keep = sl::topp_ties_kept(above, mass_of(sl::key_float(s.tau), s), target, n_tie);
    s.use_p = 1;
    s.p_last = n_keep >= n_tie ? 0x7fffffff
               : n_keep == 0   ? -1
                               : nth(V, n_keep, [&](int64_t i) {
                                   return keys[size_t(i)] == s.tau && sl::keep_k(s, keys[size_t(i)], i);
                                 });
    if (need_z) {
      z = 0;
      for (int64_t i = 0; i < V; ++i) z += sl::keep(s, keys[size_t(i)], i) ? mass_of(x[i], s) : 0.0;
    }
  }
  s.z = z;
  return s;
}

// The per-warp ordered pick of block_pick (nw warps).
int32_t block_pick(const std::vector<double>& w, int nw, double u, bool scaled, double* total_out) {
  const int64_t V = int64_t(w.size());
  std::vector<double> tot(static_cast<size_t>(nw));
  std::vector<int32_t> last(size_t(nw), -1);
  auto chunk_scan = [&](int64_t i0, int64_t e, double* p, double* v) {
    for (int l = 0; l < 32; ++l) v[l] = p[l] = i0 + l < e ? w[size_t(i0 + l)] : 0.0;
    for (int off = 1; off < 32; off <<= 1) {
      double np[32];
      for (int l = 0; l < 32; ++l) np[l] = l >= off ? p[l] + p[l - off] : p[l];
      std::copy(np, np + 32, p);
    }
  };
  for (int wi = 0; wi < nw; ++wi) {
    const int64_t b = sl::seg_begin(V, nw, wi), e = sl::seg_end(V, nw, wi);
    double carry = 0, p[32], v[32];
    for (int64_t i0 = b; i0 < e; i0 += 32) {
      chunk_scan(i0, e, p, v);
      carry = carry + p[31];
      for (int l = 0; l < 32; ++l)
        if (v[l] > 0.0) last[size_t(wi)] = int32_t(i0 + l);
    }
    tot[size_t(wi)] = carry;
  }
  std::vector<double> excl(static_cast<size_t>(nw));
  double ex = 0;
  for (int wi = 0; wi < nw; ++wi) {
    excl[size_t(wi)] = ex;
    ex = ex + tot[size_t(wi)];
  }
  *total_out = ex;
  const double x = scaled ? u * ex : u;
  for (int wi = 0; wi < nw; ++wi) {
    if (!(x < excl[size_t(wi)] + tot[size_t(wi)])) continue;
    const int64_t b = sl::seg_begin(V, nw, wi), e = sl::seg_end(V, nw, wi);
    double carry = 0, p[32], v[32];
    for (int64_t i0 = b; i0 < e; i0 += 32) {
      chunk_scan(i0, e, p, v);
      for (int l = 0; l < 32; ++l)
        if (i0 + l < e && sl::crosses(x, excl[size_t(wi)] + (carry + p[l]), v[l])) return int32_t(i0 + l);
      carry = carry + p[31];
    }
    return last[size_t(wi)] < 0 ? 0 : last[size_t(wi)];
  }
  int32_t r = -1;
  for (int wi = 0; wi < nw; ++wi) r = std::max(r, last[size_t(wi)]);
  return r < 0 ? 0 : r;
}

std::vector<double> masses(const float* x, int64_t V, const sl::RowSel& s) {
  std::vector<double> w(static_cast<size_t>(V));
  for (int64_t i = 0; i < V; ++i) w[size_t(i)] = sl::keep(s, sl::order_key(x[i]), i) ? mass_of(x[i], s) : 0.0;
  return w;
}

int32_t argmax_row(const float* x, int64_t V) {
  int64_t b = 0;
  for (int64_t i = 1; i < V; ++i)
    if (x[i] > x[b]) b = i;
  return int32_t(b);
}

[[maybe_unused]] int32_t emu_sample(const float* x, int64_t V, float T, float top_p, int32_t top_k, double u, int nw) {
  if (T <= 0.0f) return argmax_row(x, V);
  const sl::RowSel s = select_row(x, V, T, top_p, top_k, false);
  double total;
  return block_pick(masses(x, V, s), nw, u, true, &total);
}

// The kept set by definition (test_sampling.py exact_probs): a stable sort by value
// (descending; the sampler's keys), top_k, then the smallest prefix reaching top_p.
std::vector<int> kept_by_sorting(const float* x, int64_t V, float T, float top_p, int32_t top_k) {
  std::vector<int> order(static_cast<size_t>(V));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return sl::order_key(x[a]) > sl::order_key(x[b]); });
  if (top_k > 0 && top_k < V) order.resize(size_t(top_k));
  // masses as the CPU forms them (exact boundaries, e.g. equal masses, then agree)
  const double invT = 1.0 / double(T);
  double mx = -INFINITY;
  for (int64_t i = 0; i < V; ++i) mx = std::max(mx, double(x[i]) * invT);
  if (top_p < 1.0f) {
    double z = 0, cum = 0;
    for (int i : order) z += std::exp(double(x[i]) * invT - mx);
    size_t n = 0;
    for (; n < order.size();) {
      cum += std::exp(double(x[order[n]]) * invT - mx);
      ++n;
      if (cum >= double(top_p) * z) break;
    }
    order.resize(n);
  }
  std::sort(order.begin(), order.end());
  return order;
}

// Random rows: continuous, or a few values with many ties (integers), or -inf masked.
std::vector<float> random_row(int64_t V, int kind) {
  std::vector<float> r(static_cast<size_t>(V));
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (auto& v : r) {
    if (kind == 0) v = nd(gen());
    else if (kind == 1) v = float(irand(-3, 3));
    else v = irand(0, 4) == 0 ? -INFINITY : nd(gen());
  }
  if (kind == 2) r[size_t(irand(0, V - 1))] = 1.0f;  // at least one finite
  return r;
}

}  // namespace

// ============================================================================ host: the rules
TEST(keys_preserve_order_and_invert) {
  std::vector<float> v = {-INFINITY, -3e38f, -1.5f, -1e-30f, -0.0f, 0.0f, 1e-40f, 1e-30f, 2.0f, 3e38f, INFINITY};
  for (size_t i = 0; i + 1 < v.size(); ++i) CHECK(sl::order_key(v[i]) < sl::order_key(v[i + 1]));
  for (float f : v) CHECK(sl::float_bits(sl::key_float(sl::order_key(f))) == sl::float_bits(f));
  for (int i = 0; i < 10000; ++i) {
    const uint32_t bits = uint32_t(gen()());
    const float f = sl::bits_float(bits);
    CHECK(sl::float_bits(sl::key_float(sl::order_key(f))) == bits);
    if (f == f) CHECK(sl::topk_key(f) > sl::topk_key(std::numeric_limits<float>::quiet_NaN()));
  }
  // topk: -0 ties with +0, NaN below -inf (key 0)
  CHECK(sl::topk_key(-0.0f) == sl::topk_key(0.0f));
  CHECK(sl::topk_key(std::nanf("")) == 0u && sl::topk_key(-std::nanf("")) == 0u);
  CHECK(sl::topk_key(-INFINITY) > 0u);
  CHECK(sl::topk_sort_key(5, 3) < sl::topk_sort_key(5, 4));
  CHECK(sl::topk_sort_key(6, 9) < sl::topk_sort_key(5, 0));
  CHECK(sl::topk_sort_index(sl::topk_sort_key(7, 123)) == 123u && sl::topk_sort_keyval(sl::topk_sort_key(7, 1)) == 7u);
}

TEST(lane_bucket_walk_equals_the_serial_walk) {
  for (int trial = 0; trial < 4000; ++trial) {
    double hist[256] = {};
    const int density = int(irand(1, 4));
    const bool counts = trial % 2 == 0;
    for (int d = 0; d < 256; ++d)
      if (irand(0, 7) < density) hist[d] = counts ? double(irand(0, 50)) : unif() * std::pow(10.0, double(irand(-8, 2)));
    if (trial % 97 == 0) std::fill(hist, hist + 256, 0.0);  // empty
    double total = 0;
    for (double h : hist) total += h;
    const double acc0 = counts ? double(irand(0, 20)) : unif();
    // targets: reachable, exactly at a boundary (counts), unreachable
    double target = acc0 + (counts ? double(irand(0, int64_t(total) + 3)) : unif() * total * 1.1);
    if (trial % 13 == 0) target = acc0 + total + 1.0;
    const sl::BucketPick a = warp_pick(hist, acc0, target), b = sl::serial_walk(hist, acc0, target);
    CHECK(a.d == b.d);
    if (counts) {
      CHECK(a.above == b.above);
    } else {
      CHECK_NEAR(a.above, b.above, 1e-12 * (1 + std::fabs(b.above)));
    }
    if (a.d != b.d) {
      std::printf("  trial %d: lanes %d vs serial %d\n", trial, a.d, b.d);
      break;
    }
  }
}

TEST(topp_ties_and_acceptance_rules) {
  // four tokens of mass 0.25 each after 0 above: top_p 0.4 keeps 2, 0.5 keeps 2 (0.5 >= 0.5), 0.51 keeps 3
  CHECK(sl::topp_ties_kept(0.0, 0.25, 0.4, 4) == 2);
  CHECK(sl::topp_ties_kept(0.0, 0.25, 0.5, 4) == 2);
  CHECK(sl::topp_ties_kept(0.0, 0.25, 0.51, 4) == 3);
  CHECK(sl::topp_ties_kept(0.0, 0.25, 2.0, 4) == 4);  // unreachable: every tie
  CHECK(sl::topp_ties_kept(0.3, 0.25, 0.3, 4) == 0);
  CHECK(sl::accept_draft(0.5, 0.4, 0.3) == true);   // 0.2 < 0.3
  CHECK(sl::accept_draft(0.5, 1.0, 0.5) == false);  // strict
  CHECK(sl::residual(0.3, 0.5) == 0.0 && sl::residual(0.5, 0.25) == 0.25);
  CHECK(sl::residual(std::nan(""), 0.1) == 0.0);  // std::max(0.0, NaN) = 0 on the CPU
  CHECK(!sl::crosses(0.5, 1.0, 0.0) && sl::crosses(0.5, 1.0, 0.1) && !sl::crosses(1.0, 1.0, 0.1));
  // segments: cover [0, V) in order, multiples of 32
  for (int64_t V : {1, 31, 32, 33, 1000, 154880})
    for (int nw : {1, 3, 16, 32}) {
      int64_t at = 0;
      for (int w = 0; w < nw; ++w) {
        CHECK(sl::seg_begin(V, nw, w) == at);
        CHECK(sl::seg_begin(V, nw, w) % 32 == 0 || sl::seg_begin(V, nw, w) == V);
        at = sl::seg_end(V, nw, w);
      }
      CHECK(at == V);
    }
}

TEST(emulated_selection_keeps_the_defined_set) {
  // the kernels' procedure (emulated) vs the sort-based definition of the kept set
  const float temps[] = {1.0f, 0.7f, 1.3f};
  const float tops_p[] = {1.0f, 0.9f, 0.5f, 0.3f, 1e-6f, 0.999f};
  const int32_t tops_k[] = {0, 1, 3, 6, 12, 50};
  int checked = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t V = trial % 3 == 0 ? irand(1, 40) : irand(30, 700);
    const int kind = int(irand(0, 2));
    const std::vector<float> x = random_row(V, kind);
    const float T = temps[irand(0, 2)], tp = tops_p[irand(0, 5)];
    const int32_t tk = tops_k[irand(0, 5)];
    const sl::RowSel s = select_row(x.data(), V, T, tp, tk, true);
    std::vector<int> got;
    for (int64_t i = 0; i < V; ++i)
      if (sl::keep(s, sl::order_key(x[size_t(i)]), i) && mass_of(x[size_t(i)], s) > 0) got.push_back(int(i));
    std::vector<int> want = kept_by_sorting(x.data(), V, T, tp, tk);
    want.erase(std::remove_if(want.begin(), want.end(), [&](int i) { return !(mass_of(x[size_t(i)], s) > 0); }),
               want.end());
    CHECK(got == want);
    if (got != want) {
      std::printf("  trial %d V %lld kind %d T %g top_p %g top_k %d: %zu kept vs %zu\n", trial, (long long)V, kind,
                  double(T), double(tp), int(tk), got.size(), want.size());
      break;
    }
    ++checked;
  }
  CHECK(checked == 300);
}

TEST(emulated_draw_equals_a_serial_cdf_walk) {
  // the per-warp ordered pick vs the CPU's sequential walk (cpu draw) over random masses
  // with zeros, for several warp counts
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t V = irand(1, 3000);
    std::vector<double> w(static_cast<size_t>(V));
    for (auto& v : w) v = irand(0, 2) == 0 ? 0.0 : unif();
    double z = 0;
    for (double v : w) z += v;
    for (int nw : {1, 4, 16, 32}) {
      const double u = unif();
      double total;
      const int32_t got = block_pick(w, nw, u, true, &total);
      // serial
      const double x = u * z;
      double cum = 0;
      int32_t want = 0, last = 0;
      bool found = false;
      for (int64_t i = 0; i < V && !found; ++i) {
        if (w[size_t(i)] <= 0) continue;
        cum += w[size_t(i)];
        last = int32_t(i);
        if (x < cum) {
          want = int32_t(i);
          found = true;
        }
      }
      if (!found) want = last;
      CHECK(got == want);
      CHECK(w[size_t(got)] > 0 || z == 0);
      CHECK_NEAR(total, z, 1e-12 * z);
    }
  }
  // nothing has mass: 0, as the CPU
  double total;
  CHECK(block_pick(std::vector<double>(100, 0.0), 4, 0.5, true, &total) == 0 && total == 0.0);
  // the count search: the n-th flagged element
  std::vector<double> flags(500, 0.0);
  for (int i = 7; i < 500; i += 11) flags[size_t(i)] = 1.0;
  for (int n = 1; n <= 45; ++n) CHECK(block_pick(flags, 3, double(n - 1), false, &total) == 7 + 11 * (n - 1));
}

#ifndef DFLASH2_SAMPLING_LOGIC_ONLY
using namespace dflash2;

namespace {
Tensor host_f32(std::vector<float>& v, const Tensor::Shape& s) { return Tensor::view(v.data(), DType::F32, s); }
Tensor host_i32(std::vector<int32_t>& v, const Tensor::Shape& s) { return Tensor::view(v.data(), DType::I32, s); }
Tensor host_i64(std::vector<int64_t>& v, const Tensor::Shape& s) { return Tensor::view(v.data(), DType::I64, s); }

struct Batch {  // R rows with per-row sampling parameters and Philox states
  int64_t R, V;
  std::vector<float> logits, temp, top_p;
  std::vector<int32_t> top_k;
  std::vector<int64_t> rng;
};
Batch random_batch(int64_t R, int64_t V) {
  Batch b{R, V, {}, {}, {}, {}, {}};
  const float temps[] = {0.0f, 1.0f, 0.7f, 1.3f};
  const float tops_p[] = {1.0f, 0.9f, 0.5f, 1e-6f};
  const int32_t tops_k[] = {0, 1, 5, 50};
  for (int64_t r = 0; r < R; ++r) {
    const std::vector<float> x = random_row(V, int(r % 3));
    b.logits.insert(b.logits.end(), x.begin(), x.end());
    b.temp.push_back(temps[irand(0, 3)]);
    b.top_p.push_back(tops_p[irand(0, 3)]);
    b.top_k.push_back(tops_k[irand(0, 3)]);
    b.rng.push_back(int64_t(irand(0, int64_t(1) << 62)));
    b.rng.push_back(irand(0, int64_t(1) << 40));
  }
  return b;
}
ops::SamplingTensors params(Batch& b, Device dev) {
  return {host_f32(b.temp, {b.R}).to(dev), host_f32(b.top_p, {b.R}).to(dev), host_i32(b.top_k, {b.R}).to(dev)};
}
}  // namespace

TEST(emulated_sample_equals_the_cpu_op) {
  for (int64_t V : {1, 7, 40, 333, 2000}) {
    Batch b = random_batch(24, V);
    Tensor out = Tensor::empty(DType::I32, {b.R});
    ops::sample(host_f32(b.logits, {b.R, V}), params(b, Device::cpu()), host_i64(b.rng, {b.R, 2}), out);
    for (int64_t r = 0; r < b.R; ++r) {
      const double u = philox::uniform(uint64_t(b.rng[size_t(2 * r)]), uint64_t(b.rng[size_t(2 * r + 1)]));
      for (int nw : {1, 16}) {
        const int32_t got = emu_sample(b.logits.data() + r * V, V, b.temp[size_t(r)], b.top_p[size_t(r)],
                                       b.top_k[size_t(r)], u, nw);
        CHECK(got == out.data_as<int32_t>()[r]);
      }
    }
  }
}

TEST(emulated_accept_equals_the_cpu_op) {
  // the two-kernel procedure of accept (row selections, sequential decisions, the bonus draw
  // from the residual with a K-wide q) replayed on the host against cpu accept
  const int64_t V = 60, K = 4, C = 5, S = 40;
  std::vector<float> logits(size_t(S * (K + 1) * V));
  for (auto& v : logits) v = float(std::normal_distribution<double>(0, 1.5)(gen()));
  std::vector<int32_t> row0(S), draft(size_t(S * K)), draft_row(S), draft_len(S), cand(size_t(S * K * C)), top_k(S);
  std::vector<float> q(size_t(S * K * C)), temp(S), top_p(S);
  std::vector<int64_t> rng(size_t(2 * S));
  for (int64_t s = 0; s < S; ++s) {
    row0[size_t(s)] = int32_t(s * (K + 1));
    draft_row[size_t(s)] = int32_t(S - 1 - s);
    draft_len[size_t(s)] = int32_t(irand(0, K));
    temp[size_t(s)] = s % 5 == 0 ? 0.0f : 1.0f;
    top_p[size_t(s)] = s % 3 == 0 ? 0.8f : 1.0f;
    top_k[size_t(s)] = s % 4 == 0 ? 10 : 0;
    rng[size_t(2 * s)] = irand(0, int64_t(1) << 62);
    rng[size_t(2 * s + 1)] = irand(0, int64_t(1) << 40);
  }
  for (int64_t n = 0; n < S; ++n)
    for (int64_t j = 0; j < K; ++j) {
      double sum = 0;
      for (int64_t c = 0; c < C; ++c) {
        cand[size_t((n * K + j) * C + c)] = int32_t(irand(0, V - 1));
        sum += (q[size_t((n * K + j) * C + c)] = float(unif()));
      }
      for (int64_t c = 0; c < C; ++c) q[size_t((n * K + j) * C + c)] = float(q[size_t((n * K + j) * C + c)] / sum);
      const int64_t pick = irand(0, C);  // a candidate, or a token outside them
      draft[size_t(n * K + j)] = pick < C ? cand[size_t((n * K + j) * C + pick)] : int32_t(irand(0, V - 1));
    }
  Tensor acc = Tensor::empty(DType::I32, {S}), bon = Tensor::empty(DType::I32, {S});
  ops::SamplingTensors sp{host_f32(temp, {S}), host_f32(top_p, {S}), host_i32(top_k, {S})};
  ops::accept(host_f32(logits, {S * (K + 1), V}), host_i32(row0, {S}), host_i32(draft, {S, K}),
              host_i32(draft_row, {S}), host_i32(draft_len, {S}), host_i32(cand, {S, K, C}), host_f32(q, {S, K, C}),
              sp, host_i64(rng, {S, 2}), acc, bon);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t L = draft_len[size_t(s)], dr = draft_row[size_t(s)];
    auto row = [&](int64_t j) { return logits.data() + (row0[size_t(s)] + j) * V; };
    auto u = [&](int64_t j) { return philox::uniform(uint64_t(rng[size_t(2 * s)]), uint64_t(rng[size_t(2 * s + 1)]) + uint64_t(j)); };
    int64_t n = 0;
    int32_t b = 0;
    if (temp[size_t(s)] <= 0.0f) {
      while (n < L && draft[size_t(dr * K + n)] == argmax_row(row(n), V)) ++n;
      b = argmax_row(row(n), V);
    } else {
      std::vector<sl::RowSel> sel;
      for (int64_t j = 0; j <= L; ++j)
        sel.push_back(select_row(row(j), V, temp[size_t(s)], top_p[size_t(s)], top_k[size_t(s)], true));
      for (; n < L; ++n) {
        const int32_t tok = draft[size_t(dr * K + n)];
        double qd = 1.0;
        for (int64_t c = 0; c < C; ++c)
          if (cand[size_t((dr * K + n) * C + c)] == tok) {
            qd = q[size_t((dr * K + n) * C + c)];
            break;
          }
        const double pd = masses(row(n), V, sel[size_t(n)])[size_t(tok)] / sel[size_t(n)].z;
        if (!sl::accept_draft(u(n), qd, pd)) break;
      }
      double total;
      if (n < L) {
        std::vector<double> w = masses(row(n), V, sel[size_t(n)]);
        for (auto& v : w) v /= sel[size_t(n)].z;
        for (int64_t c = 0; c < C; ++c) {
          const int32_t id = cand[size_t((dr * K + n) * C + c)];
          w[size_t(id)] = sl::residual(masses(row(n), V, sel[size_t(n)])[size_t(id)] / sel[size_t(n)].z,
                                       double(q[size_t((dr * K + n) * C + c)]));
        }
        b = block_pick(w, 2, u(K), true, &total);
        if (!(total > 0)) b = block_pick(masses(row(n), V, sel[size_t(n)]), 2, u(K), true, &total);
      } else {
        b = block_pick(masses(row(L), V, sel[size_t(L)]), 2, u(K), true, &total);
      }
    }
    CHECK(n == acc.data_as<int32_t>()[s]);
    CHECK(b == bon.data_as<int32_t>()[s]);
  }
}

TEST(emulated_topk_equals_the_cpu_op) {
  for (int trial = 0; trial < 60; ++trial) {
    const int64_t V = irand(1, 500), k = irand(1, V);
    std::vector<float> x(static_cast<size_t>(V));
    for (auto& v : x) v = float(irand(-5, 5));
    if (V > 3) {
      x[size_t(irand(0, V - 1))] = std::nanf("");
      x[size_t(irand(0, V - 1))] = -0.0f;
      x[size_t(irand(0, V - 1))] = -INFINITY;
    }
    Tensor vals = Tensor::empty(DType::F32, {1, k}), idx = Tensor::empty(DType::I32, {1, k});
    ops::topk(host_f32(x, {1, V}), k, vals, idx);
    // emulation: count radix over topk keys, the first ties in id order, then sort
    std::vector<uint32_t> keys(static_cast<size_t>(V));
    for (int64_t i = 0; i < V; ++i) keys[size_t(i)] = sl::topk_key(x[size_t(i)]);
    uint32_t kth = 0;
    int32_t k_last = 0x7fffffff;
    if (k < V) {
      double gt;
      int64_t n_eq;
      kth = radix(keys, std::vector<double>(size_t(V), 1.0), double(k), &gt, &n_eq);
      const int64_t ties_left = k - int64_t(gt);
      if (ties_left < n_eq) k_last = nth(V, ties_left, [&](int64_t i) { return keys[size_t(i)] == kth; });
    }
    std::vector<uint64_t> sk;
    for (int64_t i = 0; i < V; ++i)
      if (keys[size_t(i)] > kth || (keys[size_t(i)] == kth && i <= k_last))
        sk.push_back(sl::topk_sort_key(keys[size_t(i)], uint32_t(i)));
    CHECK(int64_t(sk.size()) == k);
    std::sort(sk.begin(), sk.end());
    for (int64_t j = 0; j < k && j < int64_t(sk.size()); ++j)
      CHECK(int32_t(sl::topk_sort_index(sk[size_t(j)])) == idx.data_as<int32_t>()[j]);
  }
}

// ============================================================================ device vs CPU
#ifdef DFLASH2_WITH_CUDA
namespace {
bool have_gpu(const char* test) {
  std::string why;
  if (cuda_available(&why)) return true;
  std::printf("  %s: skipped on this machine: %s\n", test, why.c_str());
  return false;
}
std::vector<int32_t> to_i32(const Tensor& t) {
  Tensor h = t.to(Device::cpu());
  return std::vector<int32_t>(h.data_as<int32_t>(), h.data_as<int32_t>() + h.numel());
}
std::vector<float> to_f32(const Tensor& t) {
  Tensor h = t.to(Device::cpu());
  return std::vector<float>(h.data_as<float>(), h.data_as<float>() + h.numel());
}
}  // namespace

TEST(cuda_topk_matches_cpu) {
  if (!have_gpu("cuda_topk_matches_cpu")) return;
  const Device dev = Device::cuda(0);
  for (auto rvk : std::vector<std::array<int64_t, 3>>{{1, 1, 1}, {3, 17, 5}, {2, 9680, 16}, {4, 300, 300}, {5, 64, 8},
                                                      {2, 154880, 16}, {1, 5000, 2500}, {3, 1000, 64}}) {
    const int64_t R = rvk[0], V = rvk[1], k = rvk[2];
    std::vector<float> x(size_t(R * V));
    for (auto& v : x) v = float(irand(-20, 20));
    if (V > 3) x[1] = std::nanf(""), x[2] = -0.0f;
    Tensor cv = Tensor::empty(DType::F32, {R, k}), ci = Tensor::empty(DType::I32, {R, k});
    ops::topk(host_f32(x, {R, V}), k, cv, ci);
    Tensor dv = Tensor::empty(DType::F32, {R, k}, dev), di = Tensor::empty(DType::I32, {R, k}, dev);
    cuda::topk(host_f32(x, {R, V}).to(dev), k, dv, di);
    const std::vector<int32_t> gi = to_i32(di);
    const std::vector<float> gv = to_f32(dv);
    for (int64_t j = 0; j < R * k; ++j) {
      CHECK(gi[size_t(j)] == ci.data_as<int32_t>()[j]);
      CHECK(std::memcmp(&gv[size_t(j)], cv.data_as<float>() + j, 4) == 0);
    }
  }
}

TEST(cuda_sample_matches_cpu) {
  if (!have_gpu("cuda_sample_matches_cpu")) return;
  const Device dev = Device::cuda(0);
  for (int64_t V : {1, 7, 40, 333, 2000, 154880}) {
    Batch b = random_batch(V > 10000 ? 12 : 64, V);
    Tensor out = Tensor::empty(DType::I32, {b.R});
    ops::sample(host_f32(b.logits, {b.R, V}), params(b, Device::cpu()), host_i64(b.rng, {b.R, 2}), out);
    Tensor dout = Tensor::empty(DType::I32, {b.R}, dev);
    cuda::sample(host_f32(b.logits, {b.R, V}).to(dev), params(b, dev), host_i64(b.rng, {b.R, 2}).to(dev), dout);
    const std::vector<int32_t> got = to_i32(dout);
    for (int64_t r = 0; r < b.R; ++r) CHECK(got[size_t(r)] == out.data_as<int32_t>()[r]);
  }
}

TEST(cuda_accept_matches_cpu) {
  if (!have_gpu("cuda_accept_matches_cpu")) return;
  const Device dev = Device::cuda(0);
  for (int64_t V : {50, 3000}) {
    for (bool wide : {false, true}) {
      const int64_t K = 6, C = 8, S = 48;
      std::vector<float> logits(size_t(S * (K + 1) * V));
      for (auto& v : logits) v = float(std::normal_distribution<double>(0, 2.0)(gen()));
      std::vector<int32_t> row0(S), draft(size_t(S * K)), draft_row(S), draft_len(S), cand(size_t(S * K * C)),
          top_k(S);
      std::vector<float> q(size_t(S * K * C)), temp(S), top_p(S);
      std::vector<int64_t> rng(size_t(2 * S));
      for (int64_t s = 0; s < S; ++s) {
        row0[size_t(s)] = int32_t(s * (K + 1));
        draft_row[size_t(s)] = int32_t(s);
        draft_len[size_t(s)] = int32_t(irand(0, K));
        temp[size_t(s)] = s % 6 == 0 ? 0.0f : 0.9f;
        top_p[size_t(s)] = s % 3 == 0 ? 0.85f : 1.0f;
        top_k[size_t(s)] = s % 4 == 0 ? 20 : 0;
        rng[size_t(2 * s)] = irand(0, int64_t(1) << 62);
        rng[size_t(2 * s + 1)] = irand(0, int64_t(1) << 40);
        for (int64_t j = 0; j < K; ++j) {
          double sum = 0;
          for (int64_t c = 0; c < C; ++c) {
            cand[size_t((s * K + j) * C + c)] = int32_t(irand(0, V - 1));
            sum += (q[size_t((s * K + j) * C + c)] = float(unif()));
          }
          for (int64_t c = 0; c < C; ++c) q[size_t((s * K + j) * C + c)] = float(q[size_t((s * K + j) * C + c)] / sum);
          // mostly the target's argmax (long accepted prefixes), else a candidate
          draft[size_t(s * K + j)] = irand(0, 2) ? argmax_row(logits.data() + (s * (K + 1) + j) * V, V)
                                                 : cand[size_t((s * K + j) * C + irand(0, C - 1))];
        }
      }
      Tensor acc = Tensor::empty(DType::I32, {S}), bon = Tensor::empty(DType::I32, {S});
      ops::SamplingTensors sp{host_f32(temp, {S}), host_f32(top_p, {S}), host_i32(top_k, {S})};
      Tensor hc = wide ? host_i32(cand, {S, K, C}) : Tensor(), hq = wide ? host_f32(q, {S, K, C}) : Tensor();
      ops::accept(host_f32(logits, {S * (K + 1), V}), host_i32(row0, {S}), host_i32(draft, {S, K}),
                  host_i32(draft_row, {S}), host_i32(draft_len, {S}), hc, hq, sp, host_i64(rng, {S, 2}), acc, bon);
      Tensor dacc = Tensor::empty(DType::I32, {S}, dev), dbon = Tensor::empty(DType::I32, {S}, dev);
      ops::SamplingTensors dsp{sp.temperature.to(dev), sp.top_p.to(dev), sp.top_k.to(dev)};
      cuda::accept(host_f32(logits, {S * (K + 1), V}).to(dev), host_i32(row0, {S}).to(dev),
                   host_i32(draft, {S, K}).to(dev), host_i32(draft_row, {S}).to(dev), host_i32(draft_len, {S}).to(dev),
                   wide ? hc.to(dev) : Tensor(), wide ? hq.to(dev) : Tensor(), dsp, host_i64(rng, {S, 2}).to(dev),
                   dacc, dbon);
      const std::vector<int32_t> ga = to_i32(dacc), gb = to_i32(dbon);
      for (int64_t s = 0; s < S; ++s) {
        CHECK(ga[size_t(s)] == acc.data_as<int32_t>()[s]);
        CHECK(gb[size_t(s)] == bon.data_as<int32_t>()[s]);
      }
    }
  }
}

TEST(cuda_selector_walk_matches_cpu) {
  if (!have_gpu("cuda_selector_walk_matches_cpu")) return;
  const Device dev = Device::cuda(0);
  for (auto c : std::vector<std::array<int64_t, 5>>{{1, 1, 1, 1, 3}, {3, 6, 8, 13, 100}, {2, 16, 16, 256, 5000},
                                                    {2, 7, 40, 64, 300}}) {
    const int64_t S = c[0], P = c[1], K = c[2], R = c[3], V = c[4];
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> vals(size_t(S * P * K)), g(size_t(S * P * R)), pred(size_t(V * R)), succ(size_t(V * R));
    std::vector<int32_t> cand(size_t(S * P * K)), anchors(static_cast<size_t>(S));
    for (auto& v : vals) v = 4.0f * nd(gen());  // spread: margins between scores
    for (auto& v : g) v = nd(gen()) / std::sqrt(float(R));
    for (auto& v : pred) v = nd(gen());
    for (auto& v : succ) v = nd(gen());
    for (auto& v : cand) v = int32_t(irand(0, V - 1));
    for (auto& v : anchors) v = int32_t(irand(0, V - 1));
    for (float t : {0.0f, 0.8f}) {
      std::vector<float> temp(size_t(S), t);
      std::vector<int64_t> rng(size_t(2 * S));
      for (auto& v : rng) v = irand(0, int64_t(1) << 40);
      Tensor tok = Tensor::empty(DType::I32, {S, P}), q = Tensor::zeros(DType::F32, {S, P, K});
      ops::selector_walk(host_f32(vals, {S, P, K}), host_i32(cand, {S, P, K}), host_f32(g, {S, P, R}),
                         host_f32(pred, {V, R}), host_f32(succ, {V, R}), host_i32(anchors, {S}), host_f32(temp, {S}),
                         host_i64(rng, {S, 2}), tok, q);
      Tensor dtok = Tensor::empty(DType::I32, {S, P}, dev), dq = Tensor::zeros(DType::F32, {S, P, K}, dev);
      cuda::selector_walk(host_f32(vals, {S, P, K}).to(dev), host_i32(cand, {S, P, K}).to(dev),
                          host_f32(g, {S, P, R}).to(dev), host_f32(pred, {V, R}).to(dev),
                          host_f32(succ, {V, R}).to(dev), host_i32(anchors, {S}).to(dev),
                          host_f32(temp, {S}).to(dev), host_i64(rng, {S, 2}).to(dev), dtok, dq);
      const std::vector<int32_t> gt = to_i32(dtok);
      for (int64_t i = 0; i < S * P; ++i) CHECK(gt[size_t(i)] == tok.data_as<int32_t>()[i]);
      const std::vector<float> gq = to_f32(dq);
      double err = 0, nrm = 0;
      for (int64_t i = 0; i < S * P * K; ++i) {
        const double d = double(gq[size_t(i)]) - double(q.data_as<float>()[i]);
        err += d * d;
        nrm += double(q.data_as<float>()[i]) * double(q.data_as<float>()[i]);
      }
      CHECK(err <= 1e-10 * std::max(nrm, 1e-30));
      if (t == 0.0f) {  // a greedy-only call without rng and q
        Tensor none, dtok2 = Tensor::empty(DType::I32, {S, P}, dev);
        cuda::selector_walk(host_f32(vals, {S, P, K}).to(dev), host_i32(cand, {S, P, K}).to(dev),
                            host_f32(g, {S, P, R}).to(dev), host_f32(pred, {V, R}).to(dev),
                            host_f32(succ, {V, R}).to(dev), host_i32(anchors, {S}).to(dev),
                            host_f32(temp, {S}).to(dev), Tensor(), dtok2, none);
        CHECK(to_i32(dtok2) == gt);
      }
    }
  }
}
#endif  // DFLASH2_WITH_CUDA
#endif  // DFLASH2_SAMPLING_LOGIC_ONLY

TEST_MAIN()
