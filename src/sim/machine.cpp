// Machine: op and copy times from rates, and the presets of the machines we know.
//
// Derived op time (when no measurement is given):
//   device op of a fitted kind (op_fits): op_launch_s + fixed_s + work / rate
//              + bytes / bytes_per_s, work being the kind's flops (op_cost_flops) if it
//              has any, else its bytes
//   other device op: max(flops / matmul_flops_per_s (attention: attention_flops_per_s),
//              bytes touched / device_bytes_per_s) + op_launch_s
//   host op:   elements / host_adam_params_per_s (ops with a host implementation,
//              AdamW: attrs.n; other ops: the largest operand's element count)
// Flops and bytes are the op registry's (program/op_registry.h: op_cost_flops,
// op_bytes_moved): flops for matrix products and attention only, every other op is
// memory-bound; bytes: each distinct operand once for Read or Write, twice for
// Update (read and written back); embedding ops touch only the rows their tokens
// select.
#include "sim/machine.h"

#include <cctype>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <fstream>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/atomic_file.h"
#include "core/input_file.h"

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
  const double bytes = static_cast<double>(op_bytes_moved(program, op));
  if (const OpFit& fit = op_fit(op.kind); fit.measured()) return op_launch_s + fit.seconds(op_rate_work(program, op), bytes);
  const OpKindInfo& info = op_info(op.kind);
  if (info.priced_as && op_fit(*info.priced_as).measured()) {
    double s = op_launch_s + op_fit(*info.priced_as).seconds(op_rate_work(program, op), bytes);
    if (info.priced_with && op_fit(*info.priced_with).measured()) {
      const double part = info.priced_with_bytes(program, op);
      s += op_launch_s + op_fit(*info.priced_with).seconds(part, part);
    }
    return s;
  }
  const double rate = info.op_class == OpClass::Attention ? attention_flops_per_s : matmul_flops_per_s;
  const double compute = rate > 0 ? op_cost_flops(op) / rate : 0;
  const double memory = device_bytes_per_s > 0 ? bytes / device_bytes_per_s : 0;
  // An elementwise part (priced_with) is priced as its own kernel, as it ran before
  // any measurement of the fused kind.
  double part = 0;
  if (info.priced_with && device_bytes_per_s > 0)
    part = info.priced_with_bytes(program, op) / device_bytes_per_s + op_launch_s;
  return std::max(compute, memory) + op_launch_s + part;
}

const OpFit& Machine::op_fit(OpKind k) const {
  static const OpFit kNone{};
  const size_t i = static_cast<size_t>(k);
  return i < op_fits.size() ? op_fits[i] : kNone;
}

double op_rate_work(const Program& program, const Op& op) {
  const double flops = op_cost_flops(op);
  return flops > 0 ? flops : op_bytes_moved(program, op);
}

std::vector<OpTiming> op_timings(const Program& program, const std::vector<double>& seconds) {
  std::vector<OpTiming> out;
  for (size_t i = 0; i < program.ops.size() && i < seconds.size(); ++i) {
    const Op& op = program.ops[i];
    if (op.place != Place::Device || static_cast<size_t>(op.kind) >= kOpKindCount || !(seconds[i] > 0)) continue;
    out.push_back({.kind = op.kind,
                   .work = op_rate_work(program, op),
                   .bytes = static_cast<double>(op_bytes_moved(program, op)),
                   .seconds = seconds[i]});
  }
  return out;
}

namespace {

// Weighted least squares over the columns `use` of rows x (each [3]) against y, rows
// weighted by w: the coefficients (0 for unused columns) and the weighted residual, or
// nothing when the columns are dependent (no unique solution).
struct Solved {
  std::array<double, 3> c{};
  double residual = 0;
};
std::optional<Solved> least_squares(const std::vector<std::array<double, 3>>& x, const std::vector<double>& y,
                                    const std::vector<double>& w, const std::array<bool, 3>& use) {
  std::array<int, 3> col{};
  int n = 0;
  for (int j = 0; j < 3; ++j)
    if (use[static_cast<size_t>(j)]) col[static_cast<size_t>(n++)] = j;
  if (n == 0 || static_cast<size_t>(n) > x.size()) return std::nullopt;
  // Columns scaled to a largest |value| of 1: flops, bytes and 1 differ by 10^12.
  std::array<double, 3> scale{1, 1, 1};
  for (int a = 0; a < n; ++a) {
    double most = 0;
    for (const auto& row : x) most = std::max(most, std::fabs(row[static_cast<size_t>(col[static_cast<size_t>(a)])]));
    if (most == 0) return std::nullopt;
    scale[static_cast<size_t>(a)] = most;
  }
  // Normal equations A c = b, A = Xᵀ W² X, b = Xᵀ W² y, solved by Gaussian elimination.
  double A[3][4] = {};
  for (size_t i = 0; i < x.size(); ++i) {
    const double w2 = w[i] * w[i];
    for (int a = 0; a < n; ++a) {
      const double xa = x[i][static_cast<size_t>(col[static_cast<size_t>(a)])] / scale[static_cast<size_t>(a)];
      for (int b = 0; b < n; ++b)
        A[a][b] += w2 * xa * x[i][static_cast<size_t>(col[static_cast<size_t>(b)])] / scale[static_cast<size_t>(b)];
      A[a][n] += w2 * xa * y[i];
    }
  }
  double trace = 0;
  for (int a = 0; a < n; ++a) trace += A[a][a];
  for (int a = 0; a < n; ++a) {
    int pivot = a;
    for (int r = a + 1; r < n; ++r)
      if (std::fabs(A[r][a]) > std::fabs(A[pivot][a])) pivot = r;
    if (!(std::fabs(A[pivot][a]) > 1e-12 * trace)) return std::nullopt;  // dependent columns
    for (int k = 0; k <= n; ++k) std::swap(A[a][k], A[pivot][k]);
    for (int r = 0; r < n; ++r) {
      if (r == a) continue;
      const double f = A[r][a] / A[a][a];
      for (int k = a; k <= n; ++k) A[r][k] -= f * A[a][k];
    }
  }
  Solved s;
  for (int a = 0; a < n; ++a)
    s.c[static_cast<size_t>(col[static_cast<size_t>(a)])] = A[a][n] / A[a][a] / scale[static_cast<size_t>(a)];
  for (size_t i = 0; i < x.size(); ++i) {
    const double e = (s.c[0] * x[i][0] + s.c[1] * x[i][1] + s.c[2] * x[i][2] - y[i]) * w[i];
    s.residual += e * e;
  }
  return s;
}

}  // namespace

double take_off_synchronization(std::vector<OpTiming>* ops, double step_s) {
  if (ops->empty() || !(step_s > 0)) return 0;
  double sum = 0;
  for (const OpTiming& op : *ops) sum += op.seconds;
  if (!(sum > step_s)) return 0;
  const double each = (sum - step_s) / static_cast<double>(ops->size());
  for (OpTiming& op : *ops) op.seconds = std::max(op.seconds - each, 0.0);
  return each;
}

std::array<OpFit, kOpKindCount> fit_op_kinds(const std::vector<OpTiming>& timed, double launch_s) {
  std::array<OpFit, kOpKindCount> fits{};
  for (size_t k = 0; k < kOpKindCount; ++k) {
    const bool has_flops = op_info(static_cast<OpKind>(k)).flops != nullptr;
    std::vector<std::array<double, 3>> x;  // [ops of the kind] (1, work, bytes)
    std::vector<double> y, w;              // seconds beyond launch_s; 1 / √(timed seconds)
    double beyond = 0;
    for (const OpTiming& t : timed) {
      if (static_cast<size_t>(t.kind) != k || !(t.seconds > 0)) continue;
      x.push_back({1.0, t.work, has_flops ? t.bytes : 0.0});
      y.push_back(t.seconds - launch_s);
      w.push_back(1.0 / std::sqrt(t.seconds));
      beyond = std::max(beyond, t.seconds - launch_s);
    }
    if (x.empty() || !(beyond > 0)) continue;
    // The subsets of (fixed, work, bytes), the work-only cost first: among equal fits
    // the earlier stands (one op fits either a rate or a fixed cost exactly).
    static constexpr std::array<std::array<bool, 3>, 7> kSubsets = {{{false, true, false},
                                                                     {true, true, false},
                                                                     {false, true, true},
                                                                     {true, true, true},
                                                                     {true, false, false},
                                                                     {false, false, true},
                                                                     {true, false, true}}};
    std::optional<Solved> best;
    for (const auto& use : kSubsets) {
      if (use[2] && !has_flops) continue;
      auto s = least_squares(x, y, w, use);
      if (!s) continue;
      bool positive = true;
      for (size_t j = 0; j < 3; ++j) positive = positive && (!use[j] || s->c[j] > 0);
      if (!positive) continue;
      if (!best || s->residual < best->residual * (1 - 1e-9)) best = s;
    }
    if (!best) continue;
    fits[k] = {.fixed_s = best->c[0],
               .rate = best->c[1] > 0 ? 1.0 / best->c[1] : 0,
               .bytes_per_s = best->c[2] > 0 ? 1.0 / best->c[2] : 0};
  }
  return fits;
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
  // bf16 matrix products as whole steps run them: 784 TFLOP/s was measured on 8192³
  // products and 417-743 on the layer products of gpt2-124m (bench ops); with the
  // attention rate below, 720 makes the simulator predict the resident steps of
  // gpt2-124m, gpt2-1.5b and gpt-2.7b (472.8k, 44.3k, 31.0k tokens/s measured
  // 2026-12-05 with the Hopper attention kernels) within 1.2%, gpt2-350m (188.1k)
  // 4.4% low.
  m.matmul_flops_per_s = 720e12;
  // Our Hopper flash attention at 124M shapes (B 16, T 1024, 12 heads of 64):
  // forward 0.176 ms, backward 0.545 ms (bench ops, 2026-12-05): 90.2 GFLOP in
  // 0.721 ms.
  m.attention_flops_per_s = 125e12;
  m.device_bytes_per_s = 3.5e12;  // achieved by elementwise kernels (4.8 TB/s peak)
  m.op_launch_s = 5e-6;
  // The host AdamW (bf16, 16 threads) and compute beside copies: `spillway profile
  // --backend cuda` of 2026-12-05 (bench/RESULTS.md, "Seventh call"): 4.69 G params/s
  // alone, 3.30 while host⇄device copies run (they share the host's memory
  // bandwidth); products and attention at 0.928 of their speed while copies run.
  // Copies beside a host op, and the out-of-place (speculative) update against the
  // in-place one, are not measured on this host yet: 1.
  m.host_adam_params_per_s = 3.30e9;
  m.host_adam_params_per_s_alone = 4.69e9;
  m.compute_share_while_copying = 0.928;
  m.host_runs_ahead = true;
  // machines/h200.json holds the same figures (a test checks that they agree).
  m.measured_on = {.date = "2026-12-02, host rates 2026-12-05, attention 2026-12-05",
                   .host = "the lent H200 host (one GPU, 16 cores, 128 GiB RAM, ext4 on virtio /dev/vda)",
                   .cpu = "16 cores",
                   .gpu = "NVIDIA H200, 139.8 GiB",
                   .driver = "not recorded",
                   .notes = "figures of bench/RESULTS.md (2026-12-02): bench io (PCIe 54.9/55.1 GB/s, both 95.7-101; "
                            "disk 1.7 GB/s O_DIRECT), host AdamW and compute beside copies from spillway profile "
                            "--backend cuda of 2026-12-05 (bf16, 16 threads: 4.69 G params/s alone, 3.30 while copies "
                            "run; compute at 0.928 while copies run; copies beside host ops not measured: 1), bench ops (784 TFLOP/s bf16 on 8192^3 products, 417-743 on gpt2-124m's "
                            "layer products; 720 fits the resident steps of gpt2-124m, 1.5b and 2.7b of 2026-12-05 within 1.2%; "
                            "Hopper attention forward 0.176 ms and backward 0.545 ms at B16 T1024 12x64, 2026-12-05: "
                            "125 TFLOP/s); "
                            "storage latency not measured (0)"};
  return m;
}

Machine Machine::cpu_dev_box() {
  // `spillway profile --backend cpu --threads 2` on the dev box, 2026-12-05 01:48 UTC,
  // after 3 s of idle cores (other sessions compile on it; bench/RESULTS.md, "Predicted
  // against measured on the CPU backend", `PROFILE=1 scripts/cpu-predictions.sh`); the
  // figures rounded to 3 digits. The capacities are the CI's choices (the CPU backend's
  // device is host memory), not measurements.
  Machine m;
  m.name = "cpu-dev-box";
  m.device_bytes = 8ull << 30;  // the CPU backend's arena stands in for the device
  m.host_bytes = 16ull << 30;
  m.h2d_bytes_per_s = 1.77e10;  // memcpy by the copy engine's worker thread, 256 MiB pieces
  m.d2h_bytes_per_s = 1.82e10;
  m.duplex_factor = 0.971;      // two memcpy threads, one per direction
  // Compute (a 512^3 product and a residual add over 8 M floats) while copies run, over
  // alone; copies while compute runs: calibrated on an offloaded step of gpt2-124m at
  // 1x256 under 400 MiB (the probe alone said 0.825).
  m.compute_share_while_copying = 0.356;
  m.copy_share_while_computing = 0.165;
  // Beside the host AdamW (f32, 16 M params, 2 threads), each over its speed alone:
  // copies both ways 0.390, compute 0.592 (both run on the two cores), the AdamW
  // 0.479 beside compute (`spillway profile --backend cpu --threads 2`, 2026-12-05
  // 08:00 UTC, with another session's build on the box; the rest of that profile
  // was not kept).
  m.copy_share_while_host_computes = 0.390;
  m.compute_share_while_host_computes = 0.592;
  m.host_share_while_computing = 0.479;
  m.storage_read_bytes_per_s = 3.14e9;    // O_DIRECT, 1 MiB requests, best depth, /tmp
  m.storage_write_bytes_per_s = 2.17e9;
  m.storage_latency_s = 5.93e-5;
  m.matmul_flops_per_s = 1.91e11;  // OpenBLAS sgemm, 512^3 and 1024x768x768
  m.attention_flops_per_s = 6.03e10;  // fwd+bwd at B2 T256 4x32
  m.device_bytes_per_s = 6.39e10;  // residual add over 32 M floats
  m.op_launch_s = 2.74e-8;         // tiny ops back to back
  // Each kind's cost fitted over the ops of five sample steps (gpt2-124m: one layer at
  // 1x128 and 1x512, all twelve at 1x256; tiny: all four at 4x128, one at 16x128;
  // median of 5 profiled steps): fixed seconds, work rate (flop/s for products and
  // attention, bytes/s for the others) and bytes rate (0: no such term).
  auto fit = [&m](OpKind k, double fixed_s, double rate, double bytes_per_s) {
    m.op_fits[static_cast<size_t>(k)] = {.fixed_s = fixed_s, .rate = rate, .bytes_per_s = bytes_per_s};
  };
  fit(OpKind::Zero, 1.44e-7, 2.35e10, 0);
  fit(OpKind::EmbeddingForward, 8.56e-5, 3.05e10, 0);
  fit(OpKind::EmbeddingBackward, 1.24e-5, 9.72e9, 0);
  fit(OpKind::LayerNormForward, 3e-5, 2.57e10, 0);
  fit(OpKind::LayerNormBackward, 7.56e-5, 2.39e10, 0);
  fit(OpKind::MatmulForward, 2.81e-5, 1.84e11, 0);
  fit(OpKind::MatmulBackward, 8.91e-5, 1.99e11, 2.04e10);
  fit(OpKind::AttentionForward, 6.66e-5, 1.36e11, 6.87e9);
  fit(OpKind::AttentionBackward, 7.34e-5, 1.76e11, 7.54e9);
  fit(OpKind::GeluForward, 2.77e-5, 8.25e9, 0);
  fit(OpKind::GeluBackward, 1.77e-5, 9.63e9, 0);
  fit(OpKind::ResidualForward, 2.68e-5, 4.81e10, 0);
  fit(OpKind::CrossEntropyBackward, 2.27e-5, 9.52e9, 0);
  fit(OpKind::SquaredNorm, 8.81e-7, 1.67e10, 0);
  fit(OpKind::ClipScale, 7.84e-7, 2.38e9, 0);
  fit(OpKind::AdamW, 8.73e-7, 7.51e10, 0);
  m.host_adam_params_per_s = 1.86e9;  // f32, 2 threads, while copies run
  m.host_runs_ahead = false;    // CPU ops run on the host thread
  // machines/cpu.json holds the same figures (a test checks that they agree).
  m.host_adam_params_per_s_alone = 3.33e9;
  // Out of place (speculative updates) over in place, f32, 2 threads, 1e8 params:
  // `bench adam --dtype f32 --simd avx512 --iters 7` and the same with --into, two
  // rounds each, 3.31 and 3.24 against 2.94 and 2.91 G params/s (2026-12-05 12:00 UTC,
  // load average 2.2), with the out-of-place update's streaming stores.
  m.host_adam_out_of_place_share = 0.895;
  m.measured_on = {.date = "2026-12-05T01:48:38Z",
                   .host = "this project's dev box (a VM: Debian 12, 23 GiB RAM)",
                   .cpu = "AMD EPYC, 2 cores",
                   .gpu = "CPU, 2 threads",
                   .driver = "none",
                   .notes = "PROFILE=1 scripts/cpu-predictions.sh (spillway profile --backend cpu --threads 2 with the "
                            "default op samples and offloaded step), rounded to 3 digits; device and host capacities "
                            "are the CI's choices, not measured; bench/RESULTS.md, 'Predicted against measured on the "
                            "CPU backend'; the three shares beside the host AdamW from spillway profile of "
                            "2026-12-05 08:00 (format 6)"};
  return m;
}

}  // namespace spillway

// ---- machine files ----

namespace spillway {

namespace {

constexpr const char* kMachineFormat = "spillway-machine";

using Json = nlohmann::ordered_json;

// Reads the fields of one JSON object, each once; finish() reports keys nobody read.
class FieldReader {
 public:
  FieldReader(const nlohmann::json& object, std::string where, std::string source)
      : object_(object), where_(std::move(where)), source_(std::move(source)) {}

  Status error(const std::string& key, const std::string& what) const {
    return Status::invalid_argument("machine file " + source_ + ": " + where_ + key + ": " + what);
  }
  Result<const nlohmann::json*> get(const std::string& key) {
    auto it = object_.find(key);
    if (it == object_.end()) return error(key, "missing (every field is required; `spillway profile` writes them all)");
    seen_.push_back(key);
    return &*it;
  }
  Status string(const std::string& key, std::string* out) {
    SPILLWAY_ASSIGN_OR_RETURN(const nlohmann::json* v, get(key));
    if (!v->is_string()) return error(key, "expected a string, got " + std::string(v->type_name()));
    *out = v->get<std::string>();
    return Status::ok();
  }
  Status boolean(const std::string& key, bool* out) {
    SPILLWAY_ASSIGN_OR_RETURN(const nlohmann::json* v, get(key));
    if (!v->is_boolean()) return error(key, "expected true or false, got " + std::string(v->type_name()));
    *out = v->get<bool>();
    return Status::ok();
  }
  Status bytes(const std::string& key, uint64_t* out) {
    SPILLWAY_ASSIGN_OR_RETURN(const nlohmann::json* v, get(key));
    if (!v->is_number_unsigned())
      return error(key, "expected a whole number of bytes (0 or more), got " +
                            (v->is_number() ? v->dump() : std::string(v->type_name())));
    *out = v->get<uint64_t>();
    return Status::ok();
  }
  // A finite number ≥ 0 (> 0 when `positive`), at most `most`.
  Status number(const std::string& key, double* out, bool positive, double most = INFINITY) {
    SPILLWAY_ASSIGN_OR_RETURN(const nlohmann::json* v, get(key));
    if (!v->is_number()) return error(key, "expected a number, got " + std::string(v->type_name()));
    const double x = v->get<double>();
    if (!std::isfinite(x) || x < 0 || (positive && x == 0) || x > most) {
      std::ostringstream range;
      range << (positive ? "above 0" : "0 or more");
      if (std::isfinite(most)) range << " and at most " << most;
      return error(key, "expected a number " + range.str() + ", got " + v->dump());
    }
    *out = x;
    return Status::ok();
  }
  Status finish() const {
    for (auto it = object_.begin(); it != object_.end(); ++it) {
      bool known = false;
      for (const std::string& k : seen_) known = known || k == it.key();
      if (!known) return error(it.key(), "unknown key");
    }
    return Status::ok();
  }

 private:
  const nlohmann::json& object_;
  std::string where_, source_;
  std::vector<std::string> seen_;
};

}  // namespace

std::string Machine::to_json() const {
  Json j;
  j["format"] = kMachineFormat;
  j["version"] = kMachineFormatVersion;
  j["name"] = name;
  j["measured_on"] = Json{{"date", measured_on.date},     {"host", measured_on.host},
                          {"cpu", measured_on.cpu},       {"gpu", measured_on.gpu},
                          {"driver", measured_on.driver}, {"notes", measured_on.notes}};
  j["device_bytes"] = device_bytes;
  j["host_bytes"] = host_bytes;
  j["storage_bytes"] = storage_bytes;
  j["h2d_bytes_per_s"] = h2d_bytes_per_s;
  j["d2h_bytes_per_s"] = d2h_bytes_per_s;
  j["duplex_factor"] = duplex_factor;
  j["compute_share_while_copying"] = compute_share_while_copying;
  j["copy_share_while_computing"] = copy_share_while_computing;
  j["copy_share_while_host_computes"] = copy_share_while_host_computes;
  j["compute_share_while_host_computes"] = compute_share_while_host_computes;
  j["host_share_while_computing"] = host_share_while_computing;
  j["storage_read_bytes_per_s"] = storage_read_bytes_per_s;
  j["storage_write_bytes_per_s"] = storage_write_bytes_per_s;
  j["storage_duplex_factor"] = storage_duplex_factor;
  j["storage_latency_s"] = storage_latency_s;
  j["matmul_flops_per_s"] = matmul_flops_per_s;
  j["attention_flops_per_s"] = attention_flops_per_s;
  j["device_bytes_per_s"] = device_bytes_per_s;
  j["op_launch_s"] = op_launch_s;
  Json fits = Json::object();
  for (size_t k = 0; k < kOpKindCount; ++k)
    if (op_fits[k].measured())
      fits[op_kind_name(static_cast<OpKind>(k))] =
          Json{{"fixed_s", op_fits[k].fixed_s}, {"rate", op_fits[k].rate}, {"bytes_per_s", op_fits[k].bytes_per_s}};
  j["op_fits"] = fits;
  j["host_adam_params_per_s"] = host_adam_params_per_s;
  j["host_adam_params_per_s_alone"] = host_adam_params_per_s_alone;
  j["host_adam_out_of_place_share"] = host_adam_out_of_place_share;
  j["host_runs_ahead"] = host_runs_ahead;
  j["measured_op_seconds"] = measured_op_seconds;
  return j.dump(2) + "\n";
}

Result<Machine> Machine::from_json(const std::string& text, const std::string& source) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {  // a syntax error, or a number beyond double (1e999)
    return Status::invalid_argument("machine file " + source + ": not JSON: " + e.what());
  }
  if (!j.is_object())
    return Status::invalid_argument("machine file " + source + ": expected a JSON object, got " +
                                    std::string(j.type_name()));
  FieldReader r(j, "", source);
  std::string format;
  SPILLWAY_RETURN_IF_ERROR(r.string("format", &format));
  if (format != kMachineFormat) return r.error("format", "expected \"" + std::string(kMachineFormat) + "\", got \"" + format + "\"");
  uint64_t version = 0;
  SPILLWAY_RETURN_IF_ERROR(r.bytes("version", &version));
  if (version < 2 || version > static_cast<uint64_t>(kMachineFormatVersion))
    return r.error("version", "this build reads versions 2 to " + std::to_string(kMachineFormatVersion) +
                                  ", the file is version " + std::to_string(version) +
                                  " (profile the machine again with this build)");
  Machine m;
  SPILLWAY_RETURN_IF_ERROR(r.string("name", &m.name));
  {
    SPILLWAY_ASSIGN_OR_RETURN(const nlohmann::json* on, r.get("measured_on"));
    if (!on->is_object()) return r.error("measured_on", "expected an object, got " + std::string(on->type_name()));
    FieldReader o(*on, "measured_on.", source);
    SPILLWAY_RETURN_IF_ERROR(o.string("date", &m.measured_on.date));
    SPILLWAY_RETURN_IF_ERROR(o.string("host", &m.measured_on.host));
    SPILLWAY_RETURN_IF_ERROR(o.string("cpu", &m.measured_on.cpu));
    SPILLWAY_RETURN_IF_ERROR(o.string("gpu", &m.measured_on.gpu));
    SPILLWAY_RETURN_IF_ERROR(o.string("driver", &m.measured_on.driver));
    SPILLWAY_RETURN_IF_ERROR(o.string("notes", &m.measured_on.notes));
    SPILLWAY_RETURN_IF_ERROR(o.finish());
  }
  SPILLWAY_RETURN_IF_ERROR(r.bytes("device_bytes", &m.device_bytes));
  SPILLWAY_RETURN_IF_ERROR(r.bytes("host_bytes", &m.host_bytes));
  SPILLWAY_RETURN_IF_ERROR(r.bytes("storage_bytes", &m.storage_bytes));
  SPILLWAY_RETURN_IF_ERROR(r.number("h2d_bytes_per_s", &m.h2d_bytes_per_s, true));
  SPILLWAY_RETURN_IF_ERROR(r.number("d2h_bytes_per_s", &m.d2h_bytes_per_s, true));
  SPILLWAY_RETURN_IF_ERROR(r.number("duplex_factor", &m.duplex_factor, true, 1.0));
  SPILLWAY_RETURN_IF_ERROR(r.number("compute_share_while_copying", &m.compute_share_while_copying, true, 1.0));
  if (version >= 4)  // before: copies at full speed while compute runs
    SPILLWAY_RETURN_IF_ERROR(r.number("copy_share_while_computing", &m.copy_share_while_computing, true, 1.0));
  if (version >= 5)  // before: copies at full speed while a host op runs
    SPILLWAY_RETURN_IF_ERROR(
        r.number("copy_share_while_host_computes", &m.copy_share_while_host_computes, true, 1.0));
  if (version >= 6) {  // before: compute and host ops at full speed side by side
    SPILLWAY_RETURN_IF_ERROR(
        r.number("compute_share_while_host_computes", &m.compute_share_while_host_computes, true, 1.0));
    SPILLWAY_RETURN_IF_ERROR(r.number("host_share_while_computing", &m.host_share_while_computing, true, 1.0));
  }
  SPILLWAY_RETURN_IF_ERROR(r.number("storage_read_bytes_per_s", &m.storage_read_bytes_per_s, true));
  SPILLWAY_RETURN_IF_ERROR(r.number("storage_write_bytes_per_s", &m.storage_write_bytes_per_s, true));
  if (version >= 8)  // before: reads and writes one at a time, as one queue
    SPILLWAY_RETURN_IF_ERROR(r.number("storage_duplex_factor", &m.storage_duplex_factor, true, 1.0));
  SPILLWAY_RETURN_IF_ERROR(r.number("storage_latency_s", &m.storage_latency_s, false));
  SPILLWAY_RETURN_IF_ERROR(r.number("matmul_flops_per_s", &m.matmul_flops_per_s, true));
  SPILLWAY_RETURN_IF_ERROR(r.number("attention_flops_per_s", &m.attention_flops_per_s, true));
  SPILLWAY_RETURN_IF_ERROR(r.number("device_bytes_per_s", &m.device_bytes_per_s, true));
  SPILLWAY_RETURN_IF_ERROR(r.number("op_launch_s", &m.op_launch_s, false));
  // Version 2 files have no fitted kinds (every kind from the class rates); version 3
  // files have one rate per kind ("op_rates"), read as a fit of that rate alone.
  if (version >= 3) {
    const std::string key = version == 3 ? "op_rates" : "op_fits";
    SPILLWAY_ASSIGN_OR_RETURN(const nlohmann::json* kinds, r.get(key));
    if (!kinds->is_object())
      return r.error(key, "expected an object of op kind names to " + std::string(version == 3 ? "rates" : "fits") +
                              ", got " + std::string(kinds->type_name()));
    FieldReader o(*kinds, key + ".", source);
    for (auto it = kinds->begin(); it != kinds->end(); ++it) {
      size_t k = 0;
      while (k < kOpKindCount && it.key() != op_kind_name(static_cast<OpKind>(k))) ++k;
      if (k == kOpKindCount)
        return o.error(it.key(), "not a kind of op (kinds are named as in the op registry: MatmulForward, GeluBackward, ...)");
      OpFit& fit = m.op_fits[k];
      if (version == 3) {
        SPILLWAY_RETURN_IF_ERROR(o.number(it.key(), &fit.rate, true));
        continue;
      }
      SPILLWAY_ASSIGN_OR_RETURN(const nlohmann::json* f, o.get(it.key()));
      if (!f->is_object())
        return o.error(it.key(), "expected an object with fixed_s, rate and bytes_per_s, got " + std::string(f->type_name()));
      FieldReader fr(*f, key + "." + it.key() + ".", source);
      SPILLWAY_RETURN_IF_ERROR(fr.number("fixed_s", &fit.fixed_s, false));
      SPILLWAY_RETURN_IF_ERROR(fr.number("rate", &fit.rate, false));
      SPILLWAY_RETURN_IF_ERROR(fr.number("bytes_per_s", &fit.bytes_per_s, false));
      SPILLWAY_RETURN_IF_ERROR(fr.finish());
      if (!fit.measured()) return o.error(it.key(), "every term is 0 (leave an unmeasured kind out)");
      if (fit.bytes_per_s > 0 && op_info(static_cast<OpKind>(k)).flops == nullptr)
        return fr.error("bytes_per_s", "only kinds with flops have a bytes term (this kind's work is its bytes)");
    }
    SPILLWAY_RETURN_IF_ERROR(o.finish());
  }
  SPILLWAY_RETURN_IF_ERROR(r.number("host_adam_params_per_s", &m.host_adam_params_per_s, true));
  SPILLWAY_RETURN_IF_ERROR(r.number("host_adam_params_per_s_alone", &m.host_adam_params_per_s_alone, false));
  if (version >= 7)  // before: speculative updates at the in-place rate
    SPILLWAY_RETURN_IF_ERROR(
        r.number("host_adam_out_of_place_share", &m.host_adam_out_of_place_share, true, 1.0));
  SPILLWAY_RETURN_IF_ERROR(r.boolean("host_runs_ahead", &m.host_runs_ahead));
  {
    SPILLWAY_ASSIGN_OR_RETURN(const nlohmann::json* ops, r.get("measured_op_seconds"));
    if (!ops->is_array())
      return r.error("measured_op_seconds", "expected an array of seconds, got " + std::string(ops->type_name()));
    for (size_t i = 0; i < ops->size(); ++i) {
      const nlohmann::json& v = (*ops)[i];
      if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < 0)
        return r.error("measured_op_seconds[" + std::to_string(i) + "]", "expected seconds (0 or more), got " + v.dump());
      m.measured_op_seconds.push_back(v.get<double>());
    }
  }
  SPILLWAY_RETURN_IF_ERROR(r.finish());
  return m;
}

Result<Machine> load_machine(const std::string& file_or_preset) {
  if (file_or_preset == "h200") return Machine::h200();
  if (file_or_preset == "cpu") return Machine::cpu_dev_box();
  if (Status r = check_regular_file(file_or_preset, "machine file"); !r.is_ok() && r.code() != StatusCode::NotFound)
    return r;
  std::ifstream in(file_or_preset, std::ios::binary);
  if (!in) {
    const int err = errno;
    return errno_status("machine: '" + file_or_preset + "' is not a preset (h200, cpu) and cannot be opened as a file",
                        err);
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return Status::io_error("machine file " + file_or_preset + ": read failed");
  return Machine::from_json(text.str(), file_or_preset);
}

Status save_machine(const Machine& m, const std::string& path) {
  return write_file_atomically(path, m.to_json());
}

std::string nvidia_driver_version_from(const std::string& first_line) {
  size_t i = 0;
  while (i < first_line.size()) {
    while (i < first_line.size() && std::isspace(static_cast<unsigned char>(first_line[i]))) ++i;
    size_t end = i;
    while (end < first_line.size() && !std::isspace(static_cast<unsigned char>(first_line[end]))) ++end;
    const std::string word = first_line.substr(i, end - i);
    bool digits = !word.empty() && std::isdigit(static_cast<unsigned char>(word.front())) &&
                  std::isdigit(static_cast<unsigned char>(word.back()));
    bool dot = false;
    for (char ch : word) {
      dot |= ch == '.';
      digits &= std::isdigit(static_cast<unsigned char>(ch)) || ch == '.';
    }
    if (digits && dot) return word;
    i = end;
  }
  return "unknown";
}

DataSheetPeak data_sheet_bf16_peak(const std::string& gpu_name) {
  // Dense bf16 tensor TFLOP/s from NVIDIA's data sheets (the sparse figures are twice
  // these). CUDA names the SXM parts by memory ("NVIDIA H100 80GB HBM3", "NVIDIA
  // H200"), the others by form factor ("NVIDIA H100 PCIe", "NVIDIA H100 NVL").
  struct Row {
    const char* family;  // a word of the name
    const char* variant; // a second word that must also appear ("" for the default)
    double tflops;
    const char* part;
  };
  static const Row rows[] = {
      {"H200", "NVL", 835, "H200 NVL"},   {"H200", "", 989, "H200 SXM"},   {"GH200", "", 989, "GH200"},
      {"H100", "PCIe", 756, "H100 PCIe"}, {"H100", "NVL", 835, "H100 NVL"}, {"H100", "", 989.4, "H100 SXM"},
      {"H800", "PCIe", 756, "H800 PCIe"}, {"H800", "", 989.4, "H800 SXM"},  {"A100", "", 312, "A100"},
      {"L40S", "", 362.05, "L40S"},
  };
  const auto has_word = [&](const char* w) {
    // a whole word of the name: "H100" in "NVIDIA H100 PCIe", not in "GH100X"
    const std::string word(w);
    for (size_t at = gpu_name.find(word); at != std::string::npos; at = gpu_name.find(word, at + 1)) {
      const bool starts = at == 0 || !std::isalnum(static_cast<unsigned char>(gpu_name[at - 1]));
      const size_t end = at + word.size();
      const bool ends = end == gpu_name.size() || !std::isalnum(static_cast<unsigned char>(gpu_name[end]));
      if (starts && ends) return true;
    }
    return false;
  };
  for (const Row& r : rows) {
    // A100 names carry their form after a dash ("NVIDIA A100-SXM4-80GB"): the dash ends a word.
    if (has_word(r.family) && (*r.variant == '\0' || has_word(r.variant))) return {r.tflops * 1e12, r.part};
  }
  return {};
}

}  // namespace spillway
