// exec/dispatch.cpp's table agrees with the op registry: a host call exactly for the
// registry's host ops, and operand counts checked against the registry's slots
// before any backend call, with an error naming the op and its kind.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "backend/backend.h"
#include "exec/dispatch.h"
#include "program/op_registry.h"

using namespace spillway;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

Op probe(OpKind k) {
  Op op;
  op.kind = k;
  op.name = "probe";
  return op;
}

}  // namespace

TEST(Dispatch, HostCallsExactlyForTheRegistrysHostOps) {
  for (size_t i = 0; i < kOpKindCount; ++i) {
    const OpKind k = static_cast<OpKind>(i);
    EXPECT_EQ(has_host_implementation(k), op_info(k).host) << op_kind_name(k);
    if (op_info(k).host) continue;
    Status st = run_host_op(probe(k), {}, DType::F32, OptimizerStep{});
    ASSERT_FALSE(st.is_ok());
    EXPECT_TRUE(contains(st.message(), std::string("op probe (") + op_kind_name(k) + ") has no host implementation"))
        << st.message();
  }
  EXPECT_FALSE(has_host_implementation(static_cast<OpKind>(kOpKindCount)));
}

TEST(Dispatch, OperandCountsComeFromTheRegistry) {
  auto backend = make_backend("cpu", {.threads = 1});
  ASSERT_TRUE(backend.ok()) << backend.status().to_string();
  Program program;
  for (size_t i = 0; i < kOpKindCount; ++i) {
    const OpKind k = static_cast<OpKind>(i);
    const size_t lo = op_required_operands(k), hi = op_info(k).slots.size();
    const std::string expected = std::to_string(lo) + (lo == hi ? "" : ".." + std::to_string(hi));
    for (size_t n : {lo - 1, hi + 1}) {
      if (n == static_cast<size_t>(-1)) continue;
      const std::vector<void*> ptrs(n, nullptr);  // refused before any pointer is used
      Status st = run_device_op(**backend, program, probe(k), ptrs, OptimizerStep{});
      ASSERT_FALSE(st.is_ok()) << op_kind_name(k) << " ran with " << n << " operands";
      EXPECT_TRUE(contains(st.message(), std::string("op probe (") + op_kind_name(k) + "): " + std::to_string(n) +
                                             " operands, expected " + expected))
          << st.message();
      if (op_info(k).host) {
        st = run_host_op(probe(k), ptrs, DType::F32, OptimizerStep{});
        ASSERT_FALSE(st.is_ok());
        EXPECT_TRUE(contains(st.message(), "operands, expected " + expected)) << st.message();
      }
    }
  }
  Status st = run_device_op(**backend, program, probe(static_cast<OpKind>(kOpKindCount)), {}, OptimizerStep{});
  ASSERT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), "op probe: unknown kind")) << st.message();
}
