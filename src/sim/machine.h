// Machine: what the hardware can do, for the planner's cost model and the simulator.
//
//   Machine m = Machine::h200();                   // figures measured on the lent H200 host
//   auto c = measure_machine(backend, m);          // rates measured by a short profile (sim/profiler.h)
//   double s = m.op_seconds(program, op_index);    // measured if profiled, else derived
//
// A user can describe a machine that does not exist ("a 24 GiB GPU and two NVMe
// drives") by editing the fields; the simulator then answers what-if questions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "program/program.h"

namespace spillway {

struct Machine {
  std::string name = "generic";
  uint64_t device_bytes = 0;            // device memory
  uint64_t host_bytes = 0;              // host memory
  double h2d_bytes_per_s = 25e9;        // host → device link, one direction alone
  double d2h_bytes_per_s = 25e9;        // device → host link, one direction alone
  double duplex_factor = 0.9;           // each direction's share of its rate while both run
  double compute_share_while_copying = 1.0;  // device compute speed while a host⇄device copy
                                             // runs (below 1 on the CPU backend: shared cores)
  double storage_read_bytes_per_s = 1.5e9;
  double storage_write_bytes_per_s = 1.2e9;
  double matmul_flops_per_s = 100e12;   // device matrix products
  double device_bytes_per_s = 2e12;     // device memory-bound ops
  double op_launch_s = 5e-6;            // fixed cost per op
  double host_adam_params_per_s = 2e9;  // host SIMD AdamW
  bool host_runs_ahead = true;          // CUDA: the host issues ahead of the device; CPU: false
  // Per-op measured seconds for one program ([ops]); empty → derived from the rates.
  std::vector<double> measured_op_seconds;

  double op_seconds(const Program& program, size_t op_index) const;
  double copy_seconds(uint64_t bytes, bool h2d) const;

  static Machine h200();        // PCIe 55 GB/s each way, 784 TFLOP/s bf16, 1.7 GB/s disk, 16 cores
  static Machine cpu_dev_box(); // this project's 2-core CI machine
};

}  // namespace spillway
