#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>

namespace dflash2::runtime {

int32_t argmax(const float* x, int64_t V) {
  int64_t best = 0;
  for (int64_t i = 1; i < V; ++i)
    if (x[i] > x[best]) best = i;
  return int32_t(best);
}

void sampling_probs(const float* logits, int64_t V, const SamplerParams& p, double* probs, int32_t* order) {
  const double invT = 1.0 / double(p.temperature);
  double mx = -INFINITY;
  for (int64_t i = 0; i < V; ++i) mx = std::max(mx, double(logits[i]) * invT);
  // top-k: keep the k largest logits (ties to the lower id)
  int64_t keep = V;
  for (int64_t i = 0; i < V; ++i) order[i] = int32_t(i);
  auto better = [logits](int32_t a, int32_t b) { return logits[a] != logits[b] ? logits[a] > logits[b] : a < b; };
  if (p.top_k > 0 && p.top_k < V) {
    std::partial_sort(order, order + p.top_k, order + V, better);
    keep = p.top_k;
  } else if (p.top_p < 1.0f) {
    std::sort(order, order + V, better);
  }
  std::fill(probs, probs + V, 0.0);
  double sum = 0;
  for (int64_t j = 0; j < keep; ++j) {
    const int32_t i = order[j];
    probs[i] = std::exp(double(logits[i]) * invT - mx);
    sum += probs[i];
  }
  if (p.top_p < 1.0f) {
    // nucleus: the smallest prefix (by probability, descending) whose mass reaches top_p
    double cum = 0;
    int64_t j = 0;
    for (; j < keep; ++j) {
      cum += probs[order[j]] / sum;
      if (cum >= double(p.top_p)) {
        ++j;
        break;
      }
    }
    for (int64_t r = j; r < keep; ++r) probs[order[r]] = 0.0;
    sum = 0;
    for (int64_t r = 0; r < std::min(j, keep); ++r) sum += probs[order[r]];
  }
  for (int64_t i = 0; i < V; ++i) probs[i] /= sum;
}

int32_t draw(const double* w, int64_t V, double total, std::mt19937_64& rng) {
  const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng) * total;
  double cum = 0;
  int32_t last = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (w[i] <= 0) continue;
    cum += w[i];
    last = int32_t(i);
    if (u < cum) return int32_t(i);
  }
  return last;  // rounding left u >= cum: the last token with mass
}

int32_t sample(const float* logits, int64_t V, const SamplerParams& p, std::mt19937_64& rng, double* probs,
               int32_t* order) {
  if (p.temperature <= 0.0f) return argmax(logits, V);
  sampling_probs(logits, V, p, probs, order);
  return draw(probs, V, 1.0, rng);
}

std::mt19937_64 make_rng(int64_t seed, int64_t index) {
  uint64_t s = seed < 0 ? std::random_device{}() ^ (uint64_t(std::random_device{}()) << 32) : uint64_t(seed);
  // splitmix64 of (seed, index): independent streams per request
  uint64_t z = s + 0x9e3779b97f4a7c15ull * uint64_t(index + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return std::mt19937_64(z);
}

}  // namespace dflash2::runtime
