// Machine: op and copy times from rates, and the presets of the machines we know.
//
// Derived op time (when no measurement is given):
//   device op: max(flops / matmul_flops_per_s, bytes touched / device_bytes_per_s) + op_launch_s
//   host op:   elements / host_adam_params_per_s (ops with a host implementation,
//              AdamW: attrs.n; other ops: the largest operand's element count)
// Flops and bytes are the op registry's (program/op_registry.h: op_cost_flops,
// op_bytes_moved): flops for matrix products and attention only, every other op is
// memory-bound; bytes: each distinct operand once for Read or Write, twice for
// Update (read and written back); embedding ops touch only the rows their tokens
// select.
#include "sim/machine.h"

#include <algorithm>

#include "program/op_registry.h"

namespace spillway {

namespace {

double tensor_numel(const Program& program, TensorId t) {
  if (t < 0 || static_cast<size_t>(t) >= program.tensors.size()) return 0;
  return static_cast<double>(program.tensors.info(t).shape.numel());
}

}  // namespace

double Machine::op_seconds(const Program& program, size_t op_index) const {
  if (measured_op_seconds.size() == program.ops.size() && op_index < measured_op_seconds.size() &&
      measured_op_seconds[op_index] > 0)
    return measured_op_seconds[op_index];
  if (op_index >= program.ops.size()) return 0;
  const Op& op = program.ops[op_index];
  if (op.place == Place::Host) {
    double elements = 0;
    if (op_info(op.kind).host) {
      elements = static_cast<double>(op.attrs.n);
    } else {
      for (const Operand& o : op.operands) elements = std::max(elements, tensor_numel(program, o.tensor));
    }
    return host_adam_params_per_s > 0 ? elements / host_adam_params_per_s : 0;
  }
  const double compute = matmul_flops_per_s > 0 ? op_cost_flops(op) / matmul_flops_per_s : 0;
  const double memory = device_bytes_per_s > 0 ? op_bytes_moved(program, op) / device_bytes_per_s : 0;
  return std::max(compute, memory) + op_launch_s;
}

double Machine::copy_seconds(uint64_t bytes, bool h2d) const {
  const double rate = h2d ? h2d_bytes_per_s : d2h_bytes_per_s;
  return rate > 0 ? static_cast<double>(bytes) / rate : 0;
}

Machine Machine::h200() {
  Machine m;
  m.name = "h200";
  m.device_bytes = 141'000'000'000ull;
  m.host_bytes = 128ull << 30;
  m.h2d_bytes_per_s = 55e9;
  m.d2h_bytes_per_s = 55e9;
  m.duplex_factor = 101.0 / 110.0;  // both directions together move about 101 GB/s
  m.storage_read_bytes_per_s = 1.7e9;
  m.storage_write_bytes_per_s = 1.7e9;
  m.matmul_flops_per_s = 784e12;  // bf16 dense, measured on 8192³ products
  m.device_bytes_per_s = 3.5e12;  // achieved by elementwise kernels (4.8 TB/s peak)
  m.op_launch_s = 5e-6;
  m.host_adam_params_per_s = 4.4e9;  // bf16, 16 threads: 4.11 and 4.64 G/s (bench/RESULTS.md)
  m.host_runs_ahead = true;
  return m;
}

Machine Machine::cpu_dev_box() {
  Machine m;
  m.name = "cpu-dev-box";
  m.device_bytes = 8ull << 30;  // the CPU backend's arena stands in for the device
  m.host_bytes = 16ull << 30;
  m.h2d_bytes_per_s = 5e9;      // memcpy by the copy engine's worker thread
  m.d2h_bytes_per_s = 5e9;
  m.duplex_factor = 0.6;        // two memcpy threads share one memory bus
  m.compute_share_while_copying = 0.7;  // copy threads take cores and memory bandwidth
  m.storage_read_bytes_per_s = 1e9;
  m.storage_write_bytes_per_s = 1e9;
  m.matmul_flops_per_s = 120e9;  // OpenBLAS sgemm on 2 cores: gpt2-124m 1x128 then predicts 96 tokens/s (129-151 measured)
  m.device_bytes_per_s = 10e9;
  m.op_launch_s = 2e-6;
  m.host_adam_params_per_s = 1.4e9;  // bf16, 2 threads: 1.42 G/s (bench/RESULTS.md)
  m.host_runs_ahead = false;    // CPU ops run on the host thread
  return m;
}

}  // namespace spillway
