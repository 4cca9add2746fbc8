// make_backend, the CPU backend's memory and copies, and determinism: every op gives
// the same bits on every run, at other (64-aligned) addresses, and for any thread
// count.
#include <gtest/gtest.h>

#include "support/test_support.h"

#include <unistd.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"

using namespace spillway;

namespace {

std::unique_ptr<Backend> cpu_backend(int threads) {
  auto r = make_backend("cpu", {.threads = threads});
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return std::move(r).value();
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST(MakeBackend, CpuByName) {
  auto b = make_backend("cpu", {.threads = 2});
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_EQ((*b)->name(), "cpu");
  EXPECT_EQ((*b)->activation_dtype(), DType::F32);
  EXPECT_EQ((*b)->alignment(), 64u);
  EXPECT_TRUE(contains((*b)->description(), "2 threads")) << (*b)->description();
}

TEST(MakeBackend, UnknownNameNamesTheAcceptedValues) {
  auto b = make_backend("tpu");
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::InvalidArgument);
  const std::string& m = b.status().message();
  EXPECT_TRUE(contains(m, "tpu") && contains(m, "cpu") && contains(m, "cuda") && contains(m, "auto")) << m;
}

TEST(MakeBackend, NegativeThreadCountIsRejected) {
  auto b = make_backend("cpu", {.threads = -1});
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::InvalidArgument);
}

TEST(MakeBackend, CudaWhenUnavailable) {
#ifdef SPILLWAY_HAVE_CUDA
  if (cuda_available()) GTEST_SKIP() << "a GPU is present";
  auto b = make_backend("cuda");
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::Unsupported);
  EXPECT_TRUE(contains(b.status().message(), "--backend cpu")) << b.status().message();
#else
  EXPECT_FALSE(cuda_available());
  auto b = make_backend("cuda");
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::Unsupported);
  EXPECT_TRUE(contains(b.status().message(), "built without CUDA")) << b.status().message();
  EXPECT_TRUE(contains(b.status().message(), "--backend cpu")) << b.status().message();
#endif
}

TEST(MakeBackend, AutoPicksCudaOnlyWithAGpu) {
  auto b = make_backend("auto", {.threads = 1});
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_EQ((*b)->name(), cuda_available() ? "cuda" : "cpu");
}

// Collectives on a stream (backend.h): the CPU backend's ops finish before they
// return, so ordering after them is a synchronize, work that finished (a null
// stream) needs nothing, and a real stream is refused, naming the backend.
TEST(CpuBackend, OrdersWithOtherStreamsOnlyForWorkThatFinished) {
  auto b = cpu_backend(1);
  std::vector<float> x = {1.0f, 2.0f};
  const std::vector<Backend::DeviceRange> ranges = {{x.data(), sizeof(float) * x.size()}};
  EXPECT_TRUE(b->order_stream_after_compute(nullptr).is_ok());
  EXPECT_TRUE(b->order_after_stream(nullptr, ranges).is_ok());
  EXPECT_TRUE(b->order_compute_for(ranges).is_ok());
  int stands_for_a_stream = 0;
  const Status s = b->order_after_stream(&stands_for_a_stream, ranges);
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::Unsupported);
  EXPECT_TRUE(contains(s.message(), "the cpu backend has no streams")) << s.to_string();
}

TEST(CpuBackend, DeviceAndHostMemory) {
  auto b = cpu_backend(2);
  const size_t free0 = b->device_free_bytes();
  EXPECT_EQ(b->device_capacity(), SIZE_MAX);
  auto d = b->device_alloc(100);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(*d) % 64, 0u);
  EXPECT_LE(b->device_free_bytes(), free0 - 100);
  auto z = b->device_alloc(0);
  ASSERT_TRUE(z.ok());
  b->device_free(*z);
  auto h = b->host_alloc(5000);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(*h) % static_cast<uintptr_t>(sysconf(_SC_PAGESIZE)), 0u);

  std::vector<uint8_t> src(100), back(100, 0xEE);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7 + 1);
  ASSERT_TRUE(b->upload(*d, src.data(), 100).is_ok());
  ASSERT_TRUE(b->download(back.data(), *d, 100).is_ok());
  EXPECT_EQ(src, back);
  auto d2 = b->device_alloc(100);
  ASSERT_TRUE(d2.ok());
  b->copy_device(*d2, *d, 100);
  ASSERT_TRUE(b->download(back.data(), *d2, 100).is_ok());
  EXPECT_EQ(src, back);
  b->fill_zero(*d2, 60);
  ASSERT_TRUE(b->download(back.data(), *d2, 100).is_ok());
  for (size_t i = 0; i < 100; ++i) EXPECT_EQ(back[i], i < 60 ? 0 : src[i]);

  // Through the copy engine: host → device → host.
  std::memcpy(*h, src.data(), 100);
  CopyEngine& ce = b->copy_engine();
  auto t1 = ce.copy(CopyDirection::HostToDevice, *d2, *h, 100);
  ASSERT_TRUE(t1.ok()) << t1.status().to_string();
  ASSERT_TRUE(ce.order_compute_after(*t1).is_ok());
  std::memset(*h, 0, 100);
  auto t2 = ce.copy(CopyDirection::DeviceToHost, *h, *d2, 100);
  ASSERT_TRUE(t2.ok()) << t2.status().to_string();
  ASSERT_TRUE(b->synchronize().is_ok());
  EXPECT_EQ(0, std::memcmp(*h, src.data(), 100));
  EXPECT_EQ(ce.bytes_copied(CopyDirection::HostToDevice), 100u);

  b->device_free(*d);
  b->device_free(*d2);
  b->host_free(*h);
  EXPECT_EQ(b->device_free_bytes(), free0);
}

namespace {

// Tensors packed into one device allocation from byte `shift` on, with gaps that
// vary with `shift`, so that two runs see different (64-aligned) addresses.
class Arena {
 public:
  Arena(Backend& b, size_t bytes, size_t shift) : b_(b), next_(shift), shift_(shift) {
    auto r = b.device_alloc(bytes);
    EXPECT_TRUE(r.ok());
    base_ = static_cast<uint8_t*>(*r);
    bytes_ = bytes;
  }
  ~Arena() { b_.device_free(base_); }
  template <class T>
  T* put(const std::vector<T>& host) {
    const size_t bytes = host.size() * sizeof(T);
    T* p = reinterpret_cast<T*>(base_ + next_);
    next_ += (bytes + 63) / 64 * 64 + (shift_ ? 64 * (count_++ % 3) : 0);
    EXPECT_LE(next_, bytes_);
    EXPECT_TRUE(b_.upload(p, host.data(), bytes).is_ok());
    return p;
  }

 private:
  Backend& b_;
  uint8_t* base_ = nullptr;
  size_t bytes_ = 0, next_ = 0, shift_ = 0, count_ = 0;
};

struct Output {
  std::string name;
  std::vector<uint32_t> bits;
};

using testing_support::random_floats;
using testing_support::random_ints;

// Runs every op once on shapes that span several blocks of each kernel.
std::vector<Output> run_every_op(Backend& b, size_t shift) {
  const int B = 3, T = 70, C = 48, NH = 3, OC = 40, V = 50, VL = 300, N = B * T;
  const size_t n_norm = 3 * 65536 + 11;
  Arena a(b, size_t{16} << 20, shift);
  std::vector<Output> outs;
  auto record = [&](const std::string& name, const void* p, size_t n) {
    Output o{name, std::vector<uint32_t>(n)};
    EXPECT_TRUE(b.download(o.bits.data(), p, n * 4).is_ok());
    outs.push_back(std::move(o));
  };
  auto* tokens = a.put(random_ints(N, 1, V));
  auto* wte = a.put(random_floats(V * C, 2));
  auto* wpe = a.put(random_floats(T * C, 3));
  auto* x = a.put(random_floats(N * C, 4, -1.0f, 2.0f));
  auto* lnw = a.put(random_floats(C, 5, 0.5f, 1.5f));
  auto* lnb = a.put(random_floats(C, 6));
  auto* mw = a.put(random_floats(OC * C, 7));
  auto* mb = a.put(random_floats(OC, 8));
  auto* qkv = a.put(random_floats(N * 3 * C, 9, -2.0f, 2.0f));
  auto* dout = a.put(random_floats(N * C, 10));
  auto* dout_oc = a.put(random_floats(N * OC, 11));
  auto* gx = a.put(random_floats(N * 4 * C, 12, -5.0f, 5.0f));
  auto* gd = a.put(random_floats(N * 4 * C, 13));
  auto* logits = a.put(random_floats(N * VL, 14, -4.0f, 4.0f));
  auto* targets = a.put(random_ints(N, 15, VL));
  auto* grad = a.put(random_floats(n_norm, 16, -3.0f, 3.0f));

  auto* emb = a.put(std::vector<float>(N * C));
  auto* dwte = a.put(random_floats(V * C, 20));
  auto* dwpe = a.put(random_floats(T * C, 21));
  b.embedding_forward(emb, tokens, wte, wpe, B, T, C);
  b.embedding_backward(dwte, dwpe, dout, tokens, B, T, C);
  record("embedding out", emb, N * C);
  record("embedding dwte", dwte, V * C);
  record("embedding dwpe", dwpe, T * C);

  auto* ln = a.put(std::vector<float>(N * C));
  auto* mean = a.put(std::vector<float>(N));
  auto* rstd = a.put(std::vector<float>(N));
  auto* dx = a.put(random_floats(N * C, 22));
  auto* dlnw = a.put(random_floats(C, 23));
  auto* dlnb = a.put(random_floats(C, 24));
  b.layernorm_forward(ln, mean, rstd, x, lnw, lnb, N, C);
  b.layernorm_backward(dx, dlnw, dlnb, dout, x, lnw, mean, rstd, N, C);
  record("layernorm out", ln, N * C);
  record("layernorm mean", mean, N);
  record("layernorm rstd", rstd, N);
  record("layernorm dinp", dx, N * C);
  record("layernorm dweight", dlnw, C);
  record("layernorm dbias", dlnb, C);

  auto* mo = a.put(std::vector<float>(N * OC));
  auto* mdi = a.put(std::vector<float>(N * C));
  auto* mdw = a.put(random_floats(OC * C, 25));
  auto* mdb = a.put(random_floats(OC, 26));
  b.matmul_forward(mo, x, mw, mb, N, C, OC);
  b.matmul_backward(mdi, mdw, mdb, dout_oc, x, mw, N, C, OC);
  record("matmul out", mo, N * OC);
  record("matmul dinp", mdi, N * C);
  record("matmul dweight", mdw, OC * C);
  record("matmul dbias", mdb, OC);

  auto* ao = a.put(std::vector<float>(N * C));
  auto* lse = a.put(std::vector<float>(B * NH * T));
  auto* dqkv = a.put(std::vector<float>(N * 3 * C));
  b.attention_forward(ao, lse, qkv, B, T, C, NH);
  b.attention_backward(dqkv, dout, qkv, ao, lse, B, T, C, NH);
  record("attention out", ao, N * C);
  record("attention lse", lse, B * NH * T);
  record("attention dqkv", dqkv, N * 3 * C);

  auto* go = a.put(std::vector<float>(N * 4 * C));
  auto* gdi = a.put(std::vector<float>(N * 4 * C));
  auto* ro = a.put(std::vector<float>(N * 4 * C));
  b.gelu_forward(go, gx, size_t{N} * 4 * C);
  b.gelu_backward(gdi, gx, gd, size_t{N} * 4 * C);
  b.residual_forward(ro, gx, gd, size_t{N} * 4 * C);
  record("gelu out", go, N * 4 * C);
  record("gelu dinp", gdi, N * 4 * C);
  record("residual out", ro, N * 4 * C);

  auto* losses = a.put(std::vector<float>(N));
  auto* losses2 = a.put(std::vector<float>(N));
  b.crossentropy_forward(losses, logits, targets, N, VL);
  b.crossentropy_backward(losses2, logits, targets, N, VL, 1.0f / N);
  record("crossentropy losses", losses, N);
  record("crossentropy backward losses", losses2, N);
  record("crossentropy dlogits", logits, N * VL);

  auto* sq = a.put(std::vector<float>(1));
  b.squared_norm(sq, grad, n_norm);
  record("squared_norm", sq, 1);
  return outs;
}

void expect_same_bits(const std::vector<Output>& x, const std::vector<Output>& y, const char* what) {
  ASSERT_EQ(x.size(), y.size());
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_TRUE(x[i].bits == y[i].bits) << what << ": " << x[i].name << " differs";
  }
}

}  // namespace

TEST(CpuDeterminism, SameBitsOnEveryRunAndAtOtherAddresses) {
  auto b = cpu_backend(2);
  auto first = run_every_op(*b, 0);
  auto again = run_every_op(*b, 0);
  auto moved = run_every_op(*b, 192);
  expect_same_bits(first, again, "second run");
  expect_same_bits(first, moved, "other addresses");
}

TEST(CpuDeterminism, SameBitsForAnyThreadCount) {
  auto one = cpu_backend(1);
  auto three = cpu_backend(3);
  auto x = run_every_op(*one, 0);
  auto y = run_every_op(*three, 64);
  expect_same_bits(x, y, "1 vs 3 threads");
}
