// A minimal test harness for the C++ tests (no external dependency). Each TEST registers
// a function; CHECK failures are counted and reported with file:line; the binary exits
// non-zero if any test failed. ctest runs each test binary.
#pragma once
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "dflash2/error.h"

namespace dtest {
struct Case {
  const char* name;
  std::function<void()> fn;
};
inline std::vector<Case>& registry() {
  static std::vector<Case> r;
  return r;
}
inline int& failures() {
  static int f = 0;
  return f;
}
struct Reg {
  Reg(const char* n, std::function<void()> f) { registry().push_back({n, std::move(f)}); }
};
inline int run_all() {
  int failed_cases = 0, passed = 0;
  for (auto& c : registry()) {
    int before = failures();
    try {
      c.fn();
    } catch (const std::exception& e) {
      std::printf("  %s: unexpected exception: %s\n", c.name, e.what());
      ++failures();
    }
    if (failures() != before) {
      std::printf("FAIL %s\n", c.name);
      ++failed_cases;
    } else {
      std::printf("ok   %s\n", c.name);
      ++passed;
    }
  }
  std::printf("%d passed, %d failed\n", passed, failed_cases);
  return failed_cases ? 1 : 0;
}
}  // namespace dtest

#define DT_CAT2(a, b) a##b
#define DT_CAT(a, b) DT_CAT2(a, b)
#define TEST(name)                                                  \
  static void name();                                               \
  static ::dtest::Reg DT_CAT(dt_reg_, name)(#name, name);           \
  static void name()
#define CHECK(cond)                                                                   \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      std::printf("  %s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond);          \
      ++::dtest::failures();                                                          \
    }                                                                                 \
  } while (0)
#define CHECK_NEAR(a, b, tol)                                                                          \
  do {                                                                                                 \
    double da_ = double(a), db_ = double(b);                                                           \
    if (!(std::fabs(da_ - db_) <= (tol))) {                                                            \
      std::printf("  %s:%d: CHECK_NEAR(%s, %s): %.9g vs %.9g\n", __FILE__, __LINE__, #a, #b, da_, db_); \
      ++::dtest::failures();                                                                           \
    }                                                                                                  \
  } while (0)
// Expects `stmt` to throw dflash2::Error whose message contains `substr`.
#define CHECK_THROWS(stmt, substr)                                                                  \
  do {                                                                                              \
    bool thrown_ = false;                                                                           \
    try {                                                                                           \
      stmt;                                                                                         \
    } catch (const ::dflash2::Error& e_) {                                                          \
      thrown_ = true;                                                                               \
      if (std::string(e_.what()).find(substr) == std::string::npos) {                               \
        std::printf("  %s:%d: message '%s' lacks '%s'\n", __FILE__, __LINE__, e_.what(), substr);   \
        ++::dtest::failures();                                                                      \
      }                                                                                             \
    }                                                                                               \
    if (!thrown_) {                                                                                 \
      std::printf("  %s:%d: %s did not throw\n", __FILE__, __LINE__, #stmt);                       \
      ++::dtest::failures();                                                                        \
    }                                                                                               \
  } while (0)
#define TEST_MAIN() \
  int main() { return ::dtest::run_all(); }
