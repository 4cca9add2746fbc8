#include "core/input_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

namespace spillway {

const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a named pipe (FIFO)";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

namespace {
Status not_regular(const std::string& path, const std::string& what, mode_t mode) {
  return Status::invalid_argument(what + " " + path + " is " + file_kind(mode) + "; expected a regular file");
}
}  // namespace

Result<int> open_regular_file(const std::string& path, const std::string& what, struct stat* st_out) {
  int fd;
  do fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return Status::not_found(what + " " + path + ": no such file");
    return errno_status("open " + what + " " + path, err);
  }
  struct stat st {};
  Status s;
  if (::fstat(fd, &st) != 0) {
    s = errno_status("fstat " + what + " " + path, errno);
  } else if (!S_ISREG(st.st_mode)) {
    s = not_regular(path, what, st.st_mode);
  } else {
    const int flags = ::fcntl(fd, F_GETFL);
    if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) s = errno_status("fcntl " + what + " " + path, errno);
  }
  if (!s.is_ok()) {
    ::close(fd);  // read-only: nothing to lose; the first error is the one reported
    return s;
  }
  if (st_out != nullptr) *st_out = st;
  return fd;
}

Status check_regular_file(const std::string& path, const std::string& what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT) return Status::not_found(what + " " + path + ": no such file");
    return errno_status("stat " + what + " " + path, err);
  }
  if (!S_ISREG(st.st_mode)) return not_regular(path, what, st.st_mode);
  return Status::ok();
}

}  // namespace spillway
