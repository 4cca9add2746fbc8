// The data-parallel prediction (dist/predict.h): the busiest rank's planned step plus
// its collectives over the network, costed by hand here.
#include <gtest/gtest.h>

#include "dist/data_parallel.h"
#include "plan/cost_model.h"
#include "dist/predict.h"
#include "model/model.h"
#include "plan/planner.h"
#include "sim/machine.h"
#include "sim/simulator.h"

using namespace spillway;

namespace {

const ModelConfig kModel{2, 32, 2, 16, 64};

}  // namespace

TEST(DataParallelPrediction, CollectivesCostTheirBytesOverTheLink) {
  auto training = build_training_program(kModel, {2, 16, 1}, DType::F32);
  ASSERT_TRUE(training.ok());
  Simulator sim(Machine::cpu_dev_box());
  auto plan_rank = [&](const Program& p) { return make_plan(p, sim, {}, {.policy = Policy::Resident, .alignment = 64}); };
  const NetworkLink link{.bytes_per_s = 1e9, .latency_s = 1e-5};
  // One rank: no collective time, the step of its program.
  auto one = predict_data_parallel(*training, 1, 1, 32, sim, plan_rank, link);
  ASSERT_TRUE(one.ok()) << one.status().to_string();
  EXPECT_EQ(one->collective_s, 0.0);
  EXPECT_GT(one->compute_s, 0.0);
  EXPECT_DOUBLE_EQ(one->tokens_per_s, 32 / one->step_s);
  // Three ranks, by hand: per parameter a chained reduce (n·4 bytes over a link, one
  // latency, then two more hops of a chunk, here the whole gradient, each with the
  // latency) and a broadcast of n·4 with the latency; the norms' gather and broadcast.
  const int world = 3;
  auto layout = make_data_parallel_layout(*training, world, world);
  ASSERT_TRUE(layout.ok());
  double want = 0;
  for (const DataParallelParam& p : layout->params) {
    ASSERT_LT(p.n * 4.0, kChainChunkBytes) << "one chunk per gradient in this model";
    want += (p.n * 4.0) / 1e9 + 1e-5 + 2 * ((p.n * 4.0) / 1e9 + 1e-5) + (p.n * 4.0) / 1e9 + 1e-5;
  }
  const double P = static_cast<double>(training->tensors.info(training->tensors.find("grad_sqnorms")).shape.numel());
  want += 3.0 * P * 4 / 1e9 + 2e-5;
  auto three = predict_data_parallel(*training, world, world, 32, sim, plan_rank, link);
  ASSERT_TRUE(three.ok()) << three.status().to_string();
  EXPECT_NEAR(three->collective_s, want, 1e-12);
  const auto& bytes = layout->partition.rank_bytes;
  EXPECT_EQ(bytes[static_cast<size_t>(three->busiest_rank)], *std::max_element(bytes.begin(), bytes.end()));
  EXPECT_DOUBLE_EQ(three->step_s, three->compute_s + three->exposed_s);
  EXPECT_LE(three->exposed_s, three->collective_s);
  EXPECT_NEAR(three->hidden_s + three->exposed_s, three->collective_s, 1e-15);
  EXPECT_DOUBLE_EQ(three->tokens_per_s, 3 * 32 / three->step_s);
  EXPECT_LT(three->tokens_per_s_per_gpu, one->tokens_per_s_per_gpu);
  // A faster link: less collective time.
  auto fast = predict_data_parallel(*training, world, world, 32, sim, plan_rank, {.bytes_per_s = 1e11});
  ASSERT_TRUE(fast.ok());
  EXPECT_LT(fast->collective_s, three->collective_s / 50);
  // Several ranks without a network rate: an error asking for it.
  auto none = predict_data_parallel(*training, world, world, 32, sim, plan_rank, {});
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("need the network's rate"), std::string::npos) << none.status().to_string();
}

// ZeRO stage 3 (issue 15): the busiest rank holds only its parameters and gathers each
// other one before every op that reads it; no broadcast after the update. By hand: the
// stage-2 reduces and norms, plus n·4 bytes over the link and a latency per gather;
// issued a layer ahead, part of them hides behind the layer before; the plan has the
// room of the parameters it no longer holds (8 layers: the copies of two layers in
// flight are fewer bytes than half the parameters).
TEST(DataParallelPrediction, ZeroStage3GathersBeforeEveryUse) {
  const ModelConfig eight_layers{8, 32, 2, 16, 64};
  auto training = build_training_program(eight_layers, {2, 16, 1}, DType::F32);
  ASSERT_TRUE(training.ok());
  Simulator sim(Machine::cpu_dev_box());
  int64_t peak_bytes = 0;
  auto plan_rank = [&](const Program& p) -> Result<Plan> {
    auto plan = make_plan(p, sim, {}, {.policy = Policy::Resident, .alignment = 64});
    if (plan.ok()) peak_bytes = static_cast<int64_t>(plan->device_bytes);
    return plan;
  };
  const NetworkLink link{.bytes_per_s = 1e9, .latency_s = 1e-5};
  const int world = 2;
  auto stage2 = predict_data_parallel(*training, world, world, 32, sim, plan_rank, link);
  ASSERT_TRUE(stage2.ok()) << stage2.status().to_string();
  const int64_t peak2 = peak_bytes;
  auto stage3 = predict_data_parallel(*training, world, world, 32, sim, plan_rank, link, 3);
  ASSERT_TRUE(stage3.ok()) << stage3.status().to_string();
  const int64_t peak3 = peak_bytes;
  EXPECT_EQ(stage2->zero_stage, 2);
  EXPECT_EQ(stage3->zero_stage, 3);
  auto layout = make_data_parallel_layout(*training, world, world, stage3->busiest_rank, 3);
  ASSERT_TRUE(layout.ok());
  const Program& mine = layout->rank_programs[static_cast<size_t>(stage3->busiest_rank)];
  double gathers = 0, broadcasts = 0;
  int gather_ops = 0;
  for (const Op& op : mine.ops) {
    if (op.kind == OpKind::GatherParam) {
      gathers += op.attrs.n * 4.0 / 1e9 + 1e-5;
      ++gather_ops;
    }
    if (op.kind == OpKind::BroadcastParam) broadcasts += 1;
  }
  EXPECT_EQ(broadcasts, 0);
  // Every parameter is read by a forward op, and the weights by backward ops too.
  ASSERT_GT(gather_ops, static_cast<int>(layout->params.size()));
  double stage2_broadcasts = 0;
  for (const DataParallelParam& p : layout->params) stage2_broadcasts += p.n * 4.0 / 1e9 + 1e-5;
  EXPECT_NEAR(stage3->collective_s, stage2->collective_s - stage2_broadcasts + gathers, 1e-12);
  // The first layer's gathers of each phase wait whole; the later ones partly hide.
  EXPECT_GT(stage3->exposed_s, 0);
  EXPECT_LT(stage3->exposed_s, gathers);
  EXPECT_DOUBLE_EQ(stage3->step_s, stage3->compute_s + stage3->exposed_s);
  EXPECT_LT(peak3, peak2) << "the rank holds half the parameters (and their copies only while in use)";
  // Only stages 2 and 3 exist.
  auto stage4 = predict_data_parallel(*training, world, world, 32, sim, plan_rank, link, 4);
  ASSERT_FALSE(stage4.ok());
  EXPECT_NE(stage4.status().message().find("stage 4"), std::string::npos) << stage4.status().to_string();
}

TEST(DataParallelPrediction, OneRankLayoutsBuildOnlyThatRank) {
  auto training = build_training_program(kModel, {2, 16, 1}, DType::F32);
  ASSERT_TRUE(training.ok());
  auto full = make_data_parallel_layout(*training, 4, 4);
  auto only = make_data_parallel_layout(*training, 4, 4, 2);
  ASSERT_TRUE(full.ok() && only.ok());
  ASSERT_EQ(only->rank_programs.size(), 4u);
  EXPECT_TRUE(only->rank_programs[0].ops.empty());
  ASSERT_EQ(only->rank_programs[2].ops.size(), full->rank_programs[2].ops.size());
  for (size_t i = 0; i < full->rank_programs[2].ops.size(); ++i)
    EXPECT_EQ(only->rank_programs[2].ops[i].name, full->rank_programs[2].ops[i].name);
  EXPECT_FALSE(make_data_parallel_layout(*training, 4, 4, 4).ok());
}

// A bf16 program (the GPU's) can be predicted; its gradient reductions and parameter
// broadcasts are costed in bf16 (half the f32 program's bytes), the squared norms'
// all-reduce in f32.
TEST(DataParallelPrediction, Bf16ProgramsArePredicted) {
  {
    auto f32 = build_training_program(kModel, {2, 16, 1}, DType::F32);
    auto bf16 = build_training_program(kModel, {2, 16, 1}, DType::BF16);
    ASSERT_TRUE(f32.ok() && bf16.ok());
    auto lf = make_data_parallel_layout(*f32, 4, 4, 1);
    auto lb = make_data_parallel_layout(*bf16, 4, 4, 1);
    ASSERT_TRUE(lf.ok() && lb.ok());
    const Program& F = lf->rank_programs[1];
    const Program& B = lb->rank_programs[1];
    ASSERT_EQ(F.ops.size(), B.ops.size());
    const NetworkLink link{.bytes_per_s = 1e9, .latency_s = 0};
    int collectives = 0;
    for (size_t i = 0; i < F.ops.size(); ++i) {
      const double f = collective_seconds(F, i, 4, link), b = collective_seconds(B, i, 4, link);
      if (f == 0) continue;
      ++collectives;
      EXPECT_DOUBLE_EQ(b, F.ops[i].kind == OpKind::AllReduceInRankOrder ? f : f / 2) << F.ops[i].name;
    }
    EXPECT_GT(collectives, 0);
  }
  auto training = build_training_program(kModel, {2, 16, 1}, DType::BF16);
  ASSERT_TRUE(training.ok());
  Simulator sim(Machine::h200());
  auto plan_rank = [&](const Program& p) { return make_plan(p, sim, {}, {.policy = Policy::Resident, .alignment = 256}); };
  auto p = predict_data_parallel(*training, 8, 8, 32, sim, plan_rank, {.bytes_per_s = 450e9, .latency_s = 1e-5});
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_GT(p->collective_s, 0.0);
  EXPECT_GT(p->compute_s, 0.0);
}

// The chained reduce: each link carries the gradient once, so at large n its cost
// barely grows with the world size (a gather on the owner grew as world-1). By hand,
// a 512 MiB gradient (bf16, 2^28 elements) over 450 GB/s with 10 us per hop, 4 MiB
// chunks: 2^29/450e9 + 1e-5 + (world-1)·(2^22/450e9 + 1e-5).
TEST(DataParallelPrediction, ChainedReduceCostDoesNotGrowWithTheWorldAtLargeSizes) {
  const NetworkLink link{.bytes_per_s = 450e9, .latency_s = 1e-5};
  const double bytes = 536870912.0, stream = bytes / 450e9, hop = 4194304.0 / 450e9 + 1e-5;
  for (int world : {2, 4, 8, 64})
    EXPECT_NEAR(chained_reduce_seconds(bytes, world, link), stream + 1e-5 + (world - 1) * hop, 1e-15) << world;
  EXPECT_EQ(chained_reduce_seconds(bytes, 1, link), 0.0);
  const double two = chained_reduce_seconds(bytes, 2, link), eight = chained_reduce_seconds(bytes, 8, link);
  EXPECT_LT(eight, 1.1 * two) << "8 ranks cost about what 2 do";
  EXPECT_LT(eight, 2 * stream) << "the gather's (8-1)·bytes/bandwidth would be 7 times the stream";
  // A small gradient (under a chunk) crosses world hops whole.
  EXPECT_NEAR(chained_reduce_seconds(1000, 4, link), 4 * (1000 / 450e9 + 1e-5), 1e-18);

  // The program's gradient ops cost the chain of their n·e bytes: the largest gradient
  // of a model with a 51.5 M-element embedding (f32: 206 MB), on rank 0 of 2 and 8.
  const ModelConfig big{2, 1024, 16, 1024, 50304};
  auto training = build_training_program(big, {1, 16, 1}, DType::F32);
  ASSERT_TRUE(training.ok()) << training.status().to_string();
  double at[9] = {}, stream_big = 0;
  for (int world : {2, 8}) {
    auto layout = make_data_parallel_layout(*training, world, world, 0);
    ASSERT_TRUE(layout.ok()) << layout.status().to_string();
    const Program& p = layout->rank_programs[0];
    size_t largest = p.ops.size();
    for (size_t i = 0; i < p.ops.size(); ++i)
      if ((p.ops[i].kind == OpKind::ReduceGradient || p.ops[i].kind == OpKind::SendGradient) &&
          (largest == p.ops.size() || p.ops[i].attrs.n > p.ops[largest].attrs.n))
        largest = i;
    ASSERT_LT(largest, p.ops.size());
    const double n = static_cast<double>(p.ops[largest].attrs.n);
    ASSERT_EQ(n, 50304.0 * 1024) << p.ops[largest].name;
    at[world] = collective_seconds(p, largest, world, link);
    stream_big = n * 4 / 450e9;
    EXPECT_NEAR(at[world], n * 4 / 450e9 + 1e-5 + (world - 1) * hop, 1e-15) << world;
  }
  // The pipeline's fill (6 more hops of a 4 MiB chunk) is a quarter of the stream
  // here; the gather's 8-rank cost was 7 streams.
  EXPECT_LT(at[8], 1.3 * at[2]);
  EXPECT_LT(at[8], 2 * stream_big);
}

namespace {

// Every compute op 1 ms, collectives nothing (the prediction costs those itself), a
// step the sum of its ops: a cost model to compute the overlap by hand against.
class MillisecondOps : public CostModel {
 public:
  double op_seconds(const Program& p, size_t i) const override {
    const OpKind k = p.ops[i].kind;
    const bool collective = k == OpKind::ReduceGradient || k == OpKind::SendGradient ||
                            k == OpKind::AllReduceInRankOrder || k == OpKind::BroadcastParam;
    return collective ? 0.0 : 1e-3;
  }
  double copy_seconds(uint64_t, bool) const override { return 0; }
  double duplex_copy_seconds(double) const override { return 0; }
  double host_adam_seconds(double) const override { return 0; }
  double step_seconds(const Program& p, const Plan&) const override {
    double s = 0;
    for (size_t i = 0; i < p.ops.size(); ++i) s += op_seconds(p, i);
    return s;
  }
};

bool is_reduce(const Op& op) { return op.kind == OpKind::ReduceGradient || op.kind == OpKind::SendGradient; }

}  // namespace

// A reduce is hidden behind the backward compute that follows it. Two ranks, f32
// (each reduce one chunk: 2·n·4/bandwidth, no latency), every compute op 1 ms, counted
// on the busiest rank's program:
// - a slow link (100 B/s: each reduce outlasts the whole backward): the reduces queue
//   back to back from the first one's start, a ms after the a compute ops before it,
//   and the b ms of compute before the optimizer phase hide b − a of them:
//   exposed = a ms + Σ reduces − b ms + the optimizer phase's collectives;
// - a fast link (1 GB/s: a reduce of at most 4096 elements, 33 us, ends before the
//   next compute op does): only the reduces after the backward's last compute op are
//   exposed, with the optimizer phase's collectives.
TEST(DataParallelPrediction, AReduceIsHiddenBehindTheBackwardComputeAfterIt) {
  auto training = build_training_program(kModel, {2, 16, 1}, DType::F32);
  ASSERT_TRUE(training.ok());
  Simulator sim(Machine::cpu_dev_box());
  MillisecondOps cost;
  auto plan_rank = [&](const Program& p) { return make_plan(p, sim, {}, {.policy = Policy::Resident, .alignment = 64}); };
  auto probe = predict_data_parallel(*training, 2, 2, 32, cost, plan_rank, {.bytes_per_s = 1e9});
  ASSERT_TRUE(probe.ok()) << probe.status().to_string();
  auto layout = make_data_parallel_layout(*training, 2, 2, probe->busiest_rank);
  ASSERT_TRUE(layout.ok());
  const Program& R = layout->rank_programs[static_cast<size_t>(probe->busiest_rank)];
  // The program's shape, counted: compute ops before the first reduce (a) and before
  // the optimizer phase (b), all compute ops, each reduce's n and the tail's sizes.
  int a = -1, b = 0, all = 0, after_last_compute = 0;
  double reduce_elems = 0, broadcast_elems = 0, trailing_elems = 0, sq = 0;
  bool optimizer = false;
  for (const Op& op : R.ops) {
    optimizer = optimizer || op.phase == Phase::Optimizer;
    if (is_reduce(op)) {
      ASSERT_FALSE(optimizer) << op.name;
      if (a < 0) a = b;
      reduce_elems += static_cast<double>(op.attrs.n);
      trailing_elems += static_cast<double>(op.attrs.n);
      ++after_last_compute;
      ASSERT_LE(op.attrs.n * 4, 4096 * 4) << op.name << ": the fast case's bound";
      continue;
    }
    if (op.kind == OpKind::BroadcastParam) broadcast_elems += static_cast<double>(op.attrs.n);
    if (op.kind == OpKind::AllReduceInRankOrder) sq = static_cast<double>(op.attrs.n);
    if (op.kind == OpKind::AllReduceInRankOrder || op.kind == OpKind::BroadcastParam) continue;
    ++all;
    if (!optimizer) {
      ++b;
      trailing_elems = 0;
      after_last_compute = 0;
    }
  }
  ASSERT_GT(a, 0);
  ASSERT_GT(b - a, 10) << "reduces with backward compute after them";
  ASSERT_GT(after_last_compute, 0) << "the embedding's reduce follows the backward's last op";
  for (double bw : {1e2, 1e9}) {
    SCOPED_TRACE("link " + std::to_string(bw) + " B/s");
    auto p = predict_data_parallel(*training, 2, 2, 32, cost, plan_rank, {.bytes_per_s = bw});
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    const double tail = 2 * sq * 4 / bw + broadcast_elems * 4 / bw;  // gather + broadcast of the norms; params
    const double reduces = 2 * reduce_elems * 4 / bw;
    EXPECT_NEAR(p->compute_s, all * 1e-3, 1e-12);
    EXPECT_NEAR(p->collective_s, reduces + tail, 1e-9 * (reduces + tail));
    const double exposed = bw < 1e6 ? a * 1e-3 + reduces - b * 1e-3 + tail : 2 * trailing_elems * 4 / bw + tail;
    EXPECT_NEAR(p->exposed_s, exposed, 1e-9 * p->collective_s) << "a " << a << ", b " << b;
    EXPECT_NEAR(p->hidden_s, p->collective_s - exposed, 1e-9 * p->collective_s);
    EXPECT_NEAR(p->step_s, all * 1e-3 + exposed, 1e-9 * p->step_s);
    EXPECT_LT(p->exposed_s, p->collective_s) << "some of the reduces are hidden";
  }
}
