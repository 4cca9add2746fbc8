#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "core/checksum.h"
#include "core/input_file.h"
#include "core/size.h"
#include "core/thread_pool.h"
#include "tensor/tensor.h"

using namespace spillway;

TEST(Size, ParsesUnitsAndPlainCounts) {
  EXPECT_EQ(*parse_size("24GiB"), 24ull << 30);
  EXPECT_EQ(*parse_size("512MiB"), 512ull << 20);
  EXPECT_EQ(*parse_size("1.5GB"), 1500000000ull);
  EXPECT_EQ(*parse_size("4096"), 4096ull);
  EXPECT_EQ(*parse_size(" 2 kib "), 2048ull);
}

TEST(Size, RejectsGarbageWithClearMessage) {
  auto r = parse_size("12 parsecs", "--device-budget");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::InvalidArgument);
  EXPECT_NE(r.status().message().find("--device-budget"), std::string::npos);
  EXPECT_NE(r.status().message().find("12 parsecs"), std::string::npos);
  EXPECT_FALSE(parse_size("").ok());
  EXPECT_FALSE(parse_size("GiB").ok());
  EXPECT_FALSE(parse_size("1.2.3").ok());
  EXPECT_FALSE(parse_size("-5").ok());
}

TEST(Size, OverflowIsAnErrorNamingTheTextAndTheLimit) {
  for (const char* text : {"10000000000GB", "9223372036854775808", "18446744073709551615", "8388608TiB",
                           "99999999999999999999999", "20000000000000000000 B", "9.3e18"}) {
    auto r = parse_size(text, "--host-budget");
    ASSERT_FALSE(r.ok()) << text << " gave " << *r;
    EXPECT_EQ(r.status().code(), StatusCode::InvalidArgument);
    EXPECT_NE(r.status().message().find("--host-budget"), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find(text), std::string::npos) << r.status().message();
  }
  auto r = parse_size("10000000000GB");
  EXPECT_NE(r.status().message().find("9223372036854775807"), std::string::npos) << r.status().message();
  EXPECT_EQ(*parse_size("9223372036854775807"), kMaxSize);
  EXPECT_EQ(*parse_size("8388607TiB"), 8388607ull << 40);
  EXPECT_EQ(*parse_size("00000000000000000000000001KiB"), 1024u);  // leading zeros are not digits of size
}

TEST(Size, FractionsAreExact) {
  EXPECT_EQ(*parse_size("1.5GB"), 1500000000ull);
  EXPECT_EQ(*parse_size("0.5KiB"), 512ull);
  EXPECT_EQ(*parse_size("0.3MiB"), 314573ull);  // 314572.8 rounds to the nearest byte
  EXPECT_EQ(*parse_size("1.1TB"), 1100000000000ull);
  EXPECT_EQ(*parse_size("2.000000000000000000000000GiB"), 2ull << 30);  // trailing zeros
  EXPECT_EQ(*parse_size("0.000000000001TB"), 1ull);
  EXPECT_EQ(*parse_size(".25k"), 250ull);
  EXPECT_EQ(*parse_size("1.5"), 2ull);
  EXPECT_EQ(*parse_size("7999999999.999999999GB"), 7999999999999999999ull);
  EXPECT_FALSE(parse_size("1.0000000000000000001GB").ok());  // finer than the parser counts
  EXPECT_FALSE(parse_size(".").ok());
}

TEST(Size, BudgetOfZeroIsRejected) {
  auto r = parse_budget("0", "--host-budget");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("0 bytes"), std::string::npos);
  EXPECT_TRUE(parse_budget("1MiB", "--host-budget").ok());
}

TEST(ThreadPool, CoversRangeOnceWithFixedChunks) {
  ThreadPool pool(3);
  std::vector<std::atomic<int>> hits(1000);
  pool.parallel_for(1000, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) hits[i]++;
  });
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
}

// A thread held up in one tile (as one the scheduler takes off its core) holds up
// that tile only: the others take every remaining tile. With parallel_for's fixed
// chunks the held thread would own a quarter of them, and the wait below would end
// at its deadline with those tiles undone.
TEST(ThreadPool, TilesGoToTheThreadsThatAreFree) {
  ThreadPool pool(4);
  ASSERT_TRUE(pool.status().is_ok());
  constexpr int64_t kTiles = 400;
  std::vector<std::atomic<int>> hits(kTiles);
  std::atomic<int64_t> done{0};
  std::atomic<bool> waited_out{false};
  std::thread::id held;
  std::mutex mu;
  std::map<std::thread::id, int> tiles_of;
  pool.parallel_tiles(kTiles, [&](int64_t b, int64_t e) {
    ASSERT_EQ(e, b + 1);
    {
      std::lock_guard<std::mutex> lock(mu);
      tiles_of[std::this_thread::get_id()]++;
    }
    if (b == 0) {
      held = std::this_thread::get_id();
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (done.load() < kTiles - 1 && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      waited_out = done.load() < kTiles - 1;
    }
    hits[b]++;
    done++;
  });
  EXPECT_FALSE(waited_out.load()) << "the other threads did not take the held thread's tiles";
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
  EXPECT_EQ(tiles_of[held], 1);
  // On the calling thread alone (no workers) every tile still runs once, in order.
  ThreadPool alone(1);
  std::vector<int64_t> order;
  alone.parallel_tiles(5, [&](int64_t b, int64_t) { order.push_back(b); });
  EXPECT_EQ(order, (std::vector<int64_t>{0, 1, 2, 3, 4}));
  pool.parallel_tiles(0, [&](int64_t, int64_t) { ADD_FAILURE() << "no tiles, no calls"; });
}

// parallel_memcpy copies every byte exactly once, tiled or not: sizes below the tiled
// threshold, at it, and odd sizes past it whose last tile is short; on a pool of four
// threads and on a pool of the calling thread alone. Bytes around the destination stay.
TEST(ThreadPool, ParallelMemcpyCopiesEveryByteOnce) {
  ThreadPool four(4), alone(1);
  const size_t mib = size_t{1} << 20;
  for (ThreadPool* pool : {&four, &alone})
    for (size_t bytes : {size_t{0}, size_t{1}, 16 * mib - 1, 16 * mib, 16 * mib + 1, 37 * mib + 4093}) {
      std::vector<unsigned char> src(bytes), dst(bytes + 2, 0xAB);
      for (size_t i = 0; i < bytes; ++i) src[i] = static_cast<unsigned char>((i * 2654435761u) >> 13);
      parallel_memcpy(*pool, dst.data() + 1, src.data(), bytes);
      EXPECT_EQ(dst.front(), 0xAB) << bytes;
      EXPECT_EQ(dst.back(), 0xAB) << bytes;
      EXPECT_TRUE(std::equal(src.begin(), src.end(), dst.begin() + 1)) << bytes << " bytes, pool of " << pool->size();
    }
}

TEST(ThreadPool, ParallelZeroClearsEveryByteAndNoMore) {
  ThreadPool four(4), alone(1);
  const size_t mib = size_t{1} << 20;
  for (ThreadPool* pool : {&four, &alone})
    for (size_t bytes : {size_t{0}, size_t{1}, 16 * mib - 1, 16 * mib, 37 * mib + 4093}) {
      std::vector<unsigned char> buf(bytes + 2, 0xAB);
      parallel_zero(*pool, buf.data() + 1, bytes);
      EXPECT_EQ(buf.front(), 0xAB) << bytes;
      EXPECT_EQ(buf.back(), 0xAB) << bytes;
      EXPECT_TRUE(std::all_of(buf.begin() + 1, buf.end() - 1, [](unsigned char c) { return c == 0; }))
          << bytes << " bytes, pool of " << pool->size();
    }
}

// On a GPU backend the host compute leaves one core to the thread that issues GPU
// work; a --threads value is kept as given.
TEST(ThreadPool, HostComputeLeavesACoreBesideGpuIssue) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  EXPECT_EQ(host_compute_threads(0, false), cores);
  EXPECT_EQ(host_compute_threads(0, true), std::max(1, cores - 1));
  EXPECT_EQ(host_compute_threads(7, true), 7);
  EXPECT_EQ(host_compute_threads(3, false), 3);
}

TEST(ThreadPool, RefusesMoreThanFourTimesTheHardwareThreads) {
  const int cap = max_thread_count();
  EXPECT_EQ(cap, 4 * static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  EXPECT_TRUE(check_thread_count(cap, "--threads").is_ok());
  EXPECT_TRUE(check_thread_count(0, "--threads").is_ok());
  Status s = check_thread_count(100000, "--threads");
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("--threads 100000"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(std::to_string(cap)), std::string::npos) << s.message();
  EXPECT_FALSE(check_thread_count(-1, "--threads").is_ok());

  auto made = ThreadPool::create(cap + 1);
  ASSERT_FALSE(made.ok());
  EXPECT_NE(made.status().message().find(std::to_string(cap)), std::string::npos) << made.status().message();
  // Constructed directly, the pool says why and still runs loops on the calling thread.
  ThreadPool pool(100000);
  EXPECT_FALSE(pool.status().is_ok());
  EXPECT_EQ(pool.size(), 1);
  std::vector<int> hits(100);
  pool.parallel_for(100, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) hits[i]++;
  });
  for (int h : hits) EXPECT_EQ(h, 1);
}

TEST(ThreadPool, AThreadThatFailsToStartIsAnErrorNotAnAbort) {
  int started = 0;
  ThreadStarter third_fails = [&](std::function<void()> body) -> std::thread {
    if (++started == 3) throw std::system_error(EAGAIN, std::generic_category(), "pthread_create");
    return std::thread(std::move(body));
  };
  auto made = ThreadPool::create(5, third_fails);
  ASSERT_FALSE(made.ok());
  EXPECT_EQ(made.status().code(), StatusCode::OutOfMemory);
  EXPECT_NE(made.status().message().find("starting thread 4 of 5 failed"), std::string::npos) << made.status().message();
  EXPECT_NE(made.status().message().find("fewer threads"), std::string::npos) << made.status().message();
  EXPECT_EQ(started, 3);  // the two that started were stopped and joined

  started = 0;
  ThreadPool pool(5, third_fails);
  EXPECT_FALSE(pool.status().is_ok());
  EXPECT_EQ(pool.size(), 1);
  std::atomic<int> sum{0};
  pool.parallel_for(10, [&](int64_t b, int64_t e) { sum += static_cast<int>(e - b); });
  EXPECT_EQ(sum.load(), 10);

  auto fine = ThreadPool::create(3);
  ASSERT_TRUE(fine.ok()) << fine.status().to_string();
  EXPECT_EQ((*fine)->size(), 3);
}

TEST(Checksum, DetectsOneFlippedBit) {
  std::vector<uint8_t> a(4097, 7);
  uint64_t c = checksum64(a.data(), a.size());
  a[4000] ^= 1;
  EXPECT_NE(c, checksum64(a.data(), a.size()));
}

TEST(TensorTable, KeepsInfoAndFindsByName) {
  TensorTable t;
  TensorId w = t.add({"w", DType::F32, {4, 8}, Role::Param});
  TensorId g = t.add({"g", DType::BF16, {4, 8}, Role::Grad});
  EXPECT_EQ(t.info(w).bytes(), 128u);
  EXPECT_EQ(t.info(g).bytes(), 64u);
  EXPECT_EQ(t.find("g"), g);
  EXPECT_EQ(t.find("missing"), kNoTensor);
  EXPECT_EQ(t.total_bytes(), 192u);
  EXPECT_EQ(t.bytes_with_role(Role::Grad), 64u);
}

// A named pipe, a directory or a missing path given as an input file is an error that
// names it, at once: the open does not wait for a writer. A regular file opens, and its
// descriptor reads.
TEST(InputFile, RefusesPipesAndDirectoriesByNameWithoutWaiting) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("spillway_input_file_" + std::to_string(::getpid()))).string();
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string fifo = dir + "/pipe", file = dir + "/plain";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  { std::ofstream(file) << "abc"; }
  auto pipe = open_regular_file(fifo, "weights file");
  ASSERT_FALSE(pipe.ok());
  EXPECT_EQ(pipe.status().code(), StatusCode::InvalidArgument);
  EXPECT_NE(pipe.status().message().find("weights file " + fifo + " is a named pipe (FIFO)"), std::string::npos)
      << pipe.status().to_string();
  Status checked = check_regular_file(fifo, "machine file");
  EXPECT_NE(checked.message().find("machine file " + fifo + " is a named pipe"), std::string::npos) << checked.to_string();
  EXPECT_NE(open_regular_file(dir, "tokenizer").status().message().find("is a directory"), std::string::npos);
  EXPECT_EQ(open_regular_file(dir + "/none", "x").status().code(), StatusCode::NotFound);
  EXPECT_EQ(check_regular_file(dir + "/none", "x").code(), StatusCode::NotFound);
  EXPECT_TRUE(check_regular_file(file, "x").is_ok());
  auto fd = open_regular_file(file, "x");
  ASSERT_TRUE(fd.ok()) << fd.status().to_string();
  char buf[4] = {};
  EXPECT_EQ(::read(*fd, buf, sizeof buf), 3);
  EXPECT_EQ(std::string(buf, 3), "abc");
  ::close(*fd);
  std::filesystem::remove_all(dir);
}
