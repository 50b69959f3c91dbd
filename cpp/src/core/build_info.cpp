#include "dflash2/build_info.h"

#include <omp.h>

#include <algorithm>
#include <sstream>

#include "backend/cpu/cpu_ops.h"
#include "ops/backend.h"
#ifdef DFLASH2_WITH_CUDA
#include "backend/cuda/cuda_api.h"
#endif
#ifdef DFLASH2_WITH_NCCL
#include <nccl.h>
#endif
#ifdef DFLASH2_WITH_CUTLASS
#include <cutlass/version.h>
#endif

#ifndef DFLASH2_VERSION
#define DFLASH2_VERSION "0.0.0"
#endif

namespace dflash2 {

[[maybe_unused]] static std::vector<std::string> split_archs(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s + ";") {
    if (c == ';' || c == ',' || c == ' ') {
      if (!cur.empty()) out.push_back("sm_" + cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  return out;
}

BuildInfo build_info() {
  BuildInfo b;
  b.version = DFLASH2_VERSION;
  b.backends.push_back("cpu");
#ifdef DFLASH2_WITH_CUDA
  b.backends.push_back("cuda");
  b.cuda_archs = split_archs(DFLASH2_CUDA_ARCHS_STR);
  b.cuda_version = cuda::toolkit_version();
#endif
#ifdef DFLASH2_CUDA_EMULATED
  b.cuda_emulated = true;
#endif
#ifdef DFLASH2_WITH_NCCL
  b.nccl = true;
  b.nccl_version = std::to_string(NCCL_MAJOR) + "." + std::to_string(NCCL_MINOR) + "." + std::to_string(NCCL_PATCH);
#endif
#ifdef DFLASH2_WITH_CUTLASS
  b.cutlass = true;
  b.cutlass_version =
      std::to_string(CUTLASS_MAJOR) + "." + std::to_string(CUTLASS_MINOR) + "." + std::to_string(CUTLASS_PATCH);
#endif
  std::ostringstream cc;
#if defined(__clang__)
  cc << "clang " << __clang_major__ << "." << __clang_minor__ << "." << __clang_patchlevel__;
#elif defined(__GNUC__)
  cc << "gcc " << __GNUC__ << "." << __GNUC_MINOR__ << "." << __GNUC_PATCHLEVEL__;
#else
  cc << "unknown";
#endif
  b.compiler = cc.str();
  b.cpu_isa = cpu::gemm_isa();
  b.blas =
      "own GEMM kernels (no BLAS): weights stay in their stored format (BF16/FP8/NVFP4) and are "
      "dequantized in registers, with a fixed reduction order so one row equals the same row in a batch";
  b.num_threads = cpu::num_threads();
  b.threading = "OpenMP (" + std::to_string(b.num_threads) + " threads)";
  b.ops = ops::op_backends();
  // composite ops (built from table entries in ops.cpp)
  auto backends_of = [&](const std::string& op) {
    for (const auto& e : b.ops)
      if (e.first == op) return e.second;
    return std::vector<std::string>{};
  };
  b.ops.emplace_back("embedding", backends_of("gather_rows"));
  std::vector<std::string> mlp;
  for (const auto& be : backends_of("linear")) {
    const auto s = backends_of("silu_mul");
    if (std::find(s.begin(), s.end(), be) != s.end()) mlp.push_back(be);
  }
  b.ops.emplace_back("gated_mlp", mlp);
  return b;
}

void set_num_threads(int n) { cpu::set_thread_default(n); }

}  // namespace dflash2
