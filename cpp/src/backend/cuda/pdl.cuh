// cuda/pdl.cuh: programmatic dependent launch (PDL), the kernels' side.
//
// In a CUDA graph, a launch waits for the previous kernel to finish and only then begins its
// own launch: a few microseconds per kernel, ~1700-2100 times in a GLM-5.3 decode step. With a
// programmatic edge (graph.cu turns the captured kernel -> kernel edges into them when
// ops::pdl() is on), the next kernel's blocks may be scheduled while this one still runs; each
// then waits at griddepcontrol.wait until every prerequisite grid has completed and its memory
// is visible -- the same order as before, with the launch latency overlapped.
//
// Hence the rule of this folder: every __global__ function's first statement is
// detail::pdl_enter(). It waits (a no-op when the launch has no programmatic dependency), then
// lets the next kernel's launch begin (griddepcontrol.launch_dependents: its blocks are
// placed only as this grid's last blocks have started, and they too wait before touching
// memory). A kernel without it must never be the later end of a programmatic edge; the CPU
// emulator fails any kernel whose threads reach a barrier, a warp collective, an async copy or
// their end without having entered this way (cpp/emu), so CI checks the rule on every
// emulated launch.
//
// Status: compiled for sm_90a / sm_100a / sm_103a, NOT yet run on a GPU (ops::pdl() is off by
// default until bench/device_check.sh has measured it).
#pragma once
#include <cuda_runtime.h>

namespace dflash2::cuda::detail {

__device__ __forceinline__ void pdl_enter() {
#if defined(DFLASH2_CUDA_EMULATED)
  ::emu::pdl_enter();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace dflash2::cuda::detail
