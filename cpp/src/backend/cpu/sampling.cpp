// CPU backend: sorting-free sampling (temperature, top-k, top-p) and lossless acceptance
// of drafted blocks (greedy compare; rejection sampling with the selector's K-wide q).
//
// The kept set of a row is found without sorting the vocabulary: the logits' float bits
// are mapped to order-preserving 32-bit keys and a 4-pass radix selection (8 bits a pass,
// 256-bin histograms of counts for top-k, of probability mass for top-p) finds the
// threshold key; elements tied at the threshold are taken in id order. One more pass
// draws. Every pass is a reduction over the vocabulary, the shape a GPU kernel takes too.
#include <algorithm>
#include <cmath>
#include <cfloat>
#include <cstring>

#include "backend/cpu/cpu_ops.h"
#include "dflash2/error.h"
#include "ops/philox.h"

namespace dflash2::cpu {

namespace {

inline uint32_t order_key(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // larger float -> larger key
}

// Radix selection: the key k* such that the count (or mass) of keys > k* is < target and
// of keys >= k* is >= target, among elements with w[i] != 0 (w = nullptr: all, counting).
// *above receives the count/mass of keys > k*.
uint32_t radix_select(const uint32_t* keys, const double* w, int64_t V, double target, double* above) {
  uint32_t prefix = 0, mask = 0;
  double acc = 0;  // of keys above the current prefix's range
  double hist[256];
  for (int shift = 24; shift >= 0; shift -= 8) {
    std::fill(hist, hist + 256, 0.0);
    for (int64_t i = 0; i < V; ++i) {
      if (w && w[i] == 0.0) continue;
      if ((keys[i] & mask) != prefix) continue;
      hist[(keys[i] >> shift) & 255u] += w ? w[i] : 1.0;
    }
    int d = 255, last_nonempty = -1;
    for (; d >= 0; --d) {
      if (hist[d] == 0.0) continue;
      last_nonempty = d;
      if (acc + hist[d] >= target) break;
      acc += hist[d];
    }
    if (d < 0) {  // rounding left the target unreached: take the smallest bucket with mass
      d = last_nonempty < 0 ? 0 : last_nonempty;
      acc -= hist[d];
    }
    prefix |= uint32_t(d) << shift;
    mask |= 255u << shift;
  }
  *above = acc;
  return prefix;
}

// The sampling distribution of one row as unnormalised masses w[i] (0 outside the kept
// set); returns their sum. keys: scratch of V.
double row_masses(const float* lg, int64_t V, float temperature, float top_p, int64_t top_k, double* w,
                  uint32_t* keys) {
  const double invT = 1.0 / double(temperature);
  double mx = -INFINITY;
  for (int64_t i = 0; i < V; ++i) {
    keys[i] = order_key(lg[i]);
    mx = std::max(mx, double(lg[i]) * invT);
  }
  // top-k: keys above the k-th largest, plus the first ties in id order
  uint32_t kth = 0;
  int64_t ties_left = V;
  const bool use_k = top_k > 0 && top_k < V;
  if (use_k) {
    double gt = 0;
    kth = radix_select(keys, nullptr, V, double(top_k), &gt);
    ties_left = top_k - int64_t(gt);
  }
  double z = 0;
  for (int64_t i = 0; i < V; ++i) {
    bool keep = true;
    if (use_k) keep = keys[i] > kth || (keys[i] == kth && ties_left-- > 0);
    w[i] = keep ? std::exp(double(lg[i]) * invT - mx) : 0.0;
    z += w[i];
  }
  if (!(top_p < 1.0f)) return z;
  // top-p: the smallest set of the largest whose mass reaches top_p * z (ties in id order)
  const double target = double(top_p) * z;
  double above = 0;
  const uint32_t tau = radix_select(keys, w, V, target, &above);
  double cum = above, zp = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (w[i] == 0.0) continue;
    if (keys[i] > tau) {
      zp += w[i];
    } else if (keys[i] == tau && cum < target) {
      cum += w[i];
      zp += w[i];
    } else {
      w[i] = 0.0;
    }
  }
  return zp;
}

// A draw from masses w (sum `total`) with u in [0, 1): scan in id order.
int32_t draw(const double* w, int64_t V, double total, double u) {
  const double x = u * total;
  double cum = 0;
  int32_t last = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (w[i] <= 0) continue;
    cum += w[i];
    last = int32_t(i);
    if (x < cum) return int32_t(i);
  }
  return last;  // rounding left x >= cum: the last token with mass
}

inline int32_t argmax_row(const float* x, int64_t V) {
  int64_t best = 0;
  for (int64_t i = 1; i < V; ++i)
    if (x[i] > x[best]) best = i;
  return int32_t(best);
}

struct RowParams {
  float temperature, top_p;
  int64_t top_k;
};
RowParams params_of(const ops::SamplingTensors& sp, int64_t r) {
  return {sp.temperature.data_as<const float>()[r * sp.temperature.stride(0)],
          sp.top_p.data_as<const float>()[r * sp.top_p.stride(0)],
          sp.top_k.data_as<const int32_t>()[r * sp.top_k.stride(0)]};
}
inline double draw_u(const Tensor& rng, int64_t r, uint64_t j) {
  const int64_t* st = rng.data_as<const int64_t>() + r * rng.stride(0);
  return philox::uniform(uint64_t(st[0]), uint64_t(st[rng.stride(1)]) + j);
}

}  // namespace

void sample(const Tensor& logits, const ops::SamplingTensors& sp, const Tensor& rng, Tensor& out) {
  const int64_t R = logits.shape(0), V = logits.shape(1);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads()) if (R > 1 && R * V > (1 << 15))
  for (int64_t r = 0; r < R; ++r) {
    const float* lg = logits.data_as<const float>() + r * logits.stride(0);
    const RowParams p = params_of(sp, r);
    int32_t tok;
    if (p.temperature <= 0.0f) {
      tok = argmax_row(lg, V);
    } else {
      double* w = thread_dscratch(0, size_t(V));
      uint32_t* keys = reinterpret_cast<uint32_t*>(thread_iscratch(0, size_t(V)));
      const double z = row_masses(lg, V, p.temperature, p.top_p, p.top_k, w, keys);
      tok = draw(w, V, z, draw_u(rng, r, 0));
    }
    out.data_as<int32_t>()[r * out.stride(0)] = tok;
  }
}

void accept_greedy(const Tensor& ids, const Tensor& row0, const Tensor& draft, const Tensor& draft_row,
                   const Tensor& draft_len, Tensor& accepted, Tensor& bonus) {
  const int64_t S = row0.shape(0);
  auto at = [](const Tensor& t, int64_t k) { return int64_t(t.data_as<const int32_t>()[k * t.stride(0)]); };
  for (int64_t s = 0; s < S; ++s) {
    const int64_t base = at(row0, s), L = at(draft_len, s), dr = at(draft_row, s);
    const int32_t* d = L > 0 ? draft.data_as<const int32_t>() + dr * draft.stride(0) : nullptr;
    int64_t a = 0;
    while (a < L && d[a] == at(ids, base + a)) ++a;
    accepted.data_as<int32_t>()[s * accepted.stride(0)] = int32_t(a);
    bonus.data_as<int32_t>()[s * bonus.stride(0)] = int32_t(at(ids, base + a));
  }
}

void accept(const Tensor& logits, const Tensor& row0, const Tensor& draft, const Tensor& draft_row,
            const Tensor& draft_len, const Tensor& cand, const Tensor& q, const ops::SamplingTensors& sp,
            const Tensor& rng, Tensor& accepted, Tensor& bonus) {
  const int64_t S = row0.shape(0), V = logits.shape(1), K = draft.shape(1);
  const int64_t C = q.defined() ? q.shape(2) : 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads()) if (S > 1)
  for (int64_t s = 0; s < S; ++s) {
    const int64_t base = row0.data_as<const int32_t>()[s * row0.stride(0)];
    const int64_t L = draft_len.data_as<const int32_t>()[s * draft_len.stride(0)];
    const int64_t dr = draft_row.data_as<const int32_t>()[s * draft_row.stride(0)];
    const int32_t* d = draft.data_as<const int32_t>() + dr * draft.stride(0);
    auto row = [&](int64_t j) { return logits.data_as<const float>() + (base + j) * logits.stride(0); };
    const RowParams p = params_of(sp, s);
    int64_t a = 0;
    int32_t b = 0;
    if (p.temperature <= 0.0f) {
      while (a < L && d[a] == argmax_row(row(a), V)) ++a;
      b = argmax_row(row(a), V);
    } else {
      double* w = thread_dscratch(0, size_t(V));
      uint32_t* keys = reinterpret_cast<uint32_t*>(thread_iscratch(0, size_t(V)));
      int32_t* cids = thread_iscratch(1, size_t(C));
      double* cres = thread_dscratch(1, size_t(C));
      bool rejected = false;
      for (; a < L; ++a) {
        const double z = row_masses(row(a), V, p.temperature, p.top_p, p.top_k, w, keys);
        const int32_t tok = d[a];
        // the proposal: the selector's q over its candidates, or one-hot on the draft
        int64_t nc = 1;
        const int32_t* cd = nullptr;
        const float* qr = nullptr;
        double qd = 1.0;
        if (q.defined()) {
          cd = cand.data_as<const int32_t>() + dr * cand.stride(0) + a * cand.stride(1);
          qr = q.data_as<const float>() + dr * q.stride(0) + a * q.stride(1);
          nc = C;
          for (int64_t c = 0; c < C; ++c)
            if (cd[c] == tok) {
              qd = qr[c];
              break;
            }
        }
        const double pd = w[tok] / z;
        if (draw_u(rng, s, uint64_t(a)) * qd < pd) continue;
        // rejected: the bonus from normalize(max(p - q, 0)); q lives on nc candidates
        for (int64_t c = 0; c < nc; ++c) {
          cids[c] = cd ? cd[c] : tok;
          const double qc = qr ? double(qr[c]) : 1.0;
          cres[c] = std::max(0.0, w[cids[c]] / z - qc);
        }
        // residual masses in id order: p_i outside the candidates, max(p - q, 0) on them
        double mass = 0;
        for (int64_t i = 0; i < V; ++i) w[i] /= z;
        for (int64_t c = 0; c < nc; ++c) w[cids[c]] = cres[c];
        for (int64_t i = 0; i < V; ++i) mass += w[i];
        if (mass > 0) {
          b = draw(w, V, mass, draw_u(rng, s, uint64_t(K)));
        } else {  // no residual mass left (rounding): draw from p
          const double z2 = row_masses(row(a), V, p.temperature, p.top_p, p.top_k, w, keys);
          b = draw(w, V, z2, draw_u(rng, s, uint64_t(K)));
        }
        rejected = true;
        break;
      }
      if (!rejected) {
        const double z = row_masses(row(L), V, p.temperature, p.top_p, p.top_k, w, keys);
        b = draw(w, V, z, draw_u(rng, s, uint64_t(K)));
      }
    }
    accepted.data_as<int32_t>()[s * accepted.stride(0)] = int32_t(a);
    bonus.data_as<int32_t>()[s * bonus.stride(0)] = b;
  }
}

// ops::apply_penalties: each row's tokens in id order, every operation rounded to F32 as the
// op's comment says (the product frequency * c stored before the subtraction, so no fused
// multiply-add), bitwise the CUDA kernel's.
void apply_penalties(Tensor& logits, const Tensor& row0, const Tensor& draft, const Tensor& draft_row,
                     const Tensor& draft_len, const Tensor& seq, const Tensor& params, const Tensor& state,
                     const Tensor& bias) {
  const int64_t S = row0.shape(0), V = logits.shape(1);
  for (int64_t s = 0; s < S; ++s) {
    const int32_t* sq = seq.data_as<const int32_t>() + s * seq.stride(0);
    const int64_t t = sq[0], min_left = sq[1];
    if (t < 0) continue;
    const float* pp = params.data_as<const float>() + s * params.stride(0);
    const float presence = pp[0], frequency = pp[1], rep = pp[2];
    const int64_t r0 = row0.data_as<const int32_t>()[s * row0.stride(0)];
    const int64_t L = draft_len.data_as<const int32_t>()[s * draft_len.stride(0)];
    const int32_t* d =
        L > 0 ? draft.data_as<const int32_t>() + draft_row.data_as<const int32_t>()[s * draft_row.stride(0)] * draft.stride(0)
              : nullptr;
    const int32_t* st = state.data_as<const int32_t>() + t * state.stride(0);
    const float* b = bias.data_as<const float>() + t * bias.stride(0);
    for (int64_t j = 0; j <= L; ++j) {
      float* x = logits.data_as<float>() + (r0 + j) * logits.stride(0);
      for (int64_t v = 0; v < V; ++v) {
        const int32_t f = st[v];
        int64_t c = f & ops::kPenaltyCountMask;
        for (int64_t i = 0; i < j; ++i) c += d[i] == v ? 1 : 0;
        float y = x[v] + b[v];
        if ((c > 0 || (f & ops::kPenaltyPrompt)) && rep != 1.0f) y = y > 0.0f ? y / rep : y * rep;
        if (c > 0) {
          volatile float fc = frequency * float(c);
          y = y - fc;
          y = y - presence;
        }
        if ((f & ops::kPenaltyStop) && j < min_left) y = -FLT_MAX;
        x[v] = y;
      }
    }
  }
}

void count_tokens(Tensor& state, const Tensor& rows, const Tensor& ids) {
  for (int64_t i = 0; i < rows.shape(0); ++i) {
    const int64_t r = rows.data_as<const int32_t>()[i * rows.stride(0)];
    if (r < 0) continue;
    state.data_as<int32_t>()[r * state.stride(0) + ids.data_as<const int32_t>()[i * ids.stride(0)]] += 1;
  }
}

void mask_logits(Tensor& logits, const Tensor& rows, const Tensor& masks) {
  const int64_t V = logits.shape(1);
  for (int64_t r = 0; r < rows.shape(0); ++r) {
    const int64_t row = rows.data_as<const int32_t>()[r * rows.stride(0)];
    if (row < 0) continue;
    float* x = logits.data_as<float>() + row * logits.stride(0);
    const uint32_t* m = reinterpret_cast<const uint32_t*>(masks.data_as<const int32_t>() + r * masks.stride(0));
    for (int64_t v = 0; v < V; ++v)
      if (!((m[v >> 5] >> (v & 31)) & 1u)) x[v] = -FLT_MAX;
  }
}

}  // namespace dflash2::cpu
