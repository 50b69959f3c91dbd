#include "runtime/target.h"

#include <algorithm>

#include "dflash2/error.h"
#include "dflash2/ops.h"

namespace dflash2::runtime {

Target::Target(std::vector<std::unique_ptr<model::GlmModel>> models, const Options& opt)
    : models_(std::move(models)), opt_(opt) {
  const int n = int(models_.size());
  DFLASH2_INTERNAL(n >= 1, "a target needs at least one model");
  const model::GlmConfig& c = models_[0]->config();
  const int64_t blocks_per_seq = (opt.max_seq_len + opt.kv_block_size - 1) / opt.kv_block_size;
  // one sequence beyond the batch: the step-level API (Sequence, logits, propose) beside it
  const int64_t nblocks = blocks_per_seq * (opt.max_batch_size + 1);
  int64_t n_index = 0;
  for (bool f : c.indexer_full) n_index += f ? 1 : 0;
  // planes: 0 = MLA latent per layer, 1 = indexer keys per indexer layer; the latent and the
  // indexer are replicated on every rank (MLA shares one latent across heads)
  cache_ = KvCache("KV cache", {{c.num_layers, c.latent_dim()}, {n_index, c.index_head_dim}}, opt.kv_block_size,
                   nblocks, Device::cpu(), n);
  cache_.set_max_blocks_per_stream(blocks_per_seq);
  views_.resize(size_t(n));
  mtp_views_.resize(size_t(n));
  for (int r = 0; r < n; ++r) {
    int64_t slot = 0;
    for (int64_t l = 0; l < c.num_layers; ++l) {
      views_[size_t(r)].latent.push_back(cache_.layer(0, l, r));
      views_[size_t(r)].index.push_back(c.indexer_full[size_t(l)] ? cache_.layer(1, slot++, r) : Tensor());
    }
  }
  if (models_[0]->has_mtp()) {
    const bool ix = models_[0]->mtp_has_indexer();
    DFLASH2_CHECK(ix || opt.max_seq_len <= c.index_topk, ErrorKind::Checkpoint,
                  "the MTP layer has no indexer tensors, which is only supported while max_seq_len (", opt.max_seq_len,
                  ") <= index_topk (", c.index_topk, ")");
    mtp_cache_ = KvCache("MTP KV cache", {{1, c.latent_dim()}, {ix ? 1 : 0, c.index_head_dim}}, opt.kv_block_size,
                         nblocks, Device::cpu(), n);
    mtp_cache_.set_max_blocks_per_stream(blocks_per_seq);
    for (int r = 0; r < n; ++r) {
      mtp_views_[size_t(r)].latent.push_back(mtp_cache_.layer(0, 0, r));
      mtp_views_[size_t(r)].index.push_back(ix ? mtp_cache_.layer(1, 0, r) : Tensor());
    }
  }
  planner_ = StepPlanner(opt.max_step_tokens, std::max(opt.max_batch_size + 1, opt.max_step_tokens), blocks_per_seq);
  if (n > 1) {
    comms_ = comm::make_cpu_group(n);
    for (int r = 0; r < n; ++r) models_[size_t(r)]->set_comm(comms_[size_t(r)].get());
    const int total = opt.num_threads > 0 ? opt.num_threads : ops::cpu_cores();
    rank_threads_ = std::max(1, total / n);
    for (int r = 1; r < n; ++r)
      scratch_logits_.push_back(Tensor::empty(DType::F32, {opt.max_step_tokens, c.vocab_size}));
    errors_.resize(size_t(n));
    for (int r = 1; r < n; ++r) workers_.emplace_back([this, r] { worker(r); });
  }
}

Target::~Target() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void Target::worker(int rank) {
  int64_t seen = 0;
  while (true) {
    const std::function<void(int)>* job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || job_seq_ != seen; });
      if (stop_) return;
      seen = job_seq_;
      job = job_;
    }
    try {
      ops::CpuThreadScope threads(rank_threads_);
      (*job)(rank);
    } catch (...) {
      errors_[size_t(rank)] = std::current_exception();
      comms_[size_t(rank)]->abort();
    }
    std::lock_guard<std::mutex> lk(mu_);
    if (--pending_ == 0) cv_.notify_all();
  }
}

void Target::on_all_ranks(const std::function<void(int)>& job) {
  const int n = tp_size();
  if (n == 1) return job(0);
  {
    std::lock_guard<std::mutex> lk(mu_);
    job_ = &job;
    pending_ = n - 1;
    ++job_seq_;
    for (auto& e : errors_) e = nullptr;
  }
  cv_.notify_all();
  try {
    ops::CpuThreadScope threads(rank_threads_);
    job(0);
  } catch (...) {
    errors_[0] = std::current_exception();
    comms_[0]->abort();  // ranks waiting in a collective for rank 0 give up instead of hanging
  }
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return pending_ == 0; });
  // the cause: the first error that is not another rank's abort
  std::exception_ptr cause, any;
  for (auto& e : errors_) {
    if (!e) continue;
    if (!any) any = e;
    try {
      std::rethrow_exception(e);
    } catch (const comm::CollectiveAborted&) {
    } catch (...) {
      if (!cause) cause = e;
    }
  }
  if (any) {
    comms_[0]->reset();  // every rank has left the step: the group is usable again
    std::rethrow_exception(cause ? cause : any);
  }
}

void Target::run_chunk(const std::vector<Piece>& pieces, const model::ForwardOutputs& out) {
  for (const Piece& p : pieces)
    DFLASH2_CHECK_ARG(p.stream->length + p.n <= opt_.max_seq_len, "sequence of ", p.stream->length + p.n,
                      " tokens exceeds max_seq_len ", opt_.max_seq_len);
  model::TokenBatch b = planner_.plan(pieces, cache_);
  on_all_ranks([&](int r) {
    if (r == 0) return models_[0]->forward(b, views_[0], out);
    // the other ranks: the same step; only the gathered logits are needed (as scratch)
    model::ForwardOutputs o;
    if (out.logits.defined()) o.logits = scratch_logits_[size_t(r - 1)].slice(0, 0, out.logits.shape(0));
    o.all_logits = out.all_logits;
    models_[size_t(r)]->forward(b, views_[size_t(r)], o);
  });
  for (const Piece& p : pieces) p.stream->length += p.n;
}

void Target::mtp_chunk(const std::vector<Piece>& pieces, const Tensor& h_main, Tensor& logits, Tensor& hidden,
                       bool all_rows) {
  DFLASH2_CHECK(model().has_mtp(), ErrorKind::Unsupported,
                "this checkpoint has no MTP layer (num_nextn_predict_layers = 0)");
  for (const Piece& p : pieces)
    DFLASH2_CHECK_ARG(p.stream->length + p.n <= opt_.max_seq_len, "MTP sequence of ", p.stream->length + p.n,
                      " tokens exceeds max_seq_len ", opt_.max_seq_len);
  model::TokenBatch b = planner_.plan(pieces, mtp_cache_, all_rows);
  on_all_ranks([&](int r) {
    if (r == 0) return models_[0]->mtp_forward(b, h_main, mtp_views_[0], logits, hidden);
    Tensor lg = scratch_logits_[size_t(r - 1)].slice(0, 0, logits.shape(0)), none;
    models_[size_t(r)]->mtp_forward(b, h_main, mtp_views_[size_t(r)], lg, none);
  });
  for (const Piece& p : pieces) p.stream->length += p.n;
}

}  // namespace dflash2::runtime
