// ops/kv_fp8.h: the FP8 KV-cache row format (Engine kv_cache_dtype = "fp8"), written once for
// the host and the device. Plain C++ (no CUDA header): the DFLASH2_HD functions compile as
// __host__ __device__ under nvcc and as inline host functions elsewhere, so the CPU op, the
// CUDA kernels and tests/cpp/test_kv_fp8.cpp share one encoder and one layout.
//
// A quantized row of D values (D a multiple of 16, and D <= 128 or a multiple of 128) is
//   [D E4M3 codes][ng float32 scales, padded to 16 bytes]        fp8_bytes(D) bytes
// in groups of G = min(D, 128) values (ng = D / G), each group's scale a power of two: the
// smallest 2^e with amax <= 448 * 2^e (e >= -100; 1 for an all-zero group). A value is stored
// as the E4M3 code of v / 2^e (round to nearest even; exact scaling), so every stored value
// code * 2^e is exact in F32 and in BF16: a kernel that dequantizes a row computes bitwise the
// F32 op over the dequantized rows, and the tensor-core kernels take them as exact BF16 keys.
// A non-finite value is stored as E4M3's NaN (it stays non-finite; the group's scale is taken
// over its finite values).
//
// The MLA latent row (kv_lora c values, rope k_pe values) is the quantized c followed by k_pe in
// BF16, padded to 16 bytes: fp8_latent_bytes(kvl, rope). For GLM-5.3 (kv_lora 512, rope 64):
// 512 codes + 4 scales (16 bytes) + 64 BF16 = 656 bytes, the byte layout of FlashMLA's / vLLM's
// "fp8_ds_mla" cache (whose float32 scales may be any value; ours are powers of two). The
// indexer's key rows are quantized whole: fp8_bytes(index_head_dim) (GLM-5.3: 144 bytes).
#pragma once
#include <cstdint>

#include "backend/cuda/layout.h"  // DFLASH2_HD, float_bits / bits_float (plain C++, every build)

namespace dflash2::kvfp8 {

constexpr int kMaxGroup = 128;
constexpr int kMinScaleExp = -100;
constexpr uint8_t kNaN = 0x7f;

using cuda::layout::bits_float;
using cuda::layout::float_bits;

// ---- layout
// Whether D values can be stored as one quantized row.
DFLASH2_HD bool fits(int64_t D) { return D >= 16 && D % 16 == 0 && (D <= kMaxGroup || D % kMaxGroup == 0); }
DFLASH2_HD int64_t group(int64_t D) { return D < kMaxGroup ? D : kMaxGroup; }
DFLASH2_HD int64_t groups(int64_t D) { return D / group(D); }
DFLASH2_HD int64_t scale_bytes(int64_t D) { return (4 * groups(D) + 15) / 16 * 16; }
// Bytes of a quantized row of D values (codes, then the scales); a multiple of 16.
DFLASH2_HD int64_t fp8_bytes(int64_t D) { return D + scale_bytes(D); }
// Bytes of an MLA latent row: the quantized kv_lora values, then rope BF16 values at byte
// fp8_bytes(kvl), padded to 16 bytes.
DFLASH2_HD int64_t fp8_latent_bytes(int64_t kvl, int64_t rope) { return (fp8_bytes(kvl) + 2 * rope + 15) / 16 * 16; }

// ---- numbers
// 2^e as a float (e in [-126, 127]).
DFLASH2_HD float pow2(int e) { return bits_float(uint32_t(e + 127) << 23); }

// The group scale's exponent: the smallest e >= kMinScaleExp with amax <= 448 * 2^e (amax
// finite, >= 0); 0 for amax = 0.
DFLASH2_HD int scale_exp(float amax) {
  const uint32_t a = float_bits(amax) & 0x7fffffffu;
  if (a == 0) return 0;
  const int E = int(a >> 23) - 127;  // f32 subnormals: -127, clamped below anyway
  // amax = 1.m * 2^E; 448 = 1.75 * 2^8: amax <= 448 * 2^(E-8) iff 1.m <= 1.75
  int e = (a & 0x7fffffu) <= 0x600000u ? E - 8 : E - 7;
  return e < kMinScaleExp ? kMinScaleExp : e;
}

// f32 -> OCP E4M3 ("fn") code, round to nearest even, saturating at +-448; NaN and +-inf give
// kNaN. Integer arithmetic only (the same code on every machine).
DFLASH2_HD uint8_t e4m3_encode(float v) {
  const uint32_t u = float_bits(v);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) return kNaN;
  if (a >= 0x43e00000u) return uint8_t(sign | 0x7e);  // >= 448
  const int E = int(a >> 23) - 127;
  if (E < -10) return sign;  // below 2^-10 (half the smallest subnormal 2^-9): zero
  const uint32_t m = (a & 0x7fffffu) | 0x800000u;  // value = m * 2^(E - 23)
  int s = (E > -6 ? E : -6) - 3;                   // the quantum's exponent
  const int shift = 23 + s - E;                    // 20..24
  uint32_t n = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (n & 1u))) ++n;
  // value = n * 2^s
  if (n >= 16) {  // rounded up into the next binade
    n >>= 1;
    ++s;
  }
  uint32_t code;
  if (n < 8)  // subnormal (s = -9)
    code = n;
  else
    code = (uint32_t(s + 10) << 3) | (n - 8);
  if (code > 0x7eu) code = 0x7eu;
  return uint8_t(sign | code);
}

// E4M3 code -> its exact f32 value (NaN for 0x7f / 0xff).
DFLASH2_HD float e4m3_decode(uint8_t c) {
  const uint32_t sign = uint32_t(c & 0x80u) << 24;
  const uint32_t e = (c >> 3) & 15u, mnt = c & 7u;
  if (e == 15 && mnt == 7) return bits_float(0x7fc00000u | sign);
  if (e == 0) return bits_float(float_bits(float(mnt) * pow2(-9)) | sign);
  return bits_float(sign | ((e + 120u) << 23) | (mnt << 20));  // (8 + mnt) 2^(e - 10) = 1.mnt 2^(e - 7)
}

}  // namespace dflash2::kvfp8
