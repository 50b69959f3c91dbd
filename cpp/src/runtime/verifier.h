// The verifier: decides how much of a drafted block the target accepts, losslessly.
// Greedy: the longest prefix equal to the target's argmax, plus the target's next token.
// Sampling: accept d_i iff u * q(d_i) < p(d_i); on a rejection the bonus comes from
// normalize(max(p - q, 0)) (q is zero outside the selector's candidates, one-hot for
// greedy drafts); with temperature / top-k / top-p applied to p exactly as plain
// sampling applies them.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

#include "dflash2/tensor.h"
#include "runtime/sampler.h"

namespace dflash2::runtime {

struct Accepted {
  int64_t n = 0;      // accepted draft tokens
  int32_t bonus = 0;  // the target's token after them
};

class Verifier {
 public:
  explicit Verifier(int64_t vocab);
  // logits: F32 [k + 1, V] of [anchor, d_1 .. d_k]; drafts: k tokens; cand / q: per draft
  // position the selector's `top_k` candidates and proposal (q undefined: one-hot drafts).
  Accepted accept(const Tensor& logits, const int32_t* drafts, int64_t k, const Tensor& cand, const Tensor& q,
                  bool greedy, const SamplerParams& sp, std::mt19937_64& rng);
  // One token from a logits row (argmax if sp.temperature <= 0).
  int32_t sample(const Tensor& row, const SamplerParams& sp, std::mt19937_64& rng);

 private:
  int64_t V_;
  std::vector<double> probs_, probs2_;
  std::vector<int32_t> order_;
};

}  // namespace dflash2::runtime
