// Profiler: measures link bandwidths and compute rates on the real backend, so that
// the planner and the simulator predict this machine rather than a preset.
//
//   auto backend = make_backend("cuda");
//   Machine m = Machine::h200();
//   auto measured = measure_machine(**backend, m);           // copy, matmul, memory, AdamW rates
//   if (!measured) die(measured.status());
//   m = *measured;
//   auto seconds = profile_ops(**backend, program, /*repeats=*/3);  // exec/op_timer.h
//   if (!seconds) die(seconds.status());
//   m.measured_op_seconds = *seconds;                        // Machine::op_seconds uses them
//
// The times of a Program's ops are measured where ops are dispatched to a backend,
// in the exec module (exec/op_timer.h: profile_ops); this module measures only
// backend calls, copies, storage and the host optimizer.
//
// The pieces of a machine profile (`spillway profile`, `bench io`, `bench adam`):
//
//   auto copies = measure_copies(backend, 64 << 20, 1 << 30, 3);   // H2D, D2H, both (bytes/s)
//   auto disk = measure_storage("auto", 16, "/nvme/spill/probe.bin", 1 << 30, 1 << 20);
//   auto adam = measure_host_adam(128 << 20, DType::BF16, 5, &backend);  // while copies run
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "sim/machine.h"

namespace spillway {

// `base` with the rates this backend shows in short tests: H2D and D2H bandwidth
// through the copy engine (64 MiB, each direction alone, then both at once for
// duplex_factor), matrix-product flops, memory-bound bytes/s (a residual add), host AdamW
// params/s, device capacity, and whether the host runs ahead (CUDA). Storage rates
// are left as given (they need a spill directory: `spillway bench io`).
Result<Machine> measure_machine(Backend& backend, Machine base);

// ---- pieces of a profile; rates in bytes/s, flop/s, params/s ----

// Host⇄device copies through backend.copy_engine() from host_alloc memory (pinned on
// CUDA, as the executor's): `total` bytes per direction in `piece`-byte copies, each
// direction alone, then both at once; the best of `rounds` rounds. `both` is the sum
// of the two directions' bytes over the time both took.
struct CopyRates {
  double h2d = 0, d2h = 0, both = 0;
};
Result<CopyRates> measure_copies(Backend& backend, uint64_t piece, uint64_t total, int rounds);

// Storage through make_storage_engine(kind) (O_DIRECT where the file system allows,
// as the executor's spill files): `total` bytes written, then read back, at `path`
// (created, and removed afterwards) in `block`-byte requests, `depth` of them in
// flight. The file's blocks are reserved first, as the StorageStore does.
struct StorageRates {
  double write = 0, read = 0;
  bool direct = true;  // false: the file system refused O_DIRECT (page cache figures)
};
Result<StorageRates> measure_storage(const std::string& kind, int depth, const std::string& path, uint64_t total,
                                     size_t block);
// Reads and writes at once (Machine::storage_duplex_factor): a file is written, then
// read back while a second one is written, through one engine with `depth` requests
// in flight, at `path`.read and `path`.write (removed afterwards). Each kind moves
// the bytes that take it the same time alone (`alone`, from measure_storage; the
// faster kind moves `total`); the factor is that time over the time both took
// together, from 0.05 to 1 (0.5: as if one at a time).
Result<double> measure_storage_duplex(const std::string& kind, int depth, const std::string& path, uint64_t total,
                                      size_t block, const StorageRates& alone);
// Seconds per 4 KiB read at queue depth 1: `requests` reads of a file written first.
Result<double> measure_storage_latency(const std::string& kind, const std::string& path, int requests);

// AdamW state of n params on the host: master, m, v (F32), param and grad (`dtype`),
// 2 MiB aligned (transparent huge pages asked for), every page first touched by the
// global thread pool's thread that updates it, with fixed pseudo-random values.
class HostAdamState {
 public:
  // out_of_place: a second master, m and v, and each step reads one set and writes
  // the other (adamw_host_into, as the executor's speculative updates run).
  static Result<HostAdamState> make(size_t n, DType dtype, bool out_of_place = false);
  // One AdamW step over all n params: in place (adamw_host), or out of place.
  void step(int64_t step_number);
  size_t size() const { return n_; }
  DType dtype() const { return dtype_; }

 private:
  struct Free {
    void operator()(void* p) const;
  };
  using Buffer = std::unique_ptr<void, Free>;
  size_t n_ = 0;
  DType dtype_ = DType::F32;
  Buffer master_, m_, v_, param_, grad_;  // [n] f32 ×3, [n] dtype ×2
  Buffer master2_, m2_, v2_;               // [n] f32 ×3: out of place only
};

// Host AdamW params/s over the global thread pool: the best of `iters` steps of n
// params after one warm-up. With `copying`, its copy engine moves 64 MiB pieces of
// pinned memory host→device and device→host the whole time (they share the host's
// memory bandwidth with the optimizer, as in a pipelined step). out_of_place: the
// update reads one master, m and v and writes a second (the speculative update).
Result<double> measure_host_adam(size_t n, DType dtype, int iters, Backend* copying, bool out_of_place = false);
// Copies beside the host optimizer (Machine::copy_share_while_host_computes): the
// rates of measure_copies (pieces of `piece` bytes, `total` per direction) while host
// AdamW steps of n params run back to back on the global thread pool, over the same
// rates alone, each in (0, 1]: host→device alone, device→host alone, and both at once
// (the share the machine keeps). The directions differ where the optimizer's reads and
// writes of host memory meet the device's reads (h2d) and writes (d2h) unevenly.
struct CopyShares {
  double h2d = 1, d2h = 1, both = 1;
};
Result<CopyShares> measure_copy_share_beside_host_adam(Backend& backend, size_t n, DType dtype, uint64_t piece,
                                                       uint64_t total);

// A matrix product out[N,OC] = inp[N,C]·weight[OC,C]ᵀ (activation dtype): flop/s,
// the mean of `repeats` after a warm-up.
Result<double> measure_matmul(Backend& backend, int N, int C, int OC, int repeats);
// Causal attention forward then backward at B·T tokens, NH heads of D (the backend's
// kernels, as a step runs them): flop/s in op_cost_flops' terms (2·B·T²·C forward,
// 5·B·T²·C backward, C = NH·D), the mean of `repeats` pairs after a warm-up pair.
Result<double> measure_attention(Backend& backend, int B, int T, int NH, int D, int repeats);
// A memory-bound op (residual add over n elements: three arrays): bytes/s.
Result<double> measure_memory_bound(Backend& backend, size_t n, int repeats);
// Seconds per op of `ops` tiny ops back to back (the fixed cost per op).
Result<double> measure_op_launch(Backend& backend, int ops);
// Compute and copies at once, each over its speed alone (0 to 1]: compute (an S³
// product and a residual add over 32·S² elements, at most 64 Mi, a step's mix of compute-bound and
// memory-bound ops) while host→device copies run, and host→device copies while that
// compute runs. On the CPU backend both share the cores and the memory bus; on a GPU
// the copy engines and the SMs are apart, but share device memory.
// Device compute (the same mix) and the host AdamW (n params of `dtype` on the global
// thread pool, steps back to back on a thread of their own) side by side, each over
// its speed alone, in (0, 1]: on the CPU backend both run on the host's cores; on a
// GPU the compute loses what the thread issuing and waiting for it loses to the
// optimizer's threads.
struct HostComputeShares {
  double compute_while_host = 1;    // Machine::compute_share_while_host_computes
  double host_while_computing = 1;  // Machine::host_share_while_computing
};
Result<HostComputeShares> measure_compute_beside_host_adam(Backend& backend, size_t n, DType dtype, int S,
                                                           int repeats);
struct SharedSpeeds {
  double compute_while_copying = 1;  // Machine::compute_share_while_copying
  double copy_while_computing = 1;   // Machine::copy_share_while_computing
};
Result<SharedSpeeds> measure_shared_speeds(Backend& backend, int S, int repeats, double h2d_bytes_per_s);

}  // namespace spillway
