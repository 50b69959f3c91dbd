#include "dflash2/dtype.h"

#include <cmath>

#include "dflash2/error.h"

namespace dflash2 {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: return 2;
    case DType::F8_E4M3: case DType::U8: return 1;
    case DType::I64: return 8;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::F8_E4M3: return "F8_E4M3";
    case DType::U8: return "U8";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
  }
  return "?";
}

bool dtype_from_name(const std::string& s, DType* out) {
  static const struct { const char* n; DType t; } table[] = {
      {"F32", DType::F32}, {"F16", DType::F16}, {"BF16", DType::BF16}, {"F8_E4M3", DType::F8_E4M3},
      {"U8", DType::U8},   {"I32", DType::I32}, {"I64", DType::I64}};
  for (const auto& e : table)
    if (s == e.n) { *out = e.t; return true; }
  return false;
}

bool dtype_is_float(DType t) {
  return t == DType::F32 || t == DType::F16 || t == DType::BF16 || t == DType::F8_E4M3;
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: value = man * 2^-24
      float f = std::ldexp(float(man), -24);
      std::memcpy(&u, &f, 4);
      u |= sign;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  float a = std::fabs(f);
  if (std::isnan(f)) return uint16_t(sign | 0x7e00);
  if (a >= 65520.0f) return uint16_t(sign | 0x7c00);  // rounds to inf
  if (a < 6.103515625e-05f) {                         // subnormal (or zero): step 2^-24
    uint16_t m = uint16_t(std::nearbyint(a * 16777216.0f));  // round-half-even (default mode)
    return uint16_t(sign | m);
  }
  uint32_t exp = ((u >> 23) & 0xff) - 112;
  uint32_t man = u & 0x7fffff;
  uint32_t r = (exp << 10) | (man >> 13);
  uint32_t rem = man & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) r++;
  return uint16_t(sign | r);
}

float fp8_e4m3_to_f32(uint8_t v) {
  uint32_t sign = v >> 7, exp = (v >> 3) & 0xf, man = v & 7;
  float out;
  if (exp == 0xf && man == 7) return std::nanf("");
  if (exp == 0)
    out = std::ldexp(float(man), -9);  // subnormal: man/8 * 2^-6
  else
    out = std::ldexp(1.0f + float(man) / 8.0f, int(exp) - 7);
  return sign ? -out : out;
}

float load_as_f32(const void* p, DType t) {
  switch (t) {
    case DType::F32: return *static_cast<const float*>(p);
    case DType::BF16: return bf16_to_f32(*static_cast<const uint16_t*>(p));
    case DType::F16: return f16_to_f32(*static_cast<const uint16_t*>(p));
    case DType::F8_E4M3: return fp8_e4m3_to_f32(*static_cast<const uint8_t*>(p));
    default: fail(ErrorKind::InvalidArgument, "load_as_f32: dtype ", dtype_name(t), " is not a float type");
  }
}

}  // namespace dflash2
