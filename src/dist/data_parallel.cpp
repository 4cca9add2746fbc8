#include "dist/data_parallel.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <string>

#include "exec/dispatch.h"
#include "program/op_registry.h"

namespace spillway {

namespace {

Status fail(const std::string& what) { return Status::invalid_argument("data parallel: " + what); }

}  // namespace

Result<DataParallelLayout> make_data_parallel_layout(const Program& training, int world,
                                                     int loss_scale_micro_batches) {
  if (world < 1) return fail("world size is " + std::to_string(world) + "; need at least 1 rank");
  if (loss_scale_micro_batches < 1)
    return fail("loss scale micro-batches is " + std::to_string(loss_scale_micro_batches) + "; need at least 1");
  SPILLWAY_RETURN_IF_ERROR(training.validate());
  DataParallelLayout L;
  L.training = training;
  const TensorTable& T = training.tensors;
  bool have_clip = false;
  for (size_t i = 0; i < training.ops.size(); ++i) {
    const Op& op = training.ops[i];
    if (op.micro_batch > 0)
      return fail("op '" + op.name + "' belongs to micro-batch " + std::to_string(op.micro_batch) +
                  "; each rank's program has one micro-batch (build it with accum 1)");
    for (const Operand& o : op.operands) {
      const DType d = T.info(o.tensor).dtype;
      if (d == DType::BF16)
        return fail("tensor '" + T.info(o.tensor).name + "' is bf16; exact reduction needs f32 gradients (bf16: not yet)");
    }
    if (op.kind == OpKind::ClipScale) {
      L.clip_op = i;
      have_clip = true;
    }
  }
  if (!have_clip) return fail("the training program has no ClipScale op");

  // Parameters, from the AdamW ops (operands: param, master, m, v, grad, scale_norm).
  std::map<TensorId, size_t> param_of_grad;
  for (size_t i = 0; i < training.ops.size(); ++i) {
    const Op& op = training.ops[i];
    if (op.kind != OpKind::AdamW) continue;
    DataParallelParam p;
    p.name = T.info(op.operands[0].tensor).name;
    p.adamw_op = i;
    p.n = op.attrs.n;
    param_of_grad[op.operands[4].tensor] = L.params.size();
    L.params.push_back(std::move(p));
  }
  if (L.params.empty()) return fail("the training program has no AdamW op");
  const int64_t P = training.ops[L.clip_op].attrs.P;
  L.norm_owner.assign(static_cast<size_t>(P), -1);
  for (size_t i = 0; i < training.ops.size(); ++i) {
    const Op& op = training.ops[i];
    if (op.kind != OpKind::SquaredNorm) continue;
    auto it = param_of_grad.find(op.operands[1].tensor);
    if (it == param_of_grad.end()) return fail("SquaredNorm op '" + op.name + "' reads no parameter's gradient");
    if (op.operands[0].access != Access::Update)
      return fail("SquaredNorm op '" + op.name + "' writes a norm of its own; expected the packed form");
    L.params[it->second].norm_ops.push_back(i);
    const int64_t segments = op.attrs.block > 0 ? (op.attrs.n + op.attrs.block - 1) / op.attrs.block : 1;
    for (int64_t s = 0; s < segments; ++s) L.norm_owner[static_cast<size_t>(op.attrs.index + s)] = static_cast<int>(it->second);
  }
  for (int64_t e = 0; e < P; ++e)
    if (L.norm_owner[static_cast<size_t>(e)] < 0)
      return fail("element " + std::to_string(e) + " of the squared norms is written by no SquaredNorm op");

  // The rank program: the ops before the optimizer, each gradient's second and later
  // contributions retargeted to a zeroed part of their own, and only the tensors
  // those ops use.
  std::vector<Op> ops;
  std::map<TensorId, int> contributions;  // grad -> ops seen adding into it
  std::vector<TensorInfo> infos(T.infos().begin(), T.infos().end());
  std::vector<Op> part_zeros;
  std::map<TensorId, std::vector<TensorId>> parts;  // training grad -> its parts (the grad itself first)
  for (const Op& src : training.ops) {
    if (src.phase == Phase::Optimizer) continue;
    Op op = src;
    if (op.kind == OpKind::CrossEntropyBackward)
      op.attrs.scale = static_cast<float>(1.0 / (static_cast<double>(op.attrs.N) * loss_scale_micro_batches));
    if (op.kind != OpKind::Zero) {
      for (Operand& o : op.operands) {
        if (o.access == Access::Read || T.info(o.tensor).role != Role::Grad) continue;
        const int j = contributions[o.tensor]++;
        std::vector<TensorId>& list = parts[o.tensor];
        if (j == 0) {
          list.push_back(o.tensor);
          continue;
        }
        TensorInfo part = T.info(o.tensor);
        part.name = "grad.part" + std::to_string(j) + "." + part.name.substr(part.name.rfind("grad.", 0) == 0 ? 5 : 0);
        infos.push_back(part);
        const TensorId id = static_cast<TensorId>(infos.size() - 1);
        list.push_back(id);
        Op zero;  // just before its first (only) contribution
        zero.kind = OpKind::Zero;
        zero.name = part.name + ".zero";
        zero.operands = {{id, Access::Write}};
        zero.phase = src.phase;
        zero.layer = src.layer;
        zero.micro_batch = src.micro_batch;
        part_zeros.push_back(zero);
        o.tensor = id;
        if (o.access == Access::Write) o.access = Access::Update;
      }
    }
    for (Op& zero : part_zeros) ops.push_back(std::move(zero));
    part_zeros.clear();
    ops.push_back(std::move(op));
  }
  // Keep the used tensors, renumbered in table order.
  std::vector<TensorId> remap(infos.size(), kNoTensor);
  std::vector<bool> used(infos.size(), false);
  for (const Op& op : ops)
    for (const Operand& o : op.operands) used[static_cast<size_t>(o.tensor)] = true;
  for (TensorId t : training.inputs) used[static_cast<size_t>(t)] = true;
  Program& R = L.rank_program;
  for (size_t t = 0; t < infos.size(); ++t)
    if (used[t]) remap[t] = R.tensors.add(infos[t]);
  for (Op& op : ops) {
    for (Operand& o : op.operands) o.tensor = remap[static_cast<size_t>(o.tensor)];
    R.add_op(std::move(op));
  }
  for (TensorId t : training.inputs) R.inputs.push_back(remap[static_cast<size_t>(t)]);
  for (TensorId t : training.outputs)  // the losses (the clip scale is formed outside the program)
    if (used[static_cast<size_t>(t)]) R.outputs.push_back(remap[static_cast<size_t>(t)]);
  SPILLWAY_RETURN_IF_ERROR(R.validate().with_context("data parallel: the rank program"));

  std::vector<uint64_t> bytes;
  for (DataParallelParam& p : L.params) {
    const Op& adamw = training.ops[p.adamw_op];
    const TensorId grad = adamw.operands[4].tensor;
    auto it = parts.find(grad);
    if (it == parts.end()) return fail("no op of the backward adds into '" + T.info(grad).name + "'");
    for (TensorId t : it->second) p.rank_grad_parts.push_back(remap[static_cast<size_t>(t)]);
    p.rank_param = remap[static_cast<size_t>(adamw.operands[0].tensor)];
    if (p.rank_param == kNoTensor) return fail("parameter '" + p.name + "' is used by no op of the step");
    // What the owner holds: master, moments and the reduced gradient, F32.
    bytes.push_back(static_cast<uint64_t>(p.n) * 4 * sizeof(float));
  }
  SPILLWAY_ASSIGN_OR_RETURN(L.partition, partition_by_bytes(bytes, world));
  return L;
}

// ---- DataParallelRank --------------------------------------------------------------

DataParallelRank::~DataParallelRank() {
  executor_.reset();
  for (void* p : allocations_) backend_.device_free(p);
}

void* DataParallelRank::alloc(size_t bytes) {
  auto p = backend_.device_alloc(std::max<size_t>(bytes, 1));
  if (!p.ok()) return nullptr;
  allocations_.push_back(*p);
  backend_.fill_zero(*p, std::max<size_t>(bytes, 1));
  return *p;
}

Result<std::unique_ptr<DataParallelRank>> DataParallelRank::create(Communicator& comm, Backend& backend,
                                                                   const DataParallelLayout& layout, const Plan& plan,
                                                                   const ExecutorOptions& options) {
  if (layout.partition.world != comm.world_size())
    return fail("the layout is partitioned over " + std::to_string(layout.partition.world) +
                " ranks; the communicator has " + std::to_string(comm.world_size()));
  if (backend.activation_dtype() != DType::F32)
    return fail("the " + backend.name() + " backend's activations are " + dtype_name(backend.activation_dtype()) +
                "; exact reduction needs f32 gradients (bf16: not yet)");
  std::unique_ptr<DataParallelRank> r(new DataParallelRank(comm, backend, layout));
  SPILLWAY_ASSIGN_OR_RETURN(r->executor_, Executor::create(backend, r->layout_.rank_program, plan, options));
  const auto& L = r->layout_;
  size_t max_n = 0, max_parts = 0;
  r->shards_.resize(L.params.size());
  for (size_t i = 0; i < L.params.size(); ++i) {
    const size_t n = static_cast<size_t>(L.params[i].n);
    max_n = std::max(max_n, n);
    max_parts = std::max(max_parts, L.params[i].rank_grad_parts.size());
    if (L.partition.owner[i] != comm.rank()) continue;
    Shard& s = r->shards_[i];
    s.master = static_cast<float*>(r->alloc(n * sizeof(float)));
    s.m = static_cast<float*>(r->alloc(n * sizeof(float)));
    s.v = static_cast<float*>(r->alloc(n * sizeof(float)));
    s.grad = static_cast<float*>(r->alloc(n * sizeof(float)));
    if (!s.master || !s.m || !s.v || !s.grad)
      return Status::out_of_memory("data parallel: no device memory for the optimizer state of '" +
                                        L.params[i].name + "' (" + std::to_string(4 * n * sizeof(float)) + " bytes)");
  }
  const size_t P = L.norm_owner.size(), world = static_cast<size_t>(comm.world_size());
  r->parts_ = static_cast<float*>(r->alloc(max_parts * max_n * sizeof(float)));
  r->param_ = static_cast<float*>(r->alloc(max_n * sizeof(float)));
  r->sq_ = static_cast<float*>(r->alloc(P * sizeof(float)));
  r->sq_all_ = static_cast<float*>(r->alloc(world * P * sizeof(float)));
  r->scale_norm_ = static_cast<float*>(r->alloc(2 * sizeof(float)));
  for (const Op& op : L.training.ops) {
    if (op.kind != OpKind::SquaredNorm && op.kind != OpKind::ClipScale && op.kind != OpKind::AdamW) continue;
    SPILLWAY_ASSIGN_OR_RETURN(uint64_t need, op_workspace_bytes(backend, L.training, op));
    r->workspace_bytes_ = std::max<size_t>(r->workspace_bytes_, need);
  }
  if (r->workspace_bytes_ > 0) r->workspace_ = r->alloc(r->workspace_bytes_);
  if (!r->parts_ || !r->param_ || !r->sq_ || !r->sq_all_ || !r->scale_norm_ || (r->workspace_bytes_ && !r->workspace_))
    return Status::out_of_memory("data parallel: no device memory for the reduction buffers (" +
                                      std::to_string((max_parts + 1) * max_n * sizeof(float)) + " bytes and more)");
  r->host_.resize(std::max(max_parts * max_n, world * P));
  return r;
}

Status DataParallelRank::write_parameter(const std::string& name, const std::vector<float>& values) {
  for (size_t i = 0; i < layout_.params.size(); ++i) {
    const DataParallelParam& p = layout_.params[i];
    if (p.name != name) continue;
    if (values.size() != static_cast<size_t>(p.n))
      return fail("parameter '" + name + "' has " + std::to_string(p.n) + " elements; given " +
                  std::to_string(values.size()));
    const size_t bytes = values.size() * sizeof(float);
    SPILLWAY_RETURN_IF_ERROR(executor_->write_tensor(p.rank_param, values.data(), bytes));
    const Shard& s = shards_[i];
    if (s.master != nullptr) {
      SPILLWAY_RETURN_IF_ERROR(backend_.upload(s.master, values.data(), bytes));
      backend_.fill_zero(s.m, bytes);
      backend_.fill_zero(s.v, bytes);
    }
    return Status::ok();
  }
  return fail("no parameter is called '" + name + "'");
}

Status DataParallelRank::write_input(const std::string& name, const void* data, size_t bytes) {
  const TensorId t = layout_.rank_program.tensors.find(name);
  if (t == kNoTensor) return fail("the rank program has no tensor '" + name + "'");
  return executor_->write_tensor(t, data, bytes);
}

Status DataParallelRank::read_output(const std::string& name, void* data, size_t bytes) {
  const TensorId t = layout_.rank_program.tensors.find(name);
  if (t == kNoTensor) return fail("the rank program has no tensor '" + name + "'");
  return executor_->read_tensor(t, data, bytes);
}

Status DataParallelRank::step(const StepContext& ctx) {
  SPILLWAY_RETURN_IF_ERROR(executor_->run_step(ctx));
  SPILLWAY_RETURN_IF_ERROR(executor_->drain());
  return run_optimizer(ctx).with_context("data parallel rank " + std::to_string(comm_.rank()) + ", step " +
                                         std::to_string(ctx.step));
}

Status DataParallelRank::run_optimizer(const StepContext& ctx) {
  const DataParallelLayout& L = layout_;
  const Program& training = L.training;
  const int me = comm_.rank();
  // 1. Each gradient to its owner: this rank's parts, summed in rank order there.
  for (size_t i = 0; i < L.params.size(); ++i) {
    const DataParallelParam& p = L.params[i];
    const size_t n = static_cast<size_t>(p.n), parts = p.rank_grad_parts.size();
    for (size_t j = 0; j < parts; ++j)
      SPILLWAY_RETURN_IF_ERROR(executor_->read_tensor(p.rank_grad_parts[j], host_.data() + j * n, n * sizeof(float)));
    SPILLWAY_RETURN_IF_ERROR(backend_.upload(parts_, host_.data(), parts * n * sizeof(float)));
    const int owner = L.partition.owner[i];
    SPILLWAY_RETURN_IF_ERROR(comm_.reduce_in_rank_order(parts_, owner == me ? shards_[i].grad : nullptr, n,
                                                        static_cast<int>(parts), owner)
                                 .with_context("reducing the gradient of '" + p.name + "'"));
  }
  // 2. The owners' squared norms, gathered; every rank forms the clip scale alike.
  backend_.set_workspace(workspace_, workspace_bytes_);
  const size_t P = L.norm_owner.size();
  backend_.fill_zero(sq_, P * sizeof(float));
  const OptimizerStep opt{ctx.step, ctx.lr};
  Status s = Status::ok();
  for (size_t i = 0; i < L.params.size() && s.is_ok(); ++i) {
    if (L.partition.owner[i] != me) continue;
    for (size_t op : L.params[i].norm_ops)
      if (s.is_ok()) s = run_device_op(backend_, training, training.ops[op], {sq_, shards_[i].grad}, opt);
  }
  if (s.is_ok()) s = backend_.synchronize();
  if (s.is_ok()) s = comm_.all_gather(sq_, sq_all_, P * sizeof(float));
  if (s.is_ok()) {
    // Each element from the rank that owns it (a copy: no arithmetic).
    s = backend_.download(host_.data(), sq_all_, comm_.world_size() * P * sizeof(float));
    std::vector<float> sq(P);
    for (size_t e = 0; e < P; ++e)
      sq[e] = host_[static_cast<size_t>(L.partition.owner[static_cast<size_t>(L.norm_owner[e])]) * P + e];
    if (s.is_ok()) s = backend_.upload(sq_, sq.data(), P * sizeof(float));
  }
  if (s.is_ok()) s = run_device_op(backend_, training, training.ops[L.clip_op], {scale_norm_, sq_}, opt);
  if (s.is_ok()) s = backend_.synchronize();
  if (s.is_ok()) s = backend_.download(scale_norm_host_, scale_norm_, sizeof scale_norm_host_);
  // 3. Each owner's AdamW; the new parameter broadcast from it.
  for (size_t i = 0; i < L.params.size() && s.is_ok(); ++i) {
    const DataParallelParam& p = L.params[i];
    const size_t bytes = static_cast<size_t>(p.n) * sizeof(float);
    const int owner = L.partition.owner[i];
    if (owner == me) {
      const Shard& sh = shards_[i];
      s = run_device_op(backend_, training, training.ops[p.adamw_op], {param_, sh.master, sh.m, sh.v, sh.grad, scale_norm_},
                        opt);
      if (s.is_ok()) s = backend_.synchronize();
    }
    if (s.is_ok()) s = comm_.broadcast(param_, bytes, owner).with_context("broadcasting '" + p.name + "'");
    if (s.is_ok()) s = backend_.download(host_.data(), param_, bytes);
    if (s.is_ok()) s = executor_->write_tensor(p.rank_param, host_.data(), bytes);
  }
  backend_.set_workspace(nullptr, 0);
  return s;
}

Result<std::vector<float>> DataParallelRank::master(size_t i) const {
  if (i >= shards_.size() || shards_[i].master == nullptr)
    return fail("rank " + std::to_string(comm_.rank()) + " does not own parameter " + std::to_string(i));
  std::vector<float> v(static_cast<size_t>(layout_.params[i].n));
  SPILLWAY_RETURN_IF_ERROR(backend_.download(v.data(), shards_[i].master, v.size() * sizeof(float)));
  return v;
}

Result<std::vector<float>> DataParallelRank::parameter(size_t i) {
  if (i >= layout_.params.size()) return fail("no parameter " + std::to_string(i));
  std::vector<float> v(static_cast<size_t>(layout_.params[i].n));
  SPILLWAY_RETURN_IF_ERROR(executor_->read_tensor(layout_.params[i].rank_param, v.data(), v.size() * sizeof(float)));
  return v;
}

}  // namespace spillway
