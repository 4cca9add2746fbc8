// Data parallelism with partitioned optimizer state (ZeRO stage 1-2 by whole tensors),
// exact: N ranks with micro-batch B give, bit for bit, the losses and weights of one
// rank with accumulation N and micro-batch B, where rank r reads micro-batch r of each
// step's batch.
//
//   auto training = build_training_program(cfg, {.B = 4, .T = 64, .accum = 1}, DType::F32);
//   auto layout = make_data_parallel_layout(*training, comm.world_size());
//   auto plan = make_plan(layout->rank_program, cost_model, budgets, options);
//   auto rank = DataParallelRank::create(comm, backend, *layout, *plan);
//   for (const ParamSpec& s : parameter_specs(cfg))          // the same values on every rank
//     (*rank)->write_parameter(s.name, init_parameter(cfg, s, seed));  // (or each vocab tile "<name>#j")
//   (*rank)->write_input("mb0.tokens", my_tokens.data(), bytes);  // this rank's micro-batch
//   SPILLWAY_RETURN_IF_ERROR((*rank)->step({.step = 1, .lr = 6e-4f}));
//   (*rank)->read_output("mb0.losses", losses.data(), bytes);
//
// How the bits of one rank are kept:
// - Gradients. One rank zeroes each gradient and lets every micro-batch's backward add
//   its contributions into it, in micro-batch order; the CPU kernels form each
//   contribution from zero and add it once (backend/cpu/cpu_kernels.h), so the
//   gradient is ((0 + c[0][0]) + c[0][1]) + c[1][0] ... with c[k][j] the j-th op of
//   micro-batch k that adds into it (tied embeddings have two: the LM head and the
//   embedding). The rank program gives each such op after the first its own zeroed
//   gradient "grad.part<j>.<p>", so every contribution arrives separately, and the
//   owner sums them with Communicator::reduce_in_rank_order: ranks in order, parts in
//   program order, fp32. The 1/(B·T·accum) scale sits in the loss's backward as on one
//   rank (the training program of each rank is built with accum 1, so the caller
//   builds it with the world's token count: see make_data_parallel_layout).
// - Global norm. Each tensor's owner runs the training program's SquaredNorm op(s) of
//   it on the reduced gradient; the P squared norms are gathered (copied, no
//   arithmetic) and every rank runs the same ClipScale op, which sums them in tensor
//   order as one rank does.
// - Update. The owner runs the tensor's AdamW op on its master weights and moments
//   (the only copy of them: partitioned state), then broadcasts the new parameter.
//
// The collectives run between the executor's steps (a hook, not yet ops of the
// Program): see README's data-parallel paragraph for what Program ops need.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "dist/communicator.h"
#include "dist/partition.h"
#include "exec/executor.h"
#include "plan/plan.h"
#include "program/program.h"

namespace spillway {

// One parameter tensor of the training program (one AdamW op).
struct DataParallelParam {
  std::string name;               // the parameter's tensor name ("transformer.h.0.attn.c_attn.weight", or a tile "#j")
  size_t adamw_op = 0;            // index of its AdamW op in the training program
  std::vector<size_t> norm_ops;   // its SquaredNorm op(s) in the training program
  TensorId rank_param = kNoTensor;           // the parameter in the rank program
  std::vector<TensorId> rank_grad_parts;     // its gradient's contributions in the rank program, in op order
  int64_t n = 0;                  // elements
};

struct DataParallelLayout {
  Program training;       // the one-rank training program (accum 1) whose optimizer ops are run
  Program rank_program;   // what each rank's executor runs: forward and backward of its micro-batch
  std::vector<DataParallelParam> params;  // in AdamW order (ParamSpec order)
  size_t clip_op = 0;     // the ClipScale op of `training`
  std::vector<int> norm_owner;  // [P] which param each element of the squared-norm vector belongs to
  Partition partition;    // owner of each entry of `params`
};

// Splits `training` (build_training_program with accum 1: one micro-batch, this
// rank's) into the rank program and the partition of its parameters over `world`
// ranks. One rank with accumulation N scales the loss gradient by 1/(B·T·N); each
// rank's CrossEntropyBackward scale is set to exactly that value with N =
// `loss_scale_micro_batches` (the world size, or world · accumulation per rank),
// computed as the builder does. Errors: a program with more than one micro-batch, no
// AdamW or ClipScale op, an activation dtype other than F32 (bf16 gradients need their
// contributions in fp32 to be reduced exactly: not done yet), world < 1.
Result<DataParallelLayout> make_data_parallel_layout(const Program& training, int world,
                                                     int loss_scale_micro_batches);

class DataParallelRank {
 public:
  static Result<std::unique_ptr<DataParallelRank>> create(Communicator& comm, Backend& backend,
                                                          const DataParallelLayout& layout, const Plan& plan,
                                                          const ExecutorOptions& options = {});
  ~DataParallelRank();

  // Sets parameter `name` (a name of layout.params) to `values` (F32, n elements): the
  // parameter on this rank and, on its owner, the master weights (moments zeroed).
  // Every rank must be given the same values.
  Status write_parameter(const std::string& name, const std::vector<float>& values);
  // Inputs and outputs of the rank program (mb0.tokens, mb0.targets; mb0.losses).
  Status write_input(const std::string& name, const void* data, size_t bytes);
  Status read_output(const std::string& name, void* data, size_t bytes);
  // One step: this rank's forward and backward, the gradients reduced to their
  // owners, the global norm, the owners' AdamW, the parameters broadcast. Every rank
  // calls it together. After an error the ranks' states differ; do not step again.
  Status step(const StepContext& ctx);
  // {clip scale, global gradient norm} of the last step (the same on every rank).
  const float* scale_norm() const { return scale_norm_host_; }
  // The master weights of layout.params[i] when this rank owns it (F32, n elements).
  Result<std::vector<float>> master(size_t i) const;
  // The parameter layout.params[i] as this rank's executor holds it.
  Result<std::vector<float>> parameter(size_t i);
  const DataParallelLayout& layout() const { return layout_; }

 private:
  DataParallelRank(Communicator& comm, Backend& backend, const DataParallelLayout& layout)
      : comm_(comm), backend_(backend), layout_(layout) {}
  Status run_optimizer(const StepContext& ctx);
  void* alloc(size_t bytes);

  struct Shard {  // an owned parameter's state, in the backend's device memory
    float* master = nullptr;  // [n]
    float* m = nullptr;       // [n]
    float* v = nullptr;       // [n]
    float* grad = nullptr;    // [n] the reduced gradient
  };

  Communicator& comm_;
  Backend& backend_;
  DataParallelLayout layout_;
  std::unique_ptr<Executor> executor_;
  std::vector<Shard> shards_;      // [params] (empty Shard when not owned)
  std::vector<void*> allocations_;
  float* parts_ = nullptr;         // [max parts · max n] this rank's contributions of one gradient
  float* param_ = nullptr;         // [max n] a parameter being updated or broadcast
  float* sq_ = nullptr;            // [P] squared norms (this rank's, then the gathered ones)
  float* sq_all_ = nullptr;        // [world · P]
  float* scale_norm_ = nullptr;    // [2]
  void* workspace_ = nullptr;      // for the optimizer's ops
  size_t workspace_bytes_ = 0;
  float scale_norm_host_[2] = {0, 0};
  std::vector<float> host_;        // staging between the executor and the device buffers
};

}  // namespace spillway
