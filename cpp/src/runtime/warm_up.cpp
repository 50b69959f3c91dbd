#include "runtime/warm_up.h"

#include <chrono>
#include <exception>
#include <memory>
#include <string>

#include "runtime/decoder.h"

namespace dflash2::runtime {

namespace {
class QuietSink final : public Decoder::Sink {
 public:
  void on_tokens(Request&, const int32_t*, int64_t) override {}
  void on_error(Request&, std::exception_ptr e) override {
    if (!error) error = e;
  }
  std::exception_ptr error;
};
}  // namespace

WarmUp warm_up_steps(Core& core) {
  WarmUp w;
  const auto t0 = std::chrono::steady_clock::now();
  Target& t = *core.target;
  const auto& o = t.options();
  // three steps at the full batch: each commits 1 .. K + 1 tokens, the prefill one
  const int64_t new_tokens = 2 * (core.K + 1) + 2;
  if (1 + new_tokens > o.max_seq_len) return w;
  for (int64_t s = 1; s <= o.max_batch_size; s = t.bucket(s) + 1) {
    const int64_t b = t.bucket(s);
    if (b * (core.K + 1) > o.max_step_tokens) break;  // not run as one unit: nothing to capture
    bool fits = true;
    for (const float temperature : {0.0f, 1.0f}) {
      QuietSink sink;
      Decoder dec(core, sink, /*adaptive=*/false);
      std::vector<std::unique_ptr<Request>> reqs;
      for (int64_t i = 0; i < b && fits; ++i) {
        auto r = std::make_unique<Request>();
        r->id = -1 - i;
        r->prompt = {0};
        r->p.max_new_tokens = new_tokens;
        r->p.temperature = temperature;
        r->rng_key = rng_key(0, i);
        r->adaptive = false;
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
        break;
      }
      if (!fits) break;
    }
    if (!fits || !w.stopped.empty()) break;
    w.buckets.push_back(b);
  }
  w.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return w;
}

}  // namespace dflash2::runtime
