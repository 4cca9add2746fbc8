#include "core/atomic_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <random>

#include "core/process.h"

namespace spillway {
namespace {

constexpr std::string_view kTempMarker = ".tmp-";
constexpr size_t kRandomDigits = 8;

bool is_hex(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); }

}  // namespace

std::string parent_directory(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

Status fsync_directory(const std::string& dir) {
  int fd;
  do fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  while (fd < 0 && errno == EINTR);
  if (fd < 0) return errno_status("open folder " + dir + " to fsync it", errno);
  if (::fsync(fd) != 0) {
    // Some file systems cannot fsync a folder; they give EINVAL, and have nothing to flush.
    int err = errno;
    ::close(fd);
    if (err == EINVAL) return Status::ok();
    return errno_status("fsync folder " + dir, err);
  }
  if (::close(fd) != 0) return errno_status("close folder " + dir, errno);
  return Status::ok();
}

int64_t temp_file_pid(std::string_view name) {
  const size_t at = name.rfind(kTempMarker);
  if (at == std::string_view::npos || at == 0) return 0;
  std::string_view rest = name.substr(at + kTempMarker.size());  // "<pid>-<hex>"
  const size_t dash = rest.find('-');
  if (dash == std::string_view::npos || dash == 0 || dash > 12) return 0;
  int64_t pid = 0;
  for (size_t i = 0; i < dash; ++i) {
    if (rest[i] < '0' || rest[i] > '9') return 0;
    pid = pid * 10 + (rest[i] - '0');
  }
  std::string_view suffix = rest.substr(dash + 1);
  if (suffix.size() != kRandomDigits) return 0;
  for (char c : suffix)
    if (!is_hex(c)) return 0;
  return pid;
}

Result<std::vector<StaleTempFile>> find_stale_temp_files(const std::string& dir) {
  std::vector<StaleTempFile> found;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return errno_status("folder " + dir + ": cannot list it", errno);
  for (;;) {
    errno = 0;  // readdir returns null both at the end and on error
    dirent* e = ::readdir(d);
    if (e == nullptr) break;
    const int64_t pid = temp_file_pid(e->d_name);
    if (pid == 0) continue;
    std::string path = dir + "/" + e->d_name;
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0 || !(S_ISREG(st.st_mode) || S_ISDIR(st.st_mode))) continue;
    if (process_alive(pid)) continue;
    if (S_ISREG(st.st_mode)) {
      found.push_back({path, pid, static_cast<uint64_t>(st.st_blocks) * 512, false});
      continue;
    }
    uint64_t bytes = 0;  // a model directory's temporary: the files in it
    if (DIR* inner = ::opendir(path.c_str())) {
      while (dirent* f = ::readdir(inner)) {
        struct stat fst;
        if (::lstat((path + "/" + f->d_name).c_str(), &fst) == 0 && S_ISREG(fst.st_mode))
          bytes += static_cast<uint64_t>(fst.st_blocks) * 512;
      }
      ::closedir(inner);
    }
    found.push_back({path, pid, bytes, true});
  }
  int err = errno;
  if (::closedir(d) != 0 && err == 0) return errno_status("folder " + dir + ": closedir", errno);
  if (err != 0) return errno_status("folder " + dir + ": readdir", err);
  return found;
}

Status remove_stale_temp(const StaleTempFile& t) {
  if (!t.folder) {
    if (::unlink(t.path.c_str()) != 0 && errno != ENOENT) return errno_status("remove " + t.path, errno);
    return Status::ok();
  }
  DIR* d = ::opendir(t.path.c_str());
  if (d == nullptr) return errno == ENOENT ? Status::ok() : errno_status("list " + t.path, errno);
  Status first;
  for (;;) {
    errno = 0;
    dirent* e = ::readdir(d);
    if (e == nullptr) {
      if (errno != 0 && first.is_ok()) first = errno_status("readdir " + t.path, errno);
      break;
    }
    const std::string path = t.path + "/" + e->d_name;
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    if (::unlink(path.c_str()) != 0 && errno != ENOENT && first.is_ok()) first = errno_status("remove " + path, errno);
  }
  ::closedir(d);
  SPILLWAY_RETURN_IF_ERROR(first);
  if (::rmdir(t.path.c_str()) != 0 && errno != ENOENT) return errno_status("remove folder " + t.path, errno);
  return Status::ok();
}

Result<AtomicFile> AtomicFile::create(const std::string& target, mode_t mode) {
  if (target.empty()) return Status::invalid_argument("file name is empty");
  AtomicFile f;
  f.target_ = target;
  std::random_device random;
  int err = EEXIST;
  for (int attempt = 0; attempt < 16 && err == EEXIST; ++attempt) {
    char suffix[16];
    std::snprintf(suffix, sizeof suffix, "%08x", static_cast<unsigned>(random()));
    f.temp_ = target + std::string(kTempMarker) + std::to_string(::getpid()) + "-" + suffix;
    do f.fd_ = ::open(f.temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
    while (f.fd_ < 0 && errno == EINTR);
    err = f.fd_ >= 0 ? 0 : errno;
  }
  if (err != 0) return errno_status("create temporary file " + f.temp_ + " for " + target, err);
  f.remove_on_interrupt_ = RemoveOnInterrupt(f.temp_);
  return f;
}

AtomicFile::AtomicFile(AtomicFile&& other) noexcept
    : fd_(other.fd_),
      target_(std::move(other.target_)),
      temp_(std::move(other.temp_)),
      remove_on_interrupt_(std::move(other.remove_on_interrupt_)) {
  other.fd_ = -1;
  other.temp_.clear();
}

AtomicFile& AtomicFile::operator=(AtomicFile&& other) noexcept {
  if (this != &other) {
    abandon();
    fd_ = other.fd_;
    target_ = std::move(other.target_);
    temp_ = std::move(other.temp_);
    remove_on_interrupt_ = std::move(other.remove_on_interrupt_);
    other.fd_ = -1;
    other.temp_.clear();
  }
  return *this;
}

AtomicFile::~AtomicFile() { abandon(); }

void AtomicFile::abandon() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!temp_.empty()) ::unlink(temp_.c_str());  // best effort: a leftover is reported by later runs
  temp_.clear();
  remove_on_interrupt_.release();
}

Status write_file_atomically(const std::string& path, std::string_view text) {
  SPILLWAY_ASSIGN_OR_RETURN(AtomicFile f, AtomicFile::create(path));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(f.fd(), text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno_status("write " + f.temp_path(), errno);
    done += static_cast<size_t>(n);
  }
  return f.commit();
}

Status AtomicFile::commit() {
  if (fd_ < 0) return Status::invalid_argument("commit of " + target_ + ": the temporary file is already closed");
  Status s;
  if (::fsync(fd_) != 0) s = errno_status("fsync " + temp_, errno);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0 && s.is_ok()) s = errno_status("close " + temp_, errno);
  if (s.is_ok() && ::rename(temp_.c_str(), target_.c_str()) != 0)
    s = errno_status("rename " + temp_ + " to " + target_, errno);
  if (!s.is_ok()) {
    abandon();
    return s;
  }
  temp_.clear();  // it is the target now
  remove_on_interrupt_.release();
  return fsync_directory(parent_directory(target_)).with_context("after renaming onto " + target_);
}

}  // namespace spillway
