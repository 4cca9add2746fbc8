#include "dist/data_parallel.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <map>
#include <string>

#include "core/checksum.h"
#include "model/safetensors.h"
#include "optim/adamw.h"
#include "program/op_registry.h"

namespace spillway {

namespace {

Status fail(const std::string& what) { return Status::invalid_argument("data parallel: " + what); }

// One parameter as the training program has it.
struct ParamOps {
  size_t adamw = 0;                  // its AdamW op
  std::vector<size_t> norms;         // its SquaredNorm op(s)
  TensorId param = kNoTensor, grad = kNoTensor;
  std::vector<TensorId> parts;       // its gradient's contributions, in op order (grad first)
};

Op make(OpKind kind, std::string name, std::vector<Operand> operands, OpAttrs attrs, int micro_batch = -1) {
  Op op;
  op.kind = kind;
  op.name = std::move(name);
  op.operands = std::move(operands);
  op.attrs = attrs;
  op.phase = Phase::Optimizer;
  op.micro_batch = micro_batch;
  return op;
}

}  // namespace

Result<DataParallelLayout> make_data_parallel_layout(const Program& training, int world,
                                                     int loss_scale_micro_batches, int only_rank, int zero_stage) {
  if (world < 1) return fail("world size is " + std::to_string(world) + "; need at least 1 rank");
  if (zero_stage != 2 && zero_stage != 3)
    return fail("ZeRO stage " + std::to_string(zero_stage) +
                "; expected 2 (optimizer state and gradients partitioned, every rank holds the parameters) or 3 "
                "(the parameters partitioned too, gathered ahead of each use)");
  if (only_rank >= world)
    return fail("rank " + std::to_string(only_rank) + " is not one of " + std::to_string(world));
  if (loss_scale_micro_batches < 1)
    return fail("loss scale micro-batches is " + std::to_string(loss_scale_micro_batches) + "; need at least 1");
  SPILLWAY_RETURN_IF_ERROR(training.validate());
  const TensorTable& T = training.tensors;
  size_t clip = SIZE_MAX;
  for (size_t i = 0; i < training.ops.size(); ++i) {
    const Op& op = training.ops[i];
    if (op.kind == OpKind::ClipScale) clip = i;
  }
  if (clip == SIZE_MAX) return fail("the training program has no ClipScale op");

  // Parameters, from the AdamW ops (operands: param, master, m, v, grad, scale_norm).
  std::vector<ParamOps> params;
  std::map<TensorId, size_t> param_of_grad;
  for (size_t i = 0; i < training.ops.size(); ++i) {
    const Op& op = training.ops[i];
    if (op.kind != OpKind::AdamW) continue;
    ParamOps p;
    p.adamw = i;
    p.param = op.operands[0].tensor;
    p.grad = op.operands[4].tensor;
    param_of_grad[p.grad] = params.size();
    params.push_back(p);
  }
  if (params.empty()) return fail("the training program has no AdamW op");
  const TensorId sq = training.ops[clip].operands[1].tensor;
  for (size_t i = 0; i < training.ops.size(); ++i) {
    const Op& op = training.ops[i];
    if (op.kind != OpKind::SquaredNorm) continue;
    auto it = param_of_grad.find(op.operands[1].tensor);
    if (it == param_of_grad.end()) return fail("SquaredNorm op '" + op.name + "' reads no parameter's gradient");
    if (op.operands[0].access != Access::Update || op.operands[0].tensor != sq)
      return fail("SquaredNorm op '" + op.name + "' does not add into the clip's packed squared norms");
    params[it->second].norms.push_back(i);
  }

  // The forward and backward, shared by every rank: each gradient's second and later
  // contributions retargeted to a zeroed part of their own. F32 programs add every
  // contribution into the gradient; bf16 programs already form the later ones in a
  // zeroed scratch and add it with AccumulateGradient (model.h, "Gradient
  // accumulation"): that scratch becomes a part of its own, and the addition is left
  // to the owner's reduction.
  std::vector<TensorInfo> infos(T.infos().begin(), T.infos().end());
  std::vector<Op> body;
  std::map<TensorId, std::vector<TensorId>> parts;  // grad -> its parts (the grad itself first)
  // bf16: for each op that zeroes a scratch which an AccumulateGradient adds into a
  // gradient, that gradient (found scanning backwards: the next such addition).
  std::map<size_t, TensorId> zero_of_part;
  {
    std::map<TensorId, TensorId> next_grad;  // scratch -> the gradient of its next AccumulateGradient
    for (size_t i = training.ops.size(); i-- > 0;) {
      const Op& op = training.ops[i];
      if (op.kind == OpKind::AccumulateGradient) {
        if (T.info(op.operands[0].tensor).role != Role::Grad)
          return fail("AccumulateGradient op '" + op.name + "' adds into '" + T.info(op.operands[0].tensor).name +
                      "', which is not a gradient");
        next_grad[op.operands[1].tensor] = op.operands[0].tensor;
      } else if (op.kind == OpKind::Zero) {
        auto it = next_grad.find(op.operands[0].tensor);
        if (it != next_grad.end()) {
          zero_of_part[i] = it->second;
          next_grad.erase(it);
        }
      }
    }
  }
  std::map<TensorId, TensorId> current_part;  // bf16 scratch -> the part it stands for since its last Zero
  for (size_t index = 0; index < training.ops.size(); ++index) {
    const Op& src = training.ops[index];
    if (src.phase == Phase::Optimizer) continue;
    if (src.kind == OpKind::AccumulateGradient) {
      if (current_part.erase(src.operands[1].tensor) == 0)
        return fail("AccumulateGradient op '" + src.name + "' reads '" + T.info(src.operands[1].tensor).name +
                    "', which no earlier op zeroed");
      continue;  // the owner adds the part (ReduceGradient)
    }
    Op op = src;
    if (auto z = zero_of_part.find(index); z != zero_of_part.end()) {
      std::vector<TensorId>& list = parts[z->second];
      if (list.empty())
        return fail("op '" + src.name + "' starts a later contribution to '" + T.info(z->second).name +
                    "' before its first");
      TensorInfo part = T.info(z->second);
      const std::string base = part.name.rfind("grad.", 0) == 0 ? part.name.substr(5) : part.name;
      part.name = "grad.part" + std::to_string(list.size()) + "." + base;
      infos.push_back(part);
      const TensorId id = static_cast<TensorId>(infos.size() - 1);
      list.push_back(id);
      current_part[src.operands[0].tensor] = id;
      op.operands[0].tensor = id;
      body.push_back(std::move(op));
      continue;
    }
    if (op.kind == OpKind::CrossEntropyBackward)
      op.attrs.scale = static_cast<float>(1.0 / (static_cast<double>(op.attrs.N) * loss_scale_micro_batches));
    if (op.kind != OpKind::Zero) {
      for (Operand& o : op.operands) {
        if (auto c = current_part.find(o.tensor); c != current_part.end()) {
          o.tensor = c->second;  // a bf16 later contribution, into its own part
          continue;
        }
        if (o.access == Access::Read || T.info(o.tensor).role != Role::Grad) continue;
        std::vector<TensorId>& list = parts[o.tensor];
        if (list.empty()) {
          list.push_back(o.tensor);
          continue;
        }
        TensorInfo part = T.info(o.tensor);
        const std::string base = part.name.rfind("grad.", 0) == 0 ? part.name.substr(5) : part.name;
        part.name = "grad.part" + std::to_string(list.size()) + "." + base;
        infos.push_back(part);
        const TensorId id = static_cast<TensorId>(infos.size() - 1);
        list.push_back(id);
        Op zero = make(OpKind::Zero, part.name + ".zero", {{id, Access::Write}}, {}, src.micro_batch);
        zero.phase = src.phase;  // just before its first (only) contribution
        zero.layer = src.layer;
        body.push_back(std::move(zero));
        o.tensor = id;
        if (o.access == Access::Write) o.access = Access::Update;
      }
    }
    body.push_back(std::move(op));
  }
  DataParallelLayout L;
  L.zero_stage = zero_stage;
  std::vector<uint64_t> bytes;
  for (ParamOps& p : params) {
    auto it = parts.find(p.grad);
    if (it == parts.end()) return fail("no op of the backward adds into '" + T.info(p.grad).name + "'");
    p.parts = it->second;
    DataParallelParam d;
    d.name = T.info(p.param).name;
    d.n = T.info(p.param).shape.numel();
    d.parts = static_cast<int>(p.parts.size());
    const int most = static_cast<int>(op_info(OpKind::SendGradient).slots.size());
    if (d.parts > most)
      return fail("the gradient of '" + d.name + "' has " + std::to_string(d.parts) +
                  " contributions a step (micro-batches a rank × contributions each); the reduction takes at most " +
                  std::to_string(most) + ": fewer micro-batches a rank");
    L.param_index[d.name] = L.params.size();
    L.params.push_back(d);
    // What the owner holds besides the parameter: master and moments (F32) and the
    // reduced gradient (the gradient's dtype).
    bytes.push_back(static_cast<uint64_t>(d.n) * (3 * sizeof(float) + dtype_size(T.info(p.grad).dtype)));
  }
  if (!current_part.empty()) return fail("a bf16 part is zeroed and never added into its gradient");
  SPILLWAY_ASSIGN_OR_RETURN(L.partition, partition_by_bytes(bytes, world));
  // The owners' reduced gradients.
  std::vector<TensorId> gradsum(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string base = T.info(params[i].param).name;
    infos.push_back({"gradsum." + base, T.info(params[i].grad).dtype, T.info(params[i].param).shape, Role::Grad});
    gradsum[i] = static_cast<TensorId>(infos.size() - 1);
  }

  // Each gradient's reduction goes right after the op of the backward that writes its
  // last contribution (the last op that writes any of its parts), so that it can run
  // while the rest of the backward computes. Parameters whose last contributions come
  // from the same op follow it in parameter order. Every rank has the same body and
  // the same positions: the ranks call the collectives in the same order.
  std::vector<std::vector<size_t>> reduce_after(body.size());  // body op -> the parameters reduced after it
  {
    std::map<TensorId, size_t> param_of_part;
    for (size_t i = 0; i < params.size(); ++i)
      for (TensorId t : params[i].parts) param_of_part[t] = i;
    std::vector<size_t> last(params.size(), SIZE_MAX);
    for (size_t j = 0; j < body.size(); ++j)
      for (const Operand& o : body[j].operands)
        if (o.access != Access::Read)
          if (auto it = param_of_part.find(o.tensor); it != param_of_part.end()) last[it->second] = j;
    for (size_t i = 0; i < params.size(); ++i) {
      if (last[i] == SIZE_MAX) return fail("no op of the backward writes the gradient of '" + L.params[i].name + "'");
      reduce_after[last[i]].push_back(i);
    }
  }
  // ZeRO stage 3: every op of the forward and backward that reads a parameter reads
  // a copy of it instead, which a GatherParam fills from the owner (the same copy and
  // place on every rank: the ranks call the gathers in one order). Only the owner
  // keeps the parameter; the copies live from the gather to their one use, so the
  // planner frees them after it. The gathers go one layer ahead, as FSDP prefetches
  // the next module: those of a layer's ops (a run of ops of one phase, micro-batch
  // and layer) go to the start of the run before it when that run has the same phase
  // and micro-batch, so the link moves them while that layer computes (the executor
  // makes only the op that reads a copy wait for its gather); those of the first run
  // of a phase and micro-batch stay right before their op. Each gather carries the phase, micro-batch and layer of
  // the op it precedes, so the planner's reorders keep it ahead of its reader.
  std::vector<std::vector<std::pair<size_t, TensorId>>> gather_at(body.size());  // body op -> (param, copy) before it
  if (zero_stage == 3) {
    std::vector<size_t> run_start(body.size());  // the first op of each op's run
    for (size_t j = 0; j < body.size(); ++j) {
      const bool same = j > 0 && body[j].phase == body[j - 1].phase && body[j].micro_batch == body[j - 1].micro_batch &&
                        body[j].layer == body[j - 1].layer;
      run_start[j] = same ? run_start[j - 1] : j;
    }
    auto issue_point = [&](size_t j) {
      const size_t s = run_start[j];
      if (s == 0 || body[s - 1].phase != body[j].phase || body[s - 1].micro_batch != body[j].micro_batch) return j;
      return run_start[s - 1];
    };
    std::map<TensorId, size_t> param_index;
    for (size_t i = 0; i < params.size(); ++i) param_index[params[i].param] = i;
    size_t copies = 0;
    for (size_t j = 0; j < body.size(); ++j)
      for (Operand& o : body[j].operands) {
        auto it = param_index.find(o.tensor);
        if (it == param_index.end()) continue;
        if (o.access != Access::Read)
          return fail("op '" + body[j].name + "' writes the parameter '" + T.info(o.tensor).name +
                      "'; with ZeRO stage 3 only its AdamW may");
        TensorInfo copy = T.info(o.tensor);
        copy.name = "gathered" + std::to_string(copies++) + "." + copy.name;
        copy.role = Role::Activation;
        infos.push_back(copy);
        const TensorId id = static_cast<TensorId>(infos.size() - 1);
        gather_at[issue_point(j)].push_back({it->second, id});
        o.tensor = id;
      }
  }
  for (int r = 0; r < world; ++r) {
    if (only_rank >= 0 && r != only_rank) {
      L.rank_programs.emplace_back();
      continue;
    }
    std::vector<Op> ops;
    ops.reserve(body.size() + 2 * params.size() + 8);
    for (size_t j = 0; j < body.size(); ++j) {
      for (const auto& [i, copy] : gather_at[j]) {
        const int owner = L.partition.owner[i];
        OpAttrs a;
        a.n = L.params[i].n;
        a.root = owner;
        std::vector<Operand> in = {{copy, Access::Write}};
        if (owner == r) in.push_back({params[i].param, Access::Read});
        Op op = make(OpKind::GatherParam, "gather." + infos[static_cast<size_t>(copy)].name, std::move(in), a,
                     body[j].micro_batch);
        op.phase = body[j].phase;
        op.layer = body[j].layer;
        ops.push_back(std::move(op));
      }
      ops.push_back(body[j]);
      for (size_t i : reduce_after[j]) {
        const int owner = L.partition.owner[i];
        OpAttrs a;
        a.n = L.params[i].n;
        a.root = owner;
        std::vector<Operand> in;
        for (TensorId t : params[i].parts) in.push_back({t, Access::Read});
        Op op;
        if (owner == r) {
          in.insert(in.begin(), Operand{gradsum[i], Access::Write});
          op = make(OpKind::ReduceGradient, "reduce." + L.params[i].name, std::move(in), a);
        } else {
          op = make(OpKind::SendGradient, "send." + L.params[i].name, std::move(in), a);
        }
        // Part of the backward now (the planner's reorders keep backward ops in
        // program order, and so these right after the op they follow).
        op.phase = Phase::Backward;
        op.micro_batch = body[j].micro_batch;
        op.layer = body[j].layer;
        ops.push_back(std::move(op));
      }
    }
    // The packed squared norms: zeroed, the owners' elements, summed over ranks.
    const Op* zero_sq = nullptr;
    for (const Op& op : training.ops)
      if (op.kind == OpKind::Zero && op.operands[0].tensor == sq) zero_sq = &op;
    if (zero_sq == nullptr) return fail("no op zeroes the squared norms '" + T.info(sq).name + "'");
    ops.push_back(*zero_sq);
    for (size_t i = 0; i < params.size(); ++i) {
      if (L.partition.owner[i] != r) continue;
      for (size_t n : params[i].norms) {
        Op op = training.ops[n];
        op.operands[1].tensor = gradsum[i];
        ops.push_back(std::move(op));
      }
    }
    OpAttrs all;
    all.n = T.info(sq).shape.numel();
    ops.push_back(make(OpKind::AllReduceInRankOrder, "allreduce.grad_sqnorms", {{sq, Access::Update}}, all));
    ops.push_back(training.ops[clip]);
    for (size_t i = 0; i < params.size(); ++i) {
      const int owner = L.partition.owner[i];
      if (owner == r) {
        Op op = training.ops[params[i].adamw];
        op.operands[4].tensor = gradsum[i];
        ops.push_back(std::move(op));
      }
      if (zero_stage == 3) continue;  // only the owner holds the parameter; it is gathered where used
      OpAttrs a;
      a.n = L.params[i].n;
      a.root = owner;
      ops.push_back(make(OpKind::BroadcastParam, "broadcast." + L.params[i].name, {{params[i].param, Access::Update}}, a));
    }
    // Keep the tensors these ops use, renumbered in table order.
    std::vector<bool> used(infos.size(), false);
    for (const Op& op : ops)
      for (const Operand& o : op.operands) used[static_cast<size_t>(o.tensor)] = true;
    for (TensorId t : training.inputs) used[static_cast<size_t>(t)] = true;
    std::vector<TensorId> remap(infos.size(), kNoTensor);
    Program R;
    for (size_t t = 0; t < infos.size(); ++t)
      if (used[t]) remap[t] = R.tensors.add(infos[t]);
    for (Op& op : ops) {
      for (Operand& o : op.operands) o.tensor = remap[static_cast<size_t>(o.tensor)];
      R.add_op(std::move(op));
    }
    for (TensorId t : training.inputs) R.inputs.push_back(remap[static_cast<size_t>(t)]);
    for (TensorId t : training.outputs)
      if (used[static_cast<size_t>(t)]) R.outputs.push_back(remap[static_cast<size_t>(t)]);
    SPILLWAY_RETURN_IF_ERROR(R.validate().with_context("data parallel: the program of rank " + std::to_string(r)));
    L.rank_programs.push_back(std::move(R));
  }
  return L;
}

// ---- DataParallelRank --------------------------------------------------------------

DataParallelRank::~DataParallelRank() {
  executor_.reset();
  backend_.set_communicator(nullptr);
}

Result<std::unique_ptr<DataParallelRank>> DataParallelRank::create(Communicator& comm, Backend& backend,
                                                                   const DataParallelLayout& layout, const Plan& plan,
                                                                   const ExecutorOptions& options) {
  if (layout.partition.world != comm.world_size() ||
      layout.rank_programs.size() != static_cast<size_t>(comm.world_size()))
    return fail("the layout is made for " + std::to_string(layout.partition.world) + " ranks; the communicator has " +
                std::to_string(comm.world_size()));
  std::unique_ptr<DataParallelRank> r(new DataParallelRank(backend, layout, comm.rank()));
  SPILLWAY_ASSIGN_OR_RETURN(r->executor_, Executor::create(backend, r->program(), plan, options));
  backend.set_communicator(&comm);
  return r;
}

Result<TensorId> DataParallelRank::find(const std::string& name) const {
  const TensorId t = program().tensors.find(name);
  if (t == kNoTensor) return fail("the program of rank " + std::to_string(rank_) + " has no tensor '" + name + "'");
  return t;
}

Status DataParallelRank::write_floats(TensorId t, const std::vector<float>& values) {
  const TensorInfo& info = program().tensors.info(t);
  if (values.size() != static_cast<size_t>(info.shape.numel()))
    return fail("tensor '" + info.name + "' has " + std::to_string(info.shape.numel()) + " elements; given " +
                std::to_string(values.size()));
  if (info.dtype == DType::F32) return executor_->write_tensor(t, values.data(), values.size() * sizeof(float));
  if (info.dtype != DType::BF16)
    return fail("tensor '" + info.name + "' is " + dtype_name(info.dtype) + "; expected f32 or bf16");
  std::vector<uint16_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i) bits[i] = float_to_bf16(values[i]);
  return executor_->write_tensor(t, bits.data(), bits.size() * sizeof(uint16_t));
}

Result<std::vector<float>> DataParallelRank::read_floats(TensorId t) {
  const TensorInfo& info = program().tensors.info(t);
  std::vector<float> v(static_cast<size_t>(info.shape.numel()));
  if (info.dtype == DType::F32) {
    SPILLWAY_RETURN_IF_ERROR(executor_->read_tensor(t, v.data(), v.size() * sizeof(float)));
    return v;
  }
  if (info.dtype != DType::BF16)
    return fail("tensor '" + info.name + "' is " + dtype_name(info.dtype) + "; expected f32 or bf16");
  std::vector<uint16_t> bits(v.size());
  SPILLWAY_RETURN_IF_ERROR(executor_->read_tensor(t, bits.data(), bits.size() * sizeof(uint16_t)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = bf16_to_float(bits[i]);
  return v;
}

Status DataParallelRank::write_parameter(const std::string& name, const std::vector<float>& values) {
  for (size_t i = 0; i < layout_.params.size(); ++i) {
    const DataParallelParam& p = layout_.params[i];
    if (p.name != name) continue;
    if (values.size() != static_cast<size_t>(p.n))
      return fail("parameter '" + name + "' has " + std::to_string(p.n) + " elements; given " +
                  std::to_string(values.size()));
    const size_t bytes = values.size() * sizeof(float);
    const bool owner = layout_.partition.owner[i] == rank_;
    if (!owner && layout_.zero_stage == 3) return Status::ok();  // held by its owner alone
    SPILLWAY_ASSIGN_OR_RETURN(TensorId param, find(name));
    // In the program's dtype (bf16: rounded to nearest even, as Trainer writes it).
    SPILLWAY_RETURN_IF_ERROR(write_floats(param, values));
    if (!owner) return Status::ok();
    SPILLWAY_ASSIGN_OR_RETURN(TensorId master, find("master." + name));
    return executor_->write_tensor(master, values.data(), bytes);
  }
  return fail("no parameter is called '" + name + "'");
}

Status DataParallelRank::write_input(const std::string& name, const void* data, size_t bytes) {
  SPILLWAY_ASSIGN_OR_RETURN(TensorId t, find(name));
  return executor_->write_tensor(t, data, bytes);
}

Status DataParallelRank::read_output(const std::string& name, void* data, size_t bytes) {
  SPILLWAY_ASSIGN_OR_RETURN(TensorId t, find(name));
  return executor_->read_tensor(t, data, bytes);
}

Status DataParallelRank::step(const StepContext& ctx) {
  return executor_->run_step(ctx).with_context("data parallel rank " + std::to_string(rank_) + ", step " +
                                               std::to_string(ctx.step));
}

Result<std::array<float, 2>> DataParallelRank::scale_norm() {
  std::array<float, 2> v{};
  SPILLWAY_RETURN_IF_ERROR(read_output("clip.scale_norm", v.data(), sizeof v));
  return v;
}

Result<std::vector<float>> DataParallelRank::master(size_t i) {
  if (i >= layout_.params.size()) return fail("no parameter " + std::to_string(i));
  if (layout_.partition.owner[i] != rank_)
    return fail("rank " + std::to_string(rank_) + " does not own '" + layout_.params[i].name + "' (rank " +
                std::to_string(layout_.partition.owner[i]) + " does)");
  std::vector<float> v(static_cast<size_t>(layout_.params[i].n));
  SPILLWAY_RETURN_IF_ERROR(read_output("master." + layout_.params[i].name, v.data(), v.size() * sizeof(float)));
  return v;
}

Result<std::vector<float>> DataParallelRank::parameter(size_t i) {
  if (i >= layout_.params.size()) return fail("no parameter " + std::to_string(i));
  if (layout_.zero_stage == 3 && layout_.partition.owner[i] != rank_)
    return fail("rank " + std::to_string(rank_) + " does not hold parameter '" + layout_.params[i].name +
                "' (ZeRO stage 3: only its owner, rank " + std::to_string(layout_.partition.owner[i]) + ", does)");
  SPILLWAY_ASSIGN_OR_RETURN(TensorId t, find(layout_.params[i].name));
  return read_floats(t);
}

}  // namespace spillway

// ---- sharded checkpoints ------------------------------------------------------------

namespace spillway {

namespace {

constexpr const char* kShardFormat = "spillway-dp-shard";
constexpr int kShardVersion = 1;

std::string shard_name(int rank, int world) {
  return "shard-" + std::to_string(rank) + "-of-" + std::to_string(world) + ".safetensors";
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

uint64_t checksum_of(const std::vector<float>& v) { return checksum64(v.data(), v.size() * sizeof(float)); }

// A shard's metadata field as an integer, or an error naming the shard.
Result<int64_t> meta_int(const SafetensorsReader& r, const std::string& key) {
  auto it = r.metadata().find(key);
  if (it == r.metadata().end()) return fail(r.path() + ": no '" + key + "' in its metadata (not a data-parallel shard)");
  try {
    size_t used = 0;
    const long long v = std::stoll(it->second, &used);
    if (used != it->second.size()) throw std::invalid_argument(it->second);
    return static_cast<int64_t>(v);
  } catch (const std::exception&) {
    return fail(r.path() + ": metadata '" + key + "' is '" + it->second + "', expected an integer");
  }
}

}  // namespace

Status DataParallelRank::save_shard(const std::string& dir, int64_t step) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::io_error("data parallel: cannot make checkpoint folder " + dir + ": " + ec.message());
  std::vector<SafetensorsTensor> tensors;
  std::map<std::string, std::string> meta{{"format", kShardFormat},
                                          {"version", std::to_string(kShardVersion)},
                                          {"rank", std::to_string(rank_)},
                                          {"world", std::to_string(layout_.partition.world)},
                                          {"step", std::to_string(step)}};
  // Values are read now (the checksums go in the header, written first).
  auto add = [&](const std::string& name, std::vector<float> v) {
    meta["xxh3." + name] = hex64(checksum_of(v));
    const auto n = static_cast<int64_t>(v.size());
    auto shared = std::make_shared<std::vector<float>>(std::move(v));
    tensors.push_back({name, {n}, [shared]() -> Result<std::vector<float>> { return *shared; }});
  };
  for (size_t i = 0; i < layout_.params.size(); ++i) {
    const std::string& name = layout_.params[i].name;
    const size_t n = static_cast<size_t>(layout_.params[i].n);
    // The parameters: rank 0 writes them all, or with ZeRO stage 3 each owner its own
    // (load_shards takes a tensor from whichever shard holds it).
    if (layout_.zero_stage == 3 ? layout_.partition.owner[i] == rank_ : rank_ == 0) {
      SPILLWAY_ASSIGN_OR_RETURN(std::vector<float> p, parameter(i));
      add(name, std::move(p));
    }
    if (layout_.partition.owner[i] != rank_) continue;
    for (const char* prefix : {"master.", "adam_m.", "adam_v."}) {
      std::vector<float> v(n);
      SPILLWAY_RETURN_IF_ERROR(read_output(prefix + name, v.data(), n * sizeof(float)));
      add(prefix + name, std::move(v));
    }
  }
  const std::string path = (std::filesystem::path(dir) / shard_name(rank_, layout_.partition.world)).string();
  return write_safetensors(path, tensors, meta).with_context("data parallel: rank " + std::to_string(rank_) +
                                                             " writing its checkpoint shard");
}

namespace {

// The shards of a checkpoint folder, opened, with their metadata checked: every one
// of one format, version, world size and step, named after its rank, none missing.
struct ShardSet {
  std::vector<SafetensorsReader> shards;  // by file name
  int64_t world = 0, step = 0;
};

Result<ShardSet> open_shard_set(const std::string& dir) {
  std::error_code ec;
  std::vector<std::string> found;
  // Incremented with an error code: a range-for would throw on a failing step.
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.starts_with("shard-") && name.ends_with(".safetensors")) found.push_back(it->path().string());
  }
  if (ec) return Status::io_error("data parallel: cannot read checkpoint folder " + dir + ": " + ec.message());
  if (found.empty()) return Status::not_found("data parallel: no checkpoint shards (shard-R-of-N.safetensors) in " + dir);
  std::sort(found.begin(), found.end());
  ShardSet set;
  int64_t world = -1, step = -1;
  std::vector<bool> seen;
  for (const std::string& path : found) {
    SPILLWAY_ASSIGN_OR_RETURN(SafetensorsReader r, SafetensorsReader::open(path));
    auto format = r.metadata().find("format");
    if (format == r.metadata().end() || format->second != kShardFormat)
      return Status::corrupt(path + ": not a data-parallel checkpoint shard (metadata format is not " +
                             std::string(kShardFormat) + ")");
    SPILLWAY_ASSIGN_OR_RETURN(int64_t version, meta_int(r, "version"));
    if (version != kShardVersion)
      return fail(path + ": shard version " + std::to_string(version) + "; this build reads version " +
                  std::to_string(kShardVersion));
    SPILLWAY_ASSIGN_OR_RETURN(int64_t rank, meta_int(r, "rank"));
    SPILLWAY_ASSIGN_OR_RETURN(int64_t w, meta_int(r, "world"));
    SPILLWAY_ASSIGN_OR_RETURN(int64_t s, meta_int(r, "step"));
    if (w < 1 || w > (int64_t{1} << 20) || rank < 0 || rank >= w ||
        std::filesystem::path(path).filename().string() != shard_name(static_cast<int>(rank), static_cast<int>(w)))
      return Status::corrupt(path + ": its metadata says rank " + std::to_string(rank) + " of " + std::to_string(w) +
                             ", which does not match its name");
    if (world < 0) {
      world = w;
      step = s;
      seen.assign(static_cast<size_t>(w), false);
    } else if (w != world || s != step) {
      return Status::corrupt("data parallel: " + dir + ": shards of different checkpoints (" + found.front() + ": " +
                             std::to_string(world) + " ranks, step " + std::to_string(step) + "; " + path + ": " +
                             std::to_string(w) + " ranks, step " + std::to_string(s) + ")");
    }
    seen[static_cast<size_t>(rank)] = true;
    set.shards.push_back(std::move(r));
  }
  for (size_t r = 0; r < seen.size(); ++r)
    if (!seen[r])
      return Status::corrupt("data parallel: " + dir + ": the checkpoint of " + std::to_string(world) +
                             " ranks lacks " + shard_name(static_cast<int>(r), static_cast<int>(world)));
  set.world = world;
  set.step = step;
  return set;
}

// Entry `e` of shard `r`, F32, checked against the checksum its metadata records.
Result<std::vector<float>> read_verified(const SafetensorsReader& r, const SafetensorsEntry& e) {
  if (e.dtype != "F32")
    return Status::corrupt(r.path() + ": " + e.name + " is " + e.dtype + "; a shard holds F32 tensors only");
  SPILLWAY_ASSIGN_OR_RETURN(std::vector<float> v, r.read_f32(e));
  auto sum = r.metadata().find("xxh3." + e.name);
  if (sum == r.metadata().end()) return Status::corrupt(r.path() + ": no checksum for " + e.name);
  if (sum->second != hex64(checksum_of(v)))
    return Status::corrupt(r.path() + ": " + e.name + " does not match its checksum (xxh3 " + hex64(checksum_of(v)) +
                           ", recorded " + sum->second + "): the shard is corrupt");
  return v;
}

}  // namespace

Result<DataParallelShards> verify_data_parallel_shards(const std::string& dir) {
  SPILLWAY_ASSIGN_OR_RETURN(ShardSet set, open_shard_set(dir));
  DataParallelShards out;
  out.world = static_cast<int>(set.world);
  out.step = set.step;
  for (const SafetensorsReader& r : set.shards) {
    std::error_code ec;
    const uintmax_t size = std::filesystem::file_size(r.path(), ec);
    if (ec) return Status::io_error("data parallel: stat " + r.path() + ": " + ec.message());
    out.bytes += static_cast<uint64_t>(size);
    for (const SafetensorsEntry& e : r.entries()) {
      SPILLWAY_RETURN_IF_ERROR(read_verified(r, e).status());
      ++out.tensors;
    }
    // A checksum without its tensor: the tensor is missing.
    for (const auto& [key, value] : r.metadata())
      if (key.starts_with("xxh3.") && r.find(key.substr(5)) == nullptr)
        return Status::corrupt(r.path() + ": its metadata records a checksum for " + key.substr(5) +
                               ", which the shard does not hold");
  }
  return out;
}

Result<int64_t> DataParallelRank::load_shards(const std::string& dir) {
  // The shards present, by rank; all of one world size and one step.
  SPILLWAY_ASSIGN_OR_RETURN(ShardSet set, open_shard_set(dir));
  const std::vector<SafetensorsReader>& shards = set.shards;
  // A tensor from whichever shard holds it, checked against its size and checksum.
  auto read = [&](const std::string& name, size_t n) -> Result<std::vector<float>> {
    for (const SafetensorsReader& r : shards) {
      const SafetensorsEntry* e = r.find(name);
      if (!e) continue;
      if (e->dtype != "F32" || e->numel() != static_cast<int64_t>(n))
        return fail(r.path() + ": " + name + " is " + e->dtype + " with " + std::to_string(e->numel()) +
                    " elements; this program's has " + std::to_string(n) + " F32");
      return read_verified(r, *e);
    }
    return fail(dir + ": no shard holds " + name);
  };
  for (size_t i = 0; i < layout_.params.size(); ++i) {
    const std::string& name = layout_.params[i].name;
    const size_t n = static_cast<size_t>(layout_.params[i].n);
    const bool owner = layout_.partition.owner[i] == rank_;
    if (!owner && layout_.zero_stage == 3) continue;  // held by its owner alone
    SPILLWAY_ASSIGN_OR_RETURN(std::vector<float> p, read(name, n));
    SPILLWAY_ASSIGN_OR_RETURN(TensorId param, find(name));
    SPILLWAY_RETURN_IF_ERROR(write_floats(param, p));  // a bf16 parameter's values round-trip exactly
    if (!owner) continue;
    for (const char* prefix : {"master.", "adam_m.", "adam_v."}) {
      SPILLWAY_ASSIGN_OR_RETURN(std::vector<float> v, read(prefix + name, n));
      SPILLWAY_ASSIGN_OR_RETURN(TensorId t, find(prefix + name));
      SPILLWAY_RETURN_IF_ERROR(executor_->write_tensor(t, v.data(), n * sizeof(float)));
    }
  }
  return set.step;
}

}  // namespace spillway
