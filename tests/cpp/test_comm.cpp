// The in-process CPU communicator: every collective on 1..5 ranks (threads), results equal on
// every rank and to a host computation in rank order, repeated back to back (no stale state).
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "dflash2/dflash2.h"
#include "testing.h"

using namespace dflash2;

namespace {
template <class F>
void on_ranks(std::vector<std::unique_ptr<comm::Communicator>>& g, F f) {
  std::vector<std::thread> ts;
  for (auto& c : g) ts.emplace_back([&, p = c.get()] { f(*p); });
  for (auto& t : ts) t.join();
}
float value(int rank, int64_t i, int round) { return float((rank + 1) * 0.1 + i * 0.01 + round); }
}  // namespace

TEST(cpu_collectives) {
  for (int n : {1, 2, 3, 4, 5}) {
    auto g = comm::make_cpu_group(n);
    const int64_t len = 37;
    std::vector<int> bad(size_t(n), 0);
    on_ranks(g, [&](comm::Communicator& c) {
      const int r = c.rank();
      for (int round = 0; round < 20; ++round) {
        Tensor x = Tensor::empty(DType::F32, {len});
        for (int64_t i = 0; i < len; ++i) x.data_as<float>()[i] = value(r, i, round);
        c.all_reduce_sum(x);
        for (int64_t i = 0; i < len; ++i) {
          float want = value(0, i, round);
          for (int q = 1; q < n; ++q) want += value(q, i, round);
          if (x.data_as<float>()[i] != want) bad[size_t(r)]++;
        }
        Tensor in = Tensor::empty(DType::F32, {3}), out = Tensor::empty(DType::F32, {int64_t(n) * 3});
        for (int i = 0; i < 3; ++i) in.data_as<float>()[i] = float(r * 10 + i + round);
        c.all_gather(in, out);
        for (int q = 0; q < n; ++q)
          for (int i = 0; i < 3; ++i)
            if (out.data_as<float>()[q * 3 + i] != float(q * 10 + i + round)) bad[size_t(r)]++;
        Tensor rs_in = Tensor::empty(DType::F32, {int64_t(n) * 2}), rs_out = Tensor::empty(DType::F32, {2});
        for (int64_t i = 0; i < n * 2; ++i) rs_in.data_as<float>()[i] = float(r + i);
        c.reduce_scatter_sum(rs_in, rs_out);
        for (int i = 0; i < 2; ++i) {
          float want = 0;
          for (int q = 0; q < n; ++q) want += float(q + r * 2 + i);
          if (rs_out.data_as<float>()[i] != want) bad[size_t(r)]++;
        }
        Tensor b = Tensor::empty(DType::I32, {4});
        for (int i = 0; i < 4; ++i) b.data_as<int32_t>()[i] = r * 100 + i;
        c.broadcast(b, n - 1);
        for (int i = 0; i < 4; ++i)
          if (b.data_as<int32_t>()[i] != (n - 1) * 100 + i) bad[size_t(r)]++;
      }
    });
    for (int v : bad) CHECK(v == 0);
  }
  CHECK_THROWS(comm::make_cpu_group(0), "tensor parallel size");
}

// A rank that fails between collectives aborts the group: the others, waiting in a
// collective, throw CollectiveAborted instead of hanging; after reset the group works again.
TEST(abort_and_reset) {
  for (int n : {2, 3, 4}) {
    auto g = comm::make_cpu_group(n);
    std::vector<int> aborted(size_t(n), 0), bad(size_t(n), 0);
    on_ranks(g, [&](comm::Communicator& c) {
      Tensor x = Tensor::empty(DType::F32, {8});
      for (int i = 0; i < 8; ++i) x.data_as<float>()[i] = 1.0f;
      try {
        c.all_reduce_sum(x);  // a healthy collective first
        if (c.rank() == n - 1) {
          c.abort();  // this rank "fails" and never joins the next collective
          return;
        }
        c.all_reduce_sum(x);
      } catch (const comm::CollectiveAborted&) {
        aborted[size_t(c.rank())] = 1;
      }
    });
    for (int r = 0; r < n - 1; ++r) CHECK(aborted[size_t(r)] == 1);
    g[0]->reset();
    on_ranks(g, [&](comm::Communicator& c) {
      Tensor x = Tensor::empty(DType::F32, {5});
      for (int i = 0; i < 5; ++i) x.data_as<float>()[i] = float(c.rank());
      c.all_reduce_sum(x);
      for (int i = 0; i < 5; ++i)
        if (x.data_as<float>()[i] != float(n * (n - 1) / 2)) bad[size_t(c.rank())]++;
    });
    for (int v : bad) CHECK(v == 0);
  }
}

TEST_MAIN()
