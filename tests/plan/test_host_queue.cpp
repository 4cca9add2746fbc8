// HostQueue: host ops as an engine with tickets (exec/host_queue.h).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "exec/host_queue.h"

using namespace spillway;

TEST(HostQueue, RunsJobsInOrderAndTicketsSayWhenTheyAreDone) {
  HostQueue q;
  ASSERT_TRUE(q.start().is_ok());
  std::vector<int> order;
  std::atomic<bool> release{false};
  uint64_t first = q.submit([&] {
    while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    order.push_back(1);
    return Status::ok();
  });
  uint64_t second = q.submit([&] {
    order.push_back(2);
    return Status::ok();
  });
  EXPECT_EQ(first, 1u);
  EXPECT_EQ(second, 2u);
  EXPECT_TRUE(q.is_done(0));
  EXPECT_FALSE(q.is_done(first));  // held until released: submit did not wait for it
  EXPECT_FALSE(q.is_done(second));
  release = true;
  ASSERT_TRUE(q.wait(second).is_ok());
  EXPECT_TRUE(q.is_done(first));
  EXPECT_EQ(q.completed(), 2u);
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
}

TEST(HostQueue, AFailedJobSkipsTheRestAndEveryLaterWaitReportsIt) {
  HostQueue q;
  ASSERT_TRUE(q.start().is_ok());
  int ran = 0;
  uint64_t ok = q.submit([&] {
    ++ran;
    return Status::ok();
  });
  uint64_t bad = q.submit([&] { return Status::io_error("disk gone"); });
  uint64_t after = q.submit([&] {
    ++ran;
    return Status::ok();
  });
  Status s = q.wait(after);
  EXPECT_EQ(s.code(), StatusCode::IoError);
  EXPECT_NE(s.message().find("disk gone"), std::string::npos);
  EXPECT_TRUE(q.wait(ok).is_ok());  // before the failure
  EXPECT_FALSE(q.wait(bad).is_ok());
  EXPECT_FALSE(q.failure().is_ok());
  EXPECT_EQ(ran, 1);  // the job after the failed one did not run
}

TEST(HostQueue, WithoutAWorkerJobsRunAtSubmit) {
  HostQueue q;  // not started
  int ran = 0;
  uint64_t t = q.submit([&] {
    ++ran;
    return Status::ok();
  });
  EXPECT_EQ(ran, 1);
  EXPECT_TRUE(q.is_done(t));
  EXPECT_TRUE(q.wait_all().is_ok());
}
