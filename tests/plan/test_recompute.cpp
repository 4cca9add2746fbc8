// Recomputation safety: the planner drops an activation and re-runs its producer only
// when the re-run reproduces the value the dropped copy held — the producer wrote the
// whole tensor, nothing has written it since, and the producer's inputs still hold the
// values it read. Tiled logits are the case that needs it: the first LM-head tile
// writes them, the other tiles add their columns, and the cross-entropy turns them
// into gradients in place.
#include <gtest/gtest.h>

#include <map>

#include "model/model.h"
#include "plan/planner.h"
#include "sim/machine.h"
#include "sim/simulator.h"
#include "backend/backend.h"
#include "exec/executor.h"
#include "support/test_support.h"
#include "support/train_support.h"

using namespace spillway;

namespace {

// Copies that cost more than any op: the planner recomputes wherever it may.
Machine slow_link() {
  Machine m = Machine::cpu_dev_box();
  m.h2d_bytes_per_s = 1e6;
  m.d2h_bytes_per_s = 1e6;
  return m;
}

// A hand-built step whose logits have two writers, as tiled logits do:
//   logits[:, :OC] = a·w0ᵀ (Write); logits[:, OC:] = a·w1ᵀ (Update);
//   two large scratch ops that need the room the logits hold; losses = CE(logits).
// Under a budget that holds the scratch but not the logits beside it, the logits are
// evicted after their second writer, and re-running only the first tile would lose
// the second tile's columns.
constexpr int64_t kN = 64, kC = 64, kOC = 64, kBig = 64 * 1024;
Program two_writer_program() {
  Program p;
  auto& t = p.tensors;
  TensorId a = t.add({"a", DType::F32, {kN, kC}, Role::Input});
  TensorId targets = t.add({"targets", DType::I32, {kN}, Role::Input});
  TensorId w0 = t.add({"w0", DType::F32, {kOC, kC}, Role::Param});
  TensorId w1 = t.add({"w1", DType::F32, {kOC, kC}, Role::Param});
  TensorId logits = t.add({"logits", DType::F32, {kN, 2 * kOC}, Role::Activation});
  TensorId big0 = t.add({"big0", DType::F32, {kBig}, Role::Activation});
  TensorId big1 = t.add({"big1", DType::F32, {kBig}, Role::Activation});
  TensorId losses = t.add({"losses", DType::F32, {kN}, Role::Activation});
  p.inputs = {a, targets};
  p.outputs = {losses};
  auto op = [&](OpKind kind, const std::string& name, std::vector<Operand> operands, OpAttrs attrs) {
    p.add_op({.kind = kind, .name = name, .operands = std::move(operands), .attrs = attrs,
              .phase = Phase::Forward, .micro_batch = 0});
  };
  op(OpKind::MatmulForward, "head#0", {{logits, Access::Write}, {a, Access::Read}, {w0, Access::Read}},
     {.C = kC, .OC = kOC, .N = kN, .ld = 2 * kOC, .begin = 0});
  op(OpKind::MatmulForward, "head#1", {{logits, Access::Update}, {a, Access::Read}, {w1, Access::Read}},
     {.C = kC, .OC = kOC, .N = kN, .ld = 2 * kOC, .begin = kOC});
  op(OpKind::Zero, "scratch.zero", {{big0, Access::Write}}, {.n = kBig});
  op(OpKind::GeluForward, "scratch.gelu", {{big1, Access::Write}, {big0, Access::Read}}, {.n = kBig});
  op(OpKind::CrossEntropyForward, "crossentropy", {{losses, Access::Write}, {logits, Access::Read}, {targets, Access::Read}},
     {.N = kN, .V = 2 * kOC});
  return p;
}

// Runs one step of `program` under `plan` on the CPU backend with fixed inputs and
// weights; returns the losses.
Result<std::vector<float>> run_two_writer(const Program& program, const Plan& plan) {
  SPILLWAY_ASSIGN_OR_RETURN(auto backend, make_backend("cpu", {.threads = 2}));
  SPILLWAY_ASSIGN_OR_RETURN(auto ex, Executor::create(*backend, program, plan, {}));
  auto floats = [&](const char* name, uint32_t seed) -> Status {
    TensorId t = program.tensors.find(name);
    std::vector<float> v = testing_support::random_floats(program.tensors.info(t).shape.numel(), seed);
    return ex->write_tensor(t, v.data(), v.size() * 4);
  };
  SPILLWAY_RETURN_IF_ERROR(floats("a", 1));
  SPILLWAY_RETURN_IF_ERROR(floats("w0", 2));
  SPILLWAY_RETURN_IF_ERROR(floats("w1", 3));
  std::vector<int32_t> targets = testing_support::random_ints(kN, 4, static_cast<int32_t>(2 * kOC));
  SPILLWAY_RETURN_IF_ERROR(ex->write_tensor(program.tensors.find("targets"), targets.data(), targets.size() * 4));
  SPILLWAY_RETURN_IF_ERROR(ex->run_step({.step = 1, .lr = 0}));
  std::vector<float> losses(kN);
  SPILLWAY_RETURN_IF_ERROR(ex->read_tensor(program.tensors.find("losses"), losses.data(), losses.size() * 4));
  return losses;
}

// For each recompute in the plan, whether it overwrites a tensor that an op other than
// the recomputed one wrote last (a value the re-run does not reproduce). Returns the
// first such "op -> tensor (last written by op)" or "".
std::string first_unsafe_recompute(const Program& program, const Plan& plan) {
  std::vector<int> last_writer(program.tensors.size(), -1);
  for (const Instruction& in : plan.instructions) {
    if (in.kind != InstrKind::Run) continue;
    const Op& op = program.ops[in.op];
    for (const Operand& o : op.operands) {
      if (o.access == Access::Read) continue;
      if (in.recompute && last_writer[o.tensor] != in.op)
        return op.name + " -> " + program.tensors.info(o.tensor).name + " (last written by " +
               (last_writer[o.tensor] < 0 ? std::string("no op") : program.ops[last_writer[o.tensor]].name) + ")";
      if (!in.recompute) last_writer[o.tensor] = in.op;
    }
  }
  return "";
}

// Whether the plan drops a live value of `t` from the device (Evict or Release between
// a write and a later read) after a second op has written it.
bool evicts_after_second_writer(const Program& program, const Plan& plan, TensorId t) {
  int writers = 0;
  bool dropped = false;
  for (const Instruction& in : plan.instructions) {
    if (in.kind == InstrKind::Run) {
      for (const Operand& o : program.ops[in.op].operands) {
        if (o.tensor != t) continue;
        if (dropped) return true;  // used again after it was dropped: the value was live
        if (o.access != Access::Read && !in.recompute) writers++;
      }
    } else if ((in.kind == InstrKind::Evict || in.kind == InstrKind::Release) && in.tensor == t && writers >= 2) {
      dropped = true;
    }
  }
  return false;
}

}  // namespace

TEST(Recompute, ATensorWrittenTwiceIsNeverRecomputedFromItsFirstWriter) {
  const Program program = two_writer_program();
  ASSERT_TRUE(program.validate().is_ok()) << program.validate().to_string();
  const TensorId logits = program.tensors.find("logits");
  auto resident = make_plan(program, Simulator(slow_link()), {}, {.policy = Policy::Resident, .alignment = 64});
  ASSERT_TRUE(resident.ok()) << resident.status().to_string();
  auto ref = run_two_writer(program, *resident);
  ASSERT_TRUE(ref.ok()) << ref.status().to_string();
  const uint64_t minimum = minimum_device_budget(program, 64);
  int forced = 0;
  for (uint64_t budget = minimum; budget <= resident->device_bytes; budget += 4096) {
    const std::string what = "device budget " + std::to_string(budget);
    auto plan = make_plan(program, Simulator(slow_link()), {.device = budget}, {.policy = Policy::Planned, .recompute = 1, .alignment = 64});
    if (!plan.ok()) {  // too tight for this program
      EXPECT_EQ(plan.status().code(), StatusCode::OutOfMemory) << what << ": " << plan.status().to_string();
      continue;
    }
    EXPECT_EQ(first_unsafe_recompute(program, *plan), "") << what;
    if (!evicts_after_second_writer(program, *plan, logits)) continue;
    ++forced;
    auto losses = run_two_writer(program, *plan);
    ASSERT_TRUE(losses.ok()) << what << ": " << losses.status().to_string();
    testing_support::expect_same_losses(*losses, *ref, what);
  }
  EXPECT_GT(forced, 0) << "no budget made the plan evict the logits after their second writer";
}

// Plan::validate models value versions: a recompute of the first writer after the
// second one wrote the tensor is refused, naming the op, the tensor and the versions.
TEST(Recompute, ValidateRefusesARecomputeOfATensorModifiedAfterItsProducer) {
  const Program program = two_writer_program();
  auto plan = make_plan(program, Simulator(slow_link()), {}, {.policy = Policy::Resident, .alignment = 64});
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  ASSERT_TRUE(plan->validate(program, {}).is_ok());
  const TensorId logits = program.tensors.find("logits");
  int head0 = -1, head1 = -1;
  for (size_t i = 0; i < program.ops.size(); ++i) {
    if (program.ops[i].name == "head#0") head0 = static_cast<int>(i);
    if (program.ops[i].name == "head#1") head1 = static_cast<int>(i);
  }
  // Release the logits, allocate them again at their offset and re-run head#0.
  std::vector<Instruction> rerun_after(3);
  rerun_after[0].kind = InstrKind::Release;
  rerun_after[0].tensor = logits;
  rerun_after[1].kind = InstrKind::Allocate;
  rerun_after[1].tensor = logits;
  rerun_after[2].kind = InstrKind::Run;
  rerun_after[2].op = head0;
  rerun_after[2].recompute = true;
  Plan bad = *plan;
  uint64_t offset = 0;
  for (const Instruction& in : bad.instructions)
    if (in.kind == InstrKind::Allocate && in.tensor == logits) offset = in.offset;
  rerun_after[1].offset = offset;
  // After head#1: the re-run would lose head#1's columns.
  for (size_t at = 0; at < bad.instructions.size(); ++at) {
    if (bad.instructions[at].kind != InstrKind::Run || bad.instructions[at].op != head1) continue;
    bad.instructions.insert(bad.instructions.begin() + static_cast<long>(at) + 1, rerun_after.begin(), rerun_after.end());
    break;
  }
  Status s = bad.validate(program, {});
  ASSERT_FALSE(s.is_ok()) << "a recompute that loses head#1's columns passed validation";
  EXPECT_EQ(s.code(), StatusCode::Internal);
  for (const char* part : {"recompute of op head#0", "logits", "version 2", "head#1", "version 1"})
    EXPECT_NE(s.message().find(part), std::string::npos) << part << " not in: " << s.message();
  // The same recompute right after head#0, before head#1 wrote the logits, is legal.
  Plan good = *plan;
  for (size_t at = 0; at < good.instructions.size(); ++at) {
    if (good.instructions[at].kind != InstrKind::Run || good.instructions[at].op != head0) continue;
    good.instructions.insert(good.instructions.begin() + static_cast<long>(at) + 1, rerun_after.begin(), rerun_after.end());
    break;
  }
  EXPECT_TRUE(good.validate(program, {}).is_ok()) << good.validate(program, {}).to_string();
}

// A chain of recomputes (an input of the re-run op dropped too, its producer re-run
// first) is planned only where the whole chain fits the device at once. GPT-2's
// residual stream is recomputable since the projections add it themselves
// (MatmulResidualForward), so at fc's backward the planner could drop ln2_out,
// res_attn, atty and qkv one after the other, each re-run fitting beside its own
// consumer but the four together not: before chains were weighed whole, every budget
// here (around a tenth of the resident step) failed with OutOfMemory.
TEST(Recompute, AChainIsPlannedOnlyWhereItFitsWhole) {
  const ModelConfig cfg{2, 64, 2, 16, 64};
  auto program = build_training_program(cfg, {.B = 2, .T = 16, .accum = 2}, DType::F32);
  ASSERT_TRUE(program.ok()) << program.status().to_string();
  Machine m = Machine::cpu_dev_box();  // recomputing pays: slower links, the class rule for ops
  m.h2d_bytes_per_s = m.d2h_bytes_per_s = 5e9;
  m.op_fits = {};
  auto resident = make_plan(*program, Simulator(m), {}, {.policy = Policy::Resident, .alignment = 64});
  ASSERT_TRUE(resident.ok()) << resident.status().to_string();
  int recomputes = 0;
  for (int64_t delta = -16 << 10; delta <= 16 << 10; delta += 4 << 10) {
    const uint64_t budget = resident->device_bytes / 10 + delta;
    auto plan = make_plan(*program, Simulator(m), {.device = budget},
                          {.policy = Policy::Planned, .recompute = 1, .alignment = 64});
    ASSERT_TRUE(plan.ok()) << "device budget " << budget << ": " << plan.status().to_string();
    EXPECT_EQ(first_unsafe_recompute(*program, *plan), "") << "device budget " << budget;
    for (const Instruction& in : plan->instructions) recomputes += in.recompute;
  }
  EXPECT_GT(recomputes, 0);
}
