// Which host AdamW ops of a plan may start before the clip scale is known (plan.h,
// "Speculative updates").
#include <algorithm>

#include "core/size.h"
#include "plan/plan.h"
#include "program/op_registry.h"

namespace spillway {

namespace {

TensorId operand(const Op& op, int slot) {
  return slot >= 0 && static_cast<size_t>(slot) < op.operands.size() ? op.operands[static_cast<size_t>(slot)].tensor
                                                                     : kNoTensor;
}

Place place_of(const Program& program, const Plan& plan, int op) {
  return plan.op_place.empty() ? program.ops[static_cast<size_t>(op)].place : plan.op_place[static_cast<size_t>(op)];
}

}  // namespace

std::vector<Speculation> find_speculations(const Program& program, const Plan& plan) {
  const int kParam = op_slot(OpKind::AdamW, "param"), kMaster = op_slot(OpKind::AdamW, "master");
  const int kM = op_slot(OpKind::AdamW, "m"), kV = op_slot(OpKind::AdamW, "v"), kGrad = op_slot(OpKind::AdamW, "grad");
  const auto& ins = plan.instructions;
  // The instructions naming each tensor (a Run names its operands), in order, and
  // where each op first runs (not as a recompute).
  std::vector<std::vector<int32_t>> uses(program.tensors.size());
  std::vector<int32_t> run_at(program.ops.size(), -1);
  for (size_t at = 0; at < ins.size(); ++at) {
    const Instruction& in = ins[at];
    if (in.kind == InstrKind::Run) {
      if (in.op < 0 || static_cast<size_t>(in.op) >= program.ops.size()) return {};
      if (!in.recompute && run_at[static_cast<size_t>(in.op)] < 0) run_at[static_cast<size_t>(in.op)] = static_cast<int32_t>(at);
      for (const Operand& o : program.ops[static_cast<size_t>(in.op)].operands)
        if (o.tensor >= 0 && static_cast<size_t>(o.tensor) < uses.size()) uses[static_cast<size_t>(o.tensor)].push_back(static_cast<int32_t>(at));
    } else if (in.tensor >= 0 && static_cast<size_t>(in.tensor) < uses.size()) {
      uses[static_cast<size_t>(in.tensor)].push_back(static_cast<int32_t>(at));
    }
  }
  auto on_host = [&](TensorId t) { return static_cast<size_t>(t) < plan.home.size() && plan.home[static_cast<size_t>(t)] == Tier::Host; };
  auto mirrored = [&](TensorId t) {
    return static_cast<size_t>(t) < plan.host_mirror.size() && plan.host_mirror[static_cast<size_t>(t)];
  };
  auto writes = [&](const Instruction& in, TensorId t) {
    for (const Operand& o : program.ops[static_cast<size_t>(in.op)].operands)
      if (o.tensor == t && o.access != Access::Read) return true;
    return false;
  };

  std::vector<Speculation> found;
  for (size_t a = 0; a < program.ops.size(); ++a) {
    const Op& op = program.ops[a];
    const int32_t r = run_at[a];
    if (op.kind != OpKind::AdamW || r < 0 || place_of(program, plan, static_cast<int>(a)) != Place::Host) continue;
    const TensorId param = operand(op, kParam), grad = operand(op, kGrad);
    const TensorId state[3] = {operand(op, kMaster), operand(op, kM), operand(op, kV)};
    if (param == kNoTensor || grad == kNoTensor) continue;
    // Master, m and v: on host, touched by this Run alone.
    bool ok = true;
    for (TensorId t : state)
      ok = ok && t != kNoTensor && on_host(t) && uses[static_cast<size_t>(t)] == std::vector<int32_t>{r};
    // Param keeps one host buffer all step.
    ok = ok && (on_host(param) || mirrored(param));
    for (int32_t j : uses[static_cast<size_t>(param)]) {
      const InstrKind k = ins[static_cast<size_t>(j)].kind;
      ok = ok && k != InstrKind::HostAllocate && k != InstrKind::HostRelease && k != InstrKind::Load && k != InstrKind::Store;
    }
    if (!ok) continue;
    // The gradient's last write before the Run: it must leave the final value on host.
    int32_t after = -1;
    const std::vector<int32_t>& g = uses[static_cast<size_t>(grad)];
    for (auto it = std::lower_bound(g.begin(), g.end(), r); it != g.begin() && ok;) {
      const int32_t j = *--it;
      const Instruction& in = ins[static_cast<size_t>(j)];
      switch (in.kind) {
        case InstrKind::Run:
          if (!writes(in, grad)) break;
          if (place_of(program, plan, in.op) == Place::Host) after = j;
          else ok = false;  // its last write is on device: the host copy is older
          break;
        case InstrKind::Evict:
          if (in.write_back) after = j;
          break;
        case InstrKind::Flush:
          after = j;
          break;
        case InstrKind::Store:
          ok = !in.free_host;  // the buffer must outlive the speculation
          break;
        case InstrKind::Load:
        case InstrKind::HostAllocate:
        case InstrKind::HostRelease:
          ok = false;
          break;
        case InstrKind::Fetch:
        case InstrKind::Allocate:
        case InstrKind::Release:
          break;
      }
      if (after >= 0) break;
    }
    if (!ok || after < 0) continue;
    // From there to the Run, nothing reads or writes param's host copy.
    for (int32_t j : uses[static_cast<size_t>(param)]) {
      if (j <= after || j >= r) continue;
      const Instruction& in = ins[static_cast<size_t>(j)];
      switch (in.kind) {
        case InstrKind::Run: ok = ok && place_of(program, plan, in.op) == Place::Device; break;
        case InstrKind::Fetch:
        case InstrKind::Flush: ok = false; break;
        case InstrKind::Evict: ok = ok && !in.write_back; break;
        default: break;
      }
    }
    if (ok) found.push_back({static_cast<int32_t>(a), after});
  }
  std::stable_sort(found.begin(), found.end(), [](const Speculation& x, const Speculation& y) { return x.after < y.after; });
  return found;
}

uint64_t speculation_bytes(const Program& program, const std::vector<Speculation>& speculation) {
  uint64_t bytes = 0;
  for (const Speculation& s : speculation) {
    const Op& op = program.ops[static_cast<size_t>(s.op)];
    for (const char* slot : {"master", "m", "v"}) {
      const TensorId t = operand(op, op_slot(OpKind::AdamW, slot));
      if (t != kNoTensor) bytes += align_up(std::max<uint64_t>(1, program.tensors.info(t).bytes()), 4096);
    }
  }
  return bytes;
}

Plan without_speculation(Plan plan) {
  plan.speculation.clear();
  plan.speculation_bytes = 0;
  return plan;
}

TensorId clip_scale_tensor(const Program& program) {
  const int slot = op_slot(OpKind::AdamW, "scale_norm");
  for (const Op& op : program.ops)
    if (op.kind == OpKind::AdamW && slot >= 0 && static_cast<int>(op.operands.size()) > slot)
      return op.operands[static_cast<size_t>(slot)].tensor;
  return kNoTensor;
}

}  // namespace spillway
