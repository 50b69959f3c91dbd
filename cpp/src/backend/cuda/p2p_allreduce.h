// cuda/p2p_allreduce.h: all-reduces, all-gathers and broadcasts over peer memory for the
// collectives of tensor-parallel decode steps, small enough that NCCL's latency is most of
// their cost (one
// process drives every rank's GPU, so each rank's kernel reads the other ranks' buffers
// directly through peer access: NVLink on GB300 / H200).
//
// One kernel per call on each rank: every block copies its slice of x into this rank's
// publish buffer, raises its flag in every rank's flag array, waits until every rank's same
// block has raised its flag for this call, then (one-shot, up to 512 KiB) sums the slice over
// the ranks' buffers, or (two-shot, larger calls) sums its rank's part of the slice into its
// own buffer, raises a second flag, waits, and copies every rank's summed part (all-gathers
// and broadcasts copy the published slices after the first wait). Either way
// each element is summed in rank order 0, 1, ..., size-1 (the CPU communicator's order: every
// rank gets the same bits, and the same bits as the CPU communicator). A call number kept on the device (no
// host state per call: CUDA-graph safe) tells the flags of one call from the next, and two
// publish buffers alternate so a rank never overwrites a buffer a slower rank still reads.
// A rank that waits past the group's timeout, or a group aborted from the host, writes NaN
// into its output (the step's non-finite check then refuses it) and a sticky status that
// error() reports.
//
// One GPU per rank: on a real GPU, create() refuses ranks that share a device (their
// kernels spin for each other, and a thread that waits for the whole device, in cudaFree or
// a kernel's lazy first load, deadlocks them: seen on an H200). The CPU emulation runs
// ranks of one device as host threads, and its tests use that.
//
// Status: compiled for sm_90a / sm_100a / sm_103a, run in CI by the CPU emulation
// (cpp/emu, where a host rendezvous stands between the kernel's parts); on an H200 (one GPU)
// only its one-rank and refusal cases have run: the multi-rank cases need several GPUs.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace dflash2::cuda::p2p {

constexpr int kMaxRanks = 8;
constexpr int kMaxBlocks = 32;
constexpr int kThreads = 512;

struct GroupState;
size_t default_one_shot_max_bytes();

class Group {
 public:
  // devices[r]: rank r's GPU, distinct on a real GPU. Needs peer access between every pair
  // of devices; returns nullptr with *why otherwise (the caller keeps NCCL for every size).
  // max_bytes: the largest all-reduce this group takes (F32 bytes); timeout_s: how long a
  // rank's kernel waits for the others before giving up.
  static std::shared_ptr<Group> create(const std::vector<int>& devices, size_t max_bytes, double timeout_s,
                                       std::string* why, size_t one_shot_max_bytes = default_one_shot_max_bytes());
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  int size() const;
  size_t max_bytes() const;
  // Rank `rank`'s part of one all-reduce: x (F32 on devices[rank], n elements, 4 n <=
  // max_bytes) becomes the rank-order sum over the ranks' x, queued on this thread's current
  // stream. Every rank calls it, in the same order with the same n. Throws if the group
  // failed earlier (error()). With add_to (F32, n elements, on the same GPU): add_to[i] =
  // add_to[i] + sum[i] instead, x left as it was (the residual add after o_proj / the MLP
  // in the same pass, bitwise the all-reduce then the add). With x2 (F32, n elements): the
  // ranks' x + x2 are summed (bitwise adding x2 into x first; x unchanged).
  void all_reduce_sum(int rank, float* x, int64_t n, float* add_to = nullptr, const float* x2 = nullptr);
  // out[q * words, (q + 1) * words) = rank q's `in` (4-byte words, bits kept), every rank.
  void all_gather(int rank, const void* in, int64_t words, void* out);
  // x = root's x (4-byte words), every rank.
  void broadcast(int rank, void* x, int64_t words, int root);
  // "" while healthy, else why the group failed (a rank timed out; aborted). Sticky.
  std::string error() const;
  // Whether abort() was called (by any rank's communicator).
  bool aborted() const;
  // Releases every kernel waiting in the group (their outputs become NaN); the group stays
  // failed.
  void abort();
  // Runs each kind of call once on every rank (one host thread and stream per rank, waits
  // of at most `timeout_s`): a one-shot and a two-shot all-reduce, one added into a
  // residual, an all-gather and a broadcast, of values whose sums are exact, against the
  // expected results. "" when all match, else what differed (the group is then not to be
  // used: make_nccl_group keeps NCCL for everything).
  std::string self_check(double timeout_s = 10.0);

 private:
  Group() = default;
  void run(int rank, void* params);
  std::unique_ptr<GroupState> s_;
};

// The default size limit: $DFLASH2_P2P_ALLREDUCE_MAX_KB kilobytes (0 turns the path off),
// else 8 MiB (larger all-reduces go to NCCL, whose ring moves the same bytes as the two-shot
// form and whose latency no longer dominates).
size_t default_max_bytes();
// Calls up to $DFLASH2_P2P_ONE_SHOT_MAX_KB kilobytes (512 KiB) take the one-shot form, larger
// ones the two-shot form.
size_t default_one_shot_max_bytes();
// $DFLASH2_P2P_ALLREDUCE_TIMEOUT_S, else 60 s.
double default_timeout_s();

}  // namespace dflash2::cuda::p2p
