#include "plan/plan.h"

#include <algorithm>
#include <functional>
#include <map>

#include "core/size.h"
#include "plan/residency.h"

namespace spillway {

const char* instr_kind_name(InstrKind k) {
  switch (k) {
    case InstrKind::Run: return "run";
    case InstrKind::Allocate: return "allocate";
    case InstrKind::Fetch: return "fetch";
    case InstrKind::Evict: return "evict";
    case InstrKind::Flush: return "flush";
    case InstrKind::Release: return "release";
    case InstrKind::HostAllocate: return "host-allocate";
    case InstrKind::Load: return "load";
    case InstrKind::Store: return "store";
    case InstrKind::HostRelease: return "host-release";
  }
  return "?";
}

const char* policy_name(Policy p) {
  switch (p) {
    case Policy::Resident: return "resident";
    case Policy::Paging: return "paging";
    case Policy::Planned: return "planned";
    case Policy::Auto: return "auto";
  }
  return "?";
}

Result<Policy> parse_policy(const std::string& name) {
  if (name == "resident") return Policy::Resident;
  if (name == "paging") return Policy::Paging;
  if (name == "planned") return Policy::Planned;
  if (name == "auto") return Policy::Auto;
  return Status::invalid_argument("--policy: unknown policy '" + name +
                                  "'; expected one of resident, paging, planned, auto");
}

// A dry run of the instruction semantics of plan.h through the one residency state
// machine (plan/residency.h), over the executor's exact arenas: catches every plan bug
// before the executor touches memory.
Status Plan::validate(const Program& program, const Budgets& budgets) const {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0)
    return Status::internal("plan: device alignment " + std::to_string(alignment) + " is not a power of two");
  // The executor's arenas: exactly these sizes, one allocation each.
  const uint64_t device_arena = std::max<uint64_t>(device_bytes, alignment);
  const uint64_t host_arena = host_arena_bytes();
  if (device_arena > budgets.device)
    return Status::internal("plan: device arena " + format_size(device_arena) + " exceeds the device budget " +
                            format_size(budgets.device));
  if (host_arena > budgets.host)
    return Status::internal("plan: host arena " + format_size(host_arena) + " exceeds the host budget " +
                            format_size(budgets.host));
  if (!speculation.empty()) {
    const std::vector<Speculation> allowed = find_speculations(program, *this);
    std::vector<bool> seen(program.ops.size(), false);
    for (size_t i = 0; i < speculation.size(); ++i) {
      const Speculation& s = speculation[i];
      if (s.op < 0 || static_cast<size_t>(s.op) >= seen.size() || seen[static_cast<size_t>(s.op)])
        return Status::internal("plan: speculative update " + std::to_string(i) + " names op " + std::to_string(s.op) +
                                ", which is out of range or listed twice");
      seen[static_cast<size_t>(s.op)] = true;
      auto it = std::find_if(allowed.begin(), allowed.end(), [&](const Speculation& a) { return a.op == s.op; });
      if (it == allowed.end() || it->after != s.after)
        return Status::internal("plan: speculative update " + std::to_string(i) + " (op " + std::to_string(s.op) +
                                " after instruction " + std::to_string(s.after) + ") is not one the plan allows" +
                                (it == allowed.end() ? std::string()
                                                     : " (its gradient is final after instruction " +
                                                           std::to_string(it->after) + ")"));
      if (i > 0 && speculation[i - 1].after > s.after)
        return Status::internal("plan: speculative updates are not ordered by the instruction they follow");
    }
  }
  if (speculation_bytes != spillway::speculation_bytes(program, speculation))
    return Status::internal("plan: speculation buffers of " + format_size(speculation_bytes) + " where its " +
                            std::to_string(speculation.size()) + " speculative updates need " +
                            format_size(spillway::speculation_bytes(program, speculation)));
  if (speculation_bytes > 0 && (host_arena > budgets.host || speculation_bytes > budgets.host - host_arena))
    return Status::internal("plan: host arena " + format_size(host_arena) + " and speculation buffers " +
                            format_size(speculation_bytes) + " exceed the host budget " + format_size(budgets.host));
  ResidencyMachine m(program, *this, {.device = device_arena, .host = host_arena, .storage = budgets.storage / 4096 * 4096});
  SPILLWAY_RETURN_IF_ERROR(m.start());
  for (size_t at = 0; at < instructions.size(); ++at) SPILLWAY_RETURN_IF_ERROR(m.apply(at, instructions[at]));
  SPILLWAY_RETURN_IF_ERROR(m.finish());
  if (m.device_peak() > budgets.device)
    return Status::internal("plan: device peak " + format_size(m.device_peak()) + " exceeds the budget " + format_size(budgets.device));
  if (m.host_peak() > budgets.host)
    return Status::internal("plan: host peak " + format_size(m.host_peak()) + " exceeds the budget " + format_size(budgets.host));
  return Status::ok();
}

Program placed_as_planned(const Program& program, const Plan& plan) {
  Program placed = program;
  for (size_t i = 0; i < placed.ops.size() && i < plan.op_place.size(); ++i) placed.ops[i].place = plan.op_place[i];
  return placed;
}

}  // namespace spillway
