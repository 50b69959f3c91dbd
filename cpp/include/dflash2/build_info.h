// dflash2/build_info.h: what this build contains.
#pragma once
#include <string>
#include <utility>
#include <vector>

namespace dflash2 {

struct BuildInfo {
  std::string version;
  std::vector<std::string> backends;    // "cpu", "cuda"
  std::vector<std::string> cuda_archs;  // e.g. "sm_90a", "sm_100a", "sm_103a"
  std::string cuda_version;             // toolkit version compiled against ("" without CUDA)
  // the CUDA backend built for the CPU emulator (cpp/emu, DFLASH2_CUDA_EMULATE): a test
  // harness whose "cuda" devices are the host; never a product build
  bool cuda_emulated = false;
  bool nccl = false;
  std::string nccl_version;
  bool cutlass = false;
  std::string cutlass_version;
  std::string compiler;
  std::string cpu_isa;     // what the CPU kernels dispatch to on this machine ("avx2+fma", "generic")
  std::string blas;        // which GEMM implementation and why
  std::string threading;   // "OpenMP (N threads)" / "none"
  int num_threads = 1;
  // every op of the op interface with the backends implementing it, e.g. {"rms_norm", {"cpu", "cuda"}}
  std::vector<std::pair<std::string, std::vector<std::string>>> ops;
};

BuildInfo build_info();
// The CPU backend's thread count for ops called from this thread outside an engine (<= 0:
// all cores). Engines apply their own num_threads while they run; nothing is process-wide.
void set_num_threads(int n);

}  // namespace dflash2
