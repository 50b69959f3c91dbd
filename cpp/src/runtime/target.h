// The target on the runtime side: the GLM model, its KV caches (main + MTP, one
// KvCache module each) and a planner, run chunk by chunk (chunked prefill, verify).
#pragma once
#include <memory>
#include <vector>

#include "model/glm_model.h"
#include "runtime/kv_cache.h"
#include "runtime/step_plan.h"

namespace dflash2::runtime {

class Target {
 public:
  struct Options {
    int64_t max_seq_len = 4096;
    int64_t max_batch_size = 8;
    int64_t max_step_tokens = 256;
    int64_t kv_block_size = 16;
  };
  Target(std::unique_ptr<model::GlmModel> model, const Options& opt);

  model::GlmModel& model() { return *model_; }
  const model::GlmConfig& config() const { return model_->config(); }
  const Options& options() const { return opt_; }
  KvCache& cache() { return cache_; }
  KvCache& mtp_cache() { return mtp_cache_; }

  // One chunk of at most max_step_tokens tokens through the decoder (pieces from
  // make_chunks); each piece's stream advances by its tokens. Logit rows (when
  // out.logits is defined and not all_logits) are the pieces that end their sequence.
  void run_chunk(const std::vector<Piece>& pieces, const model::ForwardOutputs& out);
  // The MTP layer over one chunk of pieces on MTP streams: tokens are the next tokens,
  // h_main F32 [T, H] the main model's final hidden states of the same positions; logits
  // [R, V] and hidden [R, H] (optional) for the pieces that end their sequence.
  // all_rows: logits (and hidden) for every row instead.
  void mtp_chunk(const std::vector<Piece>& pieces, const Tensor& h_main, Tensor& logits, Tensor& hidden,
                 bool all_rows = false);

 private:
  std::unique_ptr<model::GlmModel> model_;
  Options opt_;
  KvCache cache_, mtp_cache_;
  model::GlmCache views_, mtp_views_;
  StepPlanner planner_;
};

}  // namespace dflash2::runtime
