// Simulator, Machine and Profiler: hand-built programs and plans with times worked
// out by hand, then a planned GPT step and a profile on the CPU backend.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <tuple>

#include "backend/backend.h"
#include "model/model.h"
#include "plan/planner.h"
#include "sim/machine.h"
#include "exec/op_timer.h"
#include "sim/profiler.h"
#include "sim/simulator.h"

using namespace spillway;

namespace {

constexpr double kMs = 1e-3;
constexpr double kTol = 1e-12;
constexpr int64_t kN = 1000;  // elements of most test tensors: 4000 bytes of F32

// Copies of 4000 bytes take 1 ms each way; every op takes 2 ms.
Machine test_machine(const Program& p, bool host_runs_ahead) {
  Machine m;
  m.name = "test";
  m.h2d_bytes_per_s = 4e6;
  m.d2h_bytes_per_s = 4e6;
  m.duplex_factor = 0.5;
  m.storage_read_bytes_per_s = 2e6;
  m.storage_write_bytes_per_s = 1e6;
  m.op_launch_s = 0;
  m.host_runs_ahead = host_runs_ahead;
  m.measured_op_seconds.assign(p.ops.size(), 2 * kMs);
  return m;
}

TensorId add(Program& p, const std::string& name, Role role, int64_t n = kN) {
  return p.tensors.add({name, DType::F32, {n}, role});
}

size_t gelu(Program& p, const std::string& name, TensorId out, TensorId in, Place place = Place::Device) {
  return p.add_op({.kind = OpKind::GeluForward,
                   .name = name,
                   .operands = {{out, Access::Write}, {in, Access::Read}},
                   .attrs = {.n = p.tensors.info(in).shape.numel()},
                   .place = place});
}

Instruction run(int op) { return {.kind = InstrKind::Run, .op = op}; }
Instruction alloc(TensorId t, uint64_t off) { return {.kind = InstrKind::Allocate, .tensor = t, .offset = off}; }
Instruction fetch(TensorId t, uint64_t off) { return {.kind = InstrKind::Fetch, .tensor = t, .offset = off}; }
Instruction evict(TensorId t, bool write_back = true) {
  return {.kind = InstrKind::Evict, .tensor = t, .write_back = write_back};
}
Instruction release(TensorId t) { return {.kind = InstrKind::Release, .tensor = t}; }
Instruction load(TensorId t) { return {.kind = InstrKind::Load, .tensor = t}; }
Instruction store(TensorId t, bool free_host) { return {.kind = InstrKind::Store, .tensor = t, .free_host = free_host}; }
Instruction host_release(TensorId t) { return {.kind = InstrKind::HostRelease, .tensor = t}; }
Instruction host_alloc(TensorId t, uint64_t off) { return {.kind = InstrKind::HostAllocate, .tensor = t, .offset = off}; }

Plan make_plan_of(const Program& p, std::vector<Instruction> instructions,
                  std::map<TensorId, std::pair<Tier, uint64_t>> homes) {
  Plan plan;
  plan.policy = Policy::Planned;
  plan.instructions = std::move(instructions);
  plan.home.assign(p.tensors.size(), Tier::Device);
  plan.home_offset.assign(p.tensors.size(), 0);
  plan.home_host_offset.assign(p.tensors.size(), 0);
  for (auto& [t, h] : homes) {
    plan.home[t] = h.first;
    (h.first == Tier::Host ? plan.home_host_offset : plan.home_offset)[t] = h.second;
  }
  return plan;
}

// The replay of a plan the residency machine accepts throughout.
SimResult simulate_checked(const Program& p, const Plan& plan, const Machine& m) {
  SimResult r = simulate(p, plan, m);
  EXPECT_EQ(r.plan_error, "");
  return r;
}

const SimEvent* find_event(const SimResult& r, SimResource res, const std::string& name) {
  for (const SimEvent& e : r.timeline)
    if (e.resource == res && e.name == name) return &e;
  return nullptr;
}

// op0: b = gelu(a) on device-homed a; op1: c = gelu(w) on host-homed w.
struct FetchCase {
  Program p;
  TensorId a, w, b, c;
  FetchCase() {
    a = add(p, "a", Role::Input);
    w = add(p, "w", Role::Param);
    b = add(p, "b", Role::Activation);
    c = add(p, "c", Role::Activation);
    gelu(p, "op0", b, a);
    gelu(p, "op1", c, w);
  }
  Plan plan(bool early) const {
    std::vector<Instruction> in = {alloc(b, 4096)};
    if (early) in.push_back(fetch(w, 8192));
    in.push_back(run(0));
    if (!early) in.push_back(fetch(w, 8192));
    for (Instruction i : {alloc(c, 12288), run(1), release(w), release(b), release(c)}) in.push_back(i);
    return make_plan_of(p, in, {{a, {Tier::Device, 0}}, {w, {Tier::Host, 0}}});
  }
};

}  // namespace

TEST(Machine, DerivedOpSecondsFollowRates) {
  Program p;
  TensorId out = p.tensors.add({"out", DType::F32, {4, 16}, Role::Activation});
  TensorId inp = p.tensors.add({"inp", DType::F32, {4, 8}, Role::Activation});
  TensorId w = p.tensors.add({"w", DType::F32, {16, 8}, Role::Param});
  p.add_op({.kind = OpKind::MatmulForward,
            .name = "mm",
            .operands = {{out, Access::Write}, {inp, Access::Read}, {w, Access::Read}},
            .attrs = {.C = 8, .OC = 16, .N = 4}});
  TensorId x = add(p, "x", Role::Activation), y = add(p, "y", Role::Activation);
  gelu(p, "gelu", y, x);
  p.add_op({.kind = OpKind::AdamW, .name = "adam", .operands = {}, .attrs = {.n = 1000}, .place = Place::Host});

  Machine m;
  m.matmul_flops_per_s = 1e9;
  m.device_bytes_per_s = 1e9;
  m.op_launch_s = 1e-6;
  m.host_adam_params_per_s = 1e6;
  // matmul: 2·4·8·16 = 1024 flops (1.024 us) beats 896 bytes (0.896 us)
  EXPECT_NEAR(m.op_seconds(p, 0), 1.024e-6 + 1e-6, kTol);
  // gelu: 8000 bytes touched
  EXPECT_NEAR(m.op_seconds(p, 1), 8e-6 + 1e-6, kTol);
  // host AdamW: n / params per second
  EXPECT_NEAR(m.op_seconds(p, 2), 1e-3, kTol);
  EXPECT_NEAR(m.copy_seconds(4000, true), 4000 / m.h2d_bytes_per_s, kTol);

  m.measured_op_seconds = {0.5, 0.25, 0.125};
  EXPECT_EQ(m.op_seconds(p, 1), 0.25);
  m.measured_op_seconds = {0.5};  // measured for another program: ignored
  EXPECT_NEAR(m.op_seconds(p, 1), 9e-6, kTol);
}

// The predicted tokens/s of a resident gpt2-124m step of B×T on machine m.
static double predicted_tokens_per_s(const Machine& m, int B, int T, DType act) {
  auto cfg = model_preset("gpt2-124m");
  EXPECT_TRUE(cfg.ok());
  if (!cfg.ok()) return 0;
  auto program = build_training_program(*cfg, {.B = B, .T = T, .accum = 1}, act);
  EXPECT_TRUE(program.ok()) << program.status().to_string();
  if (!program.ok()) return 0;
  auto plan = make_plan(*program, Simulator(m), {}, {.policy = Policy::Resident});
  EXPECT_TRUE(plan.ok()) << plan.status().to_string();
  if (!plan.ok()) return 0;
  return static_cast<double>(B) * T / simulate(*program, *plan, m).step_s;
}

// Each preset against what was measured on its machine (bench/RESULTS.md), the
// figures written here from that record, not from machine.cpp, so that a preset
// that drifts from its machine, or a typo in one, fails. Bands: ±10% for the H200
// host's links (dedicated hardware), ±25% for its virtio disk and memory-bound host
// AdamW (shared host, swings between runs), a factor of 2 on the 2-core dev box
// (shared by several sessions; its speed swings by ±40%). The whole-step checks tie
// the compute rates (matmul, memory-bound ops, launch) to measured training steps.
TEST(Machine, PresetsAgreeWithTheMeasuredMachines) {
  auto within = [](const char* what, double preset, double lo, double hi, double band) {
    EXPECT_GE(preset, lo / band) << what << ": measured " << lo << " to " << hi;
    EXPECT_LE(preset, hi * band) << what << ": measured " << lo << " to " << hi;
  };
  const Machine h = Machine::h200();
  // CUDA copy engine, scripts/device-bench.sh: 54.94 / 55.13 GB/s alone, 95.73 both at once.
  within("h200 h2d", h.h2d_bytes_per_s, 54.94e9, 54.94e9, 1.10);
  within("h200 d2h", h.d2h_bytes_per_s, 55.13e9, 55.13e9, 1.10);
  within("h200 both directions", (h.h2d_bytes_per_s + h.d2h_bytes_per_s) * h.duplex_factor, 95.73e9, 95.73e9, 1.10);
  // Storage, 1 GiB through uring and threads: read 1.28-1.46 GB/s, write 1.49-1.77.
  within("h200 storage read", h.storage_read_bytes_per_s, 1.28e9, 1.46e9, 1.25);
  within("h200 storage write", h.storage_write_bytes_per_s, 1.49e9, 1.77e9, 1.25);
  // Host AdamW, bf16, 16 threads: 4.11 and 4.64 G params/s (means of two runs).
  within("h200 host AdamW", h.host_adam_params_per_s, 4.11e9, 4.64e9, 1.25);
  // Matrix products at 124M shapes ran at 417-743 TFLOP/s; H200 dense bf16 peak is 989.
  within("h200 matmul", h.matmul_flops_per_s, 417e12, 989e12, 1.0);
  // Training gpt2-124m, micro-batch 16 × 1024, on the GPU: 472.8k tokens/s (2026-12-05, Hopper attention).
  within("h200 gpt2-124m step", predicted_tokens_per_s(h, 16, 1024, DType::BF16), 472.8e3, 472.8e3, 1.05);
  EXPECT_TRUE(h.host_runs_ahead);  // CUDA launches return before the kernels finish

  const Machine c = Machine::cpu_dev_box();
  // CPU copy engine, 64 and 256 MiB pieces (spillway profile, 2026-12-05): 17.7-18.3 h2d,
  // 17.4-18.2 d2h, 34.6-34.8 both (2026-12-02, 1 GiB: 7.8-10.8, 7.2-11.0, 7.0-12.4).
  within("dev box h2d", c.h2d_bytes_per_s, 7.76e9, 18.34e9, 1.25);
  within("dev box d2h", c.d2h_bytes_per_s, 7.20e9, 18.19e9, 1.25);
  within("dev box both directions", (c.h2d_bytes_per_s + c.d2h_bytes_per_s) * c.duplex_factor, 7.00e9, 34.83e9, 1.25);
  // Host AdamW, bf16, 2 threads: 1.06 (AVX2) to 1.47 (AVX-512 best) G params/s.
  within("dev box host AdamW", c.host_adam_params_per_s, 1.06e9, 1.47e9, 2.0);
  // Training gpt2-124m resident, 1 × 128, on the CPU backend: 129 and 151 tokens/s.
  within("dev box gpt2-124m step", predicted_tokens_per_s(c, 1, 128, DType::F32), 129, 151, 2.0);
  EXPECT_FALSE(c.host_runs_ahead);  // CPU ops run on the issuing thread
}

TEST(Simulator, EarlyFetchHidesBehindCompute) {
  FetchCase f;
  for (bool ahead : {false, true}) {
    SCOPED_TRACE(ahead ? "host runs ahead" : "host blocked by runs");
    Machine m = test_machine(f.p, ahead);
    SimResult r = simulate_checked(f.p, f.plan(/*early=*/true), m);
    EXPECT_NEAR(r.step_s, 4 * kMs, kTol);
    EXPECT_NEAR(r.stall_s, 0, kTol);
    EXPECT_NEAR(r.compute_s, 4 * kMs, kTol);
    EXPECT_EQ(r.h2d_bytes, 4000u);
    const SimEvent* copy = find_event(r, SimResource::H2D, "w");
    ASSERT_NE(copy, nullptr);
    EXPECT_NEAR(copy->start_s, 0, kTol);
    EXPECT_NEAR(copy->end_s, 1 * kMs, kTol);
  }
}

// On a machine whose copies and compute share the cores (the CPU backend), a copy
// slows while compute runs (copy_share_while_computing), and compute while a copy
// runs (compute_share_while_copying).
TEST(Simulator, CopiesAndComputeSlowEachOtherWhereTheyShare) {
  FetchCase f;
  for (bool ahead : {false, true}) {
    SCOPED_TRACE(ahead ? "host runs ahead" : "host blocked by runs");
    Machine m = test_machine(f.p, ahead);
    m.copy_share_while_computing = 0.25;
    // w's 4000 bytes at 1e6 B/s beside op0 (0-2 ms): 2000 bytes; the rest at 4e6 B/s
    // after it: 0.5 ms. op1 waits for it: 2.5-4.5 ms.
    SimResult r = simulate_checked(f.p, f.plan(/*early=*/true), m);
    const SimEvent* copy = find_event(r, SimResource::H2D, "w");
    ASSERT_NE(copy, nullptr);
    EXPECT_NEAR(copy->end_s, 2.5 * kMs, kTol);
    EXPECT_NEAR(r.stall_s, 0.5 * kMs, kTol);
    EXPECT_NEAR(r.step_s, 4.5 * kMs, kTol);
    // Both ways: op0 at half speed and the copy at a quarter beside each other; both
    // end at 4 ms (2 ms of op0's work, 4000 bytes at 1e6 B/s); op1 4-6 ms.
    m.compute_share_while_copying = 0.5;
    r = simulate_checked(f.p, f.plan(/*early=*/true), m);
    EXPECT_NEAR(find_event(r, SimResource::H2D, "w")->end_s, 4 * kMs, kTol);
    EXPECT_NEAR(find_event(r, SimResource::Compute, "op0")->end_s, 4 * kMs, kTol);
    EXPECT_NEAR(r.step_s, 6 * kMs, kTol);
  }
}

TEST(Simulator, LateFetchStallsForTheCopy) {
  FetchCase f;
  for (bool ahead : {false, true}) {
    SCOPED_TRACE(ahead ? "host runs ahead" : "host blocked by runs");
    Machine m = test_machine(f.p, ahead);
    SimResult r = simulate_checked(f.p, f.plan(/*early=*/false), m);
    // The copy starts after op0 (issued before it), takes 1 ms; op1 waits for it.
    const SimEvent* copy = find_event(r, SimResource::H2D, "w");
    ASSERT_NE(copy, nullptr);
    EXPECT_NEAR(copy->start_s, 2 * kMs, kTol);
    EXPECT_NEAR(copy->end_s, 3 * kMs, kTol);
    const SimEvent* op1 = find_event(r, SimResource::Compute, "op1");
    ASSERT_NE(op1, nullptr);
    EXPECT_NEAR(op1->start_s, 3 * kMs, kTol);
    EXPECT_NEAR(r.stall_s, m.copy_seconds(4000, true), kTol);
    EXPECT_NEAR(r.step_s, 5 * kMs, kTol);
  }
}

// An eviction and a fetch run at once: each direction at half its rate until the
// smaller one ends, then the other at full rate.
TEST(Simulator, DuplexSharesTheLink) {
  Program p;
  TensorId a = add(p, "a", Role::Input);
  TensorId x = add(p, "x", Role::Activation);
  TensorId w = add(p, "w", Role::Param, 2 * kN);  // 8000 bytes
  TensorId c = add(p, "c", Role::Activation, 2 * kN);
  gelu(p, "op0", x, a);
  gelu(p, "op1", c, w);
  Plan plan = make_plan_of(p,
                           {alloc(x, 4096), run(0), host_alloc(x, 8192), evict(x), fetch(w, 8192), alloc(c, 16384),
                            run(1), release(w), release(c), host_release(x)},
                           {{a, {Tier::Device, 0}}, {w, {Tier::Host, 0}}});
  Machine m = test_machine(p, false);
  SimResult r = simulate_checked(p, plan, m);
  const SimEvent* down = find_event(r, SimResource::D2H, "x");
  const SimEvent* up = find_event(r, SimResource::H2D, "w");
  ASSERT_TRUE(down && up);
  // 4000 bytes at 2e6 B/s: 2 ms; w moved 4000 of 8000 meanwhile, the rest at 4e6 B/s: 1 ms.
  EXPECT_NEAR(down->start_s, 2 * kMs, kTol);
  EXPECT_NEAR(down->end_s, 4 * kMs, kTol);
  EXPECT_NEAR(up->start_s, 2 * kMs, kTol);
  EXPECT_NEAR(up->end_s, 5 * kMs, kTol);
  EXPECT_NEAR(r.step_s, 7 * kMs, kTol);
  EXPECT_NEAR(r.stall_s, 3 * kMs, kTol);
  EXPECT_EQ(r.d2h_bytes, 4000u);
  EXPECT_EQ(r.h2d_bytes, 8000u);

  m.duplex_factor = 1.0;  // a link with no sharing: x ends at 3 ms, w at 4 ms
  r = simulate_checked(p, plan, m);
  EXPECT_NEAR(find_event(r, SimResource::D2H, "x")->end_s, 3 * kMs, kTol);
  EXPECT_NEAR(find_event(r, SimResource::H2D, "w")->end_s, 4 * kMs, kTol);
  EXPECT_NEAR(r.step_s, 6 * kMs, kTol);
}

// A storage write and a read at once share the drive by Machine::storage_duplex_factor:
// w's write takes 4 ms alone, s's read 2 ms. Independent (1): the read ends at 2 ms,
// the write at 4. As one queue (0.5): the read at half speed ends at 4 ms, the write
// has done 2 ms of its work by then and ends at 6. At 0.75: the read ends at 2/0.75 ms,
// when the write has done 2 ms; it ends 2 ms later.
TEST(Simulator, StorageReadsAndWritesShareTheDrive) {
  Program p;
  TensorId a = add(p, "a", Role::Input);
  TensorId w = add(p, "w", Role::Param);     // on host, written to storage
  TensorId s = add(p, "s", Role::OptState);  // in storage, read to host
  TensorId x = add(p, "x", Role::Activation);
  gelu(p, "op0", x, a);
  Plan plan = make_plan_of(p, {store(w, /*free_host=*/false), host_alloc(s, 4096), load(s), host_release(s)},
                           {{a, {Tier::Device, 0}}, {w, {Tier::Host, 0}}, {s, {Tier::Storage, 0}}});
  Machine m = test_machine(p, true);
  for (auto [factor, read_end, write_end] : {std::tuple{1.0, 2.0, 4.0}, {0.5, 4.0, 6.0}, {0.75, 2.0 / 0.75, 2.0 / 0.75 + 2}}) {
    SCOPED_TRACE(factor);
    m.storage_duplex_factor = factor;
    SimResult r = simulate_checked(p, plan, m);
    const SimEvent* read = find_event(r, SimResource::StorageRead, "s");
    const SimEvent* write = find_event(r, SimResource::StorageWrite, "w");
    ASSERT_NE(read, nullptr);
    ASSERT_NE(write, nullptr);
    EXPECT_NEAR(read->start_s, 0, kTol);
    EXPECT_NEAR(write->start_s, 0, kTol);
    EXPECT_NEAR(read->end_s, read_end * kMs, kTol);
    EXPECT_NEAR(write->end_s, write_end * kMs, kTol);
  }
}

// x goes device → host → storage → host → device. Times (host blocked by runs):
// op0 0–2; D2H 2–3; the Store waits for it, writes 3–7; the Load waits for the
// write, reads 7–9; the Fetch waits for the read, copies 9–10; op1 10–12.
TEST(Simulator, PeaksAndStorageRoundTripMatchHandCounts) {
  Program p;
  TensorId a = add(p, "a", Role::Input);
  TensorId w = add(p, "w", Role::Param);       // rests on host, untouched
  TensorId s = add(p, "s", Role::OptState);    // rests in storage, untouched
  TensorId x = add(p, "x", Role::Activation);
  TensorId c = add(p, "c", Role::Activation);
  gelu(p, "op0", x, a);
  gelu(p, "op1", c, x);
  Plan plan = make_plan_of(p,
                           {alloc(x, 4096), run(0), host_alloc(x, 4096), evict(x), store(x, /*free_host=*/true),
                            host_alloc(x, 4096), load(x), fetch(x, 4096), alloc(c, 8192), run(1), release(x), release(c),
                            host_release(x)},
                           {{a, {Tier::Device, 0}}, {w, {Tier::Host, 0}}, {s, {Tier::Storage, 0}}});
  SimResult r = simulate_checked(p, plan, test_machine(p, false));
  EXPECT_EQ(r.peak_device_bytes, 12000u);   // a, x, c
  EXPECT_EQ(r.peak_host_bytes, 8000u);      // w and x's buffer (freed by the Store before the Load)
  EXPECT_EQ(r.peak_storage_bytes, 8000u);   // s and x
  EXPECT_EQ(r.storage_write_bytes, 4000u);
  EXPECT_EQ(r.storage_read_bytes, 4000u);
  EXPECT_NEAR(find_event(r, SimResource::StorageWrite, "x")->start_s, 3 * kMs, kTol);
  EXPECT_NEAR(find_event(r, SimResource::StorageRead, "x")->end_s, 9 * kMs, kTol);
  EXPECT_NEAR(r.step_s, 12 * kMs, kTol);
  EXPECT_NEAR(r.host_stall_s, 7 * kMs, kTol);  // 1 (D2H) + 4 (write) + 2 (read)
  EXPECT_NEAR(r.stall_s, 8 * kMs, kTol);       // compute idle from 2 to 10
  // Memory over time: device falls when the D2H ends, host at the Store's end.
  auto at = [&](double t) {
    MemorySample last;
    for (const MemorySample& m : r.memory)
      if (m.t_s <= t + kTol) last = m;
    return last;
  };
  EXPECT_EQ(at(0).device_bytes, 8000u);
  EXPECT_EQ(at(0).host_bytes, 4000u);
  EXPECT_EQ(at(0).storage_bytes, 4000u);
  EXPECT_EQ(at(2.5 * kMs).host_bytes, 8000u);
  EXPECT_EQ(at(3 * kMs).device_bytes, 4000u);
  EXPECT_EQ(at(3 * kMs).storage_bytes, 8000u);
  EXPECT_EQ(at(9.5 * kMs).device_bytes, 12000u);
  EXPECT_EQ(at(r.step_s).device_bytes, 4000u);
  EXPECT_EQ(at(r.step_s).host_bytes, 4000u);

  PlanReport report = summarize(p, plan, r);
  std::map<Role, RoleReport> by_role;
  for (const RoleReport& rr : report.roles) by_role[rr.role] = rr;
  EXPECT_EQ(by_role[Role::Activation].tensors, 2);
  EXPECT_EQ(by_role[Role::Activation].count[static_cast<int>(Tier::Storage)], 1);  // x
  EXPECT_EQ(by_role[Role::Activation].count[static_cast<int>(Tier::Device)], 1);   // c
  EXPECT_EQ(by_role[Role::Activation].moved, 1);
  EXPECT_EQ(by_role[Role::Param].count[static_cast<int>(Tier::Host)], 1);
  EXPECT_EQ(by_role[Role::OptState].tier_bytes[static_cast<int>(Tier::Storage)], 4000u);
  const std::string table = format_report(report);
  for (const char* word : {"activation", "param", "optstate", "memory peak", "storage write", "predicted step"})
    EXPECT_NE(table.find(word), std::string::npos) << word << " missing from\n" << table;
}

// Allocating into the region of a tensor whose write-back copy is still running
// blocks the host until the copy ends.
TEST(Simulator, RegionReuseWaitsForTheEviction) {
  Program p;
  TensorId a = add(p, "a", Role::Input);
  TensorId x = add(p, "x", Role::Activation);
  TensorId y = add(p, "y", Role::Activation);
  gelu(p, "op0", x, a);
  gelu(p, "op1", y, a);
  auto plan_with_y_at = [&](uint64_t y_offset) {
    return make_plan_of(p,
                        {alloc(x, 4096), run(0), host_alloc(x, 0), evict(x), alloc(y, y_offset), run(1), release(y),
                         host_release(x)},
                        {{a, {Tier::Device, 0}}});
  };
  Machine m = test_machine(p, /*host_runs_ahead=*/true);

  // op0 0–2, its eviction 2–3; y reuses x's region, so op1 is issued at 3.
  SimResult reuse = simulate_checked(p, plan_with_y_at(4096), m);
  EXPECT_NEAR(find_event(reuse, SimResource::D2H, "x")->end_s, 3 * kMs, kTol);
  EXPECT_NEAR(find_event(reuse, SimResource::Compute, "op1")->start_s, 3 * kMs, kTol);
  const SimEvent* wait = find_event(reuse, SimResource::Host, "wait y");
  ASSERT_NE(wait, nullptr);
  EXPECT_NEAR(wait->end_s - wait->start_s, 3 * kMs, kTol);
  EXPECT_NEAR(reuse.host_stall_s, 3 * kMs, kTol);
  EXPECT_NEAR(reuse.stall_s, 1 * kMs, kTol);  // compute idle from 2 to 3
  EXPECT_NEAR(reuse.step_s, 5 * kMs, kTol);
  EXPECT_EQ(reuse.peak_device_bytes, 8000u);

  // Elsewhere: no wait, op1 right after op0, the copy overlapping it.
  SimResult apart = simulate_checked(p, plan_with_y_at(8192), m);
  EXPECT_NEAR(apart.host_stall_s, 0, kTol);
  EXPECT_NEAR(apart.stall_s, 0, kTol);
  EXPECT_NEAR(apart.step_s, 4 * kMs, kTol);
  EXPECT_EQ(apart.peak_device_bytes, 12000u);
}

// A host buffer whose range another tensor's buffer takes waits for the store
// still reading the earlier occupant, as the executor's host arena does. op0 0–2;
// x's D2H 2–3; its Store (freeing the buffer) waits for it and writes 3–7; op1 3–5;
// y's buffer at x's offset waits for the write (the host blocked 3–7), so y's D2H
// runs 7–8. The host peak is one buffer, never both.
TEST(Simulator, HostBufferReuseWaitsForTheStore) {
  Program p;
  TensorId a = add(p, "a", Role::Input);
  TensorId x = add(p, "x", Role::Activation);
  TensorId y = add(p, "y", Role::Activation);
  gelu(p, "op0", x, a);
  gelu(p, "op1", y, a);
  auto plan_with_y_at = [&](uint64_t y_host) {
    return make_plan_of(p,
                        {alloc(x, 4096), run(0), host_alloc(x, 0), evict(x), store(x, /*free_host=*/true),
                         alloc(y, 8192), run(1), host_alloc(y, y_host), evict(y), host_release(y)},
                        {{a, {Tier::Device, 0}}});
  };
  Machine m = test_machine(p, /*host_runs_ahead=*/true);
  SimResult reuse = simulate_checked(p, plan_with_y_at(0), m);
  EXPECT_NEAR(find_event(reuse, SimResource::StorageWrite, "x")->end_s, 7 * kMs, kTol);
  EXPECT_NEAR(find_event(reuse, SimResource::Compute, "op1")->start_s, 3 * kMs, kTol);
  EXPECT_NEAR(find_event(reuse, SimResource::D2H, "y")->start_s, 7 * kMs, kTol);
  EXPECT_NEAR(reuse.step_s, 8 * kMs, kTol);
  EXPECT_EQ(reuse.peak_host_bytes, 4000u);

  // Elsewhere in the arena: y's buffer does not wait; its D2H follows op1 at 5.
  SimResult apart = simulate_checked(p, plan_with_y_at(4096), m);
  EXPECT_NEAR(find_event(apart, SimResource::D2H, "y")->start_s, 5 * kMs, kTol);
  EXPECT_NEAR(apart.step_s, 7 * kMs, kTol);
  EXPECT_EQ(apart.peak_host_bytes, 8000u);
}

// Flush copies to host and keeps the device copy; once the tensor leaves, its
// region's reuse still waits for that copy.
TEST(Simulator, FlushKeepsTheDeviceCopy) {
  Program p;
  TensorId a = add(p, "a", Role::Input);
  TensorId g = add(p, "g", Role::Activation);
  TensorId y = add(p, "y", Role::Activation);
  gelu(p, "op0", g, a);
  gelu(p, "op1", y, a);
  Instruction flush{.kind = InstrKind::Flush, .tensor = g};
  Plan plan = make_plan_of(p, {alloc(g, 4096), run(0), host_alloc(g, 0), flush, release(g), alloc(y, 4096), run(1),
                               release(y), host_release(g)},
                           {{a, {Tier::Device, 0}}});
  SimResult r = simulate_checked(p, plan, test_machine(p, false));
  EXPECT_EQ(r.d2h_bytes, 4000u);
  EXPECT_EQ(r.peak_host_bytes, 4000u);
  EXPECT_EQ(r.peak_device_bytes, 8000u);
  EXPECT_NEAR(find_event(r, SimResource::D2H, "g")->end_s, 3 * kMs, kTol);
  EXPECT_NEAR(find_event(r, SimResource::Compute, "op1")->start_s, 3 * kMs, kTol);  // y waited for the flush
}

// A host op waits for its operand's write-back to reach host memory.
TEST(Simulator, HostOpWaitsForItsData) {
  Program p;
  TensorId a = add(p, "a", Role::Input);
  TensorId g = add(p, "g", Role::Activation);
  TensorId h = add(p, "h", Role::Master);
  gelu(p, "op0", g, a);
  gelu(p, "host op", h, g, Place::Host);
  Plan plan = make_plan_of(p, {alloc(g, 4096), run(0), host_alloc(g, 4096), evict(g), run(1), host_release(g)},
                           {{a, {Tier::Device, 0}}, {h, {Tier::Host, 0}}});
  SimResult r = simulate_checked(p, plan, test_machine(p, false));
  const SimEvent* host = find_event(r, SimResource::Host, "host op");
  ASSERT_NE(host, nullptr);
  EXPECT_NEAR(host->start_s, 3 * kMs, kTol);  // after the 2–3 ms D2H
  EXPECT_NEAR(r.host_compute_s, 2 * kMs, kTol);
  EXPECT_NEAR(r.host_stall_s, 1 * kMs, kTol);
  EXPECT_NEAR(r.step_s, 5 * kMs, kTol);
}

// A host op goes to the host engine and the host thread goes on. The fetch of what
// it writes is deferred: its copy (1 ms) joins the h2d queue when the host op ends
// at 2 ms, so it does not hold up the fetch of w issued after it (0–1 ms), and op1
// runs 1–3 ms while the host op still works. op2 reads the host op's output: the host
// thread waits for the host op (0–2 ms) and issues the fetch then, as the executor's
// resolve_deferred does; op2 runs 3–5 ms.
// (Were the host thread to run the host op itself: hm 2–3, w 3–4, op1 4–6, op2 6–8.)
TEST(Simulator, HostOpsRunBesideTheHostThreadAndDeferTheirFetches) {
  Program p;
  TensorId m = add(p, "m", Role::Master);
  TensorId hm = add(p, "hm", Role::OptState);
  TensorId w = add(p, "w", Role::Param);
  TensorId c = add(p, "c", Role::Activation);
  TensorId d = add(p, "d", Role::Activation);
  gelu(p, "host op", hm, m, Place::Host);
  gelu(p, "op1", c, w);
  gelu(p, "op2", d, hm);
  Plan plan = make_plan_of(p,
                           {run(0), fetch(hm, 0), fetch(w, 4096), alloc(c, 8192), run(1), alloc(d, 12288), run(2),
                            release(hm), release(w), release(c), release(d)},
                           {{m, {Tier::Host, 0}}, {hm, {Tier::Host, 8192}}, {w, {Tier::Host, 16384}}});
  SimResult r = simulate_checked(p, plan, test_machine(p, true));
  const SimEvent* host = find_event(r, SimResource::Host, "host op");
  const SimEvent* fetch_hm = find_event(r, SimResource::H2D, "hm");
  const SimEvent* fetch_w = find_event(r, SimResource::H2D, "w");
  const SimEvent* op1 = find_event(r, SimResource::Compute, "op1");
  const SimEvent* op2 = find_event(r, SimResource::Compute, "op2");
  ASSERT_TRUE(host && fetch_hm && fetch_w && op1 && op2);
  EXPECT_NEAR(host->start_s, 0, kTol);
  EXPECT_NEAR(host->end_s, 2 * kMs, kTol);
  EXPECT_NEAR(fetch_w->start_s, 0, kTol);
  EXPECT_NEAR(fetch_w->end_s, 1 * kMs, kTol);
  EXPECT_NEAR(fetch_hm->start_s, 2 * kMs, kTol);
  EXPECT_NEAR(fetch_hm->end_s, 3 * kMs, kTol);
  EXPECT_NEAR(op1->start_s, 1 * kMs, kTol);
  EXPECT_NEAR(op2->start_s, 3 * kMs, kTol);
  EXPECT_NEAR(r.step_s, 5 * kMs, kTol);
  EXPECT_NEAR(r.host_stall_s, 2 * kMs, kTol);  // at op2, for the host op
}

// A host op shares host memory bandwidth with the copies: its 2 ms are timed at the
// rate while copies run both ways (half the alone rate here), so alone it needs 1 ms.
// One direction takes half that bandwidth from it: from 0 to 1 ms an unrelated 1 ms
// fetch runs (rate 1 - 0.5 / 2 = 0.75: 0.75 ms of work done), then the remaining
// 0.25 ms runs alone: it ends at 1.25 ms.
// A host op (2 ms on the test machine) and a parameter w whose fetch is unrelated
// to it (1 ms alone), all at home on host.
struct HostOpAndFetch {
  Program p;
  TensorId a = add(p, "a", Role::Input);
  TensorId h = add(p, "h", Role::Master);
  TensorId w = add(p, "w", Role::Param);
  std::map<TensorId, std::pair<Tier, uint64_t>> homes{
      {a, {Tier::Host, 0}}, {h, {Tier::Host, 8192}}, {w, {Tier::Host, 16384}}};
  HostOpAndFetch() { gelu(p, "host op", h, a, Place::Host); }
};

TEST(Simulator, HostOpsSlowDownWhileCopiesRun) {
  HostOpAndFetch f;
  const Program& p = f.p;
  Plan with_copy = make_plan_of(p, {fetch(f.w, 0), run(0), release(f.w)}, f.homes);
  Plan without = make_plan_of(p, {run(0)}, f.homes);
  Machine m = test_machine(p, true);
  m.host_adam_params_per_s = 1e9;
  m.host_adam_params_per_s_alone = 2e9;
  auto host_end = [&](const Plan& plan, const Machine& machine) {
    SimResult r = simulate_checked(p, plan, machine);
    const SimEvent* e = find_event(r, SimResource::Host, "host op");
    EXPECT_NE(e, nullptr);
    return e ? e->end_s : -1.0;
  };
  EXPECT_NEAR(host_end(with_copy, m), 1.25 * kMs, kTol);
  EXPECT_NEAR(host_end(without, m), 1.0 * kMs, kTol);
  m.host_adam_params_per_s_alone = 0;  // no alone rate given: 2 ms, copies or not
  EXPECT_NEAR(host_end(with_copy, m), 2.0 * kMs, kTol);
  EXPECT_NEAR(host_end(without, m), 2.0 * kMs, kTol);
}

// And the other way: a copy shares host memory bandwidth with a host op. The 1 ms
// fetch of w runs at a quarter of its speed beside the 2 ms host op (0-2 ms: half its
// bytes), then the rest at full speed alone: it ends at 2.5 ms (at 1 ms alone).
TEST(Simulator, CopiesSlowWhileAHostOpRuns) {
  HostOpAndFetch f;
  const Program& p = f.p;
  Plan plan = make_plan_of(p, {run(0), fetch(f.w, 0), release(f.w)}, f.homes);
  Machine m = test_machine(p, true);
  auto fetch_end = [&](double share) {
    m.copy_share_while_host_computes = share;
    SimResult r = simulate_checked(p, plan, m);
    const SimEvent* e = find_event(r, SimResource::H2D, "w");
    EXPECT_NE(e, nullptr);
    const SimEvent* host = find_event(r, SimResource::Host, "host op");
    EXPECT_NE(host, nullptr);
    if (host) {
      EXPECT_NEAR(host->end_s, 2 * kMs, kTol);  // host ops keep their rate (no alone rate given)
    }
    return e ? e->end_s : -1.0;
  };
  EXPECT_NEAR(fetch_end(1.0), 1 * kMs, kTol);
  EXPECT_NEAR(fetch_end(0.25), 2.5 * kMs, kTol);
}

// Device compute beside a host op (on the CPU backend both run on the host's
// cores). A 2 ms host op, then a 2 ms device op on device tensors. Both at half speed
// side by side: each has done 1 ms of work at 2 ms and the rest at 4 ms. With only
// compute slowed (to a quarter): the host op ends at 2 ms, the device op has done
// 0.5 ms of its work by then and ends at 3.5 ms. Machines without the shares (1):
// both end at 2 ms.
TEST(Simulator, ComputeAndHostOpsSlowEachOtherSideBySide) {
  for (bool runs_ahead : {true, false}) {
    SCOPED_TRACE(runs_ahead ? "host runs ahead" : "host runs the device ops");
    HostOpAndFetch f;
    Program& p = f.p;
    const TensorId x = add(p, "x", Role::Param), y = add(p, "y", Role::Activation);  // x: home on device
    gelu(p, "device op", y, x);
    Plan plan = make_plan_of(p, {run(0), alloc(y, 4096), run(1), release(y)}, f.homes);
    Machine m = test_machine(p, runs_ahead);
    auto ends = [&](double compute_share, double host_share) {
      m.compute_share_while_host_computes = compute_share;
      m.host_share_while_computing = host_share;
      SimResult r = simulate_checked(p, plan, m);
      const SimEvent* host = find_event(r, SimResource::Host, "host op");
      const SimEvent* device = find_event(r, SimResource::Compute, "device op");
      EXPECT_NE(host, nullptr);
      EXPECT_NE(device, nullptr);
      return std::pair{host ? host->end_s : -1.0, device ? device->end_s : -1.0};
    };
    auto [host, device] = ends(1.0, 1.0);
    EXPECT_NEAR(host, 2 * kMs, kTol);
    EXPECT_NEAR(device, 2 * kMs, kTol);
    std::tie(host, device) = ends(0.5, 0.5);
    EXPECT_NEAR(host, 4 * kMs, kTol);
    EXPECT_NEAR(device, 4 * kMs, kTol);
    std::tie(host, device) = ends(0.25, 1.0);
    EXPECT_NEAR(host, 2 * kMs, kTol);
    EXPECT_NEAR(device, 3.5 * kMs, kTol);
  }
}

// Steps back to back (simulate_loop_step). The host thread runs a 2 ms device op,
// then queues a 2 ms host op and returns: a step call waits for the device, not for
// host ops. Alone the step ends at 4 ms and its call returns at 2. The next step's
// device op runs from 2 to 4 ms beside the first host op, its own host op queues
// behind that one (4 to 6 ms), and its call returns at 4: a step every 2 ms.
TEST(Simulator, StepsBackToBackOverlapTheHostTail) {
  HostOpAndFetch f;
  Program& p = f.p;
  const TensorId x = add(p, "x", Role::Param), y = add(p, "y", Role::Activation);  // x: home on device
  gelu(p, "device op", y, x);
  Plan plan = make_plan_of(p, {alloc(y, 4096), run(1), release(y), run(0)}, f.homes);
  const Machine m = test_machine(p, /*host_runs_ahead=*/false);
  SimResult r = simulate_checked(p, plan, m);
  EXPECT_NEAR(r.step_s, 4 * kMs, kTol);
  EXPECT_NEAR(r.return_s, 2 * kMs, kTol);
  EXPECT_NEAR(simulate_loop_step(p, plan, m), 2 * kMs, kTol);
  // A plan the replay refuses is predicted as its step alone.
  Plan bad = make_plan_of(p, {run(1), run(0)}, f.homes);  // y never allocated
  EXPECT_EQ(simulate_loop_step(p, bad, m), simulate(p, bad, m).step_s);
}

TEST(Simulator, RecomputeRunsAreCounted) {
  FetchCase f;
  Plan plan = f.plan(true);
  plan.instructions.insert(plan.instructions.begin() + 3, Instruction{.kind = InstrKind::Run, .op = 0, .recompute = true});
  SimResult r = simulate_checked(f.p, plan, test_machine(f.p, false));
  EXPECT_EQ(r.recomputed_ops, 1);
  EXPECT_NE(find_event(r, SimResource::Compute, "recompute op0"), nullptr);
  EXPECT_NEAR(r.compute_s, 6 * kMs, kTol);
}

// A planned GPT step: every Run appears once on the timeline, compute time is the
// sum of op times, and the simulated peaks stay within the plan's.
TEST(Simulator, PlannedGptStep) {
  ModelConfig cfg{2, 32, 2, 16, 64};
  auto program = build_training_program(cfg, {.B = 2, .T = 16, .accum = 2}, DType::F32);
  ASSERT_TRUE(program.ok()) << program.status().to_string();
  Machine m = Machine::cpu_dev_box();
  for (Policy policy : {Policy::Resident, Policy::Paging, Policy::Planned}) {
    SCOPED_TRACE(policy_name(policy));
    Budgets budgets;
    if (policy != Policy::Resident) budgets.device = minimum_device_budget(*program, 64) * 3;
    auto plan = make_plan(*program, Simulator(m), budgets, {.policy = policy});
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();
    const Program placed = placed_as_planned(*program, *plan);
    SimResult r = simulate(placed, *plan, m);
    size_t runs = 0;
    double compute = 0;
    for (const Instruction& in : plan->instructions) {
      if (in.kind != InstrKind::Run) continue;
      ++runs;
      if (placed.ops[in.op].place == Place::Device) compute += m.op_seconds(placed, in.op);
    }
    size_t run_events = 0;
    for (const SimEvent& e : r.timeline) run_events += e.op >= 0;
    // Each Run, and each speculative update (a host op of its own before its Run).
    EXPECT_EQ(r.speculated_ops, static_cast<int>(plan->speculation.size()));
    EXPECT_EQ(run_events, runs + plan->speculation.size());
    EXPECT_NEAR(r.compute_s, compute, 1e-9);
    EXPECT_GE(r.step_s, r.compute_s);
    EXPECT_LE(r.peak_device_bytes, plan->device_bytes);
    if (policy == Policy::Resident) {
      EXPECT_EQ(r.h2d_bytes, 0u);
      EXPECT_NEAR(r.stall_s, 0, 1e-12);
    } else {
      EXPECT_GT(r.h2d_bytes, 0u);
    }
    EXPECT_FALSE(format_report(summarize(*program, *plan, r)).empty());
  }
}

TEST(Profiler, ProfilesEachShapeOnceOnTheCpuBackend) {
  auto backend = make_backend("cpu", {.threads = 2});
  ASSERT_TRUE(backend.ok()) << backend.status().to_string();
  ModelConfig cfg{2, 32, 2, 16, 64};
  auto program = build_training_program(cfg, {.B = 2, .T = 16, .accum = 1}, (*backend)->activation_dtype());
  ASSERT_TRUE(program.ok()) << program.status().to_string();
  auto seconds = profile_ops(**backend, *program, 2);
  ASSERT_TRUE(seconds.ok()) << seconds.status().to_string();
  ASSERT_EQ(seconds->size(), program->ops.size());
  using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, std::vector<size_t>>;
  std::map<Key, std::vector<size_t>> groups;
  for (size_t i = 0; i < program->ops.size(); ++i) {
    const Op& op = program->ops[i];
    std::vector<size_t> sizes;
    for (const Operand& o : op.operands) sizes.push_back(program->tensors.info(o.tensor).bytes() * 4 + int(o.access));
    groups[{static_cast<int>(op.kind) * 2 + static_cast<int>(op.place), op.attrs.N, op.attrs.C, op.attrs.OC,
            op.attrs.n, sizes}]
        .push_back(i);
    EXPECT_GT((*seconds)[i], 0) << op.name;
  }
  bool shared = false;
  for (auto& [key, ops] : groups) {
    shared = shared || ops.size() > 1;
    for (size_t i : ops) EXPECT_EQ((*seconds)[i], (*seconds)[ops[0]]) << program->ops[i].name;
  }
  EXPECT_TRUE(shared);

  Machine m = Machine::cpu_dev_box();
  m.measured_op_seconds = *seconds;
  for (size_t i = 0; i < program->ops.size(); ++i)
    if ((*seconds)[i] > 0) {
      EXPECT_EQ(m.op_seconds(*program, i), (*seconds)[i]) << program->ops[i].name;
    }
}

TEST(Profiler, MeasuresTheCpuBackend) {
  auto backend = make_backend("cpu", {.threads = 2});
  ASSERT_TRUE(backend.ok()) << backend.status().to_string();
  auto m = measure_machine(**backend, Machine::cpu_dev_box());
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_GT(m->h2d_bytes_per_s, 1e8);
  EXPECT_GT(m->d2h_bytes_per_s, 1e8);
  EXPECT_GT(m->duplex_factor, 0);
  EXPECT_LE(m->duplex_factor, 1);
  EXPECT_GT(m->matmul_flops_per_s, 1e8);
  EXPECT_GT(m->device_bytes_per_s, 1e8);
  EXPECT_GT(m->host_adam_params_per_s, 1e6);
  EXPECT_FALSE(m->host_runs_ahead);
  for (double share : {m->compute_share_while_host_computes, m->host_share_while_computing}) {
    EXPECT_GT(share, 0);
    EXPECT_LE(share, 1);
  }
  std::printf("cpu backend: h2d %.2f GB/s, d2h %.2f GB/s, duplex %.2f, matmul %.1f GFLOP/s, memory %.2f GB/s, "
              "launch %.2f us, host AdamW %.2f Gparams/s; side by side: compute %.3f, host AdamW %.3f of alone\n",
              m->h2d_bytes_per_s / 1e9, m->d2h_bytes_per_s / 1e9, m->duplex_factor, m->matmul_flops_per_s / 1e9,
              m->device_bytes_per_s / 1e9, m->op_launch_s * 1e6, m->host_adam_params_per_s / 1e9,
              m->compute_share_while_host_computes, m->host_share_while_computing);
}
