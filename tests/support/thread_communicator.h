// TESTS ONLY: a Communicator between threads of one process, for testing the
// data-parallel logic without GPUs. Production uses NCCL (src/dist/nccl_communicator.h);
// this is not a transport.
//
//   ThreadGroup group(4);
//   std::vector<std::thread> ranks;
//   for (int r = 0; r < 4; ++r)
//     ranks.emplace_back([&, r] { ThreadCommunicator comm(group, r); /* ... comm.barrier() ... */ });
//
// Pointers are host memory (the CPU backend's device memory), or, given a Copy that
// reaches it, any memory: the CUDA test passes one over cudaMemcpy (cudaMemcpyDefault),
// so ranks of one process on one GPU share it. Reductions stage every part in host
// memory through the Copy and add there. Each collective posts
// the caller's pointers and sizes, meets the others at a barrier, works on the posted
// buffers, and meets them again before anyone returns (so the buffers stay valid).
// Sizes or roots that differ between ranks are an error on every rank. A rank that
// fails calls abort(): every rank waiting, or arriving later, gets the error instead
// of waiting forever.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "backend/communicator.h"

namespace spillway::testing_support {

class ThreadGroup {
 public:
  explicit ThreadGroup(int world) : world_(world), posts_(static_cast<size_t>(world)) {}
  int world() const { return world_; }

  struct Post {
    const void* in = nullptr;
    void* out = nullptr;
    size_t n = 0;
    int parts = 0, root = 0, kind = 0;
  };

  // Blocks until all ranks arrive; an error once any rank aborted.
  Status arrive() {
    std::unique_lock<std::mutex> lock(mu_);
    if (aborted_) return Status::interrupted("in-process group: " + why_);
    const uint64_t gen = generation_;
    if (++arrived_ == world_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != gen || aborted_; });
    }
    if (aborted_) return Status::interrupted("in-process group: " + why_);
    return Status::ok();
  }
  void abort(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_) why_ = why;
    aborted_ = true;
    cv_.notify_all();
  }
  Post& post(int rank) { return posts_[static_cast<size_t>(rank)]; }

 private:
  int world_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
  std::string why_;
  std::vector<Post> posts_;
};

// Copies `bytes` from src to dst, either of which may be the ranks' memory; the
// default is memcpy (host memory).
using ThreadCopy = Status (*)(void* dst, const void* src, size_t bytes);
inline Status host_copy(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
  return Status::ok();
}

// bf16 bits <-> float, rounding to nearest even (NaN kept quiet), as
// __float2bfloat16_rn and the host optimizer's float_to_bf16 do.
inline float bf16_bits_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

class ThreadCommunicator : public Communicator {
 public:
  ThreadCommunicator(ThreadGroup& group, int rank, ThreadCopy copy = host_copy) : g_(group), rank_(rank), copy_(copy) {}
  int rank() const override { return rank_; }
  int world_size() const override { return g_.world(); }
  void abort(const std::string& why) { g_.abort("rank " + std::to_string(rank_) + ": " + why); }

  Status reduce_in_rank_order(const std::vector<const float*>& parts, float* out, size_t n, int root) override {
    const std::vector<const void*> mine(parts.begin(), parts.end());
    return collective({&mine, out, n, static_cast<int>(parts.size()), root, 1}, [&]() -> Status {
      if (rank_ != root) return Status::ok();
      if (out == nullptr) return Status::invalid_argument("reduce: the root's output is null");
      SPILLWAY_ASSIGN_OR_RETURN(std::vector<std::vector<float>> all, staged<float>(n));
      std::vector<float> sum(n);
      for (size_t i = 0; i < n; ++i) {
        float acc = 0.0f;
        for (const std::vector<float>& x : all) acc += x[i];
        sum[i] = acc;
      }
      return copy_(out, sum.data(), n * sizeof(float));
    });
  }
  Status reduce_bf16_in_rank_order(const std::vector<const void*>& parts, void* out, size_t n, int root) override {
    return collective({&parts, out, n, static_cast<int>(parts.size()), root, 4}, [&]() -> Status {
      if (rank_ != root) return Status::ok();
      if (out == nullptr) return Status::invalid_argument("bf16 reduce: the root's output is null");
      SPILLWAY_ASSIGN_OR_RETURN(std::vector<std::vector<uint16_t>> all, staged<uint16_t>(n));
      std::vector<uint16_t> sum(n);
      for (size_t i = 0; i < n; ++i) {
        uint16_t acc = all[0][i];
        for (size_t k = 1; k < all.size(); ++k)
          acc = float_to_bf16_bits(bf16_bits_to_float(acc) + bf16_bits_to_float(all[k][i]));
        sum[i] = acc;
      }
      return copy_(out, sum.data(), n * sizeof(uint16_t));
    });
  }
  Status all_gather(const void* in, void* out, size_t bytes) override {
    return collective({in, out, bytes, 1, 0, 2}, [&]() -> Status {
      for (int r = 0; r < g_.world(); ++r)
        SPILLWAY_RETURN_IF_ERROR(copy_(static_cast<char*>(out) + static_cast<size_t>(r) * bytes, g_.post(r).in, bytes));
      return Status::ok();
    });
  }
  Status broadcast(void* buf, size_t bytes, int root) override {
    return collective({buf, buf, bytes, 1, root, 3}, [&]() -> Status {
      if (rank_ != root) return copy_(buf, g_.post(root).in, bytes);
      return Status::ok();
    });
  }
  Status barrier() override { return g_.arrive(); }

 private:
  // Every rank's posted parts (n elements of T each), rank order, parts within a rank,
  // copied into host memory.
  template <class T>
  Result<std::vector<std::vector<T>>> staged(size_t n) {
    std::vector<std::vector<T>> all;
    for (int r = 0; r < g_.world(); ++r)
      for (const void* x : *static_cast<const std::vector<const void*>*>(g_.post(r).in)) {
        all.emplace_back(n);
        SPILLWAY_RETURN_IF_ERROR(copy_(all.back().data(), x, n * sizeof(T)));
      }
    return all;
  }

  template <class F>
  Status collective(ThreadGroup::Post mine, F work) {
    const char* names[] = {"", "reduce", "all_gather", "broadcast", "bf16 reduce"};
    if (mine.root < 0 || mine.root >= g_.world()) {
      abort(std::string(names[mine.kind]) + " root " + std::to_string(mine.root) + " is not a rank");
      return Status::invalid_argument(std::string(names[mine.kind]) + ": root " + std::to_string(mine.root) +
                                      " is not a rank of " + std::to_string(g_.world()));
    }
    g_.post(rank_) = mine;
    SPILLWAY_RETURN_IF_ERROR(g_.arrive());
    for (int r = 0; r < g_.world(); ++r) {
      const ThreadGroup::Post& p = g_.post(r);
      if (p.kind != mine.kind || p.n != mine.n || p.parts != mine.parts || p.root != mine.root) {
        // Every rank sees the mismatch; meet once more so no one's buffers go away early.
        (void)g_.arrive();
        return Status::invalid_argument(std::string(names[mine.kind]) + ": rank " + std::to_string(r) +
                                        " called with size " + std::to_string(p.n) + ", parts " +
                                        std::to_string(p.parts) + ", root " + std::to_string(p.root) + "; rank " +
                                        std::to_string(rank_) + " with " + std::to_string(mine.n) + ", " +
                                        std::to_string(mine.parts) + ", " + std::to_string(mine.root));
      }
    }
    Status s = work();
    Status again = g_.arrive();
    return s.is_ok() ? again : s;
  }

  ThreadGroup& g_;
  int rank_;
  ThreadCopy copy_;
};

}  // namespace spillway::testing_support
