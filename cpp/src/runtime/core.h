// What every generation of an engine shares: the target, the drafter, and the step
// buffers allocated once at load (logits, drafter features, sampling / acceptance plan
// rows). Engine owns one; a Batch runs its requests on it.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dflash2/engine.h"
#include "dflash2/ops.h"
#include "runtime/drafter.h"
#include "runtime/staging.h"
#include "runtime/target.h"

namespace dflash2::runtime {

struct Core {
  std::unique_ptr<Target> target;
  std::unique_ptr<Drafter> drafter;  // null for ar
  int64_t K = 0;                     // draft tokens per verify step (0 for ar)
  std::vector<int64_t> taps;         // target layers the drafter reads
  bool want_final = false;           // the drafter reads the final hidden states (MTP)
  int num_threads = 0;
  // step buffers: logits of a verify step or of a prefill chunk's last rows, the drafter's
  // features (taps, final hidden) of a chunk or a verify step, non-finite flags per row
  Tensor logits, taps_buf, fin, flags;
  // sampling / acceptance plan rows (one per sequence of a step), filled on the host
  Tensor s_temp, s_topp, s_topk, s_rng, s_out;
  Tensor a_row0, a_draft_row, a_draft_len, a_accepted, a_bonus;
  Tensor no_drafts;  // I32 [B, 1] zeros on `device` (ar's drafts: acceptance reads them there)
  // The verify rows' argmax ids I32 [B (K + 1)] on `device`, for greedy steps that reduce
  // the logits to (max, id) pairs (ForwardOutputs::argmax_only): under tensor parallelism
  // (the pairs are gathered instead of the logits) and on one GPU (fewer launches);
  // undefined on one CPU rank or where ids are not exact in F32 (vocabulary > 2^24).
  Tensor ids;
  // host bookkeeping reused across steps
  std::vector<std::vector<Piece>> chunks;

  // CUDA target: `logits` lives on the target's (rank 0's) device and the decode loop's ops
  // run there on device copies of the plan rows below. The rows a step needs (sampling
  // parameters, Philox states, acceptance rows) are packed on the host into pinned staging
  // and go up in one asynchronous copy (in_up; d_rng .. d_draft_len view its device
  // buffer); the flags,
  // accepted counts, bonus and sampled tokens are written into one device buffer (d_res
  // views), and a drafter on the device has its drafts copied beside them (device to
  // device), so all of it comes back in one asynchronous copy into pinned memory (h_res),
  // waited for by an event: the one host wait of a step.
  // The drafter's features (taps_buf, fin) live on the drafter's device
  // (Drafter::device(): the GPU for the DFlash drafter without tensor parallelism, else
  // the host).
  Device device = Device::cpu();
  Tensor d_res, h_res;  // packed results (device / host)
  Tensor d_flags, d_temp, d_topp, d_topk, d_rng, d_out, d_row0, d_draft_row, d_draft_len, d_accepted, d_bonus;
  StagedUpload in_up;     // CUDA: the packed inputs' staging and device buffer
  PinnedResults res_pin;  // CUDA: h_res's pinned memory
  Tensor d_step_drafts, h_step_drafts;  // I32 [max_batch_size + 1, K]: regions of d_res / h_res
  // Marks of a decode step: 0 before the draft, 1 after it, 2 after the verify pass, 3
  // after acceptance (recorded by accept_rows before the results are fetched).
  StepMarks marks;
  // After accept_rows: the host's view of the step's drafts (rows as the DraftResult's):
  // the drafter's own host tensor, or the copy that came back with the results.
  Tensor drafts_host;
  Tensor d_drafts, d_cand, d_q;  // grown to the drafter's shapes on first use

  // Allocates the step buffers for the target / drafter already set.
  void allocate_buffers();
  // Whether decode steps (that fit max_step_tokens) are recorded as one unit: the target
  // can record them (Target::can_record_steps) and so can the drafter, if any (MTP under
  // tensor parallelism cannot). The decoder records by it; capture_at_load "auto" follows it.
  bool records_steps() const {
    return target->can_record_steps() && (!drafter || drafter->records_steps());
  }
  // Flags (1 = NaN or Inf present) of the first `rows` logits rows, into `flags`: at once on
  // the CPU; on CUDA they come back with the next sample_rows / accept_rows (one copy for
  // the whole step), and `flags` is valid after that.
  void check_rows(int64_t rows);
  // s_out[0 .. R) = a token per logits row from sampling rows [0, R) (s_temp .. s_rng).
  void sample_rows(int64_t R);
  // s_out[0] = argmax of logits row 0.
  void argmax_row0();
  // a_accepted / a_bonus [0, S) = ops::accept over logits rows [0, rows) with plan rows
  // a_row0 / a_draft_row / a_draft_len and sampling rows [0, S); drafts I32 [N, K] and the
  // selector's cand / q (undefined: one-hot proposals) on the host or already on the device.
  // in_step: in a recorded step, called after acceptance is queued (before the flush) with
  // its tensors (Drafter::commit_in_step).
  // target_ids (a greedy step with argmax ids, rows of `ids`): acceptance from the
  // target's argmax ids (ops::accept_greedy) instead of the logits; not in a recorded step.
  void accept_rows(int64_t rows, int64_t S, const Tensor& drafts, const Tensor& cand, const Tensor& q,
                   const std::function<void(const Drafter::StepAcceptance&)>& in_step = nullptr,
                   const Tensor& target_ids = Tensor());
  // Log-probabilities of logits rows [lo, rows) at lp_ids' ids (host, row i at i): lp_val /
  // lp_lse (ops::token_logprobs) and with top > 0 the rows' top ids and logits (lp_topi /
  // lp_topv, row i's at i * top: ops::topk). Eager, after the step's results are back: on
  // CUDA one upload, the two ops, and copies back (a second wait, in the steps of requests
  // that asked for log-probabilities only).
  Tensor lp_ids, lp_val, lp_lse, lp_topv, lp_topi;
  Tensor d_lp_ids, d_lp_val, d_lp_lse, d_lp_topv, d_lp_topi;
  void logprobs(int64_t lo, int64_t rows, int64_t top);
  // Repetition control (SamplingParams' penalties, logit_bias and min_tokens;
  // ops::apply_penalties): per-slot tables on `device` -- pen_state I32 [max_batch_size, V]
  // (token counts | stop bit | prompt bit), pen_bias F32 [max_batch_size, V] -- made when the
  // first request that asks for them is admitted (ensure_penalties), and the rows of a
  // step's sequences, filled on the host by the decoder: pen_seq I32 [B, 2] = (table row, or
  // -1 for a sequence without any, min_left), pen_par F32 [B, 3] (on CUDA they go up with the
  // sampling rows: d_pen_seq / d_pen_par). pen_rows > 0: the next sample_rows / accept_rows
  // applies them to that many sequences first (the decoder sets it per step; 0: no op).
  Tensor pen_state, pen_bias, pen_seq, pen_par, d_pen_seq, d_pen_par;
  Tensor pen_cnt;       // count_penalized's rows and ids (the CPU)
  StagedUpload cnt_up;  // ... on CUDA: packed into pinned staging, one asynchronous copy up
  int64_t pen_rows = 0;
  void ensure_penalties();
  // Table row `slot` for a new request: no counts, its prompt's tokens and its stop tokens
  // marked, its logit bias (a later pair for the same token replaces an earlier one).
  void reset_penalties(int64_t slot, const std::vector<int32_t>& prompt, const std::vector<int32_t>& stops,
                       const std::vector<std::pair<int32_t, float>>& bias);
  // Adds committed tokens to their slots' counts (ops::count_tokens; slots[i] -> ids[i]).
  void count_penalized(const std::vector<int32_t>& slots, const std::vector<int32_t>& ids);
  // Structured output (SamplingParams::constraint; ops::mask_logits): the token masks of a
  // step's constrained rows, filled on the host by the decoder: mask_bits I32 [verify_rows, W]
  // (W = ceil(V / 32)), mask_rows I32 [verify_rows] (row i's logits row), made at the first
  // constrained request (ensure_masks). mask_count > 0: the next sample_rows / accept_rows
  // masks that many rows, after the penalties (on CUDA the rows go up first, d_mask_*). A step
  // that masks is never recorded (its masks need the drafts on the host).
  Tensor mask_bits, mask_rows, d_mask_bits, d_mask_rows;
  int64_t mask_count = 0;
  void ensure_masks();
  int64_t mask_words() const { return (logits.shape(1) + 31) / 32; }
  // The flags buffer the verify pass writes (the host's on the CPU, the device results' on CUDA).
  Tensor flags_out(int64_t row0, int64_t row1) const {
    return (device.is_cuda() ? d_flags : flags).slice(0, row0, row1);
  }
  // CUDA: packs the first n sampling rows (and with accept the acceptance rows) into the
  // staging and uploads them in one asynchronous copy; brings d_res back into
  // h_res in one asynchronous copy (with the first draft_rows rows of the drafts region)
  // and waits for it.
  void upload_inputs(int64_t n, bool accept);
  void download_results(int64_t draft_rows = 0);
  // The plan buffers' first n sampling rows.
  ops::SamplingTensors sampling_rows(int64_t n) const {
    return {s_temp.slice(0, 0, n), s_topp.slice(0, 0, n), s_topk.slice(0, 0, n)};
  }
};

// Row i's TokenLogprobs from ops::token_logprobs' lp / lse and ops::topk's `top` values /
// ids of that row (the top log-probabilities are the logits minus the F32 lse, in double).
void set_token_logprobs(TokenLogprobs& o, float lp, float lse, const float* top_vals, const int32_t* top_ids,
                        int64_t top);

// The Philox key of request `index` of a call with `seed` (< 0: nondeterministic).
uint64_t rng_key(int64_t seed, int64_t index);

}  // namespace dflash2::runtime
