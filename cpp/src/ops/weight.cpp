// Weight: a linear layer's stored weight in one of the formats the GEMM understands.
// "Checkpoint formats are data, not code paths": the format is detected from the tensors
// stored under a prefix, validated once, and the GEMM dequantizes in its inner loop.
#include <cmath>

#include "dflash2/error.h"
#include "dflash2/ops.h"
#include "dflash2/safetensors.h"

namespace dflash2::ops {

const char* weight_format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::Dense: return "dense";
    case WeightFormat::FP8Block128: return "fp8-block128";
    case WeightFormat::NVFP4: return "nvfp4";
  }
  return "?";
}

namespace {
// A weight whose logical shape is its data's [out, in] (dense, FP8 block-128).
Weight unpacked(WeightFormat fmt, Tensor w, Tensor scale, std::string name) {
  Weight r;
  r.format = fmt;
  r.data = std::move(w);
  r.scale = std::move(scale);
  r.name = std::move(name);
  DFLASH2_CHECK_ARG(r.data.defined() && r.data.ndim() == 2, "weight '", r.name, "' must be 2-D [out, in], found ",
                    r.data.describe());
  r.out_features = r.data.shape(0);
  r.in_features = r.data.shape(1);
  r.validate();
  return r;
}
}  // namespace

Weight Weight::dense(Tensor w, std::string name) {
  return unpacked(WeightFormat::Dense, std::move(w), Tensor(), std::move(name));
}

Weight Weight::fp8_block128(Tensor w, Tensor scale_inv, std::string name) {
  return unpacked(WeightFormat::FP8Block128, std::move(w), std::move(scale_inv), std::move(name));
}

Weight Weight::nvfp4(Tensor packed, Tensor block_scale, float global_scale, float input_scale, int64_t in_features,
                     std::string name) {
  Weight r;
  r.format = WeightFormat::NVFP4;
  r.data = std::move(packed);
  r.scale = std::move(block_scale);
  r.global_scale = global_scale;
  r.input_scale = input_scale;
  r.name = std::move(name);
  DFLASH2_CHECK_ARG(r.data.defined() && r.data.ndim() == 2, "weight '", r.name,
                    "' must be 2-D [out, in/2] packed E2M1, found ", r.data.describe());
  r.out_features = r.data.shape(0);
  r.in_features = in_features > 0 ? in_features : 2 * r.data.shape(1);
  r.validate();
  return r;
}

void Weight::validate() const {
  const std::string& n = name;
  DFLASH2_CHECK(data.defined() && data.ndim() == 2, ErrorKind::Checkpoint, "weight '", n, "': data must be 2-D, found ",
                data.describe());
  DFLASH2_CHECK(data.stride(1) == 1, ErrorKind::Checkpoint, "weight '", n,
                "': rows must be contiguous, found strides ", shape_str(data.strides()));
  const int64_t N = out_features, K = in_features;
  switch (format) {
    case WeightFormat::Dense:
      DFLASH2_CHECK(data.dtype() == DType::F32 || data.dtype() == DType::BF16 || data.dtype() == DType::F16,
                    ErrorKind::Checkpoint, "weight '", n, "': a dense weight must be F32, BF16 or F16, found ",
                    data.describe());
      DFLASH2_CHECK(data.shape(0) == N && data.shape(1) == K, ErrorKind::Internal, "weight '", n, "' shape");
      break;
    case WeightFormat::FP8Block128: {
      DFLASH2_CHECK(data.dtype() == DType::F8_E4M3, ErrorKind::Checkpoint, "weight '", n,
                    "': an fp8 block-128 weight must be F8_E4M3, found ", data.describe());
      const int64_t sn = (N + 127) / 128, sk = (K + 127) / 128;
      DFLASH2_CHECK(scale.defined() && scale.dtype() == DType::F32 && scale.ndim() == 2 && scale.shape(0) == sn &&
                        scale.shape(1) == sk && scale.stride(1) == 1,
                    ErrorKind::Checkpoint, "weight '", n, "': weight_scale_inv must be F32[", sn, ", ", sk,
                    "] (ceil(N/128), ceil(K/128)) for weight [", N, ", ", K, "], found ", scale.describe());
      break;
    }
    case WeightFormat::NVFP4: {
      DFLASH2_CHECK(data.dtype() == DType::U8, ErrorKind::Checkpoint, "weight '", n,
                    "': an NVFP4 weight must be U8 (two E2M1 per byte), found ", data.describe());
      DFLASH2_CHECK(K % 16 == 0 && data.shape(1) * 2 == K, ErrorKind::Checkpoint, "weight '", n,
                    "': NVFP4 needs in_features divisible by 16 and packed as [N, K/2]; found ", data.describe(),
                    " for in_features ", K);
      DFLASH2_CHECK(scale.defined() && scale.dtype() == DType::F8_E4M3 && scale.ndim() == 2 && scale.shape(0) == N &&
                        scale.shape(1) == K / 16 && scale.stride(1) == 1,
                    ErrorKind::Checkpoint, "weight '", n, "': weight_scale must be F8_E4M3[", N, ", ", K / 16,
                    "] (one per 16 inputs, row-major), found ", scale.describe());
      DFLASH2_CHECK(std::isfinite(global_scale) && global_scale > 0, ErrorKind::Checkpoint, "weight '", n,
                    "': weight_scale_2 must be a positive finite number, found ", global_scale);
      break;
    }
  }
}

Tensor Weight::dequantize() const {
  validate();
  DFLASH2_CHECK_ARG(data.device().is_cpu(), "Weight::dequantize runs on the CPU; weight '", name, "' is on ",
                    data.device().str());
  const int64_t N = out_features, K = in_features;
  Tensor out = Tensor::empty(DType::F32, {N, K});
  float* o = out.data_as<float>();
  for (int64_t r = 0; r < N; ++r) {
    const char* row = static_cast<const char*>(data.data()) + r * data.stride(0) * int64_t(data.itemsize());
    for (int64_t k = 0; k < K; ++k) {
      float v = 0.0f;
      switch (format) {
        case WeightFormat::Dense: v = load_as_f32(row + k * int64_t(data.itemsize()), data.dtype()); break;
        case WeightFormat::FP8Block128:
          v = fp8_e4m3_to_f32(uint8_t(row[k])) * scale.data_as<float>()[(r / 128) * scale.stride(0) + k / 128];
          break;
        case WeightFormat::NVFP4: {
          uint8_t byte = uint8_t(row[k / 2]);
          uint8_t nib = (k & 1) ? (byte >> 4) : (byte & 15);
          float s = fp8_e4m3_to_f32(scale.data_as<uint8_t>()[r * scale.stride(0) + k / 16]);
          v = e2m1_to_f32(nib) * s * global_scale;
          break;
        }
      }
      o[r * K + k] = v;
    }
  }
  return out;
}

namespace {
float read_scalar(const Checkpoint& ck, const std::string& name) {
  const TensorInfo& ti = ck.info(name);
  int64_t n = 1;
  for (auto d : ti.shape) n *= d;
  DFLASH2_CHECK(n == 1 && dtype_is_float(ti.dtype), ErrorKind::Checkpoint, "tensor '", name,
                "' must be a float scalar, found ", dtype_name(ti.dtype), shape_str(ti.shape), " in ", ti.file);
  Tensor t = ck.tensor(name);
  return load_as_f32(t.data(), t.dtype());
}
}  // namespace

Weight Weight::load(const Checkpoint& ck, const std::string& prefix, int64_t expected_out, int64_t expected_in) {
  const std::string wn = prefix + ".weight";
  DFLASH2_CHECK(ck.has(wn), ErrorKind::Checkpoint, "checkpoint ", ck.path(), ": missing tensor '", wn, "'");
  Tensor w = ck.tensor(wn);
  Weight r;
  if (w.dtype() == DType::F8_E4M3) {
    const std::string sn = prefix + ".weight_scale_inv";
    DFLASH2_CHECK(ck.has(sn), ErrorKind::Checkpoint, "checkpoint ", ck.path(), ": '", wn,
                  "' is F8_E4M3 but its block scales '", sn, "' are missing");
    Tensor s = ck.tensor(sn);
    if (s.dtype() == DType::BF16 || s.dtype() == DType::F16) {  // widen once at load time
      Tensor f = Tensor::empty(DType::F32, s.shape());
      const int64_t n = s.numel();
      Tensor sc = s.contiguous();
      for (int64_t i = 0; i < n; ++i)
        f.data_as<float>()[i] = load_as_f32(static_cast<const char*>(sc.data()) + i * 2, s.dtype());
      s = f;
    }
    r = fp8_block128(w, s, wn);
  } else if (w.dtype() == DType::U8) {
    const std::string sn = prefix + ".weight_scale", gn = prefix + ".weight_scale_2", in = prefix + ".input_scale";
    DFLASH2_CHECK(ck.has(sn) && ck.has(gn), ErrorKind::Checkpoint, "checkpoint ", ck.path(), ": '", wn,
                  "' is U8 (NVFP4) but ", ck.has(sn) ? "" : ("'" + sn + "' "), ck.has(gn) ? "" : ("'" + gn + "' "),
                  "missing");
    float in_scale = ck.has(in) ? read_scalar(ck, in) : 0.0f;
    r = nvfp4(w, ck.tensor(sn), read_scalar(ck, gn), in_scale, 2 * w.shape(1), wn);
  } else {
    r = dense(w, wn);
  }
  if (expected_out > 0 || expected_in > 0) {
    DFLASH2_CHECK((expected_out <= 0 || r.out_features == expected_out) &&
                      (expected_in <= 0 || r.in_features == expected_in),
                  ErrorKind::Checkpoint, "checkpoint ", ck.path(), ": '", wn, "' has logical shape [", r.out_features,
                  ", ", r.in_features, "], expected [", expected_out, ", ", expected_in, "]");
  }
  return r;
}

Weight Weight::to(Device dev) const {
  Weight w = *this;
  w.sf_blocked = Tensor();  // a device's layout: prepare again where it lands
  if (data.defined()) w.data = data.to(dev);
  if (scale.defined()) w.scale = scale.to(dev);
  return w;
}

size_t Weight::bytes() const {
  return (data.defined() ? data.nbytes() : 0) + (scale.defined() ? scale.nbytes() : 0);
}

Weight Weight::rows(int64_t begin, int64_t end) const {
  DFLASH2_CHECK_ARG(0 <= begin && begin < end && end <= out_features, "weight '", name, "': rows [", begin, ", ", end,
                    ") outside [0, ", out_features, ")");
  Weight w = *this;
  w.sf_blocked = Tensor();  // of the whole weight
  w.out_features = end - begin;
  w.data = data.slice(0, begin, end);
  if (format == WeightFormat::FP8Block128) {
    DFLASH2_CHECK(begin % 128 == 0 && (end % 128 == 0 || end == out_features), ErrorKind::Config, "weight '", name,
                  "': rows [", begin, ", ", end, ") split an fp8 block of 128 rows (tensor parallelism needs slices on ",
                  "128-row boundaries)");
    w.scale = scale.slice(0, begin / 128, (end + 127) / 128);
  } else if (format == WeightFormat::NVFP4) {
    w.scale = scale.slice(0, begin, end);
  }
  w.name = name + "[rows " + std::to_string(begin) + ":" + std::to_string(end) + "]";
  w.validate();
  return w;
}

Weight Weight::cols(int64_t begin, int64_t end) const {
  DFLASH2_CHECK_ARG(0 <= begin && begin < end && end <= in_features, "weight '", name, "': columns [", begin, ", ",
                    end, ") outside [0, ", in_features, ")");
  Weight w = *this;
  w.sf_blocked = Tensor();  // of the whole weight
  w.in_features = end - begin;
  if (format == WeightFormat::Dense) {
    w.data = data.slice(1, begin, end);
  } else if (format == WeightFormat::FP8Block128) {
    DFLASH2_CHECK(begin % 128 == 0 && (end % 128 == 0 || end == in_features), ErrorKind::Config, "weight '", name,
                  "': columns [", begin, ", ", end, ") split an fp8 block of 128 columns (tensor parallelism needs ",
                  "slices on 128-column boundaries)");
    w.data = data.slice(1, begin, end);
    w.scale = scale.slice(1, begin / 128, (end + 127) / 128);
  } else {
    DFLASH2_CHECK(begin % 16 == 0 && end % 16 == 0, ErrorKind::Config, "weight '", name, "': columns [", begin, ", ",
                  end, ") split an NVFP4 block of 16 inputs (tensor parallelism needs slices on 16-column boundaries)");
    w.data = data.slice(1, begin / 2, end / 2);
    w.scale = scale.slice(1, begin / 16, end / 16);
  }
  w.name = name + "[cols " + std::to_string(begin) + ":" + std::to_string(end) + "]";
  w.validate();
  return w;
}

}  // namespace dflash2::ops
