// cuda/scratch.cu: per-(device, stream) scratch memory for ops whose signature has no
// workspace (indexer scores over long contexts, sampling row buffers, ...).
//
// A buffer belongs to one (device, stream) pair, so ops that run on different streams
// (TP ranks' threads, a capture stream next to an eager one) never share bytes; ops on one
// stream run in order, so the one buffer is reused safely by consecutive kernels. It only
// grows (to the largest request seen), and growing is refused while the stream is being
// captured into a CUDA graph: a graph must be captured after an eager warm-up step of the
// same shapes, which sizes every buffer (the error says so). Growing frees the old buffer
// after the stream has finished with it (cudaStreamSynchronize) -- an eager-only event,
// never inside a step after warm-up.
//
// Status: compiled for sm_90a/sm_100a/sm_103a, NOT yet run on a GPU.
#include <cuda_runtime.h>

#include <atomic>
#include <map>
#include <mutex>
#include <utility>

#include "backend/cuda/cuda_api.h"
#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/scratch.h"
#include "dflash2/error.h"

namespace dflash2::cuda::detail {

namespace {
struct Buf {
  void* p = nullptr;
  size_t bytes = 0;
};
std::mutex g_mu;
std::atomic<uint64_t> g_generation{0};
std::map<std::pair<int, CUstream_st*>, Buf>& buffers() {
  static auto* m = new std::map<std::pair<int, CUstream_st*>, Buf>();  // never destroyed: freed by process exit
  return *m;
}
// Growing a stream's buffer while that stream is being captured would bake a pointer the
// next growth frees into the graph: refused (the warm-up before a capture sizes them).
void refuse_in_capture(CUstream_st* s, int device, const char* what, size_t bytes, size_t held) {
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  DFLASH2_CUDA_CHECK(cudaStreamIsCapturing(s, &cap), what, ": cuda:", device);
  DFLASH2_CHECK(cap == cudaStreamCaptureStatusNone, ErrorKind::Backend, "cuda ", what, ": an op needs ", bytes,
                " bytes of ", what, " on cuda:", device, " (", held,
                " held) while its stream is being captured into a CUDA graph; run one eager step of the same "
                "shapes before capturing");
}
}  // namespace

void* scratch(int device, size_t bytes) {
  if (bytes == 0) bytes = 1;
  bytes = (bytes + 255) / 256 * 256;
  CUstream_st* s = current_stream();
  std::lock_guard<std::mutex> lock(g_mu);
  Buf& b = buffers()[{device, s}];
#ifdef DFLASH2_CUDA_EMULATED
  // the CPU emulation's memcheck: the request ends where the buffer does (256-byte aligned
  // still), so its guard page catches a kernel reaching past what its op asked for
  if (::emu::memcheck_enabled() && b.bytes >= bytes) return static_cast<char*>(b.p) + (b.bytes - bytes);
#endif
  if (b.bytes >= bytes) return b.p;
  DeviceGuard guard(device);
  refuse_in_capture(s, device, "scratch", bytes, b.bytes);
  if (b.p) {
    DFLASH2_CUDA_CHECK(cudaStreamSynchronize(s), "scratch: cuda:", device);
    device_free(b.p, device);
    b.p = nullptr;
    b.bytes = 0;
  }
  b.p = device_malloc(bytes, device);
  b.bytes = bytes;
  g_generation.fetch_add(1, std::memory_order_relaxed);
  return b.p;
}

uint32_t* zeroed_counters(int device) {
  static auto* counters = new std::map<std::pair<int, CUstream_st*>, void*>();  // never freed: process exit
  CUstream_st* s = current_stream();
  std::lock_guard<std::mutex> lock(g_mu);
  void*& p = (*counters)[{device, s}];
  if (p) return static_cast<uint32_t*>(p);
  DeviceGuard guard(device);
  refuse_in_capture(s, device, "counters", size_t(kCounterWords) * 4, 0);
  void* q = device_malloc(size_t(kCounterWords) * 4, device);
  const cudaError_t e = cudaMemsetAsync(q, 0, size_t(kCounterWords) * 4, s);  // before this stream's kernels
  if (e != cudaSuccess) {
    device_free(q, device);
    detail::raise(e, "zeroing the counters", " cuda:", device);
  }
  p = q;
  return static_cast<uint32_t*>(p);
}
}  // namespace dflash2::cuda::detail

namespace dflash2::cuda {
uint64_t scratch_generation() { return detail::g_generation.load(std::memory_order_relaxed); }
}  // namespace dflash2::cuda
