// cpp/emu/nccl_emu.cpp: the NCCL entry points comm/nccl_comm.cpp uses, emulated in process
// for the CPU emulator of the CUDA backend (never in a product build), so tensor parallelism
// on CUDA runs without GPUs: EMU_DEVICES=N emulated devices, one rank per device, each rank
// driven by its own host thread (as the engine drives NCCL).
//
// A collective is queued on the rank's stream like a kernel (run at once, or at each replay
// of a captured graph). When it runs it waits for every rank of the group to reach its
// collective of the same sequence number; the last to arrive performs it for all, reading
// every rank's buffers, summing in rank order (deterministic; real NCCL's ring / tree order
// differs), and writing every rank's output. Checked, where real NCCL would hang or corrupt
// memory:
//   - ranks meeting in different collectives (kind, count, type, root): ncclInvalidUsage;
//   - a buffer outside the rank's own device allocations: ncclInvalidArgument;
//   - a rank that never arrives (EMU_NCCL_TIMEOUT seconds, default 300): ncclSystemError.
// The error is reported as NCCL reports errors of enqueued work, through
// ncclCommGetAsyncError, and printed to stderr.
#include <nccl.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "emu_host.h"
#include "nccl_emu.h"

namespace emu::nccl {

enum class Kind { AllReduce, AllGather, ReduceScatter, Broadcast };
const char* kind_name(Kind k) {
  switch (k) {
    case Kind::AllReduce: return "AllReduce";
    case Kind::AllGather: return "AllGather";
    case Kind::ReduceScatter: return "ReduceScatter";
    case Kind::Broadcast: return "Broadcast";
  }
  return "?";
}

struct Call {
  Kind kind;
  const void* send;
  void* recv;
  size_t count;
  ncclDataType_t type;
  ncclRedOp_t op;
  int root;
};

struct Group {
  int n = 0;
  std::mutex mu;
  std::condition_variable cv;
  uint64_t done = 0;  // collectives completed
  int arrived = 0;
  std::vector<Call> calls;
  std::vector<int> devices;
  bool aborted = false;
  ncclResult_t failed = ncclSuccess;  // the group's sticky error (every rank sees it)
};

size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
  }
}

}  // namespace emu::nccl

struct ncclComm {
  std::shared_ptr<emu::nccl::Group> group;
  int rank = 0;
  int device = 0;
  bool aborted = false;
};

namespace emu::nccl {
namespace {

double timeout_seconds() {
  const char* e = std::getenv("EMU_NCCL_TIMEOUT");
  return e && *e ? std::atof(e) : 300.0;
}

// The [p, p + bytes) range lies in one allocation of `device` (emu_runtime's cudaMalloc).
bool on_device(const void* p, size_t bytes, int device) {
  int d = -1;
  return emu::device_range(p, bytes, &d) && d == device;
}

void fail_group(Group& g, ncclResult_t why, const std::string& msg) {
  if (g.failed == ncclSuccess) {
    g.failed = why;
    std::fprintf(stderr, "emu: NCCL: %s\n", msg.c_str());
  }
}

// Performs the round's collective over every rank's call (the group's lock held).
void perform(Group& g) {
  const Call& c0 = g.calls[0];
  for (int r = 1; r < g.n; ++r) {
    const Call& c = g.calls[size_t(r)];
    if (c.kind != c0.kind || c.count != c0.count || c.type != c0.type || c.root != c0.root || c.op != c0.op)
      return fail_group(g, ncclInvalidUsage,
                        std::string("ranks 0 and ") + std::to_string(r) + " met in different collectives (" +
                            kind_name(c0.kind) + " of " + std::to_string(c0.count) + " vs " + kind_name(c.kind) +
                            " of " + std::to_string(c.count) + ")");
  }
  const size_t es = type_size(c0.type);
  const bool reduce = c0.kind == Kind::AllReduce || c0.kind == Kind::ReduceScatter;
  if (es == 0 || (reduce && (c0.type != ncclFloat32 || c0.op != ncclSum)))
    return fail_group(g, ncclInvalidArgument, std::string(kind_name(c0.kind)) +
                                                  ": the emulator reduces F32 sums only and moves sized types");
  const size_t n = size_t(g.n), count = c0.count, bytes = count * es;
  // input and output sizes per rank
  const size_t in_bytes = c0.kind == Kind::ReduceScatter ? bytes * n : bytes;
  const size_t out_bytes = c0.kind == Kind::AllGather ? bytes * n : bytes;
  for (size_t r = 0; r < n; ++r) {
    const Call& c = g.calls[r];
    const bool reads = c0.kind != Kind::Broadcast || int(r) == c0.root;
    if ((reads && count && !on_device(c.send, in_bytes, g.devices[r])) ||
        (count && !on_device(c.recv, out_bytes, g.devices[r])))
      return fail_group(g, ncclInvalidArgument, std::string(kind_name(c0.kind)) + ": rank " + std::to_string(r) +
                                                    "'s buffers are not " + std::to_string(in_bytes) + " / " +
                                                    std::to_string(out_bytes) + " bytes of its device's memory");
  }
  // every output computed before any is written (in-place calls alias their inputs)
  std::vector<std::vector<unsigned char>> out(n, std::vector<unsigned char>(out_bytes));
  switch (c0.kind) {
    case Kind::AllReduce:
    case Kind::ReduceScatter: {
      for (size_t r = 0; r < n; ++r) {
        float* o = reinterpret_cast<float*>(out[r].data());
        const size_t base = c0.kind == Kind::ReduceScatter ? r * count : 0;
        for (size_t i = 0; i < count; ++i) {
          float s = 0.0f;
          for (size_t q = 0; q < n; ++q) s += static_cast<const float*>(g.calls[q].send)[base + i];
          o[i] = s;
        }
      }
      break;
    }
    case Kind::AllGather:
      for (size_t r = 0; r < n; ++r)
        for (size_t q = 0; q < n; ++q) std::memcpy(out[r].data() + q * bytes, g.calls[q].send, bytes);
      break;
    case Kind::Broadcast:
      for (size_t r = 0; r < n; ++r) std::memcpy(out[r].data(), g.calls[size_t(c0.root)].send, bytes);
      break;
  }
  for (size_t r = 0; r < n; ++r)
    if (out_bytes) std::memcpy(g.calls[r].recv, out[r].data(), out_bytes);
}

// Runs on the rank's stream: the rendezvous, then the collective (by the last to arrive).
void rendezvous(ncclComm* comm, const Call& call) {
  Group& g = *comm->group;
  std::unique_lock<std::mutex> lk(g.mu);
  if (g.aborted || g.failed != ncclSuccess) return;
  g.calls[size_t(comm->rank)] = call;
  const uint64_t round = g.done;
  if (++g.arrived == g.n) {
    perform(g);
    g.arrived = 0;
    ++g.done;
    g.cv.notify_all();
    return;
  }
  const auto limit = std::chrono::duration<double>(timeout_seconds());
  if (!g.cv.wait_for(lk, limit, [&] { return g.done != round || g.aborted || g.failed != ncclSuccess; })) {
    fail_group(g, ncclSystemError,
               std::string(kind_name(call.kind)) + " #" + std::to_string(round) + ": rank " +
                   std::to_string(comm->rank) + " waited " + std::to_string(int(timeout_seconds())) + " s for " +
                   std::to_string(g.n - g.arrived) + " other rank(s) that never reached it");
    g.cv.notify_all();
  }
}

ncclResult_t enqueue(ncclComm_t comm, const Call& call, cudaStream_t stream) {
  if (!comm || comm->aborted) return ncclInvalidArgument;
  if (call.count && (!call.recv || (!call.send && call.kind != Kind::Broadcast))) return ncclInvalidArgument;
  int dev = -1;
  if (cudaGetDevice(&dev) != cudaSuccess || dev != comm->device) {
    std::fprintf(stderr, "emu: NCCL: rank %d's collective called with device %d current, not its device %d\n",
                 comm->rank, dev, comm->device);
    return ncclInvalidUsage;
  }
  emu::enqueue_host(stream, [comm, call]() { rendezvous(comm, call); });
  return ncclSuccess;
}

}  // namespace

ncclResult_t GetVersion(int* v) {
  if (!v) return ncclInvalidArgument;
  *v = NCCL_VERSION_CODE;
  return ncclSuccess;
}

const char* GetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (emulated NCCL)";
    case ncclSystemError: return "unhandled system error (emulated NCCL: a rank never reached a collective)";
    case ncclInternalError: return "internal error (emulated NCCL)";
    case ncclInvalidArgument: return "invalid argument (emulated NCCL)";
    case ncclInvalidUsage: return "invalid usage (emulated NCCL: ranks met in different collectives)";
    case ncclRemoteError: return "remote process exited or there was a network error (emulated NCCL)";
    default: return "unknown result code (emulated NCCL)";
  }
}

ncclResult_t CommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
  if (!comms || ndev <= 0) return ncclInvalidArgument;
  int count = 0;
  cudaGetDeviceCount(&count);
  auto g = std::make_shared<Group>();
  g->n = ndev;
  g->calls.resize(size_t(ndev));
  for (int r = 0; r < ndev; ++r) {
    const int d = devlist ? devlist[r] : r;
    if (d < 0 || d >= count) return ncclInvalidArgument;
    for (int q = 0; q < r; ++q)
      if (g->devices[size_t(q)] == d) return ncclInvalidUsage;  // NCCL: duplicate GPU
    g->devices.push_back(d);
  }
  for (int r = 0; r < ndev; ++r) comms[r] = new ncclComm{g, r, g->devices[size_t(r)], false};
  return ncclSuccess;
}

ncclResult_t CommDestroy(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}

ncclResult_t CommAbort(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  {
    Group& g = *comm->group;
    std::lock_guard<std::mutex> lk(g.mu);
    g.aborted = true;  // releases every rank waiting in a collective
    g.cv.notify_all();
  }
  delete comm;
  return ncclSuccess;
}

ncclResult_t CommGetAsyncError(ncclComm_t comm, ncclResult_t* async) {
  if (!comm || !async) return ncclInvalidArgument;
  Group& g = *comm->group;
  std::lock_guard<std::mutex> lk(g.mu);
  *async = g.failed != ncclSuccess ? g.failed : g.aborted ? ncclRemoteError : ncclSuccess;
  return ncclSuccess;
}

ncclResult_t AllReduce(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op,
                       ncclComm_t comm, cudaStream_t stream) {
  return enqueue(comm, {Kind::AllReduce, send, recv, count, type, op, 0}, stream);
}

ncclResult_t AllGather(const void* send, void* recv, size_t count, ncclDataType_t type, ncclComm_t comm,
                       cudaStream_t stream) {
  return enqueue(comm, {Kind::AllGather, send, recv, count, type, ncclSum, 0}, stream);
}

ncclResult_t ReduceScatter(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
  return enqueue(comm, {Kind::ReduceScatter, send, recv, count, type, op, 0}, stream);
}

ncclResult_t Broadcast(const void* send, void* recv, size_t count, ncclDataType_t type, int root, ncclComm_t comm,
                       cudaStream_t stream) {
  if (!comm || root < 0 || root >= comm->group->n) return ncclInvalidArgument;
  return enqueue(comm, {Kind::Broadcast, send, recv, count, type, ncclSum, root}, stream);
}

}  // namespace emu::nccl
