// CPU GEMM for linear layers: y[M, N] = x[M, K] (F32) @ W[N, K]^T, W in F32/BF16/F16,
// FP8 block-128 or NVFP4. No BLAS: weights stay in their stored format (mmap'ed, zero
// copy) and are widened/dequantized in registers, which halves (BF16) to quarters (FP8)
// or eighths (NVFP4) the memory traffic that bounds decode.
//
// Numerics contract: every output y[m, n] is computed with the same sequence of fp32
// operations whatever M, the blocking and the thread count: 8 lanes accumulate
// w[k + j] * x[k + j] (fused multiply-add, k ascending in steps of 8, with quantized weights
// dequantized to f32 exactly as Weight::dequantize does), a fixed horizontal sum, then the
// K % 8 tail in order. So a row computed inside a verify batch is bitwise equal to the
// same row decoded alone.
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "dflash2/dtype.h"
#include "dflash2/error.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define DFLASH2_X86 1
#endif

namespace dflash2::cpu {



namespace {

// f32 value tables for the 8-bit / 4-bit formats (exact).
struct Tables {
  float fp8[256];
  Tables() {
    for (int i = 0; i < 256; ++i) fp8[i] = fp8_e4m3_to_f32(uint8_t(i));
  }
};
const Tables g_tables;  // built at load time: no guard check in the inner loops
inline const Tables& tables() { return g_tables; }

// Everything a kernel needs to know about the weight, flattened.
struct WView {
  ops::WeightFormat fmt;
  DType dtype;           // of data
  const uint8_t* data;   // row r at data + r * row_bytes
  int64_t row_bytes;
  const float* fp8_scale;     // FP8: [ceil(N/128), ceil(K/128)]
  int64_t fp8_scale_cols;
  const uint8_t* nv_scale;    // NVFP4: F8_E4M3 [N, K/16] (row stride nv_scale_stride)
  int64_t nv_scale_stride;
  float nv_global;
  int64_t K;
};

// Scalar dequantization of W[r, k] (reference order for tails and the generic path).
inline float w_at(const WView& w, int64_t r, int64_t k) {
  const uint8_t* row = w.data + r * w.row_bytes;
  switch (w.fmt) {
    case ops::WeightFormat::Dense:
      if (w.dtype == DType::F32) {
        float v;
        std::memcpy(&v, row + 4 * k, 4);
        return v;
      } else {
        uint16_t h;
        std::memcpy(&h, row + 2 * k, 2);
        return w.dtype == DType::BF16 ? bf16_to_f32(h) : f16_to_f32(h);
      }
    case ops::WeightFormat::FP8Block128:
      return tables().fp8[row[k]] * w.fp8_scale[(r / 128) * w.fp8_scale_cols + k / 128];
    case ops::WeightFormat::NVFP4: {
      uint8_t b = row[k / 2];
      return e2m1_to_f32((k & 1) ? (b >> 4) : (b & 15)) *
             tables().fp8[w.nv_scale[r * w.nv_scale_stride + k / 16]] * w.nv_global;
    }
  }
  return 0.f;
}

// ---------------------------------------------------------------- generic kernel
// Same lane structure as the SIMD kernel (8 lanes, fixed horizontal sum), in plain C++.
inline float hsum8_generic(const float* l) {
  float a0 = l[0] + l[4], a1 = l[1] + l[5], a2 = l[2] + l[6], a3 = l[3] + l[7];
  float b0 = a0 + a2, b1 = a1 + a3;
  return b0 + b1;
}

void rows_generic(const WView& w, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy, int64_t n0,
                  int64_t n1, bool accumulate) {
  const int64_t K = w.K, K8 = K / 8 * 8;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * ldx;
      float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t k = 0; k < K8; k += 8)
        for (int j = 0; j < 8; ++j) lanes[j] = __builtin_fmaf(w_at(w, n, k + j), xr[k + j], lanes[j]);
      float s = hsum8_generic(lanes);
      for (int64_t k = K8; k < K; ++k) s = __builtin_fmaf(w_at(w, n, k), xr[k], s);
      float* out = y + m * ldy + n;
      *out = accumulate ? *out + s : s;
    }
  }
}

#ifdef DFLASH2_X86
// ---------------------------------------------------------------- AVX2 + FMA + F16C kernel
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

inline float hsum8(__m256 v) {
  // (l0+l4, l1+l5, l2+l6, l3+l7) -> (a0+a2, a1+a3) -> b0+b1: same tree as hsum8_generic
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  __m128 c = _mm_add_ss(b, _mm_shuffle_ps(b, b, 1));
  return _mm_cvtss_f32(c);
}

// Eight consecutive weights W[r, k..k+7] (k % 8 == 0) as f32, fully dequantized.
// `srow` points at row r's scales (FP8: its 128-row block's row of scales; NVFP4: its
// K/16 block scales).
template <ops::WeightFormat F, DType D>
inline __m256 load_w8(const WView& w, const uint8_t* row, const void* srow, int64_t k) {
  if constexpr (F == ops::WeightFormat::Dense) {
    if constexpr (D == DType::F32) {
      return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + k);
    } else if constexpr (D == DType::BF16) {
      __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k));
      return _mm256_cvtph_ps(h);
    }
  } else if constexpr (F == ops::WeightFormat::FP8Block128) {
    // e4m3 bits s.eeee.mmm placed into f16 as s.0eeee.mmm0000000 is exactly value * 2^-8
    // (normals and subnormals alike); the 2^8 is folded into the block scale. Sign-extend
    // to 16 bits, shift by 7 (sign lands in bit 15, and a stray copy in bit 14), clear bit 14.
    __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k)));
    __m128i h = _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(int16_t(0xbfff)));
    float s = static_cast<const float*>(srow)[k >> 7] * 256.0f;
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(s));
  } else {
    // NVFP4: the 8 E2M1 magnitudes scaled by this 16-block's scale form one 8-float table
    // (each entry (|e2m1| * fp8 scale) * global: the same single rounding as
    // Weight::dequantize); a lane permute looks the 3 magnitude bits up, bit 3 sets the sign.
    uint32_t four;
    std::memcpy(&four, row + k / 2, 4);
    const __m256i nib = _mm256_srlv_epi32(_mm256_set1_epi32(int(four)), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    const __m256 mags = _mm256_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
    const float bs = g_tables.fp8[static_cast<const uint8_t*>(srow)[k >> 4]];
    const __m256 tbl = _mm256_mul_ps(_mm256_mul_ps(mags, _mm256_set1_ps(bs)), _mm256_set1_ps(w.nv_global));
    const __m256 mag = _mm256_permutevar8x32_ps(tbl, nib);  // uses the low 3 bits of each lane
    const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(nib, _mm256_set1_epi32(8)), 28));
    return _mm256_xor_ps(mag, sign);
  }
}

// NR weight rows x MR activation rows, the whole K.
template <ops::WeightFormat F, DType D, int NR, int MR>
void micro(const WView& w, int64_t n, const float* x, int64_t ldx, float* y, int64_t ldy, bool accumulate) {
  const int64_t K = w.K, K8 = K / 8 * 8;
  const uint8_t* rows[NR];
  const void* srows[NR];
  for (int i = 0; i < NR; ++i) {
    rows[i] = w.data + (n + i) * w.row_bytes;
    if constexpr (F == ops::WeightFormat::FP8Block128)
      srows[i] = w.fp8_scale + ((n + i) / 128) * w.fp8_scale_cols;
    else if constexpr (F == ops::WeightFormat::NVFP4)
      srows[i] = w.nv_scale + (n + i) * w.nv_scale_stride;
    else
      srows[i] = nullptr;
  }
  __m256 acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 xv[MR];
    for (int j = 0; j < MR; ++j) xv[j] = _mm256_loadu_ps(x + j * ldx + k);
    for (int i = 0; i < NR; ++i) {
      __m256 wv = load_w8<F, D>(w, rows[i], srows[i], k);
      for (int j = 0; j < MR; ++j) acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < NR; ++i) {
    for (int j = 0; j < MR; ++j) {
      float s = hsum8(acc[i][j]);
      for (int64_t k = K8; k < K; ++k) s = __builtin_fmaf(w_at(w, n + i, k), x[j * ldx + k], s);
      float* out = y + j * ldy + n + i;
      *out = accumulate ? *out + s : s;
    }
  }
}

template <ops::WeightFormat F, DType D, int MR>
void rows_mr(const WView& w, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t n0, int64_t n1,
             bool acc) {
  // register budget: NR * MR accumulators + MR activations + 1 weight vector <= 16 ymm
  constexpr int NR = MR == 1 ? 12 : MR == 2 ? 6 : MR == 3 ? 4 : 3;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) micro<F, D, NR, MR>(w, n, x, ldx, y, ldy, acc);
  for (; n < n1; ++n) micro<F, D, 1, MR>(w, n, x, ldx, y, ldy, acc);
}

template <ops::WeightFormat F, DType D>
void rows_avx2(const WView& w, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy, int64_t n0,
               int64_t n1, bool acc) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) rows_mr<F, D, 4>(w, x + m * ldx, ldx, y + m * ldy, ldy, n0, n1, acc);
  switch (M - m) {
    case 3: rows_mr<F, D, 3>(w, x + m * ldx, ldx, y + m * ldy, ldy, n0, n1, acc); break;
    case 2: rows_mr<F, D, 2>(w, x + m * ldx, ldx, y + m * ldy, ldy, n0, n1, acc); break;
    case 1: rows_mr<F, D, 1>(w, x + m * ldx, ldx, y + m * ldy, ldy, n0, n1, acc); break;
    default: break;
  }
}

#pragma GCC pop_options

using RowsFn = void (*)(const WView&, const float*, int64_t, int64_t, float*, int64_t, int64_t, int64_t, bool);

RowsFn pick_avx2(const WView& w) {
  switch (w.fmt) {
    case ops::WeightFormat::Dense:
      if (w.dtype == DType::F32) return rows_avx2<ops::WeightFormat::Dense, DType::F32>;
      if (w.dtype == DType::BF16) return rows_avx2<ops::WeightFormat::Dense, DType::BF16>;
      return rows_avx2<ops::WeightFormat::Dense, DType::F16>;
    case ops::WeightFormat::FP8Block128: return rows_avx2<ops::WeightFormat::FP8Block128, DType::F8_E4M3>;
    case ops::WeightFormat::NVFP4: return rows_avx2<ops::WeightFormat::NVFP4, DType::U8>;
  }
  return nullptr;
}

bool have_avx2() {
  static const bool ok = [] {
    if (const char* e = std::getenv("DFLASH2_CPU_GENERIC")) {
      if (e[0] == '1') return false;
    }
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return ok;
}
#else
bool have_avx2() { return false; }
#endif

}  // namespace

const char* gemm_isa() { return have_avx2() ? "avx2+fma+f16c" : "generic"; }

void linear(const Tensor& x, const ops::Weight& w, Tensor& y, bool accumulate) {
  WView v{};
  v.fmt = w.format;
  v.dtype = w.data.dtype();
  v.data = static_cast<const uint8_t*>(w.data.data());
  v.row_bytes = w.data.stride(0) * int64_t(w.data.itemsize());
  v.K = w.in_features;
  if (w.format == ops::WeightFormat::FP8Block128) {
    v.fp8_scale = w.scale.data_as<const float>();
    v.fp8_scale_cols = w.scale.stride(0);  // the row stride (a column slice keeps the full one)
  } else if (w.format == ops::WeightFormat::NVFP4) {
    v.nv_scale = static_cast<const uint8_t*>(w.scale.data());
    v.nv_scale_stride = w.scale.stride(0);
    v.nv_global = w.global_scale;
  }
  const int64_t M = x.shape(0), N = w.out_features;
  const float* xp = x.data_as<const float>();
  float* yp = y.data_as<float>();
  const int64_t ldx = x.stride(0), ldy = y.stride(0);
  if (M == 0 || N == 0) return;
#ifdef DFLASH2_X86
  RowsFn fn = have_avx2() ? pick_avx2(v) : rows_generic;
#else
  auto fn = rows_generic;
#endif
  // Threads split the output features (never K): the reduction order stays fixed. Panels
  // of 24 rows keep a weight panel in L2 while the activation rows stream past it.
  constexpr int64_t NB = 24;
  const int64_t panels = (N + NB - 1) / NB;
  const double work = double(M) * double(N) * double(w.in_features);
#pragma omp parallel for schedule(static) num_threads(threads()) if (work > 1 << 16)
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t n0 = p * NB, n1 = n0 + NB < N ? n0 + NB : N;
    fn(v, xp, ldx, M, yp, ldy, n0, n1, accumulate);
  }
}

// The tensor-core numerics (ops.h linear_bf16), emulated: x and W rounded to BF16 (kept
// as F32 / BF16 tensors, exact), then this backend's fp32 GEMM. BF16 weights are used as
// stored; any other format is dequantized (Weight::dequantize) and rounded per element.
// Allocates its rounded copies: an oracle and CPU-prefill path, not a decode hot path.
void gated_mlp_decode(const Tensor&, const ops::Weight&, const ops::Weight&, const ops::Weight&, Tensor&, bool,
                      bool& done) {
  done = false;
}

void linear_many(const Tensor&, const std::vector<const ops::Weight*>&, const std::vector<Tensor*>&, bool& done) {
  done = false;
}

void linear_silu_mul(const Tensor&, const ops::Weight&, const ops::Weight&, Tensor&, bool& done) { done = false; }

void linear_bf16_decode_many(const Tensor&, const std::vector<const ops::Weight*>&, const std::vector<Tensor*>&,
                             bool& done) {
  done = false;
}

void linear_bf16(const Tensor& x, const ops::Weight& w, Tensor& y, bool accumulate, bool /*decode: one kernel*/) {
  const int64_t M = x.shape(0), K = w.in_features;
  Tensor xr = Tensor::empty(DType::F32, {M, K});
  const float* xp = x.data_as<const float>();
  float* xo = xr.data_as<float>();
  const int64_t ldx = x.stride(0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xo[m * K + k] = bf16_to_f32(f32_to_bf16(xp[m * ldx + k]));
  if (w.format == ops::WeightFormat::Dense && w.data.dtype() == DType::BF16) return cpu::linear(xr, w, y, accumulate);
  const int64_t N = w.out_features;
  Tensor wb = Tensor::empty(DType::BF16, {N, K});
  uint16_t* wp = static_cast<uint16_t*>(wb.data());
  if (w.format == ops::WeightFormat::Dense) {  // F32 / F16 rows (any row stride)
    const DType dt = w.data.dtype();
    const int64_t es = int64_t(w.data.itemsize()), rb = w.data.stride(0) * es;
    const char* base = static_cast<const char*>(w.data.data());
#pragma omp parallel for schedule(static) num_threads(threads()) if (N * K > 1 << 16)
    for (int64_t r = 0; r < N; ++r)
      for (int64_t k = 0; k < K; ++k) wp[r * K + k] = f32_to_bf16(load_as_f32(base + r * rb + k * es, dt));
  } else {  // FP8 / NVFP4: the reference dequantization, then rounded
    const Tensor d = w.dequantize();
    const float* dp = d.data_as<const float>();
    const int64_t n = N * K;
    for (int64_t i = 0; i < n; ++i) wp[i] = f32_to_bf16(dp[i]);
  }
  cpu::linear(xr, ops::Weight::dense(wb, w.name), y, accumulate);
}

// The FP8 block-128 W8A8 numerics (ops.h linear_fp8), emulated: the activation codes and
// scales (fp8_quantize_rows), the weight's E4M3 codes as exact floats, then per 128-input
// block P_b = codes_x . codes_w through this backend's fp32 GEMM (the products are exact;
// only the sums round) and acc = fma(P_b, sa * sw, acc) in block order. Allocates its
// copies (one block of the weight at a time): an oracle and CPU-prefill path.
void linear_fp8(const Tensor& x, const ops::Weight& w, Tensor& y, bool accumulate) {
  const int64_t M = x.shape(0), K = w.in_features, N = w.out_features, nb = (K + 127) / 128;
  if (M == 0 || N == 0) return;
  Tensor q = Tensor::empty(DType::F32, {M, K});
  std::vector<float> sa(size_t(M * nb));
  fp8_quantize_rows(x, q.data_as<float>(), K, sa.data(), nb);
  std::vector<float> acc(size_t(M * N), 0.0f);
  Tensor wb = Tensor::empty(DType::F32, {N, std::min<int64_t>(K, 128)});
  Tensor part = Tensor::empty(DType::F32, {M, N});
  const uint8_t* wd = static_cast<const uint8_t*>(w.data.data());
  const int64_t wrs = w.data.stride(0);
  const float* ws = w.scale.data_as<const float>();
  const int64_t srs = w.scale.stride(0), scs = w.scale.stride(1);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t k0 = b * 128, kw = std::min(K, k0 + 128) - k0;
    Tensor wv = wb.slice(1, 0, kw);
    float* wo = wb.data_as<float>();
    const int64_t ldw = wb.stride(0);
#pragma omp parallel for schedule(static) num_threads(threads()) if (N * kw > 1 << 16)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < kw; ++k) wo[n * ldw + k] = fp8_e4m3_to_f32(wd[n * wrs + k0 + k]);
    cpu::linear(q.slice(1, k0, k0 + kw), ops::Weight::dense(wv, w.name), part, false);
    const float* pp = part.data_as<const float>();
#pragma omp parallel for schedule(static) num_threads(threads()) if (M * N > 1 << 16)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        const float s = sa[size_t(m * nb + b)] * ws[(n / 128) * srs + b * scs];
        float& a = acc[size_t(m * N + n)];
        a = std::fma(pp[m * N + n], s, a);
      }
  }
  float* yp = y.data_as<float>();
  const int64_t ldy = y.stride(0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float& o = yp[m * ldy + n];
      o = accumulate ? o + acc[size_t(m * N + n)] : acc[size_t(m * N + n)];
    }
}

// The NVFP4 W4A4 numerics (ops.h linear_nvfp4), emulated: the activations quantized as the
// Blackwell GEMM quantizes them (nvfp4_quantize_act, dequantized), then the exact GEMM over
// the weight's own dequantization. Allocates the quantized copy: an oracle and CPU path.
void linear_nvfp4(const Tensor& x, const ops::Weight& w, Tensor& y, bool accumulate) {
  Tensor xq = Tensor::empty(DType::F32, {x.shape(0), x.shape(1)});
  cpu::nvfp4_quantize_act(x, w.input_scale, xq);
  cpu::linear(xq, w, y, accumulate);
}

void linear_heads(const Tensor& x, const Tensor& w, Tensor& y) {
  const int64_t G = x.shape(1);
  for (int64_t g = 0; g < G; ++g) {
    const ops::Weight wg = ops::Weight::dense(w.select(0, g));
    Tensor yg = y.select(1, g);
    cpu::linear(x.select(1, g), wg, yg, false);
  }
}

}  // namespace dflash2::cpu
