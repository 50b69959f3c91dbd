// cpp/emu/cuda_emu.h: the CPU emulation of the CUDA backend's device side (a test harness,
// never a product path). With -DDFLASH2_CUDA_EMULATE=ON the build compiles the CUDA
// backend's .cu files as C++ (after rewrite_cu.py turns `k<<<g, b, s, st>>>(args)` into
// ::emu::launch calls), force-including this header, and links emu_runtime.cpp in place of
// the CUDA runtime. Every kernel then runs on the host: each CUDA thread is a fiber, a block
// runs its fibers until all of them wait at a barrier or a warp collective, then the
// scheduler completes that barrier / collective and resumes them. So the backend's own
// kernel code, launch logic, scratch buffers and graph capture run unmodified in CI, and
// the GPU tests (tests/cpp/test_cuda_*.cpp, tests/*.py on device="cuda") check them
// against the CPU backend without a GPU.
//
// What it checks: indexing, tiling, fragment layouts of mma.sync / ldmatrix (emulated from
// the PTX ISA's tables, independently of mma_sm80.cuh's comments), shared-memory races
// that a barrier should order (fibers run in reverse thread order between barriers, so a
// reader scheduled before its writer sees stale data), cp.async groups (copies land at
// the wait, not at the issue), warp collectives waiting for lanes that exited (reported as
// a deadlock), launch configurations (block size, grid limits, dynamic shared memory above
// 48 KiB without the opt-in attribute), and CUDA's stream-capture rules (an allocation, a
// free or a synchronizing call on the capturing thread -- any thread in global mode --, a
// capturing stream's wait on an event recorded outside its capture, a host query of an event
// recorded inside one, or an end of capture on another thread fail as on a GPU, and the
// broken capture ends with cudaErrorStreamCaptureInvalidated).
// What it does not: timing, occupancy, register limits, memory-model subtleties inside a
// barrier interval beyond the one schedule, hardware transcendental approximations
// (__expf is expf), the tensor cores' internal summation order (emulated in fp32, in k
// order), CUTLASS's kernels (host references in this mode: cutlass_ref.cpp). EMU_MEMCHECK=1
// adds guard pages around allocations, shared memory and stacks (emu_runtime.cpp).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

namespace emu {

// A CUDA thread of the block being run.
struct ThreadCtx {
  uint3 tid;
};
extern ThreadCtx* g_thread;   // the running fiber's thread
extern uint3 g_block_idx;
extern dim3 g_block_dim, g_grid_dim;
extern unsigned char* g_dyn_smem;  // the launch's dynamic shared memory

// Whether EMU_MEMCHECK is on (the backend's own pools then place each request against the
// end of their buffer, so the guard page after it catches an overflow past the request).
bool memcheck_enabled();

// Synchronization points (each suspends the calling fiber).
void syncthreads();
// detail::pdl_enter (backend/cuda/pdl.cuh): the thread has waited for the launches before it.
// A thread of a backend kernel (rewrite_cu.py --backend) that reaches a barrier, a warp
// collective, an async copy or its end without it fails the launch (every kernel of the
// backend must begin with it).
void pdl_enter();
int syncthreads_or(int pred);
int syncthreads_count(int pred);
int syncthreads_and(int pred);

enum class WarpOp : int { Sync, ShflIdx, ShflXor, ShflUp, ShflDown, Ballot, Any, All, MatchAny, Ldsm, LdsmT, Mma };
// A warp collective: this lane's inputs in `in`, its result returned in `out`.
struct WarpArgs {
  WarpOp op;
  unsigned mask;
  int param;  // lane / lane mask / delta
  int width;
  uint64_t in[10];
  uint64_t out[4];
};
void warp_collective(WarpArgs& a);

// Shared memory as 32-bit addresses (__cvta_generic_to_shared): offsets from one anchor in
// the emulator's static storage, where all __shared__ arrays and the dynamic buffer live.
uint32_t smem_addr(const void* p);
void* smem_ptr(uint32_t a);
// cp.async: queued on the calling thread, performed at its next cp_async_wait_all.
void cp_async16(uint32_t dst, const void* src, bool valid);
void cp_async_commit();
void cp_async_wait_all();

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 and
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (c += a * b) as warp collectives.
inline void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4], bool trans) {
  WarpArgs a{};
  a.op = trans ? WarpOp::LdsmT : WarpOp::Ldsm;
  a.mask = 0xffffffffu;
  a.width = 32;
  a.in[0] = addr;
  warp_collective(a);
  for (int j = 0; j < 4; ++j) r[j] = uint32_t(a.out[j]);
}
inline void mma_bf16(float (&c)[4], const uint32_t (&av)[4], uint32_t b0, uint32_t b1) {
  WarpArgs a{};
  a.op = WarpOp::Mma;
  a.mask = 0xffffffffu;
  a.width = 32;
  for (int q = 0; q < 4; ++q) a.in[q] = av[q];
  a.in[4] = b0;
  a.in[5] = b1;
  for (int q = 0; q < 4; ++q) {
    uint32_t u;
    std::memcpy(&u, &c[q], 4);
    a.in[6 + q] = u;
  }
  warp_collective(a);
  for (int q = 0; q < 4; ++q) {
    const uint32_t u = uint32_t(a.out[q]);
    std::memcpy(&c[q], &u, 4);
  }
}

// wgmma (sm_90a; backend/cuda/wgmma_sm90.cuh): wgmma.mma_async m64nNk16 F32 += BF16 x BF16,
// A (64 x 16) and B (16 x N) both from shared memory through matrix descriptors (K-major; no
// swizzle or the 128-byte swizzle), queued on the calling thread and done at its
// wgmma_wait, which reads the operands then (so shared memory overwritten before the wait is
// caught as wrong data) and fails the launch if the accumulators changed in between. Each
// thread computes its own accumulator elements (the PTX ISA's D fragment: warp w % 4 of the
// warpgroup holds rows 16 (w % 4) ..). A wgmma without a wgmma_fence since the thread's last
// wait, a wait with uncommitted wgmmas, or a thread ending with wgmmas in flight fails the launch.
void wgmma_fence();
void wgmma_bf16_ss(float* d, int n, uint64_t desc_a, uint64_t desc_b);
void wgmma_commit();
void wgmma_wait(int pending);
// The shared address of element (row, k) of a K-major BF16 operand described by `desc`
// (PTX ISA, "Matrix Descriptor Format" and the canonical K-major layouts); ~0u with *why set
// for descriptors the emulator does not implement (swizzles of 32 / 64 bytes, a base offset).
uint32_t wgmma_operand_addr(uint64_t desc, int row, int k, const char** why);

// A kernel launch: runs every block now (or records it while the stream captures a graph).
struct LaunchCfg {
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  const void* func;
  const char* name;  // the kernel as the launch spells it (EMU_PROFILE, failure messages)
  bool backend = false;  // one of the backend's kernels: its threads must begin with pdl_enter()
};
// Runs body(block index) for each block; body runs the block's fibers through run_block.
void launch(const LaunchCfg& cfg, void (*thunk)(void*), void* payload, void* (*clone)(void*), void (*drop)(void*));

template <class... P>
struct KernelCall {
  void (*fn)(P...);
  std::tuple<std::decay_t<P>...> args;
};

template <class... P, class... A>
void launch_kernel(const LaunchCfg& cfg, void (*fn)(P...), A&&... a) {
  static_assert(sizeof...(P) == sizeof...(A), "kernel launched with the wrong number of arguments");
  using Call = KernelCall<P...>;
  Call call{fn, std::tuple<std::decay_t<P>...>(static_cast<std::decay_t<P>>(a)...)};
  LaunchCfg c = cfg;
  c.func = reinterpret_cast<const void*>(fn);
  launch(
      c, [](void* p) { auto* k = static_cast<Call*>(p); std::apply(k->fn, k->args); }, &call,
      [](void* p) -> void* { return new Call(*static_cast<Call*>(p)); }, [](void* p) { delete static_cast<Call*>(p); });
}

struct Launcher {
  LaunchCfg cfg;
  Launcher(dim3 g, dim3 b, size_t smem = 0, cudaStream_t s = nullptr) : cfg{g, b, smem, s, nullptr, "?"} {}
  Launcher& named(const char* n) {
    cfg.name = n;
    return *this;
  }
  Launcher& backend() {
    cfg.backend = true;
    return *this;
  }
  template <class F, class... A>
  void run(F* fn, A&&... a) {
    launch_kernel(cfg, fn, std::forward<A>(a)...);
  }
};

}  // namespace emu

#if !defined(EMU_RUNTIME_IMPL)  // the device-side spellings, for the rewritten .cu files
// ------------------------------------------------------------------ built-in variables
#define threadIdx (::emu::g_thread->tid)
#define blockIdx (::emu::g_block_idx)
#define blockDim (::emu::g_block_dim)
#define gridDim (::emu::g_grid_dim)
#define warpSize 32
#undef __noinline__
#define __noinline__
#undef __launch_bounds__
#define __launch_bounds__(...)

// __shared__ arrays are static storage: blocks run one at a time (a process-wide lock).
#undef __shared__
#define __shared__ static

// ------------------------------------------------------------------ barriers
inline void __syncthreads() { ::emu::syncthreads(); }
inline int __syncthreads_or(int p) { return ::emu::syncthreads_or(p); }
inline int __syncthreads_and(int p) { return ::emu::syncthreads_and(p); }
inline int __syncthreads_count(int p) { return ::emu::syncthreads_count(p); }
inline void __threadfence() {}
inline void __threadfence_block() {}
inline void __threadfence_system() {}

// ------------------------------------------------------------------ warp collectives
namespace emu {
template <class T>
inline uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a type over 8 bytes");
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  return u;
}
template <class T>
inline T from_bits(uint64_t u) {
  T v;
  std::memcpy(&v, &u, sizeof(T));
  return v;
}
template <class T>
inline T shfl(WarpOp op, unsigned mask, T v, int param, int width) {
  WarpArgs a{};
  a.op = op;
  a.mask = mask;
  a.param = param;
  a.width = width;
  a.in[0] = to_bits(v);
  warp_collective(a);
  return from_bits<T>(a.out[0]);
}
inline uint64_t vote(WarpOp op, unsigned mask, uint64_t v) {
  WarpArgs a{};
  a.op = op;
  a.mask = mask;
  a.width = 32;
  a.in[0] = v;
  warp_collective(a);
  return a.out[0];
}
}  // namespace emu

template <class T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  return ::emu::shfl(::emu::WarpOp::ShflIdx, mask, v, src, width);
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return ::emu::shfl(::emu::WarpOp::ShflXor, mask, v, lane_mask, width);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return ::emu::shfl(::emu::WarpOp::ShflUp, mask, v, int(delta), width);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return ::emu::shfl(::emu::WarpOp::ShflDown, mask, v, int(delta), width);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  return unsigned(::emu::vote(::emu::WarpOp::Ballot, mask, pred != 0));
}
inline int __any_sync(unsigned mask, int pred) { return int(::emu::vote(::emu::WarpOp::Any, mask, pred != 0)); }
inline int __all_sync(unsigned mask, int pred) { return int(::emu::vote(::emu::WarpOp::All, mask, pred != 0)); }
template <class T>
inline unsigned __match_any_sync(unsigned mask, T v) {
  return unsigned(::emu::vote(::emu::WarpOp::MatchAny, mask, ::emu::to_bits(v)));
}
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::emu::vote(::emu::WarpOp::Sync, mask, 0); }
inline unsigned __activemask() { return 0xffffffffu; }

// ------------------------------------------------------------------ atomics (blocks and
// fibers never run concurrently: plain read-modify-write)
template <class T>
inline T atomicAdd(T* p, T v) {
  const T old = *p;
  *p = old + v;
  return old;
}
template <class T>
inline T atomicMax(T* p, T v) {
  const T old = *p;
  *p = old < v ? v : old;
  return old;
}
template <class T>
inline T atomicMin(T* p, T v) {
  const T old = *p;
  *p = v < old ? v : old;
  return old;
}
template <class T>
inline T atomicExch(T* p, T v) {
  const T old = *p;
  *p = v;
  return old;
}
template <class T>
inline T atomicCAS(T* p, T cmp, T v) {
  const T old = *p;
  if (old == cmp) *p = v;
  return old;
}

// ------------------------------------------------------------------ intrinsics
template <class T>
inline T __ldg(const T* p) {
  return *p;
}
template <class T>
inline T __ldcg(const T* p) {  // cache-global load (past L1): host memory has no L1
  return *p;
}
inline float __uint_as_float(unsigned u) { return ::emu::from_bits<float>(u); }
inline unsigned __float_as_uint(float v) { return unsigned(::emu::to_bits(v)); }
inline float __int_as_float(int u) { return ::emu::from_bits<float>(uint32_t(u)); }
inline int __float_as_int(float v) { return int(uint32_t(::emu::to_bits(v))); }
inline double __longlong_as_double(long long u) { return ::emu::from_bits<double>(uint64_t(u)); }
inline long long __double_as_longlong(double v) { return (long long)(::emu::to_bits(v)); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline float __expf(float a) { return std::exp(a); }
inline float __logf(float a) { return std::log(a); }
inline float __fdividef(float a, float b) { return a / b; }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline int __ffsll(long long v) { return __builtin_ffsll(v); }
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz(unsigned(v)); }
inline int __clzll(long long v) { return v == 0 ? 64 : __builtin_clzll((unsigned long long)v); }
inline unsigned __brev(unsigned v) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((v >> i) & 1u) << (31 - i);
  return r;
}
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
inline unsigned __umulhi(unsigned a, unsigned b) { return unsigned((uint64_t(a) * b) >> 32); }

using std::isfinite;
using std::isinf;
using std::isnan;
// CUDA's global min / max overloads (integers and floats).
template <class A, class B>
inline std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  return C(a) < C(b) ? C(b) : C(a);
}
template <class A, class B>
inline std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  return C(b) < C(a) ? C(b) : C(a);
}

// The runtime's template conveniences that cuda_runtime.h declares for nvcc only.
template <class T>
inline cudaError_t cudaMemcpyToSymbol(const T& sym, const void* src, size_t n, size_t off = 0,
                                      cudaMemcpyKind k = cudaMemcpyHostToDevice) {
  return ::cudaMemcpyToSymbol(static_cast<const void*>(&sym), src, n, off, k);
}
template <class T>
inline cudaError_t cudaMemcpyFromSymbol(void* dst, const T& sym, size_t n, size_t off = 0,
                                        cudaMemcpyKind k = cudaMemcpyDeviceToHost) {
  return ::cudaMemcpyFromSymbol(dst, static_cast<const void*>(&sym), n, off, k);
}
template <class T>
inline cudaError_t cudaFuncSetAttribute(T* f, cudaFuncAttribute a, int v) {
  return ::cudaFuncSetAttribute(reinterpret_cast<const void*>(f), a, v);
}
#endif  // !EMU_RUNTIME_IMPL
