// Planner: turns a Program, a CostModel and Budgets into a Plan (plan.h). The cost
// model answers the planner's time questions; the simulator of a Machine is one
// (sim/simulator.h), which the caller passes in.
//
//   PlannerOptions o{.policy = Policy::Planned};
//   auto plan = make_plan(program, Simulator(Machine::cpu_dev_box()), {.device = 64 << 20}, o);
//   // Budget too small: "device budget 8.00 MiB is below the minimum 19.25 MiB that
//   // the largest op (mb0.lm_head.forward) needs (19.25 MiB of operands and inputs,
//   // 0 B of workspace); give --device-budget 20MiB or more"
//
// Policies (DESIGN.md, "Planner policies"):
// - resident: everything on device, activations packed by lifetime; an error if it
//   does not fit.
// - paging: no lookahead; fetch at first touch, evict the least recently used
//   (decided by replaying the step's access sequence, which is what a pager sees);
//   with learned prefetch, each op's tensors are fetched one op ahead, as a
//   correlation prefetcher that learned the sequence in earlier steps would.
// - planned: lookahead over the static program (lifetimes, swap/recompute choice,
//   parameter streaming, optimizer placement, static offsets, early fetches).
// - auto: planned-policy candidates ranked by the cost model's predicted step time.
#pragma once

#include "plan/plan.h"
#include "plan/cost_model.h"

namespace spillway {

struct PlannerOptions {
  Policy policy = Policy::Resident;
  bool learned_prefetch = false;  // paging only
  // planned: -1 = choose; else forces the choice (auto enumerates these)
  int optimizer_on_host = -1;     // 1 = master/moments live on host and AdamW runs there
  // With the optimizer offloaded: bytes of optimizer state (grad, master, moments of a
  // prefix of the parameters) that stay on device, their AdamW running there.
  // -1 = what leaves half the device budget free, divided by the micro-batches of a
  // step (accumulation makes activation memory worth more); 0 = all on host.
  int64_t device_optimizer_bytes = -1;
  // With device_optimizer_bytes = -1: 1 (the default, -1) = also try larger shares, up
  // to all the room the state leaves beside the largest op (the activations then live
  // on recomputation), and keep the one the cost model predicts fastest; 0 = the rule's
  // share only.
  int optimizer_share_search = -1;
  // With the optimizer offloaded: run AdamW on device for some of the parameters whose
  // state rests on host, fetching it and writing it back, so that the link and the
  // host share the update (sized so both take about as long by the cost model).
  // -1 = on, 0 = off.
  int stream_optimizer = -1;
  // With stream_optimizer: the share of the rule's balance that is streamed (1 = the
  // rule). Where the optimizer share is searched, the planner tries 1, 1/2, 1/4 and 0
  // and keeps the fastest the cost model predicts; this fixes it otherwise.
  double stream_fraction = 1.0;
  // planned and auto: start host AdamW ops speculatively, before the clip scale is
  // known (Plan::speculation), as many as the host budget has room for the second
  // buffers of their master, m and v (earliest first). -1 = where the cost model
  // predicts the step faster with them than without (each level is planned both
  // ways), 1 = wherever host AdamW ops are, 0 = off.
  int speculate = -1;
  // planned and auto, with streamed updates: carry them into the next step, each
  // running just before the first op that reads its parameter, the state of the last
  // parameters streaming while the first layers compute (Plan::carried). -1 = where
  // the cost model predicts the step faster (both are planned), 1 = always, 0 = off
  // (the trainer turns it off where a step's state must be whole at its end: data
  // parallelism, --save-grads).
  int carry_updates = -1;
  // planned and auto: where each gradient is zeroed. 1 = just before the first op
  // that touches it (its first backward: a gradient that does not rest on device gets
  // its region there, with no round trip of zeros), 0 = all at the step's start (the
  // program's order), -1 = both are planned and the cost model picks the faster.
  // 1 by default: on the H100 (bench/RESULTS.md, session 33) late zeros ran gpt-2.7b
  // accum 1 and 4 and gpt-4b accum 1, clipping on and off, 2.0-17% faster in every
  // pair measured, and the cost model ranked all four pairs that way.
  int late_zeros = 1;
  int recompute = -1;             // 1 = allow recomputation of activations
  int prefetch_distance = -1;     // ops ahead a fetch may be issued (-1 = as early as memory allows)
  int layer_major = -1;           // 1 = forward layer by layer across micro-batches (planned: off unless 1)
  // auto: which candidate to return in the cost model's ranking (0 = the fastest
  // predicted, 1 = the second, ...); past the last candidate is an error. The trainer
  // times the first two and keeps the faster (TrainerOptions::auto_confirm).
  int auto_rank = 0;
  size_t alignment = 64;          // the backend's alignment (Backend::alignment())
  // Device workspace the ops need besides their operands (exec/dispatch.h
  // program_workspace): the arena is planned within the device budget minus this.
  uint64_t workspace_bytes = 0;
  // Device memory outside the arena and the workspace that the budget must also hold
  // (the GPU's mapping of the executor's pinned host memory, host_mapping_reserve).
  uint64_t reserved_device_bytes = 0;
  // The backend's allocation granularity (Backend::allocation_granularity): budgets
  // are used in whole multiples of it, so a refusal's suggested budget is one.
  uint64_t allocation_granularity = 1;
  // Device memory the process holds outside the budgets given to make_plan (the
  // backend's own: Backend::fixed_device_bytes, which the caller took out of the
  // user's --device-budget): added to the --device-budget a refusal suggests, so that
  // the suggestion is the flag's value.
  uint64_t outside_budget_bytes = 0;
};

Result<Plan> make_plan(const Program& program, const CostModel& cost, const Budgets& budgets,
                       const PlannerOptions& options);

// Policy auto: the plans make_plan returns for auto_rank = options.auto_rank,
// options.auto_rank + 1, ... (count of them, fewer when fewer candidates plan), from
// one search of the candidates instead of one per rank.
//   auto top = make_auto_plans(program, cost, budgets, {.policy = Policy::Auto}, 2);  // the best two
Result<std::vector<Plan>> make_auto_plans(const Program& program, const CostModel& cost, const Budgets& budgets,
                                          const PlannerOptions& options, int count);

// The smallest device budget any policy can run this program with: the largest
// single op's working set (operands plus alignment padding), the inputs and outputs,
// and `workspace_bytes` rounded up to the alignment.
uint64_t minimum_device_budget(const Program& program, size_t alignment, uint64_t workspace_bytes = 0);

}  // namespace spillway
