// cuda/device_attr.cuh: a device attribute (SM count, compute capability) queried once per
// device and cached, for launch decisions made on every call (a driver query per launch
// would add host time to every op); and a kernel's opt-in to more than 48 KiB of dynamic
// shared memory, set once per (device, kernel).
//
// Status: compiled for sm_90a/sm_100a/sm_103a, NOT yet run on a GPU.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <map>
#include <mutex>
#include <utility>

#include "backend/cuda/cuda_check.cuh"
#include "dflash2/error.h"

namespace dflash2::cuda::detail {

template <cudaDeviceAttr A>
inline int device_attribute(int device) {
  static std::atomic<int> cache[64] = {};
  const bool cached = device >= 0 && device < 64;
  if (cached) {
    const int v = cache[device].load(std::memory_order_relaxed);
    if (v > 0) return v;
  }
  int v = 0;
  DFLASH2_CUDA_CHECK(cudaDeviceGetAttribute(&v, A, device), "cuda:", device);
  if (cached) cache[device].store(v, std::memory_order_relaxed);
  return v;
}

inline int sm_count(int device) { return device_attribute<cudaDevAttrMultiProcessorCount>(device); }
// major * 10 + minor: 90 for H100 / H200, 100 / 103 for B200 / GB300
inline int compute_capability(int device) {
  return device_attribute<cudaDevAttrComputeCapabilityMajor>(device) * 10 +
         device_attribute<cudaDevAttrComputeCapabilityMinor>(device);
}

constexpr size_t kDefaultSmem = 48 * 1024;

// Opts `kernel` into `bytes` of dynamic shared memory when above the default 48 KiB. The
// attribute is per (device, kernel) and a larger limit also serves smaller launches, so the
// largest size set so far is remembered and the driver calls are made only when a launch
// needs more (not on every launch). Call with `device` current (DeviceGuard). A
// cudaDeviceReset would drop the attribute; the runtime never resets a device.
template <class K>
inline void allow_smem(K kernel, size_t bytes, int device, const char* op) {
  if (bytes <= kDefaultSmem) return;
  static std::mutex mu;
  static std::map<std::pair<int, const void*>, size_t> granted;  // (device, kernel) -> bytes set
  const std::pair<int, const void*> key{device, reinterpret_cast<const void*>(kernel)};
  std::lock_guard<std::mutex> lock(mu);
  const auto it = granted.find(key);
  if (it != granted.end() && it->second >= bytes) return;
  int optin = 0;
  DFLASH2_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), op);
  DFLASH2_CHECK(bytes <= size_t(optin), ErrorKind::Unsupported, "cuda::", op, ": these shapes need ", bytes,
                " bytes of shared memory per block, cuda:", device, " allows ", optin);
  DFLASH2_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)), op);
  granted[key] = bytes;
}

}  // namespace dflash2::cuda::detail
