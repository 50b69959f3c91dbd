#include "runtime/kv_cache.h"

#include <algorithm>

#include "dflash2/error.h"

namespace dflash2::runtime {

KvCache::KvCache(std::string name, const std::vector<Plane>& planes, int64_t block_size, int64_t num_blocks,
                 Device dev, int replicas)
    : name_(std::move(name)), block_size_(block_size), num_blocks_(num_blocks), max_blocks_per_stream_(num_blocks) {
  DFLASH2_CHECK_ARG(block_size >= 1 && num_blocks >= 1 && replicas >= 1, name_,
                    ": block_size, num_blocks and replicas must be >= 1");
  nplanes_ = planes.size();
  for (int r = 0; r < replicas; ++r) {
    // tensor parallelism on CUDA: replica r lives on rank r's GPU (dev.index + r)
    const Device d = dev.is_cuda() ? Device::cuda(dev.index + r) : dev;
    for (const Plane& p : planes)
      planes_.push_back(p.layers > 0 ? Tensor::zeros(p.dtype, {p.layers, num_blocks * block_size, p.dim}, d)
                                     : Tensor());
  }
  free_.reserve(size_t(num_blocks));
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(int32_t(b));
  ref_.assign(size_t(num_blocks), 0);
}

bool KvCache::make_room(int64_t blocks) {
  while (int64_t(free_.size()) < blocks)
    if (!evict_ || !evict_()) return false;
  return true;
}

int32_t KvCache::take() {
  const int32_t b = free_.back();
  free_.pop_back();
  ref_[size_t(b)] = 1;
  return b;
}

void KvCache::share(CacheStream& s, const std::vector<int32_t>& blocks) {
  DFLASH2_INTERNAL(s.blocks.empty() && s.length == 0, name_, ": shared blocks go into an empty stream");
  DFLASH2_CHECK_ARG(int64_t(blocks.size()) <= max_blocks_per_stream_, name_, ": ", blocks.size(),
                    " shared blocks but a sequence may hold at most ", max_blocks_per_stream_);
  for (int32_t b : blocks) {
    hold(b);
    s.blocks.push_back(b);
  }
}

void KvCache::hold(int32_t b) {
  DFLASH2_INTERNAL(b >= 0 && b < num_blocks_ && ref_[size_t(b)] > 0, name_, ": holding block ", b,
                   " that nothing holds");
  ++ref_[size_t(b)];
}

void KvCache::drop(int32_t b) {
  DFLASH2_INTERNAL(b >= 0 && b < num_blocks_ && ref_[size_t(b)] > 0, name_, ": dropping block ", b,
                   " that nothing holds");
  if (--ref_[size_t(b)] == 0) free_.push_back(b);
}

Tensor KvCache::layer(size_t plane, int64_t layer, int replica) const {
  const size_t i = size_t(replica) * nplanes_ + plane;
  DFLASH2_INTERNAL(plane < nplanes_ && i < planes_.size() && planes_[i].defined() && layer >= 0 &&
                       layer < planes_[i].shape(0),
                   name_, ": no plane ", plane, " layer ", layer, " replica ", replica);
  return planes_[i].select(0, layer);
}

void KvCache::reserve(CacheStream& s, int64_t new_len) {
  const int64_t need = (new_len + block_size_ - 1) / block_size_;
  DFLASH2_CHECK_ARG(need <= max_blocks_per_stream_, name_, ": a sequence of ", new_len, " tokens needs ", need,
                    " blocks of ", block_size_, " but a sequence may hold at most ", max_blocks_per_stream_);
  const int64_t more = need - int64_t(s.blocks.size());
  if (more <= 0) return;
  if (!make_room(more))
    fail(ErrorKind::OutOfMemory, name_, " is full: ", more, " more blocks of ", block_size_, " tokens are needed but ",
         free_.size(), " of ", num_blocks_, " are free (raise max_batch_size or max_seq_len)");
  for (int64_t i = 0; i < more; ++i) s.blocks.push_back(take());
}

bool KvCache::try_pin(CacheStream& s, int64_t tokens) {
  const int64_t need = std::min((tokens + block_size_ - 1) / block_size_, max_blocks_per_stream_);
  if (!make_room(need - int64_t(s.blocks.size()))) return false;
  while (int64_t(s.blocks.size()) < need) s.blocks.push_back(take());
  s.pinned = std::max(s.pinned, need);
  return true;
}

void KvCache::truncate(CacheStream& s, int64_t length) {
  DFLASH2_CHECK_ARG(length >= 0 && length <= s.length, name_, ": rollback to length ", length,
                    " but the sequence has ", s.length, " tokens");
  const int64_t keep = std::max((length + block_size_ - 1) / block_size_, s.pinned);
  while (int64_t(s.blocks.size()) > keep) {
    drop(s.blocks.back());
    s.blocks.pop_back();
  }
  s.length = length;
}

}  // namespace dflash2::runtime
