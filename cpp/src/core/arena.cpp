#include "dflash2/arena.h"

#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>

#include "dflash2/error.h"

#ifdef DFLASH2_CUDA_EMULATED
#include <cuda_runtime.h>
namespace emu {  // cpp/emu/emu_host.h
bool memcheck_enabled();
void set_after_kernel_hook(void (*hook)(const char* kernel));
void set_graph_hook(void (*hook)(bool before));
}  // namespace emu
#endif

namespace dflash2 {

namespace {
constexpr unsigned char kCanary = 0xcd;
bool red_zones() {
#ifdef DFLASH2_CUDA_EMULATED
  return ::emu::memcheck_enabled();
#else
  return false;
#endif
}
// The arenas with red zones (EMU_MEMCHECK=2 checks them after every kernel).
std::mutex g_live_mu;
std::set<const Arena*>& live_arenas() {
  static auto* s = new std::set<const Arena*>();
  return *s;
}
}  // namespace

#ifdef DFLASH2_CUDA_EMULATED
namespace {
// Calls fn(arena) for the live arenas with red zones on this thread's device (another rank's
// thread may be allocating in its own).
template <class F>
void for_live_arenas(F fn) {
  int dev = 0;
  cudaGetDevice(&dev);
  std::lock_guard<std::mutex> g(g_live_mu);
  for (const Arena* a : live_arenas())
    if (a->device().is_cuda() && a->device().index == dev) fn(const_cast<Arena&>(*a));
}
}  // namespace

void Arena::after_kernel(const char* kernel) {
  for_live_arenas([kernel](Arena& a) {
    const std::string bad = a.bad_zone(0, true);
    if (!bad.empty()) std::fprintf(stderr, "emu: EMU_MEMCHECK=2: %s %s\n", kernel, bad.c_str());
  });
}

void Arena::graph_hook(bool before) {
  for_live_arenas([before](Arena& a) {
    if (before) {
      // what eager kernels did since the last check: reported at the next reset
      const std::string bad = a.bad_zone(0, true);
      if (!bad.empty() && a.pending_.empty()) a.pending_ = "EMU_MEMCHECK: something " + bad;
    } else {
      // the replay wrote the buffers of its capture's layout, which may cover today's red
      // zones legitimately: renew them
      for (const Zone& z : a.zones_) std::memset(a.base_ + z.off + z.bytes, kCanary, kRedZone);
    }
  });
}
#endif

Arena::~Arena() {
  if (!red_ || planning_) return;
  std::lock_guard<std::mutex> g(g_live_mu);
  live_arenas().erase(this);
}

Arena::Arena(size_t capacity, Device dev, size_t alignment)
    : device_(dev), alignment_(alignment), capacity_(capacity), red_(red_zones()) {
  DFLASH2_CHECK_ARG(alignment > 0 && (alignment & (alignment - 1)) == 0, "Arena alignment ", alignment,
                    " is not a power of two");
  if (capacity > 0) {
    Tensor block = Tensor::empty(DType::U8, {int64_t(capacity)}, dev);
    block_ = block.owner();
    base_ = static_cast<char*>(block.data());
  }
#ifdef DFLASH2_CUDA_EMULATED
  if (red_) {
    static const bool hooked = [] {
      ::emu::set_after_kernel_hook(&Arena::after_kernel);
      ::emu::set_graph_hook(&Arena::graph_hook);
      return true;
    }();
    (void)hooked;
    std::lock_guard<std::mutex> g(g_live_mu);
    live_arenas().insert(this);
  }
#endif
}

Arena Arena::planner(Device dev, size_t alignment) {
  Arena a;
  a.device_ = dev;
  a.alignment_ = alignment;
  a.planning_ = true;
  a.red_ = red_zones();
  return a;
}

Tensor Arena::alloc(DType dtype, const Tensor::Shape& shape) {
  int64_t n = 1;
  for (auto d : shape) {
    DFLASH2_CHECK_ARG(d >= 0, "Arena::alloc: negative dimension in ", shape_str(shape));
    n *= d;
  }
  size_t bytes = size_t(n) * dtype_size(dtype);
  size_t off = (used_ + alignment_ - 1) / alignment_ * alignment_;
  size_t end = off + bytes + (red_ ? kRedZone : 0);
  if (!planning_ && end > capacity_)
    fail(ErrorKind::OutOfMemory, "workspace arena on ", device_.str(), " is too small: allocating ", bytes,
         " bytes for ", dtype_name(dtype), shape_str(shape), " needs ", end, " bytes but its capacity is ",
         capacity_, " (", used_, " in use); size it with a planning pass");
  used_ = end;
  if (used_ > high_water_) high_water_ = used_;
  ++num_allocs_;
  if (red_ && !planning_) {
    // the emulated device's memory is host memory: the canaries are written and read here
    std::memset(base_ + off + bytes, kCanary, kRedZone);
    zones_.push_back({off, bytes, std::string(dtype_name(dtype)) + shape_str(shape)});
  }
  return Tensor::view(planning_ ? nullptr : base_ + off, dtype, shape, {}, device_, block_);
}

void Arena::reset(size_t mark) {
  DFLASH2_CHECK_ARG(mark <= used_, "Arena::reset to ", mark, " beyond the used size ", used_);
  if (!pending_.empty()) {
    const std::string why = pending_;
    pending_.clear();
    fail(ErrorKind::Backend, why);
  }
  if (!zones_.empty()) {
    const std::string bad = bad_zone(mark, false);
    if (!bad.empty()) fail(ErrorKind::Backend, "EMU_MEMCHECK: something ", bad);
    while (!zones_.empty() && zones_.back().off >= mark) zones_.pop_back();
  }
  used_ = mark;
}

std::string Arena::bad_zone(size_t from, bool once) const {
  for (size_t i = 0; i < zones_.size(); ++i) {
    const Zone& z = zones_[i];
    if (z.off < from || (once && z.reported)) continue;
    const unsigned char* p = reinterpret_cast<const unsigned char*>(base_ + z.off + z.bytes);
    for (size_t k = 0; k < kRedZone; ++k)
      if (p[k] != kCanary) {
        if (once) z.reported = true;
        return "wrote past the end of workspace arena tensor #" + std::to_string(i) + " (" + z.what + ", " +
               std::to_string(z.bytes) + " bytes at offset " + std::to_string(z.off) + " on " + device_.str() +
               "): byte " + std::to_string(k) + " after its end changed";
      }
  }
  return "";
}

}  // namespace dflash2
