// Internal to cpp/src/io: how names from untrusted files appear in error messages.
#pragma once
#include <algorithm>
#include <cstdio>
#include <string>

namespace dflash2::io {

// A tensor or file name for a message: control characters and quotes escaped, long names
// shortened, in single quotes.
inline std::string quote_name(const std::string& name) {
  std::string out = "'";
  const size_t n = std::min<size_t>(name.size(), 200);
  for (size_t i = 0; i < n; ++i) {
    const unsigned char c = static_cast<unsigned char>(name[i]);
    if (c < 0x20 || c == 0x7f || c == '\'' || c == '\\') {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += char(c);
    }
  }
  if (name.size() > n) out += "...";
  return out + "'";
}

}  // namespace dflash2::io
