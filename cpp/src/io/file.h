// Internal to cpp/src/io: reading small text files (config.json, the sharded index) that a
// checkpoint names. Only regular files are read: a FIFO would block forever, /dev/zero
// never ends, a directory has no contents; each is an error that says what the path is.
#pragma once
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

#include "dflash2/error.h"

namespace dflash2::io {

// The largest text file read whole (config.json and index files are kilobytes to a few MiB).
constexpr uint64_t kMaxTextFileBytes = uint64_t(256) << 20;

// What a stat'ed path is, for a message: "a directory", "a FIFO (named pipe)", ...
inline const char* file_kind(mode_t m) {
  if (S_ISREG(m)) return "a regular file";
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO (named pipe)";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISLNK(m)) return "a symbolic link";
  return "not a regular file";
}

// The whole contents of the regular file `path`. Errors are of `kind` and read
// "cannot read <what> '<path>': <why>". Opened non-blocking, so a FIFO is refused instead
// of waiting for a writer; a symlink loop reports ELOOP; the size is checked before reading.
inline std::string read_regular_file(const std::string& path, ErrorKind kind, const char* what,
                                     uint64_t max_bytes = kMaxTextFileBytes) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    int err = errno;
    struct stat st;
    if (err == EISDIR || (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)))
      fail(kind, "cannot read ", what, " '", path, "': it is a directory, expected a file");
    if (err == ENOENT) {
      struct stat lst;
      if (::lstat(path.c_str(), &lst) == 0 && S_ISLNK(lst.st_mode))
        fail(kind, "cannot read ", what, " '", path, "': it is a dangling symbolic link (its target does not exist)");
    }
    fail(kind, "cannot read ", what, " '", path, "': ", std::strerror(err));
  }
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    fail(kind, "cannot read ", what, " '", path, "': ", std::strerror(err));
  }
  if (S_ISDIR(st.st_mode)) fail(kind, "cannot read ", what, " '", path, "': it is a directory, expected a file");
  if (!S_ISREG(st.st_mode))
    fail(kind, "cannot read ", what, " '", path, "': it is ", file_kind(st.st_mode),
         ", not a regular file (refusing to read it)");
  if (st.st_size < 0 || uint64_t(st.st_size) > max_bytes)
    fail(kind, "cannot read ", what, " '", path, "': it is ", uint64_t(st.st_size), " bytes, more than the limit of ",
         max_bytes, " bytes for this file");
  std::string out(size_t(st.st_size), '\0');
  size_t got = 0;
  while (got < out.size()) {
    ssize_t r = ::read(fd, &out[got], out.size() - got);
    if (r < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      fail(kind, "cannot read ", what, " '", path, "': ", std::strerror(err));
    }
    if (r == 0) break;  // the file shrank while being read
    got += size_t(r);
  }
  out.resize(got);
  return out;
}

}  // namespace dflash2::io
