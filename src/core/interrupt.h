// Interruption by SIGINT or SIGTERM: the command stops between units of work,
// removes the files it was writing, and exits with 128 + the signal's number.
//
//   install_interrupt_handlers();             // once, at the start of a command
//   RemoveOnInterrupt guard(run_dir);         // removed if a signal ends the process at once
//   for (int step = 1; step <= steps; ++step) {
//     if (interrupted()) return interrupted_status("before step " + std::to_string(step));
//     ...                                     // unwinding removes files as usual
//   }
//   // main: a Status with code Interrupted becomes exit code interrupt_exit_code()
//
// InterruptMode::BetweenSteps (train): the first signal only sets a flag, which the
// work checks with interrupted() between steps; a second signal ends the process at
// once. InterruptMode::AtOnce (commands with nothing to finish): the first signal
// ends the process at once. Ending at once removes every path registered with
// RemoveOnInterrupt (a file, or a directory and the files in it), says so on
// stderr, and _exits with 128 + signo.
//
// The signal handler only records the signal in an atomic and writes a byte to a
// pipe (both async-signal-safe); a watcher thread reads the pipe and does the rest.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace spillway {

enum class InterruptMode { BetweenSteps, AtOnce };

// Installs the SIGINT and SIGTERM handlers and starts the watcher thread (the first
// call); later calls only change the mode. An IoError if the pipe, the thread or
// sigaction fails.
Status install_interrupt_handlers(InterruptMode mode = InterruptMode::BetweenSteps);

// True once SIGINT or SIGTERM arrived after install_interrupt_handlers().
bool interrupted();
// The first signal's number (SIGINT, SIGTERM), 0 if none.
int interrupt_signal();
// 128 + interrupt_signal() (130 for SIGINT, 143 for SIGTERM); 130 if none arrived.
int interrupt_exit_code();
// "SIGINT", "SIGTERM", "signal N".
std::string signal_name(int signo);
// An Interrupted status: "interrupted by SIGTERM <where>".
Status interrupted_status(const std::string& where);

// Registers `path` to be removed when a signal ends the process at once; the
// destructor unregisters it (the owner removes it itself on the normal path).
class RemoveOnInterrupt {
 public:
  RemoveOnInterrupt() = default;
  explicit RemoveOnInterrupt(std::string path);
  ~RemoveOnInterrupt();
  RemoveOnInterrupt(RemoveOnInterrupt&& other) noexcept;
  RemoveOnInterrupt& operator=(RemoveOnInterrupt&& other) noexcept;
  RemoveOnInterrupt(const RemoveOnInterrupt&) = delete;
  RemoveOnInterrupt& operator=(const RemoveOnInterrupt&) = delete;
  void release();  // unregister now

 private:
  uint64_t id_ = 0;  // 0: nothing registered
};

// Removes every registered path now (a file, or a directory with the files in it)
// and clears the registry; returns the paths that are gone. The watcher calls it
// before ending the process.
std::vector<std::string> remove_paths_registered_for_interrupt();

}  // namespace spillway
