#include "core/interrupt.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace spillway {
namespace {

static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs a lock-free atomic int");

std::atomic<int> g_first_signal{0};
std::atomic<int> g_signal_count{0};
std::atomic<int> g_mode{static_cast<int>(InterruptMode::BetweenSteps)};
std::atomic<int> g_pipe_write{-1};

// Never destroyed: the watcher may use it while static destructors run.
struct Registry {
  std::mutex mu;
  std::map<uint64_t, std::string> paths;
  uint64_t next_id = 1;
  std::mutex install_mu;
  bool installed = false;
};
Registry& registry() {
  static Registry* r = new Registry();
  return *r;
}

extern "C" void on_interrupt_signal(int signo) {
  const int saved_errno = errno;
  int none = 0;
  g_first_signal.compare_exchange_strong(none, signo);
  g_signal_count.fetch_add(1);
  const unsigned char byte = static_cast<unsigned char>(signo);
  const int fd = g_pipe_write.load();
  if (fd >= 0) {
    ssize_t n = ::write(fd, &byte, 1);  // the pipe is non-blocking: a full pipe loses nothing that matters
    (void)n;
  }
  errno = saved_errno;
}

void say(const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(STDERR_FILENO, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

// A file, or a directory and the files directly in it; true if it is gone.
bool remove_path(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return errno == ENOENT;
  if (!S_ISDIR(st.st_mode)) return ::unlink(path.c_str()) == 0 || errno == ENOENT;
  if (DIR* d = ::opendir(path.c_str())) {
    while (dirent* e = ::readdir(d)) {
      if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) continue;
      std::string inner = path + "/" + e->d_name;
      struct stat ist;
      if (::lstat(inner.c_str(), &ist) == 0 && !S_ISDIR(ist.st_mode)) ::unlink(inner.c_str());
    }
    ::closedir(d);
  }
  return ::rmdir(path.c_str()) == 0 || errno == ENOENT;
}

[[noreturn]] void end_at_once(int signo, bool again) {
  const std::vector<std::string> removed = remove_paths_registered_for_interrupt();
  std::string text = "\nspillway: " + signal_name(signo) + (again ? " received again" : " received") +
                     ": stopped at once";
  for (size_t i = 0; i < removed.size(); ++i) text += (i == 0 ? "; removed " : ", ") + removed[i];
  say(text + "\n");
  ::_exit(128 + signo);
}

void watch(int read_fd) {
  for (;;) {
    unsigned char byte = 0;
    ssize_t n = ::read(read_fd, &byte, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    const int signo = byte;
    const bool at_once = static_cast<InterruptMode>(g_mode.load()) == InterruptMode::AtOnce;
    if (at_once || g_signal_count.load() >= 2) end_at_once(signo, !at_once);
    say("\nspillway: " + signal_name(signo) +
        " received: stopping after the current step (send it again to stop at once)\n");
  }
}

}  // namespace

Status install_interrupt_handlers(InterruptMode mode) {
  g_mode.store(static_cast<int>(mode));
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.install_mu);
  if (r.installed) return Status::ok();
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return errno_status("interrupt handlers: pipe2", errno);
  int flags = ::fcntl(fds[1], F_GETFL);
  if (flags < 0 || ::fcntl(fds[1], F_SETFL, flags | O_NONBLOCK) != 0) {
    Status s = errno_status("interrupt handlers: fcntl O_NONBLOCK", errno);
    ::close(fds[0]);
    ::close(fds[1]);
    return s;
  }
  try {
    std::thread(watch, fds[0]).detach();
  } catch (const std::system_error& e) {
    ::close(fds[0]);
    ::close(fds[1]);
    return Status::io_error(std::string("interrupt handlers: cannot start the watcher thread: ") + e.what());
  }
  g_pipe_write.store(fds[1]);
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_interrupt_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int signo : {SIGINT, SIGTERM})
    if (::sigaction(signo, &sa, nullptr) != 0) return errno_status("interrupt handlers: sigaction " + signal_name(signo), errno);
  r.installed = true;
  return Status::ok();
}

bool interrupted() { return g_first_signal.load() != 0; }

int interrupt_signal() { return g_first_signal.load(); }

int interrupt_exit_code() {
  const int signo = g_first_signal.load();
  return 128 + (signo != 0 ? signo : SIGINT);
}

std::string signal_name(int signo) {
  switch (signo) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    default: return "signal " + std::to_string(signo);
  }
}

Status interrupted_status(const std::string& where) {
  return Status::interrupted("interrupted by " + signal_name(interrupt_signal()) + " " + where);
}

RemoveOnInterrupt::RemoveOnInterrupt(std::string path) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  id_ = r.next_id++;
  r.paths.emplace(id_, std::move(path));
}

RemoveOnInterrupt::~RemoveOnInterrupt() { release(); }

RemoveOnInterrupt::RemoveOnInterrupt(RemoveOnInterrupt&& other) noexcept : id_(other.id_) { other.id_ = 0; }

RemoveOnInterrupt& RemoveOnInterrupt::operator=(RemoveOnInterrupt&& other) noexcept {
  if (this != &other) {
    release();
    id_ = other.id_;
    other.id_ = 0;
  }
  return *this;
}

void RemoveOnInterrupt::release() {
  if (id_ == 0) return;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.paths.erase(id_);
  id_ = 0;
}

std::vector<std::string> remove_paths_registered_for_interrupt() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::string> removed;
  for (auto& [id, path] : r.paths)
    if (remove_path(path)) removed.push_back(path);
  r.paths.clear();
  return removed;
}

}  // namespace spillway
