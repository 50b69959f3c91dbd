// cuda/scratch.h: scratch memory for CUDA ops without a workspace argument (scratch.cu).
#pragma once
#include <cstddef>
#include <cstdint>

namespace dflash2::cuda::detail {
// At least `bytes` of device memory on `device` for the current stream (cuda_api.h
// current_stream()), valid until the next scratch() call on the same stream. Contents are
// undefined. Throws (Backend) if it must grow while the stream is capturing a CUDA graph.
void* scratch(int device, size_t bytes);
// kCounterWords 32-bit words on `device` for the current stream, zero when first handed out
// and to be left zero by every kernel that uses them (the split-K GEMV's arrival counters:
// each launch's last block resets its own), so they persist across launches and graph
// replays. Allocated once per (device, stream), never while that stream is being captured
// into a CUDA graph (Backend error, as scratch()).
constexpr int kCounterWords = 4096;
uint32_t* zeroed_counters(int device);
}  // namespace dflash2::cuda::detail
