// write_safetensors: the file appears whole under its name or not at all, through a
// temporary file of its own (PATH.tmp-<pid>-<random>).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "model/safetensors.h"
#include "support/test_support.h"

namespace spillway {
namespace {

using testing_support::TempDir;
using testing_support::names_in;
using testing_support::read_file;

std::vector<SafetensorsTensor> two_tensors(float scale) {
  return {{"a", {2, 3}, [scale] { return Result<std::vector<float>>(std::vector<float>(6, scale)); }},
          {"b", {4}, [scale] { return Result<std::vector<float>>(std::vector<float>(4, -scale)); }}};
}

TEST(SafetensorsWrite, LeavesOnlyTheTargetAndItReadsBack) {
  TempDir dir;
  const std::string path = dir.file("w.safetensors");
  ASSERT_TRUE(write_safetensors(path, two_tensors(1.5f)).is_ok());
  EXPECT_EQ(names_in(dir.path()), std::vector<std::string>{"w.safetensors"});
  auto r = SafetensorsReader::open(path);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  auto b = r->read_f32(*r->find("b"));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b, std::vector<float>(4, -1.5f));
}

// Another writer's temporary file (or one of a run still going) under the old fixed
// name PATH.tmp is neither truncated nor renamed away.
TEST(SafetensorsWrite, AnotherFileNamedLikeATemporaryIsLeftAlone) {
  TempDir dir;
  const std::string path = dir.file("w.safetensors");
  std::ofstream(path + ".tmp") << "someone else's";
  ASSERT_TRUE(write_safetensors(path, two_tensors(2.0f)).is_ok());
  EXPECT_EQ(read_file(path + ".tmp"), "someone else's");
  EXPECT_EQ(names_in(dir.path()), (std::vector<std::string>{"w.safetensors", "w.safetensors.tmp"}));
}

TEST(SafetensorsWrite, FailedSaveKeepsTheOldFileAndLeavesNoTemporary) {
  TempDir dir;
  const std::string path = dir.file("w.safetensors");
  ASSERT_TRUE(write_safetensors(path, two_tensors(1.0f)).is_ok());
  const std::string before = read_file(path);
  std::vector<SafetensorsTensor> bad = two_tensors(3.0f);
  bad[1].values = [] { return Result<std::vector<float>>(Status::io_error("the source failed")); };
  Status s = write_safetensors(path, bad);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("the source failed"), std::string::npos) << s.message();
  EXPECT_EQ(read_file(path), before);
  EXPECT_EQ(names_in(dir.path()), std::vector<std::string>{"w.safetensors"});
}

}  // namespace
}  // namespace spillway
