#include "runtime/target.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>

#ifdef DFLASH2_WITH_CUDA
#include "backend/cuda/cuda_api.h"
#endif

#include "dflash2/error.h"
#include "dflash2/ops.h"
#include "ops/kv_fp8.h"

namespace dflash2::runtime {

struct Target::Rank0Event {
#ifdef DFLASH2_WITH_CUDA
  explicit Rank0Event(int device) : ev(device) {}
  cuda::Event ev;
#endif
};

Target::Target(std::vector<std::unique_ptr<model::GlmModel>> models, const Options& opt)
    : models_(std::move(models)), opt_(opt) {
  const int n = int(models_.size());
  DFLASH2_INTERNAL(n >= 1, "a target needs at least one model");
  const model::GlmConfig& c = models_[0]->config();
  const int64_t blocks_per_seq = (opt.max_seq_len + opt.kv_block_size - 1) / opt.kv_block_size;
  // one sequence beyond the batch: the step-level API (Sequence, logits, propose) beside it;
  // and the padding sequences' blocks (pad_stream)
  const int64_t pad_tokens = opt.pad_to_buckets ? std::min(opt.max_step_tokens, opt.max_seq_len) : 0;
  const int64_t pad_blocks = (pad_tokens + opt.kv_block_size - 1) / opt.kv_block_size;
  const int64_t nblocks = blocks_per_seq * (opt.max_batch_size + 1) + pad_blocks;
  int64_t n_index = 0;
  for (bool f : c.indexer_full) n_index += f ? 1 : 0;
  // planes: 0 = MLA latent per layer, 1 = indexer keys per indexer layer; the latent and the
  // indexer are replicated on every rank (MLA shares one latent across heads)
  // (U8: FP8 rows, ops/kv_fp8.h: the latent's kv_lora values and the index keys quantized in
  // groups of up to 128 with power-of-two scales, the latent's rope in BF16)
  const DType cdt = opt.kv_cache_dtype;
  DFLASH2_CHECK_ARG(cdt == DType::F32 || cdt == DType::BF16 || cdt == DType::U8,
                    "the KV cache must be F32, BF16 or FP8 (U8 rows), found ", dtype_name(cdt));
  if (cdt == DType::U8) {
    DFLASH2_CHECK(kvfp8::fits(c.kv_lora_rank) && kvfp8::fits(c.index_head_dim), ErrorKind::InvalidArgument,
                  "kv_cache_dtype='fp8' quantizes the latent's kv_lora values and the index keys in groups: both "
                  "must be multiples of 16, at most 128 or multiples of 128; this model has kv_lora_rank ",
                  c.kv_lora_rank, " and index_head_dim ", c.index_head_dim);
  }
  const bool fp8 = cdt == DType::U8;
  const int64_t lat_w = fp8 ? kvfp8::fp8_latent_bytes(c.kv_lora_rank, c.qk_rope_head_dim) : c.latent_dim();
  const int64_t idx_w = fp8 ? kvfp8::fp8_bytes(c.index_head_dim) : c.index_head_dim;
  const bool has_mtp = models_[0]->has_mtp(), mtp_ix = has_mtp && models_[0]->mtp_has_indexer();
  const std::vector<KvCache::Plane> planes = {{c.num_layers, lat_w, cdt}, {n_index, idx_w, cdt}};
  const std::vector<KvCache::Plane> mtp_planes = {{1, lat_w, cdt}, {mtp_ix ? 1 : 0, idx_w, cdt}};
  if (opt.device.is_cuda())
    place_on_devices(KvCache::bytes_for(planes, nblocks * opt.kv_block_size) +
                     (has_mtp ? KvCache::bytes_for(mtp_planes, nblocks * opt.kv_block_size) : 0));
  if (opt.device.is_cuda() && opt.cuda_graphs) {
    graphs_ = std::make_unique<ForwardGraphs>(opt.device);  // rank 0's stream (the drafter's graphs too)
    if (n > 1) {  // every rank's chunks, one decision per chunk
      std::vector<Device> devs;
      std::vector<CUstream_st*> streams;
      for (int r = 0; r < n; ++r) {
        devs.push_back(Device::cuda(opt.device.index + r));
        streams.push_back(r == 0 ? graphs_->stream() : nullptr);
      }
      group_ = std::make_unique<GroupGraphs>(devs, streams);
    }
  }
  cache_ = KvCache("KV cache", planes, opt.kv_block_size, nblocks, opt.device, n);
  cache_.set_max_blocks_per_stream(blocks_per_seq);
  if (pad_tokens > 0)
    DFLASH2_INTERNAL(cache_.try_pin(pad_stream_, pad_tokens), "the padding stream's ", pad_blocks, " blocks");
  views_.resize(size_t(n));
  mtp_views_.resize(size_t(n));
  for (int r = 0; r < n; ++r) {
    int64_t slot = 0;
    for (int64_t l = 0; l < c.num_layers; ++l) {
      views_[size_t(r)].latent.push_back(cache_.layer(0, l, r));
      views_[size_t(r)].index.push_back(c.indexer_full[size_t(l)] ? cache_.layer(1, slot++, r) : Tensor());
    }
  }
  if (has_mtp) {
    const bool ix = mtp_ix;
    DFLASH2_CHECK(ix || opt.max_seq_len <= c.index_topk, ErrorKind::Checkpoint,
                  "the MTP layer has no indexer tensors, which is only supported while max_seq_len (", opt.max_seq_len,
                  ") <= index_topk (", c.index_topk, ")");
    mtp_cache_ = KvCache("MTP KV cache", mtp_planes, opt.kv_block_size, nblocks, opt.device, n);
    mtp_cache_.set_max_blocks_per_stream(blocks_per_seq);
    for (int r = 0; r < n; ++r) {
      mtp_views_[size_t(r)].latent.push_back(mtp_cache_.layer(0, 0, r));
      mtp_views_[size_t(r)].index.push_back(ix ? mtp_cache_.layer(1, 0, r) : Tensor());
    }
  }
  planner_ = StepPlanner(opt.max_step_tokens, std::max(opt.max_batch_size + 1, opt.max_step_tokens), blocks_per_seq);
  if (opt.device.is_cuda()) {
    d_logits_.resize(size_t(n));
    d_taps_.resize(size_t(n));
    d_fin_.resize(size_t(n));
    d_hmain_.resize(size_t(n));
    d_hidden_.resize(size_t(n));
    d_src_.resize(size_t(n));
    // the MTP layer's hidden-state inputs of each rank at their largest (a graph holds their
    // address; rank 0's key does not name the other ranks' buffers)
    for (int r = 0; r < n && n > 1; ++r)
      d_hmain_[size_t(r)] = Tensor::empty(DType::F32, {opt.max_step_tokens * c.hidden_size}, models_[size_t(r)]->device());
#ifdef DFLASH2_WITH_CUDA
    if (n > 1) {
      rank0_event_ = std::make_unique<Rank0Event>(models_[0]->device().index);
      // the ranks' copies of the drafter's outputs read rank 0's memory: directly where the
      // pair allows it (else the copies are staged by the driver)
      for (int r = 1; r < n; ++r) cuda::enable_peer_access(models_[size_t(r)]->device().index, models_[0]->device().index);
    }
#endif
    const int64_t rows = planner_.max_tokens(), seqs = planner_.max_seqs();
    const int64_t words = PlanUploader::planned_words(rows, seqs, blocks_per_seq);
    for (int r = 0; r < n; ++r) {
      const Device d = models_[size_t(r)]->device();
      dplan_.push_back(std::make_unique<PlanUploader>(d, words));
      d_logits_[size_t(r)] = Tensor::empty(DType::F32, {opt.max_step_tokens, c.vocab_size}, d);
    }
  }
  if (n > 1) {
    if (opt.device.is_cuda()) {
      std::vector<int> devices;
      for (int r = 0; r < n; ++r) devices.push_back(opt.device.index + r);
      comms_ = comm::make_nccl_group(devices);
    } else {
      comms_ = comm::make_cpu_group(n);
    }
    for (int r = 0; r < n; ++r) models_[size_t(r)]->set_comm(comms_[size_t(r)].get());
    const int total = opt.num_threads > 0 ? opt.num_threads : ops::cpu_cores();
    rank_threads_ = std::max(1, total / n);
    if (!opt.device.is_cuda())
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
    // Every rank's communicator is aborted, not only the failed one's: a rank whose collective
    // the failed rank never joined is released (on a GPU its NCCL kernels would otherwise wait
    // forever). Every rank has left the step: the CPU group is usable again after reset(); an
    // aborted NCCL group is not (its later collectives fail saying so), and that refusal must
    // not hide the cause.
    for (auto& c : comms_) c->abort();
    try {
      comms_[0]->reset();
    } catch (const Error&) {
    }
    std::rethrow_exception(cause ? cause : any);
  }
}

void Target::run_chunk(const std::vector<Piece>& pieces, const model::ForwardOutputs& out,
                       const Tensor& token_src) {
  for (const Piece& p : pieces)
    DFLASH2_CHECK_ARG(p.stream->length + p.n <= opt_.max_seq_len, "sequence of ", p.stream->length + p.n,
                      " tokens exceeds max_seq_len ", opt_.max_seq_len);
  model::TokenBatch b = planner_.plan(pieces, cache_);
  if (rec_.recording()) {  // queued: the drafts it refers to do not exist yet
    record_chunk(b, out, token_src);
    for (const Piece& p : pieces) p.stream->length += p.n;
    return;
  }
  const Tensor dev_src = resolve_host_refs(b, token_src);
  if (opt_.device.is_cuda()) {
    run_chunk_device(b, out, dev_src);
    for (const Piece& p : pieces) p.stream->length += p.n;
    return;
  }
  on_all_ranks([&](int r) { models_[size_t(r)]->forward(b, views_[size_t(r)], cpu_rank_outputs(r, out)); });
  for (const Piece& p : pieces) p.stream->length += p.n;
}

model::ForwardOutputs Target::cpu_rank_outputs(int r, const model::ForwardOutputs& out) const {
  if (r == 0) return out;
  // the other ranks: the same step; only the gathered logits are needed (as scratch)
  model::ForwardOutputs o;
  if (out.logits.defined()) o.logits = scratch_logits_[size_t(r - 1)].slice(0, 0, out.logits.shape(0));
  o.argmax_only = out.argmax_only;  // rank 0 merges the gathered pairs
  o.all_logits = out.all_logits;
  o.prompt = out.prompt;  // every rank runs the chunk's numerics
  o.exact = out.exact;
  return o;
}

uint32_t Target::common_experts(ops::GemmNumerics g, uint32_t allowed) const {
  using G = ops::GemmNumerics;
  for (;;) {
    const G first = models_[0]->experts_numerics(g, allowed);
    bool same = true;
    G best = G::Exact;  // the most preferred choice of any rank (FP8 / NVFP4, then BF16)
    for (const auto& m : models_) {
      const G e = m->experts_numerics(g, allowed);
      same = same && e == first;
      if (e != G::Exact && (best == G::Exact || (best == G::BF16 && e != G::BF16))) best = e;
    }
    if (same) return allowed;
    allowed &= ~(1u << unsigned(best));  // some rank could not take it: none does
  }
}

GraphStats Target::graph_stats() const {
  GraphStats g = graphs_ ? graphs_->stats() : GraphStats{};
  if (group_) g += group_->stats();  // one count per chunk of the group
  return g;
}

int64_t Target::bucket(int64_t S) const {
  int64_t b = 1;
  while (b < S && b < 32) b *= 2;
  if (b < S) b = (S + 31) / 32 * 32;
  return std::min(b, opt_.max_batch_size);
}

void Target::flush_step() {
  if (tp_size() > 1)  // every rank's part at once (GroupGraphs with graphs, else eagerly)
    return rec_.flush_group(group_.get(), [this](const std::function<void(int)>& job) { on_all_ranks(job); },
                            comms_[0].get());
#ifdef DFLASH2_WITH_CUDA
  rec_.flush(graphs_.get(), models_[0]->device().index);
#else
  rec_.flush(nullptr, 0);
#endif
}

namespace {
// The launch shape of a forward / MTP chunk on rank 0 (see step_graphs.h): its sizes, then
// every buffer its kernels are given. One builder for the per-chunk graphs and the recorded
// step, so the two keys cannot drift apart.
std::string forward_key(const model::TokenBatch& db, const model::ForwardOutputs& o, const Tensor& token_src) {
  std::string key;
  for (int64_t v : {db.T, db.S, db.paged.block_size, int64_t(o.all_logits), int64_t(o.argmax_only)})
    ForwardGraphs::key_add(key, v);
  for (const Tensor* t : std::initializer_list<const Tensor*>{&db.tokens, &db.paged.seq, &db.paged.pos,
                                                              &db.paged.block_table, &db.slots, &db.logit_rows,
                                                              &db.ctx_len, &o.logits, &o.taps, &o.final_hidden,
                                                              &o.argmax, &o.argmax_flags, &token_src})
    ForwardGraphs::key_add(key, *t);
  for (int64_t l : o.tap_layers) ForwardGraphs::key_add(key, l);
  return key;
}
std::string mtp_key(const model::TokenBatch& db, const Tensor& hm, const Tensor& lg, const Tensor& hid,
                    const Tensor& token_src) {
  std::string key = "mtp|";
  for (int64_t v : {db.T, db.S, db.paged.block_size}) ForwardGraphs::key_add(key, v);
  for (const Tensor* t : std::initializer_list<const Tensor*>{&db.tokens, &db.paged.seq, &db.paged.pos,
                                                              &db.paged.block_table, &db.slots, &db.logit_rows, &hm,
                                                              &lg, &hid, &token_src})
    ForwardGraphs::key_add(key, *t);
  return key;
}
}  // namespace

model::TokenBatch Target::record_plan(const model::TokenBatch& b, PlanRole role, int rank) {
  const int64_t words = PlanUploader::words_of(b), bps = cache_.max_blocks_per_stream();
  const int64_t seqs = opt_.max_batch_size + 1;
  const int64_t cap = role == PlanRole::Chain ? PlanUploader::planned_words(seqs, seqs, bps)
                                              : PlanUploader::planned_words(planner_.max_tokens(), planner_.max_seqs(), bps);
  DFLASH2_INTERNAL(words <= cap, "a recorded plan of ", words, " words for a buffer of ", cap);
  DFLASH2_INTERNAL(rank == 0 || role == PlanRole::Verify, "rank ", rank, "'s copy of a recorded MTP plan");
  if (!opt_.device.is_cuda()) {  // a copy: the planner's buffers serve the step's next chunk
    model::TokenBatch c = b;
    for (Tensor* t : {&c.tokens, &c.paged.seq, &c.paged.pos, &c.paged.block_table, &c.slots, &c.logit_rows,
                      &c.ctx_len})
      if (t->defined()) {
        Tensor copy = Tensor::empty(t->dtype(), t->shape());
        copy.copy_from(*t);
        *t = copy;
      }
    return c;
  }
#ifdef DFLASH2_WITH_CUDA
  if (rec_.begun() != rec_step_) {  // a new step: its chain's chunks take the buffers from the first
    rec_step_ = rec_.begun();
    rec_plans_used_ = 0;
  }
  std::unique_ptr<PlanUploader>* slot = nullptr;
  if (role == PlanRole::Verify) {  // one per step and rank (a recorded step's verify pass is one chunk)
    if (rec_verify_.size() < size_t(tp_size())) rec_verify_.resize(size_t(tp_size()));
    slot = &rec_verify_[size_t(rank)];
  } else if (role == PlanRole::AfterAccept) {  // one per step
    slot = &rec_after_;
  } else {  // the MTP chain's i-th position
    const size_t i = rec_plans_used_++;
    if (rec_plans_.size() <= i) rec_plans_.resize(i + 1);
    slot = &rec_plans_[i];
  }
  const Device d = models_[size_t(rank)]->device();
  if (!*slot) *slot = std::make_unique<PlanUploader>(d, cap);
  PlanUploader* up = slot->get();
  // on the rank's graphs' stream (rank 0's is graphs_'), in order with its legacy stream;
  // nothing else writes this buffer before the flush
  CUstream_st* s = group_ ? group_->stream(rank) : graphs_ ? graphs_->stream() : nullptr;
  cuda::OrderedStreamScope stream_scope(s, d.index);
  return up->upload(b);
#else
  fail(ErrorKind::Unsupported, "a CUDA plan in a build without CUDA");
#endif
}

void Target::record_chunk(const model::TokenBatch& b, const model::ForwardOutputs& out, const Tensor& token_src) {
  DFLASH2_INTERNAL(!out.prompt && !out.exact, "a recorded step needs a decode chunk");
  const Device d0 = models_[0]->device();
  DFLASH2_INTERNAL(!token_src.defined() || token_src.device() == d0, "a recorded verify chunk reads ",
                   token_src.describe(), " (the drafts must be on ", d0.str(), ")");
  DFLASH2_INTERNAL((!out.logits.defined() || out.logits.device() == d0) &&
                       (!out.taps.defined() || out.taps.device() == d0) &&
                       (!out.final_hidden.defined() || out.final_hidden.device() == d0),
                   "a recorded chunk writes its outputs on ", d0.str());
  DFLASH2_INTERNAL(!out.argmax_only || (out.argmax.device() == d0 && out.argmax_flags.device() == d0),
                   "a recorded chunk's argmax outputs on ", d0.str());
  if (tp_size() > 1) return record_chunk_ranks(b, out, token_src);
  model::TokenBatch db = record_plan(b, PlanRole::Verify);
  const std::string key = opt_.device.is_cuda() ? forward_key(db, out, token_src) : std::string();
  // the references are filled in when the piece runs, after the draft's (on a GPU: in the graph)
  rec_.add(key, [this, db, o = out, src = token_src]() mutable {
    if (src.defined()) ops::resolve_tokens(db.tokens, src);
    models_[0]->forward(db, views_[0], o);
  });
}

void Target::record_chunk_ranks(const model::TokenBatch& b, const model::ForwardOutputs& out,
                                const Tensor& token_src) {
  const int n = tp_size();
  const bool cuda = opt_.device.is_cuda();
  std::vector<model::TokenBatch> db(static_cast<size_t>(n));
  std::vector<model::ForwardOutputs> o(static_cast<size_t>(n));
  std::vector<Tensor> src(static_cast<size_t>(n));
  if (rec_src_.empty()) rec_src_.resize(size_t(n));
  for (int r = 0; r < n; ++r) {
    db[size_t(r)] = record_plan(b, PlanRole::Verify, r);
    o[size_t(r)] = cuda ? rank_outputs(r, b, out) : cpu_rank_outputs(r, out);
    if (!token_src.defined()) continue;
    if (r == 0) {
      DFLASH2_INTERNAL(token_src.is_contiguous(), "a recorded verify chunk's drafts ", token_src.describe(),
                       " must be contiguous (the other ranks receive them by broadcast)");
      src[0] = token_src;
      continue;
    }
    // the other ranks' copies: one fixed buffer each (their graphs hold its address), sized
    // by the first source -- the drafter's output buffer, the same every step
    Tensor& buf = rec_src_[size_t(r)];
    if (!buf.defined()) buf = Tensor::empty(token_src.dtype(), {token_src.numel()}, models_[size_t(r)]->device());
    DFLASH2_INTERNAL(buf.dtype() == token_src.dtype() && token_src.numel() <= buf.numel(), "rank ", r,
                     "'s copy of the drafts ", token_src.describe(), " in ", buf.describe());
    src[size_t(r)] = buf.slice(0, 0, token_src.numel()).reshape(token_src.shape());
  }
  // keyed by rank 0's launch shape: the other ranks' buffers are fixed (plans, drafts' copies,
  // logits scratch)
  const std::string key = cuda ? forward_key(db[0], o[0], token_src) : std::string();
  rec_.add_ranks(key, [this, db, o, src](int r) {
    const model::TokenBatch& d = db[size_t(r)];
    Tensor x = src[size_t(r)];
    if (x.defined()) {  // rank 0's drafts to every rank, then the references filled in from them
      comms_[size_t(r)]->broadcast(x, 0);
      Tensor tokens = d.tokens;  // (a handle: the rank's own plan buffer)
      ops::resolve_tokens(tokens, x);
    }
    models_[size_t(r)]->forward(d, views_[size_t(r)], o[size_t(r)]);
  });
}

void Target::record_mtp_chunk(const model::TokenBatch& b, const Tensor& h_main, const Tensor& logits,
                              const Tensor& hidden, const Tensor& token_src, const ChunkPrep& prep) {
  DFLASH2_INTERNAL(tp_size() == 1, "a recorded step needs one rank");
  const Device d0 = models_[0]->device();
  DFLASH2_INTERNAL(h_main.device() == d0 && logits.device() == d0 && (!hidden.defined() || hidden.device() == d0) &&
                       (!token_src.defined() || token_src.device() == d0),
                   "a recorded MTP chunk reads and writes on ", d0.str());
  model::TokenBatch db = record_plan(b, prep.fn ? PlanRole::AfterAccept : PlanRole::Chain);
  std::string key = opt_.device.is_cuda() ? mtp_key(db, h_main, logits, hidden, token_src) : std::string("mtp|");
  key += prep.key;
  rec_.add(key, [this, db, hm = h_main, lg = logits, hid = hidden, src = token_src, fn = prep.fn]() mutable {
    if (src.defined()) ops::resolve_tokens(db.tokens, src);  // the chain's ids, when the piece runs
    if (fn) fn(db);
    models_[0]->mtp_forward(db, hm, mtp_views_[0], lg, hid);
  });
}

Tensor Target::resolve_host_refs(model::TokenBatch& b, const Tensor& token_src) {
  // references into a host source are filled in on the host plan (every rank reads it);
  // a device source is rank 0's (one rank: the device drafter), filled in after the upload
  if (!token_src.defined()) return Tensor();
  if (token_src.device().is_cpu()) {
    ops::resolve_tokens(b.tokens, token_src);
    return Tensor();
  }
  DFLASH2_INTERNAL(opt_.device.is_cuda() && token_src.device() == models_[0]->device() && token_src.is_contiguous(),
                   "token references into ", token_src.describe(), " with ", tp_size(), " ranks");
  return token_src;
}

void Target::mark_rank0_inputs() {
#ifdef DFLASH2_WITH_CUDA
  DFLASH2_INTERNAL(rank0_event_ != nullptr, "rank 0's input event without tensor parallelism on CUDA");
  rank0_event_->ev.record();  // this thread's stream of rank 0's device: after the producers
#endif
}

Tensor Target::from_rank0(int r, const Tensor& src, std::vector<Tensor>& bufs) {
  if (r == 0 || !src.defined()) return src;
#ifdef DFLASH2_WITH_CUDA
  const Device d0 = models_[0]->device(), d = models_[size_t(r)]->device();
  DFLASH2_INTERNAL(src.device() == d0 && src.is_contiguous(), "rank ", r, " copies ", src.describe(),
                   " from rank 0's ", d0.str());
  Tensor& b = bufs[size_t(r)];
  if (!b.defined() || b.dtype() != src.dtype() || b.numel() < src.numel())
    b = Tensor::empty(src.dtype(), {std::max<int64_t>(src.numel(), 1)}, d);
  Tensor out = b.slice(0, 0, src.numel()).reshape(src.shape());
  rank0_event_->ev.stream_wait(d.index);  // this rank's stream: after rank 0's producers
  cuda::copy_peer_async(out.data(), d.index, src.data(), d0.index, src.nbytes());
  return out;
#else
  fail(ErrorKind::Unsupported, "rank ", r, " reads ", src.describe(), " in a build without CUDA");
#endif
}

bool Target::vocab_head_ok(int64_t k) const {
  const int64_t n = tp_size(), V = config().vocab_size;
  return n > 1 && V % n == 0 && V / n >= std::max<int64_t>(k, 3) && V <= (int64_t(1) << 24);
}

void Target::reserve_vocab_head(int64_t rows, int64_t k, ops::GemmNumerics g, bool rows_copies) {
  DFLASH2_INTERNAL(vocab_head_ok(k) && rows >= 1 && vh_.empty(), "a vocabulary-parallel head of k = ", k, " over ",
                   tp_size(), " ranks (reserved once: group graphs hold its buffers)");
  const int n = tp_size();
  const int64_t V = config().vocab_size, Vl = V / n, w = k > 0 ? 2 * k : 2;
  vh_.assign(size_t(n), VocabHeadBufs{});
  d_vrows_.assign(size_t(n), Tensor());
  // every rank's buffers checked against its free memory before anything is allocated
  for (int r = 0; r < n; ++r) {
    const Device d = models_[size_t(r)]->device();
    if (!d.is_cuda()) continue;
#ifdef DFLASH2_WITH_CUDA
    const size_t need = size_t(rows) * size_t(Vl + w + n * w + (r == 0 ? 1 : rows_copies ? config().hidden_size : 0)) * 4;
    size_t free_b = 0, total_b = 0;
    cuda::mem_info(d.index, &free_b, &total_b);
    const std::string what = k > 0 ? "their top " + std::to_string(k) : std::string("their argmax pairs");
    DFLASH2_CHECK(need <= free_b, ErrorKind::OutOfMemory, "the drafter's LM head on the vocabulary shards does not fit ",
                  d.str(), ": it needs ", need >> 20, " MiB (the shard's logits of ", rows, " rows, ", what,
                  ", the gathered ones", r > 0 && rows_copies ? ", a copy of the rows" : "", ") but ", free_b >> 20,
                  " MiB of ", total_b >> 20, " are free; lower max_batch_size or max_seq_len");
#endif
  }
  for (int r = 0; r < n; ++r) {
    const Device d = models_[size_t(r)]->device();
    VocabHeadBufs& b = vh_[size_t(r)];
    b.local = Tensor::empty(DType::F32, {rows, Vl}, d);
    b.packed = Tensor::empty(DType::F32, {rows * w}, d);
    b.gathered = Tensor::empty(DType::F32, {n * rows * w}, d);
    if (r == 0) b.flags = Tensor::empty(DType::I32, {rows}, d);
    // the other ranks' copies of the rows (on the CPU too: a recorded step broadcasts them)
    if (r > 0 && rows_copies) d_vrows_[size_t(r)] = Tensor::empty(DType::F32, {rows * config().hidden_size}, d);
    models_[size_t(r)]->prepare_head(g);
  }
  vh_rows_ = rows;
  vh_k_ = k;
}

void Target::vocab_head(const Tensor& rows, ops::GemmNumerics g, int64_t k, Tensor& vals, Tensor& ids) {
  const int n = tp_size();
  const int64_t R = rows.shape(0);
  DFLASH2_INTERNAL(n > 1 && k == vh_k_ && R >= 1 && R <= vh_rows_ && rows.ndim() == 2 &&
                       rows.shape(1) == config().hidden_size,
                   "vocabulary-parallel head of ", rows.describe(), ", k = ", k, " (reserved: ", vh_rows_,
                   " rows, k = ", vh_k_, ")");
  const bool cuda = opt_.device.is_cuda();
  std::string key;
  if (group_ || rec_.recording()) {  // the launch shape (rank 0's; the other ranks' buffers are fixed)
    key = "vocab_head|";
    for (int64_t v : {R, k, int64_t(g)}) ForwardGraphs::key_add(key, v);
    for (const Tensor* t : std::initializer_list<const Tensor*>{&rows, &vals, &ids}) ForwardGraphs::key_add(key, *t);
  }
  if (rec_.recording()) {
    // a piece of every rank in the recorded step: rank 0's rows broadcast to the others (the
    // collective, inside every rank's graph, orders them after rank 0's draft forward)
    DFLASH2_INTERNAL(rows.is_contiguous() && (!cuda || rows.device() == models_[0]->device()), "the head's rows ",
                     rows.describe(), " of a recorded step (contiguous, on rank 0's device)");
    const int64_t H = config().hidden_size;
    rec_.add_ranks(cuda ? key : std::string(), [this, rows, g, k, vals, ids, R, H](int r) {
      Tensor x = r == 0 ? rows : d_vrows_[size_t(r)].slice(0, 0, R * H).reshape({R, H});
      comms_[size_t(r)]->broadcast(x, 0);
      vocab_head_part(r, x, g, k, vals, ids);
    });
    ++vocab_head_calls_;
    return;
  }
  if (cuda) mark_rank0_inputs();  // the rows, for the other ranks' copies
  auto part = [&](int r, const Tensor& x) { vocab_head_part(r, x, g, k, vals, ids); };
  if (group_) {
    // CUDA graphs: one GroupGraphs entry for every rank's part (the all-gather inside), keyed
    // by rank 0's launch shape; the other ranks' buffers are fixed (reserve_vocab_head). The
    // event wait and the peer copy of the rows stay before each rank's graph.
    std::vector<Tensor> x(static_cast<size_t>(n));
    group_->run(
        key, [this](const std::function<void(int)>& job) { on_all_ranks(job); },
        [&](int r) { x[size_t(r)] = from_rank0(r, rows, d_vrows_); },  // rank 0: rows itself
        [&](int r) { part(r, x[size_t(r)]); }, comms_[0].get());
  } else {
    // eagerly: rank 0 on the caller's stream (the drafter's), the others on their current one
    // (the legacy stream, where their chunks run without graphs)
    on_all_ranks([&](int r) {
      part(r, cuda ? from_rank0(r, rows, d_vrows_) : rows);  // the CPU ranks share the host's rows
    });
  }
  ++vocab_head_calls_;
}

void Target::vocab_head_part(int r, const Tensor& x, ops::GemmNumerics g, int64_t k, const Tensor& vals,
                             const Tensor& ids) {
  const int n = tp_size();
  const int64_t R = x.shape(0), w = k > 0 ? 2 * k : 2;
  const Device d = models_[size_t(r)]->device();
  DFLASH2_INTERNAL(n > 1 && k == vh_k_ && R >= 1 && R <= vh_rows_ && x.ndim() == 2 && x.shape(1) == config().hidden_size &&
                       x.device() == d,
                   "rank ", r, "'s vocabulary-parallel head of ", x.describe(), ", k = ", k, " (reserved: ", vh_rows_,
                   " rows, k = ", vh_k_, ")");
  VocabHeadBufs& b = vh_[size_t(r)];
  Tensor local = b.local.slice(0, 0, R);
  Tensor packed = Tensor::view(b.packed.data(), DType::F32, {R, w}, {}, d);
  Tensor gathered = Tensor::view(b.gathered.data(), DType::F32, {int64_t(n), R, w}, {}, d);
  Tensor v = r == 0 ? vals : Tensor(), i = r == 0 ? ids : Tensor();
  Tensor f = r == 0 && k == 0 ? b.flags.slice(0, 0, R) : Tensor();
  models_[size_t(r)]->vocab_head(x, g, k, local, packed, gathered, v, i, f);
}

void Target::mtp_chunk(const std::vector<Piece>& pieces, const Tensor& h_main, Tensor& logits, Tensor& hidden,
                       bool all_rows, const Tensor& token_src, bool queue, const ChunkPrep& prep) {
  DFLASH2_CHECK(model().has_mtp(), ErrorKind::Unsupported,
                "this checkpoint has no MTP layer (num_nextn_predict_layers = 0)");
  for (const Piece& p : pieces)
    DFLASH2_CHECK_ARG(p.stream->length + p.n <= opt_.max_seq_len, "MTP sequence of ", p.stream->length + p.n,
                      " tokens exceeds max_seq_len ", opt_.max_seq_len);
  model::TokenBatch b = planner_.plan(pieces, mtp_cache_, all_rows);
  DFLASH2_INTERNAL(!prep.fn || (queue && rec_.recording()), "a chunk preparation outside a recorded step");
  if (queue && rec_.recording()) {  // a piece of the step (the ids it refers to do not exist yet)
    record_mtp_chunk(b, h_main, logits, hidden, token_src, prep);
    for (const Piece& p : pieces) p.stream->length += p.n;
    return;
  }
  const Tensor dev_src = resolve_host_refs(b, token_src);
  if (opt_.device.is_cuda()) {
    mtp_chunk_device(b, h_main, logits, hidden, dev_src);
    for (const Piece& p : pieces) p.stream->length += p.n;
    return;
  }
  on_all_ranks([&](int r) {
    if (r == 0) return models_[0]->mtp_forward(b, h_main, mtp_views_[0], logits, hidden);
    Tensor lg = scratch_logits_[size_t(r - 1)].slice(0, 0, logits.shape(0)), none;
    models_[size_t(r)]->mtp_forward(b, h_main, mtp_views_[size_t(r)], lg, none);
  });
  for (const Piece& p : pieces) p.stream->length += p.n;
}

// ------------------------------------------------------------------ CUDA
#ifdef DFLASH2_WITH_CUDA
namespace {
std::string gib(size_t b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", double(b) / double(size_t(1) << 30));
  return buf;
}
}  // namespace
#endif

void Target::place_on_devices(int64_t cache_bytes_per_rank) {
#ifndef DFLASH2_WITH_CUDA
  (void)cache_bytes_per_rank;
  fail(ErrorKind::Unsupported, "device ", opt_.device.str(), ": dflash2 was built without CUDA (DFLASH2_CUDA=OFF)");
#else
  const model::GlmConfig& c = models_[0]->config();
  const int n = tp_size();
  // per rank: the caches (latent + indexer keys, and the MTP layer's), the plan copies and
  // the logits of a chunk, besides the model's own weights and workspace
  const size_t cache_bytes = size_t(cache_bytes_per_rank);
  // logits of a chunk, the drafter features / MTP inputs copied through the device, the
  // indexer's per-stream score scratch (tokens x context), plan copies and slack
  const size_t T = size_t(opt_.max_step_tokens), H = size_t(c.hidden_size);
  const size_t io_bytes = T * size_t(c.vocab_size) * 4 + T * H * 4 * size_t(c.num_layers + 4) +
                          T * size_t(opt_.max_seq_len) * 4 + (size_t(64) << 20);
  const int64_t count = cuda::device_count();
  DFLASH2_CHECK_ARG(opt_.device.index >= 0 && opt_.device.index + n <= count, "device ", opt_.device.str(), " with ",
                    "tensor_parallel=", n, " needs CUDA devices ", opt_.device.index, "..", opt_.device.index + n - 1,
                    " but ", count, " ", count == 1 ? "is" : "are", " visible");
  for (int r = 0; r < n; ++r) {  // everything is checked before anything is allocated
    const int dev = opt_.device.index + r;
    cuda::check_arch(dev);
    const size_t model_bytes = models_[size_t(r)]->device_bytes();
    const size_t need = model_bytes + cache_bytes + io_bytes;
    size_t free_b = 0, total_b = 0;
    cuda::mem_info(dev, &free_b, &total_b);
    DFLASH2_CHECK(need <= free_b, ErrorKind::OutOfMemory, "the model does not fit cuda:", dev, ": it needs ",
                  gib(need), " (weights + workspace ", gib(model_bytes), ", KV caches ", gib(cache_bytes),
                  " for max_batch_size=", opt_.max_batch_size, " x max_seq_len=", opt_.max_seq_len, ", step buffers ",
                  gib(io_bytes), ") but ", gib(free_b), " of ", gib(total_b), " are free",
                  n == 1 ? "; tensor_parallel splits the weights across GPUs" : "");
  }
  for (int r = 0; r < n; ++r) {
    const Device d = Device::cuda(opt_.device.index + r);
    const size_t total = models_[size_t(r)]->device_bytes();
    const bool report = total > (size_t(1) << 30);
    int shown = -1;
    models_[size_t(r)]->to_device(d, [&](size_t done, size_t all) {
      const int pct = all ? int(100.0 * double(done) / double(all)) : 100;
      if (report && pct / 10 != shown) {
        shown = pct / 10;
        std::fprintf(stderr, "\rdflash2: weights to %s: %3d%% (%s of %s)%s", d.str().c_str(), pct, gib(done).c_str(),
                     gib(all).c_str(), done >= all ? "\n" : "");
      }
    });
  }
#endif
}

Tensor Target::device_rows(std::vector<Tensor>& bufs, int r, int64_t rows, int64_t cols) {
  Tensor& b = bufs[size_t(r)];
  if (!b.defined() || b.numel() < rows * cols)
    b = Tensor::empty(DType::F32, {std::max<int64_t>(rows * cols, 1)}, models_[size_t(r)]->device());
  return b.slice(0, 0, rows * cols).reshape({rows, cols});
}

model::TokenBatch Target::upload(const model::TokenBatch& b, int r) { return dplan_[size_t(r)]->upload(b); }

model::ForwardOutputs Target::rank_outputs(int r, const model::TokenBatch& b, const model::ForwardOutputs& out) {
  const int64_t H = config().hidden_size;
  const Device d0 = models_[0]->device();
  model::ForwardOutputs o;
  o.all_logits = out.all_logits;
  o.prompt = out.prompt;  // prompt chunks: Engine prefill_gemm's numerics
  o.exact = out.exact;    // the comparison APIs: exact whatever decode_gemm
  o.argmax_only = out.argmax_only;  // greedy under tensor parallelism: (max, id) pairs, merged on rank 0
  if (r == 0 && out.argmax_only) {
    DFLASH2_INTERNAL(out.argmax.device() == d0 && out.argmax_flags.device() == d0, "argmax outputs ",
                     out.argmax.describe(), " must be on rank 0's ", d0.str());
    o.argmax = out.argmax;
    o.argmax_flags = out.argmax_flags;
  }
  // rank 0 writes logits straight into the caller's tensor when it is on its device,
  // likewise the features when the drafter reading them is there
  if (out.logits.defined())
    o.logits = r == 0 && out.logits.device() == d0 ? out.logits : d_logits_[size_t(r)].slice(0, 0, out.logits.shape(0));
  if (r == 0) {
    o.tap_layers = out.tap_layers;
    if (out.taps.defined())
      o.taps = out.taps.device() == d0 ? out.taps : device_rows(d_taps_, r, b.T, out.taps.shape(1));
    if (out.final_hidden.defined())
      o.final_hidden = out.final_hidden.device() == d0 ? out.final_hidden : device_rows(d_fin_, r, b.T, H);
  }
  return o;
}

void Target::copy_back(const model::ForwardOutputs& out, const model::ForwardOutputs& o0) {
  // the outputs the caller asked for, back to its host tensors (synchronizes)
  if (out.logits.defined() && out.logits.shape(0) > 0 && o0.logits.data() != out.logits.data()) {
    DFLASH2_INTERNAL(out.logits.shape(1) == config().vocab_size, "logits width");
    Tensor dst = out.logits;
    dst.copy_from(o0.logits);
  }
  if (out.taps.defined() && o0.taps.data() != out.taps.data()) {
    Tensor dst = out.taps;
    dst.copy_from(o0.taps);
  }
  if (out.final_hidden.defined() && o0.final_hidden.data() != out.final_hidden.data()) {
    Tensor dst = out.final_hidden;
    dst.copy_from(o0.final_hidden);
  }
}

void Target::run_chunk_device(const model::TokenBatch& b, const model::ForwardOutputs& out, const Tensor& token_src) {
  if (group_ && !out.prompt && !out.exact) return run_chunk_group(b, out, token_src);
  if (token_src.defined() && tp_size() > 1) mark_rank0_inputs();  // the drafts, for the other ranks' copies
  // one rank with graphs: rank 0's decode / verify chunks as CUDA graphs; tensor parallelism
  // without graphs, and prompt / comparison chunks: eagerly
  ForwardGraphs* g = tp_size() == 1 && !out.prompt && !out.exact ? graphs_.get() : nullptr;
  on_all_ranks([&](int r) {
#ifdef DFLASH2_WITH_CUDA
    // with graphs: everything on the graphs' stream, in order with the eager work on the
    // legacy default stream before and after (OrderedStreamScope)
    cuda::OrderedStreamScope stream_scope(g ? g->stream() : nullptr, models_[size_t(r)]->device().index);
#endif
    model::TokenBatch db = upload(b, r);
    model::ForwardOutputs o = rank_outputs(r, b, out);
    if (g) {
      // the launch shape: sizes, then every buffer the kernels are given (see step_graphs.h)
      g->run(forward_key(db, o, token_src), [&] {
        if (token_src.defined()) ops::resolve_tokens(db.tokens, token_src);  // the drafts, in the graph
        models_[0]->forward(db, views_[0], o);
      });
    } else {
      const Tensor src = from_rank0(r, token_src, d_src_);  // the drafts: the other ranks' copies
      if (src.defined()) ops::resolve_tokens(db.tokens, src);
      models_[size_t(r)]->forward(db, views_[size_t(r)], o);
    }
    if (r == 0) copy_back(out, o);
  });
}

void Target::run_chunk_group(const model::TokenBatch& b, const model::ForwardOutputs& out, const Tensor& token_src) {
#ifdef DFLASH2_WITH_CUDA
  const int n = tp_size();
  const Device d0 = models_[0]->device();
  if (token_src.defined()) mark_rank0_inputs();  // the drafts, for the other ranks' copies
  std::vector<model::TokenBatch> db(static_cast<size_t>(n));
  std::vector<model::ForwardOutputs> o(static_cast<size_t>(n));
  {  // rank 0's plan first: its device buffers are part of the key
    cuda::OrderedStreamScope scope(group_->stream(0), d0.index);
    db[0] = upload(b, 0);
  }
  for (int r = 0; r < n; ++r) o[size_t(r)] = rank_outputs(r, b, out);
  group_->run(
      forward_key(db[0], o[0], token_src), [this](const std::function<void(int)>& job) { on_all_ranks(job); },
      [&](int r) {  // the other ranks' plans, and their copies of the drafts, before their graphs
        if (r == 0) return;
        db[size_t(r)] = upload(b, r);
        const Tensor src = from_rank0(r, token_src, d_src_);
        if (src.defined()) ops::resolve_tokens(db[size_t(r)].tokens, src);
      },
      [&](int r) {
        if (r == 0 && token_src.defined()) ops::resolve_tokens(db[0].tokens, token_src);  // in rank 0's graph
        models_[size_t(r)]->forward(db[size_t(r)], views_[size_t(r)], o[size_t(r)]);
      },
      comms_[0].get());
  copy_back(out, o[0]);
#else
  (void)b, (void)out, (void)token_src;
  fail(ErrorKind::Unsupported, "CUDA graphs in a build without CUDA");
#endif
}

void Target::mtp_chunk_device(const model::TokenBatch& b, const Tensor& h_main, Tensor& logits, Tensor& hidden,
                              const Tensor& token_src) {
  if (group_) return mtp_chunk_group(b, h_main, logits, hidden, token_src);
  const Device d0 = models_[0]->device();
  // the MTP drafter's chain on rank 0's GPU: its ids and hidden states, for the other ranks' copies
  const bool from0 = tp_size() > 1 && h_main.device() == d0;
  DFLASH2_INTERNAL(!from0 || h_main.is_contiguous(), "the MTP layer's input ", h_main.describe(),
                   " on rank 0's device must be contiguous (the other ranks copy it)");
  if (tp_size() > 1 && (token_src.defined() || from0)) mark_rank0_inputs();
  ForwardGraphs* g = tp_size() == 1 ? graphs_.get() : nullptr;
  on_all_ranks([&](int r) {
#ifdef DFLASH2_WITH_CUDA
    cuda::OrderedStreamScope stream_scope(g ? g->stream() : nullptr, models_[size_t(r)]->device().index);
#endif
    model::TokenBatch db = upload(b, r);
    const Tensor hm = mtp_input(r, h_main, from0);
    MtpOutputs o = mtp_outputs(r, logits, hidden);
    if (g) {  // the MTP layer's chunks (commits, chained positions) as graphs too
      g->run(mtp_key(db, hm, o.logits, o.hidden, token_src), [&] {
        if (token_src.defined()) ops::resolve_tokens(db.tokens, token_src);  // the chain's ids, in the graph
        models_[0]->mtp_forward(db, hm, mtp_views_[0], o.logits, o.hidden);
      });
    } else {
      const Tensor src = from_rank0(r, token_src, d_src_);  // rank 0's ids: the others' copies
      if (src.defined()) ops::resolve_tokens(db.tokens, src);
      models_[size_t(r)]->mtp_forward(db, hm, mtp_views_[size_t(r)], o.logits, o.hidden);
    }
    if (r == 0) mtp_copy_back(o, logits, hidden);
  });
}

Tensor Target::mtp_input(int r, const Tensor& h_main, bool from0) {
  if (from0) return from_rank0(r, h_main, d_hmain_);  // rank 0: in place
  if (h_main.device() == models_[size_t(r)]->device()) return h_main;
  Tensor hm = device_rows(d_hmain_, r, h_main.shape(0), config().hidden_size);
  hm.copy_from(h_main.contiguous());
  return hm;
}

Target::MtpOutputs Target::mtp_outputs(int r, const Tensor& logits, const Tensor& hidden) {
  const Device d = models_[size_t(r)]->device();
  MtpOutputs o;
  o.logits_direct = r == 0 && logits.device() == d;
  o.hidden_direct = r == 0 && hidden.defined() && hidden.device() == d;
  o.logits = o.logits_direct ? logits : d_logits_[size_t(r)].slice(0, 0, logits.shape(0));
  if (o.hidden_direct)
    o.hidden = hidden;
  else if (r == 0 && hidden.defined())
    o.hidden = device_rows(d_hidden_, r, hidden.shape(0), config().hidden_size);
  return o;
}

void Target::mtp_copy_back(const MtpOutputs& o, Tensor& logits, Tensor& hidden) {
  if (!o.logits_direct && logits.shape(0) > 0) logits.copy_from(o.logits);
  if (hidden.defined() && !o.hidden_direct) hidden.copy_from(o.hidden);
}

void Target::mtp_chunk_group(const model::TokenBatch& b, const Tensor& h_main, Tensor& logits, Tensor& hidden,
                             const Tensor& token_src) {
#ifdef DFLASH2_WITH_CUDA
  const int n = tp_size();
  const Device d0 = models_[0]->device();
  const bool from0 = h_main.device() == d0;
  DFLASH2_INTERNAL(!from0 || h_main.is_contiguous(), "the MTP layer's input ", h_main.describe(),
                   " on rank 0's device must be contiguous (the other ranks copy it)");
  if (token_src.defined() || from0) mark_rank0_inputs();  // the chain's ids and hidden states
  std::vector<model::TokenBatch> db(static_cast<size_t>(n));
  std::vector<Tensor> hm(static_cast<size_t>(n));
  std::vector<MtpOutputs> o(static_cast<size_t>(n));
  {  // rank 0's plan and inputs first: their device buffers are part of the key (the host's
     // rows go to a fixed buffer: d_hmain_ is allocated at its largest)
    cuda::OrderedStreamScope scope(group_->stream(0), d0.index);
    db[0] = upload(b, 0);
    hm[0] = mtp_input(0, h_main, from0);
  }
  for (int r = 0; r < n; ++r) o[size_t(r)] = mtp_outputs(r, logits, hidden);
  group_->run(
      mtp_key(db[0], hm[0], o[0].logits, o[0].hidden, token_src),
      [this](const std::function<void(int)>& job) { on_all_ranks(job); },
      [&](int r) {  // the other ranks' plans and inputs (fixed buffers), before their graphs
        if (r == 0) return;
        db[size_t(r)] = upload(b, r);
        hm[size_t(r)] = mtp_input(r, h_main, from0);
        const Tensor src = from_rank0(r, token_src, d_src_);
        if (src.defined()) ops::resolve_tokens(db[size_t(r)].tokens, src);
      },
      [&](int r) {
        if (r == 0 && token_src.defined()) ops::resolve_tokens(db[0].tokens, token_src);  // in rank 0's graph
        models_[size_t(r)]->mtp_forward(db[size_t(r)], hm[size_t(r)], mtp_views_[size_t(r)], o[size_t(r)].logits,
                                        o[size_t(r)].hidden);
      },
      comms_[0].get());
  mtp_copy_back(o[0], logits, hidden);
#else
  (void)b, (void)h_main, (void)logits, (void)hidden, (void)token_src;
  fail(ErrorKind::Unsupported, "CUDA graphs in a build without CUDA");
#endif
}

}  // namespace dflash2::runtime
