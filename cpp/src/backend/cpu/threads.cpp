// CPU backend threading: a per-thread width instead of OpenMP's process-wide setting, so
// that engines with different num_threads (or a thread that called set_num_threads) never
// change each other's width; and per-thread scratch buffers.
#include <omp.h>

#include <algorithm>

#include "backend/cpu/cpu_ops.h"

namespace dflash2::cpu {

namespace {
thread_local int tl_default = 0;  // set_thread_default (0: all cores)
thread_local int tl_scope = 0;    // innermost ThreadScope (0: none)
int all_cores() { return std::max(1, omp_get_num_procs()); }
}  // namespace

int threads() {
  if (tl_scope > 0) return tl_scope;
  if (tl_default > 0) return tl_default;
  return all_cores();
}
int num_threads() { return threads(); }
void set_thread_default(int n) { tl_default = n > 0 ? n : 0; }

int tl_scope_value() { return tl_scope; }
void set_tl_scope(int n) { tl_scope = n; }

float* thread_scratch(int slot, size_t n) {
  thread_local std::vector<float> bufs[4];
  std::vector<float>& b = bufs[slot];
  if (b.size() < n) b.resize(std::max(n, b.size() * 2));
  return b.data();
}

double* thread_dscratch(int slot, size_t n) {
  thread_local std::vector<double> bufs[4];
  std::vector<double>& b = bufs[slot];
  if (b.size() < n) b.resize(std::max(n, b.size() * 2));
  return b.data();
}

int32_t* thread_iscratch(int slot, size_t n) {
  thread_local std::vector<int32_t> bufs[4];
  std::vector<int32_t>& b = bufs[slot];
  if (b.size() < n) b.resize(std::max(n, b.size() * 2));
  return b.data();
}

}  // namespace dflash2::cpu

namespace dflash2::ops {
CpuThreadScope::CpuThreadScope(int n) : prev_(cpu::tl_scope_value()) {
  if (n > 0) cpu::set_tl_scope(n);
}
CpuThreadScope::~CpuThreadScope() { cpu::set_tl_scope(prev_); }
int cpu_cores() { return std::max(1, omp_get_num_procs()); }
int cpu_max_threads() { return std::max(256, 4 * cpu_cores()); }
}  // namespace dflash2::ops
