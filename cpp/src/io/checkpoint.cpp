// Checkpoints: a single .safetensors file, or a directory with an index
// (model.safetensors.index.json) or plain *.safetensors files, plus config.json.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <set>

#include "io/file.h"
#include "io/names.h"
#include "dflash2/error.h"
#include "dflash2/safetensors.h"

namespace dflash2 {

namespace fs = std::filesystem;

namespace {

constexpr const char* kIndexName = "model.safetensors.index.json";

using io::quote_name;

std::string read_text_file(const std::string& path, ErrorKind kind) {
  return io::read_regular_file(path, kind, "file");
}

// Levenshtein distance, or limit + 1 as soon as it must exceed `limit`. Only the band
// |i - j| <= limit of the table is computed.
size_t edit_distance(const std::string& a, const std::string& b, size_t limit) {
  const size_t n = a.size(), m = b.size(), inf = limit + 1;
  if ((n > m ? n - m : m - n) > limit) return inf;
  std::vector<size_t> prev(m + 1, inf), cur(m + 1, inf);
  for (size_t j = 0; j <= std::min(m, limit); ++j) prev[j] = j;
  for (size_t i = 1; i <= n; ++i) {
    const size_t lo = i > limit ? i - limit : 1, hi = std::min(m, i + limit);
    cur[lo - 1] = lo == 1 ? std::min(i, inf) : inf;
    size_t row_min = cur[lo - 1];
    for (size_t j = lo; j <= hi; ++j) {
      size_t v = std::min({prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1), prev[j] + 1, cur[j - 1] + 1, inf});
      cur[j] = v;
      row_min = std::min(row_min, v);
    }
    if (hi < m) cur[hi + 1] = inf;
    if (row_min >= inf) return inf;
    std::swap(prev, cur);
  }
  return std::min(prev[m], inf);
}

// Up to 3 names close to `name` (only computed for moderately sized checkpoints).
std::vector<std::string> close_names(const std::string& name, const std::map<std::string, TensorInfo>& all) {
  std::vector<std::pair<size_t, std::string>> scored;
  if (all.size() > 200000 || name.size() > 512) return {};
  const size_t limit = std::min<size_t>(8, std::max<size_t>(2, name.size() / 3));
  for (const auto& kv : all) {
    size_t d = edit_distance(name, kv.first, limit);
    if (d <= limit) scored.emplace_back(d, kv.first);
  }
  std::sort(scored.begin(), scored.end());
  std::vector<std::string> out;
  for (size_t i = 0; i < scored.size() && i < 3; ++i) out.push_back(scored[i].second);
  return out;
}

// A file name from the index must stay inside the checkpoint directory.
bool safe_relative(const std::string& name) {
  if (name.empty()) return false;
  fs::path p(name);
  if (p.is_absolute() || p.has_root_name() || p.has_root_directory()) return false;
  for (const auto& part : p)
    if (part == "..") return false;
  return true;
}

}  // namespace

Checkpoint Checkpoint::open(const std::string& path) {
  const ErrorKind K = ErrorKind::Checkpoint;
  std::error_code ec;
  fs::file_status st = fs::status(path, ec);
  if (path.empty()) fail(K, "checkpoint path is empty");
  if (ec || !fs::exists(st)) {
    if (ec && ec != std::errc::no_such_file_or_directory)
      fail(K, "cannot access checkpoint path '", path, "': ", ec.message());
    fail(K, "checkpoint path '", path, "' does not exist");
  }

  Checkpoint ck;
  ck.path_ = path;
  // Adds a file's tensors; a name already present in another file is an error.
  auto add_file = [&ck, K](const std::shared_ptr<SafetensorsFile>& f) {
    ck.files_[f->path()] = f;
    for (const auto& t : f->tensors()) {
      auto ins = ck.infos_.emplace(t.name, t);
      if (!ins.second)
        fail(K, "checkpoint '", ck.path_, "': tensor ", quote_name(t.name), " is present in two files: '",
             ins.first->second.file, "' and '", t.file, "'");
    }
  };

  fs::path config_path;
  if (fs::is_directory(st)) {
    const fs::path dir(path);
    const fs::path index = dir / kIndexName;
    config_path = dir / "config.json";
    if (fs::exists(fs::symlink_status(index, ec))) {  // anything there (also a broken link) is read
      const std::string index_str = index.string();
      Json root = Json::parse(read_text_file(index_str, K), index_str, K);
      if (!root.is_object()) fail(K, index_str, ": expected a JSON object at the top level, found ", root.type_name());
      const Json* wm = root.find("weight_map");
      if (!wm) fail(K, index_str, ": missing field 'weight_map'");
      if (!wm->is_object()) fail(K, index_str, ": field 'weight_map': expected an object, found ", wm->type_name());
      // The files in order of first mention, each with one tensor that names it.
      std::vector<std::string> order;
      std::map<std::string, std::string> first_tensor;
      for (const auto& kv : wm->as_object()) {
        if (!kv.second.is_string())
          fail(K, index_str, ": weight_map entry ", quote_name(kv.first), ": expected a file name, found ",
               kv.second.type_name());
        const std::string& file = kv.second.as_string();
        if (!safe_relative(file))
          fail(K, index_str, ": weight_map entry ", quote_name(kv.first), " names file ", quote_name(file),
               ", which is not a relative path inside the checkpoint directory");
        if (first_tensor.emplace(file, kv.first).second) order.push_back(file);
      }
      if (order.empty()) fail(K, index_str, ": weight_map is empty");
      std::sort(order.begin(), order.end());
      std::map<std::string, std::string> full_of;  // index file name -> opened path
      for (const auto& file : order) {
        const fs::path fp = dir / file;
        std::error_code e2;
        if (!fs::exists(fp, e2))
          fail(K, index_str, ": names file ", quote_name(file), " (for tensor ", quote_name(first_tensor[file]),
               " and maybe others), which does not exist in '", path, "'");
        auto f = SafetensorsFile::open(fp.string());
        full_of[file] = f->path();
        add_file(f);
      }
      for (const auto& kv : wm->as_object()) {
        const std::string& file = kv.second.as_string();
        const auto& f = ck.files_.at(full_of.at(file));
        if (!f->find(kv.first)) {
          auto it = ck.infos_.find(kv.first);
          if (it != ck.infos_.end())
            fail(K, index_str, ": maps tensor ", quote_name(kv.first), " to ", quote_name(file),
                 ", which does not contain it (it is in '", it->second.file, "')");
          fail(K, index_str, ": maps tensor ", quote_name(kv.first), " to ", quote_name(file),
               ", which does not contain it");
        }
      }
    } else {
      std::vector<std::string> files;
      fs::directory_iterator it(dir, ec), end;
      if (ec) fail(K, "cannot list checkpoint directory '", path, "': ", ec.message());
      for (; it != end; it.increment(ec)) {
        if (ec) fail(K, "cannot list checkpoint directory '", path, "': ", ec.message());
        // Every *.safetensors entry, whatever it is: a FIFO, a directory or a broken link
        // is reported by SafetensorsFile::open rather than skipped.
        const fs::path& p = it->path();
        if (p.extension() == ".safetensors") files.push_back(p.string());
      }
      if (files.empty())
        fail(K, "checkpoint directory '", path, "' contains no ", kIndexName, " and no *.safetensors files");
      std::sort(files.begin(), files.end());
      for (const auto& f : files) add_file(SafetensorsFile::open(f));
    }
  } else {
    add_file(SafetensorsFile::open(path));
    fs::path parent = fs::path(path).parent_path();
    config_path = (parent.empty() ? fs::path(".") : parent) / "config.json";
  }

  // Anything named config.json (a FIFO, a directory, a device, a dangling link, a link
  // loop) is loaded, so that what is wrong with it is reported instead of "missing".
  std::error_code e3;
  if (fs::exists(fs::symlink_status(config_path, e3))) {
    ck.config_ = Config::load(config_path.string());
    ck.has_config_ = true;
  }
  return ck;
}

bool Checkpoint::has(const std::string& name) const { return infos_.count(name) != 0; }

const TensorInfo& Checkpoint::info(const std::string& name) const {
  auto it = infos_.find(name);
  if (it != infos_.end()) return it->second;
  std::vector<std::string> near = close_names(name, infos_);
  std::string hint;
  if (!near.empty()) {
    hint = " (did you mean ";
    for (size_t i = 0; i < near.size(); ++i) hint += (i ? ", " : "") + quote_name(near[i]);
    hint += "?)";
  }
  fail(ErrorKind::Checkpoint, "checkpoint '", path_, "' has no tensor ", quote_name(name), hint);
}

Tensor Checkpoint::tensor(const std::string& name) const {
  const TensorInfo& ti = info(name);
  auto it = files_.find(ti.file);
  DFLASH2_INTERNAL(it != files_.end(), "checkpoint file '", ti.file, "' of tensor '", name, "' is not open");
  return it->second->tensor(name);
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(infos_.size());
  for (const auto& kv : infos_) out.push_back(kv.first);
  return out;
}

std::vector<std::string> Checkpoint::files() const {
  std::vector<std::string> out;
  out.reserve(files_.size());
  for (const auto& kv : files_) out.push_back(kv.first);
  return out;
}

uint64_t Checkpoint::total_bytes() const {
  uint64_t n = 0;
  for (const auto& kv : infos_) n += kv.second.end - kv.second.begin;
  return n;
}

}  // namespace dflash2
