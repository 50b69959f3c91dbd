// Token selection from logits: greedy (ties to the lower id) or sampling with temperature,
// top-k and top-p applied in that order, then one draw from a per-request RNG.
#pragma once
#include <cstdint>
#include <random>

namespace dflash2::runtime {

struct SamplerParams {
  float temperature = 0.0f;
  float top_p = 1.0f;
  int64_t top_k = 0;
};

int32_t argmax(const float* logits, int64_t V);
// Probabilities after temperature / top-k / top-p (renormalised), written to `probs` (V).
void sampling_probs(const float* logits, int64_t V, const SamplerParams& p, double* probs, int32_t* order_scratch);
int32_t sample(const float* logits, int64_t V, const SamplerParams& p, std::mt19937_64& rng, double* probs,
               int32_t* order_scratch);
// One draw from a distribution given by non-negative weights summing to `total` (mass <= 0
// entries are never drawn; if rounding leaves the draw past the end, the last entry with mass).
int32_t draw(const double* weights, int64_t V, double total, std::mt19937_64& rng);
// A per-request RNG stream derived from (seed, request index).
std::mt19937_64 make_rng(int64_t seed, int64_t index);

}  // namespace dflash2::runtime
