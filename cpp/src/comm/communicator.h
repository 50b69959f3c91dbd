// Tensor-parallel collectives behind one interface. Every rank of a group calls the same
// collective in the same order with tensors of the same shape; the call returns when the
// collective is complete on this rank. Backends: an in-process CPU communicator (ranks are
// threads of one process; a fixed reduction order, so results are deterministic and equal
// on every rank) and NCCL (one GPU per rank, loaded lazily).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dflash2/error.h"
#include "dflash2/tensor.h"

namespace dflash2::comm {

// Collectives issued by one rank since creation: calls and payload bytes per kind (the
// payload: the tensor reduced, the gathered output, the scattered input, the broadcast
// buffer). Read by the engine's tp_collectives() and by bench/tp_model.py.
struct CommStats {
  int64_t all_reduce_calls = 0, all_reduce_bytes = 0;
  int64_t all_reduce_p2p_calls = 0;  // of those, taken by the kernels over peer memory (p2p_allreduce.h)
  int64_t all_gather_calls = 0, all_gather_bytes = 0;
  int64_t all_gather_p2p_calls = 0;  // of those, over peer memory
  int64_t reduce_scatter_calls = 0, reduce_scatter_bytes = 0;
  int64_t broadcast_calls = 0, broadcast_bytes = 0;
  int64_t broadcast_p2p_calls = 0;  // of those, over peer memory
  int64_t barrier_calls = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  // Counters of this rank (updated by the calling rank's thread only).
  const CommStats& stats() const { return stats_; }
  // A CUDA graph's replay runs the collectives its capture issued without calling them
  // again: its owner adds what they counted at the capture (diff of two stats()).
  void count_replay(const CommStats& captured) {
    stats_.all_reduce_calls += captured.all_reduce_calls;
    stats_.all_reduce_bytes += captured.all_reduce_bytes;
    stats_.all_reduce_p2p_calls += captured.all_reduce_p2p_calls;
    stats_.all_gather_calls += captured.all_gather_calls;
    stats_.all_gather_bytes += captured.all_gather_bytes;
    stats_.all_gather_p2p_calls += captured.all_gather_p2p_calls;
    stats_.reduce_scatter_calls += captured.reduce_scatter_calls;
    stats_.reduce_scatter_bytes += captured.reduce_scatter_bytes;
    stats_.broadcast_calls += captured.broadcast_calls;
    stats_.broadcast_bytes += captured.broadcast_bytes;
    stats_.broadcast_p2p_calls += captured.broadcast_p2p_calls;
    stats_.barrier_calls += captured.barrier_calls;
  }
  static CommStats diff(const CommStats& after, const CommStats& before) {
    CommStats d;
    d.all_reduce_calls = after.all_reduce_calls - before.all_reduce_calls;
    d.all_reduce_bytes = after.all_reduce_bytes - before.all_reduce_bytes;
    d.all_reduce_p2p_calls = after.all_reduce_p2p_calls - before.all_reduce_p2p_calls;
    d.all_gather_calls = after.all_gather_calls - before.all_gather_calls;
    d.all_gather_bytes = after.all_gather_bytes - before.all_gather_bytes;
    d.all_gather_p2p_calls = after.all_gather_p2p_calls - before.all_gather_p2p_calls;
    d.reduce_scatter_calls = after.reduce_scatter_calls - before.reduce_scatter_calls;
    d.reduce_scatter_bytes = after.reduce_scatter_bytes - before.reduce_scatter_bytes;
    d.broadcast_calls = after.broadcast_calls - before.broadcast_calls;
    d.broadcast_bytes = after.broadcast_bytes - before.broadcast_bytes;
    d.broadcast_p2p_calls = after.broadcast_p2p_calls - before.broadcast_p2p_calls;
    d.barrier_calls = after.barrier_calls - before.barrier_calls;
    return d;
  }
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* backend() const = 0;
  // Whether collectives up to 8 MiB take the kernels over peer memory (all-reduce one-shot /
  // two-shot, all-gather, broadcast; backend/cuda/p2p_allreduce.h: an NCCL group whose GPUs
  // reach each other's memory); else why not.
  bool peer_all_reduce() const { return peer_why_.empty(); }
  const std::string& peer_all_reduce_why() const { return peer_why_; }
  void set_peer_all_reduce(const std::string& why_not) { peer_why_ = why_not; }
  // x (F32, contiguous) = sum over ranks of x, summed in rank order 0, 1, ..., size-1.
  virtual void all_reduce_sum(Tensor& x) = 0;
  // acc += the rank-order sum of x over the ranks (acc: F32, x's shape, contiguous) in one
  // pass, when this communicator can (x's contents afterwards unspecified): bitwise an
  // all_reduce_sum of x then acc + x. With x2 (x's shape, F32, contiguous): of x + x2, bitwise
  // x + x2 into x first. Returns false, doing nothing, where it cannot; the caller then does
  // those steps itself.
  virtual bool all_reduce_sum_add(Tensor& x, Tensor& acc, const Tensor* x2 = nullptr) { return false; }
  // out[r * n .. (r + 1) * n) = in of rank r, along dim 0 (in contiguous [n, ...], out [size n, ...]).
  virtual void all_gather(const Tensor& in, Tensor& out) = 0;
  // out (this rank's slice [n, ...] of the rank-order sum of in [size n, ...]).
  virtual void reduce_scatter_sum(const Tensor& in, Tensor& out) = 0;
  // x = root's x.
  virtual void broadcast(Tensor& x, int root) = 0;
  virtual void barrier() = 0;
  // A rank that fails between collectives calls abort: every rank waiting in (or later
  // entering) a collective of the group throws CollectiveAborted instead of waiting forever.
  // reset() (called once all ranks have left the failed step) makes the group usable again.
  virtual void abort() = 0;
  virtual void reset() = 0;

 protected:
  CommStats stats_;
  std::string peer_why_ = "not an NCCL group";
};

// Thrown on the other ranks of an aborted group (the failing rank's own error is the cause).
class CollectiveAborted : public Error {
 public:
  CollectiveAborted() : Error(ErrorKind::Internal, "collective aborted: another tensor-parallel rank failed") {}
};

// An in-process group of `size` ranks: the communicators of its ranks, to be used by one
// thread each. Fails clearly for size < 1.
std::vector<std::unique_ptr<Communicator>> make_cpu_group(int size);

// NCCL: one rank per device of `devices` (one process, one thread per rank), created
// together (ncclCommInitAll). libnccl.so.2 is loaded on first use ($DFLASH2_NCCL_LIBRARY,
// then the library found at build time, then the loader's search path). Collectives take
// device tensors on the rank's GPU and are ordered on the calling thread's current CUDA
// stream. Throws UnsupportedError in a build without NCCL, BackendError when the library
// or a GPU is missing, InvalidArgumentError for more ranks than GPUs.
std::vector<std::unique_ptr<Communicator>> make_nccl_group(const std::vector<int>& devices);
// Whether make_nccl_group can work here (NCCL loads and a CUDA device is usable); else why.
bool nccl_available(std::string* why);
// The loaded library's version ("2.27.7"), or "" when it cannot be loaded.
std::string nccl_version();

}  // namespace dflash2::comm
