// StorageStore: spill files, extents, checksums, budgets, leftovers, faults.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "io/fault_storage_engine.h"
#include "memory/storage_store.h"
#include "support/test_support.h"
#include "support/storage_support.h"

namespace spillway {
namespace {

using testing_support::TempDir;



bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

bool engine_available(const std::string& kind) {
  return kind != "uring" || make_storage_engine("uring").ok();
}

class StorageStoreTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!engine_available(GetParam())) GTEST_SKIP() << "io_uring is not available here";
  }
  std::unique_ptr<StorageStore> make(uint64_t budget = 0, std::unique_ptr<StorageEngine> engine = nullptr) {
    StorageStoreOptions o;
    o.dir = dir_.path();
    o.budget_bytes = budget;
    o.engine = GetParam();
    o.engine_options.queue_depth = 8;
    o.engine_options.chunk_bytes = 256 << 10;
    auto s = StorageStore::create(o, std::move(engine));
    EXPECT_TRUE(s.ok()) << s.status().to_string();
    return s.ok() ? std::move(*s) : nullptr;
  }
  std::unique_ptr<FaultStorageEngine> fault_engine(FaultOptions faults) {
    auto e = make_storage_engine(GetParam(), {.queue_depth = 8});
    EXPECT_TRUE(e.ok());
    return std::make_unique<FaultStorageEngine>(std::move(*e), std::move(faults));
  }
  TempDir dir_;
};

TEST_P(StorageStoreTest, RoundTripsOddSizesManyInFlight) {
  auto store = make();
  ASSERT_TRUE(store);
  EXPECT_TRUE(contains(store->run_dir(), dir_.path() + "/spillway-" + std::to_string(::getpid()) + "-"));
  std::vector<size_t> sizes = {1, 4095, 4096, 4097, (1u << 20) + 3, 0, 12345};
  for (int i = 0; i < 40; ++i) sizes.push_back(1 + (i * 7919) % 70000);
  std::vector<Extent> extents;
  std::vector<AlignedBuffer> data, back;
  std::vector<StorageStore::Ticket> tickets;
  for (size_t i = 0; i < sizes.size(); ++i) {
    auto e = store->allocate(sizes[i]);
    ASSERT_TRUE(e.ok()) << e.status().to_string();
    EXPECT_EQ(e->offset % 4096, 0u);
    extents.push_back(*e);
    data.push_back(random_buffer(sizes[i], 500 + i));
    auto t = store->write(*e, data.back().data());
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    tickets.push_back(*t);
  }
  for (auto t : tickets) ASSERT_TRUE(store->wait(t).is_ok());
  tickets.clear();
  for (size_t i = 0; i < sizes.size(); ++i) {
    back.push_back(random_buffer(sizes[i] + 64, 9));  // junk, with bytes after it
    auto t = store->read(extents[i], back.back().data());
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    tickets.push_back(*t);
  }
  Status all = store->wait_all();
  ASSERT_TRUE(all.is_ok()) << all.to_string();
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(std::memcmp(back[i].data(), data[i].data(), sizes[i]), 0) << "size " << sizes[i];
    AlignedBuffer fresh = random_buffer(sizes[i] + 64, 9);
    EXPECT_EQ(std::memcmp(back[i].data() + sizes[i], fresh.data() + sizes[i], 64), 0)
        << "a read of " << sizes[i] << " bytes wrote past them";
  }
  uint64_t total = 0;
  for (size_t s : sizes) total += s;
  EXPECT_EQ(store->bytes_written(), total);
  EXPECT_EQ(store->bytes_read(), total);
}

TEST_P(StorageStoreTest, FreedExtentsAreReused) {
  auto store = make();
  ASSERT_TRUE(store);
  auto a = store->allocate(10000);
  auto b = store->allocate(4096);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(store->bytes_in_use(), 3 * 4096u + 4096u);
  ASSERT_TRUE(store->free(*a).is_ok());
  auto c = store->allocate(8000);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->offset, a->offset);
  EXPECT_EQ(store->peak_bytes(), 4u * 4096);
  // A freed extent's handle is dead, even though its offset lives again.
  EXPECT_EQ(store->free(*a).code(), StatusCode::InvalidArgument);
  AlignedBuffer buf = random_buffer(10000, 1);
  EXPECT_EQ(store->write(*a, buf.data()).status().code(), StatusCode::InvalidArgument);
  // Reading what was never written is refused.
  auto r = store->read(*b, buf.data());
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "never written")) << r.status().message();
}

TEST_P(StorageStoreTest, OneRequestAtATimePerExtent) {
  auto store = make();
  ASSERT_TRUE(store);
  auto e = store->allocate(1 << 20);
  ASSERT_TRUE(e.ok());
  AlignedBuffer buf = random_buffer(1 << 20, 1);
  auto w = store->write(*e, buf.data());
  ASSERT_TRUE(w.ok());
  auto again = store->write(*e, buf.data());
  auto freed = store->free(*e);
  EXPECT_EQ(freed.code(), StatusCode::InvalidArgument);
  ASSERT_FALSE(again.ok());
  EXPECT_TRUE(contains(again.status().message(), "in flight")) << again.status().message();
  ASSERT_TRUE(store->wait(*w).is_ok());
  EXPECT_TRUE(store->free(*e).is_ok());
}

TEST_P(StorageStoreTest, MisalignedHostBufferIsRefusedClearly) {
  auto store = make();
  ASSERT_TRUE(store);
  auto e = store->allocate(100);
  ASSERT_TRUE(e.ok());
  AlignedBuffer buf = random_buffer(8192, 1);
  auto w = store->write(*e, buf.data() + 16);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::InvalidArgument);
  EXPECT_TRUE(contains(w.status().message(), "not aligned to 4096")) << w.status().message();
  EXPECT_TRUE(contains(w.status().message(), "O_DIRECT"));
}

TEST_P(StorageStoreTest, CorruptionBehindTheEnginesBackIsCaught) {
  auto store = make();
  ASSERT_TRUE(store);
  auto keep = store->allocate(4097);
  auto hit = store->allocate(50000);
  ASSERT_TRUE(keep.ok() && hit.ok());
  AlignedBuffer a = random_buffer(4097, 1), b = random_buffer(50000, 2);
  ASSERT_TRUE(store->wait(*store->write(*keep, a.data())).is_ok());
  ASSERT_TRUE(store->wait(*store->write(*hit, b.data())).is_ok());
  // Someone else scribbles on the spill file.
  int fd = ::open(store->file_path().c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  const char garbage[] = "not your tensor";
  ASSERT_EQ(::pwrite(fd, garbage, sizeof garbage, static_cast<off_t>(hit->offset + 30000)),
            static_cast<ssize_t>(sizeof garbage));
  ASSERT_EQ(::fsync(fd), 0);
  ::close(fd);
  // With O_DIRECT reads go to the disk; a buffered fallback sees the page cache,
  // which the pwrite above updated too.
  AlignedBuffer back = random_buffer(50000, 3);
  auto r = store->read(*hit, back.data());
  ASSERT_TRUE(r.ok());
  Status s = store->wait(*r);
  ASSERT_EQ(s.code(), StatusCode::Corrupt) << s.to_string();
  EXPECT_TRUE(contains(s.message(), store->file_path())) << s.message();
  EXPECT_TRUE(contains(s.message(), "offset " + std::to_string(hit->offset))) << s.message();
  EXPECT_TRUE(contains(s.message(), "written 0x")) << s.message();
  EXPECT_TRUE(contains(s.message(), "read back 0x")) << s.message();
  // The neighbour is untouched.
  AlignedBuffer back_a = random_buffer(4097, 4);
  ASSERT_TRUE(store->wait(*store->read(*keep, back_a.data())).is_ok());
  EXPECT_EQ(std::memcmp(back_a.data(), a.data(), 4097), 0);
}

TEST_P(StorageStoreTest, EveryInjectedFaultIsAnErrorNeverWrongData) {
  FaultOptions faults{.seed = 1234,
                      .rules = {{FaultKind::WriteError, 0.06},
                                {FaultKind::NoSpace, 0.06},
                                {FaultKind::ShortWrite, 0.08},
                                {FaultKind::TornWrite, 0.10},
                                {FaultKind::ReadError, 0.08},
                                {FaultKind::CorruptRead, 0.10}}};
  auto engine = fault_engine(faults);
  FaultStorageEngine* fe = engine.get();
  auto store = make(0, std::move(engine));
  ASSERT_TRUE(store);
  const int n = 120;
  std::vector<Extent> extents;
  std::vector<AlignedBuffer> data;
  std::vector<bool> written(n, false);
  for (int i = 0; i < n; ++i) {
    size_t bytes = 1 + (static_cast<size_t>(i) * 104729) % 40000;
    auto e = store->allocate(bytes);
    ASSERT_TRUE(e.ok());
    extents.push_back(*e);
    data.push_back(random_buffer(bytes, 900 + i));
  }
  int write_errors = 0, read_errors = 0, corrupt = 0, good = 0;
  for (int round = 0; round < 2; ++round) {
    for (int i = 0; i < n; ++i) {
      auto t = store->write(extents[i], data[i].data());
      ASSERT_TRUE(t.ok());
      Status s = store->wait(*t);
      written[i] = s.is_ok();
      if (!s.is_ok()) {
        ++write_errors;
        EXPECT_TRUE(contains(s.message(), store->file_path()) || contains(s.message(), store->dir()))
            << s.message();
      }
    }
    for (int i = 0; i < n; ++i) {
      AlignedBuffer back = random_buffer(extents[i].bytes, 77);
      auto t = store->read(extents[i], back.data());
      if (!t.ok()) {  // the last write failed: no data, and it says so
        EXPECT_FALSE(written[i]);
        EXPECT_TRUE(contains(t.status().message(), "last write failed")) << t.status().message();
        continue;
      }
      Status s = store->wait(*t);
      if (s.is_ok()) {
        ++good;
        ASSERT_EQ(std::memcmp(back.data(), data[i].data(), extents[i].bytes), 0)
            << "extent " << i << " read back Ok with wrong bytes";
      } else if (s.code() == StatusCode::Corrupt) {
        ++corrupt;
      } else {
        ++read_errors;
      }
    }
  }
  EXPECT_GT(fe->faults_injected(FaultKind::TornWrite), 0u);
  EXPECT_GT(fe->faults_injected(FaultKind::CorruptRead), 0u);
  EXPECT_GT(write_errors, 0);
  EXPECT_GT(read_errors, 0);
  EXPECT_GT(corrupt, 0);
  EXPECT_GT(good, n / 2);
}

TEST_P(StorageStoreTest, FullDiskNamesTheDirectoryAndKeepsEarlierData) {
  auto engine = fault_engine({.seed = 1, .rules = {{FaultKind::NoSpace, 0.0, 2}, {FaultKind::ShortWrite, 0.0, 3}}});
  auto store = make(0, std::move(engine));
  ASSERT_TRUE(store);
  auto a = store->allocate(20000), b = store->allocate(20000), c = store->allocate(20000);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  AlignedBuffer da = random_buffer(20000, 1), db = random_buffer(20000, 2), dc = random_buffer(20000, 3);
  ASSERT_TRUE(store->wait(*store->write(*a, da.data())).is_ok());
  Status full = store->wait(*store->write(*b, db.data()));
  ASSERT_EQ(full.code(), StatusCode::NoSpace) << full.to_string();
  EXPECT_TRUE(contains(full.message(), "spill directory " + dir_.path() + " is full")) << full.message();
  EXPECT_TRUE(contains(full.message(), "expected room for")) << full.message();
  Status cut = store->wait(*store->write(*c, dc.data()));
  ASSERT_EQ(cut.code(), StatusCode::IoError) << cut.to_string();
  EXPECT_TRUE(contains(cut.message(), "short write")) << cut.message();
  // Data already written survives the failed writes after it.
  AlignedBuffer back = random_buffer(20000, 9);
  Status s = store->wait(*store->read(*a, back.data()));
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(std::memcmp(back.data(), da.data(), 20000), 0);
  // A failed extent reads as an error until written again.
  EXPECT_FALSE(store->read(*b, back.data()).ok());
  ASSERT_TRUE(store->wait(*store->write(*b, db.data())).is_ok());
  ASSERT_TRUE(store->wait(*store->read(*b, back.data())).is_ok());
  EXPECT_EQ(std::memcmp(back.data(), db.data(), 20000), 0);
}

TEST_P(StorageStoreTest, BudgetIsNeverExceeded) {
  const uint64_t budget = (1 << 20) + 100;  // not a multiple of 4096
  auto store = make(budget);
  ASSERT_TRUE(store);
  std::mt19937_64 rng(3);
  std::vector<Extent> live;
  AlignedBuffer data = random_buffer(300000, 5);
  int refused = 0;
  for (int i = 0; i < 400; ++i) {
    if (!live.empty() && rng() % 3 == 0) {
      size_t k = rng() % live.size();
      ASSERT_TRUE(store->free(live[k]).is_ok());
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
      continue;
    }
    auto e = store->allocate(1 + rng() % 300000);
    if (!e.ok()) {
      ++refused;
      EXPECT_EQ(e.status().code(), StatusCode::OutOfMemory);
      EXPECT_TRUE(contains(e.status().message(), "storage budget")) << e.status().message();
      EXPECT_TRUE(contains(e.status().message(), "1.00 MiB")) << e.status().message();
      continue;
    }
    EXPECT_LE(e->offset + e->bytes, budget);
    ASSERT_TRUE(store->wait(*store->write(*e, data.data())).is_ok());
    live.push_back(*e);
    EXPECT_LE(store->bytes_in_use(), budget);
  }
  EXPECT_GT(refused, 0);
  EXPECT_LE(store->peak_bytes(), budget);
  EXPECT_LE(store->file_bytes(), budget);
  struct stat st;
  ASSERT_EQ(::stat(store->file_path().c_str(), &st), 0);
  EXPECT_LE(static_cast<uint64_t>(st.st_size), budget);
}

INSTANTIATE_TEST_SUITE_P(Storage, StorageStoreTest, ::testing::Values("uring", "threads"),
                         [](const auto& info) { return info.param; });

// ---- the spill directory ----

TEST(StorageStoreDir, MissingDirectoryIsAClearError) {
  TempDir dir;
  StorageStoreOptions o;
  o.dir = dir.path() + "/nope";
  auto s = StorageStore::create(o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::NotFound);
  EXPECT_TRUE(contains(s.status().message(), o.dir + " does not exist")) << s.status().message();
  EXPECT_TRUE(contains(s.status().message(), "expected an existing directory")) << s.status().message();

  std::ofstream(dir.path() + "/file") << "x";
  o.dir = dir.path() + "/file";
  s = StorageStore::create(o);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(contains(s.status().message(), "is not a directory")) << s.status().message();

  o.dir = "";
  EXPECT_EQ(StorageStore::create(o).status().code(), StatusCode::InvalidArgument);

  o.dir = dir.path() + "/empty";  // a failure after the run directory was made leaves nothing
  ASSERT_EQ(::mkdir(o.dir.c_str(), 0755), 0);
  o.engine = "floppy";
  EXPECT_EQ(StorageStore::create(o).status().code(), StatusCode::InvalidArgument);
  EXPECT_TRUE(std::filesystem::is_empty(o.dir));
}

// Runs create() on a read-only directory, as an unprivileged user when we are root
// (root writes anywhere), in a child process; returns its error message.
std::string unwritable_dir_error(const std::string& dir) {
  auto attempt = [&]() -> std::string {
    StorageStoreOptions o;
    o.dir = dir;
    o.engine = "threads";
    auto s = StorageStore::create(o);
    return s.ok() ? std::string("created ") + (*s)->run_dir() : s.status().to_string();
  };
  if (::geteuid() != 0) return attempt();
  int fds[2];
  if (::pipe(fds) != 0) return "pipe failed";
  pid_t pid = ::fork();
  if (pid < 0) return "fork failed";
  if (pid == 0) {
    ::close(fds[0]);
    std::string m = (::setgid(65534) == 0 && ::setuid(65534) == 0) ? attempt() : "setuid failed";
    ssize_t n = ::write(fds[1], m.data(), m.size());
    (void)n;
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string m;
  char buf[512];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof buf)) > 0) m.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return m;
}

TEST(StorageStoreDir, UnwritableDirectoryIsAClearError) {
  TempDir dir;
  std::string ro = dir.path() + "/readonly";
  ASSERT_EQ(::mkdir(ro.c_str(), 0555), 0);
  ASSERT_EQ(::chmod(dir.path().c_str(), 0755), 0);  // the child must reach it
  std::string m = unwritable_dir_error(ro);
  EXPECT_TRUE(contains(m, "spill directory " + ro + " is not writable")) << m;
  EXPECT_TRUE(contains(m, "Permission denied")) << m;
}

TEST(StorageStoreDir, CleanExitRemovesTheRunDirectory) {
  TempDir dir;
  StorageStoreOptions o;
  o.dir = dir.path();
  o.engine = "threads";
  std::string run_dir, file;
  {
    AlignedBuffer buf = random_buffer(4096, 1);  // outlives the store, which waits for it
    auto s = StorageStore::create(o);
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    run_dir = (*s)->run_dir();
    file = (*s)->file_path();
    EXPECT_TRUE(std::filesystem::exists(file));
    std::ifstream marker(run_dir + "/owner");
    std::string text((std::istreambuf_iterator<char>(marker)), std::istreambuf_iterator<char>());
    EXPECT_TRUE(contains(text, "pid " + std::to_string(::getpid()))) << text;
    auto e = (*s)->allocate(4096);
    ASSERT_TRUE(e.ok());
    ASSERT_TRUE((*s)->write(*e, buf.data()).ok());  // left in flight: the destructor waits
  }
  EXPECT_FALSE(std::filesystem::exists(run_dir));
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

// A pid that no process has: a child that has exited and been reaped.
pid_t dead_pid() {
  pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  int status;
  ::waitpid(pid, &status, 0);
  return pid;
}

TEST(StorageStoreDir, LeftoversAreReportedAndNeverReused) {
  TempDir dir;
  pid_t gone = dead_pid();
  std::string crashed = dir.path() + "/spillway-" + std::to_string(gone) + "-deadbeef";
  ASSERT_EQ(::mkdir(crashed.c_str(), 0755), 0);
  std::ofstream(crashed + "/owner") << "spillway spill directory\npid " << gone << "\n";
  std::ofstream(crashed + "/spill-0.bin") << std::string(10000, 'x');
  // Alive: this process (with its real start time), and a marker-less directory
  // whose name names pid 1.
  std::string alive = dir.path() + "/spillway-1-cafe0000";
  ASSERT_EQ(::mkdir(alive.c_str(), 0755), 0);
  // Not ours at all.
  ASSERT_EQ(::mkdir((dir.path() + "/spillway-notes").c_str(), 0755), 0);
  // A marker whose pid is alive but started at another time: the pid was reused.
  std::string reused = dir.path() + "/spillway-" + std::to_string(::getpid()) + "-0badf00d";
  ASSERT_EQ(::mkdir(reused.c_str(), 0755), 0);
  std::ofstream(reused + "/owner") << "spillway spill directory\npid " << ::getpid() << "\nstart 1\n";

  auto found = StorageStore::find_leftovers(dir.path());
  ASSERT_TRUE(found.ok()) << found.status().to_string();
  std::vector<std::string> paths;
  for (auto& l : *found) paths.push_back(l.path);
  std::sort(paths.begin(), paths.end());
  std::vector<std::string> expected = {crashed, reused};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(paths, expected);

  StorageStoreOptions o;
  o.dir = dir.path();
  o.engine = "threads";
  testing::internal::CaptureStderr();
  auto s = StorageStore::create(o);
  std::string err = testing::internal::GetCapturedStderr();
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ((*s)->leftovers().size(), 2u);
  EXPECT_TRUE(contains(err, "2 spill directories (pids ")) << err;
  EXPECT_TRUE(contains(err, std::to_string(gone))) << err;
  EXPECT_TRUE(contains(err, "remove them with `spillway clean " + dir.path() + "`")) << err;
  EXPECT_NE((*s)->run_dir(), crashed);
  s->reset();
  EXPECT_TRUE(std::filesystem::exists(crashed + "/spill-0.bin"));  // the user's call
  EXPECT_TRUE(std::filesystem::exists(alive));
}

TEST(StorageStoreDir, BudgetSmallerThanABlockIsRefused) {
  TempDir dir;
  StorageStoreOptions o;
  o.dir = dir.path();
  o.budget_bytes = 100;
  auto s = StorageStore::create(o);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(contains(s.status().message(), "storage budget")) << s.status().message();
}

// A spill directory where no run directory can be made (mode 0444: not even
// searchable, so removing a name in it fails too, as on a read-only mount). The
// error and stderr name the directory given, never the run directory that was not
// made. create() runs in a child, as an unprivileged user when we are root (root
// writes anywhere), with its stderr captured.
TEST(StorageStoreDir, UnwritableDirectoryNamesNoRunDirectoryThatWasNotMade) {
  TempDir dir;
  std::string locked = dir.path() + "/locked";
  ASSERT_EQ(::mkdir(locked.c_str(), 0444), 0);
  ASSERT_EQ(::chmod(locked.c_str(), 0444), 0);       // whatever the umask
  ASSERT_EQ(::chmod(dir.path().c_str(), 0755), 0);  // the child must reach it
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(fds[0]);
    ::dup2(fds[1], STDERR_FILENO);
    std::string m;
    if (::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) {
      m = "setuid failed";
    } else {
      StorageStoreOptions o;
      o.dir = locked;
      o.engine = "threads";
      auto s = StorageStore::create(o);  // destroyed before the message is written
      m = s.ok() ? "created" : s.status().to_string();
    }
    m = "\nstatus: " + m;
    ssize_t n = ::write(fds[1], m.data(), m.size());
    (void)n;
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string out;
  char buf[512];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  EXPECT_TRUE(contains(out, "status: IoError: spill directory " + locked + " is not writable")) << out;
  EXPECT_TRUE(contains(out, "Permission denied")) << out;
  EXPECT_FALSE(contains(out, "spillway-" + std::to_string(pid) + "-")) << out;  // the run directory's name
  EXPECT_FALSE(contains(out, "warning")) << out;
}

}  // namespace
}  // namespace spillway
