// The NCCL communicator (cpp/src/comm/nccl_comm.cpp). With NCCL and a GPU: groups of 1 rank
// (TP = 1 through NCCL, what device_check can run on one GPU) and, where the machine has
// them, of 2..4 GPUs, one thread per rank: every collective against values whose sums are
// exact in any order (small integers), repeated, on a non-default stream; then the errors
// (tensors on the wrong device, an aborted communicator). Without NCCL or a GPU: the
// reason is clear and make_nccl_group raises it instead of failing later.
//
// Status: compiled in CI; never run on a GPU yet.
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "dflash2/dflash2.h"
#include "testing.h"
#ifdef DFLASH2_WITH_CUDA
#include <cuda_runtime.h>

#include "backend/cuda/cuda_api.h"
#endif

using namespace dflash2;

TEST(unavailable_is_clear) {
  std::string why;
  if (comm::nccl_available(&why)) {
    std::printf("  NCCL %s available\n", comm::nccl_version().c_str());
    return;
  }
  std::printf("  skipped on this machine: %s\n", why.c_str());
  CHECK(!why.empty());
  bool threw = false;
  try {
    comm::make_nccl_group({0});
  } catch (const Error& e) {
    threw = true;
    CHECK(e.kind() == ErrorKind::Unsupported || e.kind() == ErrorKind::Backend);
    CHECK(std::string(e.what()).find("NCCL") != std::string::npos);
  }
  CHECK(threw);
}

#ifdef DFLASH2_WITH_CUDA
namespace {

Tensor to_device(const std::vector<float>& v, int dev) {
  Tensor h = Tensor::empty(DType::F32, {int64_t(v.size())});
  for (size_t i = 0; i < v.size(); ++i) h.data_as<float>()[i] = v[i];
  return h.to(Device::cuda(dev));
}
std::vector<float> to_host(const Tensor& d) {
  Tensor h = d.to(Device::cpu());
  return std::vector<float>(h.data_as<float>(), h.data_as<float>() + h.numel());
}

void run_group(int n) {
  std::vector<int> devs;
  for (int i = 0; i < n; ++i) devs.push_back(i);
  auto g = comm::make_nccl_group(devs);
  CHECK(int(g.size()) == n && g[0]->size() == n && std::string(g[0]->backend()) == "nccl");
  std::vector<int> bad(size_t(n), 0);
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r) {
    ts.emplace_back([&, r] {
      try {
        comm::Communicator& c = *g[size_t(r)];
        cudaSetDevice(r);
        cudaStream_t s = nullptr;
        cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
        cuda::StreamScope scope(reinterpret_cast<CUstream_st*>(s));
        for (int round = 0; round < 5; ++round) {
          const int64_t len = 1000 + round;
          std::vector<float> x(static_cast<size_t>(len));
          for (int64_t i = 0; i < len; ++i) x[size_t(i)] = float((r + 1) * (i % 7) + round);
          Tensor dx = to_device(x, r);
          c.all_reduce_sum(dx);
          cudaStreamSynchronize(s);
          auto got = to_host(dx);
          for (int64_t i = 0; i < len; ++i) {
            float want = 0;
            for (int q = 0; q < n; ++q) want += float((q + 1) * (i % 7) + round);
            if (got[size_t(i)] != want) bad[size_t(r)]++;
          }
          // all_gather: rank q's 3 values at [3q, 3q + 3)
          Tensor in = to_device({float(r * 10), float(r * 10 + 1), float(r * 10 + 2 + round)}, r);
          Tensor out = Tensor::zeros(DType::F32, {int64_t(3 * n)}, Device::cuda(r));
          c.all_gather(in, out);
          cudaStreamSynchronize(s);
          auto ag = to_host(out);
          for (int q = 0; q < n; ++q)
            for (int i = 0; i < 3; ++i)
              if (ag[size_t(q * 3 + i)] != float(q * 10 + i + (i == 2 ? round : 0))) bad[size_t(r)]++;
          // reduce_scatter: rank r gets the sum of everyone's slice r
          std::vector<float> rs(size_t(2 * n));
          for (int i = 0; i < 2 * n; ++i) rs[size_t(i)] = float(r + i);
          Tensor rin = to_device(rs, r), rout = Tensor::zeros(DType::F32, {2}, Device::cuda(r));
          c.reduce_scatter_sum(rin, rout);
          cudaStreamSynchronize(s);
          auto rsg = to_host(rout);
          for (int i = 0; i < 2; ++i) {
            float want = 0;
            for (int q = 0; q < n; ++q) want += float(q + r * 2 + i);
            if (rsg[size_t(i)] != want) bad[size_t(r)]++;
          }
          // broadcast from the last rank (I32: bytes move unchanged)
          Tensor bh = Tensor::empty(DType::I32, {4});
          for (int i = 0; i < 4; ++i) bh.data_as<int32_t>()[i] = r * 100 + i + round;
          Tensor bd = bh.to(Device::cuda(r));
          c.broadcast(bd, n - 1);
          c.barrier();
          Tensor bb = bd.to(Device::cpu());
          for (int i = 0; i < 4; ++i)
            if (bb.data_as<int32_t>()[i] != (n - 1) * 100 + i + round) bad[size_t(r)]++;
        }
        // a host tensor is refused before anything is enqueued
        Tensor host = Tensor::zeros(DType::F32, {4});
        bool threw = false;
        try {
          c.all_reduce_sum(host);
        } catch (const Error& e) {
          threw = e.kind() == ErrorKind::InvalidArgument;
        }
        if (!threw) bad[size_t(r)]++;
        cudaStreamDestroy(s);
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  }
  for (auto& t : ts) t.join();
  for (int r = 0; r < n; ++r) {
    if (!errors[size_t(r)].empty()) std::printf("  rank %d of %d: %s\n", r, n, errors[size_t(r)].c_str());
    CHECK(errors[size_t(r)].empty());
    CHECK(bad[size_t(r)] == 0);
    // groups of 2+ GPUs with peer access take the kernels over peer memory for these all-reduces
    const comm::Communicator& c = *g[size_t(r)];
    if (n > 1) std::printf("  rank %d of %d: all-reduce over peer memory %s\n", r, n, c.peer_all_reduce() ? "on" : c.peer_all_reduce_why().c_str());
    CHECK(c.stats().all_reduce_calls == 5);  // the refused host tensor is not counted
    CHECK(c.stats().all_reduce_p2p_calls == (c.peer_all_reduce() ? 5 : 0));
    CHECK(c.stats().all_gather_p2p_calls == (c.peer_all_reduce() ? 5 : 0));
    CHECK(c.stats().broadcast_p2p_calls == (c.peer_all_reduce() ? 5 : 0));
    CHECK(n > 1 || !c.peer_all_reduce());
  }
}

}  // namespace

TEST(collectives_on_gpus) {
  std::string why;
  if (!comm::nccl_available(&why)) {
    std::printf("  skipped on this machine: %s\n", why.c_str());
    return;
  }
  const int count = cuda::device_count();
  std::printf("  NCCL %s, %d GPU(s)\n", comm::nccl_version().c_str(), count);
  run_group(1);  // TP = 1 through NCCL: what one GPU can check
  for (int n = 2; n <= std::min(count, 4); ++n) run_group(n);
  // a rank that fails mid-step aborts its communicator: the others' next collective throws
  // CollectiveAborted (a bystander's error, so the step reports the failing rank's)
  if (count >= 2) {
    auto g2 = comm::make_nccl_group({0, 1});
    if (g2[0]->peer_all_reduce()) {
      g2[1]->abort();
      cudaSetDevice(0);
      Tensor x = Tensor::zeros(DType::F32, {4}, Device::cuda(0));
      bool bystander = false;
      try {
        g2[0]->all_reduce_sum(x);
      } catch (const comm::CollectiveAborted&) {
        bystander = true;
      } catch (const Error&) {
      }
      CHECK(bystander);
    }
  }
  CHECK_THROWS(comm::make_nccl_group({0, 0}), "listed twice");
  CHECK_THROWS(comm::make_nccl_group({count}), "does not exist");
  // an aborted communicator refuses further collectives and cannot be reset
  auto g = comm::make_nccl_group({0});
  g[0]->abort();
  Tensor x = Tensor::zeros(DType::F32, {4}, Device::cuda(0));
  CHECK_THROWS(g[0]->all_reduce_sum(x), "was aborted");
  CHECK_THROWS(g[0]->reset(), "cannot be reset");
}

#if defined(DFLASH2_CUDA_EMULATED)
// The emulator's NCCL (cpp/emu/nccl_emu.cpp) reports what real NCCL would hang or corrupt
// memory on, through the asynchronous error the communicator checks on its next call.
TEST(emulated_nccl_reports_misuse) {
  if (cuda::device_count() < 2) {
    std::printf("  skipped: needs EMU_DEVICES >= 2\n");
    return;
  }
  // NCCL's own checks: every all-reduce through NCCL (the peer-memory kernels off; their own
  // failures are test_p2p_allreduce's)
  setenv("DFLASH2_P2P_ALLREDUCE_MAX_KB", "0", 1);
  // ranks meeting in different collectives
  {
    auto g = comm::make_nccl_group({0, 1});
    CHECK(!g[0]->peer_all_reduce() && g[0]->peer_all_reduce_why().find("is off") != std::string::npos);
    std::vector<std::string> errors(2);
    std::vector<std::thread> ts;
    for (int r = 0; r < 2; ++r)
      ts.emplace_back([&, r] {
        try {
          cudaSetDevice(r);
          Tensor x = Tensor::zeros(DType::F32, {8}, Device::cuda(r));
          if (r == 0)
            g[0]->all_reduce_sum(x);
          else
            g[1]->broadcast(x, 0);
          g[size_t(r)]->barrier();
        } catch (const Error& e) {
          errors[size_t(r)] = e.what();
        }
      });
    for (auto& t : ts) t.join();
    for (int r = 0; r < 2; ++r) {
      std::printf("  rank %d: %s\n", r, errors[size_t(r)].c_str());
      CHECK(errors[size_t(r)].find("asynchronous error") != std::string::npos);
    }
  }
  // a rank that never reaches the collective: reported after EMU_NCCL_TIMEOUT seconds
  {
    setenv("EMU_NCCL_TIMEOUT", "1", 1);
    auto g = comm::make_nccl_group({0, 1});
    cudaSetDevice(0);
    Tensor x = Tensor::zeros(DType::F32, {8}, Device::cuda(0));
    g[0]->all_reduce_sum(x);  // rank 1 never calls
    CHECK_THROWS(g[0]->all_reduce_sum(x), "asynchronous error");
    unsetenv("EMU_NCCL_TIMEOUT");
  }
  unsetenv("DFLASH2_P2P_ALLREDUCE_MAX_KB");
}
#endif
#endif

TEST_MAIN()
