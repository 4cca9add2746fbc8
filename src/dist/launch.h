// The ranks of a data-parallel job on one machine: N copies of a program, each with
// RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE in its environment, watched until
// all end (`spillway launch`; cli/launch.cpp adds the NCCL id). Nothing here knows
// NCCL or training: the children are any program (tests run /bin/sh scripts).
//
//   LaunchOptions o{.program = "/proc/self/exe", .args = {"train", "--backend", "cuda"}, .world = 4};
//   o.env.push_back({"SPILLWAY_NCCL_ID", hex});
//   SPILLWAY_ASSIGN_OR_RETURN(LaunchOutcome out, launch_ranks(o));
//   if (out.exit_code != 0) std::cerr << out.message << "\n";
//   return out.exit_code;
//
// - Output: rank 0 writes to out_fd and err_fd directly (a terminal stays a terminal,
//   so train's progress line is redrawn in place); every line of a rank r > 0 comes
//   through a pipe and is written to the same place prefixed "[rank r] " (a last line
//   without a newline gets one).
// - Signals: SIGINT and SIGTERM sent to the launcher are forwarded, each time, to every
//   rank still running (to its process group: each rank is the leader of a group of
//   its own, so a terminal's Ctrl-C reaches the ranks once, through the launcher); the
//   launcher then waits for them and its exit code is 128 + the first signal's number.
//   A rank gets SIGTERM if the launcher itself dies (PR_SET_PDEATHSIG).
// - Failure: the first rank to end with a non-zero status or a signal (while no
//   signal was forwarded) fails the job: the others get SIGTERM, and SIGKILL after
//   `grace`; the exit code is that rank's status (128 + its signal's number when a
//   signal ended it), and the message names the rank and how it ended.
// - Every system call is checked; one that fails (fork, pipe, exec of the program)
//   stops the ranks started so far (SIGKILL) and is the returned error.
// The calling thread's signal mask holds SIGINT, SIGTERM and SIGCHLD blocked while
// this runs (they are read through a signalfd); children are also polled, so a
// SIGCHLD taken by another thread of the process only delays noticing an exit.
#pragma once

#include <unistd.h>

#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"

namespace spillway {

struct LaunchOptions {
  std::string program;             // the executable's path (no PATH search)
  std::vector<std::string> args;   // its arguments (argv[1] on)
  int world = 1;                   // ranks to start
  // Variables set in every rank besides RANK, WORLD_SIZE, LOCAL_RANK and
  // LOCAL_WORLD_SIZE (the launcher's environment is passed on, these replacing it).
  std::vector<std::pair<std::string, std::string>> env;
  std::chrono::milliseconds grace{10000};  // after a failure: SIGTERM, then SIGKILL this much later
  int out_fd = STDOUT_FILENO, err_fd = STDERR_FILENO;  // where the ranks' output goes
};

struct LaunchOutcome {
  int exit_code = 0;       // 0 when every rank exited with 0 (see above)
  std::string message;     // empty when every rank exited with 0; else what happened, naming the rank
  int failed_rank = -1;    // the rank whose end failed the job, -1 if none
  int forwarded_signal = 0;  // the first SIGINT or SIGTERM forwarded, 0 if none
  std::vector<int> status;   // [world] each rank's exit code, or 128 + the signal that ended it;
                             // -1: never started (a signal or a failed rank came first)
};

Result<LaunchOutcome> launch_ranks(const LaunchOptions& options);

// "exited with status 3", "was killed by SIGKILL" for a waitpid status.
std::string describe_wait_status(int status);

}  // namespace spillway
