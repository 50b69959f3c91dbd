#include "dflash2/tensor.h"

#include <cstdlib>
#include <cstring>
#include <sstream>

#include "dflash2/error.h"
#ifdef DFLASH2_WITH_CUDA
#include "backend/cuda/cuda_api.h"
#endif

namespace dflash2 {

std::string Device::str() const {
  return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index);
}

Device Device::parse(const std::string& s) {
  if (s == "cpu") return Device::cpu();
  if (s == "cuda") return Device::cuda(0);
  if (s.rfind("cuda:", 0) == 0 && s.size() > 5 && s.size() <= 9 &&
      s.find_first_not_of("0123456789", 5) == std::string::npos)
    return Device::cuda(std::stoi(s.substr(5)));
  fail(ErrorKind::InvalidArgument, "unknown device '", s, "' (expected 'cpu', 'cuda' or 'cuda:N')");
}

std::string shape_str(const Tensor::Shape& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

namespace {

std::shared_ptr<void> allocate(size_t bytes, Device dev) {
  if (dev.is_cpu()) {
    // 256 bytes: the alignment cudaMalloc gives and Arena::kDefaultAlignment, so an arena
    // carved from a host tensor aligns its allocations as on the device
    size_t n = (bytes + 255) / 256 * 256;
    void* p = std::aligned_alloc(256, n ? n : 256);
    if (!p) fail(ErrorKind::OutOfMemory, "cannot allocate ", bytes, " bytes of host memory");
    return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  }
#ifdef DFLASH2_WITH_CUDA
  int idx = dev.index;
  void* p = cuda::device_malloc(bytes ? bytes : 1, idx);
  return std::shared_ptr<void>(p, [idx](void* q) { cuda::device_free(q, idx); });
#else
  fail(ErrorKind::Unsupported, "cannot allocate on ", dev.str(), ": dflash2 was built without CUDA");
#endif
}

void check_shape(const Tensor::Shape& shape) {
  DFLASH2_CHECK_ARG(shape.size() <= size_t(Tensor::kMaxDims), "tensor rank ", shape.size(),
                    " exceeds the maximum of ", Tensor::kMaxDims);
  for (auto d : shape) DFLASH2_CHECK_ARG(d >= 0, "negative dimension in shape ", shape_str(shape));
}

}  // namespace

Tensor Tensor::empty(DType dtype, const Shape& shape, Device dev) {
  check_shape(shape);
  // The byte size, checked: a wrapped product would allocate a small block for a huge shape.
  uint64_t n = 1, bytes = 0;
  for (auto d : shape)
    if (__builtin_mul_overflow(n, uint64_t(d), &n))
      fail(ErrorKind::OutOfMemory, "cannot allocate ", dtype_name(dtype), shape_str(shape),
           ": its element count does not fit in 64 bits");
  if (__builtin_mul_overflow(n, uint64_t(dtype_size(dtype)), &bytes) || bytes > uint64_t(INT64_MAX) - 256)
    fail(ErrorKind::OutOfMemory, "cannot allocate ", dtype_name(dtype), shape_str(shape), ": ", n,
         " elements do not fit in 63 bits of bytes");
  auto mem = allocate(size_t(bytes), dev);
  return view(mem.get(), dtype, shape, {}, dev, mem);
}

Tensor Tensor::zeros(DType dtype, const Shape& shape, Device dev) {
  Tensor t = empty(dtype, shape, dev);
  if (dev.is_cpu()) {
    std::memset(t.data(), 0, t.nbytes());
  } else {
#ifdef DFLASH2_WITH_CUDA
    cuda::memset_zero(t.data(), dev.index, t.nbytes());
#endif
  }
  return t;
}

Tensor Tensor::view(void* data, DType dtype, const Shape& shape, const Shape& strides, Device dev,
                    std::shared_ptr<void> owner) {
  check_shape(shape);
  DFLASH2_CHECK_ARG(strides.empty() || strides.size() == shape.size(), "strides ", shape_str(strides),
                    " do not match shape ", shape_str(shape));
  Tensor t;
  t.data_ = data;
  t.dtype_ = dtype;
  t.device_ = dev;
  t.ndim_ = int(shape.size());
  int64_t s = 1;
  for (int i = t.ndim_ - 1; i >= 0; --i) {
    t.shape_[i] = shape[i];
    t.strides_[i] = strides.empty() ? s : strides[i];
    s *= shape[i];
  }
  t.owner_ = std::move(owner);
  t.defined_ = true;
  return t;
}

int64_t Tensor::shape(int i) const {
  int j = i < 0 ? i + ndim_ : i;
  DFLASH2_CHECK_ARG(j >= 0 && j < ndim_, "dimension ", i, " out of range for ", describe());
  return shape_[j];
}

int64_t Tensor::stride(int i) const {
  int j = i < 0 ? i + ndim_ : i;
  DFLASH2_CHECK_ARG(j >= 0 && j < ndim_, "dimension ", i, " out of range for ", describe());
  return strides_[j];
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim_; ++i) n *= shape_[i];
  return n;
}

bool Tensor::is_contiguous() const {
  int64_t s = 1;
  for (int i = ndim_ - 1; i >= 0; --i) {
    if (shape_[i] != 1 && strides_[i] != s) return false;
    s *= shape_[i];
  }
  return true;
}

Tensor Tensor::slice(int dim, int64_t begin, int64_t end) const {
  int d = dim < 0 ? dim + ndim_ : dim;
  DFLASH2_CHECK_ARG(d >= 0 && d < ndim_, "slice: dimension ", dim, " out of range for ", describe());
  DFLASH2_CHECK_ARG(0 <= begin && begin <= end && end <= shape_[d], "slice [", begin, ", ", end,
                    ") out of range for dimension ", d, " of ", describe());
  Tensor t = *this;
  t.data_ = static_cast<char*>(data_) + begin * strides_[d] * int64_t(itemsize());
  t.shape_[d] = end - begin;
  return t;
}

Tensor Tensor::select(int dim, int64_t index) const {
  int d = dim < 0 ? dim + ndim_ : dim;
  Tensor t = slice(d, index, index + 1);
  for (int i = d; i < ndim_ - 1; ++i) {
    t.shape_[i] = t.shape_[i + 1];
    t.strides_[i] = t.strides_[i + 1];
  }
  t.ndim_--;
  return t;
}

Tensor Tensor::unsqueeze(int dim) const {
  int d = dim < 0 ? dim + ndim_ + 1 : dim;
  DFLASH2_CHECK_ARG(d >= 0 && d <= ndim_ && ndim_ < kMaxDims, "unsqueeze: dimension ", dim, " out of range for ",
                    describe());
  Tensor t = *this;
  for (int i = ndim_; i > d; --i) {
    t.shape_[i] = shape_[i - 1];
    t.strides_[i] = strides_[i - 1];
  }
  t.shape_[d] = 1;
  t.strides_[d] = d < ndim_ ? strides_[d] * shape_[d] : 1;
  t.ndim_++;
  return t;
}

Tensor Tensor::reshape(const Shape& shape) const {
  DFLASH2_CHECK_ARG(is_contiguous(), "reshape of a non-contiguous tensor ", describe());
  Shape s = shape;
  int64_t known = 1;
  int infer = -1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      DFLASH2_CHECK_ARG(infer < 0, "reshape: more than one -1 in ", shape_str(shape));
      infer = int(i);
    } else {
      known *= s[i];
    }
  }
  if (infer >= 0) {
    DFLASH2_CHECK_ARG(known > 0 && numel() % known == 0, "reshape: cannot infer ", shape_str(shape),
                      " from ", describe());
    s[infer] = numel() / known;
    known *= s[infer];
  }
  DFLASH2_CHECK_ARG(known == numel(), "reshape: ", shape_str(shape), " does not hold ", numel(),
                    " elements of ", describe());
  return view(data_, dtype_, s, {}, device_, owner_);
}

Tensor Tensor::transpose(int a, int b) const {
  int i = a < 0 ? a + ndim_ : a, j = b < 0 ? b + ndim_ : b;
  DFLASH2_CHECK_ARG(i >= 0 && i < ndim_ && j >= 0 && j < ndim_, "transpose(", a, ", ", b, ") of ", describe());
  Tensor t = *this;
  std::swap(t.shape_[i], t.shape_[j]);
  std::swap(t.strides_[i], t.strides_[j]);
  return t;
}

namespace {
// Strided copy on the host, element size `es`.
void host_copy(char* dst, const int64_t* dstr, const char* src, const int64_t* sstr, const int64_t* shape,
               int nd, size_t es) {
  if (nd == 0) {
    std::memcpy(dst, src, es);
    return;
  }
  if (nd == 1) {
    if (dstr[0] == 1 && sstr[0] == 1) {
      std::memcpy(dst, src, size_t(shape[0]) * es);
    } else {
      for (int64_t i = 0; i < shape[0]; ++i) std::memcpy(dst + i * dstr[0] * es, src + i * sstr[0] * es, es);
    }
    return;
  }
  for (int64_t i = 0; i < shape[0]; ++i)
    host_copy(dst + i * dstr[0] * int64_t(es), dstr + 1, src + i * sstr[0] * int64_t(es), sstr + 1, shape + 1,
              nd - 1, es);
}
}  // namespace

void Tensor::copy_from(const Tensor& src) {
  DFLASH2_CHECK_ARG(src.dtype_ == dtype_ && src.shape() == shape(), "copy_from: ", src.describe(),
                    " into ", describe());
  if (device_.is_cpu() && src.device_.is_cpu()) {
    host_copy(static_cast<char*>(data_), strides_, static_cast<const char*>(src.data_), src.strides_, shape_,
              ndim_, itemsize());
    return;
  }
#ifdef DFLASH2_WITH_CUDA
  if (is_contiguous() && src.is_contiguous()) {
    cuda::copy(data_, device_, src.data_, src.device_, nbytes());
    return;
  }
  // stage through contiguous host copies
  Tensor s = src.device_.is_cpu() ? src.contiguous() : src;
  DFLASH2_CHECK(s.is_contiguous(), ErrorKind::Unsupported, "copy_from: strided device tensor ", src.describe());
  if (device_.is_cpu()) {
    Tensor tmp = Tensor::empty(dtype_, shape(), Device::cpu());
    cuda::copy(tmp.data_, tmp.device_, s.data_, s.device_, s.nbytes());
    copy_from(tmp);
    return;
  }
  fail(ErrorKind::Unsupported, "copy_from: strided destination on ", device_.str(), " ", describe());
#else
  fail(ErrorKind::Unsupported, "copy_from between ", src.device_.str(), " and ", device_.str(),
       ": dflash2 was built without CUDA");
#endif
}

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  Tensor t = empty(dtype_, shape(), device_);
  t.copy_from(*this);
  return t;
}

Tensor Tensor::to(Device dev) const {
  if (dev == device_) return contiguous();
  Tensor t = empty(dtype_, shape(), dev);
  t.copy_from(device_.is_cpu() ? contiguous() : *this);
  return t;
}

std::string Tensor::describe() const {
  if (!defined_) return "<undefined tensor>";
  return std::string(dtype_name(dtype_)) + shape_str(shape()) + " " + device_.str();
}

bool cuda_available(std::string* why) {
#ifdef DFLASH2_WITH_CUDA
  return cuda::available(why);
#else
  if (why) *why = "dflash2 was built without CUDA (DFLASH2_CUDA=OFF or no CUDA toolkit found at build time)";
  return false;
#endif
}

int cuda_device_count() {
#ifdef DFLASH2_WITH_CUDA
  return cuda::device_count();
#else
  return 0;
#endif
}

void device_synchronize(Device dev) {
#ifdef DFLASH2_WITH_CUDA
  if (dev.is_cuda()) cuda::synchronize(dev.index);
#endif
}

}  // namespace dflash2
