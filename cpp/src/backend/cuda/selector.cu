// cuda/selector.cu: the DFlash 2 candidate selector's path walk (selector_walk) on the CUDA
// backend.
//
// Status: compiled for sm_90a/sm_100a/sm_103a, NOT yet run on a GPU. Checked against the
// CPU backend by tests/test_ops.py (selector_walk cases) and
// tests/cpp/test_cuda_sampling.cpp when a GPU is present.
//
// Semantics (ops.h; CPU oracle cpu/drafter.cpp), per sequence s over positions t < P:
//   a = pred_book[prev] * g[s, t];  score_b = vals[s, t, b] + a . succ_book[cand[s, t, b]]
// prev starts at anchors[s] and becomes the chosen candidate. temperature[s] <= 0: the best
// score (first on ties); otherwise q = softmax(score / temperature[s]) is written to q[s, t]
// and the candidate is drawn with draw t of rng[s]: the first b with u < cum_b (cum: the
// running sum of the fp32 q in double), else b = K - 1. vals F32 / cand I32 [S, P, K],
// g F32 [S, P, R], books F32/BF16/F16 [V, R] (contiguous rows), anchors I32 [S], tokens I32
// [S, P], temperature F32 [S], rng I64 [S, 2], q F32 [S, P, K] (any leading strides).
//
// Mapping: one block per sequence (grid-strided), one warp per candidate (32..512 threads:
// up to 16 warps, each taking candidates b, b + 16, ...). A step: every warp forms its dot
// products (lanes stride over R: a_e = pred[e] * g[e] rounded as the CPU does, then fmaf
// into a lane sum, a butterfly across the warp) and stores score_b in shared memory; then
// warp 0 makes the choice (argmax with layout.h's rule, or the softmax + draw) and writes
// the token; the chosen candidate is the next step's predecessor. Two barriers a step.
// K <= 4096 candidates (shared score buffers). Sampling needs both rng and q; when either
// is undefined (a greedy-only call, e.g. the binding's scalar temperature 0 moved to the
// device) every sequence takes the greedy choice whatever its temperature and q is not
// touched (ops.cpp requires both on the CUDA backend today).
//
// Numerics vs the CPU: the dot product's summation order differs (the CPU adds fp32 terms
// sequentially): scores agree to ~1e-7 relative, so the greedy choice is the CPU's given
// a margin. The softmax is the CPU's fp32 chain ((score - max) / T, expf: CUDA's expf is
// within 2 ulp of glibc's), its sum in double (order differs), q = float(e / sum); the
// draw compares the Philox draw (bit-identical, philox.h) with the running sum of q in
// double. Device-side indices (anchors, candidates) outside [0, V) are clamped for the
// book lookups (the CPU op rejects them on the host; nothing faults here); the token
// written is the candidate as given.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "backend/cuda/argmax.cuh"
#include "backend/cuda/cuda_api.h"
#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/layout.h"
#include "backend/cuda/sampling_logic.h"
#include "dflash2/error.h"
#include "ops/philox.h"

namespace dflash2::cuda {

namespace {

namespace sl = sampling;

constexpr unsigned kFull = 0xffffffffu;
constexpr int kMaxWarps = 16;
constexpr int kMaxThreads = kMaxWarps * 32;
constexpr int kMaxK = 4096;  // the drafter config allows selector_top_k up to 4096 (32 KiB of scores)

struct Book {
  const void* p;
  detail::WCode c;
  int64_t stride;  // elements between rows
};

struct SelectorArgs {
  const float* vals;
  int64_t vs0, vs1;
  const int32_t* cand;
  int64_t cs0, cs1;
  const float* g;
  int64_t gs0, gs1;
  Book pred, succ;
  int64_t V;
  const int32_t* anchors;
  int64_t as;
  const float* temp;
  int64_t ts;
  const int64_t* rng;
  int64_t rs0, rs1;
  int32_t* tokens;
  int64_t ts0, ts1;
  float* q;
  int64_t qs0, qs1;
  int64_t S, P, K, R;
};

__device__ __forceinline__ int64_t clamp_row(int64_t v, int64_t n) { return v < 0 ? 0 : (v >= n ? n - 1 : v); }

__device__ __forceinline__ double warp_incl_scan(double v) {
  const int lane = int(threadIdx.x & 31);
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const double o = __shfl_up_sync(kFull, v, off);
    if (lane >= off) v += o;
  }
  return v;
}

__global__ void __launch_bounds__(kMaxThreads) selector_kernel(SelectorArgs a) {
  detail::pdl_enter();
  __shared__ float score[kMaxK];
  __shared__ float e[kMaxK];
  __shared__ int32_t prev_s;
  const int lane = int(threadIdx.x & 31), warp = int(threadIdx.x >> 5), nw = int(blockDim.x >> 5);
  const int32_t K = int32_t(a.K);
  for (int64_t s = blockIdx.x; s < a.S; s += gridDim.x) {
    const float temp = a.temp[s * a.ts];
    if (threadIdx.x == 0) prev_s = a.anchors[s * a.as];
    __syncthreads();
    for (int64_t t = 0; t < a.P; ++t) {
      const int64_t prev = clamp_row(prev_s, a.V);
      const float* gt = a.g + s * a.gs0 + t * a.gs1;
      const int32_t* cd = a.cand + s * a.cs0 + t * a.cs1;
      const float* vr = a.vals + s * a.vs0 + t * a.vs1;
      const int64_t po = prev * a.pred.stride;
      for (int32_t b = warp; b < K; b += nw) {
        const int64_t so = clamp_row(cd[b], a.V) * a.succ.stride;
        float acc = 0.0f;
        for (int64_t k = lane; k < a.R; k += 32) {
          const float av = __fmul_rn(detail::load_w(a.pred.p, a.pred.c, po + k), gt[k]);
          acc = fmaf(av, detail::load_w(a.succ.p, a.succ.c, so + k), acc);
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(kFull, acc, off));
        if (lane == 0) score[b] = __fadd_rn(vr[b], acc);
      }
      __syncthreads();
      if (warp == 0) {
        int32_t choice;
        if (temp <= 0.0f || a.q == nullptr) {
          // the CPU's `score[b] > score[choice]` from choice = 0 (layout.h argmax rule)
          float bv = -INFINITY;
          int32_t bi = layout::kArgmaxNone;
          for (int32_t b = lane; b < K; b += 32) detail::argmax_take(score[b], b, bv, bi);
          detail::warp_argmax(bv, bi);
          choice = layout::argmax_finish(isnan(score[0]), bi);
        } else {
          float mx = -INFINITY;
          for (int32_t b = lane; b < K; b += 32) mx = mx < score[b] ? score[b] : mx;
#pragma unroll
          for (int off = 16; off > 0; off >>= 1) {
            const float o = __shfl_xor_sync(kFull, mx, off);
            mx = mx < o ? o : mx;
          }
          double sum = 0.0;
          for (int32_t b = lane; b < K; b += 32) {
            const float v = expf(__fdiv_rn(__fsub_rn(score[b], mx), temp));
            e[b] = v;
            sum += double(v);
          }
#pragma unroll
          for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(kFull, sum, off);
          const int64_t* st = a.rng + s * a.rs0;
          const double u = philox::uniform(uint64_t(st[0]), uint64_t(st[a.rs1]) + uint64_t(t));
          float* qo = a.q + s * a.qs0 + t * a.qs1;
          double carry = 0.0;
          choice = K - 1;
          bool done = false;
          for (int32_t b0 = 0; b0 < K; b0 += 32) {
            const int32_t b = b0 + lane;
            double qv = 0.0;
            if (b < K) {
              const float qf = float(double(e[b]) / sum);
              qo[b] = qf;
              qv = double(qf);
            }
            const double cum = carry + warp_incl_scan(qv);
            const unsigned hit = __ballot_sync(kFull, b < K && sl::selector_crosses(u, cum));
            if (hit && !done) {
              choice = b0 + __ffs(int(hit)) - 1;
              done = true;  // keep going: every q is written
            }
            carry = __shfl_sync(kFull, cum, 31);
          }
        }
        if (lane == 0) {
          const int32_t tok = cd[choice];
          a.tokens[s * a.ts0 + t * a.ts1] = tok;
          prev_s = tok;
        }
      }
      __syncthreads();
    }
  }
}

Book book_of(const Tensor& b) { return Book{b.data(), detail::wcode(b.dtype()), b.stride(0)}; }

}  // namespace

void selector_walk(const Tensor& vals, const Tensor& cand, const Tensor& g, const Tensor& pred_book,
                   const Tensor& succ_book, const Tensor& anchors, const Tensor& temperature, const Tensor& rng,
                   Tensor& tokens, Tensor& q) {
  const char* op = "cuda::selector_walk";
  for (const Tensor* t : std::initializer_list<const Tensor*>{&vals, &cand, &g, &pred_book, &succ_book, &anchors,
                                                              &temperature, &tokens})
    DFLASH2_CHECK_ARG(t->defined(), op, ": vals, cand, g, the codebooks, anchors, temperature and tokens must be defined");
  // sampling needs both; without them every sequence is greedy (see the file comment)
  const bool with_rng = rng.defined() && q.defined();
  for (const Tensor* t : std::initializer_list<const Tensor*>{&cand, &g, &pred_book, &succ_book, &anchors,
                                                              &temperature, &rng, &tokens, &q})
    DFLASH2_CHECK_ARG(!t->defined() || (vals.device().is_cuda() && t->device() == vals.device()), op,
                      ": every tensor must be on the CUDA device of vals, found ", vals.describe(), " and ",
                      t->describe());
  auto rows3 = [&](const Tensor& t, DType dt, const char* arg) {
    DFLASH2_CHECK_ARG(t.dtype() == dt && t.ndim() == 3 && (t.stride(2) == 1 || t.shape(2) == 1), op, ": '", arg,
                      "' must be ", dtype_name(dt), " [a, b, c] with contiguous rows, found ", t.describe());
  };
  rows3(vals, DType::F32, "vals");
  rows3(cand, DType::I32, "cand");
  rows3(g, DType::F32, "g");
  if (q.defined()) rows3(q, DType::F32, "q");
  const int64_t S = vals.shape(0), P = vals.shape(1), K = vals.shape(2), R = g.shape(2);
  DFLASH2_CHECK_ARG(cand.shape() == vals.shape() && (!q.defined() || q.shape() == vals.shape()), op,
                    ": cand and q must be ", shape_str(vals.shape()), ", found ", cand.describe(), " and ",
                    q.defined() ? q.describe() : std::string("<undefined>"));
  DFLASH2_CHECK_ARG(g.shape(0) == S && g.shape(1) == P, op, ": g must be [", S, ", ", P, ", rank], found ",
                    g.describe());
  DFLASH2_CHECK_ARG(K <= kMaxK, op, ": ", K, " candidates exceed the CUDA kernel's limit of ", kMaxK);
  for (const Tensor* b : {&pred_book, &succ_book})
    DFLASH2_CHECK_ARG(b->ndim() == 2 && b->shape(1) == R && (b->stride(1) == 1 || R == 1) &&
                          (b->dtype() == DType::F32 || b->dtype() == DType::BF16 || b->dtype() == DType::F16),
                      op, ": codebooks must be F32/BF16/F16 [vocab, ", R, "] with contiguous rows, found ",
                      b->describe());
  DFLASH2_CHECK_ARG(pred_book.shape(0) == succ_book.shape(0) && pred_book.shape(0) >= 1, op,
                    ": the codebooks must have the same (non-empty) vocabulary, found ", pred_book.describe(), " and ",
                    succ_book.describe());
  DFLASH2_CHECK_ARG(anchors.dtype() == DType::I32 && anchors.ndim() == 1 && anchors.shape(0) == S, op,
                    ": anchors must be I32 [", S, "], found ", anchors.describe());
  DFLASH2_CHECK_ARG(temperature.dtype() == DType::F32 && temperature.ndim() == 1 && temperature.shape(0) == S, op,
                    ": temperature must be F32 [", S, "], found ", temperature.describe());
  if (rng.defined())
    DFLASH2_CHECK_ARG(rng.dtype() == DType::I64 && rng.ndim() == 2 && rng.shape(0) == S && rng.shape(1) == 2, op,
                      ": rng must be I64 [", S, ", 2] (key, counter), found ", rng.describe());
  DFLASH2_CHECK_ARG(tokens.dtype() == DType::I32 && tokens.ndim() == 2 && tokens.shape(0) == S &&
                        tokens.shape(1) == P,
                    op, ": tokens must be I32 [", S, ", ", P, "], found ", tokens.describe());
  if (S == 0 || P == 0) return;
  DFLASH2_CHECK_ARG(K >= 1, op, ": there must be at least one candidate, found ", vals.describe());
  SelectorArgs a{};
  a.vals = vals.data_as<const float>();
  a.vs0 = vals.stride(0);
  a.vs1 = vals.stride(1);
  a.cand = cand.data_as<const int32_t>();
  a.cs0 = cand.stride(0);
  a.cs1 = cand.stride(1);
  a.g = g.data_as<const float>();
  a.gs0 = g.stride(0);
  a.gs1 = g.stride(1);
  a.pred = book_of(pred_book);
  a.succ = book_of(succ_book);
  a.V = pred_book.shape(0);
  a.anchors = anchors.data_as<const int32_t>();
  a.as = anchors.stride(0);
  a.temp = temperature.data_as<const float>();
  a.ts = temperature.stride(0);
  if (with_rng) {
    a.rng = rng.data_as<const int64_t>();
    a.rs0 = rng.stride(0);
    a.rs1 = rng.stride(1);
    a.q = q.data_as<float>();
    a.qs0 = q.stride(0);
    a.qs1 = q.stride(1);
  }
  a.tokens = tokens.data_as<int32_t>();
  a.ts0 = tokens.stride(0);
  a.ts1 = tokens.stride(1);
  a.S = S;
  a.P = P;
  a.K = K;
  a.R = R;
  const int warps = int(K < kMaxWarps ? K : kMaxWarps);
  detail::DeviceGuard guard(vals.device().index);
  selector_kernel<<<detail::row_blocks(S), warps * 32, 0, detail::stream()>>>(a);
  detail::check_launch("selector_walk kernel launch", vals.describe(), " with ", pred_book.describe());
}

}  // namespace dflash2::cuda
