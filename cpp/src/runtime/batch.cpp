#include "runtime/batch.h"

#include <algorithm>
#include <chrono>
#include <random>

#include "dflash2/error.h"

namespace dflash2::runtime {

namespace {
double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

uint64_t rng_key(int64_t seed, int64_t index) {
  uint64_t s = seed < 0 ? std::random_device{}() ^ (uint64_t(std::random_device{}()) << 32) : uint64_t(seed);
  uint64_t z = s + 0x9e3779b97f4a7c15ull * uint64_t(index + 1);  // splitmix64 of (seed, index)
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void Core::allocate_buffers() {
  const auto& mc = target->config();
  const int64_t V = mc.vocab_size, H = mc.hidden_size, B = target->options().max_batch_size;
  const int64_t verify_rows = B * (K + 1);
  const int64_t feat_rows = std::max(target->options().max_step_tokens, verify_rows);
  logits = Tensor::empty(DType::F32, {verify_rows, V});
  flags = Tensor::empty(DType::I32, {verify_rows});
  if (!taps.empty()) taps_buf = Tensor::empty(DType::F32, {feat_rows, int64_t(taps.size()) * H});
  if (want_final) fin = Tensor::empty(DType::F32, {feat_rows, H});
  s_temp = Tensor::zeros(DType::F32, {B});
  s_topp = Tensor::zeros(DType::F32, {B});
  s_topk = Tensor::zeros(DType::I32, {B});
  s_rng = Tensor::zeros(DType::I64, {B, 2});
  s_out = Tensor::zeros(DType::I32, {B});
  a_row0 = Tensor::zeros(DType::I32, {B});
  a_draft_row = Tensor::zeros(DType::I32, {B});
  a_draft_len = Tensor::zeros(DType::I32, {B});
  a_accepted = Tensor::zeros(DType::I32, {B});
  a_bonus = Tensor::zeros(DType::I32, {B});
  no_drafts = Tensor::zeros(DType::I32, {B, 1});
}

void Core::check_finite(int64_t rows, const char* what, int64_t step, const std::vector<int64_t>* row_owner) {
  Tensor lg = logits.slice(0, 0, rows), fl = flags.slice(0, 0, rows);
  ops::check_finite(lg, fl);
  const int32_t* f = fl.data_as<const int32_t>();
  for (int64_t r = 0; r < rows; ++r)
    if (f[r])
      fail(ErrorKind::Numerical, "non-finite logits (NaN or Inf) from the target in ", what,
           step >= 0 ? " at decode step " + std::to_string(step) : std::string(),
           row_owner ? ", request " + std::to_string((*row_owner)[size_t(r)]) : std::string(), ", logits row ", r,
           ": the checkpoint holds non-finite weights or its activations overflow");
}

// Everything one request carries through the decode loop.
struct Batch::Req {
  size_t idx = 0;
  int slot = 0;
  const std::vector<int32_t>* prompt = nullptr;
  CacheStream main;
  int32_t anchor = 0;  // last emitted token: not yet in the target cache
  bool done = false;
  uint64_t rng_key = 0, rng_counter = 0;  // the request's random stream (Philox)
  std::vector<int32_t> next;              // the tokens following the positions being committed
  std::vector<int32_t> verify;            // [anchor, drafts...] of the current step
  int64_t committed = 0;
  std::vector<int64_t> accepted_at;
};

Batch::Batch(Core& core, const std::vector<std::vector<int32_t>>& prompts, size_t first, size_t count,
             const SamplingParams& p, const std::vector<int32_t>& stops, const TokenCallback& on_tokens,
             std::vector<GenerationResult>& results)
    : c_(core), p_(p), stops_(stops), on_tokens_(on_tokens), results_(results), reqs_(count) {
  greedy_ = p.temperature <= 0.0f;
  max_len_ = c_.target->options().max_seq_len;
  t0_ = now();
  for (size_t i = 0; i < count; ++i) {
    Req& r = reqs_[i];
    r.idx = first + i;
    r.slot = int(i);
    r.prompt = &prompts[first + i];
    r.rng_key = rng_key(p.seed, int64_t(first + i));
    r.accepted_at.assign(size_t(c_.K), 0);
    results_[first + i].stats.prompt_tokens = int64_t(prompts[first + i].size());
  }
}

Batch::~Batch() {
  for (auto& r : reqs_) {
    c_.target->cache().release(r.main);
    if (c_.drafter) c_.drafter->release(r.slot);
  }
}

// Writes row r of the sampling plan for request q, taking `draws` of its stream.
void Batch::plan_row(int64_t r, Req& q, uint64_t draws) {
  c_.s_temp.data_as<float>()[r] = greedy_ ? 0.0f : p_.temperature;
  c_.s_topp.data_as<float>()[r] = p_.top_p;
  c_.s_topk.data_as<int32_t>()[r] = int32_t(p_.top_k);
  c_.s_rng.data_as<int64_t>()[2 * r] = int64_t(q.rng_key);
  c_.s_rng.data_as<int64_t>()[2 * r + 1] = int64_t(q.rng_counter);
  q.rng_counter += draws;
}

// Emits accepted tokens in order; a stop token or the length budget ends the request.
void Batch::emit(Req& r, const int32_t* toks, int64_t count) {
  GenerationResult& res = results_[r.idx];
  sent_.clear();
  for (int64_t k = 0; k < count; ++k) {
    const int32_t t = toks[k];
    res.token_ids.push_back(t);
    sent_.push_back(t);
    if (std::find(stops_.begin(), stops_.end(), t) != stops_.end()) {
      res.finish_reason = "stop";
      r.done = true;
      break;
    }
    if (int64_t(res.token_ids.size()) >= p_.max_new_tokens) {
      res.finish_reason = "length";
      r.done = true;
      break;
    }
  }
  if (on_tokens_ && !sent_.empty()) on_tokens_(int64_t(r.idx), sent_);
}

void Batch::after_commit(Req& r) {  // room for the next anchor?
  if (!r.done && r.main.length + 1 > max_len_) {
    results_[r.idx].finish_reason = "length";
    r.done = true;
  }
}

// ---------------- prefill, chunk by chunk; each chunk's features go to the drafter
void Batch::prefill() {
  const double t0 = now();
  Target& tgt = *c_.target;
  Drafter* drafter = c_.drafter.get();
  const Features feats{c_.taps_buf, c_.fin};
  streams_.clear();
  toks_.clear();
  counts_.clear();
  for (auto& r : reqs_) {
    streams_.push_back(&r.main);
    toks_.push_back(r.prompt->data());
    counts_.push_back(int64_t(r.prompt->size()));
  }
  make_chunks(streams_, toks_, counts_, tgt.options().max_step_tokens, c_.chunks);
  for (const auto& ch : c_.chunks) {
    int64_t R = 0, T = 0;
    for (const auto& pc : ch) {
      R += pc.last ? 1 : 0;
      T += pc.n;
    }
    model::ForwardOutputs out;
    out.logits = c_.logits.slice(0, 0, R);
    out.tap_layers = c_.taps;
    if (c_.taps_buf.defined()) out.taps = c_.taps_buf.slice(0, 0, T);
    if (c_.fin.defined()) out.final_hidden = c_.fin.slice(0, 0, T);
    tgt.run_chunk(ch, out);
    if (R > 0) c_.check_finite(R, "the prefill", -1, nullptr);
    // the first token of every prompt that ends here (one draw each)
    int64_t r = 0;
    for (const auto& pc : ch)
      if (pc.last) plan_row(r++, reqs_[size_t(pc.seq)], 1);
    if (R > 0) {
      Tensor lg = c_.logits.slice(0, 0, R), rng = c_.s_rng.slice(0, 0, R), tok = c_.s_out.slice(0, 0, R);
      ops::sample(lg, c_.sampling_rows(R), rng, tok);
    }
    r = 0;
    for (const auto& pc : ch) {
      if (!pc.last) continue;
      Req& q = reqs_[size_t(pc.seq)];
      q.anchor = c_.s_out.data_as<const int32_t>()[r++];
      q.next.assign(q.prompt->begin() + 1, q.prompt->end());
      q.next.push_back(q.anchor);
    }
    if (drafter) {
      commits_.clear();
      int64_t row = 0;
      for (const auto& pc : ch) {
        const Req& q = reqs_[size_t(pc.seq)];
        CommitRows cr;
        cr.slot = q.slot;
        cr.pos0 = pc.offset;
        cr.row0 = row;
        cr.n = pc.n;
        cr.next = pc.last ? q.next.data() + pc.offset : q.prompt->data() + pc.offset + 1;
        commits_.push_back(cr);
        row += pc.n;
      }
      drafter->commit(commits_, feats);
    }
    for (const auto& pc : ch) {
      if (!pc.last) continue;
      Req& q = reqs_[size_t(pc.seq)];
      emit(q, &q.anchor, 1);
      after_commit(q);
    }
  }
  t_prefill_ = now() - t0;
}

// ---------------- draft / verify / accept / commit
bool Batch::step() {
  Target& tgt = *c_.target;
  Drafter* drafter = c_.drafter.get();
  act_.clear();
  for (auto& r : reqs_)
    if (!r.done) act_.push_back(&r);
  if (act_.empty()) return false;
  const int64_t S = int64_t(act_.size());
  // 1. draft
  double t0 = now();
  const DraftResult* dr = nullptr;
  if (drafter) {
    jobs_.clear();
    for (Req* r : act_) {
      DraftJob j;
      j.slot = r->slot;
      j.anchor = r->anchor;
      j.max_tokens = max_len_ - r->main.length - 1;
      j.temperature = greedy_ ? 0.0f : p_.temperature;
      j.rng_key = r->rng_key;
      j.rng_counter = &r->rng_counter;
      jobs_.push_back(j);
    }
    dr = &drafter->draft(jobs_);
  }
  t_draft_ += now() - t0;

  // 2. verify [anchor, d_1..d_k] in one target pass (chunked if it exceeds max_step_tokens)
  t0 = now();
  streams_.clear();
  toks_.clear();
  counts_.clear();
  row_owner_.clear();
  for (int64_t k = 0; k < S; ++k) {
    Req& r = *act_[size_t(k)];
    r.verify.assign(1, r.anchor);
    if (dr && dr->len[size_t(k)] > 0) {
      const int32_t* d = dr->tokens.data_as<const int32_t>() + dr->row[size_t(k)] * dr->tokens.stride(0);
      r.verify.insert(r.verify.end(), d, d + dr->len[size_t(k)]);
    }
    streams_.push_back(&r.main);
    toks_.push_back(r.verify.data());
    counts_.push_back(int64_t(r.verify.size()));
    for (size_t j = 0; j < r.verify.size(); ++j) row_owner_.push_back(int64_t(r.idx));
  }
  make_chunks(streams_, toks_, counts_, tgt.options().max_step_tokens, c_.chunks);
  int64_t row0 = 0;
  for (const auto& ch : c_.chunks) {
    int64_t T = 0;
    for (const auto& pc : ch) T += pc.n;
    model::ForwardOutputs out;
    out.logits = c_.logits.slice(0, row0, row0 + T);
    out.all_logits = true;
    out.tap_layers = c_.taps;
    if (c_.taps_buf.defined()) out.taps = c_.taps_buf.slice(0, row0, row0 + T);
    if (c_.fin.defined()) out.final_hidden = c_.fin.slice(0, row0, row0 + T);
    tgt.run_chunk(ch, out);
    row0 += T;
  }
  c_.check_finite(row0, "a decode step", step_, &row_owner_);
  t_verify_ += now() - t0;

  // 3. accept (greedy: longest matching prefix; sampling: lossless rejection sampling)
  const Tensor& drafts = dr ? dr->tokens : c_.no_drafts;
  {
    int64_t row = 0;
    for (int64_t k = 0; k < S; ++k) {
      Req& r = *act_[size_t(k)];
      const int64_t kk = int64_t(r.verify.size()) - 1;
      c_.a_row0.data_as<int32_t>()[k] = int32_t(row);
      c_.a_draft_row.data_as<int32_t>()[k] = dr ? int32_t(dr->row[size_t(k)]) : 0;
      c_.a_draft_len.data_as<int32_t>()[k] = int32_t(kk);
      plan_row(k, r, uint64_t(drafts.shape(1) + 1));
      row += kk + 1;
    }
    Tensor lg = c_.logits.slice(0, 0, row), rng = c_.s_rng.slice(0, 0, S);
    Tensor acc = c_.a_accepted.slice(0, 0, S), bon = c_.a_bonus.slice(0, 0, S);
    const bool with_q = dr && dr->has_q;
    ops::accept(lg, c_.a_row0.slice(0, 0, S), drafts, c_.a_draft_row.slice(0, 0, S), c_.a_draft_len.slice(0, 0, S),
                with_q ? dr->cand : Tensor(), with_q ? dr->q : Tensor(), c_.sampling_rows(S), rng, acc, bon);
  }
  // 4. commit anchor + the accepted tokens; roll back the rest of the verify pass
  commits_.clear();
  int64_t row = 0;
  for (int64_t k = 0; k < S; ++k) {
    Req& r = *act_[size_t(k)];
    const int64_t kk = int64_t(r.verify.size()) - 1;
    const int64_t a = c_.a_accepted.data_as<const int32_t>()[k];
    const int32_t bonus = c_.a_bonus.data_as<const int32_t>()[k];
    const int64_t L = r.main.length - (kk + 1);
    tgt.cache().truncate(r.main, L + a + 1);
    r.committed += a + 1;
    for (int64_t j = 0; j < a && j < c_.K; ++j) r.accepted_at[size_t(j)] += 1;
    results_[r.idx].stats.verify_steps += 1;
    r.next.assign(r.verify.begin() + 1, r.verify.begin() + 1 + a);
    r.next.push_back(bonus);
    emit(r, r.next.data(), int64_t(r.next.size()));
    r.anchor = bonus;
    if (drafter && !r.done) {
      CommitRows cr;
      cr.slot = r.slot;
      cr.pos0 = L;
      cr.row0 = row;
      cr.n = a + 1;
      cr.next = r.next.data();
      commits_.push_back(cr);
    }
    after_commit(r);
    row += kk + 1;
  }
  if (drafter && !commits_.empty()) drafter->commit(commits_, Features{c_.taps_buf, c_.fin});
  ++step_;
  return true;
}

void Batch::finish_stats() {
  const double t_total = now() - t0_;
  const int64_t K = c_.K;
  for (auto& r : reqs_) {
    GenerationStats& st = results_[r.idx].stats;
    st.prefill_s = t_prefill_;
    st.draft_s = t_draft_;
    st.verify_s = t_verify_;
    st.decode_s = t_total - t_prefill_;
    st.host_s = std::max(0.0, t_total - t_prefill_ - t_draft_ - t_verify_);
    st.steps = st.verify_steps;
    // the first token comes from the prefill; each verify step commits r.committed / steps
    st.acceptance_length = st.verify_steps ? double(r.committed) / double(st.verify_steps) : 1.0;
    st.accepted_per_position.assign(size_t(K), 0.0);
    for (int64_t j = 0; j < K; ++j)
      st.accepted_per_position[size_t(j)] =
          st.verify_steps ? double(r.accepted_at[size_t(j)]) / double(st.verify_steps) : 0.0;
  }
}

}  // namespace dflash2::runtime
