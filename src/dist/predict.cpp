#include "dist/predict.h"

#include <algorithm>
#include <string>
#include <unordered_map>

#include "dist/data_parallel.h"

namespace spillway {

double chained_reduce_seconds(double bytes, int world, const NetworkLink& link) {
  if (world <= 1 || link.bytes_per_s <= 0) return 0;
  const double chunk = std::min(bytes, kChainChunkBytes);
  return bytes / link.bytes_per_s + link.latency_s + (world - 1) * (chunk / link.bytes_per_s + link.latency_s);
}

double collective_seconds(const Program& rank_program, size_t op_index, int world, const NetworkLink& link) {
  if (world <= 1 || op_index >= rank_program.ops.size() || link.bytes_per_s <= 0) return 0;
  const Op& op = rank_program.ops[op_index];
  // Elements of the operands' dtype (bf16 gradients and parameters on CUDA).
  const double elem = op.operands.empty()
                          ? sizeof(float)
                          : static_cast<double>(dtype_size(rank_program.tensors.info(op.operands.back().tensor).dtype));
  const double bytes = static_cast<double>(op.attrs.n) * elem, others = world - 1;
  switch (op.kind) {
    case OpKind::ReduceGradient:  // the running sum (n elements, the parts added on each rank)
    case OpKind::SendGradient:    // every rank of the chain waits for it to pass
      return chained_reduce_seconds(bytes, world, link);
    case OpKind::AllReduceInRankOrder:  // a gather to rank 0, then a broadcast
      return (others + 1) * bytes / link.bytes_per_s + 2 * link.latency_s;
    case OpKind::BroadcastParam:
    case OpKind::GatherParam:
      return bytes / link.bytes_per_s + link.latency_s;
    default:
      return 0;
  }
}

Result<DataParallelPrediction> predict_data_parallel(const Program& training, int world, int loss_scale_micro_batches,
                                                     int64_t tokens_per_rank, const CostModel& cost,
                                                     const std::function<Result<Plan>(const Program&)>& plan_rank,
                                                     const NetworkLink& link, int zero_stage) {
  if (world > 1 && !(link.bytes_per_s > 0))
    return Status::invalid_argument("data-parallel prediction: " + std::to_string(world) +
                                    " ranks need the network's rate (bytes/s per GPU, one direction); none was given");
  if (tokens_per_rank <= 0)
    return Status::invalid_argument("data-parallel prediction: tokens per rank is " + std::to_string(tokens_per_rank));
  // The busiest rank: the partition depends on the sizes only, so a one-rank layout
  // first tells which rank that is.
  SPILLWAY_ASSIGN_OR_RETURN(DataParallelLayout probe,
                            make_data_parallel_layout(training, world, loss_scale_micro_batches, 0, zero_stage));
  const auto& bytes = probe.partition.rank_bytes;
  const int busiest = static_cast<int>(std::max_element(bytes.begin(), bytes.end()) - bytes.begin());
  DataParallelLayout layout = std::move(probe);
  if (busiest != 0) {
    SPILLWAY_ASSIGN_OR_RETURN(layout,
                              make_data_parallel_layout(training, world, loss_scale_micro_batches, busiest, zero_stage));
  }
  const Program& mine = layout.rank_programs[static_cast<size_t>(busiest)];
  SPILLWAY_ASSIGN_OR_RETURN(Plan plan, plan_rank(mine));
  DataParallelPrediction p;
  p.world = world;
  p.zero_stage = layout.zero_stage;
  p.busiest_rank = busiest;
  p.compute_s = cost.step_seconds(mine, plan);
  // The reduces and gathers on their own stream beside the forward and backward
  // (predict.h, "Overlap"), one after another in program order; an op that reads a
  // gathered copy waits for its gather.
  double compute = 0, stream_end = 0, tail = 0, waited = 0;
  std::unordered_map<TensorId, double> gathered;  // copy -> when its gather ends
  bool optimizer = false;
  for (size_t i = 0; i < mine.ops.size(); ++i) {
    const Op& op = mine.ops[i];
    const double c = collective_seconds(mine, i, world, link);
    p.collective_s += c;
    optimizer = optimizer || op.phase == Phase::Optimizer;
    if (optimizer) {
      tail += c;  // waited for whole
    } else if (op.kind == OpKind::ReduceGradient || op.kind == OpKind::SendGradient) {
      stream_end = std::max(stream_end, compute) + c;
    } else if (op.kind == OpKind::GatherParam) {
      stream_end = std::max(stream_end, compute) + c;
      gathered[op.operands[0].tensor] = stream_end;
    } else {
      for (const Operand& o : op.operands) {
        auto it = gathered.find(o.tensor);
        if (it == gathered.end() || it->second <= compute) continue;
        waited += it->second - compute;
        compute = it->second;
      }
      compute += cost.op_seconds(mine, i);
    }
  }
  p.exposed_s = std::max(0.0, stream_end - compute) + tail + waited;
  p.hidden_s = std::max(0.0, p.collective_s - p.exposed_s);
  p.step_s = p.compute_s + p.exposed_s;
  if (p.step_s > 0) {
    p.tokens_per_s_per_gpu = static_cast<double>(tokens_per_rank) / p.step_s;
    p.tokens_per_s = p.tokens_per_s_per_gpu * world;
  }
  return p;
}

}  // namespace spillway
