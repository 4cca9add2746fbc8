// Data parallelism with bf16 gradients (the CUDA backend's), what can be checked on
// the CPU: how a bf16 training program accumulates a gradient (the step's first
// contribution in place, each later one in a zeroed part added by AccumulateGradient:
// model.h, "Gradient accumulation"), how the layout turns those additions into parts
// of their own that the owner reduces in bf16 (dist/data_parallel.h), the in-process
// communicator's bf16 reduction against one rank's additions, and the registry's and
// dispatch's handling of the new op and of bf16 collectives. The ranks' bits on a GPU:
// test_data_parallel_cuda.cpp.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "backend/backend.h"
#include "dist/data_parallel.h"
#include "exec/dispatch.h"
#include "model/model.h"
#include "program/op_registry.h"
#include "support/thread_communicator.h"

using namespace spillway;
using testing_support::bf16_bits_to_float;
using testing_support::float_to_bf16_bits;
using testing_support::ThreadCommunicator;
using testing_support::ThreadGroup;

namespace {

ModelConfig gpt2() { return ModelConfig{2, 32, 2, 16, 64}; }
ModelConfig llama() { return llama_config(2, 32, 4, 2, 64, 16, 64, /*tied=*/false, 1e-5f, RopeParams{}); }

// Ops other than Zero and AccumulateGradient that add into tensor t.
std::vector<size_t> contributions(const Program& p, TensorId t) {
  std::vector<size_t> out;
  for (size_t i = 0; i < p.ops.size(); ++i) {
    const Op& op = p.ops[i];
    if (op.kind == OpKind::Zero || op.kind == OpKind::AccumulateGradient) continue;
    for (const Operand& o : op.operands)
      if (o.tensor == t && o.access != Access::Read) out.push_back(i);
  }
  return out;
}

}  // namespace

// F32 programs add every contribution into the gradient. BF16 programs add only the
// step's first there; every later one goes to a zeroed part, added right after by an
// AccumulateGradient: as many additions as the f32 program has later contributions.
TEST(Bf16Accumulation, LaterContributionsAreFormedInAZeroedPartAndAdded) {
  for (const auto& [name, cfg] : {std::pair<std::string, ModelConfig>{"gpt2", gpt2()}, {"llama", llama()}}) {
    for (int accum : {1, 3}) {
      SCOPED_TRACE(name + ", accum " + std::to_string(accum));
      auto f32 = build_training_program(cfg, {2, 16, accum}, DType::F32);
      auto bf16 = build_training_program(cfg, {2, 16, accum}, DType::BF16);
      ASSERT_TRUE(f32.ok() && bf16.ok());
      for (const Op& op : f32->ops) EXPECT_NE(op.kind, OpKind::AccumulateGradient) << op.name;
      int additions = 0, tied = 0;
      for (size_t t = 0; t < bf16->tensors.size(); ++t) {
        const TensorInfo& info = bf16->tensors.info(static_cast<TensorId>(t));
        if (info.role != Role::Grad) continue;
        const TensorId g = static_cast<TensorId>(t);
        const size_t all = contributions(*f32, f32->tensors.find(info.name)).size();
        ASSERT_GE(all, 1u) << info.name;
        EXPECT_EQ(contributions(*bf16, g).size(), 1u) << info.name << ": only the first adds in place";
        if (all == 2u * static_cast<size_t>(accum)) ++tied;
        // Each addition: Zero(part), the contribution into the part, AccumulateGradient(g, part).
        size_t seen = 0;
        for (size_t i = 0; i < bf16->ops.size(); ++i) {
          const Op& op = bf16->ops[i];
          if (op.kind != OpKind::AccumulateGradient || op.operands[0].tensor != g) continue;
          ++seen;
          const TensorId part = op.operands[1].tensor;
          const TensorInfo& pi = bf16->tensors.info(part);
          EXPECT_EQ(pi.dtype, DType::BF16);
          EXPECT_EQ(pi.role, Role::Scratch);
          EXPECT_EQ(pi.shape, info.shape);
          EXPECT_EQ(pi.name.rfind("grad_part", 0), 0u) << pi.name;
          // The contribution: the op before this op's additions (an op with two later
          // contributions has two, one after the other).
          size_t at = i - 1;
          while (at > 0 && bf16->ops[at].kind == OpKind::AccumulateGradient) --at;
          ASSERT_GE(at, 1u);
          const Op& into = bf16->ops[at];
          bool adds = false;
          for (const Operand& o : into.operands) adds = adds || (o.tensor == part && o.access == Access::Update);
          EXPECT_TRUE(adds) << into.name << " adds into " << pi.name;
          // Its Zero comes before the contribution (after any other part's Zero of that op).
          bool zeroed = false;
          for (size_t k = at; k-- > 0 && !zeroed;) {
            const Op& z = bf16->ops[k];
            if (z.kind != OpKind::Zero) break;
            zeroed = z.operands[0].tensor == part;
          }
          EXPECT_TRUE(zeroed) << pi.name << " is zeroed right before " << into.name;
        }
        EXPECT_EQ(seen, all - 1) << info.name;
        additions += static_cast<int>(seen);
      }
      if (accum > 1) {
        EXPECT_GT(additions, 0);
      }
      if (name == "gpt2") {
        EXPECT_EQ(tied, 1) << "wte: the LM head and the embedding each micro-batch";
      }
      if (name == "gpt2" && accum == 1) {
        EXPECT_EQ(additions, 1) << "only the tied embedding's second contribution";
      }
      if (name == "llama" && accum == 1) {
        EXPECT_EQ(additions, 0) << "untied: one contribution per gradient";
      }
      EXPECT_TRUE(bf16->validate().is_ok());
    }
  }
}

// The bf16 rank programs are the f32 rank programs in bf16: the same ops on the same
// tensors in the same order (each later contribution a part of its own, the
// AccumulateGradient ops gone), the gradient sums and parameter broadcasts in bf16.
TEST(Bf16Layout, RankProgramsAreTheF32OnesInBf16) {
  for (const auto& [name, cfg] : {std::pair<std::string, ModelConfig>{"gpt2", gpt2()}, {"llama", llama()}}) {
    for (int accum : {1, 2}) {
      SCOPED_TRACE(name + ", 2 ranks of " + std::to_string(accum));
      auto f32 = build_training_program(cfg, {2, 16, accum}, DType::F32);
      auto bf16 = build_training_program(cfg, {2, 16, accum}, DType::BF16);
      ASSERT_TRUE(f32.ok() && bf16.ok());
      auto lf = make_data_parallel_layout(*f32, 2, 2 * accum);
      auto lb = make_data_parallel_layout(*bf16, 2, 2 * accum);
      ASSERT_TRUE(lf.ok()) << lf.status().to_string();
      ASSERT_TRUE(lb.ok()) << lb.status().to_string();
      ASSERT_EQ(lf->params.size(), lb->params.size());
      for (size_t i = 0; i < lf->params.size(); ++i) {
        EXPECT_EQ(lb->params[i].name, lf->params[i].name);
        EXPECT_EQ(lb->params[i].parts, lf->params[i].parts) << lb->params[i].name;
      }
      for (int r = 0; r < 2; ++r) {
        SCOPED_TRACE("rank " + std::to_string(r));
        const Program& F = lf->rank_programs[static_cast<size_t>(r)];
        const Program& B = lb->rank_programs[static_cast<size_t>(r)];
        ASSERT_TRUE(B.validate().is_ok()) << B.validate().to_string();
        ASSERT_EQ(B.ops.size(), F.ops.size());
        for (size_t i = 0; i < B.ops.size(); ++i) {
          const Op& a = F.ops[i];
          const Op& b = B.ops[i];
          ASSERT_EQ(b.kind, a.kind) << "op " << i << ": " << b.name << " against " << a.name;
          ASSERT_EQ(b.operands.size(), a.operands.size()) << b.name;
          for (size_t j = 0; j < b.operands.size(); ++j) {
            const TensorInfo& tb = B.tensors.info(b.operands[j].tensor);
            const TensorInfo& ta = F.tensors.info(a.operands[j].tensor);
            EXPECT_EQ(tb.name, ta.name) << b.name << " operand " << j;
            EXPECT_EQ(b.operands[j].access, a.operands[j].access) << b.name << " operand " << j;
            EXPECT_EQ(tb.shape, ta.shape) << tb.name;
            if (b.kind == OpKind::ReduceGradient || b.kind == OpKind::SendGradient ||
                b.kind == OpKind::BroadcastParam) {
              EXPECT_EQ(tb.dtype, DType::BF16) << b.name << ": " << tb.name;
            }
            if (tb.name.rfind("grad.part", 0) == 0) {
              EXPECT_EQ(tb.role, Role::Grad) << tb.name;
            }
          }
          EXPECT_EQ(b.attrs.root, a.attrs.root) << b.name;
          EXPECT_EQ(b.attrs.n, a.attrs.n) << b.name;
          if (b.kind == OpKind::CrossEntropyBackward) {
            EXPECT_EQ(b.attrs.scale, a.attrs.scale);
          }
        }
        for (size_t t = 0; t < B.tensors.size(); ++t) {
          const TensorInfo& info = B.tensors.info(static_cast<TensorId>(t));
          EXPECT_EQ(info.name.rfind("grad_part", 0), std::string::npos) << info.name << ": the scratch parts are gone";
          if (info.name.rfind("gradsum.", 0) == 0) {
            EXPECT_EQ(info.dtype, DType::BF16) << info.name;
          }
        }
      }
    }
  }
}

// A program whose AccumulateGradient reads a part no op zeroed since its last
// addition is refused by name (the program itself validates: the scratch was written
// by an earlier op, so only the layout can tell).
TEST(Bf16Layout, AnAdditionWithoutItsZeroedPartIsRefused) {
  auto bf16 = build_training_program(gpt2(), {2, 16, 2}, DType::BF16);
  ASSERT_TRUE(bf16.ok());
  Program p = *bf16;
  // The Zero of the last addition whose scratch earlier additions used.
  bool dropped = false;
  for (size_t i = bf16->ops.size(); i-- > 0 && !dropped;) {
    if (bf16->ops[i].kind != OpKind::AccumulateGradient) continue;
    for (size_t k = i; k-- > 0;)
      if (bf16->ops[k].kind == OpKind::Zero && bf16->ops[k].operands[0].tensor == bf16->ops[i].operands[1].tensor) {
        p = *bf16;
        p.ops.erase(p.ops.begin() + static_cast<std::ptrdiff_t>(k));
        dropped = p.validate().is_ok();
        break;
      }
  }
  ASSERT_TRUE(dropped) << "no addition reuses a scratch";
  auto layout = make_data_parallel_layout(p, 2, 4);
  ASSERT_FALSE(layout.ok());
  EXPECT_NE(layout.status().message().find("which no earlier op zeroed"), std::string::npos)
      << layout.status().to_string();
}

// One bf16 rank adds its contributions c0, c1, ... as g = c0, then g = bf16(g + c) for
// each later one; the in-process communicator's bf16 reduction over 3 ranks of 2 parts
// gives those bits, keeps rank 0's first part as it is (-0 stays -0), and differs
// from summing in fp32 and rounding once (so the rounding at each addition is seen).
TEST(Bf16Reduce, ThreadCommunicatorAddsLikeOneRankRoundingEachAddition) {
  const int world = 3, parts = 2;
  const size_t n = 4096;
  std::mt19937 rng(7);
  std::normal_distribution<float> d(0.0f, 1.0f);
  // [rank][part][n] bf16 bits, magnitudes spread so that rounding bites.
  std::vector<std::vector<std::vector<uint16_t>>> x(world, std::vector<std::vector<uint16_t>>(parts));
  for (auto& rank : x)
    for (auto& part : rank) {
      part.resize(n);
      for (size_t i = 0; i < n; ++i) part[i] = float_to_bf16_bits(d(rng) * std::ldexp(1.0f, static_cast<int>(i % 9)));
    }
  x[0][0][0] = 0x8000;  // -0, with -0 in every later part too: one rank's gradient stays -0
  for (auto& rank : x)
    for (auto& part : rank) part[0] = 0x8000;
  std::vector<uint16_t> want(n), fp32_once(n);
  for (size_t i = 0; i < n; ++i) {
    uint16_t acc = x[0][0][i];
    float wide = 0.0f;
    bool first = true;
    for (int r = 0; r < world; ++r)
      for (int j = 0; j < parts; ++j) {
        wide += bf16_bits_to_float(x[r][j][i]);
        if (first) {
          first = false;
          continue;
        }
        acc = float_to_bf16_bits(bf16_bits_to_float(acc) + bf16_bits_to_float(x[r][j][i]));
      }
    want[i] = acc;
    fp32_once[i] = float_to_bf16_bits(wide);
  }
  EXPECT_EQ(want[0], 0x8000);
  size_t differ = 0;
  for (size_t i = 0; i < n; ++i) differ += want[i] != fp32_once[i];
  EXPECT_GT(differ, 0u) << "the data do not tell one rounding from one per addition";

  ThreadGroup group(world);
  std::vector<std::vector<uint16_t>> got(world);
  std::vector<Status> status(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      ThreadCommunicator comm(group, r);
      std::vector<const void*> mine;
      for (const auto& part : x[static_cast<size_t>(r)]) mine.push_back(part.data());
      const int root = 1;
      if (r == root) got[static_cast<size_t>(r)].assign(n, 0x7fff);
      status[static_cast<size_t>(r)] =
          comm.reduce_bf16_in_rank_order(mine, r == root ? got[static_cast<size_t>(r)].data() : nullptr, n, root);
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) ASSERT_TRUE(status[static_cast<size_t>(r)].is_ok()) << status[static_cast<size_t>(r)].to_string();
  EXPECT_EQ(got[1], want);
}

// The f32 reduction and the bf16 one are different collectives: a rank calling the
// other is an error on every rank, not a silent mix.
TEST(Bf16Reduce, MixingTheF32AndBf16ReductionsIsAnError) {
  ThreadGroup group(2);
  std::vector<Status> status(2);
  std::vector<float> f(8, 1.0f), out(8);
  std::vector<uint16_t> h(8, 0x3f80), hout(8);
  std::thread a([&] {
    ThreadCommunicator comm(group, 0);
    status[0] = comm.reduce_in_rank_order({f.data()}, out.data(), 8, 0);
  });
  std::thread b([&] {
    ThreadCommunicator comm(group, 1);
    status[1] = comm.reduce_bf16_in_rank_order({h.data()}, nullptr, 8, 0);
  });
  a.join();
  b.join();
  EXPECT_FALSE(status[0].is_ok());
  EXPECT_FALSE(status[1].is_ok());
}

// AccumulateGradient: its operands share one dtype (f32 or bf16); on the CPU backend
// (f32) it is grad + part, element by element, in place.
TEST(Bf16Accumulation, AccumulateGradientChecksItsOperandsAndAddsInPlace) {
  Program p;
  const TensorId g = p.tensors.add({"grad.w", DType::F32, {5}, Role::Grad});
  const TensorId part = p.tensors.add({"part.w", DType::F32, {5}, Role::Grad});
  const TensorId half = p.tensors.add({"half.w", DType::BF16, {5}, Role::Grad});
  p.add_op({.kind = OpKind::AccumulateGradient, .name = "add", .operands = {{g, Access::Update}, {part, Access::Read}},
            .attrs = {.n = 5}});
  EXPECT_TRUE(p.validate().is_ok()) << p.validate().to_string();
  Program mixed = p;
  mixed.ops[0].operands[1].tensor = half;
  Status s = mixed.validate();
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("operand 1 (part) 'half.w' has dtype bf16; operand 0 has f32"), std::string::npos)
      << s.to_string();
  Program wrong_n = p;
  wrong_n.ops[0].attrs.n = 4;
  EXPECT_FALSE(wrong_n.validate().is_ok());

  auto backend = make_backend("cpu", {.threads = 1});
  ASSERT_TRUE(backend.ok());
  std::vector<float> acc = {1.0f, -2.5f, 1e8f, 0.0f, -0.0f}, add = {0.25f, 2.5f, 1.0f, -0.0f, -0.0f};
  std::vector<float> want(5);
  for (size_t i = 0; i < 5; ++i) want[i] = acc[i] + add[i];
  ASSERT_TRUE(run_device_op(**backend, p, p.ops[0], {acc.data(), add.data()}, {}).is_ok());
  ASSERT_TRUE((*backend)->synchronize().is_ok());
  EXPECT_EQ(std::memcmp(acc.data(), want.data(), sizeof(float) * 5), 0);
}

// Collectives over bf16: the parts and the sum share the gradient's dtype (a bf16 sum
// of f32 parts is refused); the squared norms' all-reduce stays f32.
TEST(Bf16Layout, CollectiveOperandsShareOneDtype) {
  Program p;
  const TensorId sum = p.tensors.add({"gradsum.w", DType::BF16, {6}, Role::Grad});
  const TensorId p0 = p.tensors.add({"grad.w", DType::BF16, {6}, Role::Grad});
  const TensorId p1 = p.tensors.add({"grad.part1.w", DType::F32, {6}, Role::Grad});
  p.add_op({.kind = OpKind::ReduceGradient, .name = "reduce.w", .operands = {{sum, Access::Write}, {p0, Access::Read}},
            .attrs = {.n = 6}});
  EXPECT_TRUE(p.validate().is_ok()) << p.validate().to_string();
  p.ops[0].operands.push_back({p1, Access::Read});
  Status s = p.validate();
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("'grad.part1.w' has dtype f32; operand 0 has bf16"), std::string::npos) << s.to_string();
}
