// cpp/emu/emu_runtime.cpp: the CPU emulation's scheduler (CUDA threads as fibers) and the
// part of the CUDA runtime API the backend calls, over host memory. See cuda_emu.h.
//
// Devices: EMU_DEVICES (default 1) devices "Emulated GPU (sm_90)", compute capability 9.0
// (EMU_SM=100 for 10.0), 132 SMs, 227 KiB of opt-in shared memory per block,
// EMU_DEVICE_MEM bytes (default 8 GiB) of which cudaMalloc'ed bytes are used. EMU_PROFILE=1
// prints the time per kernel at exit (the slowest 25; EMU_PROFILE=all: every kernel);
// EMU_ORDER=forward runs threads in ascending order. EMU_FAIL_GRAPHS=1 (read at each call):
// every cudaGraphInstantiate fails with cudaErrorNotSupported, so tests can check the
// backend's fallback from a failed capture to eager runs. EMU_WGMMA_FAULT=1 (read at each
// wgmma wait): every wgmma adds 1 to each of its sums, so tests can check the engine's
// fallback from a failed load-time check of a wgmma kernel; EMU_MMA_FAULT=<name> (read at
// each launch) does the same to every mma.sync of the kernels whose name contains <name>.
// EMU_MEMCHECK=1: a memcheck in the manner of compute-sanitizer's, with guard pages: every
// cudaMalloc gets its own mapping, its end (rounded up to 16 bytes) against an inaccessible
// page; freed allocations stay inaccessible for a while (use after free); the launch's
// dynamic shared memory ends against an inaccessible page; each fiber stack has one below
// it. A kernel thread touching one fails its launch with a message (kernel, block, thread,
// address, which allocation and how far past its end), as a GPU's illegal-address error
// would, and the process goes on; copies and memsets past an allocation's end are refused.
// The backend's scratch and workspace arenas add their own checks on top (scratch.cu,
// core/arena.cpp: red zones; EMU_MEMCHECK=2 checks those after every kernel).
// Streams are in order by construction: every launch and copy completes before it returns,
// except while a stream captures, when launches, copies and memsets are recorded into the
// graph and run by cudaGraphLaunch. One process-wide lock serializes kernels (fibers of
// one block at a time), so `__shared__` arrays can be plain statics.
#define EMU_RUNTIME_IMPL 1
#include "cuda_emu.h"
#include "emu_host.h"

#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace emu {

ThreadCtx* g_thread = nullptr;
uint3 g_block_idx;
dim3 g_block_dim, g_grid_dim;
unsigned char* g_dyn_smem = nullptr;

namespace {

constexpr size_t kSmemOptin = 232448;  // 227 KiB, as an H100 / H200
constexpr size_t kSmemDefault = 49152;
constexpr size_t kStack = 256 * 1024;
constexpr size_t kPage = 4096;
constexpr size_t kSmemArea = (kSmemOptin + kPage - 1) / kPage * kPage;
// Shared memory: the dynamic buffer at the start (or, under EMU_MEMCHECK, ending at
// kSmemArea), then one page that EMU_MEMCHECK makes inaccessible.
alignas(4096) unsigned char g_smem_buf[kSmemArea + kPage];

bool memcheck() {
  static const bool on = [] {
    const char* e = std::getenv("EMU_MEMCHECK");
    return e && *e && *e != '0';
  }();
  return on;
}
// EMU_MEMCHECK=2: also the after-kernel hook (the workspace arenas' red zones checked after
// every kernel, naming the one that wrote past a tensor).
int memcheck_level() {
  static const int v = [] {
    const char* e = std::getenv("EMU_MEMCHECK");
    return e && *e ? std::atoi(e) : 0;
  }();
  return v;
}
void (*g_after_kernel)(const char*) = nullptr;
void (*g_graph_hook)(bool before) = nullptr;
thread_local bool tl_replaying = false;  // in cudaGraphLaunch (the after-kernel hook waits for its end)

std::recursive_mutex& kernel_lock() {
  static std::recursive_mutex m;
  return m;
}

// ------------------------------------------------------------------ fibers
// x86-64: a minimal switch (callee-saved registers, MXCSR and the x87 control word on the
// fiber's own stack; no signal-mask system call as swapcontext makes), elsewhere ucontext.
#if defined(__x86_64__)
extern "C" void emu_fiber_switch(void** save_sp, void* load_sp);
asm(R"(
.text
.globl emu_fiber_switch
.type emu_fiber_switch,@function
emu_fiber_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size emu_fiber_switch,.-emu_fiber_switch
.section .note.GNU-stack,"",@progbits
.text
)");
struct Context {
  void* sp = nullptr;
};
// A context that starts entry() on the stack [base, base + size).
inline void make_context(Context& c, char* base, size_t size, void (*entry)()) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(base) + size) & ~uintptr_t(15);
  auto* p = reinterpret_cast<uint64_t*>(top);
  *--p = 0;                                   // entry's return address (never used); entry sees rsp % 16 == 8
  *--p = reinterpret_cast<uint64_t>(entry);   // emu_fiber_switch's ret
  for (int i = 0; i < 6; ++i) *--p = 0;       // rbp rbx r12 r13 r14 r15
  uint32_t mxcsr;
  uint16_t fpucw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  *--p = uint64_t(mxcsr) | (uint64_t(fpucw) << 32);
  c.sp = p;
}
inline void switch_context(Context& from, Context& to) { emu_fiber_switch(&from.sp, to.sp); }
#else
struct Context {
  ucontext_t uc;
};
inline void make_context(Context& c, char* base, size_t size, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = base;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
inline void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

enum class St { Run, Bar, Warp, Done };
struct Copy {
  void* dst;
  const void* src;
  bool valid;
};
// A queued wgmma (wgmma_bf16_ss): done at the thread's wgmma_wait.
struct WgOp {
  float* d;
  int n;
  uint64_t da, db;
  int group;                 // commit group (Fiber::wg_open when issued)
  std::vector<float> before; // d at issue, when no earlier queued op writes d
};
struct Fiber {
  Context ctx;
  ThreadCtx t;
  St st = St::Done;
  int bar_pred = 0, bar_kind = 1, bar_out = 0;
  WarpArgs* warp = nullptr;
  std::vector<Copy> copies;
  char* stack = nullptr;
  bool pdl_entered = false;  // pdl_enter() has run
  std::vector<WgOp> wg;       // wgmmas in flight
  int wg_open = 0;            // the group the next wgmma joins
  bool wg_fenced = false;     // a wgmma_fence since the last wait
};

// Fiber stacks, kept for the next launches (under the kernel lock).
// Under EMU_MEMCHECK each stack is a mapping with an inaccessible page below it (an
// overflow faults there; the fault handler runs on its own signal stack).
std::vector<char*>& stack_pool() {
  static std::vector<char*> pool;
  return pool;
}
char* stack_for(size_t i) {
  auto& pool = stack_pool();
  while (pool.size() <= i) {
    char* p = nullptr;
    if (memcheck()) {
      void* m = mmap(nullptr, kStack + kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (m == MAP_FAILED) {
        std::fprintf(stderr, "emu: cannot map a fiber stack\n");
        std::abort();
      }
      mprotect(m, kPage, PROT_NONE);
      p = static_cast<char*>(m) + kPage;
    } else {
      p = new char[kStack];
    }
    pool.push_back(p);
  }
  return pool[i];
}

struct BlockRun {
  std::vector<Fiber> f;
  Context sched;
  Fiber* cur = nullptr;
  int pass_pos = 0;   // the running fiber's place in this pass's order
  bool rev = true;    // the pass order: threads n-1 .. 0 (EMU_ORDER=forward: 0 .. n-1)
  void (*thunk)(void*) = nullptr;
  void* payload = nullptr;
  std::string error;
  bool check_pdl = false;  // a backend kernel: every thread must begin with pdl_enter()
  bool mma_fault = false;  // EMU_MMA_FAULT names this kernel: its mma.sync sums are off by one
};
BlockRun* g_run = nullptr;

// Leaves the running fiber (its state set): straight into the next fiber of this pass that
// can run (one switch instead of two through the scheduler), or back to the scheduler when
// the pass is over.
void yield_from(Fiber* me) {
  BlockRun* r = g_run;
  const int n = int(r->f.size());
  for (int k = r->pass_pos + 1; k < n; ++k) {
    Fiber& f = r->f[size_t(r->rev ? n - 1 - k : k)];
    if (f.st != St::Run) continue;
    r->pass_pos = k;
    r->cur = &f;
    g_thread = &f.t;
    switch_context(me->ctx, f.ctx);
    return;
  }
  r->pass_pos = n;
  switch_context(me->ctx, r->sched);
}

// PDL (backend/cuda/pdl.cuh): every kernel's threads begin with detail::pdl_enter(); a
// thread that synchronizes, copies asynchronously or exits before it fails the launch.
void need_pdl_enter(const char* where) {
  BlockRun* r = g_run;
  if (!r->check_pdl || r->cur->pdl_entered || !r->error.empty()) return;
  r->error = std::string("thread ") + std::to_string(r->cur - r->f.data()) + " reached " + where +
             " before detail::pdl_enter() (backend/cuda/pdl.cuh: every kernel must begin with it)";
}

void fiber_main() {
  BlockRun* r = g_run;
  r->thunk(r->payload);
  need_pdl_enter("its end");
  Fiber* me = r->cur;
  if (!me->wg.empty() && r->error.empty())
    r->error = "thread " + std::to_string(me - r->f.data()) + " ended with " + std::to_string(me->wg.size()) +
               " wgmma(s) in flight (no wgmma.wait_group after them)";
  me->st = St::Done;
  yield_from(me);  // never resumed
  std::abort();
}

void suspend(St st) {
  Fiber* me = g_run->cur;
  me->st = st;
  yield_from(me);
}

bool reverse_order() {
  static const bool rev = [] {
    const char* e = std::getenv("EMU_ORDER");
    return !(e && std::string(e) == "forward");
  }();
  return rev;
}

uint32_t b16_of(const uint32_t* regs, int idx) { return (regs[idx / 2] >> (16 * (idx % 2))) & 0xffffu; }
float bf16_to_float(uint32_t b) {
  const uint32_t u = b << 16;
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

// Completes warp collective `op` for the lanes `lanes` (bit i: lane i of warp w), all waiting.
void complete_warp(BlockRun& r, int base, unsigned lanes) {
  Fiber* L[32] = {};
  for (int i = 0; i < 32; ++i)
    if (lanes >> i & 1u) L[i] = &r.f[base + i];
  WarpArgs* any = nullptr;
  for (int i = 0; i < 32; ++i)
    if (L[i]) any = L[i]->warp;
  const WarpOp op = any->op;
  float A[16][16], B[16][8];  // mma.sync's operands, gathered at the first lane
  bool have_ab = false;
  for (int i = 0; i < 32; ++i) {
    if (!L[i]) continue;
    WarpArgs& a = *L[i]->warp;
    const int w = a.width;
    switch (op) {
      case WarpOp::Sync: break;
      case WarpOp::ShflIdx:
      case WarpOp::ShflXor:
      case WarpOp::ShflUp:
      case WarpOp::ShflDown: {
        const int seg = i / w * w, li = i % w;
        int src = i;
        if (op == WarpOp::ShflIdx) src = seg + (a.param % w + w) % w;
        if (op == WarpOp::ShflXor) src = seg + ((li ^ a.param) % w);
        if (op == WarpOp::ShflUp) src = li >= a.param ? i - a.param : i;
        if (op == WarpOp::ShflDown) src = li + a.param < w ? i + a.param : i;
        a.out[0] = (src >= 0 && src < 32 && L[src]) ? L[src]->warp->in[0] : a.in[0];
        break;
      }
      case WarpOp::Ballot:
      case WarpOp::Any:
      case WarpOp::All: {
        unsigned bits = 0;
        for (int j = 0; j < 32; ++j)
          if (L[j] && L[j]->warp->in[0]) bits |= 1u << j;
        a.out[0] = op == WarpOp::Ballot ? bits : op == WarpOp::Any ? (bits != 0) : (bits == lanes);
        break;
      }
      case WarpOp::MatchAny: {
        unsigned bits = 0;
        for (int j = 0; j < 32; ++j)
          if (L[j] && L[j]->warp->in[0] == a.in[0]) bits |= 1u << j;
        a.out[0] = bits;
        break;
      }
      case WarpOp::Ldsm:
      case WarpOp::LdsmT: {
        // ldmatrix .x4: lanes 8j..8j+7 hold the row addresses of matrix j; register j of
        // lane l gets row l/4, elements 2(l%4), 2(l%4)+1 of matrix j (.trans: of its
        // transpose, i.e. rows 2(l%4), 2(l%4)+1 of column l/4).
        for (int j = 0; j < 4; ++j) {
          uint32_t v = 0;
          for (int h = 0; h < 2; ++h) {
            int row, col;
            if (op == WarpOp::Ldsm) {
              row = i / 4;
              col = 2 * (i % 4) + h;
            } else {
              row = 2 * (i % 4) + h;
              col = i / 4;
            }
            Fiber* src = L[8 * j + row];
            if (!src) {
              r.error = "ldmatrix: a row address comes from a lane that is not in the collective";
              return;
            }
            const uint16_t* p = static_cast<const uint16_t*>(smem_ptr(uint32_t(src->warp->in[0])));
            v |= uint32_t(p[col]) << (16 * h);
          }
          a.out[j] = v;
        }
        break;
      }
      case WarpOp::Mma: {
        // mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32, fragments per the PTX ISA (g = lane/4,
        // t = lane%4): A a0:(g, 2t..2t+1) a1:(g+8, 2t..) a2:(g, 2t+8..) a3:(g+8, 2t+8..);
        // B b0:(k 2t..2t+1, n g) b1:(k 2t+8.., n g); C c0,c1:(g, 2t..2t+1) c2,c3:(g+8, 2t..).
        // Gather A (16x16) and B (16x8) from all 32 lanes, once per collective.
        if (!have_ab) {
          have_ab = true;
          for (int l = 0; l < 32; ++l) {
            if (!L[l]) {
              r.error = "mma.sync: not all 32 lanes take part";
              return;
            }
            const int g = l / 4, t = l % 4;
            uint32_t ar[4], br[2];
            for (int q = 0; q < 4; ++q) ar[q] = uint32_t(L[l]->warp->in[q]);
            br[0] = uint32_t(L[l]->warp->in[4]);
            br[1] = uint32_t(L[l]->warp->in[5]);
            for (int h = 0; h < 2; ++h) {
              A[g][2 * t + h] = bf16_to_float(b16_of(ar, 0 + h));
              A[g + 8][2 * t + h] = bf16_to_float(b16_of(ar, 2 + h));
              A[g][2 * t + 8 + h] = bf16_to_float(b16_of(ar, 4 + h));
              A[g + 8][2 * t + 8 + h] = bf16_to_float(b16_of(ar, 6 + h));
              B[2 * t + h][g] = bf16_to_float(b16_of(br, 0 + h));
              B[2 * t + 8 + h][g] = bf16_to_float(b16_of(br, 2 + h));
            }
          }
        }
        const int g = i / 4, t = i % 4;
        const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
        for (int q = 0; q < 4; ++q) {
          float c;
          const uint32_t cb = uint32_t(a.in[6 + q]);
          std::memcpy(&c, &cb, 4);
          float s = 0.0f;
          for (int k = 0; k < 16; ++k) s += A[rows[q]][k] * B[k][cols[q]];
          const float d = c + s + (r.mma_fault ? 1.0f : 0.0f);
          uint32_t db;
          std::memcpy(&db, &d, 4);
          a.out[q] = db;
        }
        break;
      }
    }
  }
}

void describe(BlockRun& r, std::string& out) {
  int counts[4] = {};
  for (auto& f : r.f) counts[int(f.st)]++;
  out += " (threads: " + std::to_string(counts[1]) + " at __syncthreads, " + std::to_string(counts[2]) +
         " in warp collectives, " + std::to_string(counts[3]) + " exited";
  for (size_t i = 0; i < r.f.size(); ++i)
    if (r.f[i].st == St::Warp) {
      out += "; first waiting lane: thread " + std::to_string(i) + " op " + std::to_string(int(r.f[i].warp->op)) +
             " mask " + std::to_string(r.f[i].warp->mask);
      break;
    }
  out += ")";
}

// Runs all threads of one block; returns false with r.error on a deadlock or a bad collective.
bool run_block(BlockRun& r, int n) {
  std::vector<std::unique_ptr<char[]>> keep;
  for (int i = 0; i < n; ++i) {
    Fiber& f = r.f[i];
    f.st = St::Run;
    f.copies.clear();
    f.warp = nullptr;
    f.pdl_entered = false;
    f.wg.clear();
    f.wg_open = 0;
    f.wg_fenced = false;
    const unsigned bx = g_block_dim.x, by = g_block_dim.y;
    f.t.tid = make_uint3(unsigned(i) % bx, unsigned(i) / bx % by, unsigned(i) / (bx * by));
    if (!f.stack) f.stack = stack_for(size_t(i));
    // each fiber's stack top at its own offset (0..255 cache lines down): the stacks are
    // separate 256 KiB allocations, and tops at one offset mod 4 KiB would all fall in the
    // same L1 set, every switch evicting the previous fibers' frames
    make_context(f.ctx, f.stack, kStack - size_t(i * 37 % 256) * 64, fiber_main);
  }
  r.rev = reverse_order();
  for (;;) {
    // one pass: the runnable fibers in order, each handing over to the next (yield_from)
    for (int k = 0; k < n; ++k) {
      Fiber& f = r.f[size_t(r.rev ? n - 1 - k : k)];
      if (f.st != St::Run) continue;
      r.pass_pos = k;
      r.cur = &f;
      g_thread = &f.t;
      switch_context(r.sched, f.ctx);
      break;
    }
    if (!r.error.empty()) return false;
    int live = 0, at_bar = 0;
    for (int i = 0; i < n; ++i) {
      if (r.f[i].st != St::Done) ++live;
      if (r.f[i].st == St::Bar) ++at_bar;
    }
    if (live == 0) return true;
    bool released = false;
    // Warp collectives whose lanes have all arrived.
    for (int base = 0; base < n; base += 32) {
      unsigned handled = 0;
      for (int i = base; i < std::min(n, base + 32); ++i) {
        Fiber& f = r.f[i];
        if (f.st != St::Warp || (handled >> (i - base) & 1u)) continue;
        const unsigned mask = f.warp->mask;
        if (!(mask >> (i - base) & 1u)) {
          r.error = "a warp collective's mask leaves out its own lane (thread " + std::to_string(i) + ")";
          return false;
        }
        unsigned lanes = 0;
        bool ready = true;
        for (int j = 0; j < 32; ++j) {
          if (!(mask >> j & 1u)) continue;
          const int t = base + j;
          if (t >= n) continue;  // a partial last warp
          Fiber& o = r.f[t];
          if (o.st == St::Done) {
            r.error = "a warp collective (op " + std::to_string(int(f.warp->op)) + ") waits for lane " +
                      std::to_string(j) + " of warp " + std::to_string(base / 32) + ", which has exited";
            return false;
          }
          if (o.st != St::Warp) {
            ready = false;
            break;
          }
          if (o.warp->op != f.warp->op || o.warp->mask != mask) {
            r.error = "lanes of warp " + std::to_string(base / 32) + " meet in different warp collectives (ops " +
                      std::to_string(int(f.warp->op)) + " and " + std::to_string(int(o.warp->op)) + ", masks " +
                      std::to_string(mask) + " and " + std::to_string(o.warp->mask) + ")";
            return false;
          }
          lanes |= 1u << j;
        }
        if (!ready) continue;
        complete_warp(r, base, lanes);
        if (!r.error.empty()) return false;
        for (int j = 0; j < 32; ++j)
          if (lanes >> j & 1u) r.f[base + j].st = St::Run;
        handled |= lanes;
        released = true;
      }
    }
    if (!released && at_bar == live) {
      int any = 0, all = 1, count = 0;
      for (int i = 0; i < n; ++i)
        if (r.f[i].st == St::Bar) {
          any |= r.f[i].bar_pred;
          all &= r.f[i].bar_pred;
          count += r.f[i].bar_pred;
        }
      for (int i = 0; i < n; ++i)
        if (r.f[i].st == St::Bar) {
          r.f[i].bar_out = r.f[i].bar_kind == 2 ? all : r.f[i].bar_kind == 3 ? count : any;
          r.f[i].st = St::Run;
        }
      released = true;
    }
    if (!released) {
      r.error = "deadlock: no barrier or warp collective can complete";
      describe(r, r.error);
      return false;
    }
  }
}

// kind 1: or, 2: and, 3: count, computed when the barrier releases.
int sync_reduce(int pred, int kind) {
  need_pdl_enter("a barrier");
  Fiber* me = g_run->cur;
  me->bar_pred = pred != 0 ? 1 : 0;
  me->bar_kind = kind;
  suspend(St::Bar);
  return me->bar_out;
}

}  // namespace

// ------------------------------------------------------------------ device side
void syncthreads() { sync_reduce(1, 1); }
int syncthreads_or(int pred) { return sync_reduce(pred, 1); }
int syncthreads_and(int pred) { return sync_reduce(pred, 2); }
int syncthreads_count(int pred) { return sync_reduce(pred, 3); }

void warp_collective(WarpArgs& a) {
  need_pdl_enter("a warp collective");
  BlockRun* r = g_run;
  Fiber* me = r->cur;
  me->warp = &a;
  suspend(St::Warp);
  me->warp = nullptr;
}

uint32_t smem_addr(const void* p) {
  return uint32_t(reinterpret_cast<uintptr_t>(p) - reinterpret_cast<uintptr_t>(g_smem_buf));
}
void* smem_ptr(uint32_t a) { return g_smem_buf + int64_t(int32_t(a)); }

void pdl_enter() { g_run->cur->pdl_entered = true; }

// ------------------------------------------------------------------ wgmma
uint32_t wgmma_operand_addr(uint64_t desc, int row, int k, const char** why) {
  const uint32_t start = uint32_t(desc & 0x3FFFu) << 4, lbo = uint32_t((desc >> 16) & 0x3FFFu) << 4,
                 sbo = uint32_t((desc >> 32) & 0x3FFFu) << 4, base = uint32_t((desc >> 49) & 7u),
                 mode = uint32_t(desc >> 62);
  if (base != 0) {
    *why = "a matrix descriptor with a base offset (not emulated)";
    return ~0u;
  }
  if (mode == 0) {  // no swizzle: core matrices of 8 rows x 16 bytes, LBO between k-neighbours
    return start + uint32_t(row / 8) * sbo + uint32_t(k / 8) * lbo + uint32_t(row % 8) * 16 + uint32_t(k % 8) * 2;
  }
  if (mode == 1) {  // 128-byte swizzle: rows of 128 bytes, 8-row groups SBO apart, then the XOR
    const uint32_t a = start + uint32_t(row / 8) * sbo + uint32_t(row % 8) * 128 + uint32_t(k) * 2;
    return a ^ (((a >> 7) & 7u) << 4);
  }
  *why = "a matrix descriptor with the 32- or 64-byte swizzle (not emulated)";
  return ~0u;
}

namespace {
std::string thread_name(const BlockRun* r, const Fiber* f) { return "thread " + std::to_string(f - r->f.data()); }
// Does op q of thread f: f's elements of d += A * B, the products summed in fp32 in k order
// (plus 1 with `fault`: EMU_WGMMA_FAULT=1, a wgmma that computes wrong sums, for the tests of
// the engine's load-time check).
void wgmma_do(BlockRun* r, Fiber* f, const WgOp& q, bool fault) {
  if (!q.before.empty() && std::memcmp(q.before.data(), q.d, q.before.size() * sizeof(float)) != 0) {
    r->error = thread_name(r, f) + ": wgmma accumulators changed while the wgmma was in flight";
    return;
  }
  const unsigned bx = g_block_dim.x, by = g_block_dim.y;
  const int linear = int(f->t.tid.x + f->t.tid.y * bx + f->t.tid.z * bx * by);
  const int t = linear % 128;  // the thread of its warpgroup
  const uint8_t* sm = static_cast<const uint8_t*>(smem_ptr(0));
  auto load = [&](uint64_t desc, int row, int k, float& v) {
    const char* why = nullptr;
    const uint32_t a = wgmma_operand_addr(desc, row, k, &why);
    if (why) {
      r->error = thread_name(r, f) + ": wgmma: " + why;
      return false;
    }
    if (a % 2 != 0 || a + 2 > kSmemArea) {
      r->error = thread_name(r, f) + ": wgmma operand address " + std::to_string(a) + " outside shared memory";
      return false;
    }
    uint16_t b;
    std::memcpy(&b, sm + a, 2);
    v = bf16_to_float(b);
    return true;
  };
  for (int v = 0; v < q.n / 2; ++v) {
    const int row = 16 * (t / 32) + (t % 32) / 4 + 8 * ((v / 2) % 2), col = 8 * (v / 4) + 2 * (t % 4) + v % 2;
    float s = 0.0f;
    for (int k = 0; k < 16; ++k) {
      float x, y;
      if (!load(q.da, row, k, x) || !load(q.db, col, k, y)) return;
      s += x * y;
    }
    q.d[v] += fault ? s + 1.0f : s;
  }
}
}  // namespace

void wgmma_fence() {
  need_pdl_enter("a wgmma fence");
  g_run->cur->wg_fenced = true;
}
void wgmma_bf16_ss(float* d, int n, uint64_t desc_a, uint64_t desc_b) {
  need_pdl_enter("a wgmma");
  BlockRun* r = g_run;
  Fiber* me = r->cur;
  if (!r->error.empty()) return;
  if ((size_t(g_block_dim.x) * g_block_dim.y * g_block_dim.z) % 128 != 0) {
    r->error = "wgmma in a block of " + std::to_string(g_block_dim.x * g_block_dim.y * g_block_dim.z) +
               " threads: not whole warpgroups of 128";
    return;
  }
  if (n % 8 != 0 || n < 8 || n > 256) {
    r->error = "wgmma: N = " + std::to_string(n) + " is not one of 8, 16, .. 256";
    return;
  }
  if (!me->wg_fenced) {
    r->error = thread_name(r, me) + ": wgmma without a wgmma.fence since the thread's last wait";
    return;
  }
  WgOp q{d, n, desc_a, desc_b, me->wg_open, {}};
  bool pending = false;
  for (const WgOp& o : me->wg) pending = pending || o.d == d;
  if (!pending) q.before.assign(d, d + n / 2);
  me->wg.push_back(std::move(q));
}
void wgmma_commit() {
  need_pdl_enter("a wgmma commit");
  ++g_run->cur->wg_open;
}
void wgmma_wait(int pending) {
  need_pdl_enter("a wgmma wait");
  BlockRun* r = g_run;
  Fiber* me = r->cur;
  me->wg_fenced = false;
  const char* fault_env = std::getenv("EMU_WGMMA_FAULT");  // read at each wait
  const bool fault = fault_env && std::string(fault_env) == "1";
  size_t done = 0;
  for (const WgOp& q : me->wg) {
    if (q.group >= me->wg_open) {
      r->error = thread_name(r, me) + ": wgmma.wait_group with wgmmas not yet committed";
      return;
    }
    if (q.group >= me->wg_open - pending) break;  // the newest `pending` groups stay in flight
    if (r->error.empty()) wgmma_do(r, me, q, fault);
    ++done;
  }
  me->wg.erase(me->wg.begin(), me->wg.begin() + std::ptrdiff_t(done));
}

void cp_async16(uint32_t dst, const void* src, bool valid) {
  need_pdl_enter("an async copy");
  g_run->cur->copies.push_back({smem_ptr(dst), src, valid});
}
void cp_async_commit() {}
void cp_async_wait_all() {
  Fiber* me = g_run->cur;
  for (const Copy& c : me->copies) {
    if (c.valid)
      std::memcpy(c.dst, c.src, 16);
    else
      std::memset(c.dst, 0, 16);
  }
  me->copies.clear();
}

// ------------------------------------------------------------------ host side state
namespace {

struct DevState {
  size_t used = 0;
};
struct Alloc {
  size_t bytes;
  int device;
};
// A captured op's node (cudaGraphNode_t): the ops of a capture form a chain, each node
// depending on the one before it; graph.cu's PDL pass may make a kernel -> kernel edge
// programmatic (removed, then added back with that type: the emulator runs it as before).
struct GraphNode {
  const void* func = nullptr;  // the kernel (null: a copy, a memset, a host function, ...)
  GraphNode* prev = nullptr;   // the node it depends on (null: the first)
  bool edge = true;            // that dependency is present
  bool programmatic = false;   // ... and programmatic
};
struct Graph {
  std::vector<std::function<void()>> ops;
  std::vector<std::shared_ptr<GraphNode>> nodes;  // ops[i]'s node
};
struct StreamState {
  bool capturing = false;
  Graph* graph = nullptr;
  int device = 0;
  // the capture in progress: its id (events recorded in it carry it), the thread and mode
  // it began with, and whether a call broke CUDA's stream-capture rules (with the call)
  uint64_t capture_id = 0;
  std::thread::id capture_thread;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  std::string invalidated;
};

std::mutex& host_lock() {
  static std::mutex m;
  return m;
}
std::map<void*, Alloc>& allocs() {
  static std::map<void*, Alloc> m;
  return m;
}
std::map<const void*, int>& smem_attr() {
  static std::map<const void*, int> m;
  return m;
}
int n_devices() {
  static const int n = [] {
    const char* e = std::getenv("EMU_DEVICES");
    return e ? std::max(0, std::atoi(e)) : 1;
  }();
  return n;
}
int sm_version() {
  static const int v = [] {
    const char* e = std::getenv("EMU_SM");
    return e ? std::atoi(e) : 90;
  }();
  return v;
}
size_t device_mem() {
  static const size_t v = [] {
    const char* e = std::getenv("EMU_DEVICE_MEM");
    return e ? size_t(std::strtoull(e, nullptr, 10)) : (size_t(8) << 30);
  }();
  return v;
}
std::vector<DevState>& devs() {
  static std::vector<DevState> d(size_t(std::max(1, n_devices())));
  return d;
}
thread_local int tl_device = 0;
thread_local cudaError_t tl_error = cudaSuccess;
StreamState g_legacy;
std::map<cudaStream_t, StreamState*>& streams() {
  static std::map<cudaStream_t, StreamState*> m;
  return m;
}
// The stream the call names: nullptr / cudaStreamLegacy / cudaStreamPerThread = legacy.
StreamState* stream_of(cudaStream_t s) {
  std::lock_guard<std::mutex> g(host_lock());
  auto it = streams().find(s);
  return it == streams().end() ? &g_legacy : it->second;
}
cudaError_t set_error(cudaError_t e) {
  if (e != cudaSuccess) tl_error = e;
  return e;
}
// Marks `st`'s capture broken by `why` (the first violation is the one reported, as a GPU
// reports the first). Under host_lock.
void invalidate_locked(StreamState* st, const std::string& why) {
  if (!st->capturing || !st->invalidated.empty()) return;
  st->invalidated = why;
  std::fprintf(stderr, "emu: %s: the capture is invalidated, as on a GPU\n", why.c_str());
}
// CUDA's stream-capture rules (the programming guide's "Prohibited and Unhandled
// Operations"; cudaThreadExchangeStreamCaptureMode): while a capture that is not in relaxed
// mode is in progress, a potentially unsafe call (one that allocates, frees or synchronizes
// outside the stream order: cudaMalloc, cudaFree, synchronous copies and memsets, the
// synchronize calls) from its thread -- from any thread for a capture in global mode --
// fails with cudaErrorStreamCaptureUnsupported and invalidates that capture, whose
// cudaStreamEndCapture then returns cudaErrorStreamCaptureInvalidated. Returns whether
// `call` broke a capture (said on stderr, as the first violation is what a GPU reports).
bool unsafe_during_capture(const char* call) {
  std::lock_guard<std::mutex> g(host_lock());
  bool broke = false;
  for (auto& kv : streams()) {
    StreamState* st = kv.second;
    if (!st->capturing || st->mode == cudaStreamCaptureModeRelaxed) continue;
    if (st->mode == cudaStreamCaptureModeThreadLocal && st->capture_thread != std::this_thread::get_id()) continue;
    invalidate_locked(st, std::string(call) + " while a stream capture is in progress (cudaErrorStreamCaptureUnsupported)");
    broke = true;
  }
  return broke;
}
// A capture that broke a rule: the call's error, the capture invalidated (see above).
cudaError_t break_capture(StreamState* st, cudaError_t e, const std::string& why) {
  {
    std::lock_guard<std::mutex> g(host_lock());
    invalidate_locked(st, why);
  }
  return set_error(e);
}
// EMU_PROFILE=1: each kernel's launches, blocks, threads and wall time, printed (slowest
// first) to stderr at exit: where the emulator spends its time.
struct KernelStats {
  uint64_t launches = 0, blocks = 0, threads = 0;
  double seconds = 0;
};
// launches run eagerly vs by a graph replay (a GPU pays the host's launch cost for the former)
uint64_t g_eager_launches = 0, g_replayed_launches = 0;
bool profiling() {
  static const bool on = [] {
    const char* e = std::getenv("EMU_PROFILE");
    return e && *e && *e != '0';
  }();
  return on;
}
std::map<std::string, KernelStats>& kernel_stats() {
  static auto* m = new std::map<std::string, KernelStats>;  // never destroyed: read at exit
  return *m;
}
void print_profile() {
  std::vector<std::pair<std::string, KernelStats>> v(kernel_stats().begin(), kernel_stats().end());
  std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.second.seconds > b.second.seconds; });
  double total = 0;
  for (const auto& e : v) total += e.second.seconds;
  std::fprintf(stderr, "emu: %.2f s in kernels (%llu launches eager, %llu by graph replays); slowest first:\n",
               total, (unsigned long long)g_eager_launches, (unsigned long long)g_replayed_launches);
  const char* e = std::getenv("EMU_PROFILE");
  const size_t shown = e && std::string(e) == "all" ? v.size() : 25;  // EMU_PROFILE=all: every kernel
  for (size_t i = 0; i < v.size() && i < shown; ++i) {
    const KernelStats& k = v[i].second;
    std::fprintf(stderr, "emu: %8.3f s %7llu launches %9llu blocks %11llu threads  %.160s\n", k.seconds,
                 (unsigned long long)k.launches, (unsigned long long)k.blocks, (unsigned long long)k.threads,
                 v[i].first.c_str());
  }
}
struct Profiled {
  const LaunchCfg& c;
  std::chrono::steady_clock::time_point t0;
  explicit Profiled(const LaunchCfg& cfg) : c(cfg) {
    if (profiling()) t0 = std::chrono::steady_clock::now();
  }
  ~Profiled() {
    if (!profiling()) return;
    static const bool registered = [] { return std::atexit(print_profile) == 0; }();
    (void)registered;
    KernelStats& k = kernel_stats()[c.name ? c.name : "?"];
    ++(tl_replaying ? g_replayed_launches : g_eager_launches);
    const uint64_t blocks = uint64_t(c.grid.x) * c.grid.y * c.grid.z;
    ++k.launches;
    k.blocks += blocks;
    k.threads += blocks * c.block.x * c.block.y * c.block.z;
    k.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
};

// Runs `op` now, or records it when `s` captures.
cudaError_t issue(cudaStream_t s, std::function<void()> op, const void* kernel = nullptr) {
  StreamState* st = stream_of(s);
  if (st->capturing) {
    Graph& g = *st->graph;
    auto node = std::make_shared<GraphNode>();
    node->func = kernel;
    node->prev = g.nodes.empty() ? nullptr : g.nodes.back().get();
    g.ops.push_back(std::move(op));
    g.nodes.push_back(std::move(node));
    return cudaSuccess;
  }
  op();
  return cudaSuccess;
}

// ------------------------------------------------------------------ EMU_MEMCHECK
// Each device allocation is one mapping: an inaccessible page, the data pages (the data
// ends 16-byte aligned against the next page), an inaccessible page. cudaFree makes the
// pages inaccessible and keeps the mapping (the last kQuarantine frees), so a stale
// pointer faults too.
struct Region {
  uintptr_t base = 0;  // the mapping
  size_t len = 0;
  uintptr_t data = 0;  // the allocation
  size_t bytes = 0;
  bool freed = false;
};
constexpr size_t kQuarantine = 4096;
std::map<uintptr_t, Region>& regions() {  // by mapping start (under host_lock)
  static auto* m = new std::map<uintptr_t, Region>;
  return *m;
}
std::vector<uintptr_t>& quarantine() {
  static auto* v = new std::vector<uintptr_t>;
  return *v;
}
const char* g_kernel_name = nullptr;  // the launch now running (fault messages)

size_t round16(size_t n) { return (std::max<size_t>(n, 1) + 15) / 16 * 16; }

void* memcheck_alloc(size_t bytes) {
  const size_t data_len = round16(bytes);
  const size_t pages = (data_len + kPage - 1) / kPage;
  const size_t len = (pages + 2) * kPage;
  void* m = mmap(nullptr, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  const auto base = reinterpret_cast<uintptr_t>(m);
  if (mprotect(reinterpret_cast<void*>(base + kPage), pages * kPage, PROT_READ | PROT_WRITE) != 0) {
    munmap(m, len);
    return nullptr;
  }
  Region r;
  r.base = base;
  r.len = len;
  r.data = base + kPage + pages * kPage - data_len;
  r.bytes = bytes;
  regions()[base] = r;
  return reinterpret_cast<void*>(r.data);
}

// Under host_lock. The allocation at `p` (from memcheck_alloc) becomes inaccessible.
void memcheck_free(void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = regions().upper_bound(a);
  if (it == regions().begin()) return;
  --it;
  Region& r = it->second;
  if (r.data != a || r.freed) return;
  // a fresh inaccessible mapping over the old one: its pages go back to the system
  mmap(reinterpret_cast<void*>(r.base), r.len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
       -1, 0);
  r.freed = true;
  quarantine().push_back(r.base);
  if (quarantine().size() > kQuarantine) {
    const uintptr_t old = quarantine().front();
    quarantine().erase(quarantine().begin());
    auto o = regions().find(old);
    if (o != regions().end()) {
      munmap(reinterpret_cast<void*>(o->second.base), o->second.len);
      regions().erase(o);
    }
  }
}

// The region whose mapping holds `a`, or nullptr (no lock: also called from the fault
// handler, where the kernel thread holds the kernel lock and no allocation is under way).
const Region* region_of(uintptr_t a) {
  auto it = regions().upper_bound(a);
  if (it == regions().begin()) return nullptr;
  --it;
  return a < it->second.base + it->second.len ? &it->second : nullptr;
}

// Where `a` is, in words.
std::string where(uintptr_t a) {
  char buf[256];
  if (const Region* r = region_of(a)) {
    if (r->freed)
      std::snprintf(buf, sizeof buf, "inside a freed %zu-byte allocation (used after cudaFree)", r->bytes);
    else
      std::snprintf(buf, sizeof buf, "offset %lld of a %zu-byte allocation at 0x%zx (%s)",
                    (long long)(int64_t(a) - int64_t(r->data)), r->bytes, size_t(r->data),
                    a >= r->data + r->bytes ? "past its end" : "before its start");
    return buf;
  }
  const auto smem = reinterpret_cast<uintptr_t>(g_smem_buf);
  if (a >= smem + kSmemArea && a < smem + kSmemArea + kPage) {
    std::snprintf(buf, sizeof buf, "offset %zu of the launch's dynamic shared memory (%zu bytes with padding to 128: "
                  "past its end)", size_t(a - reinterpret_cast<uintptr_t>(g_dyn_smem)),
                  size_t(smem + kSmemArea - reinterpret_cast<uintptr_t>(g_dyn_smem)));
    return buf;
  }
  for (char* st : stack_pool())
    if (a >= reinterpret_cast<uintptr_t>(st) - kPage && a < reinterpret_cast<uintptr_t>(st))
      return "the guard page below a thread's stack (a stack overflow: each thread has 256 KiB)";
  return "an address in no device allocation";
}

struct sigaction g_prev_segv;

void on_fault(int sig, siginfo_t* si, void* ucv) {
  const auto a = reinterpret_cast<uintptr_t>(si->si_addr);
  const char* access = "access";
  uintptr_t sp = 0;
#if defined(__x86_64__)
  const auto* uc = static_cast<const ucontext_t*>(ucv);
  access = (uc->uc_mcontext.gregs[REG_ERR] & 2) ? "write" : "read";
  sp = uintptr_t(uc->uc_mcontext.gregs[REG_RSP]);
#else
  (void)ucv;
#endif
  BlockRun* r = g_run;
  Fiber* me = r ? r->cur : nullptr;
  const bool on_fiber = me && me->stack && sp >= reinterpret_cast<uintptr_t>(me->stack) - kPage &&
                        sp < reinterpret_cast<uintptr_t>(me->stack) + kStack;
  if (on_fiber) {
    // a kernel thread: its launch fails with the reason (as a GPU reports an illegal
    // address), the block's other threads are dropped, the process goes on
    char buf[160];
    std::snprintf(buf, sizeof buf, "invalid %s at 0x%zx by thread (%u, %u, %u): ", access, size_t(a), me->t.tid.x,
                  me->t.tid.y, me->t.tid.z);
    r->error = std::string("EMU_MEMCHECK: ") + buf + where(a);
    me->st = St::Done;
    switch_context(me->ctx, r->sched);  // never resumed
  }
  // elsewhere (host code, the emulator itself): say what it was, then the previous handler
  char buf[200];
  const int n = std::snprintf(buf, sizeof buf, "emu: EMU_MEMCHECK: invalid %s at 0x%zx outside a kernel thread%s%s\n",
                              access, size_t(a), g_kernel_name ? " during kernel " : "",
                              g_kernel_name ? g_kernel_name : "");
  if (n > 0) (void)!write(2, buf, size_t(std::min(n, int(sizeof buf) - 1)));
  sigaction(sig, &g_prev_segv, nullptr);  // the access faults again, under that handler
}

// Before a launch runs: the handler (once per process) and a signal stack (once per thread).
void memcheck_arm() {
  static const bool installed = [] {
    mprotect(g_smem_buf + kSmemArea, kPage, PROT_NONE);
    struct sigaction sa {};
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;  // NODEFER: the handler never returns to a kernel thread
    sigemptyset(&sa.sa_mask);
    return sigaction(SIGSEGV, &sa, &g_prev_segv) == 0;
  }();
  (void)installed;
  thread_local bool alt = false;
  if (!alt) {
    alt = true;
    stack_t ss{};
    ss.ss_size = 1 << 16;
    ss.ss_sp = std::malloc(ss.ss_size);  // kept for the thread's life
    ss.ss_flags = 0;
    if (ss.ss_sp) sigaltstack(&ss, nullptr);
  }
}

// Copies and memsets: [p, p + n) must lie inside one live allocation when p is in one.
bool span_ok(const void* p, size_t n, const char* what) {
  if (!memcheck() || n == 0) return true;
  const auto a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> g(host_lock());
  const Region* r = region_of(a);
  if (!r || (!r->freed && a >= r->data && a + n <= r->data + r->bytes)) return true;
  const uintptr_t bad = r->freed || a < r->data ? a : std::max(a, r->data + r->bytes);  // the first byte outside
  std::fprintf(stderr, "emu: EMU_MEMCHECK: %s of %zu bytes at 0x%zx reaches %s\n", what, n, size_t(a),
               where(bad).c_str());
  return false;
}

}  // namespace

void launch(const LaunchCfg& cfg, void (*thunk)(void*), void* payload, void* (*clone)(void*), void (*drop)(void*)) {
  const uint64_t threads = uint64_t(cfg.block.x) * cfg.block.y * cfg.block.z;
  if (threads == 0 || threads > 1024 || cfg.block.z > 64 || cfg.grid.x == 0 || cfg.grid.y == 0 || cfg.grid.z == 0 ||
      cfg.grid.y > 65535 || cfg.grid.z > 65535 || uint64_t(cfg.grid.x) > 0x7fffffffull) {
    std::fprintf(stderr, "emu: invalid launch configuration grid (%u, %u, %u) block (%u, %u, %u)\n", cfg.grid.x,
                 cfg.grid.y, cfg.grid.z, cfg.block.x, cfg.block.y, cfg.block.z);
    set_error(cudaErrorInvalidConfiguration);
    return;
  }
  if (cfg.smem > kSmemDefault) {
    int allowed = 0;
    {
      std::lock_guard<std::mutex> g(host_lock());
      auto it = smem_attr().find(cfg.func);
      if (it != smem_attr().end()) allowed = it->second;
    }
    if (cfg.smem > size_t(allowed)) {
      std::fprintf(stderr, "emu: a launch asks %zu bytes of dynamic shared memory; the kernel allows %d (set "
                   "cudaFuncAttributeMaxDynamicSharedMemorySize)\n", cfg.smem, allowed);
      set_error(cudaErrorInvalidValue);
      return;
    }
  }
  const LaunchCfg c = cfg;
  void* owned = clone(payload);
  auto run = [c, thunk, owned]() {
    std::lock_guard<std::recursive_mutex> g(kernel_lock());
    Profiled prof(c);
    BlockRun r;
    const int n = int(uint64_t(c.block.x) * c.block.y * c.block.z);
    r.f.resize(size_t(n));
    r.thunk = thunk;
    r.payload = owned;
    r.check_pdl = c.backend;
    const char* mma_fault = std::getenv("EMU_MMA_FAULT");  // read at each launch
    r.mma_fault = mma_fault && *mma_fault && c.name && std::strstr(c.name, mma_fault);
    BlockRun* prev = g_run;
    g_run = &r;
    g_block_dim = c.block;
    g_grid_dim = c.grid;
    // dynamic shared memory: under EMU_MEMCHECK its end (rounded up to 128 bytes) against
    // the inaccessible page
    g_dyn_smem = memcheck() ? g_smem_buf + kSmemArea - (c.smem + 127) / 128 * 128 : g_smem_buf;
    const char* prev_name = g_kernel_name;
    g_kernel_name = c.name ? c.name : "?";
    if (memcheck()) memcheck_arm();
    for (unsigned z = 0; z < c.grid.z; ++z)
      for (unsigned y = 0; y < c.grid.y; ++y)
        for (unsigned x = 0; x < c.grid.x; ++x) {
          g_block_idx = make_uint3(x, y, z);
          std::memset(g_dyn_smem, 0xff, c.smem);  // uninitialized shared memory reads as NaN
          if (!run_block(r, n)) {
            std::fprintf(stderr, "emu: kernel %s failed in block (%u, %u, %u): %s\n", c.name ? c.name : "?", x, y, z,
                         r.error.c_str());
            set_error(cudaErrorLaunchFailure);
            g_run = prev;
            g_kernel_name = prev_name;
            return;
          }
        }
    g_run = prev;
    g_kernel_name = prev_name;
    if (g_after_kernel && memcheck_level() >= 2 && !tl_replaying) g_after_kernel(c.name ? c.name : "?");
  };
  std::shared_ptr<void> hold(owned, drop);
  issue(cfg.stream, [run, hold]() { run(); }, cfg.func ? cfg.func : reinterpret_cast<const void*>(thunk));
}

cudaError_t enqueue_host(cudaStream_t s, std::function<void()> op) {
  return issue(s, [op = std::move(op)]() {
    op();
    if (g_after_kernel && memcheck_level() >= 2 && !tl_replaying) g_after_kernel("a host reference (cutlass_ref.cpp)");
  });
}

void set_after_kernel_hook(void (*hook)(const char* kernel)) { g_after_kernel = hook; }
void set_graph_hook(void (*hook)(bool before)) { g_graph_hook = hook; }

bool memcheck_enabled() { return memcheck(); }

bool device_range(const void* p, size_t bytes, int* device) {
  std::lock_guard<std::mutex> g(host_lock());
  auto it = allocs().upper_bound(const_cast<void*>(p));
  if (it == allocs().begin()) return false;
  --it;
  const auto* base = static_cast<const unsigned char*>(it->first);
  const auto* q = static_cast<const unsigned char*>(p);
  if (q < base || q + bytes > base + it->second.bytes) return false;
  *device = it->second.device;
  return true;
}

}  // namespace emu

// ------------------------------------------------------------------ the runtime API
using emu::set_error;

extern "C" {

cudaError_t cudaGetDeviceCount(int* n) {
  *n = emu::n_devices();
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* d) {
  *d = emu::tl_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) {
  if (d < 0 || d >= emu::n_devices()) return set_error(cudaErrorInvalidDevice);
  emu::tl_device = d;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) {
  if (emu::unsafe_during_capture("cudaDeviceSynchronize")) return set_error(cudaErrorStreamCaptureUnsupported);
  return cudaSuccess;
}
cudaError_t cudaDeviceReset(void) { return cudaSuccess; }
cudaError_t cudaGetLastError(void) {
  const cudaError_t e = emu::tl_error;
  emu::tl_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError(void) { return emu::tl_error; }
const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureIsolation: return "cudaErrorStreamCaptureIsolation";
    case cudaErrorStreamCaptureWrongThread: return "cudaErrorStreamCaptureWrongThread";
    case cudaErrorCapturedEvent: return "cudaErrorCapturedEvent";
    case cudaErrorIllegalState: return "cudaErrorIllegalState";
    default: return "cudaErrorUnknown";
  }
}
const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorMemoryAllocation: return "out of memory (emulated device)";
    case cudaErrorLaunchFailure: return "unspecified launch failure (emulator: see stderr)";
    case cudaErrorNotSupported: return "operation not supported (emulator: EMU_FAIL_GRAPHS=1)";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureIsolation: return "dependency created on uncaptured work in another stream";
    case cudaErrorStreamCaptureWrongThread: return "attempt to terminate a thread-local capture sequence from another thread";
    case cudaErrorCapturedEvent: return "operation not permitted on an event last recorded in a capturing stream";
    default: return "emulated CUDA error";
  }
}
cudaError_t cudaDriverGetVersion(int* v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int* v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int d) {
  if (d < 0 || d >= emu::n_devices()) return set_error(cudaErrorInvalidDevice);
  switch (a) {
    case cudaDevAttrComputeCapabilityMajor: *v = emu::sm_version() / 10; break;
    case cudaDevAttrComputeCapabilityMinor: *v = emu::sm_version() % 10; break;
    case cudaDevAttrMultiProcessorCount: *v = 132; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *v = int(emu::kSmemOptin); break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *v = int(emu::kSmemDefault); break;
    case cudaDevAttrMaxThreadsPerBlock: *v = 1024; break;
    case cudaDevAttrWarpSize: *v = 32; break;
    case cudaDevAttrL2CacheSize: *v = 60 << 20; break;
    default: *v = 0; break;
  }
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties_v2(cudaDeviceProp* p, int d) {
  if (d < 0 || d >= emu::n_devices()) return set_error(cudaErrorInvalidDevice);
  std::memset(p, 0, sizeof(*p));
  std::snprintf(p->name, sizeof(p->name), "Emulated GPU (sm_%d, dflash2 emu)", emu::sm_version());
  p->major = emu::sm_version() / 10;
  p->minor = emu::sm_version() % 10;
  p->multiProcessorCount = 132;
  p->totalGlobalMem = emu::device_mem();
  p->sharedMemPerBlock = emu::kSmemDefault;
  p->sharedMemPerBlockOptin = emu::kSmemOptin;
  p->maxThreadsPerBlock = 1024;
  p->warpSize = 32;
  p->l2CacheSize = 60 << 20;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int d) { return cudaGetDeviceProperties_v2(p, d); }
cudaError_t cudaMemGetInfo(size_t* free_b, size_t* total_b) {
  std::lock_guard<std::mutex> g(emu::host_lock());
  const size_t used = emu::devs()[size_t(emu::tl_device)].used;
  *total_b = emu::device_mem();
  *free_b = used < *total_b ? *total_b - used : 0;
  return cudaSuccess;
}
cudaError_t cudaMalloc(void** p, size_t bytes) {
  *p = nullptr;
  if (emu::unsafe_during_capture("cudaMalloc")) return set_error(cudaErrorStreamCaptureUnsupported);
  std::lock_guard<std::mutex> g(emu::host_lock());
  auto& d = emu::devs()[size_t(emu::tl_device)];
  if (d.used + bytes > emu::device_mem()) return set_error(cudaErrorMemoryAllocation);
  void* q = emu::memcheck() ? emu::memcheck_alloc(bytes)
                            : std::aligned_alloc(256, std::max<size_t>(256, (bytes + 255) / 256 * 256));
  if (!q) return set_error(cudaErrorMemoryAllocation);
  std::memset(q, 0xa5, bytes);  // device memory starts as garbage
  emu::allocs()[q] = {bytes, emu::tl_device};
  d.used += bytes;
  *p = q;
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  if (!p) return cudaSuccess;
  if (emu::unsafe_during_capture("cudaFree")) return set_error(cudaErrorStreamCaptureUnsupported);
  std::lock_guard<std::mutex> g(emu::host_lock());
  auto it = emu::allocs().find(p);
  if (it == emu::allocs().end()) return set_error(cudaErrorInvalidValue);
  emu::devs()[size_t(it->second.device)].used -= it->second.bytes;
  emu::allocs().erase(it);
  if (emu::memcheck())
    emu::memcheck_free(p);
  else
    std::free(p);
  return cudaSuccess;
}
cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned int) {
  *p = nullptr;
  if (emu::unsafe_during_capture("cudaHostAlloc / cudaMallocHost")) return set_error(cudaErrorStreamCaptureUnsupported);
  *p = std::aligned_alloc(256, std::max<size_t>(256, (bytes + 255) / 256 * 256));
  return *p ? cudaSuccess : set_error(cudaErrorMemoryAllocation);
}
cudaError_t cudaMallocHost(void** p, size_t bytes) { return cudaHostAlloc(p, bytes, 0); }
// host memory is the device's: a mapped allocation's device pointer is its host pointer
cudaError_t cudaHostGetDevicePointer(void** dev, void* host, unsigned int) {
  if (!dev || !host) return set_error(cudaErrorInvalidValue);
  *dev = host;
  return cudaSuccess;
}
cudaError_t cudaFreeHost(void* p) {
  if (p && emu::unsafe_during_capture("cudaFreeHost")) return set_error(cudaErrorStreamCaptureUnsupported);
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind) {
  if (emu::unsafe_during_capture("cudaMemcpy (synchronous)")) return set_error(cudaErrorStreamCaptureUnsupported);
  if (!emu::span_ok(dst, n, "cudaMemcpy's destination") || !emu::span_ok(src, n, "cudaMemcpy's source"))
    return set_error(cudaErrorInvalidValue);
  if (n) std::memmove(dst, src, n);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind, cudaStream_t s) {
  if (!emu::span_ok(dst, n, "cudaMemcpyAsync's destination") || !emu::span_ok(src, n, "cudaMemcpyAsync's source"))
    return set_error(cudaErrorInvalidValue);
  return emu::issue(s, [dst, src, n]() {
    if (n) std::memmove(dst, src, n);
  });
}
cudaError_t cudaMemcpyPeer(void* dst, int, const void* src, int, size_t n) {
  if (emu::unsafe_during_capture("cudaMemcpyPeer (synchronous)")) return set_error(cudaErrorStreamCaptureUnsupported);
  if (!emu::span_ok(dst, n, "cudaMemcpyPeer's destination") || !emu::span_ok(src, n, "cudaMemcpyPeer's source"))
    return set_error(cudaErrorInvalidValue);
  if (n) std::memmove(dst, src, n);
  return cudaSuccess;
}
cudaError_t cudaDeviceCanAccessPeer(int* can, int, int) {  // host memory: every pair
  *can = 1;
  return cudaSuccess;
}
cudaError_t cudaDeviceEnablePeerAccess(int, unsigned int) { return cudaSuccess; }
cudaError_t cudaMemcpyPeerAsync(void* dst, int, const void* src, int, size_t n, cudaStream_t s) {
  if (!emu::span_ok(dst, n, "cudaMemcpyPeerAsync's destination") ||
      !emu::span_ok(src, n, "cudaMemcpyPeerAsync's source"))
    return set_error(cudaErrorInvalidValue);
  return emu::issue(s, [dst, src, n]() {
    if (n) std::memmove(dst, src, n);
  });
}
cudaError_t cudaMemset(void* dst, int v, size_t n) {
  if (emu::unsafe_during_capture("cudaMemset (synchronous)")) return set_error(cudaErrorStreamCaptureUnsupported);
  if (!emu::span_ok(dst, n, "cudaMemset")) return set_error(cudaErrorInvalidValue);
  std::memset(dst, v, n);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* dst, int v, size_t n, cudaStream_t s) {
  if (!emu::span_ok(dst, n, "cudaMemsetAsync")) return set_error(cudaErrorInvalidValue);
  return emu::issue(s, [dst, v, n]() { std::memset(dst, v, n); });
}
cudaError_t cudaMemcpyToSymbol(const void* sym, const void* src, size_t n, size_t off, cudaMemcpyKind) {
  std::memcpy(static_cast<char*>(const_cast<void*>(sym)) + off, src, n);
  return cudaSuccess;
}
cudaError_t cudaMemcpyFromSymbol(void* dst, const void* sym, size_t n, size_t off, cudaMemcpyKind) {
  std::memcpy(dst, static_cast<const char*>(sym) + off, n);
  return cudaSuccess;
}
cudaError_t cudaFuncSetAttribute(const void* f, cudaFuncAttribute a, int v) {
  if (a == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (v < 0 || size_t(v) > emu::kSmemOptin) return set_error(cudaErrorInvalidValue);
    std::lock_guard<std::mutex> g(emu::host_lock());
    emu::smem_attr()[f] = v;
  }
  return cudaSuccess;
}

// Streams, events and graphs.
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int) {
  auto* st = new emu::StreamState();
  st->device = emu::tl_device;
  // A distinct handle: the state's own address.
  *s = reinterpret_cast<cudaStream_t>(st);
  std::lock_guard<std::mutex> g(emu::host_lock());
  emu::streams()[*s] = st;
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, 0); }
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  std::lock_guard<std::mutex> g(emu::host_lock());
  auto it = emu::streams().find(s);
  if (it == emu::streams().end()) return set_error(cudaErrorInvalidValue);
  delete it->second;
  emu::streams().erase(it);
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  emu::StreamState* st = emu::stream_of(s);
  if (st->capturing)
    return emu::break_capture(st, cudaErrorStreamCaptureUnsupported, "cudaStreamSynchronize on the capturing stream");
  if (emu::unsafe_during_capture("cudaStreamSynchronize")) return set_error(cudaErrorStreamCaptureUnsupported);
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* st) {
  *st = emu::stream_of(s)->capturing ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode) {
  emu::StreamState* st = emu::stream_of(s);
  if (st == &emu::g_legacy || st->capturing) return set_error(cudaErrorStreamCaptureUnsupported);
  static std::atomic<uint64_t> next_id{0};
  std::lock_guard<std::mutex> g(emu::host_lock());
  st->capturing = true;
  st->graph = new emu::Graph();
  st->capture_id = ++next_id;
  st->capture_thread = std::this_thread::get_id();
  st->mode = mode;
  st->invalidated.clear();
  return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* g) {
  *g = nullptr;
  emu::StreamState* st = emu::stream_of(s);
  if (!st->capturing) return set_error(cudaErrorIllegalState);
  // not relaxed: the thread that began the capture ends it
  if (st->mode != cudaStreamCaptureModeRelaxed && st->capture_thread != std::this_thread::get_id())
    return set_error(cudaErrorStreamCaptureWrongThread);
  std::lock_guard<std::mutex> lock(emu::host_lock());
  st->capturing = false;
  st->capture_id = 0;
  if (!st->invalidated.empty()) {  // a rule was broken during the capture: no graph
    delete st->graph;
    st->graph = nullptr;
    return set_error(cudaErrorStreamCaptureInvalidated);
  }
  *g = reinterpret_cast<cudaGraph_t>(st->graph);
  st->graph = nullptr;
  return cudaSuccess;
}
// The node queries and edge edits graph.cu's PDL pass makes, over the chain of a capture.
cudaError_t cudaGraphGetNodes(cudaGraph_t g, cudaGraphNode_t* nodes, size_t* num) {
  if (!g || !num) return set_error(cudaErrorInvalidValue);
  const auto& ns = reinterpret_cast<emu::Graph*>(g)->nodes;
  if (nodes) {
    for (size_t i = 0; i < *num; ++i)
      nodes[i] = i < ns.size() ? reinterpret_cast<cudaGraphNode_t>(ns[i].get()) : nullptr;
    *num = std::min(*num, ns.size());
  } else {
    *num = ns.size();
  }
  return cudaSuccess;
}
cudaError_t cudaGraphNodeGetType(cudaGraphNode_t n, cudaGraphNodeType* type) {
  if (!n || !type) return set_error(cudaErrorInvalidValue);
  *type = reinterpret_cast<emu::GraphNode*>(n)->func ? cudaGraphNodeTypeKernel : cudaGraphNodeTypeHost;
  return cudaSuccess;
}
cudaError_t cudaGraphKernelNodeGetParams(cudaGraphNode_t n, cudaKernelNodeParams* p) {
  if (!n || !p || !reinterpret_cast<emu::GraphNode*>(n)->func) return set_error(cudaErrorInvalidValue);
  *p = cudaKernelNodeParams{};
  p->func = const_cast<void*>(reinterpret_cast<emu::GraphNode*>(n)->func);
  return cudaSuccess;
}
cudaError_t cudaGraphNodeGetDependencies(cudaGraphNode_t n, cudaGraphNode_t* deps, cudaGraphEdgeData* edge,
                                         size_t* num) {
  if (!n || !num) return set_error(cudaErrorInvalidValue);
  const auto* node = reinterpret_cast<emu::GraphNode*>(n);
  const size_t have = node->prev && node->edge ? 1 : 0;
  if (deps) {
    if (*num >= 1 && have) {
      deps[0] = reinterpret_cast<cudaGraphNode_t>(node->prev);
      if (edge) {
        edge[0] = cudaGraphEdgeData{};
        if (node->programmatic) {
          edge[0].from_port = cudaGraphKernelNodePortProgrammatic;
          edge[0].type = cudaGraphDependencyTypeProgrammatic;
        }
      }
    }
    *num = std::min(*num, have);
  } else {
    *num = have;
  }
  return cudaSuccess;
}
// Only the chain's own edges: removed, then added back (programmatic between two kernels).
cudaError_t cudaGraphRemoveDependencies(cudaGraph_t g, const cudaGraphNode_t* from, const cudaGraphNode_t* to,
                                        const cudaGraphEdgeData*, size_t n) {
  if (!g || (n && (!from || !to))) return set_error(cudaErrorInvalidValue);
  for (size_t i = 0; i < n; ++i) {
    auto* t = reinterpret_cast<emu::GraphNode*>(to[i]);
    if (!t->edge || t->prev != reinterpret_cast<emu::GraphNode*>(from[i])) return set_error(cudaErrorInvalidValue);
    t->edge = false;
    t->programmatic = false;
  }
  return cudaSuccess;
}
cudaError_t cudaGraphAddDependencies(cudaGraph_t g, const cudaGraphNode_t* from, const cudaGraphNode_t* to,
                                     const cudaGraphEdgeData* edge, size_t n) {
  if (!g || (n && (!from || !to))) return set_error(cudaErrorInvalidValue);
  for (size_t i = 0; i < n; ++i) {
    auto* f = reinterpret_cast<emu::GraphNode*>(from[i]);
    auto* t = reinterpret_cast<emu::GraphNode*>(to[i]);
    if (t->edge || t->prev != f) return set_error(cudaErrorNotSupported);  // the emulator keeps the chain
    const bool prog = edge && edge[i].type == cudaGraphDependencyTypeProgrammatic;
    if (prog && (!f->func || !t->func || edge[i].from_port != cudaGraphKernelNodePortProgrammatic))
      return set_error(cudaErrorInvalidValue);  // CUDA: programmatic edges join kernels, from their programmatic port
    t->edge = true;
    t->programmatic = prog;
  }
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* e, cudaGraph_t g, unsigned long long) {
  const char* fail = std::getenv("EMU_FAIL_GRAPHS");
  if (fail && std::string(fail) == "1") {  // tests of the fallback to eager runs
    *e = nullptr;
    return set_error(cudaErrorNotSupported);
  }
  for (const auto& node : reinterpret_cast<emu::Graph*>(g)->nodes)
    if (node->prev && !node->edge) {  // a dependency removed and not added back: not a chain
      *e = nullptr;
      return set_error(cudaErrorNotSupported);
    }
  *e = reinterpret_cast<cudaGraphExec_t>(new emu::Graph(*reinterpret_cast<emu::Graph*>(g)));
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s) {
  auto* g = reinterpret_cast<emu::Graph*>(e);
  // EMU_MEMCHECK: a replay writes the buffers its capture saw, which an eager step may since
  // have laid out otherwise (the arenas' red zones): the hook checks before and renews after
  const bool hook = emu::g_graph_hook && emu::memcheck() && !emu::tl_replaying;
  if (hook) emu::g_graph_hook(true);
  const bool outer = !emu::tl_replaying;
  emu::tl_replaying = true;
  cudaError_t r = cudaSuccess;
  for (auto& op : g->ops) {
    r = emu::issue(s, op);
    if (r != cudaSuccess) break;
  }
  if (outer) emu::tl_replaying = false;
  if (hook) emu::g_graph_hook(false);
  return r != cudaSuccess ? r : emu::tl_error;
}
cudaError_t cudaGraphDestroy(cudaGraph_t g) {
  delete reinterpret_cast<emu::Graph*>(g);
  return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e) {
  delete reinterpret_cast<emu::Graph*>(e);
  return cudaSuccess;
}
struct EmuEvent {
  std::chrono::steady_clock::time_point t;
  // last recorded inside a capture (its id; 0: by eager work or a graph's replay), and
  // whether as an external event record node (cudaEventRecordExternal)
  uint64_t capture = 0;
  bool external = false;
};
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) {
  *e = reinterpret_cast<cudaEvent_t>(new EmuEvent());
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete reinterpret_cast<EmuEvent*>(e);
  return cudaSuccess;
}
cudaError_t cudaEventRecordWithFlags(cudaEvent_t e, cudaStream_t s, unsigned int flags) {
  auto* ev = reinterpret_cast<EmuEvent*>(e);
  emu::StreamState* st = emu::stream_of(s);
  {
    std::lock_guard<std::mutex> g(emu::host_lock());
    ev->capture = st->capturing ? st->capture_id : 0;
    ev->external = st->capturing && (flags & cudaEventRecordExternal) != 0;
  }
  // run now, or when a graph replays its record node: then the event holds eager work
  return emu::issue(s, [ev]() {
    ev->t = std::chrono::steady_clock::now();
    ev->capture = 0;
    ev->external = false;
  });
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) { return cudaEventRecordWithFlags(e, s, 0); }
// An event last recorded inside a capture (as an internal node) stands for no eager work:
// querying, waiting on or timing it from the host is cudaErrorCapturedEvent on a GPU.
bool captured_event(cudaEvent_t e) {
  auto* ev = reinterpret_cast<EmuEvent*>(e);
  std::lock_guard<std::mutex> g(emu::host_lock());
  return ev->capture != 0 && !ev->external;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int flags) {
  auto* ev = reinterpret_cast<EmuEvent*>(e);
  emu::StreamState* st = emu::stream_of(s);
  uint64_t ev_capture = 0, st_capture = 0;
  bool capturing = false, ev_external = false;
  {
    std::lock_guard<std::mutex> g(emu::host_lock());
    ev_capture = ev->capture;
    ev_external = ev->external;
    capturing = st->capturing;
    st_capture = st->capture_id;
  }
  if (capturing) {
    // a capturing stream may wait on an event recorded in the same capture (a join), or on
    // any event as an external wait node; anything else would cross the capture's boundary
    if ((flags & cudaEventWaitExternal) || (ev_capture == st_capture && !ev_external)) return cudaSuccess;
    return emu::break_capture(st, cudaErrorStreamCaptureIsolation,
                              ev_capture ? "cudaStreamWaitEvent on an event recorded in another capture "
                                           "(cudaErrorStreamCaptureIsolation)"
                                         : "cudaStreamWaitEvent on an event recorded outside the capture "
                                           "(cudaErrorStreamCaptureIsolation; cudaEventWaitExternal makes it a node)");
  }
  if (ev_capture != 0 && !ev_external) {
    // a GPU would fork this stream into that capture; nothing in the backend does that
    std::fprintf(stderr, "emu: cudaStreamWaitEvent from a stream outside any capture on an event recorded inside "
                         "one (a capture fork): not emulated\n");
    return set_error(cudaErrorStreamCaptureUnsupported);
  }
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  if (captured_event(e)) return set_error(cudaErrorCapturedEvent);
  if (emu::unsafe_during_capture("cudaEventSynchronize")) return set_error(cudaErrorStreamCaptureUnsupported);
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
  if (captured_event(e)) return set_error(cudaErrorCapturedEvent);
  return cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b) {
  if (captured_event(a) || captured_event(b)) return set_error(cudaErrorCapturedEvent);
  *ms = std::chrono::duration<float, std::milli>(reinterpret_cast<EmuEvent*>(b)->t - reinterpret_cast<EmuEvent*>(a)->t)
            .count();
  return cudaSuccess;
}

}  // extern "C"
