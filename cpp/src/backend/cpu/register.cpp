// The CPU backend implements every op of the dispatch table (it is the oracle).
#include "backend/cpu/cpu_ops.h"
#include "ops/backend.h"

namespace dflash2::ops {
void register_cpu_ops(BackendTable& t) {
#define DFLASH2_CPU_ENTRY(op, params) t.op = &cpu::op;
  DFLASH2_BACKEND_OPS(DFLASH2_CPU_ENTRY)
#undef DFLASH2_CPU_ENTRY
}
}  // namespace dflash2::ops
