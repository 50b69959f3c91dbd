// cpp/emu/cutlass_ref.cpp: the CUDA backend's CUTLASS GEMMs (the entry points of
// backend/cuda/cutlass/*_gemm.h) as host reference computations, for the CPU emulator only.
// CUTLASS's kernels need a GPU; what the emulator can check is everything around them: the
// operands our kernels produce (BF16 / E4M3 / E2M1 codes, block scales in CUTLASS's layouts,
// per-group offsets and pointer tables on the device), the arguments gemm_tc.cu and moe.cu
// pass, and how the results are used. So each entry point here
//   1. checks the preconditions its header documents (alignment, extents), returning the
//      error string as the real kernel's can_implement would, and
//   2. queues on the stream (in order, captured into graphs like a launch) a plain fp32
//      computation of what the header says the kernel computes, reading the scale factors
//      through the CuTe layouts the real kernels are built with (cutlass/fp8_config.cuh,
//      cutlass/nvfp4_config.cuh), not through our layout.h, and the FP4 codes in CUTLASS's
//      sub-byte order (element 2i in the low nibble).
// The sums run over k in ascending order in fp32 (the real tensor cores' order within a
// k-tile differs: tests compare with tolerances, as they do on a GPU). Not CUTLASS, not a
// GPU: a pass here says the glue is right, not that the kernels are.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "backend/cuda/cutlass/bf16_gemm.h"
#include "backend/cuda/cutlass/fp8_config.cuh"
#include "backend/cuda/cutlass/fp8_gemm.h"
#include "backend/cuda/cutlass/fp8_grouped_gemm.h"
#include "backend/cuda/cutlass/nvfp4_config.cuh"
#include "backend/cuda/cutlass/nvfp4_gemm.h"
#include "backend/cuda/cutlass/nvfp4_grouped_gemm.h"
#include "emu_host.h"

namespace dflash2::cuda::tc {

namespace {

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

float bf16_value(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// E4M3 (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; S.1111.111 is NaN, no inf).
float e4m3_value(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7) return std::numeric_limits<float>::quiet_NaN();
  const float v = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(float(8 + m), e - 10);
  return (b & 0x80) ? -v : v;
}

// The NVFP4 scale factors are CUTLASS's float_ue4m3_t: E4M3 without a sign (bit 7 unused).
float ue4m3_value(uint8_t b) { return e4m3_value(uint8_t(b & 0x7f)); }

// E2M1 (1 sign, 2 exponent bits with bias 1, 1 mantissa bit): 0, 0.5, 1, 1.5, 2, 3, 4, 6.
float e2m1_value(uint8_t c) {
  static const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  return (c & 8) ? -mag[c & 7] : mag[c & 7];
}

// Element k of a packed E2M1 row (CUTLASS's sub-byte order: element 2i in bits 0..3).
float e2m1_at(const uint8_t* row, int64_t k) { return e2m1_value(uint8_t((row[k / 2] >> ((k % 2) * 4)) & 15)); }

// The epilogue: D = alpha * acc (+ D: LinearCombination with beta = 1, one fma).
void store(float* d, float alpha, float acc, bool accumulate) {
  const float v = alpha == 1.0f ? acc : alpha * acc;
  *d = accumulate ? std::fma(1.0f, *d, v) : v;
}

std::string shape_error(const char* what, const std::string& rule, int M, int N, int K) {
  return std::string(what) + ": " + rule + " (M " + std::to_string(M) + ", N " + std::to_string(N) + ", K " +
         std::to_string(K) + ")";
}

// ------------------------------------------------------------------ BF16
std::string bf16_ref(const Bf16GemmArgs& a, CUstream_st* stream, const char* what) {
  if (a.M < 0 || a.N <= 0 || a.K <= 0) return shape_error(what, "empty problem", a.M, a.N, a.K);
  if (a.K % 8 || a.lda % 8 || a.ldb % 8 || a.lda < a.K || a.ldb < a.K || !aligned16(a.a) || !aligned16(a.b))
    return shape_error(what, "A and B need 16-byte aligned rows of K >= 8-multiple elements", a.M, a.N, a.K);
  if (a.N % 4 || a.ldd % 4 || a.ldd < a.N || !aligned16(a.d))
    return shape_error(what, "D needs N % 4 == 0 and 16-byte aligned rows", a.M, a.N, a.K);
  emu::enqueue_host(stream, [a]() {
    const auto* A = static_cast<const uint16_t*>(a.a);
    const auto* B = static_cast<const uint16_t*>(a.b);
    std::vector<float> bt(size_t(a.N) * a.K), ar(static_cast<size_t>(a.K));
    for (int n = 0; n < a.N; ++n)
      for (int k = 0; k < a.K; ++k) bt[size_t(n) * a.K + k] = bf16_value(B[n * a.ldb + k]);
    for (int m = 0; m < a.M; ++m) {
      for (int k = 0; k < a.K; ++k) ar[size_t(k)] = bf16_value(A[m * a.lda + k]);
      for (int n = 0; n < a.N; ++n) {
        const float* b = &bt[size_t(n) * a.K];
        float acc = 0.0f;
        for (int k = 0; k < a.K; ++k) acc = std::fma(ar[size_t(k)], b[k], acc);
        store(a.d + m * a.ldd + n, 1.0f, acc, a.accumulate);
      }
    }
  });
  return "";
}

// ------------------------------------------------------------------ FP8 block-128
// D[m, n] = sum_b P_b * (sfa(m, b) * sfb(n, b)), P_b the fp32 sum of block b's products.
template <class LayoutA, class LayoutB>
void fp8_compute(int M, int N, int K, const uint8_t* A, int64_t lda, const float* sfa, const LayoutA& la,
                 const uint8_t* B, int64_t ldb, const float* sfb, const LayoutB& lb, float* D, int64_t ldd,
                 bool accumulate) {
  const int nbk = (K + 127) / 128;
  std::vector<float> bt(size_t(N) * K), ar(static_cast<size_t>(K)), sb(size_t(N) * nbk), sa(static_cast<size_t>(nbk));
  for (int n = 0; n < N; ++n) {
    for (int k = 0; k < K; ++k) bt[size_t(n) * K + k] = e4m3_value(B[n * ldb + k]);
    for (int b = 0; b < nbk; ++b) sb[size_t(n) * nbk + b] = sfb[int64_t(lb(n, b * 128, 0))];
  }
  for (int m = 0; m < M; ++m) {
    for (int k = 0; k < K; ++k) ar[size_t(k)] = e4m3_value(A[m * lda + k]);
    for (int b = 0; b < nbk; ++b) sa[size_t(b)] = sfa[int64_t(la(m, b * 128, 0))];
    for (int n = 0; n < N; ++n) {
      const float* w = &bt[size_t(n) * K];
      float acc = 0.0f;
      for (int b = 0; b < nbk; ++b) {
        float p = 0.0f;
        for (int k = b * 128; k < K && k < (b + 1) * 128; ++k) p = std::fma(ar[size_t(k)], w[k], p);
        acc += p * (sa[size_t(b)] * sb[size_t(n) * nbk + b]);
      }
      store(D + m * ldd + n, 1.0f, acc, accumulate);
    }
  }
}

std::string fp8_ref(const Fp8GemmArgs& a, CUstream_st* stream, const char* what) {
  if (a.M < 0 || a.N <= 0 || a.K <= 0) return shape_error(what, "empty problem", a.M, a.N, a.K);
  if (a.M % 4 || a.N % 4 || a.K % 16) return shape_error(what, "M % 4, N % 4 and K % 16 must be 0", a.M, a.N, a.K);
  if (a.lda % 16 || a.ldb % 16 || a.lda < a.K || a.ldb < a.K || !aligned16(a.a) || !aligned16(a.b) ||
      !aligned16(a.sfa) || a.ldd % 4 || a.ldd < a.N || !aligned16(a.d))
    return shape_error(what, "A, B, D and the activation scales need 16-byte alignment", a.M, a.N, a.K);
  emu::enqueue_host(stream, [a]() {
    const auto shape = cute::make_shape(a.M, a.N, a.K, 1);
    fp8_compute(a.M, a.N, a.K, static_cast<const uint8_t*>(a.a), a.lda, a.sfa,
                Fp8ScaleConfig::tile_atom_to_shape_SFA(shape), static_cast<const uint8_t*>(a.b), a.ldb, a.sfb,
                Fp8ScaleConfig::tile_atom_to_shape_SFB(shape), a.d, a.ldd, a.accumulate);
  });
  return "";
}

template <class ScaleConfig>
std::string fp8_grouped_ref(const Fp8GroupedArgs& a, CUstream_st* stream, const char* what) {
  if (a.groups <= 0) return "";
  if (a.K % 16 != 0 || a.N % 4 != 0 || !aligned16(a.a) || !aligned16(a.d) ||
      reinterpret_cast<uintptr_t>(a.params) % 256 != 0)
    return shape_error(what, "K % 16, N % 4, A and D 16-byte aligned, params 256-byte aligned", 0, a.N, a.K);
  emu::enqueue_host(stream, [a]() {
    const int nbk = (a.K + 127) / 128;
    for (int g = 0; g < a.groups; ++g) {
      const int64_t r0 = a.offsets[g];
      const int M = int(a.offsets[g + 1] - r0);
      if (M <= 0) continue;
      const auto shape = cute::make_shape(M, a.N, a.K, 1);
      fp8_compute(M, a.N, a.K, static_cast<const uint8_t*>(a.a) + r0 * a.K, a.K, a.sfa + int64_t(nbk) * r0,
                  ScaleConfig::tile_atom_to_shape_SFA(shape), static_cast<const uint8_t*>(a.b[g]), a.K, a.sfb[g],
                  ScaleConfig::tile_atom_to_shape_SFB(shape), a.d + r0 * a.N, a.N, false);
    }
  });
  return "";
}

// ------------------------------------------------------------------ NVFP4 W4A4
// D[m, n] = alpha * sum_k (a_k sfa(m, k)) (b_k sfb(n, k)).
template <class LayoutA, class LayoutB>
void nvfp4_compute(int M, int N, int K, const uint8_t* A, int64_t lda_bytes, const uint8_t* sfa, const LayoutA& la,
                   const uint8_t* B, int64_t ldb_bytes, const uint8_t* sfb, const LayoutB& lb, float alpha, float* D,
                   int64_t ldd, bool accumulate) {
  std::vector<float> bt(size_t(N) * K), ar(static_cast<size_t>(K));
  for (int n = 0; n < N; ++n)
    for (int k0 = 0; k0 < K; k0 += 16) {
      const float s = ue4m3_value(sfb[int64_t(lb(n, k0, 0))]);
      for (int k = k0; k < k0 + 16; ++k) bt[size_t(n) * K + k] = e2m1_at(B + n * ldb_bytes, k) * s;
    }
  for (int m = 0; m < M; ++m) {
    for (int k0 = 0; k0 < K; k0 += 16) {
      const float s = ue4m3_value(sfa[int64_t(la(m, k0, 0))]);
      for (int k = k0; k < k0 + 16; ++k) ar[size_t(k)] = e2m1_at(A + m * lda_bytes, k) * s;
    }
    for (int n = 0; n < N; ++n) {
      const float* w = &bt[size_t(n) * K];
      float acc = 0.0f;
      for (int k = 0; k < K; ++k) acc = std::fma(ar[size_t(k)], w[k], acc);
      store(D + m * ldd + n, alpha, acc, accumulate);
    }
  }
}

std::string nvfp4_ref(const Nvfp4GemmArgs& a, CUstream_st* stream, const char* what) {
  if (a.M < 0 || a.N <= 0 || a.K <= 0) return shape_error(what, "empty problem", a.M, a.N, a.K);
  if (a.N % 4 || a.K % 32 || a.lda % 32 || a.ldb % 32 || a.lda < a.K || a.ldb < a.K)
    return shape_error(what, "N % 4, K % 32 and the row strides % 32 must be 0", a.M, a.N, a.K);
  if (!aligned16(a.a) || !aligned16(a.b) || !aligned16(a.sfa) || !aligned16(a.sfb) || a.ldd % 4 || a.ldd < a.N ||
      !aligned16(a.d))
    return shape_error(what, "A, B, D and both scale buffers need 16-byte alignment", a.M, a.N, a.K);
  emu::enqueue_host(stream, [a]() {
    const auto shape = cute::make_shape(a.M, a.N, a.K, 1);
    nvfp4_compute(a.M, a.N, a.K, static_cast<const uint8_t*>(a.a), a.lda / 2, static_cast<const uint8_t*>(a.sfa),
                  Nvfp4SfConfig::tile_atom_to_shape_SFA(shape), static_cast<const uint8_t*>(a.b), a.ldb / 2,
                  static_cast<const uint8_t*>(a.sfb), Nvfp4SfConfig::tile_atom_to_shape_SFB(shape), a.alpha, a.d,
                  a.ldd, a.accumulate);
  });
  return "";
}

std::string nvfp4_grouped_ref(const Nvfp4GroupedArgs& a, CUstream_st* stream, const char* what) {
  if (a.groups <= 0) return "";
  if (a.K % 32 != 0 || a.N % 4 != 0 || !aligned16(a.a) || !aligned16(a.d) ||
      reinterpret_cast<uintptr_t>(a.params) % 256 != 0)
    return shape_error(what, "K % 32, N % 4, A and D 16-byte aligned, params 256-byte aligned", 0, a.N, a.K);
  emu::enqueue_host(stream, [a]() {
    for (int g = 0; g < a.groups; ++g) {
      const int64_t r0 = a.offsets[g];
      const int M = int(a.offsets[g + 1] - r0);
      if (M <= 0) continue;
      const auto shape = cute::make_shape(M, a.N, a.K, 1);
      // the group's scales: 512-byte atoms (128 rows x 4 scales) start on a 512-byte multiple
      if (a.sfa_off[g] % 512 != 0) {
        for (int64_t r = r0; r < r0 + M; ++r)
          for (int n = 0; n < a.N; ++n) a.d[r * a.N + n] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      nvfp4_compute(M, a.N, a.K, static_cast<const uint8_t*>(a.a) + r0 * (a.K / 2), a.K / 2, a.sfa + a.sfa_off[g],
                    Nvfp4SfConfig::tile_atom_to_shape_SFA(shape), static_cast<const uint8_t*>(a.b[g]), a.K / 2,
                    a.sfb[g], Nvfp4SfConfig::tile_atom_to_shape_SFB(shape), a.alpha[g], a.d + r0 * a.N, a.N, false);
    }
  });
  return "";
}

// Room for the per-group argument arrays the real kernels' setup kernels write (13 arrays of
// at most 64 bytes per group, each 256-byte aligned); the reference reads the caller's own.
size_t params_bytes(int groups) { return 13 * ((size_t(groups) * 64 + 255) / 256 * 256); }

}  // namespace

size_t bf16_gemm_sm90_workspace(const Bf16GemmArgs&) { return 0; }
std::string bf16_gemm_sm90(const Bf16GemmArgs& a, void*, CUstream_st* s) { return bf16_ref(a, s, "bf16_gemm_sm90"); }
size_t bf16_gemm_sm100_workspace(const Bf16GemmArgs&) { return 0; }
std::string bf16_gemm_sm100(const Bf16GemmArgs& a, void*, CUstream_st* s) { return bf16_ref(a, s, "bf16_gemm_sm100"); }

size_t fp8_gemm_sm90_workspace(const Fp8GemmArgs&) { return 0; }
std::string fp8_gemm_sm90(const Fp8GemmArgs& a, void*, CUstream_st* s) { return fp8_ref(a, s, "fp8_gemm_sm90"); }
size_t fp8_gemm_sm100_workspace(const Fp8GemmArgs&) { return 0; }
std::string fp8_gemm_sm100(const Fp8GemmArgs& a, void*, CUstream_st* s) { return fp8_ref(a, s, "fp8_gemm_sm100"); }

size_t fp8_grouped_sm90_params_bytes(int groups) { return params_bytes(groups); }
size_t fp8_grouped_sm90_workspace(const Fp8GroupedArgs&) { return 0; }
std::string fp8_grouped_sm90(const Fp8GroupedArgs& a, void*, CUstream_st* s) {
  return fp8_grouped_ref<Fp8ScaleConfig>(a, s, "fp8_grouped_sm90");
}
size_t fp8_grouped_sm100_params_bytes(int groups) { return params_bytes(groups); }
size_t fp8_grouped_sm100_workspace(const Fp8GroupedArgs&) { return 0; }
std::string fp8_grouped_sm100(const Fp8GroupedArgs& a, void*, CUstream_st* s) {
  return fp8_grouped_ref<Fp8GroupedKMajorScaleConfig>(a, s, "fp8_grouped_sm100");
}

size_t nvfp4_gemm_sm100_workspace(const Nvfp4GemmArgs&) { return 0; }
std::string nvfp4_gemm_sm100(const Nvfp4GemmArgs& a, void*, CUstream_st* s) {
  return nvfp4_ref(a, s, "nvfp4_gemm_sm100");
}
size_t nvfp4_grouped_sm100_params_bytes(int groups) { return params_bytes(groups); }
size_t nvfp4_grouped_sm100_workspace(const Nvfp4GroupedArgs&) { return 0; }
std::string nvfp4_grouped_sm100(const Nvfp4GroupedArgs& a, void*, CUstream_st* s) {
  return nvfp4_grouped_ref(a, s, "nvfp4_grouped_sm100");
}

}  // namespace dflash2::cuda::tc
