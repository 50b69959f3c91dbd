// dflash2/error.h: errors are values with context. Every failure the runtime can
// detect (bad checkpoint, bad config, bad request, missing backend) is thrown as a
// dflash2::Error whose message names the file / tensor / field / argument, what was
// expected and what was found. Nothing in the library calls abort() on bad input.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace dflash2 {

enum class ErrorKind {
  InvalidArgument,  // a bad request or API argument (Python: ValueError)
  Checkpoint,       // malformed / truncated / inconsistent weights file (Python: ValueError)
  Config,           // inconsistent or unsupported config.json value (Python: ValueError)
  Unsupported,      // a path that is not implemented (Python: NotImplementedError)
  Backend,          // a device/backend failure, e.g. a CUDA error (Python: RuntimeError)
  OutOfMemory,      // an arena or device allocation that does not fit (Python: MemoryError)
  Internal,         // a broken invariant inside the runtime (Python: RuntimeError)
  Numerical,        // non-finite values where the model must produce finite ones, e.g. NaN logits
                    // from NaN weights (Python: ArithmeticError)
};

const char* error_kind_name(ErrorKind k);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& msg) : std::runtime_error(msg), kind_(kind) {}
  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

namespace detail {
inline void append_all(std::ostringstream&) {}
template <class T, class... R>
void append_all(std::ostringstream& os, const T& v, const R&... rest) {
  os << v;
  append_all(os, rest...);
}
}  // namespace detail

// Builds a message from any streamable pieces and throws.
template <class... A>
[[noreturn]] void fail(ErrorKind kind, const A&... parts) {
  std::ostringstream os;
  detail::append_all(os, parts...);
  throw Error(kind, os.str());
}

}  // namespace dflash2

#define DFLASH2_CHECK(cond, kind, ...)                 \
  do {                                                 \
    if (!(cond)) ::dflash2::fail((kind), __VA_ARGS__); \
  } while (0)

#define DFLASH2_CHECK_ARG(cond, ...) DFLASH2_CHECK(cond, ::dflash2::ErrorKind::InvalidArgument, __VA_ARGS__)
#define DFLASH2_INTERNAL(cond, ...) DFLASH2_CHECK(cond, ::dflash2::ErrorKind::Internal, "internal error: ", __VA_ARGS__)
