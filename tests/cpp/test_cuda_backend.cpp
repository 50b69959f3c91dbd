// The CUDA backend's device layer and kernels: RMSNorm against a double-precision host
// reference; copy, add, silu_mul, rope, layer_norm, softmax, argmax, check_finite,
// gather_rows / embedding, cache_write and dyn_conv against the CPU backend (the oracle) on
// mirrored buffers: the same bytes on the host and on the device, the same views (offsets,
// shapes, strides) on both, then the whole buffers compared, so writes outside a view are
// caught too. Without a CUDA build or a usable device every case checks only what can be
// checked (the reason string, the errors raised before any launch, the thread-local
// stream); the mirrored cases then run with the CPU standing in for the device, which
// checks the harness itself, and say they skipped the device part.
//
// Status: the device cases of the new ops were compiled but have not yet run on a GPU.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "dflash2/dflash2.h"
#include "testing.h"
#ifdef DFLASH2_WITH_CUDA
#include <cuda_runtime.h>

#include "backend/cuda/cuda_api.h"
#endif

using namespace dflash2;

namespace {

bool have_device(const char* test) {
  std::string why;
  if (cuda_available(&why)) return true;
  std::printf("  %s: skipped on this machine: %s\n", test, why.c_str());
  return false;
}

}  // namespace

TEST(reason_when_unavailable) {
  std::string why;
  bool ok = cuda_available(&why);
  if (ok) {
    CHECK(why.empty());
    CHECK(cuda_device_count() > 0);
    return;
  }
  CHECK(!why.empty());
  CHECK(cuda_device_count() == 0);
#ifdef DFLASH2_WITH_CUDA
  CHECK(why.rfind("no CUDA device", 0) == 0);
  CHECK_THROWS(Tensor::empty(DType::F32, {4}, Device::cuda(0)), "no CUDA device");
  std::printf("  info: %s\n", cuda::runtime_info().c_str());
#else
  CHECK(why.find("without CUDA") != std::string::npos);
  CHECK_THROWS(Tensor::empty(DType::F32, {4}, Device::cuda(0)), "without CUDA");
#endif
}

#ifdef DFLASH2_WITH_CUDA

TEST(toolkit_version) {
  std::string v = cuda::toolkit_version();
  CHECK(!v.empty());
  CHECK(v.find('.') != std::string::npos);
  CHECK(!cuda::runtime_info().empty());
}

TEST(copies_round_trip) {
  if (!have_device("copies_round_trip")) return;
  std::vector<float> h(1000);
  for (size_t i = 0; i < h.size(); ++i) h[i] = float(i) * 0.5f - 7.0f;
  Tensor host = Tensor::view(h.data(), DType::F32, {1000});
  Tensor dev = host.to(Device::cuda(0));
  CHECK(dev.device() == Device::cuda(0));
  Tensor dev2 = Tensor::zeros(DType::F32, {1000}, Device::cuda(0));
  dev2.copy_from(dev);  // device -> device
  Tensor back = dev2.to(Device::cpu());
  CHECK(std::memcmp(back.data(), h.data(), h.size() * 4) == 0);
  Tensor z = Tensor::zeros(DType::BF16, {17}, Device::cuda(0)).to(Device::cpu());
  bool all_zero = true;
  for (int i = 0; i < 17; ++i) all_zero &= z.data_as<uint16_t>()[i] == 0;
  CHECK(all_zero);
  device_synchronize(Device::cuda(0));
}

TEST(errors_are_values) {
  if (!have_device("errors_are_values")) return;
  // 1 PiB cannot fit: OutOfMemory naming the size and the device, not an abort.
  try {
    cuda::device_malloc(size_t(1) << 50, 0);
    CHECK(false);
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::OutOfMemory);
    CHECK(std::string(e.what()).find("cuda:0") != std::string::npos);
    CHECK(std::string(e.what()).find("free") != std::string::npos);
  }
  int n = cuda_device_count();
  CHECK_THROWS(cuda::device_malloc(16, n + 3), "does not exist");
  // the runtime is still usable afterwards
  Tensor t = Tensor::zeros(DType::F32, {8}, Device::cuda(0));
  CHECK(t.to(Device::cpu()).data_as<float>()[7] == 0.0f);
}

namespace {

uint16_t to_half_bits(float v, DType t) { return t == DType::BF16 ? f32_to_bf16(v) : f32_to_f16(v); }

// Host buffer holding `n` elements of dtype t, filled from f32 values.
std::vector<uint8_t> pack(const std::vector<float>& v, DType t) {
  std::vector<uint8_t> out(v.size() * dtype_size(t));
  for (size_t i = 0; i < v.size(); ++i) {
    if (t == DType::F32) {
      std::memcpy(out.data() + i * 4, &v[i], 4);
    } else {
      uint16_t h = to_half_bits(v[i], t);
      std::memcpy(out.data() + i * 2, &h, 2);
    }
  }
  return out;
}

float elem(const uint8_t* base, size_t i, DType t) { return load_as_f32(base + i * dtype_size(t), t); }

struct Case {
  DType xt, wt, ot;
  int64_t rows, D;
  int64_t x_offset = 0, x_stride = 0;  // element offset of row 0 and row stride in the x buffer
  int64_t o_offset = 0, o_stride = 0;
  bool in_place = false;
};

// Runs one case through ops::rms_norm on cuda:0; returns the number of mismatches.
int run_case(const Case& c, std::mt19937& rng) {
  const int64_t R = c.rows, D = c.D;
  const int64_t xs = c.x_stride ? c.x_stride : D, os = c.o_stride ? c.o_stride : D;
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> xv(size_t(c.x_offset + (R - 1) * xs + D) + 16);
  std::vector<float> wv(static_cast<size_t>(D));
  for (auto& v : xv) v = nd(rng);
  for (auto& v : wv) v = 1.0f + 0.25f * nd(rng);
  // round the inputs to their storage dtype so the reference sees exactly what the kernel sees
  auto xb = pack(xv, c.xt);
  auto wb = pack(wv, c.wt);
  const float sentinel = 4096.0f;  // exact in F32 and BF16
  const int64_t o_len = c.o_offset + (R - 1) * os + D + 16;
  auto ob = pack(std::vector<float>(size_t(o_len), sentinel), c.ot);

  Device dev = Device::cuda(0);
  Tensor xbuf = Tensor::view(xb.data(), c.xt, {int64_t(xv.size())}).to(dev);
  Tensor wt = Tensor::view(wb.data(), c.wt, {D}).to(dev);
  Tensor obuf = Tensor::view(ob.data(), c.ot, {o_len}).to(dev);
  auto rows_view = [&](const Tensor& buf, int64_t off, int64_t stride, DType t) {
    char* p = static_cast<char*>(buf.data()) + off * int64_t(dtype_size(t));
    return Tensor::view(p, t, {R, D}, {stride, 1}, dev, buf.owner());
  };
  Tensor x = rows_view(xbuf, c.x_offset, xs, c.xt);
  Tensor out = c.in_place ? x : rows_view(obuf, c.o_offset, os, c.ot);
  const float eps = 1e-6f;
  ops::rms_norm(x, wt, eps, out);
  Tensor res = (c.in_place ? xbuf : obuf).to(Device::cpu());
  const uint8_t* rb = static_cast<const uint8_t*>(res.data());
  const DType rt = c.in_place ? c.xt : c.ot;
  const int64_t r_off = c.in_place ? c.x_offset : c.o_offset, r_stride = c.in_place ? xs : os;

  int bad = 0;
  for (int64_t r = 0; r < R; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) {
      double v = elem(xb.data(), size_t(c.x_offset + r * xs + i), c.xt);
      ss += v * v;
    }
    const double inv = 1.0 / std::sqrt(ss / double(D) + eps);
    for (int64_t i = 0; i < D; ++i) {
      const double ref = double(elem(wb.data(), size_t(i), c.wt)) * elem(xb.data(), size_t(c.x_offset + r * xs + i), c.xt) * inv;
      const double got = elem(rb, size_t(r_off + r * r_stride + i), rt);
      // fp32 math differs from the double reference by a few ulp of fp32; a bf16 output may
      // round to the neighbouring bf16 value.
      const double tol = rt == DType::F32 ? 2e-5 * std::fabs(ref) + 1e-6 : 1.0 / 128 * std::fabs(ref) + 1e-6;
      if (!(std::fabs(got - ref) <= tol)) {
        if (bad < 3)
          std::printf("    x %s w %s out %s rows %lld D %lld: [%lld, %lld] got %.8g want %.8g\n", dtype_name(c.xt),
                      dtype_name(c.wt), dtype_name(c.ot), (long long)R, (long long)D, (long long)r, (long long)i,
                      got, ref);
        ++bad;
      }
    }
  }
  if (!c.in_place) {  // nothing outside the rows was written
    for (int64_t j = 0; j < o_len; ++j) {
      const int64_t rel = j - c.o_offset;
      const bool inside = rel >= 0 && rel / os < R && rel % os < D;
      if (!inside && elem(rb, size_t(j), c.ot) != sentinel) {
        if (bad < 3) std::printf("    wrote outside the rows at element %lld\n", (long long)j);
        ++bad;
      }
    }
  }
  return bad;
}

}  // namespace

TEST(rms_norm_matches_reference) {
  if (!have_device("rms_norm_matches_reference")) return;
  std::mt19937 rng(1234);
  const DType acts[] = {DType::F32, DType::BF16};
  const DType weights[] = {DType::F32, DType::BF16, DType::F16};
  const int64_t dims[] = {1, 3, 8, 31, 128, 1000, 4096, 6144, 7168, 16383, 16384, 32768};
  int cases = 0, bad = 0;
  for (DType xt : acts)  // out has x's dtype (ops::rms_norm refuses a mix)
    for (DType wt : weights)
      for (int64_t D : dims) {
        Case c{xt, wt, xt, D >= 16384 ? 3 : 5, D};
        bad += run_case(c, rng) ? 1 : 0;
        ++cases;
      }
  std::printf("  %d dtype/size cases, %d with mismatches\n", cases, bad);
  CHECK(bad == 0);
}

TEST(rms_norm_layouts) {
  if (!have_device("rms_norm_layouts")) return;
  std::mt19937 rng(99);
  int bad = 0;
  for (DType t : {DType::F32, DType::BF16}) {
    // strided rows (a slice of a wider buffer), vector-friendly
    bad += run_case({t, DType::BF16, t, 7, 512, 0, 1024, 0, 768}, rng) ? 1 : 0;
    // misaligned start: forces the element-wise path
    bad += run_case({t, DType::F32, t, 4, 4096, 1, 0, 3, 0}, rng) ? 1 : 0;
    // odd row stride
    bad += run_case({t, DType::F32, t, 6, 200, 0, 201, 0, 203}, rng) ? 1 : 0;
    // many rows (more than one row per block would be needed past the grid cap; here many blocks)
    bad += run_case({t, DType::BF16, t, 3000, 96}, rng) ? 1 : 0;
    // in place
    Case ip{t, DType::F32, t, 9, 2048};
    ip.in_place = true;
    bad += run_case(ip, rng) ? 1 : 0;
  }
  CHECK(bad == 0);
}

TEST(rms_norm_row_independent_of_batch) {
  if (!have_device("rms_norm_row_independent_of_batch")) return;
  // decode == verify: row r of a batch is bitwise equal to the same row normalised alone
  const int64_t R = 16, D = 5120;
  std::vector<uint16_t> xs(static_cast<size_t>(R * D));
  std::vector<uint16_t> ws(static_cast<size_t>(D));
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  for (auto& v : xs) v = f32_to_bf16(nd(rng));
  for (auto& v : ws) v = f32_to_bf16(1.0f + 0.1f * nd(rng));
  Device dev = Device::cuda(0);
  Tensor x = Tensor::view(xs.data(), DType::BF16, {R, D}).to(dev);
  Tensor w = Tensor::view(ws.data(), DType::BF16, {D}).to(dev);
  Tensor all = Tensor::empty(DType::BF16, {R, D}, dev);
  ops::rms_norm(x, w, 1e-5f, all);
  Tensor one = Tensor::empty(DType::BF16, {1, D}, dev);
  ops::rms_norm(x.slice(0, 11, 12), w, 1e-5f, one);
  Tensor a = all.to(Device::cpu()), b = one.to(Device::cpu());
  CHECK(std::memcmp(a.data_as<uint16_t>() + 11 * D, b.data(), size_t(D) * 2) == 0);
}

TEST(rms_norm_rejects_bad_arguments) {
  if (!have_device("rms_norm_rejects_bad_arguments")) return;
  Device dev = Device::cuda(0);
  Tensor x = Tensor::zeros(DType::F32, {2, 8}, dev);
  Tensor w = Tensor::zeros(DType::F32, {8}, dev);
  Tensor w_cpu = Tensor::zeros(DType::F32, {8});
  Tensor out = Tensor::zeros(DType::F32, {2, 8}, dev);
  CHECK_THROWS(cuda::rms_norm(x, w_cpu, 1e-6f, out), "same CUDA device");
  Tensor w7 = Tensor::zeros(DType::F32, {7}, dev);
  CHECK_THROWS(cuda::rms_norm(x, w7, 1e-6f, out), "w must be [8]");
  Tensor xi = Tensor::zeros(DType::I32, {2, 8}, dev);
  CHECK_THROWS(cuda::rms_norm(xi, w, 1e-6f, out), "x must be F32 or BF16");
  Tensor xt = x.transpose(0, 1);
  Tensor ot = out.transpose(0, 1);
  CHECK_THROWS(cuda::rms_norm(xt, Tensor::zeros(DType::F32, {2}, dev), 1e-6f, ot), "contiguous in its last");
}


// ============================================================================ the new ops
namespace {

// cuda:0 when usable; otherwise the CPU stands in for the device (a self-check of the
// harness: both sides then run the CPU backend) and the test says it skipped the device.
Device test_device(const char* test) {
  std::string why;
  if (cuda_available(&why)) return Device::cuda(0);
  std::printf("  %s: skipped on this machine: %s (the harness ran with the CPU as the device)\n", test, why.c_str());
  return Device::cpu();
}

std::mt19937& gen() {
  static std::mt19937 r(4321);
  return r;
}

// A buffer of n elements held twice: on the host (for the CPU backend) and on `dev`.
struct Mirror {
  DType dt;
  int64_t n;
  Device dev;
  std::vector<uint8_t> bytes;  // the host copy
  Tensor d;                    // the device copy (the whole buffer)

  Mirror(DType t, int64_t count, Device device)
      : dt(t), n(count), dev(device), bytes(static_cast<size_t>(count) * dtype_size(t)) {}
  size_t es() const { return dtype_size(dt); }
  void upload() {
    Tensor h = Tensor::view(bytes.data(), dt, {n});
    d = Tensor::empty(dt, {n}, dev);
    d.copy_from(h);
  }
  Tensor hv(int64_t off, const Tensor::Shape& shape, const Tensor::Shape& strides = {}) {
    return Tensor::view(bytes.data() + off * int64_t(es()), dt, shape, strides);
  }
  Tensor dv(int64_t off, const Tensor::Shape& shape, const Tensor::Shape& strides = {}) const {
    return Tensor::view(static_cast<char*>(d.data()) + off * int64_t(es()), dt, shape, strides, dev, d.owner());
  }
  std::vector<uint8_t> device_bytes() const {
    Tensor b = d.to(Device::cpu());
    std::vector<uint8_t> out(bytes.size());
    std::memcpy(out.data(), b.data(), out.size());
    return out;
  }
  void set_f(int64_t i, float v) {
    if (dt == DType::F32) {
      std::memcpy(bytes.data() + i * 4, &v, 4);
    } else {
      const uint16_t h = dt == DType::BF16 ? f32_to_bf16(v) : f32_to_f16(v);
      std::memcpy(bytes.data() + i * 2, &h, 2);
    }
  }
  void set_i(int64_t i, int64_t v) {
    if (dt == DType::I64) {
      std::memcpy(bytes.data() + i * 8, &v, 8);
    } else {
      const int32_t w = int32_t(v);
      std::memcpy(bytes.data() + i * 4, &w, 4);
    }
  }
  void fill_normal(float scale = 1.0f) {
    std::normal_distribution<float> nd(0.0f, scale);
    for (int64_t i = 0; i < n; ++i) set_f(i, nd(gen()));
  }
  void fill_random_bytes() {
    for (auto& b : bytes) b = uint8_t(gen()() & 0xff);
  }
  void fill_f(float v) {
    for (int64_t i = 0; i < n; ++i) set_f(i, v);
  }
};

float f32_at(const std::vector<uint8_t>& b, int64_t i) {
  float v;
  std::memcpy(&v, b.data() + i * 4, 4);
  return v;
}

// Compares the device buffer with the host one: bitwise when tol_rel == tol_abs == 0, else
// |got - want| <= tol_abs + tol_rel * |want| per F32 element (NaN matches NaN). Returns the
// number of mismatches and prints the first few.
int compare(const char* what, const Mirror& m, double tol_rel = 0.0, double tol_abs = 0.0) {
  const std::vector<uint8_t> got = m.device_bytes();
  int bad = 0;
  if (tol_rel == 0.0 && tol_abs == 0.0) {
    const size_t es = m.es();
    for (int64_t i = 0; i < m.n; ++i) {
      if (std::memcmp(got.data() + i * es, m.bytes.data() + i * es, es) != 0) {
        if (bad < 3) {
          if (m.dt == DType::F32 || m.dt == DType::I32)
            std::printf("    %s: element %lld differs (got %.9g / %d, want %.9g / %d)\n", what, (long long)i,
                        f32_at(got, i), *reinterpret_cast<const int32_t*>(got.data() + i * 4), f32_at(m.bytes, i),
                        *reinterpret_cast<const int32_t*>(m.bytes.data() + i * 4));
          else
            std::printf("    %s: element %lld differs\n", what, (long long)i);
        }
        ++bad;
      }
    }
    return bad;
  }
  for (int64_t i = 0; i < m.n; ++i) {
    const double g = f32_at(got, i), w = f32_at(m.bytes, i);
    const bool ok = (std::isnan(g) && std::isnan(w)) || (g == w) || std::fabs(g - w) <= tol_abs + tol_rel * std::fabs(w);
    if (!ok) {
      if (bad < 3) std::printf("    %s: element %lld: got %.9g want %.9g\n", what, (long long)i, g, w);
      ++bad;
    }
  }
  return bad;
}

// ---------------------------------------------------------------- copy
struct CopyCase {
  DType st, dt;
  Tensor::Shape shape;
  Tensor::Shape s_strides;  // empty = contiguous
  int64_t s_off, s_n;
  Tensor::Shape d_strides;
  int64_t d_off, d_n;
};

int run_copy(const CopyCase& c, Device dev) {
  Mirror src(c.st, c.s_n, dev), dst(c.dt, c.d_n, dev);
  if (c.st == c.dt)
    src.fill_random_bytes();  // any bits, NaN payloads included: copy moves them
  else
    src.fill_normal(10.0f);  // widening: finite values
  for (auto& b : dst.bytes) b = 0x41;  // sentinel bytes (12.0625f as F32)
  src.upload();
  dst.upload();
  Tensor hs = src.hv(c.s_off, c.shape, c.s_strides), hd = dst.hv(c.d_off, c.shape, c.d_strides);
  ops::copy(hs, hd);
  Tensor ds = src.dv(c.s_off, c.shape, c.s_strides), dd = dst.dv(c.d_off, c.shape, c.d_strides);
  ops::copy(ds, dd);
  const int bad = compare("copy", dst);
  if (bad)
    std::printf("    copy %s -> %s shape %s src strides %s dst strides %s: %d mismatches\n", dtype_name(c.st),
                dtype_name(c.dt), shape_str(c.shape).c_str(), shape_str(ds.strides()).c_str(),
                shape_str(dd.strides()).c_str(), bad);
  return bad;
}

}  // namespace

TEST(copy_matches_cpu_on_strided_views) {
  Device dev = test_device("copy_matches_cpu_on_strided_views");
  const std::vector<CopyCase> cases = {
      // contiguous: one cudaMemcpyAsync
      {DType::U8, DType::U8, {1000}, {}, 0, 1000, {}, 0, 1000},
      {DType::F32, DType::F32, {7, 33}, {}, 5, 300, {}, 3, 300},
      // the transpose of a contiguous [3, 4, 5, 6] (a permuted view) into a contiguous dst
      {DType::F32, DType::F32, {6, 5, 4, 3}, {1, 6, 30, 120}, 0, 360, {}, 0, 360},
      {DType::I64, DType::I64, {6, 5, 4, 3}, {1, 6, 30, 120}, 0, 360, {}, 0, 360},
      {DType::U8, DType::U8, {6, 5, 4, 3}, {1, 6, 30, 120}, 0, 360, {}, 0, 360},
      // strided last dims on both sides, offsets
      {DType::BF16, DType::BF16, {3, 4, 5}, {60, 15, 3}, 1, 200, {50, 12, 2}, 3, 160},
      {DType::I32, DType::I32, {3, 4, 5}, {60, 15, 3}, 2, 200, {1, 3, 12}, 1, 80},
      // 6-D with size-1 dims, slices of wider buffers
      {DType::I64, DType::I64, {2, 1, 3, 1, 4, 2}, {100, 100, 30, 7, 6, 1}, 4, 240, {30, 99, 8, 5, 2, 1}, 1, 64},
      {DType::F16, DType::F16, {2, 3, 2, 2, 2, 3}, {144, 48, 24, 12, 6, 2}, 0, 300, {}, 2, 150},
      // a broadcast (zero-stride) source
      {DType::F32, DType::F32, {4, 5}, {0, 1}, 3, 10, {}, 0, 20},
      // widening BF16 / F16 -> F32: contiguous, transposed, strided dst
      {DType::BF16, DType::F32, {9, 130}, {}, 0, 1170, {}, 0, 1170},
      {DType::F16, DType::F32, {6, 5, 4, 3}, {1, 6, 30, 120}, 0, 360, {}, 0, 360},
      {DType::BF16, DType::F32, {4, 6}, {6, 1}, 0, 24, {14, 1}, 1, 60},
      {DType::F16, DType::F32, {3, 4}, {1, 3}, 0, 12, {5, 1}, 0, 16},
      // many blocks (grid-stride): a [700, 900] transpose
      {DType::F32, DType::F32, {900, 700}, {1, 900}, 0, 630000, {}, 0, 630000},
  };
  int bad = 0;
  for (const auto& c : cases) bad += run_copy(c, dev) ? 1 : 0;
  std::printf("  %d copy cases, %d with mismatches\n", int(cases.size()), bad);
  CHECK(bad == 0);

  // 0-D: the one element is copied (the CPU backend copies nothing for a 0-D tensor, so
  // this case checks the device result directly)
  Mirror a(DType::I32, 2, dev), b(DType::I32, 2, dev);
  a.set_i(0, 1234567);
  a.set_i(1, -1);
  b.set_i(0, 0);
  b.set_i(1, 0);
  a.upload();
  b.upload();
  if (dev.is_cuda()) {
    Tensor bd = b.dv(1, {});
    ops::copy(a.dv(0, {}), bd);
    const std::vector<uint8_t> got = b.device_bytes();
    CHECK(reinterpret_cast<const int32_t*>(got.data())[0] == 0);
    CHECK(reinterpret_cast<const int32_t*>(got.data())[1] == 1234567);
    b.set_i(1, 1234567);  // the mirror follows the device
  }
  // empty: nothing happens
  Tensor ed = b.dv(0, {2, 0});
  ops::copy(a.dv(0, {2, 0}), ed);
  CHECK(compare("copy empty", b) == 0);
}

// ---------------------------------------------------------------- add, silu_mul
namespace {

struct RowsView {
  int64_t off, stride;
};

// a (and b, out) [R, D] views at the given offsets / row strides of three buffers; `alias`:
// 0 none, 1 out is a, 2 out is b.
int run_binary(const char* name, int64_t R, int64_t D, RowsView va, RowsView vb, RowsView vo, int alias, Device dev,
               double tol_rel) {
  auto len = [&](RowsView v) { return v.off + (R - 1) * v.stride + D + 5; };
  Mirror a(DType::F32, len(va), dev), b(DType::F32, len(vb), dev), o(DType::F32, len(vo), dev);
  a.fill_normal(3.0f);
  b.fill_normal(1.0f);
  o.fill_f(-12345.0f);
  a.upload();
  b.upload();
  o.upload();
  auto run = [&](bool device) {
    Tensor ta = device ? a.dv(va.off, {R, D}, {va.stride, 1}) : a.hv(va.off, {R, D}, {va.stride, 1});
    Tensor tb = device ? b.dv(vb.off, {R, D}, {vb.stride, 1}) : b.hv(vb.off, {R, D}, {vb.stride, 1});
    Tensor to = alias == 1 ? ta : alias == 2 ? tb : device ? o.dv(vo.off, {R, D}, {vo.stride, 1}) : o.hv(vo.off, {R, D}, {vo.stride, 1});
    if (std::string(name) == "add")
      ops::add(ta, tb, to);
    else
      ops::silu_mul(ta, tb, to);
  };
  run(false);
  run(true);
  const int bad = compare(name, a, tol_rel) + compare(name, b, tol_rel) + compare(name, o, tol_rel);
  if (bad)
    std::printf("    %s R %lld D %lld alias %d: %d mismatches\n", name, (long long)R, (long long)D, alias, bad);
  return bad;
}

}  // namespace

TEST(add_and_silu_mul_match_cpu) {
  Device dev = test_device("add_and_silu_mul_match_cpu");
  int bad = 0, cases = 0;
  for (const char* name : {"add", "silu_mul"}) {
    // add is bitwise the CPU's; silu_mul differs only by CUDA's expf (<= 2 ulp)
    const double tol = std::string(name) == "add" ? 0.0 : 1e-6;
    const int64_t dims[] = {1, 3, 4, 17, 64, 1000, 4096};
    for (int64_t D : dims) {
      for (int64_t R : {int64_t(1), int64_t(5)}) {
        bad += run_binary(name, R, D, {0, D}, {0, D}, {0, D}, 0, dev, tol) ? 1 : 0;  // contiguous (vector path)
        bad += run_binary(name, R, D, {1, D + 3}, {4, D + 8}, {3, D}, 0, dev, tol) ? 1 : 0;  // misaligned
        bad += run_binary(name, R, D, {8, D + 16}, {0, D}, {4, D + 4}, 0, dev, tol) ? 1 : 0;  // strided rows
        bad += run_binary(name, R, D, {0, D}, {0, D}, {0, D}, 1, dev, tol) ? 1 : 0;  // out is a / gate
        bad += run_binary(name, R, D, {4, D + 4}, {0, D}, {0, D}, 2, dev, tol) ? 1 : 0;  // out is b / up
        cases += 5;
      }
    }
    // more rows than gridDim.y
    bad += run_binary(name, 70000, 4, {0, 4}, {0, 8}, {0, 4}, 0, dev, tol) ? 1 : 0;
    ++cases;
  }
  std::printf("  %d add / silu_mul cases, %d with mismatches\n", cases, bad);
  CHECK(bad == 0);
}

// ---------------------------------------------------------------- rope
TEST(rope_matches_cpu_on_strided_slices) {
  Device dev = test_device("rope_matches_cpu_on_strided_slices");
  struct RopeCase {
    int64_t T, H, D, width, rope_off;  // x = buf[T, H, width][:, :, rope_off : rope_off + D]
    double theta;
    int max_pos;
  };
  // D <= 512: inv_freq from the host (bitwise the CPU's); D = 1024: computed on the device
  // (positions kept small so that a 1-ulp inv_freq difference stays within the tolerance)
  const RopeCase cases[] = {{1, 1, 2, 2, 0, 1e4, 5000},   {5, 3, 64, 64, 0, 1e6, 5000},
                            {4, 3, 64, 96, 32, 1e6, 5000}, {7, 2, 128, 160, 16, 8e6, 100000},
                            {3, 64, 32, 48, 8, 1e4, 5000}, {2, 2, 1024, 1024, 0, 1e4, 50}};
  int bad = 0, n = 0;
  for (const auto& c : cases) {
    for (DType pdt : {DType::I32, DType::I64}) {
      for (auto style : {ops::RopeStyle::Interleaved, ops::RopeStyle::NeoX}) {
        Mirror x(DType::F32, c.T * c.H * c.width, dev);
        x.fill_normal();
        Mirror pos(pdt, 2 * c.T + 1, dev);  // positions at stride 2, offset 1
        for (int64_t t = 0; t < pos.n; ++t) pos.set_i(t, int64_t(gen()() % uint32_t(c.max_pos)) - (t == 3 ? 7 : 0));
        x.upload();
        pos.upload();
        const Tensor::Shape shape = {c.T, c.H, c.D}, strides = {c.H * c.width, c.width, 1};
        Tensor hx = x.hv(c.rope_off, shape, strides), dx = x.dv(c.rope_off, shape, strides);
        ops::rope(hx, pos.hv(1, {c.T}, {2}), c.theta, style);
        ops::rope(dx, pos.dv(1, {c.T}, {2}), c.theta, style);
        // cosf / sinf within 2 ulp of glibc's: relative 1e-6 of |x| ~ 1
        const int b = compare("rope", x, 1e-6, c.D == 1024 ? 5e-5 : 4e-6);
        if (b) std::printf("    rope T %lld H %lld D %lld: %d mismatches\n", (long long)c.T, (long long)c.H, (long long)c.D, b);
        bad += b ? 1 : 0;
        ++n;
      }
    }
  }
  // a strided rotary dim (every other element of the last dim)
  {
    Mirror x(DType::F32, 3 * 2 * 64, dev);
    x.fill_normal();
    Mirror pos(DType::I32, 3, dev);
    for (int64_t t = 0; t < 3; ++t) pos.set_i(t, 11 + 100 * t);
    x.upload();
    pos.upload();
    Tensor hx = x.hv(1, {3, 2, 32}, {128, 64, 2}), dx = x.dv(1, {3, 2, 32}, {128, 64, 2});
    ops::rope(hx, pos.hv(0, {3}), 1e4, ops::RopeStyle::NeoX);
    ops::rope(dx, pos.dv(0, {3}), 1e4, ops::RopeStyle::NeoX);
    bad += compare("rope strided dim", x, 1e-6, 4e-6) ? 1 : 0;
    ++n;
  }
  std::printf("  %d rope cases, %d with mismatches\n", n, bad);
  CHECK(bad == 0);
}

// ---------------------------------------------------------------- layer_norm, softmax
TEST(layer_norm_matches_cpu) {
  Device dev = test_device("layer_norm_matches_cpu");
  int bad = 0, n = 0;
  for (int64_t D : {int64_t(1), int64_t(7), int64_t(128), int64_t(1000), int64_t(4099)}) {
    for (DType wt : {DType::F32, DType::BF16, DType::F16}) {
      for (int bias = 0; bias < 3; ++bias) {  // 0: none, 1: F32, 2: same dtype as w
        for (int in_place = 0; in_place < 2; ++in_place) {
          const int64_t R = 6, xs = D + 3, os = D + 1;
          Mirror x(DType::F32, 2 + (R - 1) * xs + D, dev), o(DType::F32, (R - 1) * os + D + 2, dev);
          Mirror w(wt, D, dev), b(bias == 1 ? DType::F32 : wt, D, dev);
          x.fill_normal(2.0f);
          for (int64_t i = 0; i < x.n; ++i) x.set_f(i, f32_at(x.bytes, i) + 1.0f);
          w.fill_normal();
          b.fill_normal();
          o.fill_f(-7.0f);
          x.upload();
          o.upload();
          w.upload();
          b.upload();
          for (bool device : {false, true}) {
            Tensor tx = device ? x.dv(2, {R, D}, {xs, 1}) : x.hv(2, {R, D}, {xs, 1});
            Tensor to = in_place ? tx : device ? o.dv(1, {R, D}, {os, 1}) : o.hv(1, {R, D}, {os, 1});
            Tensor tw = device ? w.dv(0, {D}) : w.hv(0, {D});
            Tensor tb = bias == 0 ? Tensor() : device ? b.dv(0, {D}) : b.hv(0, {D});
            ops::layer_norm(tx, tw, tb, 1e-6f, to);
          }
          // double sums in another order: almost always bitwise, a few ulp at worst
          const int e = compare("layer_norm x", x, 2e-6, 1e-6) + compare("layer_norm out", o, 2e-6, 1e-6);
          if (e) std::printf("    layer_norm D %lld w %s bias %d in_place %d: %d mismatches\n", (long long)D,
                             dtype_name(wt), bias, in_place, e);
          bad += e ? 1 : 0;
          ++n;
        }
      }
    }
  }
  std::printf("  %d layer_norm cases, %d with mismatches\n", n, bad);
  CHECK(bad == 0);
}

TEST(softmax_matches_cpu) {
  Device dev = test_device("softmax_matches_cpu");
  const float inf = std::numeric_limits<float>::infinity();
  int bad = 0, n = 0;
  for (int64_t D : {int64_t(1), int64_t(17), int64_t(1000), int64_t(5000)}) {
    for (float scale : {1.0f, 0.0625f, 3.0f}) {
      for (int in_place = 0; in_place < 2; ++in_place) {
        const int64_t R = 6, xs = D + 2;
        Mirror x(DType::F32, R * xs, dev), o(DType::F32, R * D + 4, dev);
        x.fill_normal(5.0f);
        for (int64_t r = 0; r < R; ++r) x.set_f(r * xs, -inf);        // masked entries
        for (int64_t i = 0; i < D; ++i) x.set_f(2 * xs + i, -inf);   // a fully masked row: zeros
        if (D > 3) x.set_f(3 * xs + 2, std::numeric_limits<float>::quiet_NaN());  // NaN row: NaNs
        o.fill_f(-5.0f);
        x.upload();
        o.upload();
        for (bool device : {false, true}) {
          Tensor tx = device ? x.dv(0, {R, D}, {xs, 1}) : x.hv(0, {R, D}, {xs, 1});
          Tensor to = in_place ? tx : device ? o.dv(2, {R, D}) : o.hv(2, {R, D});
          ops::softmax(tx, to, scale);
        }
        // expf within 2 ulp, the double sum in another order
        const int e = compare("softmax x", x, 1e-6, 1e-12) + compare("softmax out", o, 1e-6, 1e-12);
        if (e) std::printf("    softmax D %lld scale %g in_place %d: %d mismatches\n", (long long)D, scale, in_place, e);
        bad += e ? 1 : 0;
        ++n;
      }
    }
  }
  std::printf("  %d softmax cases, %d with mismatches\n", n, bad);
  CHECK(bad == 0);
}

// ---------------------------------------------------------------- argmax, check_finite
TEST(argmax_and_check_finite_match_cpu_exactly) {
  Device dev = test_device("argmax_and_check_finite_match_cpu_exactly");
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  int bad = 0, n = 0;
  for (int64_t V : {int64_t(1), int64_t(2), int64_t(31), int64_t(1000), int64_t(154880)}) {
    const int64_t R = 9, xs = V + 5;
    Mirror x(DType::F32, R * xs, dev);
    for (int64_t i = 0; i < x.n; ++i) x.set_f(i, float(int(gen()() % 9) - 4));  // many ties
    auto at = [&](int64_t r, int64_t i) { return r * xs + 1 + i; };
    for (int64_t i = 0; i < V; ++i) x.set_f(at(1, i), -inf);  // all -inf: 0
    x.set_f(at(2, 0), nan);                                     // NaN first: 0
    if (V > 2) x.set_f(at(3, V / 2), nan);                      // a NaN elsewhere is skipped
    for (int64_t i = 0; i < V; ++i) x.set_f(at(4, i), (i % 3) ? 0.0f : -0.0f);  // +0 / -0 tie: 0
    x.set_f(at(5, V - 1), inf);                                 // the max last
    for (int64_t i = 0; i < V; ++i) x.set_f(at(6, i), nan);    // all NaN: 0
    x.set_f(at(7, V - 1), 1e30f);
    if (V > 1) x.set_f(at(7, V - 2), 1e30f);                    // a tie at the end: V - 2
    Mirror out(DType::I32, 2 * R + 1, dev), flags(DType::I32, 2 * R + 1, dev);
    for (int64_t i = 0; i < out.n; ++i) {
      out.set_i(i, -777);
      flags.set_i(i, -777);
    }
    x.upload();
    out.upload();
    flags.upload();
    for (bool device : {false, true}) {
      Tensor tx = device ? x.dv(1, {R, V}, {xs, 1}) : x.hv(1, {R, V}, {xs, 1});
      Tensor to = device ? out.dv(1, {R}, {2}) : out.hv(1, {R}, {2});  // strided outputs
      Tensor tf = device ? flags.dv(0, {R}, {2}) : flags.hv(0, {R}, {2});
      ops::argmax(tx, to);
      ops::check_finite(tx, tf);
    }
    const int e = compare("argmax", out) + compare("check_finite", flags);
    if (e) std::printf("    argmax / check_finite V %lld: %d mismatches\n", (long long)V, e);
    bad += e ? 1 : 0;
    ++n;
  }
  // many rows (past one block per row)
  {
    const int64_t R = 3000, V = 40;
    Mirror x(DType::F32, R * V, dev), out(DType::I32, R, dev), flags(DType::I32, R, dev);
    x.fill_normal();
    x.set_f(17 * V + 3, inf);
    x.set_f(2999 * V, nan);
    x.upload();
    out.upload();
    flags.upload();
    for (bool device : {false, true}) {
      Tensor tx = device ? x.dv(0, {R, V}) : x.hv(0, {R, V});
      Tensor to = device ? out.dv(0, {R}) : out.hv(0, {R});
      Tensor tf = device ? flags.dv(0, {R}) : flags.hv(0, {R});
      ops::argmax(tx, to);
      ops::check_finite(tx, tf);
    }
    bad += (compare("argmax many rows", out) + compare("check_finite many rows", flags)) ? 1 : 0;
    ++n;
  }
  std::printf("  %d argmax / check_finite cases, %d with mismatches\n", n, bad);
  CHECK(bad == 0);
}

// ---------------------------------------------------------------- gather_rows, embedding
TEST(gather_rows_matches_cpu_exactly) {
  Device dev = test_device("gather_rows_matches_cpu_exactly");
  int bad = 0, n = 0;
  for (DType st : {DType::F32, DType::BF16, DType::F16}) {
    for (DType it : {DType::I32, DType::I64}) {
      for (int64_t D : {int64_t(1), int64_t(33), int64_t(64), int64_t(1000)}) {
        for (int layout = 0; layout < 2; ++layout) {  // 0: contiguous, 1: strided rows, offsets, strided ids
          const int64_t N = 97, T = 11;
          const int64_t ss = layout ? D + 8 : D, os = layout ? D + 4 : D, soff = layout ? 3 : 0, ooff = layout ? 1 : 0;
          Mirror src(st, soff + N * ss, dev), idx(it, 2 * T, dev), out(DType::F32, ooff + T * os + 3, dev);
          src.fill_normal();
          for (int64_t t = 0; t < 2 * T; ++t) idx.set_i(t, int64_t(gen()() % N));
          idx.set_i(0, N - 1);
          idx.set_i(2, 0);
          out.fill_f(-3.0f);
          src.upload();
          idx.upload();
          out.upload();
          const int64_t istep = layout ? 2 : 1;
          for (bool device : {false, true}) {
            Tensor ts = device ? src.dv(soff, {N, D}, {ss, 1}) : src.hv(soff, {N, D}, {ss, 1});
            Tensor ti = device ? idx.dv(0, {T}, {istep}) : idx.hv(0, {T}, {istep});
            Tensor to = device ? out.dv(ooff, {T, D}, {os, 1}) : out.hv(ooff, {T, D}, {os, 1});
            if (layout)
              ops::gather_rows(ts, ti, to);
            else
              ops::embedding(ts, ti, to);
          }
          const int e = compare("gather_rows", out);
          if (e) std::printf("    gather_rows %s by %s D %lld layout %d: %d mismatches\n", dtype_name(st), dtype_name(it),
                             (long long)D, layout, e);
          bad += e ? 1 : 0;
          ++n;
        }
      }
    }
  }
  std::printf("  %d gather_rows / embedding cases, %d with mismatches\n", n, bad);
  CHECK(bad == 0);

  // ids outside [0, N) on the device: zero rows, counted; never out of bounds
  if (dev.is_cuda()) {
    const int64_t N = 5, D = 8, T = 4;
    Mirror src(DType::F32, N * D, dev), idx(DType::I64, T, dev), out(DType::F32, T * D, dev);
    src.fill_normal();
    idx.set_i(0, 2);
    idx.set_i(1, 5);
    idx.set_i(2, -1);
    idx.set_i(3, int64_t(1) << 40);
    out.fill_f(-3.0f);
    src.upload();
    idx.upload();
    out.upload();
    cuda::index_errors(0, true);
    Tensor to = out.dv(0, {T, D});
    ops::gather_rows(src.dv(0, {N, D}), idx.dv(0, {T}), to);
    CHECK(cuda::index_errors(0, true) == 3);
    const std::vector<uint8_t> got = out.device_bytes();
    for (int64_t i = 0; i < D; ++i) {
      CHECK(f32_at(got, i) == f32_at(src.bytes, 2 * D + i));
      for (int64_t t = 1; t < T; ++t) CHECK(f32_at(got, t * D + i) == 0.0f);
    }
  }
}

// ---------------------------------------------------------------- cache_write
TEST(cache_write_matches_cpu_exactly) {
  Device dev = test_device("cache_write_matches_cpu_exactly");
  int bad = 0, n = 0;
  for (int64_t D : {int64_t(1), int64_t(37), int64_t(64), int64_t(576)}) {
    for (int layout = 0; layout < 2; ++layout) {
      const int64_t rows = 48, T = 20;
      const int64_t cs = layout ? D + 4 : D, ss = layout ? D + 3 : D, coff = layout ? 2 : 0;
      Mirror cache(DType::F32, coff + rows * cs + 2, dev), src(DType::F32, T * ss, dev), slots(DType::I32, 2 * T, dev);
      cache.fill_normal();
      src.fill_normal();
      // distinct slots (a permutation), with padding rows (-1, -7)
      std::vector<int64_t> perm(static_cast<size_t>(rows));
      for (int64_t i = 0; i < rows; ++i) perm[size_t(i)] = i;
      std::shuffle(perm.begin(), perm.end(), gen());
      for (int64_t t = 0; t < 2 * T; ++t) slots.set_i(t, perm[size_t(t)]);
      slots.set_i(2, -1);
      slots.set_i(8, -7);
      cache.upload();
      src.upload();
      slots.upload();
      const int64_t step = layout ? 2 : 1;
      for (bool device : {false, true}) {
        Tensor tc = device ? cache.dv(coff, {rows, D}, {cs, 1}) : cache.hv(coff, {rows, D}, {cs, 1});
        Tensor ts = device ? src.dv(0, {T, D}, {ss, 1}) : src.hv(0, {T, D}, {ss, 1});
        Tensor tl = device ? slots.dv(0, {T}, {step}) : slots.hv(0, {T}, {step});
        ops::cache_write(ts, tl, tc);
      }
      const int e = compare("cache_write", cache);
      if (e) std::printf("    cache_write D %lld layout %d: %d mismatches\n", (long long)D, layout, e);
      bad += e ? 1 : 0;
      ++n;
    }
  }
  std::printf("  %d cache_write cases, %d with mismatches\n", n, bad);
  CHECK(bad == 0);

  // slots >= rows on the device: skipped and counted (the CPU raises InvalidArgument)
  if (dev.is_cuda()) {
    const int64_t rows = 4, D = 16, T = 3;
    Mirror cache(DType::F32, rows * D, dev), src(DType::F32, T * D, dev), slots(DType::I32, T, dev);
    cache.fill_f(1.0f);
    src.fill_f(2.0f);
    slots.set_i(0, 4);
    slots.set_i(1, 1);
    slots.set_i(2, 1 << 30);
    cache.upload();
    src.upload();
    slots.upload();
    cuda::index_errors(0, true);
    Tensor tc = cache.dv(0, {rows, D});
    ops::cache_write(src.dv(0, {T, D}), slots.dv(0, {T}), tc);
    CHECK(cuda::index_errors(0, true) == 2);
    const std::vector<uint8_t> got = cache.device_bytes();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < D; ++i) CHECK(f32_at(got, r * D + i) == (r == 1 ? 2.0f : 1.0f));
  }
}

// ---------------------------------------------------------------- dyn_conv
TEST(dyn_conv_matches_cpu_exactly_in_place_too) {
  Device dev = test_device("dyn_conv_matches_cpu_exactly_in_place_too");
  struct DynCase {
    int64_t nb, B, H, G;
  };
  const DynCase cases[] = {{1, 1, 4, 1}, {3, 3, 12, 3}, {2, 16, 64, 8}, {2, 20, 100, 5}, {1, 9, 7168, 16}};
  int bad = 0, n = 0;
  for (const auto& c : cases) {
    for (int in_place = 0; in_place < 2; ++in_place) {
      const int64_t R = c.nb * c.B, H = c.H, G2 = 2 * c.G, dws = G2 + 7;
      Mirror x(DType::F32, R * (H + 2), dev), base(DType::F32, 2 * H + 3, dev), dyn(DType::F32, R * dws, dev),
          out(DType::F32, R * H + 1, dev);
      x.fill_normal();
      base.fill_normal();
      dyn.fill_normal();
      out.fill_f(-9.0f);
      x.upload();
      base.upload();
      dyn.upload();
      out.upload();
      for (bool device : {false, true}) {
        Tensor tx = device ? x.dv(1, {R, H}, {H + 2, 1}) : x.hv(1, {R, H}, {H + 2, 1});
        Tensor tb = device ? base.dv(0, {2, H}, {H + 3, 1}) : base.hv(0, {2, H}, {H + 3, 1});
        Tensor td = device ? dyn.dv(3, {R, G2}, {dws, 1}) : dyn.hv(3, {R, G2}, {dws, 1});
        Tensor to = in_place ? tx : device ? out.dv(1, {R, H}) : out.hv(1, {R, H});
        ops::dyn_conv(tx, tb, td, c.B, to);
      }
      const int e = compare("dyn_conv x", x) + compare("dyn_conv out", out);
      if (e) std::printf("    dyn_conv nb %lld B %lld H %lld G %lld in_place %d: %d mismatches\n", (long long)c.nb,
                         (long long)c.B, (long long)c.H, (long long)c.G, in_place, e);
      bad += e ? 1 : 0;
      ++n;
    }
  }
  std::printf("  %d dyn_conv cases, %d with mismatches\n", n, bad);
  CHECK(bad == 0);
}

// ---------------------------------------------------------------- streams, errors before launch
TEST(current_stream_is_thread_local) {
  CHECK(cuda::current_stream() == nullptr);
  auto* fake = reinterpret_cast<CUstream_st*>(uintptr_t(0x1000));
  {
    cuda::StreamScope scope(fake);
    CHECK(cuda::current_stream() == fake);
    CUstream_st* seen = fake;
    std::thread([&] { seen = cuda::current_stream(); }).join();
    CHECK(seen == nullptr);  // another thread keeps the default
  }
  CHECK(cuda::current_stream() == nullptr);
}

TEST(ops_run_on_the_current_stream) {
  if (!have_device("ops_run_on_the_current_stream")) return;
  cudaStream_t s = nullptr;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  const int64_t R = 64, D = 4096;
  std::vector<float> a(size_t(R * D)), b(size_t(R * D));
  for (size_t i = 0; i < a.size(); ++i) {
    a[i] = float(i % 97) * 0.5f;
    b[i] = float(i % 13) - 6.0f;
  }
  Device dev = Device::cuda(0);
  Tensor ta = Tensor::view(a.data(), DType::F32, {R, D}).to(dev);
  Tensor tb = Tensor::view(b.data(), DType::F32, {R, D}).to(dev);
  Tensor out = Tensor::zeros(DType::F32, {R, D}, dev);
  Tensor copy_out = Tensor::zeros(DType::F32, {D, R}, dev);
  // the uploads and memsets above ran on the legacy stream, which a non-blocking stream
  // does not wait for
  CHECK(cudaDeviceSynchronize() == cudaSuccess);
  {
    cuda::StreamScope scope(s);
    ops::add(ta, tb, out);
    ops::copy(out.transpose(0, 1), copy_out);
    CHECK(cudaStreamSynchronize(s) == cudaSuccess);
  }
  Tensor back = copy_out.to(Device::cpu());
  int bad = 0;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < D; ++i)
      bad += back.data_as<float>()[i * R + r] == a[size_t(r * D + i)] + b[size_t(r * D + i)] ? 0 : 1;
  CHECK(bad == 0);
  cudaStreamDestroy(s);
}

TEST(new_ops_reject_bad_arguments_before_launching) {
  // these fail in the host-side checks, so they need no device
  Tensor x = Tensor::zeros(DType::F32, {2, 8});
  Tensor i32 = Tensor::zeros(DType::I32, {2});
  CHECK_THROWS(cuda::add(x, x, x), "same CUDA device");
  CHECK_THROWS(cuda::silu_mul(x, x, x), "same CUDA device");
  CHECK_THROWS(cuda::copy(x, x), "same CUDA device");
  CHECK_THROWS(cuda::softmax(x, x, 1.0f), "same CUDA device");
  CHECK_THROWS(cuda::argmax(x, i32), "same CUDA device");
  CHECK_THROWS(cuda::check_finite(x, i32), "same CUDA device");
  CHECK_THROWS(cuda::gather_rows(x, i32, x), "same CUDA device");
  CHECK_THROWS(cuda::cache_write(x, i32, x), "same CUDA device");
  CHECK_THROWS(cuda::layer_norm(x, Tensor::zeros(DType::F32, {8}), Tensor(), 1e-5f, x), "same CUDA device");
  Tensor x3 = Tensor::zeros(DType::F32, {2, 1, 8});
  CHECK_THROWS(cuda::rope(x3, i32, 1e4, ops::RopeStyle::NeoX), "same CUDA device");
  CHECK_THROWS(cuda::dyn_conv(x, x, Tensor::zeros(DType::F32, {2, 2}), 1, x), "same CUDA device");
  if (cuda_device_count() == 0) CHECK_THROWS(cuda::index_errors(0, false), "does not exist");
  if (!have_device("new_ops_reject_bad_arguments_before_launching")) return;
  Device dev = Device::cuda(0);
  Tensor xd = Tensor::zeros(DType::F32, {4, 8}, dev);
  Tensor overlap = Tensor::view(xd.data(), DType::F32, {4, 8}, {4, 1}, dev, xd.owner());
  CHECK_THROWS(cuda::add(xd, xd, overlap), "rows of 'out' overlap");
  Tensor xt = xd.transpose(0, 1);
  Tensor ot = Tensor::zeros(DType::F32, {8, 4}, dev);
  CHECK_THROWS(cuda::softmax(xt, ot, 1.0f), "contiguous in its last dimension");
  CHECK_THROWS(cuda::copy(xd, ot), "same shape");
  Tensor bf = Tensor::zeros(DType::BF16, {4, 8}, dev);
  CHECK_THROWS(cuda::copy(xd, bf), "same dtype");
}

// ---------------------------------------------------------------- linear, linear_heads, embedding_shard (gemm.cu)
namespace {

// A weight of one format held twice (host and device bytes), [N, Kfull] in storage, used
// as its columns [c0, c0 + K) (a tensor-parallel column slice when c0 > 0 or K < Kfull).
struct GemmWeight {
  Mirror data, scale;
  ops::Weight host, dev;
  GemmWeight(const char* fmt, int64_t N, int64_t Kfull, int64_t c0, int64_t K, Device d)
      : data(std::string(fmt) == "fp8" ? DType::F8_E4M3
             : std::string(fmt) == "nvfp4" ? DType::U8
             : std::string(fmt) == "bf16" ? DType::BF16
             : std::string(fmt) == "f16" ? DType::F16
                                          : DType::F32,
             std::string(fmt) == "nvfp4" ? N * Kfull / 2 : N * Kfull, d),
        scale(std::string(fmt) == "nvfp4" ? DType::F8_E4M3 : DType::F32,
              std::string(fmt) == "nvfp4" ? N * Kfull / 16 : ((N + 127) / 128) * ((Kfull + 127) / 128), d) {
    const std::string f = fmt;
    if (f == "fp8") {
      data.fill_random_bytes();
      for (auto& b : data.bytes)
        if ((b & 0x7f) == 0x7f) b = 0x38;  // no NaN encodings
      for (int64_t i = 0; i < scale.n; ++i) scale.set_f(i, 0.002f + 0.001f * float(i % 7));
    } else if (f == "nvfp4") {
      data.fill_random_bytes();
      for (auto& b : scale.bytes) b = uint8_t(0x30 + gen()() % 0x18);  // positive, finite E4M3
    } else {
      data.fill_normal(0.1f);
      for (int64_t i = 0; i < scale.n; ++i) scale.set_f(i, 0.0f);
    }
    data.upload();
    scale.upload();
    for (bool device : {false, true}) {
      ops::Weight w;
      if (f == "fp8") {
        const int64_t sn = (N + 127) / 128, sk = (Kfull + 127) / 128;
        w = ops::Weight::fp8_block128(device ? data.dv(0, {N, Kfull}) : data.hv(0, {N, Kfull}),
                                      device ? scale.dv(0, {sn, sk}) : scale.hv(0, {sn, sk}), "w");
      } else if (f == "nvfp4") {
        w = ops::Weight::nvfp4(device ? data.dv(0, {N, Kfull / 2}) : data.hv(0, {N, Kfull / 2}),
                               device ? scale.dv(0, {N, Kfull / 16}) : scale.hv(0, {N, Kfull / 16}), 0.37f, 0.0f,
                               Kfull, "w");
      } else {
        w = ops::Weight::dense(device ? data.dv(0, {N, Kfull}) : data.hv(0, {N, Kfull}), "w");
      }
      if (c0 > 0 || K < Kfull) w = w.cols(c0, c0 + K);
      (device ? dev : host) = w;
    }
  }
};

// |got - want| <= 1e-5 * rms(want) + 1e-5 |want| elementwise over the whole buffer
// (elements outside the output view are sentinels, compared exactly by the same rule).
int compare_gemm(const char* what, const Mirror& m) {
  double ss = 0;
  for (int64_t i = 0; i < m.n; ++i) ss += double(f32_at(m.bytes, i)) * f32_at(m.bytes, i);
  const double rms = std::sqrt(ss / double(m.n > 0 ? m.n : 1));
  return compare(what, m, 1e-5, 1e-5 * rms);
}

}  // namespace

TEST(linear_matches_cpu_on_all_formats) {
  Device dev = test_device("linear_matches_cpu_on_all_formats");
  struct LinCase {
    int64_t M, K, N;
  };
  const LinCase dense_cases[] = {{1, 64, 32},  {3, 100, 17},  {8, 256, 96},  {17, 48, 50}, {1, 1000, 7},
                                 {4, 8, 1},    {2, 1, 3},     {1, 7, 5},     {9, 300, 70}, {13, 4100, 20},
                                 {2, 8200, 9}, {64, 512, 33}, {1, 7168, 64}, {260, 6144, 40}};
  const LinCase nvfp4_cases[] = {{1, 64, 32},    {3, 160, 17}, {7, 256, 40},   {9, 48, 5},
                                 {1, 2048, 13},  {2, 4096, 20}, {1, 8192, 30}, {40, 512, 24}};
  int bad = 0, n = 0;
  for (const char* fmt : {"f32", "bf16", "f16", "fp8", "nvfp4"}) {
    const bool nv = std::string(fmt) == "nvfp4", fp8 = std::string(fmt) == "fp8";
    std::vector<LinCase> cases;
    if (nv)
      cases.assign(std::begin(nvfp4_cases), std::end(nvfp4_cases));
    else
      cases.assign(std::begin(dense_cases), std::end(dense_cases));
    for (const LinCase& c : cases) {
      for (int variant = 0; variant < 2; ++variant) {  // 1: column slice, strided x / y rows, accumulate
        const int64_t M = c.M, K = c.K, N = c.N;
        const int64_t c0 = variant ? (nv ? 16 : fp8 ? 128 : 8) : 0;
        const int64_t Kfull = variant ? (fp8 ? K + 128 : K + c0 + (nv ? 32 : 5)) : K;
        GemmWeight w(fmt, N, Kfull, c0, K, dev);
        const int64_t ldx = variant ? K + 5 : K, xoff = variant ? 1 : 0, ldy = variant ? N + 3 : N;
        Mirror x(DType::F32, xoff + M * ldx, dev), y(DType::F32, M * ldy + 2, dev);
        x.fill_normal();
        if (variant)
          y.fill_normal();
        else
          y.fill_f(-7.0f);
        x.upload();
        y.upload();
        for (bool device : {false, true}) {
          Tensor tx = device ? x.dv(xoff, {M, K}, {ldx, 1}) : x.hv(xoff, {M, K}, {ldx, 1});
          Tensor ty = device ? y.dv(0, {M, N}, {ldy, 1}) : y.hv(0, {M, N}, {ldy, 1});
          ops::linear(tx, device ? w.dev : w.host, ty, variant == 1);
        }
        const int e = compare_gemm("linear", y);
        if (e)
          std::printf("    linear %s M %lld K %lld N %lld variant %d: %d mismatches\n", fmt, (long long)M, (long long)K,
                      (long long)N, variant, e);
        bad += e ? 1 : 0;
        ++n;
      }
    }
    // decode == verify on the device: a row computed alone is bitwise the row in a batch
    // (K = 4112 and 6144 split each column group's K over 4 blocks; M = 260: two launches)
    for (const auto& [K, M] : {std::pair<int64_t, int64_t>{272, 13}, {4112, 13}, {6144, 260}}) {
      const int64_t N = 37;
      GemmWeight w(fmt, N, K, 0, K, dev);
      Mirror x(DType::F32, M * K, dev);
      x.fill_normal();
      x.upload();
      Tensor full = Tensor::zeros(DType::F32, {M, N}, dev);
      ops::linear(x.dv(0, {M, K}), w.dev, full);
      const Tensor full_h = full.to(Device::cpu());
      int differ = 0;
      for (int64_t m = 0; m < M; ++m) {
        Tensor one = Tensor::zeros(DType::F32, {1, N}, dev);
        ops::linear(x.dv(m * K, {1, K}), w.dev, one);
        const Tensor one_h = one.to(Device::cpu());
        differ += std::memcmp(one_h.data(), full_h.data_as<float>() + m * N, size_t(N) * 4) != 0;
      }
      if (differ) std::printf("    linear %s K %lld: %d rows differ when computed alone\n", fmt, (long long)K, differ);
      bad += differ ? 1 : 0;
      ++n;
    }
  }
  std::printf("  %d linear cases, %d with mismatches\n", n, bad);
  CHECK(bad == 0);
}

TEST(linear_heads_and_embedding_shard_match_cpu) {
  Device dev = test_device("linear_heads_and_embedding_shard_match_cpu");
  int bad = 0, n = 0;
  struct HeadCase {
    int64_t T, G, N, K;
  };
  for (DType wt : {DType::F32, DType::BF16, DType::F16}) {
    for (const HeadCase& c : {HeadCase{1, 1, 1, 1}, HeadCase{3, 4, 17, 33}, HeadCase{5, 2, 64, 128},
                              HeadCase{2, 3, 7, 100}, HeadCase{9, 1, 5, 256}, HeadCase{4, 16, 128, 512}}) {
      // x: a slice of a wider projection; w rows strided; y [T, G, N]
      const int64_t xk = c.K + 9, wk = c.K + 3;
      Mirror x(DType::F32, c.T * c.G * xk, dev), w(wt, c.G * c.N * wk, dev), y(DType::F32, c.T * c.G * c.N + 2, dev);
      x.fill_normal();
      w.fill_normal(0.1f);
      y.fill_f(5.0f);
      x.upload();
      w.upload();
      y.upload();
      for (bool device : {false, true}) {
        const Tensor::Shape xs = {c.T, c.G, c.K}, xst = {c.G * xk, xk, 1}, ws = {c.G, c.N, c.K},
                            wst = {c.N * wk, wk, 1}, ys = {c.T, c.G, c.N};
        Tensor tx = device ? x.dv(5, xs, xst) : x.hv(5, xs, xst);
        Tensor tw = device ? w.dv(0, ws, wst) : w.hv(0, ws, wst);
        Tensor ty = device ? y.dv(0, ys) : y.hv(0, ys);
        ops::linear_heads(tx, tw, ty);
      }
      const int e = compare_gemm("linear_heads", y);
      if (e)
        std::printf("    linear_heads %s T %lld G %lld N %lld K %lld: %d mismatches\n", dtype_name(wt), (long long)c.T,
                    (long long)c.G, (long long)c.N, (long long)c.K, e);
      bad += e ? 1 : 0;
      ++n;
    }
  }
  // embedding_shard: exactly the CPU's rows, zeros for ids outside the shard
  for (DType tt : {DType::F32, DType::BF16, DType::F16}) {
    for (DType it : {DType::I32, DType::I64}) {
      for (int64_t D : {int64_t(1), int64_t(24), int64_t(33)}) {
        for (int64_t first : {int64_t(0), int64_t(32), int64_t(64)}) {
          const int64_t Vs = 32, T = 9, ts = D + 4, os = D + 3;
          Mirror table(tt, Vs * ts, dev), ids(it, T, dev), out(DType::F32, T * os + 1, dev);
          table.fill_normal();
          const int64_t idv[T] = {0, 95, 31, 32, 64, 7, 63, 96, 40};
          for (int64_t t = 0; t < T; ++t) ids.set_i(t, idv[t]);
          out.fill_f(-2.0f);
          table.upload();
          ids.upload();
          out.upload();
          for (bool device : {false, true}) {
            Tensor tb = device ? table.dv(0, {Vs, D}, {ts, 1}) : table.hv(0, {Vs, D}, {ts, 1});
            Tensor ti = device ? ids.dv(0, {T}) : ids.hv(0, {T});
            Tensor to = device ? out.dv(0, {T, D}, {os, 1}) : out.hv(0, {T, D}, {os, 1});
            ops::embedding_shard(tb, ti, first, to);
          }
          const int e = compare("embedding_shard", out);
          if (e)
            std::printf("    embedding_shard %s by %s D %lld first %lld: %d mismatches\n", dtype_name(tt),
                        dtype_name(it), (long long)D, (long long)first, e);
          bad += e ? 1 : 0;
          ++n;
        }
      }
    }
  }
  if (dev.is_cuda()) {  // the shard's out-of-range ids are not index errors
    cuda::index_errors(0, true);
    Tensor table = Tensor::zeros(DType::F32, {4, 8}, dev);
    std::vector<int32_t> h = {-3, 2, 9};
    Tensor ids = Tensor::view(h.data(), DType::I32, {3}).to(dev);
    Tensor out = Tensor::zeros(DType::F32, {3, 8}, dev);
    ops::embedding_shard(table, ids, 0, out);
    CHECK(cuda::index_errors(0, true) == 0);
  }
  std::printf("  %d linear_heads / embedding_shard cases, %d with mismatches\n", n, bad);
  CHECK(bad == 0);
  // host-side checks before any launch
  Tensor x = Tensor::zeros(DType::F32, {2, 8});
  CHECK_THROWS(cuda::linear(x, ops::Weight::dense(Tensor::zeros(DType::F32, {4, 8})), x, false), "same CUDA device");
  Tensor x3 = Tensor::zeros(DType::F32, {2, 1, 8});
  CHECK_THROWS(cuda::linear_heads(x3, Tensor::zeros(DType::F32, {1, 4, 8}), x3), "same CUDA device");
  CHECK_THROWS(cuda::embedding_shard(x, Tensor::zeros(DType::I32, {2}), 0, x), "same CUDA device");
}

#endif  // DFLASH2_WITH_CUDA

TEST_MAIN()
