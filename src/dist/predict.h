// The predicted step of N data-parallel ranks, for machines that are not here: the
// busiest rank's program (the most optimizer state; the others wait for it at every
// collective) planned and timed by a cost model, plus its collectives over the
// network, which the current Communicator runs synchronously between the compute
// (so their time adds).
//
//   auto training = build_training_program(cfg, {.B = 4, .T = 1024, .accum = 1}, DType::BF16);
//   Simulator sim(Machine::h200());
//   auto plan_rank = [&](const Program& p) { return make_plan(p, sim, budgets, options); };
//   auto p = predict_data_parallel(*training, /*world=*/8, /*loss_scale=*/8, /*tokens_per_rank=*/4 * 1024,
//                                  sim, plan_rank, {.bytes_per_s = 450e9, .latency_s = 10e-6});  // NVLink
//   p->tokens_per_s_per_gpu;   // against the one-GPU figure: the scaling efficiency
//
// The collectives are costed as the NCCL communicator runs them (dist/nccl): a
// gradient's reduce gathers every rank's parts on its owner, so the owner's link
// carries (world−1)·parts·n·e bytes (e = 4 for f32, 2 for bf16 gradients and
// parameters); a broadcast moves n·e bytes into every rank
// (NCCL pipelines it); the squared norms' all-reduce is a gather to rank 0 and a
// broadcast. Each collective also costs the link's latency once. The gather makes the
// gradient traffic grow with the world size: a reduce chained through the ranks in
// rank order (pipelined in chunks, each link carrying the gradient once) keeps the
// order and would not; it is not written yet.
#pragma once

#include <cstdint>
#include <functional>

#include "core/status.h"
#include "plan/cost_model.h"
#include "plan/plan.h"
#include "program/program.h"

namespace spillway {

struct NetworkLink {
  double bytes_per_s = 0;  // each GPU's link to the others, one direction (NVLink, InfiniBand)
  double latency_s = 0;    // per collective
};

struct DataParallelPrediction {
  int world = 1;
  int busiest_rank = 0;       // the rank owning the most optimizer state
  double compute_s = 0;       // its program's step as the cost model predicts it
  double collective_s = 0;    // its collectives over the network
  double step_s = 0;          // compute_s + collective_s
  double tokens_per_s = 0;    // all ranks together
  double tokens_per_s_per_gpu = 0;
};

// Seconds collective op `op_index` of a rank program takes over `link` with `world`
// ranks (0 for other ops, and for every op when world is 1).
double collective_seconds(const Program& rank_program, size_t op_index, int world, const NetworkLink& link);

// `training`: one rank's program (build_training_program with its micro-batches);
// tokens_per_rank: the tokens each rank reads per step; plan_rank plans a rank's
// program (make_plan with the caller's cost model, budgets and options), and `cost`
// times it. A world above 1 needs the link's rate (an error asks for it: nothing is
// guessed).
Result<DataParallelPrediction> predict_data_parallel(const Program& training, int world, int loss_scale_micro_batches,
                                                     int64_t tokens_per_rank, const CostModel& cost,
                                                     const std::function<Result<Plan>(const Program&)>& plan_rank,
                                                     const NetworkLink& link);

}  // namespace spillway
