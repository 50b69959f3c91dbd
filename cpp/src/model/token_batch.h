// A planned forward chunk, as the model reads it: fixed I32 buffers filled by the
// planner (runtime/step_plan.h) on the host; the model never looks at host bookkeeping.
#pragma once
#include <cstdint>

#include "dflash2/ops.h"

namespace dflash2::model {

struct TokenBatch {
  int64_t T = 0;             // tokens in this chunk
  int64_t S = 0;             // sequences (block-table rows)
  Tensor tokens;             // I32 [T] token ids
  ops::PagedTokens paged;    // seq / pos I32 [T], block_table I32 [S, max_blocks], block_size
  Tensor slots;              // I32 [T]: cache row of each token's position
  Tensor logit_rows;         // I32 [R]: the rows whose logits are wanted (R may be 0)
  Tensor ctx_len;            // I32 [S]: each sequence's committed length (drafter blocks)
};

}  // namespace dflash2::model
