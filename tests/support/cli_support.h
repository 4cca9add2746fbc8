// Runs the spillway binary of this build, as a user would from a shell.
//
//   CliRun r = run_cli("train --model tiny --steps 2 --backend cpu");
//   EXPECT_EQ(r.code, 0) << r.output;               // exit status; -1 when killed
//
// Needs SPILLWAY_BINARY and SPILLWAY_SOURCE_DIR defined for the test target.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace spillway::testing_support {

struct CliRun {
  int code = -1;
  std::string output;  // stdout and stderr together
};

// `args` is appended to the binary's path and run through the shell, stderr into stdout.
// The bundled corpus is found through SPILLWAY_DATA wherever the build folder is.
inline CliRun run_cli(const std::string& args) {
  ::setenv("SPILLWAY_DATA", SPILLWAY_SOURCE_DIR "/data", 0);
  const std::string cmd = std::string(SPILLWAY_BINARY) + " " + args + " 2>&1";
  CliRun r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) {
    ADD_FAILURE() << "popen failed for " << cmd;
    return r;
  }
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  const int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

}  // namespace spillway::testing_support
