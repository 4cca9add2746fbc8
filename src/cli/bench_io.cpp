// `spillway bench io`: storage write/read bandwidth per engine and queue depth
// (O_DIRECT, the file removed afterwards), then device ⇄ host copy bandwidth
// through a backend's copy engine (sim/profiler.h measures both; `spillway profile`
// uses the same functions).
//
//   spillway bench io --dir /nvme/spill --size 4GiB --engines uring,threads
//                     --depths 1,4,16,64 --block 1MiB --backend cuda
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "cli/command.h"
#include "core/interrupt.h"
#include "core/size.h"
#include "io/storage_engine.h"
#include "sim/profiler.h"

namespace spillway::cli {
namespace {

struct BenchIoOptions {
  std::string dir;
  std::string size = "4GiB";
  std::string engines = "uring,threads";
  std::string depths = "1,4,16,64";
  std::string block = "1MiB";
  std::string backend = "cpu";
  std::string copy_size = "1GiB";
};

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> items;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ','))
    if (!item.empty()) items.push_back(item);
  return items;
}

int run_bench_io(const BenchIoOptions& o) {
  auto total = parse_size(o.size, "--size");
  if (!total) return fail(total.status());
  auto block = parse_size(o.block, "--block");
  if (!block) return fail(block.status());
  auto copy_total = parse_size(o.copy_size, "--copy-size");
  if (!copy_total) return fail(copy_total.status());
  if (*block < kStorageAlignment || *block % kStorageAlignment != 0 || *block > (1ull << 30))
    return fail(Status::invalid_argument("--block " + o.block + ": expected a multiple of 4 KiB, at most 1 GiB"));
  if (*total < *block)
    return fail(Status::invalid_argument("--size " + o.size + " is smaller than one block (" + o.block + ")"));
  uint64_t bytes = *total / *block * *block;
  std::vector<int> depths;
  for (const std::string& d : split_list(o.depths)) {
    int v = 0;
    try {
      v = std::stoi(d);
    } catch (const std::exception&) {
      v = 0;
    }
    if (v < 1 || v > 1024) return fail(Status::invalid_argument("--depths: '" + d + "' is not a depth from 1 to 1024"));
    depths.push_back(v);
  }
  std::vector<std::string> engines = split_list(o.engines);
  if (engines.empty() || depths.empty())
    return fail(Status::invalid_argument("--engines and --depths need at least one value each"));

  std::string path = o.dir + "/spillway-bench-" + std::to_string(::getpid()) + ".bin";
  // SIGINT/SIGTERM: nothing to finish; remove the test file and stop at once.
  Status handlers = install_interrupt_handlers(InterruptMode::AtOnce);
  if (!handlers.is_ok()) return fail(handlers);
  RemoveOnInterrupt remove_on_interrupt(path);
  std::printf("storage: %s, %s per run, %s blocks\n", o.dir.c_str(), format_size(bytes).c_str(),
              format_size(*block).c_str());
  std::printf("%-8s %6s %11s %11s\n", "engine", "depth", "write GB/s", "read GB/s");
  for (const std::string& kind : engines) {
    for (int depth : depths) {
      auto f = measure_storage(kind, depth, path, bytes, *block);
      if (!f) return fail(f.status().with_context("bench io, " + kind + " engine, depth " + std::to_string(depth)));
      std::printf("%-8s %6d %11.2f %11.2f%s\n", kind.c_str(), depth, f->write / 1e9, f->read / 1e9,
                  f->direct ? "" : "  (buffered: the file system refused O_DIRECT)");
      std::fflush(stdout);
    }
  }

  if (*copy_total == 0) return 0;  // --copy-size 0: storage only
  auto backend = make_backend(o.backend);
  if (!backend) return fail(backend.status().with_context("bench io, copy engine"));
  auto c = measure_copies(**backend, std::min<uint64_t>(*copy_total, 64ull << 20), *copy_total, 3);
  if (!c) return fail(c.status().with_context("bench io, copy engine on " + (*backend)->description()));
  std::printf("\ncopy engine: %s backend (%s), %s per direction\n", (*backend)->name().c_str(),
              (*backend)->description().c_str(), format_size(*copy_total).c_str());
  std::printf("%10s %10s %10s\n", "H2D GB/s", "D2H GB/s", "both GB/s");
  std::printf("%10.2f %10.2f %10.2f\n", c->h2d / 1e9, c->d2h / 1e9, c->both / 1e9);
  return 0;
}

CommandRegistration bench_io_command(
    "bench io", "storage (O_DIRECT) and device-host copy bandwidth", [](CLI::App& app) {
      auto o = std::make_shared<BenchIoOptions>();
      app.add_option("--dir", o->dir, "directory for the test file (removed afterwards)")->required();
      app.add_option("--size", o->size, "bytes written then read per engine and depth")->capture_default_str();
      app.add_option("--engines", o->engines, "storage engines: uring, threads (comma-separated)")
          ->capture_default_str();
      app.add_option("--depths", o->depths, "queue depths (comma-separated)")->capture_default_str();
      app.add_option("--block", o->block, "bytes per request")->capture_default_str();
      app.add_option("--backend", o->backend, "backend whose copy engine is measured: cpu or cuda")
          ->capture_default_str();
      app.add_option("--copy-size", o->copy_size, "bytes per copy direction (0: skip the copy part)")
          ->capture_default_str();
      return [o]() { return run_bench_io(*o); };
    });

}  // namespace
}  // namespace spillway::cli
