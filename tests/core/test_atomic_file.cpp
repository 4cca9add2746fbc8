// core/atomic_file.h: unique temporary names made with O_EXCL, the target replaced
// only by a whole file, the temporary removed on failure, abandonment and signals.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/atomic_file.h"
#include "support/test_support.h"

namespace spillway {
namespace {

using testing_support::TempDir;
using testing_support::names_in;
using testing_support::read_file;

void write_text(int fd, const std::string& text) { ASSERT_EQ(::write(fd, text.data(), text.size()), ssize_t(text.size())); }

TEST(AtomicFile, TemporaryNameCarriesThePidAndIsUnique) {
  TempDir dir;
  const std::string target = dir.file("w.safetensors");
  auto a = AtomicFile::create(target);
  auto b = AtomicFile::create(target);
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_NE(a->temp_path(), b->temp_path());
  const std::string prefix = target + ".tmp-" + std::to_string(::getpid()) + "-";
  EXPECT_EQ(a->temp_path().rfind(prefix, 0), 0u) << a->temp_path();
  EXPECT_EQ(temp_file_pid(std::filesystem::path(a->temp_path()).filename().string()), ::getpid());
  EXPECT_TRUE(std::filesystem::exists(a->temp_path()));
  EXPECT_FALSE(std::filesystem::exists(target));
}

TEST(AtomicFile, CommitReplacesTheTargetAndLeavesNoTemporary) {
  TempDir dir;
  const std::string target = dir.file("w.bin");
  std::ofstream(target) << "old";
  auto f = AtomicFile::create(target);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  write_text(f->fd(), "new contents");
  EXPECT_EQ(read_file(target), "old");  // untouched until commit
  ASSERT_TRUE(f->commit().is_ok());
  EXPECT_EQ(read_file(target), "new contents");
  EXPECT_EQ(names_in(dir.path()), std::vector<std::string>{"w.bin"});
  EXPECT_FALSE(f->commit().is_ok());  // once only
}

TEST(AtomicFile, DestroyedWithoutCommitRemovesTheTemporary) {
  TempDir dir;
  const std::string target = dir.file("w.bin");
  std::ofstream(target) << "old";
  {
    auto f = AtomicFile::create(target);
    ASSERT_TRUE(f.ok());
    write_text(f->fd(), "half");
  }
  EXPECT_EQ(read_file(target), "old");
  EXPECT_EQ(names_in(dir.path()), std::vector<std::string>{"w.bin"});
}

TEST(AtomicFile, FailedRenameRemovesTheTemporary) {
  TempDir dir;
  const std::string target = dir.file("taken");
  std::filesystem::create_directory(target);
  std::ofstream(target + "/inside") << "x";  // rename onto a non-empty folder fails
  auto f = AtomicFile::create(target);
  ASSERT_TRUE(f.ok());
  Status s = f->commit();
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("rename"), std::string::npos) << s.message();
  EXPECT_EQ(names_in(dir.path()), std::vector<std::string>{"taken"});
}

TEST(AtomicFile, MissingFolderIsAnErrorNamingTheFile) {
  auto f = AtomicFile::create("/nonexistent-spillway-folder/w.bin");
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("/nonexistent-spillway-folder/w.bin"), std::string::npos)
      << f.status().message();
}

TEST(AtomicFile, ConcurrentWritersOfOneTargetEachWriteAWholeFile) {
  TempDir dir;
  const std::string target = dir.file("w.bin");
  std::vector<std::string> contents;
  for (int i = 0; i < 8; ++i) contents.push_back(std::string(100000 + i, static_cast<char>('a' + i)));
  std::vector<std::thread> writers;
  std::vector<int> ok(contents.size(), 0);
  for (size_t i = 0; i < contents.size(); ++i)
    writers.emplace_back([&, i] {
      auto f = AtomicFile::create(target);
      if (!f.ok()) return;
      const std::string& c = contents[i];
      if (::write(f->fd(), c.data(), c.size()) != ssize_t(c.size())) return;
      ok[i] = f->commit().is_ok();
    });
  for (auto& t : writers) t.join();
  for (size_t i = 0; i < ok.size(); ++i) EXPECT_TRUE(ok[i]) << "writer " << i;
  const std::string result = read_file(target);
  EXPECT_NE(std::find(contents.begin(), contents.end(), result), contents.end()) << "a mixed file of " << result.size()
                                                                                  << " bytes";
  EXPECT_EQ(names_in(dir.path()), std::vector<std::string>{"w.bin"});
}

TEST(AtomicFile, SignalThatEndsTheProcessRemovesTheTemporary) {
  TempDir dir;
  const std::string target = dir.file("w.bin");
  std::fflush(stdout);
  std::fflush(stderr);
  pid_t pid = ::fork();
  if (pid == 0) {
    if (!install_interrupt_handlers(InterruptMode::AtOnce).is_ok()) ::_exit(10);
    auto f = AtomicFile::create(target);
    if (!f.ok()) ::_exit(11);
    if (::write(f->fd(), "partial", 7) != 7) ::_exit(12);
    ::kill(::getpid(), SIGTERM);
    std::this_thread::sleep_for(std::chrono::seconds(5));
    ::_exit(13);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM);
  EXPECT_TRUE(names_in(dir.path()).empty());
}

TEST(AtomicFile, TempFilePidParsesOnlyOurNames) {
  EXPECT_EQ(temp_file_pid("w.safetensors.tmp-123-0a1b2c3d"), 123);
  EXPECT_EQ(temp_file_pid("a.tmp-b.tmp-4194305-ffffffff"), 4194305);
  EXPECT_EQ(temp_file_pid("w.safetensors.tmp"), 0);           // the old fixed name
  EXPECT_EQ(temp_file_pid("w.safetensors.tmp-123"), 0);
  EXPECT_EQ(temp_file_pid("w.safetensors.tmp-123-0a1b2c3"), 0);  // 7 digits
  EXPECT_EQ(temp_file_pid("w.safetensors.tmp-12x-0a1b2c3d"), 0);
  EXPECT_EQ(temp_file_pid("w.safetensors.tmp-123-0A1B2C3D"), 0);  // we write lower case
  EXPECT_EQ(temp_file_pid(".tmp-123-0a1b2c3d"), 0);              // no target name
  EXPECT_EQ(parent_directory("a/b/c"), "a/b");
  EXPECT_EQ(parent_directory("c"), ".");
  EXPECT_EQ(parent_directory("/c"), "/");
}

}  // namespace
}  // namespace spillway
