// The in-process CPU communicator: ranks are threads sharing memory. A collective is two
// barriers: ranks publish their buffer pointers, then each rank computes its share of the
// result from everyone's buffers in a fixed order (rank 0 + rank 1 + ... for sums: the same
// rounding on every rank and in every run), then copies the result after a second barrier.
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <vector>

#include "comm/communicator.h"
#include "dflash2/error.h"

namespace dflash2::comm {

namespace {

struct Shared {
  explicit Shared(int n) : size(n), ptrs(size_t(n), nullptr), scratch() {}
  int size;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  int64_t generation = 0;
  bool aborted = false;
  std::vector<const void*> ptrs;  // per rank, published for the current collective
  std::vector<float> scratch;     // the reduced result

  void barrier() {
    std::unique_lock<std::mutex> lk(mu);
    if (aborted) throw CollectiveAborted();
    const int64_t gen = generation;
    if (++arrived == size) {
      arrived = 0;
      ++generation;
      cv.notify_all();
    } else {
      cv.wait(lk, [&] { return generation != gen || aborted; });
      if (generation == gen) throw CollectiveAborted();  // aborted before the last rank arrived
    }
  }
  void abort() {
    std::lock_guard<std::mutex> lk(mu);
    aborted = true;
    cv.notify_all();
  }
  void reset() {
    std::lock_guard<std::mutex> lk(mu);
    aborted = false;
    arrived = 0;
    ++generation;
  }
};

void need_contiguous(const Tensor& t, DType dt, const char* op, const char* arg) {
  DFLASH2_CHECK_ARG(t.defined() && t.device().is_cpu() && t.is_contiguous() && (dt == t.dtype()), "comm::", op,
                    ": '", arg, "' must be a contiguous ", dtype_name(dt), " CPU tensor, found ", t.describe());
}

class CpuComm final : public Communicator {
 public:
  CpuComm(std::shared_ptr<Shared> s, int rank) : s_(std::move(s)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return s_->size; }
  const char* backend() const override { return "cpu"; }

  void all_reduce_sum(Tensor& x) override {
    need_contiguous(x, DType::F32, "all_reduce_sum", "x");
    const int64_t n = x.numel();
    stats_.all_reduce_calls++;
    stats_.all_reduce_bytes += int64_t(x.nbytes());
    if (s_->size == 1) return;
    publish(x.data());
    // rank r reduces the slice [r n / size, (r + 1) n / size) of every rank's buffer
    const int64_t b = n * rank_ / s_->size, e = n * (rank_ + 1) / s_->size;
    if (rank_ == 0) {
      std::lock_guard<std::mutex> lk(s_->mu);
      if (int64_t(s_->scratch.size()) < n) s_->scratch.resize(size_t(n));
    }
    s_->barrier();  // scratch sized
    float* out = s_->scratch.data();
    for (int64_t i = b; i < e; ++i) {
      float acc = static_cast<const float*>(s_->ptrs[0])[i];
      for (int r = 1; r < s_->size; ++r) acc += static_cast<const float*>(s_->ptrs[size_t(r)])[i];
      out[i] = acc;
    }
    s_->barrier();  // every slice reduced; nobody reads the inputs any more
    std::memcpy(x.data(), out, size_t(n) * 4);
    s_->barrier();  // every rank copied out before the scratch is reused
  }

  void all_gather(const Tensor& in, Tensor& out) override {
    DFLASH2_CHECK_ARG(in.defined() && out.defined() && in.dtype() == out.dtype() && in.is_contiguous() &&
                          out.is_contiguous() && out.numel() == in.numel() * s_->size,
                      "comm::all_gather: out must be contiguous with size x the elements of in, found ",
                      in.describe(), " and ", out.describe());
    const size_t bytes = in.nbytes();
    stats_.all_gather_calls++;
    stats_.all_gather_bytes += int64_t(out.nbytes());
    publish(in.data());
    for (int r = 0; r < s_->size; ++r)
      std::memcpy(static_cast<char*>(out.data()) + size_t(r) * bytes, s_->ptrs[size_t(r)], bytes);
    s_->barrier();  // nobody reads the inputs any more
  }

  void reduce_scatter_sum(const Tensor& in, Tensor& out) override {
    need_contiguous(in, DType::F32, "reduce_scatter_sum", "in");
    need_contiguous(out, DType::F32, "reduce_scatter_sum", "out");
    DFLASH2_CHECK_ARG(in.numel() == out.numel() * s_->size, "comm::reduce_scatter_sum: in must hold size x out's ",
                      "elements, found ", in.describe(), " and ", out.describe());
    const int64_t n = out.numel();
    stats_.reduce_scatter_calls++;
    stats_.reduce_scatter_bytes += int64_t(in.nbytes());
    publish(in.data());
    float* o = out.data_as<float>();
    for (int64_t i = 0; i < n; ++i) {
      float acc = static_cast<const float*>(s_->ptrs[0])[rank_ * n + i];
      for (int r = 1; r < s_->size; ++r) acc += static_cast<const float*>(s_->ptrs[size_t(r)])[rank_ * n + i];
      o[i] = acc;
    }
    s_->barrier();
  }

  void broadcast(Tensor& x, int root) override {
    DFLASH2_CHECK_ARG(root >= 0 && root < s_->size, "comm::broadcast: root ", root, " outside [0, ", s_->size, ")");
    DFLASH2_CHECK_ARG(x.defined() && x.is_contiguous(), "comm::broadcast: x must be contiguous, found ", x.describe());
    stats_.broadcast_calls++;
    stats_.broadcast_bytes += int64_t(x.nbytes());
    publish(x.data());
    if (rank_ != root) std::memcpy(x.data(), s_->ptrs[size_t(root)], x.nbytes());
    s_->barrier();
  }

  void barrier() override {
    stats_.barrier_calls++;
    s_->barrier();
  }
  void abort() override { s_->abort(); }
  void reset() override { s_->reset(); }

 private:
  void publish(const void* p) {
    s_->ptrs[size_t(rank_)] = p;
    s_->barrier();
  }
  std::shared_ptr<Shared> s_;
  int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_cpu_group(int size) {
  DFLASH2_CHECK_ARG(size >= 1, "tensor parallel size must be >= 1, found ", size);
  auto shared = std::make_shared<Shared>(size);
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < size; ++r) out.push_back(std::make_unique<CpuComm>(shared, r));
  return out;
}

}  // namespace dflash2::comm
