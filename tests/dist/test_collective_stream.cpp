// The collective ops on a stream of their own (exec/dispatch.cpp, Backend::order_*):
// a communicator with a stream only enqueues (set_enqueue_only is on during its calls
// and off after, so host users stay synchronous), and on CUDA the host does not wait:
// the NCCL stream waits for the compute queued before the collective, and compute
// waits for the collective only before an op touching its tensors. The CPU tests run
// everywhere; the CUDA one skips without a GPU (and is absent without NCCL):
//   build/test_dist --gtest_filter='CollectiveStream.*:CudaCollectiveStream.*'
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "backend/backend.h"
#include "backend/communicator.h"
#include "exec/dispatch.h"
#include "program/program.h"
#include "support/gpu_support.h"

#ifdef SPILLWAY_HAVE_NCCL
#include <cuda_runtime.h>

#include <chrono>

#include "backend/cuda/cuda_backend.h"
#include "dist/nccl/nccl_communicator.h"
#endif

using namespace spillway;

namespace {

// One rank on host memory that claims a stream (or not): its reduce runs at once and
// records whether the caller had turned enqueue-only on.
class RecordingCommunicator final : public Communicator {
 public:
  explicit RecordingCommunicator(bool claim_stream) : claim_stream_(claim_stream) {}
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  Status reduce_in_rank_order(const std::vector<const float*>& parts, float* out, size_t n, int) override {
    enqueue_only_seen_.push_back(enqueue_only_);
    for (size_t i = 0; i < n; ++i) {
      float acc = 0.0f;
      for (const float* p : parts) acc += p[i];
      out[i] = acc;
    }
    return Status::ok();
  }
  Status reduce_bf16_in_rank_order(const std::vector<const void*>&, void*, size_t, int) override {
    return Status::unsupported("bf16 is not used here");
  }
  Status all_gather(const void* in, void* out, size_t bytes) override {
    std::memcpy(out, in, bytes);
    return Status::ok();
  }
  Status broadcast(void*, size_t, int) override { return Status::ok(); }
  Status barrier() override { return Status::ok(); }
  void* stream() const override { return claim_stream_ ? const_cast<int*>(&fake_stream_) : nullptr; }
  void set_enqueue_only(bool on) override { enqueue_only_ = on; }

  bool enqueue_only() const { return enqueue_only_; }
  const std::vector<bool>& enqueue_only_seen() const { return enqueue_only_seen_; }

 private:
  bool claim_stream_;
  int fake_stream_ = 0;  // its address stands for a stream
  bool enqueue_only_ = false;
  std::vector<bool> enqueue_only_seen_;
};

// grad[n] = Σ part (one rank's ReduceGradient, root 0), in the given dtype.
Program reduce_program(DType dtype, int64_t n) {
  Program p;
  const TensorId g = p.tensors.add({"grad.w", dtype, {n}, Role::Grad});
  const TensorId part = p.tensors.add({"part.w", dtype, {n}, Role::Grad});
  p.add_op({.kind = OpKind::ReduceGradient, .name = "reduce.w",
            .operands = {{g, Access::Write}, {part, Access::Read}}, .attrs = {.n = n, .root = 0}});
  return p;
}

}  // namespace

// A communicator without a stream runs synchronously, enqueue-only never on.
TEST(CollectiveStream, ACommunicatorWithoutAStreamRunsSynchronously) {
  auto backend = make_backend("cpu", {.threads = 1});
  ASSERT_TRUE(backend.ok());
  RecordingCommunicator comm(/*claim_stream=*/false);
  (*backend)->set_communicator(&comm);
  const Program p = reduce_program(DType::F32, 4);
  std::vector<float> grad(4, -1.0f), part = {1.5f, -2.0f, 0.25f, 8.0f};
  ASSERT_TRUE(run_device_op(**backend, p, p.ops[0], {grad.data(), part.data()}, {}).is_ok());
  EXPECT_EQ(grad, part);
  EXPECT_EQ(comm.enqueue_only_seen(), std::vector<bool>{false});
  (*backend)->set_communicator(nullptr);
}

// With a stream, the calls are made enqueue-only and it is turned off after; the CPU
// backend, which has no streams, cannot order its compute after one: an error naming
// the op and the backend.
TEST(CollectiveStream, ACommunicatorWithAStreamIsEnqueueOnlyDuringTheOp) {
  auto backend = make_backend("cpu", {.threads = 1});
  ASSERT_TRUE(backend.ok());
  RecordingCommunicator comm(/*claim_stream=*/true);
  (*backend)->set_communicator(&comm);
  const Program p = reduce_program(DType::F32, 4);
  std::vector<float> grad(4, -1.0f), part = {1.5f, -2.0f, 0.25f, 8.0f};
  const Status s = run_device_op(**backend, p, p.ops[0], {grad.data(), part.data()}, {});
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::Unsupported) << s.to_string();
  EXPECT_NE(s.message().find("op reduce.w: the cpu backend has no streams"), std::string::npos) << s.to_string();
  EXPECT_EQ(comm.enqueue_only_seen(), std::vector<bool>{true});
  EXPECT_FALSE(comm.enqueue_only());
  EXPECT_EQ(grad, part);  // the call itself ran
  (*backend)->set_communicator(nullptr);
}

#ifdef SPILLWAY_HAVE_NCCL

// One rank over NCCL on one GPU: a bf16 ReduceGradient of a matrix product's output,
// queued behind about a hundred large products. When the op returns, the NCCL stream
// must still be waiting (the host did not wait for the compute queue: no
// synchronize), the collective is pending, an op on other tensors leaves it pending
// and the first op that reads the sum waits for it on the device; every value is then
// right (the sum of one part is that part, bit for bit).
TEST(CudaCollectiveStream, AReduceDoesNotWaitOnTheHostAndComputeWaitsOnlyWhereItTouchesItsTensors) {
  if (!testing_support::gpu_present()) GTEST_SKIP() << "no CUDA GPU on this machine";
  auto made = make_backend("cuda");
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  Backend& b = **made;
  auto id = nccl_unique_id();
  ASSERT_TRUE(id.ok()) << id.status().to_string();
  auto comm = NcclCommunicator::create(0, 1, *id, 0);
  ASSERT_TRUE(comm.ok()) << comm.status().to_string();
  b.set_communicator(comm->get());

  constexpr int N = 4096, C = 4096;  // out[N,C] = inp[N,C] · w[C,C]ᵀ, bf16
  constexpr int kProducts = 100;
  const size_t elems = static_cast<size_t>(N) * C, bytes = elems * 2;
  Program p;
  const TensorId g = p.tensors.add({"grad.w", DType::BF16, {static_cast<int64_t>(elems)}, Role::Grad});
  const TensorId part = p.tensors.add({"part.w", DType::BF16, {static_cast<int64_t>(elems)}, Role::Grad});
  const TensorId other = p.tensors.add({"other", DType::BF16, {16}, Role::Grad});
  const TensorId acc = p.tensors.add({"acc", DType::BF16, {static_cast<int64_t>(elems)}, Role::Grad});
  p.add_op({.kind = OpKind::ReduceGradient, .name = "reduce.w",
            .operands = {{g, Access::Write}, {part, Access::Read}},
            .attrs = {.n = static_cast<int64_t>(elems), .root = 0}});
  p.add_op({.kind = OpKind::Zero, .name = "zero.other", .operands = {{other, Access::Write}}, .attrs = {}});
  p.add_op({.kind = OpKind::AccumulateGradient, .name = "acc += sum",
            .operands = {{acc, Access::Update}, {g, Access::Read}}, .attrs = {.n = static_cast<int64_t>(elems)}});

  auto inp = b.device_alloc(bytes), w = b.device_alloc(bytes), dpart = b.device_alloc(bytes),
       dsum = b.device_alloc(bytes), dother = b.device_alloc(64), dacc = b.device_alloc(bytes),
       scratch = b.device_alloc(bytes);
  ASSERT_TRUE(inp.ok() && w.ok() && dpart.ok() && dsum.ok() && dother.ok() && dacc.ok() && scratch.ok());
  std::vector<uint16_t> h(elems);
  for (size_t i = 0; i < elems; ++i) h[i] = static_cast<uint16_t>(0x3c00 + (i * 2654435761u >> 20) % 512);  // ~[0.0078, 0.03]
  ASSERT_TRUE(b.upload(*inp, h.data(), bytes).is_ok());
  ASSERT_TRUE(b.upload(*w, h.data(), bytes).is_ok());
  b.fill_zero(*dacc, bytes);
  b.fill_zero(*dpart, bytes);
  ASSERT_TRUE(b.use_own_workspace(b.matmul_workspace(N, C, false, false)).is_ok());
  ASSERT_TRUE(b.synchronize().is_ok());

  const auto t0 = std::chrono::steady_clock::now();
  // The last product writes the part (zero until then): a reduce that did not wait
  // for it would read zeros.
  for (int k = 0; k < kProducts; ++k) b.matmul_forward(k + 1 < kProducts ? *scratch : *dpart, *inp, *w, nullptr, N, C, C);
  ASSERT_TRUE(run_device_op(b, p, p.ops[0], {*dsum, *dpart}, {}).is_ok());
  const double host_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const cudaError_t q = cudaStreamQuery(static_cast<cudaStream_t>((*comm)->stream()));
  EXPECT_EQ(q, cudaErrorNotReady) << "the NCCL stream finished before the queued products could have ("
                                  << host_s << " s on the host for " << kProducts
                                  << " products): the op waited for the compute queue";
  (void)cudaGetLastError();
  EXPECT_EQ(*cuda_pending_collectives(b), 1u);
  ASSERT_TRUE(run_device_op(b, p, p.ops[1], {*dother}, {}).is_ok());
  EXPECT_EQ(*cuda_pending_collectives(b), 1u) << "an op on other tensors waited for the collective";
  ASSERT_TRUE(run_device_op(b, p, p.ops[2], {*dacc, *dsum}, {}).is_ok());
  EXPECT_EQ(*cuda_pending_collectives(b), 0u) << "the op reading the sum did not wait for the collective";
  ASSERT_TRUE(b.synchronize().is_ok());

  std::vector<uint16_t> want(elems), got_sum(elems), got_acc(elems);
  ASSERT_TRUE(b.download(want.data(), *dpart, bytes).is_ok());
  ASSERT_TRUE(b.download(got_sum.data(), *dsum, bytes).is_ok());
  ASSERT_TRUE(b.download(got_acc.data(), *dacc, bytes).is_ok());
  EXPECT_EQ(got_sum, want) << "one rank's sum of one part is that part (the last product's output)";
  EXPECT_NE(want, std::vector<uint16_t>(elems, 0));
  EXPECT_EQ(got_acc, want) << "0 + the sum, read after the collective";
  // A host user still gets a synchronous collective after the op turned enqueue-only off.
  ASSERT_TRUE((*comm)->broadcast(*dsum, bytes, 0).is_ok());
  EXPECT_EQ(cudaStreamQuery(static_cast<cudaStream_t>((*comm)->stream())), cudaSuccess);

  b.set_communicator(nullptr);
  for (void* ptr : {*inp, *w, *dpart, *dsum, *dother, *dacc, *scratch}) b.device_free(ptr);
}

#endif  // SPILLWAY_HAVE_NCCL
