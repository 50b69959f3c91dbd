// CPU backend: norms, RoPE, SiLU-gating, softmax, top-k, embedding gather. Row ops take
// tensors whose rows are contiguous and evenly strided (checked in ops.cpp). Statistics
// (sums of squares, means) accumulate in double, results are f32.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "dflash2/error.h"

namespace dflash2::cpu {

namespace {

struct Rows {
  char* base;
  int64_t n, d, stride;  // rows, row length, row stride (elements)
  size_t es;
  template <class T>
  T* row(int64_t i) const { return reinterpret_cast<T*>(base + i * stride * int64_t(es)); }
};

Rows rows_of(const Tensor& t) {
  Rows r;
  r.base = static_cast<char*>(t.data());
  r.d = t.shape(-1);
  r.n = r.d ? t.numel() / r.d : 0;
  r.stride = t.ndim() >= 2 ? t.stride(-2) : r.d;
  r.es = t.itemsize();
  return r;
}

// f32 copy of a small 1-D weight vector into `dst` (stack/arena memory of the caller).
inline float weight_at(const Tensor& w, int64_t i) {
  return load_as_f32(static_cast<const char*>(w.data()) + i * int64_t(w.itemsize()), w.dtype());
}

inline bool parallel_worth(int64_t elems) { return elems >= (1 << 15); }

}  // namespace

void rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out) {
  Rows xr = rows_of(x), orows = rows_of(out);
  const int64_t D = xr.d;
#pragma omp parallel for schedule(static) num_threads(threads()) if (parallel_worth(xr.n * D))
  for (int64_t r = 0; r < xr.n; ++r) {
    const float* xi = xr.row<const float>(r);
    float* oi = orows.row<float>(r);
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += double(xi[i]) * xi[i];
    const float inv = 1.0f / std::sqrt(float(ss / double(D)) + eps);
    if (w.dtype() == DType::F32) {
      const float* wf = w.data_as<const float>();
      for (int64_t i = 0; i < D; ++i) oi[i] = wf[i] * (xi[i] * inv);
    } else {
      for (int64_t i = 0; i < D; ++i) oi[i] = weight_at(w, i) * (xi[i] * inv);
    }
  }
}

void layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, float eps, Tensor& out) {
  Rows xr = rows_of(x), orows = rows_of(out);
  const int64_t D = xr.d;
  const bool has_b = b.defined();
#pragma omp parallel for schedule(static) num_threads(threads()) if (parallel_worth(xr.n * D))
  for (int64_t r = 0; r < xr.n; ++r) {
    const float* xi = xr.row<const float>(r);
    float* oi = orows.row<float>(r);
    double s = 0;
    for (int64_t i = 0; i < D; ++i) s += xi[i];
    const double mean = s / double(D);
    double v = 0;
    for (int64_t i = 0; i < D; ++i) v += (xi[i] - mean) * (xi[i] - mean);
    const float inv = 1.0f / std::sqrt(float(v / double(D)) + eps);
    const float mf = float(mean);
    for (int64_t i = 0; i < D; ++i) {
      float y = (xi[i] - mf) * inv * weight_at(w, i);
      oi[i] = has_b ? y + weight_at(b, i) : y;
    }
  }
}

void rope(Tensor& x, const Tensor& positions, double theta, ops::RopeStyle style) {
  const int64_t T = x.shape(0), H = x.shape(1), D = x.shape(2), half = D / 2;
  const int64_t st = x.stride(0), sh = x.stride(1), sd = x.stride(2);
  float* base = x.data_as<float>();
  const bool i64 = positions.dtype() == DType::I64;
  const float ftheta = float(theta);
#pragma omp parallel for schedule(static) num_threads(threads()) if (parallel_worth(T * H * D))
  for (int64_t t = 0; t < T; ++t) {
    const int64_t pos = i64 ? positions.data_as<const int64_t>()[t * positions.stride(0)]
                            : positions.data_as<const int32_t>()[t * positions.stride(0)];
    for (int64_t i = 0; i < half; ++i) {
      // as transformers computes it: inv_freq in f32, angle = f32(pos) * inv_freq
      const float inv_freq = 1.0f / std::pow(ftheta, float(2 * i) / float(D));
      const float ang = float(pos) * inv_freq;
      const float c = std::cos(ang), s = std::sin(ang);
      const int64_t a = style == ops::RopeStyle::Interleaved ? 2 * i : i;
      const int64_t bb = style == ops::RopeStyle::Interleaved ? 2 * i + 1 : i + half;
      for (int64_t h = 0; h < H; ++h) {
        float* p = base + t * st + h * sh;
        const float x0 = p[a * sd], x1 = p[bb * sd];
        p[a * sd] = x0 * c - x1 * s;
        p[bb * sd] = x1 * c + x0 * s;
      }
    }
  }
}

void rope_many(const std::vector<Tensor*>&, const Tensor&, double, ops::RopeStyle, bool& done) { done = false; }

void rms_norm_many(const std::vector<const Tensor*>&, const std::vector<const Tensor*>&, const std::vector<float>&,
                   const std::vector<Tensor*>&, bool& done) {
  done = false;
}

void silu_mul(const Tensor& gate, const Tensor& up, Tensor& out) {
  Rows g = rows_of(gate), u = rows_of(up), o = rows_of(out);
  const int64_t D = g.d;
#pragma omp parallel for schedule(static) num_threads(threads()) if (parallel_worth(g.n * D))
  for (int64_t r = 0; r < g.n; ++r) {
    const float* gi = g.row<const float>(r);
    const float* ui = u.row<const float>(r);
    float* oi = o.row<float>(r);
    for (int64_t i = 0; i < D; ++i) {
      const float v = gi[i];
      oi[i] = (v / (1.0f + std::exp(-v))) * ui[i];
    }
  }
}

void softmax(const Tensor& x, Tensor& out, float scale) {
  Rows xr = rows_of(x), o = rows_of(out);
  const int64_t D = xr.d;
#pragma omp parallel for schedule(static) num_threads(threads()) if (parallel_worth(xr.n * D))
  for (int64_t r = 0; r < xr.n; ++r) {
    const float* xi = xr.row<const float>(r);
    float* oi = o.row<float>(r);
    float mx = -INFINITY;
    for (int64_t i = 0; i < D; ++i) mx = std::max(mx, xi[i] * scale);
    if (mx == -INFINITY) {  // all -inf (fully masked): uniform would be a lie; emit zeros
      for (int64_t i = 0; i < D; ++i) oi[i] = 0.0f;
      continue;
    }
    double sum = 0;
    for (int64_t i = 0; i < D; ++i) {
      oi[i] = std::exp(xi[i] * scale - mx);
      sum += oi[i];
    }
    const float inv = float(1.0 / sum);
    for (int64_t i = 0; i < D; ++i) oi[i] *= inv;
  }
}

void topk(const Tensor& x, int64_t k, Tensor& values, Tensor& indices) {
  Rows xr = rows_of(x), vr = rows_of(values), ir = rows_of(indices);
  const int64_t D = xr.d;
#pragma omp parallel for schedule(static) num_threads(threads()) if (parallel_worth(xr.n * D))
  for (int64_t r = 0; r < xr.n; ++r) {
    const float* xi = xr.row<const float>(r);
    int32_t* heap = ir.row<int32_t>(r);  // the output doubles as the heap: no allocation
    float* vo = vr.row<float>(r);
    // better(a, b): a ranks before b (larger value; NaN last; ties to the lower index)
    auto better = [xi](int32_t a, int32_t b) {
      const float va = xi[a], vb = xi[b];
      const bool na = std::isnan(va), nb = std::isnan(vb);
      if (na != nb) return nb;
      if (!na && va != vb) return va > vb;
      return a < b;
    };
    int64_t n = 0;
    for (int64_t i = 0; i < D; ++i) {
      const int32_t id = int32_t(i);
      if (n < k) {
        heap[n++] = id;
        std::push_heap(heap, heap + n, better);  // heap top = worst kept
      } else if (better(id, heap[0])) {
        std::pop_heap(heap, heap + n, better);
        heap[n - 1] = id;
        std::push_heap(heap, heap + n, better);
      }
    }
    std::sort_heap(heap, heap + n, better);  // best first
    for (int64_t j = 0; j < k; ++j) vo[j] = xi[heap[j]];
  }
}

void gather_rows(const Tensor& src, const Tensor& idx, Tensor& out) {
  const int64_t T = idx.shape(0), V = src.shape(0), D = src.shape(1);
  const bool i64 = idx.dtype() == DType::I64;
  auto id_at = [&](int64_t t) -> int64_t {
    return i64 ? idx.data_as<const int64_t>()[t * idx.stride(0)] : idx.data_as<const int32_t>()[t * idx.stride(0)];
  };
  for (int64_t t = 0; t < T; ++t) {
    const int64_t id = id_at(t);
    DFLASH2_CHECK_ARG(id >= 0 && id < V, "gather_rows: index ", id, " at position ", t, " is outside [0, ", V, ")");
  }
  const char* tb = static_cast<const char*>(src.data());
  const int64_t trow = src.stride(0) * int64_t(src.itemsize());
  Rows o = rows_of(out);
#pragma omp parallel for schedule(static) num_threads(threads()) if (parallel_worth(T * D))
  for (int64_t t = 0; t < T; ++t) {
    const char* s = tb + id_at(t) * trow;
    float* dst = o.row<float>(t);
    if (src.dtype() == DType::F32) {
      std::memcpy(dst, s, size_t(D) * 4);
    } else if (src.dtype() == DType::BF16) {
      for (int64_t i = 0; i < D; ++i) {
        uint16_t h;
        std::memcpy(&h, s + 2 * i, 2);
        dst[i] = bf16_to_f32(h);
      }
    } else {
      for (int64_t i = 0; i < D; ++i) dst[i] = load_as_f32(s + 2 * i, src.dtype());
    }
  }
}

void embedding_shard(const Tensor& table, const Tensor& ids, int64_t first, Tensor& out) {
  const int64_t T = ids.shape(0), Vs = table.shape(0), D = table.shape(1);
  const bool i64 = ids.dtype() == DType::I64;
  const char* tb = static_cast<const char*>(table.data());
  const int64_t trow = table.stride(0) * int64_t(table.itemsize());
  Rows o = rows_of(out);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t id = (i64 ? ids.data_as<const int64_t>()[t * ids.stride(0)]
                            : ids.data_as<const int32_t>()[t * ids.stride(0)]) - first;
    float* dst = o.row<float>(t);
    if (id < 0 || id >= Vs) {
      std::fill(dst, dst + D, 0.0f);
      continue;
    }
    const char* s = tb + id * trow;
    for (int64_t i = 0; i < D; ++i) dst[i] = load_as_f32(s + i * int64_t(table.itemsize()), table.dtype());
  }
}

void copy(const Tensor& src, Tensor& dst) {
  // innermost dimension as a run; the outer index walks the rest in row-major order
  const int nd = src.ndim();
  const size_t es = src.itemsize();
  if (nd == 0 || src.numel() == 0) return;
  const int64_t inner = src.shape(nd - 1);
  const int64_t outer = src.numel() / inner;
  const bool widen = src.dtype() != dst.dtype();  // BF16/F16 -> F32
  const bool runs = !widen && src.stride(nd - 1) == 1 && dst.stride(nd - 1) == 1;
  const size_t ds = dst.itemsize();
  const char* sb = static_cast<const char*>(src.data());
  char* db = static_cast<char*>(dst.data());
#pragma omp parallel for schedule(static) num_threads(threads()) if (parallel_worth(src.numel()))
  for (int64_t o = 0; o < outer; ++o) {
    int64_t rem = o, soff = 0, doff = 0;
    for (int d = nd - 2; d >= 0; --d) {
      const int64_t i = rem % src.shape(d);
      rem /= src.shape(d);
      soff += i * src.stride(d);
      doff += i * dst.stride(d);
    }
    if (runs) {
      std::memcpy(db + doff * int64_t(es), sb + soff * int64_t(es), size_t(inner) * es);
    } else if (widen) {
      for (int64_t i = 0; i < inner; ++i) {
        const float v = load_as_f32(sb + (soff + i * src.stride(nd - 1)) * int64_t(es), src.dtype());
        std::memcpy(db + (doff + i * dst.stride(nd - 1)) * int64_t(ds), &v, 4);
      }
    } else {
      for (int64_t i = 0; i < inner; ++i)
        std::memcpy(db + (doff + i * dst.stride(nd - 1)) * int64_t(es), sb + (soff + i * src.stride(nd - 1)) * int64_t(es),
                    es);
    }
  }
}

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  Rows ar = rows_of(a), br = rows_of(b), o = rows_of(out);
  const int64_t D = ar.d;
#pragma omp parallel for schedule(static) num_threads(threads()) if (parallel_worth(ar.n * D))
  for (int64_t r = 0; r < ar.n; ++r) {
    const float* ai = ar.row<const float>(r);
    const float* bi = br.row<const float>(r);
    float* oi = o.row<float>(r);
    for (int64_t i = 0; i < D; ++i) oi[i] = ai[i] + bi[i];
  }
}

void argmax(const Tensor& x, Tensor& out) {
  Rows xr = rows_of(x);
  const int64_t V = xr.d;
  int32_t* o = out.data_as<int32_t>();
  const int64_t os = out.stride(0);
#pragma omp parallel for schedule(static) num_threads(threads()) if (parallel_worth(xr.n * V))
  for (int64_t r = 0; r < xr.n; ++r) {
    const float* xi = xr.row<const float>(r);
    int64_t best = 0;
    for (int64_t i = 1; i < V; ++i)
      if (xi[i] > xi[best]) best = i;
    o[r * os] = int32_t(best);
  }
}

void resolve_tokens(Tensor& tokens, const Tensor& src) {
  const int64_t T = tokens.shape(0), N = src.numel();
  int32_t* t = tokens.data_as<int32_t>();
  const int32_t* s = src.data_as<const int32_t>();
  for (int64_t i = 0; i < T; ++i) {
    if (t[i] >= 0) continue;
    const int64_t j = -int64_t(t[i]) - 1;
    DFLASH2_CHECK_ARG(j < N, "resolve_tokens: reference ", t[i], " at position ", i, " is element ", j,
                      " of a source of ", N);
    t[i] = s[j];
  }
}

void next_after_accept(const Tensor& row0, const Tensor& draft_row, const Tensor& draft_len, const Tensor& accepted,
                       const Tensor& bonus, const Tensor& drafts, Tensor& next, Tensor& last) {
  const int64_t S = row0.shape(0), T = next.shape(0), N = drafts.shape(0), K = drafts.shape(1);
  auto at = [](const Tensor& t, int64_t k) { return int64_t(t.data_as<const int32_t>()[k * t.stride(0)]); };
  int32_t* nx = next.data_as<int32_t>();
  int32_t* ls = last.data_as<int32_t>();
  for (int64_t k = 0; k < S; ++k) {
    const int64_t r0 = at(row0, k), n = at(draft_len, k), a = at(accepted, k), dr = at(draft_row, k);
    DFLASH2_CHECK_ARG(r0 >= 0 && n >= 0 && r0 + n < T && a >= 0 && a <= n && n <= K && (n == 0 || (dr >= 0 && dr < N)),
                      "next_after_accept: sequence ", k, " has rows ", r0, "..", r0 + n, " of ", T, ", ", a,
                      " of ", n, " drafts accepted, draft row ", dr, " of ", N, " x ", K);
    const int32_t* d = n > 0 ? drafts.data_as<const int32_t>() + dr * drafts.stride(0) : nullptr;
    const int32_t b = int32_t(at(bonus, k));
    for (int64_t j = 0; j <= n; ++j) nx[(r0 + j) * next.stride(0)] = j < a ? d[j] : b;
    ls[k * last.stride(0)] = int32_t(r0 + a);
  }
}

void check_finite(const Tensor& x, Tensor& flags) {
  Rows xr = rows_of(x);
  const int64_t V = xr.d;
  int32_t* f = flags.data_as<int32_t>();
  const int64_t fs = flags.stride(0);
#pragma omp parallel for schedule(static) num_threads(threads()) if (parallel_worth(xr.n * V))
  for (int64_t r = 0; r < xr.n; ++r) {
    const float* xi = xr.row<const float>(r);
    float acc = 0.0f;  // x * 0 is NaN exactly for NaN and +-inf
    for (int64_t i = 0; i < V; ++i) acc += xi[i] * 0.0f;
    f[r * fs] = acc == acc ? 0 : 1;
  }
}

void token_logprobs(const Tensor& x, const Tensor& ids, Tensor& lp, Tensor& lse) {
  Rows xr = rows_of(x);
  const int64_t V = xr.d;
  const int32_t* id = ids.data_as<const int32_t>();
  float* lo = lp.data_as<float>();
  float* so = lse.data_as<float>();
  const int64_t is = ids.stride(0), ls = lp.stride(0), ss = lse.stride(0);
#pragma omp parallel for schedule(static) num_threads(threads()) if (parallel_worth(xr.n * V))
  for (int64_t r = 0; r < xr.n; ++r) {
    const float* xi = xr.row<const float>(r);
    float m = xi[0];
    bool finite = true;
    for (int64_t i = 0; i < V; ++i) {
      finite = finite && std::isfinite(xi[i]);
      m = xi[i] > m ? xi[i] : m;
    }
    if (!finite) {
      lo[r * ls] = so[r * ss] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    double sum = 0.0;
    for (int64_t i = 0; i < V; ++i) sum += std::exp(double(xi[i]) - double(m));
    const double l = double(m) + std::log(sum);
    so[r * ss] = float(l);
    lo[r * ls] = float(double(xi[id[r * is]]) - double(float(l)));  // from the F32 lse, as top lists are
  }
}

void argmax_shard(const Tensor& x, int64_t first, Tensor& out) {
  Rows xr = rows_of(x);
  const int64_t V = xr.d;
#pragma omp parallel for schedule(static) num_threads(threads()) if (parallel_worth(xr.n * V))
  for (int64_t r = 0; r < xr.n; ++r) {
    const float* xi = xr.row<const float>(r);
    int64_t best = 0;
    float acc = 0.0f;  // x * 0 is NaN exactly for NaN and +-inf (check_finite)
    for (int64_t i = 0; i < V; ++i) {
      acc += xi[i] * 0.0f;
      if (xi[i] > xi[best]) best = i;
    }
    float* o = out.data_as<float>() + r * out.stride(0);
    const bool finite = acc == acc;
    o[0] = finite ? xi[best] : std::numeric_limits<float>::quiet_NaN();
    o[out.stride(1)] = float(first + (finite ? best : 0));
  }
}

void argmax_merge(const Tensor& pairs, Tensor& ids, Tensor& flags) {
  const int64_t N = pairs.shape(0), R = pairs.shape(1);
  const float* p = pairs.data_as<const float>();
  for (int64_t r = 0; r < R; ++r) {
    bool bad = false;
    float best = 0.0f, id = 0.0f;
    bool have = false;
    for (int64_t n = 0; n < N; ++n) {
      const float* e = p + n * pairs.stride(0) + r * pairs.stride(1);
      const float v = e[0];
      if (v != v) {
        bad = true;
        continue;
      }
      if (!have || v > best) {  // a later shard (higher ids) wins only when strictly larger
        best = v;
        id = e[pairs.stride(2)];
        have = true;
      }
    }
    ids.data_as<int32_t>()[r * ids.stride(0)] = int32_t(id);
    flags.data_as<int32_t>()[r * flags.stride(0)] = bad ? 1 : 0;
  }
}

void topk_merge(const Tensor& vals, const Tensor& idx, int64_t shard_size, Tensor& values, Tensor& indices) {
  const int64_t N = vals.shape(0), R = vals.shape(1), kin = vals.shape(2), k = values.shape(1);
  struct Cand {
    float v;
    int64_t id;
  };
  std::vector<Cand> c(size_t(N * kin));
  // topk's order: larger first, NaN last, ties (+0 == -0) to the lower id
  auto better = [](const Cand& a, const Cand& b) {
    const bool na = std::isnan(a.v), nb = std::isnan(b.v);
    if (na != nb) return nb;
    if (!na && a.v != b.v) return a.v > b.v;
    return a.id < b.id;
  };
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < kin; ++j) {
        const int64_t i = idx.data_as<const int32_t>()[n * idx.stride(0) + r * idx.stride(1) + j * idx.stride(2)];
        DFLASH2_CHECK_ARG(i >= 0 && i < shard_size, "topk_merge: idx[", n, ", ", r, ", ", j, "] = ", i,
                          " is outside the shard's ", shard_size, " positions");
        c[size_t(n * kin + j)] =
            Cand{vals.data_as<const float>()[n * vals.stride(0) + r * vals.stride(1) + j * vals.stride(2)],
                 n * shard_size + i};
      }
    std::partial_sort(c.begin(), c.begin() + k, c.end(), better);
    for (int64_t j = 0; j < k; ++j) {
      values.data_as<float>()[r * values.stride(0) + j * values.stride(1)] = c[size_t(j)].v;
      indices.data_as<int32_t>()[r * indices.stride(0) + j * indices.stride(1)] = int32_t(c[size_t(j)].id);
    }
  }
}

namespace {
// f32 -> OCP E4M3 ("fn") value, round to nearest even, saturating at +-448 (what the
// hardware's cvt.rn.satfinite.e4m3x2.f32 gives); returned as the exact f32 it encodes.
float round_e4m3(float v) {
  const float a = std::fabs(v);
  if (!(a == a)) return v;  // NaN stays NaN
  if (a >= 448.0f) return std::copysign(448.0f, v);
  // normals (exponent >= -6): 3 mantissa bits, step 2^(e-3); subnormals: step 2^-9
  int e;
  std::frexp(a, &e);  // a = m 2^e, m in [0.5, 1)
  const int step_exp = std::max(e - 1, -6) - 3;
  const float step = std::ldexp(1.0f, step_exp);
  const float r = std::nearbyint(a / step) * step;  // default rounding mode: nearest even
  return std::copysign(std::min(r, 448.0f), v);
}
// f32 -> E2M1 value {0, .5, 1, 1.5, 2, 3, 4, 6}, round to nearest even code, saturating at 6.
float round_e2m1(float v) {
  const float a = std::fabs(v);
  if (!(a == a)) return v;
  float r;
  if (a < 2.0f)
    r = std::nearbyint(a * 2.0f) * 0.5f;  // steps of 0.5 in [0, 2): even codes = multiples of 1
  else if (a < 4.0f)
    r = std::nearbyint(a) ;               // steps of 1 in [2, 4): 2 (even code 4), 3 (5), 4 (6)
  else
    r = a <= 5.0f ? 4.0f : 6.0f;          // [4, 6]: 4 (code 6) or 6 (code 7); the tie 5 -> 4 (even)
  // [0, 2) with steps of 0.5: the codes 0..3 are 0, .5, 1, 1.5; nearbyint(2a) ties to even
  // multiples of 0.5 = even codes. [2, 4): 2.5 -> 2 and 3.5 -> 4 (nearbyint ties to even).
  return std::copysign(std::min(r, 6.0f), v);
}
}  // namespace

void nvfp4_quantize_act(const Tensor& x, float input_scale, Tensor& out) {
  Rows xr = rows_of(x), orow = rows_of(out);
  const int64_t K = xr.d;
  const float g = 1.0f / input_scale, sixth = 1.0f / 6.0f;
#pragma omp parallel for schedule(static) num_threads(threads()) if (parallel_worth(xr.n * K))
  for (int64_t r = 0; r < xr.n; ++r) {
    const float* xi = xr.row<const float>(r);
    float* oi = orow.row<float>(r);
    for (int64_t b = 0; b < K; b += 16) {
      float amax = 0.0f;
      bool nan = false;
      for (int i = 0; i < 16; ++i) {
        const float a = std::fabs(xi[b + i]);
        nan = nan || !(a <= 3.4028235e38f);
        amax = std::max(amax, a);
      }
      if (nan) {  // a non-finite input: the block is NaN
        for (int i = 0; i < 16; ++i) oi[b + i] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const float sf = round_e4m3(g * (amax * sixth));
      if (sf == 0.0f) {
        for (int i = 0; i < 16; ++i) oi[b + i] = 0.0f;
        continue;
      }
      const float inv = 1.0f / (sf / g);
      for (int i = 0; i < 16; ++i) oi[b + i] = round_e2m1(xi[b + i] * inv) * sf * input_scale;
    }
  }
}

// ops.h fp8_quantize_act / linear_fp8: per block of 128 inputs, sa = amax / 448 and the
// E4M3 codes of x / sa (IEEE fp32 division and rounding: what the CUDA kernel computes too).
void fp8_quantize_rows(const Tensor& x, float* q, int64_t ldq, float* sf, int64_t ldsf) {
  Rows xr = rows_of(x);
  const int64_t K = xr.d, nb = (K + 127) / 128;
#pragma omp parallel for schedule(static) num_threads(threads()) if (parallel_worth(xr.n * K))
  for (int64_t r = 0; r < xr.n; ++r) {
    const float* xi = xr.row<const float>(r);
    float* qi = q + r * ldq;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t k0 = b * 128, k1 = std::min(K, k0 + 128);
      float amax = 0.0f;
      bool bad = false;
      for (int64_t k = k0; k < k1; ++k) {
        const float a = std::fabs(xi[k]);
        bad = bad || !(a <= 3.4028235e38f);
        amax = std::max(amax, a);
      }
      if (bad) {  // a non-finite input: the block is NaN
        sf[r * ldsf + b] = std::numeric_limits<float>::quiet_NaN();
        for (int64_t k = k0; k < k1; ++k) qi[k] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const float sa = amax / 448.0f;
      sf[r * ldsf + b] = sa;
      for (int64_t k = k0; k < k1; ++k) qi[k] = sa == 0.0f ? 0.0f : round_e4m3(xi[k] / sa);
    }
  }
}

void fp8_quantize_act(const Tensor& x, Tensor& out) {
  const int64_t M = x.shape(0), K = x.shape(1), nb = (K + 127) / 128;
  std::vector<float> q(size_t(M * K)), sf(size_t(M * nb));
  fp8_quantize_rows(x, q.data(), K, sf.data(), nb);
  Rows orow = rows_of(out);
  for (int64_t r = 0; r < M; ++r) {
    float* o = orow.row<float>(r);
    for (int64_t k = 0; k < K; ++k) o[k] = q[size_t(r * K + k)] * sf[size_t(r * nb + k / 128)];
  }
}

}  // namespace dflash2::cpu
