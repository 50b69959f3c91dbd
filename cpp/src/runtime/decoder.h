// The decoder: the running batch of the engine, one step at a time (continuous batching).
// Requests join between steps (admit: a free slot and their whole cache reserved up
// front, so a running request never runs out of pages), are prefilled (chunked, each
// sampling its first token), then every step() is one draft -> verify -> accept -> commit
// round for all of them; a request leaves when it ends (retire frees its slot and pages).
// Runs on the scheduler thread only; tokens leave through a Sink.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "dflash2/engine.h"
#include "runtime/core.h"
#include "runtime/prefix_cache.h"
#include "runtime/spec_policy.h"

namespace dflash2::runtime {

// One request, from submit to its final result.
struct Request {
  RequestId id = 0;
  std::vector<int32_t> prompt;
  SamplingParams p;
  std::vector<int32_t> stops;
  uint64_t rng_key = 0;
  bool adaptive = true;  // may take adaptive draft lengths (greedy, or sampled without a seed)
  bool penalized = false;  // asks for penalties, a logit bias or min_tokens (Core::pen_*)
  // ---- decoder state (scheduler thread only)
  int slot = -1;
  CacheStream main;
  int32_t anchor = 0;  // last emitted token: not yet in the target cache
  bool prefilled = false, done = false;
  int64_t prompt_fed = 0, prefill_rounds = 0;  // prompt tokens in the cache; rounds they took
  int64_t cached_tokens = 0;                   // of them, taken from the prefix cache
  std::vector<int32_t> prefix_entries;         // the prefix cache's entries it holds
  uint64_t rng_counter = 0;
  std::vector<int32_t> next, verify;  // tokens after the committed positions; [anchor, drafts...]
  std::vector<int32_t> tokens;        // everything generated
  std::string finish_reason;
  int64_t committed = 0, verify_steps = 0;
  std::vector<int64_t> accepted_at;
  double prefill_s = 0, draft_s = 0, verify_s = 0, t_prefilled = 0, t_prefill0 = 0;
  double prefill_wait_s = 0, accept_s = 0;  // decoding, waiting for other requests' prompts (Decoder::prefill)
  std::vector<TokenLogprobs> logprobs;  // of `tokens` (p.logprobs >= 0)
  std::vector<int32_t> staged;  // committed, not yet handed to the clients (Scheduler::publish_locked)
  std::vector<TokenLogprobs> staged_lp;  // theirs (p.logprobs >= 0)
  // ---- shared with clients (guarded by the scheduler's mutex)
  std::vector<int32_t> unread;
  std::vector<TokenLogprobs> unread_lp;
  std::vector<std::condition_variable*> waiters;  // the polls waiting on this request
  bool finished = false, cancel_requested = false, detached = false, reported = false;
  GenerationResult result;
  std::exception_ptr error;
};

class Decoder {
 public:
  struct Sink {
    virtual ~Sink() = default;
    // committed, in order (lps: their log-probabilities when the request asked for them, else null)
    virtual void on_tokens(Request& r, const int32_t* toks, int64_t n, const TokenLogprobs* lps) = 0;
    virtual void on_error(Request& r, std::exception_ptr e) = 0;            // r fails (r.done is set)
  };
  Decoder(Core& core, Sink& sink, bool adaptive);

  int64_t free_slots() const;
  const std::vector<Request*>& running() const { return running_; }
  // Takes a slot and reserves the request's cache; false (nothing taken) if none is free, or
  // if its prompt should wait for a running prompt's prefill (waits_for_a_prefill).
  bool admit(Request* r);
  // The prompts of admitted requests not prefilled yet: all of them whole, or, while other
  // requests are decoding and a budget is set, at most that many of their tokens (in
  // admission order; a prompt cut short continues in the next round).
  void prefill();
  // Prompt tokens per round while requests decode (0 = no limit).
  void set_prefill_budget(int64_t tokens) { prefill_budget_ = tokens; }
  int64_t prefilling() const;  // running requests whose prompts are partly run
  // Automatic prefix caching (prefix_cache.h) over the target's cache and the drafter's;
  // generated: a request that ends keeps the blocks of its generated tokens too (its prompt
  // and output as one prefix, for a later prompt that continues it), for engines whose
  // decode rows are bitwise what a prompt's prefill computes (EngineConfig::prefix_cache_generated).
  void enable_prefix_cache(bool generated = false);
  const PrefixCache* prefix_cache() const { return prefix_.get(); }
  void step();      // one round for the running requests not done
  void retire(Request* r);  // frees its slot and pages; fills its stats
  void retire_all();

  // recent figures (EWMA) for metrics
  double step_time_s() const { return step_time_; }
  double tokens_per_second() const { return tok_s_; }
  double acceptance_length() const { return acc_len_; }
  double draft_len() const { return draft_len_; }
  int64_t steps() const { return steps_; }
  const SpecPolicy& policy() const { return policy_; }
  // Every step drafts min(k, K) tokens for its adaptive requests (the load-time warm-up).
  void force_draft_len(int64_t k) { policy_.force(k); }

 private:
  void plan_row(int64_t row, Request& q, uint64_t draws);
  // its filled prompt blocks into the prefix cache (at the end: with cache_generated_, the
  // generated tokens' blocks too)
  void keep_prompt(Request& r, bool hold = true);
  // With prefix caching: whether r's prompt starts like the prompt of a running request whose
  // prefill has not ended, with more whole blocks in common than the cache holds now: then r
  // is admitted after that prefill and takes those blocks instead of running them beside it
  // (n choices of one prompt, a batch sharing a system prompt).
  bool waits_for_a_prefill(const Request& r) const;
  void emit(Request& r, const int32_t* toks, int64_t count, const TokenLogprobs* lps = nullptr);
  // The log-probabilities of the tokens at logits rows [lo, rows) (ids[i]: row i's token;
  // top: the most likely tokens per row) into lps_[lo, rows), for the requests that asked.
  void logprobs_of_rows(int64_t lo, int64_t rows, const int32_t* ids, int64_t top);
  void after_commit(Request& r);
  // Penalty row `row` of the step's plan for q (a table row of its own when it is penalized,
  // else -1; min_left from the tokens it has generated).
  void plan_penalty_row(int64_t row, const Request* q);
  void count_emitted();  // the tokens emit() noted for penalized requests into their counts
  void fail_request(Request& r, std::exception_ptr e);  // r ends with e (the others go on)
  // Structured output: r's masks for logits rows row .. (after its n drafts, host ids) into
  // Core::mask_bits / mask_rows from Core::mask_count on (which grows by the rows filled);
  // a constraint that throws or misbehaves fails r (nothing masked for it).
  int64_t plan_masks(Request& r, const int32_t* drafts, int64_t n, int64_t row);
  void steer_drafts(const DraftResult& dr);  // TokenConstraint::steer over lens_ (greedy requests)
  std::vector<int64_t> lens_;   // this step's draft lengths (per job)
  std::vector<int32_t> steer_;  // steer_drafts' drafts

  Core& c_;
  Sink& sink_;
  SpecPolicy policy_;
  std::vector<Request*> slots_;    // slot -> request (null: free)
  std::vector<Request*> running_;  // admitted, in admission order
  int64_t max_len_ = 0, steps_ = 0, prefill_budget_ = 0;
  bool debug_spec_ = false;
  double step_time_ = 0, tok_s_ = 0, acc_len_ = 0, draft_len_ = 0;
  // host bookkeeping reused across steps
  std::vector<Request*> act_;
  std::vector<DraftJob> jobs_;
  std::vector<CommitRows> commits_;
  std::vector<int64_t> counts_, drafted_, accepted_, fed0_;
  std::vector<char> ends_;
  std::vector<CacheStream*> streams_;
  std::vector<const int32_t*> toks_;
  std::vector<Drafter::StepRows> step_rows_;
  std::unique_ptr<PrefixCache> prefix_;
  bool cache_generated_ = false;
  std::vector<int32_t> seq_;  // keep_prompt: prompt + generated tokens
  std::vector<int32_t> pad_tokens_;  // a padding sequence's verify ids (zeros)
  std::vector<int32_t> lp_ids_;       // logprobs_of_rows' ids
  std::vector<int32_t> pen_slots_, pen_ids_;  // emitted tokens of penalized requests (count_emitted)
  std::vector<TokenLogprobs> lps_;    // its results, one per row
  uint64_t pad_counter_ = 0;         // padding drafts take no draws; their counter lands here
};

}  // namespace dflash2::runtime
