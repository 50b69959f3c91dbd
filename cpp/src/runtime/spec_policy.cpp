#include "runtime/spec_policy.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace dflash2::runtime {

namespace {
constexpr double kDecay = 0.98;   // forgetting of old steps (time model)
constexpr double kAccDecay = 0.95;  // of old acceptance
constexpr int64_t kExplore = 16;
constexpr double kPriorCount = 8;  // the 0.5 prior of each position's acceptance weighs 8 observations

// Solves the 4x4 system A x = b (A symmetric positive semi-definite, ridge-regularised).
bool solve4(double A[4][4], const double b[4], double x[4]) {
  double M[4][5];
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 4; ++j) M[i][j] = A[i][j] + (i == j ? 1e-9 * (1.0 + std::fabs(A[i][i])) : 0.0);
    M[i][4] = b[i];
  }
  for (int c = 0; c < 4; ++c) {
    int piv = c;
    for (int r = c + 1; r < 4; ++r)
      if (std::fabs(M[r][c]) > std::fabs(M[piv][c])) piv = r;
    if (std::fabs(M[piv][c]) < 1e-300) return false;
    for (int j = 0; j < 5; ++j) std::swap(M[c][j], M[piv][j]);
    for (int r = 0; r < 4; ++r) {
      if (r == c) continue;
      const double f = M[r][c] / M[c][c];
      for (int j = c; j < 5; ++j) M[r][j] -= f * M[c][j];
    }
  }
  for (int i = 0; i < 4; ++i) x[i] = M[i][4] / M[i][i];
  return true;
}
}  // namespace

SpecPolicy::SpecPolicy(int64_t K, bool adaptive, bool scales_with_k)
    : K_(K), adaptive_(adaptive && K > 0), scales_with_k_(scales_with_k), acc_(size_t(K), 0.5),
      acc_n_(size_t(K), kPriorCount) {}

std::array<double, SpecPolicy::kF> SpecPolicy::features(int64_t S, int64_t k) const {
  const double T = double(S * (k + 1));
  const double on = k > 0 ? 1.0 : 0.0;
  const double X = scales_with_k_ ? double(S * k) : double(S);
  return {1.0, T, on, on * X};
}

double SpecPolicy::expected_tokens(int64_t k) const {
  double e = 1.0;
  for (int64_t j = 0; j < k && j < K_; ++j) e += acc_[size_t(j)];
  return e;
}

double SpecPolicy::predicted_time(int64_t S, int64_t k) const {
  const auto f = features(S, k);
  double t = 0;
  for (int i = 0; i < kF; ++i) t += beta_[i] * f[size_t(i)];
  return t;
}

int64_t SpecPolicy::choose(int64_t S) {
  ++steps_;
  if (forced_ >= 0) return std::min(forced_, K_);
  if (!adaptive_ || S <= 0) return K_;
  if (!fitted()) return steps_ % 4 == 0 ? 0 : steps_ % 4 == 2 ? std::max<int64_t>(1, K_ / 2) : K_;  // warm-up
  int64_t best = K_;
  double best_rate = -1;
  static const bool dbg = std::getenv("DFLASH2_DEBUG_SPEC") != nullptr;
  for (int64_t k = 0; k <= K_; ++k) {
    const double t = predicted_time(S, k);
    if (dbg) std::fprintf(stderr, "  k=%lld t=%.2fms E=%.2f rate=%.0f\n", (long long)k, t * 1e3, expected_tokens(k),
                          double(S) * expected_tokens(k) / t);
    if (!(t > 0)) continue;
    const double rate = double(S) * expected_tokens(k) / t;
    if (rate > best_rate) {
      best_rate = rate;
      best = k;
    }
  }
  // keep the model fresh: plain decoding once every kExplore steps, and the full block
  // (which also measures the acceptance of every position) about as often, less often when
  // a full-block step costs much more than the chosen one (large batches)
  if (best != 0 && steps_ % kExplore == 0) return 0;
  // the full block is re-measured less often the more it costs and the worse it is predicted
  const double cost = predicted_time(S, K_) / std::max(predicted_time(S, best), 1e-12);
  const double rate_k = double(S) * expected_tokens(K_) / std::max(predicted_time(S, K_), 1e-12);
  const double worse = best_rate / std::max(rate_k, 1e-12);
  const int64_t every = std::max<int64_t>(kExplore, int64_t(double(kExplore) * std::min(cost * worse, 64.0)));
  if (best != K_ && steps_ % every == kExplore / 2) return K_;
  return best;
}

void SpecPolicy::record(int64_t S, int64_t k, int64_t T, double seconds, const std::vector<int64_t>& drafted,
                        const std::vector<int64_t>& accepted) {
  if (K_ == 0) return;
  // acceptance: P(position j accepted) over sequences that drafted j
  for (size_t i = 0; i < drafted.size(); ++i)
    for (int64_t j = 0; j < drafted[i] && j < K_; ++j) {
      const double hit = accepted[i] > j ? 1.0 : 0.0;
      acc_n_[size_t(j)] += 1;
      const double w = std::max(1.0 - kAccDecay, 1.0 / acc_n_[size_t(j)]);
      acc_[size_t(j)] += w * (hit - acc_[size_t(j)]);
    }
  if (!adaptive_ || S <= 0 || !(seconds > 0)) return;
  const auto f = features(S, k);
  (void)T;
  for (int i = 0; i < kF; ++i) {
    for (int j = 0; j < kF; ++j) xtx_[i][j] = kDecay * xtx_[i][j] + f[size_t(i)] * f[size_t(j)];
    xty_[i] = kDecay * xty_[i] + f[size_t(i)] * seconds;
  }
  ++n_;
  seen_zero_ = seen_zero_ || k == 0;
  seen_full_ = seen_full_ || k > 0;
  double x[kF];
  if (solve4(xtx_, xty_, x))
    for (int i = 0; i < kF; ++i) beta_[i] = x[i];
}

}  // namespace dflash2::runtime
