// dflash2/engine.h: the public engine API for C++ programs.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dflash2/error.h"
#include "dflash2/tensor.h"

namespace dflash2 {

struct EngineConfig {
  std::string target;             // checkpoint directory or .safetensors file (with config.json)
  std::string draft;              // drafter checkpoint ("" = none)
  int64_t mtp_draft_tokens = 7;   // method "mtp": tokens drafted per step by the chained MTP layer
  std::string method;             // "ar" | "mtp" | "dflash" | "dflash2" (dflash* need a drafter);
                                  // "" = "ar" without a drafter, else from the drafter's architecture
                                  // (DFlash2DraftModel -> "dflash2", DFlashDraftModel -> "dflash")
  std::string device = "cpu";
  int64_t max_batch_size = 8;     // sequences decoded together
  int64_t max_seq_len = 0;        // prompt + generated tokens per sequence (0 = min(4096, the model's
                                  // max_position_embeddings))
  int64_t max_step_tokens = 256;  // tokens per forward chunk (longer prefills are chunked)
  int64_t prefill_tokens_per_step = -1;  // while requests are decoding, at most this many prompt
                                         // tokens of newly admitted requests run between two
                                         // decode steps (chunked prefill interleaved with decoding:
                                         // a long prompt stalls the running streams one chunk at a
                                         // time, not for its whole prefill); -1 = max_step_tokens,
                                         // 0 = no limit (every admitted prompt whole before the next
                                         // step). With no request decoding, prompts run whole.
  int64_t kv_block_size = 16;     // tokens per KV-cache page
  std::string kv_cache_dtype = "f32";  // the target's MLA latent and indexer-key caches (and the MTP
                                       // layer's): "f32", "bf16" (half the memory: values rounded to
                                       // nearest even when written, widened exactly when read) or "fp8"
                                       // (E4M3 with a power-of-two scale per 128 values, the latent's
                                       // rope in BF16: 656 bytes a token and layer for GLM-5.3's latent
                                       // against 1152 in BF16); every method reads the same cache, so
                                       // speculative == AR holds
  int num_threads = 0;            // CPU threads of this engine's ops (0 = all cores; at most
                                  // max(256, 4 x cores)); applied per engine, never process-wide
  int64_t tensor_parallel = 1;    // ranks the target is split across (CPU: threads of this process
                                  // with an in-process communicator); 1 = no tensor parallelism
  bool expert_parallel = false;   // with tensor_parallel > 1: routed experts whole per rank (expert
                                  // parallelism) instead of every expert's intermediate split
  std::string prefill_gemm = "auto";  // prompt tokens' projections: "exact" (ops::linear, fp32
                                      // activations), "bf16" (ops::linear_bf16: the tensor cores'
                                      // BF16 numerics; the CPU emulates it), "fp8" (FP8 block-128
                                      // checkpoints: ops::linear_fp8, W8A8, for the FP8 weights and
                                      // bf16 for the rest), "nvfp4" (NVFP4 checkpoints with an
                                      // input_scale: ops::linear_nvfp4, W4A4), "auto" = on a GPU
                                      // this build has the CUTLASS kernels for, "fp8" / "nvfp4" for
                                      // such a checkpoint (sm_90a / sm_100a) else "bf16", each after
                                      // a load-time check; else "exact".
                                      // Generated tokens take decode_gemm (see README).
  std::string decode_gemm = "exact";  // generated tokens' projections and routed experts (decode and
                                      // verify chunks), the same choices as prefill_gemm; "exact"
                                      // (the default) keeps them fp32 as on the CPU, a tensor-core
                                      // mode makes verify batches (block x concurrency rows)
                                      // tensor-core bound instead of SIMT bound. Every mode computes
                                      // a row independently of the batch around it, so speculative ==
                                      // AR holds in each; "auto" = on a GPU the tensor cores (as
                                      // prefill_gemm's "auto"), else "exact". Under "bf16" the
                                      // projections run the skinny split-K kernel of generated
                                      // tokens (ops::linear_bf16 decode = true: any weight format
                                      // read in place). Reads back as the numerics in effect.
  std::string experts_decode_gemm;  // set by the engine (an output): what the routed experts of
                                    // decode / verify chunks take under decode_gemm
  std::string experts_prefill_gemm;  // set by the engine (an output): the numerics the routed
                                     // experts of prompt chunks take under prefill_gemm ("exact",
                                     // "bf16", "fp8", "nvfp4"; "exact" without MoE layers)
  std::string draft_gemm = "auto";  // the DFlash drafter's projections and its LM head over the block:
                                    // "exact" (ops::linear), "bf16", "fp8" (a drafter with FP8
                                    // block-128 weights), "nvfp4" (NVFP4 weights with an
                                    // input_scale), as prefill_gemm; "auto" = on a GPU the drafter
                                    // runs on, "fp8" / "nvfp4" for such a drafter else "bf16",
                                    // each after the load-time check; else "exact". Drafts only
                                    // steer acceptance: every choice is lossless. Reads back as
                                    // the numerics in effect ("exact" for ar / mtp).
  bool cuda_graphs = true;  // CUDA: decode / verify chunks of the target captured as CUDA graphs
                           // and replayed (every rank under tensor parallelism); false: every
                           // chunk eagerly
  int pad_to_buckets = -1;  // a decode step run as one unit (one CUDA graph) is padded to the next
                            // batch-size bucket (1, 2, 4, 8, 16, 32, then multiples of 32, at most
                            // max_batch_size) with sequences whose output is dropped, so the graphs
                            // are one per bucket and draft length; -1 = on with CUDA graphs, 0 = off,
                            // 1 = on (also on the CPU, where it only costs: the padded plan's test)
  int capture_at_load = -1;  // run a few decode steps of dummy requests at every batch-size bucket
                             // while loading, greedy and sampled, so their step graphs are captured
                             // before the first request; -1 = on with CUDA graphs at
                             // tensor_parallel = 1, 0 = off (graphs
                             // are then captured on first use), 1 = on (also on the CPU: a test)
  bool prefix_caching = true;  // automatic prefix caching: the full KV-cache blocks of prompts that
                               // ran stay cached (least recently used evicted when needed), and a
                               // prompt starting with the same tokens takes them instead of running
                               // them again (GenerationStats::cached_tokens); outputs do not depend on it
  // (read back) whether the generated tokens' full blocks are kept too, so that a later prompt
  // that continues a conversation takes them: where a prompt's rows are bitwise what the
  // decode steps computed (prefill_gemm, decode_gemm, the experts' and the DFlash drafter's
  // draft_gemm all "exact"), else only prompt blocks are kept
  bool prefix_cache_generated = false;
  std::string speculation = "fixed";  // "fixed": every step drafts the full block; "adaptive": per
                                      // step the draft length (0..K) that maximises the measured
                                      // throughput of the running batch (see README)
};

// Structured output: restricts which tokens a request may generate (a JSON schema, a regular
// expression, a grammar...). The engine asks for token masks and reports what it commits; the
// grammar itself is the implementation's (the Python package implements one over llguidance:
// dflash2_rt.structured). Speculative methods stay lossless: every verify row's logits are
// masked for the state after the drafts before it (ops::mask_logits), before penalties' result
// is sampled from or accepted against, and a draft the grammar rejects is rejected there
// (its row's mask gives it probability 0). Called on the engine's scheduler thread only, one
// request's calls in order; an exception fails that request (the others go on).
class TokenConstraint {
 public:
  virtual ~TokenConstraint() = default;
  // The masks of the next positions into rows (each `words` 32-bit words: bit v % 32 of word
  // v / 32 set = token v allowed; words >= ceil(V / 32)): row 0 for the token after what was
  // committed so far, row j for the token after drafts[0 .. j) as well (n drafts, n + 1 rows
  // at most). Returns how many rows it filled, from row 0 (0 .. n + 1): rows not filled are not
  // masked (a row after a draft the grammar rejects is never read: that draft is rejected).
  // Must leave the constraint's state as it was (the drafts are not committed yet).
  virtual int64_t masks(const int32_t* drafts, int64_t n, uint32_t* rows, int64_t words) = 0;
  // Tokens the request committed (each allowed by the mask it was drawn under), in order, one
  // call per token: every token it generates, its last (a stop token, or the one that reached
  // max_new_tokens) too; after each, done() says whether the output is complete (then the
  // tokens after it in the same verify block are dropped, as autoregressive decoding ends
  // there).
  virtual void commit(const int32_t* tokens, int64_t n) = 0;
  // Optional: drafts that follow the constraint, for a greedy request whose drafter proposes
  // candidates (DFlash 2's selector: cand[j * C .. j * C + C) are position j's C candidates,
  // best first). `drafts` holds the drafter's n drafts; the constraint rewrites them (e.g.
  // position by position the drafter's draft where it allows it, else the best candidate it
  // allows after the drafts before it) and returns how many to verify (0 .. n), or -1 to keep
  // the drafter's. Drafts only steer acceptance: greedy output does not depend on them. Must
  // leave the constraint's state as it was.
  virtual int64_t steer(const int32_t* cand, int64_t n, int64_t C, int32_t* drafts) {
    (void)cand, (void)n, (void)C, (void)drafts;
    return -1;
  }
  // Whether the constraint is complete and allows no further token: the request then ends
  // (finish_reason "stop", also when its last token reached max_new_tokens) after the tokens
  // committed so far.
  virtual bool done() = 0;
};

struct SamplingParams {
  int64_t max_new_tokens = 16;
  float temperature = 0.0f;  // 0 = greedy
  float top_p = 1.0f;        // in (0, 1]
  int64_t top_k = 0;         // 0 = off
  int64_t seed = -1;         // < 0: nondeterministic; generate()'s request i uses a stream derived from
                             // (seed, i); submit() uses (seed, stream_index)
  int64_t stream_index = 0;  // see seed
  bool has_stop_tokens = false;        // false: the config's eos_token_id
  std::vector<int32_t> stop_token_ids;  // a stop token ends the request (and is its last token)
  // >= 0: every generated token comes with its log-probability under the target and the
  // `logprobs` most likely tokens' (at most kMaxLogprobs); -1: none (TokenLogprobs)
  int64_t logprobs = -1;
  // Repetition control, as OpenAI's API and vLLM define it, applied to the target's logits
  // before temperature / top-p / top-k (speculative methods stay lossless: each verify row
  // sees the drafts before it as generated; ops::apply_penalties):
  // presence_penalty / frequency_penalty in [-2, 2]: subtracted from the logit of every token
  // generated so far, once / once per occurrence; repetition_penalty in [0.01, 100] (1 = off): a logit of a token of the prompt or the output is divided by it when positive,
  // multiplied when not; logit_bias: (token id, bias in [-100, 100]) pairs added to those
  // logits first (a later pair for the same id wins); min_tokens <= max_new_tokens: the stop
  // tokens cannot be generated before this many tokens. Log-probabilities of such a request
  // are of the adjusted logits.
  float presence_penalty = 0.0f, frequency_penalty = 0.0f, repetition_penalty = 1.0f;
  std::vector<std::pair<int32_t, float>> logit_bias;
  int64_t min_tokens = 0;
  // Structured output (TokenConstraint above); null: none. One object per request: it is
  // stateful (the engine commits the request's tokens to it).
  std::shared_ptr<TokenConstraint> constraint;
  bool adjusts_logits() const {
    return presence_penalty != 0.0f || frequency_penalty != 0.0f || repetition_penalty != 1.0f ||
           !logit_bias.empty() || min_tokens > 0;
  }
};

// The most top tokens SamplingParams::logprobs may ask for (OpenAI's top_logprobs bound).
constexpr int64_t kMaxLogprobs = 20;

// One generated token's log-probabilities (SamplingParams::logprobs >= 0): under the target's
// distribution at its position -- the log-softmax of the target's logits there, before
// temperature, top-p and top-k (what vLLM returns by default) --, the token's own and the
// `logprobs` most likely tokens' (best first, ties to the lower id). Speculative methods give
// the same numbers as ar: the verify pass's rows are the target's rows.
struct TokenLogprobs {
  float logprob = 0.0f;
  std::vector<int32_t> top_ids;
  std::vector<float> top_logprobs;
};

struct GenerationStats {
  int64_t prompt_tokens = 0, generated_tokens = 0, steps = 0;
  double prefill_s = 0, decode_s = 0, tokens_per_second = 0;
  // speculative methods: committed tokens per verify step (bonus included; 1 for ar),
  // verify steps, the acceptance rate of each draft position, and where the time went.
  double acceptance_length = 1.0;
  int64_t verify_steps = 0;
  std::vector<double> accepted_per_position;
  // decode_s = draft_s + verify_s (the verify forward, the non-finite check, the drafter's
  // context append) + accept_s (acceptance: greedy compare or rejection sampling, bonus;
  // MTP: and its layer over the committed rows) +
  // prefill_wait_s (this request waiting while other requests' prompts ran: the scheduler
  // prefills new prompts between steps) + host_s (the rest: planning, scheduling, and on a
  // GPU the host work the device waits for). On a GPU the first three are device time
  // (CUDA events inside the step).
  double draft_s = 0, verify_s = 0, host_s = 0, prefill_wait_s = 0, accept_s = 0;
  // prefill_s runs from the request's first prompt chunk to its first token; prefill_rounds:
  // the scheduler rounds its prompt took (1: whole; more when prefill_tokens_per_step split it
  // between decode steps of other requests).
  int64_t prefill_rounds = 0;
  int64_t cached_tokens = 0;  // prompt tokens taken from the prefix cache (not run again)
};

// One greedy draft block after a prefill of some tokens (for debugging acceptance).
struct Proposal {
  int32_t anchor = 0;                          // the target's greedy next token
  std::vector<int32_t> tokens;                 // block_size - 1 drafted tokens
  std::vector<std::vector<int32_t>> candidates;  // per drafted position: the selector's top-k ids
};

// Called with (request index, newly committed tokens) as generation proceeds.
using TokenCallback = std::function<void(int64_t, const std::vector<int32_t>&)>;

using RequestId = int64_t;

struct GenerationResult {
  std::vector<int32_t> token_ids;  // generated tokens only
  std::string finish_reason;       // "stop" | "length" | "cancelled"
  GenerationStats stats;
  std::vector<TokenLogprobs> logprobs;  // one per token of token_ids with SamplingParams::logprobs >= 0
};

// What poll() throws for a request that failed: the failure's kind and message, and which
// request it was (the request is forgotten afterwards).
struct RequestError : Error {
  RequestError(ErrorKind k, const std::string& msg, RequestId i) : Error(k, msg), id(i) {}
  RequestId id;
};

// What poll() reports about one request.
struct RequestUpdate {
  RequestId id = 0;
  std::vector<int32_t> new_tokens;  // committed since the last poll
  bool finished = false;
  GenerationResult result;          // when finished: every token, the finish reason, stats
  std::vector<TokenLogprobs> new_logprobs;  // new_tokens' (SamplingParams::logprobs >= 0), else empty
};

// Engine-wide counters (for /metrics and dashboards).
struct EngineMetrics {
  int64_t queue_length = 0, running = 0, requests_total = 0, requests_finished = 0, requests_cancelled = 0;
  int64_t prefilling = 0;  // of the running requests, those whose prompts are partly run (interleaved
                           // with decode steps: prefill_tokens_per_step)
  int64_t generated_tokens_total = 0, steps_total = 0;
  double tokens_per_second = 0;   // committed tokens / s over the recent steps
  double acceptance_length = 0;   // committed tokens per sequence per step, recent mean
  double step_time_s = 0;         // recent mean
  double draft_len = 0;           // recent mean draft length (adaptive speculation)
  int64_t cache_pages_used = 0, cache_pages_total = 0;  // the target's KV-cache blocks (used: by requests)
  // automatic prefix caching (EngineConfig::prefix_caching): blocks it keeps (per cache; those
  // no request uses count as free above), prompt tokens admitted and of them taken from it,
  // entries evicted
  int64_t prefix_cache_pages = 0, prefix_cache_query_tokens = 0, prefix_cache_hit_tokens = 0;
  int64_t prefix_cache_evictions = 0;
  int64_t draft_cache_bytes = 0;  // the DFlash drafter's context cache (F32, or BF16 under draft_gemm)
  int64_t kv_cache_bytes = 0;     // the target's KV caches (latent + index keys, and the MTP layer's),
                                  // per tensor-parallel rank (kv_cache_dtype: F32, BF16 or FP8 rows)
  // CUDA graphs of the target's chunks: captured, replayed, run eagerly (warm-ups, prompt
  // chunks), failed captures (then run eagerly) and the last failure's reason
  int64_t cuda_graphs_captured = 0, cuda_graphs_replayed = 0, cuda_graphs_eager = 0, cuda_graphs_failed = 0;
  std::string cuda_graphs_last_failure;
  // programmatic kernel -> kernel edges in the graphs captured (ops::pdl(): programmatic
  // dependent launch; 0 with it off)
  int64_t cuda_graphs_pdl_edges = 0;
  // decode steps run as one unit (draft or MTP chain, verify, acceptance queued, then run
  // together: one CUDA graph with graphs on; in order on the CPU); the others ran piece by
  // piece (tensor parallelism, a verify pass over several chunks, CUDA without graphs)
  int64_t steps_as_one_unit = 0;
  // padding sequences run in those steps (pad_to_buckets): the work spent on fixed shapes
  int64_t padding_rows = 0;
  // of those steps, the ones whose drafter context append (the verified rows' K/V into the
  // DFlash drafter's cache) ran inside the step instead of before the next draft
  int64_t drafter_appends_in_step = 0;
  // decode steps under tensor parallelism whose requests were all greedy, so the verify pass
  // gathered each rank's (max, id) pairs instead of the logits (no R x V all-gather)
  int64_t argmax_gather_steps = 0;
  // DFlash drafts under tensor parallelism whose LM head ran on the target's vocabulary
  // shards (each rank's top k gathered and merged on rank 0; one all-gather each)
  int64_t draft_head_gathers = 0;
};

// Tensor-parallel collectives issued by rank 0 since the engine was loaded (every rank
// issues the same ones): calls and payload bytes. All zero at tensor_parallel = 1.
// Broadcasts: a decode step run as one unit sends rank 0's drafted ids (and the DFlash
// head's input rows) to the other ranks inside the step (README "Tensor parallelism").
struct TpCollectives {
  int64_t all_reduce_calls = 0, all_reduce_bytes = 0;
  // of the all-reduces, those taken by the kernels over peer memory (CUDA ranks whose GPUs
  // have peer access, up to 8 MiB each: one-shot to 512 KiB, then two-shot; the rest NCCL)
  int64_t all_reduce_peer_calls = 0;
  int64_t all_gather_calls = 0, all_gather_bytes = 0;
  int64_t broadcast_calls = 0, broadcast_bytes = 0;
  // of the all-gathers and broadcasts, those over peer memory (as the all-reduces above)
  int64_t all_gather_peer_calls = 0, broadcast_peer_calls = 0;
};

class Engine;

// A sequence and its caches, for step-level use (verification, rollback, debugging).
class Sequence {
 public:
  ~Sequence();
  Sequence(const Sequence&) = delete;
  Sequence& operator=(const Sequence&) = delete;
  int64_t length() const;
  // Appends tokens; returns logits F32 [n, V] and, for each id in hidden_layers, the hidden
  // state after that decoder layer F32 [n, H] (the drafter's context features).
  Tensor extend(const std::vector<int32_t>& tokens, const std::vector<int64_t>& hidden_layers,
                std::vector<Tensor>* hidden, Tensor* final_hidden = nullptr);
  void rollback(int64_t length);
  void release();  // frees its cache blocks (main and MTP); the sequence is empty afterwards
  int64_t mtp_length() const;
  // MTP layer: next_tokens (t+1) with the main model's final hidden states at t.
  Tensor mtp_extend(const std::vector<int32_t>& next_tokens, const Tensor& hidden_main);
  void mtp_rollback(int64_t length);

 private:
  friend class Engine;
  struct Impl;
  explicit Sequence(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class Engine {
 public:
  explicit Engine(const EngineConfig& cfg);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Every request below runs on the engine's scheduler thread: requests from any number of
  // threads join the running batch between steps and leave it when done (continuous
  // batching). generate() submits its prompts and waits for them (on_tokens is called on
  // the calling thread as tokens are committed).
  std::vector<GenerationResult> generate(const std::vector<std::vector<int32_t>>& prompts, const SamplingParams& p,
                                        const TokenCallback& on_tokens = nullptr);
  // Queues one request (validated now: a bad request throws here) and returns its id.
  RequestId submit(const std::vector<int32_t>& prompt, const SamplingParams& p);
  // Waits up to timeout_s (< 0: until there is news) for news on any of `ids`; returns one
  // update per id with news (new tokens or finished). A finished request is reported once,
  // then forgotten. A request that failed rethrows its error here. Unknown ids are an error.
  std::vector<RequestUpdate> poll(const std::vector<RequestId>& ids, double timeout_s);
  // Ends a request within one step (finish reason "cancelled") and frees its cache pages;
  // its record is dropped once it has ended (no poll needed). Unknown or ended ids: no-op.
  void cancel(RequestId id);
  // Cancels every request, stops the scheduler thread; later requests raise. Idempotent
  // (the destructor calls it).
  void close();
  EngineMetrics metrics() const;
  TpCollectives tp_collectives() const;
  Proposal propose(const std::vector<int32_t>& tokens);
  int64_t block_size() const;  // tokens verified per step (1 for ar)
  const std::string& method() const;
  // Teacher-forced logits F32 [n, V] of a prompt through the real prefill path.
  Tensor logits(const std::vector<int32_t>& tokens);
  // The log-probabilities of a prompt's tokens under the target (scoring; exact numerics, the
  // prefill path): entry j is token j + 1's after tokens [0, j], with the `top` (0..20) most
  // likely tokens' there; tokens.size() - 1 entries. Computed where the logits are (on a GPU
  // only these numbers come back, not the logits).
  std::vector<TokenLogprobs> prompt_logprobs(const std::vector<int32_t>& tokens, int64_t top = 0);
  std::unique_ptr<Sequence> new_sequence();

  int64_t vocab_size() const;
  int64_t hidden_size() const;
  int64_t num_layers() const;
  bool has_mtp() const;
  const EngineConfig& config() const;
  std::string model_config_json() const;  // the target's config.json as loaded
  // Where the drafter (DFlash, or MTP's chain) runs: "cpu", or "cuda:N" (the target's GPU,
  // rank 0's with tensor parallelism); "" for method ar.
  std::string draft_device() const;
  // The ranks the drafter runs on: tensor_parallel when the DFlash drafter is split across
  // them (each rank its share of heads and MLP), else 1; 0 for method ar.
  int draft_ranks() const;


  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace dflash2
