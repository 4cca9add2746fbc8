// Data parallelism on the CUDA backend (bf16 activations and gradients), on ONE GPU:
// N ranks in threads of this process, each with its own CUDA backend (stream,
// cuBLASLt handle, executor) on device 0, joined by the in-process communicator over
// cudaMemcpy, against one process's Trainer with the matching accumulation on the same
// GPU: every step's loss and gradient norm, the validation loss and the saved file's
// bytes equal. Also the two bf16 additions this rests on (AccumulateGradient's kernel
// and the reduction's) agree bit for bit, and one rank over NCCL (collectives on the
// NCCL stream, ordered by events) equals one process. Skips without a GPU, as in CI:
//   build/test_dist --gtest_filter='CudaDataParallel.*'
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "backend/backend.h"
#include "dist/data_parallel_training.h"
#include "exec/dispatch.h"
#include "model/model.h"
#include "support/gpu_support.h"
#include "support/thread_communicator.h"
#include "train/data.h"
#include "train/trainer.h"

#ifdef SPILLWAY_HAVE_CUDA
#include <cuda_runtime.h>
#endif
#ifdef SPILLWAY_HAVE_NCCL
#include "dist/nccl/nccl_communicator.h"
#endif

using namespace spillway;
using testing_support::bf16_bits_to_float;
using testing_support::float_to_bf16_bits;
using testing_support::gpu_present;
using testing_support::ThreadCommunicator;
using testing_support::ThreadGroup;

namespace {

#ifdef SPILLWAY_HAVE_CUDA
// The ranks' memory is device memory of one GPU (host memory for the staging): one
// copy on the legacy default stream, waited for, so that no rank's stream (each
// backend's is non-blocking) reads before it has landed.
Status cuda_copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return Status::ok();
  cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cudaStreamLegacy);
  if (e == cudaSuccess) e = cudaStreamSynchronize(cudaStreamLegacy);
  if (e != cudaSuccess)
    return Status::internal(std::string("in-process communicator: cudaMemcpyAsync of ") + std::to_string(bytes) +
                            " bytes: " + cudaGetErrorString(e));
  return Status::ok();
}
#else
Status cuda_copy(void*, const void*, size_t) { return Status::unsupported("built without CUDA"); }
#endif

constexpr int kSteps = 4;
constexpr float kMaxNorm = 0.5f;

const Dataset& corpus() {
  static const Dataset d = [] {
    auto loaded = load_dataset(std::string(SPILLWAY_SOURCE_DIR) + "/data/tinyshakespeare.txt", 256);
    EXPECT_TRUE(loaded.ok()) << loaded.status().to_string();
    return loaded.ok() ? std::move(*loaded) : Dataset{};
  }();
  return d;
}

// tiny (4 layers, width 128, vocab 256: GPT-2 with the tied embedding), a learning
// rate and a clip low enough that clipping acts (the global norm's reduction counts).
// host_optimizer: the optimizer state on host and AdamW there (gradients copied out
// after their reduction), instead of all resident.
TrainerOptions options(const Backend& b, int accum, bool host_optimizer = false) {
  TrainerOptions o;
  o.model = *model_preset("tiny");
  o.shape = {.B = 4, .T = 64, .accum = accum};
  o.schedule = {.peak = 3e-2f, .warmup_steps = 1, .total_steps = kSteps};
  o.max_grad_norm = kMaxNorm;
  o.seed = 2468;
  o.planner = {.policy = Policy::Resident};
  if (host_optimizer)
    o.planner = {.policy = Policy::Planned, .optimizer_on_host = 1, .device_optimizer_bytes = 0,
                 .stream_optimizer = 0, .speculate = 0, .carry_updates = 0};
  o.machine = machine_for(b);
  o.auto_confirm = 0;
  return o;
}

struct Losses {
  std::vector<float> train, norm, val;
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string temp(const std::string& name) {
  const std::string path = testing::TempDir() + "/dp_cuda_" + name;
  std::filesystem::remove_all(path);
  return path;
}

// One process: the train loader's batches, `accum` a step, one evaluation at the end.
Losses single_process(int accum, const std::string& save, bool host_optimizer = false) {
  Losses out;
  auto backend = make_backend("cuda");
  EXPECT_TRUE(backend.ok()) << backend.status().to_string();
  if (!backend.ok()) return out;
  const TrainerOptions o = options(**backend, accum, host_optimizer);
  auto trainer = Trainer::create(**backend, o);
  EXPECT_TRUE(trainer.ok()) << trainer.status().to_string();
  if (!trainer.ok()) return out;
  EXPECT_TRUE((*trainer)->init_parameters().is_ok());
  auto train = DataLoader::create(corpus().train, o.shape.B, o.shape.T, LoaderMode::Random, o.seed);
  auto val = DataLoader::create(corpus().val, o.shape.B, o.shape.T, LoaderMode::Sequential);
  EXPECT_TRUE(train.ok() && val.ok());
  for (int s = 1; s <= kSteps; ++s) {
    auto r = (*trainer)->step(*train);
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    if (!r.ok()) return out;
    out.train.push_back(r->loss);
    out.norm.push_back(r->grad_norm);
  }
  val->seek(0);
  auto v = (*trainer)->evaluate(*val, 2);
  EXPECT_TRUE(v.ok()) << v.status().to_string();
  out.val.push_back(v.ok() ? *v : -1.0f);
  EXPECT_TRUE((*trainer)->drain().is_ok());
  Status saved = (*trainer)->save(save);
  EXPECT_TRUE(saved.is_ok()) << saved.to_string();
  return out;
}

struct RankRun {
  Status status;
  Losses losses;
};

// `world` ranks of `accum` micro-batches in threads, each with its own CUDA backend on
// device 0; rank 0 evaluates after the last step and saves to `save`.
std::vector<RankRun> data_parallel(int world, int accum, const std::string& save, int zero_stage = 2) {
  ThreadGroup group(world);
  std::vector<RankRun> runs(static_cast<size_t>(world));
  std::atomic<int> finished{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      RankRun& run = runs[static_cast<size_t>(r)];
      ThreadCommunicator comm(group, r, cuda_copy);
      auto backend = make_backend("cuda");
      if (!backend.ok()) {
        run.status = backend.status();
        ++finished;
        comm.abort(run.status.message());
        return;
      }
      DataParallelTrainingOptions o;
      o.trainer = options(**backend, accum);
      o.data = &corpus();
      o.steps = kSteps;
      o.eval_every = kSteps;
      o.eval_batches = 2;
      o.zero_stage = zero_stage;
      if (r == 0) o.save = save;
      o.on_step = [&](const StepResult& s) {
        run.losses.train.push_back(s.loss);
        run.losses.norm.push_back(s.grad_norm);
        if (s.val_loss) run.losses.val.push_back(*s.val_loss);
      };
      auto result = train_data_parallel(comm, **backend, o);
      ++finished;
      if (!result.ok()) {
        run.status = result.status();
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
        while (finished < world && std::chrono::steady_clock::now() < until)
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        if (finished < world) comm.abort(run.status.message());
      }
    });
  for (auto& t : threads) t.join();
  return runs;
}

}  // namespace

// 2 ranks of 1 micro-batch against one process with --accum 2, and 2 ranks of 2
// against --accum 4 (each rank's own two micro-batches travel as parts of their own);
// also with ZeRO stage 3 (2 ranks of 2), whose evaluation gathers the bf16 parameters
// on rank 0 as F32 and narrows them back.
TEST(CudaDataParallel, TwoRanksOnOneGpuEqualOneRankWithTheirMicroBatchesBitForBit) {
  if (!gpu_present()) GTEST_SKIP() << "no CUDA GPU on this machine";
  ASSERT_GT(corpus().train.size(), 0u);
  for (auto [accum, zero_stage] : {std::pair{1, 2}, std::pair{2, 2}, std::pair{2, 3}}) {
    const int world = 2;
    SCOPED_TRACE(std::to_string(world) + " ranks of " + std::to_string(accum) + " micro-batches on one GPU, ZeRO stage " +
                 std::to_string(zero_stage));
    const std::string one = temp("one.safetensors"), many = temp("many.safetensors");
    const Losses ref = single_process(world * accum, one);
    ASSERT_EQ(ref.train.size(), static_cast<size_t>(kSteps));
    int clipped = 0;
    for (float n : ref.norm) clipped += n > kMaxNorm;
    EXPECT_GT(clipped, 0) << "no step clipped: the global norm's reduction is not tested";
    const auto runs = data_parallel(world, accum, many, zero_stage);
    for (int r = 0; r < world; ++r) {
      const RankRun& run = runs[static_cast<size_t>(r)];
      ASSERT_TRUE(run.status.is_ok()) << "rank " << r << ": " << run.status.to_string();
      EXPECT_TRUE(same_bits(run.losses.train, ref.train)) << "rank " << r << "'s step losses";
      EXPECT_TRUE(same_bits(run.losses.norm, ref.norm)) << "rank " << r << "'s gradient norms";
      for (size_t s = 0; s < std::min(run.losses.train.size(), ref.train.size()); ++s)
        EXPECT_EQ(run.losses.train[s], ref.train[s]) << "rank " << r << ", step " << s + 1;
    }
    EXPECT_TRUE(same_bits(runs[0].losses.val, ref.val)) << "rank 0's validation loss";
    EXPECT_EQ(file_bytes(many), file_bytes(one)) << "the saved weights";
  }
}

#ifdef SPILLWAY_HAVE_NCCL
// One rank over NCCL (a world of 1, on the real path): its collectives run on the
// NCCL stream, ordered with the compute stream by events (each ReduceGradient in the
// backward, waited for only by the first later op touching its tensors; the norms'
// all-reduce, the broadcasts; the trainer's host gathers stay synchronous), against
// one process with the same accumulation: the same bits; resident, and with AdamW on
// host (each reduced gradient copied out by the copy engine, after the collective).
TEST(CudaDataParallel, OneRankOverNcclOnItsOwnStreamEqualsOneProcess) {
  if (!gpu_present()) GTEST_SKIP() << "no CUDA GPU on this machine";
  ASSERT_GT(corpus().train.size(), 0u);
  for (auto [accum, host] : {std::pair{1, false}, std::pair{2, false}, std::pair{2, true}}) {
    SCOPED_TRACE("one NCCL rank of " + std::to_string(accum) + " micro-batches" +
                 (host ? ", the optimizer on host" : ""));
    const std::string one = temp("nccl_one.safetensors"), rank = temp("nccl_rank.safetensors");
    const Losses ref = single_process(accum, one, host);
    ASSERT_EQ(ref.train.size(), static_cast<size_t>(kSteps));
    auto id = nccl_unique_id();
    ASSERT_TRUE(id.ok()) << id.status().to_string();
    auto comm = NcclCommunicator::create(0, 1, *id, 0);
    ASSERT_TRUE(comm.ok()) << comm.status().to_string();
    auto backend = make_backend("cuda");
    ASSERT_TRUE(backend.ok()) << backend.status().to_string();
    Losses got;
    DataParallelTrainingOptions o;
    o.trainer = options(**backend, accum, host);
    o.data = &corpus();
    o.steps = kSteps;
    o.eval_every = kSteps;
    o.eval_batches = 2;
    o.save = rank;
    o.on_step = [&](const StepResult& s) {
      got.train.push_back(s.loss);
      got.norm.push_back(s.grad_norm);
      if (s.val_loss) got.val.push_back(*s.val_loss);
    };
    auto result = train_data_parallel(**comm, **backend, o);
    ASSERT_TRUE(result.ok()) << result.status().to_string();
    EXPECT_TRUE(same_bits(got.train, ref.train)) << "step losses";
    EXPECT_TRUE(same_bits(got.norm, ref.norm)) << "gradient norms";
    EXPECT_TRUE(same_bits(got.val, ref.val)) << "validation loss";
    EXPECT_EQ(file_bytes(rank), file_bytes(one)) << "the saved weights";
  }
}
#endif  // SPILLWAY_HAVE_NCCL

// The two bf16 additions the exactness rests on, on the GPU: AccumulateGradient (the
// residual kernel, in place) and the in-process reduction's (on the host) give the
// same bits for the same operands: g + part, rounded to bf16 once per addition.
TEST(CudaDataParallel, AccumulateGradientAddsAsTheBf16ReductionDoes) {
  if (!gpu_present()) GTEST_SKIP() << "no CUDA GPU on this machine";
  auto backend = make_backend("cuda");
  ASSERT_TRUE(backend.ok()) << backend.status().to_string();
  Backend& b = **backend;
  const size_t n = 1 << 16;  // a multiple of 8: the kernel's vector path; n - 3 below: its scalar one
  std::mt19937 rng(11);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<uint16_t> g(n), part(n);
  for (size_t i = 0; i < n; ++i) {
    g[i] = float_to_bf16_bits(d(rng) * std::ldexp(1.0f, static_cast<int>(i % 11)));
    part[i] = float_to_bf16_bits(d(rng));
  }
  g[0] = part[0] = 0x8000;  // -0 + -0 = -0
  for (size_t count : {n, n - 3}) {
    SCOPED_TRACE(std::to_string(count) + " elements");
    Program p;
    const TensorId tg = p.tensors.add({"grad.w", DType::BF16, {static_cast<int64_t>(count)}, Role::Grad});
    const TensorId tp = p.tensors.add({"grad.part1.w", DType::BF16, {static_cast<int64_t>(count)}, Role::Grad});
    p.add_op({.kind = OpKind::AccumulateGradient, .name = "add",
              .operands = {{tg, Access::Update}, {tp, Access::Read}}, .attrs = {.n = static_cast<int64_t>(count)}});
    ASSERT_TRUE(p.validate().is_ok()) << p.validate().to_string();
    auto dg = b.device_alloc(count * 2), dp = b.device_alloc(count * 2);
    ASSERT_TRUE(dg.ok() && dp.ok());
    ASSERT_TRUE(b.upload(*dg, g.data(), count * 2).is_ok());
    ASSERT_TRUE(b.upload(*dp, part.data(), count * 2).is_ok());
    ASSERT_TRUE(run_device_op(b, p, p.ops[0], {*dg, *dp}, {}).is_ok());
    ASSERT_TRUE(b.synchronize().is_ok());
    std::vector<uint16_t> got(count);
    ASSERT_TRUE(b.download(got.data(), *dg, count * 2).is_ok());
    // The reduction of one rank's two parts [g, part] on the host.
    ThreadGroup group(1);
    ThreadCommunicator comm(group, 0);
    std::vector<uint16_t> reduced(count);
    ASSERT_TRUE(comm.reduce_bf16_in_rank_order({g.data(), part.data()}, reduced.data(), count, 0).is_ok());
    size_t differ = 0;
    for (size_t i = 0; i < count; ++i) differ += got[i] != reduced[i];
    EXPECT_EQ(differ, 0u);
    EXPECT_EQ(got[0], 0x8000);
    b.device_free(*dg);
    b.device_free(*dp);
  }
}
