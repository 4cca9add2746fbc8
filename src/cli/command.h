// Sub-commands of the `spillway` binary register themselves here, one file each.
//
//   static CommandRegistration reg("bench io", "storage and copy bandwidth",
//       [](CLI::App& app) {
//         auto opts = std::make_shared<Options>();
//         app.add_option("--dir", opts->dir, "spill directory")->required();
//         return [opts]() -> int { return run(*opts); };   // exit code
//       });
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

#include "core/status.h"

namespace spillway::cli {

using CommandRun = std::function<int()>;
using CommandSetup = std::function<CommandRun(CLI::App&)>;

struct CommandRegistration {
  CommandRegistration(std::string path, std::string help, CommandSetup setup);
};

struct RegisteredCommand {
  std::string path;  // "train", "bench io"
  std::string help;
  CommandSetup setup;
};
std::vector<RegisteredCommand>& registered_commands();

// Prints "spillway: error: <status>" to stderr and returns exit code 1; an
// Interrupted status (core/interrupt.h) prints "spillway: <message>" and returns
// 128 + the signal's number.
int fail(const Status& s);

}  // namespace spillway::cli
