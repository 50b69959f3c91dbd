// Adaptive speculation: per step, the draft length (0 = plain decoding, up to the
// drafter's K) that maximises the expected committed tokens per second of the running
// batch, from the acceptance measured so far and a step-time model fitted online:
//   tokens(k)  = S * (1 + a_1 + ... + a_k)          a_j: P(draft position j accepted)
//   time(k)    = c0 + c1 * T + [k > 0] (d0 + d1 * X) T = S (k + 1) verified tokens,
//                                                     X = S (DFlash: one block pass) or S k (MTP)
// fitted by exponentially weighted least squares over the steps run. Twice every 16 steps
// it explores (k = 0, and the full block, which also measures every position's
// acceptance) so the model keeps seeing both ends; while it has seen too few steps it
// cycles K, K/2, 0. "fixed" always returns K.
#pragma once
#include <array>
#include <cstdint>
#include <vector>

namespace dflash2::runtime {

class SpecPolicy {
 public:
  SpecPolicy() = default;
  SpecPolicy(int64_t K, bool adaptive, bool draft_cost_scales_with_k);
  int64_t K() const { return K_; }
  bool adaptive() const { return adaptive_; }
  // The draft length for a step with S adaptive sequences.
  int64_t choose(int64_t S);
  // From now on choose() returns min(k, K) (k >= 0), adaptive or not; k < 0: as before.
  // For the warm-up that captures the step graphs of every draft length at load.
  void force(int64_t k) { forced_ = k; }
  // After the step: S sequences, draft length k, T tokens verified, step seconds, and for
  // each sequence the accepted count (drafted positions only: accepted <= drafted).
  void record(int64_t S, int64_t k, int64_t T, double seconds, const std::vector<int64_t>& drafted,
              const std::vector<int64_t>& accepted);
  double expected_tokens(int64_t k) const;  // per sequence, 1 + sum a_j
  double predicted_time(int64_t S, int64_t k) const;
  const std::vector<double>& acceptance() const { return acc_; }

 private:
  static constexpr int kF = 4;  // features: 1, T, [k>0], [k>0] X
  std::array<double, kF> features(int64_t S, int64_t k) const;
  bool fitted() const { return n_ >= 8 && seen_zero_ && seen_full_; }
  int64_t K_ = 0;
  bool adaptive_ = false, scales_with_k_ = false;
  std::vector<double> acc_;  // a_j (EWMA), j = 1..K
  std::vector<double> acc_n_;
  double xtx_[kF][kF] = {}, xty_[kF] = {}, beta_[kF] = {};
  int64_t n_ = 0, steps_ = 0;
  bool seen_zero_ = false, seen_full_ = false;
  int64_t forced_ = -1;
};

}  // namespace dflash2::runtime
