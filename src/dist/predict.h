// The predicted step of N data-parallel ranks, for machines that are not here: the
// busiest rank's program (the most optimizer state; the others wait for it at every
// collective) planned and timed by a cost model, plus the part of its collectives
// over the network that the compute does not hide.
//
//   auto training = build_training_program(cfg, {.B = 4, .T = 1024, .accum = 1}, DType::BF16);
//   Simulator sim(Machine::h200());
//   auto plan_rank = [&](const Program& p) { return make_plan(p, sim, budgets, options); };
//   auto p = predict_data_parallel(*training, /*world=*/8, /*loss_scale=*/8, /*tokens_per_rank=*/4 * 1024,
//                                  sim, plan_rank, {.bytes_per_s = 450e9, .latency_s = 10e-6});  // NVLink
//   p->tokens_per_s_per_gpu;   // against the one-GPU figure: the scaling efficiency
//
// Overlap. A gradient's reduce sits in the rank program right after the backward op
// that writes its last contribution (dist/data_parallel.h), and the collectives run
// one after another on a stream of their own: reduce k starts when the compute before
// it is done and the previous collective has finished, so it is hidden behind the
// backward ops that follow it. The compute waits for the reduces where the optimizer
// phase begins (its first op reads the reduced gradients or follows them on the
// collectives' stream); what the reduces' stream has left then is exposed:
//   ready_k  = Σ op_seconds of the rank program's non-collective ops before reduce k
//   end_k    = max(ready_k, end_{k-1}) + reduce_seconds(k)        (end_0 = 0 before the first)
//   exposed  = max(0, end_last − Σ op_seconds of every op before the optimizer phase)
// The optimizer phase's collectives (the squared norms' all-reduce, the parameters'
// broadcasts) are exposed whole (the clip scale and the updates wait for them). The
// backward's time is the cost model's op_seconds summed, without the copies and
// stalls the planned step also has: a lower bound on the time there is to hide
// behind, so the hidden part is, if anything, under-counted. step_s = compute_s +
// exposed_s. ZeRO stage 3's gathers share that stream: gather k ends at
// max(ready_k, end_{k-1}) + gather_seconds(k), and the op that reads its copy starts
// no earlier (the wait is exposed); issued a layer ahead (dist/data_parallel.h), a
// gather hides behind that layer's ops. (The executor runs collectives on the
// communicator's stream where it has one, exec/dispatch.cpp, and compute waits only
// where an op touches what a collective writes.)
//
// The collectives are costed as the NCCL communicator runs them (dist/nccl). A
// gradient's reduce is a chain in rank order, pipelined in chunks (kChainChunkBytes,
// as the NCCL communicator's kNcclChainChunkBytes): each rank adds its parts to the
// running sum (n elements) and sends it on, the last rank to the owner. Every link
// carries n·e bytes once (e = 4 for f32, 2 for bf16 gradients and parameters), and
// the chunks of a hop overlap the next hop's, so a reduce costs
//   n·e/bandwidth + latency + (world−1)·(min(n·e, chunk)/bandwidth + latency)
// the gradient streaming over one link, then the pipeline's fill: its last chunk
// crosses world hops (0 → 1 → ... → world−1 → owner). Every rank's share of it
// (ReduceGradient on the owner, SendGradient elsewhere) costs the whole chain: each
// waits for its neighbours. The latency is counted per hop, not per chunk (the NCCL
// communicator launches one group and one add per chunk and hop, an overhead this
// leaves out; nothing here is measured on several GPUs yet). A
// broadcast moves n·e bytes into every rank (NCCL pipelines it); the squared norms'
// all-reduce is a gather to rank 0 and a broadcast, each with the link's latency.
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
  int zero_stage = 2;         // 2: every rank holds every parameter; 3: only its shard (gathered before use)
  int busiest_rank = 0;       // the rank owning the most optimizer state
  double compute_s = 0;       // its program's step as the cost model predicts it
  double collective_s = 0;    // its collectives over the network, all of them
  double hidden_s = 0;        // the part of collective_s that runs behind the backward
  double exposed_s = 0;       // collective_s − hidden_s: what the step waits for
  double step_s = 0;          // compute_s + exposed_s
  double tokens_per_s = 0;    // all ranks together
  double tokens_per_s_per_gpu = 0;
};

// One message of the chained reduce, as the NCCL communicator sends it.
inline constexpr double kChainChunkBytes = 4.0 * 1024 * 1024;

// Seconds the chained reduce of `bytes` (one gradient, n·e) takes over `link` with
// `world` ranks (the formula above; 0 when world is 1).
double chained_reduce_seconds(double bytes, int world, const NetworkLink& link);

// Seconds collective op `op_index` of a rank program takes over `link` with `world`
// ranks (0 for other ops, and for every op when world is 1).
double collective_seconds(const Program& rank_program, size_t op_index, int world, const NetworkLink& link);

// `training`: one rank's program (build_training_program with its micro-batches);
// tokens_per_rank: the tokens each rank reads per step; plan_rank plans a rank's
// program (make_plan with the caller's cost model, budgets and options), and `cost`
// times it. A world above 1 needs the link's rate (an error asks for it: nothing is
// guessed). zero_stage as make_data_parallel_layout's: with 3 the rank program holds
// only its parameters (so the plan has that much more room) and gathers each other
// one right before every forward and backward op that reads it; the gathers are
// waited for where they sit (the executor issues them there).
Result<DataParallelPrediction> predict_data_parallel(const Program& training, int world, int loss_scale_micro_batches,
                                                     int64_t tokens_per_rank, const CostModel& cost,
                                                     const std::function<Result<Plan>(const Program&)>& plan_rank,
                                                     const NetworkLink& link, int zero_stage = 2);

}  // namespace spillway
