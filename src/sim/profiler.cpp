#include "sim/profiler.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <cerrno>
#include <cstdlib>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>
#include <string>
#include <utility>

#include "backend/scratch.h"
#include "core/size.h"
#include "core/thread_pool.h"
#include "io/storage_engine.h"
#include "optim/adamw.h"

namespace spillway {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

Result<Machine> measure_machine(Backend& backend, Machine m) {
  const bool gpu = backend.name() == "cuda";
  const size_t act = dtype_size(backend.activation_dtype());
  constexpr int kRepeats = 3;
  (void)act;

  // ---- copy engine: each direction alone, then both at once ----
  {
    constexpr uint64_t kCopyBytes = uint64_t{64} << 20;
    SPILLWAY_ASSIGN_OR_RETURN(CopyRates c, measure_copies(backend, kCopyBytes, kCopyBytes, kRepeats));
    if (c.h2d > 0 && c.d2h > 0 && c.both > 0) {
      m.h2d_bytes_per_s = c.h2d;
      m.d2h_bytes_per_s = c.d2h;
      m.duplex_factor = std::clamp(c.both / (c.h2d + c.d2h), 0.05, 1.0);
    }
  }

  // ---- device matrix products and memory-bound ops ----
  {
    const int S = gpu ? 8192 : 512;
    SPILLWAY_ASSIGN_OR_RETURN(m.matmul_flops_per_s, measure_matmul(backend, S, S, S, kRepeats));
    SPILLWAY_ASSIGN_OR_RETURN(m.attention_flops_per_s,
                              gpu ? measure_attention(backend, 8, 1024, 16, 64, kRepeats)
                                  : measure_attention(backend, 2, 128, 4, 32, kRepeats));
    SPILLWAY_ASSIGN_OR_RETURN(SharedSpeeds shared, measure_shared_speeds(backend, S, kRepeats, m.h2d_bytes_per_s));
    m.compute_share_while_copying = shared.compute_while_copying;
    m.copy_share_while_computing = shared.copy_while_computing;
    const size_t n = gpu ? (size_t{128} << 20) : (size_t{4} << 20);
    SPILLWAY_ASSIGN_OR_RETURN(m.device_bytes_per_s, measure_memory_bound(backend, n, kRepeats));
    SPILLWAY_ASSIGN_OR_RETURN(m.op_launch_s, measure_op_launch(backend, 200));
  }

  // ---- host AdamW, and beside device compute ----
  {
    const size_t n = gpu ? (size_t{32} << 20) : (size_t{4} << 20);
    SPILLWAY_ASSIGN_OR_RETURN(m.host_adam_params_per_s,
                              measure_host_adam(n, backend.activation_dtype(), kRepeats, nullptr));
    SPILLWAY_ASSIGN_OR_RETURN(const double into, measure_host_adam(n, backend.activation_dtype(), kRepeats, nullptr,
                                                                   /*out_of_place=*/true));
    m.host_adam_out_of_place_share = std::clamp(into / m.host_adam_params_per_s, 0.05, 1.0);
    SPILLWAY_ASSIGN_OR_RETURN(HostComputeShares side, measure_compute_beside_host_adam(backend, n, backend.activation_dtype(),
                                                                                     gpu ? 8192 : 512, kRepeats));
    m.compute_share_while_host_computes = side.compute_while_host;
    m.host_share_while_computing = side.host_while_computing;
  }

  const size_t capacity = backend.device_capacity();
  if (capacity != SIZE_MAX) m.device_bytes = capacity;
  m.host_runs_ahead = gpu;
  m.name = backend.description();
  m.measured_op_seconds.clear();
  return m;
}

// ---- pieces of a profile ----

Result<CopyRates> measure_copies(Backend& backend, uint64_t piece, uint64_t total, int rounds) {
  if (piece == 0 || total < piece)
    return Status::invalid_argument("measure copies: piece " + format_size(piece) + " must be above 0 and at most " +
                                    "the total " + format_size(total));
  total = total / piece * piece;
  rounds = std::max(1, rounds);
  ScratchBuffers buffers(backend);
  SPILLWAY_ASSIGN_OR_RETURN(void* host_src, buffers.host(total));
  SPILLWAY_ASSIGN_OR_RETURN(void* host_dst, buffers.host(total));
  SPILLWAY_ASSIGN_OR_RETURN(void* dev_a, buffers.device(total));
  SPILLWAY_ASSIGN_OR_RETURN(void* dev_b, buffers.device(total));
  std::memset(host_src, 0x5a, total);  // touch every page before timing
  SPILLWAY_RETURN_IF_ERROR(backend.synchronize());
  CopyEngine& ce = backend.copy_engine();
  auto run = [&](bool h2d, bool d2h, double* best) -> Status {
    for (int round = 0; round < rounds + 1; ++round) {  // round 0 warms up
      const double t0 = now_s();
      for (uint64_t at = 0; at < total; at += piece) {
        if (h2d) {
          auto t = ce.copy(CopyDirection::HostToDevice, static_cast<char*>(dev_a) + at,
                           static_cast<char*>(host_src) + at, piece);
          if (!t) return t.status().with_context("host→device copy");
        }
        if (d2h) {
          auto t = ce.copy(CopyDirection::DeviceToHost, static_cast<char*>(host_dst) + at,
                           static_cast<char*>(dev_b) + at, piece);
          if (!t) return t.status().with_context("device→host copy");
        }
      }
      SPILLWAY_RETURN_IF_ERROR(ce.wait_all());
      const double s = now_s() - t0;
      const double rate = s > 0 ? static_cast<double>(total) * ((h2d ? 1 : 0) + (d2h ? 1 : 0)) / s : 0;
      if (round > 0 && rate > *best) *best = rate;
    }
    return Status::ok();
  };
  CopyRates r;
  SPILLWAY_RETURN_IF_ERROR(run(true, false, &r.h2d));
  SPILLWAY_RETURN_IF_ERROR(run(false, true, &r.d2h));
  SPILLWAY_RETURN_IF_ERROR(run(true, true, &r.both));
  if (!(r.h2d > 0 && r.d2h > 0 && r.both > 0))
    return Status::internal("measure copies: a copy of " + format_size(total) + " took no measurable time");
  return r;
}

namespace {

// Moves `total` bytes in `block`-sized requests, keeping `depth` of them in flight:
// when all slots are busy it waits for the oldest.
Status stream_storage(StorageEngine& engine, StorageFile file, bool write, uint64_t total, size_t block, int depth,
                      AlignedBuffer& buffer, double* seconds) {
  std::vector<StorageTicket> slots(static_cast<size_t>(depth));
  const uint64_t blocks = total / block;
  const double t0 = now_s();
  for (uint64_t i = 0; i < blocks; ++i) {
    const size_t slot = i % static_cast<size_t>(depth);
    SPILLWAY_RETURN_IF_ERROR(engine.wait(slots[slot]));
    char* buf = buffer.data() + slot * block;
    auto t = write ? engine.submit_write(file, i * block, buf, block) : engine.submit_read(file, i * block, buf, block);
    if (!t) return t.status();
    slots[slot] = *t;
  }
  SPILLWAY_RETURN_IF_ERROR(engine.wait_all());
  *seconds = now_s() - t0;
  return Status::ok();
}

Result<AlignedBuffer> random_buffer(size_t bytes) {
  SPILLWAY_ASSIGN_OR_RETURN(AlignedBuffer buffer, AlignedBuffer::allocate(bytes));
  uint64_t z = 0x9e3779b97f4a7c15ull;
  for (size_t i = 0; i < buffer.size(); i += 8) {
    z ^= z << 13;
    z ^= z >> 7;
    z ^= z << 17;
    std::memcpy(buffer.data() + i, &z, std::min<size_t>(8, buffer.size() - i));
  }
  return buffer;
}

// Writes then reads `path` (removed afterwards, also on an error).
Result<StorageRates> storage_pass(const std::string& kind, int depth, const std::string& path, uint64_t total,
                                  size_t block, double* read_seconds) {
  if (block < kStorageAlignment || block % kStorageAlignment != 0 || total < block || depth < 1 || depth > 1024)
    return Status::invalid_argument("measure storage: block " + format_size(block) + " must be a multiple of " +
                                    format_size(kStorageAlignment) + " and at most the total " + format_size(total) +
                                    ", depth " + std::to_string(depth) + " from 1 to 1024");
  total = total / block * block;
  SPILLWAY_ASSIGN_OR_RETURN(AlignedBuffer buffer, random_buffer(static_cast<size_t>(depth) * block));
  auto made = make_storage_engine(kind, {.queue_depth = depth, .chunk_bytes = block});
  if (!made) return made.status();
  StorageEngine& engine = **made;
  auto file = engine.open(path, OpenMode::Create);
  if (!file) return file.status();
  StorageRates r;
  r.direct = engine.is_direct(*file);
  Status s = engine.reserve(*file, 0, total);
  double write_s = 0, read_s = 0;
  if (s.is_ok()) s = stream_storage(engine, *file, true, total, block, depth, buffer, &write_s);
  if (s.is_ok()) s = stream_storage(engine, *file, false, total, block, depth, buffer, &read_s);
  Status c = engine.close(*file);
  if (::unlink(path.c_str()) != 0 && s.is_ok()) s = errno_status("remove " + path, errno);
  if (!s.is_ok()) return s.with_context("storage at " + path);
  if (!c.is_ok()) return c.with_context("storage at " + path);
  if (!(write_s > 0 && read_s > 0))
    return Status::internal("measure storage: " + format_size(total) + " at " + path + " took no measurable time");
  r.write = static_cast<double>(total) / write_s;
  r.read = static_cast<double>(total) / read_s;
  if (read_seconds) *read_seconds = read_s;
  return r;
}

// Reads of one file and writes of another through one engine, `depth` requests in
// flight, interleaved so that each kind has done the same share of its bytes.
Status stream_storage_mixed(StorageEngine& engine, StorageFile in, uint64_t read_blocks, StorageFile out,
                            uint64_t write_blocks, size_t block, int depth, AlignedBuffer& buffer, double* seconds) {
  std::vector<StorageTicket> slots(static_cast<size_t>(depth));
  uint64_t reads = 0, writes = 0;
  const double t0 = now_s();
  for (uint64_t i = 0; reads < read_blocks || writes < write_blocks; ++i) {
    const size_t slot = i % static_cast<size_t>(depth);
    SPILLWAY_RETURN_IF_ERROR(engine.wait(slots[slot]));
    char* buf = buffer.data() + slot * block;
    // The kind further behind goes next (reads * write_blocks < writes * read_blocks).
    const bool read = writes == write_blocks || (reads < read_blocks && reads * write_blocks <= writes * read_blocks);
    auto t = read ? engine.submit_read(in, reads++ * block, buf, block)
                  : engine.submit_write(out, writes++ * block, buf, block);
    if (!t) return t.status();
    slots[slot] = *t;
  }
  SPILLWAY_RETURN_IF_ERROR(engine.wait_all());
  *seconds = now_s() - t0;
  return Status::ok();
}

}  // namespace

Result<StorageRates> measure_storage(const std::string& kind, int depth, const std::string& path, uint64_t total,
                                     size_t block) {
  return storage_pass(kind, depth, path, total, block, nullptr);
}

Result<double> measure_storage_duplex(const std::string& kind, int depth, const std::string& path, uint64_t total,
                                      size_t block, const StorageRates& alone) {
  if (block < kStorageAlignment || block % kStorageAlignment != 0 || total < block || depth < 1 || depth > 1024)
    return Status::invalid_argument("measure storage reads and writes at once: block " + format_size(block) +
                                    " must be a multiple of " + format_size(kStorageAlignment) +
                                    " and at most the total " + format_size(total) + ", depth " +
                                    std::to_string(depth) + " from 1 to 1024");
  if (!(alone.read > 0 && alone.write > 0))
    return Status::invalid_argument("measure storage reads and writes at once: the rates alone are not known");
  // Bytes of each kind that take the same time alone: both end together when the
  // drive serves them alike, and the factor is that time over the time both took.
  const double faster = std::max(alone.read, alone.write);
  const uint64_t blocks = total / block;
  const auto read_blocks = std::max<uint64_t>(1, static_cast<uint64_t>(static_cast<double>(blocks) * alone.read / faster));
  const auto write_blocks = std::max<uint64_t>(1, static_cast<uint64_t>(static_cast<double>(blocks) * alone.write / faster));
  SPILLWAY_ASSIGN_OR_RETURN(AlignedBuffer buffer, random_buffer(static_cast<size_t>(depth) * block));
  auto made = make_storage_engine(kind, {.queue_depth = depth, .chunk_bytes = block});
  if (!made) return made.status();
  StorageEngine& engine = **made;
  const std::string in_path = path + ".read", out_path = path + ".write";
  auto in = engine.open(in_path, OpenMode::Create);
  if (!in) return in.status().with_context("storage at " + in_path);
  auto out = engine.open(out_path, OpenMode::Create);
  if (!out) {
    (void)engine.close(*in);
    (void)::unlink(in_path.c_str());
    return out.status().with_context("storage at " + out_path);
  }
  Status s = engine.reserve(*in, 0, read_blocks * block);
  if (s.is_ok()) s = engine.reserve(*out, 0, write_blocks * block);
  double unused = 0, both_s = 0;
  if (s.is_ok()) s = stream_storage(engine, *in, true, read_blocks * block, block, depth, buffer, &unused);
  if (s.is_ok())
    s = stream_storage_mixed(engine, *in, read_blocks, *out, write_blocks, block, depth, buffer, &both_s);
  Status c = engine.close(*in);
  Status c2 = engine.close(*out);
  for (const std::string& p : {in_path, out_path})
    if (::unlink(p.c_str()) != 0 && s.is_ok()) s = errno_status("remove " + p, errno);
  if (!s.is_ok()) return s.with_context("storage reads and writes at once at " + path);
  if (!c.is_ok()) return c.with_context("storage at " + in_path);
  if (!c2.is_ok()) return c2.with_context("storage at " + out_path);
  if (!(both_s > 0))
    return Status::internal("measure storage reads and writes at once: took no measurable time at " + path);
  const double alone_s = std::max(static_cast<double>(read_blocks * block) / alone.read,
                                  static_cast<double>(write_blocks * block) / alone.write);
  return std::clamp(alone_s / both_s, 0.05, 1.0);
}

Result<double> measure_storage_latency(const std::string& kind, const std::string& path, int requests) {
  requests = std::max(1, requests);
  double read_s = 0;
  SPILLWAY_RETURN_IF_ERROR(
      storage_pass(kind, 1, path, static_cast<uint64_t>(requests) * kStorageAlignment, kStorageAlignment, &read_s)
          .status());
  return read_s / requests;
}

void HostAdamState::Free::operator()(void* p) const { std::free(p); }

namespace {
// A fixed pseudo-random number in [0, 1) for element i of stream k.
float unit_hash(uint64_t i, uint64_t k) {
  uint64_t z = i * 0x9e3779b97f4a7c15ull + k * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
}
}  // namespace

Result<HostAdamState> HostAdamState::make(size_t n, DType dtype, bool out_of_place) {
  if (dtype != DType::F32 && dtype != DType::BF16)
    return Status::invalid_argument(std::string("host AdamW: param dtype must be f32 or bf16, got ") +
                                    dtype_name(dtype));
  HostAdamState st;
  st.n_ = n;
  st.dtype_ = dtype;
  const size_t pbytes = dtype_size(dtype);
  constexpr size_t kHuge = size_t{2} << 20;
  auto allocate = [&](size_t bytes) {
    const size_t size = align_up(std::max<size_t>(bytes, 1), kHuge);
    void* p = std::aligned_alloc(kHuge, size);
    if (p) madvise(p, size, MADV_HUGEPAGE);  // advice only; failure leaves normal pages
    return Buffer(p);
  };
  st.master_ = allocate(n * 4);
  st.m_ = allocate(n * 4);
  st.v_ = allocate(n * 4);
  st.param_ = allocate(n * pbytes);
  st.grad_ = allocate(n * pbytes);
  if (out_of_place) {
    st.master2_ = allocate(n * 4);
    st.m2_ = allocate(n * 4);
    st.v2_ = allocate(n * 4);
  }
  if (!st.master_ || !st.m_ || !st.v_ || !st.param_ || !st.grad_ ||
      (out_of_place && (!st.master2_ || !st.m2_ || !st.v2_)))
    return Status::out_of_memory("host AdamW: cannot allocate " +
                                 format_size((12 + 2 * pbytes + (out_of_place ? 12 : 0)) * n) +
                                 " of optimizer state for " + std::to_string(n) + " params");
  auto* fm = static_cast<float*>(st.master_.get());
  auto* fmm = static_cast<float*>(st.m_.get());
  auto* fv = static_cast<float*>(st.v_.get());
  void* grad = st.grad_.get();
  void* param = st.param_.get();
  // First touch from the same contiguous split the update uses, so pages sit on
  // the memory node of the thread that streams them.
  float* out[3] = {static_cast<float*>(st.master2_.get()), static_cast<float*>(st.m2_.get()),
                   static_cast<float*>(st.v2_.get())};
  global_thread_pool().parallel_for(static_cast<int64_t>(n), [&](int64_t b, int64_t e) {
    for (auto* o : out)
      if (o) std::fill(o + b, o + e, 0.0f);
    for (int64_t i = b; i < e; ++i) {
      auto u = static_cast<uint64_t>(i);
      fm[i] = 0.04f * (unit_hash(u, 1) - 0.5f);
      fmm[i] = 2e-3f * (unit_hash(u, 2) - 0.5f);
      fv[i] = 1e-6f * unit_hash(u, 3) + 1e-9f;
      const float g = 2e-3f * (unit_hash(u, 4) - 0.5f);
      if (dtype == DType::BF16) {
        static_cast<uint16_t*>(grad)[i] = float_to_bf16(g);
        static_cast<uint16_t*>(param)[i] = 0;
      } else {
        static_cast<float*>(grad)[i] = g;
        static_cast<float*>(param)[i] = 0;
      }
    }
  });
  return st;
}

void HostAdamState::step(int64_t step_number) {
  const float scale_norm[2] = {1.0f, 0.0f};
  const AdamWHyper hyper = adamw_hyper(6e-4f, step_number, 0.1f);
  auto* master = static_cast<float*>(master_.get());
  auto* m = static_cast<float*>(m_.get());
  auto* v = static_cast<float*>(v_.get());
  if (!master2_) {
    adamw_host(dtype_, param_.get(), master, m, v, grad_.get(), scale_norm, n_, hyper);
    return;
  }
  adamw_host_into(dtype_, param_.get(), master, m, v, static_cast<float*>(master2_.get()),
                  static_cast<float*>(m2_.get()), static_cast<float*>(v2_.get()), grad_.get(), scale_norm, n_, hyper);
  std::swap(master_, master2_);  // the next step reads what this one wrote
  std::swap(m_, m2_);
  std::swap(v_, v2_);
}

Result<double> measure_host_adam(size_t n, DType dtype, int iters, Backend* copying, bool out_of_place) {
  if (n == 0) return Status::invalid_argument("measure host AdamW: no params");
  iters = std::max(1, iters);
  SPILLWAY_ASSIGN_OR_RETURN(HostAdamState state, HostAdamState::make(n, dtype, out_of_place));
  int64_t step = 1;
  state.step(step++);  // warm-up
  double alone_s = 1e30;
  auto time_steps = [&](double* best) {
    for (int i = 0; i < iters; ++i) {
      const double t0 = now_s();
      state.step(step++);
      *best = std::min(*best, now_s() - t0);
    }
  };
  if (!copying) {
    time_steps(&alone_s);
    return static_cast<double>(n) / alone_s;
  }
  // Copies for about twice the steps' time alone (they may slow down together), both ways.
  state.step(step++);
  {
    const double t0 = now_s();
    state.step(step++);
    alone_s = now_s() - t0;
  }
  constexpr size_t kPiece = size_t{64} << 20;
  Backend& backend = *copying;
  ScratchBuffers buffers(backend);
  SPILLWAY_ASSIGN_OR_RETURN(void* host_up, buffers.host(kPiece));
  SPILLWAY_ASSIGN_OR_RETURN(void* host_down, buffers.host(kPiece));
  SPILLWAY_ASSIGN_OR_RETURN(void* dev_up, buffers.device(kPiece));
  SPILLWAY_ASSIGN_OR_RETURN(void* dev_down, buffers.device(kPiece));
  SPILLWAY_RETURN_IF_ERROR(backend.synchronize());
  SPILLWAY_ASSIGN_OR_RETURN(CopyRates rates, measure_copies(backend, kPiece, kPiece, 1));
  const double seconds = 2.0 * alone_s * (iters + 1);
  const int pieces = 2 + static_cast<int>(std::min(seconds * std::max(rates.h2d, rates.d2h) / kPiece, 20000.0));
  CopyEngine& ce = backend.copy_engine();
  for (int i = 0; i < pieces; ++i) {
    auto up = ce.copy(CopyDirection::HostToDevice, dev_up, host_up, kPiece, false);
    if (!up) return up.status().with_context("host→device copies beside host AdamW");
    auto down = ce.copy(CopyDirection::DeviceToHost, host_down, dev_down, kPiece, false);
    if (!down) return down.status().with_context("device→host copies beside host AdamW");
  }
  double best = 1e30;
  state.step(step++);  // the copies are under way
  time_steps(&best);
  SPILLWAY_RETURN_IF_ERROR(ce.wait_all());
  return static_cast<double>(n) / best;
}

Result<CopyShares> measure_copy_share_beside_host_adam(Backend& backend, size_t n, DType dtype, uint64_t piece,
                                                       uint64_t total) {
  if (n == 0) return Status::invalid_argument("measure copies beside host AdamW: no params");
  SPILLWAY_ASSIGN_OR_RETURN(HostAdamState state, HostAdamState::make(n, dtype));
  state.step(1);  // warm-up
  SPILLWAY_ASSIGN_OR_RETURN(CopyRates alone, measure_copies(backend, piece, total, 2));
  std::atomic<bool> stop{false};
  std::atomic<int64_t> steps{0};
  std::thread optimizer([&] {
    for (int64_t s = 2; !stop.load(std::memory_order_relaxed); ++s) {
      state.step(s);
      steps.fetch_add(1, std::memory_order_relaxed);
    }
  });
  // Copies start once a whole step has run: the optimizer is under way throughout.
  while (steps.load(std::memory_order_relaxed) < 1) std::this_thread::sleep_for(std::chrono::microseconds(200));
  auto busy = measure_copies(backend, piece, total, 2);
  stop.store(true, std::memory_order_relaxed);  // the step under way still runs to its end
  optimizer.join();
  if (!busy) return busy.status().with_context("copies beside host AdamW");
  return CopyShares{.h2d = std::clamp(busy->h2d / alone.h2d, 0.05, 1.0),
                    .d2h = std::clamp(busy->d2h / alone.d2h, 0.05, 1.0),
                    .both = std::clamp(busy->both / alone.both, 0.05, 1.0)};
}

Result<double> measure_matmul(Backend& backend, int N, int C, int OC, int repeats) {
  repeats = std::max(1, repeats);
  const size_t act = dtype_size(backend.activation_dtype());
  ScratchBuffers buffers(backend);
  SPILLWAY_ASSIGN_OR_RETURN(void* out, buffers.device(static_cast<size_t>(N) * OC * act));
  SPILLWAY_ASSIGN_OR_RETURN(void* inp, buffers.device(static_cast<size_t>(N) * C * act));
  SPILLWAY_ASSIGN_OR_RETURN(void* w, buffers.device(static_cast<size_t>(OC) * C * act));
  OwnWorkspace workspace(backend);
  SPILLWAY_RETURN_IF_ERROR(workspace.use(backend.matmul_workspace(N, OC, false, false)));
  backend.matmul_forward(out, inp, w, nullptr, N, C, OC);
  SPILLWAY_RETURN_IF_ERROR(backend.synchronize());
  const double t0 = now_s();
  for (int r = 0; r < repeats; ++r) backend.matmul_forward(out, inp, w, nullptr, N, C, OC);
  SPILLWAY_RETURN_IF_ERROR(backend.synchronize());
  const double s = now_s() - t0;
  if (!(s > 0)) return Status::internal("measure matmul: took no measurable time");
  return 2.0 * N * C * static_cast<double>(OC) * repeats / s;
}

Result<double> measure_attention(Backend& backend, int B, int T, int NH, int D, int repeats) {
  repeats = std::max(1, repeats);
  if (B <= 0 || T <= 0 || NH <= 0 || D <= 0)
    return Status::invalid_argument("measure attention: B, T, NH and D must be positive");
  const size_t act = dtype_size(backend.activation_dtype());
  const int C = NH * D;
  const size_t rows = static_cast<size_t>(B) * T;
  ScratchBuffers buffers(backend);
  SPILLWAY_ASSIGN_OR_RETURN(void* qkv, buffers.device(rows * 3 * C * act));
  SPILLWAY_ASSIGN_OR_RETURN(void* dqkv, buffers.device(rows * 3 * C * act));
  SPILLWAY_ASSIGN_OR_RETURN(void* out, buffers.device(rows * C * act));
  SPILLWAY_ASSIGN_OR_RETURN(void* dout, buffers.device(rows * C * act));
  SPILLWAY_ASSIGN_OR_RETURN(void* lse, buffers.device(static_cast<size_t>(B) * NH * T * sizeof(float)));
  OwnWorkspace workspace(backend);
  SPILLWAY_RETURN_IF_ERROR(workspace.use(backend.attention_backward_workspace(B, T, NH)));
  auto pair = [&] {
    backend.attention_forward(out, static_cast<float*>(lse), qkv, B, T, C, NH);
    backend.attention_backward(dqkv, dout, qkv, out, static_cast<const float*>(lse), B, T, C, NH);
  };
  pair();
  SPILLWAY_RETURN_IF_ERROR(backend.synchronize());
  const double t0 = now_s();
  for (int r = 0; r < repeats; ++r) pair();
  SPILLWAY_RETURN_IF_ERROR(backend.synchronize());
  const double s = now_s() - t0;
  if (!(s > 0)) return Status::internal("measure attention: took no measurable time");
  return 7.0 * B * static_cast<double>(T) * T * C * repeats / s;
}

Result<double> measure_memory_bound(Backend& backend, size_t n, int repeats) {
  repeats = std::max(1, repeats);
  const size_t act = dtype_size(backend.activation_dtype());
  ScratchBuffers buffers(backend);
  SPILLWAY_ASSIGN_OR_RETURN(void* a, buffers.device(n * act));
  SPILLWAY_ASSIGN_OR_RETURN(void* b, buffers.device(n * act));
  SPILLWAY_ASSIGN_OR_RETURN(void* c, buffers.device(n * act));
  backend.residual_forward(c, a, b, n);
  SPILLWAY_RETURN_IF_ERROR(backend.synchronize());
  const double t0 = now_s();
  for (int r = 0; r < repeats; ++r) backend.residual_forward(c, a, b, n);
  SPILLWAY_RETURN_IF_ERROR(backend.synchronize());
  const double s = now_s() - t0;
  if (!(s > 0)) return Status::internal("measure memory-bound op: took no measurable time");
  return 3.0 * static_cast<double>(n * act) * repeats / s;
}

Result<double> measure_op_launch(Backend& backend, int ops) {
  ops = std::max(1, ops);
  const size_t act = dtype_size(backend.activation_dtype());
  ScratchBuffers buffers(backend);
  SPILLWAY_ASSIGN_OR_RETURN(void* a, buffers.device(64 * act));
  SPILLWAY_ASSIGN_OR_RETURN(void* b, buffers.device(64 * act));
  SPILLWAY_ASSIGN_OR_RETURN(void* c, buffers.device(64 * act));
  backend.residual_forward(c, a, b, 64);
  SPILLWAY_RETURN_IF_ERROR(backend.synchronize());
  const double t0 = now_s();
  for (int r = 0; r < ops; ++r) backend.residual_forward(c, a, b, 64);
  SPILLWAY_RETURN_IF_ERROR(backend.synchronize());
  const double s = now_s() - t0;
  if (!(s > 0)) return Status::internal("measure op launch: took no measurable time");
  return s / ops;
}

namespace {

// The compute of the side-by-side measurements: an S³ product (held in the caches on
// a CPU) then a residual add over three arrays of S² · 32 elements, at most 64 Mi
// (beyond them), as a step mixes compute-bound and memory-bound ops: copies and the
// host optimizer contend for the memory bus with the second.
class ComputeMix {
 public:
  explicit ComputeMix(Backend& backend) : backend_(backend), buffers_(backend), workspace_(backend) {}
  Status make(int S) {
    S_ = S;
    const size_t act = dtype_size(backend_.activation_dtype());
    const size_t mat = static_cast<size_t>(S) * S * act;
    n_ = std::min(static_cast<size_t>(S) * S * 32, size_t{64} << 20);
    for (auto [p, bytes] : {std::pair{&out_, mat}, std::pair{&inp_, mat}, std::pair{&w_, mat},
                            std::pair{&ra_, n_ * act}, std::pair{&rb_, n_ * act}, std::pair{&rc_, n_ * act}}) {
      auto buffer = buffers_.device(bytes);
      if (!buffer) return buffer.status();
      *p = *buffer;
    }
    SPILLWAY_RETURN_IF_ERROR(workspace_.use(backend_.matmul_workspace(S, S, false, false)));
    queue();  // warm-up
    return backend_.synchronize();
  }
  // One round, queued (the backend may run it asynchronously).
  void queue() {
    backend_.matmul_forward(out_, inp_, w_, nullptr, S_, S_, S_);
    backend_.residual_forward(rc_, ra_, rb_, n_);
  }
  // Seconds of `rounds` rounds, to their end.
  Result<double> time(int rounds) {
    const double t0 = now_s();
    for (int r = 0; r < rounds; ++r) queue();
    SPILLWAY_RETURN_IF_ERROR(backend_.synchronize());
    return now_s() - t0;
  }
  ScratchBuffers& buffers() { return buffers_; }

 private:
  Backend& backend_;
  ScratchBuffers buffers_;
  OwnWorkspace workspace_;
  int S_ = 0;
  size_t n_ = 0;
  void *out_ = nullptr, *inp_ = nullptr, *w_ = nullptr, *ra_ = nullptr, *rb_ = nullptr, *rc_ = nullptr;
};

}  // namespace

Result<HostComputeShares> measure_compute_beside_host_adam(Backend& backend, size_t n, DType dtype, int S,
                                                           int repeats) {
  if (n == 0) return Status::invalid_argument("measure compute beside host AdamW: no params");
  repeats = std::max(1, repeats);
  ComputeMix mix(backend);
  SPILLWAY_RETURN_IF_ERROR(mix.make(S).with_context("measure compute beside host AdamW"));
  SPILLWAY_ASSIGN_OR_RETURN(HostAdamState state, HostAdamState::make(n, dtype));
  state.step(1);  // warm-up
  SPILLWAY_ASSIGN_OR_RETURN(const double compute_alone, mix.time(repeats));
  double host_alone = 1e30;
  for (int64_t s = 2; s < 4; ++s) {
    const double t0 = now_s();
    state.step(s);
    host_alone = std::min(host_alone, now_s() - t0);
  }
  if (!(compute_alone > 0) || !(host_alone > 0))
    return Status::internal("measure compute beside host AdamW: took no measurable time");
  // Side by side: the optimizer's steps back to back on their own thread (the global
  // pool under it, as the executor's host queue runs them), the compute rounds on
  // this one (issuing and waiting, as the executor does) until at least two whole
  // optimizer steps and `repeats` rounds have run beside each other.
  std::atomic<bool> stop{false};
  std::atomic<int64_t> steps{0};
  std::mutex mu;
  std::vector<std::pair<double, double>> spans;  // optimizer steps' start and end
  std::thread optimizer([&] {
    for (int64_t s = 4; !stop.load(std::memory_order_relaxed); ++s) {
      const double t0 = now_s();
      state.step(s);
      const double t1 = now_s();
      {
        std::lock_guard<std::mutex> lock(mu);
        spans.emplace_back(t0, t1);
      }
      steps.fetch_add(1, std::memory_order_relaxed);
    }
  });
  while (steps.load(std::memory_order_relaxed) < 1) std::this_thread::sleep_for(std::chrono::microseconds(200));
  const double begin = now_s();
  int rounds = 0;
  Status failed = Status::ok();
  while (failed.is_ok()) {
    mix.queue();
    failed = backend.synchronize();
    ++rounds;
    size_t inside = 0;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (auto& [a, b] : spans) inside += a >= begin;
    }
    if (rounds >= repeats && inside >= 2) break;
  }
  const double end = now_s();
  stop.store(true, std::memory_order_relaxed);
  optimizer.join();
  SPILLWAY_RETURN_IF_ERROR(failed.with_context("compute beside host AdamW"));
  double host_side = 0;
  int counted = 0;
  for (auto& [a, b] : spans)
    if (a >= begin && b <= end) host_side += b - a, ++counted;
  if (counted == 0) return Status::internal("measure compute beside host AdamW: no optimizer step ran beside compute");
  HostComputeShares shares;
  shares.compute_while_host = std::clamp(compute_alone / repeats / ((end - begin) / rounds), 0.05, 1.0);
  shares.host_while_computing = std::clamp(host_alone / (host_side / counted), 0.05, 1.0);
  return shares;
}

Result<SharedSpeeds> measure_shared_speeds(Backend& backend, int S, int repeats, double h2d_bytes_per_s) {
  repeats = std::max(1, repeats);
  ComputeMix mix(backend);
  SPILLWAY_RETURN_IF_ERROR(mix.make(S).with_context("measure compute while copying"));
  auto compute = [&]() { mix.queue(); };
  SPILLWAY_ASSIGN_OR_RETURN(const double alone, mix.time(repeats));
  if (!(alone > 0)) return Status::internal("measure compute while copying: took no measurable time");
  ScratchBuffers& buffers = mix.buffers();
  double t0 = 0;
  // The same products while host→device copies run: on the CPU backend the copy
  // threads share the cores and the memory bus with compute.
  constexpr size_t kCopyBytes = size_t{64} << 20;
  SPILLWAY_ASSIGN_OR_RETURN(void* host_buf, buffers.host(kCopyBytes));
  SPILLWAY_ASSIGN_OR_RETURN(void* dev_buf, buffers.device(kCopyBytes));
  std::memset(host_buf, 0x5a, kCopyBytes);  // touch every page before timing
  CopyEngine& ce = backend.copy_engine();
  const int copies = 2 + static_cast<int>(std::min(alone * h2d_bytes_per_s / kCopyBytes, 20000.0));
  auto queue_copies = [&]() -> Result<CopyTicket> {
    CopyTicket last{};
    for (int c = 0; c < copies; ++c) {
      auto t = ce.copy(CopyDirection::HostToDevice, dev_buf, host_buf, kCopyBytes);
      if (!t) return t.status().with_context("host→device copy");
      last = *t;
    }
    return last;
  };
  SPILLWAY_RETURN_IF_ERROR(queue_copies().status());
  t0 = now_s();
  for (int r = 0; r < repeats; ++r) compute();
  SPILLWAY_RETURN_IF_ERROR(backend.synchronize());
  const double with_copies = now_s() - t0;
  SPILLWAY_RETURN_IF_ERROR(ce.wait_all());
  SharedSpeeds speeds;
  speeds.compute_while_copying = with_copies > 0 ? std::clamp(alone / with_copies, 0.05, 1.0) : 1.0;
  // The copies alone, then the same copies while compute runs until the last copy is
  // done (to within one round of compute).
  t0 = now_s();
  SPILLWAY_RETURN_IF_ERROR(queue_copies().status());
  SPILLWAY_RETURN_IF_ERROR(ce.wait_all());
  const double copies_alone = now_s() - t0;
  t0 = now_s();
  SPILLWAY_ASSIGN_OR_RETURN(CopyTicket last, queue_copies());
  do {
    compute();
    SPILLWAY_RETURN_IF_ERROR(backend.synchronize());
  } while (!ce.is_done(last));
  const double copies_computing = now_s() - t0;
  SPILLWAY_RETURN_IF_ERROR(ce.wait_all());
  speeds.copy_while_computing = copies_computing > 0 ? std::clamp(copies_alone / copies_computing, 0.05, 1.0) : 1.0;
  return speeds;
}

}  // namespace spillway
