// bench/cpp/bench_ops.cpp: latency microbenchmarks of the CUDA ops on GLM-5.3's real shapes.
//
//   bench_ops [--quick] [--json PATH] [--filter SUBSTR] [--trials N] [--cpu-smoke]
//
// Every case is one op (dflash2/ops.h, called exactly as cpp/src/model/glm_model.cpp calls
// it: F32 activations, weights in BF16 / FP8 block-128 / NVFP4) for T tokens, T = batch x
// (1 for decode, 8 for verify), batch 1, 8, 32: T in {1, 8, 32, 64, 256} (T = 8 is both
// decode at batch 8 and verify at batch 1; the attention ops, which see sequences, run
// those separately). Per case one line: time (median of --trials event pairs, each pair
// around enough calls for >= ~200 us), GB/s of the compulsory bytes (weights once +
// activations in and out; for attention the distinct cache rows read), TFLOP/s, that
// bandwidth as a fraction of the device-to-device copy bandwidth measured in the same run
// (cudaMemcpyAsync of 1 GiB, read + write bytes), and for the GEMMs the cuBLASLt time on
// the same shape and the ratio cuBLASLt time / our time (the goal: >= 0.90; for
// memory-bound ops: >= 0.85 of the copy bandwidth). linear_bf16 (the prompt chunks'
// tensor-core GEMM) runs at prefill sizes T in {256, 1024, 4096} ({256, 1024} with --quick)
// against cuBLASLt's BF16 GEMM, and linear_fp8 (FP8 checkpoints' W8A8 prefill GEMM, sm_90a / sm_100a / sm_103a)
// at the same sizes against cuBLASLt's block-scaled FP8 GEMM, and linear_nvfp4 (W4A4,
// sm_100a / sm_103a) on the MLP shapes against cuBLASLt's NVFP4 GEMM. linear_bf16_decode (the
// tensor-core GEMM of generated tokens, decode_gemm="bf16": gemm_sk.cu) runs at the decode
// sizes T above, BF16 / FP8 / NVFP4 weights read in place, against cuBLASLt's BF16 GEMM.
//
// L2: a weight that fits in L2 would be re-read from L2 by back-to-back calls, unlike in a
// model step, where every layer has its own weights. Cases whose operands are small keep
// several copies of them (together >= 4x the L2 size, at most 32) and cycle through them,
// so each call reads its weights / caches from HBM. The small activations stay L2-hot (as
// they are in a step).
//
// cuBLASLt baseline (built with DFLASH2_WITH_CUBLASLT, library dlopen'ed at run time): BF16
// weights x BF16 activations with fp32 accumulation and an F32 output (our op reads F32
// activations); FP8: E4M3 x E4M3 with 128x128 block scales on the weight and 1x128 on the
// activations (CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F / VEC128_32F) when cuBLASLt
// offers an algorithm for it on this device, else per-tensor scales (said in the case's
// "cublaslt_kind"); NVFP4: E2M1 with 16-element UE4M3 scales on sm_100+ only (Hopper has no
// FP4 MMA); linear_heads: a strided-batched GEMM over the heads (F32 weights against
// cuBLASLt's F32 GEMM). moe_experts has no cuBLASLt baseline (a grouped GEMM).
//
// linear_exact_tc: linear (the exact numerics, the default decode_gemm) on the tensor cores
// (ops::set_exact_tc: x as three BF16 planes, gemm_sk.h) beside its SIMT kernel on the same
// operands ("speedup"), at T = 1, 8, 32 (--quick) / 1 .. 256; moe_experts_exact_tc the same
// for the routed experts (FP8 with --quick, NVFP4 too without) against the SIMT expert kernels.
//
// linear_bf16_dq and moe_experts_bf16_dq (Hopper only): the mainloop-dequantizing GEMM of
// FP8 / NVFP4 weights' prompt chunks, and grouped over NVFP4 experts, in its wgmma form (the
// default there), beside its mma.sync form on the same operands ("speedup";
// ops::set_dq_wgmma switches them).
//
// moe_experts_fp8 (prompt chunks of FP8 checkpoints: the FP8 grouped GEMM, sm_90a / sm_100a / sm_103a) runs at
// T = 256 and 1024 beside the exact SIMT expert kernels on the same routing ("speedup"), and
// so do moe_experts_bf16 (NVFP4 experts on the grouped mainloop-dequantizing GEMM, W4A16)
// and moe_experts_nvfp4 (NVFP4 experts W4A4 on the block-scaled grouped GEMM, sm_100a /
// sm_103a only).
// moe_experts: the experts that the (uniform random, top-8 of 256) routing of the case hits
// are allocated (FP8: 37.7 MB each; all 256 = 9.7 GB once T >= 64); the experts that no
// token names share one of the allocated ones (never read).
//
// Without a usable GPU (or in a build without CUDA) it prints "no usable GPU: <why>",
// writes a JSON saying so and exits 0. Exit 1 when a case failed (its error is in the
// JSON), 2 on bad arguments.
//
// --cpu-smoke builds every case for T = 1 and 8 (batch 1) with CPU tensors and calls its op
// once through the CPU backend: a check, without a GPU, that each case's setup passes the
// ops' argument validation (it did for all 265 cases); its times mean nothing.
//
// Status: compiled, NOT yet run on a GPU (the timing, the copy bandwidth and the cuBLASLt
// calls have never executed).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dflash2/error.h"
#include "dflash2/json.h"
#include "dflash2/ops.h"
#include "dflash2/tensor.h"

#ifdef DFLASH2_WITH_CUDA
#include <cuda_runtime_api.h>
#endif
#ifdef DFLASH2_WITH_CUBLASLT
#include <cublasLt.h>
#include <dlfcn.h>
#endif

namespace {

using dflash2::DType;
using dflash2::Device;
using dflash2::Json;
using dflash2::Tensor;
namespace ops = dflash2::ops;

// ---------------------------------------------------------------- GLM-5.3 (config.json of
// the released checkpoint; the repo's bundled model is a tiny test config, so the values
// are written here)
struct Glm {
  int64_t hidden = 6144, q_lora = 2048, kv_lora = 512, rope = 64, nope = 192, v = 256;
  int64_t idx_heads = 32, idx_dim = 128, idx_topk = 2048;
  int64_t experts = 256, top_k = 8, moe_inter = 2048, vocab = 154880;
  int64_t qk() const { return nope + rope; }
  int64_t latent() const { return kv_lora + rope; }
};
const Glm G;
constexpr int64_t kBlockSize = 16;  // the engine's default kv_block_size

struct Options {
  bool quick = false;
  std::string json_path;
  std::string filter;
  int trials = 0;  // 0: 20 (10 with --quick)
  bool cpu_smoke = false;
};

Json jstr(const std::string& s) { return Json::make_string(s); }
[[maybe_unused]] Json jnum(double v) { return Json::make_number(v); }
[[maybe_unused]] Json jint(int64_t v) { return Json::make_int(v); }
Json jbool(bool v) { return Json::make_bool(v); }

bool write_json(const std::string& path, const Json& j) {
  if (path.empty()) return true;
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "bench_ops: cannot write %s\n", path.c_str());
    return false;
  }
  const std::string text = j.dump();
  std::fwrite(text.data(), 1, text.size(), f);
  std::fputc('\n', f);
  std::fclose(f);
  std::printf("wrote %s\n", path.c_str());
  return true;
}

// "T=8 (decode b8, verify b1)"-style label of a token count.
[[maybe_unused]] std::string t_label(int64_t T) {
  switch (T) {
    case 1: return "decode b1";
    case 8: return "decode b8 = verify b1";
    case 32: return "decode b32";
    case 64: return "verify b8";
    case 256: return "verify b32";
    default: return "T=" + std::to_string(T);
  }
}

#ifdef DFLASH2_WITH_CUDA
// ---------------------------------------------------------------- CUDA helpers
void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
#define CK(x) ck((x), #x)

// The device of the operands: cuda:0, or the CPU with --cpu-smoke (a check of every case's
// setup and op arguments through the CPU backend, no timing worth reading).
Device g_dev = Device::cuda(0);
bool on_gpu() { return g_dev.is_cuda(); }

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
float uniform(uint64_t& s) { return float(splitmix(s) >> 40) * (1.0f / 16777216.0f); }  // [0, 1)

enum class Fill { Values, Scales };  // values ~[-1, 1]; scales positive around 1

// Fills a contiguous CUDA tensor with pseudo-random data: a host pattern of up to 4 MiB,
// copied once and then doubled device-to-device (a big weight repeats its pattern, which
// no kernel here can tell). FP8 bytes are finite (exponent field <= 7 / 8, never NaN).
void fill(Tensor& t, Fill kind, uint64_t seed) {
  const size_t n = t.nbytes();
  if (n == 0) return;
  const size_t pat = std::min<size_t>(n, size_t(4) << 20);
  std::vector<uint8_t> host(pat);
  uint64_t s = seed * 0x2545F4914F6CDD1Dull + 12345;
  switch (t.dtype()) {
    case DType::F32: {
      for (size_t i = 0; i + 4 <= pat; i += 4) {
        const float v = kind == Fill::Scales ? 0.5f + uniform(s) : 2.0f * uniform(s) - 1.0f;
        std::memcpy(&host[i], &v, 4);
      }
      break;
    }
    case DType::BF16:
    case DType::F16: {
      for (size_t i = 0; i + 2 <= pat; i += 2) {
        const float v = kind == Fill::Scales ? 0.5f + uniform(s) : 2.0f * uniform(s) - 1.0f;
        uint16_t h;
        if (t.dtype() == DType::BF16) {
          uint32_t u;
          std::memcpy(&u, &v, 4);
          h = uint16_t(u >> 16);
        } else {  // |v| <= 1.5: a normal half from the float's bits
          uint32_t u;
          std::memcpy(&u, &v, 4);
          const uint32_t sign = (u >> 16) & 0x8000u;
          const int e = int((u >> 23) & 0xff) - 127 + 15;
          h = e <= 0 ? uint16_t(sign) : uint16_t(sign | (uint32_t(e) << 10) | ((u >> 13) & 0x3ffu));
        }
        std::memcpy(&host[i], &h, 2);
      }
      break;
    }
    case DType::F8_E4M3: {
      for (size_t i = 0; i < pat; ++i) {
        const uint64_t r = splitmix(s);
        if (kind == Fill::Scales)  // exponent 6..8: 0.5 .. 3.75, positive
          host[i] = uint8_t(((6 + r % 3) << 3) | ((r >> 8) & 7));
        else  // exponent 1..7: +-2^-6 .. 1.875
          host[i] = uint8_t(((r >> 16) & 0x80) | ((1 + r % 7) << 3) | ((r >> 8) & 7));
      }
      break;
    }
    default:
      for (size_t i = 0; i < pat; ++i) host[i] = uint8_t(splitmix(s));
  }
  auto* dst = static_cast<uint8_t*>(t.data());
  if (!on_gpu()) {
    for (size_t done = 0; done < n; done += pat) std::memcpy(dst + done, host.data(), std::min(pat, n - done));
    return;
  }
  CK(cudaMemcpy(dst, host.data(), pat, cudaMemcpyHostToDevice));
  for (size_t done = pat; done < n;) {
    const size_t c = std::min(done, n - done);
    CK(cudaMemcpy(dst + done, dst, c, cudaMemcpyDeviceToDevice));
    done += c;
  }
}

Tensor dev_empty(DType dt, const Tensor::Shape& shape) { return Tensor::empty(dt, shape, g_dev); }
Tensor dev_rand(DType dt, const Tensor::Shape& shape, uint64_t seed, Fill kind = Fill::Values) {
  Tensor t = dev_empty(dt, shape);
  fill(t, kind, seed);
  return t;
}
template <class T>
Tensor upload(const std::vector<T>& v, DType dt, const Tensor::Shape& shape) {
  Tensor h = Tensor::empty(dt, shape);
  if (!v.empty()) std::memcpy(h.data(), v.data(), v.size() * sizeof(T));
  return h.to(g_dev);
}
// An FP8 cache layer (kv_cache_dtype "fp8") of `rows` rows on the device: D random values
// quantized by ops::cache_write (valid codes and scales), then `tail` random BF16 values (the
// MLA latent's rope).
Tensor dev_fp8_cache(int64_t rows, int64_t D, int64_t tail, uint64_t seed) {
  const int64_t qb = ops::fp8_cache_row_bytes(D);
  const int64_t width = tail ? ops::fp8_latent_row_bytes(D, tail) : qb;
  Tensor c = Tensor::zeros(DType::U8, {rows, width}, g_dev);
  std::vector<int32_t> sl(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) sl[size_t(i)] = int32_t(i);
  Tensor slots = upload(sl, DType::I32, {rows});
  Tensor src = dev_rand(DType::F32, {rows, D + tail}, seed);
  Tensor q8 = c.slice(1, 0, qb);
  ops::cache_write(src.slice(1, 0, D), slots, q8);
  if (tail) {
    Tensor pe = Tensor::view(c.data_as<uint8_t>() + qb, DType::BF16, {rows, tail}, {width / 2, 1}, g_dev, c.owner());
    ops::cache_write(src.slice(1, D, D + tail), slots, pe);
  }
  return c;
}
[[maybe_unused]] Tensor dev_fill_f32(float value, const Tensor::Shape& shape) {
  Tensor h = Tensor::empty(DType::F32, shape);
  std::fill(h.data_as<float>(), h.data_as<float>() + h.numel(), value);
  return h.to(g_dev);
}

// ---------------------------------------------------------------- device facts
struct DeviceInfo {
  std::string name;
  int major = 0, minor = 0, sms = 0;
  int64_t l2 = 0, mem = 0;
};
DeviceInfo device_info() {
  DeviceInfo d;
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  d.name = p.name;
  d.major = p.major;
  d.minor = p.minor;
  d.sms = p.multiProcessorCount;
  d.l2 = p.l2CacheSize;
  d.mem = int64_t(p.totalGlobalMem);
  return d;
}
int64_t g_rotate_bytes = int64_t(200) << 20;  // 4 x L2, set in main

// Copies of an operand of `bytes` so that cycling through them streams from HBM.
int rotations(int64_t bytes) {
  if (bytes <= 0) return 1;
  return int(std::clamp<int64_t>((g_rotate_bytes + bytes - 1) / bytes, 1, 32));
}

// ---------------------------------------------------------------- timing
struct Timing {
  double median_us = 0, min_us = 0;
  int inner = 1, trials = 0;
};

class Events {
 public:
  Events() {
    CK(cudaEventCreate(&a_));
    CK(cudaEventCreate(&b_));
  }
  ~Events() {
    cudaEventDestroy(a_);
    cudaEventDestroy(b_);
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  // Milliseconds of fn() on the legacy default stream (the ops' stream in this thread).
  float time(const std::function<void()>& fn) {
    CK(cudaEventRecord(a_, nullptr));
    fn();
    CK(cudaEventRecord(b_, nullptr));
    CK(cudaEventSynchronize(b_));
    CK(cudaGetLastError());
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a_, b_));
    return ms;
  }

 private:
  cudaEvent_t a_ = nullptr, b_ = nullptr;
};

// run(i) runs the op once on operand copy i % variants.
Timing time_op(const std::function<void(int)>& run, int variants, int trials) {
  if (!on_gpu()) {  // --cpu-smoke: one call
    const auto t0 = std::chrono::steady_clock::now();
    run(0);
    Timing t;
    t.median_us = t.min_us = std::max(1e-3, std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    t.trials = 1;
    return t;
  }
  Events ev;
  int k = 0;
  auto next = [&] { run(k++ % variants); };
  // warm-up: every copy once (first-call allocations, caches, clocks), at least 3 calls
  ev.time([&] {
    for (int i = 0; i < std::max(variants, 3); ++i) next();
  });
  const float one = ev.time(next) * 1000.0f;
  const float three = ev.time([&] {
    for (int i = 0; i < 3; ++i) next();
  }) * 1000.0f / 3.0f;
  const double per = std::max(0.5, double(std::min(one, three)));
  Timing t;
  t.inner = int(std::clamp(200.0 / per, 1.0, 2000.0));
  t.trials = trials;
  std::vector<double> us;
  for (int r = 0; r < trials; ++r)
    us.push_back(ev.time([&] {
      for (int i = 0; i < t.inner; ++i) next();
    }) * 1000.0 / t.inner);
  std::sort(us.begin(), us.end());
  t.median_us = us[us.size() / 2];
  t.min_us = us.front();
  return t;
}

double copy_bandwidth_GBps(int trials) {
  if (!on_gpu()) {  // --cpu-smoke: a host memcpy of 256 MiB
    std::vector<uint8_t> a(size_t(256) << 20, 1), b(a.size());
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(b.data(), a.data(), a.size());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return 2.0 * double(a.size()) / s / 1e9 + double(b[12345] - 1);
  }
  const size_t bytes = size_t(1) << 30;
  void *a = nullptr, *b = nullptr;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  CK(cudaMemset(a, 1, bytes));
  Events ev;
  ev.time([&] { CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, nullptr)); });
  std::vector<double> ms;
  for (int r = 0; r < trials; ++r)
    ms.push_back(ev.time([&] { CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, nullptr)); }));
  std::sort(ms.begin(), ms.end());
  cudaFree(a);
  cudaFree(b);
  return 2.0 * double(bytes) / (ms[ms.size() / 2] * 1e-3) / 1e9;
}

// ---------------------------------------------------------------- cuBLASLt (dlopen'ed)
#ifdef DFLASH2_WITH_CUBLASLT
struct LtApi {
  bool ok = false;
  std::string why, path;
  size_t version = 0;
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = size_t(64) << 20;
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtGetVersion) get_version = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatrixLayoutSetAttribute) layout_set = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
};

LtApi& lt() {
  static LtApi api = [] {
    LtApi a;
    std::vector<std::string> tries;
    if (const char* e = std::getenv("DFLASH2_CUBLASLT_LIBRARY"); e && *e) tries.push_back(e);
    if (std::strlen(DFLASH2_CUBLASLT_LIBRARY_PATH) > 0) tries.push_back(DFLASH2_CUBLASLT_LIBRARY_PATH);
    tries.push_back("libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR));
    void* so = nullptr;
    std::string errors;
    for (const auto& p : tries) {
      so = dlopen(p.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (so) {
        a.path = p;
        break;
      }
      const char* e = dlerror();
      errors += (errors.empty() ? "" : "; ") + std::string(e ? e : p.c_str());
    }
    if (!so) {
      a.why = "dlopen failed (" + errors + "); set DFLASH2_CUBLASLT_LIBRARY to libcublasLt.so." +
              std::to_string(CUBLAS_VER_MAJOR);
      return a;
    }
    bool all = true;
    auto sym = [&](auto& fp, const char* name) {
      fp = reinterpret_cast<std::remove_reference_t<decltype(fp)>>(dlsym(so, name));
      if (!fp) {
        all = false;
        a.why += std::string(a.why.empty() ? "" : ", ") + name;
      }
    };
    sym(a.create, "cublasLtCreate");
    sym(a.get_version, "cublasLtGetVersion");
    sym(a.matmul, "cublasLtMatmul");
    sym(a.desc_create, "cublasLtMatmulDescCreate");
    sym(a.desc_destroy, "cublasLtMatmulDescDestroy");
    sym(a.desc_set, "cublasLtMatmulDescSetAttribute");
    sym(a.layout_create, "cublasLtMatrixLayoutCreate");
    sym(a.layout_destroy, "cublasLtMatrixLayoutDestroy");
    sym(a.layout_set, "cublasLtMatrixLayoutSetAttribute");
    sym(a.pref_create, "cublasLtMatmulPreferenceCreate");
    sym(a.pref_destroy, "cublasLtMatmulPreferenceDestroy");
    sym(a.pref_set, "cublasLtMatmulPreferenceSetAttribute");
    sym(a.heuristic, "cublasLtMatmulAlgoGetHeuristic");
    if (!all) {
      a.why = a.path + " lacks " + a.why;
      return a;
    }
    a.version = a.get_version();
    if (a.create(&a.handle) != CUBLAS_STATUS_SUCCESS) {
      a.why = "cublasLtCreate failed";
      return a;
    }
    if (cudaMalloc(&a.workspace, a.workspace_bytes) != cudaSuccess) {
      a.why = "cannot allocate the cuBLASLt workspace";
      return a;
    }
    a.ok = true;
    return a;
  }();
  return api;
}

enum class LtKind { BF16, F32, FP8Block, FP8Tensor, FP4 };
const char* lt_kind_name(LtKind k) {
  switch (k) {
    case LtKind::BF16: return "bf16 x bf16 -> f32 (fp32 accumulate)";
    case LtKind::F32: return "f32 x f32 -> f32";
    case LtKind::FP8Block: return "e4m3 x e4m3, 128x128 weight / 1x128 activation block scales";
    case LtKind::FP8Tensor: return "e4m3 x e4m3, per-tensor scales (block scaling not offered here)";
    case LtKind::FP4: return "e2m1 x e2m1, 16-element ue4m3 scales";
  }
  return "?";
}

// D[N, M] (column-major, = y[M, N] row-major) = op(A) B with A the weight W[N, K] (row-major:
// column-major K x N, transposed) and B = x[M, K] (column-major K x M): the "TN" layout.
// batch > 1: strided batches (linear_heads). Holds its descriptors and the chosen algorithm.
class LtGemm {
 public:
  LtGemm() = default;
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;
  ~LtGemm() { release(); }

  struct Shape {
    int64_t N, K, M;
    int64_t lda, ldb, ldd;           // elements
    int64_t batch = 1, sa = 0, sb = 0, sd = 0;
  };
  // a_scale / b_scale: device pointers for the FP8 / FP4 kinds (kept in the descriptor).
  bool init(LtKind kind, const Shape& s, const void* a_scale, const void* b_scale, std::string* why) {
    LtApi& api = lt();
    kind_ = kind;
    cudaDataType_t ab = CUDA_R_16BF, dt = CUDA_R_32F;
    cublasComputeType_t ct = CUBLAS_COMPUTE_32F;
    switch (kind) {
      case LtKind::BF16: ab = CUDA_R_16BF; break;
      case LtKind::F32: ab = CUDA_R_32F; break;
      case LtKind::FP8Block:
      case LtKind::FP8Tensor: ab = CUDA_R_8F_E4M3; break;
      case LtKind::FP4: ab = CUDA_R_4F_E2M1; break;
    }
    // F32 output first (as our op writes); the low-precision kinds may only offer BF16.
    for (cudaDataType_t out : {CUDA_R_32F, CUDA_R_16BF}) {
      release();
      dt = out;
      if (api.desc_create(&desc_, ct, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) return fail("MatmulDescCreate", why);
      const cublasOperation_t tA = CUBLAS_OP_T, tB = CUBLAS_OP_N;
      api.desc_set(desc_, CUBLASLT_MATMUL_DESC_TRANSA, &tA, sizeof(tA));
      api.desc_set(desc_, CUBLASLT_MATMUL_DESC_TRANSB, &tB, sizeof(tB));
      if (kind == LtKind::FP8Block || kind == LtKind::FP8Tensor || kind == LtKind::FP4) {
        int32_t ma = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F, mb = ma;
        if (kind == LtKind::FP8Block) {
          ma = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
          mb = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
        } else if (kind == LtKind::FP4) {
          ma = mb = CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3;
        }
        if (api.desc_set(desc_, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ma, sizeof(ma)) != CUBLAS_STATUS_SUCCESS ||
            api.desc_set(desc_, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mb, sizeof(mb)) != CUBLAS_STATUS_SUCCESS)
          return fail("scale mode not accepted", why);
        api.desc_set(desc_, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof(a_scale));
        api.desc_set(desc_, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof(b_scale));
      }
      if (api.layout_create(&a_, ab, uint64_t(s.K), uint64_t(s.N), s.lda) != CUBLAS_STATUS_SUCCESS ||
          api.layout_create(&b_, ab, uint64_t(s.K), uint64_t(s.M), s.ldb) != CUBLAS_STATUS_SUCCESS ||
          api.layout_create(&d_, dt, uint64_t(s.N), uint64_t(s.M), s.ldd) != CUBLAS_STATUS_SUCCESS)
        return fail("MatrixLayoutCreate", why);
      if (s.batch > 1) {
        const int32_t bc = int32_t(s.batch);
        const std::pair<cublasLtMatrixLayout_t, int64_t> ls[] = {{a_, s.sa}, {b_, s.sb}, {d_, s.sd}};
        for (const auto& [l, stride] : ls) {
          api.layout_set(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof(bc));
          api.layout_set(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride));
        }
      }
      cublasLtMatmulPreference_t pref = nullptr;
      if (api.pref_create(&pref) != CUBLAS_STATUS_SUCCESS) return fail("MatmulPreferenceCreate", why);
      const uint64_t ws = api.workspace_bytes;
      api.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
      cublasLtMatmulHeuristicResult_t res[1];
      int n = 0;
      const cublasStatus_t st = api.heuristic(api.handle, desc_, a_, b_, d_, d_, pref, 1, res, &n);
      api.pref_destroy(pref);
      if (st == CUBLAS_STATUS_SUCCESS && n > 0) {
        algo_ = res[0].algo;
        out_ = dt;
        return true;
      }
      if (why) *why = "no cuBLASLt algorithm for " + std::string(lt_kind_name(kind)) + " (status " +
                      std::to_string(int(st)) + ")";
    }
    release();
    return false;
  }
  size_t out_bytes() const { return out_ == CUDA_R_32F ? 4 : 2; }
  bool bf16_out() const { return out_ == CUDA_R_16BF; }
  void run(const void* A, const void* B, void* D) {
    LtApi& api = lt();
    const float alpha = 1.0f, beta = 0.0f;
    const cublasStatus_t st = api.matmul(api.handle, desc_, &alpha, A, a_, B, b_, &beta, D, d_, D, d_, &algo_,
                                         api.workspace, api.workspace_bytes, nullptr);
    if (st != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cublasLtMatmul failed: status " + std::to_string(int(st)));
  }

 private:
  bool fail(const char* what, std::string* why) {
    if (why) *why = std::string("cuBLASLt: ") + what;
    release();
    return false;
  }
  void release() {
    LtApi& api = lt();
    if (desc_) api.desc_destroy(desc_);
    for (auto* l : {&a_, &b_, &d_})
      if (*l) api.layout_destroy(*l), *l = nullptr;
    desc_ = nullptr;
  }
  LtKind kind_ = LtKind::BF16;
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr, b_ = nullptr, d_ = nullptr;
  cublasLtMatmulAlgo_t algo_{};
  cudaDataType_t out_ = CUDA_R_32F;
};
#endif  // DFLASH2_WITH_CUBLASLT

bool g_lt_ok = false;
std::string g_lt_why;

// ---------------------------------------------------------------- cases
struct Baseline {
  std::function<void(int)> run;  // empty: none
  int variants = 1;
  std::string kind, note;
  std::string name = "cublasLt";  // another name: our own slower path (JSON baseline_*, not the cuBLASLt goal)
};

struct Result {
  std::string op, shape, format, label;
  int64_t T = 0;
  double bytes = 0, flops = 0;
};

struct Bench {
  Options opt;
  double copy_GBps = 0;
  Json::Array cases;
  int failures = 0;
  bool fatal = false;  // a sticky CUDA error: the rest cannot run

  int trials() const { return opt.trials > 0 ? opt.trials : (opt.quick ? 10 : 20); }
  bool want(const std::string& name) const {
    return opt.filter.empty() || name.find(opt.filter) != std::string::npos;
  }
  static std::string name_of(const Result& r) {
    return r.op + " " + r.shape + " " + r.format + " T=" + std::to_string(r.T) + " " + r.label;
  }

  // Runs a case: build() allocates and returns the op (and sets the baseline); the operands
  // live in the closures and are freed when this returns.
  void run(Result r, const std::function<std::pair<std::function<void(int)>, int>(Baseline&)>& build) {
    if (fatal || !want(name_of(r))) return;
    Json::Object j{{"op", jstr(r.op)},   {"shape", jstr(r.shape)}, {"format", jstr(r.format)},
                   {"T", jint(r.T)},     {"label", jstr(r.label)}, {"bytes", jnum(r.bytes)},
                   {"flops", jnum(r.flops)}};
    std::printf("%-13s %-40s %-8s T=%-4lld %-22s", r.op.c_str(), r.shape.c_str(), r.format.c_str(),
                static_cast<long long>(r.T), r.label.c_str());
    std::fflush(stdout);
    try {
      Baseline base;
      double base_us = -1;
      std::string base_err;
      Timing t;
      {
        auto [fn, variants] = build(base);
        t = time_op(fn, variants, trials());
      }
      if (base.run) {
        try {
          base_us = time_op(base.run, base.variants, trials()).median_us;
        } catch (const std::exception& e) {
          base_err = e.what();
          if (on_gpu() && (cudaGetLastError() != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess)) fatal = true;
        }
      }
      const double s = t.median_us * 1e-6;
      const double gbps = r.bytes / s / 1e9, tflops = r.flops / s / 1e12, frac = gbps / copy_GBps;
      std::printf(" %10.2f us %8.1f GB/s %7.2f TF/s %5.1f%% copy", t.median_us, gbps, tflops, 100.0 * frac);
      j.emplace_back("time_us", jnum(t.median_us));
      j.emplace_back("min_us", jnum(t.min_us));
      j.emplace_back("calls_per_event_pair", jint(t.inner));
      j.emplace_back("trials", jint(t.trials));
      j.emplace_back("GBps", jnum(gbps));
      j.emplace_back("TFLOPs", jnum(tflops));
      j.emplace_back("copy_fraction", jnum(frac));
      j.emplace_back("latency_bound", jbool(r.bytes < double(8 << 20)));
      if (base.name != "cublasLt" && base.run && base_us > 0) {
        std::printf(" | %s %10.2f us speedup %.2f", base.name.c_str(), base_us, base_us / t.median_us);
        j.emplace_back("baseline", jstr(base.name));
        j.emplace_back("baseline_kind", jstr(base.kind));
        j.emplace_back("baseline_us", jnum(base_us));
        j.emplace_back("speedup_vs_baseline", jnum(base_us / t.median_us));
      } else if (base.run || !base.note.empty()) {
        j.emplace_back("cublaslt_kind", jstr(base.kind));
        if (base_us > 0) {
          std::printf(" | cublasLt %10.2f us ratio %.2f", base_us, base_us / t.median_us);
          j.emplace_back("cublaslt_us", jnum(base_us));
          j.emplace_back("ratio_vs_cublaslt", jnum(base_us / t.median_us));
        } else {
          const std::string why = !base_err.empty() ? base_err : base.note;
          std::printf(" | cublasLt: %s", why.c_str());
          j.emplace_back("cublaslt_error", jstr(why));
        }
        if (!base.note.empty() && base_us > 0) j.emplace_back("cublaslt_note", jstr(base.note));
      }
      std::printf("\n");
      j.emplace_back("ok", jbool(true));
    } catch (const std::exception& e) {
      std::printf(" FAILED: %s\n", e.what());
      j.emplace_back("ok", jbool(false));
      j.emplace_back("error", jstr(e.what()));
      ++failures;
      if (on_gpu() && (cudaGetLastError() != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess)) {
        fatal = true;
        std::printf("bench_ops: the CUDA context is unusable after this error; the remaining cases are skipped\n");
      }
    }
    std::fflush(stdout);
    cases.push_back(Json::make_object(std::move(j)));
  }
};

std::string dims(std::initializer_list<int64_t> d) {
  std::string s;
  for (int64_t v : d) s += (s.empty() ? "" : "x") + std::to_string(v);
  return s;
}

// ---------------------------------------------------------------- weights
enum class Fmt { BF16, FP8, NVFP4, F32 };
const char* fmt_name(Fmt f) {
  switch (f) {
    case Fmt::BF16: return "bf16";
    case Fmt::FP8: return "fp8b128";
    case Fmt::NVFP4: return "nvfp4";
    case Fmt::F32: return "f32";
  }
  return "?";
}
int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
[[maybe_unused]] int64_t round_up(int64_t a, int64_t b) { return cdiv(a, b) * b; }

double weight_bytes(Fmt f, int64_t N, int64_t K) {
  switch (f) {
    case Fmt::BF16: return 2.0 * N * K;
    case Fmt::F32: return 4.0 * N * K;
    case Fmt::FP8: return double(N) * K + 4.0 * cdiv(N, 128) * cdiv(K, 128);
    case Fmt::NVFP4: return double(N) * K / 2 + double(N) * K / 16;
  }
  return 0;
}

ops::Weight make_weight(Fmt f, int64_t N, int64_t K, uint64_t seed, const std::string& name) {
  switch (f) {
    case Fmt::BF16: return ops::Weight::dense(dev_rand(DType::BF16, {N, K}, seed), name);
    case Fmt::F32: return ops::Weight::dense(dev_rand(DType::F32, {N, K}, seed), name);
    case Fmt::FP8:
      return ops::Weight::fp8_block128(dev_rand(DType::F8_E4M3, {N, K}, seed),
                                       dev_rand(DType::F32, {cdiv(N, 128), cdiv(K, 128)}, seed + 1, Fill::Scales),
                                       name);
    case Fmt::NVFP4: {
      ops::Weight w = ops::Weight::nvfp4(dev_rand(DType::U8, {N, K / 2}, seed),
                                         dev_rand(DType::F8_E4M3, {N, K / 16}, seed + 1, Fill::Scales),
                                         1.0f / 2688.0f, 1.0f, K, name);
      ops::prepare_nvfp4_scales(w);  // as the engine at load (where the W4A4 GEMM runs)
      return w;
    }
  }
  throw std::runtime_error("bad format");
}

// The cuBLASLt baseline of y[M, N] = x[M, K] W^T (batch > 1: per head, strided).
void lt_baseline(Baseline& base, Fmt f, int64_t N, int64_t K, int64_t M, int variants, int64_t batch = 1,
                 const std::vector<int64_t>& x_strides = {}, int major = 9) {
  if (!g_lt_ok) {
    base.note = g_lt_why;
    return;
  }
#ifdef DFLASH2_WITH_CUBLASLT
  if (f == Fmt::NVFP4 && major < 10) {
    base.kind = "e2m1";
    base.note = "not on sm_" + std::to_string(major) + "x: FP4 MMA needs sm_100+";
    return;
  }
  // operands in cuBLASLt's types; B (= x) uses x's strides when given (linear_heads)
  DType ab = f == Fmt::F32 ? DType::F32 : f == Fmt::BF16 ? DType::BF16 : f == Fmt::FP8 ? DType::F8_E4M3 : DType::U8;
  const int64_t kdiv = f == Fmt::NVFP4 ? 2 : 1;
  std::vector<Tensor> A;
  for (int v = 0; v < variants; ++v) A.push_back(dev_rand(ab, {batch, N, K / kdiv}, 1000 + v));
  const int64_t ldb = x_strides.empty() ? K : x_strides[0], sb = x_strides.empty() ? 0 : x_strides[1];
  const int64_t x_span = (M - 1) * ldb + (batch - 1) * sb + K;
  Tensor B = dev_rand(ab, {x_span / kdiv + 64}, 77);
  Tensor D = dev_empty(DType::F32, {batch, M, N});
  Tensor sa, sbs;
  std::vector<LtKind> kinds;
  if (f == Fmt::BF16) kinds = {LtKind::BF16};
  if (f == Fmt::F32) kinds = {LtKind::F32};
  if (f == Fmt::FP8) {
    kinds = {LtKind::FP8Block, LtKind::FP8Tensor};
    // generous: BLK128x128 of A, VEC128 of B (outer dim padded), or one float each
    sa = dev_fill_f32(1.0f, {cdiv(N, 128) * cdiv(K, 128) + 256});
    sbs = dev_fill_f32(1.0f, {cdiv(K, 128) * round_up(M, 128) + 256});
  }
  if (f == Fmt::NVFP4) {
    kinds = {LtKind::FP4};
    // 128x4 tiled ue4m3 scales: padded rows x padded K / 16
    sa = dev_rand(DType::F8_E4M3, {round_up(N, 128) * round_up(K / 16, 4)}, 5, Fill::Scales);
    sbs = dev_rand(DType::F8_E4M3, {round_up(M, 128) * round_up(K / 16, 4)}, 6, Fill::Scales);
  }
  auto g = std::make_shared<LtGemm>();
  std::string why;
  LtKind chosen = kinds[0];
  bool ok = false;
  for (LtKind k : kinds) {
    LtGemm::Shape s{N, K, M, K, ldb, N, batch, N * K, sb, M * N};
    if (batch > 1) s.ldd = batch * N, s.sd = N;  // y[t, g, :]
    if (g->init(k, s, sa.defined() ? sa.data() : nullptr, sbs.defined() ? sbs.data() : nullptr, &why)) {
      chosen = k;
      ok = true;
      break;
    }
  }
  base.kind = lt_kind_name(chosen);
  if (!ok) {
    base.note = why;
    return;
  }
  if (g->bf16_out()) base.kind += " (bf16 output: no f32-output algorithm)";
  base.variants = variants;
  base.run = [g, A, B, D, sa, sbs](int v) { g->run(A[size_t(v)].data(), B.data(), D.data()); };
#else
  (void)f, (void)N, (void)K, (void)M, (void)variants, (void)batch, (void)x_strides, (void)major;
#endif
}

// ---------------------------------------------------------------- the op families
struct Proj {
  std::string name;
  int64_t N, K;
  bool quick;
  bool nvfp4;  // the expert shapes: also NVFP4
  bool fp8 = true;
};

// A GEMM case's operands: `vars` copies of the weight in format f (rotated past L2), x [T, K]
// F32 and y [T, N]; and its compulsory bytes and flops.
struct GemmOperands {
  std::vector<ops::Weight> ws;
  Tensor x, y;
  int vars = 1;
};
GemmOperands gemm_operands(const Proj& p, Fmt f, int64_t T) {
  GemmOperands o;
  o.vars = rotations(int64_t(weight_bytes(f, p.N, p.K)));
  for (int v = 0; v < o.vars; ++v) o.ws.push_back(make_weight(f, p.N, p.K, 10 + v, p.name));
  o.x = dev_rand(DType::F32, {T, p.K}, 3);
  o.y = dev_empty(DType::F32, {T, p.N});
  return o;
}
void gemm_cost(Result& r, const Proj& p, Fmt f, int64_t T) {
  r.bytes = weight_bytes(f, p.N, p.K) + 4.0 * T * (p.N + p.K);
  r.flops = 2.0 * T * p.N * p.K;
}

// One GEMM case: y[T, N] = op(x[T, K] F32, W in format f), weights rotated past L2, beside
// cuBLASLt's GEMM in format base_fmt on the same shape.
using LinearFn = void (*)(const Tensor&, const ops::Weight&, Tensor&, bool);
void gemm_case(Bench& b, Result r, const Proj& p, Fmt f, Fmt base_fmt, int64_t T, int major, LinearFn op) {
  gemm_cost(r, p, f, T);
  b.run(r, [&](Baseline& base) {
    GemmOperands o = gemm_operands(p, f, T);
    lt_baseline(base, base_fmt, p.N, p.K, T, o.vars, 1, {}, major);
    return std::make_pair(std::function<void(int)>([o, op](int v) mutable { op(o.x, o.ws[size_t(v)], o.y, false); }),
                          o.vars);
  });
}

void bench_linear(Bench& b, const std::vector<int64_t>& Ts, int major) {
  std::vector<Proj> ps = {
      {"q_a_proj", G.q_lora, G.hidden, true, false},
      {"q_b_proj h64", 64 * G.qk(), G.q_lora, false, false},
      {"q_b_proj h16", 16 * G.qk(), G.q_lora, true, false},
      {"kv_a_proj", G.latent(), G.hidden, true, false},
      {"o_proj h64", G.hidden, 64 * G.v, false, false},
      {"o_proj h16", G.hidden, 16 * G.v, true, false},
      {"idx.wq_b", G.idx_heads * G.idx_dim, G.q_lora, true, false},
      {"idx.wk", G.idx_dim, G.hidden, false, false},
      {"idx.weights_proj", G.idx_heads, G.hidden, false, false},
      {"router", G.experts, G.hidden, true, false, false},
      {"expert gate|up (=shared)", G.moe_inter, G.hidden, true, true},
      {"expert down (=shared)", G.hidden, G.moe_inter, true, true},
      {"lm_head", G.vocab, G.hidden, false, false},
      {"lm_head tp4", G.vocab / 4, G.hidden, true, false},
  };
  for (const Proj& p : ps) {
    if (b.opt.quick && !p.quick) continue;
    std::vector<Fmt> fmts = {Fmt::BF16};
    if (p.fp8) fmts.push_back(Fmt::FP8);
    if (p.nvfp4) fmts.push_back(Fmt::NVFP4);
    if (p.name == "router" && !b.opt.quick) fmts.push_back(Fmt::F32);
    for (Fmt f : fmts)
      for (int64_t T : Ts)
        gemm_case(b, Result{"linear", p.name + " " + dims({p.N, p.K}), fmt_name(f), t_label(T), T}, p, f, f, T,
                  major, &ops::linear);
  }
}

void linear_bf16_prompt(const Tensor& x, const ops::Weight& w, Tensor& y, bool acc) {
  ops::linear_bf16(x, w, y, acc, /*decode=*/false);
}
void linear_bf16_decode(const Tensor& x, const ops::Weight& w, Tensor& y, bool acc) {
  ops::linear_bf16(x, w, y, acc, /*decode=*/true);
}

// Generated tokens on the tensor cores (decode_gemm="bf16": ops::linear_bf16(..., decode =
// true), the skinny split-K kernel of gemm_sk.cu) at the decode / verify sizes of
// bench_linear, every weight format read in place (BF16, FP8 as W8A16, NVFP4 as W4A16),
// against cuBLASLt's BF16 GEMM on the same shape (a BF16 weight: for FP8 / NVFP4 weights it
// reads 2x / 3.6x the bytes, so the fraction of copy bandwidth is the fairer figure there);
// the exact SIMT GEMV (bench_linear's "linear" rows) is the other baseline in the same run.
void bench_linear_sk(Bench& b, const std::vector<int64_t>& Ts, int major) {
  if (!ops::linear_bf16_available(on_gpu() ? Device::cuda(0) : Device::cpu())) {
    std::printf("linear_bf16 decode: no tensor-core GEMM for this device in this build (skipped)\n");
    return;
  }
  const std::vector<Proj> ps = {
      {"q_a_proj", G.q_lora, G.hidden, false, false},
      {"q_b_proj h16", 16 * G.qk(), G.q_lora, false, false},
      {"kv_a_proj", G.latent(), G.hidden, true, false},
      {"o_proj h16", G.hidden, 16 * G.v, false, false},
      {"idx.wk", G.idx_dim, G.hidden, false, false},
      {"shared gate|up", G.moe_inter, G.hidden, true, false},
      {"shared down", G.hidden, G.moe_inter, false, false},
      {"lm_head tp4", G.vocab / 4, G.hidden, false, false},
  };
  for (const Proj& p : ps) {
    if (b.opt.quick && !p.quick) continue;
    for (Fmt f : {Fmt::BF16, Fmt::FP8, Fmt::NVFP4})
      for (int64_t T : Ts)
        gemm_case(b, Result{"linear_bf16_decode", p.name + " " + dims({p.N, p.K}), fmt_name(f), t_label(T), T}, p,
                  f, Fmt::BF16, T, major, &linear_bf16_decode);
  }
}

// One GEMM case run two ways on the same operands: op with a process-wide switch (get / set)
// on (ours) and off (the baseline `base_name`, what `base_kind` says), the switch as it was
// after each call: the two forms of one kernel family (ops::set_dq_wgmma, ops::set_exact_tc).
void switch_forms_case(Bench& b, Result r, const Proj& p, Fmt f, int64_t T, bool (*get)(), void (*set)(bool),
                       LinearFn op, const char* base_name, const char* base_kind) {
  gemm_cost(r, p, f, T);
  b.run(r, [&](Baseline& base) {
    GemmOperands o = gemm_operands(p, f, T);
    auto form = [o, get, set, op](bool on) {
      return [o, get, set, op, on](int v) mutable {
        const bool was = get();
        set(on);
        op(o.x, o.ws[size_t(v)], o.y, false);
        set(was);
      };
    };
    base.run = form(false);
    base.variants = o.vars;
    base.name = base_name;
    base.kind = base_kind;
    return std::make_pair(std::function<void(int)>(form(true)), o.vars);
  });
}

// linear's exact form on the tensor cores (ops::set_exact_tc(true): x as three BF16 planes,
// gemm_sk.h) beside the exact SIMT kernel on the same operands (the switch around each call):
// both give linear's numerics, so "speedup" says which should be the default. T = 8 (verify
// at batch 1) in every mode: the size where the SIMT kernel's FMAs start to bound it.
void bench_linear_exact_tc(Bench& b, const std::vector<int64_t>& Ts) {
  const std::vector<Proj> ps = {
      {"q_a_proj", G.q_lora, G.hidden, true, false},
      {"kv_a_proj", G.latent(), G.hidden, false, false},
      {"o_proj h16", G.hidden, 16 * G.v, true, false},
      {"shared gate|up", G.moe_inter, G.hidden, true, true},
      {"lm_head tp4", G.vocab / 4, G.hidden, true, false},
  };
  for (const Proj& p : ps) {
    if (b.opt.quick && !p.quick) continue;
    std::vector<Fmt> fmts = {Fmt::BF16, Fmt::FP8};
    if (p.nvfp4) fmts.push_back(Fmt::NVFP4);
    for (Fmt f : fmts)
      for (int64_t T : Ts)
        switch_forms_case(b, Result{"linear_exact_tc", p.name + " " + dims({p.N, p.K}), fmt_name(f), t_label(T), T},
                          p, f, T, &ops::exact_tc, &ops::set_exact_tc, &ops::linear, "exact SIMT",
                          "linear's SIMT kernel (ops::set_exact_tc(false)), the same numerics");
  }
}

// Prompt chunks on the tensor cores (ops::linear_bf16: CUTLASS wgmma / tcgen05) at prefill
// sizes, against cuBLASLt's BF16 GEMM on the same shape. FP8 weights take the same path
// after a dequantize-to-BF16 pass (counted in our time), so their baseline is BF16 too.
// NVFP4 weights: on sm_90a the mainloop-dequantizing kernel (gemm_dq.cu, W4A16: the weight
// read once in its 4-bit format), elsewhere the dequantize pass; baseline BF16 as well.
void bench_linear_tc(Bench& b, const std::vector<int64_t>& Ts, int major) {
  if (!ops::linear_bf16_available(on_gpu() ? Device::cuda(0) : Device::cpu())) {
    std::printf("linear_bf16: no tensor-core GEMM for this device in this build (skipped)\n");
    return;
  }
  const bool fp8_ok = ops::linear_fp8_available(on_gpu() ? Device::cuda(0) : Device::cpu());
  const bool fp4_ok = ops::linear_nvfp4_available(on_gpu() ? Device::cuda(0) : Device::cpu());
  const std::vector<Proj> ps = {
      {"q_a_proj", G.q_lora, G.hidden, true, false},
      {"q_b_proj h16", 16 * G.qk(), G.q_lora, true, false},
      {"kv_a_proj", G.latent(), G.hidden, false, false},
      {"o_proj h16", G.hidden, 16 * G.v, true, false},
      {"idx.wq_b", G.idx_heads * G.idx_dim, G.q_lora, false, false},
      {"shared gate|up", G.moe_inter, G.hidden, true, false},
      {"shared down", G.hidden, G.moe_inter, false, false},
  };
  for (const Proj& p : ps) {
    if (b.opt.quick && !p.quick) continue;
    for (Fmt f : {Fmt::BF16, Fmt::FP8, Fmt::NVFP4})
      for (int64_t T : Ts)
        gemm_case(b, Result{"linear_bf16", p.name + " " + dims({p.N, p.K}), fmt_name(f), "prefill chunk", T}, p, f,
                  Fmt::BF16, T, major, &linear_bf16_prompt);
    // FP8 checkpoints' W8A8 GEMM (prefill_gemm="fp8"; sm_90a, sm_100a / sm_103a): the activation quantization
    // is in our time; the baseline is cuBLASLt's block-scaled FP8 GEMM on the same shape
    // (per-tensor scales where it offers no block scaling: said in cublaslt_kind).
    if (fp8_ok)
      for (int64_t T : Ts)
        gemm_case(b, Result{"linear_fp8", p.name + " " + dims({p.N, p.K}), fmt_name(Fmt::FP8), "prefill chunk", T},
                  p, Fmt::FP8, Fmt::FP8, T, major, &ops::linear_fp8);
    // NVFP4 checkpoints' W4A4 GEMM (prefill_gemm="nvfp4"; sm_100a / sm_103a) on the MLP
    // shapes NVFP4 checkpoints quantize: activation quantization and the weight-scale
    // swizzle in our time; the baseline is cuBLASLt's NVFP4 GEMM.
    if (fp4_ok && p.name.rfind("shared", 0) == 0)
      for (int64_t T : Ts)
        gemm_case(b, Result{"linear_nvfp4", p.name + " " + dims({p.N, p.K}), fmt_name(Fmt::NVFP4), "prefill chunk",
                            T},
                  p, Fmt::NVFP4, Fmt::NVFP4, T, major, &ops::linear_nvfp4);
  }
  // Hopper: the mainloop-dequantizing kernel's wgmma form (the default there) against its
  // mma.sync form on the same shapes in the same run (JSON baseline "dq mma.sync")
  // (--quick: the shared expert's gate | up only; --cpu-smoke: every case's setup)
  if ((major == 9 && on_gpu()) || b.opt.cpu_smoke)
    for (const Proj& p : ps) {
      if (b.opt.quick && p.name.rfind("shared gate", 0) != 0) continue;
      for (Fmt f : {Fmt::FP8, Fmt::NVFP4})
        for (int64_t T : Ts)
          // the mainloop-dequantizing GEMM (FP8 / NVFP4 weights' linear_bf16) in its wgmma form,
          // its mma.sync form on the same operands the baseline
          switch_forms_case(b, Result{"linear_bf16_dq", p.name + " " + dims({p.N, p.K}), fmt_name(f), "prefill chunk",
                                      T},
                            p, f, T, &ops::dq_wgmma, &ops::set_dq_wgmma, &linear_bf16_prompt, "dq mma.sync",
                            "the same kernel's mma.sync m16n8k16 form");
    }
  if (!fp8_ok) std::printf("linear_fp8: no FP8 block-128 tensor-core GEMM for this device in this build (skipped)\n");
  if (!fp4_ok) std::printf("linear_nvfp4: no NVFP4 W4A4 tensor-core GEMM for this device in this build (skipped)\n");
}

void bench_linear_heads(Bench& b, const std::vector<int64_t>& Ts, int major) {
  for (int64_t nh : {int64_t(64), int64_t(16)}) {
    if (b.opt.quick && nh == 64) continue;
    for (Fmt f : {Fmt::F32, Fmt::BF16}) {
      if (b.opt.quick && f == Fmt::BF16) continue;
      for (int which = 0; which < 2; ++which) {  // 0: W_UK^T (q_nope -> latent), 1: W_UV (latent -> v)
        const int64_t N = which == 0 ? G.kv_lora : G.v, K = which == 0 ? G.nope : G.kv_lora;
        for (int64_t T : Ts) {
          Result r{"linear_heads", std::string(which == 0 ? "W_UK^T" : "W_UV") + " h" + std::to_string(nh) + " " +
                                       dims({nh, N, K}),
                   fmt_name(f), t_label(T), T};
          const double wb = weight_bytes(f, nh * N, K);
          r.bytes = wb + 4.0 * T * nh * (N + K);
          r.flops = 2.0 * T * nh * N * K;
          b.run(r, [&](Baseline& base) {
            const int vars = rotations(int64_t(wb));
            const DType wd = f == Fmt::F32 ? DType::F32 : DType::BF16;
            std::vector<Tensor> ws;
            Tensor x, y;
            if (which == 0) {  // w [nh, kv_lora, nope]; x = the nope slice of q [T, nh, 256]
              for (int v = 0; v < vars; ++v) ws.push_back(dev_rand(wd, {nh, N, K}, 20 + v));
              x = dev_rand(DType::F32, {T, nh, G.qk()}, 4).slice(2, 0, G.nope);
            } else {  // w = the v rows of kv_b per head [nh, nope + v, kv_lora]
              for (int v = 0; v < vars; ++v)
                ws.push_back(dev_rand(wd, {nh, G.nope + G.v, K}, 20 + v).slice(1, G.nope, G.nope + G.v));
              x = dev_rand(DType::F32, {T, nh, K}, 4);
            }
            y = dev_empty(DType::F32, {T, nh, N});
            lt_baseline(base, f, N, K, T, vars, nh, {x.stride(0), x.stride(1)}, major);
            if (!base.run && base.note.empty()) base.note = "no baseline";
            return std::make_pair(std::function<void(int)>([ws, x, y](int v) mutable {
                                    ops::linear_heads(x, ws[size_t(v)], y);
                                  }),
                                  vars);
          });
        }
      }
    }
  }
}

// Sequences of a decode (tokens_per_seq 1) or verify (8) step: the token positions end at
// ctx - 1; the block tables map each sequence's blocks to a shuffled set of cache blocks.
struct Step {
  int64_t batch, tps, ctx;
  std::string label() const {
    return std::string(tps == 1 ? "decode" : "verify") + " b" + std::to_string(batch) + " ctx" + std::to_string(ctx);
  }
  int64_t T() const { return batch * tps; }
};

struct PagedHost {
  std::vector<int32_t> seq, pos, table;
  int64_t blocks_per_seq = 0, rows = 0;
};
PagedHost make_paged(const Step& s, uint64_t seed) {
  PagedHost h;
  h.blocks_per_seq = cdiv(s.ctx, kBlockSize);
  const int64_t nblocks = s.batch * h.blocks_per_seq;
  h.rows = nblocks * kBlockSize;
  std::vector<int32_t> perm(static_cast<size_t>(nblocks));
  for (int64_t i = 0; i < nblocks; ++i) perm[size_t(i)] = int32_t(i);
  uint64_t r = seed;
  for (int64_t i = nblocks - 1; i > 0; --i) std::swap(perm[size_t(i)], perm[size_t(splitmix(r) % uint64_t(i + 1))]);
  h.table = perm;
  for (int64_t q = 0; q < s.batch; ++q)
    for (int64_t i = 0; i < s.tps; ++i) {
      h.seq.push_back(int32_t(q));
      h.pos.push_back(int32_t(s.ctx - s.tps + i));
    }
  return h;
}
ops::PagedTokens upload_paged(const PagedHost& h, const Step& s) {
  ops::PagedTokens t;
  t.seq = upload(h.seq, DType::I32, {s.T()});
  t.pos = upload(h.pos, DType::I32, {s.T()});
  t.block_table = upload(h.table, DType::I32, {s.batch, h.blocks_per_seq});
  t.block_size = kBlockSize;
  return t;
}

std::vector<Step> steps_for(const Bench& b, const std::vector<int64_t>& ctxs) {
  std::vector<Step> out;
  for (int64_t ctx : ctxs)
    for (int64_t tps : {int64_t(1), int64_t(8)})
      for (int64_t batch : {int64_t(1), int64_t(8), int64_t(32)}) {
        if (b.opt.quick && !((tps == 1 && (batch == 1 || batch == 32)) || (tps == 8 && batch == 32))) continue;
        if (b.opt.cpu_smoke && batch != 1) continue;
        out.push_back({batch, tps, ctx});
      }
  return out;
}

// MLA over the latent cache in F32 (the default, the SIMT kernel), BF16 (Engine
// kv_cache_dtype="bf16": the tensor-core kernel, ops::mla_tc(), against the SIMT kernel over the
// same BF16 cache in the same run) and FP8 (kv_cache_dtype="fp8": 656-byte rows dequantized as
// the tensor-core kernel stages them, against that kernel over a BF16 cache of the same shape).
void bench_mla(Bench& b) {
  for (const DType cdt : {DType::F32, DType::BF16, DType::U8})
  for (int64_t nh : {int64_t(64), int64_t(16)}) {
    if (b.opt.quick && nh == 64) continue;
    for (bool sparse : {true, false}) {
      if (cdt != DType::F32 && !sparse && b.opt.quick) continue;
      // sparse: 2048 selected keys of a 4096-token context; dense: a 2048-token context
      for (const Step& s : steps_for(b, {sparse ? 2 * G.idx_topk : G.idx_topk})) {
        const int64_t T = s.T(), lat = G.latent();
        PagedHost ph = make_paged(s, 7);
        // selections: 2048 distinct keys <= pos, ascending
        std::vector<int32_t> sel, sel_len;
        double keys = 0, distinct = 0;
        if (sparse) {
          uint64_t rr = 99;
          std::vector<std::set<int32_t>> per_seq(size_t(s.batch));
          for (int64_t t = 0; t < T; ++t) {
            const int32_t p = ph.pos[size_t(t)];
            std::vector<int32_t> all(size_t(p) + 1);
            for (int32_t i = 0; i <= p; ++i) all[size_t(i)] = i;
            for (int64_t i = 0; i < G.idx_topk; ++i)
              std::swap(all[size_t(i)], all[size_t(i) + size_t(splitmix(rr) % uint64_t(p + 1 - i))]);
            std::sort(all.begin(), all.begin() + G.idx_topk);
            sel.insert(sel.end(), all.begin(), all.begin() + G.idx_topk);
            per_seq[size_t(ph.seq[size_t(t)])].insert(all.begin(), all.begin() + G.idx_topk);
            sel_len.push_back(int32_t(G.idx_topk));
            keys += double(G.idx_topk);
          }
          for (const auto& st : per_seq) distinct += double(st.size());
        } else {
          for (int64_t t = 0; t < T; ++t) keys += ph.pos[size_t(t)] + 1.0;
          distinct = double(s.batch) * s.ctx;
        }
        const bool bf = cdt == DType::BF16, f8 = cdt == DType::U8;
        const double row_bytes = f8 ? double(ops::fp8_latent_row_bytes(G.kv_lora, G.rope)) : lat * (bf ? 2.0 : 4.0);
        Result r{"mla_attention", "h" + std::to_string(nh) + (sparse ? " sel2048" : " dense") + " " + s.label(),
                 f8 ? "fp8 kv tc" : bf ? "bf16 kv tc" : "f32", s.label(), T};
        r.bytes = distinct * row_bytes + 4.0 * T * nh * (G.kv_lora + G.rope) + 4.0 * T * nh * G.kv_lora;
        r.flops = keys * nh * 2.0 * (lat + G.kv_lora);
        b.run(r, [&](Baseline& base) {
          const double cache_bytes = double(ph.rows) * row_bytes;
          const int vars = rotations(int64_t(cache_bytes));
          std::vector<Tensor> caches, bf16_caches;
          for (int v = 0; v < vars; ++v)
            caches.push_back(f8 ? dev_fp8_cache(ph.rows, G.kv_lora, G.rope, 30 + v) : dev_rand(cdt, {ph.rows, lat}, 30 + v));
          ops::PagedTokens tok = upload_paged(ph, s);
          Tensor q = dev_rand(DType::F32, {T, nh, G.qk()}, 5);
          Tensor q_pe = q.slice(2, G.nope, G.qk());
          Tensor q_lat = dev_rand(DType::F32, {T, nh, G.kv_lora}, 6), out = dev_empty(DType::F32, {T, nh, G.kv_lora});
          Tensor dsel, dlen;
          if (sparse) {
            dsel = upload(sel, DType::I32, {T, G.idx_topk});
            dlen = upload(sel_len, DType::I32, {T});
          }
          const float scale = 1.0f / std::sqrt(float(G.qk()));
          if (f8) {
            const int bvars = rotations(int64_t(double(ph.rows) * lat * 2));
            for (int v = 0; v < bvars; ++v) bf16_caches.push_back(dev_rand(DType::BF16, {ph.rows, lat}, 30 + v));
            base.name = "bf16_tc";
            base.kind = "mla_attention's tensor-core kernel over a BF16 cache (kv_cache_dtype bf16)";
            base.variants = bvars;
            base.run = [=](int v) mutable {
              ops::mla_attention(q_lat, q_pe, bf16_caches[size_t(v)], tok, dsel, dlen, scale, out);
            };
          }
          if (bf) {
            base.name = "simt_bf16";
            base.kind = "mla_attention's SIMT kernel over the same BF16 cache (ops::set_mla_tc(false))";
            base.variants = vars;
            base.run = [=](int v) mutable {
              const bool was = ops::mla_tc();
              ops::set_mla_tc(false);
              ops::mla_attention(q_lat, q_pe, caches[size_t(v)], tok, dsel, dlen, scale, out);
              ops::set_mla_tc(was);
            };
          }
          return std::make_pair(std::function<void(int)>([=](int v) mutable {
                                  ops::mla_attention(q_lat, q_pe, caches[size_t(v)], tok, dsel, dlen, scale, out);
                                }),
                                vars);
        });
      }
    }
  }
}

// The DFlash 2 drafter's block attention at GLM-5.3's drafter shapes (64 heads over 8 KV
// heads, head_dim 128, block 8, sliding window 2048, a 4096-token context): the tensor-core
// kernel (BlockAttention::tensor_cores, what draft_gemm="auto" runs on a GPU) against the
// exact fp32 SIMT kernel in the same run. Bytes: each sequence's window of context K / V
// (fp32) once, q and out; FLOPs: QK^T and PV over every row's keys.
void bench_block_attention(Bench& b) {
  const int64_t nh = 64, kvh = 8, hd = 128, B = 8, window = 2048, ctx = 4096;
  // the draft cache: F32 (draft_gemm "exact") or BF16 (a tensor-core draft_gemm, the GPU's default)
  for (const DType cdt : {DType::F32, DType::BF16})
  for (int64_t batch : {int64_t(1), int64_t(8), int64_t(32)}) {
    if (b.opt.quick && batch == 8) continue;
    if (b.opt.cpu_smoke && batch != 1) continue;
    const int64_t T = batch * B, per_seq = cdiv(ctx, kBlockSize), blocks = batch * per_seq;
    Result r{"block_attention", "h64 kv8 d128 B8 w2048 ctx4096", cdt == DType::BF16 ? "bf16tc kv16" : "bf16tc",
             "draft b" + std::to_string(batch), T};
    r.bytes = double(batch) * double(window + B) * kvh * hd * 2 * (cdt == DType::BF16 ? 2 : 4) + 2.0 * T * nh * hd * 4;
    r.flops = double(T) * nh * double(window + B) * 4.0 * hd;
    b.run(r, [&](Baseline& base) {
      std::vector<int32_t> table(static_cast<size_t>(blocks)), lens(static_cast<size_t>(batch), int32_t(ctx));
      for (int64_t i = 0; i < blocks; ++i) table[size_t(i)] = int32_t(i);
      uint64_t rr = 5;
      for (int64_t i = blocks - 1; i > 0; --i) std::swap(table[size_t(i)], table[size_t(splitmix(rr) % uint64_t(i + 1))]);
      Tensor cache = dev_rand(cdt, {blocks * kBlockSize, 2 * kvh * hd}, 41);
      Tensor bt = upload(table, DType::I32, {batch, per_seq}), cl = upload(lens, DType::I32, {batch});
      Tensor q = dev_rand(DType::F32, {T, nh, hd}, 42), k = dev_rand(DType::F32, {T, kvh, hd}, 43);
      Tensor v = dev_rand(DType::F32, {T, kvh, hd}, 44), out = dev_empty(DType::F32, {T, nh, hd});
      ops::BlockAttention p;
      p.block = B;
      p.window = window;
      p.scale = 1.0f / std::sqrt(float(hd));
      p.cache_block_size = kBlockSize;
      p.tensor_cores = true;
      ops::BlockAttention exact = p;
      exact.tensor_cores = false;
      base.name = "simt_exact";
      base.kind = "block_attention, tensor_cores=false (the exact fp32 SIMT kernel)";
      base.run = [=](int) mutable { ops::block_attention(q, k, v, cache, cl, bt, exact, out); };
      return std::make_pair(std::function<void(int)>([=](int) mutable {
                              ops::block_attention(q, k, v, cache, cl, bt, p, out);
                            }),
                            1);
    });
  }
}

// The DSA indexer over F32 index keys (the default) and BF16 ones (kv_cache_dtype="bf16"): on
// the SIMT kernel against the F32 keys, and on the tensor cores (ops::indexer_tc()) against
// the SIMT kernel over the same BF16 keys, each baseline in the same run; contexts of 4096 and
// 32768 keys (--quick: the BF16 rows at 4096 only), and 131072 for one sequence on the tensor
// cores; FP8 keys (kv_cache_dtype="fp8": 144-byte rows dequantized as the tensor-core kernel
// stages them) against the tensor cores over BF16 keys.
void bench_indexer(Bench& b) {
  enum Mode { kF32, kBf16Simt, kBf16Tc, kFp8Tc };
  for (const Mode mode : {kF32, kBf16Simt, kBf16Tc, kFp8Tc})
  for (const Step& s : steps_for(b, {4096, 32768, 131072})) {
    const bool f8 = mode == kFp8Tc, bf = mode != kF32 && !f8, tc = mode == kBf16Tc || f8;
    if (f8 && s.ctx == 131072) continue;
    // 128K keys (GLM-5.3's long contexts: the select's passes, the key tiles' L2 reuse): one
    // sequence, on the tensor cores against the SIMT kernel
    if (s.ctx == 131072 && (!tc || s.batch != 1)) continue;
    if ((bf || f8) && b.opt.quick && s.ctx == 32768) continue;
    const DType cdt = bf ? DType::BF16 : DType::F32;
    const int64_t T = s.T();
    PagedHost ph = make_paged(s, 8);
    double keys = 0;
    for (int64_t t = 0; t < T; ++t) keys += ph.pos[size_t(t)] + 1.0;
    Result r{"indexer_topk", "h32x128 top2048 " + s.label(), f8 ? "fp8 kv tc" : tc ? "bf16 kv tc" : bf ? "bf16 kv" : "f32",
             s.label(), T};
    const double row_bytes = f8 ? double(ops::fp8_cache_row_bytes(G.idx_dim)) : G.idx_dim * (bf ? 2.0 : 4.0);
    r.bytes = double(s.batch) * s.ctx * row_bytes + 4.0 * T * G.idx_heads * (G.idx_dim + 1) + 4.0 * T * G.idx_topk;
    r.flops = keys * G.idx_heads * 2.0 * G.idx_dim;
    b.run(r, [&](Baseline& base) {
      const double cache_bytes = double(ph.rows) * row_bytes;
      const int vars = rotations(int64_t(cache_bytes));
      std::vector<Tensor> caches, f32_caches, bf16_caches;
      for (int v = 0; v < vars; ++v)
        caches.push_back(f8 ? dev_fp8_cache(ph.rows, G.idx_dim, 0, 40 + v) : dev_rand(cdt, {ph.rows, G.idx_dim}, 40 + v));
      ops::PagedTokens tok = upload_paged(ph, s);
      Tensor q = dev_rand(DType::F32, {T, G.idx_heads, G.idx_dim}, 9), w = dev_rand(DType::F32, {T, G.idx_heads}, 10);
      Tensor sel = dev_empty(DType::I32, {T, G.idx_topk}), len = dev_empty(DType::I32, {T});
      const int64_t k = G.idx_topk;
      // the BF16 keys on the SIMT kernel (indexer_tc off for the call)
      const auto simt = [=](int v) mutable {
        const bool was = ops::indexer_tc();
        ops::set_indexer_tc(false);
        ops::indexer_topk(q, w, caches[size_t(v)], tok, k, sel, len);
        ops::set_indexer_tc(was);
      };
      if (mode == kBf16Simt) {
        const int fvars = rotations(int64_t(2 * cache_bytes));
        for (int v = 0; v < fvars; ++v) f32_caches.push_back(dev_rand(DType::F32, {ph.rows, G.idx_dim}, 40 + v));
        base.name = "f32_cache";
        base.kind = "indexer_topk over F32 index keys (kv_cache_dtype f32)";
        base.variants = fvars;
        base.run = [=](int v) mutable { ops::indexer_topk(q, w, f32_caches[size_t(v)], tok, k, sel, len); };
        return std::make_pair(std::function<void(int)>(simt), vars);
      }
      if (f8) {
        const int bvars = rotations(int64_t(double(ph.rows) * G.idx_dim * 2));
        for (int v = 0; v < bvars; ++v) bf16_caches.push_back(dev_rand(DType::BF16, {ph.rows, G.idx_dim}, 40 + v));
        base.name = "bf16_tc";
        base.kind = "indexer_topk on the tensor cores over BF16 index keys (kv_cache_dtype bf16)";
        base.variants = bvars;
        base.run = [=](int v) mutable {
          const bool was = ops::indexer_tc();
          ops::set_indexer_tc(true);
          ops::indexer_topk(q, w, bf16_caches[size_t(v)], tok, k, sel, len);
          ops::set_indexer_tc(was);
        };
      } else if (tc) {
        base.name = "simt_bf16";
        base.kind = "indexer_topk's SIMT score kernel over the same BF16 keys (ops::set_indexer_tc(false))";
        base.variants = vars;
        base.run = simt;
      }
      return std::make_pair(std::function<void(int)>([=](int v) mutable {
                              const bool was = ops::indexer_tc();
                              ops::set_indexer_tc(true);
                              ops::indexer_topk(q, w, caches[size_t(v)], tok, k, sel, len);
                              ops::set_indexer_tc(was);
                            }),
                            vars);
    });
  }
}

// Uniform random top-8 of 256 distinct experts per token, ascending (as moe_route emits).
std::vector<int32_t> random_routing(int64_t T, uint64_t seed) {
  std::vector<int32_t> ids;
  uint64_t r = seed;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> e(static_cast<size_t>(G.experts));
    for (int64_t i = 0; i < G.experts; ++i) e[size_t(i)] = int32_t(i);
    for (int64_t i = 0; i < G.top_k; ++i)
      std::swap(e[size_t(i)], e[size_t(i) + size_t(splitmix(r) % uint64_t(G.experts - i))]);
    std::sort(e.begin(), e.begin() + G.top_k);
    ids.insert(ids.end(), e.begin(), e.begin() + G.top_k);
  }
  return ids;
}

// The routed experts of one MoE layer for a routing (the experts it hits allocated, the
// others sharing one of them), its inputs and outputs.
struct MoeCase {
  ops::ExpertWeights ew;
  Tensor x, out, ids, w, ws;
  void run(ops::GemmNumerics g, bool decode = false) { ops::moe_experts(x, ids, w, ew, out, ws, g, decode); }
};

int64_t moe_hits(const std::vector<int32_t>& ids) {
  std::vector<int32_t> hit(ids.begin(), ids.end());
  std::sort(hit.begin(), hit.end());
  return int64_t(std::unique(hit.begin(), hit.end()) - hit.begin());
}

void moe_cost(Result& r, Fmt f, int64_t T, int64_t nhit) {
  const int64_t H = G.hidden, F = G.moe_inter;
  r.bytes = nhit * (2 * weight_bytes(f, F, H) + weight_bytes(f, H, F)) + 8.0 * T * H + 8.0 * T * G.top_k;
  r.flops = 2.0 * T * G.top_k * 3 * F * H;
}

MoeCase make_moe_case(Fmt f, int64_t T, const std::vector<int32_t>& ids) {
  std::vector<int32_t> hit(ids.begin(), ids.end());
  std::sort(hit.begin(), hit.end());
  hit.erase(std::unique(hit.begin(), hit.end()), hit.end());
  const int64_t H = G.hidden, F = G.moe_inter, nhit = int64_t(hit.size());
  // one buffer per projection for the hit experts; expert e is a view into it
  auto bank = [&](int64_t n_out, int64_t n_in, uint64_t seed) {
    std::vector<ops::Weight> w;
    if (f == Fmt::FP8) {
      Tensor d = dev_rand(DType::F8_E4M3, {nhit, n_out, n_in}, seed);
      Tensor s = dev_rand(DType::F32, {nhit, cdiv(n_out, 128), cdiv(n_in, 128)}, seed + 1, Fill::Scales);
      for (int64_t i = 0; i < nhit; ++i) w.push_back(ops::Weight::fp8_block128(d.select(0, i), s.select(0, i)));
    } else {
      Tensor d = dev_rand(DType::U8, {nhit, n_out, n_in / 2}, seed);
      Tensor s = dev_rand(DType::F8_E4M3, {nhit, n_out, n_in / 16}, seed + 1, Fill::Scales);
      for (int64_t i = 0; i < nhit; ++i) {
        w.push_back(ops::Weight::nvfp4(d.select(0, i), s.select(0, i), 1.0f / 2688.0f, 1.0f, n_in));
        ops::prepare_nvfp4_scales(w.back());  // as the engine at load (where the W4A4 GEMM runs)
      }
    }
    return w;
  };
  std::vector<ops::Weight> g = bank(F, H, 50), u = bank(F, H, 52), d = bank(H, F, 54);
  MoeCase c;
  c.ew.first = 0;
  c.ew.num_global = G.experts;
  std::map<int32_t, size_t> slot;
  for (size_t i = 0; i < hit.size(); ++i) slot[hit[i]] = i;
  for (int64_t e = 0; e < G.experts; ++e) {
    auto it = slot.find(int32_t(e));
    const size_t i = it == slot.end() ? 0 : it->second;  // never-named experts: any allocated one
    c.ew.gate.push_back(g[i]);
    c.ew.up.push_back(u[i]);
    c.ew.down.push_back(d[i]);
  }
  c.x = dev_rand(DType::F32, {T, H}, 13);
  c.out = dev_empty(DType::F32, {T, H});
  c.ids = upload(ids, DType::I32, {T, G.top_k});
  c.w = dev_rand(DType::F32, {T, G.top_k}, 14, Fill::Scales);
  c.ws = dev_empty(DType::F32, {ops::moe_workspace_floats(T, G.top_k, H, F, G.experts)});
  return c;
}

void bench_moe(Bench& b, const std::vector<int64_t>& Ts, int major) {
  for (int64_t T : Ts) {
    Result r0{"moe_route", dims({T, G.experts}) + " top8", "f32", t_label(T), T};
    r0.bytes = 4.0 * T * G.experts + 4.0 * G.experts + 8.0 * T * G.top_k;
    r0.flops = 0;
    b.run(r0, [&](Baseline&) {
      Tensor logits = dev_rand(DType::F32, {T, G.experts}, 11), bias = dev_rand(DType::F32, {G.experts}, 12);
      Tensor ids = dev_empty(DType::I32, {T, G.top_k}), w = dev_empty(DType::F32, {T, G.top_k});
      ops::MoeRouting mr;
      mr.top_k = G.top_k;
      mr.routed_scaling_factor = 2.5f;
      return std::make_pair(std::function<void(int)>([=](int) mutable { ops::moe_route(logits, bias, mr, ids, w); }), 1);
    });
  }
  for (Fmt f : {Fmt::FP8, Fmt::NVFP4}) {
    if (b.opt.quick && f == Fmt::NVFP4) continue;
    for (int64_t T : Ts) {
      const std::vector<int32_t> ids = random_routing(T, 1234 + uint64_t(T));
      const int64_t nhit = moe_hits(ids);
      Result r{"moe_experts", "256 experts top8 " + dims({G.moe_inter, G.hidden}) + " hit " + std::to_string(nhit),
               fmt_name(f), t_label(T), T};
      moe_cost(r, f, T, nhit);
      b.run(r, [&](Baseline& base) {
        base.note = "none (grouped GEMM)";
        base.kind = "n/a";
        auto c = std::make_shared<MoeCase>(make_moe_case(f, T, ids));
        return std::make_pair(std::function<void(int)>([c](int) { c->run(ops::GemmNumerics::Exact); }), 1);
      });
    }
  }
  // Prompt chunks on a grouped tensor-core GEMM of the experts, each beside the exact SIMT
  // kernels on the same routing in the same run (JSON baseline_* / speedup_vs_baseline):
  //   moe_experts_fp8    FP8 checkpoints (prefill_gemm="fp8"): the CUTLASS FP8 grouped GEMM
  //                      (sm_90a / sm_100a / sm_103a)
  //   moe_experts_bf16   NVFP4 experts with the BF16 numerics (prefill_gemm="bf16", what NVFP4
  //                      checkpoints take on Hopper): the grouped mainloop-dequantizing GEMM
  //                      (gemm_dq.cu, W4A16)
  //   moe_experts_nvfp4  NVFP4 experts W4A4 (prefill_gemm="nvfp4", sm_100a / sm_103a): the
  //                      block-scaled grouped GEMM, the activation quantization and the
  //                      weight-scale swizzle in our time
  const std::vector<int64_t> prefill = b.opt.cpu_smoke ? std::vector<int64_t>{8}
                                       : b.opt.quick   ? std::vector<int64_t>{256}
                                                       : std::vector<int64_t>{256, 1024};
  struct Grouped {
    const char* name;
    Fmt fmt;
    ops::GemmNumerics numerics;
    uint64_t seed;
    bool (*available)(Device, const ops::ExpertWeights&);
    const char* where;
  };
  const Grouped grouped[] = {
      {"moe_experts_fp8", Fmt::FP8, ops::GemmNumerics::FP8, 4321, &ops::moe_experts_fp8_available,
       "the FP8 grouped GEMM does not run here (sm_90a / sm_100a / sm_103a only)"},
      {"moe_experts_bf16", Fmt::NVFP4, ops::GemmNumerics::BF16, 5321, &ops::moe_experts_bf16_available,
       "the grouped BF16 GEMM does not run here"},
      {"moe_experts_nvfp4", Fmt::NVFP4, ops::GemmNumerics::NVFP4, 6321, &ops::moe_experts_nvfp4_available,
       "the NVFP4 grouped GEMM does not run here (sm_100a / sm_103a only)"},
  };
  for (const Grouped& gc : grouped) {
    if (gc.numerics == ops::GemmNumerics::NVFP4 && !b.opt.cpu_smoke &&
        !ops::linear_nvfp4_available(on_gpu() ? Device::cuda(0) : Device::cpu())) {
      std::printf("%s: no NVFP4 grouped GEMM for this device in this build (sm_100a / sm_103a; skipped)\n", gc.name);
      continue;
    }
    for (int64_t T : prefill) {
      const std::vector<int32_t> ids = random_routing(T, gc.seed + uint64_t(T));
      const int64_t nhit = moe_hits(ids);
      Result r{gc.name, "256 experts top8 " + dims({G.moe_inter, G.hidden}) + " hit " + std::to_string(nhit),
               fmt_name(gc.fmt), "prefill chunk", T};
      moe_cost(r, gc.fmt, T, nhit);
      b.run(r, [&](Baseline& base) {
        auto c = std::make_shared<MoeCase>(make_moe_case(gc.fmt, T, ids));
        if (!gc.available(c->x.device(), c->ew)) throw std::runtime_error(std::string(gc.name) + ": " + gc.where);
        base.name = "exact SIMT";
        base.kind = "moe_experts numerics exact (the SIMT expert kernels)";
        base.variants = 1;
        base.run = [c](int) { c->run(ops::GemmNumerics::Exact); };
        const ops::GemmNumerics g = gc.numerics;
        return std::make_pair(std::function<void(int)>([c, g](int) { c->run(g); }), 1);
      });
    }
  }
  // Hopper: the grouped mainloop-dequantizing GEMM of NVFP4 experts (moe_experts_bf16) in its
  // wgmma form against its mma.sync form on the same routing (ops::set_dq_wgmma around each call)
  if ((major == 9 && on_gpu()) || b.opt.cpu_smoke)
    for (int64_t T : prefill) {
      const std::vector<int32_t> ids = random_routing(T, 5321 + uint64_t(T));
      const int64_t nhit = moe_hits(ids);
      Result r{"moe_experts_bf16_dq", "256 experts top8 " + dims({G.moe_inter, G.hidden}) + " hit " + std::to_string(nhit),
               fmt_name(Fmt::NVFP4), "prefill chunk", T};
      moe_cost(r, Fmt::NVFP4, T, nhit);
      b.run(r, [&](Baseline& base) {
        auto c = std::make_shared<MoeCase>(make_moe_case(Fmt::NVFP4, T, ids));
        auto form = [c](bool wgmma) {
          return [c, wgmma](int) {
            const bool was = ops::dq_wgmma();
            ops::set_dq_wgmma(wgmma);
            c->run(ops::GemmNumerics::BF16);
            ops::set_dq_wgmma(was);
          };
        };
        base.name = "dq mma.sync";
        base.kind = "the same grouped kernel's mma.sync m16n8k16 form";
        base.variants = 1;
        base.run = form(false);
        return std::make_pair(std::function<void(int)>(form(true)), 1);
      });
    }
}

// The shared expert of decode chunks under decode_gemm="bf16" (ops::gated_mlp with BF16
// numerics and decode: on CUDA one unit, x rounded once, gate and up reduced straight into
// bf16(silu(gate) * up), down) beside the same three linear_bf16(decode) calls and silu_mul
// issued one by one (what it replaces; bitwise the same result) in the same run.
void bench_gated_decode(Bench& b, const std::vector<int64_t>& Ts) {
  const int64_t H = G.hidden, F = G.moe_inter;
  for (Fmt f : {Fmt::BF16, Fmt::NVFP4}) {
    if (b.opt.quick && f != Fmt::BF16) continue;
    const double wb = 2 * weight_bytes(f, F, H) + weight_bytes(f, H, F);
    for (int64_t T : Ts) {
      Result r{"gated_mlp_decode", "shared expert " + dims({F, H}) + " x2, " + dims({H, F}), fmt_name(f), t_label(T),
               T};
      r.bytes = wb + 8.0 * T * H;
      r.flops = 2.0 * T * 3 * F * H;
      b.run(r, [&](Baseline& base) {
        struct Mlp {
          std::vector<ops::Weight> gate, up, down;
          Tensor x, out, scratch, g, u;
        };
        auto m = std::make_shared<Mlp>();
        const int vars = rotations(int64_t(wb));
        for (int v = 0; v < vars; ++v) {
          m->gate.push_back(make_weight(f, F, H, 20 + 3 * v, "shared gate"));
          m->up.push_back(make_weight(f, F, H, 21 + 3 * v, "shared up"));
          m->down.push_back(make_weight(f, H, F, 22 + 3 * v, "shared down"));
        }
        m->x = dev_rand(DType::F32, {T, H}, 3);
        m->out = dev_empty(DType::F32, {T, H});
        m->scratch = dev_empty(DType::F32, {2 * T * F});
        m->g = dev_empty(DType::F32, {T, F});
        m->u = dev_empty(DType::F32, {T, F});
        base.name = "steps";
        base.kind = "linear_bf16(decode) gate, up, silu_mul, linear_bf16(decode) down, one by one";
        base.variants = vars;
        base.run = [m](int v) {
          ops::linear_bf16(m->x, m->gate[size_t(v)], m->g, false, true);
          ops::linear_bf16(m->x, m->up[size_t(v)], m->u, false, true);
          ops::silu_mul(m->g, m->u, m->g);
          ops::linear_bf16(m->g, m->down[size_t(v)], m->out, false, true);
        };
        return std::make_pair(std::function<void(int)>([m](int v) {
                                ops::gated_mlp(m->x, m->gate[size_t(v)], m->up[size_t(v)], m->down[size_t(v)], m->out,
                                               m->scratch, ops::GemmNumerics::BF16, true);
                              }),
                              vars);
      });
    }
  }
}

// The routed experts of decode chunks under decode_gemm="bf16" (moe_experts with BF16 numerics
// and decode: gemm_sk.cu's skinny grouped GEMM, W4A16 / W8A16) at the decode / verify sizes,
// beside the exact SIMT expert kernels (decode_gemm="exact", the default) on the same routing
// in the same run.
void bench_moe_decode(Bench& b, const std::vector<int64_t>& Ts) {
  for (Fmt f : {Fmt::NVFP4, Fmt::FP8}) {
    if (b.opt.quick && f != Fmt::NVFP4) continue;
    for (int64_t T : Ts) {
      const std::vector<int32_t> ids = random_routing(T, 7321 + uint64_t(T));
      const int64_t nhit = moe_hits(ids);
      Result r{"moe_experts_bf16_decode", "256 experts top8 " + dims({G.moe_inter, G.hidden}) + " hit " +
               std::to_string(nhit), fmt_name(f), t_label(T), T};
      moe_cost(r, f, T, nhit);
      b.run(r, [&](Baseline& base) {
        auto c = std::make_shared<MoeCase>(make_moe_case(f, T, ids));
        if (!ops::moe_experts_bf16_available(c->x.device(), c->ew))
          throw std::runtime_error("moe_experts_bf16_decode: the grouped BF16 GEMM does not run here");
        base.name = "exact SIMT";
        base.kind = "moe_experts numerics exact (the SIMT expert kernels, decode_gemm='exact')";
        base.variants = 1;
        base.run = [c](int) { c->run(ops::GemmNumerics::Exact); };
        return std::make_pair(std::function<void(int)>([c](int) { c->run(ops::GemmNumerics::BF16, true); }), 1);
      });
    }
  }
}

// The routed experts' exact numerics on the tensor cores (ops::set_exact_tc(true): the skinny
// grouped kernel's exact form) beside the exact SIMT expert kernels on the same routing.
void bench_moe_exact_tc(Bench& b, const std::vector<int64_t>& Ts) {
  for (Fmt f : {Fmt::FP8, Fmt::NVFP4}) {
    if (b.opt.quick && f != Fmt::FP8) continue;
    for (int64_t T : Ts) {
      const std::vector<int32_t> ids = random_routing(T, 7321 + uint64_t(T));
      const int64_t nhit = moe_hits(ids);
      Result r{"moe_experts_exact_tc", "256 experts top8 " + dims({G.moe_inter, G.hidden}) + " hit " +
               std::to_string(nhit), fmt_name(f), t_label(T), T};
      moe_cost(r, f, T, nhit);
      b.run(r, [&](Baseline& base) {
        auto c = std::make_shared<MoeCase>(make_moe_case(f, T, ids));
        auto form = [c](bool tc) {
          return [c, tc](int) {
            const bool was = ops::exact_tc();
            ops::set_exact_tc(tc);
            c->run(ops::GemmNumerics::Exact);
            ops::set_exact_tc(was);
          };
        };
        base.name = "exact SIMT";
        base.kind = "moe_experts numerics exact on the SIMT expert kernels (ops::set_exact_tc(false))";
        base.variants = 1;
        base.run = form(false);
        return std::make_pair(std::function<void(int)>(form(true)), 1);
      });
    }
  }
}

// An op timed two ways on the same operands: ops::wide_rows() on (ours: long rows split over
// one block per 4096-id chunk) and off (the baseline: one block per row), the switch as it
// was after each call.
std::pair<std::function<void(int)>, int> wide_rows_forms(Baseline& base, int vars, const char* op,
                                                         std::function<void(int)> call) {
  auto form = [call](bool wide) {
    return [call, wide](int v) {
      const bool was = ops::wide_rows();
      ops::set_wide_rows(wide);
      call(v);
      ops::set_wide_rows(was);
    };
  };
  base.run = form(false);
  base.variants = vars;
  base.name = "one block per row";
  base.kind = std::string(op) + " with ops::set_wide_rows(false)";
  return std::make_pair(std::function<void(int)>(form(true)), vars);
}

void bench_small(Bench& b, const std::vector<int64_t>& Ts) {
  for (int64_t T : Ts) {
    // rms_norm: the layer norms (6144), q_a_layernorm (2048), kv_a_layernorm (512 of the 576 kv_a row)
    for (int64_t D : {G.hidden, G.q_lora, G.kv_lora}) {
      Result r{"rms_norm", dims({T, D}) + (D == G.kv_lora ? " (slice of 576)" : ""), "f32", t_label(T), T};
      r.bytes = 8.0 * T * D + 2.0 * D;
      r.flops = 4.0 * T * D;
      b.run(r, [&](Baseline&) {
        Tensor x = D == G.kv_lora ? dev_rand(DType::F32, {T, G.latent()}, 15).slice(1, 0, D)
                                  : dev_rand(DType::F32, {T, D}, 15);
        Tensor w = dev_rand(DType::BF16, {D}, 16, Fill::Scales), out = dev_empty(DType::F32, {T, D});
        return std::make_pair(std::function<void(int)>([=](int) mutable { ops::rms_norm(x, w, 1e-5f, out); }), 1);
      });
    }
    // rope: q_pe (slice of q [T, nh, 256]), k_pe (1 head of the kv_a row), indexer q (first 64 of 128)
    struct RopeCase {
      std::string name;
      int64_t heads, row;  // heads, per-head row width of the tensor it is a slice of
      int64_t off;
    };
    for (const RopeCase& rc : {RopeCase{"q_pe h64", 64, G.qk(), G.nope}, RopeCase{"q_pe h16", 16, G.qk(), G.nope},
                               RopeCase{"k_pe", 1, G.latent(), G.kv_lora},
                               RopeCase{"indexer q h32", G.idx_heads, G.idx_dim, 0}}) {
      if (b.opt.quick && rc.name == "q_pe h64") continue;
      Result r{"rope", rc.name + " " + dims({T, rc.heads, G.rope}), "f32", t_label(T), T};
      r.bytes = 8.0 * T * rc.heads * G.rope + 4.0 * T;
      r.flops = 3.0 * T * rc.heads * G.rope;
      b.run(r, [&](Baseline&) {
        Tensor base = dev_rand(DType::F32, {T, rc.heads, rc.row}, 17);
        Tensor x = base.slice(2, rc.off, rc.off + G.rope);
        std::vector<int32_t> pos(static_cast<size_t>(T));
        for (int64_t t = 0; t < T; ++t) pos[size_t(t)] = int32_t(4000 + t);
        Tensor p = upload(pos, DType::I32, {T});
        return std::make_pair(std::function<void(int)>([=](int) mutable {
                                ops::rope(x, p, 1e6, ops::RopeStyle::Interleaved);
                              }),
                              1);
      });
    }
    // cache_write: the latent c (512 of the 576-float cache row) and the indexer key (128)
    for (int64_t D : {G.kv_lora, G.idx_dim}) {
      Result r{"cache_write", std::string(D == G.kv_lora ? "latent c " : "index key ") + dims({T, D}), "f32",
               t_label(T), T};
      r.bytes = 8.0 * T * D + 4.0 * T;
      r.flops = 0;
      b.run(r, [&](Baseline&) {
        const int64_t rows = 65536, width = D == G.kv_lora ? G.latent() : D;
        Tensor cache = dev_rand(DType::F32, {rows, width}, 18).slice(1, 0, D);
        Tensor src = dev_rand(DType::F32, {T, D}, 19);
        std::vector<int32_t> slots(static_cast<size_t>(T));
        uint64_t rr = 5;
        for (int64_t t = 0; t < T; ++t) slots[size_t(t)] = int32_t((splitmix(rr) % uint64_t(rows / T)) * T + t);
        Tensor sl = upload(slots, DType::I32, {T});
        return std::make_pair(std::function<void(int)>([=](int) mutable { ops::cache_write(src, sl, cache); }), 1);
      });
    }
    // argmax over the vocabulary: rows split over blocks (ops::wide_rows, the default) beside
    // one block per row (the switch off) on the same rows
    {
      Result r{"argmax", dims({T, G.vocab}), "f32", t_label(T), T};
      r.bytes = 4.0 * T * G.vocab + 4.0 * T;
      r.flops = 0;
      b.run(r, [&](Baseline& base) {
        const int vars = rotations(int64_t(4 * T * G.vocab));
        std::vector<Tensor> logits;
        for (int v = 0; v < vars; ++v) logits.push_back(dev_rand(DType::F32, {T, G.vocab}, 60 + v));
        Tensor out = dev_empty(DType::I32, {T});
        return wide_rows_forms(base, vars, "argmax", [=](int v) mutable { ops::argmax(logits[size_t(v)], out); });
      });
    }
    // token_logprobs over the vocabulary (requests with logprobs: the verify rows after
    // acceptance): one block per row, two passes (max and the non-finite OR, then the
    // exponentials' double sum)
    {
      Result r{"token_logprobs", dims({T, G.vocab}), "f32", t_label(T), T};
      r.bytes = 8.0 * T * G.vocab + 12.0 * T;
      r.flops = 0;
      b.run(r, [&](Baseline&) {
        const int vars = rotations(int64_t(4 * T * G.vocab));
        std::vector<Tensor> logits;
        for (int v = 0; v < vars; ++v) logits.push_back(dev_rand(DType::F32, {T, G.vocab}, 80 + v));
        std::vector<int32_t> ids(static_cast<size_t>(T));
        for (int64_t t = 0; t < T; ++t) ids[size_t(t)] = int32_t((t * 7919) % G.vocab);
        Tensor id = upload(ids, DType::I32, {T});
        Tensor lp = dev_empty(DType::F32, {T}), lse = dev_empty(DType::F32, {T});
        return std::make_pair(std::function<void(int)>([=](int v) mutable {
                                ops::token_logprobs(logits[size_t(v)], id, lp, lse);
                              }),
                              vars);
      });
    }
    // apply_penalties over the verify rows of sequences with repetition control (8 rows per
    // sequence when T is a multiple of 8, else one): one block per row, the logits read and
    // written, the sequence's state and bias rows read
    {
      Result r{"apply_penalties", dims({T, G.vocab}), "f32", t_label(T), T};
      r.bytes = 16.0 * T * G.vocab;
      r.flops = 0;
      b.run(r, [&](Baseline&) {
        const int64_t per = T % 8 == 0 ? 8 : 1, S = T / per;
        const int vars = rotations(int64_t(4 * T * G.vocab));
        std::vector<Tensor> logits;
        for (int v = 0; v < vars; ++v) logits.push_back(dev_rand(DType::F32, {T, G.vocab}, 90 + v));
        const size_t n = static_cast<size_t>(S);
        std::vector<int32_t> row0(n), drow(n), dlen(n, int32_t(per - 1)), seq(2 * n), drafts(7 * n);
        std::vector<float> par(3 * n);
        for (int64_t k = 0; k < S; ++k) {
          row0[size_t(k)] = int32_t(k * per);
          drow[size_t(k)] = int32_t(k);
          seq[size_t(2 * k)] = int32_t(k);
          seq[size_t(2 * k + 1)] = 0;
          par[size_t(3 * k)] = 0.5f, par[size_t(3 * k + 1)] = 0.5f, par[size_t(3 * k + 2)] = 1.2f;
          for (int64_t j = 0; j < 7; ++j) drafts[size_t(k * 7 + j)] = int32_t((k * 131 + j * 7919) % G.vocab);
        }
        std::vector<int32_t> st(n * static_cast<size_t>(G.vocab));
        for (size_t i = 0; i < st.size(); ++i) st[i] = (i % 97 == 0 ? 2 : 0) | (i % 61 == 0 ? ops::kPenaltyPrompt : 0);
        Tensor d_row0 = upload(row0, DType::I32, {S}), d_drow = upload(drow, DType::I32, {S});
        Tensor d_dlen = upload(dlen, DType::I32, {S}), d_seq = upload(seq, DType::I32, {S, 2});
        Tensor d_drafts = upload(drafts, DType::I32, {S, 7}), d_par = upload(par, DType::F32, {S, 3});
        Tensor d_st = upload(st, DType::I32, {S, G.vocab});
        Tensor d_bias = dev_rand(DType::F32, {S, G.vocab}, 99);
        return std::make_pair(std::function<void(int)>([=](int v) mutable {
                                ops::apply_penalties(logits[size_t(v)], d_row0, d_drafts, d_drow, d_dlen, d_seq, d_par,
                                                     d_st, d_bias);
                              }),
                              vars);
      });
    }
    // mask_logits (structured output's token masks) over T verify rows: the mask words read
    // once per warp, the logits written where a bit is clear (half of them here)
    {
      Result r{"mask_logits", dims({T, G.vocab}), "f32", t_label(T), T};
      const int64_t W = (G.vocab + 31) / 32;
      r.bytes = 4.0 * T * W + 2.0 * T * G.vocab;
      r.flops = 0;
      b.run(r, [&](Baseline&) {
        const int vars = rotations(int64_t(4 * T * G.vocab));
        std::vector<Tensor> logits;
        for (int v = 0; v < vars; ++v) logits.push_back(dev_rand(DType::F32, {T, G.vocab}, 95 + v));
        std::vector<int32_t> rows(static_cast<size_t>(T)), bits(static_cast<size_t>(T * W));
        for (int64_t t = 0; t < T; ++t) rows[size_t(t)] = int32_t(t);
        for (size_t i = 0; i < bits.size(); ++i) bits[i] = int32_t(0x5555aaaau ^ uint32_t(i * 2654435761u));
        Tensor d_rows = upload(rows, DType::I32, {T}), d_bits = upload(bits, DType::I32, {T, W});
        return std::make_pair(std::function<void(int)>([=](int v) mutable {
                                ops::mask_logits(logits[size_t(v)], d_rows, d_bits);
                              }),
                              vars);
      });
    }
    // sample over the vocabulary: rows split over blocks (ops::wide_rows, the default)
    // beside one block per row (the switch off) on the same rows; t1.0 p0.95 is the published
    // setting (no top-k: the whole row is in the top-p selection)
    for (const auto& set : {std::make_tuple(0.8f, 0.95f, 50, " t0.8 p0.95 k50"), std::make_tuple(1.0f, 0.95f, 0, " t1.0 p0.95")}) {
      Result r{"sample", dims({T, G.vocab}) + std::get<3>(set), "f32", t_label(T), T};
      r.bytes = 4.0 * T * G.vocab + 4.0 * T;
      r.flops = 0;
      b.run(r, [&](Baseline& base) {
        const int vars = rotations(int64_t(4 * T * G.vocab));
        std::vector<Tensor> logits;
        for (int v = 0; v < vars; ++v) logits.push_back(dev_rand(DType::F32, {T, G.vocab}, 60 + v));
        Tensor out = dev_empty(DType::I32, {T});
        ops::SamplingTensors sp;
        sp.temperature = upload(std::vector<float>(size_t(T), std::get<0>(set)), DType::F32, {T});
        sp.top_p = upload(std::vector<float>(size_t(T), std::get<1>(set)), DType::F32, {T});
        sp.top_k = upload(std::vector<int32_t>(size_t(T), std::get<2>(set)), DType::I32, {T});
        std::vector<int64_t> rng(size_t(2 * T));
        for (int64_t t = 0; t < T; ++t) rng[size_t(2 * t)] = 1000 + t, rng[size_t(2 * t + 1)] = 0;
        Tensor dr = upload(rng, DType::I64, {T, 2});
        return wide_rows_forms(base, vars, "sample",
                               [=](int v) mutable { ops::sample(logits[size_t(v)], sp, dr, out); });
      });
    }
    // accept of verify blocks (8 rows per sequence: 7 drafted + the bonus row) with the
    // selector's q K-wide (16 candidates), t1.0 p0.95; the same two forms
    if (T % 8 == 0) {
      const int64_t S = T / 8, K = 7, C = 16;
      Result r{"accept", dims({T, G.vocab}) + " K7 C16 t1.0 p0.95", "f32", t_label(T), T};
      r.bytes = 4.0 * T * G.vocab;
      r.flops = 0;
      b.run(r, [&](Baseline& base) {
        const int vars = rotations(int64_t(4 * T * G.vocab));
        std::vector<Tensor> logits;
        for (int v = 0; v < vars; ++v) logits.push_back(dev_rand(DType::F32, {T, G.vocab}, 70 + v));
        std::vector<int32_t> row0(static_cast<size_t>(S)), drow(static_cast<size_t>(S)),
            dlen(static_cast<size_t>(S), static_cast<int32_t>(K)), draft(static_cast<size_t>(S * K)),
            cand(static_cast<size_t>(S * K * C));
        std::vector<float> q(static_cast<size_t>(S * K * C), 1.0f / float(C));
        uint64_t rr = 9;
        for (int64_t s = 0; s < S; ++s) row0[size_t(s)] = int32_t(s * 8), drow[size_t(s)] = int32_t(s);
        for (auto& c : cand) c = int32_t(splitmix(rr) % uint64_t(G.vocab));
        for (int64_t i = 0; i < S * K; ++i) draft[size_t(i)] = cand[size_t(i * C)];
        Tensor r0 = upload(row0, DType::I32, {S}), dw = upload(drow, DType::I32, {S});
        Tensor dl = upload(dlen, DType::I32, {S}), dt = upload(draft, DType::I32, {S, K});
        Tensor cd = upload(cand, DType::I32, {S, K, C}), qq = upload(q, DType::F32, {S, K, C});
        ops::SamplingTensors sp;
        sp.temperature = upload(std::vector<float>(size_t(S), 1.0f), DType::F32, {S});
        sp.top_p = upload(std::vector<float>(size_t(S), 0.95f), DType::F32, {S});
        sp.top_k = upload(std::vector<int32_t>(size_t(S), 0), DType::I32, {S});
        std::vector<int64_t> rng(size_t(2 * S));
        for (int64_t s = 0; s < S; ++s) rng[size_t(2 * s)] = 2000 + s, rng[size_t(2 * s + 1)] = 0;
        Tensor dr = upload(rng, DType::I64, {S, 2});
        Tensor acc = dev_empty(DType::I32, {S}), bon = dev_empty(DType::I32, {S});
        return wide_rows_forms(base, vars, "accept", [=](int v) mutable {
          ops::accept(logits[size_t(v)], r0, dt, dw, dl, cd, qq, sp, dr, acc, bon);
        });
      });
    }
  }
}
#endif  // DFLASH2_WITH_CUDA

void usage(FILE* f) {
  std::fprintf(f,
               "usage: bench_ops [--quick] [--json PATH] [--filter SUBSTR] [--trials N] [--cpu-smoke]\n"
               "  latency of each CUDA op on GLM-5.3 shapes (decode / verify at batch 1, 8, 32), with\n"
               "  the device copy bandwidth measured in the same run and cuBLASLt beside the GEMMs.\n"
               "  --quick   a reduced set (~1 minute)\n"
               "  --json    also write the results there\n"
               "  --filter  only cases whose name (op shape format T label) contains SUBSTR\n"
               "  --trials  event pairs per case (median; default 20, 10 with --quick)\n"
               "  --cpu-smoke  build every case for T = 1 and 8 (batch 1) on the CPU and call its op once\n"
               "            through the CPU backend: checks the cases' setup without a GPU (slow; no timing)\n");
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_ops: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--quick") {
      opt.quick = true;
    } else if (a == "--json") {
      opt.json_path = value();
    } else if (a == "--filter") {
      opt.filter = value();
    } else if (a == "--trials") {
      opt.trials = std::atoi(value().c_str());
      if (opt.trials < 1) {
        std::fprintf(stderr, "bench_ops: --trials must be >= 1\n");
        return 2;
      }
    } else if (a == "--cpu-smoke") {
      opt.cpu_smoke = true;
    } else if (a == "-h" || a == "--help") {
      usage(stdout);
      return 0;
    } else {
      std::fprintf(stderr, "bench_ops: unknown argument '%s'\n", a.c_str());
      usage(stderr);
      return 2;
    }
  }

  Json::Object report{{"bench", jstr("bench_ops")}, {"quick", jbool(opt.quick)}, {"filter", jstr(opt.filter)}};
#if defined(DFLASH2_WITH_CUBLASLT)
  const bool lt_built = true;
  std::string lt_missing;
#elif defined(DFLASH2_CUBLASLT_MISSING)
  const bool lt_built = false;
  std::string lt_missing = DFLASH2_CUBLASLT_MISSING;
#else
  const bool lt_built = false;
  std::string lt_missing = "not built with cuBLASLt";
#endif

  std::string why;
#ifdef DFLASH2_WITH_CUDA
  if (opt.cpu_smoke) g_dev = Device::cpu();
  if (!opt.cpu_smoke && !dflash2::cuda_available(&why)) {
#else
  if (!dflash2::cuda_available(&why)) {
#endif
    std::printf("no usable GPU: %s\n", why.c_str());
    std::printf("cublasLt: %s\n", lt_built ? "built in (not loaded: no GPU)" : ("not available (" + lt_missing + ")").c_str());
    report.emplace_back("gpu_available", jbool(false));
    report.emplace_back("reason", jstr("no usable GPU: " + why));
    report.emplace_back("cublaslt", Json::make_object({{"built", jbool(lt_built)},
                                                       {"available", jbool(false)},
                                                       {"reason", jstr(lt_built ? "no GPU" : lt_missing)}}));
    report.emplace_back("cases", Json::make_array({}));
    return write_json(opt.json_path, Json::make_object(std::move(report))) ? 0 : 1;
  }
#ifdef DFLASH2_WITH_CUDA
  Bench b;
  b.opt = opt;
  int status = 0;
  try {
    DeviceInfo di;
    if (on_gpu()) {
      CK(cudaSetDevice(0));
      di = device_info();
      g_rotate_bytes = std::max<int64_t>(4 * di.l2, int64_t(64) << 20);
    } else {
      di.name = "cpu (--cpu-smoke: the CPU backend, one call per case; times are not GPU times)";
      g_rotate_bytes = 0;
    }
    std::printf("device: %s (sm_%d%d, %d SMs, %.1f GiB, L2 %.0f MiB)\n", di.name.c_str(), di.major, di.minor, di.sms,
                double(di.mem) / double(1 << 30), double(di.l2) / double(1 << 20));
    report.emplace_back("gpu_available", jbool(on_gpu()));
    if (!on_gpu()) report.emplace_back("cpu_smoke", jbool(true));
    report.emplace_back("device", Json::make_object({{"name", jstr(di.name)},
                                                     {"arch", jstr("sm_" + std::to_string(di.major) +
                                                                   std::to_string(di.minor))},
                                                     {"sms", jint(di.sms)},
                                                     {"memory_bytes", jint(di.mem)},
                                                     {"l2_bytes", jint(di.l2)}}));
    // cuBLASLt
#ifdef DFLASH2_WITH_CUBLASLT
    LtApi cpu_api;
    cpu_api.why = "not loaded with --cpu-smoke";
    LtApi& api = on_gpu() ? lt() : cpu_api;
    g_lt_ok = api.ok;
    g_lt_why = api.ok ? "" : "not available (" + api.why + ")";
    if (api.ok)
      std::printf("cublasLt: %s (version %zu)\n", api.path.c_str(), api.version);
    else
      std::printf("cublasLt: %s\n", g_lt_why.c_str());
    report.emplace_back("cublaslt", Json::make_object({{"built", jbool(true)},
                                                       {"available", jbool(api.ok)},
                                                       {"library", jstr(api.path)},
                                                       {"version", jint(int64_t(api.version))},
                                                       {"header_version", jint(CUBLAS_VERSION)},
                                                       {"reason", jstr(api.why)}}));
#else
    g_lt_ok = false;
    g_lt_why = "not available (" + lt_missing + ")";
    std::printf("cublasLt: %s\n", g_lt_why.c_str());
    report.emplace_back("cublaslt", Json::make_object({{"built", jbool(false)},
                                                       {"available", jbool(false)},
                                                       {"reason", jstr(lt_missing)}}));
#endif
    b.copy_GBps = copy_bandwidth_GBps(b.trials());
    std::printf("copy bandwidth (cudaMemcpyAsync D2D 1 GiB, read + write): %.1f GB/s\n", b.copy_GBps);
    std::printf("columns: op, shape, weight format, T, label, median time, GB/s of compulsory bytes, TFLOP/s, "
                "fraction of copy bandwidth | cuBLASLt time, cuBLASLt time / ours\n");
    std::vector<int64_t> Ts = opt.quick ? std::vector<int64_t>{1, 32, 256} : std::vector<int64_t>{1, 8, 32, 64, 256};
    if (opt.cpu_smoke) Ts = {1, 8};
    bench_linear(b, Ts, di.major);
    bench_linear_heads(b, Ts, di.major);
    bench_linear_tc(b, opt.cpu_smoke ? Ts : opt.quick ? std::vector<int64_t>{256, 1024}
                                                      : std::vector<int64_t>{256, 1024, 4096}, di.major);
    bench_mla(b);
    bench_block_attention(b);
    bench_indexer(b);
    bench_moe(b, Ts, di.major);
    bench_small(b, Ts);
    bench_linear_sk(b, Ts, di.major);  // last: new in device_check's --quick, they cannot crowd out the others
    bench_moe_decode(b, Ts);
    bench_gated_decode(b, Ts);
    bench_linear_exact_tc(b, opt.cpu_smoke ? Ts : opt.quick ? std::vector<int64_t>{1, 8, 32}
                                                             : std::vector<int64_t>{1, 8, 32, 64, 256});
    bench_moe_exact_tc(b, opt.cpu_smoke ? Ts : opt.quick ? std::vector<int64_t>{8, 32, 256} : Ts);
    if (!b.fatal) {
      const double again = copy_bandwidth_GBps(b.trials());
      std::printf("copy bandwidth at the end: %.1f GB/s\n", again);
      report.emplace_back("copy_GBps_end", jnum(again));
    }
  } catch (const std::exception& e) {
    std::printf("bench_ops: %s\n", e.what());
    report.emplace_back("error", jstr(e.what()));
    status = 1;
  }
  report.emplace_back("copy_GBps", jnum(b.copy_GBps));
  report.emplace_back("copy_method", jstr("cudaMemcpyAsync device-to-device, 1 GiB, median, 2 x bytes / time"));
  // summary: the goals
  int gemm_n = 0, gemm_ok = 0, mem_n = 0, mem_ok = 0;
  for (const Json& c : b.cases) {
    const Json* ok = c.find("ok");
    if (!ok || !ok->as_bool()) continue;
    if (const Json* ratio = c.find("ratio_vs_cublaslt")) {
      ++gemm_n;
      gemm_ok += ratio->as_double() >= 0.90;
    } else if (const Json* lb = c.find("latency_bound"); lb && !lb->as_bool()) {
      ++mem_n;
      mem_ok += c.find("copy_fraction")->as_double() >= 0.85;
    }
  }
  std::printf("summary: %zu cases, %d failed; GEMMs >= 0.90 of cuBLASLt: %d of %d; cases with >= 8 MiB "
              "compulsory bytes and no cuBLASLt baseline at >= 85%% of copy bandwidth: %d of %d\n",
              b.cases.size(), b.failures, gemm_ok, gemm_n, mem_ok, mem_n);
  report.emplace_back("summary", Json::make_object({{"cases", jint(int64_t(b.cases.size()))},
                                                    {"failed", jint(b.failures)},
                                                    {"gemm_with_baseline", jint(gemm_n)},
                                                    {"gemm_at_0.90_of_cublaslt", jint(gemm_ok)},
                                                    {"memory_cases", jint(mem_n)},
                                                    {"memory_at_0.85_of_copy", jint(mem_ok)}}));
  report.emplace_back("cases", Json::make_array(std::move(b.cases)));
  if (b.failures > 0) status = 1;
  if (!write_json(opt.json_path, Json::make_object(std::move(report)))) status = 1;
  return status;
#else
  return 0;
#endif
}
