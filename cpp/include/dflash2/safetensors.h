// dflash2/safetensors.h: zero-copy safetensors reading (mmap) and sharded checkpoints.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dflash2/json.h"
#include "dflash2/tensor.h"

namespace dflash2 {

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets relative to the start of the data region
  std::string file;             // the file that holds it (full path)
};

// Parses and validates a whole safetensors image held in memory (`size` bytes at `data`):
// the 8-byte header length against the file size, the header JSON, every entry's dtype,
// shape and offsets (inside the data region, not overlapping, end - begin equal to
// prod(shape) * dtype size). `file` names the file in error messages.
// Returns the tensors sorted by name, and fills *metadata (if given) with __metadata__.
std::vector<TensorInfo> parse_safetensors(const uint8_t* data, size_t size, const std::string& file,
                                          std::map<std::string, std::string>* metadata = nullptr);

// One mmap'ed .safetensors file. Tensors returned by tensor() are views into the mapping
// (no copies) and keep it alive. The file is opened read-only and never modified; the
// mapping is private copy-on-write, so a caller that writes into a returned view (e.g. a
// numpy array obtained through DLPack, which has no read-only flag) changes only its own
// copy of that page instead of crashing. Errors are ErrorKind::Checkpoint naming the path.
class SafetensorsFile {
 public:
  static std::shared_ptr<SafetensorsFile> open(const std::string& path);
  ~SafetensorsFile();
  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const TensorInfo* find(const std::string& name) const;
  Tensor tensor(const std::string& name) const;  // throws Checkpoint error if absent
  size_t file_size() const { return size_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t size_ = 0;
  size_t data_start_ = 0;  // 8 + header length: where the data region begins
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> by_name_;
  std::map<std::string, std::string> metadata_;
  std::weak_ptr<SafetensorsFile> self_;
};

// A checkpoint: a directory (with model.safetensors.index.json, or *.safetensors files,
// and optionally config.json) or a single .safetensors file (config.json is then read from
// the same directory if present). Every file's header is validated at open(); the data
// is mmap'ed and only paged in when used. With an index, only the files it names are
// opened; every weight_map entry must be in the file it names, and no tensor may appear in
// two files. Malformed config.json is a Config error naming the file.
class Checkpoint {
 public:
  static Checkpoint open(const std::string& path);

  const std::string& path() const { return path_; }
  bool has(const std::string& name) const;
  // Checkpoint error naming the tensor and the checkpoint (with up to 3 close names).
  const TensorInfo& info(const std::string& name) const;
  Tensor tensor(const std::string& name) const;          // zero-copy view
  std::vector<std::string> names() const;                // sorted
  const std::map<std::string, TensorInfo>& all() const { return infos_; }
  std::vector<std::string> files() const;                // full paths, sorted
  // config.json beside the weights, if any.
  bool has_config() const { return has_config_; }
  const Config& config() const { return config_; }
  uint64_t total_bytes() const;

 private:
  std::string path_;
  std::map<std::string, TensorInfo> infos_;
  std::map<std::string, std::shared_ptr<SafetensorsFile>> files_;
  bool has_config_ = false;
  Config config_;
};

}  // namespace dflash2
