// cuda/op_timer.cpp: the CUDA backend's op timer (ops::set_op_timing): two events recorded
// around an op on the current stream, the elapsed time read after the end event completes.
// Events are kept in a pool for reuse (created outside any capture: a stream being captured
// gets no timer). Status: compiled; run in the CPU emulation; not yet run on a GPU.
#include <cuda_runtime.h>

#include <mutex>
#include <vector>

#include "backend/cuda/cuda_api.h"

namespace dflash2::cuda {

namespace {
struct Timer {
  cudaEvent_t start = nullptr, stop = nullptr;
};
std::mutex g_pool_mu;
std::vector<Timer*>& pool() {
  static std::vector<Timer*> p;  // never freed: a few events per thread that timed ops
  return p;
}
void give_back(Timer* t) {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  pool().push_back(t);
}
}  // namespace

void* op_timer_begin() {
  cudaStream_t s = current_stream();
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(s, &cs) != cudaSuccess || cs != cudaStreamCaptureStatusNone) {
    (void)cudaGetLastError();
    return nullptr;
  }
  Timer* t = nullptr;
  {
    std::lock_guard<std::mutex> lk(g_pool_mu);
    if (!pool().empty()) {
      t = pool().back();
      pool().pop_back();
    }
  }
  if (t == nullptr) {
    t = new Timer;
    if (cudaEventCreate(&t->start) != cudaSuccess || cudaEventCreate(&t->stop) != cudaSuccess) {
      (void)cudaGetLastError();
      if (t->start) cudaEventDestroy(t->start);
      delete t;
      return nullptr;
    }
  }
  if (cudaEventRecord(t->start, s) != cudaSuccess) {
    (void)cudaGetLastError();
    give_back(t);
    return nullptr;
  }
  return t;
}

double op_timer_end(void* timer) {
  Timer* t = static_cast<Timer*>(timer);
  float ms = 0.0f;
  if (cudaEventRecord(t->stop, current_stream()) != cudaSuccess || cudaEventSynchronize(t->stop) != cudaSuccess ||
      cudaEventElapsedTime(&ms, t->start, t->stop) != cudaSuccess) {
    (void)cudaGetLastError();  // a timing failure is no error of the op: it counts as 0
    ms = 0.0f;
  }
  give_back(t);
  return double(ms) * 1e-3;
}

}  // namespace dflash2::cuda
