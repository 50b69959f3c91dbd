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
  Tensor dequantize() const;  // F32 [N, K] on the CPU (reference path, tests, tools)
};

// y[M, N] (F32) = x[M, K] (F32) @ W^T; if accumulate, y += x @ W^T.
void linear(const Tensor& x, const Weight& w, Tensor& y, bool accumulate = false);

// out = w * x / sqrt(mean(x^2) + eps) per row (last dim); x, out F32 [.., D]; w F32/BF16/F16 [D].
void rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out);
// out = (x - mean) / sqrt(var + eps) * w + b per row; b may be undefined (no bias).
void layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, float eps, Tensor& out);

enum class RopeStyle : uint8_t {
  Interleaved,  // GPT-J: rotate pairs (2i, 2i+1) (GLM-5 main attention and indexer)
  NeoX,         // half-split: rotate (i, i + D/2) (Qwen3 / the DFlash drafter)
};
// In place on x [T, H, D] (any strides, e.g. a slice of a wider projection), positions
// I32/I64 [T]; angle(t, i) = pos[t] * theta^(-2i/D), i < D/2.
void rope(Tensor& x, const Tensor& positions, double theta, RopeStyle style);

// out = silu(gate) * up, elementwise over [.., F].
void silu_mul(const Tensor& gate, const Tensor& up, Tensor& out);
// out[M, D] = down(silu(gate x) * up x); scratch must hold 2*M*F floats (F = gate.out_features).
void gated_mlp(const Tensor& x, const Weight& gate, const Weight& up, const Weight& down,
               Tensor& out, Tensor& scratch);

// Row-wise softmax of scale * x over the last dim (F32).
void softmax(const Tensor& x, Tensor& out, float scale = 1.0f);
// Largest k per row: values F32 [.., k] sorted descending, indices I32 [.., k]; ties go to
// the lower index. Rows with fewer than k elements are an error.
void topk(const Tensor& x, int64_t k, Tensor& values, Tensor& indices);
// out[T, D] (F32) = table[ids[t], :]; table F32/BF16/F16 [V, D]; ids I32/I64 [T];
// an id outside [0, V) is an InvalidArgument error naming it.
void embedding(const Tensor& table, const Tensor& ids, Tensor& out);

}  // namespace ops
}  // namespace dflash2
