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
  // default flags: a blocking stream, ordered with the legacy default stream, so eager work
  // elsewhere on this device (sampling, the drafter, synchronous copies) stays in program order
  DFLASH2_CUDA_CHECK(cudaStreamCreate(&s), "cuda:", device);
  return s;
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
