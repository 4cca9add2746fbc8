// Where the rank programs place each gradient's reduction (dist/data_parallel.h): right
// after the backward op that writes the gradient's last contribution, so that the
// reduction runs while the rest of the backward computes; checked on f32 and bf16
// programs, GPT-2 (tied embedding: two contributions) and Llama, 1 and 2 micro-batches
// a rank, 2 and 4 ranks. That the bits stay one rank's is test_data_parallel*.cpp's.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dist/data_parallel.h"
#include "model/model.h"

using namespace spillway;

namespace {

bool is_reduce(const Op& op) { return op.kind == OpKind::ReduceGradient || op.kind == OpKind::SendGradient; }

// The gradient parts a reduce or send reads (ReduceGradient's first operand is its output).
std::vector<TensorId> parts_of(const Op& op) {
  std::vector<TensorId> out;
  for (const Operand& o : op.operands)
    if (o.access == Access::Read) out.push_back(o.tensor);
  return out;
}

bool writes_any(const Op& op, const std::vector<TensorId>& tensors) {
  for (const Operand& o : op.operands)
    if (o.access != Access::Read)
      for (TensorId t : tensors)
        if (o.tensor == t) return true;
  return false;
}

bool touches_any(const Op& op, const std::vector<TensorId>& tensors) {
  for (const Operand& o : op.operands)
    for (TensorId t : tensors)
      if (o.tensor == t) return true;
  return false;
}

}  // namespace

TEST(CollectivePlacement, EachReduceFollowsItsGradientsLastWriteInsideTheBackward) {
  const ModelConfig gpt2{2, 32, 2, 16, 64};
  const ModelConfig llama = llama_config(2, 32, 4, 2, 64, 16, 64, /*tied=*/false, 1e-5f, RopeParams{});
  for (const auto& [name, cfg] : {std::pair<std::string, ModelConfig>{"gpt2", gpt2}, {"llama", llama}}) {
    for (DType dtype : {DType::F32, DType::BF16}) {
      for (int accum : {1, 2}) {
        for (int world : {2, 4}) {
          SCOPED_TRACE(name + " " + dtype_name(dtype) + ", " + std::to_string(world) + " ranks of " +
                       std::to_string(accum));
          auto training = build_training_program(cfg, {2, 16, accum}, dtype);
          ASSERT_TRUE(training.ok()) << training.status().to_string();
          auto layout = make_data_parallel_layout(*training, world, world * accum);
          ASSERT_TRUE(layout.ok()) << layout.status().to_string();
          std::vector<std::string> rank0_order;
          for (int r = 0; r < world; ++r) {
            SCOPED_TRACE("rank " + std::to_string(r));
            const Program& R = layout->rank_programs[static_cast<size_t>(r)];
            ASSERT_TRUE(R.validate().is_ok());
            size_t optimizer_start = R.ops.size();  // the first op of the optimizer phase
            for (size_t i = 0; i < R.ops.size() && optimizer_start == R.ops.size(); ++i)
              if (R.ops[i].phase == Phase::Optimizer) optimizer_start = i;
            std::vector<std::string> order;
            int reduces = 0, overlapped = 0;
            for (size_t k = 0; k < R.ops.size(); ++k) {
              const Op& op = R.ops[k];
              if (!is_reduce(op)) continue;
              ++reduces;
              order.push_back(op.name.substr(op.name.find('.') + 1));
              EXPECT_EQ(op.phase, Phase::Backward) << op.name;
              EXPECT_LT(k, optimizer_start) << op.name << " sits in the optimizer phase";
              const std::vector<TensorId> parts = parts_of(op);
              ASSERT_FALSE(parts.empty()) << op.name;
              // Right after the final write: the ops between are reduces only, and the
              // op before them writes one of its parts.
              size_t w = k;
              while (w > 0 && is_reduce(R.ops[w - 1])) --w;
              ASSERT_GT(w, 0u) << op.name << " has no op before it";
              EXPECT_TRUE(writes_any(R.ops[w - 1], parts))
                  << op.name << " follows " << R.ops[w - 1].name << ", which writes none of its parts";
              // Nothing after it writes its parts: that write was the last.
              for (size_t j = k + 1; j < R.ops.size(); ++j)
                EXPECT_FALSE(writes_any(R.ops[j], parts)) << R.ops[j].name << " writes a part of " << op.name
                                                          << " after its reduction";
              // Before the next backward op that does not touch its gradient.
              size_t next = k + 1;
              while (next < R.ops.size() && is_reduce(R.ops[next])) ++next;
              if (next < optimizer_start) {
                ++overlapped;
                EXPECT_EQ(R.ops[next].phase, Phase::Backward) << R.ops[next].name;
              }
              for (size_t j = w; j < k; ++j)
                EXPECT_FALSE(touches_any(R.ops[j], parts) && !is_reduce(R.ops[j])) << R.ops[j].name;
            }
            EXPECT_EQ(reduces, static_cast<int>(layout->params.size()));
            // Most gradients are finished early in the backward: their reductions have
            // backward ops after them to hide behind (only the embedding's, finished by
            // the backward's last op, has none).
            EXPECT_GE(overlapped, reduces - 2) << "reductions left at the end of the backward";
            if (r == 0) rank0_order = order;
            EXPECT_EQ(order, rank0_order) << "the ranks call the reductions in different orders";
          }
        }
      }
    }
  }
}

// The same positions on every rank with a reduce and a send told apart only by the
// owner: a layout for one rank alone places them as the full layout does.
TEST(CollectivePlacement, OneRankLayoutsPlaceTheReductionsAsTheFullLayout) {
  auto training = build_training_program(ModelConfig{2, 32, 2, 16, 64}, {2, 16, 2}, DType::BF16);
  ASSERT_TRUE(training.ok());
  auto full = make_data_parallel_layout(*training, 3, 6);
  ASSERT_TRUE(full.ok()) << full.status().to_string();
  for (int r = 0; r < 3; ++r) {
    auto only = make_data_parallel_layout(*training, 3, 6, r);
    ASSERT_TRUE(only.ok());
    const Program& a = full->rank_programs[static_cast<size_t>(r)];
    const Program& b = only->rank_programs[static_cast<size_t>(r)];
    ASSERT_EQ(a.ops.size(), b.ops.size());
    for (size_t i = 0; i < a.ops.size(); ++i) EXPECT_EQ(a.ops[i].name, b.ops[i].name) << i;
  }
}
