// cuda/p2p_allreduce.cu: the one-shot / two-shot all-reduce over peer memory (see p2p_allreduce.h).
//
// Memory of a group, per rank r (on devices[r]):
//   bufs[r]     two publish buffers of `cap` floats (slot = call number & 1)
//   flags[r]    [kMaxRanks][kMaxBlocks] progress marks, written by the ranks' blocks (peer
//               stores): flags[r][q][b] = 2 k once block b of rank q published call k's
//               slice, 2 k + 1 once it summed its part of it (two-shot)
//   counters[r] [0] the number of calls this rank has completed, [1] blocks done in this call
// and one block of mapped pinned host memory for the group: [0] abort, [1 + r] rank r's status.
//
// Ordering: a block's threads store its slice, bar.sync, then each of threads 0..size-1
// fences at system scope and store-releases the progress mark into one rank's flag array;
// the waiting threads load-acquire (system scope) their flags, bar.sync, and every thread
// then reads the ranks' buffers past L1 (ld.global.cg). Rank r's call k writes buffer
// slot k & 1 only after its call k-1 completed, whose waits saw every rank start call k-1,
// so no rank still reads slot (k - 2) & 1 = k & 1 of call k - 2. In the two-shot form rank r
// overwrites only part r of its own buffer with the sums, which no other rank reads before
// the second mark.
//
// Status: compiled for sm_90a / sm_100a / sm_103a; in the CPU emulation (cpp/emu) every
// call is the kernel in parts with a host rendezvous of the ranks between them, where a
// GPU's kernels wait on the flags (the emulator runs one kernel at a time, so one kernel
// could not wait for another); never run on a GPU yet.
#include "backend/cuda/p2p_allreduce.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "backend/cuda/cuda_api.h"
#include "backend/cuda/cuda_check.cuh"
#include "backend/cuda/pdl.cuh"
#include "dflash2/error.h"
#if defined(DFLASH2_CUDA_EMULATED)
#include "cpp/emu/emu_host.h"
#endif

namespace dflash2::cuda::p2p {
namespace {

enum Status : uint32_t { kOk = 0, kAborted = 1, kTimeout = 2 };  // kTimeout | (peer << 8)
enum Mode : int { kReduce = 0, kGather = 1, kBroadcast = 2 };

struct Params {
  float* bufs[kMaxRanks];
  uint32_t* flags[kMaxRanks];
  uint32_t* counters;           // this rank's
  volatile uint32_t* control;   // mapped host memory: [0] abort, [1 + rank] status
  float* x;       // all-reduce: in and out; all-gather: in (4-byte words); broadcast: in (root) / out
  float* add_to;  // all-reduce: nullptr, the sum into x; else add_to + sum into add_to (x unchanged)
  const float* x2;  // all-reduce: nullptr, or this rank's addend: the ranks' x + x2 are summed
  float* out;     // all-gather: [size][n] words
  int mode;       // kReduce, kGather, kBroadcast
  int root;       // broadcast
  int64_t n, chunk, cap;
  uint64_t timeout_ns;
  int rank, size;
  int phase;     // 0: the whole call; the emulator's parts: 1 publish, 2 wait and sum (two-shot: its
                 // part), 3 (two-shot) wait and copy the parts
  int two_shot;  // reduce-scatter then all-gather through the buffers (larger calls)
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

// f4(i) for each float4 of [b, e) (i = b, b + 4, ...: 16-byte aligned where vec is set) and
// f1(i) for the remaining elements, spread over the block's threads
template <class F4, class F1>
__device__ __forceinline__ void block_range(int64_t b, int64_t e, bool vec, F4 f4, F1 f1) {
  const int64_t ve = vec && e > b ? b + (e - b) / 4 * 4 : b;
  for (int64_t i = b + 4 * int64_t(threadIdx.x); i < ve; i += 4 * int64_t(kThreads)) f4(i);
  for (int64_t i = ve + threadIdx.x; i < e; i += kThreads) f1(i);
}

__device__ __forceinline__ float4 add4(float4 a, float4 b) {
  return make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z), __fadd_rn(a.w, b.w));
}

// After the block's stores: raise flag `value` of this block in every rank's array.
__device__ __forceinline__ void signal(const Params& p, int b, uint32_t value) {
  __syncthreads();
  if (threadIdx.x < p.size) {
    __threadfence_system();
    store_release_sys(p.flags[threadIdx.x] + p.rank * kMaxBlocks + b, value);
  }
}

// Thread q < size waits until rank q's flag of this block reaches `value` (the abort word and
// the timeout looked at every 1024 spins); *failed set on either. Ends with a barrier.
__device__ __forceinline__ void wait_all(const Params& p, int b, uint32_t value, int* failed) {
  if (threadIdx.x < p.size) {
    const uint32_t* f = p.flags[p.rank] + threadIdx.x * kMaxBlocks + b;
    const uint64_t start = now_ns();
    for (uint32_t spins = 0;; ++spins) {
      if (int32_t(load_acquire_sys(f) - value) >= 0) break;
      if ((spins & 1023u) == 1023u) {
        if (p.control[0] != 0u) {
          p.control[1 + p.rank] = kAborted;
          *failed = 1;
          break;
        }
        if (now_ns() - start > p.timeout_ns) {
          p.control[1 + p.rank] = kTimeout | (uint32_t(threadIdx.x) << 8);
          *failed = 1;
          break;
        }
      }
    }
  }
  __syncthreads();
}

// Copies the words [b, e) of src to dst (bit patterns kept: integers, NaN payloads).
__device__ __forceinline__ void copy_words(const float* src, float* dst, int64_t b, int64_t e, bool vec) {
  const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  block_range(
      b, e, vec, [&](int64_t i) { *reinterpret_cast<uint4*>(d + i) = __ldcg(reinterpret_cast<const uint4*>(s + i)); },
      [&](int64_t i) { d[i] = __ldcg(s + i); });
}

// One collective call on one rank (all-reduce; all-gather and broadcast below). Flag values:
// 2 call once a block published its slice,
// 2 call + 1 once it reduced its part (two-shot), so one increasing sequence serves both.
//   one-shot: publish the slice; wait; every rank sums the whole slice over all buffers.
//   two-shot (larger calls): publish; wait; rank r sums part r of the slice over all buffers
//   into its own buffer (only rank r reads part r of the inputs); wait; every rank copies
//   part q from rank q's buffer. Each rank reads 2 (N - 1) / N of the bytes instead of N - 1.
// Either way each element is summed in rank order by one thread: the same bits.
// All-gather: publish; wait; copy every rank's slice to its place in out. Broadcast: the
// root publishes, every rank raises its flag (so the root cannot run two calls ahead and
// overwrite a buffer still read); wait; the others copy the root's slice.
__global__ void __launch_bounds__(kThreads) allreduce_kernel(Params p) {
  detail::pdl_enter();
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
  const bool vec = p.vec != 0;
  float* mine = p.bufs[p.rank] + slot;
  float* out = p.add_to ? p.add_to : p.x;
  // the sum of element i over the ranks' buffers, in rank order
  auto sum4 = [&](int64_t i) {
    float4 acc = __ldcg(reinterpret_cast<const float4*>(p.bufs[0] + slot + i));
    for (int q = 1; q < p.size; ++q) acc = add4(acc, __ldcg(reinterpret_cast<const float4*>(p.bufs[q] + slot + i)));
    return acc;
  };
  auto sum1 = [&](int64_t i) {
    float acc = __ldcg(p.bufs[0] + slot + i);
    for (int q = 1; q < p.size; ++q) acc = __fadd_rn(acc, __ldcg(p.bufs[q] + slot + i));
    return acc;
  };
  // the output: v, or the residual add add_to + v (as ops::add(h, part, h))
  auto put4 = [&](int64_t i, float4 v) {
    if (p.add_to) v = add4(*reinterpret_cast<const float4*>(p.add_to + i), v);
    *reinterpret_cast<float4*>(out + i) = v;
  };
  auto put1 = [&](int64_t i, float v) { out[i] = p.add_to ? __fadd_rn(p.add_to[i], v) : v; };

  if (p.phase == 0 || p.phase == 1) {  // publish this block's slice
    if (p.x2) {  // this rank's x + x2 (as ops::add(x, x2, x) before the all-reduce)
      block_range(
          begin, end, vec,
          [&](int64_t i) {
            *reinterpret_cast<float4*>(mine + i) =
                add4(*reinterpret_cast<const float4*>(p.x + i), *reinterpret_cast<const float4*>(p.x2 + i));
          },
          [&](int64_t i) { mine[i] = __fadd_rn(p.x[i], p.x2[i]); });
    } else if (p.mode != kBroadcast || p.rank == p.root) {
      copy_words(p.x, mine, begin, end, vec);
    }
    signal(p, b, 2u * call);
    if (p.phase == 1) return;
  }
  if (p.mode != kReduce) {
    wait_all(p, b, 2u * call, &s_failed);
    float* dst = p.mode == kGather ? p.out : p.x;
    for (int q = 0; q < p.size; ++q) {
      if (p.mode == kBroadcast && (q != p.root || p.rank == p.root)) continue;
      float* d = p.mode == kGather ? dst + q * p.n : dst;
      if (!s_failed) {
        copy_words(p.bufs[q] + slot, d, begin, end, vec);
      } else {  // all ones: NaN for floats, -1 for ids
        for (int64_t i = begin + tid; i < end; i += kThreads) reinterpret_cast<uint32_t*>(d)[i] = 0xffffffffu;
      }
    }
  }
  // rank r's part of the slice (two-shot): parts of a multiple of 4 elements
  const int64_t part = ((end - begin + p.size - 1) / p.size + 3) / 4 * 4;
  auto part_begin = [&](int q) { return begin + q * part < end ? begin + q * part : end; };
  if (p.mode == kReduce && (p.phase == 0 || p.phase == 2)) {
    wait_all(p, b, 2u * call, &s_failed);
    if (!p.two_shot) {
      if (!s_failed)
        block_range(
            begin, end, vec, [&](int64_t i) { put4(i, sum4(i)); }, [&](int64_t i) { put1(i, sum1(i)); });
    } else if (!s_failed) {
      block_range(
          part_begin(p.rank), part_begin(p.rank + 1), vec,
          [&](int64_t i) { *reinterpret_cast<float4*>(mine + i) = sum4(i); }, [&](int64_t i) { mine[i] = sum1(i); });
      signal(p, b, 2u * call + 1u);
    }
    if (p.two_shot && p.phase == 2) return;
  }
  if (p.mode == kReduce && p.two_shot && !s_failed) {  // copy every rank's reduced part
    wait_all(p, b, 2u * call + 1u, &s_failed);
    if (!s_failed)
      for (int q = 0; q < p.size; ++q) {
        const float* src = p.bufs[q] + slot;
        block_range(
            part_begin(q), part_begin(q + 1), vec,
            [&](int64_t i) { put4(i, __ldcg(reinterpret_cast<const float4*>(src + i))); },
            [&](int64_t i) { put1(i, __ldcg(src + i)); });
      }
  }
  if (p.mode == kReduce && s_failed)  // the step's non-finite check refuses what follows
    for (int64_t i = begin + tid; i < end; i += kThreads) out[i] = __int_as_float(0x7fc00000);

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
  size_t one_shot_max = 0;  // bytes: larger calls take the two-shot algorithm
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
                                     std::string* why, size_t one_shot_max_bytes) {
  auto refuse = [&](std::string w) -> std::shared_ptr<Group> {
    if (why) *why = std::move(w);
    return nullptr;
  };
  const int n = int(devices.size());
  if (n < 1 || n > kMaxRanks) return refuse("the all-reduce over peer memory takes 1 to " + std::to_string(kMaxRanks) + " ranks");
  if (max_bytes < 16) return refuse("the all-reduce over peer memory is off (size limit " + std::to_string(max_bytes) + " bytes)");
  const int count = device_count();
  for (int d : devices)
    if (d < 0 || d >= count) return refuse("device " + std::to_string(d) + " does not exist");
#if !defined(DFLASH2_CUDA_EMULATED)
  // Ranks spin-wait for each other inside the kernel. Two ranks on one GPU would deadlock as
  // soon as one rank's thread waits for the whole device (cudaFree, the first, lazy load of a
  // kernel) while the other rank's kernel spins for it: seen on an H200. (The CPU emulation
  // runs ranks of one GPU as host threads and has no such waits.)
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < i; ++j)
      if (devices[size_t(i)] == devices[size_t(j)])
        return refuse("ranks " + std::to_string(j) + " and " + std::to_string(i) + " share cuda:" +
                      std::to_string(devices[size_t(i)]) +
                      ": the all-reduce over peer memory takes one GPU per rank (its ranks wait for each "
                      "other on the GPU)");
#endif
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
  s.one_shot_max = one_shot_max_bytes;
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
  if (e != cudaSuccess) detail::raise(e, "cudaHostAlloc", "the peer all-reduce's control word");
  s.control_host = static_cast<uint32_t*>(host);
  std::memset(host, 0, (1 + kMaxRanks) * 4);
  void* dev = nullptr;
  e = cudaHostGetDevicePointer(&dev, host, 0);
  if (e != cudaSuccess) detail::raise(e, "cudaHostGetDevicePointer", "the peer all-reduce's control word");
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

bool Group::aborted() const { return reinterpret_cast<const volatile uint32_t*>(s_->control_host)[0] != 0u; }

std::string Group::error() const {
  if (aborted()) return "the tensor-parallel group was aborted";
  const volatile uint32_t* c = s_->control_host;
  for (int r = 0; r < s_->n; ++r) {
    const uint32_t st = c[1 + r];
    if (st == kOk) continue;
    if ((st & 0xffu) == kTimeout)
      return "rank " + std::to_string(r) + " waited over " + seconds(s_->timeout_s) + " for rank " +
             std::to_string(st >> 8) + " in a collective over peer memory (a rank stopped issuing collectives)";
    return "rank " + std::to_string(r) + " left a collective over peer memory aborted";
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

// One collective on rank `rank`: the kernel over n words (Params filled but for the group's
// part), queued on this thread's stream.
void Group::run(int rank, void* vp) {
  GroupState& s = *s_;
  Params& p = *static_cast<Params*>(vp);
  const std::string failed = error();
  DFLASH2_CHECK(failed.empty(), ErrorKind::Backend, "collective over peer memory: ", failed);
  if (p.n == 0) return;
  for (int q = 0; q < s.n; ++q) {
    p.bufs[q] = s.bufs[size_t(q)];
    p.flags[q] = s.flags[size_t(q)];
  }
  p.counters = s.counters[size_t(rank)];
  p.control = s.control_dev;
  p.cap = s.cap;
  p.timeout_ns = uint64_t(s.timeout_s * 1e9);
  p.rank = rank;
  p.size = s.n;
  const int64_t n = p.n;
  p.two_shot = p.mode == kReduce && n * 4 > int64_t(s.one_shot_max) && s.n > 1 ? 1 : 0;
  const int64_t per_block = 4 * int64_t(kThreads);
  const int blocks = int(std::clamp<int64_t>((n + per_block - 1) / per_block, 1, kMaxBlocks));
  p.chunk = ((n + blocks - 1) / blocks + 3) / 4 * 4;
  const int used = int((n + p.chunk - 1) / p.chunk);  // blocks with a slice (chunk rounding)
  auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  p.vec = aligned(p.x) && aligned(p.add_to) && aligned(p.out) && aligned(p.x2) && (p.mode != kGather || n % 4 == 0)
              ? 1
              : 0;
  detail::DeviceGuard guard(s.devices[size_t(rank)]);
  cudaStream_t st = reinterpret_cast<cudaStream_t>(current_stream());
#if defined(DFLASH2_CUDA_EMULATED)
  // the kernel's parts with a rendezvous of the ranks where a GPU's kernels would wait
  for (int phase = 1; phase <= (p.two_shot ? 3 : 2); ++phase) {
    if (phase > 1) emu::enqueue_host(st, [gs = &s] { gs->rendezvous(); });
    p.phase = phase;
    allreduce_kernel<<<used, kThreads, 0, st>>>(p);
  }
#else
  p.phase = 0;
  allreduce_kernel<<<used, kThreads, 0, st>>>(p);
#endif
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) detail::raise(e, "collective over peer memory: launch", n, " words on rank ", rank);
}

void Group::all_reduce_sum(int rank, float* x, int64_t n, float* add_to, const float* x2) {
  DFLASH2_CHECK_ARG(rank >= 0 && rank < s_->n, "p2p all-reduce: rank ", rank, " outside [0, ", s_->n, ")");
  DFLASH2_CHECK_ARG(n >= 0 && n <= s_->cap, "p2p all-reduce: ", n, " elements exceed the group's ", s_->cap);
  Params p{};
  p.mode = kReduce;
  p.x = x;
  p.add_to = add_to;
  p.x2 = x2;
  p.n = n;
  run(rank, &p);
}

void Group::all_gather(int rank, const void* in, int64_t words, void* out) {
  DFLASH2_CHECK_ARG(rank >= 0 && rank < s_->n, "p2p all-gather: rank ", rank, " outside [0, ", s_->n, ")");
  DFLASH2_CHECK_ARG(words >= 0 && words <= s_->cap, "p2p all-gather: ", words, " words exceed the group's ", s_->cap);
  Params p{};
  p.mode = kGather;
  p.x = static_cast<float*>(const_cast<void*>(in));
  p.out = static_cast<float*>(out);
  p.n = words;
  run(rank, &p);
}

void Group::broadcast(int rank, void* x, int64_t words, int root) {
  DFLASH2_CHECK_ARG(rank >= 0 && rank < s_->n && root >= 0 && root < s_->n, "p2p broadcast: rank ", rank,
                    " or root ", root, " outside [0, ", s_->n, ")");
  DFLASH2_CHECK_ARG(words >= 0 && words <= s_->cap, "p2p broadcast: ", words, " words exceed the group's ", s_->cap);
  Params p{};
  p.mode = kBroadcast;
  p.x = static_cast<float*>(x);
  p.root = root;
  p.n = words;
  run(rank, &p);
}

std::string Group::self_check(double timeout_s) {
  GroupState& s = *s_;
  const int n = s.n;
  const double saved = s.timeout_s;
  s.timeout_s = timeout_s;
  const int64_t small = 1000, words = 777;
  // the two-shot form where the group takes it (one float past the one-shot limit)
  const int64_t big = std::min<int64_t>(s.cap, int64_t(s.one_shot_max / 4) + 1000);
  std::vector<std::string> errors(static_cast<size_t>(n));
  auto value = [](int r, int64_t i) { return float((r + 1) * (int(i % 13) - 6)) * 0.25f; };  // sums exact
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      const int dev = s.devices[size_t(r)];
      CUstream_st* stream = nullptr;
      float* d = nullptr;
      try {
        detail::DeviceGuard guard(dev);
        stream = stream_create(dev);
        StreamScope scope(stream);
        cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
        const int64_t total = small + small + big + words + int64_t(n) * words + words;
        d = static_cast<float*>(device_malloc(size_t(total) * 4, dev));
        float *a = d, *h = a + small, *b = h + small, *gi = b + big, *go = gi + words, *bc = go + int64_t(n) * words;
        std::vector<float> host(static_cast<size_t>(total), 0.0f);
        for (int64_t i = 0; i < small; ++i) host[size_t(i)] = value(r, i);
        for (int64_t i = 0; i < small; ++i) host[size_t(small + i)] = 1.0f;
        for (int64_t i = 0; i < big; ++i) host[size_t(2 * small + i)] = value(r, i);
        uint32_t* wi = reinterpret_cast<uint32_t*>(host.data() + 2 * small + big);
        for (int64_t i = 0; i < words; ++i) wi[i] = 0x7f800001u + uint32_t(r * 1000 + i);  // NaN payloads
        uint32_t* wb = reinterpret_cast<uint32_t*>(host.data() + 2 * small + big + words + int64_t(n) * words);
        for (int64_t i = 0; i < words; ++i) wb[i] = uint32_t(r * 5000 + i);
        cudaError_t e = cudaMemcpyAsync(d, host.data(), size_t(total) * 4, cudaMemcpyHostToDevice, st);
        if (e != cudaSuccess) detail::raise(e, "cudaMemcpyAsync", "self-check inputs");
        all_reduce_sum(r, a, small);
        all_reduce_sum(r, a, small, h);  // h = 1 + the sum of the sums (n copies of it)
        all_reduce_sum(r, b, big);
        all_gather(r, gi, words, go);
        broadcast(r, bc, words, n - 1);
        e = cudaMemcpyAsync(host.data(), d, size_t(total) * 4, cudaMemcpyDeviceToHost, st);
        if (e != cudaSuccess) detail::raise(e, "cudaMemcpyAsync", "self-check outputs");
        e = cudaStreamSynchronize(st);
        if (e != cudaSuccess) detail::raise(e, "cudaStreamSynchronize", "self-check");
        const float ranks = float(n * (n + 1) / 2);
        std::string& why = errors[size_t(r)];
        for (int64_t i = 0; i < small && why.empty(); ++i) {
          const float sum = ranks * value(0, i);
          if (host[size_t(i)] != sum) why = small * 4 > int64_t(s.one_shot_max) ? "two-shot all-reduce" : "one-shot all-reduce";
          else if (host[size_t(small + i)] != 1.0f + float(n) * sum) why = "all-reduce added into a residual";
        }
        for (int64_t i = 0; i < big && why.empty(); ++i)
          if (host[size_t(2 * small + i)] != ranks * value(0, i))
            why = big * 4 > int64_t(s.one_shot_max) ? "two-shot all-reduce" : "one-shot all-reduce";
        const uint32_t* wo = reinterpret_cast<const uint32_t*>(host.data() + 2 * small + big + words);
        for (int q = 0; q < n && why.empty(); ++q)
          for (int64_t i = 0; i < words && why.empty(); ++i)
            if (wo[q * words + i] != 0x7f800001u + uint32_t(q * 1000 + i)) why = "all-gather";
        for (int64_t i = 0; i < words && why.empty(); ++i)
          if (wb[i] != uint32_t((n - 1) * 5000 + i)) why = "broadcast";
        if (!why.empty()) why = "rank " + std::to_string(r) + ": " + why + " gave wrong values";
      } catch (const std::exception& ex) {
        errors[size_t(r)] = "rank " + std::to_string(r) + ": " + ex.what();
      }
      if (d) device_free(d, dev);
      if (stream) stream_destroy(stream, dev);
    });
  for (auto& t : threads) t.join();
  s.timeout_s = saved;
  const std::string failed = error();
  if (!failed.empty()) return failed;
  for (const std::string& e : errors)
    if (!e.empty()) return e;
  return "";
}

size_t default_max_bytes() {
  if (const char* e = std::getenv("DFLASH2_P2P_ALLREDUCE_MAX_KB"); e && *e) return size_t(std::atoll(e)) * 1024;
  return size_t(8) << 20;
}

size_t default_one_shot_max_bytes() {
  if (const char* e = std::getenv("DFLASH2_P2P_ONE_SHOT_MAX_KB"); e && *e) return size_t(std::atoll(e)) * 1024;
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
