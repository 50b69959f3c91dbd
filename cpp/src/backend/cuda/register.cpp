// The CUDA backend's entries in the dispatch table: each op implemented in this folder
// registers here; ops without an entry raise a clear Unsupported error.
// ops::embedding dispatches to gather_rows, so it runs on the CUDA gather too.
#include "backend/cuda/cuda_api.h"
#include "ops/backend.h"

namespace dflash2::ops {
void register_cuda_ops(BackendTable& t) {
  t.timer_begin = &cuda::op_timer_begin;  // op_timer.cpp
  t.timer_end = &cuda::op_timer_end;
  t.linear = &cuda::linear;                    // gemm.cu
  t.linear_many = &cuda::linear_many;          // gemm.cu
  t.linear_silu_mul = &cuda::linear_silu_mul;  // gemm.cu
  t.linear_heads = &cuda::linear_heads;        // gemm.cu
#if defined(DFLASH2_WITH_CUTLASS)
  t.linear_bf16 = &cuda::linear_bf16;          // gemm_tc.cu + cutlass/
  t.gated_mlp_decode = &cuda::gated_mlp_decode;  // gemm_tc.cu + gemm_sk.cu
  t.linear_bf16_decode_many = &cuda::linear_bf16_decode_many;  // gemm_tc.cu + gemm_sk.cu
  t.linear_fp8 = &cuda::linear_fp8;            // gemm_tc.cu + cutlass/
  t.linear_nvfp4 = &cuda::linear_nvfp4;        // gemm_tc.cu + cutlass/
#endif
  t.fp8_quantize_act = &cuda::fp8_quantize_act;      // quant.cu
  t.nvfp4_quantize_act = &cuda::nvfp4_quantize_act;  // quant.cu
  t.embedding_shard = &cuda::embedding_shard;  // index_rows.cu
  t.rms_norm = &cuda::rms_norm;        // rmsnorm.cu
  t.rms_norm_many = &cuda::rms_norm_many;  // rmsnorm.cu
  t.layer_norm = &cuda::layer_norm;    // row_reduce.cu
  t.softmax = &cuda::softmax;          // row_reduce.cu
  t.argmax = &cuda::argmax;            // row_reduce.cu
  t.check_finite = &cuda::check_finite;  // row_reduce.cu
  t.token_logprobs = &cuda::token_logprobs;  // row_reduce.cu
  t.argmax_shard = &cuda::argmax_shard;  // row_reduce.cu
  t.argmax_merge = &cuda::argmax_merge;  // row_reduce.cu
  t.topk_merge = &cuda::topk_merge;      // row_reduce.cu
  t.accept_greedy = &cuda::accept_greedy;  // index_rows.cu
  t.apply_penalties = &cuda::apply_penalties;  // penalties.cu
  t.count_tokens = &cuda::count_tokens;  // penalties.cu
  t.mask_logits = &cuda::mask_logits;  // penalties.cu
  t.rope = &cuda::rope;                // elementwise.cu
  t.rope_many = &cuda::rope_many;      // elementwise.cu
  t.silu_mul = &cuda::silu_mul;        // elementwise.cu
  t.add = &cuda::add;                  // elementwise.cu
  t.copy = &cuda::copy;                // copy.cu
  t.gather_rows = &cuda::gather_rows;  // index_rows.cu
  t.resolve_tokens = &cuda::resolve_tokens;  // index_rows.cu
  t.next_after_accept = &cuda::next_after_accept;  // index_rows.cu
  t.cache_write = &cuda::cache_write;  // index_rows.cu
  t.cache_write_many = &cuda::cache_write_many;  // index_rows.cu
  t.dyn_conv = &cuda::dyn_conv;        // drafter_ops.cu
  t.indexer_topk = &cuda::indexer_topk;        // attention.cu
  t.indexer_scores = &cuda::indexer_scores;    // attention.cu
  t.mla_attention = &cuda::mla_attention;      // attention.cu
  t.block_attention = &cuda::block_attention;  // attention.cu
  t.moe_route = &cuda::moe_route;      // moe.cu
  t.moe_experts = &cuda::moe_experts;  // moe.cu
  t.moe_experts_fp8 = &cuda::moe_experts_fp8;  // moe.cu + cutlass/fp8_grouped_sm90.cu
  t.moe_experts_bf16 = &cuda::moe_experts_bf16;  // moe.cu + gemm_dq.cu
  t.moe_experts_nvfp4 = &cuda::moe_experts_nvfp4;  // moe.cu + cutlass/nvfp4_grouped_sm100.cu
  t.topk = &cuda::topk;                    // sampling.cu
  t.sample = &cuda::sample;                // sampling.cu
  t.accept = &cuda::accept;                // sampling.cu
  t.selector_walk = &cuda::selector_walk;  // selector.cu
}
}  // namespace dflash2::ops
