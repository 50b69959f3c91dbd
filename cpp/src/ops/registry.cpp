// The dispatch table: one BackendTable per backend compiled in, filled once by the
// backend folders' register_*_ops().
#include "dflash2/error.h"
#include "ops/backend.h"

namespace dflash2::ops {

namespace {
struct Tables {
  BackendTable cpu, cuda;
  bool has_cuda = false;
  Tables() {
    cpu.name = "cpu";
    register_cpu_ops(cpu);
    cuda.name = "cuda";
#ifdef DFLASH2_WITH_CUDA
    register_cuda_ops(cuda);
    has_cuda = true;
#endif
  }
};
const Tables& tables() {
  static const Tables t;
  return t;
}
}  // namespace

const BackendTable& backend_table(Device dev) {
  const Tables& t = tables();
  if (dev.is_cpu()) return t.cpu;
  DFLASH2_CHECK(t.has_cuda, ErrorKind::Unsupported, "a tensor is on ", dev.str(),
                " but dflash2 was built without the CUDA backend");
  return t.cuda;
}

std::vector<std::pair<std::string, std::vector<std::string>>> op_backends() {
  const Tables& t = tables();
  std::vector<std::pair<std::string, std::vector<std::string>>> out;
  auto add = [&](const char* op, bool cpu, bool cuda) {
    std::vector<std::string> b;
    if (cpu) b.push_back("cpu");
    if (cuda && t.has_cuda) b.push_back("cuda");
    out.emplace_back(op, b);
  };
#define DFLASH2_LIST_ENTRY(op, params) add(#op, t.cpu.op != nullptr, t.cuda.op != nullptr);
  DFLASH2_BACKEND_OPS(DFLASH2_LIST_ENTRY)
#undef DFLASH2_LIST_ENTRY
  return out;
}

}  // namespace dflash2::ops
