// Automatic prefix caching: the cache blocks of prompts that ran stay in the KV caches
// (kept as a prompt's prefill ends, and for as long as the caches have room), indexed by
// their tokens, and a later prompt that starts with the same tokens takes them instead of
// running those positions again.
//
// An entry is one full block of a prompt: its block_size tokens and the token after them
// (the MTP layer's row at a block's last position reads the next token), chained to the
// entry of the block before it, so an entry stands for the whole prefix up to it. It holds
// one block in each cache a request fills (the target's latent / index-key cache, the MTP
// layer's cache, the DFlash drafter's context cache): a reference each, so the blocks
// outlive the request. Matching walks a prompt's blocks from the start while the entries
// exist (the tokens compared, not only their hash) and leaves at least the prompt's last
// token to run (its logits start the generation). Prompt positions are kept: their rows are
// what the prompt's prefill computes (the prompt numerics), so a prompt that takes them gets
// the rows it would have computed, and its outputs do not depend on the cache. Generated
// positions too where the engine's decode rows are bitwise its prompt rows (every numerics
// exact: EngineConfig::prefix_cache_generated): a request that ends keeps its prompt and
// output as one prefix, which the next turn of a conversation starts with.
// Entries that no running request uses are evicted least recently used first, leaves
// before their parents, when an allocation finds too few free blocks.
// Scheduler thread only (like the decoder that uses it).
#pragma once
#include <cstdint>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "runtime/kv_cache.h"

namespace dflash2::runtime {

class PrefixCache {
 public:
  // caches: the caches a request fills, in a fixed order (the target's first); every one
  // with the same block size. Installs itself as their evictor.
  PrefixCache(std::vector<KvCache*> caches, int64_t block_size);
  ~PrefixCache();
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  int64_t block_size() const { return bs_; }
  // The entries of the longest cached prefix of tokens[0, n) (at most (n - 1) / block_size
  // blocks), each acquired (not evictable until released).
  std::vector<int32_t> acquire(const int32_t* tokens, int64_t n);
  // How many blocks acquire(tokens, n) would take now (nothing acquired).
  int64_t match(const int32_t* tokens, int64_t n) const;
  // A prompt of `queried` tokens admitted with `hit` of them cached (the statistics).
  void note(int64_t queried, int64_t hit);
  void release(const std::vector<int32_t>& entries);
  // Cache c's block of each entry, in order.
  std::vector<int32_t> blocks(const std::vector<int32_t>& entries, size_t c) const;
  // Keeps the full blocks of a prompt that ran: blocks[c][i] is cache c's block i of the
  // request's stream, filled for positions < filled (every cache); blocks i with
  // (i + 1) * block_size < min(n, filled + 1) are kept (their tokens and the next one known,
  // their rows filled). Blocks already cached (the same tokens) are left to the request.
  void insert(const int32_t* tokens, int64_t n, const std::vector<const std::vector<int32_t>*>& blocks,
              int64_t filled);
  // Evicts the least recently used unused leaf entry; false when there is none.
  bool evict_one();
  void clear();  // every unused entry

  int64_t entries() const { return live_; }
  int64_t idle_blocks() const { return idle_; }  // blocks (per cache) held only by the cache
  int64_t query_tokens() const { return queried_; }
  int64_t hit_tokens() const { return hits_; }
  int64_t evictions() const { return evicted_; }

 private:
  struct Entry {
    uint64_t hash = 0;
    int32_t parent = -1;
    int32_t users = 0, children = 0;
    uint64_t last_use = 0;
    bool live = false;
    std::vector<int32_t> tokens;  // block_size + 1
    std::vector<int32_t> blocks;  // per cache
  };
  static uint64_t chain(uint64_t h, const int32_t* t, int64_t n);
  int32_t find(uint64_t h, int32_t parent, const int32_t* t) const;
  void touch(int32_t e);
  void update_idle(int32_t e, bool was_evictable_leaf, bool was_idle);
  bool evictable(const Entry& x) const { return x.live && x.users == 0 && x.children == 0; }

  std::vector<KvCache*> caches_;
  int64_t bs_ = 0;
  std::vector<Entry> e_;
  std::vector<int32_t> free_entries_;
  std::unordered_map<uint64_t, int32_t> by_hash_;
  std::set<std::pair<uint64_t, int32_t>> lru_;  // (last_use, entry) of evictable leaves
  uint64_t clock_ = 0;
  int64_t live_ = 0, idle_ = 0, queried_ = 0, hits_ = 0, evicted_ = 0;
};

}  // namespace dflash2::runtime
