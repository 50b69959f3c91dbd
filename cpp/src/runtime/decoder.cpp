#include "runtime/decoder.h"

#include <algorithm>
#include <chrono>
#include <random>
#include <cstdio>
#include <cstdlib>

#include "dflash2/error.h"

namespace dflash2::runtime {

namespace {
double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

namespace {
std::exception_ptr numerical_error(const Request& r, const char* where, int64_t step, int64_t row) {
  try {
    fail(ErrorKind::Numerical, "non-finite logits (NaN or Inf) from the target in ",
         step >= 0 ? "decode step " + std::to_string(step) : std::string(where), " (request ", r.id, ", logits row ",
         row, "): the checkpoint holds non-finite weights or its activations overflow");
  } catch (...) {
    return std::current_exception();
  }
}
}  // namespace

Decoder::Decoder(Core& core, Sink& sink, bool adaptive)
    : c_(core), sink_(sink), policy_(core.K, adaptive, core.drafter && core.drafter->draft_cost_scales_with_k()) {
  debug_spec_ = std::getenv("DFLASH2_DEBUG_SPEC") != nullptr;
  slots_.assign(size_t(c_.target->options().max_batch_size), nullptr);
  max_len_ = c_.target->options().max_seq_len;
}

int64_t Decoder::free_slots() const {
  int64_t n = 0;
  for (Request* r : slots_) n += r == nullptr ? 1 : 0;
  return n;
}

bool Decoder::waits_for_a_prefill(const Request& r) const {
  if (!prefix_) return false;
  const int64_t bs = prefix_->block_size(), n = int64_t(r.prompt.size());
  int64_t cached = -1;  // looked up when a candidate shows up
  // the prompts that end this round (a's blocks are kept as its prefill ends; a prompt that
  // takes several rounds under prefill_tokens_per_step is not waited for)
  bool decoding = false;
  for (const Request* a : running_) decoding = decoding || (a->prefilled && !a->done);
  int64_t budget = decoding && prefill_budget_ > 0 ? prefill_budget_ : INT64_MAX;
  for (const Request* a : running_) {
    if (a->prefilled || a->done) continue;
    const int64_t na = int64_t(a->prompt.size()), m = std::min(n, na);
    const int64_t rest = na - a->prompt_fed;
    const bool ends_now = rest <= budget;
    budget = rest <= budget ? budget - rest : 0;
    if (!ends_now) continue;
    int64_t common = 0;
    while (common < m && a->prompt[size_t(common)] == r.prompt[size_t(common)]) ++common;
    // whole blocks with the token after each: what a's prefill keeps and r could take
    const int64_t k = std::min({(common - 1) / bs, (n - 1) / bs, (na - 1) / bs});
    if (k <= 0) continue;
    if (cached < 0) cached = prefix_->match(r.prompt.data(), n);
    if (k > cached) return true;
  }
  return false;
}

bool Decoder::admit(Request* r) {
  if (waits_for_a_prefill(*r)) return false;
  int slot = -1;
  for (size_t i = 0; i < slots_.size(); ++i)
    if (!slots_[i]) {
      slot = int(i);
      break;
    }
  if (slot < 0) return false;
  // the whole request's cache up front: prompt + new tokens + one verify block of lookahead
  const int64_t need = std::min(max_len_, int64_t(r->prompt.size()) + r->p.max_new_tokens + c_.K + 1);
  Target& tgt = *c_.target;
  // a cached prefix of the prompt: its blocks start the streams (acquired first, so that the
  // reservations below cannot evict them)
  std::vector<int32_t> entries;
  if (prefix_) entries = prefix_->acquire(r->prompt.data(), int64_t(r->prompt.size()));
  const int64_t shared = entries.empty() ? 0 : int64_t(entries.size()) * prefix_->block_size();
  auto undo = [&] {
    tgt.cache().release(r->main);
    if (c_.drafter) c_.drafter->release(slot);
    if (prefix_) prefix_->release(entries);
  };
  if (shared > 0) {
    tgt.cache().share(r->main, prefix_->blocks(entries, 0));
    r->main.length = shared;
  }
  if (!tgt.cache().try_pin(r->main, need)) {
    undo();
    return false;
  }
  if (c_.drafter) {
    if (shared > 0) c_.drafter->attach(slot, prefix_->blocks(entries, 1), shared);
    if (!c_.drafter->reserve(slot, need)) {
      undo();
      return false;
    }
  }
  if (prefix_) prefix_->note(int64_t(r->prompt.size()), shared);
  r->prefix_entries = std::move(entries);
  r->cached_tokens = r->prompt_fed = shared;
  r->slot = slot;
  if (r->penalized) {
    try {  // counts still pending for the slot's last request land before the reset
      count_emitted();
      c_.reset_penalties(slot, r->prompt, r->stops, r->p.logit_bias);  // the tables made at the first
      if (c_.drafter && !c_.drafter->pen_state.defined()) {            // the drafter drafts under them too
        c_.drafter->pen_state = c_.pen_state;
        c_.drafter->pen_bias = c_.pen_bias;
      }
    } catch (...) {  // (e.g. no device memory for the tables) the request fails; the others go on
      // admitted as ended: it retires this round, which frees what it took (the caller holds
      // the lock that guards r->error: Scheduler::loop)
      r->error = std::current_exception();
      r->done = true;
      r->finish_reason = "error";
    }
  }
  slots_[size_t(slot)] = r;
  running_.push_back(r);
  r->accepted_at.assign(size_t(c_.K), 0);
  return true;
}

int64_t Decoder::prefilling() const {
  int64_t n = 0;
  for (const Request* r : running_) n += !r->prefilled && !r->done && r->prompt_fed > 0 ? 1 : 0;
  return n;
}

void Decoder::enable_prefix_cache(bool generated) {
  cache_generated_ = generated;
  std::vector<KvCache*> caches{&c_.target->cache()};
  if (c_.drafter) {
    KvCache* dc = c_.drafter->context_cache();
    DFLASH2_INTERNAL(dc != nullptr, "a drafter without a context cache");
    caches.push_back(dc);
  }
  prefix_ = std::make_unique<PrefixCache>(caches, c_.target->cache().block_size());
}

// The prompt's full blocks whose rows every cache holds go into the prefix cache (their
// rows are what its prefill computed). At the end of its prefill (the drafter's last rows
// may still wait to be appended: those blocks come at the end of the request), and the
// request holds the entries it filled from then on, as those it took (they are not idle).
void Decoder::keep_prompt(Request& r, bool hold) {
  if (!prefix_ || !r.prefilled || r.error || r.finish_reason == "error") return;
  int64_t filled = r.main.length;
  std::vector<const std::vector<int32_t>*> blocks{&r.main.blocks};
  if (c_.drafter) {
    filled = std::min(filled, c_.drafter->context_filled(r.slot));
    blocks.push_back(&c_.drafter->context_stream(r.slot)->blocks);
  }
  const int64_t n = int64_t(r.prompt.size());
  if (!hold && cache_generated_ && !r.tokens.empty()) {
    // the request ends: its prompt and output as one prefix (the rows of every token but
    // the last are in the caches, committed; the last is only the next token of a block)
    seq_.assign(r.prompt.begin(), r.prompt.end());
    seq_.insert(seq_.end(), r.tokens.begin(), r.tokens.end());
    prefix_->insert(seq_.data(), int64_t(seq_.size()), blocks, filled);
    return;
  }
  prefix_->insert(r.prompt.data(), n, blocks, filled);
  if (!hold) return;
  // the entries over its own blocks (the same prompt kept by another request is that one's)
  std::vector<int32_t> entries = prefix_->acquire(r.prompt.data(), std::min(n, filled + 1));
  const std::vector<int32_t> mine = prefix_->blocks(entries, 0);
  size_t k = 0;
  while (k < entries.size() && mine[k] == r.main.blocks[k]) ++k;
  prefix_->release(std::vector<int32_t>(entries.begin() + int64_t(k), entries.end()));
  entries.resize(k);
  prefix_->release(r.prefix_entries);
  r.prefix_entries = std::move(entries);
}

void Decoder::retire(Request* r) {
  if (r->slot < 0) return;
  keep_prompt(*r, /*hold=*/false);
  c_.target->cache().release(r->main);
  if (c_.drafter) c_.drafter->release(r->slot);
  if (prefix_ && !r->prefix_entries.empty()) prefix_->release(r->prefix_entries);
  r->prefix_entries.clear();
  slots_[size_t(r->slot)] = nullptr;
  r->slot = -1;
  running_.erase(std::remove(running_.begin(), running_.end(), r), running_.end());
  // stats
  GenerationStats& st = r->result.stats;
  st.prompt_tokens = int64_t(r->prompt.size());
  st.generated_tokens = int64_t(r->tokens.size());
  st.prefill_s = r->prefill_s;
  st.prefill_rounds = r->prefill_rounds;
  st.cached_tokens = r->cached_tokens;
  st.draft_s = r->draft_s;
  st.verify_s = r->verify_s;
  st.accept_s = r->accept_s;
  st.decode_s = r->t_prefilled > 0 ? std::max(0.0, now() - r->t_prefilled) : 0.0;
  st.prefill_wait_s = std::min(r->prefill_wait_s, st.decode_s);
  st.host_s = std::max(0.0, st.decode_s - st.draft_s - st.verify_s - st.accept_s - st.prefill_wait_s);
  st.verify_steps = r->verify_steps;
  st.steps = r->verify_steps;
  st.acceptance_length = r->verify_steps ? double(r->committed) / double(r->verify_steps) : 1.0;
  st.accepted_per_position.assign(size_t(c_.K), 0.0);
  for (int64_t j = 0; j < c_.K; ++j)
    st.accepted_per_position[size_t(j)] =
        r->verify_steps ? double(r->accepted_at[size_t(j)]) / double(r->verify_steps) : 0.0;
  const double t = st.prefill_s + st.decode_s;
  st.tokens_per_second = t > 0 ? double(st.generated_tokens) / t : 0.0;
  r->result.token_ids = r->tokens;
  r->result.logprobs = r->logprobs;
  r->result.finish_reason = r->finish_reason;
}

void Decoder::retire_all() {
  while (!running_.empty()) retire(running_.back());
}

// Writes row r of the sampling plan for request q, taking `draws` of its stream.
void Decoder::plan_row(int64_t row, Request& q, uint64_t draws) {
  c_.s_temp.data_as<float>()[row] = q.p.temperature;
  c_.s_topp.data_as<float>()[row] = q.p.top_p;
  c_.s_topk.data_as<int32_t>()[row] = int32_t(q.p.top_k);
  c_.s_rng.data_as<int64_t>()[2 * row] = int64_t(q.rng_key);
  c_.s_rng.data_as<int64_t>()[2 * row + 1] = int64_t(q.rng_counter);
  q.rng_counter += draws;
}

namespace {
// q's repetition control for its next rows into a DraftJob's fields (table row -1: none).
void penalty_of(const Request* q, DraftJob& j) {
  const bool on = q && q->penalized;
  j.pen_row = on ? int32_t(q->slot) : -1;
  j.pen_min_left = on ? int32_t(std::max<int64_t>(0, q->p.min_tokens - int64_t(q->tokens.size()))) : 0;
  j.pen[0] = on ? q->p.presence_penalty : 0.0f;
  j.pen[1] = on ? q->p.frequency_penalty : 0.0f;
  j.pen[2] = on ? q->p.repetition_penalty : 1.0f;
}
}  // namespace

void Decoder::plan_penalty_row(int64_t row, const Request* q) {
  DraftJob j;
  penalty_of(q, j);
  c_.pen_seq.data_as<int32_t>()[2 * row] = j.pen_row;
  c_.pen_seq.data_as<int32_t>()[2 * row + 1] = j.pen_min_left;
  std::copy(j.pen, j.pen + 3, c_.pen_par.data_as<float>() + 3 * row);
}

void Decoder::count_emitted() {
  c_.count_penalized(pen_slots_, pen_ids_);
  pen_slots_.clear();
  pen_ids_.clear();
}

// Emits accepted tokens in order; a stop token or the length budget ends the request.
// lps: the tokens' log-probabilities (logprobs_of_rows' rows, their top lists cut to what
// the request asked for), for a request that asked for them.
void Decoder::emit(Request& r, const int32_t* toks, int64_t count, const TokenLogprobs* lps) {
  const bool with_lp = r.p.logprobs >= 0;
  DFLASH2_INTERNAL(!with_lp || lps != nullptr, "request ", r.id, " wants log-probabilities, none were computed");
  const size_t lp0 = r.logprobs.size();
  int64_t n = 0;
  std::exception_ptr failed;  // from its constraint
  for (; n < count;) {
    if (with_lp) {
      TokenLogprobs lp = lps[n];
      lp.top_ids.resize(size_t(r.p.logprobs));
      lp.top_logprobs.resize(size_t(r.p.logprobs));
      r.logprobs.push_back(std::move(lp));
    }
    const int32_t t = toks[n++];
    r.tokens.push_back(t);
    if (r.p.constraint) {  // structured output: its state follows every token, one at a time
      try {
        r.p.constraint->commit(&t, 1);
        // complete: nothing may follow (not the rest of an accepted block; also when the
        // length runs out with this token: the output is whole, not cut short)
        if (r.p.constraint->done()) {
          r.finish_reason = "stop";
          r.done = true;
          break;
        }
      } catch (...) {
        failed = std::current_exception();
        break;
      }
    }
    if (std::find(r.stops.begin(), r.stops.end(), t) != r.stops.end()) {
      r.finish_reason = "stop";
      r.done = true;
      break;
    }
    if (int64_t(r.tokens.size()) >= r.p.max_new_tokens) {
      r.finish_reason = "length";
      r.done = true;
      break;
    }
  }
  if (r.penalized && !r.done)  // its next rows count these (a request that ended needs no counts)
    for (int64_t i = 0; i < n; ++i) {
      pen_slots_.push_back(int32_t(r.slot));
      pen_ids_.push_back(toks[i]);
    }
  if (n > 0) sink_.on_tokens(r, toks, n, with_lp ? r.logprobs.data() + lp0 : nullptr);
  if (failed) fail_request(r, failed);
}

// Greedy constrained requests of a drafter with candidates (DFlash 2's selector): their
// constraint may replace the drafts by ones it allows (TokenConstraint::steer); the host
// drafts are rewritten, and the device's that the verify pass reads (a row each).
void Decoder::steer_drafts(const DraftResult& dr) {
  if (!dr.cand.defined() || dr.cand.ndim() != 3 || !dr.cand.is_contiguous() || !dr.tokens.is_contiguous()) return;
  const int64_t C = dr.cand.shape(2), K = dr.tokens.shape(1);
  for (size_t k = 0; k < act_.size(); ++k) {
    Request& r = *act_[k];
    const int64_t n = lens_[k];
    if (!r.p.constraint || r.p.temperature > 0.0f || n <= 0 || r.done) continue;
    const int64_t row = dr.row[k];
    const int32_t* cand = dr.cand.data_as<const int32_t>() + row * dr.cand.stride(0);
    const int32_t* own = dr.tokens.data_as<const int32_t>() + row * dr.tokens.stride(0);
    steer_.assign(own, own + n);  // the drafter's, to keep where the constraint allows them
    int64_t m = -1;
    try {
      m = r.p.constraint->steer(cand, n, C, steer_.data());
      DFLASH2_CHECK(m >= -1 && m <= n, ErrorKind::InvalidArgument, "the token constraint of request ", r.id,
                    " steered ", m, " of ", n, " drafts");
    } catch (...) {
      fail_request(r, std::current_exception());
      continue;
    }
    if (m < 0) continue;
    Tensor host = dr.tokens.slice(0, row, row + 1);
    std::copy(steer_.begin(), steer_.begin() + m, host.data_as<int32_t>());
    if (dr.dev_tokens.defined() && m > 0) {
      Tensor dev = dr.dev_tokens.slice(0, row, row + 1);
      DFLASH2_INTERNAL(dev.shape(1) == K, "device drafts ", dev.describe(), " for host drafts ", host.describe());
      dev.copy_from(host);
    }
    lens_[k] = m;
  }
}

void Decoder::fail_request(Request& r, std::exception_ptr e) {
  r.done = true;
  r.finish_reason = "error";
  sink_.on_error(r, e);
}

int64_t Decoder::plan_masks(Request& r, const int32_t* drafts, int64_t n, int64_t row) {
  c_.ensure_masks();
  const int64_t W = c_.mask_words(), cap = c_.mask_bits.shape(0);
  DFLASH2_INTERNAL(c_.mask_count + n + 1 <= cap, "mask rows ", c_.mask_count, " + ", n + 1, " exceed ", cap);
  int32_t* bits = c_.mask_bits.data_as<int32_t>() + c_.mask_count * W;
  int64_t filled = 0;
  try {
    std::fill(bits, bits + (n + 1) * W, 0);
    filled = r.p.constraint->masks(drafts, n, reinterpret_cast<uint32_t*>(bits), W);
    DFLASH2_CHECK(filled >= 0 && filled <= n + 1, ErrorKind::InvalidArgument, "the token constraint of request ",
                  r.id, " filled ", filled, " mask rows for ", n, " drafts (at most ", n + 1, ")");
    // every row must leave a token to draw (with min_tokens pending: a token that is not a stop)
    const int64_t V = c_.logits.shape(1);
    for (int64_t j = 0; j < filled; ++j) {
      const uint32_t* m = reinterpret_cast<const uint32_t*>(bits + j * W);
      const bool held = int64_t(r.tokens.size()) + j < r.p.min_tokens;
      bool any = false;
      for (int64_t w = 0; w < W && !any; ++w) {
        uint32_t x = m[w];
        if (w == V / 32 && V % 32) x &= (1u << (V % 32)) - 1u;
        if (w * 32 >= V) x = 0;
        if (held)
          for (int32_t t : r.stops)
            if (t / 32 == w) x &= ~(1u << (t % 32));
        any = x != 0;
      }
      DFLASH2_CHECK(any, ErrorKind::InvalidArgument, "the token constraint of request ", r.id,
                    held ? " allows only stop tokens while min_tokens holds them back (" : " allows no token (",
                    "mask row ", j, " after ", j, " drafts)");
    }
  } catch (...) {
    fail_request(r, std::current_exception());
    return 0;
  }
  int32_t* rows = c_.mask_rows.data_as<int32_t>() + c_.mask_count;
  for (int64_t j = 0; j < filled; ++j) rows[j] = int32_t(row + j);
  c_.mask_count += filled;
  return filled;
}

void Decoder::logprobs_of_rows(int64_t lo, int64_t rows, const int32_t* ids, int64_t top) {
  std::copy(ids, ids + rows, c_.lp_ids.data_as<int32_t>());
  c_.logprobs(lo, rows, top);
  const float* v = c_.lp_val.data_as<const float>();
  const float* l = c_.lp_lse.data_as<const float>();
  const float* tv = c_.lp_topv.data_as<const float>();
  const int32_t* ti = c_.lp_topi.data_as<const int32_t>();
  if (int64_t(lps_.size()) < rows) lps_.resize(size_t(rows));
  for (int64_t i = lo; i < rows; ++i) set_token_logprobs(lps_[size_t(i)], v[i], l[i], tv + i * top, ti + i * top, top);
}

void Decoder::after_commit(Request& r) {  // room for the next anchor?
  if (!r.done && r.main.length + 1 > max_len_) {
    r.finish_reason = "length";
    r.done = true;
  }
}

// ---------------- prefill, chunk by chunk; each chunk's features go to the drafter
void Decoder::prefill() {
  act_.clear();
  bool decoding = false;
  for (Request* r : running_) {
    if (r->done) continue;
    if (!r->prefilled) act_.push_back(r);
    else decoding = true;
  }
  if (act_.empty()) return;
  const double t0 = now();
  Target& tgt = *c_.target;
  Drafter* drafter = c_.drafter.get();
  const Features feats{c_.taps_buf, c_.fin};
  // This round's share of each prompt: everything, or while requests decode at most the
  // budget's tokens, the earliest admitted first (a prompt cut short continues next round).
  int64_t left = decoding && prefill_budget_ > 0 ? prefill_budget_ : INT64_MAX;
  size_t fed = 0;
  streams_.clear();
  toks_.clear();
  counts_.clear();
  fed0_.clear();
  ends_.clear();
  for (Request* r : act_) {
    if (left == 0) break;
    const int64_t rest = int64_t(r->prompt.size()) - r->prompt_fed;
    const int64_t take = std::min(rest, left);
    left -= take;
    if (r->prefill_rounds++ == 0) r->t_prefill0 = t0;
    streams_.push_back(&r->main);
    toks_.push_back(r->prompt.data() + r->prompt_fed);
    counts_.push_back(take);
    fed0_.push_back(r->prompt_fed);
    ends_.push_back(take == rest ? 1 : 0);
    r->prompt_fed += take;
    act_[fed++] = r;
  }
  act_.resize(fed);
  make_chunks(streams_, toks_, counts_, tgt.options().max_step_tokens, c_.chunks);
  for (auto& ch : c_.chunks)  // offsets within the prompt; `last`: the prompt's last token
    for (Piece& pc : ch) {
      pc.offset += fed0_[size_t(pc.seq)];
      pc.last = pc.last && ends_[size_t(pc.seq)];
    }
  struct PenaltyRowsOff {  // a chunk that fails leaves no penalty plan or masks behind
    Core& c;
    ~PenaltyRowsOff() { c.pen_rows = 0, c.mask_count = 0; }
  } pen_off{c_};
  for (const auto& ch : c_.chunks) {
    int64_t R = 0, T = 0;
    for (const auto& pc : ch) {
      R += pc.last ? 1 : 0;
      T += pc.n;
    }
    model::ForwardOutputs out;
    out.prompt = true;  // Engine prefill_gemm: the tensor-core numerics when on
    out.logits = c_.logits.slice(0, 0, R);
    out.tap_layers = c_.taps;
    if (c_.taps_buf.defined()) out.taps = c_.taps_buf.slice(0, 0, T);
    if (c_.fin.defined()) out.final_hidden = c_.fin.slice(0, 0, T);
    tgt.run_chunk(ch, out);
    c_.check_rows(R);  // the flags come back with the sampled tokens (CUDA: one copy)
    const int32_t* bad = c_.flags.data_as<const int32_t>();
    // the first token of every prompt that ends here (one draw each)
    int64_t r = 0;
    bool penalized = false;
    for (const auto& pc : ch)
      if (pc.last) {
        penalized = penalized || act_[size_t(pc.seq)]->penalized;
        plan_row(r++, *act_[size_t(pc.seq)], 1);
      }
    if (penalized) {
      r = 0;
      for (const auto& pc : ch)
        if (pc.last) plan_penalty_row(r++, act_[size_t(pc.seq)]);
      c_.pen_rows = R;
    }
    r = 0;
    for (const auto& pc : ch)  // structured output: the first token's mask
      if (pc.last) {
        Request& q = *act_[size_t(pc.seq)];
        if (q.p.constraint) plan_masks(q, nullptr, 0, r);
        ++r;
      }
    c_.sample_rows(R);
    c_.pen_rows = 0;
    c_.mask_count = 0;
    r = 0;
    int64_t top = -1;  // the most top tokens a request ending here asks for (-1: none asks)
    for (const auto& pc : ch) {
      if (!pc.last) continue;
      Request& q = *act_[size_t(pc.seq)];
      q.anchor = c_.s_out.data_as<const int32_t>()[r++];
      q.next.assign(q.prompt.begin() + 1, q.prompt.end());
      q.next.push_back(q.anchor);
      top = std::max(top, q.p.logprobs);
    }
    // the first tokens' log-probabilities (before the drafter's commit reuses any buffer)
    if (top >= 0) logprobs_of_rows(0, R, c_.s_out.data_as<const int32_t>(), top);
    if (drafter) {
      commits_.clear();
      int64_t row = 0;
      for (const auto& pc : ch) {
        const Request& q = *act_[size_t(pc.seq)];
        CommitRows cr;
        cr.slot = q.slot;
        cr.pos0 = pc.offset;
        cr.row0 = row;
        cr.n = pc.n;
        cr.next = pc.last ? q.next.data() + pc.offset : q.prompt.data() + pc.offset + 1;
        commits_.push_back(cr);
        row += pc.n;
      }
      drafter->commit(commits_, feats);
    }
    r = 0;
    for (const auto& pc : ch) {
      if (!pc.last) continue;
      Request& q = *act_[size_t(pc.seq)];
      q.prefilled = true;
      if (q.done) {  // failed here already (its constraint)
      } else if (bad[r]) {
        q.done = true;
        q.finish_reason = "error";
        sink_.on_error(q, numerical_error(q, "the prefill", -1, r));
      } else {
        emit(q, &q.anchor, 1, top >= 0 ? &lps_[size_t(r)] : nullptr);
        after_commit(q);
        keep_prompt(q);  // later prompts take what it has filled already
      }
      ++r;
    }
    count_emitted();
  }
  const double t1 = now();
  for (Request* r : act_)
    if (r->prefilled && r->t_prefilled == 0) {
      r->prefill_s = t1 - r->t_prefill0;
      r->t_prefilled = t1;
    }
  // the decoding requests waited for these prompts (their decode_s runs on meanwhile)
  for (Request* r : running_)
    if (r->prefilled && r->t_prefilled < t0 && !r->done) r->prefill_wait_s += t1 - t0;
}

// ---------------- draft / verify / accept / commit
void Decoder::step() {
  Target& tgt = *c_.target;
  Drafter* drafter = c_.drafter.get();
  act_.clear();
  for (Request* r : running_)
    if (r->prefilled && !r->done) act_.push_back(r);
  if (act_.empty()) return;
  const int64_t S = int64_t(act_.size());
  const double t_step = now();
  // 0. how far to speculate this step (adaptive: from the batch size and the acceptance so far)
  const int64_t k_adapt = drafter ? policy_.choose(S) : 0;
  // The whole step as one unit when it can be (Target::recorder): the draft forward, the
  // verify chunk, the non-finite check and acceptance are queued as they are planned and run
  // together when acceptance is reached -- one CUDA graph on a GPU, in order on the CPU (so
  // the CPU tests cover the queued path). The MTP chain's positions are queued too (each with
  // its plan in a buffer of its own). Under tensor parallelism every rank's part of the step
  // is one unit of that rank (Target::flush_step; MTP's chain is not recorded there). Not a
  // verify pass that might need several chunks.
  struct PenaltyRowsOff {  // a step that fails leaves no penalty plan or masks behind
    Core& c;
    ~PenaltyRowsOff() { c.pen_rows = 0, c.mask_count = 0; }
  } pen_off{c_};
  // Structured output: the verify rows' masks follow from the drafts, read on the host between
  // the draft and acceptance, so such a step runs eagerly (not as one unit)
  bool constrained = false;
  for (Request* r : act_) constrained = constrained || r->p.constraint != nullptr;
  StepRecorder& rec = tgt.recorder();
  const bool record =
      c_.records_steps() && S * (c_.K + 1) <= tgt.options().max_step_tokens && !constrained;
  // A recorded step is padded to the next batch-size bucket (Target::bucket) when that is
  // on: P padding sequences after the real ones, each drafting greedily from a real slot's
  // context and verified on the target's padding stream; nothing of them is read back, and
  // the step's shapes -- so its graph -- are the bucket's whatever the batch size inside it.
  int64_t P = 0;
  if (record && tgt.options().pad_to_buckets && (!drafter || drafter->pads_steps())) {
    const int64_t Sb = tgt.bucket(S);
    if (Sb * (c_.K + 1) <= tgt.options().max_step_tokens) P = Sb - S;
  }
  if (int64_t(pad_tokens_.size()) < c_.K + 1) pad_tokens_.assign(size_t(c_.K + 1), 0);
  struct CancelOnThrow {  // a step that fails before its flush leaves nothing queued
    StepRecorder& r;
    ~CancelOnThrow() {
      if (r.recording()) r.cancel();
    }
  } cancel_on_throw{rec};
  // 1. draft. The phases' times come from marks (Core::marks): on a GPU, events on the
  // device's timeline read after the step's one wait; on the CPU, the host's clock.
  // In a recorded step every mark is a piece of the step's graph, so draft_s is the draft
  // forward inside it; eager work the drafter does before the graph counts as host_s.
  c_.marks.reset();
  if (record) {
    rec.begin();
    rec.add("mark0|", c_.marks.deferred(0));
  } else {
    c_.marks.mark(0);
  }
  const DraftResult* dr = nullptr;
  if (drafter) {
    jobs_.clear();
    for (Request* r : act_) {
      DraftJob j;
      j.slot = r->slot;
      j.anchor = r->anchor;
      j.room = max_len_ - r->main.length - 1;
      j.max_tokens = std::min(j.room, r->adaptive ? k_adapt : c_.K);
      j.temperature = r->p.temperature;
      j.rng_key = r->rng_key;
      j.rng_counter = &r->rng_counter;
      penalty_of(r, j);
      jobs_.push_back(j);
    }
    if (P > 0) {  // padding: the first job that drafts (or job 0), greedily, taking no draws
      DraftJob pad = jobs_[0];
      for (const DraftJob& j : jobs_)
        if (j.room >= c_.K && j.max_tokens >= 1) {
          pad = j;
          break;
        }
      pad.pad = true;
      pad.pen_row = -1;
      pad.temperature = 0.0f;
      pad.rng_key = 0;
      pad.rng_counter = &pad_counter_;
      for (int64_t p = 0; p < P; ++p) jobs_.push_back(pad);
    }
    dr = &drafter->draft(jobs_);
  }
  if (record)
    rec.add("mark1|", c_.marks.deferred(1));
  else
    c_.marks.mark(1);
  if (constrained && dr && dr->dev_tokens.defined()) drafter->fetch_host();  // the masks read the drafts
  // the drafts' lengths as verified: the drafter's, or what a constraint steered them to
  lens_.clear();
  if (dr) lens_.assign(dr->len.begin(), dr->len.end());
  if (constrained && dr) steer_drafts(*dr);

  // 2. verify [anchor, d_1..d_k] in one target pass (chunked if it exceeds max_step_tokens).
  // The drafts are not read here: the plan holds references to them (-1 - their index in
  // the drafter's output, ops::resolve_tokens), filled in where the drafts are -- on the
  // device for a drafter there, inside the verify chunk's graph -- so nothing waits for the
  // draft to finish before the verify pass is queued. They come back with the results.
  streams_.clear();
  toks_.clear();
  counts_.clear();
  // a drafter on the device left its outputs there too (dev_*): verify and acceptance read those
  const bool on_dev = dr && dr->dev_tokens.defined();
  const Tensor draft_src = dr ? (on_dev ? dr->dev_tokens : dr->tokens) : Tensor();
  for (int64_t k = 0; k < S; ++k) {
    Request& r = *act_[size_t(k)];
    r.verify.assign(1, r.anchor);
    if (dr && lens_[size_t(k)] > 0) {
      const int64_t first = dr->row[size_t(k)] * draft_src.stride(0);
      for (int64_t j = 0; j < lens_[size_t(k)]; ++j) r.verify.push_back(int32_t(-1 - (first + j)));
    }
    streams_.push_back(&r.main);
    toks_.push_back(r.verify.data());
    counts_.push_back(int64_t(r.verify.size()));
  }
  for (int64_t p = 0; p < P; ++p) {  // padding: the anchor and its draft's length, as plain ids 0
    streams_.push_back(&tgt.pad_stream());
    toks_.push_back(pad_tokens_.data());
    counts_.push_back(1 + (dr ? dr->len[size_t(S + p)] : 0));
  }
  make_chunks(streams_, toks_, counts_, tgt.options().max_step_tokens, c_.chunks);
  DFLASH2_INTERNAL(!record || c_.chunks.size() == 1, "a recorded step's verify pass takes ", c_.chunks.size(),
                   " chunks");
  // The verify rows' positions, for a drafter updating its state inside the step -- when
  // something was drafted: at k = 0 the committed rows wait per slot as before (a drafter
  // costs nothing while the policy drafts nothing).
  bool drafted = false;
  for (int64_t n : counts_) drafted = drafted || n > 1;
  const bool update_in_step = record && drafter && drafted;
  if (update_in_step) {
    step_rows_.clear();
    for (size_t k = 0; k < streams_.size(); ++k) {
      Drafter::StepRows sr;
      sr.slot = int64_t(k) < S ? act_[k]->slot : -1;
      sr.pos0 = int64_t(k) < S ? act_[k]->main.length : 0;
      sr.n = counts_[k];
      step_rows_.push_back(sr);
    }
  }
  // Every request greedy (tensor parallelism, or one GPU): the verify pass returns each row's
  // argmax (each rank's vocabulary shard reduced to (max, id) pairs, gathered and merged on
  // rank 0) and its non-finite flag instead of the full logits: N x R x 2 floats cross the
  // link instead of R x V, and acceptance reads the ids (ops::accept_greedy). On one GPU the
  // same path saves launches: one pass over the logits (argmax_shard: argmax and the flag)
  // and a three-kernel acceptance, instead of check_finite and accept over the logits.
  // Log-probabilities read the logits rows after acceptance: under tensor parallelism a step
  // with a request that asks for them gathers the logits (one GPU keeps them either way).
  int64_t lp_top = -1;
  for (Request* r : act_) lp_top = std::max(lp_top, r->p.logprobs);
  bool argmax_only = c_.ids.defined() && (lp_top < 0 || tgt.tp_size() == 1);
  bool penalized = false;  // a request with penalties: acceptance reads the penalized logits
  for (Request* r : act_) penalized = penalized || r->penalized;
  for (int64_t k = 0; k < S && argmax_only; ++k) argmax_only = act_[size_t(k)]->p.temperature <= 0.0f;
  argmax_only = argmax_only && !penalized && !constrained;
  int64_t row0 = 0;
  for (const auto& ch : c_.chunks) {
    int64_t T = 0;
    for (const auto& pc : ch) T += pc.n;
    model::ForwardOutputs out;
    if (argmax_only) {
      out.argmax_only = true;
      out.argmax = c_.ids.slice(0, row0, row0 + T);
      out.argmax_flags = c_.flags_out(row0, row0 + T);
      if (tgt.tp_size() == 1) out.logits = c_.logits.slice(0, row0, row0 + T);  // the projection's buffer
    } else {
      out.logits = c_.logits.slice(0, row0, row0 + T);
    }
    out.all_logits = true;
    out.tap_layers = c_.taps;
    if (c_.taps_buf.defined()) out.taps = c_.taps_buf.slice(0, row0, row0 + T);
    if (c_.fin.defined()) out.final_hidden = c_.fin.slice(0, row0, row0 + T);
    tgt.run_chunk(ch, out, draft_src);
    row0 += T;
  }
  // the padding stream starts at 0 again (its blocks stay pinned; what was planned holds)
  if (P > 0) tgt.cache().truncate(tgt.pad_stream(), 0);
  // the drafter's context: the verified rows appended inside the step when it can
  if (update_in_step) drafter->append_in_step(step_rows_, Features{c_.taps_buf, c_.fin});
  if (!argmax_only) c_.check_rows(row0);  // the flags come back with the acceptance results (CUDA: one copy)
  const int32_t* bad = c_.flags.data_as<const int32_t>();
  if (record)
    rec.add("mark2|", c_.marks.deferred(2));
  else
    c_.marks.mark(2);

  // 3. accept (greedy: longest matching prefix; sampling: lossless rejection sampling)
  const Tensor& drafts = dr ? dr->tokens : c_.no_drafts;
  {
    int64_t row = 0;
    for (int64_t k = 0; k < S; ++k) {
      Request& r = *act_[size_t(k)];
      const int64_t kk = int64_t(r.verify.size()) - 1;
      c_.a_row0.data_as<int32_t>()[k] = int32_t(row);
      c_.a_draft_row.data_as<int32_t>()[k] = dr ? int32_t(dr->row[size_t(k)]) : 0;
      c_.a_draft_len.data_as<int32_t>()[k] = int32_t(kk);
      plan_row(k, r, uint64_t(drafts.shape(1) + 1));
      row += kk + 1;
    }
    for (int64_t k = S; k < S + P; ++k) {  // padding rows: greedy, their results are dropped
      const int64_t kk = counts_[size_t(k)] - 1;
      c_.a_row0.data_as<int32_t>()[k] = int32_t(row);
      c_.a_draft_row.data_as<int32_t>()[k] = dr ? int32_t(dr->row[size_t(k)]) : 0;
      c_.a_draft_len.data_as<int32_t>()[k] = int32_t(kk);
      c_.s_temp.data_as<float>()[k] = 0.0f;
      c_.s_topp.data_as<float>()[k] = 1.0f;
      c_.s_topk.data_as<int32_t>()[k] = 0;
      c_.s_rng.data_as<int64_t>()[2 * k] = 0;
      c_.s_rng.data_as<int64_t>()[2 * k + 1] = 0;
      row += kk + 1;
    }
    if (penalized) {  // row k of the penalty plan: sequence k's (padding: none)
      for (int64_t k = 0; k < S + P; ++k) plan_penalty_row(k, k < S ? act_[size_t(k)] : nullptr);
      c_.pen_rows = S + P;
    }
    if (constrained) {  // the constrained requests' masks, over their verify rows (the verify pass runs meanwhile)
      int64_t mrow = 0;
      for (int64_t k = 0; k < S; ++k) {
        Request& r = *act_[size_t(k)];
        const int64_t kk = int64_t(r.verify.size()) - 1;
        if (r.p.constraint) {
          const int32_t* d =
              kk > 0 ? dr->tokens.data_as<const int32_t>() + dr->row[size_t(k)] * dr->tokens.stride(0) : nullptr;
          plan_masks(r, d, kk, mrow);
        }
        mrow += kk + 1;
      }
    }
    const bool with_q = dr && dr->has_q;
    // a drafter whose state follows from what is accepted (MTP) may update it inside the step
    std::function<void(const Drafter::StepAcceptance&)> in_step;
    if (update_in_step)
      in_step = [&](const Drafter::StepAcceptance& a) {
        drafter->commit_in_step(step_rows_, Features{c_.taps_buf, c_.fin}, a);
      };
    c_.accept_rows(row, S + P, on_dev ? dr->dev_tokens : drafts,
                   with_q ? (on_dev ? dr->dev_cand : dr->cand) : Tensor(),
                   with_q ? (on_dev ? dr->dev_q : dr->q) : Tensor(), in_step,
                   argmax_only ? c_.ids.slice(0, 0, row) : Tensor());
    c_.pen_rows = 0;
    c_.mask_count = 0;
    if (argmax_only) tgt.count_argmax_step();
  }
  // the results are back (the step's one wait): every mark is complete
  if (P > 0) tgt.count_padding(P);
  const double t_draft = c_.marks.seconds(0, 1), t_verify = c_.marks.seconds(1, 2),
               t_accept = c_.marks.seconds(2, 3);
  // the committed tokens' log-probabilities, for the requests that asked for them: row j of
  // a request holds the target's distribution after its j-th verify token, so its committed
  // token there is draft j + 1 while j < accepted, then the bonus (other rows: any id)
  // (over the rows from the first to the last committed row of those requests)
  if (lp_top >= 0) {
    int64_t row = 0, lo = -1, hi = 0;
    lp_ids_.clear();
    for (int64_t k = 0; k < S; ++k) {
      const Request& r = *act_[size_t(k)];
      const int64_t kk = int64_t(r.verify.size()) - 1;
      const int64_t a = std::max<int64_t>(0, std::min<int64_t>(c_.a_accepted.data_as<const int32_t>()[k], kk));
      const int32_t* d = a > 0 ? c_.drafts_host.data_as<const int32_t>() + dr->row[size_t(k)] * c_.drafts_host.stride(0)
                               : nullptr;
      for (int64_t j = 0; j <= kk; ++j)
        lp_ids_.push_back(j < a ? d[j] : j == a ? c_.a_bonus.data_as<const int32_t>()[k] : 0);
      if (r.p.logprobs >= 0) {
        if (lo < 0) lo = row;
        hi = row + a + 1;
      }
      row += kk + 1;
    }
    logprobs_of_rows(lo, hi, lp_ids_.data(), lp_top);
  }
  // 4. commit anchor + the accepted tokens; roll back the rest of the verify pass
  commits_.clear();
  drafted_.clear();
  accepted_.clear();
  int64_t row = 0, committed = 0;
  for (int64_t k = 0; k < S; ++k) {
    Request& r = *act_[size_t(k)];
    const int64_t kk = int64_t(r.verify.size()) - 1;
    int64_t bad_row = -1;
    for (int64_t j = 0; j <= kk && bad_row < 0; ++j)
      if (bad[row + j]) bad_row = row + j;
    if (r.done) {  // failed in this step already (its constraint): nothing of it is committed
      drafted_.push_back(0);
      accepted_.push_back(0);
      row += kk + 1;
      continue;
    }
    if (bad_row >= 0) {  // this request's logits are garbage: it fails, the others go on
      r.done = true;
      r.finish_reason = "error";
      sink_.on_error(r, numerical_error(r, "a decode step", steps_, bad_row));
      drafted_.push_back(0);
      accepted_.push_back(0);
      row += kk + 1;
      continue;
    }
    const int64_t a = c_.a_accepted.data_as<const int32_t>()[k];
    const int32_t bonus = c_.a_bonus.data_as<const int32_t>()[k];
    const int64_t L = r.main.length - (kk + 1);
    tgt.cache().truncate(r.main, L + a + 1);
    r.committed += a + 1;
    committed += a + 1;
    drafted_.push_back(kk);
    accepted_.push_back(a);
    for (int64_t j = 0; j < a && j < c_.K; ++j) r.accepted_at[size_t(j)] += 1;
    r.verify_steps += 1;
    // the accepted drafts: from the drafter's host tensor, or the copy that came back with
    // the results (Core::drafts_host, same rows)
    r.next.clear();
    if (a > 0) {
      const int32_t* d = c_.drafts_host.data_as<const int32_t>() + dr->row[size_t(k)] * c_.drafts_host.stride(0);
      r.next.assign(d, d + a);
    }
    r.next.push_back(bonus);
    emit(r, r.next.data(), int64_t(r.next.size()), lp_top >= 0 ? &lps_[size_t(row)] : nullptr);
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
  count_emitted();
  const double dt = now() - t_step;
  for (Request* r : act_) {
    r->draft_s += t_draft;
    r->verify_s += t_verify;
    r->accept_s += t_accept;
  }
  policy_.record(S, k_adapt, row, dt, drafted_, accepted_);
  if (debug_spec_)  // DFLASH2_DEBUG_SPEC=1: one line per step on stderr
    std::fprintf(stderr, "step %lld S=%lld k=%lld T=%lld dt=%.3fms committed=%lld pred(k)=%.3fms\n", (long long)steps_,
                 (long long)S, (long long)k_adapt, (long long)row, dt * 1e3, (long long)committed,
                 policy_.predicted_time(S, k_adapt) * 1e3);
  // recent figures
  const double w = steps_ < 8 ? 1.0 / double(steps_ + 1) : 0.1;
  step_time_ += w * (dt - step_time_);
  tok_s_ += w * (double(committed) / std::max(dt, 1e-9) - tok_s_);
  acc_len_ += w * (double(committed) / double(S) - acc_len_);
  draft_len_ += w * (double(drafter ? k_adapt : 0) - draft_len_);
  ++steps_;
}

}  // namespace dflash2::runtime
