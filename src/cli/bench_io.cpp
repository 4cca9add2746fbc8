// `spillway bench io`: storage write/read bandwidth per engine and queue depth
// (O_DIRECT, the file removed afterwards), then device ⇄ host copy bandwidth
// through a backend's copy engine.
//
//   spillway bench io --dir /nvme/spill --size 4GiB --engines uring,threads
//                     --depths 1,4,16,64 --block 1MiB --backend cuda
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "cli/command.h"
#include "core/interrupt.h"
#include "core/size.h"
#include "io/storage_engine.h"

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

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double gbps(uint64_t bytes, double seconds) { return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0; }

struct StorageFigures {
  double write_gbps = 0, read_gbps = 0;
  bool direct = true;
};

// Moves `total` bytes in `block`-sized requests, keeping `depth` of them in flight:
// when all slots are busy it waits for the oldest.
Status stream(StorageEngine& engine, StorageFile file, bool write, uint64_t total, size_t block, int depth,
              AlignedBuffer& buffer, double* seconds) {
  std::vector<StorageTicket> slots(static_cast<size_t>(depth));
  uint64_t blocks = total / block;
  auto t0 = std::chrono::steady_clock::now();
  for (uint64_t i = 0; i < blocks; ++i) {
    size_t slot = i % static_cast<size_t>(depth);
    SPILLWAY_RETURN_IF_ERROR(engine.wait(slots[slot]));
    char* buf = buffer.data() + slot * block;
    auto t = write ? engine.submit_write(file, i * block, buf, block) : engine.submit_read(file, i * block, buf, block);
    if (!t) return t.status();
    slots[slot] = *t;
  }
  SPILLWAY_RETURN_IF_ERROR(engine.wait_all());
  *seconds = seconds_since(t0);
  return Status::ok();
}

Result<StorageFigures> bench_storage(const std::string& kind, int depth, const std::string& path, uint64_t total,
                                     size_t block, AlignedBuffer& buffer) {
  auto made = make_storage_engine(kind, {.queue_depth = depth, .chunk_bytes = block});
  if (!made) return made.status();
  StorageEngine& engine = **made;
  auto file = engine.open(path, OpenMode::Create);
  if (!file) return file.status();
  StorageFigures f;
  f.direct = engine.is_direct(*file);
  // Reserve the file's blocks first, as the StorageStore does for its extents.
  Status s = engine.reserve(*file, 0, total);
  double secs = 0;
  if (s.is_ok()) s = stream(engine, *file, true, total, block, depth, buffer, &secs);
  f.write_gbps = gbps(total, secs);
  if (s.is_ok()) s = stream(engine, *file, false, total, block, depth, buffer, &secs);
  f.read_gbps = gbps(total, secs);
  Status c = engine.close(*file);
  if (::unlink(path.c_str()) != 0 && s.is_ok()) s = errno_status("remove " + path, errno);
  if (!s.is_ok()) return s;
  if (!c.is_ok()) return c;
  return f;
}

struct CopyFigures {
  double h2d = 0, d2h = 0, both = 0;
};

// Copies `total` bytes in pieces; the best of three rounds per direction.
Result<CopyFigures> bench_copy(Backend& backend, uint64_t total) {
  const size_t piece = static_cast<size_t>(std::min<uint64_t>(total, 64ull << 20));
  total = total / piece * piece;
  CopyEngine& ce = backend.copy_engine();
  struct Buffers {
    Backend& b;
    void* host_src = nullptr;
    void* host_dst = nullptr;
    void* dev_a = nullptr;
    void* dev_b = nullptr;
    ~Buffers() {
      if (host_src) b.host_free(host_src);
      if (host_dst) b.host_free(host_dst);
      if (dev_a) b.device_free(dev_a);
      if (dev_b) b.device_free(dev_b);
    }
  } buf{backend};
  for (void** p : {&buf.host_src, &buf.host_dst}) {
    auto r = backend.host_alloc(total);
    if (!r) return r.status();
    *p = *r;
    std::memset(*p, 0x5a, total);  // touch every page before timing
  }
  for (void** p : {&buf.dev_a, &buf.dev_b}) {
    auto r = backend.device_alloc(total);
    if (!r) return r.status();
    *p = *r;
  }
  SPILLWAY_RETURN_IF_ERROR(backend.upload(buf.dev_b, buf.host_src, total));
  auto run = [&](bool h2d, bool d2h, double* best) -> Status {
    for (int round = 0; round < 3; ++round) {
      auto t0 = std::chrono::steady_clock::now();
      for (uint64_t at = 0; at < total; at += piece) {
        if (h2d) {
          auto t = ce.copy(CopyDirection::HostToDevice, static_cast<char*>(buf.dev_a) + at,
                           static_cast<char*>(buf.host_src) + at, piece);
          if (!t) return t.status();
        }
        if (d2h) {
          auto t = ce.copy(CopyDirection::DeviceToHost, static_cast<char*>(buf.host_dst) + at,
                           static_cast<char*>(buf.dev_b) + at, piece);
          if (!t) return t.status();
        }
      }
      SPILLWAY_RETURN_IF_ERROR(ce.wait_all());
      double rate = gbps(total * ((h2d ? 1 : 0) + (d2h ? 1 : 0)), seconds_since(t0));
      if (rate > *best) *best = rate;
    }
    return Status::ok();
  };
  CopyFigures f;
  SPILLWAY_RETURN_IF_ERROR(run(true, false, &f.h2d));
  SPILLWAY_RETURN_IF_ERROR(run(false, true, &f.d2h));
  SPILLWAY_RETURN_IF_ERROR(run(true, true, &f.both));
  return f;
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

  int max_depth = 1;
  for (int d : depths) max_depth = std::max(max_depth, d);
  auto buffer = AlignedBuffer::allocate(static_cast<size_t>(max_depth) * *block);
  if (!buffer) return fail(buffer.status());
  std::mt19937_64 rng(1);
  for (size_t i = 0; i < buffer->size(); i += 8) {
    uint64_t v = rng();
    std::memcpy(buffer->data() + i, &v, std::min<size_t>(8, buffer->size() - i));
  }

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
      auto f = bench_storage(kind, depth, path, bytes, *block, *buffer);
      if (!f) return fail(f.status().with_context("bench io, " + kind + " engine, depth " + std::to_string(depth)));
      std::printf("%-8s %6d %11.2f %11.2f%s\n", kind.c_str(), depth, f->write_gbps, f->read_gbps,
                  f->direct ? "" : "  (buffered: the file system refused O_DIRECT)");
      std::fflush(stdout);
    }
  }

  if (*copy_total == 0) return 0;  // --copy-size 0: storage only
  auto backend = make_backend(o.backend);
  if (!backend) return fail(backend.status().with_context("bench io, copy engine"));
  auto c = bench_copy(**backend, *copy_total);
  if (!c) return fail(c.status().with_context("bench io, copy engine on " + (*backend)->description()));
  std::printf("\ncopy engine: %s backend (%s), %s per direction\n", (*backend)->name().c_str(),
              (*backend)->description().c_str(), format_size(*copy_total).c_str());
  std::printf("%10s %10s %10s\n", "H2D GB/s", "D2H GB/s", "both GB/s");
  std::printf("%10.2f %10.2f %10.2f\n", c->h2d, c->d2h, c->both);
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
