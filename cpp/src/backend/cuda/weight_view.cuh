// cuda/weight_view.cuh: a linear layer's weight (ops::Weight) as the CUDA kernels read it:
// a flat view (format, pointers, strides) and device functions that dequantize elements
// exactly as the CPU does (Weight::dequantize, backend/cpu/gemm.cpp w_at): dense F32 /
// BF16 / F16 widened, FP8 E4M3 times its block-128 scale (one fp32 multiply), NVFP4 E2M1
// times its E4M3 per-16 scale times the global scale (two fp32 multiplies, in that order).
// Shared by gemm.cu (linear) and moe.cu (the routed experts).
//
// Status: compiled for sm_90a/sm_100a/sm_103a, NOT yet run on a GPU.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/layout.h"
#include "dflash2/error.h"
#include "dflash2/ops.h"

namespace dflash2::cuda::detail {

enum class WFmt : int { F32 = 0, BF16 = 1, F16 = 2, FP8 = 3, NVFP4 = 4 };

// Host: f(std::integral_constant<WFmt, F>{}) for the runtime format `fmt`, the one switch
// from a weight's format to the kernel instantiated for it (use decltype(tag)::value).
template <class Fn>
void with_format(WFmt fmt, Fn&& f) {
  switch (fmt) {
    case WFmt::F32: return f(std::integral_constant<WFmt, WFmt::F32>{});
    case WFmt::BF16: return f(std::integral_constant<WFmt, WFmt::BF16>{});
    case WFmt::F16: return f(std::integral_constant<WFmt, WFmt::F16>{});
    case WFmt::FP8: return f(std::integral_constant<WFmt, WFmt::FP8>{});
    case WFmt::NVFP4: return f(std::integral_constant<WFmt, WFmt::NVFP4>{});
  }
}

// Plain data: passed to kernels by value.
struct WeightView {
  WFmt fmt = WFmt::F32;
  const uint8_t* data = nullptr;  // row r at data + r * row_bytes
  int64_t row_bytes = 0;
  const void* scale = nullptr;    // FP8: F32 [ceil(N/128), *] (row stride scale_stride);
                                  // NVFP4: E4M3 bytes [N, *] (row stride scale_stride)
  int64_t scale_stride = 0;       // in elements
  float global_scale = 1.0f;
  float input_scale = 0.0f;       // NVFP4: the activations' per-tensor scale (W4A4), 0 if none
  int64_t N = 0, K = 0;
  // NVFP4, optional: the scales in the block-scaled layout (ops::Weight::sf_blocked:
  // layout.h nvfp4_sf_offset over nvfp4_sf_rows(N) x nvfp4_sf_cols(K)), or nullptr
  const uint8_t* sf_blocked = nullptr;
};

// Host: the view of `w`, which must live on CUDA device `device` (data and scale).
inline WeightView weight_view(const ops::Weight& w, int device, const char* op) {
  DFLASH2_CHECK_ARG(w.data.defined(), op, ": undefined weight '", w.name, "'");
  DFLASH2_CHECK_ARG(w.data.device().is_cuda() && w.data.device().index == device, op, ": weight '", w.name,
                    "' must be on cuda:", device, ", found ", w.data.describe());
  DFLASH2_CHECK_ARG(w.data.ndim() == 2 && w.data.stride(1) == 1, op, ": weight '", w.name,
                    "' rows must be contiguous, found ", w.data.describe());
  WeightView v;
  v.data = static_cast<const uint8_t*>(w.data.data());
  v.row_bytes = w.data.stride(0) * int64_t(w.data.itemsize());
  v.N = w.out_features;
  v.K = w.in_features;
  v.global_scale = w.global_scale;
  v.input_scale = w.input_scale;
  switch (w.format) {
    case ops::WeightFormat::Dense:
      switch (w.data.dtype()) {
        case DType::F32: v.fmt = WFmt::F32; break;
        case DType::BF16: v.fmt = WFmt::BF16; break;
        case DType::F16: v.fmt = WFmt::F16; break;
        default:
          fail(ErrorKind::InvalidArgument, op, ": dense weight '", w.name, "' must be F32/BF16/F16, found ",
               w.data.describe());
      }
      break;
    case ops::WeightFormat::FP8Block128:
    case ops::WeightFormat::NVFP4:
      DFLASH2_CHECK_ARG(w.scale.defined() && w.scale.device() == w.data.device() && w.scale.ndim() == 2 &&
                            w.scale.stride(1) == 1,
                        op, ": weight '", w.name, "' scales must be a row-major 2-D tensor on cuda:", device,
                        ", found ", w.scale.describe());
      v.fmt = w.format == ops::WeightFormat::FP8Block128 ? WFmt::FP8 : WFmt::NVFP4;
      v.scale = w.scale.data();
      v.scale_stride = w.scale.stride(0);
      break;
  }
  if (w.sf_blocked.defined()) {
    const int64_t want = layout::nvfp4_sf_rows(v.N) * layout::nvfp4_sf_cols(v.K);
    DFLASH2_CHECK_ARG(v.fmt == WFmt::NVFP4 && w.sf_blocked.device() == w.data.device() &&
                          w.sf_blocked.dtype() == DType::U8 && w.sf_blocked.is_contiguous() &&
                          w.sf_blocked.numel() == want,
                      op, ": weight '", w.name, "': its block-scaled scales must be U8 [", want,
                      "] (contiguous) on cuda:", device, " for an NVFP4 weight, found ", w.sf_blocked.describe());
    v.sf_blocked = static_cast<const uint8_t*>(w.sf_blocked.data());
  }
  return v;
}

// OCP E4M3 ("fn") byte -> f32, exact (the CPU's fp8_e4m3_to_f32; 0x7f / 0xff are NaN).
__device__ __forceinline__ float e4m3_to_f32(uint8_t b) {
  __nv_fp8_e4m3 v;
  v.__x = b;
  return float(v);
}
// E2M1 nibble -> f32, exact.
// Built from the bits (no table, which would live in local memory): exponent field e =
// bits 2..1, mantissa bit 0; e > 0 is 2^(e-1) (1 + m/2), e = 0 the subnormal m/2.
__device__ __forceinline__ float e2m1_to_f32(uint32_t nib) {
  const uint32_t e = (nib >> 1) & 3u, m = nib & 1u;
  uint32_t bits = e ? (((e + 126u) << 23) | (m << 22)) : (m ? 0x3f000000u : 0u);
  bits |= (nib & 8u) << 28;
  return __uint_as_float(bits);
}

// NVFP4's fast pair decode (gemm_sk.cu's dequant8, gemm_dq.cu's finish_w), for global scales
// g with g' = g * 2^126 finite (g below 4; fast = false otherwise, and for other formats):
// a code's BF16 bits sign << 15 | (exponent, mantissa) << 6 are the E2M1 value v times 2^-126
// exactly (the subnormal E2M1 0.5 too); v 2^-126 * s is exact in fp32 (at most 6 significant
// bits, >= 2^-136) for an E4M3 scale s, and times g' is one rounding of the same real v s g:
// bitwise w_at's fl(fl(v s) g), in about half the operations of decoding each nibble's fields.
struct Fp4Global {
  bool fast;
  float g_scaled;  // g * 2^126
  float g;
};
__host__ __device__ inline Fp4Global fp4_global(const WeightView& w) {
  const float gs = w.global_scale * 0x1p126f;  // exact unless it overflows
  return {w.fmt == WFmt::NVFP4 && w.global_scale > 0.0f && gs <= 0x1.fffffep127f, gs, w.global_scale};
}
// The two codes of byte b (inputs 2j: low nibble, 2j + 1: high nibble) as the fp32 bits of
// their values times 2^-126: `pair << 16` is the low input's, `pair & 0xffff0000` the high's.
__device__ __forceinline__ uint32_t fp4_pair_bits(uint32_t b) {
  return ((b & 0x7u) << 6) | ((b & 0x8u) << 12) | ((b & 0x70u) << 18) | ((b & 0x80u) << 24);
}
// 8 NVFP4 codes (a word, input i in nibble i) with E4M3 scale s (as f32) to f32 values,
// bitwise w_at's: the pair decode when q.fast, else field by field.
__device__ __forceinline__ void fp4_word_to_f32(const Fp4Global q, uint32_t word, float s, float (&f)[8]) {
  if (q.fast) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t pair = fp4_pair_bits((word >> (8 * j)) & 0xffu);
      f[2 * j] = __fmul_rn(__fmul_rn(__uint_as_float(pair << 16), s), q.g_scaled);
      f[2 * j + 1] = __fmul_rn(__fmul_rn(__uint_as_float(pair & 0xffff0000u), s), q.g_scaled);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = __fmul_rn(__fmul_rn(e2m1_to_f32((word >> (4 * i)) & 15u), s), q.g);
  }
}

// W[r, k] as f32 (any format; the reference order of the CPU's scalar path).
template <WFmt F>
__device__ __forceinline__ float w_at(const WeightView& w, int64_t r, int64_t k) {
  const uint8_t* row = w.data + r * w.row_bytes;
  if constexpr (F == WFmt::F32) {
    return reinterpret_cast<const float*>(row)[k];
  } else if constexpr (F == WFmt::BF16) {
    return to_f32(reinterpret_cast<const __nv_bfloat16*>(row)[k]);
  } else if constexpr (F == WFmt::F16) {
    return to_f32(reinterpret_cast<const __half*>(row)[k]);
  } else if constexpr (F == WFmt::FP8) {
    const float s = static_cast<const float*>(w.scale)[(r / 128) * w.scale_stride + k / 128];
    return __fmul_rn(e4m3_to_f32(row[k]), s);
  } else {
    const uint8_t b = row[k >> 1];
    const uint32_t nib = (k & 1) ? (b >> 4) : (b & 15u);
    const float s = e4m3_to_f32(static_cast<const uint8_t*>(w.scale)[r * w.scale_stride + k / 16]);
    return __fmul_rn(__fmul_rn(e2m1_to_f32(nib), s), w.global_scale);
  }
}

// The raw bytes of W[r, k0 .. k0 + 7] (one 32 / 16 / 8 / 4 byte load, the caller having
// checked the alignment of every row: weight_rows_vectorizable) and the scale they need,
// fetched by w_fetch8 and turned into f32 by w_decode8. A kernel that fetches several chunks
// before decoding the first keeps that many loads in flight in a few registers per chunk
// (decoded values would take 8 each).
template <WFmt F>
struct WRaw8;
template <>
struct WRaw8<WFmt::F32> {
  float4 a, b;
};
template <>
struct WRaw8<WFmt::BF16> {
  uint4 u;
};
template <>
struct WRaw8<WFmt::F16> {
  uint4 u;
};
template <>
struct WRaw8<WFmt::FP8> {
  uint2 u;
  float s;  // the block-128 scale
};
template <>
struct WRaw8<WFmt::NVFP4> {
  uint32_t u;
  uint8_t s;  // the E4M3 per-16 scale
};

template <WFmt F>
__device__ __forceinline__ WRaw8<F> w_fetch8(const WeightView& w, int64_t r, int64_t k0) {
  const uint8_t* row = w.data + r * w.row_bytes;
  WRaw8<F> q;
  if constexpr (F == WFmt::F32) {
    const float4* p = reinterpret_cast<const float4*>(row + 4 * k0);
    q.a = p[0];
    q.b = p[1];
  } else if constexpr (F == WFmt::BF16 || F == WFmt::F16) {
    q.u = *reinterpret_cast<const uint4*>(row + 2 * k0);
  } else if constexpr (F == WFmt::FP8) {
    q.u = *reinterpret_cast<const uint2*>(row + k0);
    q.s = static_cast<const float*>(w.scale)[(r / 128) * w.scale_stride + k0 / 128];
  } else {
    q.u = *reinterpret_cast<const uint32_t*>(row + k0 / 2);
    q.s = static_cast<const uint8_t*>(w.scale)[r * w.scale_stride + k0 / 16];
  }
  return q;
}

// The 8 values of a fetched chunk, bitwise w_at's for each element.
template <WFmt F>
__device__ __forceinline__ void w_decode8(const WRaw8<F>& q, const WeightView& w, float out[8]) {
  if constexpr (F == WFmt::F32) {
    out[0] = q.a.x; out[1] = q.a.y; out[2] = q.a.z; out[3] = q.a.w;
    out[4] = q.b.x; out[5] = q.b.y; out[6] = q.b.z; out[7] = q.b.w;
  } else if constexpr (F == WFmt::BF16 || F == WFmt::F16) {
    const uint32_t words[4] = {q.u.x, q.u.y, q.u.z, q.u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (F == WFmt::BF16) {
        out[2 * i] = __uint_as_float(words[i] << 16);
        out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
      } else {
        out[2 * i] = __half2float(__ushort_as_half(uint16_t(words[i] & 0xffffu)));
        out[2 * i + 1] = __half2float(__ushort_as_half(uint16_t(words[i] >> 16)));
      }
    }
  } else if constexpr (F == WFmt::FP8) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t word = i < 4 ? q.u.x : q.u.y;
      out[i] = __fmul_rn(e4m3_to_f32(uint8_t(word >> (8 * (i & 3)))), q.s);
    }
  } else {
    const float s = e4m3_to_f32(q.s);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = __fmul_rn(__fmul_rn(e2m1_to_f32((q.u >> (4 * i)) & 15u), s), w.global_scale);
  }
}

// W[r, k0 .. k0 + 7] as f32 into out[8]; k0 % 8 == 0 and k0 + 8 <= K. One 8-16-32 byte
// load when the row start allows it (vec = true: the caller checked alignment of every row:
// row_bytes and data aligned to 8 elements' bytes), else element loads.
template <WFmt F, bool vec>
__device__ __forceinline__ void w_load8(const WeightView& w, int64_t r, int64_t k0, float out[8]) {
  if constexpr (vec) {
    w_decode8<F>(w_fetch8<F>(w, r, k0), w, out);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = w_at<F>(w, r, k0 + i);
  }
}

// Whether every row of `w` starts 16-byte aligned (gemm_sk.cu's 16-byte segment loads).
inline bool rows_aligned16(const WeightView& w) {
  return reinterpret_cast<uintptr_t>(w.data) % 16 == 0 && w.row_bytes % 16 == 0;
}

// Bytes of 8 consecutive weights of format f (w_fetch8's load): 32 for F32, 16 for BF16 /
// F16, 8 for FP8, 4 for NVFP4.
__host__ __device__ constexpr int chunk8_bytes(WFmt f) {
  return f == WFmt::F32 ? 32 : (f == WFmt::FP8 ? 8 : (f == WFmt::NVFP4 ? 4 : 16));
}

// Whether every row of `w` can take w_load8<F, true> (row starts aligned to the 8-element
// load, chunk8_bytes).
inline bool weight_rows_vectorizable(const WeightView& w) {
  const int64_t a = chunk8_bytes(w.fmt);
  return reinterpret_cast<uintptr_t>(w.data) % a == 0 && w.row_bytes % a == 0;
}

}  // namespace dflash2::cuda::detail
