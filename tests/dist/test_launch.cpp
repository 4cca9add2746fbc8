// The process management of `spillway launch` (dist/launch.h) with /bin/sh scripts
// for ranks: what each rank sees in its environment, how its output comes back, a
// failing rank stopping the others, and signals forwarded.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "dist/launch.h"

using namespace spillway;

namespace {

std::string temp_dir(const std::string& name) {
  const std::string dir = testing::TempDir() + "/launch_" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::string read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

LaunchOptions shell(const std::string& script, int world) {
  LaunchOptions o;
  o.program = "/bin/sh";
  o.args = {"-c", script};
  o.world = world;
  return o;
}

// Output files for a launch (the test's own stdout stays clean).
struct Output {
  explicit Output(const std::string& dir)
      : out_path(dir + "/out"), err_path(dir + "/err"),
        out(::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)),
        err(::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)) {
    EXPECT_GE(out, 0);
    EXPECT_GE(err, 0);
  }
  ~Output() {
    ::close(out);
    ::close(err);
  }
  std::string out_path, err_path;
  int out, err;
};

// Waits up to 10 s for `path` to exist.
bool wait_for(const std::string& path) {
  for (int i = 0; i < 1000; ++i) {
    if (std::filesystem::exists(path)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

}  // namespace

TEST(Launch, EachRankSeesItsPlaceAndTheExtraVariables) {
  const std::string dir = temp_dir("env");
  Output output(dir);
  ::setenv("SPILLWAY_LAUNCH_TEST_INHERITED", "kept", 1);
  ::setenv("RANK", "99", 1);  // the launcher's own are replaced
  LaunchOptions o = shell("echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $SPILLWAY_NCCL_ID "
                          "$SPILLWAY_LAUNCH_TEST_INHERITED\" > " + dir + "/seen.$RANK; "
                          "echo \"out of $RANK\"; printf 'err of %s' $RANK >&2",
                          3);
  o.env.push_back({"SPILLWAY_NCCL_ID", "00ff"});
  o.out_fd = output.out;
  o.err_fd = output.err;
  auto r = launch_ranks(o);
  ::unsetenv("RANK");
  ::unsetenv("SPILLWAY_LAUNCH_TEST_INHERITED");
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->exit_code, 0) << r->message;
  EXPECT_TRUE(r->message.empty()) << r->message;
  EXPECT_EQ(r->status, std::vector<int>({0, 0, 0}));
  for (int rank = 0; rank < 3; ++rank)
    EXPECT_EQ(read(dir + "/seen." + std::to_string(rank)),
              std::to_string(rank) + " 3 " + std::to_string(rank) + " 3 00ff kept\n");
  // Rank 0's output as it is; the others' line by line with their rank (a last
  // line without a newline gets one).
  const std::string out = read(output.out_path), err = read(output.err_path);
  EXPECT_NE(out.find("out of 0\n"), std::string::npos) << out;
  EXPECT_EQ(out.find("] out of 0"), std::string::npos) << out;
  EXPECT_NE(out.find("[rank 1] out of 1\n"), std::string::npos) << out;
  EXPECT_NE(out.find("[rank 2] out of 2\n"), std::string::npos) << out;
  EXPECT_NE(err.find("err of 0"), std::string::npos) << err;
  EXPECT_NE(err.find("[rank 1] err of 1\n"), std::string::npos) << err;
  EXPECT_NE(err.find("[rank 2] err of 2\n"), std::string::npos) << err;
}

// Rank 1 fails with status 3: the others (which would sleep for a minute) get
// SIGTERM, and the outcome names rank 1 and its status.
TEST(Launch, AFailingRankStopsTheOthersAndNamesItself) {
  const std::string dir = temp_dir("fail");
  Output output(dir);
  LaunchOptions o = shell("if [ $RANK = 1 ]; then sleep 0.2; exit 3; fi; "
                          "trap 'echo TERM > " + dir + "/term.$RANK; exit 143' TERM; "
                          "sleep 60 & wait",
                          3);
  o.out_fd = output.out;
  o.err_fd = output.err;
  const auto start = std::chrono::steady_clock::now();
  auto r = launch_ranks(o);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->exit_code, 3);
  EXPECT_EQ(r->failed_rank, 1);
  EXPECT_NE(r->message.find("rank 1 exited with status 3"), std::string::npos) << r->message;
  EXPECT_LT(took, 30) << "the others were not stopped";
  EXPECT_EQ(read(dir + "/term.0"), "TERM\n");
  EXPECT_EQ(read(dir + "/term.2"), "TERM\n");
  EXPECT_EQ(r->status, std::vector<int>({143, 3, 143}));
}

// A rank that ignores SIGTERM gets SIGKILL after the grace period; a rank that a
// signal ends is named with it.
TEST(Launch, SigkillAfterTheGracePeriodAndSignalsNamed) {
  const std::string dir = temp_dir("kill");
  Output output(dir);
  LaunchOptions o = shell("if [ $RANK = 0 ]; then sleep 0.2; kill -HUP $$; fi; "
                          "trap '' TERM; while :; do sleep 0.05; done",
                          2);
  o.out_fd = output.out;
  o.err_fd = output.err;
  o.grace = std::chrono::milliseconds(300);
  auto r = launch_ranks(o);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->failed_rank, 0);
  EXPECT_EQ(r->exit_code, 128 + SIGHUP);
  EXPECT_NE(r->message.find("rank 0 was killed by SIGHUP"), std::string::npos) << r->message;
  EXPECT_NE(r->message.find("SIGKILL 300 ms later"), std::string::npos) << r->message;
  EXPECT_EQ(r->status[1], 128 + SIGKILL);
}

// A program that cannot start is an error naming the rank and the program.
TEST(Launch, AProgramThatCannotStartIsAnError) {
  LaunchOptions o;
  o.program = "/nonexistent/spillway";
  o.world = 2;
  auto r = launch_ranks(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("starting rank 0: execve /nonexistent/spillway"), std::string::npos)
      << r.status().to_string();
  EXPECT_FALSE(launch_ranks(shell("true", 0)).ok());
}

// SIGTERM and SIGINT sent to the launcher reach every rank once (each rank leads a
// process group of its own, so the launcher's group is not signalled twice); the
// launcher exits with 128 + the signal. The launcher runs in a child process here, so
// that the signal goes to it alone.
TEST(Launch, SignalsAreForwardedToEveryRank) {
  for (int sig : {SIGTERM, SIGINT}) {
    const std::string dir = temp_dir("signal" + std::to_string(sig));
    const pid_t launcher = ::fork();
    ASSERT_GE(launcher, 0);
    if (launcher == 0) {
      const int out = ::open((dir + "/out").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      LaunchOptions o = shell("trap 'echo got >> " + dir + "/got.$RANK; exit 7' INT TERM; "
                              "touch " + dir + "/ready.$RANK; sleep 60 & wait",
                              3);
      o.out_fd = o.err_fd = out;
      auto r = launch_ranks(o);
      if (!r.ok()) ::_exit(100);
      std::ofstream(dir + "/outcome") << r->exit_code << " " << r->forwarded_signal << " " << r->failed_rank << " "
                                      << r->status[0] << r->status[1] << r->status[2] << "\n"
                                      << r->message << "\n";
      ::_exit(r->exit_code);
    }
    for (int rank = 0; rank < 3; ++rank) ASSERT_TRUE(wait_for(dir + "/ready." + std::to_string(rank))) << rank;
    ASSERT_EQ(::kill(launcher, sig), 0);
    int status = 0;
    ASSERT_EQ(::waitpid(launcher, &status, 0), launcher);
    ASSERT_TRUE(WIFEXITED(status)) << status;
    EXPECT_EQ(WEXITSTATUS(status), 128 + sig);
    const std::string outcome = read(dir + "/outcome");
    EXPECT_EQ(outcome.substr(0, outcome.find('\n')),
              std::to_string(128 + sig) + " " + std::to_string(sig) + " -1 777")
        << outcome;
    EXPECT_NE(outcome.find(std::string(sig == SIGINT ? "SIGINT" : "SIGTERM") + " forwarded to the ranks"),
              std::string::npos)
        << outcome;
    for (int rank = 0; rank < 3; ++rank) EXPECT_EQ(read(dir + "/got." + std::to_string(rank)), "got\n") << rank;
  }
}

// A SIGTERM that comes while the ranks are starting ends the starting: the ranks
// started so far get it, the rest never start. Here it is pending before the launch
// (blocked in the launcher's process, which runs in a child): rank 0 starts, the
// signal is read, and 49 ranks are never started.
TEST(Launch, ASignalWhileStartingStopsTheStarting) {
  const std::string dir = temp_dir("signal_starting");
  const pid_t launcher = ::fork();
  ASSERT_GE(launcher, 0);
  if (launcher == 0) {
    sigset_t term;
    sigemptyset(&term);
    sigaddset(&term, SIGTERM);
    if (::sigprocmask(SIG_BLOCK, &term, nullptr) != 0 || ::kill(::getpid(), SIGTERM) != 0) ::_exit(101);
    const int out = ::open((dir + "/out").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    LaunchOptions o = shell("touch " + dir + "/started.$RANK; sleep 60", 50);
    o.out_fd = o.err_fd = out;
    auto r = launch_ranks(o);
    if (!r.ok()) ::_exit(100);
    int never = 0;
    for (int s : r->status) never += s == -1;
    std::ofstream(dir + "/outcome") << r->exit_code << " " << r->forwarded_signal << " " << never << "\n"
                                    << r->message << "\n";
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(launcher, &status, 0), launcher);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  ASSERT_EQ(WEXITSTATUS(status), 0);
  const std::string outcome = read(dir + "/outcome");
  EXPECT_EQ(outcome.substr(0, outcome.find('\n')), std::to_string(128 + SIGTERM) + " " + std::to_string(SIGTERM) + " 49")
      << outcome;
  EXPECT_NE(outcome.find("1: not started"), std::string::npos) << outcome;
  EXPECT_NE(outcome.find("49 of the 50 ranks were never started"), std::string::npos) << outcome;
  EXPECT_FALSE(std::filesystem::exists(dir + "/started.1"));
}

TEST(Launch, DescribesWaitStatuses) {
  int status = 0;
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(5);
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_EQ(describe_wait_status(status), "exited with status 5");
}
