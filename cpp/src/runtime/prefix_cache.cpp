#include "runtime/prefix_cache.h"

#include <algorithm>

#include "dflash2/error.h"

namespace dflash2::runtime {

PrefixCache::PrefixCache(std::vector<KvCache*> caches, int64_t block_size)
    : caches_(std::move(caches)), bs_(block_size) {
  DFLASH2_INTERNAL(!caches_.empty() && bs_ >= 1, "a prefix cache over no cache");
  for (KvCache* c : caches_) {
    DFLASH2_INTERNAL(c && c->block_size() == bs_, "a prefix cache over caches of different block sizes");
    c->set_evictor([this] { return evict_one(); });
  }
}

PrefixCache::~PrefixCache() {
  for (KvCache* c : caches_) c->set_evictor(nullptr);
  for (Entry& x : e_)  // the caches outlive it: its blocks go back to them
    if (x.live)
      for (size_t c = 0; c < caches_.size(); ++c) caches_[c]->drop(x.blocks[c]);
}

uint64_t PrefixCache::chain(uint64_t h, const int32_t* t, int64_t n) {
  // splitmix64 over the parent's hash and the tokens: a good spread; matches compare the
  // tokens themselves, so a collision only costs a miss
  auto mix = [](uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  uint64_t x = mix(h ^ 0x5851f42d4c957f2dull);
  for (int64_t i = 0; i < n; ++i) x = mix(x ^ uint64_t(uint32_t(t[i])));
  return x;
}

int32_t PrefixCache::find(uint64_t h, int32_t parent, const int32_t* t) const {
  auto it = by_hash_.find(h);
  if (it == by_hash_.end()) return -1;
  const Entry& x = e_[size_t(it->second)];
  if (!x.live || x.parent != parent || !std::equal(x.tokens.begin(), x.tokens.end(), t)) return -1;
  return it->second;
}

// Applies a change to entry e's users / children / live, keeping lru_ and idle_ in step.
#define DFLASH2_PREFIX_UPDATE(e, change)                                 \
  do {                                                                   \
    Entry& x_ = e_[size_t(e)];                                           \
    if (evictable(x_)) lru_.erase({x_.last_use, (e)});                   \
    if (x_.live && x_.users == 0) --idle_;                               \
    change;                                                              \
    if (x_.live && x_.users == 0) ++idle_;                               \
    if (evictable(x_)) lru_.insert({x_.last_use, (e)});                  \
  } while (0)

void PrefixCache::touch(int32_t e) {
  DFLASH2_PREFIX_UPDATE(e, x_.last_use = ++clock_);
}

std::vector<int32_t> PrefixCache::acquire(const int32_t* tokens, int64_t n) {
  std::vector<int32_t> out;
  if (n <= 0) return out;
  uint64_t h = 0;
  int32_t parent = -1;
  for (int64_t i = 0; (i + 1) * bs_ < n; ++i) {
    const int32_t* t = tokens + i * bs_;
    h = chain(h, t, bs_ + 1);
    const int32_t e = find(h, parent, t);
    if (e < 0) break;
    out.push_back(e);
    parent = e;
  }
  for (int32_t e : out) {
    DFLASH2_PREFIX_UPDATE(e, (++x_.users, x_.last_use = ++clock_));
  }
  return out;
}

int64_t PrefixCache::match(const int32_t* tokens, int64_t n) const {
  uint64_t h = 0;
  int32_t parent = -1;
  int64_t k = 0;
  for (; (k + 1) * bs_ < n; ++k) {
    h = chain(h, tokens + k * bs_, bs_ + 1);
    parent = find(h, parent, tokens + k * bs_);
    if (parent < 0) break;
  }
  return k;
}

void PrefixCache::note(int64_t queried, int64_t hit) {
  queried_ += queried;
  hits_ += hit;
}

void PrefixCache::release(const std::vector<int32_t>& entries) {
  for (int32_t e : entries) {
    DFLASH2_INTERNAL(e >= 0 && size_t(e) < e_.size() && e_[size_t(e)].live && e_[size_t(e)].users > 0,
                     "prefix cache: releasing entry ", e, " that is not in use");
    DFLASH2_PREFIX_UPDATE(e, --x_.users);
  }
}

std::vector<int32_t> PrefixCache::blocks(const std::vector<int32_t>& entries, size_t c) const {
  std::vector<int32_t> out;
  out.reserve(entries.size());
  for (int32_t e : entries) out.push_back(e_[size_t(e)].blocks[c]);
  return out;
}

void PrefixCache::insert(const int32_t* tokens, int64_t n, const std::vector<const std::vector<int32_t>*>& blocks,
                         int64_t filled) {
  DFLASH2_INTERNAL(blocks.size() == caches_.size(), "prefix cache: ", blocks.size(), " block lists for ",
                   caches_.size(), " caches");
  const int64_t upto = std::min(n, filled + 1);
  uint64_t h = 0;
  int32_t parent = -1;
  for (int64_t i = 0; (i + 1) * bs_ < upto; ++i) {
    for (const auto* b : blocks)
      if (int64_t(b->size()) <= i) return;
    const int32_t* t = tokens + i * bs_;
    h = chain(h, t, bs_ + 1);
    int32_t e = find(h, parent, t);
    if (e < 0) {
      if (by_hash_.count(h)) return;  // another prefix with this hash: not kept (a miss later)
      if (free_entries_.empty()) {
        e = int32_t(e_.size());
        e_.emplace_back();
      } else {
        e = free_entries_.back();
        free_entries_.pop_back();
      }
      Entry& x = e_[size_t(e)];
      x.hash = h;
      x.parent = parent;
      x.users = 0;
      x.children = 0;
      x.last_use = ++clock_;
      x.tokens.assign(t, t + bs_ + 1);
      x.blocks.clear();
      for (size_t c = 0; c < caches_.size(); ++c) {
        const int32_t blk = (*blocks[c])[size_t(i)];
        caches_[c]->hold(blk);
        x.blocks.push_back(blk);
      }
      by_hash_[h] = e;
      ++live_;
      if (parent >= 0) DFLASH2_PREFIX_UPDATE(parent, ++x_.children);
      DFLASH2_PREFIX_UPDATE(e, x_.live = true);
    } else {
      touch(e);
    }
    parent = e;
  }
}

bool PrefixCache::evict_one() {
  if (lru_.empty()) return false;
  const int32_t e = lru_.begin()->second;
  Entry& x = e_[size_t(e)];
  const int32_t parent = x.parent;
  DFLASH2_PREFIX_UPDATE(e, x_.live = false);
  by_hash_.erase(x.hash);
  for (size_t c = 0; c < caches_.size(); ++c) caches_[c]->drop(x.blocks[c]);
  x.blocks.clear();
  x.tokens.clear();
  free_entries_.push_back(e);
  --live_;
  ++evicted_;
  if (parent >= 0) DFLASH2_PREFIX_UPDATE(parent, --x_.children);
  return true;
}

void PrefixCache::clear() {
  while (evict_one()) {
  }
}

#undef DFLASH2_PREFIX_UPDATE

}  // namespace dflash2::runtime
