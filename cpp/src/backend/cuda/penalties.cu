// cuda/penalties.cu: repetition control on the CUDA backend: apply_penalties (presence /
// frequency / repetition penalties, logit bias, min_tokens' stop-token mask over the
// target's logits rows, in place) and count_tokens (the per-sequence token counts it reads).
//
// Status: compiled for sm_90a/sm_100a/sm_103a, NOT yet run on a GPU. Checked against the
// CPU backend (bitwise) by tests/test_ops.py in the emulated build and on a GPU by
// bench/device_check.sh.
//
//   apply_penalties  one block per (sequence, verify row): the row's preceding drafts go to
//                shared memory, then each thread walks the vocabulary with a stride of the
//                block: the token's count from the state table plus its occurrences among
//                those drafts, then the op's operations in its order, each with a _rn
//                intrinsic (never contracted into an FMA): bitwise the CPU's. A row past
//                the sequence's draft_len, a sequence with table row < 0, and (device data
//                cannot raise) a table row >= B or a logits row outside [0, M) are skipped.
//                A step pays this only when one of its requests asked for a penalty (the
//                decoder passes table row -1 for the others and skips the op when none did).
//   count_tokens one thread per entry, atomicAdd into state[rows[i], ids[i]] (entries with
//                a negative row, a row >= B or an id outside [0, V) are skipped).
//   mask_logits  structured output's token masks: blocks of 256 tokens of a row (grid y: the
//                mask rows), a thread per token reading its mask word (a warp shares one
//                word: one load) and writing -FLT_MAX where the bit is clear (coalesced).
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "backend/cuda/cuda_api.h"
#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/pdl.cuh"
#include "dflash2/error.h"
#include "dflash2/ops.h"

namespace dflash2::cuda {

namespace {
constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    apply_penalties_kernel(float* logits, int64_t ls, int64_t M, int64_t V, const int32_t* row0, int64_t s0,
                           const int32_t* draft, int64_t N, int64_t K, int64_t ds, const int32_t* draft_row,
                           int64_t s1, const int32_t* draft_len, int64_t s2, const int32_t* seq, int64_t sqs,
                           const float* params, int64_t ps, const int32_t* state, const float* bias, int64_t ts,
                           int64_t B) {
  extern __shared__ int32_t prev[];  // the row's preceding drafts
  detail::pdl_enter();
  const int64_t s = blockIdx.x, j = blockIdx.y;
  const int64_t t = seq[s * sqs], min_left = seq[s * sqs + 1];
  if (t < 0 || t >= B) return;
  int64_t L = draft_len[s * s2];
  L = L < 0 ? 0 : L > K ? K : L;
  if (j > L) return;
  const int64_t r = int64_t(row0[s * s0]) + j;
  if (r < 0 || r >= M) return;
  int64_t dr = draft_row[s * s1];
  dr = dr < 0 ? 0 : dr >= N ? N - 1 : dr;
  for (int64_t i = threadIdx.x; i < j; i += blockDim.x) prev[i] = draft[dr * ds + i];
  __syncthreads();
  const float presence = params[s * ps], frequency = params[s * ps + 1], rep = params[s * ps + 2];
  float* x = logits + r * ls;
  const int32_t* st = state + t * ts;
  const float* b = bias + t * ts;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    const int32_t f = st[v];
    int64_t c = f & ops::kPenaltyCountMask;
    for (int64_t i = 0; i < j; ++i) c += prev[i] == v ? 1 : 0;
    float y = __fadd_rn(x[v], b[v]);
    if ((c > 0 || (f & ops::kPenaltyPrompt)) && rep != 1.0f) y = y > 0.0f ? __fdiv_rn(y, rep) : __fmul_rn(y, rep);
    if (c > 0) {
      y = __fsub_rn(y, __fmul_rn(frequency, float(c)));
      y = __fsub_rn(y, presence);
    }
    if ((f & ops::kPenaltyStop) && j < min_left) y = -FLT_MAX;
    x[v] = y;
  }
}

__global__ void __launch_bounds__(kThreads)
    count_tokens_kernel(int32_t* state, int64_t ts, int64_t B, int64_t V, const int32_t* rows, int64_t rs,
                        const int32_t* ids, int64_t is, int64_t n) {
  detail::pdl_enter();
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads) {
    const int64_t r = rows[i * rs], v = ids[i * is];
    if (r < 0 || r >= B || v < 0 || v >= V) continue;
    atomicAdd(state + r * ts + v, 1);
  }
}

__global__ void __launch_bounds__(kThreads)
    mask_logits_kernel(float* logits, int64_t ls, int64_t M, int64_t V, const int32_t* rows, int64_t rs,
                       const int32_t* masks, int64_t ms) {
  detail::pdl_enter();
  const int64_t r = blockIdx.y, row = rows[r * rs];
  if (row < 0 || row >= M) return;
  const uint32_t* m = reinterpret_cast<const uint32_t*>(masks + r * ms);
  float* x = logits + row * ls;
  for (int64_t v = int64_t(blockIdx.x) * kThreads + threadIdx.x; v < V; v += int64_t(gridDim.x) * kThreads)
    if (!((m[v >> 5] >> (v & 31)) & 1u)) x[v] = -FLT_MAX;
}
}  // namespace

void apply_penalties(Tensor& logits, const Tensor& row0, const Tensor& draft, const Tensor& draft_row,
                     const Tensor& draft_len, const Tensor& seq, const Tensor& params, const Tensor& state,
                     const Tensor& bias) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{&logits, &row0, &draft, &draft_row, &draft_len, &seq,
                                                              &params, &state, &bias})
    DFLASH2_CHECK_ARG(t->defined() && t->device().is_cuda() && t->device() == logits.device(),
                      "cuda::apply_penalties: every argument must be on the logits' CUDA device, found ",
                      t->defined() ? t->describe() : std::string("<undefined>"));
  const int64_t S = row0.shape(0), M = logits.shape(0), V = logits.shape(1), K = draft.shape(1);
  if (S == 0 || M == 0 || V == 0 || state.shape(0) == 0) return;
  DFLASH2_CHECK_ARG(state.stride(0) == bias.stride(0), "cuda::apply_penalties: state ", state.describe(),
                    " and bias ", bias.describe(), " must have one row stride");
  DFLASH2_CHECK_ARG(S <= INT32_MAX && K + 1 <= detail::kMaxGridY, "cuda::apply_penalties: ", S,
                    " sequences of up to ", K, " drafts are more than one launch takes");
  DFLASH2_CHECK_ARG(K * 4 <= 48 * 1024, "cuda::apply_penalties: ", K, " drafts per row exceed the shared memory");
  detail::DeviceGuard guard(logits.device().index);
  const dim3 grid(unsigned(S), unsigned(K + 1));
  apply_penalties_kernel<<<grid, kThreads, size_t(std::max<int64_t>(K, 1)) * 4, detail::stream()>>>(
      logits.data_as<float>(), logits.stride(0), M, V, row0.data_as<const int32_t>(), row0.stride(0),
      draft.data_as<const int32_t>(), std::max<int64_t>(draft.shape(0), 1), K, draft.stride(0),
      draft_row.data_as<const int32_t>(), draft_row.stride(0), draft_len.data_as<const int32_t>(),
      draft_len.stride(0), seq.data_as<const int32_t>(), seq.stride(0), params.data_as<const float>(),
      params.stride(0), state.data_as<const int32_t>(), bias.data_as<const float>(), state.stride(0),
      state.shape(0));
  detail::check_launch("apply_penalties kernel launch", logits.describe(), " ", draft.describe());
}

void count_tokens(Tensor& state, const Tensor& rows, const Tensor& ids) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{&state, &rows, &ids})
    DFLASH2_CHECK_ARG(t->defined() && t->device().is_cuda() && t->device() == state.device(),
                      "cuda::count_tokens: every argument must be on the state's CUDA device, found ",
                      t->defined() ? t->describe() : std::string("<undefined>"));
  const int64_t n = rows.shape(0);
  if (n == 0) return;
  detail::DeviceGuard guard(state.device().index);
  const int blocks = int(std::min<int64_t>((n + kThreads - 1) / kThreads, 1024));
  count_tokens_kernel<<<blocks, kThreads, 0, detail::stream()>>>(state.data_as<int32_t>(), state.stride(0),
                                                                  state.shape(0), state.shape(1),
                                                                  rows.data_as<const int32_t>(), rows.stride(0),
                                                                  ids.data_as<const int32_t>(), ids.stride(0), n);
  detail::check_launch("count_tokens kernel launch", state.describe(), " ", rows.describe());
}

void mask_logits(Tensor& logits, const Tensor& rows, const Tensor& masks) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{&logits, &rows, &masks})
    DFLASH2_CHECK_ARG(t->defined() && t->device().is_cuda() && t->device() == logits.device(),
                      "cuda::mask_logits: every argument must be on the logits' CUDA device, found ",
                      t->defined() ? t->describe() : std::string("<undefined>"));
  const int64_t R = rows.shape(0), M = logits.shape(0), V = logits.shape(1);
  if (R == 0 || M == 0 || V == 0) return;
  DFLASH2_CHECK_ARG(R <= detail::kMaxGridY, "cuda::mask_logits: ", R, " mask rows are more than one launch takes");
  detail::DeviceGuard guard(logits.device().index);
  const dim3 grid(unsigned(std::min<int64_t>((V + kThreads - 1) / kThreads, 1024)), unsigned(R));
  mask_logits_kernel<<<grid, kThreads, 0, detail::stream()>>>(logits.data_as<float>(), logits.stride(0), M, V,
                                                             rows.data_as<const int32_t>(), rows.stride(0),
                                                             masks.data_as<const int32_t>(), masks.stride(0));
  detail::check_launch("mask_logits kernel launch", logits.describe(), " ", masks.describe());
}

}  // namespace dflash2::cuda
