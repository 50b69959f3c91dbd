// The engine: loads the target (and a drafter), allocates every step buffer once, and
// starts the scheduler thread that runs all generation (continuous batching). The
// step-level API (logits, propose, Sequence) runs on the caller's thread between steps,
// under the same model mutex.
#include "dflash2/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <functional>
#include <mutex>
#include <tuple>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "dflash2/error.h"
#include "dflash2/ops.h"
#include "dflash2/safetensors.h"
#include "model/dflash_drafter.h"
#include "model/glm_model.h"
#include "runtime/drafter.h"
#include "runtime/scheduler.h"
#include "runtime/warm_up.h"
#include "runtime/target.h"
#include "ops/kv_fp8.h"

#ifdef DFLASH2_WITH_CUDA
#include "backend/cuda/cuda_api.h"
#endif

namespace dflash2 {

using runtime::CacheStream;
using runtime::Method;

struct Engine::Impl {
  EngineConfig cfg;
  Method method = Method::AR;
  std::string method_str;
  std::string config_json;
  runtime::Core core;  // target, drafter, step buffers
  std::mutex model_mu;  // held while the model runs (scheduler steps, the step-level API)
  std::unique_ptr<runtime::Scheduler> scheduler;

  void check_open() const {
    DFLASH2_CHECK_ARG(scheduler && !scheduler->closed(), "the engine is closed");
  }
  // Validates a request and fills a runtime::Request (stops, random stream, policy class).
  std::unique_ptr<runtime::Request> make_request(const std::vector<int32_t>& prompt, const SamplingParams& p,
                                                 const char* where);
};

struct Sequence::Impl {
  Engine::Impl* e;
  CacheStream main, mtp;
  ~Impl() {
    std::lock_guard<std::mutex> lk(e->model_mu);
    e->core.target->cache().release(main);
    if (e->core.target->model().has_mtp()) e->core.target->mtp_cache().release(mtp);
  }
};

namespace {
// The method a drafter checkpoint implies when none is given.
std::string method_of_drafter(const Checkpoint& dk) {
  const Config& c = dk.config();
  if (c.has("architectures")) {
    for (const auto& a : c.get_string_list("architectures")) {
      if (a == "DFlash2DraftModel") return "dflash2";
      if (a == "DFlashDraftModel") return "dflash";
    }
  }
  fail(ErrorKind::Config, dk.path(), ": field 'architectures': expected [\"DFlash2DraftModel\"] or [\"DFlashDraftModel\"] "
       "to infer the method; pass method= explicitly");
}
}  // namespace

namespace {
// prefill_gemm="auto" on a GPU: one small tensor-core GEMM of numerics g (two 128-row
// tiles, K and N tails: the padded paths) against the CPU's emulation of the same numerics.
// The CUDA kernel families a failed load-time check turns off in the process (their callers
// then take kernels checked before them).
enum class Fallback {
  MainloopDq,  // gemm_dq.cu: NVFP4 / FP8 weights' linear_bf16 (else a dequantize pass + CUTLASS)
  Skinny,      // gemm_sk.cu and the decode units on it (else the prompt chunks' kernels)
};

// Runs `check`; if it fails while family `f` is on (a GPU), says so on stderr (`what` failed,
// `instead` runs), turns `f` off in this process and runs `check` again: its result.
template <class Check>
std::string check_or_turn_off(Fallback f, Device dev, const char* what, const char* instead, Check&& check) {
  std::string why = check();
#ifdef DFLASH2_WITH_CUDA
  // the mainloop-dequantizing kernel's wgmma form (Hopper) goes first: its mma.sync form next
  if (!why.empty() && f == Fallback::MainloopDq && cuda::linear_dq_enabled() && ops::dq_wgmma()) {
    std::fprintf(stderr, "dflash2: %s (wgmma form) failed its load-time check on %s (%s); its mma.sync form runs instead\n",
                 what, dev.str().c_str(), why.c_str());
    ops::set_dq_wgmma(false);
    why = check();
  }
  const bool on = f == Fallback::Skinny ? cuda::linear_sk_enabled() : cuda::linear_dq_enabled();
  if (!why.empty() && on) {
    std::fprintf(stderr, "dflash2: %s failed its load-time check on %s (%s); %s\n", what, dev.str().c_str(),
                 why.c_str(), instead);
    if (f == Fallback::Skinny)
      cuda::set_linear_sk_enabled(false);
    else
      cuda::set_linear_dq_enabled(false);
    why = check();
  }
#else
  (void)f, (void)dev, (void)what, (void)instead;
#endif
  return why;
}
constexpr const char* kSkinnyInstead = "generated tokens take the prompt chunks' tensor-core kernels instead";

// BF16 runs a dequantized F32 weight, then an NVFP4 and an FP8 one (on CUDA the
// mainloop-dequantizing kernel: if it fails, those weights take the dequantize pass in this
// process and the check is repeated); FP8 an FP8 block-128 weight; NVFP4 an NVFP4 one. "" when it agrees (NMSE
// <= 1e-8 for BF16 and NVFP4, whose only difference is the fp32 summation order; <= 1e-6 for
// FP8, whose tensor-core sums inside a 128-input block carry fewer bits), else what went
// wrong: a GPU whose kernel misbehaves then prefills with the previous numerics instead of
// producing wrong prompt states. Then the routed experts' grouped GEMM of the mode where it
// runs (BF16: NVFP4, BF16 and FP8 experts on the mainloop-dequantizing kernel; FP8: FP8
// experts; NVFP4: W4A4 NVFP4 experts; NMSE <= 1e-5, 1e-3 for W4A4, whose E2M1 rounding of
// silu(gate) * up may flip): its failure only keeps the experts off this numerics
// (*experts_why says why), not the projections.
// The load-time checks' random numbers (xorshift in [-1, 1)) and weights.
struct CheckRng {
  uint64_t s = 0x9e3779b97f4a7c15ull;
  float next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return float(double(s >> 11) / double(uint64_t(1) << 52) - 1.0);
  }
};
// NVFP4 [n_out, n_in] (n_in % 16 == 0): random E2M1 codes, E4M3 scales in [0.5, 1), global 0.02
ops::Weight check_fp4_weight(CheckRng& r, int64_t n_out, int64_t n_in, float input_scale = 0.0f) {
  Tensor packed = Tensor::empty(DType::U8, {n_out, n_in / 2}), sc = Tensor::empty(DType::F8_E4M3, {n_out, n_in / 16});
  uint8_t* pp = static_cast<uint8_t*>(packed.data());
  uint8_t* sp = static_cast<uint8_t*>(sc.data());
  for (int64_t i = 0; i < packed.numel(); ++i) pp[i] = uint8_t((r.next() + 1.0f) * 127.99f);
  for (int64_t i = 0; i < sc.numel(); ++i) sp[i] = uint8_t(0x30 + int((r.next() + 1.0f) * 7.99f));
  return ops::Weight::nvfp4(packed, sc, 0.02f, input_scale, n_in, "self-check");
}
// FP8 block-128 [n_out, n_in]: magnitude codes below 0x58 (|value| < 2^4: no overflow; never
// 0x7f, E4M3's NaN), block scales around 1.5e-2
ops::Weight check_fp8_weight(CheckRng& r, int64_t n_out, int64_t n_in) {
  Tensor c = Tensor::empty(DType::F8_E4M3, {n_out, n_in});
  Tensor sc = Tensor::empty(DType::F32, {(n_out + 127) / 128, (n_in + 127) / 128});
  uint8_t* cp = static_cast<uint8_t*>(c.data());
  for (int64_t i = 0; i < c.numel(); ++i) {
    const uint8_t v = uint8_t(uint64_t((r.next() + 1.0f) * 43.99f));
    cp[i] = uint8_t(v | (r.next() < 0 ? 0x80 : 0));
  }
  for (int64_t i = 0; i < sc.numel(); ++i) sc.data_as<float>()[i] = 1e-2f * (1.5f + r.next());
  return ops::Weight::fp8_block128(c, sc, "self-check");
}
// BF16 [n_out, n_in], values in [-0.1, 0.1)
ops::Weight check_bf16_weight(CheckRng& r, int64_t n_out, int64_t n_in) {
  Tensor w = Tensor::empty(DType::BF16, {n_out, n_in});
  uint16_t* wp = static_cast<uint16_t*>(w.data());
  for (int64_t i = 0; i < w.numel(); ++i) wp[i] = f32_to_bf16(0.1f * r.next());
  return ops::Weight::dense(w, "self-check");
}

// The experts' check inputs: x [T, H] in [-1, 1), top-2 routing (expert 0, then 1 or 3:
// expert 2 unused, an empty group between used ones) with weights 0.5 and 0.25.
std::tuple<Tensor, Tensor, Tensor> check_routing(CheckRng& r, int64_t T, int64_t H) {
  constexpr int64_t k = 2;
  Tensor x = Tensor::empty(DType::F32, {T, H}), ids = Tensor::empty(DType::I32, {T, k}),
         rw = Tensor::empty(DType::F32, {T, k});
  for (int64_t i = 0; i < T * H; ++i) x.data_as<float>()[i] = r.next();
  for (int64_t t = 0; t < T; ++t) {
    ids.data_as<int32_t>()[t * k] = 0;
    ids.data_as<int32_t>()[t * k + 1] = int32_t(t % 2 ? 1 : 3);
    rw.data_as<float>()[t * k] = 0.5f;
    rw.data_as<float>()[t * k + 1] = 0.25f;
  }
  return {x, ids, rw};
}

// "" when dev_out (a GPU's result, any device) is finite and within NMSE tol of cpu_out (the
// CPU's, finite), else what went wrong.
std::string nmse_vs_cpu(const Tensor& dev_out, const Tensor& cpu_out, double tol, const std::string& what) {
  const Tensor got = dev_out.to(Device::cpu());
  double err = 0, nrm = 0;
  for (int64_t i = 0; i < cpu_out.numel(); ++i) {
    const double gv = got.data_as<float>()[i], r = cpu_out.data_as<float>()[i];
    if (!std::isfinite(r)) return "a non-finite CPU reference for the " + what + " (a bug in the check)";
    if (!std::isfinite(gv)) return "a non-finite output of the " + what;
    err += (gv - r) * (gv - r);
    nrm += r * r;
  }
  if (err <= tol * nrm) return "";
  return what + " NMSE " + std::to_string(err / nrm) + " against the CPU emulation";
}

// "" when gemm(x's first m rows on dev, y [m, N]) gives bitwise the rows of full_dev (the same
// GEMM over all M rows of xh, [M, N]) for m = 1 and 5, else why not: a row must not depend on
// its batch (decode == verify, which lossless speculation and chunked prefill rely on).
std::string rows_batch_invariant(const Tensor& xh, const Tensor& full_dev, Device dev, const std::string& what,
                                 const std::function<void(const Tensor&, Tensor&)>& gemm) {
  const int64_t M = full_dev.shape(0), N = full_dev.shape(1);
  const Tensor full = full_dev.to(Device::cpu());
  for (const int64_t m : {int64_t(1), int64_t(5)}) {
    Tensor ys = Tensor::empty(DType::F32, {m, N}, dev);
    gemm(xh.slice(0, 0, m).to(dev), ys);
    const Tensor got = ys.to(Device::cpu());
    if (std::memcmp(got.data(), full.data(), size_t(m * N) * sizeof(float)) != 0)
      return what + ": rows of an M = " + std::to_string(m) + " call differ from the same rows of an M = " +
             std::to_string(M) + " one (not batch-invariant)";
  }
  return "";
}

std::string tc_gemm_self_check(Device dev, ops::GemmNumerics g, std::string* experts_why) {
  try {
    // K = 200: tails of 8 and 16 (the BF16 / FP8 padded paths); NVFP4 needs K % 16 == 0 and
    // takes 208, not a multiple of 32 (its padded path)
    const int64_t M = 130, K = g == ops::GemmNumerics::NVFP4 ? 208 : 200, N = 150;
    CheckRng rng;
    auto next = [&rng] { return rng.next(); };
    Tensor x = Tensor::empty(DType::F32, {M, K});
    for (int64_t i = 0; i < M * K; ++i) x.data_as<float>()[i] = next();
    ops::Weight wc;
    if (g == ops::GemmNumerics::NVFP4) {
      // random E2M1 codes, E4M3 scales in [0.5, 1), a global scale and an activation scale
      Tensor packed = Tensor::empty(DType::U8, {N, K / 2}), sc = Tensor::empty(DType::F8_E4M3, {N, K / 16});
      uint8_t* pp = static_cast<uint8_t*>(packed.data());
      uint8_t* sp = static_cast<uint8_t*>(sc.data());
      for (int64_t i = 0; i < packed.numel(); ++i) pp[i] = uint8_t((next() + 1.0f) * 127.99f);
      for (int64_t i = 0; i < sc.numel(); ++i) sp[i] = uint8_t(0x30 + int((next() + 1.0f) * 7.99f));
      wc = ops::Weight::nvfp4(packed, sc, 0.01f, 8.0f / (6.0f * 448.0f), K, "self-check");
    } else if (g == ops::GemmNumerics::FP8) {
      Tensor codes = Tensor::empty(DType::F8_E4M3, {N, K});
      Tensor sc = Tensor::empty(DType::F32, {(N + 127) / 128, (K + 127) / 128});
      uint8_t* cp = static_cast<uint8_t*>(codes.data());
      for (int64_t i = 0; i < N * K; ++i) {
        const uint8_t c = uint8_t(uint64_t((next() + 1.0f) * 127.99f)) ^ uint8_t(next() < 0 ? 0x80 : 0);
        cp[i] = (c & 0x7f) == 0x7f ? uint8_t(c - 1) : c;  // never the NaN codes
      }
      for (int64_t i = 0; i < sc.numel(); ++i) sc.data_as<float>()[i] = 1e-3f * (1.5f + next());
      wc = ops::Weight::fp8_block128(codes, sc, "self-check");
    } else {
      Tensor w = Tensor::empty(DType::F32, {N, K});
      for (int64_t i = 0; i < N * K; ++i) w.data_as<float>()[i] = 0.1f * next();
      wc = ops::Weight::dense(w, "self-check");
    }
    Tensor want = Tensor::empty(DType::F32, {M, N});
    ops::linear_as(g, x, wc, want);
    Tensor yd = Tensor::empty(DType::F32, {M, N}, dev);
    const ops::Weight wd = wc.to(dev);
    ops::linear_as(g, x.to(dev), wd, yd);
    // "" when the device's result is finite and within NMSE tol of the CPU's, else why not
    auto compare = [](const Tensor& dev_out, const Tensor& cpu_out, double tol, const char* what) {
      return nmse_vs_cpu(dev_out, cpu_out, tol, what);
    };
    // NVFP4: fp32 order only, as BF16
    const std::string why = compare(yd, want, g == ops::GemmNumerics::FP8 ? 1e-6 : 1e-8, "GEMM");
    if (!why.empty()) return why;
    // decode sizes: an M = 1 and an M = 5 call give bitwise the same rows as the M = 130 one
    // (a row must not depend on its batch: decode == verify, which lossless speculation and
    // chunked prefill rely on); gemm(x rows on the device, y) runs the GEMM under test
    auto batch_invariant = [&](const Tensor& xh, const Tensor& full_dev, const std::string& what,
                               const std::function<void(const Tensor&, Tensor&)>& gemm) {
      return rows_batch_invariant(xh, full_dev, dev, what, gemm);
    };
    const std::string why_rows = batch_invariant(x, yd, "GEMM", [&](const Tensor& xm, Tensor& ym) {
      ops::linear_as(g, xm, wd, ym);
    });
    if (!why_rows.empty()) return why_rows;
    auto fp4w = [&](int64_t n_out, int64_t n_in, float input_scale = 0.0f) {
      return check_fp4_weight(rng, n_out, n_in, input_scale);
    };
    auto fp8w = [&](int64_t n_out, int64_t n_in) { return check_fp8_weight(rng, n_out, n_in); };
    if (g == ops::GemmNumerics::BF16) {
      // NVFP4 and FP8 weights through linear_bf16 (on CUDA the mainloop-dequantizing kernel),
      // each against the CPU and its M = 1 / 5 rows against the M = 130 ones
      const int64_t K4 = 208;
      Tensor x4 = Tensor::empty(DType::F32, {M, K4});
      for (int64_t i = 0; i < M * K4; ++i) x4.data_as<float>()[i] = next();
      const ops::Weight w4 = fp4w(N, K4), w8 = fp8w(N, K4);
      // each weight's linear_bf16 (decode: the kernel of generated tokens) against the CPU,
      // and its M = 1 / 5 rows against the M = 130 ones; x for the F32 weight wc, x4 otherwise
      auto check_weights = [&](std::initializer_list<const ops::Weight*> ws, bool decode) -> std::string {
        for (const ops::Weight* wq : ws) {
          const char* what = wq == &wc   ? "decode GEMM (F32 weight)"
                             : wq == &w4 ? (decode ? "decode GEMM (NVFP4 weight)" : "NVFP4-weight GEMM")
                                         : (decode ? "decode GEMM (FP8 weight)" : "FP8-weight GEMM");
          const Tensor& xq = wq == &wc ? x : x4;
          Tensor wantq = Tensor::empty(DType::F32, {M, N}), gotq = Tensor::empty(DType::F32, {M, N}, dev);
          const ops::Weight wqd = wq->to(dev);
          ops::linear_bf16(xq, *wq, wantq);
          ops::linear_bf16(xq.to(dev), wqd, gotq, false, decode);
          std::string w_why = compare(gotq, wantq, 1e-8, what);
          if (w_why.empty())
            w_why = batch_invariant(xq, gotq, what, [&](const Tensor& xm, Tensor& ym) {
              ops::linear_bf16(xm, wqd, ym, false, decode);
            });
          if (!w_why.empty()) return w_why;
        }
        return "";
      };
      // the mainloop-dequantizing kernel; if it fails, NVFP4 and FP8 weights take the
      // dequantize-to-BF16 pass and the CUTLASS GEMM (checked just before)
      const std::string why4 = check_or_turn_off(
          Fallback::MainloopDq, dev, "the mainloop-dequantizing GEMM",
          "NVFP4 and FP8 weights are dequantized to BF16 before the GEMM instead",
          [&] { return check_weights({&w4, &w8}, false); });
      if (!why4.empty()) return why4;
      // the kernel of generated tokens (linear_bf16 decode = true; on CUDA gemm_sk.cu, K split
      // over 2 CTAs for the F32 weight) over the same weights and the F32 one; if it fails,
      // generated tokens take the prompt chunks' kernels (checked above; their rows are
      // batch-invariant too)
      const std::string why_sk = check_or_turn_off(Fallback::Skinny, dev, "the skinny decode GEMM", kSkinnyInstead,
                                                   [&] { return check_weights({&wc, &w4, &w8}, true); });
      if (!why_sk.empty()) return why_sk;
      // the decode units built on that kernel (on CUDA: a gated MLP as one unit, several
      // projections of one x rounded once), bitwise the same calls one by one
      const ops::Weight u4 = fp4w(N, K4), d8 = fp8w(96, N);
      auto check_units = [&]() -> std::string {
        const ops::Weight gd = w4.to(dev), ud = u4.to(dev), dd = d8.to(dev), w8d = w8.to(dev);
        const Tensor xd = x4.to(dev);
        auto same_bits = [](const Tensor& a, const Tensor& b) {
          const Tensor ha = a.to(Device::cpu()), hb = b.to(Device::cpu());
          return std::memcmp(ha.data(), hb.data(), size_t(ha.numel()) * sizeof(float)) == 0;
        };
        auto dev_f32 = [&](int64_t r, int64_t c) { return Tensor::empty(DType::F32, {r, c}, dev); };
        Tensor got = dev_f32(M, 96), want = dev_f32(M, 96), gg = dev_f32(M, N), uu = dev_f32(M, N);
        Tensor scratch = Tensor::empty(DType::F32, {2 * M * N}, dev);
        ops::gated_mlp(xd, gd, ud, dd, got, scratch, ops::GemmNumerics::BF16, true);
        ops::linear_bf16(xd, gd, gg, false, true);
        ops::linear_bf16(xd, ud, uu, false, true);
        ops::silu_mul(gg, uu, gg);
        ops::linear_bf16(gg, dd, want, false, true);
        if (!same_bits(got, want)) return "gated MLP of generated tokens: differs from its steps one by one";
        Tensor a = dev_f32(M, N), b = dev_f32(M, N), a1 = dev_f32(M, N), b1 = dev_f32(M, N);
        ops::linear_as_many(ops::GemmNumerics::BF16, xd, {&gd, &w8d}, {&a, &b}, true);
        ops::linear_bf16(xd, gd, a1, false, true);
        ops::linear_bf16(xd, w8d, b1, false, true);
        if (!same_bits(a, a1) || !same_bits(b, b1)) return "projections of one input: differ from the single calls";
        return "";
      };
      const std::string why_units =
          check_or_turn_off(Fallback::Skinny, dev, "a fused decode unit", kSkinnyInstead, check_units);
      if (!why_units.empty()) return why_units;
    }
    // The routed experts' grouped GEMM of prompt chunks where it runs: FP8 experts with the
    // FP8 numerics (the CUTLASS grouped kernel), NVFP4 and BF16 experts with the BF16 ones
    // (the mainloop-dequantizing kernel: W4A16, and its cp.async path). 4 experts (expert 2
    // unused: an empty group between others), 5 tokens, top-2, K tails of 208 / 144 inputs.
    const std::vector<char> expert_fmts = g == ops::GemmNumerics::FP8     ? std::vector<char>{'8'}
                                          : g == ops::GemmNumerics::BF16  ? std::vector<char>{'4', 'b', '8'}
                                          : g == ops::GemmNumerics::NVFP4 ? std::vector<char>{'a'}
                                                                          : std::vector<char>{};
    for (const char fmt : expert_fmts) {
      // (W4A4: K % 32 == 0, not multiples of the 256-deep k-tile)
      const int64_t T = 5, E = 4, H = fmt == 'a' ? 224 : 208, F = fmt == 'a' ? 160 : 144, k = 2;
      auto bf16w = [&](int64_t n_out, int64_t n_in) { return check_bf16_weight(rng, n_out, n_in); };
      auto make = [&](int64_t n_out, int64_t n_in) {
        // 'a': NVFP4 with an input_scale (the W4A4 experts; x in [-1, 1): amax / (6 x 448))
        return fmt == '8'   ? fp8w(n_out, n_in)
               : fmt == '4' ? fp4w(n_out, n_in)
               : fmt == 'a' ? fp4w(n_out, n_in, 1.0f / 2688.0f)
                            : bf16w(n_out, n_in);
      };
      ops::ExpertWeights ex, exd;
      for (int64_t e = 0; e < E; ++e) {
        ex.gate.push_back(make(F, H));
        ex.up.push_back(make(F, H));
        ex.down.push_back(make(H, F));
        exd.gate.push_back(ex.gate[size_t(e)].to(dev));
        exd.up.push_back(ex.up[size_t(e)].to(dev));
        exd.down.push_back(ex.down[size_t(e)].to(dev));
      }
      const bool runs = g == ops::GemmNumerics::FP8     ? ops::moe_experts_fp8_available(dev, exd)
                        : g == ops::GemmNumerics::NVFP4 ? ops::moe_experts_nvfp4_available(dev, exd)
                                                        : ops::moe_experts_bf16_available(dev, exd);
      if (runs) {
        const auto [xe, ids, rw] = check_routing(rng, T, H);
        const int64_t nws = ops::moe_workspace_floats(T, k, H, F, E);
        Tensor ye = Tensor::empty(DType::F32, {T, H}), wse = Tensor::empty(DType::F32, {nws});
        ops::moe_experts(xe, ids, rw, ex, ye, wse, g);
        Tensor yg = Tensor::empty(DType::F32, {T, H}, dev), wsg = Tensor::empty(DType::F32, {nws}, dev);
        ops::moe_experts(xe.to(dev), ids.to(dev), rw.to(dev), exd, yg, wsg, g);
        // W4A4: where the GPU's and the CPU's gate / up sums straddle an E2M1 rounding point of
        // silu(gate) * up, one code flips (a step of up to 1/3 of its block's amax): ~1e-4
        // each at this size; a wrong layout or scale gives ~1
        const std::string why_experts = compare(yg, ye, fmt == 'a' ? 1e-3 : 1e-5, "grouped expert GEMM");
        if (!why_experts.empty()) {  // the projections pass: only the routed experts stay off this numerics
          if (experts_why) *experts_why = why_experts;
          break;
        }
        if (g == ops::GemmNumerics::BF16) {
          // the routed experts of decode chunks (decode = true; on CUDA gemm_sk.cu's grouped
          // kernel; K split in 2 for the BF16 experts) against the CPU, and token 0 alone bitwise
          // its row among all T (a token's result must not depend on its batch)
          auto check_decode = [&]() -> std::string {
            const char* what = "grouped expert GEMM of generated tokens";
            Tensor yd = Tensor::empty(DType::F32, {T, H}, dev);
            ops::moe_experts(xe.to(dev), ids.to(dev), rw.to(dev), exd, yd, wsg, g, true);
            std::string why = compare(yd, ye, 1e-5, what);
            if (!why.empty()) return why;
            Tensor y1 = Tensor::empty(DType::F32, {1, H}, dev);
            ops::moe_experts(xe.slice(0, 0, 1).to(dev), ids.slice(0, 0, 1).to(dev), rw.slice(0, 0, 1).to(dev), exd,
                             y1, wsg, g, true);
            const Tensor all = yd.to(Device::cpu()), one = y1.to(Device::cpu());
            if (std::memcmp(all.data(), one.data(), size_t(H) * sizeof(float)) != 0)
              return std::string(what) + ": a token's row alone differs from its row among " + std::to_string(T) +
                     " tokens (not batch-invariant)";
            return "";
          };
          // (if it fails: the prompt chunks' kernels, projections and experts, checked above)
          const std::string why_decode = check_or_turn_off(Fallback::Skinny, dev, "the skinny grouped decode GEMM",
                                                           kSkinnyInstead, check_decode);
          if (!why_decode.empty()) {
            if (experts_why) *experts_why = why_decode;
            break;
          }
        }
      }
    }
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

// A load-time check's verdict: f()'s ("" = passed), or why it threw.
template <class F>
std::string check_guarded(F&& f) {
  try {
    return f();
  } catch (const std::exception& e) {
    return std::string("it threw: ") + e.what();
  }
}

// ops::exact_tc() on a GPU (linear's and the routed experts' exact numerics on the tensor
// cores): a BF16, an FP8 and an NVFP4 weight (K = 208: tails of the 128 / 256-input stages;
// M = 130: many token tiles) and 4 FP8 experts (5 tokens, top-2, expert 2 unused) against
// the CPU's exact ops (NMSE <= 1e-9: fp32 sums in another order, 1e-14 in the emulator), and
// the weights' M = 1 / 5 rows bitwise their M = 130 rows. "" when it passes, else why not
// (then exact_tc is turned off in the process: the SIMT kernels run instead).
std::string exact_tc_self_check(Device dev) {
  return check_guarded([&]() -> std::string {
    CheckRng rng;
    const int64_t M = 130, K = 208, N = 150;
    Tensor x = Tensor::empty(DType::F32, {M, K});
    for (int64_t i = 0; i < M * K; ++i) x.data_as<float>()[i] = rng.next();
    const Tensor xd = x.to(dev);
    const ops::Weight ws[3] = {check_bf16_weight(rng, N, K), check_fp8_weight(rng, N, K), check_fp4_weight(rng, N, K)};
    const char* names[3] = {"exact GEMM (BF16 weight)", "exact GEMM (FP8 weight)", "exact GEMM (NVFP4 weight)"};
    for (int i = 0; i < 3; ++i) {
      Tensor want = Tensor::empty(DType::F32, {M, N}), got = Tensor::empty(DType::F32, {M, N}, dev);
      const ops::Weight wd = ws[i].to(dev);
      ops::linear(x, ws[i], want);
      ops::linear(xd, wd, got);
      std::string why = nmse_vs_cpu(got, want, 1e-9, names[i]);
      if (why.empty())
        why = rows_batch_invariant(x, got, dev, names[i], [&](const Tensor& xm, Tensor& ym) { ops::linear(xm, wd, ym); });
      if (!why.empty()) return why;
    }
    const int64_t T = 5, E = 4, H = 208, F = 144, k = 2;
    ops::ExpertWeights ex, exd;
    for (int64_t e = 0; e < E; ++e) {
      ex.gate.push_back(check_fp8_weight(rng, F, H));
      ex.up.push_back(check_fp8_weight(rng, F, H));
      ex.down.push_back(check_fp8_weight(rng, H, F));
      exd.gate.push_back(ex.gate.back().to(dev));
      exd.up.push_back(ex.up.back().to(dev));
      exd.down.push_back(ex.down.back().to(dev));
    }
    const auto [xe, ids, rw] = check_routing(rng, T, H);
    const int64_t nws = ops::moe_workspace_floats(T, k, H, F, E);
    Tensor ye = Tensor::empty(DType::F32, {T, H}), wse = Tensor::empty(DType::F32, {nws});
    ops::moe_experts(xe, ids, rw, ex, ye, wse, ops::GemmNumerics::Exact);
    Tensor yg = Tensor::empty(DType::F32, {T, H}, dev), wsg = Tensor::empty(DType::F32, {nws}, dev);
    ops::moe_experts(xe.to(dev), ids.to(dev), rw.to(dev), exd, yg, wsg, ops::GemmNumerics::Exact);
    return nmse_vs_cpu(yg, ye, 1e-9, "exact routed experts (FP8)");
  });
}

// A BF16 or FP8 KV cache's attention on the tensor cores (ops::mla_tc(), ops::indexer_tc()) on a GPU:
// sparse MLA (16 heads, kv_lora 128 + rope 32: segments of 64 keys with tails) and the
// indexer's scores (32 heads x 128, GLM-5.3's) over a paged BF16 cache (fp8: FP8 rows, ops/
// kv_fp8.h) of two sequences (150 and 70 keys, pages of 16), against the CPU's ops over the same cache (NMSE <= 1e-9:
// fp32 sums in another order), and the last token alone bitwise its row among the 3.
// {mla's "", indexer's ""} when they pass, else why not (then that switch is turned off in
// the process: the SIMT kernel runs instead).
std::pair<std::string, std::string> attention_tc_self_check(Device dev, bool fp8) {
  CheckRng rng;
  const int64_t bs = 16, nb = 10, T = 3;
  // sequence 0 on pages 9, 0, 5, ... (out of order), sequence 1 on the others
  Tensor bt = Tensor::empty(DType::I32, {2, nb});
  for (int64_t i = 0; i < 2 * nb; ++i) bt.data_as<int32_t>()[i] = int32_t((i * 7 + 9) % (2 * nb));
  const int32_t seqs[T] = {0, 1, 0}, poss[T] = {149, 69, 100};
  Tensor seq = Tensor::empty(DType::I32, {T}), pos = Tensor::empty(DType::I32, {T});
  for (int64_t t = 0; t < T; ++t) {
    seq.data_as<int32_t>()[t] = seqs[t];
    pos.data_as<int32_t>()[t] = poss[t];
  }
  const int64_t rows = 2 * nb * bs;
  auto bf16_cache = [&](int64_t width) {
    Tensor c = Tensor::empty(DType::BF16, {rows, width});
    uint16_t* p = static_cast<uint16_t*>(c.data());
    for (int64_t i = 0; i < c.numel(); ++i) p[i] = f32_to_bf16(rng.next());
    return c;
  };
  auto f32 = [&](std::vector<int64_t> shape) {
    Tensor x = Tensor::empty(DType::F32, std::move(shape));
    for (int64_t i = 0; i < x.numel(); ++i) x.data_as<float>()[i] = rng.next();
    return x;
  };
  // kv_cache_dtype = "fp8": the rows the engine writes (ops/kv_fp8.h), D quantized values and
  // `tail` BF16 ones, written by the CPU's cache_write (their values exact BF16 ones: the
  // tensor-core kernels dequantize them as they stage them)
  auto fp8_cache = [&](int64_t D, int64_t tail) {
    const int64_t qb = kvfp8::fp8_bytes(D), width = tail ? kvfp8::fp8_latent_bytes(D, tail) : qb;
    Tensor c = Tensor::zeros(DType::U8, {rows, width});
    Tensor slots = Tensor::empty(DType::I32, {rows});
    for (int64_t i = 0; i < rows; ++i) slots.data_as<int32_t>()[i] = int32_t(i);
    Tensor src = f32({rows, D + tail});
    Tensor q8 = c.slice(1, 0, qb);
    ops::cache_write(src.slice(1, 0, D), slots, q8);
    if (tail) {
      Tensor pe = Tensor::view(c.data_as<uint8_t>() + qb, DType::BF16, {rows, tail}, {width / 2, 1});
      ops::cache_write(src.slice(1, D, D + tail), slots, pe);
    }
    return c;
  };
  const char* kind = fp8 ? "an FP8" : "a BF16";
  const ops::PagedTokens tok{seq, pos, bt, bs};
  const ops::PagedTokens dtok{seq.to(dev), pos.to(dev), bt.to(dev), bs};
  const ops::PagedTokens last{seq.slice(0, T - 1, T).to(dev), pos.slice(0, T - 1, T).to(dev), dtok.block_table, bs};
  // the last token's row of a [T, ...] result on dev, bitwise that token alone
  auto alone = [&](const Tensor& all_dev, const Tensor& one_dev, const std::string& what) -> std::string {
    const Tensor all = all_dev.to(Device::cpu()), one = one_dev.to(Device::cpu());
    const size_t n = size_t(one.numel()) * sizeof(float);
    if (std::memcmp(static_cast<const char*>(all.data()) + size_t(T - 1) * n, one.data(), n) != 0)
      return what + ": a token alone differs from its row among " + std::to_string(T) + " (not batch-invariant)";
    return "";
  };
  std::string mla_why, idx_why;
  if (ops::mla_tc())
    mla_why = check_guarded([&]() -> std::string {
      const int64_t nh = 16, kvl = 128, rope = 32;
      const Tensor cache = fp8 ? fp8_cache(kvl, rope) : bf16_cache(kvl + rope), ql = f32({T, nh, kvl}),
                   qp = f32({T, nh, rope});
      const float scale = 0.125f;
      const std::string what = std::string("sparse MLA over ") + kind + " cache (tensor cores)";
      Tensor want = Tensor::empty(DType::F32, {T, nh, kvl}), got = Tensor::empty(DType::F32, {T, nh, kvl}, dev);
      ops::mla_attention(ql, qp, cache, tok, Tensor(), Tensor(), scale, want);
      const Tensor dcache = cache.to(dev);
      ops::mla_attention(ql.to(dev), qp.to(dev), dcache, dtok, Tensor(), Tensor(), scale, got);
      std::string why = nmse_vs_cpu(got, want, 1e-9, what);
      if (!why.empty()) return why;
      Tensor one = Tensor::empty(DType::F32, {1, nh, kvl}, dev);
      ops::mla_attention(ql.slice(0, T - 1, T).to(dev), qp.slice(0, T - 1, T).to(dev), dcache, last, Tensor(),
                         Tensor(), scale, one);
      return alone(got, one, what);
    });
  if (ops::indexer_tc())
    idx_why = check_guarded([&]() -> std::string {
      const int64_t nI = 32, dI = 128, C = 150;
      const Tensor keys = fp8 ? fp8_cache(dI, 0) : bf16_cache(dI), q = f32({T, nI, dI}), w = f32({T, nI});
      const std::string what = std::string("indexer scores over ") + kind + " cache (tensor cores)";
      Tensor want = Tensor::zeros(DType::F32, {T, C}), got = Tensor::zeros(DType::F32, {T, C}, dev);
      ops::indexer_scores(q, w, keys, tok, want);
      const Tensor dkeys = keys.to(dev);
      ops::indexer_scores(q.to(dev), w.to(dev), dkeys, dtok, got);
      std::string why = nmse_vs_cpu(got, want, 1e-9, what);
      if (!why.empty()) return why;
      Tensor one = Tensor::zeros(DType::F32, {1, C}, dev);
      ops::indexer_scores(q.slice(0, T - 1, T).to(dev), w.slice(0, T - 1, T).to(dev), dkeys, last, one);
      return alone(got, one, what);
    });
  return {mla_why, idx_why};
}

void check_gemm_value(const char* opt, const std::string& v) {
  DFLASH2_CHECK_ARG(v == "auto" || v == "exact" || v == "bf16" || v == "fp8" || v == "nvfp4", "Engine: ", opt,
                    " must be 'auto', 'exact', 'bf16', 'fp8' or 'nvfp4', found '", v, "'");
}
// A GEMM-numerics option (Engine decode_gemm, draft_gemm) for weights on `dev`: "exact",
// "bf16", "fp8" (needs FP8 block-128 weights: fp8_w), "nvfp4" (NVFP4 weights with an
// input_scale: fp4_w), each checked against what this build runs on `dev`; "auto" = on a
// GPU, BF16, then FP8 / NVFP4 for such weights, each once `self_check(g)` passed ("" =
// passed; the load-time check of prefill_gemm, run once per numerics); "exact" elsewhere.
// `who` names the weights' owner in errors.
template <class Check>
ops::GemmNumerics resolve_gemm(const char* opt, const std::string& v, Device dev, bool fp8_w, bool fp4_w,
                               const std::string& who, Check&& self_check) {
  using ops::GemmNumerics;
  check_gemm_value(opt, v);
  const bool bf16_ok = ops::linear_bf16_available(dev);
  if (v == "auto") {
    if (!dev.is_cuda() || !bf16_ok || !self_check(GemmNumerics::BF16).empty()) return GemmNumerics::Exact;
    if (fp8_w && ops::linear_fp8_available(dev) && self_check(GemmNumerics::FP8).empty()) return GemmNumerics::FP8;
    if (fp4_w && ops::linear_nvfp4_available(dev) && self_check(GemmNumerics::NVFP4).empty())
      return GemmNumerics::NVFP4;
    return GemmNumerics::BF16;
  }
  if (v == "exact") return GemmNumerics::Exact;
  const GemmNumerics g = v == "bf16" ? GemmNumerics::BF16 : v == "fp8" ? GemmNumerics::FP8 : GemmNumerics::NVFP4;
  DFLASH2_CHECK(bf16_ok, ErrorKind::Unsupported, "Engine: ", opt, "='", v, "' needs the tensor-core GEMM ",
                "(ops::linear_bf16), which this build has no kernel for on ", dev.str(), "; use 'exact' or 'auto'");
  DFLASH2_CHECK(g != GemmNumerics::FP8 || fp8_w, ErrorKind::Config, "Engine: ", opt, "='fp8' (W8A8) needs FP8 ",
                "block-128 weights, and ", who, " has none; use 'bf16', 'exact' or 'auto'");
  DFLASH2_CHECK(g != GemmNumerics::FP8 || ops::linear_fp8_available(dev), ErrorKind::Unsupported, "Engine: ", opt,
                "='fp8' needs ops::linear_fp8, which this build has no kernel for on ", dev.str(),
                "; use 'bf16', 'exact' or 'auto'");
  DFLASH2_CHECK(g != GemmNumerics::NVFP4 || fp4_w, ErrorKind::Config, "Engine: ", opt, "='nvfp4' (W4A4) needs ",
                "NVFP4 weights with an input_scale, and ", who, " has none; use 'bf16', 'exact' or 'auto'");
  DFLASH2_CHECK(g != GemmNumerics::NVFP4 || ops::linear_nvfp4_available(dev), ErrorKind::Unsupported, "Engine: ",
                opt, "='nvfp4' needs ops::linear_nvfp4, which this build has no kernel for on ", dev.str(),
                " (sm_100a / sm_103a); use 'bf16', 'exact' or 'auto'");
  return g;
}

// Engine draft_gemm for a loaded DFlash drafter that will run on `dev`: resolve_gemm over its
// own weights (not the target's LM head it shares).
template <class Check>
ops::GemmNumerics draft_gemm_for(const EngineConfig& cfg, const model::DFlashDrafter& m, Device dev,
                                 Check&& self_check) {
  const bool fp8_w = m.any_weight([](const ops::Weight& w) { return w.format == ops::WeightFormat::FP8Block128; });
  const bool fp4_w = m.any_weight([](const ops::Weight& w) { return ops::takes_w4a4(w); });
  return resolve_gemm("draft_gemm", cfg.draft_gemm, dev, fp8_w, fp4_w, "the drafter " + cfg.draft, self_check);
}
}  // namespace

Engine::Engine(const EngineConfig& cfg) : impl_(std::make_unique<Impl>()) {
  Impl& I = *impl_;
  I.cfg = cfg;
  DFLASH2_CHECK_ARG(!cfg.target.empty(), "Engine: 'target' (a checkpoint directory) is required");
  const Device device = Device::parse(cfg.device);
  if (device.is_cuda()) {
#ifdef DFLASH2_WITH_CUDA
    std::string why;
    DFLASH2_CHECK(cuda::available(&why), ErrorKind::Unsupported, "Engine: device '", cfg.device, "': ", why);
#else
    fail(ErrorKind::Unsupported, "Engine: device '", cfg.device,
         "': this build of dflash2 has no CUDA backend (configured with DFLASH2_CUDA=OFF or without nvcc)");
#endif
  }
  DFLASH2_CHECK_ARG(cfg.num_threads >= 0 && cfg.num_threads <= ops::cpu_max_threads(), "Engine: num_threads must be in [0, ",
                    ops::cpu_max_threads(), "] (0 = all ", ops::cpu_cores(), " cores), found ", cfg.num_threads);
  DFLASH2_CHECK_ARG(cfg.max_batch_size >= 1 && cfg.max_step_tokens >= 1 && cfg.kv_block_size >= 1 && cfg.max_seq_len >= 0,
                    "Engine: max_batch_size, max_step_tokens and kv_block_size must be >= 1 and max_seq_len >= 0 (0 = "
                    "the model's limit), found ", cfg.max_batch_size, ", ", cfg.max_step_tokens, ", ", cfg.kv_block_size,
                    ", ", cfg.max_seq_len);
  DFLASH2_CHECK_ARG(cfg.prefill_tokens_per_step >= -1,
                    "Engine: prefill_tokens_per_step must be >= 1, 0 (no limit) or -1 (max_step_tokens), found ",
                    cfg.prefill_tokens_per_step);
  DFLASH2_CHECK_ARG(cfg.kv_cache_dtype == "f32" || cfg.kv_cache_dtype == "bf16" || cfg.kv_cache_dtype == "fp8",
                    "Engine: kv_cache_dtype must be 'f32', 'bf16' or 'fp8', found '", cfg.kv_cache_dtype, "'");
  ops::CpuThreadScope threads(cfg.num_threads);
  // the method: given, or implied by the drafter
  std::unique_ptr<Checkpoint> dk;
  if (!cfg.draft.empty()) dk = std::make_unique<Checkpoint>(Checkpoint::open(cfg.draft));
  std::string m = cfg.method;
  if (m.empty()) m = dk ? method_of_drafter(*dk) : "ar";
  I.method = runtime::parse_method(m);
  I.method_str = m;
  I.cfg.method = m;
  if (I.method == Method::DFlash || I.method == Method::DFlash2)
    DFLASH2_CHECK_ARG(dk != nullptr, "Engine: method '", m, "' needs a drafter checkpoint (draft=PATH)");
  else
    DFLASH2_CHECK_ARG(dk == nullptr, "Engine: method '", m, "' takes no drafter (draft='", cfg.draft, "')",
                      I.method == Method::MTP ? ": it drafts with the target's own MTP layer" : "");

  DFLASH2_CHECK_ARG(cfg.tensor_parallel >= 1 && cfg.tensor_parallel <= 64, "Engine: tensor_parallel must be in [1, ",
                    "64], found ", cfg.tensor_parallel);
  Checkpoint ck = Checkpoint::open(cfg.target);
  std::vector<std::unique_ptr<model::GlmModel>> shards;  // one per tensor-parallel rank
  for (int64_t r = 0; r < cfg.tensor_parallel; ++r) {
    model::GlmModel::Options mo;
    mo.max_step_tokens = cfg.max_step_tokens;
    mo.tp_rank = r;
    mo.tp_size = cfg.tensor_parallel;
    mo.expert_parallel = cfg.expert_parallel;
    shards.push_back(model::GlmModel::load(ck, mo));
  }
  const model::GlmConfig& mc = shards[0]->config();
  const int64_t max_len = cfg.max_seq_len > 0 ? cfg.max_seq_len : std::min<int64_t>(4096, mc.max_position_embeddings);
  DFLASH2_CHECK_ARG(max_len <= mc.max_position_embeddings, "Engine: max_seq_len ", max_len,
                    " exceeds the model's max_position_embeddings ", mc.max_position_embeddings);
  I.cfg.max_seq_len = max_len;
  runtime::Target::Options to;
  to.max_seq_len = max_len;
  to.max_batch_size = cfg.max_batch_size;
  to.max_step_tokens = cfg.max_step_tokens;
  to.kv_block_size = cfg.kv_block_size;
  to.kv_cache_dtype = cfg.kv_cache_dtype == "bf16" ? DType::BF16 : cfg.kv_cache_dtype == "fp8" ? DType::U8 : DType::F32;
  to.num_threads = cfg.num_threads;
  to.device = device;
  to.cuda_graphs = cfg.cuda_graphs;
  DFLASH2_CHECK_ARG(cfg.pad_to_buckets >= -1 && cfg.pad_to_buckets <= 1,
                    "Engine: pad_to_buckets must be -1 (auto), 0 (off) or 1 (on), found ", cfg.pad_to_buckets);
  to.pad_to_buckets = cfg.pad_to_buckets == 1 ||
                      (cfg.pad_to_buckets == -1 && device.is_cuda() && cfg.cuda_graphs);
  I.core.target = std::make_unique<runtime::Target>(std::move(shards), to);
  // prompt tokens' GEMM numerics (the device is placed and checked by now)
  const std::string& pg = cfg.prefill_gemm;
  check_gemm_value("prefill_gemm", pg);
  const bool bf16_ok = ops::linear_bf16_available(device);
  const bool fp8_ok = bf16_ok && ops::linear_fp8_available(device);
  const bool fp4_ok = bf16_ok && ops::linear_nvfp4_available(device);
  const bool fp8_ckpt = I.core.target->model().has_fp8_weights();
  const bool fp4_ckpt = I.core.target->model().has_nvfp4_weights();
  DFLASH2_CHECK(pg != "bf16" || bf16_ok, ErrorKind::Unsupported, "Engine: prefill_gemm='bf16' needs the tensor-core GEMM ",
                "(ops::linear_bf16), which this build has no kernel for on ", device.str(),
                " (CUTLASS kernels: sm_90a, sm_100a / sm_103a); use 'exact' or 'auto'");
  DFLASH2_CHECK(pg != "fp8" || fp8_ckpt, ErrorKind::Config, "Engine: prefill_gemm='fp8' (W8A8) needs an FP8 block-128 ",
                "checkpoint, and ", cfg.target, " stores its projections in another format; use 'bf16', 'exact' or 'auto'");
  DFLASH2_CHECK(pg != "fp8" || fp8_ok, ErrorKind::Unsupported, "Engine: prefill_gemm='fp8' needs the FP8 block-128 ",
                "tensor-core GEMM (ops::linear_fp8), which this build has no kernel for on ", device.str(),
                " (CUTLASS kernel: sm_90a); use 'bf16', 'exact' or 'auto'");
  DFLASH2_CHECK(pg != "nvfp4" || fp4_ckpt, ErrorKind::Config, "Engine: prefill_gemm='nvfp4' (W4A4) needs a checkpoint ",
                "whose prompt-path projections (attention, dense / shared-expert MLPs) or routed experts are NVFP4 with an "
                "input_scale, "
                "and ", cfg.target, " has none; use 'bf16', 'exact' or 'auto'");
  DFLASH2_CHECK(pg != "nvfp4" || fp4_ok, ErrorKind::Unsupported, "Engine: prefill_gemm='nvfp4' needs the NVFP4 W4A4 ",
                "tensor-core GEMM (ops::linear_nvfp4), which this build has no kernel for on ", device.str(),
                " (CUTLASS kernel: sm_100a / sm_103a; Hopper has no FP4 MMA); use 'bf16', 'exact' or 'auto'");
  using ops::GemmNumerics;
  GemmNumerics prefill = pg == "bf16"    ? GemmNumerics::BF16
                         : pg == "fp8"   ? GemmNumerics::FP8
                         : pg == "nvfp4" ? GemmNumerics::NVFP4
                                         : GemmNumerics::Exact;
  // each tensor-core numerics' load-time check, run once (prefill_gemm / decode_gemm /
  // draft_gemm "auto"); a failure is reported once and keeps that numerics off (a failed
  // experts' part keeps only the routed experts off it)
  std::string checked[4], experts_checked[4];
  bool ran[4] = {false, false, false, false};
  auto self_check = [&](GemmNumerics g) -> const std::string& {
    const unsigned i = unsigned(g);
    if (!ran[i]) {
      checked[i] = tc_gemm_self_check(device, g, &experts_checked[i]);
      ran[i] = true;
      if (!checked[i].empty())
        std::fprintf(stderr, "dflash2: the %s tensor-core GEMM failed its load-time check on %s (%s); nothing "
                     "runs on it\n", ops::gemm_numerics_name(g), device.str().c_str(), checked[i].c_str());
      else if (!experts_checked[i].empty())
        std::fprintf(stderr, "dflash2: the routed experts' %s grouped GEMM failed its load-time check on %s (%s); "
                     "the routed experts do not take it\n", ops::gemm_numerics_name(g), device.str().c_str(),
                     experts_checked[i].c_str());
    }
    return checked[i];
  };
  if (pg == "auto" && device.is_cuda()) {
    // The default on a GPU: the tensor cores, each numerics only once it has proved itself
    // here; FP8 / NVFP4 checkpoints take their low-precision GEMM where it exists (as their
    // authors run them).
    for (GemmNumerics g : {GemmNumerics::BF16, GemmNumerics::FP8, GemmNumerics::NVFP4}) {
      const bool want = g == GemmNumerics::BF16  ? bf16_ok
                        : g == GemmNumerics::FP8 ? fp8_ok && fp8_ckpt && prefill == GemmNumerics::BF16
                                                 : fp4_ok && fp4_ckpt && prefill == GemmNumerics::BF16;
      if (!want) continue;
      if (!self_check(g).empty()) break;
      prefill = g;
    }
  }
  // linear's exact form on the tensor cores (ops::exact_tc, opt-in): checked here before the
  // first exact GEMM of this engine; a failure turns it off in the process (the SIMT kernels)
  if (device.is_cuda() && ops::exact_tc()) {
    const std::string why = exact_tc_self_check(device);
    if (!why.empty()) {
      std::fprintf(stderr, "dflash2: the exact GEMMs on the tensor cores (exact_tc) failed their load-time check on "
                   "%s (%s); the SIMT kernels run instead\n", device.str().c_str(), why.c_str());
      ops::set_exact_tc(false);
    }
  }
  // a BF16 or FP8 KV cache's attention on the tensor cores (ops::mla_tc / indexer_tc, on by default):
  // checked here before the target's first forward; a failure turns that switch off in the
  // process (the SIMT kernel)
  if (device.is_cuda() && (cfg.kv_cache_dtype == "bf16" || cfg.kv_cache_dtype == "fp8") &&
      (ops::mla_tc() || ops::indexer_tc())) {
    const auto [mla_why, idx_why] = attention_tc_self_check(device, cfg.kv_cache_dtype == "fp8");
    if (!mla_why.empty()) {
      std::fprintf(stderr, "dflash2: sparse MLA on the tensor cores (mla_tc) failed its load-time check on %s (%s); "
                   "the SIMT kernel runs instead\n", device.str().c_str(), mla_why.c_str());
      ops::set_mla_tc(false);
    }
    if (!idx_why.empty()) {
      std::fprintf(stderr, "dflash2: the indexer's scores on the tensor cores (indexer_tc) failed their load-time "
                   "check on %s (%s); the SIMT kernel runs instead\n", device.str().c_str(), idx_why.c_str());
      ops::set_indexer_tc(false);
    }
  }
  // generated tokens' GEMM numerics (decode / verify chunks): the same resolution, the same
  // load-time checks (each run once)
  const GemmNumerics decode = resolve_gemm("decode_gemm", cfg.decode_gemm, device, fp8_ckpt, fp4_ckpt,
                                           "the target " + cfg.target, self_check);
  uint32_t experts_allowed = ~0u;  // bit g: the routed experts may take numerics g (not a failed check's)
  for (unsigned g = 0; g < 4; ++g)
    if (ran[g] && !experts_checked[g].empty()) experts_allowed &= ~(1u << g);
  I.core.target->set_prefill(prefill, experts_allowed);
  I.core.target->set_decode(decode, experts_allowed);
  I.cfg.decode_gemm = ops::gemm_numerics_name(decode);
  I.cfg.experts_decode_gemm = ops::gemm_numerics_name(I.core.target->model().experts_decode());
  I.cfg.experts_prefill_gemm = ops::gemm_numerics_name(I.core.target->model().experts_prefill());
  I.cfg.prefill_gemm = ops::gemm_numerics_name(prefill);
  I.cfg.cuda_graphs = I.core.target->cuda_graphs();  // what is in effect (CUDA)
  // what is in effect: only steps recorded as one unit are padded (on CUDA, with graphs)
  I.cfg.pad_to_buckets = I.core.target->options().pad_to_buckets && I.core.target->can_record_steps() ? 1 : 0;
  I.config_json = ck.config().root().dump();
  check_gemm_value("draft_gemm", cfg.draft_gemm);
  if (I.method == Method::DFlash || I.method == Method::DFlash2) {
    I.core.drafter = runtime::make_dflash_drafter(
        *dk, *I.core.target, I.method,
        [&](const model::DFlashDrafter& m, Device dev) { return draft_gemm_for(cfg, m, dev, self_check); });
    I.cfg.draft_gemm = ops::gemm_numerics_name(I.core.drafter->dflash_model()->gemm());
  } else {
    DFLASH2_CHECK_ARG(cfg.draft_gemm == "auto" || cfg.draft_gemm == "exact", "Engine: draft_gemm='", cfg.draft_gemm,
                      "' applies to the DFlash drafters (method 'dflash' / 'dflash2'); this engine has none");
    I.cfg.draft_gemm = "exact";
    if (I.method == Method::MTP) I.core.drafter = runtime::make_mtp_drafter(*I.core.target, cfg.mtp_draft_tokens);
  }
  I.core.num_threads = cfg.num_threads;
  if (I.core.drafter) {
    I.core.K = I.core.drafter->draft_len();
    I.core.taps = I.core.drafter->tap_layers();
    I.core.want_final = I.core.drafter->wants_final_hidden();
  }
  I.core.allocate_buffers();
  DFLASH2_CHECK_ARG(cfg.speculation == "fixed" || cfg.speculation == "adaptive",
                    "Engine: speculation must be 'fixed' or 'adaptive', found '", cfg.speculation, "'");
  DFLASH2_CHECK_ARG(cfg.capture_at_load >= -1 && cfg.capture_at_load <= 1,
                    "Engine: capture_at_load must be -1 (auto), 0 (off) or 1 (on), found ", cfg.capture_at_load);
  // "auto": where decode steps are recorded as one graph (every rank's part one graph under
  // tensor parallelism; not MTP's there, whose per-chunk graphs are captured as shapes recur)
  const bool capture = cfg.capture_at_load == 1 ||
                       (cfg.capture_at_load == -1 && I.core.target->cuda_graphs() && I.core.records_steps());
  I.cfg.capture_at_load = capture ? 1 : 0;
  if (capture) {  // before the scheduler exists: nothing else runs the model yet
    const runtime::WarmUp w = runtime::warm_up_steps(I.core, cfg.speculation == "adaptive");
    if (device.is_cuda()) {
      std::string sizes, lens;
      for (int64_t b : w.buckets) sizes += (sizes.empty() ? "" : ", ") + std::to_string(b);
      for (int64_t k : w.draft_lens) lens += (lens.empty() ? "" : ", ") + std::to_string(k);
      const runtime::GraphStats g = I.core.target->graph_stats();
      std::fprintf(stderr, "dflash2: decode-step graphs captured at load for batch sizes %s, draft lengths %s (%lld "
                   "steps, %.2f s; %lld graphs, %lld failed)%s%s\n", sizes.empty() ? "(none)" : sizes.c_str(),
                   lens.c_str(), (long long)w.steps, w.seconds, (long long)g.captured, (long long)g.failed,
                   w.stopped.empty() ? "" : "; stopped early: ", w.stopped.c_str());
    }
  }
  I.cfg.prefill_tokens_per_step = cfg.prefill_tokens_per_step < 0 ? cfg.max_step_tokens : cfg.prefill_tokens_per_step;
  // generated tokens' rows equal what a prompt's prefill computes where every numerics is the
  // exact one (the rows are batch-invariant and rounded alike: decode == verify == prefill)
  I.cfg.prefix_cache_generated = cfg.prefix_caching && I.cfg.prefill_gemm == "exact" &&
                                 I.cfg.decode_gemm == "exact" && I.cfg.experts_prefill_gemm == "exact" &&
                                 I.cfg.experts_decode_gemm == "exact" && I.cfg.draft_gemm == "exact";
  I.scheduler = std::make_unique<runtime::Scheduler>(I.core, I.model_mu, cfg.speculation == "adaptive",
                                                     I.cfg.prefill_tokens_per_step, cfg.prefix_caching,
                                                     I.cfg.prefix_cache_generated);
}

Engine::~Engine() { close(); }

int64_t Engine::vocab_size() const { return impl_->core.target->config().vocab_size; }
int64_t Engine::hidden_size() const { return impl_->core.target->config().hidden_size; }
int64_t Engine::num_layers() const { return impl_->core.target->config().num_layers; }
bool Engine::has_mtp() const { return impl_->core.target->model().has_mtp(); }
const EngineConfig& Engine::config() const { return impl_->cfg; }
std::string Engine::model_config_json() const { return impl_->config_json; }
std::string Engine::draft_device() const {
  return impl_->core.drafter ? impl_->core.drafter->device().str() : std::string();
}
int Engine::draft_ranks() const { return impl_->core.drafter ? impl_->core.drafter->tp_ranks() : 0; }
int64_t Engine::block_size() const { return impl_->core.K + 1; }
const std::string& Engine::method() const { return impl_->method_str; }

Tensor Engine::logits(const std::vector<int32_t>& tokens) {
  DFLASH2_CHECK_ARG(!tokens.empty(), "logits: the token list is empty");
  auto seq = new_sequence();
  std::vector<Tensor> none;
  return seq->extend(tokens, {}, &none);
}

std::vector<TokenLogprobs> Engine::prompt_logprobs(const std::vector<int32_t>& tokens, int64_t top) {
  Impl& I = *impl_;
  runtime::Target& tgt = *I.core.target;
  const int64_t n = int64_t(tokens.size()), V = tgt.config().vocab_size;
  DFLASH2_CHECK_ARG(n >= 2, "prompt_logprobs: needs at least 2 tokens (the first has no context), found ", n);
  DFLASH2_CHECK_ARG(top >= 0 && top <= std::min<int64_t>(kMaxLogprobs, V), "prompt_logprobs: top must be in [0, ",
                    std::min<int64_t>(kMaxLogprobs, V), "], found ", top);
  DFLASH2_CHECK_ARG(n <= tgt.options().max_seq_len, "prompt_logprobs: ", n, " tokens exceed max_seq_len ",
                    tgt.options().max_seq_len);
  for (int64_t j = 0; j < n; ++j)
    DFLASH2_CHECK_ARG(tokens[size_t(j)] >= 0 && tokens[size_t(j)] < V, "prompt_logprobs: token id ",
                      tokens[size_t(j)], " at position ", j, " is outside the vocabulary [0, ", V, ")");
  std::vector<TokenLogprobs> out;
  auto seq = new_sequence();  // released (under the model lock) when it goes
  {
    ops::CpuThreadScope threads(I.core.num_threads);
    // chunks of at most R rows, their logits kept where the target leaves them (rank 0's
    // device); with every numerics exact a row does not depend on its chunk. The model lock
    // is taken per chunk, so running requests step between them (the sequence's cache
    // stream and these buffers are its own).
    const int64_t R = std::min<int64_t>({n, tgt.options().max_step_tokens, 512});
    const Device dev = I.core.device;
    const bool cuda = dev.is_cuda();
    Tensor lg = Tensor::empty(DType::F32, {R, V}, dev);
    Tensor ids_h = Tensor::zeros(DType::I32, {R}), lp_h = Tensor::zeros(DType::F32, {R});
    Tensor lse_h = Tensor::zeros(DType::F32, {R});
    Tensor tv_h = Tensor::zeros(DType::F32, {std::max<int64_t>(R * top, 1)});
    Tensor ti_h = Tensor::zeros(DType::I32, {std::max<int64_t>(R * top, 1)});
    Tensor ids_d = cuda ? Tensor::zeros(DType::I32, {R}, dev) : ids_h, lp_d = cuda ? Tensor::zeros(DType::F32, {R}, dev) : lp_h;
    Tensor lse_d = cuda ? Tensor::zeros(DType::F32, {R}, dev) : lse_h;
    Tensor tv_d = cuda ? Tensor::zeros(DType::F32, {tv_h.numel()}, dev) : tv_h;
    Tensor ti_d = cuda ? Tensor::zeros(DType::I32, {ti_h.numel()}, dev) : ti_h;
    std::vector<CacheStream*> streams{&seq->impl_->main};
    std::vector<const int32_t*> toks{tokens.data()};
    std::vector<int64_t> counts{n};
    std::vector<std::vector<runtime::Piece>> chunks;
    runtime::make_chunks(streams, toks, counts, R, chunks);
    out.reserve(size_t(n - 1));
    int64_t row0 = 0;
    for (const auto& ch : chunks) {
      std::lock_guard<std::mutex> model_lock(I.model_mu);
      const int64_t T = ch[0].n;
      model::ForwardOutputs fo;
      fo.exact = true;  // as logits(): exact whatever prefill_gemm / decode_gemm
      fo.logits = lg.slice(0, 0, T);
      fo.all_logits = true;
      tgt.run_chunk(ch, fo);
      int32_t* ids = ids_h.data_as<int32_t>();
      for (int64_t j = 0; j < T; ++j) ids[j] = row0 + j + 1 < n ? tokens[size_t(row0 + j + 1)] : 0;
      Tensor x = lg.slice(0, 0, T), id = ids_d.slice(0, 0, T), lp = lp_d.slice(0, 0, T), ls = lse_d.slice(0, 0, T);
      if (cuda) id.copy_from(ids_h.slice(0, 0, T));
      ops::token_logprobs(x, id, lp, ls);
      Tensor tv = tv_d.slice(0, 0, T * top), ti = ti_d.slice(0, 0, T * top);
      if (top > 0) {
        Tensor tv2 = tv.reshape({T, top}), ti2 = ti.reshape({T, top});
        ops::topk(x, top, tv2, ti2);
      }
      if (cuda) {
        lp_h.slice(0, 0, T).copy_from(lp);
        lse_h.slice(0, 0, T).copy_from(ls);
        if (top > 0) {
          tv_h.slice(0, 0, T * top).copy_from(tv);
          ti_h.slice(0, 0, T * top).copy_from(ti);
        }
      }
      const float *v = lp_h.data_as<const float>(), *l = lse_h.data_as<const float>();
      const float* topv = tv_h.data_as<const float>();
      const int32_t* topi = ti_h.data_as<const int32_t>();
      for (int64_t j = 0; j < T && row0 + j + 1 < n; ++j) {
        DFLASH2_CHECK(std::isfinite(v[j]), ErrorKind::Numerical, "prompt_logprobs: non-finite logits (NaN or Inf) "
                      "from the target at position ", row0 + j);
        out.emplace_back();
        runtime::set_token_logprobs(out.back(), v[j], l[j], topv + j * top, topi + j * top, top);
      }
      row0 += T;
    }
  }
  return out;
}

std::unique_ptr<Sequence> Engine::new_sequence() {
  auto impl = std::make_unique<Sequence::Impl>();
  impl->e = impl_.get();
  return std::unique_ptr<Sequence>(new Sequence(std::move(impl)));
}

std::unique_ptr<runtime::Request> Engine::Impl::make_request(const std::vector<int32_t>& prompt,
                                                             const SamplingParams& p, const char* where) {
  const auto& mc = core.target->config();
  const int64_t V = mc.vocab_size, max_len = core.target->options().max_seq_len;
  DFLASH2_CHECK_ARG(p.max_new_tokens >= 1, where, ": max_new_tokens must be >= 1, found ", p.max_new_tokens);
  DFLASH2_CHECK_ARG(p.temperature >= 0.0f && std::isfinite(p.temperature), where,
                    ": temperature must be >= 0, found ", p.temperature);
  DFLASH2_CHECK_ARG(p.top_p > 0.0f && p.top_p <= 1.0f, where, ": top_p must be in (0, 1], found ", p.top_p);
  DFLASH2_CHECK_ARG(p.top_k >= 0 && p.top_k <= INT32_MAX, where, ": top_k must be in [0, 2^31) (0 = off), found ",
                    p.top_k);
  DFLASH2_CHECK_ARG(p.logprobs >= -1 && p.logprobs <= std::min<int64_t>(kMaxLogprobs, V), where,
                    ": logprobs must be -1 (none) or in [0, ", std::min<int64_t>(kMaxLogprobs, V), "], found ",
                    p.logprobs);
  auto in = [](float v, float lo, float hi) { return std::isfinite(v) && v >= lo && v <= hi; };
  DFLASH2_CHECK_ARG(in(p.presence_penalty, -2.0f, 2.0f), where, ": presence_penalty must be in [-2, 2], found ",
                    p.presence_penalty);
  DFLASH2_CHECK_ARG(in(p.frequency_penalty, -2.0f, 2.0f), where, ": frequency_penalty must be in [-2, 2], found ",
                    p.frequency_penalty);
  DFLASH2_CHECK_ARG(in(p.repetition_penalty, 0.01f, 100.0f), where,
                    ": repetition_penalty must be in [0.01, 100] (1 = off), found ", p.repetition_penalty);
  DFLASH2_CHECK_ARG(p.min_tokens >= 0 && p.min_tokens <= p.max_new_tokens, where,
                    ": min_tokens must be in [0, max_new_tokens = ", p.max_new_tokens, "], found ", p.min_tokens);
  for (size_t i = 0; i < p.logit_bias.size(); ++i) {
    const auto& [t, b] = p.logit_bias[i];
    DFLASH2_CHECK_ARG(t >= 0 && t < V, where, ": logit_bias token ", t, " is outside the vocabulary [0, ", V, ")");
    DFLASH2_CHECK_ARG(in(b, -100.0f, 100.0f), where, ": logit_bias of token ", t, " must be in [-100, 100], found ",
                      b);
  }
  DFLASH2_CHECK_ARG(!prompt.empty(), where, " is empty");
  DFLASH2_CHECK_ARG(int64_t(prompt.size()) < max_len, where, " has ", prompt.size(), " tokens; max_seq_len is ",
                    max_len, " (the prompt plus at least one generated token must fit)");
  for (size_t j = 0; j < prompt.size(); ++j)
    DFLASH2_CHECK_ARG(prompt[j] >= 0 && prompt[j] < V, where, " token ", j, " = ", prompt[j],
                      " is outside the vocabulary [0, ", V, ")");
  auto r = std::make_unique<runtime::Request>();
  r->prompt = prompt;
  r->p = p;
  if (p.has_stop_tokens) {
    r->stops = p.stop_token_ids;
    for (size_t i = 0; i < r->stops.size(); ++i)
      DFLASH2_CHECK_ARG(r->stops[i] >= 0 && r->stops[i] < V, where, ": stop_token_ids[", i, "] = ", r->stops[i],
                        " is outside the vocabulary [0, ", V, ")");
  } else {
    for (auto e : mc.eos_token_ids) r->stops.push_back(int32_t(e));
  }
  r->rng_key = runtime::rng_key(p.seed, p.stream_index);
  r->penalized = p.adjusts_logits();
  // greedy output never depends on the drafts; a seeded sampled request keeps the full block
  // so that its tokens do not depend on what else runs (the draft length would change them)
  r->adaptive = p.temperature <= 0.0f || p.seed < 0;
  return r;
}

std::vector<GenerationResult> Engine::generate(const std::vector<std::vector<int32_t>>& prompts,
                                               const SamplingParams& p, const TokenCallback& on_tokens) {
  Impl& I = *impl_;
  I.check_open();
  DFLASH2_CHECK_ARG(!prompts.empty(), "generate: no prompts given");
  DFLASH2_CHECK_ARG(!p.constraint || prompts.size() == 1, "generate: a token constraint is the state of one request; "
                    "with ", prompts.size(), " prompts submit() each with a constraint of its own");
  std::vector<std::unique_ptr<runtime::Request>> reqs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    SamplingParams pi = p;
    pi.stream_index = int64_t(i);
    const std::string where = "generate: prompt " + std::to_string(i);
    reqs.push_back(I.make_request(prompts[i], pi, where.c_str()));
  }
  std::vector<RequestId> ids;
  std::unordered_map<RequestId, size_t> index;
  for (size_t i = 0; i < reqs.size(); ++i) {
    ids.push_back(I.scheduler->submit(std::move(reqs[i])));
    index[ids.back()] = i;
  }
  std::vector<GenerationResult> results(prompts.size());
  std::vector<RequestId> open = ids;
  try {
    while (!open.empty()) {
      for (RequestUpdate& u : I.scheduler->poll(open, -1.0)) {
        const size_t i = index[u.id];
        if (on_tokens && !u.new_tokens.empty()) on_tokens(int64_t(i), u.new_tokens);
        if (u.finished) {
          results[i] = std::move(u.result);
          open.erase(std::find(open.begin(), open.end(), u.id));
        }
      }
    }
  } catch (const runtime::RequestFailed& e) {
    for (RequestId id : open) I.scheduler->cancel(id);
    // name the prompt of the request that failed, keep the error's kind
    throw Error(e.kind(), "generate: prompt " + std::to_string(index[e.id]) + ": " + e.what());
  } catch (...) {
    for (RequestId id : open) I.scheduler->cancel(id);
    throw;
  }
  return results;
}

RequestId Engine::submit(const std::vector<int32_t>& prompt, const SamplingParams& p) {
  impl_->check_open();
  return impl_->scheduler->submit(impl_->make_request(prompt, p, "submit: prompt"));
}

std::vector<RequestUpdate> Engine::poll(const std::vector<RequestId>& ids, double timeout_s) {
  DFLASH2_CHECK_ARG(impl_->scheduler != nullptr, "the engine is closed");
  return impl_->scheduler->poll(ids, timeout_s);
}

void Engine::cancel(RequestId id) {
  if (impl_->scheduler) impl_->scheduler->cancel(id);
}

void Engine::close() {
  if (impl_ && impl_->scheduler) impl_->scheduler->close();
}

EngineMetrics Engine::metrics() const {
  EngineMetrics m = impl_->scheduler ? impl_->scheduler->metrics() : EngineMetrics{};
  if (impl_->core.target) {
    runtime::GraphStats g = impl_->core.target->graph_stats();
    if (impl_->core.drafter) g += impl_->core.drafter->graph_stats();  // the device drafter's graphs too
    m.cuda_graphs_captured = g.captured;
    m.cuda_graphs_replayed = g.replayed;
    m.cuda_graphs_eager = g.eager;
    m.cuda_graphs_failed = g.failed;
    m.cuda_graphs_pdl_edges = g.pdl_edges;
    m.cuda_graphs_last_failure = g.last_failure;
    m.steps_as_one_unit = impl_->core.target->recorder().steps();
    m.padding_rows = impl_->core.target->padding_rows();
    m.argmax_gather_steps = impl_->core.target->argmax_steps();
    m.draft_head_gathers = impl_->core.target->vocab_head_calls();
    m.drafter_appends_in_step = impl_->core.drafter ? impl_->core.drafter->appends_in_step() : 0;
    m.draft_cache_bytes = impl_->core.drafter ? impl_->core.drafter->cache_bytes() : 0;
    m.kv_cache_bytes = impl_->core.target->cache().bytes() + impl_->core.target->mtp_cache().bytes();
  }
  return m;
}

TpCollectives Engine::tp_collectives() const {
  std::lock_guard<std::mutex> lk(impl_->model_mu);  // rank 0 counts on the thread that runs the model
  comm::CommStats s = impl_->core.target->comm_stats();
  TpCollectives t;
  t.all_reduce_calls = s.all_reduce_calls;
  t.all_reduce_bytes = s.all_reduce_bytes;
  t.all_reduce_peer_calls = s.all_reduce_p2p_calls;
  t.all_gather_peer_calls = s.all_gather_p2p_calls;
  t.broadcast_peer_calls = s.broadcast_p2p_calls;
  t.all_gather_calls = s.all_gather_calls;
  t.all_gather_bytes = s.all_gather_bytes;
  t.broadcast_calls = s.broadcast_calls;
  t.broadcast_bytes = s.broadcast_bytes;
  return t;
}

Proposal Engine::propose(const std::vector<int32_t>& tokens) {
  Impl& I = *impl_;
  ops::CpuThreadScope threads(I.core.num_threads);
  std::lock_guard<std::mutex> model_lock(I.model_mu);
  runtime::Target& tgt = *I.core.target;
  DFLASH2_CHECK(I.core.drafter != nullptr, ErrorKind::InvalidArgument,
                "propose: method 'ar' drafts nothing; create the Engine with method 'dflash2', 'dflash' or 'mtp'");
  DFLASH2_CHECK_ARG(!tokens.empty(), "propose: the token list is empty");
  const int64_t n = int64_t(tokens.size()), V = tgt.config().vocab_size;
  for (int64_t j = 0; j < n; ++j)
    DFLASH2_CHECK_ARG(tokens[size_t(j)] >= 0 && tokens[size_t(j)] < V, "propose: token ", j, " = ", tokens[size_t(j)],
                      " is outside the vocabulary [0, ", V, ")");
  DFLASH2_CHECK_ARG(n + I.core.K + 1 <= tgt.options().max_seq_len, "propose: ", n, " tokens plus a block of ", I.core.K + 1,
                    " exceed max_seq_len ", tgt.options().max_seq_len);
  Proposal out;
  CacheStream main;
  const int slot = int(tgt.options().max_batch_size);  // the drafter's slot for propose
  try {
    std::vector<CacheStream*> streams{&main};
    std::vector<const int32_t*> toks{tokens.data()};
    std::vector<int64_t> counts{n};
    runtime::make_chunks(streams, toks, counts, tgt.options().max_step_tokens, I.core.chunks);
    std::vector<int32_t> next(tokens.begin() + 1, tokens.end());
    runtime::Features feats{I.core.taps_buf, I.core.fin};
    uint64_t unused = 0;
    for (const auto& ch : I.core.chunks) {
      const auto& pc = ch[0];
      model::ForwardOutputs fo;
      fo.prompt = true;  // as generate prefills it
      fo.logits = I.core.logits.slice(0, 0, pc.last ? 1 : 0);
      fo.tap_layers = I.core.taps;
      if (I.core.taps_buf.defined()) fo.taps = I.core.taps_buf.slice(0, 0, pc.n);
      if (I.core.fin.defined()) fo.final_hidden = I.core.fin.slice(0, 0, pc.n);
      tgt.run_chunk(ch, fo);
      if (pc.last) {
        I.core.argmax_row0();
        out.anchor = I.core.s_out.data_as<const int32_t>()[0];
        next.push_back(out.anchor);
      }
      runtime::CommitRows c;
      c.slot = slot;
      c.pos0 = pc.offset;
      c.n = pc.n;
      c.next = next.data() + pc.offset;
      I.core.drafter->commit({c}, feats);
    }
    runtime::DraftJob j;
    j.slot = slot;
    j.anchor = out.anchor;
    j.max_tokens = I.core.K;
    j.room = tgt.options().max_seq_len - n - 1;
    j.rng_counter = &unused;
    const runtime::DraftResult& dr = I.core.drafter->draft({j});
    I.core.drafter->fetch_host();  // a drafter on the device leaves its outputs there
    const int32_t* d = dr.tokens.data_as<const int32_t>() + dr.row[0] * dr.tokens.stride(0);
    out.tokens.assign(d, d + dr.len[0]);
    if (dr.cand.defined() && dr.len[0] > 0) {
      const int64_t Kc = dr.cand.shape(2);
      for (int64_t t = 0; t < dr.len[0]; ++t) {
        const int32_t* c = dr.cand.data_as<const int32_t>() + dr.row[0] * dr.cand.stride(0) + t * dr.cand.stride(1);
        out.candidates.emplace_back(c, c + Kc);
      }
    }
  } catch (...) {
    tgt.cache().release(main);
    I.core.drafter->release(slot);
    throw;
  }
  tgt.cache().release(main);
  I.core.drafter->release(slot);
  return out;
}

// ------------------------------------------------------------------ Sequence
Sequence::Sequence(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Sequence::~Sequence() = default;
int64_t Sequence::length() const { return impl_->main.length; }
int64_t Sequence::mtp_length() const { return impl_->mtp.length; }

Tensor Sequence::extend(const std::vector<int32_t>& tokens, const std::vector<int64_t>& hidden_layers,
                        std::vector<Tensor>* hidden, Tensor* final_hidden) {
  Engine::Impl& I = *impl_->e;
  ops::CpuThreadScope threads(I.core.num_threads);
  std::lock_guard<std::mutex> model_lock(I.model_mu);
  runtime::Target& tgt = *I.core.target;
  DFLASH2_CHECK_ARG(!tokens.empty(), "extend: the token list is empty");
  const int64_t n = int64_t(tokens.size()), V = tgt.config().vocab_size, H = tgt.config().hidden_size;
  for (int64_t j = 0; j < n; ++j)
    DFLASH2_CHECK_ARG(tokens[size_t(j)] >= 0 && tokens[size_t(j)] < V, "token id ", tokens[size_t(j)], " at position ",
                      j, " is outside the vocabulary [0, ", V, ")");
  for (auto l : hidden_layers)
    DFLASH2_CHECK_ARG(l >= 0 && l < tgt.config().num_layers, "hidden layer id ", l, " is outside [0, ",
                      tgt.config().num_layers, ")");
  DFLASH2_CHECK_ARG(impl_->main.length + n <= tgt.options().max_seq_len, "sequence of ", impl_->main.length + n,
                    " tokens exceeds max_seq_len ", tgt.options().max_seq_len);
  Tensor logits = Tensor::empty(DType::F32, {n, V});
  const int64_t nl = int64_t(hidden_layers.size());
  Tensor taps = nl ? Tensor::empty(DType::F32, {n, nl * H}) : Tensor();
  Tensor fh = final_hidden ? Tensor::empty(DType::F32, {n, H}) : Tensor();
  std::vector<CacheStream*> streams{&impl_->main};
  std::vector<const int32_t*> toks{tokens.data()};
  std::vector<int64_t> counts{n};
  std::vector<std::vector<runtime::Piece>> chunks;
  runtime::make_chunks(streams, toks, counts, tgt.options().max_step_tokens, chunks);
  int64_t row0 = 0;
  for (const auto& ch : chunks) {
    const int64_t T = ch[0].n;
    model::ForwardOutputs out;
    out.exact = true;  // the comparison API: exact whatever prefill_gemm / decode_gemm
    out.logits = logits.slice(0, row0, row0 + T);
    out.all_logits = true;
    out.tap_layers = hidden_layers;
    if (nl) out.taps = taps.slice(0, row0, row0 + T);
    if (fh.defined()) out.final_hidden = fh.slice(0, row0, row0 + T);
    tgt.run_chunk(ch, out);
    row0 += T;
  }
  if (hidden) {
    hidden->clear();
    for (int64_t j = 0; j < nl; ++j) hidden->push_back(taps.slice(1, j * H, (j + 1) * H).contiguous());
  }
  if (final_hidden) *final_hidden = fh;
  return logits;
}

void Sequence::rollback(int64_t length) {
  std::lock_guard<std::mutex> lk(impl_->e->model_mu);
  impl_->e->core.target->cache().truncate(impl_->main, length);
}
void Sequence::release() {
  std::lock_guard<std::mutex> lk(impl_->e->model_mu);
  impl_->e->core.target->cache().release(impl_->main);
  if (impl_->e->core.target->model().has_mtp()) impl_->e->core.target->mtp_cache().release(impl_->mtp);
}

Tensor Sequence::mtp_extend(const std::vector<int32_t>& next_tokens, const Tensor& hidden_main) {
  Engine::Impl& I = *impl_->e;
  ops::CpuThreadScope threads(I.core.num_threads);
  std::lock_guard<std::mutex> model_lock(I.model_mu);
  runtime::Target& tgt = *I.core.target;
  DFLASH2_CHECK(tgt.model().has_mtp(), ErrorKind::Unsupported,
                "this checkpoint has no MTP layer (num_nextn_predict_layers = 0)");
  DFLASH2_CHECK_ARG(!next_tokens.empty(), "mtp_extend: the token list is empty");
  const int64_t n = int64_t(next_tokens.size()), V = tgt.config().vocab_size, H = tgt.config().hidden_size;
  for (int64_t j = 0; j < n; ++j)
    DFLASH2_CHECK_ARG(next_tokens[size_t(j)] >= 0 && next_tokens[size_t(j)] < V, "token id ", next_tokens[size_t(j)],
                      " is outside the vocabulary [0, ", V, ")");
  DFLASH2_CHECK_ARG(hidden_main.dtype() == DType::F32 && hidden_main.shape() == Tensor::Shape({n, H}),
                    "mtp: hidden_main must be F32 [", n, ", ", H, "], found ", hidden_main.describe());
  DFLASH2_CHECK_ARG(impl_->mtp.length + n <= tgt.options().max_seq_len, "MTP sequence of ", impl_->mtp.length + n,
                    " tokens exceeds max_seq_len ", tgt.options().max_seq_len);
  Tensor hm = hidden_main.contiguous();
  Tensor logits = Tensor::empty(DType::F32, {n, V});
  // every row's logits: one piece per token so each is a "last" row
  std::vector<runtime::Piece> pieces;
  for (int64_t off = 0; off < n; off += tgt.options().max_step_tokens) {
    const int64_t T = std::min(tgt.options().max_step_tokens, n - off);
    pieces.clear();
    runtime::Piece pc;
    pc.stream = &impl_->mtp;
    pc.tokens = next_tokens.data() + off;
    pc.n = T;
    pc.last = true;
    pieces.push_back(pc);
    Tensor lg = logits.slice(0, off, off + T), none;
    tgt.mtp_chunk(pieces, hm.slice(0, off, off + T), lg, none, /*all_rows=*/true);
  }
  return logits;
}

void Sequence::mtp_rollback(int64_t length) {
  std::lock_guard<std::mutex> lk(impl_->e->model_mu);
  impl_->e->core.target->mtp_cache().truncate(impl_->mtp, length);
}

}  // namespace dflash2
