#include "dist/data_parallel_training.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <functional>
#include <limits>
#include <memory>

#include "core/atomic_file.h"
#include "dist/data_parallel.h"
#include "model/hf_model.h"
#include "model/model.h"
#include "optim/adamw.h"
#include "plan/planner.h"
#include "sim/simulator.h"

namespace spillway {

namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kManifestFormat = "spillway-dp-checkpoint";
constexpr int kManifestVersion = 1;
constexpr const char* kFolderPrefix = "dp-ckpt-";
constexpr const char* kPartialSuffix = ".partial";

std::string number_text(double v) {
  if (std::isnan(v)) return "nan";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

std::string folder_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%s%08lld", kFolderPrefix, static_cast<long long>(step));
  return buf;
}

// Host bytes gathered from every rank through a device buffer (the communicator works
// on device memory): each gets world × bytes, rank order.
class HostGather {
 public:
  HostGather(Communicator& comm, Backend& backend) : comm_(comm), backend_(backend) {}
  ~HostGather() {
    if (dev_) backend_.device_free(dev_);
  }
  HostGather(const HostGather&) = delete;
  HostGather& operator=(const HostGather&) = delete;

  Result<std::vector<uint8_t>> all_gather(const void* mine, size_t bytes) {
    const size_t world = static_cast<size_t>(comm_.world_size());
    const size_t need = bytes * (world + 1);
    if (need > capacity_) {
      if (dev_) backend_.device_free(dev_);
      dev_ = nullptr;
      capacity_ = 0;
      SPILLWAY_ASSIGN_OR_RETURN(dev_, backend_.device_alloc(need));
      capacity_ = need;
    }
    auto* in = static_cast<uint8_t*>(dev_);
    uint8_t* out = in + bytes;
    SPILLWAY_RETURN_IF_ERROR(backend_.upload(in, mine, bytes));
    SPILLWAY_RETURN_IF_ERROR(comm_.all_gather(in, out, bytes));
    std::vector<uint8_t> all(bytes * world);
    SPILLWAY_RETURN_IF_ERROR(backend_.download(all.data(), out, all.size()));
    return all;
  }

 private:
  Communicator& comm_;
  Backend& backend_;
  void* dev_ = nullptr;
  size_t capacity_ = 0;
};

// Every rank's outcome of a phase: ok when all succeeded; else this rank's own error,
// or the first failed rank's (its message carried over).
constexpr size_t kAgreementBytes = 2048;
Status agree(HostGather& gather, int rank, const Status& mine, const std::string& what) {
  std::vector<uint8_t> buf(kAgreementBytes, 0);
  const int32_t code = static_cast<int32_t>(mine.code());
  std::memcpy(buf.data(), &code, sizeof code);
  const std::string msg = mine.message().substr(0, kAgreementBytes - 5);
  std::memcpy(buf.data() + 4, msg.data(), msg.size());
  auto all = gather.all_gather(buf.data(), buf.size());
  if (!mine.is_ok()) return mine;
  if (!all.ok()) return all.status().with_context(what + ": the ranks' agreement");
  for (size_t r = 0; r * kAgreementBytes < all->size(); ++r) {
    const uint8_t* at = all->data() + r * kAgreementBytes;
    int32_t c = 0;
    std::memcpy(&c, at, sizeof c);
    if (c == static_cast<int32_t>(StatusCode::Ok)) continue;
    const char* text = reinterpret_cast<const char*>(at + 4);
    return Status(static_cast<StatusCode>(c), what + ": rank " + std::to_string(r) + " failed (rank " +
                                                  std::to_string(rank) + " stops too): " +
                                                  std::string(text, strnlen(text, kAgreementBytes - 4)));
  }
  return Status::ok();
}


struct Folder {
  std::string name;
  int64_t step = -1;
  bool partial = false;
};

// The dp-ckpt-* folders of `dir`, newest step first.
Result<std::vector<Folder>> list_folders(const std::string& dir) {
  std::vector<Folder> out;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::string name = it->path().filename().string();
    if (!name.starts_with(kFolderPrefix)) continue;
    Folder f;
    f.name = name;
    std::string digits = name.substr(std::strlen(kFolderPrefix));
    if (digits.ends_with(kPartialSuffix)) {
      f.partial = true;
      digits.resize(digits.size() - std::strlen(kPartialSuffix));
    }
    if (digits.size() < 8 || digits.size() > 18 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    f.step = std::stoll(digits);
    out.push_back(f);
  }
  if (ec && ec != std::errc::no_such_file_or_directory)
    return Status::io_error("data parallel: cannot read checkpoint folder " + dir + ": " + ec.message());
  std::sort(out.begin(), out.end(), [](const Folder& a, const Folder& b) {
    return a.step != b.step ? a.step > b.step : a.partial < b.partial;
  });
  return out;
}

Result<DataParallelCheckpoint> read_manifest(const std::string& folder) {
  const std::string path = (std::filesystem::path(folder) / "manifest.json").string();
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return errno_status("data parallel checkpoint: open " + path, errno);
  std::string text;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, n);
  const bool failed = std::ferror(f);
  std::fclose(f);
  if (failed) return Status::io_error("data parallel checkpoint: read " + path);
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    if (j.at("format").get<std::string>() != kManifestFormat)
      return Status::corrupt(path + ": format is not " + std::string(kManifestFormat));
    if (j.at("version").get<int>() != kManifestVersion)
      return Status::corrupt(path + ": version " + j.at("version").dump() + "; this build reads version " +
                             std::to_string(kManifestVersion));
    DataParallelCheckpoint c;
    c.path = folder;
    c.step = j.at("step").get<int64_t>();
    c.world = j.at("world").get<int>();
    c.data_batch = j.at("data_batch").get<int64_t>();
    c.config = j.at("config");
    if (c.step < 0 || c.world < 1 || c.data_batch < 0)
      return Status::corrupt(path + ": step, world or data_batch out of range");
    return c;
  } catch (const nlohmann::json::exception& e) {
    return Status::corrupt(path + ": " + e.what());
  }
}

// The entries of layout.params that hold parameter `name`: the whole tensor, or its
// vocab tiles name#0, name#1, ... in order (every rank's layout has them all, whether
// or not its program holds them: ZeRO stage 3).
std::vector<size_t> layout_pieces(const DataParallelLayout& layout, const std::string& name) {
  std::vector<size_t> out;
  for (int64_t i : find_pieces(name, [&](const std::string& n) -> int64_t {
         auto it = layout.param_index.find(n);
         return it == layout.param_index.end() ? -1 : static_cast<int64_t>(it->second);
       }))
    out.push_back(static_cast<size_t>(i));
  return out;
}

// A parameter's values (ParamSpec order, all its pieces) into the rank, piece by piece.
Status write_param(DataParallelRank& rank, const ParamSpec& p, const std::vector<float>& values) {
  const DataParallelLayout& layout = rank.layout();
  size_t offset = 0;
  for (size_t i : layout_pieces(layout, p.name)) {
    const DataParallelParam& info = layout.params[i];
    const size_t n = static_cast<size_t>(info.n);
    if (offset + n > values.size())
      return Status::internal("parameter " + p.name + ": its pieces hold more than its " + std::to_string(values.size()) +
                              " values");
    SPILLWAY_RETURN_IF_ERROR(rank.write_parameter(
        info.name, std::vector<float>(values.begin() + static_cast<std::ptrdiff_t>(offset),
                                      values.begin() + static_cast<std::ptrdiff_t>(offset + n))));
    offset += n;
  }
  if (offset != values.size())
    return Status::internal("parameter " + p.name + ": its pieces hold " + std::to_string(offset) + " of its " +
                            std::to_string(values.size()) + " values");
  return Status::ok();
}

// The run of one rank (one call of train_data_parallel).
class Run {
 public:
  Run(Communicator& comm, Backend& backend, const DataParallelTrainingOptions& o)
      : comm_(comm), backend_(backend), o_(o), gather_(comm, backend), rank_id_(comm.rank()),
        world_(comm.world_size()) {}

  Result<DataParallelTrainingResult> run();

 private:
  Status setup();
  Status init_or_load();
  Result<StepResult> step(int64_t s);
  Result<float> evaluate();
  Status to_rank0(const std::string& what, const std::vector<size_t>& entries,
                  const std::function<Result<std::vector<float>>(size_t)>& read,
                  const std::function<Status(size_t, std::vector<float>)>& take);
  Status checkpoint(int64_t step);
  Status save();
  Status fail_step(int64_t s, const StepResult& r);

  Communicator& comm_;
  Backend& backend_;
  const DataParallelTrainingOptions& o_;
  HostGather gather_;
  int rank_id_, world_;
  int A_ = 1;
  ModelConfig cfg_;
  bool tiled_ = false;
  std::unique_ptr<DataParallelLayout> layout_;
  Plan plan_;
  std::unique_ptr<DataParallelRank> rank_;
  std::optional<DataLoader> train_, val_;
  int64_t data_batch_ = 0;  // the train loader's batch that the next step's first micro-batch is
  int64_t steps_done_ = 0;
  DataParallelTrainingResult result_;
  int64_t checkpoint_step_ = -1;  // the step of the newest checkpoint written or resumed from
};

Status Run::setup() {
  const TrainerOptions& t = o_.trainer;
  cfg_ = t.model;
  SPILLWAY_RETURN_IF_ERROR(cfg_.validate());
  A_ = t.shape.accum;
  if (t.shape.B <= 0 || t.shape.T <= 0 || A_ <= 0)
    return Status::invalid_argument("batch, context and accumulation steps must be positive (got B=" +
                                    std::to_string(t.shape.B) + " T=" + std::to_string(t.shape.T) +
                                    " accum=" + std::to_string(A_) + ")");
  if (t.shape.T > cfg_.context)
    return Status::invalid_argument("context " + std::to_string(t.shape.T) + " is longer than the model's context " +
                                    std::to_string(cfg_.context));
  if (o_.data == nullptr) return Status::invalid_argument("data parallel training: no data");
  if (o_.steps < 1 || o_.stop_after < 0 || o_.eval_every < 0 || (o_.eval_every > 0 && o_.eval_batches < 1) ||
      o_.checkpoint_every < 0 || o_.keep < 1)
    return Status::invalid_argument("data parallel training: steps " + std::to_string(o_.steps) + ", stop after " +
                                    std::to_string(o_.stop_after) + ", evaluation every " +
                                    std::to_string(o_.eval_every) + " steps over " + std::to_string(o_.eval_batches) +
                                    " batches, checkpoints every " + std::to_string(o_.checkpoint_every) +
                                    " steps keeping " + std::to_string(o_.keep) +
                                    ": expected steps, batches and keep >= 1, the others >= 0");
  SPILLWAY_ASSIGN_OR_RETURN(DataLoader train, DataLoader::create(o_.data->train, t.shape.B, t.shape.T,
                                                                 LoaderMode::Random, t.seed));
  train_.emplace(std::move(train));
  if (rank_id_ == 0 && o_.eval_every > 0) {
    SPILLWAY_ASSIGN_OR_RETURN(DataLoader val, DataLoader::create(o_.data->val, t.shape.B, t.shape.T,
                                                                 LoaderMode::Sequential));
    val_.emplace(std::move(val));
  }
  SPILLWAY_ASSIGN_OR_RETURN(Program training,
                            build_for_budget(
                                [&](bool tile_vocab) {
                                  StepShape s = t.shape;
                                  s.tile_vocab = s.tile_vocab || tile_vocab;
                                  return build_training_program(cfg_, s, backend_.activation_dtype(), t.max_grad_norm,
                                                                t.weight_decay);
                                },
                                backend_, allocatable_budgets(t.budgets, backend_).device, &tiled_));
  SPILLWAY_ASSIGN_OR_RETURN(DataParallelLayout layout,
                            make_data_parallel_layout(training, world_, world_ * A_, rank_id_, o_.zero_stage));
  layout_ = std::make_unique<DataParallelLayout>(std::move(layout));
  const Program& mine = layout_->rank_programs[static_cast<size_t>(rank_id_)];
  // A rank's updates end its step (their parameters are broadcast after them): none
  // is carried into the next step.
  PlannerOptions planner = t.planner;
  planner.carry_updates = 0;
  auto plan = plan_for_backend(mine, backend_, t.machine, t.budgets, planner);
  if (!plan.ok()) return plan.status().with_context("planning rank " + std::to_string(rank_id_) + "'s step");
  plan_ = std::move(*plan);
  ExecutorOptions eo;
  eo.host_budget = t.budgets.host;
  eo.spill_dir = t.spill_dir;
  eo.storage_budget = t.budgets.storage;
  auto rank = DataParallelRank::create(comm_, backend_, *layout_, plan_, eo);
  if (!rank.ok()) return rank.status().with_context("creating rank " + std::to_string(rank_id_) + "'s executor");
  rank_ = std::move(*rank);
  result_.plan = plan_.description;
  return Status::ok();
}

Status Run::init_or_load() {
  if (!o_.resume.empty()) {
    SPILLWAY_ASSIGN_OR_RETURN(DataParallelCheckpoint c, read_manifest(o_.resume));
    SPILLWAY_ASSIGN_OR_RETURN(int64_t step, rank_->load_shards(o_.resume));
    if (step != c.step)
      return Status::corrupt(o_.resume + ": its shards are of step " + std::to_string(step) + ", its manifest says " +
                             std::to_string(c.step));
    steps_done_ = step;
    data_batch_ = c.data_batch;
    checkpoint_step_ = step;
    result_.checkpoint = o_.resume;
    return Status::ok();
  }
  if (!o_.load.empty()) {
    return import_model(
               o_.load, cfg_,
               [&](const ParamSpec& p, std::vector<float>&& values) -> Status { return write_param(*rank_, p, values); },
               {.allow_nonfinite = o_.allow_nonfinite})
        .with_context("--load");
  }
  for (const ParamSpec& p : parameter_specs(cfg_))
    SPILLWAY_RETURN_IF_ERROR(write_param(*rank_, p, init_parameter(cfg_, p, o_.trainer.seed)));
  return Status::ok();
}

Status Run::fail_step(int64_t s, const StepResult& r) {
  std::string m = "step " + std::to_string(s) + ": ";
  if (!r.applied)
    m += "the gradient norm is " + number_text(r.grad_norm) + " (loss " + number_text(r.loss_f64) +
         "), so the update was not applied";
  else
    m += "the loss is " + number_text(r.loss_f64) + " while the gradient norm " + number_text(r.grad_norm) +
         " is finite, so the update of step " + std::to_string(s) + " was applied";
  return Status::invalid_argument(m + " (training diverged at learning rate " + number_text(r.lr) +
                                  "); data-parallel training saves nothing after it");
}

Result<StepResult> Run::step(int64_t s) {
  const auto t0 = Clock::now();
  const StepShape& shape = o_.trainer.shape;
  const size_t n = static_cast<size_t>(shape.B) * static_cast<size_t>(shape.T);
  std::vector<int32_t> tokens(n), targets(n);
  for (int j = 0; j < A_; ++j) {
    train_->seek(data_batch_ + static_cast<int64_t>(rank_id_) * A_ + j);
    train_->next(tokens.data(), targets.data());
    const std::string mb = "mb" + std::to_string(j) + ".";
    SPILLWAY_RETURN_IF_ERROR(rank_->write_input(mb + "tokens", tokens.data(), n * sizeof(int32_t)));
    SPILLWAY_RETURN_IF_ERROR(rank_->write_input(mb + "targets", targets.data(), n * sizeof(int32_t)));
  }
  StepResult r;
  r.step = s;
  r.lr = o_.trainer.schedule.at(s);
  if (o_.trace && rank_id_ == 0 && s == o_.trace_step) rank_->executor().trace_next_step(o_.trace);
  SPILLWAY_RETURN_IF_ERROR(rank_->step({.step = s, .lr = r.lr}));
  r.exec = rank_->executor().metrics();
  std::vector<float> mine(n * static_cast<size_t>(A_));
  for (int j = 0; j < A_; ++j)
    SPILLWAY_RETURN_IF_ERROR(
        rank_->read_output("mb" + std::to_string(j) + ".losses", mine.data() + j * n, n * sizeof(float)));
  SPILLWAY_ASSIGN_OR_RETURN(std::vector<uint8_t> all, gather_.all_gather(mine.data(), mine.size() * sizeof(float)));
  // Every micro-batch's per-token losses, rank 0's first: micro-batch order.
  std::vector<float> losses(all.size() / sizeof(float));
  std::memcpy(losses.data(), all.data(), all.size());
  double sum = 0;
  for (float l : losses) sum += l;
  data_batch_ += static_cast<int64_t>(world_) * A_;
  r.tokens = result_.tokens_per_step;
  r.loss_f64 = sum / static_cast<double>(r.tokens);
  r.loss = static_cast<float>(r.loss_f64);
  SPILLWAY_ASSIGN_OR_RETURN(auto scale_norm, rank_->scale_norm());
  r.grad_norm = scale_norm[1];
  r.applied = !adamw_step_skipped(scale_norm.data());
  if (r.applied) steps_done_ = s;
  r.step_s = std::chrono::duration<double>(Clock::now() - t0).count();
  r.tokens_per_s = r.step_s > 0 ? static_cast<double>(r.tokens) / r.step_s : 0;
  if (!std::isfinite(r.grad_norm) || !std::isfinite(r.loss_f64)) return fail_step(s, r);
  return r;
}

// Rank 0 evaluates. With ZeRO stage 3 only a parameter's owner holds it, so every rank
// takes part: each owner's parameters reach rank 0 (to_rank0), which evaluates alone;
// the other ranks return 0. Otherwise only rank 0 calls it.
Result<float> Run::evaluate() {
  const bool gathered = layout_->zero_stage == 3;
  Status s = rank_->executor().drain();
  const TrainerOptions& t = o_.trainer;
  const int B = t.shape.B, T = t.shape.T;
  Program eval;
  std::unique_ptr<Executor> ex;
  const DataParallelLayout& L = *layout_;
  std::vector<size_t> entries;  // layout.params indices, in the order the evaluation takes them
  std::vector<TensorId> dst;    // rank 0: [entries] the evaluation program's tensor of each
  for (const ParamSpec& p : parameter_specs(cfg_))
    for (size_t i : layout_pieces(L, p.name)) entries.push_back(i);
  if (rank_id_ == 0 && s.is_ok()) {
    s = [&]() -> Status {
      SPILLWAY_ASSIGN_OR_RETURN(eval, build_forward_program(cfg_, B, T, backend_.activation_dtype(), true,
                                                            t.shape.tile_vocab || tiled_));
      for (const ParamSpec& p : parameter_specs(cfg_)) {
        const std::vector<TensorId> d = eval.pieces(p.name);
        if (d.size() != layout_pieces(L, p.name).size() || d.empty())
          return Status::internal("the evaluation program's pieces of parameter " + p.name + " differ from training's");
        dst.insert(dst.end(), d.begin(), d.end());
      }
      // Beside the rank's executor, in what the device budget leaves.
      Budgets budgets = t.budgets;
      const uint64_t training = rank_->executor().device_bytes();
      if (budgets.device != UINT64_MAX) budgets.device = budgets.device > training ? budgets.device - training : 0;
      const size_t free_bytes = backend_.device_free_bytes();
      if (free_bytes != SIZE_MAX) budgets.device = std::min<uint64_t>(budgets.device, free_bytes);
      auto plan = plan_for_backend(eval, backend_, t.machine, budgets, t.planner);
      if (!plan.ok()) return plan.status().with_context("planning the evaluation beside rank 0's training");
      ExecutorOptions eo;
      eo.host_budget = budgets.host;
      eo.spill_dir = t.spill_dir;
      eo.storage_budget = budgets.storage;
      SPILLWAY_ASSIGN_OR_RETURN(ex, Executor::create(backend_, eval, *plan, eo));
      return Status::ok();
    }();
  }
  if (gathered) {
    SPILLWAY_RETURN_IF_ERROR(agree(gather_, rank_id_, s, "evaluation: its program"));
    // entry k's values go to the evaluation's tensor dst[k], in its dtype (a bf16
    // parameter read widened to F32 narrows back to the same bits).
    std::map<size_t, size_t> slot;
    for (size_t k = 0; k < entries.size(); ++k) slot[entries[k]] = k;
    SPILLWAY_RETURN_IF_ERROR(to_rank0(
        "evaluation: the parameters", entries, [&](size_t i) { return rank_->parameter(i); },
        [&](size_t i, std::vector<float> v) -> Status {
          const TensorId d = dst[slot.at(i)];
          if (eval.tensors.info(d).dtype == DType::F32) return ex->write_tensor(d, v.data(), v.size() * sizeof(float));
          std::vector<uint16_t> narrow(v.size());
          for (size_t j = 0; j < v.size(); ++j) narrow[j] = float_to_bf16(v[j]);
          return ex->write_tensor(d, narrow.data(), narrow.size() * sizeof(uint16_t));
        }));
    if (rank_id_ != 0) return 0.0f;
  } else {
    SPILLWAY_RETURN_IF_ERROR(s);
    // Every rank holds every parameter: rank 0 copies its own, byte for byte.
    const Program& mine = rank_->program();
    std::vector<TensorId> src;
    for (const ParamSpec& p : parameter_specs(cfg_)) {
      const std::vector<TensorId> m = mine.pieces(p.name);
      src.insert(src.end(), m.begin(), m.end());
    }
    if (src.size() != dst.size())
      return Status::internal("the evaluation program's parameter pieces differ from rank 0's");
    std::vector<uint8_t> buffer;
    for (size_t k = 0; k < src.size(); ++k) {
      buffer.resize(mine.tensors.info(src[k]).bytes());
      SPILLWAY_RETURN_IF_ERROR(rank_->executor().read_tensor(src[k], buffer.data(), buffer.size()));
      SPILLWAY_RETURN_IF_ERROR(ex->write_tensor(dst[k], buffer.data(), buffer.size()));
    }
  }
  const TensorId tokens = eval.tensors.find("mb0.tokens"), targets = eval.tensors.find("mb0.targets"),
                 losses = eval.tensors.find("mb0.losses");
  if (tokens == kNoTensor || targets == kNoTensor || losses == kNoTensor)
    return Status::internal("the evaluation program lacks mb0.tokens, mb0.targets or mb0.losses");
  const size_t n = static_cast<size_t>(B) * static_cast<size_t>(T);
  std::vector<int32_t> tok(n), tgt(n);
  std::vector<float> loss(n);
  double sum = 0;
  val_->seek(0);
  for (int i = 0; i < o_.eval_batches; ++i) {
    val_->next(tok.data(), tgt.data());
    SPILLWAY_RETURN_IF_ERROR(ex->write_tensor(tokens, tok.data(), n * sizeof(int32_t)));
    SPILLWAY_RETURN_IF_ERROR(ex->write_tensor(targets, tgt.data(), n * sizeof(int32_t)));
    SPILLWAY_RETURN_IF_ERROR(ex->run_step({.step = 1, .lr = 0}));
    SPILLWAY_RETURN_IF_ERROR(ex->read_tensor(losses, loss.data(), n * sizeof(float)));
    for (float l : loss) sum += l;
  }
  return static_cast<float>(sum / (static_cast<double>(n) * o_.eval_batches));
}

Status Run::checkpoint(int64_t step) {
  if (step == checkpoint_step_) return Status::ok();  // nothing ran since
  const std::filesystem::path dir(o_.checkpoint_dir);
  const std::string final_path = (dir / folder_name(step)).string();
  const std::string partial = final_path + kPartialSuffix;
  Status s = rank_->executor().drain();
  if (rank_id_ == 0 && s.is_ok()) {  // a folder a crashed run left: its shards would mix with these
    std::error_code ec;
    std::filesystem::remove_all(partial, ec);
    if (!ec) std::filesystem::create_directories(partial, ec);
    if (ec) s = Status::io_error("data parallel checkpoint: cannot make " + partial + ": " + ec.message());
  }
  SPILLWAY_RETURN_IF_ERROR(agree(gather_, rank_id_, s, "checkpoint of step " + std::to_string(step)));
  s = rank_->save_shard(partial, step);
  SPILLWAY_RETURN_IF_ERROR(agree(gather_, rank_id_, s, "checkpoint of step " + std::to_string(step)));
  if (rank_id_ == 0) {
    const nlohmann::json manifest = {{"format", kManifestFormat}, {"version", kManifestVersion},
                                     {"step", step},              {"world", world_},
                                     {"data_batch", data_batch_}, {"config", o_.config}};
    s = write_file_atomically((std::filesystem::path(partial) / "manifest.json").string(), manifest.dump(2) + "\n");
    std::error_code ec;
    if (s.is_ok()) std::filesystem::remove_all(final_path, ec);  // the same step written before (another run)
    if (s.is_ok() && !ec) std::filesystem::rename(partial, final_path, ec);
    if (s.is_ok() && ec) s = Status::io_error("data parallel checkpoint: rename " + partial + " to " + final_path + ": " + ec.message());
    if (s.is_ok()) s = fsync_directory(o_.checkpoint_dir);
    // Older checkpoints beyond --keep, and unfinished folders of earlier steps.
    if (s.is_ok()) {
      auto folders = list_folders(o_.checkpoint_dir);
      if (!folders.ok()) s = folders.status();
      int whole = 0;
      for (const Folder& f : folders.ok() ? *folders : std::vector<Folder>{}) {
        if (f.step > step) continue;
        const bool drop = f.partial ? f.step < step : ++whole > o_.keep;
        if (!drop) continue;
        std::filesystem::remove_all(dir / f.name, ec);
        if (ec) {
          s = Status::io_error("data parallel checkpoint: remove the old " + (dir / f.name).string() + ": " + ec.message());
          break;
        }
      }
    }
  }
  SPILLWAY_RETURN_IF_ERROR(agree(gather_, rank_id_, s, "checkpoint of step " + std::to_string(step)));
  checkpoint_step_ = step;
  result_.checkpoint = final_path;
  ++result_.checkpoints_written;
  return Status::ok();
}

// Every rank: the F32 values of layout entries `entries`, each read by `read` on its
// owner, reach rank 0 in that order, which hands each to `take` (on rank 0 only, an
// entry it owns included). First each rank reads what it owns (agreed on, so that no
// rank waits in a broadcast that another will not join), then each owner broadcasts
// its entries in order, in chunks of kChunkFloats through a device buffer. An error
// of `take` or of a copy does not stop the broadcasts (the others would wait in
// them); the ranks agree on the outcome at the end. Errors name `what`.
constexpr size_t kChunkFloats = size_t{1} << 24;

Status Run::to_rank0(const std::string& what, const std::vector<size_t>& entries,
                     const std::function<Result<std::vector<float>>(size_t)>& read,
                     const std::function<Status(size_t, std::vector<float>)>& take) {
  const DataParallelLayout& L = *layout_;
  std::map<size_t, std::vector<float>> owned;
  Status s = Status::ok();
  for (size_t i : entries) {
    if (L.partition.owner[i] != rank_id_ || !s.is_ok()) continue;
    auto v = read(i);
    if (v.ok())
      owned[i] = std::move(*v);
    else
      s = v.status().with_context(L.params[i].name);
  }
  SPILLWAY_RETURN_IF_ERROR(agree(gather_, rank_id_, s, what + ": reading them"));
  size_t largest = 0;
  for (size_t i : entries) largest = std::max(largest, static_cast<size_t>(L.params[i].n));
  const size_t chunk = std::min(largest, kChunkFloats);
  void* buffer = nullptr;
  if (chunk > 0) {
    auto b = backend_.device_alloc(chunk * sizeof(float));
    s = b.ok() ? Status::ok() : b.status();
    if (b.ok()) buffer = *b;
  }
  SPILLWAY_RETURN_IF_ERROR(agree(gather_, rank_id_, s, what + ": a device buffer"));
  Status local = Status::ok();  // this rank's error that does not stop the broadcasts
  for (size_t i : entries) {
    const int owner = L.partition.owner[i];
    if (owner == 0) {
      if (rank_id_ == 0 && local.is_ok()) local = take(i, std::move(owned[i]));
      continue;
    }
    const size_t n = static_cast<size_t>(L.params[i].n);
    std::vector<float> got;
    if (rank_id_ == 0) got.resize(n);
    for (size_t at = 0; at < n && s.is_ok(); at += chunk) {
      const size_t k = std::min(chunk, n - at), bytes = k * sizeof(float);
      if (rank_id_ == owner && local.is_ok()) local = backend_.upload(buffer, owned[i].data() + at, bytes);
      s = comm_.broadcast(buffer, bytes, owner);
      if (s.is_ok() && rank_id_ == 0 && local.is_ok()) local = backend_.download(got.data() + at, buffer, bytes);
    }
    if (!s.is_ok()) {
      s = s.with_context(what + ": rank " + std::to_string(owner) + "'s " + L.params[i].name);
      break;
    }
    if (rank_id_ == owner) std::vector<float>().swap(owned[i]);
    if (rank_id_ == 0 && local.is_ok()) local = take(i, std::move(got));
  }
  if (buffer != nullptr) backend_.device_free(buffer);
  SPILLWAY_RETURN_IF_ERROR(s);  // the communicator failed: every rank sees it
  return agree(gather_, rank_id_, local, what);
}

// Every rank: the master weights it owns go to rank 0 (to_rank0), which writes them as
// Trainer::save does (the master weights, not the parameters: a bf16 parameter is
// the master rounded).
Status Run::save() {
  const DataParallelLayout& L = *layout_;
  SPILLWAY_RETURN_IF_ERROR(agree(gather_, rank_id_, rank_->executor().drain(), "--save"));
  std::vector<size_t> entries(L.params.size());
  for (size_t i = 0; i < entries.size(); ++i) entries[i] = i;
  std::vector<std::vector<float>> masters(L.params.size());  // rank 0: all
  SPILLWAY_RETURN_IF_ERROR(to_rank0(
      "--save: the master weights", entries, [&](size_t i) { return rank_->master(i); },
      [&](size_t i, std::vector<float> v) {
        masters[i] = std::move(v);
        return Status::ok();
      }));
  if (rank_id_ != 0) return Status::ok();
  return export_model(o_.save, cfg_, [&](const ParamSpec& p) -> Result<std::vector<float>> {
    std::vector<float> v;
    const std::vector<size_t> pieces = layout_pieces(L, p.name);
    if (pieces.empty()) return Status::internal("--save: parameter " + p.name + " is not in the layout");
    for (size_t i : pieces) v.insert(v.end(), masters[i].begin(), masters[i].end());
    for (size_t i = 0; i < v.size(); ++i)
      if (!std::isfinite(v[i]))
        return Status::invalid_argument("not saving " + o_.save + ": parameter " + p.name + " holds " +
                                        number_text(v[i]) + " at element " + std::to_string(i) + " (after step " +
                                        std::to_string(steps_done_) + ")");
    return v;
  });
}

Result<DataParallelTrainingResult> Run::run() {
  result_.tokens_per_step = int64_t{o_.trainer.shape.B} * o_.trainer.shape.T * o_.trainer.shape.accum * world_;
  Status s = setup();
  if (s.is_ok()) s = init_or_load();
  SPILLWAY_RETURN_IF_ERROR(agree(gather_, rank_id_, s, "setting up data-parallel training"));
  const int final_step = o_.stop_after > 0 ? std::min(o_.steps, o_.stop_after) : o_.steps;
  for (int64_t at = steps_done_ + 1; at <= final_step; ++at) {
    // Every rank stops before the same step when any was asked to.
    const int32_t asked = o_.stop_requested && o_.stop_requested() ? 1 : 0;
    SPILLWAY_ASSIGN_OR_RETURN(std::vector<uint8_t> flags, gather_.all_gather(&asked, sizeof asked));
    bool stop = false;
    for (size_t r = 0; r < flags.size(); r += sizeof(int32_t)) {
      int32_t f = 0;
      std::memcpy(&f, flags.data() + r, sizeof f);
      stop = stop || f != 0;
    }
    if (stop) {
      result_.stopped = true;
      if (!o_.checkpoint_dir.empty() && steps_done_ > 0) SPILLWAY_RETURN_IF_ERROR(checkpoint(steps_done_));
      result_.steps_done = steps_done_;
      return result_;
    }
    SPILLWAY_ASSIGN_OR_RETURN(StepResult r, this->step(at));
    if (o_.eval_every > 0 && (at % o_.eval_every == 0 || at == o_.steps)) {
      // Rank 0 evaluates (with ZeRO stage 3 every rank takes part: the owners send
      // it their parameters); its outcome is agreed on (the others do not wait for a
      // step that will not come).
      Status evaluated;
      if (rank_id_ == 0 || layout_->zero_stage == 3) {
        auto v = evaluate();
        if (v.ok() && rank_id_ == 0) {
          r.val_loss = *v;
          result_.last_val = *v;
        } else if (!v.ok()) {
          evaluated = v.status();
        }
      }
      SPILLWAY_RETURN_IF_ERROR(agree(gather_, rank_id_, evaluated, "evaluation after step " + std::to_string(at)));
    }
    result_.last = r;
    if (o_.on_step) o_.on_step(r);
    if (!o_.checkpoint_dir.empty() && o_.checkpoint_every > 0 && at % o_.checkpoint_every == 0 && at < final_step)
      SPILLWAY_RETURN_IF_ERROR(checkpoint(at));
  }
  s = rank_->executor().drain();
  if (s.is_ok() && !o_.checkpoint_dir.empty() && steps_done_ > 0) s = checkpoint(steps_done_);
  SPILLWAY_RETURN_IF_ERROR(agree(gather_, rank_id_, s, "finishing data-parallel training"));
  // Every rank takes part (the master weights come from their owners) when rank 0
  // saves (its `save` is the one that counts; the others' may be empty).
  const int32_t saves = rank_id_ == 0 && !o_.save.empty() ? 1 : 0;
  SPILLWAY_ASSIGN_OR_RETURN(std::vector<uint8_t> flags, gather_.all_gather(&saves, sizeof saves));
  int32_t rank0_saves = 0;
  std::memcpy(&rank0_saves, flags.data(), sizeof rank0_saves);
  if (rank0_saves != 0) s = save().with_context("--save");
  SPILLWAY_RETURN_IF_ERROR(agree(gather_, rank_id_, s, "finishing data-parallel training"));
  result_.steps_done = steps_done_;
  return result_;
}

}  // namespace

Result<DataParallelTrainingResult> train_data_parallel(Communicator& comm, Backend& backend,
                                                       const DataParallelTrainingOptions& options) {
  Run run(comm, backend, options);
  return run.run();
}

Result<DataParallelCheckpoint> newest_data_parallel_checkpoint(const std::string& dir,
                                                               std::vector<std::string>* skipped) {
  SPILLWAY_ASSIGN_OR_RETURN(std::vector<Folder> folders, list_folders(dir));
  for (const Folder& f : folders) {
    if (f.partial) {
      if (skipped) skipped->push_back(f.name + ": unfinished (no rank 0 manifest; the run stopped while writing it)");
      continue;
    }
    auto c = read_manifest((std::filesystem::path(dir) / f.name).string());
    if (c.ok()) {
      if (c->step != f.step) {
        if (skipped) skipped->push_back(f.name + ": its manifest says step " + std::to_string(c->step));
        continue;
      }
      return c;
    }
    if (skipped) skipped->push_back(f.name + ": " + c.status().message());
  }
  return Status::not_found("no data-parallel checkpoint (" + std::string(kFolderPrefix) + "<step>/manifest.json) in " +
                           dir);
}

Result<std::vector<DataParallelCheckpointListing>> list_data_parallel_checkpoints(const std::string& dir) {
  SPILLWAY_ASSIGN_OR_RETURN(std::vector<Folder> folders, list_folders(dir));
  std::vector<DataParallelCheckpointListing> out;
  for (const Folder& f : folders) {
    DataParallelCheckpointListing l;
    l.path = (std::filesystem::path(dir) / f.name).string();
    l.step = f.step;
    l.partial = f.partial;
    std::error_code ec;
    for (std::filesystem::directory_iterator it(l.path, ec), end; !ec && it != end; it.increment(ec)) {
      std::error_code size_ec;
      const uintmax_t size = it->is_regular_file(size_ec) ? it->file_size(size_ec) : 0;
      if (!size_ec) l.bytes += static_cast<uint64_t>(size);
    }
    if (ec) {
      l.status = Status::io_error(l.path + ": cannot list it: " + ec.message());
    } else if (f.partial) {
      l.status = Status::not_found("the run stopped while writing it (rank 0 renames the folder once every shard "
                                   "and the manifest are in); not resumable");
    } else {
      auto c = read_manifest(l.path);
      if (!c.ok()) {
        l.status = c.status();
      } else {
        l.world = c->world;
        if (c->step != f.step) {
          l.status = Status::corrupt(l.path + ": its manifest says step " + std::to_string(c->step));
        } else {
          l.manifest_ok = true;
          auto shards = verify_data_parallel_shards(l.path);
          if (!shards.ok())
            l.status = shards.status();
          else if (shards->world != c->world || shards->step != c->step)
            l.status = Status::corrupt(l.path + ": its shards are of " + std::to_string(shards->world) +
                                       " ranks, step " + std::to_string(shards->step) + "; its manifest says " +
                                       std::to_string(c->world) + " ranks, step " + std::to_string(c->step));
        }
      }
    }
    out.push_back(std::move(l));
  }
  return out;
}

bool holds_data_parallel_checkpoints(const std::string& dir) {
  auto folders = list_folders(dir);
  return folders.ok() && !folders->empty();
}

}  // namespace spillway
