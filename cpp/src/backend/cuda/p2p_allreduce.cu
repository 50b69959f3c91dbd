// cuda/p2p_allreduce.cu: the one-shot all-reduce over peer memory (see p2p_allreduce.h).
//
// Memory of a group, per rank r (on devices[r]):
//   bufs[r]     two publish buffers of `cap` floats (slot = call number & 1)
//   flags[r]    [kMaxRanks][kMaxBlocks] call numbers, written by the ranks' blocks (peer
//               stores): flags[r][q][b] = the last call whose block b rank q has published
//   counters[r] [0] the number of calls this rank has completed, [1] blocks done in this call
// and one block of mapped pinned host memory for the group: [0] abort, [1 + r] rank r's status.
//
// Ordering: a block's threads store its slice, bar.sync, then each of threads 0..size-1
// fences at system scope and store-releases the call number into one rank's flag array;
// the waiting threads load-acquire (system scope) their flags, bar.sync, and every thread
// then reads the ranks' buffers past L1 (ld.global.cg). Rank r's call k writes buffer
// slot k & 1 only after its call k-1 completed, whose waits saw every rank start call k-1,
// so no rank still reads slot (k - 2) & 1 = k & 1 of call k - 2.
//
// Status: compiled for sm_90a / sm_100a / sm_103a; in the CPU emulation (cpp/emu) every
// call is the kernel's publishing half, a host rendezvous of the ranks, then its waiting and
// summing half (the emulator runs one kernel at a time, so one kernel could not wait for
// another); never run on a GPU yet.
#include "backend/cuda/p2p_allreduce.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "backend/cuda/cuda_api.h"
#include "backend/cuda/cuda_check.cuh"
#include "dflash2/error.h"
#if defined(DFLASH2_CUDA_EMULATED)
#include "cpp/emu/emu_host.h"
#endif

namespace dflash2::cuda::p2p {
namespace {

enum Status : uint32_t { kOk = 0, kAborted = 1, kTimeout = 2 };  // kTimeout | (peer << 8)

struct Params {
  float* bufs[kMaxRanks];
  uint32_t* flags[kMaxRanks];
  uint32_t* counters;           // this rank's
  volatile uint32_t* control;   // mapped host memory: [0] abort, [1 + rank] status
  float* x;
  float* add_to;  // nullptr: the sum into x; else add_to + sum into add_to (x unchanged)
  int64_t n, chunk, cap;
  uint64_t timeout_ns;
  int rank, size;
  int phase;  // 0: the whole call; 1: publish only; 2: wait and sum (the emulator's halves)
  int vec;    // x and add_to are 16-byte aligned (chunk is a multiple of 4)
};

__device__ __forceinline__ uint64_t now_ns() {
#if defined(DFLASH2_CUDA_EMULATED)
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now().time_since_epoch())
                      .count());
#else
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#endif
}

__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* p) {
#if defined(DFLASH2_CUDA_EMULATED)
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#else
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#endif
}

__device__ __forceinline__ void store_release_sys(uint32_t* p, uint32_t v) {
#if defined(DFLASH2_CUDA_EMULATED)
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
#else
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#endif
}

__global__ void __launch_bounds__(kThreads) one_shot_kernel(Params p) {
  __shared__ uint32_t s_call;
  __shared__ int s_failed;
  const int tid = threadIdx.x, b = blockIdx.x;
  if (tid == 0) {
    s_call = __ldcg(p.counters) + 1u;
    s_failed = 0;
  }
  __syncthreads();
  const uint32_t call = s_call;
  const int64_t begin = int64_t(b) * p.chunk, end = begin + p.chunk < p.n ? begin + p.chunk : p.n;
  const int64_t slot = int64_t(call & 1u) * p.cap;
  // [begin, vend) in float4s where x is 16-byte aligned (begin is a multiple of 4), the rest one by one
  const int64_t vend = p.vec ? begin + (end > begin ? (end - begin) / 4 * 4 : 0) : begin;

  if (p.phase != 2) {  // publish this block's slice, then raise its flag in every rank's array
    float* mine = p.bufs[p.rank] + slot;
    for (int64_t i = begin + 4 * int64_t(tid); i < vend; i += 4 * int64_t(kThreads))
      *reinterpret_cast<float4*>(mine + i) = *reinterpret_cast<const float4*>(p.x + i);
    for (int64_t i = vend + tid; i < end; i += kThreads) mine[i] = p.x[i];
    __syncthreads();
    if (tid < p.size) {
      __threadfence_system();
      store_release_sys(p.flags[tid] + p.rank * kMaxBlocks + b, call);
    }
    if (p.phase == 1) return;
  }

  if (tid < p.size) {  // thread q waits for rank q's flag of this block and call
    const uint32_t* f = p.flags[p.rank] + tid * kMaxBlocks + b;
    const uint64_t start = now_ns();
    for (uint32_t spins = 0;; ++spins) {
      if (int32_t(load_acquire_sys(f) - call) >= 0) break;
      if ((spins & 1023u) == 1023u) {
        if (p.control[0] != 0u) {
          p.control[1 + p.rank] = kAborted;
          s_failed = 1;
          break;
        }
        if (now_ns() - start > p.timeout_ns) {
          p.control[1 + p.rank] = kTimeout | (uint32_t(tid) << 8);
          s_failed = 1;
          break;
        }
      }
    }
  }
  __syncthreads();

  float* out = p.add_to ? p.add_to : p.x;
  if (s_failed) {  // the step's non-finite check refuses what follows
    for (int64_t i = begin + tid; i < end; i += kThreads) out[i] = __int_as_float(0x7fc00000);
  } else {
    for (int64_t i = begin + 4 * int64_t(tid); i < vend; i += 4 * int64_t(kThreads)) {
      float4 acc = __ldcg(reinterpret_cast<const float4*>(p.bufs[0] + slot + i));
      for (int q = 1; q < p.size; ++q) {
        const float4 v = __ldcg(reinterpret_cast<const float4*>(p.bufs[q] + slot + i));
        acc.x = __fadd_rn(acc.x, v.x);
        acc.y = __fadd_rn(acc.y, v.y);
        acc.z = __fadd_rn(acc.z, v.z);
        acc.w = __fadd_rn(acc.w, v.w);
      }
      if (p.add_to) {  // the residual add: add_to + sum, as ops::add(h, part, h)
        const float4 h = *reinterpret_cast<const float4*>(p.add_to + i);
        acc.x = __fadd_rn(h.x, acc.x);
        acc.y = __fadd_rn(h.y, acc.y);
        acc.z = __fadd_rn(h.z, acc.z);
        acc.w = __fadd_rn(h.w, acc.w);
      }
      *reinterpret_cast<float4*>(out + i) = acc;
    }
    for (int64_t i = vend + tid; i < end; i += kThreads) {
      float acc = __ldcg(p.bufs[0] + slot + i);
      for (int q = 1; q < p.size; ++q) acc = __fadd_rn(acc, __ldcg(p.bufs[q] + slot + i));
      out[i] = p.add_to ? __fadd_rn(p.add_to[i], acc) : acc;
    }
  }

  // the last block to finish counts the call (every block read the count before it)
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    if (atomicAdd(p.counters + 1, 1u) == gridDim.x - 1) {
      p.counters[1] = 0u;
      p.counters[0] = call;
    }
  }
}

}  // namespace

struct GroupState {
  int n = 0;
  std::vector<int> devices;
  int64_t cap = 0;  // floats per publish slot
  double timeout_s = 60.0;
  std::vector<float*> bufs;
  std::vector<uint32_t*> flags, counters;
  uint32_t* control_host = nullptr;  // mapped pinned
  uint32_t* control_dev = nullptr;
#if defined(DFLASH2_CUDA_EMULATED)
  // the rendezvous standing in for the kernels' waits
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t rounds = 0;
  void rendezvous() {
    std::unique_lock<std::mutex> lk(mu);
    const uint64_t round = rounds;
    if (++arrived == n) {
      arrived = 0;
      ++rounds;
      cv.notify_all();
      return;
    }
    cv.wait_for(lk, std::chrono::duration<double>(timeout_s),
                [&] { return rounds != round || reinterpret_cast<volatile uint32_t*>(control_host)[0] != 0u; });
  }
#endif
};

Group::~Group() {
  if (!s_) return;
  for (int r = 0; r < s_->n; ++r) {
    const int d = s_->devices[size_t(r)];
    if (r < int(s_->bufs.size())) device_free(s_->bufs[size_t(r)], d);
    if (r < int(s_->flags.size())) device_free(s_->flags[size_t(r)], d);
    if (r < int(s_->counters.size())) device_free(s_->counters[size_t(r)], d);
  }
  if (s_->control_host) cudaFreeHost(s_->control_host);
}

int Group::size() const { return s_->n; }
size_t Group::max_bytes() const { return size_t(s_->cap) * 4; }

std::shared_ptr<Group> Group::create(const std::vector<int>& devices, size_t max_bytes, double timeout_s,
                                     std::string* why) {
  auto refuse = [&](std::string w) -> std::shared_ptr<Group> {
    if (why) *why = std::move(w);
    return nullptr;
  };
  const int n = int(devices.size());
  if (n < 1 || n > kMaxRanks) return refuse("the one-shot all-reduce takes 1 to " + std::to_string(kMaxRanks) + " ranks");
  if (max_bytes < 16) return refuse("the one-shot all-reduce is off (size limit " + std::to_string(max_bytes) + " bytes)");
  const int count = device_count();
  for (int d : devices)
    if (d < 0 || d >= count) return refuse("device " + std::to_string(d) + " does not exist");
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) {
      const int a = devices[size_t(i)], c = devices[size_t(j)];
      if (a != c && !enable_peer_access(a, c))
        return refuse("cuda:" + std::to_string(a) + " cannot access cuda:" + std::to_string(c) + "'s memory (peer access)");
    }
  std::shared_ptr<Group> g(new Group());
  g->s_ = std::make_unique<GroupState>();
  GroupState& s = *g->s_;
  s.n = n;
  s.devices = devices;
  s.cap = (int64_t(max_bytes / 4) + 3) / 4 * 4;
  s.timeout_s = timeout_s > 0 ? timeout_s : 60.0;
  const size_t flag_bytes = size_t(kMaxRanks) * kMaxBlocks * 4;
  for (int r = 0; r < n; ++r) {
    const int d = devices[size_t(r)];
    s.bufs.push_back(static_cast<float*>(device_malloc(size_t(2 * s.cap) * 4, d)));
    s.flags.push_back(static_cast<uint32_t*>(device_malloc(flag_bytes, d)));
    memset_zero(s.flags.back(), d, flag_bytes);
    s.counters.push_back(static_cast<uint32_t*>(device_malloc(2 * 4, d)));
    memset_zero(s.counters.back(), d, 2 * 4);
  }
  void* host = nullptr;
  cudaError_t e = cudaHostAlloc(&host, (1 + kMaxRanks) * 4, cudaHostAllocMapped | cudaHostAllocPortable);
  if (e != cudaSuccess) detail::raise(e, "cudaHostAlloc", "the one-shot all-reduce's control word");
  s.control_host = static_cast<uint32_t*>(host);
  std::memset(host, 0, (1 + kMaxRanks) * 4);
  void* dev = nullptr;
  e = cudaHostGetDevicePointer(&dev, host, 0);
  if (e != cudaSuccess) detail::raise(e, "cudaHostGetDevicePointer", "the one-shot all-reduce's control word");
  s.control_dev = static_cast<uint32_t*>(dev);
  for (int r = 0; r < n; ++r) synchronize(devices[size_t(r)]);  // the zeroed flags, before any peer writes
  if (why) *why = "";
  return g;
}

namespace {
std::string seconds(double s) {
  char b[32];
  std::snprintf(b, sizeof b, "%g s", s);
  return b;
}
}  // namespace

std::string Group::error() const {
  const volatile uint32_t* c = s_->control_host;
  if (c[0] != 0u) return "the tensor-parallel group was aborted";
  for (int r = 0; r < s_->n; ++r) {
    const uint32_t st = c[1 + r];
    if (st == kOk) continue;
    if ((st & 0xffu) == kTimeout)
      return "rank " + std::to_string(r) + " waited over " + seconds(s_->timeout_s) + " for rank " +
             std::to_string(st >> 8) + " in a one-shot all-reduce (a rank stopped issuing collectives)";
    return "rank " + std::to_string(r) + " left a one-shot all-reduce aborted";
  }
  return "";
}

void Group::abort() {
  reinterpret_cast<volatile uint32_t*>(s_->control_host)[0] = 1u;
#if defined(DFLASH2_CUDA_EMULATED)
  std::lock_guard<std::mutex> lk(s_->mu);
  s_->cv.notify_all();
#endif
}

void Group::all_reduce_sum(int rank, float* x, int64_t n, float* add_to) {
  GroupState& s = *s_;
  DFLASH2_CHECK_ARG(rank >= 0 && rank < s.n, "p2p all-reduce: rank ", rank, " outside [0, ", s.n, ")");
  DFLASH2_CHECK_ARG(n >= 0 && n <= s.cap, "p2p all-reduce: ", n, " elements exceed the group's ", s.cap);
  const std::string failed = error();
  DFLASH2_CHECK(failed.empty(), ErrorKind::Backend, "one-shot all-reduce: ", failed);
  if (n == 0) return;
  Params p{};
  for (int q = 0; q < s.n; ++q) {
    p.bufs[q] = s.bufs[size_t(q)];
    p.flags[q] = s.flags[size_t(q)];
  }
  p.counters = s.counters[size_t(rank)];
  p.control = s.control_dev;
  p.x = x;
  p.add_to = add_to;
  p.n = n;
  p.cap = s.cap;
  p.timeout_ns = uint64_t(s.timeout_s * 1e9);
  p.rank = rank;
  p.size = s.n;
  const int64_t per_block = 4 * int64_t(kThreads);
  const int blocks = int(std::clamp<int64_t>((n + per_block - 1) / per_block, 1, kMaxBlocks));
  p.chunk = ((n + blocks - 1) / blocks + 3) / 4 * 4;
  const int used = int((n + p.chunk - 1) / p.chunk);  // blocks with a slice (chunk rounding)
  p.vec = (reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(add_to) % 16 == 0) ? 1 : 0;
  detail::DeviceGuard guard(s.devices[size_t(rank)]);
  cudaStream_t st = reinterpret_cast<cudaStream_t>(current_stream());
#if defined(DFLASH2_CUDA_EMULATED)
  p.phase = 1;
  one_shot_kernel<<<used, kThreads, 0, st>>>(p);
  emu::enqueue_host(st, [gs = &s] { gs->rendezvous(); });
  p.phase = 2;
  one_shot_kernel<<<used, kThreads, 0, st>>>(p);
#else
  p.phase = 0;
  one_shot_kernel<<<used, kThreads, 0, st>>>(p);
#endif
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) detail::raise(e, "one-shot all-reduce launch", n, " floats on rank ", rank);
}

size_t default_max_bytes() {
  if (const char* e = std::getenv("DFLASH2_P2P_ALLREDUCE_MAX_KB"); e && *e) return size_t(std::atoll(e)) * 1024;
  return size_t(512) * 1024;
}

double default_timeout_s() {
  if (const char* e = std::getenv("DFLASH2_P2P_ALLREDUCE_TIMEOUT_S"); e && *e) {
    const double v = std::atof(e);
    if (v > 0) return v;
  }
  return 60.0;
}

}  // namespace dflash2::cuda::p2p
