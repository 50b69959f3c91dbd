#include "runtime/target.h"

#include "dflash2/error.h"

namespace dflash2::runtime {

Target::Target(std::unique_ptr<model::GlmModel> model, const Options& opt) : model_(std::move(model)), opt_(opt) {
  const model::GlmConfig& c = model_->config();
  const int64_t blocks_per_seq = (opt.max_seq_len + opt.kv_block_size - 1) / opt.kv_block_size;
  // one sequence beyond the batch: the step-level API (Sequence, logits, propose) beside it
  const int64_t nblocks = blocks_per_seq * (opt.max_batch_size + 1);
  int64_t n_index = 0;
  for (bool f : c.indexer_full) n_index += f ? 1 : 0;
  // planes: 0 = MLA latent per layer, 1 = indexer keys per indexer layer
  cache_ = KvCache("KV cache", {{c.num_layers, c.latent_dim()}, {n_index, c.index_head_dim}}, opt.kv_block_size,
                   nblocks);
  cache_.set_max_blocks_per_stream(blocks_per_seq);
  int64_t slot = 0;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    views_.latent.push_back(cache_.layer(0, l));
    views_.index.push_back(c.indexer_full[size_t(l)] ? cache_.layer(1, slot++) : Tensor());
  }
  if (model_->has_mtp()) {
    const bool ix = model_->mtp_has_indexer();
    DFLASH2_CHECK(ix || opt.max_seq_len <= c.index_topk, ErrorKind::Checkpoint,
                  "the MTP layer has no indexer tensors, which is only supported while max_seq_len (", opt.max_seq_len,
                  ") <= index_topk (", c.index_topk, ")");
    mtp_cache_ = KvCache("MTP KV cache", {{1, c.latent_dim()}, {ix ? 1 : 0, c.index_head_dim}}, opt.kv_block_size,
                         nblocks);
    mtp_cache_.set_max_blocks_per_stream(blocks_per_seq);
    mtp_views_.latent.push_back(mtp_cache_.layer(0, 0));
    mtp_views_.index.push_back(ix ? mtp_cache_.layer(1, 0) : Tensor());
  }
  planner_ = StepPlanner(opt.max_step_tokens, std::max(opt.max_batch_size + 1, opt.max_step_tokens), blocks_per_seq);
}

void Target::run_chunk(const std::vector<Piece>& pieces, const model::ForwardOutputs& out) {
  for (const Piece& p : pieces)
    DFLASH2_CHECK_ARG(p.stream->length + p.n <= opt_.max_seq_len, "sequence of ", p.stream->length + p.n,
                      " tokens exceeds max_seq_len ", opt_.max_seq_len);
  model::TokenBatch b = planner_.plan(pieces, cache_);
  model_->forward(b, views_, out);
  for (const Piece& p : pieces) p.stream->length += p.n;
}

void Target::mtp_chunk(const std::vector<Piece>& pieces, const Tensor& h_main, Tensor& logits, Tensor& hidden,
                       bool all_rows) {
  DFLASH2_CHECK(model_->has_mtp(), ErrorKind::Unsupported,
                "this checkpoint has no MTP layer (num_nextn_predict_layers = 0)");
  for (const Piece& p : pieces)
    DFLASH2_CHECK_ARG(p.stream->length + p.n <= opt_.max_seq_len, "MTP sequence of ", p.stream->length + p.n,
                      " tokens exceeds max_seq_len ", opt_.max_seq_len);
  model::TokenBatch b = planner_.plan(pieces, mtp_cache_, all_rows);
  model_->mtp_forward(b, h_main, mtp_views_, logits, hidden);
  for (const Piece& p : pieces) p.stream->length += p.n;
}

}  // namespace dflash2::runtime
