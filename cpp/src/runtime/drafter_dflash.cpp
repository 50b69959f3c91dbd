// The DFlash 1 / DFlash 2 block drafters behind the Drafter interface: the draft context
// cache (one KvCache), the planner for context appends and draft blocks, and the fixed
// output buffers.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>

#include "dflash2/error.h"
#include "dflash2/safetensors.h"
#include "model/dflash_drafter.h"
#include "runtime/drafter.h"
#include "runtime/pending_rows.h"
#include "runtime/target.h"
#ifdef DFLASH2_WITH_CUDA
#include "backend/cuda/cuda_api.h"
#endif

namespace dflash2::runtime {

const char* method_name(Method m) {
  switch (m) {
    case Method::AR: return "ar";
    case Method::MTP: return "mtp";
    case Method::DFlash: return "dflash";
    case Method::DFlash2: return "dflash2";
  }
  return "?";
}

Method parse_method(const std::string& s) {
  if (s == "ar") return Method::AR;
  if (s == "mtp") return Method::MTP;
  if (s == "dflash") return Method::DFlash;
  if (s == "dflash2") return Method::DFlash2;
  fail(ErrorKind::InvalidArgument, "unknown method '", s, "' (expected 'ar', 'mtp', 'dflash' or 'dflash2')");
}

namespace {

class DFlashRunner final : public Drafter {
 public:
  // ms: the drafter whole (one model: on rank 0 under tensor parallelism), or split across the
  // target's ranks (one model per rank, DFlashDrafter::load's tp_rank / tp_size).
  DFlashRunner(std::vector<std::unique_ptr<model::DFlashDrafter>> ms, Target& t) : m_(std::move(ms[0])), t_(t) {
    for (size_t r = 1; r < ms.size(); ++r) others_.push_back(std::move(ms[r]));
    split_ = !others_.empty();
    DFLASH2_INTERNAL(!split_ || int(ms.size()) == t.tp_size(), "a drafter split ", ms.size(), " ways over ",
                     t.tp_size(), " ranks");
    const auto& o = t.options();
    const auto& c = m_->config();
    const int64_t B = c.block_size, maxB = o.max_batch_size + 1, H = c.hidden_size;  // + propose's slot
    const int64_t nt = int64_t(c.target_layer_ids.size());
    const int64_t bs = o.kv_block_size, per_seq = (o.max_seq_len + bs - 1) / bs;
    // Tensor parallelism: the LM head over the block runs on the target's vocabulary shards,
    // every rank its own (Target::vocab_head: each rank's top k -- or argmax pair -- gathered
    // and merged on rank 0), not as a full head on one rank: a quarter of the head's weight
    // reads per rank at TP 4, and no copy of the head. (Where the shards cannot take it --
    // fewer ids per shard than the selector's candidates -- the full head stays.)
    const int64_t hk = m_->head_topk();
    split_head_ = t.tp_size() > 1 && t.vocab_head_ok(hk);
    DFLASH2_INTERNAL(!split_ || split_head_, "a split drafter whose head the vocabulary shards cannot take");
    for (int r = 0; r < ranks(); ++r) {
      if (split_head_) rank_model(r).drop_head();
      if (split_) rank_model(r).set_comm(t.comm(r));
    }
    // A CUDA target: the drafter runs on its (rank 0's) GPU too (weights, draft cache,
    // features, workspace). Without tensor parallelism it shares the target's embedding and
    // LM head; with it (the target holds vocabulary shards) it keeps a full copy of the
    // embedding there (and of the LM head where it is not split), and the other ranks copy
    // its drafts peer to peer (Target::from_rank0). On the device nothing of a draft waits on
    // the host: the block's ids go up with its plan, the sampling rows and the appends'
    // gather indices through pinned staging, and the outputs stay on the device (the verify
    // pass reads them there; fetch_host copies them).
    // Split across the ranks (split_), each rank's part runs on its GPU beside its target
    // shard, reading that shard's embedding (no copy), its draft cache holding its key /
    // value heads; rank 0 keeps the context features, the selector and the outputs.
    if (o.device.is_cuda()) {
      dev_ = t.model().device();
      const bool share = t.tp_size() == 1;
      const int64_t cache_rows = (per_seq * maxB + (B + bs - 1) / bs) * bs;
      for (int r = 0; r < ranks(); ++r)  // every rank checked before anything is allocated
        check_memory(rank_model(r), device_of(r), cache_rows, maxB, nt * H, plan_tokens_of(o, maxB, B),
                     !share && !split_, r == 0);
      if (split_) {
        for (int r = 0; r < ranks(); ++r)
          rank_model(r).to_device(device_of(r), t.rank_model(r).forward_embed(), ops::Weight());
      } else if (share) {
        m_->to_device(dev_, t.model().forward_embed(), t.model().forward_lm_head());
      } else {
        m_->to_device(dev_, Tensor(), ops::Weight());
      }
    }
    if (split_head_) t.reserve_vocab_head(maxB * (B - 1), hk, m_->gemm(), /*rows_copies=*/!split_);
    per_seq_ = per_seq;
    make_cache(cache_dtype());
    in_step_.assign(size_t(maxB), 0);
    step_base_.assign(size_t(maxB), 0);
    streams_.resize(size_t(maxB));
    pending_ = PendingRows(maxB, kPending, nt * H, /*with_next=*/false, dev_);
    append_ = [this](const std::vector<CommitRows>& rows, const Tensor& src) { append(rows, src); };
    const int64_t plan_tokens = plan_tokens_of(o, maxB, B);
    planner_ = StepPlanner(plan_tokens, maxB, per_seq);
    // the verified rows appended in a recorded step: a plan of their own (the draft's plan
    // of the same step is still to run)
    step_planner_ = StepPlanner(o.max_step_tokens, std::max(maxB, o.max_step_tokens), per_seq);
    if (dev_.is_cuda()) {
      const int64_t step_words = PlanUploader::planned_words(o.max_step_tokens, std::max(maxB, o.max_step_tokens), per_seq);
      const int64_t draft_words = PlanUploader::planned_words(plan_tokens, maxB, per_seq);
      step_up_ = std::make_unique<PlanUploader>(dev_, step_words);
      up_ = std::make_unique<PlanUploader>(dev_, draft_words);
      for (int r = 1; r < ranks(); ++r) {  // the other ranks' copies of the plans (split)
        rank_step_up_.push_back(std::make_unique<PlanUploader>(device_of(r), step_words));
        rank_up_.push_back(std::make_unique<PlanUploader>(device_of(r), draft_words));
      }
      idx_up_ = StagedUpload(dev_, o.max_step_tokens);
      rows_up_ = StagedUpload(dev_, 5 * maxB);  // rng I64 [maxB, 2], then temperature F32 [maxB]
    }
    // the draft forward as CUDA graphs, on the target's graph stream (see draft())
    if (dev_.is_cuda() && t.cuda_graphs()) graphs_ = std::make_unique<ForwardGraphs>(dev_, t.graph_stream());
    taps_ = Tensor::zeros(DType::F32, {o.max_step_tokens, nt * H}, dev_);
    idx_ = Tensor::zeros(DType::I32, {o.max_step_tokens}, dev_);
    ids_ = Tensor::zeros(DType::I32, {maxB * B}, dev_);
    if (rows_up_.defined()) {
      rng_ = rows_up_.view(0, DType::I64, {maxB, 2});
      temp_ = rows_up_.view(4 * maxB, DType::F32, {maxB});
    } else {
      rng_ = Tensor::zeros(DType::I64, {maxB, 2}, dev_);
      temp_ = Tensor::zeros(DType::F32, {maxB}, dev_);
    }
    res_.tokens = Tensor::zeros(DType::I32, {maxB, B - 1});
    if (m_->use_selector()) {
      res_.cand = Tensor::zeros(DType::I32, {maxB, B - 1, c.selector_top_k});
      res_.q = Tensor::zeros(DType::F32, {maxB, B - 1, c.selector_top_k});
    }
    if (dev_.is_cuda()) {
      d_tokens_ = Tensor::zeros(DType::I32, {maxB, B - 1}, dev_);
      if (m_->use_selector()) {
        d_cand_ = Tensor::zeros(DType::I32, {maxB, B - 1, c.selector_top_k}, dev_);
        d_q_ = Tensor::zeros(DType::F32, {maxB, B - 1, c.selector_top_k}, dev_);
      }
      // the outputs live on the device from the start (also after a draft of no rows: the
      // decode loop's token references and acceptance always read them there)
      res_.dev_tokens = d_tokens_;
      res_.dev_cand = d_cand_;
    }
  }
  int64_t draft_len() const override { return m_->block_size() - 1; }
  Device device() const override { return dev_; }
  int tp_ranks() const override { return ranks(); }
  GraphStats graph_stats() const override { return graphs_ ? graphs_->stats() : GraphStats{}; }
  model::DFlashDrafter* dflash_model() override { return m_.get(); }
  int64_t cache_bytes() const override {  // (split: every rank's share)
    int64_t n = 0;
    for (const auto& layers : kv_ranks_)
      for (const Tensor& t : layers) n += int64_t(t.nbytes());
    return n;
  }
  bool reserve(int slot, int64_t tokens) override { return cache_.try_pin(streams_[size_t(slot)], tokens); }
  std::vector<int64_t> tap_layers() const override { return m_->config().target_layer_ids; }
  bool records_steps() const override { return true; }

  // Committed rows wait per slot (PendingRows) and are appended to the draft context only
  // when the slot drafts next: while the speculation policy drafts nothing, this costs nothing.
  // Rows a recorded step appended already (append_in_step) only set the slot's length.
  void commit(const std::vector<CommitRows>& rows, const Features& f) override {
    staged_.clear();
    for (const CommitRows& r : rows) {
      CacheStream& s = streams_[size_t(r.slot)];
      if (in_step_[size_t(r.slot)]) {
        DFLASH2_INTERNAL(pending_.count(r.slot) == 0 && s.length >= r.pos0 + r.n, "draft context of slot ", r.slot,
                         " holds ", s.length, " positions appended in the step, commit ends at ", r.pos0 + r.n);
        cache_.truncate(s, r.pos0 + r.n);  // the rows past it are overwritten by the next step's append
        in_step_[size_t(r.slot)] = 0;
        continue;
      }
      DFLASH2_INTERNAL(s.length + pending_.count(r.slot) == r.pos0, "draft context of slot ", r.slot, " has ",
                       s.length, " + ", pending_.count(r.slot), " pending tokens, commit starts at ", r.pos0);
      staged_.push_back(r);
    }
    if (!staged_.empty()) pending_.stage(staged_, f.taps, append_);
  }

  // The verify pass's rows appended to the draft context inside the recorded step, after the
  // verify chunk that writes their features (taps rows 0.., padding rows included so the
  // step's shapes stay the bucket's; they go to the padding stream). draft() flushed every
  // slot of the step's pending rows, so each slot's context ends where its rows begin.
  bool append_in_step(const std::vector<StepRows>& rows, const Features& f) override {
    StepRecorder& rec = t_.recorder();
    if (!rec.recording() || !f.taps.defined() || rows.empty()) return false;
    int64_t T = 0;
    for (const StepRows& r : rows) {
      T += r.n;
      if (r.slot < 0) continue;
      const CacheStream& s = streams_[size_t(r.slot)];
      if (pending_.count(r.slot) != 0 || s.length != r.pos0 || in_step_[size_t(r.slot)]) return false;
    }
    if (T > step_planner_.max_tokens() || int64_t(rows.size()) > step_planner_.max_seqs()) return false;
    std::vector<Piece>& pieces = step_pieces_;
    pieces.clear();
    for (size_t i = 0; i < rows.size(); ++i) {
      Piece p;
      p.stream = rows[i].slot >= 0 ? &streams_[size_t(rows[i].slot)] : &pad_stream_;
      p.n = rows[i].n;
      p.seq = int64_t(i);
      p.last = true;
      pieces.push_back(p);
    }
    model::TokenBatch b = step_planner_.plan(pieces, cache_);
    for (const Piece& p : pieces) p.stream->length += p.n;
    cache_.truncate(pad_stream_, 0);  // its blocks stay pinned; what was planned holds
    for (const StepRows& r : rows)
      if (r.slot >= 0) {
        in_step_[size_t(r.slot)] = 1;
        step_base_[size_t(r.slot)] = r.pos0;
      }
    const Tensor taps = f.taps.slice(0, 0, T);
    std::string key;
    const model::TokenBatch hb = b;  // the host plan (a split drafter's other ranks take copies)
    if (dev_.is_cuda()) {
#ifdef DFLASH2_WITH_CUDA
      cuda::OrderedStreamScope stream_scope(graphs_ ? graphs_->stream() : nullptr, dev_.index);
#endif
      b = step_up_->upload(b);  // its own buffer: nothing else writes it before the flush
      key = "append|";
      for (int64_t v : {b.T, b.S, b.paged.block_size}) ForwardGraphs::key_add(key, v);
      for (const Tensor* x : std::initializer_list<const Tensor*>{&b.tokens, &b.paged.seq, &b.paged.pos, &b.paged.block_table, &b.slots, &taps})
        ForwardGraphs::key_add(key, *x);
    }
    if (split_) {  // every rank's key / value heads (rank 0's features broadcast inside)
      std::vector<model::TokenBatch> bs(size_t(ranks()), b);
      for (int r = 1; r < ranks() && dev_.is_cuda(); ++r)
        bs[size_t(r)] = rank_plan(*rank_step_up_[size_t(r - 1)], r, hb, graphs_ != nullptr);
      rec.add_ranks(key, [this, bs, taps](int r) {
        rank_model(r).append_context(bs[size_t(r)], taps, kv_ranks_[size_t(r)]);
      });
    } else {
      rec.add(key, [this, b, taps]() mutable { m_->append_context(b, taps, kv_layers_); });
    }
    ++appends_in_step_;
    return true;
  }
  int64_t appends_in_step() const override { return appends_in_step_.load(); }

  // Appends rows of `src` (CommitRows::row0..) to the slots' draft context.
  void append(const std::vector<CommitRows>& rows, const Tensor& src) {
    std::vector<CacheStream*>& streams = host_streams_;
    std::vector<const int32_t*>& none = host_toks_;
    std::vector<int64_t>& counts = host_counts_;
    streams.clear();
    none.clear();
    counts.clear();
    first_row_.clear();
    for (const CommitRows& r : rows) {
      streams.push_back(&streams_[size_t(r.slot)]);
      none.push_back(nullptr);
      counts.push_back(r.n);
      first_row_.push_back(r.row0);
    }
    make_chunks(streams, none, counts, t_.options().max_step_tokens, chunks_);
    for (const auto& ch : chunks_) {
      Tensor taps;
      gather_rows_of_pieces(ch, first_row_, src, idx_, host_idx_, taps_, taps, &idx_up_);
      model::TokenBatch b = planner_.plan(ch, cache_);
      if (split_) {  // on every rank at once (eagerly, on their current streams)
        std::vector<model::TokenBatch> bs(size_t(ranks()), b);
        if (up_) bs[0] = up_->upload(b);
        for (int r = 1; r < ranks() && dev_.is_cuda(); ++r) bs[size_t(r)] = rank_plan(*rank_up_[size_t(r - 1)], r, b, false);
        t_.on_all_ranks([&](int r) { rank_model(r).append_context(bs[size_t(r)], taps, kv_ranks_[size_t(r)]); });
      } else {
        if (up_) b = up_->upload(b);
        m_->append_context(b, taps, kv_layers_);
      }
      for (const Piece& p : ch) p.stream->length += p.n;
    }
  }

  const DraftResult& draft(const std::vector<DraftJob>& jobs) override {
    const int64_t S = int64_t(jobs.size()), B = m_->block_size(), K = B - 1;
    // the slots that draft now need their whole context; in a recorded step every slot's
    // context is brought up to date (append_in_step appends its verified rows next)
    bool any = false;
    for (const DraftJob& j : jobs) any = any || (j.room >= K && j.max_tokens >= 1);
    const bool all = any && t_.recorder().recording();
    flush_.clear();
    for (const DraftJob& j : jobs)
      if (all || (j.room >= K && j.max_tokens >= 1)) flush_.push_back(j.slot);
    pending_.flush(flush_, append_);
    res_.len.assign(size_t(S), 0);
    res_.row.assign(size_t(S), 0);
    std::vector<CacheStream*>& streams = host_streams_;
    streams.clear();
    host_ids_.clear();
    host_temp_.clear();
    host_rng_.clear();
    bool sample = false;
    for (int64_t i = 0; i < S; ++i) {
      const DraftJob& j = jobs[size_t(i)];
      // no room for a whole block before max_seq_len, or the policy drafts nothing
      if (j.room < K || j.max_tokens < 1) continue;
      const int64_t a = int64_t(streams.size());
      res_.len[size_t(i)] = std::min(K, j.max_tokens);
      res_.row[size_t(i)] = a;
      streams.push_back(&streams_[size_t(j.slot)]);
      host_ids_.push_back(j.anchor);
      for (int64_t t = 1; t < B; ++t) host_ids_.push_back(int32_t(m_->config().mask_token_id));
      // the selector's draws: K per sampled block, taken from the request's stream
      const bool s_j = j.temperature > 0.0f && m_->use_selector();
      host_temp_.push_back(s_j ? j.temperature : 0.0f);
      host_rng_.push_back(int64_t(j.rng_key));
      host_rng_.push_back(int64_t(s_j ? *j.rng_counter : 0));
      if (s_j) *j.rng_counter += uint64_t(K);
      sample = sample || s_j;
    }
    res_.has_q = sample;
    res_.dev_q = Tensor();
    last_rows_ = 0;
    const int64_t A = int64_t(streams.size());
    if (A == 0) return res_;
#ifdef DFLASH2_WITH_CUDA
    // with graphs: the block's upload and forward on the target's graph stream
    cuda::OrderedStreamScope stream_scope(graphs_ ? graphs_->stream() : nullptr, dev_.index);
#endif
    model::TokenBatch b = planner_.plan_blocks(streams, B, cache_);
    model::TokenBatch hb;  // the host plan (a split drafter's other ranks upload it too)
    if (up_) {  // the block's ids travel in the plan's one asynchronous copy
      b.tokens = Tensor::view(host_ids_.data(), DType::I32, {A * B});
      hb = b;
      b = up_->upload(b);
    } else {
      Tensor ids = ids_.slice(0, 0, A * B);
      ids.copy_from(Tensor::view(host_ids_.data(), DType::I32, {A * B}));
      b.tokens = ids;
      hb = b;
    }
    Tensor temp = temp_.slice(0, 0, A), rng = rng_.slice(0, 0, A);
    if (rows_up_.defined()) {  // one asynchronous copy of both
      const int64_t maxB = rng_.shape(0);
      int32_t* h = rows_up_.begin();
      std::memcpy(h, host_rng_.data(), size_t(A) * 16);
      std::memcpy(h + 4 * maxB, host_temp_.data(), size_t(A) * 4);
      rows_up_.send(5 * maxB);
    } else {
      temp.copy_from(Tensor::view(host_temp_.data(), DType::F32, {A}));
      rng.copy_from(Tensor::view(host_rng_.data(), DType::I64, {A, 2}));
    }
    model::DraftOutputs out;
    plan_penalties(jobs, out.pen);
    StepRecorder& rec = t_.recorder();
    if (!dev_.is_cuda()) {
      out.tokens = res_.tokens.slice(0, 0, A);
      if (res_.cand.defined()) out.cand = res_.cand.slice(0, 0, A);
      if (sample) out.q = res_.q.slice(0, 0, A);
      if (split_) {  // every rank's part (queued with the step when it is recorded)
        draft_ranks(hb, b, temp, rng, out, "");
      } else if (split_head_) {  // queued with the step when it is recorded
        draft_split(b, temp, rng, out, "");
      } else if (rec.recording()) {  // queued with the step (the planner's buffers hold until the flush)
        rec.add("", [this, b, temp, rng, out]() mutable { m_->draft(b, kv_layers_, temp, rng, out); });
      } else {
        m_->draft(b, kv_layers_, temp, rng, out);
      }
      return res_;
    }
    // on the device: q is always passed (the device op cannot read the temperatures; rows
    // drafted greedily leave theirs untouched), then the results come back
    out.tokens = d_tokens_.slice(0, 0, A);
    if (d_cand_.defined()) {
      out.cand = d_cand_.slice(0, 0, A);
      out.q = d_q_.slice(0, 0, A);
    }
    if (graphs_ || rec.recording()) {  // the launch shape: every size and buffer the draft's kernels take
      std::string key = "draft|";
      for (int64_t v : {A, b.T, b.S, b.paged.block_size}) ForwardGraphs::key_add(key, v);
      for (const Tensor* x : {&b.tokens, &b.paged.seq, &b.paged.pos, &b.paged.block_table, &b.slots, &b.logit_rows,
                              &b.ctx_len, &temp, &rng, &out.tokens, &out.cand, &out.q, &out.pen.seq,
                              &out.pen.params, &out.pen.state, &out.pen.bias})
        ForwardGraphs::key_add(key, *x);
      if (split_) {  // every rank's part (queued with the step when it is recorded)
        draft_ranks(hb, b, temp, rng, out, key);
      } else if (split_head_) {  // queued with the step when it is recorded
        draft_split(b, temp, rng, out, key);
      } else if (rec.recording()) {  // queued with the step: one graph with the verify pass and acceptance
        rec.add(key, [this, b, temp, rng, out]() mutable { m_->draft(b, kv_layers_, temp, rng, out); });
      } else {
        graphs_->run(key, [&] { m_->draft(b, kv_layers_, temp, rng, out); });
      }
    } else if (split_) {
      draft_ranks(hb, b, temp, rng, out, "");
    } else if (split_head_) {
      draft_split(b, temp, rng, out, "");
    } else {
      m_->draft(b, kv_layers_, temp, rng, out);
    }
    // the outputs stay on the device (no wait here): fetch_host() brings them back on demand
    last_rows_ = A;
    res_.dev_q = d_cand_.defined() && sample ? d_q_ : Tensor();
    return res_;
  }

  // The head rows' penalty plan (DraftOutputs::Penalties) when a drafting job asks for
  // repetition control and the head's logits are whole here, next to the tables (not under
  // tensor parallelism): one plan row per head row -- its request's table row, min_left less
  // its position in the block, its parameters. Left undefined otherwise (no op).
  void plan_penalties(const std::vector<DraftJob>& jobs, model::DraftOutputs::Penalties& pen) {
    if (!pen_state.defined() || split_ || split_head_ || pen_state.device() != dev_) return;
    const int64_t B = m_->block_size();
    bool any = false;
    for (size_t i = 0; i < jobs.size(); ++i) any = any || (res_.len[i] > 0 && jobs[i].pen_row >= 0);
    if (!any) return;
    const int64_t maxR = rng_.shape(0) * (B - 1);
    if (!pen_seq_.defined()) {  // first use: the plan's buffers, for the largest draft
      Tensor r0 = Tensor::zeros(DType::I32, {maxR});
      for (int64_t r = 0; r < maxR; ++r) r0.data_as<int32_t>()[r] = int32_t(r);
      pen_row0_ = r0.to(dev_);
      pen_zeros_ = Tensor::zeros(DType::I32, {maxR}, dev_);
      pen_draft_ = Tensor::zeros(DType::I32, {1, 1}, dev_);
      if (dev_.is_cuda()) {  // packed into pinned staging, one asynchronous copy per draft
        pen_up_ = StagedUpload(dev_, 5 * maxR);
        pen_seq_ = pen_up_.view(0, DType::I32, {maxR, 2});
        pen_par_ = pen_up_.view(2 * maxR, DType::F32, {maxR, 3});
      } else {
        pen_seq_ = Tensor::zeros(DType::I32, {maxR, 2});
        pen_par_ = Tensor::zeros(DType::F32, {maxR, 3});
      }
    }
    int32_t* const h = dev_.is_cuda() ? pen_up_.begin() : nullptr;
    int32_t* sq = h ? h : pen_seq_.data_as<int32_t>();
    float* pp = h ? reinterpret_cast<float*>(h + 2 * maxR) : pen_par_.data_as<float>();
    for (size_t i = 0; i < jobs.size(); ++i) {
      if (res_.len[i] == 0) continue;
      const DraftJob& j = jobs[i];
      for (int64_t k = 0; k < B - 1; ++k) {
        const int64_t r = res_.row[i] * (B - 1) + k;
        sq[2 * r] = j.pen_row;
        sq[2 * r + 1] = int32_t(std::max<int64_t>(0, int64_t(j.pen_min_left) - k));
        std::copy(j.pen, j.pen + 3, pp + 3 * r);
      }
    }
    if (h) pen_up_.send(5 * maxR);  // on the draft's stream, before its kernels
    pen = {pen_row0_, pen_draft_, pen_zeros_, pen_zeros_, pen_seq_, pen_par_, pen_state, pen_bias};
  }

  void fetch_host() override {
    if (!dev_.is_cuda() || last_rows_ == 0) return;
    const int64_t A = last_rows_;
    Tensor ht = res_.tokens.slice(0, 0, A);
    ht.copy_from(d_tokens_.slice(0, 0, A));
    if (res_.dev_cand.defined()) {
      Tensor hc = res_.cand.slice(0, 0, A);
      hc.copy_from(d_cand_.slice(0, 0, A));
    }
    if (res_.dev_q.defined()) {
      Tensor hq = res_.q.slice(0, 0, A);
      hq.copy_from(d_q_.slice(0, 0, A));
    }
  }

  void release(int slot) override {
    pending_.clear(slot);
    in_step_[size_t(slot)] = 0;
    cache_.release(streams_[size_t(slot)]);
  }
  KvCache* context_cache() override { return &cache_; }
  const CacheStream* context_stream(int slot) const override { return &streams_[size_t(slot)]; }
  // appended rows (pending ones are not in the cache yet; a step's appended rows only after
  // their commit: before it, the rows up to where the step's began)
  int64_t context_filled(int slot) const override {
    return in_step_[size_t(slot)] ? step_base_[size_t(slot)] : streams_[size_t(slot)].length;
  }
  void attach(int slot, const std::vector<int32_t>& blocks, int64_t length) override {
    CacheStream& s = streams_[size_t(slot)];
    DFLASH2_INTERNAL(pending_.count(slot) == 0 && !in_step_[size_t(slot)], "attaching to draft slot ", slot,
                     " that is in use");
    cache_.share(s, blocks);
    s.length = length;
  }

 private:
  // A draft with the LM head over the block on the target's vocabulary shards (split_head_):
  // the block's rows on rank 0, the head on every rank -- the top k of the selector's
  // candidates merged into the drafter's values and out.cand, or the argmax per position into
  // out.tokens -- then the selector's walk on rank 0. With a graph key (CUDA graphs) the two
  // parts on rank 0 run as two graphs and the head between them as a group graph of every rank
  // (Target::vocab_head). In a recorded step all three are queued: rank 0's pieces, and the
  // head as an every-rank piece (its rows broadcast inside it).
  void draft_split(const model::TokenBatch& b, const Tensor& temp, const Tensor& rng, const model::DraftOutputs& out,
                   const std::string& key) {
    StepRecorder& rec = t_.recorder();
    auto part = [&](const char* name, std::function<void()> fn) {
      if (rec.recording())
        rec.add(key.empty() ? std::string() : key + name, std::move(fn));
      else if (key.empty())
        fn();
      else
        graphs_->run(key + name, fn);
    };
    part("rows|", [this, b] { m_->draft_rows(b, kv_layers_); });
    const int64_t A = b.S, K = m_->head_topk(), R = A * (m_->block_size() - 1);
    Tensor rows = m_->head_rows(A);
    if (K > 0) {
      Tensor vals = m_->head_values(A), ids = out.cand.reshape({R, K});
      t_.vocab_head(rows, m_->gemm(), K, vals, ids);
      part("select|", [this, b, temp, rng, o = out]() mutable { m_->draft_select(b, temp, rng, o); });
    } else {
      Tensor none, ids = out.tokens.reshape({R});
      t_.vocab_head(rows, m_->gemm(), 0, none, ids);
    }
  }
  // A draft with the drafter split across the ranks (split_): every rank runs the block
  // through its share of the layers (the all-reduces inside) and its vocabulary shard of the
  // head over its own copy of the rows (the top k -- or argmax pair -- gathered and merged
  // on rank 0); then rank 0's selector walks. Recorded: an every-rank piece and a rank-0
  // piece of the step; with CUDA graphs otherwise: a group graph and a graph on rank 0;
  // else eagerly. hb: the host plan, b: rank 0's (uploaded).
  void draft_ranks(const model::TokenBatch& hb, const model::TokenBatch& b, const Tensor& temp, const Tensor& rng,
                   const model::DraftOutputs& out, const std::string& key) {
    StepRecorder& rec = t_.recorder();
    std::vector<model::TokenBatch> bs(size_t(ranks()), b);
    for (int r = 1; r < ranks() && dev_.is_cuda(); ++r)
      bs[size_t(r)] = rank_plan(*rank_up_[size_t(r - 1)], r, hb, graphs_ != nullptr);
    const int64_t A = b.S, K = m_->head_topk(), R = A * (m_->block_size() - 1);
    const Tensor vals = K > 0 ? m_->head_values(A) : Tensor();
    const Tensor ids = K > 0 ? out.cand.reshape({R, K}) : out.tokens.reshape({R});
    const ops::GemmNumerics g = m_->gemm();
    const std::function<void(int)> part = [this, bs, A, K, vals, ids, g](int r) {
      model::DFlashDrafter& m = rank_model(r);
      m.draft_rows(bs[size_t(r)], kv_ranks_[size_t(r)]);
      t_.vocab_head_part(r, m.head_rows(A), g, K, vals, ids);
    };
    const std::function<void()> select = [this, b, temp, rng, o = out]() mutable {
      m_->draft_select(b, temp, rng, o);
    };
    if (rec.recording()) {
      rec.add_ranks(key.empty() ? std::string() : key + "split|", part);
      if (K > 0) rec.add(key.empty() ? std::string() : key + "select|", select);
    } else if (graphs_) {
      t_.group_graphs()->run(
          key + "split|", [this](const std::function<void(int)>& job) { t_.on_all_ranks(job); }, [](int) {}, part,
          t_.comm(0));
      if (K > 0) graphs_->run(key + "select|", select);
    } else {
      t_.on_all_ranks(part);
      if (K > 0) select();
    }
    t_.count_vocab_head();
  }
  int ranks() const { return 1 + int(others_.size()); }
  model::DFlashDrafter& rank_model(int r) { return r == 0 ? *m_ : *others_[size_t(r - 1)]; }
  Device device_of(int r) { return t_.rank_model(r).device(); }
  // Rank r's copy of a host plan (CUDA, split): uploaded on the stream its work runs on --
  // its group graphs' (on_group: recorded steps and graphs), else its current one.
  model::TokenBatch rank_plan(PlanUploader& up, int r, const model::TokenBatch& hb, bool on_group) {
#ifdef DFLASH2_WITH_CUDA
    GroupGraphs* g = on_group ? t_.group_graphs() : nullptr;
    cuda::OrderedStreamScope scope(g ? g->stream(r) : nullptr, device_of(r).index);
#else
    (void)r, (void)on_group;
#endif
    return up.upload(hb);
  }
  static int64_t plan_tokens_of(const Target::Options& o, int64_t maxB, int64_t B) {
    return std::max(o.max_step_tokens, maxB * B);
  }
  // Before the drafter allocates on the GPU (the target's weights and caches are there by
  // now): its weights + workspace, draft KV cache, pending features and step buffers against
  // the free memory, an OutOfMemoryError with the breakdown otherwise.
  // own_vocab: the full embedding and LM head are copied too (tensor parallelism).
  // m / dev: a rank's share of a split drafter, with_bufs: the features and step buffers
  // (rank 0's).
  void check_memory(const model::DFlashDrafter& m, Device dev, int64_t cache_rows, int64_t maxB, int64_t feat,
                    int64_t plan_tokens, bool own_vocab, bool with_bufs) const {
#ifdef DFLASH2_WITH_CUDA
    const auto& c = m.config();
    const size_t weights = m.device_bytes() + (own_vocab ? m.vocab_bytes() : 0);
    const size_t cache = size_t(cache_rows) * size_t(c.num_layers) * size_t(2 * m.kv_dim()) * dtype_size(cache_dtype());
    const size_t bufs = (with_bufs ? size_t(maxB) * size_t(kPending) * size_t(feat) * 4 +
                                         size_t(t_.options().max_step_tokens) * size_t(feat) * 4
                                   : 0) +
                        size_t(plan_tokens) * 64 + (size_t(16) << 20);
    const size_t need = weights + cache + bufs;
    size_t free_b = 0, total_b = 0;
    cuda::mem_info(dev.index, &free_b, &total_b);
    auto gib = [](size_t b) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.2f GiB", double(b) / double(size_t(1) << 30));
      return std::string(buf);
    };
    DFLASH2_CHECK(need <= free_b, ErrorKind::OutOfMemory, "the drafter",
                  m.tp_size() > 1 ? " (rank " + std::to_string(m.tp_rank()) + "'s share)" : std::string(), " does not fit ", dev.str(),
                  " beside the target: ",
                  "it needs ", gib(need), " (weights + workspace ", gib(weights),
                  own_vocab ? (split_head_ ? " including its own copy of the full embedding, "
                                           : " including its own copy of the full embedding and LM head, ")
                            : "",
                  own_vocab ? gib(m.vocab_bytes()) : "", ", draft KV cache ", gib(cache),
                  ", features and step buffers ", gib(bufs), ") but ", gib(free_b), " of ", gib(total_b),
                  " are free; lower max_batch_size or max_seq_len");
#else
    (void)m, (void)dev, (void)cache_rows, (void)maxB, (void)feat, (void)plan_tokens, (void)own_vocab, (void)with_bufs;
#endif
  }

  std::unique_ptr<model::DFlashDrafter> m_;  // rank 0's (the whole drafter unless split_)
  // split_: the drafter split across the target's ranks (tensor parallelism): rank r's share
  // others_[r - 1], its draft cache kv_ranks_[r], its plans' device copies rank_*up_[r - 1]
  bool split_ = false;
  std::vector<std::unique_ptr<model::DFlashDrafter>> others_;
  std::vector<std::vector<Tensor>> kv_ranks_;
  std::vector<std::unique_ptr<PlanUploader>> rank_up_, rank_step_up_;
  bool split_head_ = false;  // tensor parallelism: the head on the target's vocabulary shards
  std::unique_ptr<ForwardGraphs> graphs_;  // CUDA graphs of draft()
  Target& t_;
  KvCache cache_;
  std::vector<Tensor> kv_layers_;
  int64_t per_seq_ = 0;  // cache blocks per sequence
  // The draft context cache's dtype: F32, or BF16 with the model's tensor-core numerics (set
  // before the runner is made: half the bytes the block attention reads and the cache holds;
  // the tensor-core attention rounds K / V to BF16 anyway).
  DType cache_dtype() const { return m_->gemm() == ops::GemmNumerics::Exact ? DType::F32 : DType::BF16; }
  // The draft context cache, allocated once in the constructor. + the padding sequences'
  // pages (append_in_step): one block's worth of tokens, shared.
  void make_cache(DType dt) {
    const auto& c = m_->config();
    const int64_t B = c.block_size, bs = t_.options().kv_block_size, maxB = t_.options().max_batch_size + 1;
    KvCache::Plane plane{c.num_layers, 2 * m_->kv_dim(), dt};
    // split: one replica per rank (its key / value heads), one set of block tables
    cache_ = KvCache("draft KV cache", {plane}, bs, per_seq_ * maxB + (B + bs - 1) / bs, dev_, ranks());
    cache_.set_max_blocks_per_stream(per_seq_);
    DFLASH2_INTERNAL(cache_.try_pin(pad_stream_, B), "the draft cache's padding stream");
    kv_ranks_.assign(size_t(ranks()), {});
    for (int r = 0; r < ranks(); ++r)
      for (int64_t l = 0; l < c.num_layers; ++l) kv_ranks_[size_t(r)].push_back(cache_.layer(0, l, r));
    kv_layers_ = kv_ranks_[0];
  }
  std::vector<CacheStream> streams_;
  StepPlanner planner_;
  Tensor taps_, idx_, ids_, rng_, temp_;
  Device dev_ = Device::cpu();
  std::unique_ptr<PlanUploader> up_;  // CUDA: the planned batches' device copies
  // append_in_step: its planner and upload, the padding rows' stream, the slots whose
  // verified rows the step appended (their commit only sets the length)
  StepPlanner step_planner_;
  std::unique_ptr<PlanUploader> step_up_;
  CacheStream pad_stream_;
  std::vector<char> in_step_;
  std::vector<int64_t> step_base_;  // per slot in a step: its context length before the step
  std::vector<Piece> step_pieces_;
  std::vector<CommitRows> staged_;
  std::atomic<int64_t> appends_in_step_{0};
  StagedUpload idx_up_;                 // CUDA: the appends' gather indices
  StagedUpload rows_up_;                // CUDA: the draft's sampling rows (rng_, temp_ view it)
  int64_t last_rows_ = 0;               // rows of the last draft() (fetch_host)
  Tensor d_tokens_, d_cand_, d_q_;      // CUDA: draft outputs on the device
  std::vector<std::vector<Piece>> chunks_;
  std::vector<int32_t> host_idx_, host_ids_;
  std::vector<int64_t> first_row_;
  std::vector<float> host_temp_;
  Tensor pen_row0_, pen_zeros_, pen_draft_, pen_seq_, pen_par_;  // plan_penalties
  StagedUpload pen_up_;  // CUDA: pen_seq_ / pen_par_ view it
  std::vector<int64_t> host_rng_;
  std::vector<CacheStream*> host_streams_;
  std::vector<const int32_t*> host_toks_;
  std::vector<int64_t> host_counts_;
  static constexpr int64_t kPending = 64;  // committed rows a slot keeps before appending them
  PendingRows pending_;
  PendingRows::Run append_;
  std::vector<int> flush_;
  DraftResult res_;
};

}  // namespace

std::unique_ptr<Drafter> make_dflash_drafter(const Checkpoint& ck, Target& target, Method method,
                                             const DraftGemmPicker& pick) {
  const auto& o = target.options();
  const int n = target.tp_size();
  std::vector<std::unique_ptr<model::DFlashDrafter>> ms;
  // Tensor parallelism: the drafter split across the ranks where it can be -- its heads and
  // MLP intermediate divide, its head runs on the vocabulary shards, no quantization block
  // is cut (a ConfigError from slicing) --, else whole on rank 0.
  if (n > 1) {
    const model::DraftConfig dc = model::DraftConfig::from_config(ck.config(), target.config());
    const int64_t k = dc.v2 && method == Method::DFlash2 ? dc.selector_top_k : 0;
    if (model::DFlashDrafter::split_ok(dc, n, nullptr) && target.vocab_head_ok(k)) {
      try {
        for (int r = 0; r < n; ++r)
          ms.push_back(model::DFlashDrafter::load(ck, target.config(), target.rank_model(r).forward_embed(),
                                                  ops::Weight(), o.max_step_tokens, o.max_batch_size + 1, r, n));
      } catch (const Error& e) {
        if (e.kind() != ErrorKind::Config) throw;
        ms.clear();
      }
    }
  }
  if (ms.empty())
    ms.push_back(model::DFlashDrafter::load(ck, target.config(), target.model().embed_tokens(),
                                            target.model().lm_head(), o.max_step_tokens, o.max_batch_size + 1));
  model::DFlashDrafter& m = *ms[0];
  // the GEMM numerics first: they decide the draft cache's dtype (the runner allocates it);
  // the drafter runs on the target's (rank 0's) GPU -- split, each rank's share on its GPU,
  // with rank 0's choice -- or on the host with a CPU target
  if (pick) {
    const Device dev = o.device.is_cuda() ? target.model().device() : Device::cpu();
    const ops::GemmNumerics g = pick(m, dev);
    for (auto& x : ms) x->set_gemm(g);
  }
  // dflash2 needs a DFlash 2 checkpoint; dflash runs DFlash 1 checkpoints, and DFlash 2
  // ones with their convs but the selector off (argmax per position: an ablation).
  DFLASH2_CHECK(m.config().v2 || method == Method::DFlash, ErrorKind::Config, "method 'dflash2' but the drafter ",
                ck.path(), " is a DFlashDraftModel (no convs, no candidate selector): use method='dflash'");
  for (auto& x : ms) x->set_use_selector(method == Method::DFlash2);
  return std::make_unique<DFlashRunner>(std::move(ms), target);
}

}  // namespace dflash2::runtime
