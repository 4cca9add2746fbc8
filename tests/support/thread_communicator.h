// TESTS ONLY: a Communicator between threads of one process, for testing the
// data-parallel logic without GPUs. Production uses NCCL (src/dist/nccl_communicator.h);
// this is not a transport.
//
//   ThreadGroup group(4);                       // or ThreadGroup(4, /*chunk_elements=*/7)
//   std::vector<std::thread> ranks;
//   for (int r = 0; r < 4; ++r)
//     ranks.emplace_back([&, r] { ThreadCommunicator comm(group, r); /* ... comm.barrier() ... */ });
//
// Pointers are host memory (the CPU backend's device memory), or, given a Copy that
// reaches it, any memory: the CUDA test passes one over cudaMemcpy (cudaMemcpyDefault),
// so ranks of one process on one GPU share it. The reductions are chained in rank
// order, as the NCCL communicator's are: rank 0 sums its parts, chunk by chunk
// (chunk_elements each), and sends each chunk's running sum to rank 1, which adds its
// parts and sends it on, ..., and the last rank sends the finished chunk to the root
// (or writes it, being the root). Messages go through per-link mailboxes of the group,
// which count the bytes each link carried (bytes_sent). Parts are read and the output
// written through the Copy only; the additions are on the host. Each collective posts
// the caller's pointers and sizes, meets the others at a barrier, works on the posted
// buffers, and meets them again before anyone returns (so the buffers stay valid).
// Sizes or roots that differ between ranks are an error on every rank. A rank that
// fails calls abort(): every rank waiting, or arriving later, gets the error instead
// of waiting forever (a rank failing inside a chained reduce aborts the group).
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "backend/communicator.h"

namespace spillway::testing_support {

class ThreadGroup {
 public:
  // chunk_elements: the elements of one message of a chained reduce (at least 1).
  explicit ThreadGroup(int world, size_t chunk_elements = size_t{1} << 18)
      : world_(world),
        chunk_(chunk_elements == 0 ? 1 : chunk_elements),
        posts_(static_cast<size_t>(world)),
        boxes_(static_cast<size_t>(world) * static_cast<size_t>(world)),
        sent_(static_cast<size_t>(world) * static_cast<size_t>(world), 0) {}
  int world() const { return world_; }
  size_t chunk_elements() const { return chunk_; }

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

  // One message from `from` to `to`, queued (never blocks).
  void send(int from, int to, std::vector<char> message) {
    std::lock_guard<std::mutex> lock(mu_);
    sent_[link(from, to)] += message.size();
    boxes_[link(from, to)].push_back(std::move(message));
    cv_.notify_all();
  }
  // The oldest message from `from` to `to`; waits for one; an error once any rank aborted.
  Result<std::vector<char>> receive(int to, int from) {
    std::unique_lock<std::mutex> lock(mu_);
    std::deque<std::vector<char>>& box = boxes_[link(from, to)];
    cv_.wait(lock, [&] { return !box.empty() || aborted_; });
    if (aborted_) return Status::interrupted("in-process group: " + why_);
    std::vector<char> message = std::move(box.front());
    box.pop_front();
    return message;
  }
  // Bytes sent from `from` to `to` since the group was made.
  size_t bytes_sent(int from, int to) {
    std::lock_guard<std::mutex> lock(mu_);
    return sent_[link(from, to)];
  }

 private:
  size_t link(int from, int to) const { return static_cast<size_t>(to) * static_cast<size_t>(world_) + static_cast<size_t>(from); }

  int world_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
  std::string why_;
  size_t chunk_;                                   // elements per chained-reduce message
  std::vector<Post> posts_;                        // [world]
  std::vector<std::deque<std::vector<char>>> boxes_;  // [world (to) · world (from)] queued messages
  std::vector<size_t> sent_;                       // [world (to) · world (from)] bytes sent
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
      // acc = +0, then every part added (so a -0 first part gives +0, as on one rank).
      return chain<float>(
          mine, out, n, root, "reduce", [](float* acc, const float* x, size_t m) {
            for (size_t i = 0; i < m; ++i) acc[i] = 0.0f + x[i];
          },
          [](float* acc, const float* x, size_t m) {
            for (size_t i = 0; i < m; ++i) acc[i] += x[i];
          });
    });
  }
  Status reduce_bf16_in_rank_order(const std::vector<const void*>& parts, void* out, size_t n, int root) override {
    return collective({&parts, out, n, static_cast<int>(parts.size()), root, 4}, [&]() -> Status {
      // acc = the first part as is, then each later one added in fp32 and rounded.
      return chain<uint16_t>(
          parts, out, n, root, "bf16 reduce", [](uint16_t* acc, const uint16_t* x, size_t m) {
            std::memcpy(acc, x, m * sizeof(uint16_t));
          },
          [](uint16_t* acc, const uint16_t* x, size_t m) {
            for (size_t i = 0; i < m; ++i) acc[i] = float_to_bf16_bits(bf16_bits_to_float(acc[i]) + bf16_bits_to_float(x[i]));
          });
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
  // The chained reduce of this rank's `parts` (each n elements of T): per chunk, rank 0
  // starts the running sum (first(acc, part 0), then add(acc, part j) for its later
  // parts); rank r > 0 receives it from r-1 and adds all its parts; each rank but the
  // last sends it on to r+1; the last sends it to the root, or writes it to `out`
  // being the root. The root, if not last, then receives the finished chunks into
  // `out`. A root's parts are read, chunk by chunk, before that chunk of `out` is
  // written, so out may be its parts[0]. A failure aborts the group (the others would
  // otherwise wait for a message that never comes).
  template <class T, class First, class Add>
  Status chain(const std::vector<const void*>& parts, void* out, size_t n, int root, const char* what, First first,
               Add add) {
    Status s = chain_steps<T>(parts, out, n, root, what, first, add);
    if (!s.is_ok()) abort(s.message());
    return s;
  }
  template <class T, class First, class Add>
  Status chain_steps(const std::vector<const void*>& parts, void* out, size_t n, int root, const char* what,
                     First first, Add add) {
    const int last = g_.world() - 1;
    if (parts.empty()) return Status::invalid_argument(std::string(what) + ": no parts (every rank gives at least one)");
    if (rank_ == root && out == nullptr) return Status::invalid_argument(std::string(what) + ": the root's output is null");
    const size_t chunk = g_.chunk_elements();
    std::vector<T> acc, x;  // [chunk] the running sum, [chunk] one part's slice
    auto expect = [&](const std::vector<char>& message, size_t m, int from, size_t c) -> Status {
      if (message.size() == m * sizeof(T)) return Status::ok();
      return Status::internal(std::string(what) + ": chunk " + std::to_string(c) + " from rank " + std::to_string(from) +
                              " has " + std::to_string(message.size()) + " bytes; expected " +
                              std::to_string(m * sizeof(T)));
    };
    for (size_t off = 0, c = 0; off < n; off += chunk, ++c) {
      const size_t m = std::min(chunk, n - off);
      acc.resize(m);
      x.resize(m);
      size_t j = 0;
      if (rank_ == 0) {
        SPILLWAY_RETURN_IF_ERROR(copy_(x.data(), static_cast<const T*>(parts[0]) + off, m * sizeof(T)));
        first(acc.data(), x.data(), m);
        j = 1;
      } else {
        SPILLWAY_ASSIGN_OR_RETURN(std::vector<char> message, g_.receive(rank_, rank_ - 1));
        SPILLWAY_RETURN_IF_ERROR(expect(message, m, rank_ - 1, c));
        std::memcpy(acc.data(), message.data(), message.size());
      }
      for (; j < parts.size(); ++j) {
        SPILLWAY_RETURN_IF_ERROR(copy_(x.data(), static_cast<const T*>(parts[j]) + off, m * sizeof(T)));
        add(acc.data(), x.data(), m);
      }
      if (rank_ == last && rank_ == root) {
        SPILLWAY_RETURN_IF_ERROR(copy_(static_cast<T*>(out) + off, acc.data(), m * sizeof(T)));
      } else {
        std::vector<char> message(m * sizeof(T));
        std::memcpy(message.data(), acc.data(), message.size());
        g_.send(rank_, rank_ == last ? root : rank_ + 1, std::move(message));
      }
    }
    if (rank_ == root && rank_ != last) {
      for (size_t off = 0, c = 0; off < n; off += chunk, ++c) {
        const size_t m = std::min(chunk, n - off);
        SPILLWAY_ASSIGN_OR_RETURN(std::vector<char> message, g_.receive(rank_, last));
        SPILLWAY_RETURN_IF_ERROR(expect(message, m, last, c));
        SPILLWAY_RETURN_IF_ERROR(copy_(static_cast<T*>(out) + off, message.data(), message.size()));
      }
    }
    return Status::ok();
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
