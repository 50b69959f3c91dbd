// CPU backend: paged cache writes, the DSA indexer (scores + causal top-k), sparse absorbed
// MLA attention and the DFlash drafter's block attention. Every (token, head) is computed
// alone, in a fixed order (scores with a 4-way partial dot product, max, exp, the sum in
// double, then the weighted sum of values in key order), so a token's result does not
// depend on the other tokens of the step or on the thread count: decode == verify.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cpu/cpu_ops.h"
#include "dflash2/error.h"
#include "ops/kv_fp8.h"

namespace dflash2::cpu {

void cache_write(const Tensor& src, const Tensor& slots, Tensor& cache) {
  const int64_t T = src.shape(0), D = src.shape(1), rows = cache.shape(0);
  const int32_t* sl = slots.data_as<const int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = sl[t * slots.stride(0)];
    DFLASH2_CHECK_ARG(s < rows, "cache_write: slot ", s, " of row ", t, " is outside the cache's ", rows, " rows");
    if (s < 0) continue;
    const float* from = src.data_as<const float>() + t * src.stride(0);
    if (cache.dtype() == DType::U8) {  // an FP8 row (ops/kv_fp8.h): codes, then the group scales
      fp8_quantize_row(from, D, static_cast<uint8_t*>(cache.data()) + s * cache.stride(0));
    } else if (cache.dtype() == DType::BF16) {
      uint16_t* to = static_cast<uint16_t*>(cache.data()) + s * cache.stride(0);
      for (int64_t d = 0; d < D; ++d) to[d] = f32_to_bf16(from[d]);
    } else {
      std::memcpy(cache.data_as<float>() + s * cache.stride(0), from, size_t(D) * 4);
    }
  }
}

void fp8_quantize_row(const float* x, int64_t D, uint8_t* out) {
  const int64_t G = kvfp8::group(D);
  float* scales = reinterpret_cast<float*>(out + D);
  std::memset(out + D, 0, size_t(kvfp8::scale_bytes(D)));
  for (int64_t g0 = 0; g0 < D; g0 += G) {
    float amax = 0.0f;
    for (int64_t d = g0; d < g0 + G; ++d) {
      const float a = std::fabs(x[d]);
      if (a <= 3.4028235e38f && a > amax) amax = a;  // the finite values
    }
    const int e = kvfp8::scale_exp(amax);
    const float inv = kvfp8::pow2(-e);
    for (int64_t d = g0; d < g0 + G; ++d) out[d] = kvfp8::e4m3_encode(x[d] * inv);  // exact scaling
    const float sc = kvfp8::pow2(e);
    std::memcpy(scales + g0 / G, &sc, 4);
  }
}

void fp8_dequantize_row(const uint8_t* row, int64_t D, int64_t tail, float* out) {
  static const auto* table = [] {
    auto* t = new float[256];
    for (int c = 0; c < 256; ++c) t[c] = kvfp8::e4m3_decode(uint8_t(c));
    return t;
  }();
  const int64_t G = kvfp8::group(D);
  for (int64_t g0 = 0; g0 < D; g0 += G) {
    float sc;
    std::memcpy(&sc, row + D + 4 * (g0 / G), 4);
    for (int64_t d = g0; d < g0 + G; ++d) out[d] = table[row[d]] * sc;  // exact: sc is a power of two
  }
  const uint8_t* t16 = row + kvfp8::fp8_bytes(D);
  for (int64_t d = 0; d < tail; ++d) {
    uint16_t h;
    std::memcpy(&h, t16 + 2 * d, 2);
    out[D + d] = bf16_to_f32(h);
  }
}

void cache_write_many(const std::vector<const Tensor*>&, const Tensor&, const std::vector<Tensor*>&, bool& done) {
  done = false;
}

namespace {
// The indexer and MLA read their cache rows through a reader: rows(s, p, buf) is row p of
// sequence s as elements of type R::E (float, or uint16_t = BF16, widened exactly as it is
// read); an FP8 cache's row is dequantized into buf (exact values). Every kind gives bitwise
// the results of an F32 cache holding the widened / dequantized values.
template <class C>
struct CacheRows {
  using E = C;
  const Tensor& cache;
  const ops::PagedTokens& tok;
  const C* operator()(int64_t s, int64_t p, float*) const { return paged_row<C>(cache, tok, s, p); }
};
struct Fp8Rows {  // ops/kv_fp8.h rows: D quantized values, then `tail` BF16 values
  using E = float;
  const Tensor& cache;
  const ops::PagedTokens& tok;
  int64_t D, tail;
  const float* operator()(int64_t s, int64_t p, float* buf) const {
    fp8_dequantize_row(paged_row<uint8_t>(cache, tok, s, p), D, tail, buf);
    return buf;
  }
};

// Token i's indexer scores of keys 0..n-1 into sc (the op's formula, heads summed in order).
template <class R>
void indexer_score_row(const Tensor& q, const Tensor& w, const R& rows, const ops::PagedTokens& tok,
                       int64_t i, int64_t n, float* sc) {
  const int64_t nI = q.shape(1), dI = q.shape(2);
  const float wscale = 1.0f / std::sqrt(float(nI)), sscale = 1.0f / std::sqrt(float(dI));
  const int64_t s = tok.seq.data_as<const int32_t>()[i * tok.seq.stride(0)];
  const float* qb = q.data_as<const float>() + i * q.stride(0);
  const float* wr = w.data_as<const float>() + i * w.stride(0);
  float* buf = thread_scratch(2, size_t(dI));
  for (int64_t t = 0; t < n; ++t) {
    const typename R::E* k = rows(s, t, buf);
    float acc = 0;
    for (int64_t hh = 0; hh < nI; ++hh) {
      const float d = dot4(qb + hh * q.stride(1), k, dI) * sscale;
      acc += (wr[hh] * wscale) * (d > 0 ? d : 0.0f);
    }
    sc[t] = acc;
  }
}

template <class R>
void indexer_topk_impl(const Tensor& q, const Tensor& w, const R& rows, const ops::PagedTokens& tok,
                       int64_t topk, Tensor& sel, Tensor& sel_len) {
  const int64_t T = q.shape(0);
  const int32_t* pos = tok.pos.data_as<const int32_t>();
  int32_t* len = sel_len.data_as<int32_t>();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads())
  for (int64_t i = 0; i < T; ++i) {
    const int64_t p = pos[i * tok.pos.stride(0)];
    if (p + 1 <= topk) {
      len[i * sel_len.stride(0)] = -1;
      continue;
    }
    float* sc = thread_scratch(0, size_t(p + 1));
    indexer_score_row(q, w, rows, tok, i, p + 1, sc);
    Tensor row = Tensor::view(sc, DType::F32, {p + 1});
    Tensor vals = Tensor::view(thread_scratch(1, size_t(topk)), DType::F32, {topk});
    Tensor idx = Tensor::view(sel.data_as<int32_t>() + i * sel.stride(0), DType::I32, {topk});
    cpu::topk(row, topk, vals, idx);
    std::sort(idx.data_as<int32_t>(), idx.data_as<int32_t>() + topk);  // attend in position order
    len[i * sel_len.stride(0)] = int32_t(topk);
  }
}

template <class R>
void mla_attention_impl(const Tensor& q_lat, const Tensor& q_pe, const R& rows, const ops::PagedTokens& tok,
                        const Tensor& sel, const Tensor& sel_len, float scale, Tensor& out) {
  using C = typename R::E;
  const int64_t T = q_lat.shape(0), nh = q_lat.shape(1), kvl = q_lat.shape(2), rope = q_pe.shape(2);
  const int32_t* seq = tok.seq.data_as<const int32_t>();
  const int32_t* pos = tok.pos.data_as<const int32_t>();
  const bool has_sel = sel_len.defined();
#pragma omp parallel for schedule(dynamic, 1) collapse(2) num_threads(threads())
  for (int64_t i = 0; i < T; ++i) {
    for (int64_t hh = 0; hh < nh; ++hh) {
      const int64_t p = pos[i * tok.pos.stride(0)], s = seq[i * tok.seq.stride(0)];
      const int64_t cnt = has_sel ? sel_len.data_as<const int32_t>()[i * sel_len.stride(0)] : -1;
      const int32_t* sl = cnt >= 0 ? sel.data_as<const int32_t>() + i * sel.stride(0) : nullptr;
      const int64_t nk = cnt < 0 ? p + 1 : cnt;
      float* sc = thread_scratch(0, size_t(nk));
      float* buf = thread_scratch(2, size_t(kvl + rope));
      const float* qt = q_lat.data_as<const float>() + i * q_lat.stride(0) + hh * q_lat.stride(1);
      const float* qpe = q_pe.data_as<const float>() + i * q_pe.stride(0) + hh * q_pe.stride(1);
      float mx = -INFINITY;
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t t = cnt < 0 ? j : sl[j];
        const C* kv = rows(s, t, buf);
        const float sj = (dot4(qt, kv, kvl) + dot4(qpe, kv + kvl, rope)) * scale;
        sc[j] = sj;
        mx = std::max(mx, sj);
      }
      double sum = 0;
      for (int64_t j = 0; j < nk; ++j) {
        sc[j] = std::exp(sc[j] - mx);
        sum += sc[j];
      }
      const float inv = float(1.0 / sum);
      float* o = out.data_as<float>() + i * out.stride(0) + hh * out.stride(1);
      std::fill(o, o + kvl, 0.0f);
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t t = cnt < 0 ? j : sl[j];
        const C* kv = rows(s, t, buf);
        const float pj = sc[j] * inv;
        for (int64_t d = 0; d < kvl; ++d) o[d] += pj * widen(kv[d]);
      }
    }
  }
}
}  // namespace

void indexer_topk(const Tensor& q, const Tensor& w, const Tensor& key_cache, const ops::PagedTokens& tok,
                  int64_t topk, Tensor& sel, Tensor& sel_len) {
  if (key_cache.dtype() == DType::U8)
    return indexer_topk_impl(q, w, Fp8Rows{key_cache, tok, q.shape(2), 0}, tok, topk, sel, sel_len);
  if (key_cache.dtype() == DType::BF16)
    return indexer_topk_impl(q, w, CacheRows<uint16_t>{key_cache, tok}, tok, topk, sel, sel_len);
  indexer_topk_impl(q, w, CacheRows<float>{key_cache, tok}, tok, topk, sel, sel_len);
}

void indexer_scores(const Tensor& q, const Tensor& w, const Tensor& key_cache, const ops::PagedTokens& tok,
                    Tensor& scores) {
  const int64_t T = q.shape(0), C = scores.shape(1);
  const int32_t* pos = tok.pos.data_as<const int32_t>();
  const DType kd = key_cache.dtype();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads())
  for (int64_t i = 0; i < T; ++i) {
    const int64_t p = pos[i * tok.pos.stride(0)];
    const int64_t n = p + 1 < C ? p + 1 : C;
    float* sc = scores.data_as<float>() + i * scores.stride(0);
    if (kd == DType::U8)
      indexer_score_row(q, w, Fp8Rows{key_cache, tok, q.shape(2), 0}, tok, i, n, sc);
    else if (kd == DType::BF16)
      indexer_score_row(q, w, CacheRows<uint16_t>{key_cache, tok}, tok, i, n, sc);
    else
      indexer_score_row(q, w, CacheRows<float>{key_cache, tok}, tok, i, n, sc);
  }
}

void mla_attention(const Tensor& q_lat, const Tensor& q_pe, const Tensor& cache, const ops::PagedTokens& tok,
                   const Tensor& sel, const Tensor& sel_len, float scale, Tensor& out) {
  if (cache.dtype() == DType::U8)
    return mla_attention_impl(q_lat, q_pe, Fp8Rows{cache, tok, q_lat.shape(2), q_pe.shape(2)}, tok, sel, sel_len,
                              scale, out);
  if (cache.dtype() == DType::BF16)
    return mla_attention_impl(q_lat, q_pe, CacheRows<uint16_t>{cache, tok}, tok, sel, sel_len, scale, out);
  mla_attention_impl(q_lat, q_pe, CacheRows<float>{cache, tok}, tok, sel, sel_len, scale, out);
}

namespace {
// block_attention over a cache of element type C (float, or uint16_t = BF16 widened exactly).
template <class C>
void block_attention_impl(const Tensor& q, const Tensor& k, const Tensor& v, const C* cache, int64_t cache_stride,
                          const Tensor& ctx_len, const Tensor& block_table, const ops::BlockAttention& p, Tensor& out) {
  const int64_t T = q.shape(0), nh = q.shape(1), hd = q.shape(2), kvh = k.shape(1), grp = nh / kvh;
  const int64_t B = p.block, kvdim = kvh * hd, cbs = p.cache_block_size;
  const int32_t* clen = ctx_len.data_as<const int32_t>();
  auto ctx_row = [&](int64_t s, int64_t j) {  // context row j of sequence s: its slot's [k | v]
    const int32_t* bt = block_table.data_as<const int32_t>() + s * block_table.stride(0);
    return cache + (int64_t(bt[j / cbs]) * cbs + j % cbs) * cache_stride;
  };
#pragma omp parallel for schedule(dynamic, 1) collapse(2) num_threads(threads())
  for (int64_t r = 0; r < T; ++r) {
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t s = r / B, t = r % B, kh = h / grp;
      const int64_t L = clen[s * ctx_len.stride(0)];
      const int64_t i = L + t;  // absolute position of this query
      const int64_t c0 = p.window > 0 ? std::max<int64_t>(0, i - p.window + 1) : 0;  // keys j with i - window < j
      const int64_t nblk = p.causal ? t + 1 : B;
      const int64_t nctx = L - c0;
      const int64_t nsc = std::max<int64_t>(nctx, 0) + nblk;
      float* sc = thread_scratch(0, size_t(nsc));
      const float* qv = q.data_as<const float>() + r * q.stride(0) + h * q.stride(1);
      float mx = -INFINITY;
      int64_t n = 0;
      for (int64_t j = c0; j < L; ++j, ++n) {
        const C* kvp = ctx_row(s, j) + kh * hd;
        float d = 0;
        for (int64_t e = 0; e < hd; ++e) d += qv[e] * widen(kvp[e]);
        sc[n] = d * p.scale;
        mx = std::max(mx, sc[n]);
      }
      for (int64_t j = 0; j < nblk; ++j, ++n) {
        const float* kp = k.data_as<const float>() + (s * B + j) * k.stride(0) + kh * k.stride(1);
        float d = 0;
        for (int64_t e = 0; e < hd; ++e) d += qv[e] * kp[e];
        sc[n] = d * p.scale;
        mx = std::max(mx, sc[n]);
      }
      double sum = 0;
      for (int64_t j = 0; j < nsc; ++j) {
        sc[j] = std::exp(sc[j] - mx);
        sum += sc[j];
      }
      float* o = out.data_as<float>() + r * out.stride(0) + h * out.stride(1);
      std::fill(o, o + hd, 0.0f);
      n = 0;
      for (int64_t j = c0; j < L; ++j, ++n) {
        const C* vp = ctx_row(s, j) + kvdim + kh * hd;
        const float pj = float(sc[n] / sum);
        for (int64_t e = 0; e < hd; ++e) o[e] += pj * widen(vp[e]);
      }
      for (int64_t j = 0; j < nblk; ++j, ++n) {
        const float* vp = v.data_as<const float>() + (s * B + j) * v.stride(0) + kh * v.stride(1);
        const float pj = float(sc[n] / sum);
        for (int64_t e = 0; e < hd; ++e) o[e] += pj * vp[e];
      }
    }
  }
}
}  // namespace

void block_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& kv_cache,
                     const Tensor& ctx_len, const Tensor& block_table, const ops::BlockAttention& p, Tensor& out) {
  if (kv_cache.dtype() == DType::BF16)
    return block_attention_impl(q, k, v, static_cast<const uint16_t*>(kv_cache.data()), kv_cache.stride(0), ctx_len,
                                block_table, p, out);
  block_attention_impl(q, k, v, kv_cache.data_as<const float>(), kv_cache.stride(0), ctx_len, block_table, p, out);
}

}  // namespace dflash2::cpu
