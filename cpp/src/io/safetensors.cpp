// safetensors: header validation on an in-memory image, and mmap'ed files.
//
// Layout: u64 little-endian header length N, N bytes of JSON, then the data region.
// Everything in the header is checked against the file before any tensor is handed out.
#include "io/file.h"
#include "io/names.h"
#include "dflash2/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "dflash2/error.h"

namespace dflash2 {

namespace {

constexpr const char* kSupportedDTypes = "F32 F16 BF16 F8_E4M3 U8 I32 I64";

std::string offsets_str(uint64_t b, uint64_t e) {
  return "[" + std::to_string(b) + ", " + std::to_string(e) + "]";
}

std::string shape_text(const std::vector<int64_t>& s) { return shape_str(s); }

// A Json value shown in a message, shortened.
std::string show(const Json& v) {
  std::string s = v.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

using io::quote_name;

uint64_t read_u64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Reads data_offsets[i] as a non-negative integer.
bool offset_value(const Json& v, uint64_t* out) {
  if (!v.is_int() || v.as_int() < 0) return false;
  *out = uint64_t(v.as_int());
  return true;
}

}  // namespace

std::vector<TensorInfo> parse_safetensors(const uint8_t* data, size_t size, const std::string& file,
                                          std::map<std::string, std::string>* metadata) {
  const ErrorKind K = ErrorKind::Checkpoint;
  if (size < 8)
    fail(K, file, ": file is too short to be a safetensors file (", size,
         " bytes; it must start with an 8-byte header length)");
  const uint64_t n = read_u64_le(data);
  if (n > uint64_t(size) - 8)
    fail(K, file, ": header length ", n, " exceeds the file size ", size, " (the header would end at byte ",
         n > UINT64_MAX - 8 ? std::string("> 2^64") : std::to_string(n + 8), "; truncated or not a safetensors file?)");
  const uint64_t data_size = uint64_t(size) - 8 - n;
  Json header = Json::parse(reinterpret_cast<const char*>(data + 8), size_t(n), file + " (safetensors header)", K);
  if (!header.is_object())
    fail(K, file, ": the safetensors header must be a JSON object, found ", header.type_name());

  std::vector<TensorInfo> out;
  out.reserve(header.size());
  if (metadata) metadata->clear();
  for (const auto& kv : header.as_object()) {
    const std::string& name = kv.first;
    const Json& e = kv.second;
    if (name == "__metadata__") {
      if (!e.is_object())
        fail(K, file, ": '__metadata__' must be an object of string values, found ", e.type_name());
      for (const auto& m : e.as_object()) {
        if (!m.second.is_string())
          fail(K, file, ": '__metadata__' entry ", quote_name(m.first), ": expected a string value, found ",
               m.second.type_name(), " ", show(m.second));
        if (metadata) (*metadata)[m.first] = m.second.as_string();
      }
      continue;
    }
    const std::string where = file + ": tensor " + quote_name(name);
    if (!e.is_object())
      fail(K, where, ": expected an object with 'dtype', 'shape' and 'data_offsets', found ", e.type_name());
    const Json* jd = e.find("dtype");
    const Json* js = e.find("shape");
    const Json* jo = e.find("data_offsets");
    if (!jd) fail(K, where, ": missing field 'dtype'");
    if (!js) fail(K, where, ": missing field 'shape'");
    if (!jo) fail(K, where, ": missing field 'data_offsets'");

    TensorInfo ti;
    ti.name = name;
    ti.file = file;
    if (!jd->is_string()) fail(K, where, ": field 'dtype': expected a string, found ", jd->type_name(), " ", show(*jd));
    if (!dtype_from_name(jd->as_string(), &ti.dtype))
      fail(K, where, ": unsupported dtype ", quote_name(jd->as_string()), " (supported: ", kSupportedDTypes, ")");

    if (!js->is_array())
      fail(K, where, ": field 'shape': expected an array of non-negative integers, found ", js->type_name(), " ",
           show(*js));
    for (const Json& d : js->as_array()) {
      if (!d.is_int())
        fail(K, where, ": field 'shape': expected an array of non-negative integers, found ", show(*js));
      if (d.as_int() < 0) fail(K, where, ": field 'shape' ", show(*js), " has a negative dimension ", d.as_int());
      ti.shape.push_back(d.as_int());
    }

    if (!jo->is_array() || jo->size() != 2)
      fail(K, where, ": field 'data_offsets': expected [begin, end], found ", show(*jo));
    if (!offset_value(jo->as_array()[0], &ti.begin) || !offset_value(jo->as_array()[1], &ti.end))
      fail(K, where, ": field 'data_offsets': expected two non-negative integers, found ", show(*jo));
    if (ti.begin > ti.end)
      fail(K, where, ": data_offsets ", offsets_str(ti.begin, ti.end), " have begin > end");
    if (ti.end > data_size)
      fail(K, where, ": data_offsets ", offsets_str(ti.begin, ti.end), " end beyond the data region of ", data_size,
           " bytes (file size ", size, ", header ", n, " bytes; truncated file?)");

    uint64_t numel = 1;
    for (int64_t d : ti.shape)
      if (__builtin_mul_overflow(numel, uint64_t(d), &numel))
        fail(K, where, ": shape ", shape_text(ti.shape), " has more elements than fit in 64 bits");
    uint64_t expected = 0;
    if (__builtin_mul_overflow(numel, uint64_t(dtype_size(ti.dtype)), &expected) ||
        expected > uint64_t(INT64_MAX))
      fail(K, where, ": ", dtype_name(ti.dtype), " shape ", shape_text(ti.shape), " is too large (", numel,
           " elements)");
    if (ti.end - ti.begin != expected)
      fail(K, where, ": byte size does not match dtype and shape: ", dtype_name(ti.dtype), " ",
           shape_text(ti.shape), " needs ", expected, " bytes, data_offsets ", offsets_str(ti.begin, ti.end),
           " hold ", ti.end - ti.begin);
    out.push_back(std::move(ti));
  }

  // Overlaps: sort the non-empty ranges by begin; each must start at or after the
  // furthest end seen so far.
  std::vector<const TensorInfo*> ranges;
  ranges.reserve(out.size());
  for (const auto& t : out)
    if (t.end > t.begin) ranges.push_back(&t);
  std::sort(ranges.begin(), ranges.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->name < b->name;
  });
  const TensorInfo* furthest = nullptr;
  for (const TensorInfo* t : ranges) {
    if (furthest && t->begin < furthest->end)
      fail(K, file, ": tensors ", quote_name(furthest->name), " (data_offsets ", offsets_str(furthest->begin, furthest->end),
           ") and ", quote_name(t->name), " (data_offsets ", offsets_str(t->begin, t->end), ") overlap");
    if (!furthest || t->end > furthest->end) furthest = t;
  }

  std::sort(out.begin(), out.end(), [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });
  return out;
}

// ------------------------------------------------------------------------- SafetensorsFile

std::shared_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  const ErrorKind K = ErrorKind::Checkpoint;
  // O_NONBLOCK: opening a FIFO must not hang (it is rejected below); no effect on files.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    int err = errno;
    fail(K, "cannot open safetensors file '", path, "': ", std::strerror(err));
  }
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    fail(K, "cannot stat safetensors file '", path, "': ", std::strerror(err));
  }
  if (S_ISDIR(st.st_mode)) fail(K, "'", path, "' is a directory, expected a .safetensors file");
  if (!S_ISREG(st.st_mode))
    fail(K, "'", path, "' is ", io::file_kind(st.st_mode), ", not a regular file; expected a .safetensors file");
  if (st.st_size == 0)
    fail(K, path, ": file is empty (0 bytes); a safetensors file starts with an 8-byte header length");
  const size_t size = size_t(st.st_size);
  // Private and copy-on-write: the file is never written; see safetensors.h.
  void* map = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_NORESERVE, fd, 0);
  if (map == MAP_FAILED) {
    int err = errno;
    fail(K, "cannot mmap safetensors file '", path, "' (", size, " bytes): ", std::strerror(err));
  }
  std::shared_ptr<SafetensorsFile> f(new SafetensorsFile());  // its destructor unmaps on any error below
  f->path_ = path;
  f->map_ = map;
  f->size_ = size;
  f->self_ = f;
  const auto* bytes = static_cast<const uint8_t*>(map);
  f->tensors_ = parse_safetensors(bytes, size, path, &f->metadata_);
  f->data_start_ = size_t(8 + read_u64_le(bytes));
  for (size_t i = 0; i < f->tensors_.size(); ++i) f->by_name_[f->tensors_[i].name] = i;
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, size_);
}

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

Tensor SafetensorsFile::tensor(const std::string& name) const {
  const TensorInfo* ti = find(name);
  if (!ti) fail(ErrorKind::Checkpoint, path_, ": no tensor ", quote_name(name), " in this file");
  if (ti->shape.size() > size_t(Tensor::kMaxDims))
    fail(ErrorKind::Checkpoint, path_, ": tensor ", quote_name(name), " has rank ", ti->shape.size(),
         ", more than the supported ", Tensor::kMaxDims);
  std::shared_ptr<void> owner = self_.lock();  // the view keeps the mapping alive
  DFLASH2_INTERNAL(owner != nullptr, "SafetensorsFile::tensor called on a file not owned by a shared_ptr");
  void* p = static_cast<char*>(map_) + data_start_ + ti->begin;
  return Tensor::view(p, ti->dtype, ti->shape, {}, Device::cpu(), std::move(owner));
}

}  // namespace dflash2
