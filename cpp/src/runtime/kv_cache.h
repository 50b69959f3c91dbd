// The one KV-cache module: a pool of fixed-size blocks with a free list, per-sequence
// block tables, and any number of cache "planes" (tensors [layers, num_blocks * block_size,
// dim]) indexed by the same block ids. It serves the target's MLA latent + indexer-key
// caches, the MTP layer's caches and the DFlash drafter's context K/V alike.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dflash2/tensor.h"

namespace dflash2::runtime {

// One sequence's stream of tokens in a KvCache: its block table and committed length.
struct CacheStream {
  std::vector<int32_t> blocks;
  int64_t length = 0;
  int64_t pinned = 0;  // blocks kept by rollback (a request's up-front reservation); release frees all
};

class KvCache {
 public:
  struct Plane {
    int64_t layers = 0;  // cache layers in this plane
    int64_t dim = 0;     // values per token per layer
    DType dtype = DType::F32;  // F32, BF16 (kv_cache_dtype bf16; the DFlash drafter's cache under
                               // draft_gemm) or U8 (kv_cache_dtype fp8: dim = bytes of an FP8 row)
  };
  KvCache() = default;
  // All memory is allocated here, once (zeroed); name is used in messages. `replicas` copies
  // of every plane share the block allocator (tensor parallelism: each rank's own caches,
  // with one set of block tables; on CUDA replica r is on device dev.index + r).
  KvCache(std::string name, const std::vector<Plane>& planes, int64_t block_size, int64_t num_blocks,
          Device dev = Device::cpu(), int replicas = 1);

  const std::string& name() const { return name_; }
  int64_t block_size() const { return block_size_; }
  int64_t num_blocks() const { return num_blocks_; }
  int64_t free_blocks() const { return int64_t(free_.size()); }
  // Bytes of one replica's planes (every plane's layers x rows x dim x element size).
  int64_t bytes() const {
    int64_t b = 0;
    for (size_t i = 0; i < nplanes_ && i < planes_.size(); ++i)
      if (planes_[i].defined()) b += planes_[i].numel() * int64_t(dtype_size(planes_[i].dtype()));
    return b;
  }
  // What bytes() will be for these planes over `rows` cache rows (num_blocks x block_size):
  // the memory a cache is sized by before it is made (the CUDA engine's out-of-memory check).
  static int64_t bytes_for(const std::vector<Plane>& planes, int64_t rows) {
    int64_t b = 0;
    for (const Plane& p : planes) b += p.layers * rows * p.dim * int64_t(dtype_size(p.dtype));
    return b;
  }
  int64_t max_blocks_per_stream() const { return max_blocks_per_stream_; }
  void set_max_blocks_per_stream(int64_t n) { max_blocks_per_stream_ = n; }
  // The cache rows of one layer of a plane: [num_blocks * block_size, dim] of its dtype.
  Tensor layer(size_t plane, int64_t layer, int replica = 0) const;
  // Blocks for positions < new_len (OutOfMemory when the pool is exhausted: nothing is
  // taken then); the stream's length is not changed.
  void reserve(CacheStream& s, int64_t new_len);
  // Reserves blocks for `tokens` positions up front and pins them (rollback keeps them), so
  // that the stream never runs out of cache later; false (nothing taken) if the pool lacks them.
  bool try_pin(CacheStream& s, int64_t tokens);
  // Rolls the stream back to `length` tokens, returning whole blocks past it (and past its
  // pinned blocks) to the pool.
  void truncate(CacheStream& s, int64_t length);
  // Returns every block of the stream to the pool; the stream is empty afterwards.
  void release(CacheStream& s) {
    s.pinned = 0;
    truncate(s, 0);
  }
  // Cache row of position p of the stream.
  int64_t slot(const CacheStream& s, int64_t p) const {
    return int64_t(s.blocks[size_t(p / block_size_)]) * block_size_ + p % block_size_;
  }

  // Blocks are reference counted: a stream's blocks hold one reference each, and the prefix
  // cache (prefix_cache.h) one more on the blocks it keeps; a block returns to the pool when
  // its last reference goes. share() puts blocks already filled (a cached prompt prefix) at
  // the start of an empty stream, one reference more each; hold() / drop() are the prefix
  // cache's references.
  void share(CacheStream& s, const std::vector<int32_t>& blocks);
  void hold(int32_t block);
  void drop(int32_t block);
  int32_t refs(int32_t block) const { return ref_[size_t(block)]; }
  // Called when an allocation finds too few free blocks: frees some (the prefix cache
  // evicting its least recently used entry) and returns whether it did.
  void set_evictor(std::function<bool()> f) { evict_ = std::move(f); }

 private:
  bool make_room(int64_t blocks);  // evicts until `blocks` are free (false: it cannot)
  int32_t take();                  // a free block, one reference
  std::string name_;
  int64_t block_size_ = 0, num_blocks_ = 0, max_blocks_per_stream_ = 0;
  std::vector<Tensor> planes_;  // [layers, rows, dim], replica-major
  size_t nplanes_ = 0;
  std::vector<int32_t> free_;
  std::vector<int32_t> ref_;  // per block
  std::function<bool()> evict_;
};

}  // namespace dflash2::runtime
