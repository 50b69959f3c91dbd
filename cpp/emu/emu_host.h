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

// Whether EMU_MEMCHECK is on; under EMU_MEMCHECK=2 `hook` (if set) runs after every kernel
// and host reference with the kernel's name (the workspace arenas check their red zones).
bool memcheck_enabled();
void set_after_kernel_hook(void (*hook)(const char* kernel));
// Under EMU_MEMCHECK, `hook(true)` runs before each cudaGraphLaunch and `hook(false)` after it.
void set_graph_hook(void (*hook)(bool before));

}  // namespace emu
