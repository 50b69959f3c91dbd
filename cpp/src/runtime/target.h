// The target on the runtime side: the GLM model, its KV caches (main + MTP, one
// KvCache module each) and a planner, run chunk by chunk (chunked prefill, verify). With
// tensor parallelism it holds one model shard per rank, each rank with its own caches (one
// set of block tables) and its own thread; a chunk is planned once and every rank runs it,
// meeting in the collectives.
#pragma once
#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"

#include "model/glm_model.h"
#include "runtime/kv_cache.h"
#include "runtime/step_graphs.h"
#include "runtime/step_plan.h"

namespace dflash2::runtime {

class Target {
 public:
  struct Options {
    int64_t max_seq_len = 4096;
    int64_t max_batch_size = 8;
    int64_t max_step_tokens = 256;
    int64_t kv_block_size = 16;
    // The element type of the MLA latent and indexer-key caches (main and MTP): F32, or BF16
    // (values rounded to nearest even as they are written, widened exactly as they are read:
    // half the memory and the attention's key bytes; every method reads the same cache, so
    // speculative == AR holds).
    DType kv_cache_dtype = DType::F32;
    int num_threads = 0;  // CPU threads of the whole target (0: all cores), shared by the ranks
    // Where the model runs: the CPU, or CUDA device d (rank r of tensor parallelism on
    // device d + r, ranks joined by NCCL). On CUDA the weights, caches and chunk workspace
    // live in device memory; the chunk's plan (I32 buffers) is copied up and the outputs
    // the caller asked for (logits, taps, final hidden states) are copied back to the
    // caller's host tensors after each chunk.
    Device device = Device::cpu();
    // CUDA: capture decode / verify chunks as CUDA graphs and replay them, on every rank
    // (runtime/step_graphs.h); false runs every chunk eagerly (the same kernels).
    bool cuda_graphs = true;
    // Steps recorded as one unit are padded to batch-size buckets (bucket(), pad_stream()).
    bool pad_to_buckets = false;
  };
  // models: one per rank (tensor parallelism: models[r] was loaded as rank r of size()).
  Target(std::vector<std::unique_ptr<model::GlmModel>> models, const Options& opt);
  ~Target();

  model::GlmModel& model() { return *models_[0]; }
  int tp_size() const { return int(models_.size()); }
  // Tensor parallelism: rank r's model shard and communicator (null at one rank); the group
  // graphs of every rank (CUDA graphs under tensor parallelism, else null); on_all_ranks (below)
  // is what a split drafter runs its every-rank work with.
  model::GlmModel& rank_model(int r) { return *models_[size_t(r)]; }
  comm::Communicator* comm(int r) { return comms_.empty() ? nullptr : comms_[size_t(r)].get(); }
  GroupGraphs* group_graphs() { return group_.get(); }
  // Runs job(rank) on every rank at once (rank 0 on the calling thread); rethrows the first
  // failure after all ranks have returned (every rank's communicator aborted then).
  void on_all_ranks(const std::function<void(int)>& job);
  // rank 0's collective counters (call with the model idle: rank 0 runs on the caller's thread)
  comm::CommStats comm_stats() const { return comms_.empty() ? comm::CommStats{} : comms_[0]->stats(); }
  const model::GlmConfig& config() const { return models_[0]->config(); }
  const Options& options() const { return opt_; }
  // Every rank's GlmModel::Options::prefill (before the first step).
  // GlmModel::set_prefill / set_decode on every rank, with one routed-experts numerics for
  // all of them: with expert parallelism each rank holds other experts, and a numerics some
  // rank's experts cannot take is kept off every rank (the ranks never mix numerics).
  void set_prefill(ops::GemmNumerics g, uint32_t experts_allowed = ~0u) {
    experts_allowed = common_experts(g, experts_allowed);
    for (auto& m : models_) m->set_prefill(g, experts_allowed);
  }
  void set_decode(ops::GemmNumerics g, uint32_t experts_allowed = ~0u) {
    experts_allowed = common_experts(g, experts_allowed);
    for (auto& m : models_) m->set_decode(g, experts_allowed);
  }
  // experts_allowed narrowed until every rank's GlmModel::experts_numerics(g, .) agrees.
  uint32_t common_experts(ops::GemmNumerics g, uint32_t experts_allowed) const;
  KvCache& cache() { return cache_; }
  // CUDA graph counters (all zero when graphs are off or not on CUDA); under tensor
  // parallelism one count per chunk for the whole group (GroupGraphs).
  GraphStats graph_stats() const;
  // The graph cache keeps at least n keys (ForwardGraphs::reserve); no-op without graphs.
  void reserve_graphs(size_t n) {
    if (graphs_) graphs_->reserve(n);
    if (group_) group_->reserve(n);
  }
  bool cuda_graphs() const { return graphs_ != nullptr; }
  // The stream rank 0's graphs run on (null without graphs): the device drafter's graphs
  // share it, so the target's and the drafter's chunks stay in order.
  CUstream_st* graph_stream() const { return graphs_ ? graphs_->stream() : nullptr; }
  KvCache& mtp_cache() { return mtp_cache_; }
  // The whole decode step as one unit (step_graphs.h StepRecorder): while recording,
  // run_chunk queues the chunk's forward instead of running it (the drafter's draft and the
  // decode loop's acceptance join it), and flush_step() runs the queue: one CUDA graph with
  // graphs on, else in order. Steps are recorded on the CPU, and on CUDA with graphs on;
  // under tensor parallelism every rank's part of the step is one graph of that rank
  // (StepRecorder::flush_group: one GroupGraphs entry).
  bool can_record_steps() const {
    return !opt_.device.is_cuda() || (tp_size() == 1 ? graphs_ != nullptr : group_ != nullptr);
  }
  StepRecorder& recorder() { return rec_; }
  void flush_step();
  // Batch-size buckets of recorded steps (Options::pad_to_buckets): the smallest bucket
  // holding S sequences -- 1, 2, 4, 8, 16, 32, then multiples of 32, at most max_batch_size.
  int64_t bucket(int64_t S) const;
  // The cache stream padding sequences write to: pinned blocks for max_step_tokens tokens
  // beyond the batch's, so padding never takes a request's cache. Several padding pieces of
  // one chunk share it (what they write is never read by a real sequence and their outputs
  // are dropped); the decode loop rolls it back to 0 after planning each padded chunk.
  CacheStream& pad_stream() { return pad_stream_; }
  // Padding sequences run so far (the decode loop counts them; any thread reads).
  void count_padding(int64_t n) { padding_rows_ += n; }
  int64_t padding_rows() const { return padding_rows_.load(); }
  // Decode steps whose verify pass gathered argmax pairs instead of logits (greedy, tensor
  // parallelism; the decode loop counts them; any thread reads).
  void count_argmax_step() { ++argmax_steps_; }
  int64_t argmax_steps() const { return argmax_steps_.load(); }

  // One chunk of at most max_step_tokens tokens through the decoder (pieces from
  // make_chunks); each piece's stream advances by its tokens. Logit rows (when
  // out.logits is defined and not all_logits) are the pieces that end their sequence.
  // token_src (I32, contiguous; on the host or on rank 0's device): the pieces' negative
  // token ids are references into it (ops::resolve_tokens), filled in where it lives --
  // on the device inside the chunk's graph, so a verify pass reads the drafts the drafter
  // left there without a copy back first.
  void run_chunk(const std::vector<Piece>& pieces, const model::ForwardOutputs& out,
                 const Tensor& token_src = Tensor());
  // The MTP layer over one chunk of pieces on MTP streams: tokens are the next tokens,
  // h_main F32 [T, H] the main model's final hidden states of the same positions; logits
  // [R, V] and hidden [R, H] (optional) for the pieces that end their sequence.
  // all_rows: logits (and hidden) for every row instead. token_src: as run_chunk's.
  // queue: while recording a step, queue the chunk in it (the MTP chain) instead of running
  // it now (the chain's commits, which come before the step). prep (queued chunks only):
  // runs on the chunk's plan (on its device) just before the forward -- ops that fill in
  // what the host could not plan (the tokens and logit rows of a step's committed rows);
  // prep.key names its launches for the step's graph key.
  struct ChunkPrep {
    std::string key;
    std::function<void(model::TokenBatch&)> fn;
  };
  void mtp_chunk(const std::vector<Piece>& pieces, const Tensor& h_main, Tensor& logits, Tensor& hidden,
                 bool all_rows = false, const Tensor& token_src = Tensor(), bool queue = false,
                 const ChunkPrep& prep = {});

  // Tensor parallelism: an LM head over rows without gathering its logits -- the DFlash
  // drafter's head over its block, on the target's vocabulary shards. rows F32 [R, H] (rank
  // 0's device, or the host with a CPU target) go through every rank's shard of the target's
  // LM head (ops::linear_as(g)); each rank reduces its logits to its top k (ops::topk; k = 0:
  // its argmax pair, ops::argmax_shard), the ranks all-gather those (N x R x 2k floats
  // instead of R x V), and rank 0 merges them (ops::topk_merge / ops::argmax_merge) into vals
  // F32 [R, k] and ids I32 [R, k] on its device (k = 0: ids I32 [R], vals unused): what
  // ops::topk / ops::argmax over the full head's logits give (argmax: for finite rows). On
  // CUDA the other ranks copy the rows peer to peer after an event on the calling thread's
  // stream (mark_rank0_inputs / from_rank0): no host wait. With CUDA graphs every rank's
  // part is one GroupGraphs entry (keyed by rank 0's launch shape), the copies before it.
  // In a recorded step (recorder()) it is queued as an every-rank piece instead: rank 0
  // broadcasts the rows (the collective orders the others after rank 0's draft forward,
  // inside the step's graphs), then each rank runs its part.
  // vocab_head_ok(k): whether the shards allow it (each shard holds >= max(k, 3) ids, the
  // ids are exact in F32); reserve_vocab_head allocates the buffers of up to `rows` rows on
  // every rank once (before the first call), and readies the heads for numerics g.
  bool vocab_head_ok(int64_t k) const;
  // rows_copies: the other ranks get buffers for copies of rank 0's rows (not needed when
  // every rank computes its own rows: a drafter split across the ranks).
  void reserve_vocab_head(int64_t rows, int64_t k, ops::GemmNumerics g, bool rows_copies = true);
  void vocab_head(const Tensor& rows, ops::GemmNumerics g, int64_t k, Tensor& vals, Tensor& ids);
  // vocab_head calls so far (any thread reads)
  int64_t vocab_head_calls() const { return vocab_head_calls_.load(); }
  // Rank r's part of vocab_head over its own copy of the rows x (a drafter split across the
  // ranks has them on every rank: nothing to copy from rank 0), rank 0 merging into vals /
  // ids; run it on every rank at once (it all-gathers), then count_vocab_head() once.
  void vocab_head_part(int r, const Tensor& x, ops::GemmNumerics g, int64_t k, const Tensor& vals, const Tensor& ids);
  void count_vocab_head() { ++vocab_head_calls_; }

 private:
  // CUDA: checks every rank's device (architecture, free memory for the weights, caches
  // and step buffers) before allocating anything, then copies the models' weights up.
  void place_on_devices(int64_t cache_bytes);  // per rank: every KvCache's bytes_for
  void run_chunk_device(const model::TokenBatch& b, const model::ForwardOutputs& out, const Tensor& token_src);
  // Queues a planned chunk's forward in rec_ (its plan uploaded now on a GPU).
  void record_chunk(const model::TokenBatch& b, const model::ForwardOutputs& out, const Tensor& token_src);
  // The same under tensor parallelism: every rank's forward as one every-rank piece, each
  // rank's plan in a buffer of its own; the drafts (token_src on rank 0) broadcast to the
  // other ranks inside the piece (into rec_src_), then each rank fills in its references.
  void record_chunk_ranks(const model::TokenBatch& b, const model::ForwardOutputs& out, const Tensor& token_src);
  // Rank r's outputs of a chunk on the CPU (ranks > 0: the gathered logits into scratch).
  model::ForwardOutputs cpu_rank_outputs(int r, const model::ForwardOutputs& out) const;
  void record_mtp_chunk(const model::TokenBatch& b, const Tensor& h_main, const Tensor& logits, const Tensor& hidden,
                        const Tensor& token_src, const ChunkPrep& prep);
  // The plan of a chunk queued in the step being recorded, in a buffer of its own until the
  // flush: on the CPU a copy of the planner's buffers; on CUDA uploaded now (on the graphs'
  // stream) into a buffer of its own, by role: the step's one verify chunk and its one chunk
  // after acceptance (the MTP layer over the committed rows) each into one of the planner's
  // largest size, the MTP chain's i-th chunk into rec_plans_[i] (one token per sequence), so
  // the addresses, and the graphs keyed on them, repeat. Both check the plan fits its role.
  // rank: whose copy (tensor parallelism: each rank's verify plan on its own device, uploaded
  // on its group stream; on the CPU each rank's own copy).
  enum class PlanRole { Verify, Chain, AfterAccept };
  model::TokenBatch record_plan(const model::TokenBatch& b, PlanRole role, int rank = 0);
  void mtp_chunk_device(const model::TokenBatch& b, const Tensor& h_main, Tensor& logits, Tensor& hidden,
                        const Tensor& token_src);
  // The same under tensor parallelism with graphs (group_): every rank's chunk as one
  // GroupGraphs entry keyed by rank 0's launch shape.
  void run_chunk_group(const model::TokenBatch& b, const model::ForwardOutputs& out, const Tensor& token_src);
  void mtp_chunk_group(const model::TokenBatch& b, const Tensor& h_main, Tensor& logits, Tensor& hidden,
                       const Tensor& token_src);
  // Rank r's forward outputs of a chunk (rank 0: the caller's tensors where they are on its
  // device, else its device buffers; the others: their logits scratch), and whether rank
  // 0's logits / taps / final hidden states are the caller's (no copy back).
  model::ForwardOutputs rank_outputs(int r, const model::TokenBatch& b, const model::ForwardOutputs& out);
  // Rank 0's device outputs back into the caller's host tensors (synchronous).
  void copy_back(const model::ForwardOutputs& out, const model::ForwardOutputs& o0);
  // The MTP layer's chunk on rank r (both CUDA paths): its input rows -- rank 0's copied
  // peer to peer (from0), rows already on its device in place, host rows through its device
  // buffer -- and its outputs: rank 0's the caller's where they are on its device, else device
  // buffers (mtp_copy_back: into the caller's, synchronous); the others' logits scratch.
  struct MtpOutputs {
    Tensor logits, hidden;
    bool logits_direct = false, hidden_direct = false;
  };
  Tensor mtp_input(int r, const Tensor& h_main, bool from0);
  MtpOutputs mtp_outputs(int r, const Tensor& logits, const Tensor& hidden);
  void mtp_copy_back(const MtpOutputs& o, Tensor& logits, Tensor& hidden);
  // Fills in b's token references into a host token_src; returns a device one (rank 0's:
  // filled in after the upload, by every rank from its copy, from_rank0), or an undefined tensor.
  Tensor resolve_host_refs(model::TokenBatch& b, const Tensor& token_src);
  // Tensor parallelism with inputs a device drafter left on rank 0's GPU (its drafts, the
  // MTP chain's ids and hidden states): mark_rank0_inputs() records an event on the calling
  // thread's stream of rank 0 (after their producers, before the chunk's ranks start);
  // from_rank0(r, src, bufs) gives rank r a copy of src (contiguous, on rank 0's device) in
  // bufs[r] on its own GPU: rank r's stream waits for that event, then copies peer to peer,
  // no host wait. Rank 0 reads src in place. The source is not overwritten before rank r's
  // copy has run: rank 0's next writes to it come after the chunk's first collective (the
  // vocabulary-sharded embedding's all-reduce), which rank r reaches only after the copy.
  void mark_rank0_inputs();
  Tensor from_rank0(int r, const Tensor& src, std::vector<Tensor>& bufs);
  // CUDA: the device copy of a host-planned chunk on rank r's device.
  model::TokenBatch upload(const model::TokenBatch& b, int r);
  // CUDA: a device buffer of rank r with at least `rows` x `cols` floats (grown on first use).
  Tensor device_rows(std::vector<Tensor>& bufs, int r, int64_t rows, int64_t cols);
  void worker(int rank);

  StepRecorder rec_;
  CacheStream pad_stream_;
  std::atomic<int64_t> padding_rows_{0};
  std::atomic<int64_t> argmax_steps_{0};
  std::atomic<int64_t> vocab_head_calls_{0};
  std::vector<std::unique_ptr<model::GlmModel>> models_;
  Options opt_;
  KvCache cache_, mtp_cache_;
  std::vector<model::GlmCache> views_, mtp_views_;  // per rank
  StepPlanner planner_;
  // tensor parallelism
  std::vector<std::unique_ptr<comm::Communicator>> comms_;
  std::vector<Tensor> scratch_logits_;  // ranks > 0: the gathered logits nobody reads
  // CUDA (per rank): the plan buffers' device copies and the forward's device outputs
  std::vector<std::unique_ptr<PlanUploader>> dplan_;  // per rank
  std::vector<Tensor> d_logits_, d_taps_, d_fin_, d_hmain_, d_hidden_;
  std::vector<Tensor> d_src_;     // ranks > 0: their copies of a token source on rank 0's device
  // vocab_head's buffers per rank: the rows' copy (ranks > 0 on CUDA), the shard's logits,
  // its packed top k / argmax pair, the gathered ones; rank 0's merged flags
  struct VocabHeadBufs {
    Tensor local, packed, gathered, flags;
  };
  std::vector<VocabHeadBufs> vh_;
  std::vector<Tensor> d_vrows_;
  int64_t vh_rows_ = 0, vh_k_ = -1;
  struct Rank0Event;              // CUDA, tensor parallelism: mark_rank0_inputs' event
  std::unique_ptr<Rank0Event> rank0_event_;
  std::unique_ptr<ForwardGraphs> graphs_;  // CUDA graphs of rank 0's chunks
  // tensor parallelism: every rank's decode / verify / MTP chunks under one decision
  std::unique_ptr<GroupGraphs> group_;
  std::vector<std::unique_ptr<PlanUploader>> rec_plans_;  // CUDA: a recorded step's MTP chunk plans
  std::vector<std::unique_ptr<PlanUploader>> rec_verify_;  // CUDA: a recorded step's verify plan, per rank
  std::unique_ptr<PlanUploader> rec_after_;                // CUDA: its after-acceptance plan
  std::vector<Tensor> rec_src_;  // ranks > 0: a recorded step's broadcast copy of the drafts (fixed)
  size_t rec_plans_used_ = 0;
  int64_t rec_step_ = -1;  // the recorder's step they were taken for
  int rank_threads_ = 0;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  const std::function<void(int)>* job_ = nullptr;
  int64_t job_seq_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::vector<std::exception_ptr> errors_;
};

}  // namespace dflash2::runtime
