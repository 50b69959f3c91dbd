// Capturing the decode step's graphs at load (issue "CUDA backend, part 2": graphs per
// batch-size bucket captured at load): a few steps of dummy requests at every bucket, so
// that the first real steps of each bucket replay instead of warming up and capturing.
#pragma once
#include <cstdint>
#include <vector>

#include "runtime/core.h"

namespace dflash2::runtime {

struct WarmUp {
  std::vector<int64_t> buckets;     // batch sizes run
  std::vector<int64_t> draft_lens;  // draft lengths run at each (K; 0 .. K with adaptive speculation)
  int64_t steps = 0;             // decode steps run
  double seconds = 0;
  std::string stopped;  // why it stopped early when a dummy request failed (non-finite logits)
};

// First one dummy request with a full prompt chunk (max_step_tokens tokens: the largest
// prefill, so the per-stream scratch has grown before anything is captured); then for every
// batch-size bucket (Target::bucket; every batch size when the drafter's steps are not
// padded, MTP; those whose verify pass fits one chunk) that many one-token dummy requests,
// greedily and then sampled (the sampled step's acceptance reads the selector's proposal:
// another graph), for at least three decode steps each -- the eager warm-up, the capture, a
// replay -- and again (at most three passes) while a pass grew the scratch, which
// invalidates the graphs captured before; all on a decoder of its own over `core`,
// then releases everything: the caches, slots and counters of real requests are as before
// (only the graphs and the counters of steps -- steps_as_one_unit, padding_rows,
// drafter_appends_in_step, the graph counts -- remember it). Stops early, without an error,
// when the KV cache cannot hold a bucket's requests, or when a dummy request fails (its
// logits are non-finite: `stopped` says so; real requests then fail or not on their own);
// any other failure propagates. With adaptive speculation (`adaptive`), every bucket also
// runs each shorter draft length 0 .. K - 1 (adaptive requests, the decoder's draft length
// forced), whose steps have shapes -- graphs -- of their own.
WarmUp warm_up_steps(Core& core, bool adaptive);

}  // namespace dflash2::runtime
