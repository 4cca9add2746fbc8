#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "io/thread_copy_engine.h"

using namespace spillway;

namespace {

std::vector<unsigned char> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

constexpr size_t kOddSizes[] = {1, 4095, 4097, (size_t{1} << 20) + 3};

}  // namespace

TEST(ThreadCopyEngine, RoundTripsOddSizesByteExact) {
  auto ce = make_thread_copy_engine();
  uint32_t seed = 1;
  for (size_t n : kOddSizes) {
    auto host = random_bytes(n, seed++);
    std::vector<unsigned char> device(n), back(n);
    auto up = ce->copy(CopyDirection::HostToDevice, device.data(), host.data(), n);
    ASSERT_TRUE(up.ok()) << up.status().to_string();
    ASSERT_TRUE(ce->wait(*up).is_ok());
    auto down = ce->copy(CopyDirection::DeviceToHost, back.data(), device.data(), n);
    ASSERT_TRUE(down.ok()) << down.status().to_string();
    ASSERT_TRUE(ce->order_compute_after(*down).is_ok());
    EXPECT_EQ(0, std::memcmp(host.data(), back.data(), n)) << "size " << n;
  }
}

// Many copies in flight in both directions at once: each direction completes in
// submission order, and every byte arrives.
TEST(ThreadCopyEngine, ManyInFlightBothDirectionsCompleteInOrder) {
  auto ce = make_thread_copy_engine();
  constexpr int kRounds = 16;
  std::vector<std::vector<unsigned char>> up_src, up_dst, down_src, down_dst;
  std::vector<CopyTicket> up_tickets, down_tickets;
  uint32_t seed = 100;
  for (int r = 0; r < kRounds; ++r) {
    for (size_t n : kOddSizes) {
      up_src.push_back(random_bytes(n, seed++));
      up_dst.emplace_back(n);
      down_src.push_back(random_bytes(n, seed++));
      down_dst.emplace_back(n);
    }
  }
  uint64_t total = 0;
  for (size_t i = 0; i < up_src.size(); ++i) {
    size_t n = up_src[i].size();
    total += n;
    auto u = ce->copy(CopyDirection::HostToDevice, up_dst[i].data(), up_src[i].data(), n);
    auto d = ce->copy(CopyDirection::DeviceToHost, down_dst[i].data(), down_src[i].data(), n);
    ASSERT_TRUE(u.ok() && d.ok());
    EXPECT_EQ(u->sequence, i + 1);
    EXPECT_EQ(d->sequence, i + 1);
    up_tickets.push_back(*u);
    down_tickets.push_back(*d);
  }
  // While copies run, a done ticket implies every earlier ticket of its direction
  // is done (in-order completion).
  for (int poll = 0; poll < 1000; ++poll) {
    for (const auto* tickets : {&up_tickets, &down_tickets}) {
      bool later_done = false;
      for (size_t i = tickets->size(); i-- > 0;) {
        bool done = ce->is_done((*tickets)[i]);
        if (later_done) {
          EXPECT_TRUE(done) << "ticket " << i + 1 << " not done after a later one";
        }
        later_done = later_done || done;
      }
    }
  }
  ASSERT_TRUE(ce->wait(up_tickets.back()).is_ok());
  for (const auto& t : up_tickets) EXPECT_TRUE(ce->is_done(t));
  ASSERT_TRUE(ce->wait_all().is_ok());
  for (const auto& t : down_tickets) EXPECT_TRUE(ce->is_done(t));
  for (size_t i = 0; i < up_src.size(); ++i) {
    EXPECT_EQ(up_src[i], up_dst[i]) << "host to device copy " << i;
    EXPECT_EQ(down_src[i], down_dst[i]) << "device to host copy " << i;
  }
  EXPECT_EQ(ce->bytes_copied(CopyDirection::HostToDevice), total);
  EXPECT_EQ(ce->bytes_copied(CopyDirection::DeviceToHost), total);
}

TEST(ThreadCopyEngine, WaitOnOldTicketAfterNewerOnesComplete) {
  auto ce = make_thread_copy_engine();
  auto a = random_bytes(4097, 7);
  std::vector<unsigned char> b(a.size()), c(a.size());
  auto first = ce->copy(CopyDirection::HostToDevice, b.data(), a.data(), a.size());
  ASSERT_TRUE(first.ok());
  std::vector<CopyTicket> later;
  for (int i = 0; i < 8; ++i) {
    auto t = ce->copy(CopyDirection::HostToDevice, c.data(), a.data(), a.size());
    ASSERT_TRUE(t.ok());
    later.push_back(*t);
  }
  ASSERT_TRUE(ce->wait(later.back()).is_ok());
  EXPECT_TRUE(ce->is_done(*first));
  EXPECT_TRUE(ce->wait(*first).is_ok());
  EXPECT_TRUE(ce->order_compute_after(*first).is_ok());
  EXPECT_EQ(a, b);
  EXPECT_EQ(a, c);
}

TEST(ThreadCopyEngine, EmptyTicketAndZeroByteCopyAreDone) {
  auto ce = make_thread_copy_engine();
  EXPECT_TRUE(ce->is_done(CopyTicket{}));
  EXPECT_TRUE(ce->wait(CopyTicket{}).is_ok());
  auto t = ce->copy(CopyDirection::DeviceToHost, nullptr, nullptr, 0);
  ASSERT_TRUE(t.ok());
  EXPECT_TRUE(ce->wait(*t).is_ok());
  EXPECT_EQ(ce->bytes_copied(CopyDirection::DeviceToHost), 0u);
}

TEST(ThreadCopyEngine, RejectsBadArgumentsWithStatus) {
  auto ce = make_thread_copy_engine();
  std::vector<unsigned char> buf(256);
  auto null_dst = ce->copy(CopyDirection::HostToDevice, nullptr, buf.data(), buf.size());
  ASSERT_FALSE(null_dst.ok());
  EXPECT_EQ(null_dst.status().code(), StatusCode::InvalidArgument);
  EXPECT_NE(null_dst.status().message().find("null destination"), std::string::npos);
  auto overlap = ce->copy(CopyDirection::HostToDevice, buf.data() + 8, buf.data(), 128);
  ASSERT_FALSE(overlap.ok());
  EXPECT_NE(overlap.status().message().find("overlap"), std::string::npos);
  // A ticket that was never issued is an error, not a hang.
  Status s = ce->wait(CopyTicket{CopyDirection::DeviceToHost, 5});
  EXPECT_EQ(s.code(), StatusCode::InvalidArgument);
}

TEST(ThreadCopyEngine, DestructorFinishesQueuedCopies) {
  auto src = random_bytes((size_t{1} << 20) + 3, 9);
  std::vector<std::vector<unsigned char>> dst(8, std::vector<unsigned char>(src.size()));
  {
    auto ce = make_thread_copy_engine();
    for (auto& d : dst) ASSERT_TRUE(ce->copy(CopyDirection::DeviceToHost, d.data(), src.data(), src.size()).ok());
  }
  for (const auto& d : dst) EXPECT_EQ(d, src);
}
