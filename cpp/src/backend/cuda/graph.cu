// cuda/graph.cu: streams and CUDA graphs for the runtime (cuda_api.h): a stream per target
// rank, and capture / instantiate / replay of the work one thread issues on it
// (runtime/step_graphs.cpp decides what is captured and when).
//
// Status: compiled for sm_90a/sm_100a/sm_103a, NOT yet run on a GPU.
#include <cuda_runtime.h>

#include <string>

#include "backend/cuda/cuda_api.h"
#include "backend/cuda/cuda_check.cuh"
#include "dflash2/error.h"

namespace dflash2::cuda {

CUstream_st* stream_create(int device) {
  detail::DeviceGuard guard(device);
  cudaStream_t s = nullptr;
  // non-blocking: a capture on it leaves the legacy default stream usable for every other
  // thread (a capturing blocking stream would not); OrderedStreamScope orders it explicitly
  DFLASH2_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cuda:", device);
  return s;
}

OrderedStreamScope::OrderedStreamScope(CUstream_st* s, int device)
    : prev_(current_stream()), stream_(s), device_(device) {
  if (!s) return;
  detail::DeviceGuard guard(device);
  cudaEvent_t e = nullptr;
  DFLASH2_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cuda:", device);
  cudaError_t err = cudaEventRecord(e, cudaStreamLegacy);  // what the legacy stream has queued ...
  if (err == cudaSuccess) err = cudaStreamWaitEvent(s, e, 0);  // ... comes before s's work
  cudaEventDestroy(e);  // released once the wait is satisfied
  if (err != cudaSuccess) detail::raise(err, "ordering a stream after the legacy stream", "cuda:", device);
  set_current_stream(s);
}

OrderedStreamScope::~OrderedStreamScope() {
  if (!stream_) return;
  set_current_stream(prev_);
  int prev = -1;
  if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
  cudaSetDevice(device_);
  cudaEvent_t e = nullptr;
  if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess) {
    if (cudaEventRecord(e, stream_) == cudaSuccess)  // s's work comes before what is queued next
      cudaStreamWaitEvent(cudaStreamLegacy, e, 0);   // on the legacy stream
    cudaEventDestroy(e);
  } else {
    cudaStreamSynchronize(stream_);  // no event: order by waiting
  }
  cudaGetLastError();
  if (prev >= 0) cudaSetDevice(prev);
}

void stream_destroy(CUstream_st* s, int device) noexcept {
  if (!s) return;
  int prev = -1;
  if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
  cudaSetDevice(device);
  cudaStreamSynchronize(s);
  cudaStreamDestroy(s);
  if (prev >= 0) cudaSetDevice(prev);
  cudaGetLastError();
}

void graph_begin_capture(CUstream_st* s) {
  // thread-local mode: only this thread's unsafe calls (a synchronous copy, an allocation)
  // break the capture; other engines' threads keep working
  DFLASH2_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "graph capture");
}

void* graph_end_capture(CUstream_st* s, std::string* why) {
  cudaGraph_t g = nullptr;
  cudaError_t e = cudaStreamEndCapture(s, &g);
  if (e != cudaSuccess || g == nullptr) {
    if (why) *why = std::string("cudaStreamEndCapture: ") + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();  // capture errors are not sticky; clear the last-error slot
    return nullptr;
  }
  cudaGraphExec_t x = nullptr;
  e = cudaGraphInstantiate(&x, g, 0);
  cudaGraphDestroy(g);
  if (e != cudaSuccess) {
    if (why) *why = std::string("cudaGraphInstantiate: ") + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
    cudaGetLastError();
    return nullptr;
  }
  return x;
}

void graph_launch(void* exec, CUstream_st* s) {
  DFLASH2_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec), s), "graph replay");
}

void graph_destroy(void* exec) noexcept {
  if (exec) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec));
}

}  // namespace dflash2::cuda
