// The GLM-5.x target (`glm_moe_dsa`) on the op interface: MLA with a latent cache
// (absorbed form for every step: prefill, decode and verify round identically), the DSA
// indexer with IndexShare, MoE with group-limited sigmoid routing and a shared expert,
// dense layers, and the MTP layer. No backend code here.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "dflash2/arena.h"
#include "dflash2/ops.h"
#include "dflash2/safetensors.h"
#include "model/glm_config.h"

namespace dflash2::model {

// A paged cache for `n_layers` attention layers: per token per layer the MLA latent
// [c (kv_lora) | k_pe (rope)] and, for layers that run an indexer, the indexer key.
class PagedCache {
 public:
  PagedCache() = default;
  PagedCache(int64_t n_layers, int64_t latent_dim, const std::vector<bool>& has_index, int64_t index_dim,
             int64_t block_size, int64_t num_blocks);
  int64_t block_size() const { return block_size_; }
  int64_t num_blocks() const { return num_blocks_; }
  int64_t free_blocks() const { return int64_t(free_.size()); }
  int32_t alloc_block();
  void free_block(int32_t b) { free_.push_back(b); }
  float* latent(int64_t layer, int32_t block, int64_t off) const {
    return latent_base_ + ((layer * num_blocks_ + block) * block_size_ + off) * latent_dim_;
  }
  float* index_key(int64_t layer, int32_t block, int64_t off) const {
    return index_base_ + ((index_slot_[layer] * num_blocks_ + block) * block_size_ + off) * index_dim_;
  }

 private:
  int64_t latent_dim_ = 0, index_dim_ = 0, block_size_ = 0, num_blocks_ = 0;
  std::vector<int64_t> index_slot_;
  Tensor latent_, index_;
  float* latent_base_ = nullptr;
  float* index_base_ = nullptr;
  std::vector<int32_t> free_;
};

// One stream of tokens in a PagedCache (a block table and a length).
struct CacheStream {
  std::vector<int32_t> blocks;
  int64_t length = 0;
};

struct Layer;  // weights of one decoder layer (glm_model.cpp)

class GlmModel {
 public:
  struct Options {
    int64_t max_seq_len = 4096;
    int64_t max_batch_size = 8;
    int64_t max_step_tokens = 256;  // longer prefills are chunked
    int64_t kv_block_size = 16;
  };
  // One sequence's part of a step: `n` new tokens appended to `stream` at positions
  // stream->length ... stream->length + n - 1.
  struct StepSeq {
    CacheStream* stream;
    const int32_t* tokens;
    int64_t n;
  };

  static std::unique_ptr<GlmModel> load(const Checkpoint& ckpt, const Options& opt);
  ~GlmModel();

  const GlmConfig& config() const { return cfg_; }
  const Options& options() const { return opt_; }
  bool has_mtp() const { return mtp_ != nullptr; }
  const Tensor& embed_tokens() const { return embed_; }
  const ops::Weight& lm_head() const { return lm_head_; }

  // Runs the new tokens of every sequence through the model, appending to their caches.
  // logits: F32 [sum n, V] (all rows) or [num seqs, V] (last row of each) as `all_logits`
  // says; hidden: for each id in hidden_layers, F32 [sum n, H] = the hidden state after
  // decoder layer id; final_hidden (if defined) receives the state after model.norm.
  // Tokens beyond max_step_tokens are processed in chunks. Outputs must be preallocated.
  void forward(const std::vector<StepSeq>& seqs, bool all_logits, Tensor& logits,
               const std::vector<int64_t>& hidden_layers, std::vector<Tensor>& hidden, Tensor& final_hidden);
  // The MTP layer: next_tokens [n] are the tokens t+1 and h_main [n, H] the main model's
  // final (normed) hidden states at t; appends to the MTP stream; logits F32 [n, V].
  // If mtp_hidden is defined it receives the layer's output hidden state [n, H] (before
  // shared_head.norm), which chained drafting feeds back as the next step's h_main.
  void mtp_forward(CacheStream& stream, const int32_t* next_tokens, const Tensor& h_main, int64_t n, Tensor& logits,
                   Tensor* mtp_hidden = nullptr);

  void rollback(CacheStream& s, int64_t length, bool mtp = false);
  void release(CacheStream& s, bool mtp = false) { rollback(s, 0, mtp); }
  int64_t max_streams_tokens() const { return opt_.max_seq_len; }

 private:
  GlmModel() = default;
  struct Step;  // per-chunk bookkeeping
  struct Piece {  // part of one sequence's new tokens inside a chunk
    StepSeq s;
    int64_t seq;  // index in forward()'s seqs
    bool last;    // holds the sequence's last new token
  };
  void ensure_capacity(CacheStream& s, int64_t new_len, PagedCache& cache);
  void run_chunk(const std::vector<Piece>& pieces, bool all_logits, Tensor& logits,
                 const std::vector<int64_t>& hidden_layers, std::vector<Tensor>& hidden, int64_t row0,
                 Tensor& final_hidden);
  void layer_forward(const Layer& L, int64_t cache_layer, PagedCache& cache, Step& st, Tensor& h);
  void plan_workspace();

  GlmConfig cfg_;
  Options opt_;
  std::shared_ptr<Checkpoint> ckpt_;
  Tensor embed_;  // [V, H] (F32/BF16/F16 view into the checkpoint)
  ops::Weight lm_head_;
  Tensor final_norm_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::unique_ptr<Layer> mtp_;
  Tensor mtp_enorm_, mtp_hnorm_, mtp_head_norm_, mtp_embed_;
  ops::Weight mtp_eh_proj_, mtp_head_;
  PagedCache cache_, mtp_cache_;
  std::unique_ptr<Arena> ws_;
  Tensor last_rows_;  // [max_batch_size, H]: normed last rows for last-row logits
  int nthreads_ = 1;
};

}  // namespace dflash2::model
