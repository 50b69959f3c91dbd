// The prefix cache's bookkeeping over plain KvCaches (no model): matching by tokens (the
// next token included, at least one token left to run), reference counts, eviction least
// recently used first and leaves before their parents, allocations that evict, acquired
// entries never evicted, and every block back in the pool at the end.
#include <vector>

#include "runtime/kv_cache.h"
#include "runtime/prefix_cache.h"
#include "testing.h"

using namespace dflash2;
using namespace dflash2::runtime;

namespace {
constexpr int64_t kBs = 4;

KvCache pool(int64_t blocks) { return KvCache("test cache", {{1, 2, DType::F32}}, kBs, blocks); }

std::vector<int32_t> seq(int n, int salt) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(100 * salt + i);
  return t;
}

// A request's stream of n positions in each cache, kept in the prefix cache, then released.
void run_and_keep(PrefixCache& pc, KvCache& a, KvCache& b, const std::vector<int32_t>& toks, int64_t filled) {
  CacheStream sa, sb;
  CHECK(a.try_pin(sa, int64_t(toks.size())) && b.try_pin(sb, int64_t(toks.size())));
  sa.length = sb.length = int64_t(toks.size());
  pc.insert(toks.data(), int64_t(toks.size()), {&sa.blocks, &sb.blocks}, filled);
  a.release(sa);
  b.release(sb);
}
}  // namespace

TEST(matches_compare_tokens_and_the_next_one) {
  KvCache a = pool(32), b = pool(32);
  {
    PrefixCache pc({&a, &b}, kBs);
    const std::vector<int32_t> t = seq(14, 1);  // blocks 0..2 keepable ((i + 1) * 4 < 14)
    run_and_keep(pc, a, b, t, 14);
    CHECK(pc.entries() == 3 && pc.idle_blocks() == 3);
    CHECK(a.free_blocks() == 32 - 3 && b.free_blocks() == 32 - 3);
    auto e = pc.acquire(t.data(), 14);
    CHECK(e.size() == 3);
    pc.release(e);
    e = pc.acquire(t.data(), 12);  // 12 tokens: 2 blocks (the third's next token is unknown)
    CHECK(e.size() == 2);
    pc.release(e);
    std::vector<int32_t> u = t;
    u[8] = -5;  // the next token of block 1: blocks 0 only
    e = pc.acquire(u.data(), 14);
    CHECK(e.size() == 1);
    pc.release(e);
    u = t;
    u[1] = -5;  // block 0 differs: nothing
    e = pc.acquire(u.data(), 14);
    CHECK(e.empty());
    // filled rows bound what is kept: 7 positions filled -> block 0 only (block 1's rows 4..7)
    const std::vector<int32_t> v = seq(20, 2);
    run_and_keep(pc, a, b, v, 7);
    e = pc.acquire(v.data(), 20);
    CHECK(e.size() == 1);
    // its blocks in both caches, shared into new streams: one reference more each
    CacheStream s;
    const std::vector<int32_t> blocks = pc.blocks(e, 0);
    a.share(s, blocks);
    CHECK(a.refs(blocks[0]) == 2);
    a.release(s);
    CHECK(a.refs(blocks[0]) == 1);
    pc.release(e);
  }
  CHECK(a.free_blocks() == 32 && b.free_blocks() == 32);  // the destructor gave everything back
}

TEST(eviction_is_lru_leaves_first_and_spares_acquired_entries) {
  KvCache a = pool(12), b = pool(12);
  PrefixCache pc({&a, &b}, kBs);
  const std::vector<int32_t> x = seq(9, 1), y = seq(9, 2);  // 2 blocks each
  run_and_keep(pc, a, b, x, 9);
  run_and_keep(pc, a, b, y, 9);
  CHECK(pc.entries() == 4 && a.free_blocks() == 8);
  auto ex = pc.acquire(x.data(), 9);  // x is in use (and now the most recent)
  CHECK(ex.size() == 2 && pc.idle_blocks() == 2);
  CHECK(pc.evict_one());  // y's leaf (block 1), not its parent, not x
  CHECK(pc.entries() == 3 && pc.evictions() == 1);
  auto ey = pc.acquire(y.data(), 9);
  CHECK(ey.size() == 1);  // block 0 of y is still there
  pc.release(ey);
  CHECK(pc.evict_one());   // y's block 0
  CHECK(!pc.evict_one());  // x's entries are acquired
  CHECK(pc.entries() == 2);
  pc.release(ex);
  // an allocation that needs every block evicts the rest
  CacheStream s;
  CHECK(a.try_pin(s, 12 * kBs));
  CHECK(pc.entries() == 0 && a.free_blocks() == 0 && b.free_blocks() == 12);
  a.release(s);
  CHECK(a.free_blocks() == 12);
}

TEST(a_prefix_already_kept_is_not_kept_twice) {
  KvCache a = pool(16), b = pool(16);
  PrefixCache pc({&a, &b}, kBs);
  const std::vector<int32_t> t = seq(10, 3);
  run_and_keep(pc, a, b, t, 10);
  run_and_keep(pc, a, b, t, 10);  // the second request's blocks go back to the pool
  CHECK(pc.entries() == 2 && a.free_blocks() == 14 && b.free_blocks() == 14);
  // a longer prompt extends the chain from the kept prefix
  const std::vector<int32_t> longer = [&] {
    std::vector<int32_t> v = t;
    for (int i = 0; i < 8; ++i) v.push_back(7000 + i);
    return v;
  }();
  run_and_keep(pc, a, b, longer, 18);
  CHECK(pc.entries() == 4);
  auto e = pc.acquire(longer.data(), 18);
  CHECK(e.size() == 4);
  pc.release(e);
  pc.clear();
  CHECK(pc.entries() == 0 && a.free_blocks() == 16 && b.free_blocks() == 16);
}

TEST_MAIN()
