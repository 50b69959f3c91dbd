// One interface for every way of drafting: the target's MTP layer chained (mtp), and the
// DFlash 1 / DFlash 2 block drafters (dflash, dflash2). The engine hands a drafter the
// target features of newly committed positions (commit), asks it for a block per running
// sequence (draft), and frees a sequence's state when it ends (release). Sequences are
// identified by their slot (0 .. max_batch_size - 1).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dflash2/ops.h"
#include "dflash2/tensor.h"
#include "runtime/kv_cache.h"
#include "runtime/step_graphs.h"

namespace dflash2::model {
class DFlashDrafter;
}

namespace dflash2::runtime {

enum class Method { AR, MTP, DFlash, DFlash2 };
const char* method_name(Method m);
// "ar" | "mtp" | "dflash" | "dflash2" (an InvalidArgument error otherwise).
Method parse_method(const std::string& s);

// Newly committed target positions of one slot: rows [row0, row0 + n) of the features
// are positions pos0 .. pos0 + n - 1 (pos0 is the slot's committed length before them);
// next[i] is the token that follows position pos0 + i (the MTP layer's input).
struct CommitRows {
  int slot = 0;
  int64_t pos0 = 0, row0 = 0, n = 0;
  const int32_t* next = nullptr;
};
// The target's outputs the rows refer to.
struct Features {
  Tensor taps;          // F32 [rows, n_taps * H] (DFlash)
  Tensor final_hidden;  // F32 [rows, H] (MTP)
};

// A slot may appear in several jobs of one draft(): the decode loop's padding rows (`pad`)
// repeat a real job greedily, with temperature 0 and a counter of their own. A block
// drafter's draft reads the slot's context and writes nothing of it, so the rows are
// independent; a drafter that writes the slot's state while drafting (the MTP chain) drafts
// nothing for a padding row.
struct DraftJob {
  int slot = 0;
  bool pad = false;
  int32_t anchor = 0;        // the last committed token (at the slot's committed length)
  int64_t room = 0;          // positions left before max_seq_len after the anchor
  int64_t max_tokens = 0;    // draft at most this many (<= room; the speculation policy's length)
  float temperature = 0.0f;  // > 0: a drafter that can sample does (DFlash 2's selector)
  uint64_t rng_key = 0;      // the request's random stream (Philox key) ...
  uint64_t* rng_counter = nullptr;  // ... and its next counter, advanced by the draws taken
  // The request's repetition control (Core::pen_*), for a drafter that drafts under it: its
  // row of the penalty tables (-1: none), min_left, and (presence, frequency, repetition).
  int32_t pen_row = -1, pen_min_left = 0;
  float pen[3] = {0.0f, 0.0f, 1.0f};
};

// A drafter's output for the jobs of one draft() call (row i = job i), in its fixed buffers.
struct DraftResult {
  Tensor tokens;             // I32 [rows, K]: job i's draft is the first len[i] entries of row[i]
  std::vector<int64_t> len;  // per job (0: nothing drafted)
  std::vector<int64_t> row;  // per job
  Tensor cand, q;            // I32 / F32 [rows, K, top_k]: the selector's candidates and proposal
  bool has_q = false;        // q holds the sampled proposal (else drafts are one-hot)
  // A drafter on a CUDA device: the tokens / cand / q on the device (verify and acceptance
  // read them there); the host tensors above hold them only after Drafter::fetch_host().
  Tensor dev_tokens, dev_cand, dev_q;
};

class Drafter {
 public:
  virtual ~Drafter() = default;
  virtual int64_t draft_len() const = 0;  // K: tokens drafted per step at most
  // The engine's penalty tables (Core::pen_state / pen_bias), once they exist: a drafter
  // that can apply the requests' repetition control to its own predictions (DraftJob::pen_*)
  // does, so its drafts follow the penalized target (the DFlash drafters, where the head's
  // logits are whole on the tables' device).
  Tensor pen_state, pen_bias;
  virtual std::vector<int64_t> tap_layers() const { return {}; }
  virtual bool wants_final_hidden() const { return false; }
  // Where the drafter runs and wants its features (Features::taps / final) to be.
  virtual Device device() const { return Device::cpu(); }
  // The tensor-parallel ranks it runs on (a drafter split across them), else 1.
  virtual int tp_ranks() const { return 1; }
  // CUDA graphs of its own forward (the device DFlash drafter), for Engine::metrics().
  virtual GraphStats graph_stats() const { return {}; }
  // The DFlash drafters' model (its GEMM numerics: Engine draft_gemm); none for MTP.
  virtual model::DFlashDrafter* dflash_model() { return nullptr; }
  // Bytes of the drafter's own context cache (the DFlash draft cache; 0 for MTP).
  virtual int64_t cache_bytes() const { return 0; }
  virtual void commit(const std::vector<CommitRows>& rows, const Features& f) = 0;
  // Greedy drafts where a job's temperature is 0; DFlash 2's selector samples the others
  // and records q.
  virtual const DraftResult& draft(const std::vector<DraftJob>& jobs) = 0;
  // A drafter on a device leaves the last draft()'s outputs there (DraftResult::dev_*) and
  // does not wait for them: this copies them into the host tensors (tokens, cand, q) for a
  // caller that reads them there (Engine::propose). The decode loop does not need it: its
  // verify pass reads the drafts on the device and they come back with the step's results.
  virtual void fetch_host() {}
  // Whether draft() queues its device work in the target's StepRecorder while it records
  // (the whole step in one graph): the DFlash drafters and the MTP chain do.
  virtual bool records_steps() const { return false; }
  // Whether recorded steps are padded to batch-size buckets with it (its padding rows draft
  // like real ones, so the step's shapes are the bucket's).
  virtual bool pads_steps() const { return records_steps(); }
  // The verify pass's rows of a recorded step, in the order of its features (Features rows
  // 0..): slot -1 marks a padding sequence. A drafter whose context is built from those
  // rows one row at a time (DFlash) may queue their append in the step, after the verify
  // chunk (all of them: the rows past what acceptance commits sit beyond the slot's
  // committed length, where nothing reads them and the next step's append overwrites
  // them); then its commit() of those rows only sets the slot's length. Returns whether it
  // did (false: the rows come through commit() as usual).
  struct StepRows {
    int slot = -1;
    int64_t pos0 = 0, n = 0;  // the rows' positions: pos0 .. pos0 + n - 1
  };
  virtual bool append_in_step(const std::vector<StepRows>& rows, const Features& f) {
    (void)rows, (void)f;
    return false;
  }
  // Steps whose rows append_in_step queued (any thread).
  virtual int64_t appends_in_step() const { return 0; }
  // Acceptance's tensors in a recorded step (where it ran: the device, or the host), I32:
  // per sequence row0 / draft_row / draft_len (its verify rows and drafts), accepted and
  // bonus (written when acceptance runs), and the drafts [N, K] it read.
  struct StepAcceptance {
    Tensor row0, draft_row, draft_len, accepted, bonus, drafts;
  };
  // Called in a recorded step after acceptance is queued: a drafter whose state after the
  // step depends on what is accepted (the MTP layer: its cache over the committed rows, with
  // the bonus as the last row's next token) may queue that work in the step (ops that read
  // the acceptance's tensors on the device); then its commit() of those rows only sets the
  // length. Returns whether it did.
  virtual bool commit_in_step(const std::vector<StepRows>& rows, const Features& f, const StepAcceptance& acc) {
    (void)rows, (void)f, (void)acc;
    return false;
  }
  virtual void release(int slot) = 0;
  // Reserves the cache of `slot` for `tokens` positions up front (false: the pool lacks them).
  virtual bool reserve(int slot, int64_t tokens) = 0;
  // The drafter's own cache of the target's committed positions (DFlash: the context K / V;
  // MTP: the MTP layer's cache), for the prefix cache: the cache, a slot's stream in it, how
  // many of its positions hold their final rows, and attach(), which starts an empty slot
  // with `length` positions already in `blocks` (a cached prompt prefix; before reserve).
  virtual KvCache* context_cache() { return nullptr; }
  virtual const CacheStream* context_stream(int slot) const {
    (void)slot;
    return nullptr;
  }
  virtual int64_t context_filled(int slot) const {
    (void)slot;
    return 0;
  }
  virtual void attach(int slot, const std::vector<int32_t>& blocks, int64_t length) {
    (void)slot, (void)blocks, (void)length;
  }
  // Whether drafting k tokens costs ~k passes (MTP) rather than one block pass (DFlash).
  virtual bool draft_cost_scales_with_k() const { return false; }
};
// Drafters hold max_batch_size + 1 slots: the last (index max_batch_size) is Engine::propose's.

}  // namespace dflash2::runtime

namespace dflash2 {
class Checkpoint;
}

namespace dflash2::runtime {

class Target;
// The target's MTP layer chained to draft `draft_tokens` tokens per step.
std::unique_ptr<Drafter> make_mtp_drafter(Target& target, int64_t draft_tokens);
// A DFlash 1 / DFlash 2 drafter checkpoint for method dflash2 (needs DFlash 2) or dflash
// (DFlash 1, or DFlash 2 with the selector off: an ablation).
// Engine draft_gemm: the numerics of a loaded DFlash drafter that will run on `dev`.
using DraftGemmPicker = std::function<ops::GemmNumerics(const model::DFlashDrafter&, Device dev)>;
// pick: set before the runner is made (it decides the draft cache's dtype: BF16 with
// tensor-core numerics); empty = Exact.
std::unique_ptr<Drafter> make_dflash_drafter(const Checkpoint& ck, Target& target, Method method,
                                             const DraftGemmPicker& pick = {});

}  // namespace dflash2::runtime
