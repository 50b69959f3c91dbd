// config.json: typed getters whose errors name the file, the field, what was expected and
// what was found. All errors are ErrorKind::Config.
#include <cmath>

#include "dflash2/error.h"
#include "dflash2/json.h"
#include "io/file.h"

namespace dflash2 {

namespace {

// A found value for a message: its JSON text, shortened.
std::string show(const Json& v) {
  std::string s = v.dump();
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s + " (" + v.type_name() + ")";
}

// An integral value of a Json number: integer literals, and doubles such as 4096.0 that
// hold an exact integer (some exporters write those).
bool integral_value(const Json& v, int64_t* out) {
  if (v.is_int()) {
    *out = v.as_int();
    return true;
  }
  if (v.is_number()) {
    double d = v.as_double();
    if (std::isfinite(d) && std::floor(d) == d && std::fabs(d) <= 9007199254740992.0) {  // 2^53
      *out = int64_t(d);
      return true;
    }
  }
  return false;
}

}  // namespace

Config::Config(Json root, std::string path) : root_(std::move(root)), path_(std::move(path)) {
  if (!root_.is_null() && !root_.is_object())
    fail(ErrorKind::Config, path_, ": expected a JSON object at the top level, found ", root_.type_name());
}

Config Config::load(const std::string& path) {
  // Only a regular file is read: a FIFO, a device (/dev/zero) or a directory is an error
  // that says what the path is, never a hang or an endless read.
  std::string text = io::read_regular_file(path, ErrorKind::Config, "config");
  Json root = Json::parse(text, path, ErrorKind::Config);
  if (!root.is_object())
    fail(ErrorKind::Config, path, ": expected a JSON object at the top level, found ", root.type_name());
  return Config(std::move(root), path);
}

bool Config::has(const std::string& key) const { return root_.find(key) != nullptr; }

const Json& Config::require(const std::string& key) const {
  const Json* v = root_.find(key);
  if (!v) fail(ErrorKind::Config, path_.empty() ? "config" : path_, ": missing required field '", key, "'");
  return *v;
}

void Config::bad(const std::string& key, const char* expected, const Json& found) const {
  fail(ErrorKind::Config, path_.empty() ? "config" : path_, ": field '", key, "': expected ", expected, ", found ",
       show(found));
}

int64_t Config::get_int(const std::string& key) const {
  const Json& v = require(key);
  int64_t out;
  if (!integral_value(v, &out)) bad(key, "an integer", v);
  return out;
}

int64_t Config::get_int(const std::string& key, int64_t def) const {
  const Json* v = root_.find(key);
  if (!v || v->is_null()) return def;
  int64_t out;
  if (!integral_value(*v, &out)) bad(key, "an integer", *v);
  return out;
}

double Config::get_double(const std::string& key) const {
  const Json& v = require(key);
  if (!v.is_number()) bad(key, "a number", v);
  return v.as_double();
}

double Config::get_double(const std::string& key, double def) const {
  const Json* v = root_.find(key);
  if (!v || v->is_null()) return def;
  if (!v->is_number()) bad(key, "a number", *v);
  return v->as_double();
}

bool Config::get_bool(const std::string& key, bool def) const {
  const Json* v = root_.find(key);
  if (!v || v->is_null()) return def;
  if (!v->is_bool()) bad(key, "true or false", *v);
  return v->as_bool();
}

std::string Config::get_string(const std::string& key) const {
  const Json& v = require(key);
  if (!v.is_string()) bad(key, "a string", v);
  return v.as_string();
}

std::string Config::get_string(const std::string& key, const std::string& def) const {
  const Json* v = root_.find(key);
  if (!v || v->is_null()) return def;
  if (!v->is_string()) bad(key, "a string", *v);
  return v->as_string();
}

std::vector<int64_t> Config::get_int_list(const std::string& key) const {
  const Json& v = require(key);
  if (!v.is_array()) bad(key, "a list of integers", v);
  std::vector<int64_t> out;
  out.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    int64_t x;
    if (!integral_value(v.as_array()[i], &x))
      fail(ErrorKind::Config, path_.empty() ? "config" : path_, ": field '", key, "': expected a list of integers, ",
           "element ", i, " is ", show(v.as_array()[i]));
    out.push_back(x);
  }
  return out;
}

std::vector<std::string> Config::get_string_list(const std::string& key) const {
  const Json& v = require(key);
  if (!v.is_array()) bad(key, "a list of strings", v);
  std::vector<std::string> out;
  out.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const Json& e = v.as_array()[i];
    if (!e.is_string())
      fail(ErrorKind::Config, path_.empty() ? "config" : path_, ": field '", key, "': expected a list of strings, ",
           "element ", i, " is ", show(e));
    out.push_back(e.as_string());
  }
  return out;
}

Config Config::sub(const std::string& key) const {
  std::string sub_path = (path_.empty() ? std::string("config") : path_) + ":" + key;
  const Json* v = root_.find(key);
  if (!v || v->is_null()) return Config(Json(), sub_path);
  if (!v->is_object()) bad(key, "an object", *v);
  return Config(*v, sub_path);
}

}  // namespace dflash2
