// cuda/device_attr.cuh: a device attribute (SM count, compute capability) queried once per
// device and cached, for launch decisions made on every call (a driver query per launch
// would add host time to every op).
//
// Status: compiled for sm_90a/sm_100a/sm_103a, NOT yet run on a GPU.
#pragma once
#include <cuda_runtime.h>

#include <atomic>

#include "backend/cuda/cuda_check.cuh"

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

}  // namespace dflash2::cuda::detail
