// Host <-> device copies of a step without host waits (CUDA): what the host packs goes up
// through pinned staging in one asynchronous copy, and what comes back lands in pinned
// memory, waited for by an event. Only the final results of a step are waited for.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>

#include "dflash2/tensor.h"

namespace dflash2::runtime {

// Uploads into a fixed device buffer of `words` 4-byte words. The host packs into begin()
// (pinned staging, two halves used in turn: a half is handed out again only once its
// previous copy has executed, so packing never waits for more than the copy before the
// last), send() copies the packed prefix with one cudaMemcpyAsync on the current stream.
// Kernels that read the device buffer before a send() come before its copy in stream
// order (one stream, or streams kept in order by cuda::OrderedStreamScope). Device
// addresses never change, so CUDA graphs may read the buffer.
class StagedUpload {
 public:
  StagedUpload();
  StagedUpload(Device dev, int64_t words);  // dev must be a CUDA device
  ~StagedUpload();
  StagedUpload(StagedUpload&&) noexcept;
  StagedUpload& operator=(StagedUpload&&) noexcept;
  bool defined() const { return state_ != nullptr; }
  int64_t capacity() const { return capacity_; }
  // The staging half to pack into (capacity() words; waits for its previous copy).
  int32_t* begin();
  // Copies words [0, n) of the half begin() returned into the device buffer's words [0, n).
  void send(int64_t n);
  const Tensor& device_buffer() const { return buf_; }  // I32 [capacity] on the device
  // A view of words [word, word + numel(shape) * itemsize / 4) of the device buffer.
  Tensor view(int64_t word, DType dt, const Tensor::Shape& shape) const;

 private:
  struct State;
  std::unique_ptr<State> state_;
  int64_t capacity_ = 0;
  Tensor buf_;
};

// Pinned host memory of `words` 4-byte words that device results are copied into
// asynchronously (fetch) and read once wait() returns.
class PinnedResults {
 public:
  PinnedResults();
  PinnedResults(Device dev, int64_t words);
  ~PinnedResults();
  PinnedResults(PinnedResults&&) noexcept;
  PinnedResults& operator=(PinnedResults&&) noexcept;
  bool defined() const { return state_ != nullptr; }
  // I32 [words] over the pinned memory (the caller takes views of it).
  const Tensor& host() const { return host_; }
  // Queues a copy of `bytes` from device memory `src` to host().data() on the current
  // stream; fetches since the last wait() are waited for together.
  void fetch(const void* src, size_t bytes);
  // Records an event after the fetches and blocks until it has completed.
  void wait();

 private:
  struct State;
  std::unique_ptr<State> state_;
  Tensor host_;
};

// Marks between a step's phases (draft, verify, acceptance): on a CUDA device, timing events
// recorded on the current stream, so the spans are the device's timeline (read them once
// the step's results have come back: every mark is complete by then); on the CPU, the
// host's clock (the ops there are synchronous).
class StepMarks {
 public:
  StepMarks();
  StepMarks(Device dev, int n);
  ~StepMarks();
  StepMarks(StepMarks&&) noexcept;
  StepMarks& operator=(StepMarks&&) noexcept;
  void mark(int i);
  // Mark i for a recorded step (StepRecorder): counted as set now, taken when the returned
  // piece runs (on a GPU: an event record node of the step's graph).
  std::function<void()> deferred(int i);
  // Seconds from mark i to mark j (0 when either was not recorded this step).
  double seconds(int i, int j) const;
  void reset();  // forgets the marks of the last step

 private:
  struct State;
  static void take(State& st, int i);
  std::unique_ptr<State> state_;
};

}  // namespace dflash2::runtime
