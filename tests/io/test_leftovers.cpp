// Leftovers of runs that are gone: spill directories and temporary files of
// unfinished saves, found by pid, reported with their size, removed only when dead.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/atomic_file.h"
#include "core/process.h"
#include "core/size.h"
#include "io/fault_storage_engine.h"
#include "memory/storage_store.h"
#include "support/storage_support.h"
#include "support/test_support.h"

namespace spillway {
namespace {

using testing_support::TempDir;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// Pids above 2^22 (the kernel's largest pid_max) name no process.
constexpr int64_t kDeadPid = (int64_t{1} << 22) + 7;
constexpr int64_t kOtherDeadPid = (int64_t{1} << 22) + 8;

// A directory as a run leaves it: the marker and a spill file of `bytes`.
std::string make_spill_dir(const std::string& dir, int64_t pid, const std::string& suffix, size_t bytes,
                           bool with_start) {
  std::string path = dir + "/spillway-" + std::to_string(pid) + "-" + suffix;
  EXPECT_EQ(::mkdir(path.c_str(), 0755), 0);
  std::ofstream marker(path + "/owner");
  marker << "spillway spill directory\npid " << pid << "\n";
  if (with_start) marker << "start " << *process_start_ticks(pid) << "\n";
  std::ofstream(path + "/spill-0.bin") << std::string(bytes, 'x');
  return path;
}

std::string make_file(const std::string& path, size_t bytes) {
  std::ofstream(path) << std::string(bytes, 'y');
  return path;
}

uint64_t disk_bytes(const std::string& path) {
  struct stat st;
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
  return static_cast<uint64_t>(st.st_blocks) * 512;
}

// A folder with one of everything: dead and live spill directories and temporary
// files, and files that only look like ours.
struct Scene {
  TempDir dir;
  std::string dead_spill, live_spill, dead_temp, live_temp;
  Scene() {
    dead_spill = make_spill_dir(dir.path(), kDeadPid, "deadbeef", 100000, false);
    live_spill = make_spill_dir(dir.path(), ::getpid(), "cafe0000", 5000, true);
    dead_temp = make_file(dir.file("w.safetensors.tmp-" + std::to_string(kOtherDeadPid) + "-0a1b2c3d"), 70000);
    live_temp = make_file(dir.file("w.safetensors.tmp-" + std::to_string(::getpid()) + "-0a1b2c3d"), 3000);
    make_file(dir.file("w.safetensors"), 100);
    make_file(dir.file("w.safetensors.tmp"), 100);                                          // the old fixed name
    make_file(dir.file("notes.tmp-" + std::to_string(kDeadPid) + "-zzzzzzzz"), 100);      // not hex
    EXPECT_EQ(::mkdir(dir.file("spillway-notes").c_str(), 0755), 0);                        // no pid
    // (A folder named like a temporary is a killed folder save's leftover, not a
    // look-alike: test_clean_cli covers those.)
  }
};

TEST(Leftovers, FindsOnlyThoseOfDeadProcesses) {
  ASSERT_FALSE(process_alive(kDeadPid));
  ASSERT_TRUE(process_alive(::getpid(), process_start_ticks(::getpid())));
  Scene s;
  auto found = find_all_leftovers(s.dir.path());
  ASSERT_TRUE(found.ok()) << found.status().to_string();
  ASSERT_EQ(found->spill_dirs.size(), 1u);
  EXPECT_EQ(found->spill_dirs[0].path, s.dead_spill);
  EXPECT_EQ(found->spill_dirs[0].pid, kDeadPid);
  EXPECT_EQ(found->spill_dirs[0].bytes, disk_bytes(s.dead_spill + "/spill-0.bin") + disk_bytes(s.dead_spill + "/owner"));
  ASSERT_EQ(found->temp_files.size(), 1u);
  EXPECT_EQ(found->temp_files[0].path, s.dead_temp);
  EXPECT_EQ(found->temp_files[0].pid, kOtherDeadPid);
  EXPECT_EQ(found->temp_files[0].bytes, disk_bytes(s.dead_temp));
  EXPECT_GE(found->bytes(), 170000u);
  EXPECT_EQ(leftover_bytes(s.dir.path()), found->bytes());
  const std::string text = found->describe();
  EXPECT_TRUE(contains(text, "1 spill directory (pid " + std::to_string(kDeadPid) + ")")) << text;
  EXPECT_TRUE(contains(text, "1 temporary file of unfinished saves (pid " + std::to_string(kOtherDeadPid) + ")")) << text;
  EXPECT_TRUE(contains(text, format_size(found->bytes()) + " in all")) << text;
}

TEST(Leftovers, NoneInACleanFolder) {
  TempDir dir;
  make_spill_dir(dir.path(), ::getpid(), "cafe0000", 5000, true);
  auto found = find_all_leftovers(dir.path());
  ASSERT_TRUE(found.ok());
  EXPECT_TRUE(found->empty());
  EXPECT_EQ(leftover_bytes(dir.path()), 0u);
  EXPECT_EQ(leftovers_note(dir.path()), "");
  EXPECT_FALSE(find_all_leftovers(dir.file("missing")).ok());
}

TEST(Leftovers, StoreOpenReportsTheirSizeAndHowToRemoveThem) {
  Scene s;
  const uint64_t total = leftover_bytes(s.dir.path());
  StorageStoreOptions o;
  o.dir = s.dir.path();
  o.engine = "threads";
  testing::internal::CaptureStderr();
  auto store = StorageStore::create(o);
  const std::string err = testing::internal::GetCapturedStderr();
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  EXPECT_TRUE(contains(err, "leftovers of runs that are gone")) << err;
  EXPECT_TRUE(contains(err, format_size(total) + " in all")) << err;
  EXPECT_TRUE(contains(err, "remove them with `spillway clean " + s.dir.path() + "`")) << err;
  store->reset();
  // Reported, never removed.
  EXPECT_TRUE(std::filesystem::exists(s.dead_spill + "/spill-0.bin"));
  EXPECT_TRUE(std::filesystem::exists(s.dead_temp));
}

TEST(Leftovers, BudgetAndFullDiskErrorsNameThem) {
  Scene s;
  StorageStoreOptions o;
  o.dir = s.dir.path();
  o.engine = "threads";
  o.budget_bytes = 8192;
  o.warn_leftovers = false;
  auto store = StorageStore::create(o);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  auto too_big = (*store)->allocate(16384);
  ASSERT_FALSE(too_big.ok());
  EXPECT_TRUE(contains(too_big.status().message(), "leftovers of runs that are gone take")) << too_big.status().message();
  EXPECT_TRUE(contains(too_big.status().message(), "`spillway clean " + s.dir.path() + "`"))
      << too_big.status().message();

  // ENOSPC from the disk.
  FaultOptions faults;
  faults.rules.push_back({FaultKind::NoSpace, 0.0, 1});
  auto inner = make_storage_engine("threads");
  ASSERT_TRUE(inner.ok());
  o.budget_bytes = 0;
  auto full = StorageStore::create(o, std::make_unique<FaultStorageEngine>(std::move(*inner), faults));
  ASSERT_TRUE(full.ok()) << full.status().to_string();
  auto e = (*full)->allocate(4096);
  ASSERT_TRUE(e.ok());
  AlignedBuffer buf = random_buffer(4096, 1);
  auto w = (*full)->write(*e, buf.data());
  ASSERT_TRUE(w.ok());
  Status st = (*full)->wait(*w);
  ASSERT_EQ(st.code(), StatusCode::NoSpace) << st.to_string();
  EXPECT_TRUE(contains(st.message(), "leftovers of runs that are gone take " + format_size(leftover_bytes(s.dir.path()))))
      << st.message();
}

TEST(Leftovers, RemovingASpillDirectoryTakesOnlyItsFiles) {
  TempDir dir;
  std::string plain = make_spill_dir(dir.path(), kDeadPid, "00000001", 1000, false);
  std::string odd = make_spill_dir(dir.path(), kDeadPid, "00000002", 1000, false);
  ASSERT_EQ(::mkdir((odd + "/user-folder").c_str(), 0755), 0);
  auto found = StorageStore::find_leftovers(dir.path());
  ASSERT_TRUE(found.ok());
  ASSERT_EQ(found->size(), 2u);
  for (const LeftoverSpill& l : *found) {
    Status s = remove_leftover_spill_dir(l);
    if (l.path == plain) {
      EXPECT_TRUE(s.is_ok()) << s.to_string();
    } else {
      EXPECT_FALSE(s.is_ok());
      EXPECT_TRUE(contains(s.message(), odd)) << s.message();
    }
  }
  EXPECT_FALSE(std::filesystem::exists(plain));
  EXPECT_TRUE(std::filesystem::exists(odd + "/user-folder"));
  EXPECT_FALSE(std::filesystem::exists(odd + "/spill-0.bin"));
}

}  // namespace
}  // namespace spillway
