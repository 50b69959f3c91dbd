// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11): a
// counter-based generator, so any draw of any request is a pure function of (key,
// counter) and can be made on the host or on the device, in any order, inside a CUDA
// graph. Checked against Random123's known-answer vectors (tests/cpp/test_core.cpp).
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define DFLASH2_HD __host__ __device__ __forceinline__
#else
#define DFLASH2_HD inline
#endif

namespace dflash2::philox {

struct U32x4 {
  uint32_t v[4];
};

DFLASH2_HD uint32_t mulhilo(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t p = uint64_t(a) * uint64_t(b);
  *hi = uint32_t(p >> 32);
  return uint32_t(p);
}

// ctr: 128-bit counter (4 words, low first), key: 64 bits (2 words).
DFLASH2_HD U32x4 philox4x32_10(U32x4 ctr, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    uint32_t hi0, hi1;
    const uint32_t lo0 = mulhilo(0xD2511F53u, ctr.v[0], &hi0);
    const uint32_t lo1 = mulhilo(0xCD9E8D57u, ctr.v[2], &hi1);
    ctr = U32x4{{hi1 ^ ctr.v[1] ^ k0, lo1, hi0 ^ ctr.v[3] ^ k1, lo0}};
  }
  return ctr;
}

// A double in [0, 1) with 53 random bits: the draw at `counter` of the stream `key`.
DFLASH2_HD double uniform(uint64_t key, uint64_t counter) {
  const U32x4 r = philox4x32_10(U32x4{{uint32_t(counter), uint32_t(counter >> 32), 0u, 0u}}, uint32_t(key),
                                uint32_t(key >> 32));
  const uint64_t bits = ((uint64_t(r.v[1]) << 32) | r.v[0]) >> 11;
  return double(bits) * (1.0 / 9007199254740992.0);  // 2^-53
}

}  // namespace dflash2::philox
