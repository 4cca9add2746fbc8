// StorageEngine: one suite run on every engine (io_uring, thread pool), and the
// fault-injection wrapper.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "io/fault_storage_engine.h"
#include "io/storage_engine.h"
#include "support/test_support.h"
#include "support/storage_support.h"

namespace spillway {
namespace {

using testing_support::TempDir;



// A buffer of `bytes` plus guard bytes after it, all set to 0xEE.
AlignedBuffer guarded_buffer(size_t bytes, size_t guard) {
  auto b = AlignedBuffer::allocate(bytes + guard);
  EXPECT_TRUE(b.ok());
  std::memset(b->data(), 0xEE, bytes + guard);
  return std::move(*b);
}

bool all_equal(const char* p, size_t n, char v) {
  for (size_t i = 0; i < n; ++i)
    if (p[i] != v) return false;
  return true;
}

class StorageEngineTest : public ::testing::TestWithParam<std::string> {
 protected:
  std::unique_ptr<StorageEngine> make(StorageEngineOptions options = {}) {
    auto e = make_storage_engine(GetParam(), options);
    if (!e && GetParam() == "uring" && e.status().code() == StatusCode::Unsupported) return nullptr;
    EXPECT_TRUE(e.ok()) << e.status().to_string();
    return e.ok() ? std::move(*e) : nullptr;
  }
  TempDir dir_;
};

#define MAKE_OR_SKIP(var, ...)                                                  \
  auto var = make(__VA_ARGS__);                                                 \
  if (!var) GTEST_SKIP() << "io_uring is not available here";

TEST_P(StorageEngineTest, OpensWithODirect) {
  MAKE_OR_SKIP(engine);
  auto f = engine->open(dir_.path() + "/a.bin", OpenMode::Create);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  // /tmp on the machines we test on takes O_DIRECT; a file system that does not
  // would take the buffered fallback, which the other tests also exercise.
  if (engine->is_direct(*f)) EXPECT_EQ(engine->alignment(*f), 4096u);
  else EXPECT_EQ(engine->alignment(*f), 1u);
  EXPECT_EQ(engine->path(*f), dir_.path() + "/a.bin");
  EXPECT_EQ(engine->name(), GetParam());
  EXPECT_TRUE(engine->close(*f).is_ok());
}

// Sizes that are not multiples of the block, one after another in one file.
TEST_P(StorageEngineTest, RoundTripsOddSizesExactly) {
  MAKE_OR_SKIP(engine, StorageEngineOptions{.queue_depth = 8, .chunk_bytes = 256 << 10});
  auto f = engine->open(dir_.path() + "/odd.bin", OpenMode::Create);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  std::vector<size_t> sizes = {1, 4095, 4096, 4097, (1u << 20) + 3, 3 * 4096};
  uint64_t offset = 0;
  std::vector<uint64_t> offsets;
  std::vector<AlignedBuffer> data;
  for (size_t i = 0; i < sizes.size(); ++i) {
    offsets.push_back(offset);
    data.push_back(random_buffer(sizes[i], 100 + i));
    auto t = engine->submit_write(*f, offset, data.back().data(), sizes[i]);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    ASSERT_TRUE(engine->wait(*t).is_ok());
    offset += (sizes[i] + 4095) / 4096 * 4096;
  }
  const size_t guard = 4096 + 17;
  for (size_t i = 0; i < sizes.size(); ++i) {
    AlignedBuffer back = guarded_buffer(sizes[i], guard);
    auto t = engine->submit_read(*f, offsets[i], back.data(), sizes[i]);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    Status s = engine->wait(*t);
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    EXPECT_EQ(std::memcmp(back.data(), data[i].data(), sizes[i]), 0) << "size " << sizes[i];
    EXPECT_TRUE(all_equal(back.data() + sizes[i], guard, static_cast<char>(0xEE)))
        << "a read of " << sizes[i] << " bytes wrote past them";
  }
  uint64_t total = 0;
  for (size_t s : sizes) total += s;
  EXPECT_EQ(engine->bytes_written(), total);
  EXPECT_EQ(engine->bytes_read(), total);
  // On O_DIRECT files the rest of a partial last block is zeros.
  if (engine->is_direct(*f)) {
    int fd = ::open((dir_.path() + "/odd.bin").c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    char block[4096];
    ASSERT_EQ(::pread(fd, block, 4096, 0), 4096);
    EXPECT_TRUE(all_equal(block + 1, 4095, 0));
    ::close(fd);
  }
}

TEST_P(StorageEngineTest, ManyRequestsInFlight) {
  MAKE_OR_SKIP(engine, StorageEngineOptions{.queue_depth = 4, .chunk_bytes = 64 << 10});
  auto f = engine->open(dir_.path() + "/many.bin", OpenMode::Create);
  ASSERT_TRUE(f.ok());
  const int n = 48;
  std::vector<size_t> sizes;
  std::vector<uint64_t> offsets;
  std::vector<AlignedBuffer> data, back;
  std::vector<StorageTicket> tickets;
  uint64_t offset = 0;
  for (int i = 0; i < n; ++i) {
    size_t bytes = (i % 3 == 0) ? (200 << 10) + 4096 : (i % 3 == 1) ? 4097 + i : 1 + i;
    sizes.push_back(bytes);
    offsets.push_back(offset);
    offset += (bytes + 4095) / 4096 * 4096;
    data.push_back(random_buffer(bytes, 7000 + i));
  }
  for (int i = 0; i < n; ++i) {  // all writes in flight before any wait
    auto t = engine->submit_write(*f, offsets[i], data[i].data(), sizes[i]);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    tickets.push_back(*t);
  }
  Status all = engine->wait_all();
  ASSERT_TRUE(all.is_ok()) << all.to_string();
  EXPECT_EQ(engine->poll(), 0);
  tickets.clear();
  for (int i = 0; i < n; ++i) {
    back.push_back(guarded_buffer(sizes[i], 0));
    auto t = engine->submit_read(*f, offsets[i], back[i].data(), sizes[i]);
    ASSERT_TRUE(t.ok());
    tickets.push_back(*t);
  }
  for (int i = n - 1; i >= 0; --i) {  // collected out of order
    Status s = engine->wait(tickets[i]);
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    EXPECT_TRUE(engine->is_done(tickets[i]));
    EXPECT_EQ(std::memcmp(back[i].data(), data[i].data(), sizes[i]), 0) << "request " << i;
  }
  EXPECT_TRUE(engine->wait(tickets[0]).is_ok());  // collected already
  EXPECT_EQ(engine->wait(StorageTicket{999999}).code(), StatusCode::InvalidArgument);
}

TEST_P(StorageEngineTest, LargeRequestIsSplitIntoChunks) {
  MAKE_OR_SKIP(engine, StorageEngineOptions{.queue_depth = 3, .chunk_bytes = 64 << 10});
  auto f = engine->open(dir_.path() + "/large.bin", OpenMode::Create);
  ASSERT_TRUE(f.ok());
  const size_t bytes = (3 << 20) + 5;
  AlignedBuffer data = random_buffer(bytes, 9);
  AlignedBuffer back = guarded_buffer(bytes, 0);
  auto w = engine->submit_write(*f, 8192, data.data(), bytes);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(engine->wait(*w).is_ok());
  auto r = engine->submit_read(*f, 8192, back.data(), bytes);
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(engine->wait(*r).is_ok());
  EXPECT_EQ(std::memcmp(back.data(), data.data(), bytes), 0);
}

TEST_P(StorageEngineTest, BufferedFilesTakeAnyOffsetAndBuffer) {
  MAKE_OR_SKIP(engine, StorageEngineOptions{.queue_depth = 2, .direct_io = false});
  auto f = engine->open(dir_.path() + "/buffered.bin", OpenMode::Create);
  ASSERT_TRUE(f.ok());
  EXPECT_FALSE(engine->is_direct(*f));
  EXPECT_EQ(engine->alignment(*f), 1u);
  AlignedBuffer data = random_buffer(10000, 3);
  AlignedBuffer back = guarded_buffer(10000, 0);
  auto w = engine->submit_write(*f, 13, data.data() + 1, 9999);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(engine->wait(*w).is_ok());
  auto r = engine->submit_read(*f, 13, back.data() + 3, 9999);
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(engine->wait(*r).is_ok());
  EXPECT_EQ(std::memcmp(back.data() + 3, data.data() + 1, 9999), 0);
}

TEST_P(StorageEngineTest, RejectsMisalignedDirectRequests) {
  MAKE_OR_SKIP(engine);
  auto f = engine->open(dir_.path() + "/a.bin", OpenMode::Create);
  ASSERT_TRUE(f.ok());
  if (!engine->is_direct(*f)) GTEST_SKIP() << "this file system refuses O_DIRECT";
  AlignedBuffer buf = random_buffer(8192, 1);
  auto t = engine->submit_write(*f, 100, buf.data(), 4096);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::InvalidArgument);
  EXPECT_NE(t.status().message().find("offset 100"), std::string::npos) << t.status().message();
  EXPECT_NE(t.status().message().find("4096"), std::string::npos);
  t = engine->submit_read(*f, 0, buf.data() + 8, 4096);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("not aligned"), std::string::npos) << t.status().message();
}

TEST_P(StorageEngineTest, ReadPastEndOfFileIsAnError) {
  MAKE_OR_SKIP(engine);
  std::string path = dir_.path() + "/short.bin";
  auto f = engine->open(path, OpenMode::Create);
  ASSERT_TRUE(f.ok());
  AlignedBuffer buf = random_buffer(3 * 4096, 1);
  auto w = engine->submit_write(*f, 0, buf.data(), 4096);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(engine->wait(*w).is_ok());
  auto r = engine->submit_read(*f, 0, buf.data(), 3 * 4096);
  ASSERT_TRUE(r.ok());
  Status s = engine->wait(*r);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find(path), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("end of file"), std::string::npos) << s.message();
  EXPECT_EQ(engine->bytes_read(), 0u);
}

TEST_P(StorageEngineTest, SystemErrorsNameFileOffsetAndCause) {
  MAKE_OR_SKIP(engine);
  std::string path = dir_.path() + "/ro.bin";
  {
    auto f = engine->open(path, OpenMode::Create);
    ASSERT_TRUE(f.ok());
    ASSERT_TRUE(engine->close(*f).is_ok());
  }
  auto f = engine->open(path, OpenMode::ReadOnly);
  ASSERT_TRUE(f.ok());
  AlignedBuffer buf = random_buffer(8192, 1);
  auto a = engine->submit_write(*f, 4096, buf.data(), 8192);  // write to a read-only fd: EBADF
  auto b = engine->submit_write(*f, 0, buf.data(), 4096);
  ASSERT_TRUE(a.ok() && b.ok());
  Status s = engine->wait(*a);
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::IoError);
  EXPECT_NE(s.message().find("write " + path + " at offset 4096 (8192 bytes)"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(std::strerror(EBADF)), std::string::npos) << s.message();
  Status all = engine->wait_all();  // the other failure, reported once
  EXPECT_FALSE(all.is_ok());
  EXPECT_TRUE(engine->wait_all().is_ok());

  auto missing = engine->open(dir_.path() + "/none/x.bin", OpenMode::ReadWrite);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::NotFound);
  EXPECT_NE(missing.status().message().find(dir_.path() + "/none/x.bin"), std::string::npos);
}

TEST_P(StorageEngineTest, ZeroByteRequestsAreDone) {
  MAKE_OR_SKIP(engine);
  auto f = engine->open(dir_.path() + "/z.bin", OpenMode::Create);
  ASSERT_TRUE(f.ok());
  auto t = engine->submit_write(*f, 0, nullptr, 0);
  ASSERT_TRUE(t.ok());
  EXPECT_TRUE(engine->is_done(*t));
  EXPECT_TRUE(engine->wait(*t).is_ok());
}

INSTANTIATE_TEST_SUITE_P(Storage, StorageEngineTest, ::testing::Values("uring", "threads"),
                         [](const auto& info) { return info.param; });

TEST(StorageEngineFactory, KindsAndOptions) {
  auto a = make_storage_engine("auto");
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  EXPECT_TRUE((*a)->name() == "uring" || (*a)->name() == "threads");
  auto bad = make_storage_engine("floppy");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::InvalidArgument);
  EXPECT_NE(bad.status().message().find("uring, threads or auto"), std::string::npos);
  EXPECT_FALSE(make_storage_engine("threads", {.queue_depth = 0}).ok());
  EXPECT_FALSE(make_storage_engine("threads", {.chunk_bytes = 1000}).ok());
  auto t = make_storage_engine("threads", {.queue_depth = 3});
  ASSERT_TRUE(t.ok());
  EXPECT_EQ((*t)->queue_depth(), 3);
#ifndef SPILLWAY_HAVE_URING
  EXPECT_EQ(make_storage_engine("uring").status().code(), StatusCode::Unsupported);
#endif
}

// How one system call's result moves a chunk on: continue, finish, or fail.
struct ChunkProbe : ChunkedStorageEngine {
  using ChunkedStorageEngine::Chunk;
  using ChunkedStorageEngine::record_result;
};

TEST(StorageEngineChunks, ShortTransfersContinueOrFailNeverSilently) {
  std::string path = "/spill/f.bin";
  auto chunk = [&](bool write, bool direct, size_t bytes, size_t required) {
    ChunkProbe::Chunk c;
    c.path = &path;
    c.write = write;
    c.direct = direct;
    c.offset = 8192;
    c.bytes = bytes;
    c.required = required;
    return c;
  };
  auto c = chunk(true, false, 10000, 10000);  // buffered write, cut short twice
  EXPECT_TRUE(ChunkProbe::record_result(c, 3000));
  EXPECT_TRUE(ChunkProbe::record_result(c, -EINTR));
  EXPECT_TRUE(ChunkProbe::record_result(c, 5000));
  EXPECT_FALSE(ChunkProbe::record_result(c, 2000));
  EXPECT_TRUE(c.status.is_ok());
  EXPECT_EQ(c.done, 10000u);

  c = chunk(true, false, 10000, 10000);  // a write that stops making progress
  EXPECT_TRUE(ChunkProbe::record_result(c, 4000));
  EXPECT_FALSE(ChunkProbe::record_result(c, 0));
  EXPECT_EQ(c.status.code(), StatusCode::IoError);
  EXPECT_NE(c.status.message().find("short write"), std::string::npos) << c.status.message();
  EXPECT_NE(c.status.message().find("after 4000 bytes"), std::string::npos) << c.status.message();

  c = chunk(false, true, 4096, 100);  // a read's last block may end at end of file
  EXPECT_FALSE(ChunkProbe::record_result(c, 512));
  EXPECT_TRUE(c.status.is_ok());

  c = chunk(false, true, 3 * 4096, 3 * 4096);  // O_DIRECT read stopped inside a block
  EXPECT_FALSE(ChunkProbe::record_result(c, 4096 + 10));
  EXPECT_NE(c.status.message().find("end of file"), std::string::npos) << c.status.message();

  c = chunk(false, true, 2 * 4096, 2 * 4096);  // O_DIRECT read continues at a block boundary
  EXPECT_TRUE(ChunkProbe::record_result(c, 4096));
  EXPECT_FALSE(ChunkProbe::record_result(c, -EIO));
  EXPECT_NE(c.status.message().find("read /spill/f.bin at offset 12288 (4096 bytes)"), std::string::npos)
      << c.status.message();
  EXPECT_NE(c.status.message().find(std::strerror(EIO)), std::string::npos);

  c = chunk(true, false, 4096, 4096);
  EXPECT_FALSE(ChunkProbe::record_result(c, -ENOSPC));
  EXPECT_EQ(c.status.code(), StatusCode::NoSpace);
}

// ---- FaultStorageEngine ----

class StorageFaultTest : public ::testing::TestWithParam<std::string> {
 protected:
  std::unique_ptr<FaultStorageEngine> make(FaultOptions faults) {
    auto e = make_storage_engine(GetParam(), {.queue_depth = 4});
    if (!e) return nullptr;
    return std::make_unique<FaultStorageEngine>(std::move(*e), std::move(faults));
  }
  TempDir dir_;
};

TEST_P(StorageFaultTest, NthWriteFailsAsAsked) {
  for (FaultKind kind : {FaultKind::WriteError, FaultKind::NoSpace, FaultKind::ShortWrite}) {
    auto engine = make({.seed = 1, .rules = {{kind, 0.0, 3}}});
    if (!engine) GTEST_SKIP() << "io_uring is not available here";
    std::string path = dir_.path() + "/nth.bin";
    auto f = engine->open(path, OpenMode::Create);
    ASSERT_TRUE(f.ok());
    AlignedBuffer data = random_buffer(5 * 8192, 2);
    for (int i = 1; i <= 5; ++i) {
      auto t = engine->submit_write(*f, (i - 1) * 8192, data.data() + (i - 1) * 8192, 8192);
      ASSERT_TRUE(t.ok());
      Status s = engine->wait(*t);
      if (i != 3) {
        EXPECT_TRUE(s.is_ok()) << fault_kind_name(kind) << " write " << i << ": " << s.to_string();
        continue;
      }
      ASSERT_FALSE(s.is_ok()) << fault_kind_name(kind);
      EXPECT_EQ(s.code(), kind == FaultKind::NoSpace ? StatusCode::NoSpace : StatusCode::IoError);
      EXPECT_NE(s.message().find(path), std::string::npos) << s.message();
      EXPECT_NE(s.message().find("offset 16384"), std::string::npos) << s.message();
      EXPECT_NE(s.message().find("injected fault"), std::string::npos) << s.message();
    }
    EXPECT_EQ(engine->faults_injected(kind), 1u);
  }
}

TEST_P(StorageFaultTest, ReadFaults) {
  auto engine = make({.seed = 5, .rules = {{FaultKind::ReadError, 0.0, 1}, {FaultKind::CorruptRead, 0.0, 2}}});
  if (!engine) GTEST_SKIP() << "io_uring is not available here";
  auto f = engine->open(dir_.path() + "/r.bin", OpenMode::Create);
  ASSERT_TRUE(f.ok());
  AlignedBuffer data = random_buffer(4096, 3);
  AlignedBuffer back = guarded_buffer(4096, 0);
  auto w = engine->submit_write(*f, 0, data.data(), 4096);
  ASSERT_TRUE(w.ok() && engine->wait(*w).is_ok());
  auto r1 = engine->submit_read(*f, 0, back.data(), 4096);
  ASSERT_TRUE(r1.ok());
  Status s = engine->wait(*r1);
  EXPECT_EQ(s.code(), StatusCode::IoError);
  EXPECT_NE(s.message().find(std::strerror(EIO)), std::string::npos);
  auto r2 = engine->submit_read(*f, 0, back.data(), 4096);
  ASSERT_TRUE(r2.ok());
  EXPECT_TRUE(engine->wait(*r2).is_ok());  // the lie: only a checksum catches it
  EXPECT_NE(std::memcmp(back.data(), data.data(), 4096), 0);
  auto r3 = engine->submit_read(*f, 0, back.data(), 4096);
  ASSERT_TRUE(r3.ok() && engine->wait(*r3).is_ok());
  EXPECT_EQ(std::memcmp(back.data(), data.data(), 4096), 0);
}

TEST_P(StorageFaultTest, TornWriteLandsOnlyAPrefix) {
  auto engine = make({.seed = 11, .rules = {{FaultKind::TornWrite, 1.0}}});
  if (!engine) GTEST_SKIP() << "io_uring is not available here";
  auto f = engine->open(dir_.path() + "/t.bin", OpenMode::Create);
  ASSERT_TRUE(f.ok());
  AlignedBuffer data = random_buffer(64 * 4096, 4);
  auto w = engine->submit_write(*f, 0, data.data(), data.size());
  ASSERT_TRUE(w.ok());
  EXPECT_TRUE(engine->wait(*w).is_ok());  // reported as success
  struct stat st;
  ASSERT_EQ(::stat((dir_.path() + "/t.bin").c_str(), &st), 0);
  EXPECT_LT(static_cast<size_t>(st.st_size), data.size());
}

TEST_P(StorageFaultTest, SameSeedSameFaults) {
  auto run = [&](uint64_t seed) {
    auto engine = make({.seed = seed, .rules = {{FaultKind::WriteError, 0.3}, {FaultKind::NoSpace, 0.2}}});
    std::string outcome;
    if (!engine) return outcome;
    auto f = engine->open(dir_.path() + "/s.bin", OpenMode::Create);
    AlignedBuffer data = random_buffer(4096, 1);
    for (int i = 0; i < 40; ++i) {
      auto t = engine->submit_write(*f, 0, data.data(), 4096);
      Status s = engine->wait(*t);
      outcome += s.is_ok() ? '.' : s.code() == StatusCode::NoSpace ? 'N' : 'E';
    }
    return outcome;
  };
  std::string a = run(42);
  if (a.empty()) GTEST_SKIP() << "io_uring is not available here";
  EXPECT_EQ(a, run(42));
  EXPECT_NE(a, run(43));
  EXPECT_NE(a.find('E'), std::string::npos);
  EXPECT_NE(a.find('N'), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Storage, StorageFaultTest, ::testing::Values("uring", "threads"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace spillway
