// dflash2/arena.h: workspace arena. The engine sizes its per-step workspaces once at
// start-up (a planning pass with a measuring arena), allocates one block, and each step
// bump-allocates from it and resets: the step itself allocates nothing, which keeps CPU
// runs free of allocator noise and makes the CUDA step capturable as a graph.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "dflash2/tensor.h"

namespace dflash2 {

class Arena {
 public:
  static constexpr size_t kDefaultAlignment = 256;
  // A real arena with `capacity` bytes on `dev`.
  Arena(size_t capacity, Device dev = Device::cpu(), size_t alignment = kDefaultAlignment);
  ~Arena();
  Arena(Arena&&) = default;
  Arena& operator=(Arena&&) = default;
  // A planning arena: allocations return tensors without memory (data() == nullptr) and
  // only the high-water mark is recorded. Size a real arena with planner.high_water().
  static Arena planner(Device dev = Device::cpu(), size_t alignment = kDefaultAlignment);

  Tensor alloc(DType dtype, const Tensor::Shape& shape);  // throws OutOfMemory if it does not fit
  size_t mark() const { return used_; }
  void reset(size_t mark = 0);  // frees everything allocated after `mark`
  size_t used() const { return used_; }
  size_t high_water() const { return high_water_; }
  size_t capacity() const { return capacity_; }
  bool planning() const { return planning_; }
  Device device() const { return device_; }
  size_t num_allocs() const { return num_allocs_; }

 private:
  Arena() = default;
  Device device_{};
  size_t alignment_ = kDefaultAlignment;
  size_t capacity_ = 0, used_ = 0, high_water_ = 0, num_allocs_ = 0;
  bool planning_ = false;
  std::shared_ptr<void> block_;
  char* base_ = nullptr;
  // The CPU emulation of the CUDA backend under EMU_MEMCHECK (cpp/emu): each allocation is
  // followed by a red zone of kRedZone canary bytes, checked when reset() frees it, so an op
  // that writes past the end of its arena tensor is reported (planning arenas reserve the
  // same bytes, so capacities still fit). Off in every other build.
  static constexpr size_t kRedZone = 256;
  struct Zone {
    size_t off, bytes;
    std::string what;
    mutable bool reported = false;
  };
  bool red_ = false;
  std::vector<Zone> zones_;
  std::string pending_;  // a corruption seen before a graph replay: reset() reports it
  // "" or what wrote past a zone of an allocation at offset >= from (once: skip and mark reported)
  std::string bad_zone(size_t from, bool once) const;
  static void after_kernel(const char* kernel);  // EMU_MEMCHECK=2 (emulated build only)
  static void graph_hook(bool before);           // around each graph replay (emulated build only)
};

}  // namespace dflash2
