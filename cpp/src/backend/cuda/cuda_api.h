// Internal: the functions the CUDA backend (cuda/*.cu) provides to the core. Only
// declared when the library is built with DFLASH2_WITH_CUDA; callers guard with #ifdef.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dflash2/ops.h"
#include "dflash2/tensor.h"

struct CUstream_st;  // the CUDA runtime's stream type: cudaStream_t is CUstream_st*

namespace dflash2::cuda {

namespace detail {
struct WeightView;  // weight_view.cuh
}

bool available(std::string* why);   // a device is usable now; else *why says why
int device_count();                 // 0 when no driver/device
void* device_malloc(size_t bytes, int device);   // throws OutOfMemory / Backend errors
void device_free(void* p, int device) noexcept;
// Copies `bytes` between host and device memory in any direction (synchronous).
void copy(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes);
void memset_zero(void* dst, int device, size_t bytes);
void synchronize(int device);
std::string toolkit_version();      // CUDART_VERSION at compile time, "13.0"
std::string runtime_info();         // driver/runtime versions and device names, or why none
// Page-locked host memory (cudaHostAlloc), so copies from / to it can be asynchronous.
void* host_alloc_pinned(size_t bytes);
void host_free_pinned(void* p) noexcept;
// Copies `bytes` from src to dst asynchronously on the current stream (current_stream());
// one side must be device memory of `device`, the other pinned host memory (or device).
void copy_async(void* dst, const void* src, size_t bytes, int device);
// Copies `bytes` from device memory of src_dev to device memory of dst_dev asynchronously,
// on the calling thread's current stream for dst_dev (cudaMemcpyPeerAsync: ordered after
// that stream's earlier work only; wait for the source's producer first, Event::stream_wait).
void copy_peer_async(void* dst, int dst_dev, const void* src, int src_dev, size_t bytes);
// Lets `device` read / write `peer`'s memory directly (cudaDeviceEnablePeerAccess: peer
// copies then go over NVLink / PCIe without staging through the host). Returns false, with
// nothing changed, where the pair cannot (copies still work, staged); already enabled: true.
// Never throws.
bool enable_peer_access(int device, int peer);
// A CUDA event (timing disabled) on `device`: record() on the current stream, wait() blocks
// the host until the work recorded before it has finished. Movable, not copyable.
class Event {
 public:
  Event() = default;
  // timing: an event elapsed_s() can measure (cudaEventDisableTiming is not set)
  explicit Event(int device, bool timing = false);
  ~Event();
  Event(Event&& o) noexcept : ev_(o.ev_), device_(o.device_), recorded_(o.recorded_) { o.ev_ = nullptr; }
  Event& operator=(Event&& o) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record();
  void wait();  // no-op if never recorded
  // The calling thread's current stream on `device` (which may be another device than the
  // event's) waits, on the GPU, for the work recorded before the event: no host wait.
  // No-op if never recorded.
  void stream_wait(int device) const;
  // Seconds between two recorded timing events of one device, both completed.
  static double elapsed_s(const Event& start, const Event& end);
 private:
  void* ev_ = nullptr;
  int device_ = 0;
  bool recorded_ = false;
};

// Free and total memory of `device` (cudaMemGetInfo).
void mem_info(int device, size_t* free_bytes, size_t* total_bytes);
// "sm_90" for an H100/H200: the device's compute capability.
std::string device_arch(int device);
// Throws Unsupported naming the device's architecture when this build has no SASS for it
// (the build's list is DFLASH2_CUDA_ARCHS: 90a for Hopper, 100a / 103a for Blackwell).
void check_arch(int device);

// op_timer.cpp: ops::set_op_timing's timer on the current stream (BackendTable::timer_begin /
// timer_end): nullptr while the stream is being captured.
void* op_timer_begin();
double op_timer_end(void* timer);

// The stream every CUDA op called from this thread launches its kernels and device-side
// copies on: nullptr (the legacy default stream) unless set. Thread-local, so each engine
// thread keeps its own (e.g. a non-default stream to capture a step as a CUDA graph). The
// stream must belong to the device of the tensors an op is called with. Ops never
// synchronize; a copy to the host (copy() below, Tensor::to) does.
CUstream_st* current_stream();
void set_current_stream(CUstream_st* stream);
// Sets this thread's stream for the lifetime of the scope and restores the previous one.
class StreamScope {
 public:
  explicit StreamScope(CUstream_st* stream) : prev_(current_stream()) { set_current_stream(stream); }
  ~StreamScope() { set_current_stream(prev_); }
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  CUstream_st* prev_;
};

// Streams and CUDA graphs (graph.cu). stream_create: a non-blocking stream of `device` (a
// capture on it leaves the legacy default stream usable by other threads); run work on it
// inside an OrderedStreamScope, which keeps it in order with the legacy stream. A capture records the work this thread issues
// on the stream (thread-local mode) without running it; graph_end_capture instantiates it,
// or returns nullptr with *why when the capture or the instantiation failed (the stream is
// usable again either way). With ops::pdl() on it first makes the graph's kernel -> kernel
// edges programmatic where the later kernel is this backend's (pdl.cuh), their count in
// *pdl_edges.
CUstream_st* stream_create(int device);
void stream_destroy(CUstream_st* s, int device) noexcept;
void graph_begin_capture(CUstream_st* s);
void* graph_end_capture(CUstream_st* s, std::string* why, int64_t* pdl_edges = nullptr);
// This thread's ops run on `s` (a stream of `device`; nullptr: no change) while the scope
// lives, and `s` stays in program order with the legacy default stream without blocking the
// host: on entry `s` waits (an event) for what the legacy stream has queued, on exit the
// legacy stream waits for what `s` has queued. Synchronous copies (copy(), Tensor::to /
// copy_from) run on the current stream, so inside the scope they are ordered on `s` too.
class OrderedStreamScope {
 public:
  OrderedStreamScope(CUstream_st* s, int device);
  ~OrderedStreamScope();
  OrderedStreamScope(const OrderedStreamScope&) = delete;
  OrderedStreamScope& operator=(const OrderedStreamScope&) = delete;

 private:
  CUstream_st* prev_;
  CUstream_st* stream_;
  int device_;
};
void graph_launch(void* exec, CUstream_st* s);
void graph_destroy(void* exec) noexcept;
// Bumped whenever a per-stream scratch buffer (scratch.cu) is (re)allocated: a graph
// captured before the bump may hold a freed scratch address and must be captured again.
uint64_t scratch_generation();

// Device-side index errors: gather_rows (and embedding) ids outside [0, N) and
// cache_write slots >= the cache's rows are device data, so the kernels cannot throw; they
// skip or zero the row (index_rows.cu) and add 1 per offending row to a per-device
// counter. Returns the count accumulated on `device` since the last reset (synchronizes
// the device; a diagnostic for tests and debug builds, not for the step loop).
uint64_t index_errors(int device, bool reset);

// ops (inputs already validated by ops.cpp: same device, shapes consistent, contiguous rows;
// each also checks what its kernel relies on, so direct callers get errors, not faults)
void rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out);
void rms_norm_many(const std::vector<const Tensor*>& xs, const std::vector<const Tensor*>& ws,
                   const std::vector<float>& eps, const std::vector<Tensor*>& outs, bool& done);
void layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, float eps, Tensor& out);
void rope(Tensor& x, const Tensor& positions, double theta, ops::RopeStyle style);
void rope_many(const std::vector<Tensor*>& xs, const Tensor& positions, double theta, ops::RopeStyle style,
               bool& done);
void silu_mul(const Tensor& gate, const Tensor& up, Tensor& out);
void softmax(const Tensor& x, Tensor& out, float scale);
void gather_rows(const Tensor& src, const Tensor& idx, Tensor& out);
void copy(const Tensor& src, Tensor& dst);
void add(const Tensor& a, const Tensor& b, Tensor& out);
void argmax(const Tensor& x, Tensor& out);
void check_finite(const Tensor& x, Tensor& flags);
void token_logprobs(const Tensor& x, const Tensor& ids, Tensor& lp, Tensor& lse);  // row_reduce.cu
void argmax_shard(const Tensor& x, int64_t first, Tensor& out);  // row_reduce.cu
void argmax_merge(const Tensor& pairs, Tensor& ids, Tensor& flags);
void topk_merge(const Tensor& vals, const Tensor& idx, int64_t shard_size, Tensor& values, Tensor& indices);
void accept_greedy(const Tensor& ids, const Tensor& row0, const Tensor& draft, const Tensor& draft_row,
                   const Tensor& draft_len, Tensor& accepted, Tensor& bonus);  // index_rows.cu
void resolve_tokens(Tensor& tokens, const Tensor& src);  // index_rows.cu
void apply_penalties(Tensor& logits, const Tensor& row0, const Tensor& draft, const Tensor& draft_row,
                     const Tensor& draft_len, const Tensor& seq, const Tensor& params, const Tensor& state,
                     const Tensor& bias);  // penalties.cu
void count_tokens(Tensor& state, const Tensor& rows, const Tensor& ids);  // penalties.cu
void mask_logits(Tensor& logits, const Tensor& rows, const Tensor& masks);  // penalties.cu
void next_after_accept(const Tensor& row0, const Tensor& draft_row, const Tensor& draft_len, const Tensor& accepted,
                       const Tensor& bonus, const Tensor& drafts, Tensor& next, Tensor& last);  // index_rows.cu
void cache_write(const Tensor& src, const Tensor& slots, Tensor& cache);
void cache_write_many(const std::vector<const Tensor*>& srcs, const Tensor& slots, const std::vector<Tensor*>& caches,
                      bool& done);
void dyn_conv(const Tensor& x, const Tensor& base, const Tensor& dyn, int64_t block, Tensor& out);

// gemm.cu
void linear(const Tensor& x, const ops::Weight& w, Tensor& y, bool accumulate);
void linear_many(const Tensor& x, const std::vector<const ops::Weight*>& ws, const std::vector<Tensor*>& ys,
                 bool& done);
// out = silu_mul(linear(x, gate), linear(x, up)) bitwise, in one launch (linear_many_kernel's
// gated pair); done = false (nothing queued) where it does not apply (over 256 rows, gate and
// up of different formats or with rows not vector-aligned, out overlapping x, an empty shape).
void linear_silu_mul(const Tensor& x, const ops::Weight& gate, const ops::Weight& up, Tensor& out, bool& done);
// gemm_tc.cu (built with CUTLASS only): ops::linear_bf16 on the tensor cores (decode: the
// skinny kernel of gemm_sk.cu), and whether this build has its kernels for `device`'s
// architecture.
void linear_bf16(const Tensor& x, const ops::Weight& w, Tensor& y, bool accumulate, bool decode);
bool linear_bf16_supported(int device);
// gemm_tc.cu (built with CUTLASS only): ops::gated_mlp with BF16 numerics for generated tokens
// as one unit on gemm_sk.cu's kernels (x rounded once, gate and up reduced straight into
// bf16(silu(gate) * up), down): bitwise linear_bf16(decode) x 3 and silu_mul. done = false
// (nothing queued) where it does not apply: the skinny kernels off, no kernels for this
// architecture, gate and up of different formats, an empty dimension.
void gated_mlp_decode(const Tensor& x, const ops::Weight& gate, const ops::Weight& up, const ops::Weight& down,
                      Tensor& out, bool accumulate, bool& done);
// gemm_tc.cu (built with CUTLASS only): linear_bf16(x, *ws[i], *ys[i], false, decode = true)
// for every i with x rounded to BF16 once; done = false (nothing queued) where the skinny
// kernels are off or this architecture has none.
void linear_bf16_decode_many(const Tensor& x, const std::vector<const ops::Weight*>& ws, const std::vector<Tensor*>& ys,
                             bool& done);
// gemm_tc.cu (built with CUTLASS only): ops::linear_fp8 (FP8 block-128 W8A8, sm_90a / sm_100a / sm_103a).
void linear_fp8(const Tensor& x, const ops::Weight& w, Tensor& y, bool accumulate);
bool linear_fp8_supported(int device);
// gemm_tc.cu (built with CUTLASS only): ops::linear_nvfp4 (NVFP4 W4A4, sm_100a / sm_103a).
void linear_nvfp4(const Tensor& x, const ops::Weight& w, Tensor& y, bool accumulate);
bool linear_nvfp4_supported(int device);
// ops::prepare_nvfp4_scales: w's per-16 scales in the block-scaled layout linear_nvfp4 and the
// grouped experts read (a new U8 device tensor; the stream is synchronized before returning).
Tensor nvfp4_blocked_scales(const ops::Weight& w);
// quant.cu
void fp8_quantize_act(const Tensor& x, Tensor& out);
void nvfp4_quantize_act(const Tensor& x, float input_scale, Tensor& out);
void linear_heads(const Tensor& x, const Tensor& w, Tensor& y);
// index_rows.cu
void embedding_shard(const Tensor& table, const Tensor& ids, int64_t first, Tensor& out);
// moe.cu
void moe_route(const Tensor& logits, const Tensor& bias, const ops::MoeRouting& r, Tensor& ids, Tensor& weights);
void moe_experts(const Tensor& x, const Tensor& ids, const Tensor& weights, const ops::ExpertWeights& experts,
                 Tensor& out, Tensor& workspace, bool accumulate = false);
// The same with the FP8 block-128 W8A8 numerics (prompt chunks): the CUTLASS grouped GEMM
// (sm_90a); whether it can run these experts on `device`.
void moe_experts_fp8(const Tensor& x, const Tensor& ids, const Tensor& weights, const ops::ExpertWeights& experts,
                     Tensor& out, Tensor& workspace, bool accumulate = false);
bool moe_experts_fp8_supported(int device, const ops::ExpertWeights& experts);
// The same with linear_bf16's numerics (any expert format): prompt chunks on the grouped
// mainloop-dequantizing GEMM of gemm_dq.cu, decode chunks (decode) on gemm_sk.cu's skinny
// grouped GEMM; whether `device` is a GPU this build runs on.
void moe_experts_bf16(const Tensor& x, const Tensor& ids, const Tensor& weights, const ops::ExpertWeights& experts,
                      Tensor& out, Tensor& workspace, bool decode, bool accumulate = false);
bool moe_experts_bf16_supported(int device);
// gemm_dq.cu: whether linear_bf16 runs NVFP4 weights on sm_90a through the mainloop-
// dequantizing kernel (default) or the dequantize pass + CUTLASS (after a failed load check).
bool linear_dq_enabled();
void set_linear_dq_enabled(bool on);
// gemm_sk.cu: whether linear_bf16(..., decode = true) takes the skinny kernel (the load-time
// check may turn it off in the process).
bool linear_sk_enabled();
void set_linear_sk_enabled(bool on);
// gemm_sk.cu: linear's exact form on the tensor cores (ops::exact_tc, gemm_sk.h's X3): whether
// it takes weight w now (the switch on, the skinny kernel enabled, a BF16 / FP8 / NVFP4
// weight), and ys[i] (+)= x W_i^T for n such weights of one K (checked by the caller as
// linear checks them), x split into its three BF16 planes once for all of them. Chosen by
// the switch and the weight's format only, never by M: a row's result does not depend on M.
bool exact_tc_takes(const detail::WeightView& w);
void linear_exact_tc(const Tensor& x, const detail::WeightView* vs, Tensor* const* ys, size_t n, bool accumulate);
// The same with linear_nvfp4's W4A4 numerics (NVFP4 experts with an input_scale): the
// CUTLASS grouped block-scaled GEMM (sm_100a / sm_103a); whether it runs these on `device`.
void moe_experts_nvfp4(const Tensor& x, const Tensor& ids, const Tensor& weights, const ops::ExpertWeights& experts,
                       Tensor& out, Tensor& workspace, bool accumulate = false);
bool moe_experts_nvfp4_supported(int device, const ops::ExpertWeights& experts);
// attention.cu
void indexer_topk(const Tensor& q, const Tensor& w, const Tensor& key_cache, const ops::PagedTokens& tok,
                  int64_t topk, Tensor& sel, Tensor& sel_len);
void indexer_scores(const Tensor& q, const Tensor& w, const Tensor& key_cache, const ops::PagedTokens& tok,
                    Tensor& scores);
void mla_attention(const Tensor& q_lat, const Tensor& q_pe, const Tensor& cache, const ops::PagedTokens& tok,
                   const Tensor& sel, const Tensor& sel_len, float scale, Tensor& out);
void block_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& kv_cache, const Tensor& ctx_len,
                     const Tensor& block_table, const ops::BlockAttention& p, Tensor& out);
// sampling.cu
void topk(const Tensor& x, int64_t k, Tensor& values, Tensor& indices);
void sample(const Tensor& logits, const ops::SamplingTensors& sp, const Tensor& rng, Tensor& out);
void accept(const Tensor& logits, const Tensor& row0, const Tensor& draft, const Tensor& draft_row,
            const Tensor& draft_len, const Tensor& cand, const Tensor& q, const ops::SamplingTensors& sp,
            const Tensor& rng, Tensor& accepted, Tensor& bonus);
// selector.cu
void selector_walk(const Tensor& vals, const Tensor& cand, const Tensor& g, const Tensor& pred_book,
                   const Tensor& succ_book, const Tensor& anchors, const Tensor& temperature, const Tensor& rng,
                   Tensor& tokens, Tensor& q);

}  // namespace dflash2::cuda
