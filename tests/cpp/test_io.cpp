// JSON parser edge cases, safetensors validation on in-memory images and files,
// checkpoints on disk, and the Config getters' errors.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "dflash2/json.h"
#include "dflash2/safetensors.h"
#include "testing.h"

using namespace dflash2;

namespace {

Json parse(const std::string& s) { return Json::parse(s, "t.json"); }

// The kind and message of the Error thrown by f (kind Internal + "" if nothing thrown).
template <class F>
std::pair<ErrorKind, std::string> error_of(F f) {
  try {
    f();
  } catch (const Error& e) {
    return {e.kind(), e.what()};
  }
  return {ErrorKind::Internal, ""};
}

bool contains(const std::string& s, const std::string& sub) { return s.find(sub) != std::string::npos; }

// A safetensors image: 8-byte little-endian length, the header text, `data_bytes` bytes
// of data (values i & 0xff).
std::vector<uint8_t> image(const std::string& header, size_t data_bytes) {
  std::vector<uint8_t> out(8 + header.size() + data_bytes);
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[size_t(i)] = uint8_t(n >> (8 * i));
  std::memcpy(out.data() + 8, header.data(), header.size());
  for (size_t i = 0; i < data_bytes; ++i) out[8 + header.size() + i] = uint8_t(i & 0xff);
  return out;
}

std::vector<TensorInfo> parse_image(const std::string& header, size_t data_bytes,
                                    std::map<std::string, std::string>* meta = nullptr) {
  auto img = image(header, data_bytes);
  return parse_safetensors(img.data(), img.size(), "x.safetensors", meta);
}

std::string tmpdir() {
  char tmpl[] = "/tmp/dflash2_test_io_XXXXXX";
  char* d = mkdtemp(tmpl);
  if (!d) std::abort();
  return d;
}

void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

void rm_rf(const std::string& dir) {
  std::string cmd = "rm -rf '" + dir + "'";
  if (std::system(cmd.c_str()) != 0) std::printf("  (could not remove %s)\n", dir.c_str());
}

const char* kTwo =
    R"({"b":{"dtype":"F32","shape":[2,3],"data_offsets":[8,32]},"a":{"dtype":"BF16","shape":[4],"data_offsets":[0,8]}})";

}  // namespace

// --------------------------------------------------------------------------- JSON

TEST(json_values) {
  Json j = parse(R"( {"a": [1, -2, 3.5, -0, 1e3, 2E-2, true, false, null], "b": {"c": "d"}, "e": ""} )");
  CHECK(j.is_object());
  CHECK(j.size() == 3);
  const Json* a = j.find("a");
  CHECK(a && a->is_array() && a->size() == 9);
  CHECK(a->as_array()[0].is_int() && a->as_array()[0].as_int() == 1);
  CHECK(a->as_array()[1].as_int() == -2);
  CHECK(!a->as_array()[2].is_int() && a->as_array()[2].as_double() == 3.5);
  CHECK(a->as_array()[3].is_int() && a->as_array()[3].as_int() == 0);
  CHECK(!a->as_array()[4].is_int() && a->as_array()[4].as_double() == 1000.0);
  CHECK_NEAR(a->as_array()[5].as_double(), 0.02, 1e-15);
  CHECK(a->as_array()[6].is_bool() && a->as_array()[6].as_bool());
  CHECK(a->as_array()[7].is_bool() && !a->as_array()[7].as_bool());
  CHECK(a->as_array()[8].is_null());
  CHECK(j.find("b")->find("c")->as_string() == "d");
  CHECK(j.find("e")->as_string().empty());
  CHECK(j.find("zz") == nullptr);
  CHECK(a->find("x") == nullptr);  // not an object
  CHECK(parse("[]").size() == 0 && parse("{}").size() == 0);
  CHECK(std::string(parse("{}").type_name()) == "object");
  CHECK(parse("\"x\"").is_string() && parse("17").is_number());
}

TEST(json_integers_and_range) {
  CHECK(parse("9223372036854775807").is_int());
  CHECK(parse("9223372036854775807").as_int() == INT64_MAX);
  CHECK(parse("-9223372036854775808").is_int());
  CHECK(parse("-9223372036854775808").as_int() == INT64_MIN);
  Json big = parse("9223372036854775808");  // past int64: a double
  CHECK(big.is_number() && !big.is_int());
  CHECK_NEAR(big.as_double(), 9223372036854775808.0, 1.0);
  CHECK(!parse("123456789012345678901234567890").is_int());
  CHECK(!parse("1.0").is_int());
  CHECK(parse("1e-400").as_double() == 0.0);  // underflow is fine
  CHECK_THROWS(parse("1e400"), "out of range");
  CHECK_THROWS(parse("-1e400"), "out of range");
}

TEST(json_strings_and_escapes) {
  CHECK(parse(R"("a\"b\\c\/d\b\f\n\r\t")").as_string() == "a\"b\\c/d\b\f\n\r\t");
  CHECK(parse(R"("\u00e9")").as_string() == "\xc3\xa9");
  CHECK(parse(R"("\u20AC")").as_string() == "\xe2\x82\xac");
  CHECK(parse(R"("\ud83d\ude00")").as_string() == "\xf0\x9f\x98\x80");  // surrogate pair -> U+1F600
  CHECK(parse(R"("\u0000")").as_string() == std::string("\0", 1));
  CHECK(parse("\"caf\xc3\xa9 \xf0\x9f\x98\x80\"").as_string() == "caf\xc3\xa9 \xf0\x9f\x98\x80");  // raw UTF-8
  CHECK_THROWS(parse(R"("\ud83d")"), "high surrogate");
  CHECK_THROWS(parse(R"("\ud83dx")"), "high surrogate");
  CHECK_THROWS(parse(R"("\ud83d\u0041")"), "low surrogate");
  CHECK_THROWS(parse(R"("\ude00")"), "unpaired low surrogate");
  CHECK_THROWS(parse(R"("\u12")"), "\\u escape");
  CHECK_THROWS(parse(R"("\u12G4")"), "invalid hex digit");
  CHECK_THROWS(parse(R"("\x")"), "invalid escape");
  CHECK_THROWS(parse("\"a\tb\""), "unescaped control character");
  CHECK_THROWS(parse("\"a\nb\""), "unescaped control character");
  CHECK_THROWS(parse("\"abc"), "unterminated string");
  CHECK_THROWS(parse("\"abc\\"), "unterminated");
  // Malformed UTF-8: overlong, encoded surrogate, past U+10FFFF, stray continuation, truncated.
  CHECK_THROWS(parse("\"\xc0\x80\""), "invalid UTF-8");
  CHECK_THROWS(parse("\"\xe0\x80\x80\""), "invalid UTF-8");
  CHECK_THROWS(parse("\"\xed\xa0\x80\""), "invalid UTF-8");
  CHECK_THROWS(parse("\"\xf4\x90\x80\x80\""), "invalid UTF-8");
  CHECK_THROWS(parse("\"\xf5\x80\x80\x80\""), "invalid UTF-8");
  CHECK_THROWS(parse("\"\x80\""), "invalid UTF-8");
  CHECK_THROWS(parse("\"\xe2\x82\""), "invalid UTF-8");
  CHECK_THROWS(parse("\"\xe2\x82"), "UTF-8");
}

TEST(json_grammar_errors) {
  const char* bad[] = {"",      "   ",    "01",     "-",        "-01",       "1.",     ".5",     "+1",
                       "1e",    "1e+",    "0x10",   "[1,]",     "[,1]",      "[1 2]",  "{\"a\":1,}", "{'a':1}",
                       "{a:1}", "{\"a\" 1}", "{\"a\":}", "nul",  "tru",       "falsey", "NaN",    "Infinity",
                       "-Infinity", "{} x", "[1]]", "{\"a\":1}}", "[", "{", "\"a\" \"b\"", "\xef\xbb\xbf{}",
                       "[1,\n2,]", "\x01", "{\"a\":1 \"b\":2}", "1 2"};
  for (const char* s : bad) {
    auto [kind, msg] = error_of([&] { parse(s); });
    if (msg.empty()) std::printf("  accepted invalid JSON: '%s'\n", s);
    CHECK(!msg.empty());
    CHECK(contains(msg, "t.json: malformed JSON at byte "));
    CHECK(kind == ErrorKind::InvalidArgument);
  }
  CHECK_THROWS(parse("01"), "leading zero");
  CHECK_THROWS(parse("[1,]"), "trailing comma");
  CHECK_THROWS(parse("{} x"), "after the JSON value");
  CHECK_THROWS(parse("\xef\xbb\xbf{}"), "byte order mark");
  CHECK_THROWS(parse("{\"k\": 1, \"k\": 2}"), "duplicate object key 'k'");
  // many keys take the sorted path
  CHECK_THROWS(parse("{\"a\":1,\"b\":2,\"c\":3,\"d\":4,\"e\":5,\"f\":6,\"g\":7,\"h\":8,\"i\":9,\"c\":0}"),
               "duplicate object key 'c'");
  // whitespace everywhere it is allowed
  CHECK(parse(" \t\r\n{ \"a\" : [ 1 , 2 ] } \n").find("a")->size() == 2);
}

TEST(json_error_offsets_and_kind) {
  CHECK_THROWS(parse("[1, 2, x]"), "t.json: malformed JSON at byte 7: ");
  CHECK_THROWS(parse("{\"a\": 01}"), "at byte 6: leading zero");
  CHECK_THROWS(Json::parse("[1,]", "w"), "w: malformed JSON at byte 3");
  auto [kind, msg] = error_of([] { Json::parse("{", "h", ErrorKind::Checkpoint); });
  CHECK(kind == ErrorKind::Checkpoint);
  CHECK(contains(msg, "h: malformed JSON at byte 1"));
  auto [kind2, msg2] = error_of([] { Json::parse("}", "c", ErrorKind::Config); });
  CHECK(kind2 == ErrorKind::Config);
  // the pointer + size overload does not read past `size`
  const char buf[] = "[1,2]garbage";
  CHECK(Json::parse(buf, 5, "b").size() == 2);
  CHECK_THROWS(Json::parse(buf, 4, "b"), "end of input");
}

TEST(json_depth_limit) {
  auto nested = [](int n) { return std::string(size_t(n), '[') + std::string(size_t(n), ']'); };
  CHECK(parse(nested(64)).is_array());
  CHECK_THROWS(parse(nested(65)), "nesting deeper than 64");
  CHECK(Json::parse(nested(10), "d", ErrorKind::InvalidArgument, 10).is_array());
  CHECK_THROWS(Json::parse(nested(11), "d", ErrorKind::InvalidArgument, 10), "nesting deeper than 10");
  // Hostile depth: must be an error, not a stack overflow, even with a huge limit asked for.
  std::string deep(1000000, '[');
  CHECK_THROWS(parse(deep), "nesting deeper");
  CHECK_THROWS(Json::parse(deep, "d", ErrorKind::InvalidArgument, 1 << 30), "nesting deeper");
  std::string deep_obj;
  for (int i = 0; i < 100000; ++i) deep_obj += "{\"a\":";
  CHECK_THROWS(parse(deep_obj), "nesting deeper");
}

TEST(json_dump) {
  const char* texts[] = {R"({"a":[1,-2,3.5,true,false,null],"b":{"c":"d\n\"e\""},"u":"\u00e9"})", "[]", "{}",
                         "[0.1,1e+300,-2.5e-300,123456789012]"};
  for (const char* t : texts) {
    Json j = parse(t);
    std::string d = j.dump();
    CHECK(parse(d).dump() == d);  // stable
  }
  CHECK(parse(R"({"b":1,"a":2})").dump() == R"({"b":1,"a":2})");  // keeps file order, compact
  CHECK(parse("[ 1 , 2 ]").dump() == "[1,2]");
  CHECK(parse("\"\\u0001\"").dump() == "\"\\u0001\"");
  CHECK(parse("0.1").dump() == "0.1");
  CHECK(Json::make_number(2.0).dump() == "2.0");
  CHECK(!parse(Json::make_number(2.0).dump()).is_int());
  CHECK(Json::make_number(1.0 / 0.0).dump() == "null");
  CHECK(Json::make_int(-7).dump() == "-7");
  Json o = Json::make_object({{"x", Json::make_array({Json::make_string("y"), Json::make_bool(true), Json()})}});
  CHECK(o.dump() == R"({"x":["y",true,null]})");
  CHECK(parse("1e300").as_double() == parse(parse("1e300").dump()).as_double());
  CHECK(parse("0.30000000000000004").as_double() == parse(parse("0.30000000000000004").dump()).as_double());
}

// --------------------------------------------------------------------------- safetensors images

TEST(safetensors_valid_image) {
  std::map<std::string, std::string> meta;
  std::string header = std::string(R"({"__metadata__":{"format":"pt","x":"y"},)") + (kTwo + 1);
  auto infos = parse_image(header, 32, &meta);
  CHECK(infos.size() == 2);
  CHECK(infos[0].name == "a" && infos[1].name == "b");  // sorted by name
  CHECK(infos[0].dtype == DType::BF16 && infos[0].shape == std::vector<int64_t>{4});
  CHECK(infos[0].begin == 0 && infos[0].end == 8);
  CHECK(infos[1].dtype == DType::F32 && infos[1].shape == (std::vector<int64_t>{2, 3}));
  CHECK(infos[1].file == "x.safetensors");
  CHECK(meta.size() == 2 && meta["format"] == "pt");
  // header padded with trailing spaces (as writers do for alignment), a scalar, an empty tensor
  auto more = parse_image(R"({"s":{"dtype":"I64","shape":[],"data_offsets":[0,8]},)"
                          R"("z":{"dtype":"U8","shape":[0,5],"data_offsets":[4,4]}}     )",
                          8);
  CHECK(more.size() == 2 && more[0].shape.empty() && more[1].end == more[1].begin);
  // every supported dtype
  for (const char* dt : {"F32", "F16", "BF16", "F8_E4M3", "U8", "I32", "I64"}) {
    DType t;
    CHECK(dtype_from_name(dt, &t));
    size_t n = dtype_size(t) * 3;
    std::string h = std::string(R"({"t":{"dtype":")") + dt + R"(","shape":[3],"data_offsets":[0,)" +
                    std::to_string(n) + "]}}";
    CHECK(parse_image(h, n).at(0).dtype == t);
  }
  CHECK(parse_image("{}", 0).empty());
  // data past the last tensor (holes) is allowed
  CHECK(parse_image(kTwo, 100).size() == 2);
}

TEST(safetensors_file_level_errors) {
  const uint8_t tiny[4] = {1, 2, 3, 4};
  CHECK_THROWS(parse_safetensors(tiny, 4, "f.st"), "f.st: file is too short");
  CHECK_THROWS(parse_safetensors(tiny, 0, "f.st"), "0 bytes");
  auto img = image(kTwo, 32);
  img[0] = 0xe8;  // 1000
  img[1] = 0x03;
  CHECK_THROWS(parse_safetensors(img.data(), img.size(), "f.st"), "header length 1000 exceeds the file size");
  auto msg = error_of([&] { parse_safetensors(img.data(), img.size(), "f.st"); }).second;
  CHECK(contains(msg, "file size " + std::to_string(img.size())));
  for (int i = 0; i < 8; ++i) img[size_t(i)] = 0xff;  // 2^64 - 1
  CHECK_THROWS(parse_safetensors(img.data(), img.size(), "f.st"), "header length 18446744073709551615");
  auto k = error_of([&] { parse_safetensors(img.data(), img.size(), "f.st"); }).first;
  CHECK(k == ErrorKind::Checkpoint);
  CHECK_THROWS(parse_image("{\"a\":", 0), "x.safetensors (safetensors header): malformed JSON at byte 5");
  CHECK(error_of([] { parse_image("{", 0); }).first == ErrorKind::Checkpoint);
  CHECK_THROWS(parse_image("", 0), "malformed JSON");
  CHECK_THROWS(parse_image("[1,2]", 0), "header must be a JSON object, found array");
  CHECK_THROWS(parse_image(R"({"__metadata__":[1]})", 0), "'__metadata__' must be an object");
  CHECK_THROWS(parse_image(R"({"__metadata__":{"k":1}})", 0), "'__metadata__' entry 'k': expected a string");
  CHECK_THROWS(parse_image(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{}})", 1),
               "duplicate object key 'a'");
}

TEST(safetensors_entry_errors) {
  struct Case {
    const char* header;
    size_t data;
    const char* expect;
  } cases[] = {
      {R"({"w":5})", 0, "x.safetensors: tensor 'w': expected an object"},
      {R"({"w":{"shape":[1],"data_offsets":[0,4]}})", 4, "tensor 'w': missing field 'dtype'"},
      {R"({"w":{"dtype":"F32","data_offsets":[0,4]}})", 4, "tensor 'w': missing field 'shape'"},
      {R"({"w":{"dtype":"F32","shape":[1]}})", 4, "tensor 'w': missing field 'data_offsets'"},
      {R"({"w":{"dtype":7,"shape":[1],"data_offsets":[0,4]}})", 4, "field 'dtype': expected a string, found integer"},
      {R"({"w":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", 8,
       "tensor 'w': unsupported dtype 'F64' (supported: F32 F16 BF16 F8_E4M3 U8 I32 I64)"},
      {R"({"w":{"dtype":"f32","shape":[1],"data_offsets":[0,4]}})", 4, "unsupported dtype 'f32'"},
      {R"({"w":{"dtype":"F32","shape":"1","data_offsets":[0,4]}})", 4, "field 'shape': expected an array"},
      {R"({"w":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", 4, "field 'shape': expected an array"},
      {R"({"w":{"dtype":"F32","shape":[2,-1],"data_offsets":[0,4]}})", 4, "has a negative dimension -1"},
      {R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})", 4,
       "more elements than fit in 64 bits"},
      {R"({"w":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,4]}})", 4, "is too large"},
      {R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", 4, "field 'data_offsets': expected [begin, end]"},
      {R"({"w":{"dtype":"F32","shape":[1],"data_offsets":{"a":1}}})", 4, "expected [begin, end]"},
      {R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})", 4, "expected two non-negative integers"},
      {R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4.0]}})", 4, "expected two non-negative integers"},
      {R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,18446744073709551616]}})", 4,
       "expected two non-negative integers"},
      {R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[4,0]}})", 4, "tensor 'w': data_offsets [4, 0] have begin > end"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4,
       "tensor 'w': data_offsets [0, 8] end beyond the data region of 4 bytes"},
      {R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}})", 16,
       "tensor 'w': byte size does not match dtype and shape: F32 [2, 2] needs 16 bytes, data_offsets [0, 12] hold 12"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"v":{"dtype":"U8","shape":[4],"data_offsets":[6,10]}})",
       10, "tensors 'w' (data_offsets [0, 8]) and 'v' (data_offsets [6, 10]) overlap"},
      {R"({"a":{"dtype":"U8","shape":[10],"data_offsets":[0,10]},"b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]}})",
       10, "tensors 'a' (data_offsets [0, 10]) and 'b' (data_offsets [3, 5]) overlap"},
      {R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
       4, "overlap"},
      {"{\"w\\n\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]}}", 8, "tensor 'w\\x0a'"},
  };
  for (const auto& c : cases) {
    auto [kind, msg] = error_of([&] { parse_image(c.header, c.data); });
    if (!contains(msg, c.expect)) std::printf("  header %s\n    message '%s'\n    lacks '%s'\n", c.header, msg.c_str(), c.expect);
    CHECK(contains(msg, c.expect));
    CHECK(kind == ErrorKind::Checkpoint);
  }
  // A zero-size tensor inside another's range does not overlap it.
  CHECK(parse_image(R"({"a":{"dtype":"U8","shape":[10],"data_offsets":[0,10]},"e":{"dtype":"U8","shape":[0],"data_offsets":[5,5]}})",
                    10).size() == 2);
  // Adjacent ranges are fine in any order.
  CHECK(parse_image(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[4,8]},"b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
                    8).size() == 2);
}

// --------------------------------------------------------------------------- files and checkpoints

TEST(safetensors_file_mmap) {
  std::string dir = tmpdir();
  std::string path = dir + "/m.safetensors";
  write_file(path, image(kTwo, 32));
  Tensor b;
  {
    auto f = SafetensorsFile::open(path);
    CHECK(f->tensors().size() == 2);
    CHECK(f->find("a") != nullptr && f->find("nope") == nullptr);
    CHECK(f->file_size() == 8 + std::strlen(kTwo) + 32);
    b = f->tensor("b");
    CHECK_THROWS(f->tensor("nope"), "no tensor 'nope'");
  }  // the file object is gone; the view keeps the mapping alive
  CHECK(b.dtype() == DType::F32 && b.shape() == (Tensor::Shape{2, 3}) && b.is_contiguous());
  const uint8_t* p = static_cast<const uint8_t*>(b.data());
  for (int i = 0; i < 24; ++i) CHECK(p[i] == uint8_t(8 + i));  // data bytes 8..31
  // writing into a view changes a private copy, never the file
  static_cast<uint8_t*>(b.data())[0] = 0xAB;
  b = Tensor();
  auto again = SafetensorsFile::open(path);
  CHECK(static_cast<const uint8_t*>(again->tensor("b").data())[0] == 8);

  CHECK_THROWS(SafetensorsFile::open(dir + "/missing.safetensors"), "missing.safetensors': No such file");
  CHECK_THROWS(SafetensorsFile::open(dir), "is a directory");
  write_text(dir + "/empty.safetensors", "");
  CHECK_THROWS(SafetensorsFile::open(dir + "/empty.safetensors"), "empty (0 bytes)");
  auto trunc = image(kTwo, 20);  // b needs bytes 8..32
  write_file(dir + "/trunc.safetensors", trunc);
  CHECK_THROWS(SafetensorsFile::open(dir + "/trunc.safetensors"),
               "trunc.safetensors: tensor 'b': data_offsets [8, 32] end beyond the data region of 20 bytes");
  rm_rf(dir);
}

TEST(checkpoint_directory_and_index) {
  std::string dir = tmpdir();
  write_file(dir + "/s1.safetensors", image(R"({"x":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 4));
  write_file(dir + "/s2.safetensors",
             image(R"({"y":{"dtype":"I32","shape":[2],"data_offsets":[0,8]},"xy":{"dtype":"U8","shape":[1],"data_offsets":[8,9]}})", 9));
  // no index: all *.safetensors
  Checkpoint ck = Checkpoint::open(dir);
  CHECK(ck.names() == (std::vector<std::string>{"x", "xy", "y"}));
  CHECK(ck.files().size() == 2);
  CHECK(ck.total_bytes() == 13);
  CHECK(!ck.has_config());
  CHECK(ck.has("y") && !ck.has("z"));
  CHECK(ck.info("y").file == dir + "/s2.safetensors");
  CHECK(ck.tensor("y").shape() == Tensor::Shape{2});
  CHECK_THROWS(ck.info("yy"), "has no tensor 'yy' (did you mean 'xy', 'y', 'x'?)");
  CHECK_THROWS(ck.tensor("model.zzz"), ("checkpoint '" + dir + "' has no tensor 'model.zzz'").c_str());

  // index
  write_text(dir + "/model.safetensors.index.json",
             R"({"metadata":{"total_size":13},"weight_map":{"x":"s1.safetensors","y":"s2.safetensors","xy":"s2.safetensors"}})");
  write_text(dir + "/config.json", R"({"hidden_size": 64, "name": "demo"})");
  Checkpoint ck2 = Checkpoint::open(dir);
  CHECK(ck2.names().size() == 3 && ck2.has_config());
  CHECK(ck2.config().get_int("hidden_size") == 64);

  write_text(dir + "/model.safetensors.index.json", R"({"weight_map":{"x":"s1.safetensors","y":"s3.safetensors"}})");
  CHECK_THROWS(Checkpoint::open(dir), "names file 's3.safetensors' (for tensor 'y'");
  write_text(dir + "/model.safetensors.index.json",
             R"({"weight_map":{"x":"s1.safetensors","y":"s1.safetensors","xy":"s2.safetensors"}})");
  CHECK_THROWS(Checkpoint::open(dir), ("maps tensor 'y' to 's1.safetensors', which does not contain it (it is in '" +
                                       dir + "/s2.safetensors')").c_str());
  write_text(dir + "/model.safetensors.index.json", R"({"weight_map":{"q":"s1.safetensors"}})");
  CHECK_THROWS(Checkpoint::open(dir), "maps tensor 'q' to 's1.safetensors', which does not contain it");
  write_text(dir + "/model.safetensors.index.json", R"({"weight_map":{"x":"../s1.safetensors"}})");
  CHECK_THROWS(Checkpoint::open(dir), "not a relative path inside the checkpoint directory");
  write_text(dir + "/model.safetensors.index.json", R"({"weight_map":{"x":"s1.safetensors",)");
  auto [k1, m1] = error_of([&] { Checkpoint::open(dir); });
  CHECK(k1 == ErrorKind::Checkpoint && contains(m1, "model.safetensors.index.json: malformed JSON at byte"));
  write_text(dir + "/model.safetensors.index.json", R"({"metadata":{}})");
  CHECK_THROWS(Checkpoint::open(dir), "missing field 'weight_map'");

  // duplicate across files
  std::remove((dir + "/model.safetensors.index.json").c_str());
  write_file(dir + "/s3.safetensors", image(R"({"y":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1));
  CHECK_THROWS(Checkpoint::open(dir), ("tensor 'y' is present in two files: '" + dir + "/s2.safetensors' and '" + dir +
                                       "/s3.safetensors'").c_str());
  std::remove((dir + "/s3.safetensors").c_str());

  // malformed config.json is a Config error naming the file
  write_text(dir + "/config.json", "{\"hidden_size\": 64,}");
  auto [k2, m2] = error_of([&] { Checkpoint::open(dir); });
  CHECK(k2 == ErrorKind::Config);
  CHECK(contains(m2, dir + "/config.json: malformed JSON at byte"));
  std::remove((dir + "/config.json").c_str());

  // a single file
  Checkpoint one = Checkpoint::open(dir + "/s1.safetensors");
  CHECK(one.names() == std::vector<std::string>{"x"});

  CHECK_THROWS(Checkpoint::open(dir + "/nothing"), "does not exist");
  std::string empty_dir = dir + "/sub";
  ::mkdir(empty_dir.c_str(), 0755);
  CHECK_THROWS(Checkpoint::open(empty_dir), "contains no model.safetensors.index.json and no *.safetensors files");
  rm_rf(dir);
}

// --------------------------------------------------------------------------- Config

TEST(config_getters) {
  Config c(Json::parse(R"({"hidden_size": 4096, "eps": 1e-5, "theta": 10000, "name": "glm", "flag": true,
                           "bad_int": "abc", "float_int": 4096.0, "half": 2.5, "ids": [1, 2, 3], "mixed": [1, "x"],
                           "names": ["a", "b"], "nul": null, "sub": {"k": 3}, "notobj": 1})",
                       "config.json"),
           "config.json");
  CHECK(c.has("hidden_size") && !c.has("nope"));
  CHECK(c.get_int("hidden_size") == 4096);
  CHECK(c.get_int("float_int") == 4096);
  CHECK(c.get_int("nope", 7) == 7);
  CHECK(c.get_int("nul", 9) == 9);
  CHECK_NEAR(c.get_double("eps"), 1e-5, 1e-20);
  CHECK(c.get_double("theta") == 10000.0);  // integers are numbers
  CHECK(c.get_double("nope", 0.5) == 0.5);
  CHECK(c.get_bool("flag", false) && c.get_bool("nope", true));
  CHECK(c.get_string("name") == "glm" && c.get_string("nope", "d") == "d");
  CHECK(c.get_int_list("ids") == (std::vector<int64_t>{1, 2, 3}));
  CHECK(c.get_string_list("names") == (std::vector<std::string>{"a", "b"}));
  CHECK(c.sub("sub").get_int("k") == 3);
  CHECK(c.sub("absent").root().is_null());

  CHECK_THROWS(c.get_int("nope"), "config.json: missing required field 'nope'");
  CHECK_THROWS(c.get_int("bad_int"), "config.json: field 'bad_int': expected an integer, found \"abc\" (string)");
  CHECK_THROWS(c.get_int("half"), "field 'half': expected an integer, found 2.5");
  CHECK_THROWS(c.get_int("bad_int", 1), "field 'bad_int': expected an integer");
  CHECK_THROWS(c.get_double("name"), "field 'name': expected a number, found \"glm\"");
  CHECK_THROWS(c.get_bool("hidden_size", false), "field 'hidden_size': expected true or false, found 4096");
  CHECK_THROWS(c.get_string("flag"), "field 'flag': expected a string, found true");
  CHECK_THROWS(c.get_int_list("mixed"), "field 'mixed': expected a list of integers, element 1 is \"x\"");
  CHECK_THROWS(c.get_int_list("name"), "field 'name': expected a list of integers");
  CHECK_THROWS(c.get_string_list("ids"), "field 'ids': expected a list of strings, element 0 is 1");
  CHECK_THROWS(c.sub("notobj"), "field 'notobj': expected an object, found 1");
  CHECK_THROWS(c.sub("sub").get_string("k"), "config.json:sub: field 'k': expected a string, found 3");
  auto [kind, msg] = error_of([&] { c.get_int("bad_int"); });
  CHECK(kind == ErrorKind::Config);
  CHECK_THROWS(Config(Json::parse("[1]", "x"), "arr.json"), "arr.json: expected a JSON object at the top level");
}

TEST(config_load) {
  std::string dir = tmpdir();
  write_text(dir + "/config.json", R"({"a": 1})");
  CHECK(Config::load(dir + "/config.json").get_int("a") == 1);
  CHECK(Config::load(dir + "/config.json").path() == dir + "/config.json");
  write_text(dir + "/bad.json", "{\"a\": 1");
  auto [kind, msg] = error_of([&] { Config::load(dir + "/bad.json"); });
  CHECK(kind == ErrorKind::Config);
  CHECK(contains(msg, dir + "/bad.json: malformed JSON at byte 7"));
  write_text(dir + "/list.json", "[1]");
  CHECK_THROWS(Config::load(dir + "/list.json"), "expected a JSON object at the top level, found array");
  CHECK_THROWS(Config::load(dir + "/none.json"), "none.json': No such file");
  CHECK_THROWS(Config::load(dir), "is a directory");
  rm_rf(dir);
}

TEST_MAIN()
