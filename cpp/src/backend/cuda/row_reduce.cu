// cuda/row_reduce.cu: the row reductions of the CUDA backend: layer_norm, softmax,
// argmax, check_finite, token_logprobs, argmax_shard (F32 rows, as ops.cpp accepts them), argmax_merge and
// topk_merge.
//
// Status: compiled for sm_90a/sm_100a/sm_103a; run on an H200 (2026-12-04: every op equal
// to the CPU's there; argmax's 16-byte loads and its wide rows since, not yet run on a GPU). The argmax
// candidate order (layout.h) is unit-tested on the CPU against the CPU backend's sequential
// rule; the kernels are checked against the CPU backend by tests/test_ops.py and
// tests/cpp/test_cuda_backend.cpp when a GPU is present (bench/device_check.sh).
//
// Mapping (every op; argmax / argmax_shard / check_finite over rows longer than 4096 ids:
// "argmax over wide rows" below): one thread block per row (grid-strided past 2^20 rows), threads
// striding over the row, block reductions with warp shuffles then across warps
// (kernel_util.cuh). The block size depends only on the row length, so a row's result does
// not depend on how many rows are reduced together (decode == verify). Rows are
// [.., D] with a contiguous last dim and one row stride per tensor (layout::row_layout).
// In every op a thread writes only the elements it read itself, after the block-wide
// reductions over the row, so out may be x itself (the same view).
//
// Numerics against the CPU backend (cpu/elementwise.cpp):
//   layer_norm  sum and sum of squared deviations in double, like the CPU, but in a
//               different order (per thread, then the tree); mean = sum / D in double,
//               inv = 1 / sqrtf(float(var / D) + eps) and y = ((x - float(mean)) * inv) * w
//               [+ b] in fp32 exactly as the CPU. The double sums agree with the CPU's to
//               ~1e-16 relative, so the results are almost always bitwise equal.
//               w and b may be F32, BF16 or F16 (independently); b may be undefined.
//   softmax     max of x * scale (NaN entries ignored, as the CPU's std::max); an all -inf
//               row (fully masked) gives zeros, as on the CPU; e = expf(x * scale - max)
//               written to out, their sum in double (order differs from the CPU), then
//               out *= float(1 / sum). Only expf (2 ulp vs glibc's 1) and the sum order
//               differ from the CPU.
//   argmax      the CPU's sequential rule (best = 0; best = i when x[i] > x[best]) as a
//               parallel reduction: NaN elements never become candidates, candidates are
//               ordered by (value, -index) (layout::argmax_better: ties and +0/-0 go to the
//               lower index), and the row's answer is 0 when x[0] is NaN (then nothing
//               beats it on the CPU), else the winner. Exactly the CPU's index, always.
//   check_finite  1 where the row holds a NaN or an infinity (isfinite per element, OR over
//               the row with __syncthreads_or): the CPU's answer, always.
//   argmax_shard  argmax's reduction and check_finite's OR in one pass over the row: (the
//               winner's value, float(first + winner)), or (NaN, float(first)) for a row with
//               a non-finite element: the CPU's answer, always.
//   argmax_merge  one thread per row walks the N shards in order (strictly larger wins, a
//               NaN value sets the flag): the CPU's loop, so its answer, always.
//   token_logprobs  the row's max and a non-finite OR in one pass, then the exponentials
//               exp(double(x) - double(max)) summed in double (per thread, then the tree: the
//               CPU sums in order), lse = F32(max + log(sum)), lp = F32(x[id] - lse):
//               equal to the CPU's but for the double sum's order (~1e-16 relative), so almost
//               always bitwise. A row with a NaN or an infinity gets NaN (as the CPU); an id
//               outside the row gets lp = NaN (the CPU's op rejects it before the call).
//   topk_merge  one warp per row: output j is the best of the N x k' candidates that
//               rank after output j - 1 in topk's total order (value descending, NaN last,
//               then the global id; ids are distinct, so the order is strict): each lane
//               scans every 32nd candidate, then a butterfly of shuffles leaves the best on
//               every lane (a strict total order has one minimum). The CPU's partial sort's
//               answer, always, whether or not the shards' lists are sorted.
// Row lengths up to INT32_MAX - 1024 elements.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backend/cuda/argmax.cuh"
#include "backend/cuda/cuda_api.h"
#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/layout.h"
#include "backend/cuda/scratch.h"
#include "dflash2/error.h"
#include "dflash2/ops.h"

namespace dflash2::cuda {

namespace {

using detail::kMaxThreads;

// ------------------------------------------------------------------ layer_norm
__global__ void __launch_bounds__(kMaxThreads)
    layer_norm_kernel(const float* x, int64_t x_stride, const void* __restrict__ w, detail::WCode wc,
                      const void* __restrict__ b, detail::WCode bc, bool has_b, float* out, int64_t out_stride,
                      int64_t rows, int D, float eps) {
  detail::pdl_enter();
  __shared__ double scratch[33];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xr = x + r * x_stride;
    float* orow = out + r * out_stride;
    double s = 0.0;
    for (int i = threadIdx.x; i < D; i += blockDim.x) s += double(xr[i]);
    s = detail::block_reduce(s, scratch, detail::SumOp{}, 0.0);
    const double mean = s / double(D);
    double v = 0.0;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
      const double d = double(xr[i]) - mean;
      v += d * d;
    }
    v = detail::block_reduce(v, scratch, detail::SumOp{}, 0.0);
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(float(v / double(D)), eps)));
    const float mf = float(mean);
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
      const float y = __fmul_rn(__fmul_rn(__fsub_rn(xr[i], mf), inv), detail::load_w(w, wc, i));
      orow[i] = has_b ? __fadd_rn(y, detail::load_w(b, bc, i)) : y;
    }
  }
}

// ------------------------------------------------------------------ softmax
__global__ void __launch_bounds__(kMaxThreads)
    softmax_kernel(const float* x, int64_t x_stride, float* out, int64_t out_stride, int64_t rows, int D,
                   float scale) {
  detail::pdl_enter();
  __shared__ float fscratch[33];
  __shared__ double dscratch[33];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xr = x + r * x_stride;
    float* orow = out + r * out_stride;
    float mx = -INFINITY;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
      const float v = __fmul_rn(xr[i], scale);
      mx = mx < v ? v : mx;  // std::max(mx, v): a NaN v is ignored
    }
    mx = detail::block_reduce(mx, fscratch, detail::MaxOp{}, -INFINITY);
    if (mx == -INFINITY) {  // all -inf (fully masked): zeros, as the CPU
      for (int i = threadIdx.x; i < D; i += blockDim.x) orow[i] = 0.0f;
      continue;
    }
    double sum = 0.0;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
      const float e = expf(__fsub_rn(__fmul_rn(xr[i], scale), mx));
      orow[i] = e;
      sum += double(e);
    }
    sum = detail::block_reduce(sum, dscratch, detail::SumOp{}, 0.0);
    const float inv = float(1.0 / sum);
    for (int i = threadIdx.x; i < D; i += blockDim.x) orow[i] = __fmul_rn(orow[i], inv);
  }
}

// ------------------------------------------------------------------ argmax
// f(v, i) for every element of a row, in an order that argmax's strict total order and the
// non-finite OR (check_finite, argmax_shard) do not see: 16-byte loads, four of them in
// flight per thread, where the row starts 16-byte aligned (else one element a step, as
// before). One block reads a whole
// row: with one 4-byte load in flight per thread the argmax of a 154880-logit row took
// 30 us on an H200 (about 20 GB/s for the row's SM; bench_ops, 2026-12-04).
template <class F>
__device__ __forceinline__ void for_each_in_row(const float* xr, int32_t V, F f) {
  const int32_t t = int32_t(threadIdx.x), nt = int32_t(blockDim.x);
  int32_t done = 0;  // elements [0, done) left to the vector loops
  if ((reinterpret_cast<uintptr_t>(xr) & 15u) == 0) {
    const float4* x4 = reinterpret_cast<const float4*>(xr);
    const int32_t V4 = V / 4;
    int32_t j = t;
    for (; j + 3 * nt < V4; j += 4 * nt) {
      float4 a[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) a[u] = x4[j + u * nt];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int32_t i = 4 * (j + u * nt);
        f(a[u].x, i);
        f(a[u].y, i + 1);
        f(a[u].z, i + 2);
        f(a[u].w, i + 3);
      }
    }
    for (; j < V4; j += nt) {
      const float4 a = x4[j];
      f(a.x, 4 * j);
      f(a.y, 4 * j + 1);
      f(a.z, 4 * j + 2);
      f(a.w, 4 * j + 3);
    }
    done = 4 * V4;
  }
  for (int32_t i = done + t; i < V; i += nt) f(xr[i], i);
}

__global__ void __launch_bounds__(kMaxThreads)
    argmax_kernel(const float* x, int64_t x_stride, int32_t* out, int64_t out_stride, int64_t rows, int32_t V) {
  detail::pdl_enter();
  __shared__ float sval[32];
  __shared__ int32_t sidx[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xr = x + r * x_stride;
    float bv = -INFINITY;
    int32_t bi = layout::kArgmaxNone;
    for_each_in_row(xr, V, [&](float v, int32_t i) { detail::argmax_take(v, i, bv, bi); });
    detail::block_argmax_merge(bv, bi, sval, sidx);
    if (threadIdx.x == 0) out[r * out_stride] = layout::argmax_finish(isnan(xr[0]), bi);
    __syncthreads();  // sval / sidx are reused by the next row
  }
}

// ------------------------------------------------------------------ argmax_shard / merge
__global__ void __launch_bounds__(kMaxThreads)
    argmax_shard_kernel(const float* x, int64_t x_stride, float* out, int64_t out_stride, int64_t out_col,
                        int64_t rows, int32_t V, int64_t first) {
  detail::pdl_enter();
  __shared__ float sval[32];
  __shared__ int32_t sidx[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xr = x + r * x_stride;
    float bv = -INFINITY;
    int32_t bi = layout::kArgmaxNone;
    int bad = 0;
    for_each_in_row(xr, V, [&](float v, int32_t i) {
      bad |= isfinite(v) ? 0 : 1;
      detail::argmax_take(v, i, bv, bi);
    });
    bad = __syncthreads_or(bad);
    detail::block_argmax_merge(bv, bi, sval, sidx);
    if (threadIdx.x == 0) {
      const int32_t best = layout::argmax_finish(isnan(xr[0]), bi);
      float* o = out + r * out_stride;
      o[0] = bad ? __int_as_float(0x7fc00000) : xr[best];
      o[out_col] = float(first + (bad ? 0 : best));
    }
    __syncthreads();  // sval / sidx are reused by the next row
  }
}

// ------------------------------------------------------------------ argmax over wide rows
// argmax, argmax_shard and check_finite over rows longer than kArgChunk ids
// (ops::wide_rows()): grid (chunk, row), one 256-thread block
// per chunk of kArgChunk ids (4 float4 loads per thread, all in flight at once), each block's
// (best, id, non-finite) into scratch, then the row's last block (an arrival counter,
// detail::zeroed_counters, reset by it) merges the chunks' partials: argmax_better is a
// strict total order and the non-finite flag an OR, so any merge gives the one-block
// kernels' answer, bitwise. One block per row kept a 154880-logit row on one SM (30 us on an
// H200); this spreads it over 38.
constexpr int kArgThreads = 256;
constexpr int32_t kArgChunk = 4096;

struct ArgPart {
  float v;
  int32_t i, bad, pad;
};

// What the row's last block writes: argmax's id (ids), argmax_shard's pair (pairs; out_col,
// first) or check_finite's flag (ids as the flags).
enum class WideOut : int { Argmax, Shard, Finite };

__global__ void __launch_bounds__(kArgThreads)
    argmax_wide_kernel(const float* x, int64_t x_stride, int32_t V, int32_t P, WideOut mode, int32_t* ids,
                       int64_t ids_stride, float* pairs, int64_t p_stride, int64_t out_col, int64_t first,
                       ArgPart* parts, uint32_t* arrivals) {
  detail::pdl_enter();
  __shared__ float sval[32];
  __shared__ int32_t sidx[32];
  __shared__ int last_s;
  const int32_t c = int32_t(blockIdx.x);
  const int64_t r = int64_t(blockIdx.y);
  const float* xr = x + r * x_stride;
  const int32_t c0 = c * kArgChunk;
  const int32_t n = min(kArgChunk, V - c0);
  float bv = -INFINITY;
  int32_t bi = layout::kArgmaxNone;
  int bad = 0;
  for_each_in_row(xr + c0, n, [&](float v, int32_t i) {
    bad |= isfinite(v) ? 0 : 1;
    detail::argmax_take(v, c0 + i, bv, bi);
  });
  bad = __syncthreads_or(bad);
  detail::block_argmax_merge(bv, bi, sval, sidx);
  if (threadIdx.x == 0) parts[r * P + c] = ArgPart{bv, bi, bad, 0};
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const bool last = atomicAdd(&arrivals[r], 1u) == uint32_t(P) - 1u;
    if (last) arrivals[r] = 0u;  // every block of this row has counted itself in
    last_s = last ? 1 : 0;
  }
  __syncthreads();
  if (!last_s) return;
  __threadfence();
  bv = -INFINITY;
  bi = layout::kArgmaxNone;
  bad = 0;
  for (int32_t p = int32_t(threadIdx.x); p < P; p += int32_t(blockDim.x)) {
    const ArgPart* q = &parts[r * P + p];
    const float qv = __ldcg(&q->v);
    const int32_t qi = __ldcg(&q->i);
    bad |= __ldcg(&q->bad);
    if (qi != layout::kArgmaxNone && layout::argmax_better(qv, qi, bv, bi)) {
      bv = qv;
      bi = qi;
    }
  }
  bad = __syncthreads_or(bad);
  detail::block_argmax_merge(bv, bi, sval, sidx);
  if (threadIdx.x == 0) {
    const int32_t best = layout::argmax_finish(isnan(xr[0]), bi);
    if (mode == WideOut::Shard) {
      float* o = pairs + r * p_stride;
      o[0] = bad ? __int_as_float(0x7fc00000) : xr[best];
      o[out_col] = float(first + (bad ? 0 : best));
    } else {
      ids[r * ids_stride] = mode == WideOut::Finite ? (bad ? 1 : 0) : best;
    }
  }
}

// Chunks per row for the wide argmax (0: one block per row).
int32_t argmax_wide_parts(int64_t V, int64_t rows) {
  if (!ops::wide_rows() || V <= kArgChunk || rows > detail::kCounterWords) return 0;
  const int64_t P = (V + kArgChunk - 1) / kArgChunk;
  return P <= kArgThreads * 64 ? int32_t(P) : 0;
}

__global__ void __launch_bounds__(kMaxThreads)
    argmax_merge_kernel(const float* pairs, int64_t ps0, int64_t ps1, int64_t ps2, int64_t N, int64_t R,
                        int32_t* ids, int64_t ids_stride, int32_t* flags, int64_t flags_stride) {
  detail::pdl_enter();
  for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < R; r += int64_t(gridDim.x) * blockDim.x) {
    bool bad = false, have = false;
    float best = 0.0f, id = 0.0f;
    for (int64_t n = 0; n < N; ++n) {
      const float* e = pairs + n * ps0 + r * ps1;
      const float v = e[0];
      if (isnan(v)) {
        bad = true;
        continue;
      }
      if (!have || v > best) {  // a later shard (higher ids) wins only when strictly larger
        best = v;
        id = e[ps2];
        have = true;
      }
    }
    ids[r * ids_stride] = int32_t(id);
    flags[r * flags_stride] = bad ? 1 : 0;
  }
}

// topk's order: a ranks before b (larger value, NaN last, ties -- +0 == -0 too -- to the lower id)
__device__ __forceinline__ bool topk_before(float va, int64_t ia, float vb, int64_t ib) {
  const bool na = isnan(va), nb = isnan(vb);
  if (na != nb) return nb;
  if (!na && va != vb) return va > vb;
  return ia < ib;
}

constexpr int kMergeThreads = 128;  // 4 warps, a row each

__global__ void __launch_bounds__(kMergeThreads)
    topk_merge_kernel(const float* vals, int64_t vs0, int64_t vs1, int64_t vs2, const int32_t* idx, int64_t is0,
                      int64_t is1, int64_t is2, int64_t N, int64_t R, int64_t kin, int64_t shard_size, float* values,
                      int64_t os0, int64_t os1, int32_t* indices, int64_t js0, int64_t js1, int64_t k) {
  detail::pdl_enter();
  const int lane = int(threadIdx.x) & 31, wpb = int(blockDim.x) / 32;
  const int64_t C = N * kin;
  for (int64_t r = int64_t(blockIdx.x) * wpb + int(threadIdx.x) / 32; r < R; r += int64_t(gridDim.x) * wpb) {
    float prev_v = 0.0f;
    int64_t prev_id = -1;  // none yet
    for (int64_t j = 0; j < k; ++j) {
      float best_v = 0.0f;
      int64_t best_id = -1;
      for (int64_t c = lane; c < C; c += 32) {
        const int64_t n = c / kin, cc = c - n * kin;
        const float v = vals[n * vs0 + r * vs1 + cc * vs2];
        const int64_t id = n * shard_size + idx[n * is0 + r * is1 + cc * is2];
        if (prev_id >= 0 && !topk_before(prev_v, prev_id, v, id)) continue;  // taken already
        if (best_id < 0 || topk_before(v, id, best_v, best_id)) {
          best_v = v;
          best_id = id;
        }
      }
      for (int off = 16; off > 0; off >>= 1) {  // every lane ends with the warp's best
        const float ov = __shfl_xor_sync(0xffffffffu, best_v, off);
        const long long oid = __shfl_xor_sync(0xffffffffu, static_cast<long long>(best_id), off);
        if (oid >= 0 && (best_id < 0 || topk_before(ov, oid, best_v, best_id))) {
          best_v = ov;
          best_id = oid;
        }
      }
      if (lane == 0) {
        values[r * os0 + j * os1] = best_v;
        indices[r * js0 + j * js1] = int32_t(best_id);
      }
      prev_v = best_v;
      prev_id = best_id;
    }
  }
}

// ------------------------------------------------------------------ check_finite
__global__ void __launch_bounds__(kMaxThreads)
    check_finite_kernel(const float* x, int64_t x_stride, int32_t* flags, int64_t flags_stride, int64_t rows,
                        int32_t V) {
  detail::pdl_enter();
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xr = x + r * x_stride;
    int bad = 0;
    for_each_in_row(xr, V, [&](float v, int32_t) { bad |= isfinite(v) ? 0 : 1; });
    bad = __syncthreads_or(bad);
    if (threadIdx.x == 0) flags[r * flags_stride] = bad ? 1 : 0;
  }
}

// ------------------------------------------------------------------ token_logprobs
__global__ void __launch_bounds__(kMaxThreads)
    token_logprobs_kernel(const float* x, int64_t x_stride, const int32_t* ids, int64_t ids_stride, float* lp,
                          int64_t lp_stride, float* lse, int64_t lse_stride, int64_t rows, int32_t V) {
  detail::pdl_enter();
  __shared__ float fscratch[33];
  __shared__ double dscratch[33];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xr = x + r * x_stride;
    float m = -INFINITY;
    int bad = 0;
    for_each_in_row(xr, V, [&](float v, int32_t) {
      bad |= isfinite(v) ? 0 : 1;
      m = m < v ? v : m;
    });
    bad = __syncthreads_or(bad);
    m = detail::block_reduce(m, fscratch, detail::MaxOp{}, -INFINITY);
    double s = 0.0;
    if (!bad) for_each_in_row(xr, V, [&](float v, int32_t) { s += exp(double(v) - double(m)); });
    s = detail::block_reduce(s, dscratch, detail::SumOp{}, 0.0);
    if (threadIdx.x == 0) {
      const int32_t id = ids[r * ids_stride];
      const double l = double(m) + log(s);
      lse[r * lse_stride] = bad ? NAN : float(l);
      lp[r * lp_stride] = bad || id < 0 || id >= V ? NAN : float(double(xr[id]) - double(float(l)));
    }
  }
}

// ------------------------------------------------------------------ host checks
void same_cuda_device(const char* op, const Tensor& a, const Tensor& b) {
  DFLASH2_CHECK_ARG(a.device().is_cuda() && b.device() == a.device(), "cuda::", op,
                    ": tensors must be on the same CUDA device, found ", a.describe(), " and ", b.describe());
}

void need_f32(const char* op, const Tensor& t, const char* arg) {
  DFLASH2_CHECK_ARG(t.defined() && t.dtype() == DType::F32, "cuda::", op, ": '", arg, "' must be F32, found ",
                    t.defined() ? t.describe() : std::string("<undefined>"));
}

void need_row_len(const char* op, int64_t D) {
  // int element indices: i + blockDim.x must not overflow
  DFLASH2_CHECK_ARG(D <= int64_t(INT32_MAX) - kMaxThreads, "cuda::", op, ": rows of ", D, " elements are too long");
}

// x F32 [R, V] with contiguous rows and out I32 [R] (argmax, check_finite).
layout::RowLayout index_rows_args(const char* op, const Tensor& x, const Tensor& out, const char* out_name) {
  need_f32(op, x, "x");
  DFLASH2_CHECK_ARG(out.defined() && out.dtype() == DType::I32, "cuda::", op, ": '", out_name, "' must be I32, found ",
                    out.defined() ? out.describe() : std::string("<undefined>"));
  same_cuda_device(op, x, out);
  DFLASH2_CHECK_ARG(x.ndim() == 2, "cuda::", op, ": x must be [rows, cols], found ", x.describe());
  DFLASH2_CHECK_ARG(out.ndim() == 1 && out.shape(0) == x.shape(0), "cuda::", op, ": '", out_name, "' must be I32 [",
                    x.shape(0), "], found ", out.describe());
  const layout::RowLayout L = layout::row_layout(x, op, "x");
  need_row_len(op, L.cols);
  return L;
}

}  // namespace

void layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, float eps, Tensor& out) {
  const char* op = "layer_norm";
  need_f32(op, x, "x");
  need_f32(op, out, "out");
  DFLASH2_CHECK_ARG(w.defined(), "cuda::layer_norm: w is undefined");
  same_cuda_device(op, x, out);
  same_cuda_device(op, x, w);
  DFLASH2_CHECK_ARG(x.shape() == out.shape(), "cuda::layer_norm: x ", x.describe(), " and out ", out.describe(),
                    " must have the same shape");
  const layout::RowLayout lx = layout::row_layout(x, op, "x");
  const layout::RowLayout lo = layout::row_layout(out, op, "out");
  layout::check_rows_disjoint(lo, op, "out");
  const int64_t D = lx.cols;
  need_row_len(op, D);
  DFLASH2_CHECK_ARG(w.ndim() == 1 && w.shape(0) == D && w.is_contiguous(), "cuda::layer_norm: w must be [", D,
                    "] contiguous, found ", w.describe());
  const detail::WCode wc = detail::wcode(w.dtype());
  detail::WCode bc = detail::WCode::F32;
  if (b.defined()) {
    same_cuda_device(op, x, b);
    DFLASH2_CHECK_ARG(b.ndim() == 1 && b.shape(0) == D && b.is_contiguous(), "cuda::layer_norm: b must be [", D,
                      "] contiguous, found ", b.describe());
    bc = detail::wcode(b.dtype());
  }
  DFLASH2_CHECK_ARG(eps >= 0, "cuda::layer_norm: eps must be >= 0, found ", eps);
  if (lx.rows == 0 || D == 0) return;
  detail::DeviceGuard guard(x.device().index);
  layer_norm_kernel<<<detail::row_blocks(lx.rows), detail::pick_threads(D), 0, detail::stream()>>>(
      x.data_as<const float>(), lx.stride, w.data(), wc, b.defined() ? b.data() : nullptr, bc, b.defined(),
      out.data_as<float>(), lo.stride, lx.rows, int(D), eps);
  detail::check_launch("layer_norm kernel launch", x.describe());
}

void softmax(const Tensor& x, Tensor& out, float scale) {
  const char* op = "softmax";
  need_f32(op, x, "x");
  need_f32(op, out, "out");
  same_cuda_device(op, x, out);
  DFLASH2_CHECK_ARG(x.shape() == out.shape(), "cuda::softmax: x ", x.describe(), " and out ", out.describe(),
                    " must have the same shape");
  const layout::RowLayout lx = layout::row_layout(x, op, "x");
  const layout::RowLayout lo = layout::row_layout(out, op, "out");
  layout::check_rows_disjoint(lo, op, "out");
  need_row_len(op, lx.cols);
  if (lx.rows == 0 || lx.cols == 0) return;
  detail::DeviceGuard guard(x.device().index);
  softmax_kernel<<<detail::row_blocks(lx.rows), detail::pick_threads(lx.cols), 0, detail::stream()>>>(
      x.data_as<const float>(), lx.stride, out.data_as<float>(), lo.stride, lx.rows, int(lx.cols), scale);
  detail::check_launch("softmax kernel launch", x.describe());
}

namespace {
// argmax_wide_kernel over x's rows in `mode` when they are wide rows (argmax_wide_parts):
// the chunks' partials in scratch, the rows' arrival counters; false (nothing launched)
// for the one-block kernels. ids / pairs: the outputs `mode` writes (see WideOut).
bool launch_argmax_wide(const char* what, const Tensor& x, const layout::RowLayout& L, WideOut mode, int32_t* ids,
                        int64_t ids_stride, float* pairs = nullptr, int64_t p_stride = 0, int64_t out_col = 0,
                        int64_t first = 0) {
  const int32_t P = argmax_wide_parts(L.cols, L.rows);
  if (!P) return false;
  const int dev = x.device().index;
  ArgPart* parts = static_cast<ArgPart*>(detail::scratch(dev, size_t(L.rows) * size_t(P) * sizeof(ArgPart)));
  argmax_wide_kernel<<<dim3(unsigned(P), unsigned(L.rows)), kArgThreads, 0, detail::stream()>>>(
      x.data_as<const float>(), L.stride, int32_t(L.cols), P, mode, ids, ids_stride, pairs, p_stride, out_col, first,
      parts, detail::zeroed_counters(dev));
  detail::check_launch(what, x.describe());
  return true;
}
}  // namespace

void argmax(const Tensor& x, Tensor& out) {
  const layout::RowLayout L = index_rows_args("argmax", x, out, "out");
  if (L.rows == 0) return;
  DFLASH2_CHECK_ARG(L.cols >= 1, "cuda::argmax: rows must not be empty, found ", x.describe());
  detail::DeviceGuard guard(x.device().index);
  if (launch_argmax_wide("argmax (wide rows) kernel launch", x, L, WideOut::Argmax, out.data_as<int32_t>(),
                         out.stride(0)))
    return;
  argmax_kernel<<<detail::row_blocks(L.rows), detail::pick_threads(L.cols), 0, detail::stream()>>>(
      x.data_as<const float>(), L.stride, out.data_as<int32_t>(), out.stride(0), L.rows, int32_t(L.cols));
  detail::check_launch("argmax kernel launch", x.describe());
}

void argmax_shard(const Tensor& x, int64_t first, Tensor& out) {
  const char* op = "argmax_shard";
  need_f32(op, x, "x");
  need_f32(op, out, "out");
  same_cuda_device(op, x, out);
  DFLASH2_CHECK_ARG(x.ndim() == 2 && out.ndim() == 2 && out.shape(0) == x.shape(0) && out.shape(1) == 2,
                    "cuda::argmax_shard: x must be [rows, cols] and out [rows, 2], found ", x.describe(), " and ",
                    out.describe());
  const layout::RowLayout L = layout::row_layout(x, op, "x");
  need_row_len(op, L.cols);
  DFLASH2_CHECK_ARG(first >= 0 && first + L.cols <= (int64_t(1) << 24), "cuda::argmax_shard: ids ", first, " + ",
                    L.cols, " are not exact in F32");
  if (L.rows == 0) return;
  DFLASH2_CHECK_ARG(L.cols >= 1, "cuda::argmax_shard: rows must not be empty, found ", x.describe());
  detail::DeviceGuard guard(x.device().index);
  if (launch_argmax_wide("argmax_shard (wide rows) kernel launch", x, L, WideOut::Shard, nullptr, 0,
                         out.data_as<float>(), out.stride(0), out.stride(1), first))
    return;
  argmax_shard_kernel<<<detail::row_blocks(L.rows), detail::pick_threads(L.cols), 0, detail::stream()>>>(
      x.data_as<const float>(), L.stride, out.data_as<float>(), out.stride(0), out.stride(1), L.rows,
      int32_t(L.cols), first);
  detail::check_launch("argmax_shard kernel launch", x.describe());
}

void argmax_merge(const Tensor& pairs, Tensor& ids, Tensor& flags) {
  const char* op = "argmax_merge";
  need_f32(op, pairs, "pairs");
  same_cuda_device(op, pairs, ids);
  same_cuda_device(op, pairs, flags);
  DFLASH2_CHECK_ARG(pairs.ndim() == 3 && pairs.shape(2) == 2 && ids.dtype() == DType::I32 &&
                        flags.dtype() == DType::I32 && ids.ndim() == 1 && flags.ndim() == 1 &&
                        ids.shape(0) == pairs.shape(1) && flags.shape(0) == pairs.shape(1),
                    "cuda::argmax_merge: pairs must be F32 [N, R, 2] and ids / flags I32 [R], found ",
                    pairs.describe(), ", ", ids.describe(), ", ", flags.describe());
  const int64_t R = pairs.shape(1);
  if (R == 0) return;
  detail::DeviceGuard guard(pairs.device().index);
  const int threads = 128;
  const int blocks = int(std::min<int64_t>((R + threads - 1) / threads, 1024));
  argmax_merge_kernel<<<blocks, threads, 0, detail::stream()>>>(
      pairs.data_as<const float>(), pairs.stride(0), pairs.stride(1), pairs.stride(2), pairs.shape(0), R,
      ids.data_as<int32_t>(), ids.stride(0), flags.data_as<int32_t>(), flags.stride(0));
  detail::check_launch("argmax_merge kernel launch", pairs.describe());
}

void topk_merge(const Tensor& vals, const Tensor& idx, int64_t shard_size, Tensor& values, Tensor& indices) {
  const char* op = "topk_merge";
  need_f32(op, vals, "vals");
  need_f32(op, values, "values");
  same_cuda_device(op, vals, idx);
  same_cuda_device(op, vals, values);
  same_cuda_device(op, vals, indices);
  DFLASH2_CHECK_ARG(vals.ndim() == 3 && idx.dtype() == DType::I32 && idx.shape() == vals.shape() &&
                        indices.dtype() == DType::I32 && values.ndim() == 2 && indices.shape() == values.shape() &&
                        values.shape(0) == vals.shape(1) && values.shape(1) <= vals.shape(2),
                    "cuda::topk_merge: vals / idx must be [N, R, k'] and values / indices [R, k <= k'], found ",
                    vals.describe(), ", ", idx.describe(), ", ", values.describe(), ", ", indices.describe());
  const int64_t R = vals.shape(1), k = values.shape(1);
  if (R == 0 || k == 0) return;
  detail::DeviceGuard guard(vals.device().index);
  const int rows_per_block = kMergeThreads / 32;
  const int blocks = int(std::min<int64_t>((R + rows_per_block - 1) / rows_per_block, 4096));
  topk_merge_kernel<<<blocks, kMergeThreads, 0, detail::stream()>>>(
      vals.data_as<const float>(), vals.stride(0), vals.stride(1), vals.stride(2), idx.data_as<const int32_t>(),
      idx.stride(0), idx.stride(1), idx.stride(2), vals.shape(0), R, vals.shape(2), shard_size,
      values.data_as<float>(), values.stride(0), values.stride(1), indices.data_as<int32_t>(), indices.stride(0),
      indices.stride(1), k);
  detail::check_launch("topk_merge kernel launch", vals.describe());
}

void check_finite(const Tensor& x, Tensor& flags) {
  const layout::RowLayout L = index_rows_args("check_finite", x, flags, "flags");
  if (L.rows == 0) return;
  detail::DeviceGuard guard(x.device().index);
  if (launch_argmax_wide("check_finite (wide rows) kernel launch", x, L, WideOut::Finite, flags.data_as<int32_t>(),
                         flags.stride(0)))
    return;
  check_finite_kernel<<<detail::row_blocks(L.rows), detail::pick_threads(L.cols), 0, detail::stream()>>>(
      x.data_as<const float>(), L.stride, flags.data_as<int32_t>(), flags.stride(0), L.rows, int32_t(L.cols));
  detail::check_launch("check_finite kernel launch", x.describe());
}

void token_logprobs(const Tensor& x, const Tensor& ids, Tensor& lp, Tensor& lse) {
  const layout::RowLayout L = index_rows_args("token_logprobs", x, ids, "ids");
  same_cuda_device("token_logprobs", x, lp);
  same_cuda_device("token_logprobs", x, lse);
  if (L.rows == 0) return;
  detail::DeviceGuard guard(x.device().index);
  token_logprobs_kernel<<<detail::row_blocks(L.rows), detail::pick_threads(L.cols), 0, detail::stream()>>>(
      x.data_as<const float>(), L.stride, ids.data_as<const int32_t>(), ids.stride(0), lp.data_as<float>(),
      lp.stride(0), lse.data_as<float>(), lse.stride(0), L.rows, int32_t(L.cols));
  detail::check_launch("token_logprobs kernel launch", x.describe());
}

}  // namespace dflash2::cuda
