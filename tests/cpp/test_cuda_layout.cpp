// The CUDA backend's index and layout arithmetic (cpp/src/backend/cuda/layout.h), checked on
// the CPU: the header is plain C++ (its DFLASH2_HD functions are __host__ __device__ under
// nvcc), so this runs in every build, with or without CUDA or a GPU. What the kernels do
// with these functions is checked on a GPU by test_cuda_backend and tests/test_ops.py.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "backend/cuda/layout.h"
#include "dflash2/dflash2.h"
#include "testing.h"

using namespace dflash2;
namespace L = dflash2::cuda::layout;

namespace {

// Every element's (src offset, dst offset) in row-major order of the original shape.
std::vector<std::pair<int64_t, int64_t>> naive_walk(const std::vector<int64_t>& shape, const std::vector<int64_t>& ss,
                                                    const std::vector<int64_t>& ds) {
  std::vector<std::pair<int64_t, int64_t>> out;
  const int nd = int(shape.size());
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  std::vector<int64_t> idx(nd, 0);
  for (int64_t e = 0; e < n; ++e) {
    int64_t so = 0, d = 0;
    for (int k = 0; k < nd; ++k) {
      so += idx[k] * ss[k];
      d += idx[k] * ds[k];
    }
    out.emplace_back(so, d);
    for (int k = nd - 1; k >= 0; --k) {
      if (++idx[k] < shape[k]) break;
      idx[k] = 0;
    }
  }
  return out;
}

template <class I>
std::vector<std::pair<int64_t, int64_t>> collapsed_walk(const L::StridedPair& p, int64_t n) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t i = 0; i < n; ++i) {
    int64_t so, d;
    L::pair_offsets<I>(p, I(i), &so, &d);
    out.emplace_back(so, d);
  }
  return out;
}

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> s(shape.size(), 0);
  int64_t acc = 1;
  for (int k = int(shape.size()) - 1; k >= 0; --k) {
    s[k] = acc;
    acc *= shape[k];
  }
  return s;
}

}  // namespace

TEST(collapse_keeps_every_offset) {
  std::mt19937 rng(2024);
  int cases = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const int nd = int(rng() % 7);  // 0-D .. 6-D
    std::vector<int64_t> shape(nd);
    for (auto& s : shape) s = 1 + int64_t(rng() % 4);
    // strides: contiguous, contiguous of a wider buffer (slices), permuted, arbitrary
    // (negative, zero, non-unit last dim)
    auto make = [&](int kind) {
      std::vector<int64_t> st = contiguous_strides(shape);
      if (kind == 1) {
        std::vector<int64_t> wide(shape);
        for (auto& w : wide) w += int64_t(rng() % 3);
        st = contiguous_strides(wide);
      } else if (kind == 2 && nd > 1) {
        std::vector<int> perm(nd);
        for (int k = 0; k < nd; ++k) perm[k] = k;
        std::shuffle(perm.begin(), perm.end(), rng);
        std::vector<int64_t> ps(nd);
        std::vector<int64_t> pshape(nd);
        for (int k = 0; k < nd; ++k) pshape[k] = shape[perm[k]];
        std::vector<int64_t> cs = contiguous_strides(pshape);
        for (int k = 0; k < nd; ++k) ps[perm[k]] = cs[k];
        st = ps;
      } else if (kind == 3) {
        for (auto& s : st) s = int64_t(rng() % 41) - 20;
      }
      return st;
    };
    const std::vector<int64_t> ss = make(int(rng() % 4)), ds = make(int(rng() % 4));
    const L::StridedPair p = L::collapse(nd, shape.data(), ss.data(), ds.data());
    CHECK(p.ndim <= nd);
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    CHECK(L::numel(p) == n);
    for (int k = 0; k < p.ndim; ++k) CHECK(p.shape[k] > 1);
    const auto want = naive_walk(shape, ss, ds);
    CHECK(collapsed_walk<uint32_t>(p, n) == want);
    CHECK(collapsed_walk<uint64_t>(p, n) == want);
    if (L::is_one_run(p)) {  // a memcpy must be exactly that
      for (int64_t i = 0; i < n; ++i) CHECK(want[size_t(i)] == std::make_pair(i, i));
    }
    ++cases;
  }
  std::printf("  %d random shapes / stride pairs\n", cases);
}

TEST(collapse_merges_what_it_should) {
  // contiguous 6-D on both sides: one run
  std::vector<int64_t> shape = {2, 3, 1, 4, 5, 6};
  std::vector<int64_t> c = contiguous_strides(shape);
  L::StridedPair p = L::collapse(6, shape.data(), c.data(), c.data());
  CHECK(p.ndim == 1 && p.shape[0] == 720 && L::is_one_run(p));
  // rows of a wider buffer on one side: 2 dims (rows, row)
  std::vector<int64_t> s2 = {3, 8}, src2 = {8, 1}, dst2 = {10, 1};
  p = L::collapse(2, s2.data(), src2.data(), dst2.data());
  CHECK(p.ndim == 2 && p.shape[0] == 3 && p.shape[1] == 8 && p.src_stride[0] == 8 && p.dst_stride[0] == 10);
  CHECK(!L::is_one_run(p));
  // a transpose does not merge
  std::vector<int64_t> s3 = {4, 5}, src3 = {1, 4}, dst3 = {5, 1};
  p = L::collapse(2, s3.data(), src3.data(), dst3.data());
  CHECK(p.ndim == 2);
  // 0-D and all-size-1 shapes: a single element
  p = L::collapse(0, nullptr, nullptr, nullptr);
  CHECK(p.ndim == 0 && L::numel(p) == 1 && L::is_one_run(p));
  std::vector<int64_t> ones = {1, 1, 1}, odd = {7, 9, 11};
  p = L::collapse(3, ones.data(), odd.data(), odd.data());
  CHECK(p.ndim == 0 && L::is_one_run(p));
  // a strided last dim (every other element) is not a run
  std::vector<int64_t> s4 = {6}, src4 = {2}, dst4 = {1};
  p = L::collapse(1, s4.data(), src4.data(), dst4.data());
  CHECK(p.ndim == 1 && !L::is_one_run(p));
  // large element counts walk correctly with 64-bit indices
  std::vector<int64_t> big = {3, int64_t(1) << 31}, bs = {int64_t(1) << 32, 1}, bd = {int64_t(1) << 31, 1};
  p = L::collapse(2, big.data(), bs.data(), bd.data());
  int64_t so, d;
  L::pair_offsets<uint64_t>(p, (uint64_t(2) << 31) + 5, &so, &d);
  CHECK(so == (int64_t(2) << 32) + 5 && d == (int64_t(2) << 31) + 5);
}

TEST(row_layout_of_views) {
  std::vector<float> buf(4 * 5 * 16);
  // contiguous [4, 5, 16]: 20 rows of 16
  Tensor t = Tensor::view(buf.data(), DType::F32, {4, 5, 16});
  L::RowLayout r = L::row_layout(t, "op", "x");
  CHECK(r.rows == 20 && r.stride == 16 && r.cols == 16);
  // a slice of the last dim: rows keep the stride of the full row
  r = L::row_layout(t.slice(2, 3, 11), "op", "x");
  CHECK(r.rows == 20 && r.stride == 16 && r.cols == 8);
  // every other row ([::2] of a [20, 16] view)
  Tensor every_other = Tensor::view(buf.data(), DType::F32, {10, 16}, {32, 1});
  r = L::row_layout(every_other, "op", "x");
  CHECK(r.rows == 10 && r.stride == 32);
  // size-1 dims anywhere are ignored, whatever their strides
  Tensor with_ones = Tensor::view(buf.data(), DType::F32, {1, 6, 1, 16}, {999, 20, 7, 1});
  r = L::row_layout(with_ones, "op", "x");
  CHECK(r.rows == 6 && r.stride == 20);
  // one row: stride = D
  r = L::row_layout(t.slice(0, 1, 2).slice(1, 2, 3), "op", "x");
  CHECK(r.rows == 1 && r.stride == 16);
  r = L::row_layout(Tensor::view(buf.data(), DType::F32, {16}), "op", "x");
  CHECK(r.rows == 1 && r.stride == 16);
  // empty rows
  r = L::row_layout(Tensor::view(buf.data(), DType::F32, {3, 0}), "op", "x");
  CHECK(r.rows == 0);
  // not evenly strided (a slice of the middle dim), strided last dim: errors naming op and arg
  CHECK_THROWS(L::row_layout(t.slice(1, 1, 3), "myop", "x"), "cuda::myop: the leading dimensions of 'x'");
  CHECK_THROWS(L::row_layout(t.transpose(1, 2), "myop", "y"), "'y' must be contiguous in its last dimension");
  // overlapping output rows
  Tensor overlap = Tensor::view(buf.data(), DType::F32, {4, 16}, {8, 1});
  CHECK_THROWS(L::check_rows_disjoint(L::row_layout(overlap, "op", "out"), "op", "out"), "rows of 'out' overlap");
  L::check_rows_disjoint(L::row_layout(t, "op", "out"), "op", "out");  // fine
}

namespace {
// Whether two views share a byte, element by element.
bool share_bytes(const Tensor& a, const Tensor& b) {
  auto bytes = [](const Tensor& t) {
    std::set<uintptr_t> out;
    std::vector<int64_t> idx(size_t(t.ndim()), 0);
    const int64_t n = t.numel();
    const size_t e = dtype_size(t.dtype());
    for (int64_t i = 0; i < n; ++i) {
      int64_t off = 0;
      for (int d = 0; d < t.ndim(); ++d) off += idx[size_t(d)] * t.stride(d);
      for (size_t k = 0; k < e; ++k) out.insert(reinterpret_cast<uintptr_t>(t.data()) + uintptr_t(off) * e + k);
      for (int d = t.ndim() - 1; d >= 0; --d) {
        if (++idx[size_t(d)] < t.shape(d)) break;
        idx[size_t(d)] = 0;
      }
    }
    return out;
  };
  const std::set<uintptr_t> sa = bytes(a), sb = bytes(b);
  for (uintptr_t x : sa)
    if (sb.count(x)) return true;
  return false;
}
}  // namespace

TEST(views_disjoint_never_claims_a_shared_element) {
  // the fused launches (rope_many, cache_write_many, linear_many) run views in any order only
  // where views_disjoint says they share nothing: it may say "maybe" (false) for disjoint
  // views, never true for sharing ones
  std::vector<float> buf(64 * 80 + 7);
  Tensor cache = Tensor::view(buf.data() + 3, DType::F32, {64, 80});  // a cache of [c 64 | k_pe 16] rows
  Tensor c = cache.slice(1, 0, 64), pe = cache.slice(1, 64, 80);
  CHECK(L::views_disjoint(c, pe) && L::views_disjoint(pe, c));  // column slices of one cache
  CHECK(!share_bytes(c, pe));
  CHECK(!L::views_disjoint(c, cache) && !L::views_disjoint(c, cache.slice(1, 60, 70)));
  CHECK(!L::views_disjoint(c, c));
  // a row view against a 3-D view of the same bytes (q [T, H, D] slices)
  Tensor q = Tensor::view(buf.data(), DType::F32, {8, 4, 96});
  Tensor q_pe = q.slice(2, 32, 96), q_nope = q.slice(2, 0, 32);
  CHECK(!L::views_disjoint(q_pe, q_nope));  // interleaved by heads: "maybe", not claimed
  CHECK(L::views_disjoint(q.slice(0, 0, 4), q.slice(0, 4, 8)));  // byte extents apart
  CHECK(L::views_disjoint(Tensor::view(buf.data(), DType::F32, {0, 5}), cache));  // empty
  // random 2-D column views of one buffer: never "disjoint" when they share a byte
  std::mt19937 rng(7);
  int claimed = 0;
  for (int it = 0; it < 3000; ++it) {
    auto pick = [&](int64_t stride) {
      const int64_t rows = 1 + int64_t(rng() % 6), c0 = int64_t(rng() % 24), w = 1 + int64_t(rng() % 12);
      const int64_t start = int64_t(rng() % 40) + c0;
      return Tensor::view(buf.data() + start, DType::F32, {rows, w}, {stride, 1});
    };
    const int64_t stride = 16 + int64_t(rng() % 3) * 8;
    Tensor a = pick(stride), b = pick(rng() % 4 == 0 ? stride + 8 : stride);
    const bool disjoint = L::views_disjoint(a, b);
    if (disjoint) ++claimed;
    CHECK(!(disjoint && share_bytes(a, b)));
    CHECK(disjoint == L::views_disjoint(b, a));
  }
  CHECK(claimed > 300);  // the row rule says "disjoint" often enough to matter
}

TEST(rope_pairs_cover_each_element_once) {
  for (int64_t D : {2, 4, 6, 64, 128, 130}) {
    const int64_t half = D / 2;
    for (bool inter : {true, false}) {
      std::vector<int> seen(size_t(D), 0);
      for (int64_t i = 0; i < half; ++i) {
        const L::RopePair p = L::rope_pair(inter, i, half);
        CHECK(p.a >= 0 && p.a < D && p.b >= 0 && p.b < D && p.a < p.b);
        ++seen[size_t(p.a)];
        ++seen[size_t(p.b)];
        if (inter)
          CHECK(p.a == 2 * i && p.b == 2 * i + 1);
        else
          CHECK(p.a == i && p.b == i + half);
      }
      CHECK(std::all_of(seen.begin(), seen.end(), [](int s) { return s == 1; }));
    }
    for (int64_t i = 0; i < half; ++i) CHECK(L::rope_exponent(i, D) == float(2 * i) / float(D));
  }
  CHECK(L::rope_exponent(0, 64) == 0.0f);
}

namespace {

struct Cand {
  float v;
  int32_t i;
};

Cand better_of(Cand a, Cand b) { return L::argmax_better(b.v, b.i, a.v, a.i) ? b : a; }

// The argmax kernel's reduction, step by step, for a block of `threads` threads.
int32_t simulate_argmax_kernel(const std::vector<float>& x, int threads) {
  const int32_t V = int32_t(x.size());
  std::vector<Cand> c(size_t(threads), Cand{-INFINITY, L::kArgmaxNone});
  for (int t = 0; t < threads; ++t)
    for (int32_t i = t; i < V; i += threads)
      if (!std::isnan(x[size_t(i)]) && L::argmax_better(x[size_t(i)], i, c[size_t(t)].v, c[size_t(t)].i))
        c[size_t(t)] = Cand{x[size_t(i)], i};
  auto butterfly = [](std::vector<Cand>& lanes) {  // 32 lanes, __shfl_xor_sync steps
    for (int off = 16; off > 0; off >>= 1) {
      std::vector<Cand> next = lanes;
      for (int l = 0; l < 32; ++l) {
        const Cand o = lanes[size_t(l ^ off)];
        if (L::argmax_better(o.v, o.i, lanes[size_t(l)].v, lanes[size_t(l)].i)) next[size_t(l)] = o;
      }
      lanes = next;
    }
  };
  const int nwarps = threads / 32;
  std::vector<Cand> warp_best(32, Cand{-INFINITY, L::kArgmaxNone});
  for (int w = 0; w < nwarps; ++w) {
    std::vector<Cand> lanes(c.begin() + w * 32, c.begin() + w * 32 + 32);
    butterfly(lanes);
    warp_best[size_t(w)] = lanes[0];
  }
  butterfly(warp_best);
  return L::argmax_finish(std::isnan(x[0]), warp_best[0].i);
}

// Any reduction tree: random pairwise merges of the candidates.
int32_t random_tree_argmax(const std::vector<float>& x, std::mt19937& rng) {
  std::vector<Cand> c;
  for (size_t i = 0; i < x.size(); ++i)
    c.push_back(std::isnan(x[i]) ? Cand{-INFINITY, L::kArgmaxNone} : Cand{x[i], int32_t(i)});
  while (c.size() > 1) {
    const size_t a = rng() % c.size();
    size_t b = rng() % (c.size() - 1);
    if (b >= a) ++b;
    const Cand m = better_of(c[a], c[b]);
    c[std::min(a, b)] = m;
    c.erase(c.begin() + std::max(a, b));
  }
  return L::argmax_finish(std::isnan(x[0]), c[0].i);
}

}  // namespace

TEST(argmax_reduction_matches_the_cpu_rule) {
  std::mt19937 rng(77);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  int cases = 0, bad = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int64_t V = trial < 50 ? 1 + trial : 1 + int64_t(rng() % 3000);
    std::vector<float> x(static_cast<size_t>(V));
    const int mode = trial % 6;
    for (auto& v : x) {
      const uint32_t u = rng() % 100;
      if (mode == 0) v = float(int(rng() % 7) - 3);  // many ties
      else if (mode == 1) v = u < 20 ? nan : float(int(rng() % 5));  // NaNs among ties
      else if (mode == 2) v = u < 50 ? 0.0f : -0.0f;  // +0 / -0 tie
      else if (mode == 3) v = u < 90 ? -INFINITY : (u < 95 ? nan : -1e30f);
      else if (mode == 4) v = nan;  // all NaN
      else v = std::ldexp(float(int(rng() % 2001) - 1000), int(rng() % 20) - 10);
    }
    if (trial % 5 == 0) x[0] = nan;  // NaN first: the CPU answers 0
    if (trial % 7 == 0) x[size_t(V - 1)] = INFINITY;
    Tensor xt = Tensor::view(x.data(), DType::F32, {1, V});
    Tensor out = Tensor::zeros(DType::I32, {1});
    ops::argmax(xt, out);  // the CPU backend: the oracle
    const int32_t want = out.data_as<int32_t>()[0];
    for (int threads : {32, 64, 96, 1024}) {
      const int32_t got = simulate_argmax_kernel(x, threads);
      if (got != want) {
        if (bad < 5) std::printf("    V %lld mode %d threads %d: got %d want %d\n", (long long)V, mode, threads, got, want);
        ++bad;
      }
      ++cases;
    }
    for (int k = 0; k < 3; ++k) {
      const int32_t got = random_tree_argmax(x, rng);
      if (got != want) ++bad;
      ++cases;
    }
  }
  std::printf("  %d reductions, %d differ from the CPU's argmax\n", cases, bad);
  CHECK(bad == 0);
}

TEST(index_helpers) {
  CHECK(L::row_in_range(0, 1) && !L::row_in_range(1, 1) && !L::row_in_range(-1, 5));
  CHECK(!L::row_in_range(int64_t(1) << 40, int64_t(1) << 20));
  CHECK(!L::row_in_range(0, 0));
  // dyn_conv: H = 12 channels in G = 3 groups of 4
  for (int64_t c = 0; c < 12; ++c) CHECK(L::conv_group(c, 4) == c / 4);
  CHECK(L::argmax_finish(false, L::kArgmaxNone) == 0);
  CHECK(L::argmax_finish(true, 17) == 0);
  CHECK(L::argmax_finish(false, 17) == 17);
}

// gemm_dq.cu: the shared-memory swizzle is a permutation of each row's chunks and every
// ldmatrix phase (8 consecutive rows, one logical chunk) hits 8 distinct groups of 4 banks.
TEST(dq_swizzle_is_conflict_free) {
  for (int row = 0; row < L::kDqBN; ++row) {
    std::set<int> slots;
    for (int c = 0; c < L::kDqChunks; ++c) slots.insert(L::dq_chunk(row, c));
    CHECK(int(slots.size()) == L::kDqChunks && *slots.begin() == row * L::kDqChunks &&
          *slots.rbegin() == row * L::kDqChunks + L::kDqChunks - 1);
  }
  for (int r0 = 0; r0 < L::kDqBN; r0 += 8)
    for (int c = 0; c < L::kDqChunks; ++c) {
      std::set<int> groups;
      for (int r = r0; r < r0 + 8; ++r) groups.insert(L::dq_chunk(r, c) % 8);  // 16-byte chunk -> 4-bank group
      CHECK(groups.size() == 8);
    }
}

// The ldmatrix.x4 lane addresses give mma.m16n8k16's fragments. ldmatrix: matrix i's row j is
// read from the address of lane 8 i + j, and thread l receives, in register i, elements
// (row l / 4, columns 2 (l % 4) + 0, 1) of matrix i. The PTX fragments: A register i holds
// row l / 4 + 8 (i & 1), inputs 8 (i >> 1) + 2 (l % 4) + 0, 1; B register b_j of 8 features
// holds feature l / 4, inputs 8 j + 2 (l % 4) + 0, 1.
TEST(dq_ldmatrix_lanes_give_mma_fragments) {
  for (int l = 0; l < 32; ++l)
    for (int i = 0; i < 4; ++i)
      for (int e = 0; e < 2; ++e) {
        const int src = 8 * i + l / 4;  // the lane whose address gave this matrix row
        const int a_row = L::dq_a_lane_row(src), a_k = 8 * L::dq_a_lane_chunk(src) + 2 * (l % 4) + e;
        CHECK(a_row == l / 4 + 8 * (i & 1) && a_k == 8 * (i >> 1) + 2 * (l % 4) + e);
        // B: registers 0, 1 = b0, b1 of features 0-7; 2, 3 = b0, b1 of features 8-15
        const int b_n = L::dq_b_lane_row(src), b_k = 8 * L::dq_b_lane_chunk(src) + 2 * (l % 4) + e;
        CHECK(b_n == l / 4 + 8 * (i >> 1) && b_k == 8 * (i & 1) + 2 * (l % 4) + e);
      }
}

// The grouped m-tiles: every row of every group in exactly one tile of its own group, at
// most kDqBM rows a tile, no tile past the last, within the launch's upper bound.
TEST(dq_grouped_tiles_cover_every_row_once) {
  std::mt19937 gen(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int G = 1 + int(gen() % 40);
    std::vector<int32_t> start(size_t(G) + 1, 0), ts(size_t(G) + 1, -1);
    for (int g = 0; g < G; ++g) {
      const uint32_t kind = gen() % 4;  // empty, small, around a tile, several tiles
      const int32_t m = kind == 0 ? 0 : kind == 1 ? int32_t(1 + gen() % 8)
                        : kind == 2 ? int32_t(L::kDqBM - 1 + gen() % 3) : int32_t(gen() % 300);
      start[size_t(g) + 1] = start[size_t(g)] + m;
    }
    const int64_t rows = start[size_t(G)] + int64_t(gen() % 5);  // M may exceed the rows used
    L::dq_tile_starts(start.data(), G, ts.data());
    const int64_t bound = L::dq_max_m_tiles(rows, G);
    CHECK(ts[0] == 0 && ts[size_t(G)] <= bound);
    std::vector<int> seen(static_cast<size_t>(start[size_t(G)]), 0);
    for (int64_t t = 0; t < bound; ++t) {
      const L::DqRows r = L::dq_tile_rows(start.data(), ts.data(), G, t);
      if (t >= ts[size_t(G)]) {
        CHECK(r.first >= r.end);
        continue;
      }
      CHECK(r.first < r.end && r.end - r.first <= L::kDqBM);
      CHECK(r.group >= 0 && r.group < G && r.first >= start[size_t(r.group)] && r.end <= start[size_t(r.group) + 1]);
      for (int64_t p = r.first; p < r.end; ++p) ++seen[size_t(p)];
    }
    CHECK(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }));
  }
}

// gemm_sk.cu: every lane's segments cover each input of a stage once (per row), the x tile's
// swizzle is a bijection within each row, and each 8-lane phase of a B-fragment load
// touches 8 distinct 16-byte bank groups.
TEST(sk_stage_mapping_and_swizzle) {
  for (const int E : {8, 16, 32}) {
    const int64_t SK = L::sk_stage_k(E);
    CHECK(SK == 4 * L::sk_segs(E) * E && SK % 128 == 0);
    std::vector<int> seen(size_t(SK), 0);
    for (int t = 0; t < 4; ++t)
      for (int i = 0; i < L::sk_segs(E); ++i)
        for (int e = 0; e < E; ++e) {
          const int64_t k = L::sk_k(E, t, i, e);
          CHECK(k >= 0 && k < SK);
          ++seen[size_t(k)];
          // the chunk a group reads is the one holding these inputs
          CHECK(L::sk_lane_chunk(E, t, i, e / 8) == int(k / 8));
        }
    CHECK(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }));
    const int chunks = int(SK / 8);
    for (int r = 0; r < L::kSkTok; ++r) {
      std::vector<int> hit(size_t(chunks), 0);
      for (int c = 0; c < chunks; ++c) {
        const int at = L::sk_x_chunk(r, c, E);
        CHECK(at >= r * chunks && at < (r + 1) * chunks);
        ++hit[size_t(at - r * chunks)];
      }
      CHECK(std::all_of(hit.begin(), hit.end(), [](int c) { return c == 1; }));
    }
    for (int p = 0; p < 16; ++p)  // phase p: lanes 8p .. 8p + 7 (rows 2p, 2p + 1 of one n-tile... mod 8)
      for (int i = 0; i < L::sk_segs(E); ++i)
        for (int h = 0; h < E / 8; ++h) {
          std::vector<int> bank(8, 0);
          for (int l = 0; l < 8; ++l) {
            const int row = (2 * p + l / 4) % L::kSkTok, t = l % 4;
            ++bank[size_t(L::sk_x_chunk(row, L::sk_lane_chunk(E, t, i, h), E) % 8)];
          }
          CHECK(std::all_of(bank.begin(), bank.end(), [](int c) { return c == 1; }));
        }
  }
}

TEST(sk_splits_depend_on_n_k_only_and_cover_k) {
  for (const int E : {8, 16, 32})
    for (const int64_t N : {1, 8, 64, 150, 576, 2048, 6144, 16384, 154880})
      for (const int64_t K : {1, 16, 200, 512, 2048, 6144, 16384})
        for (const int groups : {1, L::kSkGroups, 2 * L::kSkGroups}) {  // one weight; the grouped experts' kernel
          const int S = L::sk_splits(N, K, E, groups);
          const int64_t stages = (K + L::sk_stage_k(E) - 1) / L::sk_stage_k(E);
          CHECK(S >= 1 && S <= L::kSkMaxSplits && (S & (S - 1)) == 0 && S <= std::max<int64_t>(stages, 1));
          CHECK(L::sk_split_begin(stages, S, 0) == 0 && L::sk_split_begin(stages, S, S) == stages);
          for (int z = 0; z < S; ++z) CHECK(L::sk_split_begin(stages, S, z + 1) > L::sk_split_begin(stages, S, z));
          // more groups never split more: the CTAs of all of them already fill the GPU
          CHECK(L::sk_splits(N, K, E, groups) <= L::sk_splits(N, K, E));
        }
  // GLM-5.3's small-N projections split; the wide ones do not need to
  CHECK(L::sk_splits(576, 6144, 8) == 32 && L::sk_splits(6144, 6144, 8) == 8 && L::sk_splits(154880, 6144, 8) == 1);
  // its routed experts (NVFP4, the grouped kernel: 8 experts of a decode token): gate and up
  // (one launch: 2 x 8 groups) 2048 x 6144 in 2 (1024 CTAs), down 6144 x 2048 whole (768);
  // at TP 4 (gate and up 512 x 6144) in 8
  CHECK(L::sk_splits(2048, 6144, 32, 2 * L::kSkGroups) == 2 && L::sk_splits(6144, 2048, 32, L::kSkGroups) == 1 &&
        L::sk_splits(512, 6144, 32, 2 * L::kSkGroups) == 8);
}

TEST_MAIN()
