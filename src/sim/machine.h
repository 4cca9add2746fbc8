// Machine: what the hardware can do, for the planner's cost model and the simulator.
//
//   Machine m = Machine::h200();                   // figures measured on the lent H200 host
//   auto c = measure_machine(backend, m);          // rates measured by a short profile (sim/profiler.h)
//   double s = m.op_seconds(program, op_index);    // measured if profiled, else derived
//   m.op_fits = fit_op_kinds(op_timings(program, seconds), m.op_launch_s);  // per kind
//   auto m2 = load_machine("machines/h200.json");  // or "h200", "cpu": the presets
//   std::string text = m.to_json();                // every field; Machine::from_json reads it back
//
// A user can describe a machine that does not exist ("a 24 GiB GPU and two NVMe
// drives") by editing the fields; the simulator then answers what-if questions.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "program/program.h"

namespace spillway {

// Where and when a machine's figures were measured (`spillway profile` fills it in).
struct MeasuredOn {
  std::string date;    // "2026-12-04T10:20:00Z" (UTC)
  std::string host;    // host name
  std::string cpu;     // "AMD EPYC 9654 96-Core Processor, 16 cores"
  std::string gpu;     // the backend's description: "NVIDIA H200, 139.8 GiB" / "CPU, 2 threads"
  std::string driver;  // NVIDIA driver version, or "none"
  std::string notes;   // how the figures were obtained (a command, a results file), free text
  bool operator==(const MeasuredOn&) const = default;
};

// The fitted cost of one kind of device op (Machine::op_fits): seconds =
//   fixed_s + work / rate + bytes / bytes_per_s
// work: op_cost_flops for kinds with flops (matrix products, attention), else
// op_bytes_moved; bytes: op_bytes_moved, a second term for kinds with flops only (a
// product of few rows spends much of its time reading the weight, which the flops do
// not show). A rate of 0 means the term is absent, so a fit of {0, 0, 0} is "not
// measured".
struct OpFit {
  double fixed_s = 0;      // per op, beyond Machine::op_launch_s
  double rate = 0;         // work per second (flop/s or bytes/s)
  double bytes_per_s = 0;  // op_bytes_moved per second (kinds with flops only)
  bool measured() const { return fixed_s > 0 || rate > 0 || bytes_per_s > 0; }
  // The seconds of an op of this kind with this work and these bytes (Machine::op_launch_s not included).
  double seconds(double work, double bytes) const {
    return fixed_s + (rate > 0 ? work / rate : 0) + (bytes_per_s > 0 ? bytes / bytes_per_s : 0);
  }
  bool operator==(const OpFit&) const = default;
};

struct Machine {
  std::string name = "generic";
  uint64_t device_bytes = 0;            // device memory
  uint64_t host_bytes = 0;              // host memory
  double h2d_bytes_per_s = 25e9;        // host → device link, one direction alone
  double d2h_bytes_per_s = 25e9;        // device → host link, one direction alone
  double duplex_factor = 0.9;           // each direction's share of its rate while both run
  double compute_share_while_copying = 1.0;  // device compute speed while a host⇄device copy
                                             // runs (below 1 on the CPU backend: shared cores)
  double copy_share_while_computing = 1.0;   // a host⇄device copy's speed while device compute
                                             // runs (below 1 on the CPU backend: shared cores)
  double copy_share_while_host_computes = 1.0;  // a host⇄device copy's speed while a host op (the
                                                // host AdamW) runs: they share host memory bandwidth
  // Device compute and host ops side by side, each over its speed alone: on the CPU
  // backend both run on the host's cores; on a GPU the compute loses only what the
  // thread issuing it loses to the host optimizer's threads.
  double compute_share_while_host_computes = 1.0;  // device compute's speed while a host op runs
  double host_share_while_computing = 1.0;         // a host op's speed while device compute runs
  double storage_read_bytes_per_s = 1.5e9;
  double storage_write_bytes_per_s = 1.2e9;
  // Reads and writes in flight at once: each at its rate times this (1: they do not
  // slow each other; 0.5: the drive serves them as one queue, as if one at a time).
  // `spillway profile` measures it; files before version 8 have none and read 0.5.
  double storage_duplex_factor = 0.5;
  double matmul_flops_per_s = 100e12;   // device matrix products
  // Device causal attention (forward and backward kernels), in the flops that
  // op_cost_flops counts for them: 2·B·T²·C forward, 5·B·T²·C backward. Far below
  // the matrix-product rate on GPUs without a tuned flash attention.
  double attention_flops_per_s = 100e12;
  double device_bytes_per_s = 2e12;     // device memory-bound ops
  double op_launch_s = 5e-6;            // fixed cost per op
  // Each kind of device op's own fitted cost ([kOpKindCount], by OpKind; unmeasured
  // kinds keep the class rule below). A measured kind takes
  //   op_launch_s + fixed_s + work / rate + bytes / bytes_per_s
  // (a term whose rate is 0 is absent). `spillway profile` fits them from the ops of
  // sample steps at several shapes (fit_op_kinds).
  std::array<OpFit, kOpKindCount> op_fits{};
  double host_adam_params_per_s = 2e9;  // host SIMD AdamW
  bool host_runs_ahead = true;          // CUDA: the host issues ahead of the device; CPU: false
  // Per-op measured seconds for one program ([ops]); empty → derived from the rates.
  std::vector<double> measured_op_seconds;
  // Measured alongside the rates above: storage capacity of the spill folder's file
  // system (0: unknown) and the time of one 4 KiB read at queue depth 1 (reports and
  // what-ifs only), and host AdamW params/s with no copy running
  // (host_adam_params_per_s is the rate while copies run both ways, which the planner
  // uses; the simulator runs host ops at this rate while no copy runs, and halfway
  // between while one direction copies; 0: the same rate).
  uint64_t storage_bytes = 0;
  double storage_latency_s = 0;
  double host_adam_params_per_s_alone = 0;
  // The host AdamW out of place (reading one master, m and v and writing a second,
  // as speculative updates do) over in place, alone: the outputs' lines are not in
  // cache, so it moves more memory. The simulator slows speculative host ops by it.
  double host_adam_out_of_place_share = 1.0;
  MeasuredOn measured_on;

  bool operator==(const Machine&) const = default;

  // An op's predicted seconds: its kind's fit, else the fits of the kinds the registry
  // prices it as (OpKindInfo::priced_as, priced_with), else the roofline of the rates above.
  double op_seconds(const Program& program, size_t op_index) const;
  // The fitted cost of device ops of kind k (op_fits); not measured() when none.
  const OpFit& op_fit(OpKind k) const;
  double copy_seconds(uint64_t bytes, bool h2d) const;

  static Machine h200();        // PCIe 55 GB/s each way, 720 TFLOP/s bf16 in steps, 1.7 GB/s disk, 16 cores
  static Machine cpu_dev_box(); // this project's 2-core CI machine

  // A JSON object with every field (format "spillway-machine", version
  // kMachineFormatVersion), rates in bytes/s, flop/s and params/s, sizes in bytes.
  std::string to_json() const;
  // The inverse of to_json. Every field must be there with its JSON type; an unknown
  // key, a wrong type, a missing field, a negative rate or another format or version
  // is an error naming the key and `source` (the file, for messages).
  static Result<Machine> from_json(const std::string& text, const std::string& source);
};

// 2: attention_flops_per_s; 3: op_rates (one rate per kind); 4: op_fits (fixed cost,
// rate and bytes rate per kind) and copy_share_while_computing; 5: copy_share_while_host_computes;
// 6: compute_share_while_host_computes and host_share_while_computing; 7:
// host_adam_out_of_place_share.
// from_json also reads versions 2 (no fitted kinds: every kind from the class rates),
// 3 (each rate as a fit with that rate alone), 4, 5 and 6; a field a version lacks
// keeps what that version modelled (full speed side by side, speculative updates at
// the in-place rate).
inline constexpr int kMachineFormatVersion = 8;

// The work an op's kind is measured in (OpFit::rate): op_cost_flops when the
// kind has flops, else op_bytes_moved.
double op_rate_work(const Program& program, const Op& op);

// One device op timed in a sample step: what fit_op_kinds needs of it.
struct OpTiming {
  OpKind kind{};
  double work = 0;     // op_rate_work
  double bytes = 0;    // op_bytes_moved
  double seconds = 0;  // as timed, the fixed cost per op (op_launch_s) included
};
// The device ops of `program` with a measured time in `seconds` ([program.ops], 0:
// not timed); host ops are left out.
std::vector<OpTiming> op_timings(const Program& program, const std::vector<double>& seconds);

// Ops timed one at a time each wait for the device before and after; in a step on a
// device the host runs ahead of, the device goes from op to op without those waits.
// When the ops of one sample step sum to more than its whole step (`step_s`, timed
// unprofiled), the excess is that waiting: taken off every op evenly (none below 0).
// Returns the seconds taken off each op (0 when the ops fit within the step).
//
//   double each = take_off_synchronization(&timings, step_s);  // before fit_op_kinds
double take_off_synchronization(std::vector<OpTiming>* ops, double step_s);

// Each kind's cost from timed ops, pooled over any number of sample steps: the
// non-negative fixed_s, 1/rate and 1/bytes_per_s (bytes only for kinds with flops)
// that minimize the sum over the kind's ops of (predicted - timed)^2 / timed, each
// op's time less `launch_s` (every subset of the terms is tried; the best one whose
// coefficients are all > 0 is kept). Dividing by the time weighs small ops more than
// a plain sum of squares would (a layer's many small ops add up in a deep model) and
// large ones more than relative errors would (they make most of a step). A kind with
// no timed op, or whose ops take no time beyond `launch_s`, is not measured.
std::array<OpFit, kOpKindCount> fit_op_kinds(const std::vector<OpTiming>& timed, double launch_s);

// "h200" or "cpu": the presets; anything else: a JSON file written by
// `spillway profile` (Machine::from_json). Errors name the file or the preset.
Result<Machine> load_machine(const std::string& file_or_preset);
// Writes m.to_json() to `path` whole or not at all (core/atomic_file.h).
Status save_machine(const Machine& m, const std::string& path);

// The driver version in the first line of /proc/driver/nvidia/version: its first
// word of digits and dots ("580.95.05" from "NVRM version: NVIDIA UNIX Open Kernel
// Module for x86_64  580.95.05  Release Build ..."); "unknown" when it has none.
std::string nvidia_driver_version_from(const std::string& first_line);

// A GPU's dense bf16 tensor-core peak from NVIDIA's data sheet, by the name CUDA
// reports (cudaDeviceProp::name), for MFU:
//   DataSheetPeak p = data_sheet_bf16_peak("NVIDIA H100 80GB HBM3");  // 989.4e12, "H100 SXM"
// flops_per_s is 0 for a GPU not in the table: no MFU is claimed for it.
struct DataSheetPeak {
  double flops_per_s = 0;  // dense (no sparsity) bf16 FLOP/s
  std::string part;        // the data sheet's part: "H100 SXM", "H200 SXM", ...
};
DataSheetPeak data_sheet_bf16_peak(const std::string& gpu_name);

}  // namespace spillway
