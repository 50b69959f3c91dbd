#include "dflash2/build_info.h"

#include <omp.h>

#include <sstream>

#include "backend/cpu/cpu_ops.h"
#ifdef DFLASH2_WITH_CUDA
#include "backend/cuda_api.h"
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
  return b;
}

void set_num_threads(int n) {
  if (n <= 0) n = omp_get_num_procs();
  omp_set_num_threads(n);
}

}  // namespace dflash2
