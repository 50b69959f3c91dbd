// cuda/graph.cu: streams and CUDA graphs for the runtime (cuda_api.h): a stream per target
// rank, and capture / instantiate / replay of the work one thread issues on it
// (runtime/step_graphs.cpp decides what is captured and when).
//
// Status: compiled for sm_90a/sm_100a/sm_103a, NOT yet run on a GPU.
#include <cuda_runtime.h>

#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda/cuda_api.h"
#include "backend/cuda/cuda_check.cuh"
#include "dflash2/error.h"
#include "dflash2/ops.h"

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

namespace {
// Whether `func` is one of this backend's kernels, which all begin with detail::pdl_enter()
// (pdl.cuh): their mangled names start with the namespace dflash2 (CUTLASS's kernels, whose
// own waits this build does not turn on, and NCCL's do not).
bool waits_at_entry(const void* func) {
#if defined(DFLASH2_CUDA_EMULATED)
  (void)func;
  return true;  // the emulator runs this folder's kernels only, and checks each one's entry
#else
  const char* name = nullptr;
  if (cudaFuncGetName(&name, func) != cudaSuccess || name == nullptr) {
    cudaGetLastError();
    return false;
  }
  // mangled (_ZN7dflash2...), or demangled with or without the return type
  if (std::strncmp(name, "_ZN7dflash2", 11) == 0) return true;
  if (std::strncmp(name, "void ", 5) == 0) name += 5;
  return std::strncmp(name, "dflash2::", 9) == 0;
#endif
}

// PDL over a captured graph: each kernel -> kernel edge whose later kernel waits at its entry
// and depends on nothing else becomes programmatic (the later kernel's launch may begin while
// the earlier one runs; its pdl_enter waits for it to finish). Returns the edges made; a
// runtime that refuses an edit leaves that edge as it was and stops the pass.
int64_t chain_programmatic(cudaGraph_t g) {
  size_t n = 0;
  if (cudaGraphGetNodes(g, nullptr, &n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  std::vector<cudaGraphNode_t> nodes(n);
  if (n && cudaGraphGetNodes(g, nodes.data(), &n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  auto is_kernel = [](cudaGraphNode_t v) {
    cudaGraphNodeType t;
    return cudaGraphNodeGetType(v, &t) == cudaSuccess && t == cudaGraphNodeTypeKernel;
  };
  int64_t made = 0;
  for (size_t i = 0; i < n; ++i) {
    cudaGraphNode_t to = nodes[i], from = nullptr;
    size_t deps = 0;
    if (!is_kernel(to) || cudaGraphNodeGetDependencies(to, nullptr, nullptr, &deps) != cudaSuccess || deps != 1)
      continue;
    cudaGraphEdgeData old{};
    if (cudaGraphNodeGetDependencies(to, &from, &old, &deps) != cudaSuccess || deps != 1 || !is_kernel(from) ||
        old.type != cudaGraphDependencyTypeDefault)
      continue;
    cudaKernelNodeParams p{};
    if (cudaGraphKernelNodeGetParams(to, &p) != cudaSuccess || !waits_at_entry(p.func)) continue;
    cudaGraphEdgeData prog{};
    prog.from_port = cudaGraphKernelNodePortProgrammatic;
    prog.type = cudaGraphDependencyTypeProgrammatic;
    if (cudaGraphRemoveDependencies(g, &from, &to, &old, 1) != cudaSuccess) break;
    if (cudaGraphAddDependencies(g, &from, &to, &prog, 1) != cudaSuccess) {
      cudaGetLastError();
      if (cudaGraphAddDependencies(g, &from, &to, &old, 1) != cudaSuccess) return -1;  // the graph lost an edge
      break;
    }
    ++made;
  }
  cudaGetLastError();
  return made;
}
}  // namespace

void* graph_end_capture(CUstream_st* s, std::string* why, int64_t* pdl_edges) {
  if (pdl_edges) *pdl_edges = 0;
  cudaGraph_t g = nullptr;
  cudaError_t e = cudaStreamEndCapture(s, &g);
  if (e != cudaSuccess || g == nullptr) {
    if (why) *why = std::string("cudaStreamEndCapture: ") + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();  // capture errors are not sticky; clear the last-error slot
    return nullptr;
  }
  if (ops::pdl()) {
    const int64_t made = chain_programmatic(g);
    if (made < 0) {  // an edge could not be restored: never instantiate a graph missing an order
      if (why) *why = "the PDL pass could not restore a dependency of the captured graph";
      cudaGraphDestroy(g);
      return nullptr;
    }
    if (pdl_edges) *pdl_edges = made;
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
