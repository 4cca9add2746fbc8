// `spillway launch --gpus N [--] train ARGS...`: N ranks of `spillway train ARGS` on
// this machine's GPUs 0..N-1, data parallel over NCCL (dist/launch.h watches them;
// the ranks read RANK, WORLD_SIZE, LOCAL_RANK and SPILLWAY_NCCL_ID, cli/train.cpp).
//
//   spillway launch --gpus 4 train --backend cuda --model gpt2-124m --steps 100 --save w.safetensors
#include <signal.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "cli/command.h"
#include "dist/launch.h"
#ifdef SPILLWAY_HAVE_NCCL
#include "dist/nccl/nccl_communicator.h"
#endif

namespace spillway::cli {
namespace {

struct LaunchFlags {
  int gpus = 0;
  double grace_s = 10;
};

// This process's arguments after `launch` and its own flags (and a `--`), as typed:
// from /proc/self/cmdline.
Result<std::vector<std::string>> command_after_launch_flags() {
  const char* path = "/proc/self/cmdline";
  std::ifstream in(path, std::ios::binary);
  if (!in) return errno_status(std::string("open ") + path, errno);
  std::vector<std::string> argv;
  std::string arg;
  while (std::getline(in, arg, '\0')) argv.push_back(arg);
  if (in.bad()) return errno_status(std::string("read ") + path, errno);
  size_t i = 1;
  while (i < argv.size() && argv[i] != "launch") ++i;
  if (i == argv.size()) return Status::internal(std::string(path) + " has no 'launch' argument");
  for (++i; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (a == "--gpus" || a == "--grace") {
      ++i;  // its value (CLI11 checked it)
      continue;
    }
    if (a.starts_with("--gpus=") || a.starts_with("--grace=")) continue;
    if (a == "--") ++i;
    break;
  }
  return std::vector<std::string>(argv.begin() + static_cast<std::ptrdiff_t>(std::min(i, argv.size())), argv.end());
}

Result<int> run_launch(const LaunchFlags& f, std::vector<std::string> rest) {
  if (rest.empty() || rest.front() != "train")
    return Status::invalid_argument("spillway launch starts `spillway train` ranks: expected `train ARGS...` after "
                                    "--gpus N" + (rest.empty() ? std::string(", got nothing") : ", got '" + rest.front() + "'"));
  if (f.gpus < 1) return Status::invalid_argument("--gpus: expected at least 1 rank, got " + std::to_string(f.gpus));
  if (!(f.grace_s >= 0) || !std::isfinite(f.grace_s) || f.grace_s > 3600)
    return Status::invalid_argument("--grace: expected 0 to 3600 seconds, got " + std::to_string(f.grace_s));
#ifndef SPILLWAY_HAVE_NCCL
  return Status::unsupported("spillway launch: this spillway was built without NCCL (nccl.h and libnccl were not found "
                             "with the CUDA toolkit at build time), which its ranks need to train together; no rank "
                             "was started");
#else
  // SIGINT, SIGTERM and SIGCHLD blocked before NCCL starts a thread (the id's
  // bootstrap listener), which would otherwise inherit them unblocked: the launcher
  // reads them itself and forwards SIGINT and SIGTERM (dist/launch.h).
  sigset_t watched;
  sigemptyset(&watched);
  sigaddset(&watched, SIGINT);
  sigaddset(&watched, SIGTERM);
  sigaddset(&watched, SIGCHLD);
  if (int rc = ::pthread_sigmask(SIG_BLOCK, &watched, nullptr); rc != 0) return errno_status("pthread_sigmask", rc);
  // One rank a GPU: more ranks than GPUs would share devices (and a typo such as
  // --gpus 80 would start 80 processes).
  if (const int gpus = cuda_gpu_count(); f.gpus > gpus)
    return Status::invalid_argument("--gpus " + std::to_string(f.gpus) + ": this machine has " + std::to_string(gpus) +
                                    " GPU" + (gpus == 1 ? "" : "s") + " that CUDA sees (CUDA_VISIBLE_DEVICES " +
                                    (std::getenv("CUDA_VISIBLE_DEVICES") ? std::string("is '") +
                                                                               std::getenv("CUDA_VISIBLE_DEVICES") + "'"
                                                                         : std::string("unset")) +
                                    "), one for each rank; no rank was started");
  // The job's id: the launcher holds NCCL's bootstrap root, and lives as long as the ranks.
  auto id = nccl_unique_id();
  if (!id.ok()) return id.status().with_context("spillway launch: making the job's NCCL id (no rank was started)");
  LaunchOptions o;
  o.program = "/proc/self/exe";
  o.args = rest;
  o.world = f.gpus;
  o.env.push_back({"SPILLWAY_NCCL_ID", nccl_id_to_hex(*id)});
  o.grace = std::chrono::milliseconds(static_cast<int64_t>(f.grace_s * 1000));
  SPILLWAY_ASSIGN_OR_RETURN(LaunchOutcome out, launch_ranks(o));
  if (out.exit_code != 0) std::cerr << "spillway launch: " << out.message << "\n";
  return out.exit_code;
#endif
}

CommandRegistration launch_command(
    "launch", "start N data-parallel ranks of `spillway train` on this machine's GPUs (NCCL)", [](CLI::App& app) -> CommandRun {
      auto f = std::make_shared<LaunchFlags>();
      app.add_option("--gpus", f->gpus, "ranks to start, one a GPU: devices 0 to N-1 (LOCAL_RANK)")->required();
      app.add_option("--grace", f->grace_s,
                     "seconds the other ranks get to stop after one fails (SIGTERM), before SIGKILL")
          ->capture_default_str();
      // Everything from `train` on (or after --) is the ranks' command line.
      // The ranks' command line is read from /proc/self/cmdline, as typed (CLI11 splits
      // it between positionals and leftovers); these only let CLI11 accept it.
      app.prefix_command();
      auto after_dashes = std::make_shared<std::vector<std::string>>();
      app.add_option("command", *after_dashes, "train and its flags (after -- or not)");
      app.footer(
          "Each rank runs `spillway train ARGS` with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and "
          "SPILLWAY_NCCL_ID set; rank 0 prints as train does, the other ranks' lines come prefixed \"[rank R] \". "
          "SIGINT/SIGTERM are forwarded to every rank; when a rank fails, the others are stopped and the exit "
          "status is that rank's.");
      return [f, after_dashes]() -> int {
        (void)after_dashes;
        auto rest = command_after_launch_flags();
        if (!rest.ok()) return fail(rest.status());
        auto code = run_launch(*f, *rest);
        return code.ok() ? *code : fail(code.status());
      };
    });

}  // namespace
}  // namespace spillway::cli
