// cuda/kernel_util.cuh: small device and launch helpers shared by the CUDA op files
// (conversions, aligned vector accesses, block reductions, launch-size rules).
//
// Status: compiled for sm_90a/sm_100a/sm_103a, not yet run on a GPU.
//
// Numerics: the elementwise ops promise the CPU backend's fp32 operations in the CPU's
// order. nvcc contracts a * b + c into one FMA by default (--fmad=true) and GCC does not
// for the CPU build (no FMA in the baseline ISA), so every multiply/add whose rounding
// matters is written with the __fmul_rn / __fadd_rn / __fsub_rn intrinsics, which are never
// contracted. Divisions and square roots are IEEE (the build does not use fast-math).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/cuda_api.h"
#include "backend/cuda/cuda_check.cuh"
#include "dflash2/error.h"

namespace dflash2::cuda::detail {

constexpr int kMaxThreads = 1024;
// Row kernels use one block per row up to this many blocks, then grid-stride over rows.
constexpr int64_t kMaxRowBlocks = int64_t(1) << 20;
// gridDim.y / gridDim.z limit.
constexpr int64_t kMaxGridY = 65535;

inline cudaStream_t stream() { return current_stream(); }

// ------------------------------------------------------------------ conversions
// silu(g) * u with the CPU's operations in its order, (g / (1 + exp(-g))) * u, each correctly
// rounded but expf (CUDA's, within 2 ulp of the CPU's): the gated MLPs' and experts' input of
// the down projection, everywhere on CUDA.
__device__ __forceinline__ float silu_mul(float g, float u) {
  return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

__device__ __forceinline__ float to_f32(float v) { return v; }
// bf16 -> f32 is a 16-bit shift: exact, NaN payloads kept (as the CPU's bf16_to_f32).
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) {
  return __uint_as_float(uint32_t(__bfloat16_as_ushort(v)) << 16);
}
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
// The two BF16 values of a 32-bit word (element 0 in the low half, little endian), widened
// exactly; and the eight of a 16-byte word in element order (16-byte BF16 row loads).
__device__ __forceinline__ float bf16_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }
__device__ __forceinline__ void widen_bf16x8(const uint4& v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    f[2 * q] = bf16_lo(w[q]);
    f[2 * q + 1] = bf16_hi(w[q]);
  }
}

// A float-weight element of a runtime dtype (F32 / BF16 / F16), for small 1-D weight
// vectors where a dtype switch per element costs nothing next to the row reduction.
enum class WCode : int { F32 = 0, BF16 = 1, F16 = 2 };
inline WCode wcode(DType t) {
  switch (t) {
    case DType::F32: return WCode::F32;
    case DType::BF16: return WCode::BF16;
    case DType::F16: return WCode::F16;
    default: break;
  }
  fail(ErrorKind::InvalidArgument, "cuda: a float weight must be F32, BF16 or F16, found ", dtype_name(t));
}
__device__ __forceinline__ float load_w(const void* p, WCode c, int64_t i) {
  if (c == WCode::F32) return static_cast<const float*>(p)[i];
  if (c == WCode::BF16) return to_f32(static_cast<const __nv_bfloat16*>(p)[i]);
  return to_f32(static_cast<const __half*>(p)[i]);
}

// ------------------------------------------------------------------ vector accesses
// G consecutive elements, loaded / stored as one aligned access.
template <class T, int G>
struct alignas(sizeof(T) * G) Vec {
  T v[G];
};

inline bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// ------------------------------------------------------------------ block reductions
// Deterministic for a given blockDim: a butterfly inside each warp, then the same over the
// warp results in warp 0. The result is returned to every thread. `scratch` holds 33
// values; the function ends with a barrier so the caller may reuse scratch at once. Every
// thread of the block must call it (no divergent early exits before it).
struct SumOp {
  template <class T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
// The CPU's std::max(m, v) = (m < v) ? v : m: a NaN operand on the right is ignored.
// Operands are never NaN when combined here (NaNs are filtered before), so this is max.
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a < b ? b : a; }
};

template <class T, class Op>
__device__ __forceinline__ T block_reduce(T v, T* scratch, Op op, T identity) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = (blockDim.x + 31) >> 5;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, off));
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T s = lane < nwarps ? scratch[lane] : identity;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s = op(s, __shfl_xor_sync(0xffffffffu, s, off));
    if (lane == 0) scratch[32] = s;
  }
  __syncthreads();
  const T total = scratch[32];
  __syncthreads();
  return total;
}

// ------------------------------------------------------------------ launch sizes
// Threads for a block that loops over `work` items: a multiple of 32 in [32, 1024]. Row
// kernels take it from the row length only, so a row's reduction order (and result) does
// not depend on how many rows run together (decode == verify).
inline int pick_threads(int64_t work, int max_threads = kMaxThreads) {
  int64_t t = (work + 31) / 32 * 32;
  if (t < 32) t = 32;
  if (t > max_threads) t = max_threads;
  return int(t);
}

inline unsigned row_blocks(int64_t rows) { return unsigned(rows < kMaxRowBlocks ? rows : kMaxRowBlocks); }

inline unsigned ceil_blocks(int64_t items, int threads, int64_t cap) {
  int64_t b = (items + threads - 1) / threads;
  if (b < 1) b = 1;
  return unsigned(b < cap ? b : cap);
}

}  // namespace dflash2::cuda::detail
