// CUDA graphs of the target's forward chunks (issue "CUDA backend, part 2", first stage):
// a decode / verify chunk's device work is captured once per distinct launch shape and
// replayed afterwards, so a step's ~10 kernels per layer cost one graph launch on the host.
//
// What identifies a shape (the key, built by the caller): every value the forward's kernel
// launches depend on -- the chunk's sizes and the device addresses, shapes and strides of
// its plan buffers and outputs. The forward reads everything else from device memory
// (tokens, positions, block tables, slots: uploaded into the same device buffer before each
// chunk) or from state fixed at load (weights, caches, the chunk workspace), so a replay
// does exactly what an eager run with that key would do. The per-stream scratch is the one
// address that can move (it grows): a graph captured before it moved is captured again.
//
// Policy: the first chunk of a key runs eagerly (a warm-up: it sizes the scratch and builds
// lazily made device tables, which cannot happen inside a capture), the second is captured
// and launched, later ones replay. A capture that fails (an op that needs to allocate or
// synchronize, a driver refusal) runs the chunk eagerly instead, is logged once on stderr
// with the reason, and is retried once; a key that fails twice stays eager. Prompt
// chunks are never captured (their shapes rarely repeat); at most max_graphs keys are kept:
// when full, the least recently used key that was never captured (seen once, or failing)
// makes room for a new one, else the least recently used captured one (and its graph), so a
// stream of one-off shapes never evicts the step graphs captured at load.
// run() must be called inside a cuda::OrderedStreamScope on stream(), which orders the
// stream with the eager work on the legacy default stream.
//
// Status: compiled, NOT yet run on a GPU.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "dflash2/tensor.h"

struct CUstream_st;

namespace dflash2::runtime {

struct GraphStats {
  int64_t captured = 0, replayed = 0, eager = 0, failed = 0;
  int64_t pdl_edges = 0;  // programmatic kernel -> kernel edges in the graphs captured (ops::pdl())
  std::string last_failure;
  GraphStats& operator+=(const GraphStats& o) {  // the counts add up; a later failure's reason wins
    captured += o.captured;
    replayed += o.replayed;
    eager += o.eager;
    failed += o.failed;
    pdl_edges += o.pdl_edges;
    if (!o.last_failure.empty()) last_failure = o.last_failure;
    return *this;
  }
};

class ForwardGraphs {
 public:
  // stream: run on this stream (another ForwardGraphs' stream(), e.g. the drafter's graphs
  // on the target's stream, so the two stay in order); nullptr: a stream of its own.
  explicit ForwardGraphs(Device dev, CUstream_st* stream = nullptr, size_t max_graphs = 256);
  ~ForwardGraphs();
  ForwardGraphs(const ForwardGraphs&) = delete;
  ForwardGraphs& operator=(const ForwardGraphs&) = delete;

  // The stream the target's rank-0 work runs on (captures need a stream of their own).
  CUstream_st* stream() const { return stream_; }
  // Runs fn (the chunk's device work, issued on stream() by this thread) for `key`:
  // eagerly, or captured and launched, or replayed (see above).
  void run(const std::string& key, const std::function<void()>& fn);
  GraphStats stats() const;  // a snapshot (any thread)
  // Keeps at least n keys from now on (the load-time warm-up's, with room for the others);
  // before any other thread runs graphs.
  void reserve(size_t n) {
    if (n > max_graphs_) max_graphs_ = n;
  }

  // Key building: appends a tensor's identity for launches (address, dtype, shape, strides;
  // "-" when undefined) or an integer.
  static void key_add(std::string& key, const Tensor& t);
  static void key_add(std::string& key, int64_t v);

 private:
  struct Entry {
    void* exec = nullptr;
    uint64_t generation = 0;
    int failures = 0;
    uint64_t last_use = 0;  // tick of its last run (least recently used goes first)
  };
  uint64_t tick_ = 0;
  Device dev_;
  size_t max_graphs_;
  CUstream_st* stream_ = nullptr;
  bool own_stream_ = false;
  std::map<std::string, Entry> graphs_;
  mutable std::mutex stats_mu_;
  GraphStats stats_;
  bool logged_ = false;
  void count(int64_t GraphStats::*field, const std::string* failure = nullptr, int64_t by = 1);
};

// CUDA graphs of a chunk on every rank of a tensor-parallel group, under one decision per
// chunk: the NCCL collectives inside must be captured, replayed or run eagerly by all the
// ranks together, so one entry, keyed by rank 0's launch shape, holds every rank's graph,
// and ForwardGraphs' policy (warm-up, capture, replay, capture again after the scratch
// moved, eager after two failures, least recently used out) applies to all ranks at once.
// A capture is made on every rank and launched only if every rank's succeeded; otherwise
// every rank runs the chunk eagerly. The ranks' other inputs must follow from rank 0's key
// (their plans are uploaded in lockstep; their own buffers are fixed at load).
class GroupGraphs {
 public:
  // streams: rank r's graphs' stream (a stream of devs[r]); rank 0's may be shared (the
  // drafter's graphs run on it), the others are made here when null.
  GroupGraphs(std::vector<Device> devs, std::vector<CUstream_st*> streams, size_t max_graphs = 256);
  ~GroupGraphs();
  GroupGraphs(const GroupGraphs&) = delete;
  GroupGraphs& operator=(const GroupGraphs&) = delete;
  CUstream_st* stream(int r) const { return streams_[size_t(r)]; }
  // all(job) runs job(r) on every rank at once and returns when all have (rethrowing a
  // failure: Target::on_all_ranks); each job runs in an OrderedStreamScope on stream(r).
  // prep(r): rank r's eager work before its chunk (once per call, before its graph or its
  // eager run); fn(r): the chunk's device work (what a capture records). comm0: rank 0's
  // communicator: a replay adds the collectives its capture counted.
  using All = std::function<void(const std::function<void(int)>&)>;
  void run(const std::string& key, const All& all, const std::function<void(int)>& prep,
           const std::function<void(int)>& fn, comm::Communicator* comm0);
  GraphStats stats() const;
  void reserve(size_t n) {
    if (n > max_graphs_) max_graphs_ = n;
  }

 private:
  struct Entry {
    std::vector<void*> exec;  // one per rank, or empty
    uint64_t generation = 0;
    int failures = 0;
    uint64_t last_use = 0;
    comm::CommStats collectives;  // what rank 0's capture issued
  };
  std::vector<Device> devs_;
  std::vector<CUstream_st*> streams_;
  std::vector<bool> own_;
  size_t max_graphs_;
  uint64_t tick_ = 0;
  std::map<std::string, Entry> graphs_;
  mutable std::mutex stats_mu_;
  GraphStats stats_;
  bool logged_ = false;
  void drop(Entry& e);
  void count(int64_t GraphStats::*field, const std::string* failure = nullptr, int64_t by = 1);
};

// A decode step's device work as one unit (the whole step in one CUDA graph). While
// recording, the step's pieces -- the drafter's draft forward (or the MTP chain's chunks,
// argmaxes and copies), the verify chunk, the drafter's context append, the non-finite
// check, acceptance, the timing marks between them -- are queued with their launch keys
// instead of run; flush() runs them in order: as one CUDA graph keyed by all their keys
// (ForwardGraphs::run: warm-up, capture, replay) on the graphs' stream, or, with no graphs
// (the CPU), one after the other. A piece holds its arguments by value, and every plan a
// piece reads is uploaded before flush() into a device buffer nothing else writes before it
// (the drafter's block plan, its append plan, one buffer per recorded target chunk --
// Target::record_plan --, the acceptance rows), so what runs at flush() is what would have
// run at add(); eager work issued while recording (the drafter's pending commits) runs
// before the flushed pieces. Steps that would need a host wait within them (several verify
// chunks) are never recorded: the step runs as before.
//
// Tensor parallelism: a piece is rank 0's (add: the selector, the check, acceptance, the
// marks; a whole drafter's forward and context append) or every rank's (add_ranks: the
// verify chunk, the drafter's LM head on the vocabulary shards; a split drafter's forward
// and context append). flush_group() runs on every rank at once (one thread
// per rank) the pieces that rank takes part in, in order: with CUDA graphs as one
// GroupGraphs entry (every rank's step one graph, NCCL collectives inside, one decision for
// all ranks), else eagerly (the CPU). Nothing but collectives orders the ranks within the
// step, so a rank reads what rank 0 produced in the step only through one (the drafted ids
// and the head's input rows are broadcast inside the every-rank pieces).
class StepRecorder {
 public:
  void begin();                          // starts recording a step
  bool recording() const { return on_; }
  // Steps begun so far: who keeps per-step state (a recorded step's plan buffers) sees a
  // new step by a new value.
  int64_t begun() const { return begun_; }
  void add(const std::string& key, std::function<void()> fn);  // rank 0's piece
  // A piece every rank runs (fn(rank)); its key is rank 0's launch shape (the other ranks'
  // buffers are fixed at load).
  void add_ranks(const std::string& key, std::function<void(int)> fn);
  // Runs the queued pieces (graphs: as one graph on graphs->stream() in program order with
  // the legacy stream, device `device`; null: eagerly) and stops recording. On an error the
  // queue is dropped and recording stops, then the error propagates. One rank (an every-rank
  // piece runs as rank 0).
  void flush(ForwardGraphs* graphs, int device);
  // The same for a tensor-parallel group: all(job) runs job(r) on every rank at once
  // (Target::on_all_ranks); group: every rank's pieces as one GroupGraphs entry (null:
  // eagerly); comm0: rank 0's communicator (replays count their collectives).
  void flush_group(GroupGraphs* group, const GroupGraphs::All& all, comm::Communicator* comm0);
  void cancel();  // drops the queue and stops recording (a step that failed before its flush)
  int64_t steps() const { return steps_.load(); }  // steps flushed so far (any thread)

 private:
  struct Queued {
    bool every_rank = false;
    std::function<void(int)> fn;
  };
  bool on_ = false;
  int64_t begun_ = 0;
  std::string key_;
  std::vector<Queued> fns_;
  std::atomic<int64_t> steps_{0};
  std::vector<Queued> take();  // the queue, recording stopped
};

}  // namespace dflash2::runtime
