// The DFlash drafters: DFlash 2 (`DFlash2DraftModel`: two-tap dynamic convs per sublayer
// and a candidate selector) and DFlash 1 (`DFlashDraftModel`: neither). A block
// [anchor, MASK x (B-1)] is drafted in one pass over the draft's context cache, which
// holds K/V of the target's context features (taps of target_layer_ids) only.
#pragma once
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "dflash2/ops.h"
#include "dflash2/safetensors.h"
#include "model/draft_config.h"

namespace dflash2::model {



// One stream of context K/V in the draft cache (positions 0 .. length-1).
struct DraftStream {
  std::vector<int32_t> blocks;
  int64_t length = 0;
};

// What one drafted block proposes for one sequence.
struct DraftBlock {
  std::vector<int32_t> tokens;                 // B-1 drafted tokens
  std::vector<std::vector<int32_t>> cand;      // per position: top-k candidate ids (DFlash 2)
  std::vector<std::vector<float>> q;           // per position: proposal over cand (sampling; empty = one-hot)
};

class DFlashDrafter {
 public:
  static std::unique_ptr<DFlashDrafter> load(const Checkpoint& ck, const GlmConfig& target, const Tensor& embed,
                                             const ops::Weight& lm_head, int64_t max_seq_len, int64_t max_batch);
  ~DFlashDrafter();
  const DraftConfig& config() const { return cfg_; }
  int64_t block_size() const { return cfg_.block_size; }
  // DFlash 2 only: false drafts the argmax per position (convs still on), for ablations.
  void set_use_selector(bool on) { use_selector_ = on && cfg_.v2; }
  bool use_selector() const { return use_selector_; }

  // Appends context features for `n` committed tokens: taps[j] is F32 [n, H] = the target's
  // hidden state after layer target_layer_ids[j] for those tokens.
  void append_context(DraftStream& s, const std::vector<Tensor>& taps, int64_t n);
  void rollback(DraftStream& s, int64_t length);
  void release(DraftStream& s) { rollback(s, 0); }

  // Drafts one block per sequence: anchors[i] at position streams[i]->length. temperature
  // 0 walks the selector greedily; > 0 samples it and records q (DFlash 1 is always greedy).
  void draft(const std::vector<DraftStream*>& streams, const std::vector<int32_t>& anchors, float temperature,
             std::vector<std::mt19937_64*> rngs, std::vector<DraftBlock>& out);

 private:
  DFlashDrafter() = default;
  struct Layer;
  void ensure(DraftStream& s, int64_t len);
  float* kv(int64_t layer, int32_t block, int64_t off) const {
    return kv_base_ + ((layer * num_blocks_ + block) * kv_block_ + off) * (2 * kvdim_);
  }
  void conv(const Tensor& x, const float* base, const Tensor& dyn, int64_t side, int64_t nseq, Tensor& out) const;

  DraftConfig cfg_;
  std::shared_ptr<Checkpoint> ckpt_;
  Tensor embed_;
  ops::Weight lm_head_;
  ops::Weight fc_;
  Tensor hidden_norm_, norm_;
  std::vector<std::unique_ptr<Layer>> layers_;
  ops::Weight sel_proj_;
  Tensor pred_book_, succ_book_;  // [V, R]
  int64_t kvdim_ = 0, kv_block_ = 16, num_blocks_ = 0, max_seq_len_ = 0;
  Tensor kv_;
  float* kv_base_ = nullptr;
  std::vector<int32_t> free_;
  bool use_selector_ = true;
};

}  // namespace dflash2::model
