// The GLM-5.x target (`glm_moe_dsa`) on the op interface: MLA with a latent cache
// (absorbed form for every step: prefill, decode and verify round identically), the DSA
// indexer with IndexShare, MoE with group-limited sigmoid routing and a shared expert,
// dense layers, and the MTP layer. No backend code, no loops over tensor data and no
// allocation in a forward: every computation is an op, reading the planner's fixed
// buffers (TokenBatch) and the engine's caches, with intermediates in an Arena planned at
// load for the largest chunk.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "dflash2/arena.h"
#include "dflash2/ops.h"
#include "dflash2/safetensors.h"
#include "model/glm_config.h"
#include "comm/communicator.h"
#include "model/token_batch.h"

namespace dflash2::model {

// The target's cache layers (views into the engine's KV-cache module): per attention layer
// the MLA latent rows [c (kv_lora) | k_pe (rope)], and the indexer keys of layers that run
// an indexer (undefined for the others).
struct GlmCache {
  std::vector<Tensor> latent;  // per layer: F32 or BF16 (kv_cache_dtype) [rows, kv_lora + rope], or U8
                               // FP8 rows [rows, fp8_latent_row_bytes] (ops/kv_fp8.h)
  std::vector<Tensor> index;   // per layer: F32 [rows, index_head_dim] or undefined
};

// What a forward chunk writes (each output optional: undefined = not wanted).
struct ForwardOutputs {
  Tensor logits;                     // F32 [R, V]: logits of the rows in batch.logit_rows,
                                     // or of every row (R = T) if all_logits
  bool all_logits = false;
  std::vector<int64_t> tap_layers;   // decoder layers whose output hidden state is wanted
  Tensor taps;                       // F32 [T, n_taps * H]: tap j in columns [j H, (j+1) H)
  Tensor final_hidden;               // F32 [T, H]: after model.norm (the MTP layer's input)
  bool prompt = false;               // every row is a prompt token: the decoder layers'
                                     // projections take Options::prefill's GEMM
  bool exact = false;                // the comparison APIs (Engine::logits, Sequence): every
                                     // projection exact, whatever Options::prefill / decode
  // Greedy steps, instead of logits: each rank reduces its vocabulary shard of the same rows
  // to (max, id) pairs (ops::argmax_shard) and the ranks all-gather those (N x R x 2 floats
  // instead of R x V); where argmax is defined (rank 0) they are merged (ops::argmax_merge)
  // into argmax I32 [R] -- ops::argmax over the full rows -- and argmax_flags I32 [R] --
  // ops::check_finite over them. Every rank sets argmax_only. On one rank (a GPU) `logits`
  // must be given too: the projection's buffer (its contents are the logits afterwards).
  bool argmax_only = false;
  Tensor argmax, argmax_flags;
};

struct Layer;  // weights of one decoder layer (glm_model.cpp)
struct Bufs;   // the chunk workspace (glm_model.cpp)

class GlmModel {
 public:
  struct Options {
    int64_t max_step_tokens = 256;  // the largest chunk a forward takes
    int64_t tp_rank = 0, tp_size = 1;  // tensor parallelism: this model holds rank tp_rank's shard
    // routed experts: false = every expert's intermediate split across the ranks (balanced
    // whatever the routing); true = expert parallelism, rank r holds whole experts
    // [r E/n, (r+1) E/n)
    bool expert_parallel = false;
    // Prompt chunks (ForwardOutputs::prompt): the decoder layers' projections (MLA, indexer,
    // o_proj, dense / shared-expert MLPs) run as ops::linear_as(prefill): the tensor-core
    // numerics (BF16, or FP8 block-128 W8A8 for FP8 weights);
    // the router, the routed experts, the absorbed per-head products and the LM head stay
    // exact. Decode / verify rows always run ops::linear, so every generated token's
    // numerics are independent of this flag's batching (speculative == AR still holds).
    ops::GemmNumerics prefill = ops::GemmNumerics::Exact;
    // Decode / verify chunks (every other chunk but ForwardOutputs::exact ones): the same
    // choice for generated tokens (Engine decode_gemm). Every numerics computes a row
    // independently of the chunk around it (one tile shape, k in order), so AR decode and
    // a verify block run each token identically and speculative == AR holds in every mode.
    ops::GemmNumerics decode = ops::GemmNumerics::Exact;
  };

  static std::unique_ptr<GlmModel> load(const Checkpoint& ckpt, const Options& opt);
  ~GlmModel();

  const GlmConfig& config() const { return cfg_; }
  const Options& options() const { return opt_; }
  bool has_mtp() const { return mtp_ != nullptr; }
  bool mtp_has_indexer() const;
  // the full embedding and LM head (mmap'ed views; the drafter shares them)
  const Tensor& embed_tokens() const { return embed_; }
  const ops::Weight& lm_head() const { return lm_head_; }
  // The embedding / LM head the forward reads (on device() after to_device; without tensor
  // parallelism they are the full ones).
  const Tensor& forward_embed() const { return embed_local_; }
  const ops::Weight& forward_lm_head() const { return lm_head_local_; }
  // Tensor parallelism: the group's communicator for this rank (every rank's model runs the
  // same forward at once, in its own thread).
  void set_comm(comm::Communicator* c) { comm_ = c; }
  // Options::prefill, decided once the device is known (Engine prefill_gemm).
  // With FP8, the routed experts of prompt chunks take moe_experts' FP8 numerics too when
  // every MoE layer's experts can (ops::moe_experts_fp8_available on this device: FP8
  // experts, and on CUDA the grouped kernel); experts_fp8() says whether they do. With NVFP4
  // they take moe_experts' NVFP4 (W4A4) numerics when every MoE layer's experts can
  // (ops::moe_experts_nvfp4_available: NVFP4 experts with an input_scale; on CUDA the grouped
  // kernel, sm_100a / sm_103a). Otherwise, in every mode but Exact, they take moe_experts'
  // BF16 numerics (the grouped mainloop-dequantizing GEMM on CUDA: W4A16 for NVFP4 experts).
  // experts_prefill() is what the routed experts of prompt chunks run.
  // experts_allowed: bit n set = the experts may take numerics n (a failed load-time check
  // clears one); they fall back FP8 / NVFP4 -> BF16 -> Exact.
  void set_prefill(ops::GemmNumerics g, uint32_t experts_allowed = ~0u);
  bool experts_fp8() const { return experts_fp8_; }
  ops::GemmNumerics experts_prefill() const { return experts_prefill_; }
  // Options::decode, the same way (experts_decode(): what the routed experts of decode /
  // verify chunks run).
  void set_decode(ops::GemmNumerics g, uint32_t experts_allowed = ~0u);
  // (Both: once NVFP4 numerics are in effect on a GPU, every W4A4 weight gets its scales in
  // the tensor-core GEMMs' block-scaled layout, once: ops::prepare_nvfp4_scales.)
  ops::GemmNumerics experts_decode() const { return experts_decode_; }
  // The routed experts' numerics under projection numerics g (set_prefill's rule, over this
  // model's experts: with expert parallelism, this rank's).
  ops::GemmNumerics experts_numerics(ops::GemmNumerics g, uint32_t experts_allowed) const;
  // Whether any decoder-layer projection is stored as FP8 block-128 (an FP8 checkpoint:
  // what prefill_gemm="auto" takes W8A8 for).
  bool has_fp8_weights() const;
  // Whether any decoder-layer projection of the prompt path, or every routed expert of a
  // MoE layer, is NVFP4 with an input_scale (what prefill_gemm="nvfp4" runs W4A4).
  bool has_nvfp4_weights() const;

  // The device the forward runs on (the CPU until to_device).
  Device device() const { return device_; }
  // Bytes to_device(dev) allocates on the device: the weights the forward reads (each
  // stored tensor once, however many names share it) and the chunk workspace.
  size_t device_bytes() const;
  // Copies the weights the forward reads and the chunk workspace to `dev` (once, at load;
  // progress(done, total) in bytes after each tensor). The full embedding / LM head views
  // the drafter reads (embed_tokens(), lm_head()) stay in host memory.
  void to_device(Device dev, const std::function<void(size_t, size_t)>& progress = {});

  // One chunk (batch.T <= max_step_tokens) through the decoder: the new tokens' latents and
  // indexer keys are written into `cache` at batch.slots.
  void forward(const TokenBatch& batch, const GlmCache& cache, const ForwardOutputs& out);
  // The MTP layer over one chunk: batch.tokens are the tokens t+1, h_main F32 [T, H] the
  // main model's final (normed) hidden states at t; writes its cache. For the rows in
  // batch.logit_rows: logits F32 [R, V] and (if defined) hidden F32 [R, H], the layer's
  // output hidden state before shared_head.norm (what chained drafting feeds back).
  void mtp_forward(const TokenBatch& batch, const Tensor& h_main, const GlmCache& cache, Tensor& logits,
                   Tensor& hidden);
  // Tensor parallelism (runtime Target::vocab_head): rows F32 [R, H] through this rank's
  // vocabulary shard of the LM head (ops::linear_as(g)) into local F32 [R, Vl], reduced to
  // its top k into packed F32 [R, 2k] (values, then the ids' I32 bits: positions in the
  // shard) -- k = 0: its argmax pair (ops::argmax_shard) into packed F32 [R, 2] -- and
  // all-gathered into gathered F32 [N, R, 2k or 2]; where ids is defined (rank 0) merged into
  // vals F32 [R, k] / ids I32 [R, k] (ops::topk_merge), or ids / flags I32 [R]
  // (ops::argmax_merge). Every rank calls it with the same R, g and k.
  void vocab_head(const Tensor& rows, ops::GemmNumerics g, int64_t k, Tensor& local, Tensor& packed,
                  Tensor& gathered, Tensor& vals, Tensor& ids, Tensor& flags);
  // This rank's vocabulary shard of the LM head ready for numerics g (NVFP4 on a GPU: its
  // W4A4 scales in the tensor-core layout, once).
  void prepare_head(ops::GemmNumerics g);

 private:
  GlmModel() = default;
  // tc: the projections' GEMM numerics; ex: the routed experts' (moe_experts); decode: a
  // decode / verify chunk (linear_bf16's kernel of generated tokens)
  void layer_forward(const Layer& L, const Tensor& latent, const Tensor& index_keys, const TokenBatch& tb, Bufs& b,
                     Tensor& h, bool& have_sel, ops::GemmNumerics tc = ops::GemmNumerics::Exact,
                     ops::GemmNumerics ex = ops::GemmNumerics::Exact, bool decode = false);
  void embed(const Tensor& table, const TokenBatch& tb, Tensor& out);
  // h += the rank-order sum of part over the ranks: one pass where the communicator can (the
  // peer-memory all-reduce adds into h as it sums), else an all-reduce and the add
  void reduce_into(Tensor& part, Tensor& h);
  void project(const Tensor& rows, const ops::Weight& head, Bufs& b, Tensor& logits);
  // ForwardOutputs::argmax_only: this rank's (max, id) pairs gathered, merged into ids /
  // flags where those are defined. One rank: the logits go to `logits` (the step's buffer),
  // their pairs merged as one shard's.
  void project_argmax(const Tensor& rows, const ops::Weight& head, Bufs& b, const Tensor& ids, const Tensor& flags,
                      const Tensor& logits);
  // set_prefill / set_decode: ops::prepare_nvfp4_scales for every W4A4 weight once NVFP4
  // numerics are in effect on a GPU.
  void prepare_w4a4_scales();
  // Calls tensor(t) / weight(w) for every parameter the forward reads (not the views
  // derived from others: Attn::wuv).
  void for_each_param(const std::function<void(Tensor&)>& tensor, const std::function<void(ops::Weight&)>& weight);

  GlmConfig cfg_;
  Options opt_;
  bool experts_fp8_ = false;  // set_prefill
  ops::GemmNumerics experts_prefill_ = ops::GemmNumerics::Exact;  // set_prefill
  ops::GemmNumerics experts_decode_ = ops::GemmNumerics::Exact;   // set_decode
  Device device_ = Device::cpu();
  std::shared_ptr<Checkpoint> ckpt_;
  Tensor embed_;  // [V, H] (F32/BF16/F16 view into the checkpoint)
  ops::Weight lm_head_;
  Tensor embed_local_;           // this rank's vocabulary rows (all of them without TP)
  ops::Weight lm_head_local_;
  comm::Communicator* comm_ = nullptr;
  Tensor final_norm_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::unique_ptr<Layer> mtp_;
  Tensor mtp_enorm_, mtp_hnorm_, mtp_head_norm_, mtp_embed_;
  ops::Weight mtp_eh_proj_, mtp_head_;
  std::unique_ptr<Arena> ws_;
};

}  // namespace dflash2::model
