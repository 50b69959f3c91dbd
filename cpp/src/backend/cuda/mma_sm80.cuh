// cuda/mma_sm80.cuh: the warp-level tensor-core PTX the SIMT-scheduled kernels share
// (gemm_dq.cu's mainloop-dequantizing GEMM, attention.cu's tensor-core block attention):
// cp.async, ldmatrix (plain and transposed) from shared memory, mma.sync m16n8k16 with BF16 operands
// and fp32 accumulators (every architecture the build targets: sm_90a, sm_100a, sm_103a),
// and BF16 packing. Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16"), with
// g = lane / 4 and t = lane % 4:
//   A 16 x 16 (row): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B 16 x 8 (col):  b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C 16 x 8 fp32:   c0, c1 = (g, 2t..2t+1), c2, c3 = (g+8, 2t..2t+1)
// ldmatrix .x4: lanes 8j..8j+7 give the row addresses of matrix j (16 bytes each), and
// register j of lane l holds row l / 4, columns 2 (l % 4) .. +1 of matrix j (of its
// transpose with .trans).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

namespace dflash2::cuda::mma {

#if defined(DFLASH2_CUDA_EMULATED)
// The CPU emulation (cpp/emu/cuda_emu.h): the same operations as warp collectives of the
// emulator, which implements the PTX ISA's fragment tables itself.
inline uint32_t smem_u32(const void* p) { return ::emu::smem_addr(p); }
inline void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) { ::emu::ldmatrix_x4(addr, r, false); }
inline void ldmatrix_x4_trans(uint32_t addr, uint32_t (&r)[4]) { ::emu::ldmatrix_x4(addr, r, true); }
inline void cp_async16(uint32_t dst, const void* src, bool valid) { ::emu::cp_async16(dst, src, valid); }
inline void cp_async_commit() { ::emu::cp_async_commit(); }
inline void cp_async_wait_all() { ::emu::cp_async_wait_all(); }
inline void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) { ::emu::mma_bf16(c, a, b0, b1); }
#else
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
// 16 bytes global -> shared without registers (cp.async, L2 only), or 16 zero bytes when
// !valid (src is then not read); commit closes a group, wait_all waits for every group.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// c += a (16 x 16, row) * b (16 x 8, col), BF16 in, fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif  // DFLASH2_CUDA_EMULATED
// Two floats rounded to BF16 (nearest even), lo at the lower address (column order).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

}  // namespace dflash2::cuda::mma
