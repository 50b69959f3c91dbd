#include "runtime/verifier.h"

#include <algorithm>

namespace dflash2::runtime {

Verifier::Verifier(int64_t vocab) : V_(vocab), probs_(size_t(vocab)), probs2_(size_t(vocab)), order_(size_t(vocab)) {}

int32_t Verifier::sample(const Tensor& row, const SamplerParams& sp, std::mt19937_64& rng) {
  return runtime::sample(row.data_as<const float>(), V_, sp, rng, probs_.data(), order_.data());
}

Accepted Verifier::accept(const Tensor& logits, const int32_t* drafts, int64_t kk, const Tensor& cand, const Tensor& q,
                          bool greedy, const SamplerParams& sp, std::mt19937_64& rng) {
  const int64_t V = V_;
  const float* lg = logits.data_as<const float>();
  const int64_t ld = logits.stride(0);
  Accepted r;
  int64_t a = 0;
  if (greedy) {
    while (a < kk && drafts[a] == argmax(lg + a * ld, V)) ++a;
    r.n = a;
    r.bonus = argmax(lg + a * ld, V);
    return r;
  }
  const int64_t K = q.defined() ? q.shape(1) : 0;
  for (; a < kk; ++a) {
    sampling_probs(lg + a * ld, V, sp, probs_.data(), order_.data());
    const int32_t d = drafts[a];
    double qd = 1.0;  // one-hot proposal unless the selector recorded q
    const int32_t* cd = nullptr;
    const float* qr = nullptr;
    if (q.defined()) {
      cd = cand.data_as<const int32_t>() + a * cand.stride(0);
      qr = q.data_as<const float>() + a * q.stride(0);
      for (int64_t b = 0; b < K; ++b)
        if (cd[b] == d) {
          qd = qr[b];
          break;
        }
    }
    const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
    if (u * qd < probs_[size_t(d)]) continue;
    // rejected: the bonus comes from normalize(max(p - q, 0)) (or p if no mass is left)
    probs2_ = probs_;
    if (qr) {
      for (int64_t b = 0; b < K; ++b) probs2_[size_t(cd[b])] = std::max(0.0, probs2_[size_t(cd[b])] - double(qr[b]));
    } else {
      probs2_[size_t(d)] = std::max(0.0, probs2_[size_t(d)] - 1.0);
    }
    double mass = 0;
    for (double v : probs2_) mass += v;
    r.n = a;
    r.bonus = mass > 0 ? draw(probs2_.data(), V, mass, rng) : draw(probs_.data(), V, 1.0, rng);
    return r;
  }
  r.n = kk;
  r.bonus = runtime::sample(lg + kk * ld, V, sp, rng, probs_.data(), order_.data());
  return r;
}

}  // namespace dflash2::runtime
