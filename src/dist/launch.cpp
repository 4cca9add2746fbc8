#include "dist/launch.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <set>

extern char** environ;

namespace spillway {

namespace {

using Clock = std::chrono::steady_clock;

std::string signal_text(int sig) {
  switch (sig) {
    case SIGHUP: return "SIGHUP";
    case SIGINT: return "SIGINT";
    case SIGQUIT: return "SIGQUIT";
    case SIGILL: return "SIGILL";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGKILL: return "SIGKILL";
    case SIGSEGV: return "SIGSEGV";
    case SIGPIPE: return "SIGPIPE";
    case SIGTERM: return "SIGTERM";
    default: return "signal " + std::to_string(sig);
  }
}

// Writes all of `data` to fd (EINTR retried). False on an error (EPIPE: the reader
// went away), which the caller reports once.
bool write_all(int fd, const char* data, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, data, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    data += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

// One output stream of a rank > 0: its pipe's read end, and the line not yet ended.
struct Stream {
  int fd = -1;      // -1 once at end of file
  int to = -1;      // where its lines go
  std::string prefix;
  std::string partial;
};

struct Rank {
  pid_t pid = -1;
  bool started = false;
  bool running = false;
  int status = 0;  // waitpid's, once ended
};

// Restores the thread's signal mask and closes the fds it owns when the launch ends.
struct Cleanup {
  sigset_t old_mask{};
  bool mask_set = false;
  std::vector<int> fds;
  ~Cleanup() {
    for (int fd : fds)
      if (fd >= 0) ::close(fd);
    if (mask_set) ::pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
  }
};

}  // namespace

std::string describe_wait_status(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "was killed by " + signal_text(WTERMSIG(status));
  return "ended (wait status " + std::to_string(status) + ")";
}

Result<LaunchOutcome> launch_ranks(const LaunchOptions& o) {
  if (o.world < 1) return Status::invalid_argument("launch: " + std::to_string(o.world) + " ranks; need at least 1");
  if (o.program.empty()) return Status::invalid_argument("launch: no program to start");

  Cleanup cleanup;
  sigset_t watched;
  sigemptyset(&watched);
  sigaddset(&watched, SIGINT);
  sigaddset(&watched, SIGTERM);
  sigaddset(&watched, SIGCHLD);
  if (int rc = ::pthread_sigmask(SIG_BLOCK, &watched, &cleanup.old_mask); rc != 0)
    return errno_status("launch: pthread_sigmask", rc);
  cleanup.mask_set = true;
  const int sfd = ::signalfd(-1, &watched, SFD_CLOEXEC | SFD_NONBLOCK);
  if (sfd < 0) return errno_status("launch: signalfd", errno);
  cleanup.fds.push_back(sfd);

  // argv and each rank's environment, made before any fork (the child only execs).
  std::vector<std::string> argv_s{o.program};
  argv_s.insert(argv_s.end(), o.args.begin(), o.args.end());
  std::vector<char*> argv;
  for (std::string& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::set<std::string> replaced{"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
  for (const auto& [k, v] : o.env) {
    if (k.empty() || k.find('=') != std::string::npos)
      return Status::invalid_argument("launch: '" + k + "' is not an environment variable's name");
    replaced.insert(k);
  }
  std::vector<std::string> base_env;
  for (char** e = environ; e && *e; ++e) {
    const std::string entry = *e;
    if (!replaced.count(entry.substr(0, entry.find('=')))) base_env.push_back(entry);
  }
  for (const auto& [k, v] : o.env) base_env.push_back(k + "=" + v);
  std::vector<std::vector<std::string>> envs(static_cast<size_t>(o.world), base_env);
  std::vector<std::vector<char*>> envps(static_cast<size_t>(o.world));
  for (int r = 0; r < o.world; ++r) {
    auto& e = envs[static_cast<size_t>(r)];
    e.push_back("RANK=" + std::to_string(r));
    e.push_back("WORLD_SIZE=" + std::to_string(o.world));
    e.push_back("LOCAL_RANK=" + std::to_string(r));
    e.push_back("LOCAL_WORLD_SIZE=" + std::to_string(o.world));
    for (std::string& s : e) envps[static_cast<size_t>(r)].push_back(s.data());
    envps[static_cast<size_t>(r)].push_back(nullptr);
  }

  std::vector<Rank> ranks(static_cast<size_t>(o.world));
  std::vector<Stream> streams;
  const pid_t launcher = ::getpid();
  int stop_signal = 0;  // a SIGINT or SIGTERM that came while the ranks were starting

  // Stops every rank started so far (a set-up step failed): SIGKILL to its group, reaped.
  auto abandon = [&]() {
    for (Rank& r : ranks)
      if (r.running) {
        ::kill(-r.pid, SIGKILL);
        ::kill(r.pid, SIGKILL);
        while (::waitpid(r.pid, &r.status, 0) < 0 && errno == EINTR) {
        }
        r.running = false;
      }
  };

  for (int r = 0; r < o.world; ++r) {
    int out_pipe[2] = {-1, -1}, err_pipe[2] = {-1, -1}, exec_pipe[2] = {-1, -1};
    auto close_pipes = [&]() {
      for (int fd : {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1], exec_pipe[0], exec_pipe[1]})
        if (fd >= 0) ::close(fd);
    };
    if (r > 0 && (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0)) {
      const int err = errno;
      close_pipes();
      abandon();
      return errno_status("launch: pipe for the output of rank " + std::to_string(r), err);
    }
    if (::pipe2(exec_pipe, O_CLOEXEC) != 0) {
      const int err = errno;
      close_pipes();
      abandon();
      return errno_status("launch: pipe for starting rank " + std::to_string(r), err);
    }
    const pid_t pid = ::fork();
    if (pid < 0) {
      const int err = errno;
      close_pipes();
      abandon();
      return errno_status("launch: fork for rank " + std::to_string(r), err);
    }
    if (pid == 0) {
      // The child: only async-signal-safe calls until exec. A failure writes its errno
      // and the step into the exec pipe (which exec closes on success).
      auto die = [&](int step) {
        const int msg[2] = {step, errno};
        (void)!::write(exec_pipe[1], msg, sizeof msg);
        ::_exit(127);
      };
      if (::setpgid(0, 0) != 0) die(1);
      if (::prctl(PR_SET_PDEATHSIG, SIGTERM) != 0) die(2);
      if (::getppid() != launcher) ::_exit(1);  // the launcher died before PDEATHSIG was set
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      for (int sig : {SIGINT, SIGTERM, SIGCHLD, SIGPIPE})
        if (::sigaction(sig, &dfl, nullptr) != 0) die(3);
      if (::pthread_sigmask(SIG_SETMASK, &cleanup.old_mask, nullptr) != 0) die(4);
      const int out = r > 0 ? out_pipe[1] : o.out_fd, err = r > 0 ? err_pipe[1] : o.err_fd;
      if (out != STDOUT_FILENO && ::dup2(out, STDOUT_FILENO) < 0) die(5);
      if (err != STDERR_FILENO && ::dup2(err, STDERR_FILENO) < 0) die(5);
      ::execve(argv[0], argv.data(), envps[static_cast<size_t>(r)].data());
      die(6);
    }
    Rank& rank = ranks[static_cast<size_t>(r)];
    rank.pid = pid;
    rank.running = true;
    ::close(exec_pipe[1]);
    exec_pipe[1] = -1;
    if (r > 0) {
      ::close(out_pipe[1]);
      ::close(err_pipe[1]);
      out_pipe[1] = err_pipe[1] = -1;
    }
    // Wait for the exec (the pipe closes) or the child's report of what failed.
    int msg[2] = {0, 0};
    ssize_t got;
    do {
      got = ::read(exec_pipe[0], msg, sizeof msg);
    } while (got < 0 && errno == EINTR);
    const int read_err = errno;
    ::close(exec_pipe[0]);
    exec_pipe[0] = -1;
    if (got != 0) {
      close_pipes();
      abandon();
      if (got < 0) return errno_status("launch: reading how rank " + std::to_string(r) + " started", read_err);
      const char* steps[] = {"?", "setpgid", "prctl(PR_SET_PDEATHSIG)", "sigaction", "sigprocmask", "dup2"};
      const std::string step = msg[0] == 6 ? "execve " + o.program : steps[msg[0] >= 1 && msg[0] <= 5 ? msg[0] : 0];
      return errno_status("launch: starting rank " + std::to_string(r) + ": " + step, msg[1]);
    }
    if (r > 0) {
      const std::string prefix = "[rank " + std::to_string(r) + "] ";
      streams.push_back({out_pipe[0], o.out_fd, prefix, {}});
      streams.push_back({err_pipe[0], o.err_fd, prefix, {}});
      cleanup.fds.push_back(out_pipe[0]);
      cleanup.fds.push_back(err_pipe[0]);
    }
    rank.started = true;
    // Between starts: a SIGINT or SIGTERM for the launcher, or a rank that has already
    // failed, ends the starting; the loop below forwards the signal or stops the
    // ranks started so far, and the rest are never started.
    if (r + 1 < o.world) {
      signalfd_siginfo info;
      ssize_t n;
      while ((n = ::read(sfd, &info, sizeof info)) == static_cast<ssize_t>(sizeof info)) {
        const int sig = static_cast<int>(info.ssi_signo);
        if ((sig == SIGINT || sig == SIGTERM) && stop_signal == 0) stop_signal = sig;
      }
      if (n < 0 && errno != EAGAIN && errno != EINTR) {
        const int err = errno;
        abandon();
        return errno_status("launch: reading the signalfd", err);
      }
      bool failed = false;
      for (const Rank& started : ranks) {
        if (!started.running) continue;
        siginfo_t info_child{};
        // WNOWAIT: looked at, not reaped (the loop below reaps it and reports it).
        if (::waitid(P_PID, static_cast<id_t>(started.pid), &info_child, WEXITED | WNOHANG | WNOWAIT) == 0 &&
            info_child.si_pid == started.pid &&
            !(info_child.si_code == CLD_EXITED && info_child.si_status == 0))
          failed = true;
      }
      if (stop_signal != 0 || failed) break;
    }
  }

  LaunchOutcome out;
  out.status.assign(static_cast<size_t>(o.world), 0);
  for (size_t i = 0; i < ranks.size(); ++i)
    if (!ranks[i].started) out.status[i] = -1;
  std::optional<Clock::time_point> kill_at;  // after a failure: when the survivors get SIGKILL
  bool killed = false;
  bool output_failed = false;
  auto signal_all = [&](int sig) {
    for (Rank& r : ranks)
      if (r.running && ::kill(-r.pid, sig) != 0 && errno == ESRCH) ::kill(r.pid, sig);
  };
  // Lines of a stream (all of what is left at its end).
  auto emit = [&](Stream& s, bool at_end) {
    size_t start = 0;
    std::string text;
    for (size_t nl; (nl = s.partial.find('\n', start)) != std::string::npos; start = nl + 1)
      text += s.prefix + s.partial.substr(start, nl + 1 - start);
    s.partial.erase(0, start);
    if (at_end && !s.partial.empty()) {
      text += s.prefix + s.partial + "\n";
      s.partial.clear();
    }
    if (!text.empty() && !output_failed && !write_all(s.to, text.data(), text.size())) output_failed = true;
  };
  std::optional<Clock::time_point> all_ended_at;
  if (stop_signal != 0) {
    out.forwarded_signal = stop_signal;
    signal_all(stop_signal);
  }
  for (;;) {
    // Reap.
    for (int i = 0; i < o.world; ++i) {
      Rank& r = ranks[static_cast<size_t>(i)];
      if (!r.running) continue;
      const pid_t w = ::waitpid(r.pid, &r.status, WNOHANG);
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) {
        const int err = errno;
        abandon();
        return errno_status("launch: waitpid for rank " + std::to_string(i), err);
      }
      if (w == 0) continue;
      r.running = false;
      const int code = WIFEXITED(r.status) ? WEXITSTATUS(r.status) : 128 + WTERMSIG(r.status);
      out.status[static_cast<size_t>(i)] = code;
      if (code != 0 && out.failed_rank < 0 && out.forwarded_signal == 0) {
        out.failed_rank = i;
        out.exit_code = code;
        out.message = "rank " + std::to_string(i) + " " + describe_wait_status(r.status);
        signal_all(SIGTERM);
        kill_at = Clock::now() + o.grace;
      }
    }
    const bool any_running = std::any_of(ranks.begin(), ranks.end(), [](const Rank& r) { return r.running; });
    const bool any_open = std::any_of(streams.begin(), streams.end(), [](const Stream& s) { return s.fd >= 0; });
    if (!any_running && !all_ended_at) all_ended_at = Clock::now();
    // Output a rank's descendants hold open after it ended is waited for 1 s at most.
    if (!any_running && (!any_open || Clock::now() - *all_ended_at > std::chrono::seconds(1))) break;
    if (kill_at && !killed && any_running && Clock::now() >= *kill_at) {
      signal_all(SIGKILL);
      killed = true;
    }

    std::vector<pollfd> fds{{sfd, POLLIN, 0}};
    std::vector<Stream*> polled;
    for (Stream& s : streams)
      if (s.fd >= 0) {
        fds.push_back({s.fd, POLLIN, 0});
        polled.push_back(&s);
      }
    int timeout_ms = 50;  // children are polled too (a SIGCHLD may go to another thread)
    if (kill_at && !killed) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(*kill_at - Clock::now()).count();
      timeout_ms = static_cast<int>(std::clamp<long long>(left, 0, timeout_ms));
    }
    const int ready = ::poll(fds.data(), fds.size(), timeout_ms);
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) {
      const int err = errno;
      abandon();
      return errno_status("launch: poll", err);
    }
    if (fds[0].revents & POLLIN) {
      signalfd_siginfo info;
      for (;;) {
        const ssize_t n = ::read(sfd, &info, sizeof info);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno == EAGAIN) break;
        if (n != static_cast<ssize_t>(sizeof info)) {
          const int err = n < 0 ? errno : EIO;
          abandon();
          return errno_status("launch: reading the signalfd", err);
        }
        const int sig = static_cast<int>(info.ssi_signo);
        if (sig == SIGINT || sig == SIGTERM) {
          if (out.forwarded_signal == 0) out.forwarded_signal = sig;
          signal_all(sig);
        }
      }
    }
    for (size_t i = 1; i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      Stream& s = *polled[i - 1];
      char buf[65536];
      const ssize_t n = ::read(s.fd, buf, sizeof buf);
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (n <= 0) {  // end of file (or an error reading it: the same for the output)
        emit(s, true);
        ::close(s.fd);
        for (int& fd : cleanup.fds)
          if (fd == s.fd) fd = -1;
        s.fd = -1;
        continue;
      }
      s.partial.append(buf, static_cast<size_t>(n));
      emit(s, false);
    }
  }
  for (Stream& s : streams) emit(s, true);
  if (out.forwarded_signal != 0) {
    out.exit_code = 128 + out.forwarded_signal;
    std::string ends;
    for (int i = 0; i < o.world; ++i)
      ends += (i ? ", " : "") + std::to_string(i) + ": " +
              (ranks[static_cast<size_t>(i)].started ? describe_wait_status(ranks[static_cast<size_t>(i)].status)
                                                     : std::string("not started"));
    out.message = signal_text(out.forwarded_signal) + " forwarded to the ranks; they ended (" + ends + ")";
  } else if (out.failed_rank >= 0) {
    out.message += killed ? "; the other ranks were sent SIGTERM, and SIGKILL " +
                                std::to_string(o.grace.count()) + " ms later"
                          : "; the other ranks were sent SIGTERM";
  }
  const auto unstarted = std::count_if(ranks.begin(), ranks.end(), [](const Rank& r) { return !r.started; });
  if (unstarted > 0)
    out.message += "; " + std::to_string(unstarted) + " of the " + std::to_string(o.world) +
                   " ranks were never started";
  return out;
}

}  // namespace spillway
