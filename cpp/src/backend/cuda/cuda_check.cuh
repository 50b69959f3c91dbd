// cuda/cuda_check.cuh: CUDA error handling shared by the cuda/*.cu files. Every failing
// CUDA call becomes a dflash2::Error (ErrorKind::Backend unless stated) naming the call,
// the CUDA error name and its description; nothing aborts.
// check_launch (below) is compiled but has not yet run on a GPU.
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "dflash2/error.h"

namespace dflash2::cuda::detail {

inline std::string describe_error(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

// Throws Backend "<call> failed (<context>): cudaErrorX: text".
template <class... A>
[[noreturn]] void raise(cudaError_t e, const char* call, const A&... context) {
  cudaGetLastError();  // clear the (non-sticky) error so later calls start clean
  if constexpr (sizeof...(A) > 0) {
    fail(ErrorKind::Backend, call, " failed (", context..., "): ", describe_error(e));
  } else {
    fail(ErrorKind::Backend, call, " failed: ", describe_error(e));
  }
}

// Makes `device` current for the lifetime of the guard and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaError_t e = cudaGetDevice(&prev_);
    if (e != cudaSuccess) raise(e, "cudaGetDevice");
    if (prev_ != device) {
      e = cudaSetDevice(device);
      if (e != cudaSuccess) raise(e, "cudaSetDevice", "cuda:", device);
      restore_ = true;
    }
  }
  ~DeviceGuard() {
    if (restore_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool restore_ = false;
};

// After a kernel launch: throws Backend "<what> kernel launch failed (<context>): ..." if the
// launch failed (bad configuration, no SASS for this GPU, or a sticky error left by an
// earlier kernel), with a hint to rebuild when the build has no code for this GPU. Does
// not synchronize: a fault inside the kernel surfaces at the next synchronizing call.
template <class... A>
void check_launch(const char* what, const A&... context) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return;
  if (e == cudaErrorNoKernelImageForDevice || e == cudaErrorInvalidDeviceFunction) {
#ifdef DFLASH2_CUDA_ARCHS_STR
    const char* built = DFLASH2_CUDA_ARCHS_STR;
#else
    const char* built = "?";
#endif
    raise(e, what, context..., "; this build has SASS for ", built,
          " only: rebuild with DFLASH2_CUDA_ARCHS including this GPU's architecture");
  }
  raise(e, what, context...);
}

}  // namespace dflash2::cuda::detail

// DFLASH2_CUDA_CHECK(cudaMemcpy(...), "context", ...): throws on failure, naming the call.
#define DFLASH2_CUDA_CHECK(expr, ...)                                            \
  do {                                                                           \
    cudaError_t dflash2_cuda_err_ = (expr);                                      \
    if (dflash2_cuda_err_ != cudaSuccess)                                        \
      ::dflash2::cuda::detail::raise(dflash2_cuda_err_, #expr, ##__VA_ARGS__);   \
  } while (0)
