// dflash2/tensor.h: a small strided tensor (dtype, shape, strides in elements, device),
// owning or a view. Ownership is a shared_ptr<void> "owner" that keeps the backing memory
// (a heap block, a cudaMalloc block, an mmap'ed checkpoint, a DLPack producer) alive.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "dflash2/dtype.h"

namespace dflash2 {

enum class DeviceType : uint8_t { CPU = 0, CUDA = 1 };

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;
  static Device cpu() { return {}; }
  static Device cuda(int i = 0) { return {DeviceType::CUDA, i}; }
  bool is_cpu() const { return type == DeviceType::CPU; }
  bool is_cuda() const { return type == DeviceType::CUDA; }
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
  std::string str() const;
  // "cpu", "cuda" (= cuda:0) or "cuda:N"; anything else is an InvalidArgument error.
  static Device parse(const std::string& s);
};

class Tensor {
 public:
  static constexpr int kMaxDims = 6;
  using Shape = std::vector<int64_t>;

  Tensor() = default;
  // Owning, contiguous, uninitialised, 256-byte aligned (CPU) or cudaMalloc'ed (CUDA).
  static Tensor empty(DType dtype, const Shape& shape, Device dev = Device::cpu());
  static Tensor zeros(DType dtype, const Shape& shape, Device dev = Device::cpu());
  // A view of memory owned by someone else; strides in elements (empty = contiguous).
  static Tensor view(void* data, DType dtype, const Shape& shape, const Shape& strides = {},
                     Device dev = Device::cpu(), std::shared_ptr<void> owner = nullptr);

  bool defined() const { return defined_; }
  void* data() const { return data_; }
  template <class T>
  T* data_as() const { return static_cast<T*>(data_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  int ndim() const { return ndim_; }
  int64_t shape(int i) const;   // negative i counts from the end
  int64_t stride(int i) const;  // in elements
  Shape shape() const { return Shape(shape_, shape_ + ndim_); }
  Shape strides() const { return Shape(strides_, strides_ + ndim_); }
  int64_t numel() const;
  size_t itemsize() const { return dtype_size(dtype_); }
  size_t nbytes() const { return size_t(numel()) * itemsize(); }  // of the elements, not the span
  bool is_contiguous() const;
  const std::shared_ptr<void>& owner() const { return owner_; }

  // Views (no copies).
  Tensor slice(int dim, int64_t begin, int64_t end) const;
  Tensor select(int dim, int64_t index) const;  // drops dim
  Tensor reshape(const Shape& shape) const;     // contiguous tensors only; one -1 allowed
  Tensor transpose(int a, int b) const;
  Tensor unsqueeze(int dim) const;              // a new dimension of size 1 at dim

  // Copies.
  Tensor to(Device dev) const;          // contiguous copy on dev (or *this if already there and contiguous)
  Tensor contiguous() const;            // contiguous copy on the same device (or *this)
  void copy_from(const Tensor& src);    // same dtype and shape; any devices; any strides on CPU

  // "BF16[4, 8] cpu" for messages.
  std::string describe() const;

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::F32;
  Device device_{};
  int ndim_ = 0;
  int64_t shape_[kMaxDims] = {};
  int64_t strides_[kMaxDims] = {};
  bool defined_ = false;
  std::shared_ptr<void> owner_;
};

std::string shape_str(const Tensor::Shape& s);

// Whether a CUDA backend was compiled in and a device is usable right now; if not, *why
// says why (e.g. "built without CUDA", "no CUDA device: ...").
bool cuda_available(std::string* why = nullptr);
int cuda_device_count();
void device_synchronize(Device dev);

}  // namespace dflash2
