// dflash2/json.h: a small, strict JSON reader (RFC 8259) for config.json, safetensors
// headers and index files. Hardened for untrusted input: depth limit, no recursion past
// it, precise error offsets; it never aborts.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dflash2/error.h"

namespace dflash2 {

class Json {
 public:
  enum class Type { Null, Bool, Number, String, Array, Object };
  using Array = std::vector<Json>;
  using Object = std::vector<std::pair<std::string, Json>>;  // keeps file order

  Json() = default;
  // Parses `text`; on malformed input throws Error(kind) with "<where>: malformed JSON at
  // byte N: <what>". `where` names the file (and the part of it) for the message; `kind`
  // is Checkpoint for safetensors headers / index files, Config for config.json. Arrays
  // and objects nested deeper than `max_depth` (itself capped at 1024) are an error, so
  // the recursion depth is bounded. The text must be UTF-8; object keys must be unique.
  static Json parse(const std::string& text, const std::string& where,
                    ErrorKind kind = ErrorKind::InvalidArgument, int max_depth = 64);
  static Json parse(const char* data, size_t size, const std::string& where,
                    ErrorKind kind = ErrorKind::InvalidArgument, int max_depth = 64);

  Type type() const { return type_; }
  const char* type_name() const;
  bool is_null() const { return type_ == Type::Null; }
  bool is_bool() const { return type_ == Type::Bool; }
  bool is_number() const { return type_ == Type::Number; }
  bool is_int() const { return type_ == Type::Number && is_int_; }  // integral literal within int64
  bool is_string() const { return type_ == Type::String; }
  bool is_array() const { return type_ == Type::Array; }
  bool is_object() const { return type_ == Type::Object; }

  bool as_bool() const { return b_; }
  double as_double() const { return num_; }
  int64_t as_int() const { return int_; }
  const std::string& as_string() const { return str_; }
  const Array& as_array() const { return *arr_; }
  const Object& as_object() const { return *obj_; }

  // Object lookup: nullptr if absent (or not an object). Linear in the member count.
  const Json* find(const std::string& key) const;
  size_t size() const;  // elements of an array / members of an object

  // Builders (used by tests and tools).
  static Json make_null() { return Json(); }
  static Json make_bool(bool v);
  static Json make_number(double v);
  static Json make_int(int64_t v);
  static Json make_string(std::string v);
  static Json make_array(Array v);
  static Json make_object(Object v);
  // Compact serialisation. Non-finite numbers (only possible through make_number) are
  // written as null; a number that is not is_int() is written with a '.' or an exponent
  // so that it reads back as a non-integer.
  std::string dump() const;

 private:
  Type type_ = Type::Null;
  bool b_ = false;
  bool is_int_ = false;
  double num_ = 0;
  int64_t int_ = 0;
  std::string str_;
  std::shared_ptr<Array> arr_;
  std::shared_ptr<Object> obj_;
  friend class JsonParser;
};

// config.json with typed getters whose errors name the file and the field, e.g.
// "config.json: field 'hidden_size': expected a positive integer, found \"abc\"".
class Config {
 public:
  Config() = default;
  Config(Json root, std::string path);
  static Config load(const std::string& path);  // reads and parses the file

  const Json& root() const { return root_; }
  const std::string& path() const { return path_; }
  bool has(const std::string& key) const;
  const Json* find(const std::string& key) const { return root_.find(key); }

  int64_t get_int(const std::string& key) const;  // required
  int64_t get_int(const std::string& key, int64_t def) const;
  double get_double(const std::string& key) const;
  double get_double(const std::string& key, double def) const;
  bool get_bool(const std::string& key, bool def) const;
  std::string get_string(const std::string& key) const;
  std::string get_string(const std::string& key, const std::string& def) const;
  std::vector<int64_t> get_int_list(const std::string& key) const;
  std::vector<std::string> get_string_list(const std::string& key) const;
  // A sub-object as a Config (path "config.json:dflash_config"); empty Config if absent.
  Config sub(const std::string& key) const;

 private:
  const Json& require(const std::string& key) const;
  [[noreturn]] void bad(const std::string& key, const char* expected, const Json& found) const;
  Json root_;
  std::string path_;
};

}  // namespace dflash2
