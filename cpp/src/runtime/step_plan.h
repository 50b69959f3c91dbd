// Plan on the host, run from fixed buffers: the planner turns "these sequences get these
// new tokens" into the I32 tensors a forward chunk reads (token ids, positions, the
// block-table row of each token, cache slots, block tables, logit rows), reserving cache
// blocks for the new positions. Its buffers are allocated once, for the largest step.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "model/token_batch.h"
#include "runtime/kv_cache.h"
#include "runtime/staging.h"

namespace dflash2::runtime {

// Part of one sequence's new tokens inside a chunk.
struct Piece {
  CacheStream* stream = nullptr;
  const int32_t* tokens = nullptr;  // n token ids (may be null for plans without ids)
  int64_t n = 0;
  int64_t seq = 0;     // index of the sequence in the caller's list
  int64_t offset = 0;  // of the piece within the sequence's new tokens
  bool last = false;   // holds the sequence's last new token
};

// Splits the new tokens of `n_seqs` sequences (counts[i] tokens each, streams[i]) into
// chunks of at most max_tokens tokens; a sequence may continue in the next chunk.
void make_chunks(const std::vector<CacheStream*>& streams, const std::vector<const int32_t*>& tokens,
                 const std::vector<int64_t>& counts, int64_t max_tokens, std::vector<std::vector<Piece>>& chunks);

// dst = the rows of src that a chunk's pieces stand for: piece p covers rows
// first_row[p.seq] + p.offset ... (e.g. committed rows of the target's features), gathered
// in chunk order into a prefix of dst_buf (idx_buf: an I32 plan buffer, host: scratch;
// idx_up, for a device src: the indices go up through it without a host wait instead).
void gather_rows_of_pieces(const std::vector<Piece>& chunk, const std::vector<int64_t>& first_row, const Tensor& src,
                           Tensor& idx_buf, std::vector<int32_t>& host, Tensor& dst_buf, Tensor& dst,
                           StagedUpload* idx_up = nullptr);

// A planned chunk on a CUDA device: the host packs the planner's I32 buffers into a
// StagedUpload (pinned staging, one asynchronous copy on the current stream into one
// device buffer), and the returned batch views the device buffer. Kernels of the previous
// chunk that read the device buffer come before the copy in stream order.
class PlanUploader {
 public:
  // words: the largest packed plan in I32 elements (planned_words below).
  PlanUploader(Device dev, int64_t words);
  ~PlanUploader();
  PlanUploader(const PlanUploader&) = delete;
  PlanUploader& operator=(const PlanUploader&) = delete;
  model::TokenBatch upload(const model::TokenBatch& host);
  int64_t capacity() const { return up_.capacity(); }  // in I32 words
  // The words a batch packs into.
  static int64_t words_of(const model::TokenBatch& b);
  // The words a planner's largest batch packs into.
  static int64_t planned_words(int64_t max_tokens, int64_t max_seqs, int64_t max_blocks_per_seq) {
    return 4 * max_tokens + (max_tokens > max_seqs ? max_tokens : max_seqs) + max_seqs * max_blocks_per_seq +
           max_seqs;
  }

 private:
  StagedUpload up_;
};

class StepPlanner {
 public:
  StepPlanner() = default;
  StepPlanner(int64_t max_tokens, int64_t max_seqs, int64_t max_blocks_per_seq, Device dev = Device::cpu());
  int64_t max_tokens() const { return max_tokens_; }
  int64_t max_seqs() const { return max_seqs_; }
  // One chunk: positions continue each stream at stream->length; the cache gets blocks for
  // them (the caller advances stream->length after the forward). logit_rows lists, in
  // order, the row of each piece's last token when it is the sequence's last (`last`).
  // all_rows: every row gets logits instead.
  model::TokenBatch plan(const std::vector<Piece>& pieces, KvCache& cache, bool all_rows = false);
  // A batch without new cache positions: S sequences of `per_seq` tokens each at positions
  // stream->length + j (the drafter's block), block tables only.
  model::TokenBatch plan_blocks(const std::vector<CacheStream*>& streams, int64_t per_seq, const KvCache& cache);

 private:
  model::TokenBatch views(int64_t T, int64_t S, int64_t block_size) const;
  int64_t max_tokens_ = 0, max_seqs_ = 0, max_blocks_ = 0;
  Tensor tokens_, seq_, pos_, slots_, block_table_, logit_rows_, ctx_len_;
};

}  // namespace dflash2::runtime
