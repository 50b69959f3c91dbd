// The DFlash drafters: DFlash 2 (`DFlash2DraftModel`: two-tap dynamic convs per sublayer
// and a candidate selector) and DFlash 1 (`DFlashDraftModel`: neither). A block
// [anchor, MASK x (B-1)] is drafted in one pass over the draft's context cache, which
// holds K/V of the target's context features (taps of target_layer_ids) only. Written
// against the op interface: no loops over tensor data, no allocation per call (the
// workspace is an Arena planned at load).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "dflash2/arena.h"
#include "dflash2/ops.h"
#include "dflash2/safetensors.h"
#include "model/draft_config.h"
#include "model/token_batch.h"

namespace dflash2::model {

// What draft() writes (fixed buffers of the caller, rows = sequences of the batch).
struct DraftOutputs {
  Tensor tokens;  // I32 [S, B-1]: the drafted tokens
  Tensor cand;    // I32 [S, B-1, K]: the selector's candidates (DFlash 2 with the selector)
  Tensor q;       // F32 [S, B-1, K]: the selector's proposal over cand (sampling only)
  // Optional (seq defined): the requests' repetition control applied to the head's logits
  // before the argmax / the selector's top-k (ops::apply_penalties with one row per
  // "sequence": row0 [R] = 0..R-1, draft_len 0, seq / params per head row), so the drafts
  // follow the penalized target; drafts from them stay lossless (q is what was drawn from).
  struct Penalties {
    Tensor row0, draft, draft_row, draft_len, seq, params, state, bias;
  } pen;
};

class DFlashDrafter {
 public:
  // max_context_tokens: the largest append_context chunk; max_seqs: the largest draft batch.
  // Tensor parallelism (tp_size > 1: the drafter split across the target's ranks, rank
  // tp_rank of them; split_ok says when it can be): this rank holds query heads [r nh/N,
  // (r+1) nh/N) -- their q_proj rows and o_proj columns --, the key / value heads they read
  // (k / v rows: kvh/N of them, or the one shared head when N > kvh), a 1/N slice of the MLP
  // intermediate (gate / up rows, down columns); norms and convs are replicated; fc and
  // hidden_norm (the context features) and the selector live on rank 0 only. `embed` is
  // then this rank's vocabulary shard of the target's embedding (the block's embedding is a
  // sum of shards), and there is no LM head (drop_head: it runs on the target's shards).
  // set_comm gives the group's communicator: the forward all-reduces after o_proj and after
  // the MLP, like the target's.
  static std::unique_ptr<DFlashDrafter> load(const Checkpoint& ck, const GlmConfig& target, const Tensor& embed,
                                             const ops::Weight& lm_head, int64_t max_context_tokens,
                                             int64_t max_seqs, int64_t tp_rank = 0, int64_t tp_size = 1);
  // Whether the drafter of config c splits across n ranks (its query heads, MLP intermediate
  // and the key / value heads' groups divide evenly); else why not.
  static bool split_ok(const DraftConfig& c, int64_t n, std::string* why);
  void set_comm(comm::Communicator* c) { comm_ = c; }
  int64_t tp_rank() const { return rank_; }
  int64_t tp_size() const { return size_; }
  ~DFlashDrafter();
  const DraftConfig& config() const { return cfg_; }
  int64_t block_size() const { return cfg_.block_size; }
  // K (and V) floats per token per layer in this rank's draft cache (its key / value heads)
  int64_t kv_dim() const { return kvh_ * cfg_.head_dim; }
  // Copies the drafter's weights, constant buffers and workspace to `dev` (once, at load);
  // embed / lm_head: the target's copies of them on that device (shared, not copied), or
  // undefined (embed, lm_head.data) to copy the full ones given to load() -- a target split
  // by tensor parallelism holds only its vocabulary shards on each GPU. After drop_head()
  // only the embedding is copied (embed undefined).
  void to_device(Device dev, const Tensor& embed, const ops::Weight& lm_head);
  // The LM head over the block runs elsewhere -- tensor parallelism: on every rank's
  // vocabulary shard of the target's head (runtime Target::vocab_head) -- so the drafter
  // lets go of its head and of the block's logits in its workspace (on the host, before
  // to_device); a draft is then draft_rows, that head, then draft_select.
  void drop_head();
  // Bytes to_device allocates: its own weights (not the shared embedding / LM head) and the
  // workspace.
  size_t device_bytes() const;
  // Bytes of the full embedding and LM head (a tied head once): what to_device adds when it
  // copies them (after drop_head: the embedding only).
  size_t vocab_bytes() const;
  // Whether the LM head runs here (not after drop_head).
  bool head_here() const { return head_here_; }
  Device device() const { return device_; }
  // The numerics of the drafter's projections and of the LM head over the block (Engine
  // draft_gemm): Exact runs ops::linear (fp32, the CPU's default), the others ops::linear_as
  // (the tensor cores on a GPU), and then the block attention may take the tensor cores too
  // (BlockAttention::tensor_cores). Drafts only steer acceptance, so decoding stays lossless
  // whichever it is.
  // (NVFP4 on a GPU: its W4A4 weights' scales are prepared once, ops::prepare_nvfp4_scales.)
  void set_gemm(ops::GemmNumerics g);
  ops::GemmNumerics gemm() const { return gemm_; }
  // Whether any of the drafter's own projections (not the target's LM head) satisfies `is`.
  bool any_weight(bool (*is)(const ops::Weight&)) const;
  // DFlash 2 only: false drafts the argmax per position (convs still on), for ablations.
  void set_use_selector(bool on) { use_selector_ = on && cfg_.v2; }
  bool use_selector() const { return use_selector_; }

  // Context features of newly committed tokens: taps F32 [T, n_taps * H] (the target's
  // hidden states after target_layer_ids, in that order) -> fc -> hidden_norm -> per layer
  // K (k_norm, NeoX RoPE at batch.paged.pos) and V, written to kv_layers[l] at batch.slots.
  // Split (tp_size > 1): rank 0 computes the normed features from its taps (the others'
  // taps are not read) and broadcasts them; every rank writes its key / value heads.
  void append_context(const TokenBatch& batch, const Tensor& taps, const std::vector<Tensor>& kv_layers);
  // Drafts one block per sequence: batch.tokens = [anchor, MASK...] per sequence (T = S*B),
  // positions ctx_len[s] + j, context in kv_layers (paged by batch.paged.block_table).
  // temperature F32 [S]: 0 walks the selector greedily; > 0 samples it (B-1 draws of rng
  // I64 [S, 2], see ops::selector_walk) and writes q. DFlash 1 (and dflash) take the argmax.
  void draft(const TokenBatch& batch, const std::vector<Tensor>& kv_layers, const Tensor& temperature,
             const Tensor& rng, DraftOutputs& out);
  // draft() in its three parts, for a head that runs elsewhere (drop_head):
  //   draft_rows    the block through the layers and the final norm: the head's input rows
  //                 head_rows(S) F32 [S (B-1), H] (and the selector's factors of them);
  //   the head      draft_head here: the LM head over those rows, then, with the selector,
  //                 ops::topk of head_topk() into head_values(S) F32 [S (B-1), K] and out.cand
  //                 (its ids), else ops::argmax into out.tokens;
  //   draft_select  the selector's walk over them (nothing without the selector).
  // The rows and values live in the workspace until the next draft_rows or append_context.
  void draft_rows(const TokenBatch& batch, const std::vector<Tensor>& kv_layers);
  void draft_head(int64_t S, DraftOutputs& out);
  void draft_select(const TokenBatch& batch, const Tensor& temperature, const Tensor& rng, DraftOutputs& out);
  // K of the head's top-k (the selector's candidates), or 0 when the head's argmax is the draft.
  int64_t head_topk() const { return cfg_.v2 && use_selector_ ? cfg_.selector_top_k : 0; }
  Tensor head_rows(int64_t S);
  Tensor head_values(int64_t S);

 private:
  DFlashDrafter() = default;
  struct Layer;
  struct Bufs;
  Bufs alloc_append(Arena& a, int64_t n) const;
  Bufs alloc_draft(Arena& a, int64_t seqs) const;
  Bufs draft_bufs(int64_t seqs);  // draft_rows' tensors again (after it ran)
  std::vector<ops::Weight*> own_weights();  // the drafter's projections (defined or not)
  std::vector<const ops::Weight*> own_weights() const;
  void all_reduce(Tensor& x) const;  // split: the ranks' partial sums


  DraftConfig cfg_;
  std::shared_ptr<Checkpoint> ckpt_;
  Tensor embed_;
  ops::Weight lm_head_;
  ops::Weight fc_;
  Tensor hidden_norm_, norm_;
  std::vector<std::unique_ptr<Layer>> layers_;
  ops::Weight sel_proj_;
  Tensor pred_book_, succ_book_;  // [V, R]
  int64_t max_ctx_ = 0, max_seqs_ = 0;
  std::unique_ptr<Arena> ws_;
  Tensor logit_rows_;  // I32 [max_seqs * (B-1)]: rows s*B + 1 + t of a drafted batch
  bool use_selector_ = true;
  bool head_here_ = true;  // false after drop_head
  ops::GemmNumerics gemm_ = ops::GemmNumerics::Exact;
  Device device_ = Device::cpu();
  // tensor parallelism: this rank, its query / key-value heads and MLP intermediate
  int64_t rank_ = 0, size_ = 1, nh_ = 0, kvh_ = 0, inter_ = 0;
  comm::Communicator* comm_ = nullptr;
};

}  // namespace dflash2::model
