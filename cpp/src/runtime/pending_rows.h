// Committed rows a drafter keeps per slot until the slot drafts next: while the speculation
// policy drafts nothing, a drafter does no work; the rows are then processed in one batch
// (each row is computed alone, so batching them later changes nothing). Shared by the DFlash
// drafter (context features) and the MTP drafter (final hidden states + next tokens).
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "dflash2/ops.h"
#include "runtime/drafter.h"

namespace dflash2::runtime {

class PendingRows {
 public:
  // Processes rows (CommitRows::row0.. of a source tensor) for their slots.
  using Run = std::function<void(const std::vector<CommitRows>& rows, const Tensor& src)>;

  PendingRows() = default;
  PendingRows(int64_t slots, int64_t per_slot, int64_t width, bool with_next, Device dev = Device::cpu());
  int64_t count(int slot) const { return n_[size_t(slot)]; }
  void clear(int slot) { n_[size_t(slot)] = 0; }
  // Keeps what fits; a slot whose buffer would overflow is run first (its pending rows), and
  // rows larger than a buffer (a prefill chunk) are run directly from src.
  void stage(const std::vector<CommitRows>& rows, const Tensor& src, const Run& run);
  // Runs the pending rows of `slots` (each once); next tokens come from the buffer.
  void flush(const std::vector<int>& slots, const Run& run);

 private:
  int64_t per_slot_ = 0;
  bool with_next_ = false;
  Tensor buf_, flat_;             // [slots, per_slot, width] and its [slots * per_slot, width] view
  std::vector<int32_t> next_;     // [slots * per_slot] (with_next)
  std::vector<int64_t> n_;
  std::vector<int> over_;
  std::vector<CommitRows> direct_, pend_;
};

}  // namespace dflash2::runtime
