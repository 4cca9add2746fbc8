// A rank's place from RANK, WORLD_SIZE and LOCAL_RANK (dist/rank_env.h), each bad
// value an error naming its variable, and the rendezvous file through which rank 0
// hands the job's id to the others when no launcher set it.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include "dist/rank_env.h"

using namespace spillway;

namespace {

Result<RankEnv> parse(const std::map<std::string, std::string>& vars) {
  return rank_env([&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

// The error's message, or "ok".
std::string error_of(const std::map<std::string, std::string>& vars) {
  auto r = parse(vars);
  return r.ok() ? "ok" : r.status().message();
}

std::string temp_dir(const std::string& name) {
  const std::string dir = testing::TempDir() + "/rank_env_" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace

TEST(RankEnv, OneProcessWhenWorldSizeIsUnsetOrOne) {
  for (const auto& vars : {std::map<std::string, std::string>{}, {{"WORLD_SIZE", ""}}, {{"WORLD_SIZE", "1"}},
                           {{"WORLD_SIZE", "1"}, {"RANK", "0"}, {"LOCAL_RANK", "0"}}, {{"RANK", "0"}}}) {
    auto r = parse(vars);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->world, 1);
    EXPECT_EQ(r->rank, 0);
    EXPECT_FALSE(r->distributed());
  }
}

TEST(RankEnv, ReadsARankOfAJob) {
  auto r = parse({{"WORLD_SIZE", "4"}, {"RANK", "3"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
                  {"SPILLWAY_NCCL_ID", "abcd"}, {"MASTER_PORT", "29500"}, {"TORCHELASTIC_RUN_ID", "job7"}});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->world, 4);
  EXPECT_EQ(r->rank, 3);
  EXPECT_EQ(r->local_rank, 1);
  EXPECT_TRUE(r->distributed());
  EXPECT_EQ(r->nccl_id, "abcd");
  EXPECT_EQ(r->master_port, "29500");
  EXPECT_EQ(r->run_id, "job7");
}

TEST(RankEnv, BadValuesNameTheirVariable) {
  struct Bad {
    std::map<std::string, std::string> vars;
    std::string expected;
  };
  for (const Bad& b : std::vector<Bad>{
           {{{"WORLD_SIZE", "two"}}, "WORLD_SIZE='two': expected the number of ranks"},
           {{{"WORLD_SIZE", "-2"}}, "WORLD_SIZE='-2': expected"},
           {{{"WORLD_SIZE", "0"}}, "WORLD_SIZE='0': expected"},
           {{{"WORLD_SIZE", "99999999999"}}, "WORLD_SIZE='99999999999': expected"},
           {{{"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}}, "WORLD_SIZE=2 but RANK is not set"},
           {{{"WORLD_SIZE", "2"}, {"RANK", "2"}, {"LOCAL_RANK", "0"}}, "RANK=2: expected a whole number from 0 to 1"},
           {{{"WORLD_SIZE", "2"}, {"RANK", "x"}, {"LOCAL_RANK", "0"}}, "RANK='x': expected"},
           {{{"WORLD_SIZE", "2"}, {"RANK", ""}, {"LOCAL_RANK", "0"}}, "RANK='': expected"},
           {{{"WORLD_SIZE", "2"}, {"RANK", "1"}}, "WORLD_SIZE=2 but LOCAL_RANK is not set"},
           {{{"WORLD_SIZE", "2"}, {"RANK", "1"}, {"LOCAL_RANK", "1.5"}}, "LOCAL_RANK='1.5': expected"},
           {{{"WORLD_SIZE", "2"}, {"RANK", "1"}, {"LOCAL_RANK", "2"}}, "LOCAL_RANK=2: expected"},
           {{{"WORLD_SIZE", "4"}, {"RANK", "1"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}},
            "LOCAL_RANK=2: expected this rank's device on its machine, a whole number from 0 to 1 (LOCAL_WORLD_SIZE is 2)"},
           {{{"WORLD_SIZE", "4"}, {"RANK", "1"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "none"}},
            "LOCAL_WORLD_SIZE='none': expected"},
           {{{"WORLD_SIZE", "1"}, {"RANK", "1"}}, "RANK=1: expected 0 (WORLD_SIZE is 1)"},
           {{{"RANK", "3"}}, "RANK=3 but WORLD_SIZE is not set"},
       }) {
    const std::string got = error_of(b.vars);
    EXPECT_NE(got.find(b.expected), std::string::npos) << "expected '" << b.expected << "' in: " << got;
  }
}

TEST(RankEnv, RendezvousPathIsKeyedByThePortAndTheRun) {
  RankEnv env;
  env.world = 4;
  env.rendezvous_dir = "/some/dir";
  EXPECT_EQ(rendezvous_path(env), "/some/dir/spillway-rendezvous-4");
  env.master_port = "29500";
  env.run_id = "a/b c";  // only file-name-safe characters reach the name
  EXPECT_EQ(rendezvous_path(env), "/some/dir/spillway-rendezvous-29500-a_b_c-4");
  env.rendezvous_dir.clear();
  const std::string tmp = std::filesystem::temp_directory_path().string();
  EXPECT_EQ(rendezvous_path(env), (std::filesystem::path(tmp) / "spillway-rendezvous-29500-a_b_c-4").string());
}

TEST(Rendezvous, HandsTheTextToAWaitingRank) {
  const std::string path = temp_dir("hand") + "/r";
  Result<std::string> got = Status::internal("not run");
  std::thread waiter([&] { got = await_rendezvous(path, std::chrono::seconds(20)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the waiter finds no file first
  ASSERT_TRUE(publish_rendezvous(path, "0123abcd the id").is_ok());
  waiter.join();
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(*got, "0123abcd the id");
  // Published again (another job with the same key): replaced whole.
  ASSERT_TRUE(publish_rendezvous(path, "second").is_ok());
  got = await_rendezvous(path, std::chrono::seconds(1));
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(*got, "second");
  EXPECT_TRUE(remove_rendezvous(path).is_ok());
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_TRUE(remove_rendezvous(path).is_ok()) << "removing a file that is gone is fine";
  EXPECT_FALSE(publish_rendezvous(path, "two\nlines").is_ok());
}

TEST(Rendezvous, TimesOutNamingThePath) {
  const std::string path = temp_dir("timeout") + "/never";
  const auto start = std::chrono::steady_clock::now();
  auto got = await_rendezvous(path, std::chrono::milliseconds(300));
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(300));
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.status().message().find("for rank 0 to write the job's id into " + path), std::string::npos)
      << got.status().to_string();
}

// A file whose writer is gone (a finished job's) is waited past, not taken.
TEST(Rendezvous, AFileAFinishedJobLeftIsWaitedPast) {
  const std::string path = temp_dir("stale") + "/r";
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(publish_rendezvous(path, "old job's id").is_ok() ? 0 : 1);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  ASSERT_TRUE(std::filesystem::exists(path));
  auto got = await_rendezvous(path, std::chrono::milliseconds(200));
  ASSERT_FALSE(got.ok()) << "took " << (got.ok() ? *got : "");
  EXPECT_NE(got.status().message().find("is gone: a finished job's, waited past"), std::string::npos)
      << got.status().to_string();
  // This job's rank 0 replaces it.
  ASSERT_TRUE(publish_rendezvous(path, "new id").is_ok());
  got = await_rendezvous(path, std::chrono::seconds(1));
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(*got, "new id");
}

TEST(Rendezvous, AFileSpillwayDidNotWriteIsAnError) {
  const std::string path = temp_dir("foreign") + "/r";
  std::ofstream(path) << "hello\n";
  auto got = await_rendezvous(path, std::chrono::seconds(1));
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.status().message().find("not a file spillway wrote"), std::string::npos) << got.status().to_string();
}
