// The pieces of a machine profile (sim/profiler.h) on the CPU backend: they measure
// something positive, clean up after themselves, and refuse what they cannot measure
// with the reason and the thing named.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "backend/backend.h"
#include "core/thread_pool.h"
#include "sim/profiler.h"

namespace spillway {
namespace {

std::string temp_file(const std::string& name) {
  return ::testing::TempDir() + "/spillway-measure-" + std::to_string(::getpid()) + "-" + name;
}

TEST(Measure, CopiesStorageAndHostAdamArePositive) {
  ASSERT_TRUE(start_global_thread_pool(2).is_ok());
  auto backend = make_backend("cpu", {.threads = 2});
  ASSERT_TRUE(backend.ok()) << backend.status().to_string();
  auto copies = measure_copies(**backend, 1 << 20, 4 << 20, 2);
  ASSERT_TRUE(copies.ok()) << copies.status().to_string();
  EXPECT_GT(copies->h2d, 0);
  EXPECT_GT(copies->d2h, 0);
  EXPECT_GT(copies->both, 0);

  const std::string path = temp_file("storage.bin");
  auto storage = measure_storage("threads", 4, path, 4 << 20, 1 << 20);
  ASSERT_TRUE(storage.ok()) << storage.status().to_string();
  EXPECT_GT(storage->write, 0);
  EXPECT_GT(storage->read, 0);
  EXPECT_FALSE(std::filesystem::exists(path));  // removed afterwards
  auto latency = measure_storage_latency("threads", path, 8);
  ASSERT_TRUE(latency.ok()) << latency.status().to_string();
  EXPECT_GT(*latency, 0);
  EXPECT_FALSE(std::filesystem::exists(path));
  // Reads and writes at once: a factor of their speed alone, both files removed.
  auto duplex = measure_storage_duplex("threads", 4, path, 4 << 20, 1 << 20, *storage);
  ASSERT_TRUE(duplex.ok()) << duplex.status().to_string();
  EXPECT_GE(*duplex, 0.05);
  EXPECT_LE(*duplex, 1.0);
  EXPECT_FALSE(std::filesystem::exists(path + ".read"));
  EXPECT_FALSE(std::filesystem::exists(path + ".write"));

  auto alone = measure_host_adam(1 << 18, DType::F32, 2, nullptr);
  ASSERT_TRUE(alone.ok()) << alone.status().to_string();
  EXPECT_GT(*alone, 0);
  auto busy = measure_host_adam(1 << 18, DType::F32, 2, backend->get());
  ASSERT_TRUE(busy.ok()) << busy.status().to_string();
  EXPECT_GT(*busy, 0);
  auto share = measure_copy_share_beside_host_adam(**backend, 1 << 18, DType::F32, 1 << 20, 4 << 20);
  ASSERT_TRUE(share.ok()) << share.status().to_string();
  for (double v : {share->h2d, share->d2h, share->both}) {
    EXPECT_GT(v, 0);
    EXPECT_LE(v, 1.0);
  }
  auto nothing = measure_copy_share_beside_host_adam(**backend, 0, DType::F32, 1 << 20, 4 << 20);
  ASSERT_FALSE(nothing.ok());
  EXPECT_NE(nothing.status().to_string().find("no params"), std::string::npos) << nothing.status().to_string();

  auto flops = measure_matmul(**backend, 64, 64, 32, 2);
  ASSERT_TRUE(flops.ok()) << flops.status().to_string();
  EXPECT_GT(*flops, 0);
}

TEST(Measure, WhatCannotBeMeasuredIsNamed) {
  auto backend = make_backend("cpu", {.threads = 2});
  ASSERT_TRUE(backend.ok());
  auto copies = measure_copies(**backend, 8 << 20, 4 << 20, 1);
  ASSERT_FALSE(copies.ok());
  EXPECT_NE(copies.status().to_string().find("piece 8.00 MiB"), std::string::npos) << copies.status().to_string();
  auto block = measure_storage("threads", 1, temp_file("never.bin"), 1 << 20, 1000);
  ASSERT_FALSE(block.ok());
  EXPECT_NE(block.status().to_string().find("block"), std::string::npos) << block.status().to_string();
  auto missing = measure_storage("threads", 1, "/nonexistent/folder/probe.bin", 1 << 20, 1 << 20);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().to_string().find("/nonexistent/folder"), std::string::npos)
      << missing.status().to_string();
  auto no_rates = measure_storage_duplex("threads", 1, temp_file("never.bin"), 1 << 20, 1 << 20, StorageRates{});
  ASSERT_FALSE(no_rates.ok());
  EXPECT_NE(no_rates.status().to_string().find("rates alone"), std::string::npos) << no_rates.status().to_string();
  auto no_folder = measure_storage_duplex("threads", 1, "/nonexistent/folder/probe.bin", 1 << 20, 1 << 20,
                                          StorageRates{.write = 1e9, .read = 1e9});
  ASSERT_FALSE(no_folder.ok());
  EXPECT_NE(no_folder.status().to_string().find("/nonexistent/folder"), std::string::npos)
      << no_folder.status().to_string();
  auto engine = measure_storage("floppy", 1, temp_file("never.bin"), 1 << 20, 1 << 20);
  ASSERT_FALSE(engine.ok());
  EXPECT_NE(engine.status().to_string().find("floppy"), std::string::npos) << engine.status().to_string();
  auto dtype = measure_host_adam(16, DType::I32, 1, nullptr);
  ASSERT_FALSE(dtype.ok());
  EXPECT_NE(dtype.status().to_string().find("dtype"), std::string::npos) << dtype.status().to_string();
}

}  // namespace
}  // namespace spillway
