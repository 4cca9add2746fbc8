// core/interrupt.h: SIGINT/SIGTERM set a flag, a second signal (or the first, in
// AtOnce mode) removes the registered paths and exits with 128 + signo. Each test
// runs in a forked child, since the handlers stay for the life of the process.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>

#include "core/interrupt.h"
#include "support/test_support.h"

namespace spillway {
namespace {

using testing_support::TempDir;

// Runs `body` in a child process; its exit code, or -signo if a signal killed it.
int in_child(const std::function<int()>& body) {
  std::fflush(stdout);
  std::fflush(stderr);
  pid_t pid = ::fork();
  if (pid == 0) ::_exit(body());
  int status = 0;
  if (pid < 0 || ::waitpid(pid, &status, 0) != pid) return -1000;
  if (WIFSIGNALED(status)) return -WTERMSIG(status);
  return WEXITSTATUS(status);
}

// Waits up to 5 s for `done`.
bool eventually(const std::function<bool()>& done) {
  for (int i = 0; i < 500; ++i) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return done();
}

// A directory with a file in it, like a run's spill directory.
std::string make_run_dir(const TempDir& dir, const std::string& name) {
  std::string path = dir.file(name);
  std::filesystem::create_directory(path);
  std::ofstream(path + "/spill-0.bin") << std::string(5000, 'x');
  return path;
}

TEST(Interrupt, FirstSignalOnlySetsTheFlag) {
  TempDir dir;
  const std::string run_dir = make_run_dir(dir, "run");
  int code = in_child([&] {
    if (!install_interrupt_handlers(InterruptMode::BetweenSteps).is_ok()) return 10;
    if (interrupted() || interrupt_signal() != 0) return 11;
    RemoveOnInterrupt guard(run_dir);
    ::kill(::getpid(), SIGTERM);
    if (!eventually([] { return interrupted(); })) return 12;
    if (interrupt_signal() != SIGTERM || interrupt_exit_code() != 128 + SIGTERM) return 13;
    // Still running: the work checks the flag and unwinds by itself.
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (!std::filesystem::exists(run_dir)) return 14;
    Status s = interrupted_status("before step 3");
    if (s.code() != StatusCode::Interrupted || s.message() != "interrupted by SIGTERM before step 3") return 15;
    return 0;
  });
  EXPECT_EQ(code, 0);
  EXPECT_TRUE(std::filesystem::exists(run_dir + "/spill-0.bin"));
}

TEST(Interrupt, SecondSignalRemovesRegisteredPathsAndExits) {
  TempDir dir;
  const std::string run_dir = make_run_dir(dir, "spillway-run");
  const std::string temp_file = dir.file("w.safetensors.tmp-1-00000000");
  const std::string released = make_run_dir(dir, "released");
  const std::string unregistered = make_run_dir(dir, "user-data");
  std::ofstream(temp_file) << "partial";
  int code = in_child([&] {
    if (!install_interrupt_handlers(InterruptMode::BetweenSteps).is_ok()) return 10;
    RemoveOnInterrupt a(run_dir), b(temp_file);
    { RemoveOnInterrupt c(released); }  // its owner removed it itself, or keeps it
    ::kill(::getpid(), SIGINT);
    if (!eventually([] { return interrupted(); })) return 11;
    ::kill(::getpid(), SIGINT);
    std::this_thread::sleep_for(std::chrono::seconds(5));
    return 12;  // should have been ended by then
  });
  EXPECT_EQ(code, 128 + SIGINT);
  EXPECT_FALSE(std::filesystem::exists(run_dir));
  EXPECT_FALSE(std::filesystem::exists(temp_file));
  EXPECT_TRUE(std::filesystem::exists(released + "/spill-0.bin"));
  EXPECT_TRUE(std::filesystem::exists(unregistered + "/spill-0.bin"));
}

TEST(Interrupt, AtOnceModeEndsOnTheFirstSignal) {
  TempDir dir;
  const std::string file = dir.file("spillway-bench-1.bin");
  std::ofstream(file) << "bench";
  int code = in_child([&] {
    if (!install_interrupt_handlers(InterruptMode::AtOnce).is_ok()) return 10;
    RemoveOnInterrupt guard(file);
    ::kill(::getpid(), SIGTERM);
    std::this_thread::sleep_for(std::chrono::seconds(5));
    return 11;
  });
  EXPECT_EQ(code, 128 + SIGTERM);
  EXPECT_FALSE(std::filesystem::exists(file));
}

TEST(Interrupt, MovedGuardKeepsTheRegistration) {
  TempDir dir;
  const std::string run_dir = make_run_dir(dir, "run");
  int code = in_child([&] {
    if (!install_interrupt_handlers(InterruptMode::AtOnce).is_ok()) return 10;
    RemoveOnInterrupt moved;
    {
      RemoveOnInterrupt first(run_dir);
      moved = std::move(first);
    }  // `first` is gone; the registration moved on
    ::kill(::getpid(), SIGTERM);
    std::this_thread::sleep_for(std::chrono::seconds(5));
    return 11;
  });
  EXPECT_EQ(code, 128 + SIGTERM);
  EXPECT_FALSE(std::filesystem::exists(run_dir));
}

TEST(Interrupt, NoSignalNoFlag) {
  EXPECT_EQ(in_child([] {
              if (!install_interrupt_handlers().is_ok()) return 10;
              return interrupted() ? 11 : 0;
            }),
            0);
  EXPECT_EQ(signal_name(SIGINT), "SIGINT");
  EXPECT_EQ(signal_name(SIGTERM), "SIGTERM");
}

}  // namespace
}  // namespace spillway
