// A batch: the requests of one generate() wave, decoded in lockstep on the engine's Core.
// prefill() runs every prompt (chunked) and samples each first token; step() is one
// draft -> verify -> accept -> commit round for the requests still running. The caches and
// drafter slots of the batch are released when it is destroyed.
#pragma once
#include <cstdint>
#include <vector>

#include "dflash2/engine.h"
#include "runtime/core.h"

namespace dflash2::runtime {

class Batch {
 public:
  // prompts[i] is request first_index + i (its result goes to results[first_index + i]).
  Batch(Core& core, const std::vector<std::vector<int32_t>>& prompts, size_t first_index, size_t count,
        const SamplingParams& p, const std::vector<int32_t>& stops, const TokenCallback& on_tokens,
        std::vector<GenerationResult>& results);
  ~Batch();
  Batch(const Batch&) = delete;
  Batch& operator=(const Batch&) = delete;

  void prefill();
  bool step();           // false when every request has finished
  void finish_stats();   // fills the requests' GenerationStats (times, acceptance)

 private:
  struct Req;
  void plan_row(int64_t r, Req& q, uint64_t draws);
  void emit(Req& r, const int32_t* toks, int64_t count);
  void after_commit(Req& r);

  Core& c_;
  const SamplingParams& p_;
  const std::vector<int32_t>& stops_;
  const TokenCallback& on_tokens_;
  std::vector<GenerationResult>& results_;
  std::vector<Req> reqs_;
  bool greedy_ = true;
  int64_t max_len_ = 0, step_ = 0;
  double t_prefill_ = 0, t_draft_ = 0, t_verify_ = 0, t0_ = 0;
  // host bookkeeping reused across steps
  std::vector<Req*> act_;
  std::vector<DraftJob> jobs_;
  std::vector<CommitRows> commits_;
  std::vector<int64_t> row_owner_, counts_;
  std::vector<CacheStream*> streams_;
  std::vector<const int32_t*> toks_;
  std::vector<int32_t> sent_;
};

}  // namespace dflash2::runtime
