#include "dflash2/arena.h"

#include "dflash2/error.h"

namespace dflash2 {

Arena::Arena(size_t capacity, Device dev, size_t alignment)
    : device_(dev), alignment_(alignment), capacity_(capacity) {
  DFLASH2_CHECK_ARG(alignment > 0 && (alignment & (alignment - 1)) == 0, "Arena alignment ", alignment,
                    " is not a power of two");
  if (capacity > 0) {
    Tensor block = Tensor::empty(DType::U8, {int64_t(capacity)}, dev);
    block_ = block.owner();
    base_ = static_cast<char*>(block.data());
  }
}

Arena Arena::planner(Device dev, size_t alignment) {
  Arena a;
  a.device_ = dev;
  a.alignment_ = alignment;
  a.planning_ = true;
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
  size_t end = off + bytes;
  if (!planning_ && end > capacity_)
    fail(ErrorKind::OutOfMemory, "workspace arena on ", device_.str(), " is too small: allocating ", bytes,
         " bytes for ", dtype_name(dtype), shape_str(shape), " needs ", end, " bytes but its capacity is ",
         capacity_, " (", used_, " in use); size it with a planning pass");
  used_ = end;
  if (used_ > high_water_) high_water_ = used_;
  ++num_allocs_;
  return Tensor::view(planning_ ? nullptr : base_ + off, dtype, shape, {}, device_, block_);
}

void Arena::reset(size_t mark) {
  DFLASH2_CHECK_ARG(mark <= used_, "Arena::reset to ", mark, " beyond the used size ", used_);
  used_ = mark;
}

}  // namespace dflash2
