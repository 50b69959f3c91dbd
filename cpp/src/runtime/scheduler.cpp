#include "runtime/scheduler.h"

#include <algorithm>
#include <chrono>

#include "dflash2/error.h"

namespace dflash2::runtime {

Scheduler::Scheduler(Core& core, std::mutex& model_mutex, bool adaptive, int64_t prefill_budget,
                     bool prefix_caching, bool cache_generated)
    : core_(core), model_mu_(model_mutex), dec_(core, *this, adaptive) {
  dec_.set_prefill_budget(prefill_budget);
  if (prefix_caching) dec_.enable_prefix_cache(cache_generated);
  snap_cache_locked();  // (the thread does not run yet)
  thread_ = std::thread([this] { loop(); });
}

Scheduler::~Scheduler() { close(); }

bool Scheduler::closed() const {
  std::lock_guard<std::mutex> lk(mu_);
  return stop_;
}

RequestId Scheduler::submit(std::unique_ptr<Request> r) {
  std::lock_guard<std::mutex> lk(mu_);
  DFLASH2_CHECK_ARG(!stop_, "the engine is closed: no new requests");
  const RequestId id = next_id_++;
  r->id = id;
  Request* p = r.get();
  records_[id] = std::shared_ptr<Request>(std::move(r));
  waiting_.push_back(p);
  ++requests_total_;
  work_cv_.notify_one();
  return id;
}

bool Scheduler::has_news_locked(const Request& r) const {
  return !r.unread.empty() || (r.finished && !r.reported);
}

std::vector<RequestUpdate> Scheduler::poll(const std::vector<RequestId>& ids, double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  std::vector<std::shared_ptr<Request>> rs;
  for (RequestId id : ids) {
    auto it = records_.find(id);
    DFLASH2_CHECK_ARG(it != records_.end(), "poll: unknown request id ", id,
                      " (never submitted, cancelled, or its final update was already returned)");
    rs.push_back(it->second);
  }
  auto any_news = [&] {
    for (const auto& r : rs)
      if (has_news_locked(*r)) return true;
    return false;
  };
  if (timeout_s != 0 && !any_news()) {  // sleep until one of these requests has news
    std::condition_variable cv;
    for (const auto& r : rs) r->waiters.push_back(&cv);
    if (timeout_s < 0)
      cv.wait(lk, any_news);
    else
      cv.wait_for(lk, std::chrono::duration<double>(timeout_s), any_news);
    for (const auto& r : rs) r->waiters.erase(std::find(r->waiters.begin(), r->waiters.end(), &cv));
  }
  // a request that failed: its error, once
  for (const auto& r : rs)
    if (r->finished && r->error && !r->reported) {
      r->reported = true;
      std::exception_ptr e = r->error;
      const RequestId id = r->id;
      records_.erase(id);
      lk.unlock();
      try {
        std::rethrow_exception(e);
      } catch (const Error& err) {
        throw RequestFailed(err.kind(), err.what(), id);
      } catch (const std::bad_alloc&) {
        throw RequestFailed(ErrorKind::OutOfMemory, "out of host memory while running the request", id);
      } catch (const std::exception& ex) {
        throw RequestFailed(ErrorKind::Internal, ex.what(), id);
      }
    }
  std::vector<RequestUpdate> out;
  for (const auto& r : rs) {
    if (!has_news_locked(*r)) continue;
    RequestUpdate u;
    u.id = r->id;
    u.new_tokens.swap(r->unread);
    u.new_logprobs.swap(r->unread_lp);
    if (r->finished) {
      u.finished = true;
      u.result = r->result;
      r->reported = true;
    }
    out.push_back(std::move(u));
    if (r->reported) records_.erase(r->id);
  }
  return out;
}

void Scheduler::cancel(RequestId id) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = records_.find(id);
  if (it == records_.end()) return;
  std::shared_ptr<Request> keep = it->second;
  Request* r = keep.get();
  if (r->finished) {
    records_.erase(it);
    return;
  }
  auto w = std::find(waiting_.begin(), waiting_.end(), r);
  if (w != waiting_.end()) {  // never admitted: ends now
    waiting_.erase(w);
    r->finish_reason = "cancelled";
    r->result.finish_reason = "cancelled";
    r->result.stats.prompt_tokens = int64_t(r->prompt.size());
    r->detached = true;
    finish_locked(*r);
    return;
  }
  r->cancel_requested = true;  // running: ends at the next step boundary
  r->detached = true;
  work_cv_.notify_one();
}

void Scheduler::finish_locked(Request& r) {
  r.finished = true;
  ++requests_finished_;
  if (r.result.finish_reason == "cancelled" || r.finish_reason == "cancelled") ++requests_cancelled_;
  wake_locked(r);                      // a poller still waiting on it gets the final update
  if (r.detached) records_.erase(r.id);  // (it holds its own reference); nobody polls it later
}

void Scheduler::wake_locked(Request& r) {
  for (std::condition_variable* cv : r.waiters) cv->notify_one();
}

void Scheduler::on_tokens(Request& r, const int32_t* toks, int64_t n, const TokenLogprobs* lps) {
  if (r.staged.empty()) staged_.push_back(&r);
  r.staged.insert(r.staged.end(), toks, toks + n);
  if (lps) r.staged_lp.insert(r.staged_lp.end(), lps, lps + n);
}

void Scheduler::publish_locked() {
  for (Request* r : staged_) {
    r->unread.insert(r->unread.end(), r->staged.begin(), r->staged.end());
    tokens_total_ += int64_t(r->staged.size());
    r->staged.clear();
    for (TokenLogprobs& lp : r->staged_lp) r->unread_lp.push_back(std::move(lp));
    r->staged_lp.clear();
    wake_locked(*r);
  }
  staged_.clear();
}

void Scheduler::on_error(Request& r, std::exception_ptr e) {
  std::lock_guard<std::mutex> lk(mu_);
  r.error = e;
}

void Scheduler::close() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!stop_) {
      stop_ = true;
      while (!waiting_.empty()) {
        Request* r = waiting_.front();
        waiting_.pop_front();
        r->finish_reason = "cancelled";
        r->result.finish_reason = "cancelled";
        r->result.stats.prompt_tokens = int64_t(r->prompt.size());
        finish_locked(*r);
      }
      work_cv_.notify_all();
    }
  }
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& kv : records_) wake_locked(*kv.second);
}

EngineMetrics Scheduler::metrics() const {
  std::lock_guard<std::mutex> lk(mu_);
  EngineMetrics m;
  m.queue_length = int64_t(waiting_.size());
  m.prefilling = snap_.prefilling;
  m.prefix_cache_pages = snap_.prefix_cache_pages;
  m.prefix_cache_hit_tokens = snap_.prefix_cache_hit_tokens;
  m.prefix_cache_query_tokens = snap_.prefix_cache_query_tokens;
  m.prefix_cache_evictions = snap_.prefix_cache_evictions;
  m.running = requests_total_ - requests_finished_ - m.queue_length;
  m.requests_total = requests_total_;
  m.requests_finished = requests_finished_;
  m.requests_cancelled = requests_cancelled_;
  m.generated_tokens_total = tokens_total_;
  m.steps_total = snap_.steps_total;
  m.tokens_per_second = snap_.tokens_per_second;
  m.acceptance_length = snap_.acceptance_length;
  m.step_time_s = snap_.step_time_s;
  m.draft_len = snap_.draft_len;
  m.cache_pages_used = snap_.cache_pages_used;
  m.cache_pages_total = snap_.cache_pages_total;
  return m;
}

void Scheduler::loop() {
  ops::CpuThreadScope threads(core_.num_threads);
  std::vector<Request*> ended;
  while (true) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      work_cv_.wait(lk, [&] { return stop_ || !waiting_.empty() || !dec_.running().empty(); });
      if (stop_) break;
    }
    std::lock_guard<std::mutex> ml(model_mu_);
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (Request* r : dec_.running())  // cancelled between steps
        if (r->cancel_requested && !r->done) {
          r->done = true;
          r->finish_reason = "cancelled";
        }
      // in order; the first that cannot be admitted (no slot or cache room, or its prompt
      // waits for a running prompt's prefill: Decoder::admit) holds the rest back
      while (!waiting_.empty() && dec_.admit(waiting_.front())) waiting_.pop_front();
    }
    try {
      dec_.prefill();
      if (!staged_.empty()) {  // the prompts' first tokens, before the step runs
        std::lock_guard<std::mutex> lk(mu_);
        publish_locked();
      }
      dec_.step();
    } catch (...) {  // a failure of the step: every request in it fails with the error
      std::exception_ptr e = std::current_exception();
      std::lock_guard<std::mutex> lk(mu_);
      for (Request* r : dec_.running()) {
        if (!r->error) r->error = e;
        r->done = true;
        if (r->finish_reason.empty()) r->finish_reason = "error";
      }
    }
    ended.clear();
    for (Request* r : dec_.running())
      if (r->done) ended.push_back(r);
    for (Request* r : ended) dec_.retire(r);
    std::lock_guard<std::mutex> lk(mu_);
    publish_locked();
    for (Request* r : ended) finish_locked(*r);
    snap_.steps_total = dec_.steps();
    snap_.prefilling = dec_.prefilling();
    snap_.tokens_per_second = dec_.tokens_per_second();
    snap_.acceptance_length = dec_.acceptance_length();
    snap_.step_time_s = dec_.step_time_s();
    snap_.draft_len = dec_.draft_len();
    snap_cache_locked();
  }
  // shutdown: what still runs ends as cancelled
  std::lock_guard<std::mutex> ml(model_mu_);
  ended.assign(dec_.running().begin(), dec_.running().end());
  for (Request* r : ended) {
    if (r->finish_reason.empty()) r->finish_reason = "cancelled";
    dec_.retire(r);
  }
  std::lock_guard<std::mutex> lk(mu_);
  publish_locked();
  for (Request* r : ended) finish_locked(*r);
  snap_.prefilling = 0;
  snap_cache_locked();
}

// The cache pages in use by requests (the prefix cache's idle blocks count as free: they
// are evicted when needed) and the prefix cache's figures.
void Scheduler::snap_cache_locked() {
  const PrefixCache* pc = dec_.prefix_cache();
  const int64_t idle = pc ? pc->idle_blocks() : 0;
  snap_.cache_pages_total = core_.target->cache().num_blocks() - int64_t(core_.target->pad_stream().blocks.size());
  snap_.cache_pages_used = snap_.cache_pages_total - core_.target->cache().free_blocks() - idle;
  if (pc) {
    snap_.prefix_cache_pages = pc->entries();
    snap_.prefix_cache_hit_tokens = pc->hit_tokens();
    snap_.prefix_cache_query_tokens = pc->query_tokens();
    snap_.prefix_cache_evictions = pc->evictions();
  }
}

}  // namespace dflash2::runtime
