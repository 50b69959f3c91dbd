// cuda/stream.cpp: the thread-local stream the CUDA ops launch on (see cuda_api.h).
// Default nullptr = the legacy default stream, which is what every op used before streams
// existed. Status: compiled, not yet run on a GPU.
#include "backend/cuda/cuda_api.h"

namespace dflash2::cuda {

namespace {
thread_local CUstream_st* tl_stream = nullptr;
}  // namespace

CUstream_st* current_stream() { return tl_stream; }
void set_current_stream(CUstream_st* stream) { tl_stream = stream; }

}  // namespace dflash2::cuda
