// cuda/device.cu: device management for the CUDA backend (availability, memory, copies,
// synchronisation, version strings). The library links the static CUDA runtime, so a
// machine without a driver or a GPU still loads it; every entry point then reports why
// instead of aborting.
#include <cuda_runtime.h>

#include <cstring>
#include <sstream>
#include <string>

#include "backend/cuda/cuda_api.h"
#include "backend/cuda/cuda_check.cuh"
#include "dflash2/error.h"

namespace dflash2::cuda {

using detail::DeviceGuard;

namespace {

std::string version_str(int v) {  // 13000 -> "13.0", 12080 -> "12.8"
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

std::string human_bytes(size_t b) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(2);
  if (b >= (size_t(1) << 30))
    os << double(b) / double(size_t(1) << 30) << " GiB";
  else if (b >= (size_t(1) << 20))
    os << double(b) / double(size_t(1) << 20) << " MiB";
  else
    os << b << " B";
  return os.str();
}

// Number of devices, or an error code (no driver, no device, ...). Never throws.
cudaError_t query_count(int* n) {
  *n = 0;
  cudaError_t e = cudaGetDeviceCount(n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    *n = 0;
  }
  return e;
}

void check_index(int device, const char* what) {
  int n = 0;
  cudaError_t e = query_count(&n);
  if (e != cudaSuccess) fail(ErrorKind::Backend, what, " on cuda:", device, ": no CUDA device: ", detail::describe_error(e));
  DFLASH2_CHECK(device >= 0 && device < n, ErrorKind::InvalidArgument, what, ": device cuda:", device,
                " does not exist (", n, " CUDA device", n == 1 ? "" : "s", " visible)");
}

}  // namespace

bool available(std::string* why) {
  int n = 0;
  cudaError_t e = query_count(&n);
  if (e != cudaSuccess) {
    if (why) *why = "no CUDA device: cudaGetDeviceCount failed: " + detail::describe_error(e);
    return false;
  }
  if (n == 0) {
    if (why) *why = "no CUDA device: cudaGetDeviceCount found 0 devices";
    return false;
  }
  if (why) why->clear();
  return true;
}

int device_count() {
  int n = 0;
  query_count(&n);
  return n;
}

void* device_malloc(size_t bytes, int device) {
  check_index(device, "device_malloc");
  DeviceGuard guard(device);
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, bytes);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    std::string mem;
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess)
      mem = human_bytes(free_b) + " free of " + human_bytes(total_b);
    else
      mem = "free memory unknown";
    cudaGetLastError();
    fail(ErrorKind::OutOfMemory, "cannot allocate ", bytes, " bytes (", human_bytes(bytes), ") on cuda:", device,
         ": ", mem, " (cudaMalloc: ", cudaGetErrorString(e), ")");
  }
  if (e != cudaSuccess) detail::raise(e, "cudaMalloc", bytes, " bytes on cuda:", device);
  return p;
}

void device_free(void* p, int device) noexcept {
  if (!p) return;
  // Errors are ignored: freeing happens in destructors, possibly at process exit after the
  // runtime has shut down (cudaErrorCudartUnloading), where nothing useful can be done.
  int prev = -1;
  if (cudaGetDevice(&prev) == cudaSuccess && prev != device) cudaSetDevice(device);
  cudaFree(p);
  if (prev >= 0 && prev != device) cudaSetDevice(prev);
  cudaGetLastError();
}

void copy(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes) {
  if (bytes == 0) return;
  DFLASH2_CHECK_ARG(dst && src, "copy: null pointer (dst ", dst, " on ", dst_dev.str(), ", src ", src, " on ",
                    src_dev.str(), ")");
  if (dst_dev.is_cpu() && src_dev.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return;
  }
  if (dst_dev.is_cuda() && src_dev.is_cuda() && dst_dev.index != src_dev.index) {
    DFLASH2_CUDA_CHECK(cudaMemcpyPeer(dst, dst_dev.index, src, src_dev.index, bytes), bytes, " bytes from ",
                       src_dev.str(), " to ", dst_dev.str());
    return;
  }
  cudaMemcpyKind kind;
  int device;
  if (dst_dev.is_cuda() && src_dev.is_cuda()) {
    kind = cudaMemcpyDeviceToDevice;
    device = dst_dev.index;
  } else if (dst_dev.is_cuda()) {
    kind = cudaMemcpyHostToDevice;
    device = dst_dev.index;
  } else {
    kind = cudaMemcpyDeviceToHost;
    device = src_dev.index;
  }
  DeviceGuard guard(device);
  // on this thread's current stream, then waited for: in order with the ops before it on
  // that stream (the legacy default stream unless a scope set another), synchronous for the host
  cudaStream_t s = current_stream();
  cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, s);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  if (e != cudaSuccess) detail::raise(e, "cudaMemcpyAsync", bytes, " bytes from ", src_dev.str(), " to ", dst_dev.str());
}

void memset_zero(void* dst, int device, size_t bytes) {
  if (bytes == 0) return;
  DeviceGuard guard(device);
  cudaStream_t s = current_stream();
  cudaError_t e = cudaMemsetAsync(dst, 0, bytes, s);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  if (e != cudaSuccess) detail::raise(e, "cudaMemsetAsync", bytes, " bytes on cuda:", device);
}

void synchronize(int device) {
  check_index(device, "synchronize");
  DeviceGuard guard(device);
  DFLASH2_CUDA_CHECK(cudaDeviceSynchronize(), "cuda:", device);
}

void* host_alloc_pinned(size_t bytes) {
  void* p = nullptr;
  cudaError_t e = cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocPortable);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    fail(ErrorKind::OutOfMemory, "cannot allocate ", bytes, " bytes of pinned host memory (cudaHostAlloc)");
  }
  if (e != cudaSuccess) detail::raise(e, "cudaHostAlloc", bytes, " bytes");
  return p;
}

void host_free_pinned(void* p) noexcept {
  if (p) cudaFreeHost(p);
  cudaGetLastError();
}

void copy_async(void* dst, const void* src, size_t bytes, int device) {
  if (bytes == 0) return;
  DeviceGuard guard(device);
  DFLASH2_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, current_stream()), bytes,
                     " bytes on cuda:", device);
}

Event::Event(int device, bool timing) : device_(device) {
  DeviceGuard guard(device);
  cudaEvent_t e = nullptr;
  DFLASH2_CUDA_CHECK(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming), "cuda:", device);
  ev_ = e;
}

double Event::elapsed_s(const Event& start, const Event& end) {
  DFLASH2_CHECK_ARG(start.ev_ && end.ev_ && start.recorded_ && end.recorded_,
                    "cuda::Event::elapsed_s needs two recorded events");
  DeviceGuard guard(start.device_);
  float ms = 0.0f;
  DFLASH2_CUDA_CHECK(
      cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start.ev_), static_cast<cudaEvent_t>(end.ev_)),
      "cuda:", start.device_);
  return double(ms) * 1e-3;
}

Event::~Event() {
  if (ev_) {
    cudaEventDestroy(static_cast<cudaEvent_t>(ev_));
    cudaGetLastError();
  }
}

Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
    if (ev_) cudaEventDestroy(static_cast<cudaEvent_t>(ev_));
    ev_ = o.ev_;
    device_ = o.device_;
    recorded_ = o.recorded_;
    o.ev_ = nullptr;
  }
  return *this;
}

void Event::record() {
  DFLASH2_CHECK_ARG(ev_ != nullptr, "cuda::Event::record on an empty event");
  DeviceGuard guard(device_);
  // inside a stream capture the record becomes an event record node of the graph (external:
  // the event is recorded each time the graph runs, and the host can wait on / time it)
  cudaStream_t s = current_stream();
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  DFLASH2_CUDA_CHECK(cudaStreamIsCapturing(s, &cap), "cuda:", device_);
  DFLASH2_CUDA_CHECK(cudaEventRecordWithFlags(static_cast<cudaEvent_t>(ev_), s,
                                              cap == cudaStreamCaptureStatusActive ? cudaEventRecordExternal
                                                                                   : cudaEventRecordDefault),
                     "cuda:", device_);
  recorded_ = true;
}

void Event::wait() {
  if (!ev_ || !recorded_) return;
  DFLASH2_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(ev_)), "cuda:", device_);
}

void Event::stream_wait(int device) const {
  if (!ev_ || !recorded_) return;
  DeviceGuard guard(device);  // the legacy default stream (nullptr) is the current device's
  DFLASH2_CUDA_CHECK(cudaStreamWaitEvent(current_stream(), static_cast<cudaEvent_t>(ev_), 0), "cuda:", device,
                     " waiting for an event of cuda:", device_);
}

bool enable_peer_access(int device, int peer) {
  if (device == peer) return true;
  int can = 0;
  if (cudaDeviceCanAccessPeer(&can, device, peer) != cudaSuccess || !can) {
    cudaGetLastError();  // not sticky; nothing to report: the copies are staged instead
    return false;
  }
  DeviceGuard guard(device);
  const cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
  if (e != cudaSuccess) cudaGetLastError();  // already enabled (true), or too many peers (false)
  return e == cudaSuccess || e == cudaErrorPeerAccessAlreadyEnabled;
}

void copy_peer_async(void* dst, int dst_dev, const void* src, int src_dev, size_t bytes) {
  if (bytes == 0) return;
  DeviceGuard guard(dst_dev);
  DFLASH2_CUDA_CHECK(cudaMemcpyPeerAsync(dst, dst_dev, src, src_dev, bytes, current_stream()), bytes, " bytes from cuda:",
                     src_dev, " to cuda:", dst_dev);
}

void mem_info(int device, size_t* free_bytes, size_t* total_bytes) {
  check_index(device, "mem_info");
  DeviceGuard guard(device);
  DFLASH2_CUDA_CHECK(cudaMemGetInfo(free_bytes, total_bytes), "cuda:", device);
}

std::string device_arch(int device) {
  check_index(device, "device_arch");
  int major = 0, minor = 0;
  DFLASH2_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cuda:", device);
  DFLASH2_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "cuda:", device);
  return "sm_" + std::to_string(major) + std::to_string(minor);
}

void check_arch(int device) {
  const std::string arch = device_arch(device);  // "sm_90"
  const std::string cc = arch.substr(3);         // "90"
#ifdef DFLASH2_CUDA_ARCHS_STR
  const std::string built = DFLASH2_CUDA_ARCHS_STR;  // "90a,100a,103a"
#else
  const std::string built;
#endif
  // Architecture-specific SASS (90a, 100a, 103a) runs only on exactly that compute
  // capability; a plain number (e.g. "90") also carries PTX the driver can JIT for newer GPUs.
  size_t start = 0;
  while (start <= built.size()) {
    size_t end = built.find(',', start);
    if (end == std::string::npos) end = built.size();
    std::string item = built.substr(start, end - start);
    std::string num;
    for (char ch : item)
      if (ch >= '0' && ch <= '9') num += ch;
    const bool specific = !item.empty() && (item.back() == 'a' || item.back() == 'f');
    if (!num.empty() && (num == cc || (!specific && std::stoi(num) <= std::stoi(cc)))) return;
    start = end + 1;
  }
  std::string name = "?";
  cudaDeviceProp p;
  if (cudaGetDeviceProperties(&p, device) == cudaSuccess) name = p.name;
  cudaGetLastError();
  fail(ErrorKind::Unsupported, "cuda:", device, " (", name, ") is ", arch, ", which this build has no kernels for (built for ",
       built.empty() ? std::string("?") : built,
       "); the CUDA backend targets Hopper (sm_90a) and Blackwell (sm_100a, sm_103a): rebuild with "
       "DFLASH2_CUDA_ARCHS including ", cc, " if its kernels support it");
}

std::string toolkit_version() { return version_str(CUDART_VERSION); }

std::string runtime_info() {
  std::ostringstream os;
  os << "CUDA runtime " << toolkit_version() << " (static)";
  int drv = 0;
  if (cudaDriverGetVersion(&drv) == cudaSuccess && drv > 0)
    os << ", driver supports CUDA " << version_str(drv);
  else
    os << ", no CUDA driver";
  cudaGetLastError();
  int n = 0;
  cudaError_t e = query_count(&n);
  if (e != cudaSuccess) {
    os << "; no CUDA device: cudaGetDeviceCount failed: " << detail::describe_error(e);
    return os.str();
  }
  os << "; " << n << " device" << (n == 1 ? "" : "s");
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) {
      cudaGetLastError();
      os << "; cuda:" << i << ": properties unavailable";
      continue;
    }
    os << "; cuda:" << i << ": " << p.name << " (sm_" << p.major << p.minor << ", " << p.multiProcessorCount
       << " SMs, " << human_bytes(p.totalGlobalMem) << ")";
  }
#ifdef DFLASH2_CUDA_ARCHS_STR
  os << "; built for " << DFLASH2_CUDA_ARCHS_STR;
#endif
  return os.str();
}

}  // namespace dflash2::cuda
