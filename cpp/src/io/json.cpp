// A strict RFC 8259 JSON reader and a compact writer.
//
// The parser is a recursive-descent parser over a byte range. It is meant for untrusted
// input (safetensors headers come from downloaded files), so:
//   * nesting is limited (max_depth, itself clamped), so recursion depth is bounded;
//   * every byte is checked: UTF-8 must be well formed (no overlongs, no encoded
//     surrogates, nothing past U+10FFFF), control characters inside strings must be
//     escaped, \u escapes must pair surrogates correctly;
//   * numbers follow the RFC grammar exactly (no leading zeros, no '+', no '.5', no NaN);
//     a number whose magnitude does not fit a double is rejected;
//   * duplicate object keys are rejected (two readers could disagree on which one wins);
//   * anything after the value other than whitespace is an error.
// Errors are dflash2::Error(kind) with "<where>: malformed JSON at byte N: <what>".
#include "dflash2/json.h"

#include <algorithm>
#include <cerrno>
#include <clocale>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <locale.h>

#include "dflash2/error.h"

namespace dflash2 {

namespace {

constexpr int kHardDepthLimit = 1024;  // whatever the caller asks for

// strtod in the "C" locale (the decimal point must be '.', whatever the process locale).
double strtod_c(const char* s, char** end) {
  static locale_t c_locale = newlocale(LC_ALL_MASK, "C", locale_t(0));
  if (c_locale) return strtod_l(s, end, c_locale);
  return std::strtod(s, end);
}

// A key or string value quoted for an error message: printable ASCII kept, everything
// else escaped, long strings shortened.
std::string quote_for_message(const std::string& s, size_t max_len = 64) {
  std::string out = "'";
  size_t n = std::min(s.size(), max_len);
  for (size_t i = 0; i < n; ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\'' && c != '\\') {
      out += char(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  if (s.size() > max_len) out += "...";
  out += "'";
  return out;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

int hex_value(unsigned char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

class JsonParser {
 public:
  JsonParser(const char* data, size_t size, const std::string& where, ErrorKind kind, int max_depth)
      : p_(reinterpret_cast<const unsigned char*>(data)),
        size_(size),
        where_(where),
        kind_(kind),
        max_depth_(std::max(1, std::min(max_depth, kHardDepthLimit))) {}

  Json run() {
    if (size_ >= 3 && p_[0] == 0xEF && p_[1] == 0xBB && p_[2] == 0xBF)
      error(0, "a UTF-8 byte order mark is not allowed");
    skip_ws();
    if (pos_ >= size_) error(pos_, "empty input, expected a JSON value");
    Json v;
    parse_value(v, 0);
    skip_ws();
    if (pos_ < size_) error(pos_, "unexpected " + describe(pos_) + " after the JSON value");
    return v;
  }

 private:
  const unsigned char* p_;
  size_t size_;
  size_t pos_ = 0;
  const std::string& where_;
  ErrorKind kind_;
  int max_depth_;

  [[noreturn]] void error(size_t at, const std::string& what) const {
    fail(kind_, where_, ": malformed JSON at byte ", at, ": ", what);
  }

  std::string describe(size_t at) const {
    if (at >= size_) return "end of input";
    unsigned char c = p_[at];
    char buf[16];
    if (c >= 0x20 && c < 0x7f)
      std::snprintf(buf, sizeof buf, "'%c'", c);
    else
      std::snprintf(buf, sizeof buf, "byte 0x%02x", c);
    return buf;
  }

  void skip_ws() {
    while (pos_ < size_) {
      unsigned char c = p_[pos_];
      if (c == ' ' || c == '\t' || c == '\n' || c == '\r')
        ++pos_;
      else
        break;
    }
  }

  void parse_value(Json& out, int depth) {
    if (pos_ >= size_) error(pos_, "unexpected end of input, expected a value");
    unsigned char c = p_[pos_];
    switch (c) {
      case '{': parse_object(out, depth + 1); return;
      case '[': parse_array(out, depth + 1); return;
      case '"':
        out.type_ = Json::Type::String;
        parse_string(out.str_);
        return;
      case 't': parse_literal("true", out); out.type_ = Json::Type::Bool; out.b_ = true; return;
      case 'f': parse_literal("false", out); out.type_ = Json::Type::Bool; out.b_ = false; return;
      case 'n': parse_literal("null", out); out.type_ = Json::Type::Null; return;
      default:
        if (c == '-' || (c >= '0' && c <= '9')) {
          parse_number(out);
          return;
        }
        error(pos_, "unexpected " + describe(pos_) + ", expected a value");
    }
  }

  void parse_literal(const char* word, Json&) {
    size_t n = std::strlen(word);
    if (size_ - pos_ < n || std::memcmp(p_ + pos_, word, n) != 0)
      error(pos_, std::string("invalid literal, expected '") + word + "'");
    pos_ += n;
  }

  void enter(int depth) {
    if (depth > max_depth_)
      error(pos_, "nesting deeper than " + std::to_string(max_depth_) + " levels");
  }

  void parse_array(Json& out, int depth) {
    enter(depth);
    ++pos_;  // '['
    out.type_ = Json::Type::Array;
    out.arr_ = std::make_shared<Json::Array>();
    skip_ws();
    if (pos_ < size_ && p_[pos_] == ']') {
      ++pos_;
      return;
    }
    for (;;) {
      skip_ws();
      if (pos_ < size_ && p_[pos_] == ']') error(pos_, "trailing comma before ']'");
      out.arr_->emplace_back();
      parse_value(out.arr_->back(), depth);
      skip_ws();
      if (pos_ >= size_) error(pos_, "unexpected end of input inside an array, expected ',' or ']'");
      unsigned char c = p_[pos_];
      if (c == ',') {
        ++pos_;
        continue;
      }
      if (c == ']') {
        ++pos_;
        return;
      }
      error(pos_, "expected ',' or ']' in an array, found " + describe(pos_));
    }
  }

  void parse_object(Json& out, int depth) {
    enter(depth);
    ++pos_;  // '{'
    out.type_ = Json::Type::Object;
    out.obj_ = std::make_shared<Json::Object>();
    std::vector<size_t> key_pos;
    skip_ws();
    if (pos_ < size_ && p_[pos_] == '}') {
      ++pos_;
      return;
    }
    for (;;) {
      skip_ws();
      if (pos_ >= size_) error(pos_, "unexpected end of input inside an object, expected a string key");
      if (p_[pos_] == '}') error(pos_, "trailing comma before '}'");
      if (p_[pos_] != '"') error(pos_, "expected a string key in an object, found " + describe(pos_));
      key_pos.push_back(pos_);
      out.obj_->emplace_back();
      auto& member = out.obj_->back();
      parse_string(member.first);
      skip_ws();
      if (pos_ >= size_ || p_[pos_] != ':')
        error(pos_, "expected ':' after the object key " + quote_for_message(member.first) + ", found " +
                        describe(pos_));
      ++pos_;
      skip_ws();
      parse_value(member.second, depth);
      skip_ws();
      if (pos_ >= size_) error(pos_, "unexpected end of input inside an object, expected ',' or '}'");
      unsigned char c = p_[pos_];
      if (c == ',') {
        ++pos_;
        continue;
      }
      if (c == '}') {
        ++pos_;
        break;
      }
      error(pos_, "expected ',' or '}' in an object, found " + describe(pos_));
    }
    check_unique_keys(*out.obj_, key_pos);
  }

  void check_unique_keys(const Json::Object& obj, const std::vector<size_t>& key_pos) {
    size_t n = obj.size();
    if (n < 2) return;
    if (n <= 8) {
      for (size_t j = 1; j < n; ++j)
        for (size_t i = 0; i < j; ++i)
          if (obj[i].first == obj[j].first) error(key_pos[j], "duplicate object key " + quote_for_message(obj[j].first));
      return;
    }
    std::vector<size_t> idx(n);
    for (size_t i = 0; i < n; ++i) idx[i] = i;
    std::sort(idx.begin(), idx.end(), [&](size_t a, size_t b) {
      int c = obj[a].first.compare(obj[b].first);
      return c != 0 ? c < 0 : a < b;
    });
    for (size_t i = 1; i < n; ++i)
      if (obj[idx[i]].first == obj[idx[i - 1]].first)
        error(key_pos[idx[i]], "duplicate object key " + quote_for_message(obj[idx[i]].first));
  }

  uint32_t read_hex4(size_t at) {
    if (size_ - at < 4) error(at, "truncated \\u escape, expected 4 hex digits");
    uint32_t v = 0;
    for (size_t i = 0; i < 4; ++i) {
      int h = hex_value(p_[at + i]);
      if (h < 0) error(at + i, "invalid hex digit " + describe(at + i) + " in a \\u escape");
      v = (v << 4) | uint32_t(h);
    }
    return v;
  }

  // Length of the well-formed UTF-8 sequence starting at `at` (a byte >= 0x80), or an error.
  size_t utf8_sequence(size_t at) {
    unsigned char c = p_[at];
    size_t len;
    unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;        // no overlongs
      else if (c == 0xED) hi = 0x9F;   // no encoded surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;        // no overlongs
      else if (c == 0xF4) hi = 0x8F;   // nothing past U+10FFFF
    } else {
      error(at, "invalid UTF-8: unexpected " + describe(at));
    }
    if (size_ - at < len) error(at, "truncated UTF-8 sequence");
    for (size_t i = 1; i < len; ++i) {
      unsigned char b = p_[at + i];
      unsigned char l = i == 1 ? lo : 0x80, h = i == 1 ? hi : 0xBF;
      if (b < l || b > h) error(at + i, "invalid UTF-8: bad continuation " + describe(at + i));
    }
    return len;
  }

  void parse_string(std::string& out) {
    size_t start = pos_;
    ++pos_;  // opening quote
    for (;;) {
      // Bulk-copy a run of plain ASCII characters.
      size_t run = pos_;
      while (run < size_) {
        unsigned char c = p_[run];
        if (c == '"' || c == '\\' || c < 0x20 || c >= 0x80) break;
        ++run;
      }
      out.append(reinterpret_cast<const char*>(p_ + pos_), run - pos_);
      pos_ = run;
      if (pos_ >= size_) error(start, "unterminated string");
      unsigned char c = p_[pos_];
      if (c == '"') {
        ++pos_;
        return;
      }
      if (c < 0x20) error(pos_, "unescaped control character " + describe(pos_) + " in a string");
      if (c >= 0x80) {
        size_t len = utf8_sequence(pos_);
        out.append(reinterpret_cast<const char*>(p_ + pos_), len);
        pos_ += len;
        continue;
      }
      // backslash escape
      if (pos_ + 1 >= size_) error(pos_, "unterminated escape sequence");
      unsigned char e = p_[pos_ + 1];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          size_t esc = pos_;
          uint32_t cp = read_hex4(pos_ + 2);
          pos_ += 6;
          if (cp >= 0xDC00 && cp <= 0xDFFF) error(esc, "unpaired low surrogate in a \\u escape");
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (size_ - pos_ < 2 || p_[pos_] != '\\' || p_[pos_ + 1] != 'u')
              error(esc, "high surrogate in a \\u escape not followed by a \\u low surrogate");
            uint32_t lo = read_hex4(pos_ + 2);
            if (lo < 0xDC00 || lo > 0xDFFF)
              error(pos_, "high surrogate in a \\u escape not followed by a low surrogate");
            pos_ += 6;
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          append_utf8(out, cp);
          continue;  // pos_ already advanced
        }
        default: error(pos_, "invalid escape sequence '\\" + (e >= 0x20 && e < 0x7f ? std::string(1, char(e)) : "?") + "'");
      }
      pos_ += 2;
    }
  }

  void parse_number(Json& out) {
    size_t start = pos_;
    bool neg = false;
    if (p_[pos_] == '-') {
      neg = true;
      ++pos_;
    }
    if (pos_ >= size_ || p_[pos_] < '0' || p_[pos_] > '9')
      error(pos_, "expected a digit in a number, found " + describe(pos_));
    bool integral = true;
    uint64_t mag = 0;
    bool mag_overflow = false;
    if (p_[pos_] == '0') {
      ++pos_;
      if (pos_ < size_ && p_[pos_] >= '0' && p_[pos_] <= '9') error(start, "leading zeros are not allowed in numbers");
    } else {
      while (pos_ < size_ && p_[pos_] >= '0' && p_[pos_] <= '9') {
        uint64_t d = p_[pos_] - '0';
        if (mag > (std::numeric_limits<uint64_t>::max() - d) / 10) mag_overflow = true;
        else mag = mag * 10 + d;
        ++pos_;
      }
    }
    if (pos_ < size_ && p_[pos_] == '.') {
      integral = false;
      ++pos_;
      if (pos_ >= size_ || p_[pos_] < '0' || p_[pos_] > '9')
        error(pos_, "expected a digit after the decimal point, found " + describe(pos_));
      while (pos_ < size_ && p_[pos_] >= '0' && p_[pos_] <= '9') ++pos_;
    }
    if (pos_ < size_ && (p_[pos_] == 'e' || p_[pos_] == 'E')) {
      integral = false;
      ++pos_;
      if (pos_ < size_ && (p_[pos_] == '+' || p_[pos_] == '-')) ++pos_;
      if (pos_ >= size_ || p_[pos_] < '0' || p_[pos_] > '9')
        error(pos_, "expected a digit in the exponent, found " + describe(pos_));
      while (pos_ < size_ && p_[pos_] >= '0' && p_[pos_] <= '9') ++pos_;
    }
    out.type_ = Json::Type::Number;
    constexpr uint64_t kMaxPos = uint64_t(std::numeric_limits<int64_t>::max());
    if (integral && !mag_overflow && (mag <= kMaxPos || (neg && mag == kMaxPos + 1))) {
      out.is_int_ = true;
      out.int_ = neg ? (mag == kMaxPos + 1 ? std::numeric_limits<int64_t>::min() : -int64_t(mag)) : int64_t(mag);
      out.num_ = double(out.int_);
      return;
    }
    std::string tok(reinterpret_cast<const char*>(p_ + start), pos_ - start);
    char* end = nullptr;
    double v = strtod_c(tok.c_str(), &end);
    if (end != tok.c_str() + tok.size()) error(start, "unparseable number");  // cannot happen after the grammar check
    if (std::isinf(v)) error(start, "number " + (tok.size() > 32 ? tok.substr(0, 32) + "..." : tok) + " is out of range of a double");
    out.is_int_ = false;
    out.num_ = v;
  }
};

// ------------------------------------------------------------------------- Json

Json Json::parse(const std::string& text, const std::string& where, ErrorKind kind, int max_depth) {
  return parse(text.data(), text.size(), where, kind, max_depth);
}

Json Json::parse(const char* data, size_t size, const std::string& where, ErrorKind kind, int max_depth) {
  if (!data && size) fail(ErrorKind::Internal, "internal error: Json::parse given a null buffer of ", size, " bytes");
  JsonParser parser(data ? data : "", size, where, kind, max_depth);
  return parser.run();
}

const char* Json::type_name() const {
  switch (type_) {
    case Type::Null: return "null";
    case Type::Bool: return "boolean";
    case Type::Number: return is_int_ ? "integer" : "number";
    case Type::String: return "string";
    case Type::Array: return "array";
    case Type::Object: return "object";
  }
  return "?";
}

const Json* Json::find(const std::string& key) const {
  if (type_ != Type::Object || !obj_) return nullptr;
  for (const auto& kv : *obj_)
    if (kv.first == key) return &kv.second;
  return nullptr;
}

size_t Json::size() const {
  if (type_ == Type::Array && arr_) return arr_->size();
  if (type_ == Type::Object && obj_) return obj_->size();
  return 0;
}

Json Json::make_bool(bool v) {
  Json j;
  j.type_ = Type::Bool;
  j.b_ = v;
  return j;
}

Json Json::make_number(double v) {
  Json j;
  j.type_ = Type::Number;
  j.num_ = v;
  return j;
}

Json Json::make_int(int64_t v) {
  Json j;
  j.type_ = Type::Number;
  j.is_int_ = true;
  j.int_ = v;
  j.num_ = double(v);
  return j;
}

Json Json::make_string(std::string v) {
  Json j;
  j.type_ = Type::String;
  j.str_ = std::move(v);
  return j;
}

Json Json::make_array(Array v) {
  Json j;
  j.type_ = Type::Array;
  j.arr_ = std::make_shared<Array>(std::move(v));
  return j;
}

Json Json::make_object(Object v) {
  Json j;
  j.type_ = Type::Object;
  j.obj_ = std::make_shared<Object>(std::move(v));
  return j;
}

namespace {

void dump_string(const std::string& s, std::string& out) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += char(c);  // UTF-8 passes through
        }
    }
  }
  out += '"';
}

void dump_number(const Json& j, std::string& out) {
  if (j.is_int()) {
    out += std::to_string(j.as_int());
    return;
  }
  double v = j.as_double();
  if (!std::isfinite(v)) {
    out += "null";
    return;
  }
  // Shortest representation that reads back to the same double.
  char buf[40];
  for (int prec = 15; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, v);
    if (strtod_c(buf, nullptr) == v) break;
  }
  // The process locale might use ',' as the decimal point.
  for (char* q = buf; *q; ++q)
    if (*q == ',') *q = '.';
  std::string s = buf;
  if (s.find_first_of(".eE") == std::string::npos) s += ".0";  // keep it a non-integer on re-reading
  out += s;
}

void dump_into(const Json& j, std::string& out) {
  switch (j.type()) {
    case Json::Type::Null: out += "null"; return;
    case Json::Type::Bool: out += j.as_bool() ? "true" : "false"; return;
    case Json::Type::Number: dump_number(j, out); return;
    case Json::Type::String: dump_string(j.as_string(), out); return;
    case Json::Type::Array: {
      out += '[';
      bool first = true;
      for (const auto& e : j.as_array()) {
        if (!first) out += ',';
        first = false;
        dump_into(e, out);
      }
      out += ']';
      return;
    }
    case Json::Type::Object: {
      out += '{';
      bool first = true;
      for (const auto& kv : j.as_object()) {
        if (!first) out += ',';
        first = false;
        dump_string(kv.first, out);
        out += ':';
        dump_into(kv.second, out);
      }
      out += '}';
      return;
    }
  }
}

}  // namespace

std::string Json::dump() const {
  std::string out;
  dump_into(*this, out);
  return out;
}

}  // namespace dflash2
