// Internal: the dispatch table. Every op a backend can implement is one line of
// DFLASH2_BACKEND_OPS: X(name, (parameters)). A backend is a folder (backend/cpu,
// backend/cuda) whose register_<backend>_ops() fills a BackendTable with its
// implementations; ops.cpp validates the arguments once and calls the entry of the
// tensors' device. An empty entry is "not implemented on that backend" (a clear
// Unsupported error), so a backend may implement any subset.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "dflash2/ops.h"

namespace dflash2::ops {

#define DFLASH2_BACKEND_OPS(X)                                                                                      \
  X(linear, (const Tensor& x, const Weight& w, Tensor& y, bool accumulate))                                         \
  X(linear_bf16, (const Tensor& x, const Weight& w, Tensor& y, bool accumulate, bool decode))                       \
  /* optional (CUDA): linear(x, *ws[i], *ys[i], false) for every i, fewer launches; done = false: not taken */   \
  X(linear_many, (const Tensor& x, const std::vector<const Weight*>& ws, const std::vector<Tensor*>& ys, bool& done)) \
  /* optional (CUDA): silu_mul(linear(x, gate), linear(x, up)) in one launch; done = false: not taken */         \
  X(linear_silu_mul, (const Tensor& x, const Weight& gate, const Weight& up, Tensor& out, bool& done))             \
  /* optional (CUDA): gated_mlp of generated tokens with BF16 numerics as one unit; done = false: not taken */     \
  X(gated_mlp_decode, (const Tensor& x, const Weight& gate, const Weight& up, const Weight& down, Tensor& out,       \
                       bool accumulate, bool& done))                                                                \
  /* optional (CUDA): linear_bf16(x, *ws[i], *ys[i], false, decode = true) for every i, x rounded once */          \
  X(linear_bf16_decode_many, (const Tensor& x, const std::vector<const Weight*>& ws, const std::vector<Tensor*>& ys, \
                              bool& done))                                                                          \
  X(linear_fp8, (const Tensor& x, const Weight& w, Tensor& y, bool accumulate))                                     \
  X(linear_nvfp4, (const Tensor& x, const Weight& w, Tensor& y, bool accumulate))                                   \
  X(fp8_quantize_act, (const Tensor& x, Tensor& out))                                                               \
  X(linear_heads, (const Tensor& x, const Tensor& w, Tensor& y))                                                     \
  X(rms_norm, (const Tensor& x, const Tensor& w, float eps, Tensor& out))                                           \
  /* optional (CUDA): rms_norm of every (xs[i], ws[i], eps[i], outs[i]) in one kernel; done = false: not taken */ \
  X(rms_norm_many, (const std::vector<const Tensor*>& xs, const std::vector<const Tensor*>& ws,                   \
                    const std::vector<float>& eps, const std::vector<Tensor*>& outs, bool& done))                   \
  X(nvfp4_quantize_act, (const Tensor& x, float input_scale, Tensor& out))                                         \
  X(layer_norm, (const Tensor& x, const Tensor& w, const Tensor& b, float eps, Tensor& out))                        \
  X(rope, (Tensor & x, const Tensor& positions, double theta, RopeStyle style))                                     \
  /* optional (CUDA): rope of every xs[i] in one kernel; done = false: not taken (rope one by one) */             \
  X(rope_many, (const std::vector<Tensor*>& xs, const Tensor& positions, double theta, RopeStyle style, bool& done)) \
  X(silu_mul, (const Tensor& gate, const Tensor& up, Tensor& out))                                                  \
  X(softmax, (const Tensor& x, Tensor& out, float scale))                                                           \
  X(topk, (const Tensor& x, int64_t k, Tensor& values, Tensor& indices))                                           \
  X(gather_rows, (const Tensor& src, const Tensor& idx, Tensor& out))                                              \
  X(embedding_shard, (const Tensor& table, const Tensor& ids, int64_t first, Tensor& out))                         \
  X(copy, (const Tensor& src, Tensor& dst))                                                                         \
  X(add, (const Tensor& a, const Tensor& b, Tensor& out))                                                           \
  X(argmax, (const Tensor& x, Tensor& out))                                                                         \
  X(check_finite, (const Tensor& x, Tensor& flags))                                                                 \
  X(token_logprobs, (const Tensor& x, const Tensor& ids, Tensor& lp, Tensor& lse))                                 \
  X(argmax_shard, (const Tensor& x, int64_t first, Tensor& out))                                                    \
  X(argmax_merge, (const Tensor& pairs, Tensor& ids, Tensor& flags))                                               \
  X(topk_merge, (const Tensor& vals, const Tensor& idx, int64_t shard_size, Tensor& values, Tensor& indices))     \
  X(accept_greedy, (const Tensor& ids, const Tensor& row0, const Tensor& draft, const Tensor& draft_row,            \
                    const Tensor& draft_len, Tensor& accepted, Tensor& bonus))                                      \
  X(resolve_tokens, (Tensor & tokens, const Tensor& src))                                                           \
  X(apply_penalties, (Tensor & logits, const Tensor& row0, const Tensor& draft, const Tensor& draft_row,             \
                      const Tensor& draft_len, const Tensor& seq, const Tensor& params, const Tensor& state,         \
                      const Tensor& bias))                                                                          \
  X(count_tokens, (Tensor & state, const Tensor& rows, const Tensor& ids))                                          \
  X(mask_logits, (Tensor & logits, const Tensor& rows, const Tensor& masks))                                       \
  X(next_after_accept, (const Tensor& row0, const Tensor& draft_row, const Tensor& draft_len,                       \
                        const Tensor& accepted, const Tensor& bonus, const Tensor& drafts, Tensor& next,           \
                        Tensor& last))                                                                              \
  X(cache_write, (const Tensor& src, const Tensor& slots, Tensor& cache))                                          \
  /* optional (CUDA): cache_write of every (srcs[i], caches[i]) in one kernel; done = false: not taken */        \
  X(cache_write_many, (const std::vector<const Tensor*>& srcs, const Tensor& slots, const std::vector<Tensor*>& caches, \
                       bool& done))                                                                                 \
  X(indexer_topk, (const Tensor& q, const Tensor& w, const Tensor& key_cache, const PagedTokens& tok, int64_t topk, \
                   Tensor& sel, Tensor& sel_len))                                                                   \
  X(indexer_scores, (const Tensor& q, const Tensor& w, const Tensor& key_cache, const PagedTokens& tok,             \
                     Tensor& scores))                                                                               \
  X(mla_attention, (const Tensor& q_lat, const Tensor& q_pe, const Tensor& cache, const PagedTokens& tok,           \
                    const Tensor& sel, const Tensor& sel_len, float scale, Tensor& out))                            \
  X(block_attention, (const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& kv_cache,                    \
                      const Tensor& ctx_len, const Tensor& block_table, const BlockAttention& p, Tensor& out))      \
  X(moe_route, (const Tensor& logits, const Tensor& bias, const MoeRouting& r, Tensor& ids, Tensor& weights))      \
  X(moe_experts, (const Tensor& x, const Tensor& ids, const Tensor& weights, const ExpertWeights& experts,          \
                  Tensor& out, Tensor& workspace, bool accumulate))                                                 \
  X(moe_experts_fp8, (const Tensor& x, const Tensor& ids, const Tensor& weights, const ExpertWeights& experts,      \
                      Tensor& out, Tensor& workspace, bool accumulate))                                             \
  X(moe_experts_bf16, (const Tensor& x, const Tensor& ids, const Tensor& weights, const ExpertWeights& experts,     \
                       Tensor& out, Tensor& workspace, bool decode, bool accumulate))                               \
  X(moe_experts_nvfp4, (const Tensor& x, const Tensor& ids, const Tensor& weights, const ExpertWeights& experts,    \
                        Tensor& out, Tensor& workspace, bool accumulate))                                           \
  X(dyn_conv, (const Tensor& x, const Tensor& base, const Tensor& dyn, int64_t block, Tensor& out))                 \
  X(selector_walk, (const Tensor& vals, const Tensor& cand, const Tensor& g, const Tensor& pred_book,               \
                    const Tensor& succ_book, const Tensor& anchors, const Tensor& temperature, const Tensor& rng,   \
                    Tensor& tokens, Tensor& q))                                                                     \
  X(sample, (const Tensor& logits, const SamplingTensors& sp, const Tensor& rng, Tensor& out))                     \
  X(accept, (const Tensor& logits, const Tensor& row0, const Tensor& draft, const Tensor& draft_row,                \
             const Tensor& draft_len, const Tensor& cand, const Tensor& q, const SamplingTensors& sp, const Tensor& rng, \
             Tensor& accepted, Tensor& bonus))

struct BackendTable {
  const char* name = "";
  // Op timing (ops::set_op_timing) on this backend's devices, where the host's clock would
  // not tell (asynchronous devices): begin starts a timer on the current stream and returns
  // it, or nullptr when nothing can be timed now (the stream is being captured); end waits
  // for it and returns the seconds between. Empty: the host's clock around the call.
  void* (*timer_begin)() = nullptr;
  double (*timer_end)(void* timer) = nullptr;
#define DFLASH2_TABLE_ENTRY(op, params) void(*op) params = nullptr;
  DFLASH2_BACKEND_OPS(DFLASH2_TABLE_ENTRY)
#undef DFLASH2_TABLE_ENTRY
};

// fused_launches() / set_fused_launches(): dflash2/ops.h.

// The table of a device's backend (entries may be empty); a device type the build has
// no backend for gets an Unsupported error naming it.
const BackendTable& backend_table(Device dev);
// {op name, [backends implementing it]} for every op, in table order (build_info()).
std::vector<std::pair<std::string, std::vector<std::string>>> op_backends();

// Filled once, by the backend folders.
void register_cpu_ops(BackendTable& t);
void register_cuda_ops(BackendTable& t);  // backend/cuda (only built with DFLASH2_WITH_CUDA)

}  // namespace dflash2::ops
