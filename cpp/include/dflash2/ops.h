// dflash2/ops.h: the op interface. The model code is written once against these
// functions; each dispatches on the device of its tensors to a backend (cpu/, cuda/).
// Conventions: activations are F32 on the CPU backend (the CUDA backend will also take
// BF16); weights may be F32/BF16/F16 or quantized (see Weight). Accumulation is fp32.
// Every op writes into caller-provided outputs (no allocation inside an op, so the decode
// step can run from an Arena and be captured as a CUDA graph). Reduction order inside a
// row never depends on the number of rows M or on threading: the row computed in a batch
// of M is bitwise equal to the same row computed alone (decode == verify).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "dflash2/tensor.h"

namespace dflash2 {
class Checkpoint;

namespace ops {

enum class WeightFormat : uint8_t {
  Dense,        // data F32/BF16/F16 [N, K]
  FP8Block128,  // data F8_E4M3 [N, K], scale F32 [ceil(N/128), ceil(K/128)] (weight_scale_inv)
  NVFP4,        // data U8 [N, K/2] (low nibble = even k), scale F8_E4M3 [N, K/16],
                // global_scale = weight_scale_2, input_scale kept for W4A4 backends
};
const char* weight_format_name(WeightFormat f);

// A linear layer's weight, y = x W^T with W logically [out_features, in_features].
struct Weight {
  WeightFormat format = WeightFormat::Dense;
  Tensor data;
  Tensor scale;
  float global_scale = 1.0f;
  float input_scale = 0.0f;
  int64_t out_features = 0, in_features = 0;
  std::string name;  // checkpoint name (for messages)
  // NVFP4 on a GPU, optional: `scale` already in the W4A4 tensor-core GEMMs' block-scaled
  // layout (U8, CUTLASS's 128-row x 4-scale atoms, rows padded to 128, scale columns to 4,
  // the padding 0), made once by prepare_nvfp4_scales so that linear_nvfp4 and the NVFP4
  // grouped experts read it instead of swizzling `scale` on every call. rows() / cols() /
  // to() drop it (prepare the result again).
  Tensor sf_blocked;

  static Weight dense(Tensor w, std::string name = "");
  static Weight fp8_block128(Tensor w, Tensor scale_inv, std::string name = "");
  static Weight nvfp4(Tensor packed, Tensor block_scale, float global_scale, float input_scale,
                      int64_t in_features, std::string name = "");
  // Reads `<prefix>.weight` (+ `.weight_scale_inv` | `.weight_scale` + `.weight_scale_2`
  // [+ `.input_scale`]) from a checkpoint, detects the format from what is stored, and
  // validates every shape and dtype (Checkpoint error naming the tensor otherwise). If
  // expected_out/expected_in are > 0 the logical shape must match them.
  static Weight load(const Checkpoint& ckpt, const std::string& prefix, int64_t expected_out = -1,
                     int64_t expected_in = -1);
  void validate() const;  // consistency of data/scale shapes and dtypes
  // Views of output rows [begin, end) / input columns [begin, end) (tensor parallelism);
  // a slice that splits a quantization block (128 for FP8, 16 inputs for NVFP4) is a Config error.
  Weight rows(int64_t begin, int64_t end) const;
  Weight cols(int64_t begin, int64_t end) const;
  Tensor dequantize() const;  // F32 [N, K] on the CPU (reference path, tests, tools)
  // The same weight with data and scales copied (contiguous) to `dev` (e.g. to the GPU at
  // load); bytes() is what that copy holds.
  Weight to(Device dev) const;
  size_t bytes() const;
};

// The CPU backend's thread count for ops called from this thread while the scope lives
// (n <= 0: unchanged). An engine wraps its work in one, so each engine keeps its own
// num_threads and nothing is set process-wide.
class CpuThreadScope {
 public:
  explicit CpuThreadScope(int n);
  ~CpuThreadScope();
  CpuThreadScope(const CpuThreadScope&) = delete;
  CpuThreadScope& operator=(const CpuThreadScope&) = delete;

 private:
  int prev_;
};
// The number of cores the CPU backend sees, and the largest thread count it accepts
// (max(256, 4 x cores): beyond that a request is an error, not thousands of threads).
int cpu_cores();
int cpu_max_threads();

// y[M, N] (F32) = x[M, K] (F32) @ W^T; if accumulate, y += x @ W^T.
void linear(const Tensor& x, const Weight& w, Tensor& y, bool accumulate = false);

// The tensor-core GEMM's numerics, used for prompt tokens (Engine prefill_gemm="bf16"):
//   y = bf16(x) @ bf16(W)^T   (+ y when accumulating), fp32 accumulation,
// where bf16() rounds to nearest even and W is first dequantized exactly as linear reads it
// (F32 / F16 / FP8 block-128 / NVFP4 -> f32 -> bf16; BF16 weights as stored, exact). The CPU
// backend emulates it (the rounded operands through its own fp32 GEMM: the oracle of the
// CUDA path, which runs CUTLASS wgmma on sm_90a and tcgen05 on sm_100a / sm_103a, and for
// NVFP4 weights on sm_90a a BF16 mma.sync kernel dequantizing them in its main loop). As with
// linear, a row's result never depends on the other rows or on M. Shapes as linear.
// decode = true picks the kernel for the few rows of generated tokens (decode and verify
// chunks, small draft batches): on CUDA the skinny GEMM (gemm_sk.cu: the weight as the MMA's
// A operand, K split over CTAs as N and K say, never M), the same numerics and the same
// oracle; the CPU has one kernel for both. A row's result is the same for every M under
// either value, but may differ between them (different summation orders): a caller keeps
// one value per kind of chunk (the engine: prompt chunks false, decode / verify chunks true).
void linear_bf16(const Tensor& x, const Weight& w, Tensor& y, bool accumulate = false, bool decode = false);
// Whether linear_bf16 runs on `dev` in this build (the CPU always; a GPU when a CUTLASS
// kernel for its architecture was built).
bool linear_bf16_available(Device dev);

// FP8 block-128 W8A8: the GEMM that FP8 checkpoints (GLM-5-FP8 / DeepSeek-V3 layout) are
// made for, used for prompt tokens (Engine prefill_gemm="fp8"). w must be FP8Block128 (E4M3
// codes, one F32 scale per 128 x 128 block). Each row of x is quantized per block of 128
// inputs (fp8_quantize_act below: scale sa = amax / 448, codes e4m3(x / sa)), then
//   y[m, n] = sum over k-blocks b, in order, of  P_b * (sa[m, b] * sw[n / 128, b])
// where P_b is the dot product of the E4M3 codes over block b (exact products, fp32 sums),
// each block's term added to the fp32 accumulator with one fused multiply-add (+ y once at
// the end when accumulating). The CPU backend emulates this (the oracle); the CUDA path runs
// CUTLASS's blockwise-scaled wgmma kernel on sm_90a, whose FP8 tensor-core sums inside a
// block round differently, so the two agree to a normalized error, not bitwise. A row's
// result never depends on M or the other rows. Shapes as linear.
void linear_fp8(const Tensor& x, const Weight& w, Tensor& y, bool accumulate = false);
// Whether linear_fp8 runs on `dev` in this build (the CPU always; a GPU when the CUTLASS
// kernel for its architecture was built: sm_90a, sm_100a / sm_103a).
bool linear_fp8_available(Device dev);
// The activation side of linear_fp8, dequantized: per row of x F32 [M, K], per block of 128
// inputs (the last block may be shorter), with amax the block's largest |x| (fp32):
//   sa = amax / 448;  q_i = e4m3(x_i / sa)  (round to nearest even, saturating at 448);
//   out_i = q_i * sa                        (amax = 0: the block is zeros)
// out F32 [M, K] (may be x). A non-finite input makes its block NaN.
void fp8_quantize_act(const Tensor& x, Tensor& out);

// NVFP4 W4A4: the Blackwell GEMM that NVFP4 (ModelOpt) checkpoints are made for, used for
// prompt tokens (Engine prefill_gemm="nvfp4"). w must be NVFP4 with input_scale > 0 (the
// checkpoint's per-tensor activation scale). x is quantized as nvfp4_quantize_act(x,
// w.input_scale) does, then multiplied by the weight:
//   y = nvfp4_quantize_act(x, input_scale) @ W^T   (W dequantized as linear reads it)
// which is how the CPU backend computes it (the oracle). The CUDA path runs CUTLASS's
// block-scaled tcgen05 kernel on sm_100a / sm_103a: sum_k (q_x sf_x)(q_w sf_w) in fp32 times
// alpha = input_scale x weight_scale_2, so the two agree to fp32 rounding, not bitwise. A
// row's result never depends on M or the other rows. Shapes as linear.
void linear_nvfp4(const Tensor& x, const Weight& w, Tensor& y, bool accumulate = false);
// Whether linear_nvfp4 takes w: NVFP4 with a normal, finite input_scale (1 / input_scale finite).
bool takes_w4a4(const Weight& w);
// Whether linear_nvfp4 runs on `dev` in this build (the CPU always; a GPU when the CUTLASS
// kernel for its architecture was built: sm_100a / sm_103a).
bool linear_nvfp4_available(Device dev);
// Sets w.sf_blocked when w takes W4A4 (takes_w4a4) and lives on a GPU whose linear_nvfp4
// reads that layout (the CUTLASS kernels of sm_100a / sm_103a), from w.scale, on the device,
// and waits for it; returns whether w has them now (false on the CPU, on Hopper, for other
// formats; true without work when w already has them).
// The engine calls it at load for every W4A4 weight once NVFP4 numerics are chosen; the
// bytes it adds are 1 / 8 of the weight's codes.
bool prepare_nvfp4_scales(Weight& w);

// The GEMM numerics of prompt tokens (GlmModel::Options::prefill, Engine prefill_gemm).
enum class GemmNumerics : uint8_t {
  Exact,  // linear
  BF16,   // linear_bf16
  FP8,    // linear_fp8 for FP8Block128 weights, linear_bf16 for every other weight
  NVFP4,  // linear_nvfp4 for NVFP4 weights with an input_scale, linear_bf16 for the others
};
const char* gemm_numerics_name(GemmNumerics g);  // "exact", "bf16", "fp8", "nvfp4"
// linear / linear_bf16 / linear_fp8 / linear_nvfp4 as `g` says for this weight; `decode` is
// linear_bf16's (the other GEMMs have one kernel for every M).
void linear_as(GemmNumerics g, const Tensor& x, const Weight& w, Tensor& y, bool accumulate = false,
               bool decode = false);
// ys[i] = linear_as(g, x, *ws[i], *ys[i], false, decode) for every i: several projections of
// one x (GLM-5.3's q_a / kv_a / indexer wk / weights_proj of the normed hidden state), the same
// results; a backend may share work between them (CUDA, decode chunks under linear_bf16: x
// rounded to BF16 once for all of them instead of once per projection).
void linear_as_many(GemmNumerics g, const Tensor& x, const std::vector<const Weight*>& ws,
                    const std::vector<Tensor*>& ys, bool decode = false);

// NVFP4 activation quantization as a Blackwell W4A4 GEMM applies it (the CPU emulation that
// gives the NVFP4 tensor-core path its reference: W4A4 = linear(nvfp4_quantize_act(x), w)).
// Per row of x F32 [M, K] (K % 16 == 0), per block of 16 inputs, with g = 1 / input_scale
// (input_scale > 0, finite: the checkpoint's per-tensor activation scale) and amax the
// block's largest |x| (fp32 throughout):
//   sf  = e4m3(g * (amax * (1/6)))          round to nearest even, saturating at 448
//   q_i = e2m1(x_i * (1 / (float(sf) / g)))  round to nearest even, saturating at 6
//   out_i = q_i * float(sf) * input_scale   (sf = 0: the block is zeros)
// out F32 [M, K] (may be x). A non-finite x is an error at the GEMM's input, so it is
// passed through as NaN here (check_finite catches it downstream).
void nvfp4_quantize_act(const Tensor& x, float input_scale, Tensor& out);

// Per-op timing, for finding where a step's time goes. While on (process-wide), every op
// dispatched to a backend adds one call and its time to (op, device type): on the CPU the
// host's clock around the call; on a CUDA device the device time between two events recorded
// around it on the current stream, the op then waiting for its end event (so the run is
// slower and every op's time is its own kernels', not its launch's). An op called from
// inside another op counts in the outermost only; ops issued while their stream is being
// captured into a CUDA graph are not timed (they run at replay, where nothing dispatches: an
// engine's steps are timed with cuda_graphs=False). Starts off unless the environment has
// DFLASH2_OP_TIMING=1.
struct OpTime {
  std::string op;      // the op's name (ops.h)
  std::string device;  // "cpu" or "cuda"
  int64_t calls = 0;
  double seconds = 0.0;
};
bool op_timing();
void set_op_timing(bool on);
// The totals since the last reset, largest time first; reset: start again from zero.
std::vector<OpTime> op_times(bool reset = false);

// Whether the ops that run several of one kind as one kernel do so (rope_many,
// cache_write_many, rms_norm_many, linear_as_many: exact and the skinny BF16 kernel's, the
// exact gated_mlp's gate / up / silu_mul); off, they take them one by one -- the same
// results. Starts on unless the environment has DFLASH2_FUSED_LAUNCHES=0: a switch to isolate
// those kernels, and the baseline of bench/launch_count.py.
bool fused_launches();
// Sets what fused_launches() returns from now on (ops.set_fused_launches: an A/B of the same
// engine kind in one process; an engine's CUDA graphs keep what they captured).
void set_fused_launches(bool on);
// Whether CUDA graphs captured from now on chain their kernels with programmatic dependent
// launch (backend/cuda/pdl.cuh: each kernel's launch overlaps the one before it, which it
// still waits for before touching memory; the same results). On unless the environment has
// DFLASH2_PDL=0: on an H200 (2026-12-04, bench/bench_default_pair.py --device cuda, which runs
// ar and dflash2 both ways) the same tokens at x1.08 tok/s for both. No effect on the CPU or
// outside graphs.
bool pdl();
void set_pdl(bool on);
// Whether the mainloop-dequantizing tensor-core GEMM (the W4A16 / W8A16 linear_bf16 of NVFP4
// and FP8 weights, the grouped experts of prompt chunks under "bf16") takes its wgmma form on
// Hopper (compute capability 9.0) rather than the mma.sync form every architecture runs.
// Starts on unless the environment has DFLASH2_DQ_WGMMA=0; an engine whose load-time check
// of that kernel fails turns it off in the process (then the mma.sync form is checked). The
// same numerics either way up to fp32 summation order; no effect elsewhere.
bool dq_wgmma();
void set_dq_wgmma(bool on);
// Whether linear (the exact numerics: fp32 x, the weight as linear dequantizes it, fp32 sums)
// of BF16, FP8 block-128 and NVFP4 weights runs on the GPU's tensor cores rather than its
// SIMT kernel: x split into three BF16 planes whose sum is x exactly, the weight operand
// exact in BF16 (the FP8 block scales and the NVFP4 global scale applied to the sums), so
// every product is exact and only the fp32 sums round -- the same numerics up to summation
// order, for every M (cuda/gemm_sk.h, the exact form). For the rows of decode / verify steps,
// where the SIMT kernel's FMAs bound it from 8 rows up. Decided per call from this switch
// and the weight's format only, so set it before an engine loads and leave it (a row decoded
// under one setting and verified under the other may differ in its last bits). Starts off
// unless the environment has DFLASH2_EXACT_TC=1: not yet measured on a GPU (bench_ops times
// both forms: the linear_exact_tc rows). No effect on the CPU or on F32 / F16 weights.
bool exact_tc();
void set_exact_tc(bool on);
// Whether the CUDA backend's reductions over long rows split each row longer than 4096 ids
// over several thread blocks, one per 4096-id chunk, rather than one block per row (which
// leaves all but a few SMs idle at small batch): sample / accept run a launch per step of
// their selection (cuda/sampling.cu "wide rows"), argmax / argmax_shard / check_finite one
// launch whose last block per row merges the chunks (cuda/row_reduce.cu), topk with k <= 64
// each chunk's top k then topk_merge. The same decisions as the CPU
// either way (argmax's bitwise; sample / accept's sums of masses round in another order, so
// a draw within ~1e-16 of a boundary may differ). Starts on unless the environment has
// DFLASH2_WIDE_ROWS=0; off is the baseline that bench_ops' sample / accept / argmax rows
// time beside it. No effect on the CPU.
bool wide_rows();
void set_wide_rows(bool on);
// Whether the CUDA backend's mla_attention runs a BF16 latent cache (Engine kv_cache_dtype =
// "bf16") on the tensor cores (mma.sync m16n8k16; kv_lora a multiple of 128 up to 512,
// kv_lora + rope a multiple of 32, 16-byte aligned rows): the keys exact in BF16, queries and
// softmax weights as three BF16 planes summing to their fp32 values, so every product is exact
// and only fp32 sums round (not bitwise the SIMT kernel). Starts on unless the environment has
// DFLASH2_MLA_TC=0. It changes the numerics, so set it before an engine loads and leave it.
// No effect on the CPU or on F32 caches.
bool mla_tc();
void set_mla_tc(bool on);
// Whether the CUDA backend's indexer_topk / indexer_scores score a BF16 index-key cache on the
// tensor cores (mma.sync m16n8k16; at most 64 heads, head_dim a multiple of 8 up to 256,
// 16-byte aligned rows): q . k with the keys exact in BF16 and q as three BF16 planes summing
// to its fp32 value, so every product is exact and only the fp32 sums of the MMAs round; the
// scale, relu, head weight and the sum over heads in head order as the SIMT kernel. The scores
// are not bitwise the SIMT kernel's, so a key whose score is within rounding of the top-k
// boundary may be selected differently. Starts on unless the environment has
// DFLASH2_INDEXER_TC=0. Set it before an engine loads and leave it. No effect on the CPU or on
// F32 caches.
bool indexer_tc();
void set_indexer_tc(bool on);

// out = w * x / sqrt(mean(x^2) + eps) per row (last dim); x, out F32 [.., D]; w F32/BF16/F16 [D].
void rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out);
// rms_norm(*xs[i], *ws[i], eps[i], *outs[i]) for every i: the same results, bit for bit; the
// CUDA backend runs up to four as one kernel when their dtypes agree and no output shares an
// element with another's input or output (a layer's q_a / kv_a norms, the drafter's q / k norms).
void rms_norm_many(const std::vector<const Tensor*>& xs, const std::vector<const Tensor*>& ws,
                   const std::vector<float>& eps, const std::vector<Tensor*>& outs);
// out = (x - mean) / sqrt(var + eps) * w + b per row; b may be undefined (no bias).
void layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, float eps, Tensor& out);

enum class RopeStyle : uint8_t {
  Interleaved,  // GPT-J: rotate pairs (2i, 2i+1) (GLM-5 main attention and indexer)
  NeoX,         // half-split: rotate (i, i + D/2) (Qwen3 / the DFlash drafter)
};
// In place on x [T, H, D] (any strides, e.g. a slice of a wider projection), positions
// I32/I64 [T]; angle(t, i) = pos[t] * theta^(-2i/D), i < D/2.
void rope(Tensor& x, const Tensor& positions, double theta, RopeStyle style);
// rope(*xs[i], positions, theta, style) for every i: the same results, bit for bit; the CUDA
// backend runs them as one kernel when the rotary dims agree (a decode layer's q_pe, k_pe and
// the indexer's q / k rope slices: one launch instead of four).
void rope_many(const std::vector<Tensor*>& xs, const Tensor& positions, double theta, RopeStyle style);

// out = silu(gate) * up, elementwise over [.., F].
void silu_mul(const Tensor& gate, const Tensor& up, Tensor& out);
// out[M, D] = down(silu(gate x) * up x), or out += it (accumulate: the down projection's sums
// added to out as linear(..., accumulate) does, bitwise out + the plain result); scratch must
// hold 2*M*F floats (F = gate.out_features).
// The three projections run as linear_as(numerics, ...) (prompt tokens may take the
// tensor-core numerics, decode / verify rows decode_gemm's, with decode = true).
void gated_mlp(const Tensor& x, const Weight& gate, const Weight& up, const Weight& down,
               Tensor& out, Tensor& scratch, GemmNumerics numerics = GemmNumerics::Exact, bool decode = false,
               bool accumulate = false);

// Row-wise softmax of scale * x over the last dim (F32).
void softmax(const Tensor& x, Tensor& out, float scale = 1.0f);
// Largest k per row: values F32 [.., k] sorted descending, indices I32 [.., k]; ties go to
// the lower index. Rows with fewer than k elements are an error.
void topk(const Tensor& x, int64_t k, Tensor& values, Tensor& indices);
// out[T, D] (F32) = table[ids[t], :]; table F32/BF16/F16 [V, D]; ids I32/I64 [T];
// an id outside [0, V) is an InvalidArgument error naming it.
void embedding(const Tensor& table, const Tensor& ids, Tensor& out);

// ------------------------------------------------------------------ data movement
// dst = src: same shape (up to 6-D), any strides on either side; same dtype, or BF16/F16
// widened into an F32 dst.
void copy(const Tensor& src, Tensor& dst);
// out = a + b elementwise (F32 rows; out may be a or b: the residual add).
void add(const Tensor& a, const Tensor& b, Tensor& out);
// out[i, :] = src[idx[i], :] (src F32/BF16/F16 [N, D] with contiguous rows, idx I32 [M],
// out F32 [M, D]); an index outside [0, N) is an InvalidArgument error.
void gather_rows(const Tensor& src, const Tensor& idx, Tensor& out);
// A vocabulary shard's embedding: out[i, :] = table[ids[i] - first, :] when that row is held
// here (0 <= ids[i] - first < table rows), else zeros (an all-reduce over the shards then
// gives the full embedding). table F32/BF16/F16 [Vs, D], ids I32/I64 [M], out F32 [M, D].
void embedding_shard(const Tensor& table, const Tensor& ids, int64_t first, Tensor& out);
// argmax per row of x F32 [R, V] into out I32 [R]: the first maximum (lowest id), by
// `x[i] > x[best]` from best = 0 (comparisons with NaN are false: check_finite catches them).
void argmax(const Tensor& x, Tensor& out);
// flags I32 [R]: 1 where row r of x F32 [R, V] holds a NaN or an infinity, else 0.
void check_finite(const Tensor& x, Tensor& flags);
// Log-probabilities (log-softmax) at chosen ids: for row r of x F32 [R, V] (logits) and
// ids I32 [R] (each in [0, V)), lse[r] = log(sum_j exp(x[r, j])) and lp[r] = x[r, ids[r]] -
// lse[r] (F32 [R] each): the row's max m, then m + log(sum exp(x - m)) with the exponentials
// and their sum in double, rounded to F32; lp from that F32 lse (in double, then rounded), so
// x[r, j] - lse[r] computed so elsewhere is bitwise lp for j = ids[r]. A row holding a NaN or
// an infinity gets NaN in both.
void token_logprobs(const Tensor& x, const Tensor& ids, Tensor& lp, Tensor& lse);
// Greedy decoding over a vocabulary split across ranks, without gathering the logits.
// argmax_shard: row i of x F32 [R, Vs] (the ids first .. first + Vs - 1) into out F32 [R, 2]
// = (the row's maximum, float(first + its first position)), as argmax picks it; a row holding
// a NaN or an infinity gets (NaN, float(first)). The ids must be exact in F32: first + Vs <=
// 2^24. argmax_merge: pairs F32 [N, R, 2] (the N shards' outputs in id order, as an
// all-gather leaves them) into ids I32 [R] (the first maximum over the shards: a later shard
// wins only with a strictly larger value, so ids equal argmax over the whole row) and flags
// I32 [R] (1 where any shard's value is NaN: check_finite over the whole row).
void argmax_shard(const Tensor& x, int64_t first, Tensor& out);
void argmax_merge(const Tensor& pairs, Tensor& ids, Tensor& flags);
// Top-k over a vocabulary split across ranks, without gathering the logits: vals F32
// [N, R, k'] and idx I32 [N, R, k'] are the N shards' ops::topk outputs (shard s holds the ids
// s * shard_size .. (s + 1) * shard_size - 1, idx its positions in the shard; each list
// sorted as topk leaves it), as an all-gather leaves them; values F32 [R, k] and indices I32
// [R, k] (k <= k') get ops::topk over the whole rows: the k best of the N k' candidates,
// larger first, NaN last, ties (+0 == -0 too) to the lower id. Exactly topk's answer, since
// every element of the rows' top k is in its shard's top k'.
void topk_merge(const Tensor& vals, const Tensor& idx, int64_t shard_size, Tensor& values, Tensor& indices);
// Token references resolved in place: each entry t = tokens[i] < 0 of tokens I32 [T] is
// replaced by src's element -t - 1 (src I32, contiguous, any shape, read as flat), others
// are left as they are. How a verify pass reads drafts the drafter left on the device: the
// host plans the pass with references, the device fills them in (no copy back first). A
// reference outside [0, src.numel()) is an InvalidArgument error on the CPU; on CUDA it is
// left negative, so the embedding that reads it counts an index error (cuda::index_errors).
void resolve_tokens(Tensor& tokens, const Tensor& src);
// After acceptance, on the device that ran it: the token that follows each row of a verify
// pass. Sequence k's rows are row0[k] .. row0[k] + draft_len[k] (its anchor and drafts); with
// accepted[k] = a drafts accepted, row j is followed by drafts[draft_row[k], j] for j < a and
// by bonus[k] for j >= a (the rows past a are not committed; the bonus fills them). next
// I32 [T] (T >= every row), last I32 [S] = row0[k] + a: the sequence's last committed row.
// All I32; row0 .. bonus [S], drafts [N, K] with contiguous rows. What the MTP layer reads to
// extend its cache over a step's committed rows without the host (an out-of-range row or
// draft: InvalidArgument on the CPU, skipped on CUDA).
void next_after_accept(const Tensor& row0, const Tensor& draft_row, const Tensor& draft_len, const Tensor& accepted,
                       const Tensor& bonus, const Tensor& drafts, Tensor& next, Tensor& last);

// ------------------------------------------------------------------ paged caches
// A paged cache layer is a 2-D F32 (or BF16) tensor [num_blocks * block_size, D]: the token at
// position p of a sequence with block table row bt lives in row bt[p / bs] * bs + p % bs.
// The tokens of a step are described by the planner (host) in fixed I32 buffers:
struct PagedTokens {
  Tensor seq;          // I32 [T]: the block-table row (sequence) of token t
  Tensor pos;          // I32 [T]: its absolute position
  Tensor block_table;  // I32 [S, max_blocks]
  int64_t block_size = 0;
};
// An FP8 cache layer (kv_cache_dtype "fp8") is a U8 tensor of rows of bytes: D values as E4M3
// codes, then one float32 power-of-two scale per group of min(D, 128) values, padded to 16
// bytes (fp8_cache_row_bytes(D); D a multiple of 16, at most 128 or a multiple of 128, else
// 0); an MLA latent row adds its rope values in BF16 after them, padded to 16 bytes
// (fp8_latent_row_bytes; GLM-5.3: 656). A stored value is exact in BF16. mla_attention and
// indexer_topk / indexer_scores take such rows (the latent's kv_lora and rope from q_lat and
// q_pe); cache_write writes the quantized part (see the layout in cpp/src/ops/kv_fp8.h).
int64_t fp8_cache_row_bytes(int64_t D);
int64_t fp8_latent_row_bytes(int64_t kv_lora, int64_t rope);
// cache[slots[t], :] = src[t, :] (src F32 [T, D], slots I32 [T]; cache F32, or BF16: the
// values rounded to nearest even, or U8 [rows, fp8_cache_row_bytes(D)]: quantized, each
// group's scale the smallest power of two with amax <= 448 * scale, codes rounded to nearest
// even, a non-finite value stored as NaN); a negative slot skips the row (padding).
void cache_write(const Tensor& src, const Tensor& slots, Tensor& cache);
// cache_write(*srcs[i], slots, *caches[i]) for every i (the same slots): the same results; the
// CUDA backend writes them with one kernel (a layer's latent c, k_pe and index keys).
void cache_write_many(const std::vector<const Tensor*>& srcs, const Tensor& slots, const std::vector<Tensor*>& caches);

// ------------------------------------------------------------------ attention
// Per-head linear: y[t, g, :] = x[t, g, :] @ w[g]^T; x F32 [T, G, K] (any strides, rows
// contiguous), w F32/BF16/F16 [G, N, K] (rows contiguous), y F32 [T, G, N]. Each head is
// the dense linear above (same rounding): the absorbed MLA's W_UK^T and W_UV.
void linear_heads(const Tensor& x, const Tensor& w, Tensor& y);

// DSA indexer. For token t (sequence s = seq[t], position p = pos[t]) and every key j <= p
// of s in key_cache ([slots, dI] F32 or BF16, paged as above; BF16 values are widened exactly):
//   score(j) = sum_h (w[t, h] / sqrt(nI)) * relu(q[t, h, :] . k_j / sqrt(dI))
// with q F32 [T, nI, dI], w F32 [T, nI]. If p + 1 > topk, sel[t, :] (I32 [T, topk]) gets
// the topk best keys (ties to the earlier key) in ascending position order and
// sel_len[t] = topk; otherwise sel_len[t] = -1 (every causal key) and sel[t] is untouched.
void indexer_topk(const Tensor& q, const Tensor& w, const Tensor& key_cache, const PagedTokens& tok, int64_t topk,
                  Tensor& sel, Tensor& sel_len);
// The scores indexer_topk selects from, alone: scores[t, j] = score(j) above for every key
// j <= pos[t] with j < C (scores F32 [T, C], rows contiguous); the rest of each row is left
// as it was. For tests and analysis of each backend's scoring numerics: the CPU's and CUDA's
// SIMT kernel are bitwise equal; CUDA's tensor-core form (indexer_tc(), BF16 caches) is not.
void indexer_scores(const Tensor& q, const Tensor& w, const Tensor& key_cache, const PagedTokens& tok,
                    Tensor& scores);

// Sparse absorbed MLA over the paged latent cache (F32 or BF16 rows [c (kv_lora) | k_pe (rope)];
// BF16 values are widened exactly, so a BF16 cache gives bitwise the results of an F32 cache
// holding the same rounded values, except on CUDA's tensor-core kernel (mla_tc(), below)): for
// token t and head h, with keys K_t = sel[t, :sel_len[t]] (or 0..pos[t] when sel_len[t] < 0
// or sel_len is undefined),
//   s_j = (q_lat[t, h] . c_j + q_pe[t, h] . k_pe_j) * scale,   out[t, h] = sum_j softmax(s)_j c_j
// q_lat F32 [T, nh, kv_lora], q_pe F32 [T, nh, rope] (any strides, rows contiguous),
// out F32 [T, nh, kv_lora]. One op serves prefill chunks, decode and verify: every token
// is computed alone (a row of a verify block equals the same row decoded). An empty
// selection (sel_len[t] = 0) gives zeros.
void mla_attention(const Tensor& q_lat, const Tensor& q_pe, const Tensor& cache, const PagedTokens& tok,
                   const Tensor& sel, const Tensor& sel_len, float scale, Tensor& out);

// The DFlash drafter's block attention: queries are S blocks of B tokens (T = S * B,
// block s at positions ctx_len[s] .. ctx_len[s] + B - 1). Query (s, i) attends to the
// context keys j of sequence s in kv_cache ([slots, 2 * kvh * hd] F32 or BF16, rows [k | v],
// paged by block_table / cache_block_size) with j > ctx_len[s] + i - window when window
// > 0, and to the block's own keys k[s*B + j], v[s*B + j] for j < B (j <= i if causal).
// q F32 [T, nh, hd], k, v F32 [T, kvh, hd] (GQA: head h uses kv head h / (nh / kvh)),
// out F32 [T, nh, hd]; softmax in fp32 with the sum in double.
struct BlockAttention {
  int64_t block = 0;       // B
  int64_t window = 0;      // 0 = full attention
  bool causal = false;
  float scale = 1.0f;
  int64_t cache_block_size = 0;
  // The CUDA backend may run the block on BF16 tensor cores (q, k, v and the softmax weights
  // rounded to BF16, fp32 sums and softmax; head_dim 16 / 32 / 64 / 128 with 16-byte aligned
  // rows): the result agrees with the exact one to BF16 rounding, not bitwise, and does not
  // depend on the batch. The exact computation runs where it does not apply and on the CPU.
  // For drafts (Engine draft_gemm): they only steer acceptance.
  bool tensor_cores = false;
};
void block_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& kv_cache,
                     const Tensor& ctx_len, const Tensor& block_table, const BlockAttention& p, Tensor& out);

// ------------------------------------------------------------------ MoE
struct MoeRouting {
  int64_t top_k = 1;
  int64_t n_group = 1, topk_group = 1;
  bool norm_topk_prob = true;
  float routed_scaling_factor = 1.0f;
};
// Routing of logits F32 [T, E] (fp32 router output): s = sigmoid(logits); choice = s + bias
// (bias F32 [E], selection only); with n_group > 1 only the topk_group groups with the
// best top-2 sums of choice stay eligible; the top_k eligible experts (ties to the lower
// id) are written in ascending expert order to ids I32 [T, top_k] with weights F32
// [T, top_k] = s (/ sum of the chosen s if norm_topk_prob) * routed_scaling_factor.
void moe_route(const Tensor& logits, const Tensor& bias, const MoeRouting& r, Tensor& ids, Tensor& weights);
// The routed experts of one MoE layer (each a gated SiLU MLP). With expert parallelism a
// rank holds experts [first, first + gate.size()) of num_global (0: all of them); ids of
// other ranks' experts contribute nothing here.
struct ExpertWeights {
  std::vector<Weight> gate, up, down;
  int64_t first = 0, num_global = 0;
};
// Floats of workspace moe_experts needs for T tokens, top_k, hidden H, expert width F and
// E experts.
int64_t moe_workspace_floats(int64_t T, int64_t top_k, int64_t H, int64_t F, int64_t E);
// out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) over the experts held here (j
// ascending, from zero; ids in [0, num_global)): each
// expert runs once on the tokens routed to it (gather, grouped gated MLP, weighted
// combine; a token may name an expert more than once). x, out F32 [T, H]; workspace F32
// contiguous, >= moe_workspace_floats(...).
// numerics: Exact (linear), or FP8 (prompt chunks of FP8 checkpoints: every expert weight FP8
// block-128, each projection linear_fp8's W8A8 numerics: the activations, and silu(gate) *
// up, quantized per 128 inputs): on the CPU an emulation (the oracle), on CUDA a CUTLASS
// grouped GEMM over the experts (sm_90a, sm_100a / sm_103a) with the token counts on the device;
// or BF16 (prompt chunks, any expert format: each projection linear_bf16's numerics, the
// activations, silu(gate) * up and the dequantized weights rounded to BF16, fp32 sums): on
// the CPU an emulation, on CUDA a grouped BF16 tensor-core GEMM that dequantizes the
// weights in its main loop (W4A16 for NVFP4 experts), token counts on the device; or NVFP4
// (prompt chunks of NVFP4 checkpoints: every expert weight NVFP4 with an input_scale, each
// projection linear_nvfp4's W4A4 numerics with its expert's input_scale): on the CPU an
// emulation, on CUDA a CUTLASS block-scaled grouped GEMM (sm_100a / sm_103a).
// decode (BF16 numerics only; the others ignore it): the tokens of a decode / verify chunk, on
// CUDA the skinny grouped GEMM of generated tokens (the weight as the MMA's A operand, K split
// by the weight's shape alone) instead of the prompt chunks' kernel: the same numerics up to
// fp32 summation order, and a token's result independent of the other tokens either way.
// accumulate: out[t] += the sum (the sum formed first, then added once: bitwise ops::add of
// the plain result), e.g. straight into the residual stream.
void moe_experts(const Tensor& x, const Tensor& ids, const Tensor& weights, const ExpertWeights& experts,
                 Tensor& out, Tensor& workspace, GemmNumerics numerics = GemmNumerics::Exact, bool decode = false,
                 bool accumulate = false);
// Whether moe_experts(..., GemmNumerics::FP8) runs these experts on `dev` (every weight FP8
// with K % 16 == 0 and N % 4 == 0 on every device; on CUDA the grouped kernel built for its
// architecture and the weights readable in place: contiguous 16-byte aligned rows, contiguous
// block scales).
bool moe_experts_fp8_available(Device dev, const ExpertWeights& experts);
// Whether moe_experts(..., GemmNumerics::BF16) runs on `dev` (the CPU; a GPU of this build).
bool moe_experts_bf16_available(Device dev, const ExpertWeights& experts);
// Whether moe_experts(..., GemmNumerics::NVFP4) runs these experts on `dev` (every weight
// NVFP4 with a normal finite input_scale, K % 32 == 0, N % 4 == 0 on every device, so the CPU
// and a GPU choose alike; on CUDA the grouped kernel built for its architecture, sm_100a /
// sm_103a, and contiguous 16-byte aligned rows).
bool moe_experts_nvfp4_available(Device dev, const ExpertWeights& experts);

// ------------------------------------------------------------------ DFlash drafter
// Two-tap dynamic conv over blocks of `block` rows (taps never cross a block):
//   out[r, c] = (base[0, c] + dyn[r, c / gs]) * x[r, c] + (base[1, c] + dyn[r, G + c / gs]) * x[r - 1, c]
// where the second term is dropped at block position 0; x, out F32 [R, H] (out may be x),
// base F32 [2, H], dyn F32 [R, 2G] (rows may be strided), gs = H / G.
void dyn_conv(const Tensor& x, const Tensor& base, const Tensor& dyn, int64_t block, Tensor& out);
// The DFlash 2 candidate selector's path walk, per sequence s over positions t < P:
//   a = pred_book[prev] * g[s, t];  score_b = vals[s, t, b] + a . succ_book[cand[s, t, b]]
// prev starts at anchors[s] and becomes the chosen candidate. temperature[s] <= 0 takes
// the best score (first on ties); otherwise q = softmax(score / temperature[s]) is written
// to q F32 [S, P, K] and the candidate is drawn with the draw t of rng[s] (P draws per
// sequence). vals F32 / cand I32 [S, P, K] (a top-k of the drafter's logits), g F32
// [S, P, R] (hidden projection), books F32/BF16/F16 [V, R], anchors I32 [S], tokens I32
// [S, P], temperature F32 [S].
void selector_walk(const Tensor& vals, const Tensor& cand, const Tensor& g, const Tensor& pred_book,
                   const Tensor& succ_book, const Tensor& anchors, const Tensor& temperature, const Tensor& rng,
                   Tensor& tokens, Tensor& q);

// ------------------------------------------------------------------ sampling and acceptance
// Random numbers are counter-based (Philox4x32-10, see philox.h): rng I64 [R, 2] holds per
// row (key, counter); the op's j-th draw for row r is uniform(key_r, counter_r + j). Each
// op says how many draws a row takes; the caller advances its counters by that much
// (planned on the host: the op never writes rng, so a step can be replayed).
// Sampling parameters are per row: temperature F32 [R] (<= 0: greedy), top_p F32 [R] in
// (0, 1], top_k I32 [R] (0 = off). The distribution p of a row is: the logits scaled by
// 1 / temperature, restricted to the top_k largest (ties to the lower id), then to the
// smallest set of the largest whose mass reaches top_p of the rest (ties to the lower id),
// renormalised. Found without sorting the vocabulary (radix selection over the logits'
// bits, then one pass), as FlashInfer's sorting-free samplers do.
struct SamplingTensors {
  Tensor temperature, top_p, top_k;
};
// One token per row of logits F32 [R, V] into out I32 [R]: argmax when greedy, else a draw
// from p (one draw per row).
void sample(const Tensor& logits, const SamplingTensors& sp, const Tensor& rng, Tensor& out);
// Lossless acceptance of drafted blocks. Sequence s drafted draft_len[s] <= K tokens
// (row draft_row[s] of draft I32 [N, K]); its target logits are rows row0[s] .. row0[s] +
// draft_len[s] of logits F32 [M, V] ([anchor, d_1 .. d_k]). Greedy: the longest prefix
// equal to the target's argmax, bonus = the argmax after it. Sampling: d_i is accepted iff
// u_i * q(d_i) < p(d_i) (u_i: draw i); on the first rejection the bonus is drawn (draw K)
// from normalize(max(p - q, 0)), or from p if no mass is left; if all are accepted, from
// p of the last row (draw K). q is the selector's proposal (cand I32 / q F32 [N, K, C],
// row draft_row[s]) or, when q is undefined, one-hot on the drafted token. K + 1 draws per
// sequence. accepted / bonus I32 [S].
void accept(const Tensor& logits, const Tensor& row0, const Tensor& draft, const Tensor& draft_row,
            const Tensor& draft_len, const Tensor& cand, const Tensor& q, const SamplingTensors& sp, const Tensor& rng,
            Tensor& accepted, Tensor& bonus);
// Greedy acceptance from the target's argmax ids I32 [M] (argmax_merge's, one per verify
// row) instead of its logits: what accept does for rows with temperature 0 -- accepted[s] =
// the longest prefix of the draft equal to ids[row0[s] ..], bonus[s] = the id after it.
void accept_greedy(const Tensor& ids, const Tensor& row0, const Tensor& draft, const Tensor& draft_row,
                   const Tensor& draft_len, Tensor& accepted, Tensor& bonus);

// Repetition control and biases (SamplingParams' presence / frequency / repetition penalties,
// logit_bias and min_tokens), applied in place to the target's logits before sampling or
// acceptance, so that speculative decoding keeps the penalized distribution exactly: row j of
// a verify block sees the tokens generated before it, drafts 1 .. j of its block included.
// Per sequence s (rows row0[s] .. row0[s] + draft_len[s] of logits F32 [M, V], drafts row
// draft_row[s] of draft I32 [N, K] with contiguous rows, as accept reads them), with
// seq I32 [S, 2] = (t, min_left) and params F32 [S, 3] = (presence, frequency, repetition):
// t < 0 leaves the sequence's rows as they are; else table row t of state I32 [B, V] holds
// per token v the count of v among the tokens generated so far (bits 0..28), bit 29 set for
// a stop token, bit 30 for a token of the prompt (kPenaltyStop / kPenaltyPrompt below), and
// row t of bias F32 [B, V] is the logit bias. For row j of s and every v, with
// c = count(v) + #{i < j : draft[draft_row[s], i] == v} (in float):
//   x = logits[v] + bias[t, v]
//   if (c > 0 or v in the prompt) and repetition != 1: x = x > 0 ? x / repetition : x * repetition
//   x = x - frequency * c - (c > 0 ? presence : 0)
//   if v is a stop token and j < min_left: x = -FLT_MAX (never drawn, its log-probability finite)
// each operation rounded to F32 in that order (vLLM's order: bias, then repetition, then
// frequency and presence). Bitwise the same on every backend. draft may have K = 0 columns
// when every draft_len is 0.
constexpr int32_t kPenaltyCountMask = (1 << 29) - 1;
constexpr int32_t kPenaltyStop = 1 << 29;
constexpr int32_t kPenaltyPrompt = 1 << 30;
void apply_penalties(Tensor& logits, const Tensor& row0, const Tensor& draft, const Tensor& draft_row,
                     const Tensor& draft_len, const Tensor& seq, const Tensor& params, const Tensor& state,
                     const Tensor& bias);
// state[rows[i], ids[i]] += 1 for every i with rows[i] >= 0 (state I32 [B, V], rows / ids I32
// [n]): apply_penalties' counts of the tokens a step committed. An id outside [0, V) or a row
// >= B is an InvalidArgument error on the CPU; on CUDA it is skipped.
void count_tokens(Tensor& state, const Tensor& rows, const Tensor& ids);
// Structured output (SamplingParams::constraint): for every r with rows[r] >= 0, the tokens v
// of logits row rows[r] whose bit (bit v % 32 of word v / 32 of masks row r) is 0 get -FLT_MAX
// (never drawn, log-probabilities stay finite); set bits leave the logit as it is. logits F32
// [M, V], rows I32 [R], masks I32 [R, W] with W >= ceil(V / 32) (words past V's are not read).
// A row outside [0, M) is an InvalidArgument error on the CPU; on CUDA it is skipped.
void mask_logits(Tensor& logits, const Tensor& rows, const Tensor& masks);

}  // namespace ops
}  // namespace dflash2
