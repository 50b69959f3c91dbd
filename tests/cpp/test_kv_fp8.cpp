// The FP8 KV-cache row format (cpp/src/ops/kv_fp8.h) on the host: its E4M3 encoder and decoder,
// the group scales' exponent and the row layout, against brute force. The header is plain C++
// (DFLASH2_HD: __host__ __device__ under nvcc), the CPU op and the CUDA kernels call the same
// functions, so this checks the GPU's encoding too; tests/test_kv_fp8.py checks the bytes the
// ops write against torch's rounding.
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "ops/kv_fp8.h"
#include "testing.h"

namespace K = dflash2::kvfp8;

namespace {
// E4M3 ("fn") code -> value by the definition: exponent field e (bias 7), 3 mantissa bits.
double e4m3_ref(int c) {
  const int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
  const double v = e == 0 ? std::ldexp(double(m), -9) : std::ldexp(8.0 + m, e - 10);
  return s ? -v : v;
}
// The nearest E4M3 value to v (|v| <= 448), ties to the even code; brute force.
int nearest_code(double v) {
  int best = -1;
  double bd = 0;
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    if ((c & 0x80) && (c & 0x7f) == 0) continue;  // -0: v's sign decides below
    const double d = std::fabs(e4m3_ref(c) - v);
    if (best < 0 || d < bd || (d == bd && (c & 1) == 0)) {
      best = c;
      bd = d;
    }
  }
  if (e4m3_ref(best) == 0.0 && std::signbit(v)) best = 0x80;
  return best;
}
}  // namespace

TEST(decode_is_the_definition) {
  for (int c = 0; c < 256; ++c) {
    const float got = K::e4m3_decode(uint8_t(c));
    if ((c & 0x7f) == 0x7f) {
      CHECK(std::isnan(got));
      continue;
    }
    CHECK(double(got) == e4m3_ref(c));
    CHECK(std::signbit(got) == bool(c & 0x80));
  }
  CHECK(K::e4m3_decode(0x7e) == 448.0f && K::e4m3_decode(0x01) == std::ldexp(1.0f, -9));
}

TEST(encode_rounds_to_nearest_even) {
  // every code round-trips
  for (int c = 0; c < 256; ++c)
    if ((c & 0x7f) != 0x7f) CHECK(K::e4m3_encode(K::e4m3_decode(uint8_t(c))) == uint8_t(c));
  // midpoints (ties), a float ulp either side, and random values of every magnitude
  std::vector<float> xs;
  for (int c = 0; c < 0x7e; ++c) {
    const float a = K::e4m3_decode(uint8_t(c)), b = K::e4m3_decode(uint8_t(c + 1));
    const float mid = float((double(a) + double(b)) / 2);
    xs.insert(xs.end(), {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)});
  }
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> ex(-14.0f, 9.0f), u(-1.0f, 1.0f);
  for (int i = 0; i < 200000; ++i) xs.push_back(u(rng) * std::exp2(ex(rng)));
  xs.insert(xs.end(), {0.0f, -0.0f, 1e-30f, std::ldexp(1.0f, -10), std::ldexp(1.0f, -11), 447.99f, 448.0f});
  int bad = 0;
  for (float x : xs)
    for (float v : {x, -x}) {
      if (std::fabs(v) > 448.0f) continue;
      if (K::e4m3_encode(v) != nearest_code(v) && bad++ < 5)
        std::printf("  encode(%.9g) = 0x%02x, nearest 0x%02x\n", v, K::e4m3_encode(v), nearest_code(v));
    }
  CHECK(bad == 0);
  // saturation and non-finite values
  CHECK(K::e4m3_encode(449.0f) == 0x7e && K::e4m3_encode(-1e30f) == 0xfe && K::e4m3_encode(3e38f) == 0x7e);
  CHECK(K::e4m3_encode(NAN) == K::kNaN && K::e4m3_encode(INFINITY) == K::kNaN && K::e4m3_encode(-INFINITY) == K::kNaN);
}

TEST(scale_is_the_smallest_power_of_two) {
  CHECK(K::scale_exp(0.0f) == 0);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> ex(-140.0f, 127.0f), m(1.0f, 2.0f);
  std::vector<float> as{448.0f, 449.0f, 224.0f, 224.00002f, 1.0f, 1.75f, 1.7500001f, 3.4e38f, 1e-45f, 1e-38f};
  for (int i = 0; i < 100000; ++i) as.push_back(m(rng) * std::exp2(ex(rng)));
  for (float a : as) {
    if (!(a > 0) || !std::isfinite(a)) continue;
    const int e = K::scale_exp(a);
    CHECK(double(a) <= 448.0 * std::ldexp(1.0, e));
    CHECK(e == K::kMinScaleExp || double(a) > 448.0 * std::ldexp(1.0, e - 1));
    CHECK(e >= K::kMinScaleExp && K::pow2(e) == float(std::ldexp(1.0, e)));
    // a group's values times 2^-e are exact (a power-of-two scaling of a normal result)
    CHECK(double(a * K::pow2(-e)) == double(a) * std::ldexp(1.0, -e));
  }
}

TEST(row_layout) {
  CHECK(K::fits(16) && K::fits(112) && K::fits(128) && K::fits(512) && K::fits(1024));
  CHECK(!K::fits(0) && !K::fits(8) && !K::fits(24) && !K::fits(136) && !K::fits(320));
  CHECK(K::fp8_bytes(128) == 144 && K::fp8_bytes(512) == 528 && K::fp8_bytes(64) == 80 && K::fp8_bytes(1024) == 1056);
  CHECK(K::fp8_latent_bytes(512, 64) == 656);  // GLM-5.3: FlashMLA's / vLLM's fp8_ds_mla row
  CHECK(K::fp8_latent_bytes(64, 16) == 112 && K::fp8_latent_bytes(32, 8) == 64 && K::fp8_latent_bytes(16, 2) == 48);
  for (int64_t D = 16; D <= 2048; D += 16)
    if (K::fits(D)) {
      CHECK(K::fp8_bytes(D) % 16 == 0 && K::groups(D) * K::group(D) == D && K::group(D) <= 128);
      CHECK(K::scale_bytes(D) >= 4 * K::groups(D));
    }
}

TEST_MAIN()
