// cuda/scratch.h: scratch memory for CUDA ops without a workspace argument (scratch.cu).
#pragma once
#include <cstddef>

namespace dflash2::cuda::detail {
// At least `bytes` of device memory on `device` for the current stream (cuda_api.h
// current_stream()), valid until the next scratch() call on the same stream. Contents are
// undefined. Throws (Backend) if it must grow while the stream is capturing a CUDA graph.
void* scratch(int device, size_t bytes);
}  // namespace dflash2::cuda::detail
