// cpp/emu/emu_host.h: host work queued on an emulated stream, for the emulator's plain C++
// translation units (cutlass_ref.cpp), which are not compiled with cuda_emu.h forced in.
#pragma once
#include <cuda_runtime.h>

#include <functional>

namespace emu {

// Runs `op` in stream order: now, or at each replay of the graph when `s` is capturing
// (what a kernel launch does in the emulator). Returns cudaSuccess.
cudaError_t enqueue_host(cudaStream_t s, std::function<void()> op);

// Whether [p, p + bytes) lies inside one cudaMalloc'ed allocation; its device in *device.
bool device_range(const void* p, size_t bytes, int* device);

}  // namespace emu
