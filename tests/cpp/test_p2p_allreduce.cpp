// The one-shot all-reduce over peer memory (backend/cuda/p2p_allreduce.h): groups of 1-4
// ranks, one thread and one non-blocking stream per rank (on distinct GPUs where the machine
// has them, else ranks sharing GPU 0), against the CPU communicator's rank-order sum, bit
// for bit, on every rank: sizes from 1 element to the group's limit, aligned and misaligned
// x, the one-shot and the two-shot forms, the sum added into a residual in the same pass, many
// calls in a row (the alternating publish buffers), calls captured in a CUDA graph
// and replayed; then a rank that never comes (timeout: NaN output, a sticky error) and an
// abort from the host. Without CUDA or a GPU: skipped, saying so.
//
// Status: runs in CI in the CPU emulation (EMU_DEVICES=4); never run on a GPU yet (device_check
// runs it).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "dflash2/dflash2.h"
#include "testing.h"
#ifdef DFLASH2_WITH_CUDA
#include <cuda_runtime.h>

#include "backend/cuda/cuda_api.h"
#include "backend/cuda/p2p_allreduce.h"
#endif

using namespace dflash2;

#ifdef DFLASH2_WITH_CUDA
namespace {

namespace p2p = cuda::p2p;

bool have_gpu() {
  std::string why;
  if (cuda::available(&why)) return true;
  std::printf("  skipped on this machine: %s\n", why.c_str());
  return false;
}

std::vector<int> devices_for(int n) {
  std::vector<int> d;
  const int count = cuda::device_count();
  for (int r = 0; r < n; ++r) d.push_back(count >= n ? r : 0);
  return d;
}

// Ranks that share a GPU spin-wait for each other only in the CPU emulation; on a real GPU the
// group refuses them (a rank's thread that waits for the device, in cudaFree or a kernel's
// first load, would wait for the other rank's spinning kernel: seen deadlocked on an H200),
// so groups of more ranks than the machine has GPUs are skipped there.
bool runnable(const std::vector<int>& devs) {
#if defined(DFLASH2_CUDA_EMULATED)
  (void)devs;
  return true;
#else
  for (size_t i = 0; i < devs.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      if (devs[i] == devs[j]) {
        std::printf("  skipped: %zu ranks on %d GPU(s) (one GPU per rank on a real GPU)\n", devs.size(),
                    cuda::device_count());
        return false;
      }
  return true;
#endif
}

// rank r's input of round `round`: values of mixed magnitudes, so the order of the sum matters
std::vector<float> input(int r, int round, int64_t len) {
  std::mt19937 g(uint32_t(1000 * r + round));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(len));
  for (auto& x : v) x = u(g) * std::ldexp(1.0f, int(g() % 24) - 12);
  return v;
}

// the CPU communicator's sum: rank 0's value, then + rank 1's, ..., in float
std::vector<float> rank_order_sum(int n, int round, int64_t len) {
  std::vector<float> s = input(0, round, len);
  for (int q = 1; q < n; ++q) {
    const std::vector<float> v = input(q, round, len);
    for (int64_t i = 0; i < len; ++i) s[size_t(i)] += v[size_t(i)];
  }
  return s;
}

Tensor filled(int64_t len, float v, int dev) {
  Tensor h = Tensor::zeros(DType::F32, {len});
  for (int64_t i = 0; i < len; ++i) h.data_as<float>()[i] = v;
  return h.to(Device::cuda(dev));
}

bool bitwise_equal(const float* a, const float* b, int64_t n) { return std::memcmp(a, b, size_t(n) * 4) == 0; }

struct RankStream {
  cudaStream_t s = nullptr;
  explicit RankStream(int dev) {
    cudaSetDevice(dev);
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  }
  ~RankStream() { cudaStreamDestroy(s); }
};

// Runs body(rank) on one thread per rank with that rank's device and stream current;
// returns the errors (empty strings where a rank succeeded).
template <class F>
std::vector<std::string> on_ranks(const std::vector<int>& devs, F body) {
  const int n = int(devs.size());
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      try {
        RankStream rs(devs[size_t(r)]);
        cuda::StreamScope scope(reinterpret_cast<CUstream_st*>(rs.s));
        body(r, rs.s);
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  return errors;
}

void check_no_errors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r].empty()) std::printf("  rank %zu: %s\n", r, errors[r].c_str());
    CHECK(errors[r].empty());
  }
}

}  // namespace

TEST(creation_refuses_what_it_cannot_do) {
  if (!have_gpu()) return;
  std::string why;
  CHECK(p2p::Group::create({}, 1 << 20, 1.0, &why) == nullptr && why.find("1 to 8 ranks") != std::string::npos);
  CHECK(p2p::Group::create({0}, 0, 1.0, &why) == nullptr && why.find("is off") != std::string::npos);
  CHECK(p2p::Group::create({cuda::device_count()}, 1 << 20, 1.0, &why) == nullptr &&
        why.find("does not exist") != std::string::npos);
  auto g = p2p::Group::create({0}, 1000, 1.0, &why);
  CHECK(g != nullptr && why.empty() && g->size() == 1 && g->max_bytes() == 1008);
#if !defined(DFLASH2_CUDA_EMULATED)
  CHECK(p2p::Group::create({0, 0}, 1 << 20, 1.0, &why) == nullptr && why.find("share cuda:0") != std::string::npos);
#endif
  cudaSetDevice(0);
  Tensor x = Tensor::zeros(DType::F32, {300}, Device::cuda(0));
  CHECK_THROWS(g->all_reduce_sum(0, static_cast<float*>(x.data()), 300), "exceed");
  CHECK_THROWS(g->all_reduce_sum(1, static_cast<float*>(x.data()), 4), "outside");
}

// the load-time check make_nccl_group runs: passes on healthy groups (and leaves them usable)
TEST(self_check_passes) {
  if (!have_gpu()) return;
  for (const std::vector<int>& devs : {devices_for(2), devices_for(4), std::vector<int>{0, 0, 0}}) {
    if (!runnable(devs)) continue;
    std::string why;
    for (size_t one_shot : {size_t(512) << 10, size_t(0)}) {
      auto g = p2p::Group::create(devs, size_t(1) << 20, 5.0, &why, one_shot);
      CHECK(g != nullptr);
      if (!g) continue;
      const std::string bad = g->self_check(5.0);
      if (!bad.empty()) std::printf("  %zu ranks: %s\n", devs.size(), bad.c_str());
      CHECK(bad.empty() && g->error().empty());
    }
  }
}

TEST(rank_order_sums_bitwise_on_every_rank) {
  if (!have_gpu()) return;
  const int64_t cap = 131072;  // 512 KiB of floats
  std::vector<std::vector<int>> groups;
  for (int n = 1; n <= 4; ++n) groups.push_back(devices_for(n));
  groups.push_back({0, 0});  // two ranks on one GPU, whatever the machine has
  // every size in the one-shot form, then all but the smallest in the two-shot form
  for (size_t one_shot : {size_t(1) << 20, size_t(4096)})
  for (const std::vector<int>& devs : groups) {
    if (!runnable(devs)) continue;
    const int n = int(devs.size());
    std::string why;
    auto g = p2p::Group::create(devs, size_t(cap) * 4, 5.0, &why, one_shot);
    CHECK(g != nullptr);
    if (!g) {
      std::printf("  %d ranks: %s\n", n, why.c_str());
      continue;
    }
    // sizes: tails of every length, one block, several, the limit; rounds alternate the buffers
    const std::vector<int64_t> lens{1, 3, 5, 2047, 2048, 6145, 6144, 6144 * 9 + 2, cap, 7, cap - 1};
    std::vector<int> bad(static_cast<size_t>(n), 0);
    check_no_errors(on_ranks(devs, [&](int r, cudaStream_t s) {
      const int dev = devs[size_t(r)];
      for (size_t k = 0; k < 2 * lens.size(); ++k) {
        const int64_t len = lens[k % lens.size()];
        const int64_t off = k % 3 == 2 ? 1 : 0;  // x 4 bytes past a 16-byte boundary: the scalar path
        const int round = int(k);
        Tensor h = Tensor::zeros(DType::F32, {len + off});
        std::vector<float> in = input(r, round, len);
        std::memcpy(h.data_as<float>() + off, in.data(), size_t(len) * 4);
        Tensor d = h.to(Device::cuda(dev));
        g->all_reduce_sum(r, static_cast<float*>(d.data()) + off, len);
        cudaStreamSynchronize(s);
        Tensor back = d.to(Device::cpu());
        const std::vector<float> want = rank_order_sum(n, round, len);
        if (!bitwise_equal(back.data_as<float>() + off, want.data(), len)) {
          if (bad[size_t(r)]++ == 0) std::printf("  %d ranks, rank %d: %lld floats (offset %lld, %s) differ\n", n, r,
                                                 (long long)len, (long long)off, len * 4 > int64_t(one_shot) ? "two-shot" : "one-shot");
        }
      }
    }));
    for (int r = 0; r < n; ++r) CHECK(bad[size_t(r)] == 0);
    CHECK(g->error().empty());
  }
}

// add_to: the residual add in the same pass (h += sum), x left as it was; x2 (odd k): the
// ranks' x + x2 summed (the shared expert's output added to the routed experts')
TEST(sum_added_into_a_residual) {
  if (!have_gpu()) return;
  for (int n : {2, 4})
  for (size_t one_shot : {size_t(1) << 20, size_t(0)}) {
    const std::vector<int> devs = devices_for(n);
    if (!runnable(devs)) continue;
    std::string why;
    auto g = p2p::Group::create(devs, 1 << 18, 5.0, &why, one_shot);
    CHECK(g != nullptr);
    if (!g) continue;
    std::vector<int> bad(static_cast<size_t>(n), 0);
    check_no_errors(on_ranks(devs, [&](int r, cudaStream_t s) {
      const int dev = devs[size_t(r)];
      for (int k = 0; k < 4; ++k) {
        const int64_t len = k % 2 ? 6144 * 2 + 3 : 6144;
        const int64_t off = k >= 2 ? 1 : 0;  // h misaligned: the scalar path
        const std::vector<float> in = input(r, 40 + k, len), h0 = input(7, 50 + k, len);
        Tensor x = Tensor::zeros(DType::F32, {len});
        std::memcpy(x.data_as<float>(), in.data(), size_t(len) * 4);
        Tensor hh = Tensor::zeros(DType::F32, {len + off});
        std::memcpy(hh.data_as<float>() + off, h0.data(), size_t(len) * 4);
        Tensor x2 = Tensor::zeros(DType::F32, {len});
        const std::vector<float> in2 = input(r, 60 + k, len);
        std::memcpy(x2.data_as<float>(), in2.data(), size_t(len) * 4);
        Tensor dx = x.to(Device::cuda(dev)), dh = hh.to(Device::cuda(dev)), dx2 = x2.to(Device::cuda(dev));
        g->all_reduce_sum(r, static_cast<float*>(dx.data()), len, static_cast<float*>(dh.data()) + off,
                          k % 2 ? static_cast<const float*>(dx2.data()) : nullptr);
        cudaStreamSynchronize(s);
        Tensor bx = dx.to(Device::cpu()), bh = dh.to(Device::cpu());
        std::vector<float> want(static_cast<size_t>(len), 0.0f);
        for (int q = 0; q < n; ++q) {  // rank q's x (+ x2), added in rank order
          const std::vector<float> xq = input(q, 40 + k, len), yq = input(q, 60 + k, len);
          for (int64_t i = 0; i < len; ++i) {
            const float v = k % 2 ? xq[size_t(i)] + yq[size_t(i)] : xq[size_t(i)];
            want[size_t(i)] = q == 0 ? v : want[size_t(i)] + v;
          }
        }
        for (int64_t i = 0; i < len; ++i) want[size_t(i)] = h0[size_t(i)] + want[size_t(i)];
        if (!bitwise_equal(bh.data_as<float>() + off, want.data(), len)) bad[size_t(r)]++;
        if (!bitwise_equal(bx.data_as<float>(), in.data(), len)) bad[size_t(r)]++;
      }
    }));
    for (int r = 0; r < n; ++r) CHECK(bad[size_t(r)] == 0);
  }
}

// all-gather and broadcast: 4-byte words moved with their bits (integers, NaN payloads),
// interleaved with all-reduces on the same call sequence
TEST(gather_and_broadcast_words) {
  if (!have_gpu()) return;
  std::vector<std::vector<int>> groups;
  for (int n = 1; n <= 4; ++n) groups.push_back(devices_for(n));
  groups.push_back({0, 0});
  auto word = [](int r, int k, int64_t i) { return uint32_t(0x7fa00000u + uint32_t(r) * 7919u + uint32_t(k) * 131u + uint32_t(i)); };
  for (const std::vector<int>& devs : groups) {
    if (!runnable(devs)) continue;
    const int n = int(devs.size());
    std::string why;
    auto g = p2p::Group::create(devs, 1 << 18, 5.0, &why);
    CHECK(g != nullptr);
    if (!g) continue;
    std::vector<int> bad(static_cast<size_t>(n), 0);
    check_no_errors(on_ranks(devs, [&](int r, cudaStream_t s) {
      const int dev = devs[size_t(r)];
      const std::vector<int64_t> lens{1, 3, 6145, 20000};
      for (size_t k = 0; k < lens.size(); ++k) {
        const int64_t len = lens[k];
        Tensor hin = Tensor::zeros(DType::I32, {len});
        for (int64_t i = 0; i < len; ++i) hin.data_as<int32_t>()[i] = int32_t(word(r, int(k), i));
        Tensor din = hin.to(Device::cuda(dev));
        Tensor dout = Tensor::zeros(DType::I32, {n * len}, Device::cuda(dev));
        g->all_gather(r, din.data(), len, dout.data());
        // an all-reduce between, then a broadcast from rank k % n
        Tensor red = filled(5, float(r + 1), dev);
        g->all_reduce_sum(r, static_cast<float*>(red.data()), 5);
        const int root = int(k) % n;
        g->broadcast(r, din.data(), len, root);
        cudaStreamSynchronize(s);
        Tensor hout = dout.to(Device::cpu()), hb = din.to(Device::cpu()), hr = red.to(Device::cpu());
        for (int q = 0; q < n; ++q)
          for (int64_t i = 0; i < len; ++i)
            if (uint32_t(hout.data_as<int32_t>()[q * len + i]) != word(q, int(k), i)) {
              bad[size_t(r)]++;
              break;
            }
        for (int64_t i = 0; i < len; ++i)
          if (uint32_t(hb.data_as<int32_t>()[i]) != word(root, int(k), i)) {
            bad[size_t(r)]++;
            break;
          }
        if (hr.data_as<float>()[4] != float(n * (n + 1) / 2)) bad[size_t(r)]++;
      }
    }));
    for (int r = 0; r < n; ++r) CHECK(bad[size_t(r)] == 0);
  }
}

TEST(captured_calls_replay) {
  if (!have_gpu()) return;
  const int n = 3;
  const std::vector<int> devs = devices_for(n);
  if (!runnable(devs)) return;
  std::string why;
  auto g = p2p::Group::create(devs, 1 << 18, 5.0, &why, 4096);  // the 6144-float calls two-shot, the others one-shot
  CHECK(g != nullptr);
  if (!g) return;
  const int64_t la = 6144, lb = 100;
  std::vector<int> bad(static_cast<size_t>(n), 0);
  check_no_errors(on_ranks(devs, [&](int r, cudaStream_t s) {
    const int dev = devs[size_t(r)];
    Tensor a = Tensor::zeros(DType::F32, {la}, Device::cuda(dev));
    Tensor b = Tensor::zeros(DType::F32, {lb}, Device::cuda(dev));
    float* pa = static_cast<float*>(a.data());
    float* pb = static_cast<float*>(b.data());
    // one eager call first: the graph's calls continue the device-side call count
    g->all_reduce_sum(r, pb, lb);
    cudaStreamSynchronize(s);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    DFLASH2_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess, ErrorKind::Backend,
                  "begin capture");
    g->all_reduce_sum(r, pa, la);
    g->all_reduce_sum(r, pb, lb);
    g->all_reduce_sum(r, pa, la);  // twice: the sum of the sums
    DFLASH2_CHECK(cudaStreamEndCapture(s, &graph) == cudaSuccess && graph, ErrorKind::Backend, "end capture");
    DFLASH2_CHECK(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess, ErrorKind::Backend, "instantiate");
    for (int round = 0; round < 4; ++round) {
      const std::vector<float> ia = input(r, 10 + round, la), ib = input(r, 20 + round, lb);
      cudaMemcpyAsync(pa, ia.data(), size_t(la) * 4, cudaMemcpyHostToDevice, s);
      cudaMemcpyAsync(pb, ib.data(), size_t(lb) * 4, cudaMemcpyHostToDevice, s);
      cudaGraphLaunch(exec, s);
      cudaStreamSynchronize(s);
      std::vector<float> ga(static_cast<size_t>(la)), gb(static_cast<size_t>(lb));
      cudaMemcpy(ga.data(), pa, size_t(la) * 4, cudaMemcpyDeviceToHost);
      cudaMemcpy(gb.data(), pb, size_t(lb) * 4, cudaMemcpyDeviceToHost);
      const std::vector<float> s1 = rank_order_sum(n, 10 + round, la);
      std::vector<float> s2(static_cast<size_t>(la));  // every rank holds s1: the second call sums n copies in rank order
      for (int64_t i = 0; i < la; ++i) {
        float acc = s1[size_t(i)];
        for (int q = 1; q < n; ++q) acc += s1[size_t(i)];
        s2[size_t(i)] = acc;
      }
      if (!bitwise_equal(ga.data(), s2.data(), la)) bad[size_t(r)]++;
      if (!bitwise_equal(gb.data(), rank_order_sum(n, 20 + round, lb).data(), lb)) bad[size_t(r)]++;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }));
  for (int r = 0; r < n; ++r) CHECK(bad[size_t(r)] == 0);
}

TEST(a_missing_rank_times_out_and_abort_releases) {
  if (!have_gpu()) return;
  const std::vector<int> devs = devices_for(2);
  if (!runnable(devs)) return;
  // rank 1 never comes: rank 0 gives up after the timeout, its output NaN, the group failed
  {
    std::string why;
    auto g = p2p::Group::create(devs, 1 << 16, 0.5, &why);
    CHECK(g != nullptr);
    if (!g) return;
    std::vector<float> got(64, 0.0f);
    check_no_errors(on_ranks({devs[0]}, [&](int, cudaStream_t s) {
      Tensor x = filled(64, 1.0f, devs[0]);
      g->all_reduce_sum(0, static_cast<float*>(x.data()), 64);
      cudaStreamSynchronize(s);
      cudaMemcpy(got.data(), x.data(), 64 * 4, cudaMemcpyDeviceToHost);
    }));
    bool all_nan = true;
    for (float v : got) all_nan = all_nan && std::isnan(v);
    CHECK(all_nan);
    std::printf("  timeout: %s\n", g->error().c_str());
    CHECK(g->error().find("rank 0 waited") != std::string::npos && g->error().find("for rank 1") != std::string::npos);
    cudaSetDevice(devs[0]);
    Tensor y = filled(4, 1.0f, devs[0]);
    CHECK_THROWS(g->all_reduce_sum(0, static_cast<float*>(y.data()), 4), "waited");
  }
  // abort from the host releases a rank waiting with a long timeout
  {
    std::string why;
    auto g = p2p::Group::create(devs, 1 << 16, 120.0, &why);
    CHECK(g != nullptr);
    if (!g) return;
    std::vector<float> got(16, 0.0f);
    const auto t0 = std::chrono::steady_clock::now();
    std::thread aborter([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      g->abort();
    });
    check_no_errors(on_ranks({devs[0]}, [&](int, cudaStream_t s) {
      Tensor x = filled(16, 1.0f, devs[0]);
      g->all_reduce_sum(0, static_cast<float*>(x.data()), 16);
      cudaStreamSynchronize(s);
      cudaMemcpy(got.data(), x.data(), 16 * 4, cudaMemcpyDeviceToHost);
    }));
    aborter.join();
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(waited < 60.0);
    CHECK(std::isnan(got[0]) && std::isnan(got[15]));
    CHECK(g->error().find("aborted") != std::string::npos);
  }
}

// Latency of one call (24 KiB: a decode token's hidden state in GLM-5.3), ranks sharing a GPU
// unless the machine has one per rank, printed beside a device-to-device copy of the same
// bytes on rank 0 in the same run (information only, nothing asserted).
TEST(latency_figure) {
  if (!have_gpu()) return;
#if defined(DFLASH2_CUDA_EMULATED)
  std::printf("  skipped: the CPU emulation times nothing\n");
#else
  const int n = std::min(4, std::max(2, cuda::device_count()));
  const std::vector<int> devs = devices_for(n);
  std::string why;
  auto g = p2p::Group::create(devs, 1 << 20, 5.0, &why);
  if (!g) {
    std::printf("  skipped: %s\n", why.c_str());
    return;
  }
  const int64_t len = 6144;
  const int iters = 200;
  std::vector<double> us(static_cast<size_t>(n), 0.0);
  double copy_us = 0.0;
  check_no_errors(on_ranks(devs, [&](int r, cudaStream_t s) {
    Tensor x = filled(len, 1.0f, devs[size_t(r)]);
    Tensor y = filled(len, 1.0f, devs[size_t(r)]);
    float* px = static_cast<float*>(x.data());
    for (int i = 0; i < 10; ++i) g->all_reduce_sum(r, px, len);
    cudaStreamSynchronize(s);
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    cudaEventRecord(a, s);
    for (int i = 0; i < iters; ++i) g->all_reduce_sum(r, px, len);
    cudaEventRecord(b, s);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    us[size_t(r)] = 1000.0 * ms / iters;
    if (r == 0) {
      cudaEventRecord(a, s);
      for (int i = 0; i < iters; ++i) cudaMemcpyAsync(y.data(), x.data(), size_t(len) * 4, cudaMemcpyDeviceToDevice, s);
      cudaEventRecord(b, s);
      cudaEventSynchronize(b);
      cudaEventElapsedTime(&ms, a, b);
      copy_us = 1000.0 * ms / iters;
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }));
  std::printf("  one-shot all-reduce of %lld floats, %d ranks%s: %.2f us per call (rank 0); a copy of the same bytes: "
              "%.2f us\n",
              (long long)len, n, cuda::device_count() >= n ? " on their own GPUs" : " sharing GPU 0", us[0], copy_us);
#endif
}
#else
TEST(skipped_without_cuda) { std::printf("  skipped: this build has no CUDA backend\n"); }
#endif

TEST_MAIN()
