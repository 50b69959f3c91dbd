#include "runtime/staging.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "dflash2/error.h"
#ifdef DFLASH2_WITH_CUDA
#include "backend/cuda/cuda_api.h"
#endif

namespace dflash2::runtime {

struct StagedUpload::State {
  Device dev;
#ifdef DFLASH2_WITH_CUDA
  std::shared_ptr<void> host[2];
  cuda::Event done[2];
#endif
  int half = 0;        // the half begin() hands out next
  int packing = -1;    // the half handed out by the last begin(), until send()
};

StagedUpload::StagedUpload(Device dev, int64_t words) : state_(std::make_unique<State>()), capacity_(words) {
#ifdef DFLASH2_WITH_CUDA
  DFLASH2_CHECK_ARG(dev.is_cuda(), "StagedUpload: a CUDA device is needed, found ", dev.str());
  DFLASH2_CHECK_ARG(words >= 1, "StagedUpload: capacity must be >= 1 word, found ", words);
  state_->dev = dev;
  buf_ = Tensor::zeros(DType::I32, {words}, dev);
  for (int k = 0; k < 2; ++k) {
    state_->host[k] = std::shared_ptr<void>(cuda::host_alloc_pinned(size_t(words) * 4), cuda::host_free_pinned);
    state_->done[k] = cuda::Event(dev.index);
  }
#else
  state_.reset();
  fail(ErrorKind::Unsupported, "StagedUpload on ", dev.str(), ": dflash2 was built without CUDA");
#endif
}

StagedUpload::StagedUpload() = default;
StagedUpload::~StagedUpload() = default;
StagedUpload::StagedUpload(StagedUpload&&) noexcept = default;
StagedUpload& StagedUpload::operator=(StagedUpload&&) noexcept = default;

int32_t* StagedUpload::begin() {
  DFLASH2_INTERNAL(state_ != nullptr, "StagedUpload::begin on an empty uploader");
#ifdef DFLASH2_WITH_CUDA
  State& st = *state_;
  const int k = st.half;
  st.done[k].wait();  // this half's previous copy has executed
  st.packing = k;
  return static_cast<int32_t*>(st.host[k].get());
#else
  return nullptr;
#endif
}

void StagedUpload::send(int64_t n) {
  DFLASH2_INTERNAL(state_ != nullptr && state_->packing >= 0, "StagedUpload::send without begin");
  DFLASH2_INTERNAL(n >= 0 && n <= capacity_, "StagedUpload::send of ", n, " words, capacity ", capacity_);
#ifdef DFLASH2_WITH_CUDA
  State& st = *state_;
  const int k = st.packing;
  st.packing = -1;
  st.half = k ^ 1;
  if (n > 0) cuda::copy_async(buf_.data(), st.host[k].get(), size_t(n) * 4, st.dev.index);
  st.done[k].record();
#endif
}

Tensor StagedUpload::view(int64_t word, DType dt, const Tensor::Shape& shape) const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  const int64_t words = (n * int64_t(dtype_size(dt)) + 3) / 4;
  DFLASH2_INTERNAL(word >= 0 && word + words <= capacity_ && (word * 4) % int64_t(dtype_size(dt)) == 0,
                   "StagedUpload::view of ", words, " words at ", word, ", capacity ", capacity_);
  return Tensor::view(static_cast<uint8_t*>(buf_.data()) + word * 4, dt, shape, {}, buf_.device());
}

struct PinnedResults::State {
  Device dev;
  std::shared_ptr<void> mem;
#ifdef DFLASH2_WITH_CUDA
  cuda::Event done;
#endif
  size_t bytes = 0;
};

PinnedResults::PinnedResults(Device dev, int64_t words) : state_(std::make_unique<State>()) {
#ifdef DFLASH2_WITH_CUDA
  DFLASH2_CHECK_ARG(dev.is_cuda(), "PinnedResults: a CUDA device is needed, found ", dev.str());
  state_->dev = dev;
  state_->bytes = size_t(std::max<int64_t>(words, 1)) * 4;
  state_->mem = std::shared_ptr<void>(cuda::host_alloc_pinned(state_->bytes), cuda::host_free_pinned);
  std::memset(state_->mem.get(), 0, state_->bytes);
  state_->done = cuda::Event(dev.index);
  host_ = Tensor::view(state_->mem.get(), DType::I32, {std::max<int64_t>(words, 1)});
#else
  (void)words;
  state_.reset();
  fail(ErrorKind::Unsupported, "PinnedResults on ", dev.str(), ": dflash2 was built without CUDA");
#endif
}

PinnedResults::PinnedResults() = default;
PinnedResults::~PinnedResults() = default;
PinnedResults::PinnedResults(PinnedResults&&) noexcept = default;
PinnedResults& PinnedResults::operator=(PinnedResults&&) noexcept = default;

void PinnedResults::fetch(const void* src, size_t bytes) {
  DFLASH2_INTERNAL(state_ != nullptr && bytes <= state_->bytes, "PinnedResults::fetch of ", bytes, " bytes into ",
                   state_ ? state_->bytes : 0);
#ifdef DFLASH2_WITH_CUDA
  if (bytes > 0)
    cuda::copy_async(state_->mem.get(), src, bytes, state_->dev.index);
#else
  (void)src;
#endif
}

void PinnedResults::wait() {
  DFLASH2_INTERNAL(state_ != nullptr, "PinnedResults::wait on an empty buffer");
#ifdef DFLASH2_WITH_CUDA
  state_->done.record();
  state_->done.wait();
#endif
}

struct StepMarks::State {
  Device dev;
  std::vector<double> host;  // CPU: steady-clock seconds, < 0 = not recorded
  std::vector<bool> set;
#ifdef DFLASH2_WITH_CUDA
  std::vector<cuda::Event> ev;
#endif
};

StepMarks::StepMarks() = default;
StepMarks::~StepMarks() = default;
StepMarks::StepMarks(StepMarks&&) noexcept = default;
StepMarks& StepMarks::operator=(StepMarks&&) noexcept = default;

StepMarks::StepMarks(Device dev, int n) : state_(std::make_unique<State>()) {
  state_->dev = dev;
  state_->host.assign(size_t(n), 0.0);
  state_->set.assign(size_t(n), false);
#ifdef DFLASH2_WITH_CUDA
  if (dev.is_cuda())
    for (int i = 0; i < n; ++i) state_->ev.emplace_back(dev.index, /*timing=*/true);
#else
  DFLASH2_CHECK_ARG(!dev.is_cuda(), "StepMarks on ", dev.str(), ": dflash2 was built without CUDA");
#endif
}

std::function<void()> StepMarks::deferred(int i) {
  if (!state_) return [] {};
  DFLASH2_INTERNAL(i >= 0 && size_t(i) < state_->set.size(), "step mark ", i);
  state_->set[size_t(i)] = true;
  State* st = state_.get();  // owned by the Core, which outlives its steps
  return [st, i] { take(*st, i); };
}

void StepMarks::mark(int i) {
  if (!state_) return;
  DFLASH2_INTERNAL(i >= 0 && size_t(i) < state_->set.size(), "step mark ", i);
  state_->set[size_t(i)] = true;
  take(*state_, i);
}

void StepMarks::take(State& st, int i) {
#ifdef DFLASH2_WITH_CUDA
  if (st.dev.is_cuda()) {
    st.ev[size_t(i)].record();  // during a capture: an event record node of the graph
    return;
  }
#endif
  st.host[size_t(i)] = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double StepMarks::seconds(int i, int j) const {
  if (!state_ || !state_->set[size_t(i)] || !state_->set[size_t(j)]) return 0.0;
#ifdef DFLASH2_WITH_CUDA
  if (state_->dev.is_cuda()) {
    try {  // a diagnostic: a mark the driver cannot time reads as 0, never fails the step
      return std::max(0.0, cuda::Event::elapsed_s(state_->ev[size_t(i)], state_->ev[size_t(j)]));
    } catch (const std::exception&) {
      return 0.0;
    }
  }
#endif
  return std::max(0.0, state_->host[size_t(j)] - state_->host[size_t(i)]);
}

void StepMarks::reset() {
  if (state_) std::fill(state_->set.begin(), state_->set.end(), false);
}

}  // namespace dflash2::runtime
