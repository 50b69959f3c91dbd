// cuda/index_rows.cu: rows moved by a device index tensor on the CUDA backend:
// gather_rows (also what ops::embedding runs), embedding_shard (a vocabulary shard's
// embedding) and cache_write (paged cache rows).
//
// Status: compiled for sm_90a/sm_100a/sm_103a, NOT yet run on a GPU. Checked against the
// CPU backend by tests/test_ops.py and tests/cpp/test_cuda_backend.cpp when a GPU is
// present (bench/device_check.sh).
//
//   gather_rows  out[t, :] = float(src[idx[t], :]); src F32 / BF16 / F16 [N, D] with
//                contiguous rows (any row stride), idx I32 / I64 [T] (any stride), out F32
//                [T, D] (any row stride). Bitwise the CPU's result (F32 rows are moved,
//                BF16 / F16 widening is exact).
//   embedding_shard  out[t, :] = float(table[ids[t] - first, :]) when 0 <= ids[t] - first
//                < Vs (the shard holds that row), else a row of zeros: the normal case for
//                the other shards' ids, so not an index error. Same kernel as gather_rows
//                (table F32 / BF16 / F16 [Vs, D], ids I32 / I64 [T], out F32 [T, D]);
//                first >= 0. Bitwise the CPU's result.
//   resolve_tokens  tokens[i] = src[-tokens[i] - 1] where tokens[i] < 0 (I32, in place; src
//                I32 contiguous, read flat); a reference outside src stays negative (the
//                embedding reading it then counts an index error). Bitwise the CPU's result.
//   cache_write  cache[slots[t], :] = src[t, :]; src F32 [T, D], cache F32 [rows, D] (any
//                row strides), slots I32 [T] (any stride). A negative slot skips its row
//                (padding), as on the CPU. Bitwise the CPU's result. An FP8 cache (U8
//                [rows, fp8_bytes(D)], ops/kv_fp8.h) takes a warp per (row, group of up to
//                128 values): the group's amax by shuffles, its power-of-two scale and the
//                E4M3 codes by kv_fp8.h's integer encoder (the CPU's), so bitwise the CPU's
//                bytes; cache_write_many with an FP8 cache among its pairs runs every pair
//                that way (BF16 / F32 pairs in units of 128 values), one launch.
//
// Index values live on the device, so a kernel cannot raise the CPU backend's
// InvalidArgument for a bad one. Instead (and never touching memory out of bounds):
//   - gather_rows: an id outside [0, N) writes a row of zeros;
//   - cache_write: a slot >= rows is skipped, like a negative one;
// and each such row adds 1 to a per-device error counter (a __device__ variable of this
// file) that cuda::index_errors(device, reset) reads back (cuda_api.h).
// Ids / slots repeated inside one cache_write call (never produced by the planner) land in
// an unspecified order (the CPU's last write wins; here any of them may).
//
// Mapping: grid x covers a row (16-byte vectors of 4 elements when D, the row strides and
// the pointers allow it, else one element per thread), grid y walks the index entries
// (grid-stride past 65535). Each thread reads the index of its row (a broadcast load) and
// moves its elements; reads and writes of one row are coalesced.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "backend/cuda/cuda_api.h"
#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/layout.h"
#include "dflash2/error.h"
#include "ops/kv_fp8.h"

namespace dflash2::cuda {

namespace {

using detail::Vec;

__device__ unsigned long long g_index_errors = 0;

constexpr int kThreads = 256;

// kShard (embedding_shard): row id - first, where ids outside the shard give zero rows
// without counting an error; first >= 0, so id - first cannot overflow once id >= first.
template <class TS, class TI, int G, bool kShard>
__global__ void __launch_bounds__(kThreads)
    gather_rows_kernel(const TS* __restrict__ src, int64_t src_stride, int64_t N, const TI* __restrict__ idx,
                       int64_t idx_stride, int64_t first, float* __restrict__ out, int64_t out_stride, int64_t T,
                       int64_t nvec) {
  detail::pdl_enter();
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= nvec) return;
  for (int64_t t = blockIdx.y; t < T; t += gridDim.y) {
    const int64_t raw = int64_t(idx[t * idx_stride]);
    const bool held = kShard ? raw >= first : true;
    const int64_t id = kShard ? raw - (held ? first : 0) : raw;
    Vec<float, G> o;
    if (held && layout::row_in_range(id, N)) {
      const Vec<TS, G> s = reinterpret_cast<const Vec<TS, G>*>(src + id * src_stride)[j];
#pragma unroll
      for (int k = 0; k < G; ++k) o.v[k] = detail::to_f32(s.v[k]);
    } else {
#pragma unroll
      for (int k = 0; k < G; ++k) o.v[k] = 0.0f;
      if (!kShard && j == 0) atomicAdd(&g_index_errors, 1ull);
    }
    reinterpret_cast<Vec<float, G>*>(out + t * out_stride)[j] = o;
  }
}

// C = float: G values per thread copied as one vector; C = __nv_bfloat16 (a BF16 cache):
// each value rounded to nearest even (as the CPU's f32_to_bf16).
template <int G, class C>
__global__ void __launch_bounds__(kThreads)
    cache_write_kernel(const float* __restrict__ src, int64_t src_stride, const int32_t* __restrict__ slots,
                       int64_t slot_stride, C* __restrict__ cache, int64_t cache_stride, int64_t rows, int64_t T,
                       int64_t nvec) {
  detail::pdl_enter();
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= nvec) return;
  for (int64_t t = blockIdx.y; t < T; t += gridDim.y) {
    const int64_t s = slots[t * slot_stride];
    if (s < 0) continue;  // padding
    if (!layout::row_in_range(s, rows)) {
      if (j == 0) atomicAdd(&g_index_errors, 1ull);
      continue;
    }
    if constexpr (std::is_same_v<C, float>) {
      reinterpret_cast<Vec<float, G>*>(cache + s * cache_stride)[j] =
          reinterpret_cast<const Vec<float, G>*>(src + t * src_stride)[j];
    } else {
      const float* from = src + t * src_stride + j * G;
      C* to = cache + s * cache_stride + j * G;
#pragma unroll
      for (int g = 0; g < G; ++g) to[g] = __float2bfloat16_rn(from[g]);
    }
  }
}

// cache_write_many: up to kCacheMany (src, cache) pairs with one slots vector; pair k owns
// the columns [k ? end[k - 1] : 0, end[k]) of the launch's concatenated rows (value by value).
constexpr int kCacheMany = 4;
struct CacheTarget {
  const float* src;
  int64_t src_stride;
  void* cache;  // float or __nv_bfloat16 (bf16)
  int64_t cache_stride, rows, end;
  bool bf16;
};
struct CacheTargets {
  CacheTarget t[kCacheMany];
  int n;
};

__global__ void __launch_bounds__(kThreads)
    cache_write_many_kernel(const __grid_constant__ CacheTargets tg, const int32_t* __restrict__ slots,
                            int64_t slot_stride, int64_t T) {
  detail::pdl_enter();
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= tg.t[tg.n - 1].end) return;
  int k = 0;
  while (j >= tg.t[k].end) ++k;
  const CacheTarget& c = tg.t[k];
  const int64_t col = j - (k ? tg.t[k - 1].end : 0);
  for (int64_t t = blockIdx.y; t < T; t += gridDim.y) {
    const int64_t s = slots[t * slot_stride];
    if (s < 0) continue;  // padding
    if (!layout::row_in_range(s, c.rows)) {
      if (col == 0) atomicAdd(&g_index_errors, 1ull);  // once per pair and row, as cache_write
      continue;
    }
    const float v = c.src[t * c.src_stride + col];
    if (c.bf16)
      static_cast<__nv_bfloat16*>(c.cache)[s * c.cache_stride + col] = __float2bfloat16_rn(v);
    else
      static_cast<float*>(c.cache)[s * c.cache_stride + col] = v;
  }
}

// A warp per (row, unit): an FP8 pair's unit is one quantization group (kvfp8::group(D)
// values), an F32 / BF16 pair's 128 values; lane l takes the unit's values 4l .. 4l + 3.
struct WarpTarget {
  const float* src;
  int64_t src_stride;
  void* cache;  // float, __nv_bfloat16 or uint8_t (FP8 rows)
  int64_t cache_stride, rows, end;  // end: the cumulative unit count through this pair
  int D, unit, kind;                // kind: 0 F32, 1 BF16, 2 FP8
};
struct WarpTargets {
  WarpTarget t[kCacheMany];
  int n;
};
constexpr int kUnit = 128;
static_assert(kUnit == 4 * 32 && kvfp8::kMaxGroup <= kUnit, "a warp's lanes take 4 values of a unit each");

__global__ void __launch_bounds__(kThreads)
    cache_write_warp_kernel(const __grid_constant__ WarpTargets tg, const int32_t* __restrict__ slots,
                            int64_t slot_stride, int64_t T) {
  detail::pdl_enter();
  const int lane = threadIdx.x & 31;
  const int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (w >= tg.t[tg.n - 1].end) return;  // uniform over the warp
  int k = 0;
  while (w >= tg.t[k].end) ++k;
  const WarpTarget& c = tg.t[k];
  const int u = int(w - (k ? tg.t[k - 1].end : 0));
  const int c0 = u * c.unit, len = c.D - c0 < c.unit ? c.D - c0 : c.unit;
  for (int64_t t = blockIdx.y; t < T; t += gridDim.y) {
    const int64_t s = slots[t * slot_stride];
    if (s < 0) continue;  // padding (uniform over the warp)
    if (!layout::row_in_range(s, c.rows)) {
      if (u == 0 && lane == 0) atomicAdd(&g_index_errors, 1ull);  // once per pair and row, as cache_write
      continue;
    }
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = 4 * lane + j < len ? c.src[t * c.src_stride + c0 + 4 * lane + j] : 0.0f;
    if (c.kind == 2) {
      float amax = 0.0f;  // over the finite values (a non-finite one is stored as NaN)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float a = fabsf(v[j]);
        amax = a <= 3.4028235e38f && a > amax ? a : amax;
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        const float o = __shfl_xor_sync(0xffffffffu, amax, off);
        amax = o > amax ? o : amax;
      }
      const int e = kvfp8::scale_exp(amax);
      const float inv = kvfp8::pow2(-e);
      uint8_t* row = static_cast<uint8_t*>(c.cache) + s * c.cache_stride;
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (4 * lane + j < len) row[c0 + 4 * lane + j] = kvfp8::e4m3_encode(v[j] * inv);
      float* sc = reinterpret_cast<float*>(row + c.D);
      if (lane == 0) sc[u] = kvfp8::pow2(e);
      const int ng = c.D / c.unit, pad = int(kvfp8::scale_bytes(c.D) / 4) - ng;
      if (u == 0 && lane >= 1 && lane <= pad) sc[ng + lane - 1] = 0.0f;  // the scales' padding
    } else if (c.kind == 1) {
      __nv_bfloat16* row = static_cast<__nv_bfloat16*>(c.cache) + s * c.cache_stride;
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (4 * lane + j < len) row[c0 + 4 * lane + j] = __float2bfloat16_rn(v[j]);
    } else {
      float* row = static_cast<float*>(c.cache) + s * c.cache_stride;
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (4 * lane + j < len) row[c0 + 4 * lane + j] = v[j];
    }
  }
}

dim3 rows_grid(int64_t nvec, int64_t T, int threads) {
  return dim3(detail::ceil_blocks(nvec, threads, int64_t(INT32_MAX)),
              unsigned(T < detail::kMaxGridY ? T : detail::kMaxGridY));
}

template <class TS, class TI, bool kShard>
void launch_gather(const Tensor& src, const Tensor& idx, int64_t first, Tensor& out, int64_t out_stride) {
  const int64_t T = idx.shape(0), N = src.shape(0), D = src.shape(1);
  const TS* sp = src.data_as<const TS>();
  const TI* ip = idx.data_as<const TI>();
  float* op = out.data_as<float>();
  const bool vec = D % 4 == 0 && src.stride(0) % 4 == 0 && out_stride % 4 == 0 &&
                   detail::aligned(sp, sizeof(Vec<TS, 4>)) && detail::aligned(op, 16);
  const int64_t nvec = vec ? D / 4 : D;
  const int threads = detail::pick_threads(nvec, kThreads);
  const dim3 grid = rows_grid(nvec, T, threads);
  if (vec)
    gather_rows_kernel<TS, TI, 4, kShard><<<grid, threads, 0, detail::stream()>>>(sp, src.stride(0), N, ip,
                                                                                  idx.stride(0), first, op,
                                                                                  out_stride, T, nvec);
  else
    gather_rows_kernel<TS, TI, 1, kShard><<<grid, threads, 0, detail::stream()>>>(sp, src.stride(0), N, ip,
                                                                                  idx.stride(0), first, op,
                                                                                  out_stride, T, nvec);
}

template <class TS, bool kShard = false>
void gather_by_index(const Tensor& src, const Tensor& idx, Tensor& out, int64_t out_stride, int64_t first = 0) {
  if (idx.dtype() == DType::I64)
    launch_gather<TS, int64_t, kShard>(src, idx, first, out, out_stride);
  else
    launch_gather<TS, int32_t, kShard>(src, idx, first, out, out_stride);
}

// The host-side checks of embedding_shard (those of gather_rows; `op` names the caller).
layout::RowLayout check_gather(const Tensor& src, const Tensor& idx, const Tensor& out, const char* op) {
  DFLASH2_CHECK_ARG(src.defined() && idx.defined() && out.defined(), "cuda::", op, ": undefined tensor argument");
  DFLASH2_CHECK_ARG(src.device().is_cuda() && idx.device() == src.device() && out.device() == src.device(), "cuda::",
                    op, ": the table, the ids and out must be on the same CUDA device, found ", src.describe(), ", ",
                    idx.describe(), ", ", out.describe());
  DFLASH2_CHECK_ARG(src.ndim() == 2 && (src.stride(1) == 1 || src.shape(1) == 1), "cuda::", op,
                    ": the table must be [N, D] with contiguous rows, found ", src.describe());
  DFLASH2_CHECK_ARG(idx.ndim() == 1 && (idx.dtype() == DType::I32 || idx.dtype() == DType::I64), "cuda::", op,
                    ": ids must be I32 or I64 [T], found ", idx.describe());
  DFLASH2_CHECK_ARG(out.dtype() == DType::F32 && out.ndim() == 2 && out.shape(0) == idx.shape(0) &&
                        out.shape(1) == src.shape(1),
                    "cuda::", op, ": out must be F32 [", idx.shape(0), ", ", src.shape(1), "], found ",
                    out.describe());
  DFLASH2_CHECK_ARG(src.dtype() == DType::F32 || src.dtype() == DType::BF16 || src.dtype() == DType::F16, "cuda::",
                    op, ": the table must be F32, BF16 or F16, found ", src.describe());
  const layout::RowLayout lo = layout::row_layout(out, op, "out");
  layout::check_rows_disjoint(lo, op, "out");
  return lo;
}

}  // namespace

uint64_t index_errors(int device, bool reset) {
  DFLASH2_CHECK_ARG(device >= 0 && device < device_count(), "cuda::index_errors: device cuda:", device,
                    " does not exist");
  detail::DeviceGuard guard(device);
  DFLASH2_CUDA_CHECK(cudaDeviceSynchronize(), "cuda:", device);
  unsigned long long v = 0;
  DFLASH2_CUDA_CHECK(cudaMemcpyFromSymbol(&v, g_index_errors, sizeof(v)), "cuda:", device);
  if (reset) {
    const unsigned long long zero = 0;
    DFLASH2_CUDA_CHECK(cudaMemcpyToSymbol(g_index_errors, &zero, sizeof(zero)), "cuda:", device);
    // the reset runs on the legacy default stream and a pageable copy may return before it
    // lands: finish it before kernels on non-blocking streams can count again
    DFLASH2_CUDA_CHECK(cudaDeviceSynchronize(), "cuda:", device);
  }
  return uint64_t(v);
}

void gather_rows(const Tensor& src, const Tensor& idx, Tensor& out) {
  DFLASH2_CHECK_ARG(src.defined() && idx.defined() && out.defined(), "cuda::gather_rows: undefined tensor argument");
  DFLASH2_CHECK_ARG(src.device().is_cuda() && idx.device() == src.device() && out.device() == src.device(),
                    "cuda::gather_rows: src, idx and out must be on the same CUDA device, found ", src.describe(), ", ",
                    idx.describe(), ", ", out.describe());
  DFLASH2_CHECK_ARG(src.ndim() == 2 && (src.stride(1) == 1 || src.shape(1) == 1),
                    "cuda::gather_rows: src must be [N, D] with contiguous rows, found ", src.describe());
  DFLASH2_CHECK_ARG(idx.ndim() == 1 && (idx.dtype() == DType::I32 || idx.dtype() == DType::I64),
                    "cuda::gather_rows: idx must be I32 or I64 [T], found ", idx.describe());
  DFLASH2_CHECK_ARG(out.dtype() == DType::F32 && out.ndim() == 2 && out.shape(0) == idx.shape(0) &&
                        out.shape(1) == src.shape(1),
                    "cuda::gather_rows: out must be F32 [", idx.shape(0), ", ", src.shape(1), "], found ",
                    out.describe());
  const layout::RowLayout lo = layout::row_layout(out, "gather_rows", "out");
  layout::check_rows_disjoint(lo, "gather_rows", "out");
  if (lo.rows == 0 || lo.cols == 0) return;
  detail::DeviceGuard guard(src.device().index);
  switch (src.dtype()) {
    case DType::F32: gather_by_index<float>(src, idx, out, lo.stride); break;
    case DType::BF16: gather_by_index<__nv_bfloat16>(src, idx, out, lo.stride); break;
    case DType::F16: gather_by_index<__half>(src, idx, out, lo.stride); break;
    default: fail(ErrorKind::InvalidArgument, "cuda::gather_rows: src must be F32, BF16 or F16, found ", src.describe());
  }
  detail::check_launch("gather_rows kernel launch", src.describe(), " by ", idx.describe());
}

namespace {
__global__ void __launch_bounds__(kThreads) resolve_tokens_kernel(int32_t* tokens, int64_t T, const int32_t* src,
                                                                   int64_t n) {
  detail::pdl_enter();
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < T; i += int64_t(gridDim.x) * kThreads) {
    const int32_t t = tokens[i];
    if (t >= 0) continue;
    const int64_t j = -int64_t(t) - 1;
    if (j < n) tokens[i] = src[j];
  }
}
}  // namespace

void resolve_tokens(Tensor& tokens, const Tensor& src) {
  DFLASH2_CHECK_ARG(tokens.defined() && src.defined(), "cuda::resolve_tokens: undefined tensor argument");
  DFLASH2_CHECK_ARG(tokens.device().is_cuda() && src.device() == tokens.device(),
                    "cuda::resolve_tokens: tokens and src must be on the same CUDA device, found ", tokens.describe(),
                    " and ", src.describe());
  DFLASH2_CHECK_ARG(tokens.dtype() == DType::I32 && tokens.ndim() == 1 && (tokens.stride(0) == 1 || tokens.shape(0) <= 1),
                    "cuda::resolve_tokens: tokens must be contiguous I32 [T], found ", tokens.describe());
  DFLASH2_CHECK_ARG(src.dtype() == DType::I32 && src.is_contiguous(),
                    "cuda::resolve_tokens: src must be contiguous I32, found ", src.describe());
  const int64_t T = tokens.shape(0);
  if (T == 0) return;
  detail::DeviceGuard guard(tokens.device().index);
  const int blocks = int(std::min<int64_t>((T + kThreads - 1) / kThreads, 1024));
  resolve_tokens_kernel<<<blocks, kThreads, 0, detail::stream()>>>(tokens.data_as<int32_t>(), T,
                                                                    src.data_as<const int32_t>(), src.numel());
  detail::check_launch("resolve_tokens kernel launch", tokens.describe(), " from ", src.describe());
}

namespace {
// One thread per (sequence, row j <= K): the rows of a sequence past its draft length and
// out-of-range rows or drafts are skipped (the CPU op reports them).
__global__ void __launch_bounds__(kThreads)
    next_after_accept_kernel(const int32_t* row0, int64_t s0, const int32_t* draft_row, int64_t s1,
                             const int32_t* draft_len, int64_t s2, const int32_t* accepted, int64_t s3,
                             const int32_t* bonus, int64_t s4, const int32_t* drafts, int64_t N, int64_t K,
                             int64_t ds, int32_t* next, int64_t T, int32_t* last, int64_t s5, int64_t S) {
  detail::pdl_enter();
  const int64_t per = K + 1;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < S * per; i += int64_t(gridDim.x) * kThreads) {
    const int64_t k = i / per, j = i - k * per;
    const int64_t r0 = row0[k * s0], n = draft_len[k * s2], a = accepted[k * s3], dr = draft_row[k * s1];
    if (j == 0 && r0 >= 0 && a >= 0 && a <= n && r0 + a < T) last[k * s5] = int32_t(r0 + a);
    if (j > n || r0 < 0 || r0 + j >= T) continue;
    int32_t t = bonus[k * s4];
    if (j < a) {
      if (dr < 0 || dr >= N || j >= K) continue;
      t = drafts[dr * ds + j];
    }
    next[r0 + j] = t;
  }
}
}  // namespace

void next_after_accept(const Tensor& row0, const Tensor& draft_row, const Tensor& draft_len, const Tensor& accepted,
                       const Tensor& bonus, const Tensor& drafts, Tensor& next, Tensor& last) {
  const int64_t S = row0.shape(0);
  if (S == 0) return;
  const int64_t K = drafts.shape(1), total = S * (K + 1);
  detail::DeviceGuard guard(row0.device().index);
  const int blocks = int(std::min<int64_t>((total + kThreads - 1) / kThreads, 1024));
  next_after_accept_kernel<<<blocks, kThreads, 0, detail::stream()>>>(
      row0.data_as<const int32_t>(), row0.stride(0), draft_row.data_as<const int32_t>(), draft_row.stride(0),
      draft_len.data_as<const int32_t>(), draft_len.stride(0), accepted.data_as<const int32_t>(), accepted.stride(0),
      bonus.data_as<const int32_t>(), bonus.stride(0), drafts.data_as<const int32_t>(), drafts.shape(0), K,
      drafts.stride(0), next.data_as<int32_t>(), next.shape(0), last.data_as<int32_t>(), last.stride(0), S);
  detail::check_launch("next_after_accept kernel launch", row0.describe(), " ", drafts.describe());
}

namespace {
// One thread per sequence: the greedy prefix against the target's ids (rows clamped into
// [0, M), the draft row into [0, N), the length into [0, K]: device data cannot raise).
__global__ void __launch_bounds__(kThreads)
    accept_greedy_kernel(const int32_t* ids, int64_t is, int64_t M, const int32_t* row0, int64_t s0,
                         const int32_t* draft, int64_t N, int64_t K, int64_t ds, const int32_t* draft_row, int64_t s1,
                         const int32_t* draft_len, int64_t s2, int32_t* accepted, int64_t s3, int32_t* bonus,
                         int64_t s4, int64_t S) {
  detail::pdl_enter();
  for (int64_t s = int64_t(blockIdx.x) * kThreads + threadIdx.x; s < S; s += int64_t(gridDim.x) * kThreads) {
    const int64_t base = row0[s * s0];
    int64_t L = draft_len[s * s2];
    L = L < 0 ? 0 : L > K ? K : L;
    int64_t dr = draft_row[s * s1];
    dr = dr < 0 ? 0 : dr >= N ? N - 1 : dr;
    auto id = [&](int64_t j) {
      int64_t row = base + j;
      row = row < 0 ? 0 : row >= M ? M - 1 : row;
      return ids[row * is];
    };
    int64_t a = 0;
    while (a < L && draft[dr * ds + a] == id(a)) ++a;
    accepted[s * s3] = int32_t(a);
    bonus[s * s4] = id(a);
  }
}
}  // namespace

void accept_greedy(const Tensor& ids, const Tensor& row0, const Tensor& draft, const Tensor& draft_row,
                   const Tensor& draft_len, Tensor& accepted, Tensor& bonus) {
  for (const Tensor* t :
       std::initializer_list<const Tensor*>{&ids, &row0, &draft, &draft_row, &draft_len, &accepted, &bonus})
    DFLASH2_CHECK_ARG(t->defined() && t->device().is_cuda() && t->device() == ids.device() && t->dtype() == DType::I32,
                      "cuda::accept_greedy: every argument must be I32 on the same CUDA device, found ",
                      t->defined() ? t->describe() : std::string("<undefined>"));
  DFLASH2_CHECK_ARG(draft.ndim() == 2 && (draft.stride(1) == 1 || draft.shape(1) <= 1),
                    "cuda::accept_greedy: draft must be I32 [N, K] with contiguous rows, found ", draft.describe());
  const int64_t S = row0.shape(0), M = ids.shape(0);
  if (S == 0) return;
  DFLASH2_CHECK_ARG(M >= 1 && (draft.shape(0) >= 1 || draft.shape(1) == 0),
                    "cuda::accept_greedy: no target rows (", ids.describe(), ") or drafts (", draft.describe(), ")");
  detail::DeviceGuard guard(ids.device().index);
  const int blocks = int(std::min<int64_t>((S + kThreads - 1) / kThreads, 1024));
  accept_greedy_kernel<<<blocks, kThreads, 0, detail::stream()>>>(
      ids.data_as<const int32_t>(), ids.stride(0), M, row0.data_as<const int32_t>(), row0.stride(0),
      draft.data_as<const int32_t>(), std::max<int64_t>(draft.shape(0), 1), draft.shape(1), draft.stride(0),
      draft_row.data_as<const int32_t>(), draft_row.stride(0), draft_len.data_as<const int32_t>(), draft_len.stride(0),
      accepted.data_as<int32_t>(), accepted.stride(0), bonus.data_as<int32_t>(), bonus.stride(0), S);
  detail::check_launch("accept_greedy kernel launch", ids.describe(), " ", draft.describe());
}

void embedding_shard(const Tensor& table, const Tensor& ids, int64_t first, Tensor& out) {
  const layout::RowLayout lo = check_gather(table, ids, out, "embedding_shard");
  DFLASH2_CHECK_ARG(first >= 0, "cuda::embedding_shard: first must be >= 0, found ", first);
  if (lo.rows == 0 || lo.cols == 0) return;
  detail::DeviceGuard guard(table.device().index);
  switch (table.dtype()) {
    case DType::F32: gather_by_index<float, true>(table, ids, out, lo.stride, first); break;
    case DType::BF16: gather_by_index<__nv_bfloat16, true>(table, ids, out, lo.stride, first); break;
    default: gather_by_index<__half, true>(table, ids, out, lo.stride, first); break;  // F16 (checked)
  }
  detail::check_launch("embedding_shard kernel launch", table.describe(), " by ", ids.describe(), " from ", first);
}

void cache_write(const Tensor& src, const Tensor& slots, Tensor& cache) {
  DFLASH2_CHECK_ARG(src.defined() && slots.defined() && cache.defined(), "cuda::cache_write: undefined tensor argument");
  DFLASH2_CHECK_ARG(src.device().is_cuda() && slots.device() == src.device() && cache.device() == src.device(),
                    "cuda::cache_write: src, slots and cache must be on the same CUDA device, found ", src.describe(),
                    ", ", slots.describe(), ", ", cache.describe());
  DFLASH2_CHECK_ARG(src.dtype() == DType::F32 &&
                        (cache.dtype() == DType::F32 || cache.dtype() == DType::BF16 || cache.dtype() == DType::U8) &&
                        src.ndim() == 2 && cache.ndim() == 2,
                    "cuda::cache_write: src must be F32 [rows, D] and cache F32 or BF16 [rows, D] (or U8 FP8 rows), "
                    "found ", src.describe(), " and ", cache.describe());
  DFLASH2_CHECK_ARG(slots.dtype() == DType::I32 && slots.ndim() == 1 && slots.shape(0) == src.shape(0),
                    "cuda::cache_write: slots must be I32 [", src.shape(0), "], found ", slots.describe());
  if (cache.dtype() == DType::U8) {
    bool done = false;
    const Tensor* sp = &src;
    Tensor* cp = &cache;
    cache_write_many({sp}, slots, {cp}, done);
    DFLASH2_CHECK_ARG(done, "cuda::cache_write: src ", src.describe(), " overlaps the FP8 cache ", cache.describe());
    return;
  }
  DFLASH2_CHECK_ARG(src.shape(1) == cache.shape(1), "cuda::cache_write: src rows have ", src.shape(1),
                    " values but cache rows have ", cache.shape(1));
  const layout::RowLayout ls = layout::row_layout(src, "cache_write", "src");
  const layout::RowLayout lc = layout::row_layout(cache, "cache_write", "cache");
  layout::check_rows_disjoint(lc, "cache_write", "cache");
  const int64_t T = src.shape(0), D = src.shape(1), rows = cache.shape(0);
  if (T == 0 || D == 0) return;
  const int64_t src_stride = ls.stride, cache_stride = lc.stride;
  const float* sp = src.data_as<const float>();
  const bool bf16 = cache.dtype() == DType::BF16;
  // 4 values per thread where the rows allow it (16-byte float vectors; a BF16 cache is
  // written value by value)
  const bool vec = D % 4 == 0 && src_stride % 4 == 0 && detail::aligned(sp, 16) &&
                   (bf16 || (cache_stride % 4 == 0 && detail::aligned(cache.data(), 16)));
  const int64_t nvec = vec ? D / 4 : D;
  const int threads = detail::pick_threads(nvec, kThreads);
  const dim3 grid = rows_grid(nvec, T, threads);
  detail::DeviceGuard guard(src.device().index);
  auto launch = [&](auto* cp) {
    using C = std::remove_pointer_t<decltype(cp)>;
    const int32_t* sl = slots.data_as<const int32_t>();
    if (vec)
      cache_write_kernel<4, C><<<grid, threads, 0, detail::stream()>>>(sp, src_stride, sl, slots.stride(0), cp,
                                                                       cache_stride, rows, T, nvec);
    else
      cache_write_kernel<1, C><<<grid, threads, 0, detail::stream()>>>(sp, src_stride, sl, slots.stride(0), cp,
                                                                       cache_stride, rows, T, nvec);
  };
  if (bf16)
    launch(static_cast<__nv_bfloat16*>(cache.data()));
  else
    launch(cache.data_as<float>());
  detail::check_launch("cache_write kernel launch", src.describe(), " into ", cache.describe());
}

namespace {
// One (src, cache) pair of cache_write_many, checked: src F32 [T, D] and the cache on slots'
// device, the cache F32 / BF16 [rows, D] or U8 FP8 rows [rows, fp8_bytes(D)]; its D, its
// kind (0 F32, 1 BF16, 2 FP8) and the two row strides.
struct CachePair {
  int64_t D, src_stride, cache_stride;
  int kind;
};
CachePair check_cache_pair(const Tensor* sp, const Tensor* cp, const Tensor& slots, int64_t T, const char* op) {
  DFLASH2_CHECK_ARG(sp && cp, op, ": null tensor");
  const Tensor &src = *sp, &cache = *cp;
  DFLASH2_CHECK_ARG(src.device() == slots.device() && cache.device() == slots.device(), op,
                    ": src, slots and cache must be on the same CUDA device, found ", src.describe(), ", ",
                    slots.describe(), ", ", cache.describe());
  const bool fp8 = cache.dtype() == DType::U8;
  const int64_t D = src.ndim() == 2 ? src.shape(1) : -1;
  DFLASH2_CHECK_ARG(src.dtype() == DType::F32 && src.ndim() == 2 && cache.ndim() == 2 && src.shape(0) == T &&
                        (cache.dtype() == DType::F32 || cache.dtype() == DType::BF16 || fp8) &&
                        (fp8 ? kvfp8::fits(D) && cache.shape(1) == kvfp8::fp8_bytes(D) : D == cache.shape(1)),
                    op, ": src must be F32 [", T, ", D] and cache F32 or BF16 [rows, D] or U8 [rows, fp8_bytes(D)] ",
                    "(ops/kv_fp8.h), found ", src.describe(), " and ", cache.describe());
  DFLASH2_CHECK_ARG(D <= INT32_MAX, op, ": rows of ", D, " values are too long");
  const layout::RowLayout ls = layout::row_layout(src, "cache_write_many", "src");
  const layout::RowLayout lc = layout::row_layout(cache, "cache_write_many", "cache");
  layout::check_rows_disjoint(lc, "cache_write_many", "cache");
  return CachePair{D, ls.stride, lc.stride, fp8 ? 2 : cache.dtype() == DType::BF16 ? 1 : 0};
}
// Whether the pairs can be written in any order: no cache shares an element with another cache
// or any source.
bool pairs_disjoint(const std::vector<const Tensor*>& srcs, const std::vector<Tensor*>& caches) {
  for (size_t i = 0; i < caches.size(); ++i)
    for (size_t j = 0; j < srcs.size(); ++j)
      if ((j < i && !layout::views_disjoint(*caches[i], *caches[j])) || !layout::views_disjoint(*caches[i], *srcs[j]))
        return false;
  return true;
}

// cache_write_many's pairs when one of them is an FP8 cache: every pair in warp units, one
// launch (cache_write_warp_kernel); done stays false where the pairs overlap (one by one then).
void cache_write_warps(const std::vector<const Tensor*>& srcs, const Tensor& slots, const std::vector<Tensor*>& caches,
                       bool& done) {
  const char* op = "cuda::cache_write_many";
  const int64_t T = slots.shape(0);
  WarpTargets tg{};
  int64_t units = 0;
  for (size_t i = 0; i < srcs.size(); ++i) {
    const CachePair pr = check_cache_pair(srcs[i], caches[i], slots, T, op);
    if (pr.D == 0 || T == 0) continue;
    const int unit = pr.kind == 2 ? int(kvfp8::group(pr.D)) : kUnit;
    units += (pr.D + unit - 1) / unit;
    tg.t[tg.n++] = WarpTarget{srcs[i]->data_as<const float>(), pr.src_stride, caches[i]->data(), pr.cache_stride,
                              caches[i]->shape(0), units, int(pr.D), unit, pr.kind};
  }
  if (!pairs_disjoint(srcs, caches)) return;
  done = true;
  if (tg.n == 0) return;
  detail::DeviceGuard guard(slots.device().index);
  const int threads = kThreads;
  static_assert(kThreads % 32 == 0, "whole warps");
  const dim3 grid = rows_grid(units * 32, T, threads);
  cache_write_warp_kernel<<<grid, threads, 0, detail::stream()>>>(tg, slots.data_as<const int32_t>(), slots.stride(0),
                                                                  T);
  detail::check_launch("cache_write (FP8) kernel launch", srcs[0]->describe(), " into ", caches[0]->describe());
}
}  // namespace

void cache_write_many(const std::vector<const Tensor*>& srcs, const Tensor& slots, const std::vector<Tensor*>& caches,
                      bool& done) {
  done = false;
  const char* op = "cuda::cache_write_many";
  DFLASH2_CHECK_ARG(srcs.size() == caches.size() && slots.defined(), op, ": bad arguments");
  if (srcs.empty() || srcs.size() > size_t(kCacheMany)) return;  // ops::cache_write_many: one by one
  DFLASH2_CHECK_ARG(slots.device().is_cuda() && slots.dtype() == DType::I32 && slots.ndim() == 1, op,
                    ": slots must be I32 [T] on a CUDA device, found ", slots.describe());
  const int64_t T = slots.shape(0);
  bool any_fp8 = false;
  for (size_t i = 0; i < srcs.size(); ++i) any_fp8 = any_fp8 || (caches[i] && caches[i]->dtype() == DType::U8);
  if (any_fp8) return cache_write_warps(srcs, slots, caches, done);
  CacheTargets tg{};
  int64_t total = 0;
  for (size_t i = 0; i < srcs.size(); ++i) {
    const CachePair pr = check_cache_pair(srcs[i], caches[i], slots, T, op);
    if (pr.D == 0 || T == 0) continue;
    total += pr.D;
    tg.t[tg.n++] = CacheTarget{srcs[i]->data_as<const float>(), pr.src_stride, caches[i]->data(), pr.cache_stride,
                               caches[i]->shape(0), total, pr.kind == 1};
  }
  if (!pairs_disjoint(srcs, caches)) return;
  done = true;
  if (tg.n == 0) return;
  detail::DeviceGuard guard(slots.device().index);
  const int threads = detail::pick_threads(total, kThreads);
  const dim3 grid = rows_grid(total, T, threads);
  cache_write_many_kernel<<<grid, threads, 0, detail::stream()>>>(tg, slots.data_as<const int32_t>(), slots.stride(0),
                                                                   T);
  detail::check_launch("cache_write_many kernel launch", srcs[0]->describe());
}

}  // namespace dflash2::cuda
