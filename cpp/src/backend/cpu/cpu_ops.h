// Internal: the CPU backend (the oracle). ops.cpp validates arguments and dispatches here
// through the table filled by register_cpu_ops() (register.cpp).
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

#include "dflash2/ops.h"

namespace dflash2::cpu {

const char* gemm_isa();  // "avx2+fma" or "generic": what linear() runs on this machine

// ---- threads: every parallel region of the backend runs with threads() threads, the
// calling thread's setting (an engine's num_threads while it runs, see
// ops::CpuThreadScope), so one engine's setting never changes another's.
int threads();                   // the calling thread's width (>= 1)
int num_threads();               // same (build_info)
void set_thread_default(int n);  // this thread's width outside any scope (<= 0: all cores)
int tl_scope_value();            // the innermost scope's width (0: none)
void set_tl_scope(int n);

// Per-thread scratch that grows to a high-water mark and is then reused (no allocation
// in steady state); slot separates buffers used at the same time.
float* thread_scratch(int slot, size_t n);
double* thread_dscratch(int slot, size_t n);
int32_t* thread_iscratch(int slot, size_t n);

// An FP8 cache row (ops/kv_fp8.h): x[0..D) quantized into out (fp8_bytes(D) bytes); a row's
// D quantized values and then `tail` BF16 values (the MLA latent's rope) dequantized into out.
void fp8_quantize_row(const float* x, int64_t D, uint8_t* out);
void fp8_dequantize_row(const uint8_t* row, int64_t D, int64_t tail, float* out);

// A cache element as float: F32 as is, BF16 (uint16_t bits) widened exactly.
inline float widen(float x) { return x; }
inline float widen(uint16_t x) { return bf16_to_f32(x); }

// 4-way partial dot product (the attention / indexer score order); b F32, or BF16 widened
// exactly as it is read (so a BF16 row gives bitwise the dot of its widened F32 copy).
template <class C>
inline float dot4(const float* a, const C* b, int64_t n) {
  float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += a[i] * widen(b[i]);
    s1 += a[i + 1] * widen(b[i + 1]);
    s2 += a[i + 2] * widen(b[i + 2]);
    s3 += a[i + 3] * widen(b[i + 3]);
  }
  for (; i < n; ++i) s0 += a[i] * widen(b[i]);
  return (s0 + s1) + (s2 + s3);
}

// Row p of sequence s in a paged cache layer of element type C (float, or uint16_t: BF16).
template <class C = float>
inline const C* paged_row(const Tensor& cache, const ops::PagedTokens& tok, int64_t s, int64_t p) {
  const int32_t* bt = tok.block_table.data_as<const int32_t>() + s * tok.block_table.stride(0);
  const int64_t slot = int64_t(bt[p / tok.block_size]) * tok.block_size + p % tok.block_size;
  return static_cast<const C*>(cache.data()) + slot * cache.stride(0);
}

void linear(const Tensor& x, const ops::Weight& w, Tensor& y, bool accumulate);
void linear_bf16(const Tensor& x, const ops::Weight& w, Tensor& y, bool accumulate, bool decode);
// ops::gated_mlp / linear_as_many run the CPU's steps one by one: done = false.
void linear_many(const Tensor& x, const std::vector<const ops::Weight*>& ws, const std::vector<Tensor*>& ys,
                 bool& done);
void linear_bf16_decode_many(const Tensor& x, const std::vector<const ops::Weight*>& ws, const std::vector<Tensor*>& ys,
                             bool& done);
void gated_mlp_decode(const Tensor& x, const ops::Weight& gate, const ops::Weight& up, const ops::Weight& down,
                      Tensor& out, bool accumulate, bool& done);
void linear_silu_mul(const Tensor& x, const ops::Weight& gate, const ops::Weight& up, Tensor& out, bool& done);
void linear_fp8(const Tensor& x, const ops::Weight& w, Tensor& y, bool accumulate);
void linear_nvfp4(const Tensor& x, const ops::Weight& w, Tensor& y, bool accumulate);
void fp8_quantize_act(const Tensor& x, Tensor& out);
// linear_fp8's activation quantization (ops.h fp8_quantize_act): row m's E4M3 values (as
// exact floats) into q[m * ldq + k], its block scales into sf[m * ldsf + b].
void fp8_quantize_rows(const Tensor& x, float* q, int64_t ldq, float* sf, int64_t ldsf);
void linear_heads(const Tensor& x, const Tensor& w, Tensor& y);
void rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out);
void layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, float eps, Tensor& out);
void rope(Tensor& x, const Tensor& positions, double theta, ops::RopeStyle style);
// optional entries: the CPU takes the ops one by one (done = false)
void rope_many(const std::vector<Tensor*>& xs, const Tensor& positions, double theta, ops::RopeStyle style, bool& done);
void rms_norm_many(const std::vector<const Tensor*>& xs, const std::vector<const Tensor*>& ws,
                   const std::vector<float>& eps, const std::vector<Tensor*>& outs, bool& done);
void silu_mul(const Tensor& gate, const Tensor& up, Tensor& out);
void softmax(const Tensor& x, Tensor& out, float scale);
void topk(const Tensor& x, int64_t k, Tensor& values, Tensor& indices);
void gather_rows(const Tensor& src, const Tensor& idx, Tensor& out);
void embedding_shard(const Tensor& table, const Tensor& ids, int64_t first, Tensor& out);
void copy(const Tensor& src, Tensor& dst);
void add(const Tensor& a, const Tensor& b, Tensor& out);
void argmax(const Tensor& x, Tensor& out);
void check_finite(const Tensor& x, Tensor& flags);
void token_logprobs(const Tensor& x, const Tensor& ids, Tensor& lp, Tensor& lse);
void argmax_shard(const Tensor& x, int64_t first, Tensor& out);
void argmax_merge(const Tensor& pairs, Tensor& ids, Tensor& flags);
void topk_merge(const Tensor& vals, const Tensor& idx, int64_t shard_size, Tensor& values, Tensor& indices);
void apply_penalties(Tensor& logits, const Tensor& row0, const Tensor& draft, const Tensor& draft_row,
                     const Tensor& draft_len, const Tensor& seq, const Tensor& params, const Tensor& state,
                     const Tensor& bias);
void count_tokens(Tensor& state, const Tensor& rows, const Tensor& ids);
void mask_logits(Tensor& logits, const Tensor& rows, const Tensor& masks);
void accept_greedy(const Tensor& ids, const Tensor& row0, const Tensor& draft, const Tensor& draft_row,
                   const Tensor& draft_len, Tensor& accepted, Tensor& bonus);
void resolve_tokens(Tensor& tokens, const Tensor& src);
void next_after_accept(const Tensor& row0, const Tensor& draft_row, const Tensor& draft_len, const Tensor& accepted,
                       const Tensor& bonus, const Tensor& drafts, Tensor& next, Tensor& last);
void nvfp4_quantize_act(const Tensor& x, float input_scale, Tensor& out);
void cache_write(const Tensor& src, const Tensor& slots, Tensor& cache);
void cache_write_many(const std::vector<const Tensor*>& srcs, const Tensor& slots, const std::vector<Tensor*>& caches,
                      bool& done);
void indexer_topk(const Tensor& q, const Tensor& w, const Tensor& key_cache, const ops::PagedTokens& tok,
                  int64_t topk, Tensor& sel, Tensor& sel_len);
void indexer_scores(const Tensor& q, const Tensor& w, const Tensor& key_cache, const ops::PagedTokens& tok,
                    Tensor& scores);
void mla_attention(const Tensor& q_lat, const Tensor& q_pe, const Tensor& cache, const ops::PagedTokens& tok,
                   const Tensor& sel, const Tensor& sel_len, float scale, Tensor& out);
void block_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& kv_cache,
                     const Tensor& ctx_len, const Tensor& block_table, const ops::BlockAttention& p, Tensor& out);
void moe_route(const Tensor& logits, const Tensor& bias, const ops::MoeRouting& r, Tensor& ids, Tensor& weights);
void moe_experts(const Tensor& x, const Tensor& ids, const Tensor& weights, const ops::ExpertWeights& experts,
                 Tensor& out, Tensor& workspace, bool accumulate = false);
void moe_experts_bf16(const Tensor& x, const Tensor& ids, const Tensor& weights, const ops::ExpertWeights& experts,
                      Tensor& out, Tensor& workspace, bool decode, bool accumulate = false);
void moe_experts_nvfp4(const Tensor& x, const Tensor& ids, const Tensor& weights, const ops::ExpertWeights& experts,
                       Tensor& out, Tensor& workspace, bool accumulate = false);
void moe_experts_fp8(const Tensor& x, const Tensor& ids, const Tensor& weights, const ops::ExpertWeights& experts,
                     Tensor& out, Tensor& workspace, bool accumulate = false);
void dyn_conv(const Tensor& x, const Tensor& base, const Tensor& dyn, int64_t block, Tensor& out);
void selector_walk(const Tensor& vals, const Tensor& cand, const Tensor& g, const Tensor& pred_book,
                   const Tensor& succ_book, const Tensor& anchors, const Tensor& temperature, const Tensor& rng,
                   Tensor& tokens, Tensor& q);
void sample(const Tensor& logits, const ops::SamplingTensors& sp, const Tensor& rng, Tensor& out);
void accept(const Tensor& logits, const Tensor& row0, const Tensor& draft, const Tensor& draft_row,
            const Tensor& draft_len, const Tensor& cand, const Tensor& q, const ops::SamplingTensors& sp,
            const Tensor& rng, Tensor& accepted, Tensor& bonus);

}  // namespace dflash2::cpu
