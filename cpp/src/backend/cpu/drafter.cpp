// CPU backend: the DFlash drafter's two-tap dynamic conv and the DFlash 2 candidate
// selector's path walk.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cpu/cpu_ops.h"
#include "dflash2/error.h"
#include "ops/philox.h"

namespace dflash2::cpu {

void dyn_conv(const Tensor& x, const Tensor& base, const Tensor& dyn, int64_t block, Tensor& out) {
  const int64_t R = x.shape(0), H = x.shape(1), B = block, G = dyn.shape(1) / 2, gs = H / G;
  const float* b0 = base.data_as<const float>();
  const float* b1 = b0 + base.stride(0);
  for (int64_t s = 0; s < R / B; ++s) {
    for (int64_t t = B - 1; t >= 0; --t) {  // backwards so out may alias x
      const int64_t r = s * B + t;
      const float* xr = x.data_as<const float>() + r * x.stride(0);
      const float* xp = t > 0 ? x.data_as<const float>() + (r - 1) * x.stride(0) : nullptr;
      const float* d0 = dyn.data_as<const float>() + r * dyn.stride(0);
      const float* d1 = d0 + G;
      float* o = out.data_as<float>() + r * out.stride(0);
      for (int64_t ch = 0; ch < H; ++ch) {
        float v = (b0[ch] + d0[ch / gs]) * xr[ch];
        if (t > 0) v += (b1[ch] + d1[ch / gs]) * xp[ch];
        o[ch] = v;
      }
    }
  }
}

namespace {
inline float book_at(const Tensor& t, int64_t row, int64_t col) {
  return load_as_f32(static_cast<const char*>(t.data()) + (row * t.stride(0) + col) * int64_t(t.itemsize()), t.dtype());
}
}  // namespace

void selector_walk(const Tensor& vals, const Tensor& cand, const Tensor& g, const Tensor& pred_book,
                   const Tensor& succ_book, const Tensor& anchors, const Tensor& temperature, const Tensor& rng,
                   Tensor& tokens, Tensor& q) {
  const int64_t S = vals.shape(0), P = vals.shape(1), K = vals.shape(2), Rk = g.shape(2);
  float* a = thread_scratch(0, size_t(Rk + 2 * K));
  float* score = a + Rk;
  float* qd = score + K;
  for (int64_t s = 0; s < S; ++s) {
    int32_t pred = anchors.data_as<const int32_t>()[s * anchors.stride(0)];
    const float temp = temperature.data_as<const float>()[s * temperature.stride(0)];
    for (int64_t t = 0; t < P; ++t) {
      const float* gt = g.data_as<const float>() + s * g.stride(0) + t * g.stride(1);
      for (int64_t e = 0; e < Rk; ++e) a[e] = book_at(pred_book, pred, e) * gt[e];
      const int32_t* cd = cand.data_as<const int32_t>() + s * cand.stride(0) + t * cand.stride(1);
      const float* vr = vals.data_as<const float>() + s * vals.stride(0) + t * vals.stride(1);
      for (int64_t b = 0; b < K; ++b) {
        float dd = 0;
        for (int64_t e = 0; e < Rk; ++e) dd += a[e] * book_at(succ_book, cd[b], e);
        score[b] = vr[b] + dd;
      }
      int64_t choice = 0;
      if (temp <= 0.0f) {
        for (int64_t b = 1; b < K; ++b)
          if (score[b] > score[choice]) choice = b;
      } else {
        const float mx = *std::max_element(score, score + K);
        double sum = 0;
        for (int64_t b = 0; b < K; ++b) sum += (qd[b] = std::exp((score[b] - mx) / temp));
        float* qo = q.data_as<float>() + s * q.stride(0) + t * q.stride(1);
        for (int64_t b = 0; b < K; ++b) qo[b] = qd[b] = float(qd[b] / sum);
        const int64_t* st = rng.data_as<const int64_t>() + s * rng.stride(0);
        const double u = philox::uniform(uint64_t(st[0]), uint64_t(st[rng.stride(1)]) + uint64_t(t));
        double cum = 0;
        choice = K - 1;
        for (int64_t b = 0; b < K; ++b) {
          cum += qd[b];
          if (u < cum) {
            choice = b;
            break;
          }
        }
      }
      pred = cd[choice];
      tokens.data_as<int32_t>()[s * tokens.stride(0) + t * tokens.stride(1)] = pred;
    }
  }
}

}  // namespace dflash2::cpu
