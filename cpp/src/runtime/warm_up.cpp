#include "runtime/warm_up.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <memory>
#include <string>

#include "runtime/decoder.h"
#ifdef DFLASH2_WITH_CUDA
#include "backend/cuda/cuda_api.h"
#endif

namespace dflash2::runtime {

namespace {
class QuietSink final : public Decoder::Sink {
 public:
  void on_tokens(Request&, const int32_t*, int64_t, const TokenLogprobs*) override {}
  void on_error(Request&, std::exception_ptr e) override {
    if (!error) error = e;
  }
  std::exception_ptr error;
};
}  // namespace

namespace {
uint64_t scratch_gen() {
#ifdef DFLASH2_WITH_CUDA
  return cuda::scratch_generation();
#else
  return 0;
#endif
}

// Runs n dummy requests (prompts of prompt_len tokens) to the end; false when the cache
// cannot hold them or one failed (w.stopped says why). k >= 0: adaptive requests on a
// decoder whose draft length is forced to k; k < 0: the full block.
bool run_batch(Core& core, WarmUp& w, int64_t n, int64_t prompt_len, int64_t new_tokens, float temperature,
               int64_t k = -1) {
  QuietSink sink;
  Decoder dec(core, sink, /*adaptive=*/k >= 0);
  if (k >= 0) dec.force_draft_len(k);
  std::vector<std::unique_ptr<Request>> reqs;
  bool fits = true;
  for (int64_t i = 0; i < n && fits; ++i) {
    auto r = std::make_unique<Request>();
    r->id = -1 - i;
    r->prompt.assign(size_t(prompt_len), 0);
    r->p.max_new_tokens = new_tokens;
    r->p.temperature = temperature;
    r->rng_key = rng_key(0, i);
    r->adaptive = k >= 0;
    fits = dec.admit(r.get());
    reqs.push_back(std::move(r));
  }
  try {
    if (fits) {
      dec.prefill();
      for (;;) {
        bool any = false;
        for (Request* r : dec.running()) any = any || !r->done;
        if (!any) break;
        dec.step();
        ++w.steps;
      }
    }
  } catch (...) {
    dec.retire_all();
    throw;
  }
  dec.retire_all();
  if (sink.error) {  // a dummy request failed (non-finite logits): real ones decide for themselves
    try {
      std::rethrow_exception(sink.error);
    } catch (const std::exception& e) {
      w.stopped = e.what();
    }
    return false;
  }
  return fits;
}
}  // namespace

WarmUp warm_up_steps(Core& core, bool adaptive) {
  WarmUp w;
  const auto t0 = std::chrono::steady_clock::now();
  Target& t = *core.target;
  const auto& o = t.options();
  // three steps at the full batch: each commits 1 .. K + 1 tokens, the prefill one
  const int64_t new_tokens = 2 * (core.K + 1) + 2;
  if (1 + new_tokens > o.max_seq_len) return w;
  // A graph captured before the per-stream scratch grew is captured again on its next use:
  // first one full prompt chunk (the largest prefill the scratch serves, with the drafter's
  // appends of its rows), then the batch sizes until a whole pass leaves the scratch as it
  // found it (a later pass replays or captures what an earlier one's growth invalidated).
  const int64_t prompt = std::max<int64_t>(1, std::min(o.max_step_tokens, o.max_seq_len - new_tokens - 1));
  if (!run_batch(core, w, 1, prompt, 1 + (core.K + 1), 0.0f)) {
    w.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return w;
  }
  // buckets when steps are padded to them; every batch size otherwise (MTP); the full block,
  // and with adaptive speculation every shorter draft length too (each step commits at most
  // k + 1 tokens: 2 (k + 1) + 2 new tokens still make three steps)
  const bool pads = !core.drafter || core.drafter->pads_steps();
  w.draft_lens.assign(1, core.K);
  if (adaptive && core.drafter)
    for (int64_t k = 0; k < core.K; ++k) w.draft_lens.push_back(k);
  // every key it captures stays in the graph cache (greedy and sampled steps are different
  // keys), with the cache's default room left for the shapes real traffic adds
  int64_t sizes = 0;
  for (int64_t s = 1; s <= o.max_batch_size; s = (pads ? t.bucket(s) : s) + 1) {
    if ((pads ? t.bucket(s) : s) * (core.K + 1) > o.max_step_tokens) break;
    ++sizes;
  }
  t.reserve_graphs(size_t(256 + 2 * sizes * int64_t(w.draft_lens.size())));
  for (int pass = 0; pass < 3; ++pass) {
    const uint64_t gen = scratch_gen();
    w.buckets.clear();
    bool ok = true;
    for (int64_t s = 1; s <= o.max_batch_size && ok; s = (pads ? t.bucket(s) : s) + 1) {
      const int64_t b = pads ? t.bucket(s) : s;
      if (b * (core.K + 1) > o.max_step_tokens) break;  // not run as one unit: nothing to capture
      for (const int64_t k : w.draft_lens)
        for (const float temperature : {0.0f, 1.0f})
          ok = ok && (k == core.K ? run_batch(core, w, b, 1, new_tokens, temperature)
                                  : run_batch(core, w, b, 1, 2 * (k + 1) + 2, temperature, k));
      if (ok) w.buckets.push_back(b);
    }
    if (!ok || scratch_gen() == gen) break;
  }
  w.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return w;
}

}  // namespace dflash2::runtime
