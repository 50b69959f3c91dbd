// The CUDA backend's entries in the dispatch table: each op implemented in this folder
// registers here; ops without an entry raise a clear Unsupported error.
// ops::embedding dispatches to gather_rows, so it runs on the CUDA gather too.
#include "backend/cuda/cuda_api.h"
#include "ops/backend.h"

namespace dflash2::ops {
void register_cuda_ops(BackendTable& t) {
  t.rms_norm = &cuda::rms_norm;        // rmsnorm.cu
  t.layer_norm = &cuda::layer_norm;    // row_reduce.cu
  t.softmax = &cuda::softmax;          // row_reduce.cu
  t.argmax = &cuda::argmax;            // row_reduce.cu
  t.check_finite = &cuda::check_finite;  // row_reduce.cu
  t.rope = &cuda::rope;                // elementwise.cu
  t.silu_mul = &cuda::silu_mul;        // elementwise.cu
  t.add = &cuda::add;                  // elementwise.cu
  t.copy = &cuda::copy;                // copy.cu
  t.gather_rows = &cuda::gather_rows;  // index_rows.cu
  t.cache_write = &cuda::cache_write;  // index_rows.cu
  t.dyn_conv = &cuda::dyn_conv;        // drafter_ops.cu
}
}  // namespace dflash2::ops
