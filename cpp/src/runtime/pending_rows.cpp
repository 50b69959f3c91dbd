#include "runtime/pending_rows.h"

#include <algorithm>

namespace dflash2::runtime {

PendingRows::PendingRows(int64_t slots, int64_t per_slot, int64_t width, bool with_next, Device dev)
    : per_slot_(per_slot), with_next_(with_next) {
  buf_ = Tensor::zeros(DType::F32, {slots, per_slot, width}, dev);
  flat_ = buf_.reshape({slots * per_slot, width});
  if (with_next) next_.assign(size_t(slots * per_slot), 0);
  n_.assign(size_t(slots), 0);
}

void PendingRows::stage(const std::vector<CommitRows>& rows, const Tensor& src, const Run& run) {
  over_.clear();
  for (const CommitRows& r : rows)
    if (n_[size_t(r.slot)] + r.n > per_slot_) over_.push_back(r.slot);
  flush(over_, run);
  direct_.clear();
  for (const CommitRows& r : rows) {
    int64_t& n = n_[size_t(r.slot)];
    if (n + r.n > per_slot_) {
      direct_.push_back(r);
      continue;
    }
    Tensor dst = buf_.select(0, r.slot).slice(0, n, n + r.n);
    ops::copy(src.slice(0, r.row0, r.row0 + r.n), dst);
    if (with_next_) std::copy(r.next, r.next + r.n, next_.begin() + r.slot * per_slot_ + n);
    n += r.n;
  }
  if (!direct_.empty()) run(direct_, src);
}

void PendingRows::flush(const std::vector<int>& slots, const Run& run) {
  pend_.clear();
  for (int slot : slots) {
    if (n_[size_t(slot)] == 0) continue;
    CommitRows r;
    r.slot = slot;
    r.row0 = int64_t(slot) * per_slot_;
    r.n = n_[size_t(slot)];
    r.next = with_next_ ? next_.data() + r.row0 : nullptr;
    pend_.push_back(r);
    n_[size_t(slot)] = 0;
  }
  if (!pend_.empty()) run(pend_, flat_);
}

}  // namespace dflash2::runtime
