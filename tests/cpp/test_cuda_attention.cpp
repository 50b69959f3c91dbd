// The CUDA attention ops' index logic (cpp/src/backend/cuda/attention_index.h) checked on the
// CPU: paged slots, the float -> ordered-key map, and the whole radix top-k selection
// (histogram passes, threshold walk, ascending-position emit) run host-side against a
// sort-based reference of the CPU backend's topk rule (larger first, NaN last, ties to the
// earlier key) on score arrays with many ties. The header is plain C++, so this part runs in
// every build (and standalone: g++ -std=c++17 -Icpp/include -Icpp/src -Itests/cpp).
//
// With a CUDA build (DFLASH2_WITH_CUDA, linked with the library) the device cases compare
// cuda indexer_topk / mla_attention / block_attention with the CPU backend on the same
// inputs; they skip without a usable device.
//
// Status: the host part runs; the device cases were compiled but have not yet run on a GPU.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/attention_index.h"
#include "testing.h"
#ifdef DFLASH2_WITH_CUDA
#include "dflash2/dflash2.h"
#endif

namespace A = dflash2::cuda::attn;

namespace {

std::mt19937& rng() {
  static std::mt19937 g(20240531u);
  return g;
}

// The CPU backend's topk order (cpu/elementwise.cpp): a ranks before b.
bool cpu_better(const std::vector<float>& x, int32_t a, int32_t b) {
  const float va = x[a], vb = x[b];
  const bool na = std::isnan(va), nb = std::isnan(vb);
  if (na != nb) return nb;
  if (!na && va != vb) return va > vb;
  return a < b;
}

std::vector<int32_t> reference_topk(const std::vector<float>& x, int64_t k) {
  std::vector<int32_t> idx(x.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return cpu_better(x, a, b); });
  idx.resize(size_t(k));
  std::sort(idx.begin(), idx.end());
  return idx;
}

// The select kernel's algorithm, host-side: histogram passes over the class, the threshold
// walk, then the emit over tiles of `tile` positions with an exclusive scan per tile (here a
// sequential one). Every output slot must be written exactly once.
std::vector<int32_t> radix_topk(const std::vector<float>& x, int64_t k, int tile, int* passes_used) {
  const int64_t n = int64_t(x.size());
  A::RadixSelect st = A::radix_begin(uint32_t(k));
  int passes = 0;
  for (int pass = 0; pass < A::kRadixPasses; ++pass) {
    uint32_t hist[A::kRadixBins] = {};
    for (int64_t j = 0; j < n; ++j) {
      const uint32_t key = A::order_key(x[size_t(j)]);
      if (A::radix_in_class(st, key)) ++hist[A::radix_digit(key, pass)];
    }
    A::radix_step(st, hist, pass);
    ++passes;
    if (st.done) break;
  }
  if (passes_used) *passes_used = passes;
  std::vector<int32_t> out(size_t(k), -1);
  std::vector<int> written(size_t(k), 0);
  uint32_t above_tot = 0, class_tot = 0;
  for (int64_t base = 0; base < n; base += tile) {
    uint32_t run = 0;  // exclusive scan of the packed flags inside the tile
    for (int64_t j = base; j < base + tile; ++j) {
      const uint32_t key = j < n ? A::order_key(x[size_t(j)]) : 0u;
      const uint32_t f = j < n ? A::emit_flags(st, key) : 0u;
      const uint32_t ab = above_tot + (run & 0xffffu), cb = class_tot + (run >> 16);
      if (j < n && A::radix_selected(st, key, cb)) {
        const uint32_t slot = A::emit_slot(st, ab, cb);
        if (slot < uint32_t(k)) {
          out[slot] = int32_t(j);
          ++written[slot];
        } else {
          written[0] += 100;  // out of range: fails below
        }
      }
      run += f;
    }
    above_tot += run & 0xffffu;
    class_tot += run >> 16;
  }
  for (int w : written)
    if (w != 1) return {};
  return out;
}

}  // namespace

TEST(order_key_preserves_the_cpu_ranking) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float den = std::numeric_limits<float>::denorm_min();
  const std::vector<float> ascending = {-inf, -3e38f, -2.0f, -1.0f, -1e-30f, -den, 0.0f,
                                        den,  1e-30f, 1.0f,  2.0f,  3e38f,   inf};
  for (size_t i = 0; i + 1 < ascending.size(); ++i) CHECK(A::order_key(ascending[i]) < A::order_key(ascending[i + 1]));
  CHECK(A::order_key(-0.0f) == A::order_key(0.0f));
  CHECK(A::order_key(nan) == 0u);
  CHECK(A::order_key(-nan) == 0u);
  CHECK(A::order_key(-inf) > 0u);
  std::uniform_int_distribution<uint32_t> bits;
  int bad = 0;
  for (int i = 0; i < 200000; ++i) {
    uint32_t ua = bits(rng()), ub = (i % 3 == 0) ? ua ^ 1u : bits(rng());
    float a, b;
    std::memcpy(&a, &ua, 4);
    std::memcpy(&b, &ub, 4);
    if (std::isnan(a) || std::isnan(b)) continue;
    const uint32_t ka = A::order_key(a), kb = A::order_key(b);
    if ((a > b) != (ka > kb) || (a == b) != (ka == kb)) ++bad;
  }
  CHECK(bad == 0);
}

TEST(paged_slot_walks_the_block_table) {
  const int64_t bs = 4, nb = 5, rows = 10 * bs;
  const std::vector<int32_t> bt = {7, 2, 9, -1, 10};
  for (int64_t p = -2; p < nb * bs + 3; ++p) {
    const int64_t got = A::paged_slot(bt.data(), nb, bs, rows, p);
    int64_t want = -1;
    if (p >= 0 && p / bs < nb) {
      const int64_t blk = bt[size_t(p / bs)];
      if (blk >= 0 && (blk + 1) * bs <= rows) want = blk * bs + p % bs;
    }
    CHECK(got == want);
  }
  CHECK(A::paged_slot(bt.data(), nb, bs, rows, 5) == 2 * bs + 1);
  CHECK(A::paged_slot(bt.data(), nb, bs, rows, 13) == -1);  // block -1
  CHECK(A::paged_slot(bt.data(), nb, bs, rows, 17) == -1);  // block 10 is past the cache
  CHECK(A::causal_keys(-1, 100) == 0);
  CHECK(A::causal_keys(5, 100) == 6);
  CHECK(A::causal_keys(500, 100) == 100);
  CHECK(A::window_first_key(10, 3, 0) == 0);
  CHECK(A::window_first_key(10, 3, 4) == 10);  // keys j > 13 - 4
  CHECK(A::window_first_key(2, 0, 8) == 0);
}

TEST(block_attention_segments_cover_every_key) {
  for (int64_t cap : {int64_t(1), int64_t(64), int64_t(4096), int64_t(4104), int64_t(131072), int64_t(1) << 20}) {
    for (int64_t B : {int64_t(1), int64_t(8), int64_t(16)}) {
      const int64_t seg = A::block_attn_segment(cap, B);
      CHECK(seg >= 256 && seg % 32 == 0);
      const int64_t nz = A::block_attn_segments(cap + B, seg);
      CHECK(nz >= 1 && nz <= 33 && nz * seg >= cap + B && (nz - 1) * seg < cap + B);
    }
  }
  CHECK(A::block_attn_segment(4096, 8) == 256);        // 4104 keys: 17 segments
  CHECK(A::block_attn_segments(4104, 256) == 17);
  CHECK(A::block_attn_segment(131072, 8) == 4128);     // 32 segments
  CHECK(A::block_attn_segments(0, 256) == 0 && A::block_attn_segments(256, 256) == 1);
}

TEST(block_attention_tc_segments_cover_every_key) {
  // the tensor-core kernel's segments: whole 64-key tiles, >= 256 keys, <= 64 segments, and
  // every item's keys (its context from the earliest row's window start, then B) within
  // block_attn_tc_keys, whatever the context length, row and window
  for (int64_t cap : {int64_t(16), int64_t(4096), int64_t(131072), int64_t(1) << 20}) {
    for (int64_t window : {int64_t(0), int64_t(1), int64_t(600), int64_t(2048), int64_t(1) << 22}) {
      for (int64_t B : {int64_t(1), int64_t(8), int64_t(16)}) {
        const int64_t keys = A::block_attn_tc_keys(cap, window, B);
        CHECK(keys == (window > 0 && window < cap ? window : cap) + B);
        const int64_t seg = A::block_attn_tc_segment(keys);
        const int64_t nz = A::block_attn_segments(keys, seg);
        CHECK(seg >= 256 && seg % 64 == 0 && nz >= 1 && nz <= 64 && nz * seg >= keys && (nz - 1) * seg < keys);
        for (int64_t L : {int64_t(0), int64_t(1), window, cap - 1, cap}) {
          if (L < 0 || L > cap) continue;
          for (int64_t i0 = 0; i0 < B; ++i0) {
            const int64_t c = A::window_first_key(L, i0, window);
            const int64_t nctx = L - (c < L ? c : L);
            CHECK(nctx + B <= keys);
          }
        }
      }
    }
  }
  CHECK(A::block_attn_tc_keys(4096, 2048, 8) == 2056);  // the GLM-5.3 drafter: 9 segments of 256
  CHECK(A::block_attn_tc_segment(2056) == 256 && A::block_attn_segments(2056, 256) == 9);
  CHECK(A::block_attn_tc_segment(131080) == 2112);     // 131072 + 8 keys: 63 segments
}

TEST(radix_select_matches_sorted_reference_with_ties) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::normal_distribution<float> nd(0.0f, 1.0f);
  int cases = 0, bad = 0, early = 0;
  for (int kind = 0; kind < 7; ++kind) {
    for (int64_t n : {int64_t(2), int64_t(3), int64_t(17), int64_t(64), int64_t(1000), int64_t(3001),
                      int64_t(20000)}) {
      std::vector<float> x(static_cast<size_t>(n));
      for (int64_t j = 0; j < n; ++j) {
        const uint32_t r = rng()();
        switch (kind) {
          case 0: x[size_t(j)] = nd(rng()); break;                                    // distinct
          case 1: x[size_t(j)] = float(int(r % 5)) * 0.25f - 0.5f; break;            // 5 values
          case 2: x[size_t(j)] = 1.5f; break;                                         // all equal
          case 3: {                                                                   // specials
            const float sp[] = {0.0f, -0.0f, inf, -inf, nan, 1.0f, -1.0f, 1e-40f};
            x[size_t(j)] = sp[r % 8];
            break;
          }
          case 4: x[size_t(j)] = std::ldexp(1.0f + float(r % 3) * 0x1p-23f, int(r % 2)); break;  // 1-ulp neighbours
          case 5: x[size_t(j)] = r % 4 == 0 ? nd(rng()) : 0.0f; break;              // relu-like zeros
          default: x[size_t(j)] = float(j % 7) - float(j % 3) * 0.5f; break;        // periodic ties
        }
      }
      for (int64_t k : {int64_t(1), int64_t(2), n / 3, n / 2, n - 1}) {
        if (k < 1 || k >= n) continue;
        for (int tile : {32, 1024}) {
          int passes = 0;
          const std::vector<int32_t> got = radix_topk(x, k, tile, &passes);
          const std::vector<int32_t> want = reference_topk(x, k);
          ++cases;
          early += passes < A::kRadixPasses ? 1 : 0;
          if (got != want) {
            ++bad;
            if (bad <= 5)
              std::printf("  kind %d n %lld k %lld tile %d: selection differs\n", kind, (long long)n, (long long)k,
                          tile);
          }
        }
      }
    }
  }
  std::printf("  %d selections (%d stopped early), %d wrong\n", cases, early, bad);
  CHECK(bad == 0);
  CHECK(early > 0);
}

TEST(radix_step_walks_the_histogram) {
  uint32_t hist[A::kRadixBins] = {};
  hist[255] = 3;
  hist[200] = 5;
  hist[7] = 10;
  A::RadixSelect s = A::radix_begin(6);  // 3 above, then 3 of the 5 in bucket 200
  A::radix_step(s, hist, 0);
  CHECK(s.prefix == (200u << 24));
  CHECK(s.mask == 0xff000000u);
  CHECK(s.k_left == 3);
  CHECK(s.done == 0);
  A::RadixSelect e = A::radix_begin(8);  // exactly buckets 255 and 200: done at once
  A::radix_step(e, hist, 0);
  CHECK(e.prefix == (200u << 24) && e.k_left == 5 && e.done == 1);
  CHECK(A::radix_above(e, 255u << 24));
  CHECK(!A::radix_above(e, 7u << 24) && !A::radix_in_class(e, 7u << 24));
  CHECK(A::emit_slot(s, 4, 10) == 7);
  CHECK(A::emit_slot(s, 4, 1) == 5);
}

// ====================================================================== device cases
#ifdef DFLASH2_WITH_CUDA
using namespace dflash2;

namespace {

bool have_gpu(const char* test) {
  std::string why;
  if (cuda_available(&why)) return true;
  std::printf("  %s: skipped on this machine: %s\n", test, why.c_str());
  return false;
}

Tensor host_f32(const std::vector<float>& v, const Tensor::Shape& shape) {
  Tensor t = Tensor::empty(DType::F32, shape);
  std::memcpy(t.data(), v.data(), v.size() * 4);
  return t;
}
Tensor host_i32(const std::vector<int32_t>& v, const Tensor::Shape& shape) {
  Tensor t = Tensor::empty(DType::I32, shape);
  std::memcpy(t.data(), v.data(), v.size() * 4);
  return t;
}
std::vector<float> normal(size_t n, float sd = 1.0f) {
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng());
  return v;
}
double nmse(const Tensor& got_dev, const Tensor& want) {
  Tensor got = got_dev.to(Device::cpu());
  double err = 0, nrm = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double a = got.data_as<const float>()[i], b = want.data_as<const float>()[i];
    err += (a - b) * (a - b);
    nrm += b * b;
  }
  return nrm > 0 ? err / nrm : err;
}

// A paged cache of `nseq` sequences of up to nb blocks of bs rows, blocks shuffled.
struct Paged {
  int64_t bs, nb, nseq;
  std::vector<int32_t> bt;
  int64_t rows() const { return nseq * nb * bs; }
};
Paged make_paged(int64_t nseq, int64_t nb, int64_t bs) {
  Paged p{bs, nb, nseq, std::vector<int32_t>(size_t(nseq * nb))};
  std::iota(p.bt.begin(), p.bt.end(), 0);
  std::shuffle(p.bt.begin(), p.bt.end(), rng());
  return p;
}

}  // namespace

TEST(indexer_topk_matches_cpu_exactly) {
  if (!have_gpu("indexer_topk_matches_cpu_exactly")) return;
  const Device dev = Device::cuda(0);
  for (int variant = 0; variant < 3; ++variant) {
    const int64_t nI = variant == 2 ? 33 : 4, dI = variant == 2 ? 10 : 16, bs = 8, nb = 40, topk = variant ? 7 : 64;
    const Paged pg = make_paged(2, nb, bs);
    std::vector<float> kc = normal(size_t(pg.rows() * dI));
    if (variant == 1)  // many identical keys: exact score ties, ties to the earlier key
      for (int64_t r = 0; r < pg.rows(); ++r)
        for (int64_t e = 0; e < dI; ++e) kc[size_t(r * dI + e)] = kc[size_t((r % 5) * dI + e)];
    const std::vector<int32_t> seq = {0, 1, 1, 0, 1, 0};
    const std::vector<int32_t> pos = {3, int32_t(topk - 1), int32_t(topk), 100, 250, int32_t(nb * bs - 1)};
    const int64_t T = int64_t(seq.size());
    Tensor q = host_f32(normal(size_t(T * nI * dI)), {T, nI, dI}), w = host_f32(normal(size_t(T * nI)), {T, nI});
    Tensor key_cache = host_f32(kc, {pg.rows(), dI});
    Tensor tseq = host_i32(seq, {T}), tpos = host_i32(pos, {T}), tbt = host_i32(pg.bt, {pg.nseq, nb});
    std::vector<int32_t> init(size_t(T * topk), -7);
    Tensor sel = host_i32(init, {T, topk}), len = host_i32(std::vector<int32_t>(size_t(T), 5), {T});
    ops::PagedTokens tok{tseq, tpos, tbt, bs};
    Tensor dsel = sel.to(dev), dlen = len.to(dev);
    ops::PagedTokens dtok{tseq.to(dev), tpos.to(dev), tbt.to(dev), bs};
    ops::indexer_topk(q, w, key_cache, tok, topk, sel, len);
    ops::indexer_topk(q.to(dev), w.to(dev), key_cache.to(dev), dtok, topk, dsel, dlen);
    Tensor gsel = dsel.to(Device::cpu()), glen = dlen.to(Device::cpu());
    CHECK(std::memcmp(glen.data(), len.data(), size_t(T) * 4) == 0);
    CHECK(std::memcmp(gsel.data(), sel.data(), size_t(T * topk) * 4) == 0);
  }
}

TEST(mla_attention_matches_cpu) {
  if (!have_gpu("mla_attention_matches_cpu")) return;
  const Device dev = Device::cuda(0);
  for (int64_t nh : {int64_t(3), int64_t(20)}) {
    const int64_t kvl = nh == 3 ? 40 : 300, rope = 8, bs = 4, nb = 30, T = 5, K = 12;
    const Paged pg = make_paged(2, nb, bs);
    Tensor cache = host_f32(normal(size_t(pg.rows() * (kvl + rope))), {pg.rows(), kvl + rope});
    Tensor ql = host_f32(normal(size_t(T * nh * kvl), 0.2f), {T, nh, kvl});
    Tensor qp = host_f32(normal(size_t(T * nh * rope), 0.2f), {T, nh, rope});
    const std::vector<int32_t> seq = {0, 1, 0, 1, 1}, pos = {0, 7, 50, 100, 119};
    const std::vector<int32_t> lens = {-1, 0, 12, 5, -1};
    std::vector<int32_t> selv(size_t(T * K), 0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < K; ++j) selv[size_t(t * K + j)] = int32_t((j * 7 + t) % (pos[size_t(t)] + 1));
    Tensor tseq = host_i32(seq, {T}), tpos = host_i32(pos, {T}), tbt = host_i32(pg.bt, {pg.nseq, nb});
    Tensor sel = host_i32(selv, {T, K}), len = host_i32(lens, {T});
    ops::PagedTokens tok{tseq, tpos, tbt, bs};
    ops::PagedTokens dtok{tseq.to(dev), tpos.to(dev), tbt.to(dev), bs};
    for (bool sparse : {false, true}) {
      Tensor want = Tensor::zeros(DType::F32, {T, nh, kvl}), got = Tensor::zeros(DType::F32, {T, nh, kvl}, dev);
      ops::mla_attention(ql, qp, cache, tok, sparse ? sel : Tensor(), sparse ? len : Tensor(), 0.125f, want);
      ops::mla_attention(ql.to(dev), qp.to(dev), cache.to(dev), dtok, sparse ? sel.to(dev) : Tensor(),
                         sparse ? len.to(dev) : Tensor(), 0.125f, got);
      const double e = nmse(got, want);
      if (!(e <= 1e-12)) std::printf("  nh %lld sparse %d: NMSE %.3e\n", (long long)nh, int(sparse), e);
      CHECK(e <= 1e-12);
    }
  }
}

TEST(block_attention_matches_cpu) {
  if (!have_gpu("block_attention_matches_cpu")) return;
  const Device dev = Device::cuda(0);
  for (int64_t hd : {int64_t(16), int64_t(32), int64_t(80)}) {
    for (int64_t window : {int64_t(0), int64_t(5)}) {
      for (bool causal : {false, true}) {
        const int64_t B = 8, S = 3, nh = 4, kvh = 2, T = S * B, cbs = 4, nb = 12;
        const Paged pg = make_paged(S, nb, cbs);
        Tensor q = host_f32(normal(size_t(T * nh * hd), 0.3f), {T, nh, hd});
        Tensor k = host_f32(normal(size_t(T * kvh * hd), 0.3f), {T, kvh, hd});
        Tensor v = host_f32(normal(size_t(T * kvh * hd)), {T, kvh, hd});
        Tensor kv = host_f32(normal(size_t(pg.rows() * 2 * kvh * hd)), {pg.rows(), 2 * kvh * hd});
        Tensor cl = host_i32({0, 13, 47}, {S}), bt = host_i32(pg.bt, {S, nb});
        ops::BlockAttention p;
        p.block = B;
        p.window = window;
        p.causal = causal;
        p.scale = 1.0f / std::sqrt(float(hd));
        p.cache_block_size = cbs;
        Tensor want = Tensor::zeros(DType::F32, {T, nh, hd}), got = Tensor::zeros(DType::F32, {T, nh, hd}, dev);
        ops::block_attention(q, k, v, kv, cl, bt, p, want);
        ops::block_attention(q.to(dev), k.to(dev), v.to(dev), kv.to(dev), cl.to(dev), bt.to(dev), p, got);
        const double e = nmse(got, want);
        if (!(e <= 1e-12))
          std::printf("  hd %lld window %lld causal %d: NMSE %.3e\n", (long long)hd, (long long)window, int(causal), e);
        CHECK(e <= 1e-12);
      }
    }
  }
}
#endif  // DFLASH2_WITH_CUDA

TEST_MAIN()
