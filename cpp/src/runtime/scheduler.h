// The scheduler: the engine's own thread, fed by a request queue. Between steps it drops
// cancelled requests, admits waiting ones while the decoder has slots (and their cache
// fits), prefills them (while others decode, at most prefill_budget prompt tokens a round:
// a long prompt continues over the next rounds, so the running streams wait one chunk per
// step, not the whole prompt), and runs one step of the running batch; tokens are handed to the
// requests' records, which any number of client threads poll. The model runs only on this
// thread (under the engine's model mutex, which the step-level API also takes).
//
// Handing tokens over costs the step loop one lock per phase, whatever the batch: the
// decoder's commits are staged in the requests (scheduler thread only) and published under
// the mutex once after the prompts and once after the step, and a poll sleeps on a condition
// variable of its own, registered with the requests it waits for, so a request's news wakes
// only its pollers: S wakeups a step for S requests with a poller each. (One broadcast
// variable, notified at every request's tokens, woke every sleeping poller S times a step,
// S^2 wakeups issued from the step loop. On the 2-core CPU machine the change did not move
// bench_concurrency's host time measurably: there the Python client threads' own work
// dominates it.)
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "dflash2/error.h"
#include "runtime/decoder.h"

namespace dflash2::runtime {

using RequestFailed = RequestError;

class Scheduler final : public Decoder::Sink {
 public:
  // model_mutex: held while the model runs (a step, or the step-level API).
  // prefill_budget: prompt tokens run between two decode steps while requests decode (0 =
  // no limit; Decoder::prefill).
  // prefix_caching: the decoder keeps prompts' blocks for later prompts (prefix_cache.h);
  // cache_generated: and the generated tokens' blocks too (Decoder::enable_prefix_cache).
  Scheduler(Core& core, std::mutex& model_mutex, bool adaptive, int64_t prefill_budget = 0,
            bool prefix_caching = false, bool cache_generated = false);
  ~Scheduler() override;

  // Takes a validated request; returns its id.
  RequestId submit(std::unique_ptr<Request> r);
  std::vector<RequestUpdate> poll(const std::vector<RequestId>& ids, double timeout_s);
  void cancel(RequestId id);
  void close();  // cancels everything and joins the thread (idempotent)
  bool closed() const;
  EngineMetrics metrics() const;

  // Decoder::Sink (scheduler thread)
  void on_tokens(Request& r, const int32_t* toks, int64_t n, const TokenLogprobs* lps) override;  // staged, published later
  void on_error(Request& r, std::exception_ptr e) override;

 private:
  void loop();
  void finish_locked(Request& r);  // r has ended: publish the result
  void publish_locked();           // the staged tokens -> the requests' unread; wakes their pollers
  static void wake_locked(Request& r);
  bool has_news_locked(const Request& r) const;
  void snap_cache_locked();  // the cache figures of snap_ (scheduler thread, under mu_)

  Core& core_;
  std::mutex& model_mu_;
  Decoder dec_;
  mutable std::mutex mu_;
  std::condition_variable work_cv_;
  std::vector<Request*> staged_;  // requests with staged tokens (scheduler thread)
  std::deque<Request*> waiting_;
  // shared: a poller keeps a request alive while it waits, even if the scheduler drops the
  // record meanwhile (a cancelled request ending)
  std::unordered_map<RequestId, std::shared_ptr<Request>> records_;
  RequestId next_id_ = 1;
  bool stop_ = false;
  int64_t requests_total_ = 0, requests_finished_ = 0, requests_cancelled_ = 0, tokens_total_ = 0;
  EngineMetrics snap_;  // the decoder's recent figures, copied under mu_ after each step
  std::thread thread_;
};

}  // namespace dflash2::runtime
