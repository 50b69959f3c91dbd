// Drafting with the target's MTP layer, chained: the layer predicts position t+2 from the
// main model's final hidden state at t and the token at t+1; its own output hidden state
// is fed back to draft further tokens. After each verify step the layer's cache is rolled
// back to the committed length and re-extended over the committed tokens.
//
// With a CUDA target the chain stays on the GPU (rank 0's with tensor parallelism, the other
// ranks copying its ids and hidden states peer to peer, Target::from_rank0): the main model's
// final hidden states are written there (device() is the GPU), the layer's logits and
// hidden states, the per-slot state and the argmax run there, and nothing comes back
// between positions: the next position's plan refers to the drafted ids on the device
// (token references, ops::resolve_tokens), so the chain is queued without a host wait and
// the drafts come back with the step's results.
#include <algorithm>
#include <atomic>
#include <functional>
#include <initializer_list>
#include <string>

#include "dflash2/error.h"
#include "runtime/drafter.h"
#include "runtime/pending_rows.h"
#include "runtime/staging.h"
#include "runtime/target.h"

namespace dflash2::runtime {

namespace {

class MtpDrafter final : public Drafter {
 public:
  MtpDrafter(Target& t, int64_t K) : t_(t), K_(K) {
    const auto& o = t.options();
    const int64_t V = t.config().vocab_size, H = t.config().hidden_size, B = o.max_batch_size + 1;
    const int64_t rows = o.max_step_tokens;
    if (o.device.is_cuda()) dev_ = t.model().device();  // rank 0's GPU (the others copy from it)
    streams_.resize(size_t(B));
    last_logits_ = Tensor::zeros(DType::F32, {B, V}, dev_);
    last_hidden_ = Tensor::zeros(DType::F32, {B, H}, dev_);
    chain_hidden_ = Tensor::zeros(DType::F32, {B, H}, dev_);
    hm_ = Tensor::zeros(DType::F32, {rows, H}, dev_);
    idx_ = Tensor::zeros(DType::I32, {rows}, dev_);
    out_logits_ = Tensor::zeros(DType::F32, {rows, V}, dev_);
    out_hidden_ = Tensor::zeros(DType::F32, {rows, H}, dev_);
    res_.tokens = Tensor::zeros(DType::I32, {B, K});
    if (dev_.is_cuda()) {
      d_tokens_ = Tensor::zeros(DType::I32, {B, K}, dev_);
      idx_up_ = StagedUpload(dev_, rows);
    }
    pending_ = PendingRows(B, kPending, H, /*with_next=*/true, dev_);
    run_ = [this](const std::vector<CommitRows>& rows, const Tensor& src) { run(rows, src); };
    base_len_.assign(size_t(B), 0);
    in_step_row_.assign(size_t(B), -1);
  }
  int64_t draft_len() const override { return K_; }
  Device device() const override { return dev_; }
  bool wants_final_hidden() const override { return true; }
  bool draft_cost_scales_with_k() const override { return true; }
  bool reserve(int slot, int64_t tokens) override { return t_.mtp_cache().try_pin(streams_[size_t(slot)], tokens); }

  // Committed rows (final hidden states + next tokens) wait per slot (PendingRows) and run
  // through the MTP layer only when the slot drafts next: while the speculation policy drafts
  // nothing, the MTP layer does not run.
  // Rows a recorded step ran through the layer already (commit_in_step) only set the length.
  void commit(const std::vector<CommitRows>& rows, const Features& f) override {
    staged_.clear();
    for (const CommitRows& r : rows) {
      CacheStream& s = streams_[size_t(r.slot)];
      const int64_t k = in_step_row_[size_t(r.slot)];
      if (k >= 0) {
        DFLASH2_INTERNAL(pending_.count(r.slot) == 0 && s.length >= r.pos0 + r.n, "MTP stream of slot ", r.slot,
                         " holds ", s.length, " positions run in the step, commit ends at ", r.pos0 + r.n);
        t_.mtp_cache().truncate(s, r.pos0 + r.n);
        base_len_[size_t(r.slot)] = s.length;
        in_step_row_[size_t(r.slot)] = -1;
        // the step left the prediction for the slot's next position in row k of the outputs
        // (job order, so the step's graph does not depend on the slots): kept now
        Tensor dl = last_logits_.slice(0, r.slot, r.slot + 1), dh = last_hidden_.slice(0, r.slot, r.slot + 1);
        ops::copy(out_logits_.slice(0, k, k + 1), dl);
        ops::copy(out_hidden_.slice(0, k, k + 1), dh);
        continue;
      }
      t_.mtp_cache().truncate(s, std::min(s.length, base_len_[size_t(r.slot)]));  // drop the chain's positions
      DFLASH2_INTERNAL(s.length + pending_.count(r.slot) == r.pos0, "MTP stream of slot ", r.slot, " has ", s.length,
                       " + ", pending_.count(r.slot), " pending tokens, commit starts at ", r.pos0);
      staged_.push_back(r);
    }
    if (!staged_.empty()) pending_.stage(staged_, f.final_hidden, run_);
  }

  // After acceptance, inside the recorded step: the layer over the step's verify rows at
  // their positions (replacing the chain's), each row's next token being the accepted draft
  // after it or the bonus (ops::next_after_accept, on the device), with logits and hidden
  // states kept for each sequence's last committed row (the plan's logit rows, rewritten by
  // the same op) -- what the commit would have run before the next draft. Rows past the
  // accepted ones sit beyond the committed length (the next step overwrites them).
  bool commit_in_step(const std::vector<StepRows>& rows, const Features& f, const StepAcceptance& acc) override {
    StepRecorder& rec = t_.recorder();
    if (!rec.recording() || !f.final_hidden.defined() || rows.empty()) return false;
    int64_t T = 0;
    for (const StepRows& r : rows) {
      if (r.slot < 0) return false;  // (MTP steps are not padded)
      const CacheStream& s = streams_[size_t(r.slot)];
      if (pending_.count(r.slot) != 0 || base_len_[size_t(r.slot)] != r.pos0 || s.length < r.pos0 ||
          in_step_row_[size_t(r.slot)] >= 0)
        return false;
      T += r.n;
    }
    const int64_t S = int64_t(rows.size());
    if (T > t_.options().max_step_tokens || S > out_logits_.shape(0)) return false;
    std::vector<Piece>& pieces = step_pieces_;
    pieces.clear();
    for (size_t i = 0; i < rows.size(); ++i) {
      CacheStream& s = streams_[size_t(rows[i].slot)];
      t_.mtp_cache().truncate(s, rows[i].pos0);  // the chain's positions: this run rewrites them
      Piece p;
      p.stream = &s;
      p.n = rows[i].n;
      p.seq = int64_t(i);
      p.last = true;
      pieces.push_back(p);
    }
    Target::ChunkPrep prep;
    prep.key = "next|";
    if (dev_.is_cuda())
      for (const Tensor* x : {&acc.row0, &acc.draft_row, &acc.draft_len, &acc.accepted, &acc.bonus, &acc.drafts})
        ForwardGraphs::key_add(prep.key, *x);
    prep.fn = [acc](model::TokenBatch& b) mutable {
      ops::next_after_accept(acc.row0, acc.draft_row, acc.draft_len, acc.accepted, acc.bonus, acc.drafts, b.tokens,
                             b.logit_rows);
    };
    Tensor hm = f.final_hidden.slice(0, 0, T), lg = out_logits_.slice(0, 0, S), hd = out_hidden_.slice(0, 0, S);
    t_.mtp_chunk(pieces, hm, lg, hd, false, Tensor(), true, prep);
    for (int64_t k = 0; k < S; ++k) in_step_row_[size_t(rows[size_t(k)].slot)] = k;  // row k of lg / hd
    ++in_step_count_;
    return true;
  }
  int64_t appends_in_step() const override { return in_step_count_.load(); }

  // Runs rows of h_src (CommitRows::row0..) with their next tokens through the MTP layer; the
  // last row of each keeps what predicts the slot's next position.
  void run(const std::vector<CommitRows>& rows, const Tensor& h_src) {
    std::vector<CacheStream*>& streams = streams_tmp_;
    std::vector<const int32_t*>& next = toks_tmp_;
    std::vector<int64_t>& counts = counts_tmp_;
    streams.clear();
    next.clear();
    counts.clear();
    first_row_.clear();
    for (const CommitRows& r : rows) {
      streams.push_back(&streams_[size_t(r.slot)]);
      next.push_back(r.next);
      counts.push_back(r.n);
      first_row_.push_back(r.row0);
    }
    make_chunks(streams, next, counts, t_.options().max_step_tokens, chunks_);
    for (const auto& ch : chunks_) {
      // h_main: the committed rows of the target's final hidden states, in chunk order
      Tensor hm;
      gather_rows_of_pieces(ch, first_row_, h_src, idx_, host_idx_, hm_, hm, &idx_up_);
      int64_t R = 0;
      for (const Piece& p : ch) R += p.last ? 1 : 0;
      Tensor lg = out_logits_.slice(0, 0, R), hd = out_hidden_.slice(0, 0, R);
      t_.mtp_chunk(ch, hm, lg, hd);
      int64_t r = 0;
      for (const Piece& p : ch) {
        if (!p.last) continue;
        const int64_t slot = rows[size_t(p.seq)].slot;
        Tensor dl = last_logits_.slice(0, slot, slot + 1), dh = last_hidden_.slice(0, slot, slot + 1);
        ops::copy(lg.slice(0, r, r + 1), dl);
        ops::copy(hd.slice(0, r, r + 1), dh);
        ++r;
      }
    }
    for (const CommitRows& r : rows) base_len_[size_t(r.slot)] = streams_[size_t(r.slot)].length;
  }

  // not under tensor parallelism: the chain's ids and hidden states reach the other ranks by
  // peer copies ordered by an event, outside the ranks' graphs (Target::from_rank0)
  bool records_steps() const override { return t_.tp_size() == 1; }
  // padding rows draft nothing here (the chain writes its slot's MTP cache), so a padded
  // step's shapes would still follow the batch size: no padding
  bool pads_steps() const override { return false; }

  const DraftResult& draft(const std::vector<DraftJob>& jobs) override {  // greedy at any temperature
    const int64_t S = int64_t(jobs.size());
    // padding rows (DraftJob::pad) draft nothing: the chain writes its slot's MTP cache
    auto len_of = [&](const DraftJob& j) -> int64_t {
      return j.pad ? 0 : std::max<int64_t>(0, std::min({K_, j.max_tokens, j.room}));
    };
    // the slots that draft now need their MTP state up to date; in a recorded step every
    // slot's (commit_in_step runs its verified rows next)
    bool any = false;
    for (const DraftJob& j : jobs) any = any || len_of(j) > 0;
    const bool all = any && t_.recorder().recording();
    flush_.clear();
    for (const DraftJob& j : jobs)
      if (!j.pad && (all || len_of(j) > 0)) flush_.push_back(j.slot);
    pending_.flush(flush_, run_);  // now: the committed rows come before the step
    res_.len.assign(size_t(S), 0);
    res_.row.resize(size_t(S));
    res_.has_q = false;
    int64_t longest = 0;
    for (int64_t i = 0; i < S; ++i) {
      res_.row[size_t(i)] = i;
      res_.len[size_t(i)] = len_of(jobs[size_t(i)]);
      longest = std::max(longest, res_.len[size_t(i)]);
    }
    // The chain's device work -- argmax, the hidden-state copies, the layer's chunks -- is
    // queued in the step while it is recorded (one graph with the verify pass; each chunk's
    // plan in a buffer of its own, Target::record_plan), else run now.
    StepRecorder& rec = t_.recorder();
    const bool queue = rec.recording();
    auto op = [&](const char* name, std::initializer_list<const Tensor*> ts, std::function<void()> fn) {
      if (!queue) return fn();
      std::string key = name;
      if (dev_.is_cuda())
        for (const Tensor* t : ts) ForwardGraphs::key_add(key, *t);
      rec.add(key, std::move(fn));
    };
    auto argmax = [&](const Tensor& lg, const Tensor& tok) {
      op("mtp-argmax|", {&lg, &tok}, [lg = lg, tok = tok]() mutable { ops::argmax(lg, tok); });
    };
    auto copy = [&](const Tensor& src, const Tensor& dst) {
      op("mtp-copy|", {&src, &dst}, [src = src, dst = dst]() mutable { ops::copy(src, dst); });
    };
    // the drafted ids: written where the logits are (device tokens on the GPU); the next
    // position's plan refers to them there (refs_: -1 - index into toks_out)
    Tensor& toks_out = dev_.is_cuda() ? d_tokens_ : res_.tokens;
    last_rows_ = S;
    refs_.resize(size_t(S * K_));
    for (int64_t i = 0; i < S; ++i)
      for (int64_t j = 0; j < K_; ++j) refs_[size_t(i * K_ + j)] = int32_t(-1 - (i * toks_out.stride(0) + j));
    // position 0: the layer's prediction kept at the last commit, and the chain's hidden
    // state seeded from it -- now (eager work runs before a recorded step), so what is
    // queued reads job-indexed rows only and the step's launch keys do not depend on which
    // slots the jobs hold
    for (int64_t i = 0; i < S; ++i) {
      if (res_.len[size_t(i)] == 0) continue;
      const int64_t slot = jobs[size_t(i)].slot;
      Tensor tok = toks_out.select(1, 0).slice(0, i, i + 1), ch = chain_hidden_.slice(0, i, i + 1);
      ops::argmax(last_logits_.slice(0, slot, slot + 1), tok);
      if (res_.len[size_t(i)] > 1) ops::copy(last_hidden_.slice(0, slot, slot + 1), ch);
    }
    // positions 1..: feed the previous token and the layer's own hidden state back
    std::vector<CacheStream*>& streams = streams_tmp_;
    std::vector<const int32_t*>& toks = toks_tmp_;
    std::vector<int64_t>&counts = counts_tmp_, &who = who_tmp_;
    for (int64_t j = 1; j < longest; ++j) {
      streams.clear();
      toks.clear();
      counts.clear();
      who.clear();
      for (int64_t i = 0; i < S; ++i) {
        if (res_.len[size_t(i)] <= j) continue;
        streams.push_back(&streams_[size_t(jobs[size_t(i)].slot)]);
        toks.push_back(refs_.data() + i * K_ + (j - 1));  // the token drafted at position j - 1
        counts.push_back(1);
        who.push_back(i);
      }
      make_chunks(streams, toks, counts, t_.options().max_step_tokens, chunks_);
      for (const auto& ch : chunks_) {
        const int64_t T = int64_t(ch.size());
        for (int64_t a = 0; a < T; ++a) {
          const int64_t i = who[size_t(ch[size_t(a)].seq)];
          copy(chain_hidden_.slice(0, i, i + 1), hm_.slice(0, a, a + 1));
        }
        Tensor hm = hm_.slice(0, 0, T), lg = out_logits_.slice(0, 0, T), hd = out_hidden_.slice(0, 0, T);
        t_.mtp_chunk(ch, hm, lg, hd, false, toks_out, queue);
        for (int64_t a = 0; a < T; ++a) {
          const int64_t i = who[size_t(ch[size_t(a)].seq)];
          copy(hd.slice(0, a, a + 1), chain_hidden_.slice(0, i, i + 1));
          argmax(lg.slice(0, a, a + 1), toks_out.select(1, j).slice(0, i, i + 1));
        }
      }
    }
    if (dev_.is_cuda()) res_.dev_tokens = d_tokens_;  // verify and acceptance read them on the device
    return res_;
  }

  void fetch_host() override {
    if (!dev_.is_cuda() || last_rows_ == 0) return;
    Tensor h = res_.tokens.slice(0, 0, last_rows_);
    h.copy_from(d_tokens_.slice(0, 0, last_rows_));
  }

  void release(int slot) override {
    pending_.clear(slot);
    in_step_row_[size_t(slot)] = -1;
    base_len_[size_t(slot)] = 0;
    t_.mtp_cache().release(streams_[size_t(slot)]);
  }
  KvCache* context_cache() override { return &t_.mtp_cache(); }
  const CacheStream* context_stream(int slot) const override { return &streams_[size_t(slot)]; }
  // the rows run with their committed next tokens (the chain's positions past them are not;
  // a step's rows not yet committed neither: base_len_ is the length before that step)
  int64_t context_filled(int slot) const override { return base_len_[size_t(slot)]; }
  void attach(int slot, const std::vector<int32_t>& blocks, int64_t length) override {
    CacheStream& s = streams_[size_t(slot)];
    DFLASH2_INTERNAL(pending_.count(slot) == 0 && in_step_row_[size_t(slot)] < 0, "attaching to MTP slot ", slot,
                     " that is in use");
    t_.mtp_cache().share(s, blocks);
    s.length = length;
    base_len_[size_t(slot)] = length;
  }

 private:
  Target& t_;
  int64_t K_;
  Device dev_ = Device::cpu();  // where the chain runs (the target's GPU without tensor parallelism)
  Tensor d_tokens_;             // CUDA: the drafted ids on the device
  std::vector<CacheStream> streams_;  // per slot
  Tensor last_logits_, last_hidden_;  // per slot: what predicts the next position
  Tensor chain_hidden_;               // per job: the chain's running hidden state
  Tensor hm_, idx_, out_logits_, out_hidden_;
  std::vector<std::vector<Piece>> chunks_;
  std::vector<int32_t> host_idx_;
  StagedUpload idx_up_;          // CUDA: the gathers' row indices, uploaded without a host wait
  std::vector<int32_t> refs_;    // the chain's token references into the drafted ids
  int64_t last_rows_ = 0;        // rows of the last draft() (fetch_host)
  std::vector<int64_t> first_row_;
  std::vector<CacheStream*> streams_tmp_;
  std::vector<const int32_t*> toks_tmp_;
  std::vector<int64_t> counts_tmp_, who_tmp_;
  static constexpr int64_t kPending = 64;  // committed rows a slot keeps before running them
  PendingRows pending_;
  PendingRows::Run run_;
  std::vector<int64_t> base_len_;  // per slot: the MTP stream's length after its last run
  // per slot: -1, or its verified rows ran in the step (commit_in_step), leaving its next
  // prediction in this row of out_logits_ / out_hidden_
  std::vector<int64_t> in_step_row_;
  std::vector<Piece> step_pieces_;
  std::vector<CommitRows> staged_;
  std::atomic<int64_t> in_step_count_{0};
  std::vector<int> flush_;
  DraftResult res_;
};

}  // namespace

std::unique_ptr<Drafter> make_mtp_drafter(Target& target, int64_t draft_tokens) {
  DFLASH2_CHECK(target.model().has_mtp(), ErrorKind::Config,
                "method 'mtp' but the target has no MTP layer (num_nextn_predict_layers = 0)");
  DFLASH2_CHECK_ARG(draft_tokens >= 1, "mtp_draft_tokens must be >= 1, found ", draft_tokens);
  return std::make_unique<MtpDrafter>(target, draft_tokens);
}

}  // namespace dflash2::runtime
