// dflash2_embed: the smallest useful C++ program on top of the installed dflash2 package.
//
//   dflash2_embed CHECKPOINT [TENSOR]
//
// Opens a safetensors checkpoint (a .safetensors file or a directory), prints what it holds,
// RMS-normalises one tensor on the CPU (TENSOR, or the first floating-point tensor by name)
// with unit weights, and prints the build's backends. Any dflash2::Error is printed with its
// kind and message, and the exit status is non-zero.
#include <dflash2/dflash2.h>

#include <cstdio>
#include <string>
#include <vector>

namespace {

void print_build_info() {
  const dflash2::BuildInfo b = dflash2::build_info();
  std::printf("dflash2 %s\n", b.version.c_str());
  std::printf("backends:");
  for (const auto& s : b.backends) std::printf(" %s", s.c_str());
  std::printf("\n");
  if (!b.cuda_archs.empty()) {
    std::printf("cuda %s archs:", b.cuda_version.c_str());
    for (const auto& a : b.cuda_archs) std::printf(" %s", a.c_str());
    std::printf("\n");
  }
  std::string why;
  const bool ok = dflash2::cuda_available(&why);
  std::printf("cuda available: %s%s%s\n", ok ? "yes" : "no", ok ? "" : " (", ok ? "" : (why + ")").c_str());
  std::printf("cpu: %s, %s\n", b.cpu_isa.c_str(), b.threading.c_str());
}

// The tensor to normalise: `wanted` if given, else the first floating-point tensor by name.
std::string pick_tensor(const dflash2::Checkpoint& ckpt, const std::string& wanted) {
  if (!wanted.empty()) {
    const dflash2::TensorInfo& info = ckpt.info(wanted);  // throws a Checkpoint error naming it
    if (!dflash2::dtype_is_float(info.dtype))
      dflash2::fail(dflash2::ErrorKind::InvalidArgument, "tensor '", wanted, "' is ",
                    dflash2::dtype_name(info.dtype), ", not a floating-point tensor");
    return wanted;
  }
  for (const auto& name : ckpt.names())
    if (dflash2::dtype_is_float(ckpt.info(name).dtype)) return name;
  return "";
}

int run(const std::string& path, const std::string& wanted) {
  dflash2::Checkpoint ckpt = dflash2::Checkpoint::open(path);
  std::printf("checkpoint: %s\n", ckpt.path().c_str());
  std::printf("files: %zu\n", ckpt.files().size());
  std::printf("tensors: %zu\n", ckpt.names().size());
  std::printf("total bytes: %llu\n", static_cast<unsigned long long>(ckpt.total_bytes()));

  const std::string name = pick_tensor(ckpt, wanted);
  if (name.empty()) {
    std::printf("rms_norm: no floating-point tensor to normalise\n");
  } else {
    // The stored tensor (a zero-copy view of the mapped file) as F32 rows [R, D].
    const dflash2::Tensor stored = ckpt.tensor(name);
    const int64_t n = stored.numel();
    const int64_t D = stored.ndim() == 0 ? 1 : stored.shape(-1);
    const int64_t R = D > 0 ? n / D : 0;
    dflash2::Tensor x = dflash2::Tensor::empty(dflash2::DType::F32, {R, D});
    const dflash2::Tensor src = stored.contiguous();
    const char* p = static_cast<const char*>(src.data());
    for (int64_t i = 0; i < n; ++i)
      x.data_as<float>()[i] = dflash2::load_as_f32(p + i * int64_t(src.itemsize()), src.dtype());

    dflash2::Tensor w = dflash2::Tensor::empty(dflash2::DType::F32, {D});
    for (int64_t i = 0; i < D; ++i) w.data_as<float>()[i] = 1.0f;
    dflash2::Tensor out = dflash2::Tensor::empty(dflash2::DType::F32, {R, D});
    dflash2::ops::rms_norm(x, w, 1e-6f, out);

    std::printf("rms_norm %s %s -> [%lld, %lld]\n", name.c_str(), stored.describe().c_str(),
                static_cast<long long>(R), static_cast<long long>(D));
    if (R > 0 && D > 0) {
      const float* o = out.data_as<const float>();
      double ms = 0;
      for (int64_t i = 0; i < D; ++i) ms += double(o[i]) * o[i];
      std::printf("row 0:");
      for (int64_t i = 0; i < D && i < 4; ++i) std::printf(" %.6g", o[i]);
      std::printf("\nrow 0 mean square: %.6f\n", ms / double(D));
    }
  }
  print_build_info();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    std::fprintf(stderr, "usage: %s CHECKPOINT [TENSOR]\n", argc > 0 ? argv[0] : "dflash2_embed");
    return 2;
  }
  try {
    return run(argv[1], argc == 3 ? argv[2] : "");
  } catch (const dflash2::Error& e) {
    std::fprintf(stderr, "error (%s): %s\n", dflash2::error_kind_name(e.kind()), e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "unexpected error: %s\n", e.what());
    return 1;
  }
}
