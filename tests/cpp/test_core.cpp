// Core: dtype conversions, tensor views, the workspace arena, op argument errors.
#include <cmath>
#include <algorithm>
#include <cstring>

#include "dflash2/dflash2.h"
#include "ops/philox.h"
#include "runtime/spec_policy.h"
#include "runtime/step_graphs.h"
#include "testing.h"

using namespace dflash2;

TEST(bf16_round_to_nearest_even) {
  CHECK(f32_to_bf16(1.0f) == 0x3f80);
  float halfway;
  uint32_t u = 0x3f808000u;  // exactly between 0x3f80 and 0x3f81: ties to even
  std::memcpy(&halfway, &u, 4);
  CHECK(f32_to_bf16(halfway) == 0x3f80);
  u = 0x3f818000u;
  std::memcpy(&halfway, &u, 4);
  CHECK(f32_to_bf16(halfway) == 0x3f82);
  CHECK(std::isnan(bf16_to_f32(f32_to_bf16(std::nanf("")))));
  CHECK(bf16_to_f32(f32_to_bf16(-2.5f)) == -2.5f);
}

TEST(f16_roundtrip) {
  for (float v : {0.0f, 1.0f, -2.0f, 65504.0f, 6.1035156e-05f, 5.9604645e-08f, 0.333251953125f})
    CHECK(f16_to_f32(f32_to_f16(v)) == v);
  CHECK(std::isinf(f16_to_f32(f32_to_f16(1e6f))));
}

TEST(fp8_e4m3_values) {
  CHECK(fp8_e4m3_to_f32(0x00) == 0.0f);
  CHECK(fp8_e4m3_to_f32(0x38) == 1.0f);        // e=7, m=0
  CHECK(fp8_e4m3_to_f32(0x7e) == 448.0f);      // max
  CHECK(fp8_e4m3_to_f32(0x01) == 0.001953125f);  // smallest subnormal 2^-9
  CHECK(fp8_e4m3_to_f32(0xb8) == -1.0f);
  CHECK(std::isnan(fp8_e4m3_to_f32(0x7f)));
  CHECK(e2m1_to_f32(0x7) == 6.0f && e2m1_to_f32(0xf) == -6.0f && e2m1_to_f32(0x1) == 0.5f);
}

TEST(tensor_views) {
  Tensor t = Tensor::zeros(DType::F32, {4, 6});
  CHECK(t.is_contiguous() && t.numel() == 24 && t.nbytes() == 96);
  Tensor s = t.slice(1, 2, 5);
  CHECK(s.shape() == Tensor::Shape({4, 3}) && s.stride(0) == 6 && !s.is_contiguous());
  CHECK(s.data_as<float>() == t.data_as<float>() + 2);
  Tensor r = t.select(0, 1);
  CHECK(r.ndim() == 1 && r.shape(0) == 6 && r.data_as<float>() == t.data_as<float>() + 6);
  Tensor c = s.contiguous();
  CHECK(c.is_contiguous() && c.data() != s.data());
  CHECK(t.reshape({-1, 3}).shape() == Tensor::Shape({8, 3}));
  CHECK_THROWS(t.reshape({5, 5}), "does not hold");
  CHECK_THROWS(s.reshape({12}), "non-contiguous");
  CHECK_THROWS(t.slice(0, 3, 5), "out of range");
  CHECK_THROWS(Tensor::empty(DType::F32, {1, 2, 3, 4, 5, 6, 7}), "exceeds the maximum");
  CHECK(t.transpose(0, 1).stride(0) == 1);
}

TEST(tensor_copy_strided) {
  Tensor a = Tensor::empty(DType::F32, {3, 5});
  for (int i = 0; i < 15; ++i) a.data_as<float>()[i] = float(i);
  Tensor b = Tensor::zeros(DType::F32, {3, 2});
  b.copy_from(a.slice(1, 1, 3));
  CHECK(b.data_as<float>()[0] == 1 && b.data_as<float>()[1] == 2 && b.data_as<float>()[4] == 11);
  CHECK_THROWS(b.copy_from(a), "copy_from");
}

TEST(arena_plan_then_run) {
  Arena plan = Arena::planner();
  auto step = [](Arena& a) {
    size_t m = a.mark();
    Tensor x = a.alloc(DType::F32, {7, 33});
    Tensor y = a.alloc(DType::BF16, {5});
    a.reset(m);
    Tensor z = a.alloc(DType::I32, {100});
    return std::make_tuple(x, y, z);
  };
  step(plan);
  CHECK(plan.planning() && plan.high_water() >= 7 * 33 * 4 + 10);
  Arena real(plan.high_water());
  auto [x, y, z] = step(real);
  CHECK(x.data() != nullptr && (reinterpret_cast<uintptr_t>(y.data()) % Arena::kDefaultAlignment) == 0);
  CHECK(real.high_water() == plan.high_water());
  real.reset();
  CHECK(real.used() == 0);
  CHECK_THROWS(real.alloc(DType::F32, {int64_t(plan.high_water())}), "workspace arena on cpu is too small");
  CHECK_THROWS(real.reset(10), "beyond the used size");
  try {
    real.alloc(DType::F32, {1 << 20});
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::OutOfMemory);
  }
}

TEST(linear_row_equals_batch_row) {
  const int64_t N = 37, K = 203, M = 9;
  Tensor w = Tensor::empty(DType::BF16, {N, K});
  Tensor x = Tensor::empty(DType::F32, {M, K});
  uint32_t s = 12345;
  auto rnd = [&s] {
    s = s * 1664525u + 1013904223u;
    return float(int(s >> 9) % 2001 - 1000) / 1000.0f;
  };
  for (int64_t i = 0; i < N * K; ++i) w.data_as<uint16_t>()[i] = f32_to_bf16(rnd());
  for (int64_t i = 0; i < M * K; ++i) x.data_as<float>()[i] = rnd();
  ops::Weight W = ops::Weight::dense(w, "w");
  Tensor y = Tensor::empty(DType::F32, {M, N});
  ops::linear(x, W, y);
  Tensor y1 = Tensor::empty(DType::F32, {1, N});
  for (int64_t m = 0; m < M; ++m) {
    ops::linear(x.slice(0, m, m + 1), W, y1);
    CHECK(std::memcmp(y1.data(), y.data_as<float>() + m * N, N * 4) == 0);
  }
  // and close to a double-precision reference
  double maxerr = 0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double ref = 0;
      for (int64_t k = 0; k < K; ++k) ref += double(bf16_to_f32(w.data_as<uint16_t>()[n * K + k])) * x.data_as<float>()[m * K + k];
      maxerr = std::fmax(maxerr, std::fabs(ref - y.data_as<float>()[m * N + n]));
    }
  CHECK(maxerr < 1e-4);
}

TEST(op_errors_never_abort) {
  Tensor x = Tensor::zeros(DType::F32, {2, 8});
  Tensor w = Tensor::zeros(DType::F32, {7});
  Tensor out = Tensor::zeros(DType::F32, {2, 8});
  CHECK_THROWS(ops::rms_norm(x, w, 1e-6f, out), "w must be [8]");
  Tensor ids = Tensor::zeros(DType::I64, {3});
  ids.data_as<int64_t>()[2] = 1000;
  Tensor table = Tensor::zeros(DType::F32, {10, 8});
  Tensor e = Tensor::zeros(DType::F32, {3, 8});
  CHECK_THROWS(ops::embedding(table, ids, e), "token id 1000 at position 2");
  Tensor v = Tensor::zeros(DType::F32, {2, 9}), i = Tensor::zeros(DType::I32, {2, 9});
  CHECK_THROWS(ops::topk(x, 9, v, i), "exceeds the row length");
  CHECK_THROWS(ops::linear(x, ops::Weight::dense(Tensor::zeros(DType::I32, {4, 8}), "bad"), out), "must be F32, BF16 or F16");
}

TEST(build_info_lists_cpu) {
  BuildInfo b = build_info();
  CHECK(!b.backends.empty() && b.backends[0] == "cpu");
  CHECK(!b.version.empty() && b.num_threads >= 1);
}

// Random123's known-answer vectors (tests/kat_vectors, "philox4x32 10"): ctr[4] key[2] -> out[4]
TEST(philox_known_answers) {
  using dflash2::philox::U32x4;
  struct Kat {
    uint32_t c[4], k[2], r[4];
  } kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
      {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
       {0xffffffffu, 0xffffffffu},
       {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
      {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
       {0xa4093822u, 0x299f31d0u},
       {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
  };
  for (const auto& k : kats) {
    U32x4 out = dflash2::philox::philox4x32_10(U32x4{{k.c[0], k.c[1], k.c[2], k.c[3]}}, k.k[0], k.k[1]);
    for (int i = 0; i < 4; ++i) CHECK(out.v[i] == k.r[i]);
  }
  // uniforms lie in [0, 1) and differ across counters and keys
  double lo = 1, hi = 0, sum = 0;
  for (uint64_t c = 0; c < 20000; ++c) {
    const double u = dflash2::philox::uniform(12345, c);
    CHECK(u >= 0.0 && u < 1.0);
    lo = std::min(lo, u);
    hi = std::max(hi, u);
    sum += u;
  }
  CHECK(lo < 0.001 && hi > 0.999 && std::fabs(sum / 20000 - 0.5) < 0.01);
  CHECK(dflash2::philox::uniform(1, 7) != dflash2::philox::uniform(2, 7));
}

// The whole-step queue (runtime/step_graphs.h): pieces run in the order they were queued,
// only at the flush; a failing piece stops recording and propagates; cancel drops the queue.
TEST(step_recorder_runs_the_queue_in_order_at_the_flush) {
  dflash2::runtime::StepRecorder rec;
  std::vector<int> ran;
  CHECK(!rec.recording());
  CHECK_THROWS(rec.add("x", [] {}), "while not recording");
  rec.begin();
  CHECK(rec.recording());
  for (int i = 0; i < 3; ++i) rec.add("p" + std::to_string(i), [&ran, i] { ran.push_back(i); });
  CHECK(ran.empty());  // queued, not run
  rec.flush(nullptr, 0);
  CHECK(!rec.recording() && rec.steps() == 1);
  CHECK(ran == std::vector<int>({0, 1, 2}));
  // a piece that throws: the error reaches the caller, recording is off, the step is not counted
  rec.begin();
  rec.add("a", [&ran] { ran.push_back(7); });
  rec.add("b", [] { dflash2::fail(dflash2::ErrorKind::Backend, "piece failed"); });
  rec.add("c", [&ran] { ran.push_back(8); });
  CHECK_THROWS(rec.flush(nullptr, 0), "piece failed");
  CHECK(!rec.recording() && rec.steps() == 1);
  CHECK(ran == std::vector<int>({0, 1, 2, 7}));
  // cancel: nothing runs, a later step starts empty
  rec.begin();
  rec.add("d", [&ran] { ran.push_back(9); });
  rec.cancel();
  CHECK(!rec.recording());
  rec.begin();
  rec.flush(nullptr, 0);
  CHECK(rec.steps() == 2 && ran.size() == 4);
}

// The load-time warm-up forces the draft length of its own decoder's policy
// (SpecPolicy::force): forced lengths are clamped to K, apply adaptive or not, and -1
// gives the policy back its own choice.
TEST(spec_policy_force_overrides_and_releases) {
  runtime::SpecPolicy adaptive(8, true, false), fixed(8, false, false);
  for (int i = 0; i < 6; ++i) {
    const int64_t k = adaptive.choose(4);
    CHECK(k == 0 || k == 4 || k == 8);  // the adaptive warm-up cycle: K, K / 2, 0
  }
  adaptive.force(3);
  CHECK(adaptive.choose(4) == 3 && adaptive.choose(1) == 3);
  adaptive.force(20);
  CHECK(adaptive.choose(2) == 8);
  adaptive.force(-1);
  bool cycled = false;
  for (int i = 0; i < 4; ++i) cycled = cycled || adaptive.choose(4) != 8;
  CHECK(cycled);  // its own choices again (0 and K / 2 come back)
  CHECK(fixed.choose(3) == 8);
  fixed.force(0);
  CHECK(fixed.choose(3) == 0);
  fixed.force(-1);
  CHECK(fixed.choose(3) == 8);
}

TEST_MAIN()
