// cuda/wgmma_sm90.cuh: the warpgroup tensor-core PTX of sm_90a (Hopper) that gemm_dq.cu's
// wgmma kernel uses: wgmma.mma_async m64n128k16 with BF16 operands both in shared memory
// (K-major, described by layout::wg_desc_k_sw128), F32 accumulators in registers (64 per
// thread of the warpgroup, layout::wg_acc_row / wg_acc_col), and its fences:
//   fence()            wgmma.fence: before the first wgmma, and after any access to the
//                      accumulators (every k-tile here, after the previous wait);
//   mma_64x128(d, a, b) d += A (64 x 16) * B (16 x 128), both read from shared memory;
//   commit()           closes the group of wgmmas issued since the last commit;
//   wait<N>()          waits until at most N groups are in flight;
//   fence_operands(d)  keeps the compiler from moving accesses to d across the asynchronous
//                      instructions (registers are not "memory" to an asm clobber);
//   fence_proxy_async() orders this thread's ordinary shared-memory writes (st.shared,
//                      cp.async) before the tensor cores' reads of them (in each writing
//                      thread, before the barrier).
// Only sm_90a has wgmma: on other targets the device functions trap (the host launches the
// wgmma kernel only on compute capability 9.0). In the CPU emulation (cpp/emu) the same
// calls are the emulator's, which implements the PTX ISA's descriptor and fragment rules itself.
#pragma once
#include <cstdint>

namespace dflash2::cuda::wg {

#if defined(DFLASH2_CUDA_EMULATED)
inline void fence() { ::emu::wgmma_fence(); }
inline void commit() { ::emu::wgmma_commit(); }
template <int N>
inline void wait() { ::emu::wgmma_wait(N); }
inline void mma_64x128(float (&d)[64], uint64_t desc_a, uint64_t desc_b) { ::emu::wgmma_bf16_ss(d, 128, desc_a, desc_b); }
inline void fence_operands(float (&)[64]) {}
inline void fence_proxy_async() {}
#else
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DFLASH2_WGMMA 1
#endif
__device__ __forceinline__ void fence() {
#ifdef DFLASH2_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void commit() {
#ifdef DFLASH2_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}
template <int N>
__device__ __forceinline__ void wait() {
#ifdef DFLASH2_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#else
  __trap();
#endif
}
// d += A * B: scale-d true (accumulate: the predicate from %66 = 1), A and B not negated, both K-major (no transpose).
__device__ __forceinline__ void mma_64x128(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
#ifdef DFLASH2_WGMMA
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(1));
#else
  (void)d, (void)desc_a, (void)desc_b;
  __trap();
#endif
}
__device__ __forceinline__ void fence_operands(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void fence_proxy_async() {
#ifdef DFLASH2_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
#undef DFLASH2_WGMMA
#endif  // DFLASH2_CUDA_EMULATED

}  // namespace dflash2::cuda::wg
