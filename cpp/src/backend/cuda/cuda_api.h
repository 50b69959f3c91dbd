// Internal: the functions the CUDA backend (cuda/*.cu) provides to the core. Only
// declared when the library is built with DFLASH2_WITH_CUDA; callers guard with #ifdef.
#pragma once
#include <cstddef>
#include <string>

#include "dflash2/tensor.h"

namespace dflash2::cuda {

bool available(std::string* why);   // a device is usable now; else *why says why
int device_count();                 // 0 when no driver/device
void* device_malloc(size_t bytes, int device);   // throws OutOfMemory / Backend errors
void device_free(void* p, int device) noexcept;
// Copies `bytes` between host and device memory in any direction (synchronous).
void copy(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes);
void memset_zero(void* dst, int device, size_t bytes);
void synchronize(int device);
std::string toolkit_version();      // CUDART_VERSION at compile time, "13.0"
std::string runtime_info();         // driver/runtime versions and device names, or why none

// ops (inputs already validated by ops.cpp: same device, shapes consistent, contiguous rows)
void rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out);

}  // namespace dflash2::cuda
