// dflash2/dtype.h: element types of tensors and of checkpoint data, with the scalar
// conversions the CPU backend uses (bf16/f16/fp8-e4m3/e2m1 <-> f32).
#pragma once
#include <cstdint>
#include <cstring>
#include <string>

namespace dflash2 {

enum class DType : uint8_t { F32, F16, BF16, F8_E4M3, U8, I32, I64 };

// Bytes per element.
size_t dtype_size(DType t);
// The safetensors spelling: "F32", "BF16", "F8_E4M3", ...
const char* dtype_name(DType t);
// Parses a safetensors dtype string; returns false if unknown.
bool dtype_from_name(const std::string& s, DType* out);
bool dtype_is_float(DType t);

// ---- scalar conversions (exact where the format allows; round-to-nearest-even otherwise)
inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);
// OCP FP8 E4M3 ("fn": no infinities, 0x7f/0xff are NaN, max 448).
float fp8_e4m3_to_f32(uint8_t v);
// E2M1 (NVFP4 element): bit 3 sign, codes 0..7 -> {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
inline float e2m1_to_f32(uint8_t nibble) {
  static const float lut[16] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
  return lut[nibble & 15];
}
// Converts one element of any float dtype at p to f32.
float load_as_f32(const void* p, DType t);

}  // namespace dflash2
