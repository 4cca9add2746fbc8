// Data parallelism with partitioned optimizer state (ZeRO stages 1-2 by whole tensors;
// stage 3, the parameters partitioned too, with zero_stage = 3 below),
// exact: N ranks with micro-batch B give, bit for bit, the losses and weights of one
// rank with accumulation N and micro-batch B, where rank r reads micro-batch r of each
// step's batch. The collectives are ops of each rank's Program (ReduceGradient,
// SendGradient, AllReduceInRankOrder, BroadcastParam: program/op_registry.cpp), run
// by the executor through the backend's Communicator, so the planner places each
// rank's optimizer state (only the tensors it owns) like any other.
//
//   auto training = build_training_program(cfg, {.B = 4, .T = 64, .accum = 1}, DType::F32);
//   auto layout = make_data_parallel_layout(*training, world, /*loss_scale_micro_batches=*/world);
//   const Program& mine = layout->rank_programs[comm.rank()];
//   auto plan = make_plan(mine, cost_model, budgets, options);   // each rank plans its own
//   auto rank = DataParallelRank::create(comm, backend, *layout, *plan);
//   for (const auto& p : layout->params)                     // the same values on every rank
//     (*rank)->write_parameter(p.name, values_of(p.name));
//   (*rank)->write_input("mb0.tokens", my_tokens.data(), bytes);  // this rank's micro-batch
//   SPILLWAY_RETURN_IF_ERROR((*rank)->step({.step = 1, .lr = 6e-4f}));
//   (*rank)->read_output("mb0.losses", losses.data(), bytes);
//
// How the bits of one rank are kept:
// - Gradients, f32 (the CPU backend). One rank zeroes each gradient and lets every
//   micro-batch's backward add its contributions into it, in micro-batch order; the
//   CPU kernels form each contribution from zero and add it once
//   (backend/cpu/cpu_kernels.h), so the gradient is ((0 + c[0][0]) + c[0][1]) +
//   c[1][0] ... with c[k][j] the j-th op of micro-batch k that adds into it (tied
//   embeddings have two: the LM head and the embedding). The rank program gives each
//   such op after the first its own zeroed gradient "grad.part<j>.<p>", so every
//   contribution arrives separately, and the owner's ReduceGradient sums them into
//   "gradsum.<p>": ranks in order, parts in program order, fp32. The 1/(B·T·accum)
//   scale sits in the loss's backward as on one rank.
// - Gradients, bf16 (the CUDA backend). Its weight-gradient product adds into the
//   bf16 gradient with beta = 1: bf16(fp32(product + old value)), the product's fp32
//   sum never leaving cuBLASLt, so no rank can reproduce that addition from a product
//   formed elsewhere. One bf16 rank therefore forms only the step's first
//   contribution in place and every later one alone, in a zeroed bf16 part, adding
//   it with AccumulateGradient: g = bf16(float(g) + float(part)) (model.h, "Gradient
//   accumulation"). The rank program keeps the first contribution in the gradient and
//   gives each later one a part "grad.part<j>.<p>" of its own (the AccumulateGradient
//   ops are dropped), so each rank's parts are exactly the bf16 values one rank adds,
//   and the owner's ReduceGradient (Communicator::reduce_bf16_in_rank_order) starts
//   from rank 0's first part and adds every other in rank order, part order, with the
//   same fp32 addition rounded to bf16, into the bf16 "gradsum.<p>". SquaredNorm and
//   AdamW then read the bits one rank's gradient holds.
// - Global norm. Each tensor's owner runs the training program's SquaredNorm op(s) on
//   its reduced gradient into the packed squared norms (zero elsewhere);
//   AllReduceInRankOrder gives every rank every element (one non-zero term each, so
//   exact), and every rank runs the same ClipScale, which sums them in tensor order as
//   one rank does.
// - Update. The owner runs the tensor's AdamW op on its master weights and moments
//   (no other rank has them: partitioned state); BroadcastParam sends the new
//   parameter to every rank.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/communicator.h"
#include "core/status.h"
#include "dist/partition.h"
#include "exec/executor.h"
#include "plan/plan.h"
#include "program/program.h"

namespace spillway {

// One parameter tensor of the training program (one AdamW op).
struct DataParallelParam {
  std::string name;  // the parameter's tensor name ("transformer.h.0.attn.c_attn.weight", or a vocab tile "#j")
  int64_t n = 0;     // elements
  int parts = 1;     // contributions per micro-batch (2 for a tied embedding)
};

struct DataParallelLayout {
  int zero_stage = 2;                     // 2: parameters on every rank; 3: on their owner only
  std::vector<DataParallelParam> params;  // in AdamW order (ParamSpec order)
  std::map<std::string, size_t> param_index;  // params[i].name -> i
  Partition partition;                    // owner of each entry of `params`
  std::vector<Program> rank_programs;     // [world] what each rank's executor runs
};

// Splits `training` (build_training_program with this rank's micro-batches: accum 1,
// or A) into one program per rank and the partition of its parameters over `world`
// ranks. With A micro-batches a rank, rank r reads micro-batches r·A ... r·A+A-1 of
// one rank's N·A, and every micro-batch's contributions travel as parts of their own
// (A gradients' memory): a rank's own accumulation would add them in another order
// than one rank does. Rank r's program: the forward and backward (a gradient's second and later
// contributions each in a part of its own), each parameter's ReduceGradient (its
// owner) or SendGradient (the others) placed right after the backward op that writes
// its gradient's last contribution (phase Backward: the reduction can run while the
// rest of the backward computes; parameters finished by the same op follow it in
// parameter order, and every rank has them at the same positions), then the owned
// parameters' SquaredNorm ops,
// AllReduceInRankOrder of the squared norms, ClipScale, and per parameter the owner's
// AdamW and BroadcastParam. Only the owned parameters' master weights and moments are
// in it. One rank with accumulation N scales the loss gradient by 1/(B·T·N); each
// rank's CrossEntropyBackward scale is set to exactly that value with N =
// `loss_scale_micro_batches` (world · A), computed as the builder does.
// Errors: no AdamW or ClipScale op, world < 1, an AccumulateGradient without its
// zeroed part. F32 and bf16 programs both (the gradient sums and parameter broadcasts
// in the program's dtype; the squared norms f32).
// only_rank >= 0 builds that rank's program alone (the others are left empty), for
// predictions at sizes where a program per rank would not fit in memory.
// zero_stage 2 (the default): every rank holds every parameter, the owner broadcasts
// it after its update. 3: the parameters are partitioned too: only the owner holds
// one, and every op of the forward and backward that reads it reads a copy that a
// GatherParam fills from the owner, issued one layer ahead: at the start of the run
// of ops (same phase, micro-batch and layer) before the reader's, within its phase
// and micro-batch, else right before the reader (rank programs hold no parameter
// they do not own; a rank's device and host hold its shard and the copies in use).
Result<DataParallelLayout> make_data_parallel_layout(const Program& training, int world,
                                                     int loss_scale_micro_batches, int only_rank = -1,
                                                     int zero_stage = 2);

// One rank: its executor over its program, with the communicator set on the backend.
class DataParallelRank {
 public:
  // `plan` is a plan of layout.rank_programs[comm.rank()]. `comm` and `backend` must
  // outlive the rank.
  static Result<std::unique_ptr<DataParallelRank>> create(Communicator& comm, Backend& backend,
                                                          const DataParallelLayout& layout, const Plan& plan,
                                                          const ExecutorOptions& options = {});
  ~DataParallelRank();

  // Sets parameter `name` (a name of layout.params) to `values` (F32, n elements): the
  // parameter on this rank (a bf16 one rounded to nearest even, as Trainer does; with
  // ZeRO stage 3 on its owner only) and, on its owner, the master weights. Every rank
  // must be given the same values.
  Status write_parameter(const std::string& name, const std::vector<float>& values);
  // Inputs and outputs of the rank program (mb0.tokens, mb0.targets; mb0.losses).
  Status write_input(const std::string& name, const void* data, size_t bytes);
  Status read_output(const std::string& name, void* data, size_t bytes);
  // One step of the rank program. Every rank calls it together (its collectives wait
  // for the others). After an error the ranks' states differ; do not step again.
  Status step(const StepContext& ctx);
  // {clip scale, global gradient norm} of the last step (the same on every rank).
  Result<std::array<float, 2>> scale_norm();
  // The master weights of layout.params[i] when this rank owns it (F32, n elements).
  Result<std::vector<float>> master(size_t i);
  // The parameter layout.params[i] as this rank holds it (bf16 widened to F32); with
  // ZeRO stage 3 only its owner holds it (an error elsewhere).
  Result<std::vector<float>> parameter(size_t i);

  // Sharded checkpoints. Every rank calls save_shard after the same step: it writes
  // DIR/shard-<rank>-of-<world>.safetensors (made atomically, DIR made if missing)
  // with the master weights and both moments of the parameters it owns, and rank 0
  // also every parameter (with ZeRO stage 3, each rank the parameters it owns).
  // Metadata: format "spillway-dp-shard", version, rank, world, step, and an xxh3 of
  // each tensor's bytes. load_shards reads a checkpoint written
  // by any number of ranks into this one (the parameters everywhere, the optimizer
  // state of what this rank owns under its own partition) and returns the step it
  // was saved after. Errors name the folder, shard and tensor: a missing or extra
  // shard, shards of different runs, a checksum or size that does not match, a
  // tensor the program has not.
  Status save_shard(const std::string& dir, int64_t step);
  Result<int64_t> load_shards(const std::string& dir);
  const DataParallelLayout& layout() const { return layout_; }
  // The rank's executor (drain, metrics, trace, device_bytes, tensors by id).
  Executor& executor() { return *executor_; }
  const Program& program() const { return layout_.rank_programs[static_cast<size_t>(rank_)]; }

 private:
  DataParallelRank(Backend& backend, const DataParallelLayout& layout, int rank)
      : backend_(backend), layout_(layout), rank_(rank) {}
  Result<TensorId> find(const std::string& name) const;
  // Tensor t as F32 values, converted from or to its dtype (F32 or BF16).
  Status write_floats(TensorId t, const std::vector<float>& values);
  Result<std::vector<float>> read_floats(TensorId t);

  Backend& backend_;
  DataParallelLayout layout_;
  int rank_ = 0;
  std::unique_ptr<Executor> executor_;
};

// What verify_data_parallel_shards found in a folder of shards.
struct DataParallelShards {
  int world = 0;        // the ranks that wrote it (one shard each)
  int64_t step = 0;     // the step every shard was saved after
  uint64_t bytes = 0;   // the shards' files together
  size_t tensors = 0;   // tensors verified, over every shard
};
// Verifies a sharded checkpoint folder (DataParallelRank::save_shard's) without a
// program, with load_shards' own checks: every shard of one format, version, world
// and step, named after its rank, none missing; then every tensor of every shard read
// and compared with the xxh3 its metadata records (load_shards reads only those it
// loads). Errors name the folder or shard, and the tensor: Corrupt for damaged or
// missing data, NotFound for a folder without shards.
//
//   auto v = verify_data_parallel_shards("runs/a/dp-ckpt-00000010");
//   if (!v.ok()) std::puts(v.status().message().c_str());  // ".../shard-1-of-2.safetensors: adam_v.x does not match ..."
Result<DataParallelShards> verify_data_parallel_shards(const std::string& dir);

}  // namespace spillway
