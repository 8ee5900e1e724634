// Admission: at most num_threads tasks run and max_queued wait; the rest are
// refused at once; queued tasks can be taken back; Stop drops the queue.
#include "router/bounded_executor.h"

#include <atomic>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace pdserve {
namespace {

void WaitFor(const std::function<bool()>& done) {
  for (int i = 0; i < 2000 && !done(); ++i)
    absl::SleepFor(absl::Milliseconds(1));
  ASSERT_TRUE(done());
}

TEST(BoundedExecutorTest, RefusesBeyondRunningPlusQueued) {
  BoundedExecutor executor(2, 1);
  absl::Notification release;
  std::atomic<int> ran = 0;
  auto task = [&] {
    release.WaitForNotification();
    ++ran;
  };
  ASSERT_TRUE(executor.Submit(task, nullptr));
  ASSERT_TRUE(executor.Submit(task, nullptr));
  WaitFor([&] { return executor.running() == 2; });
  ASSERT_TRUE(executor.Submit(task, nullptr));
  EXPECT_EQ(executor.queued(), 1);
  EXPECT_FALSE(executor.Submit(task, nullptr));
  release.Notify();
  WaitFor([&] { return ran == 3; });
  EXPECT_TRUE(executor.Submit(task, nullptr));
  WaitFor([&] { return ran == 4; });
}

TEST(BoundedExecutorTest, ZeroQueueStillRunsOnIdleThreads) {
  BoundedExecutor executor(1, 0);
  absl::Notification release;
  ASSERT_TRUE(executor.Submit([&] { release.WaitForNotification(); }, nullptr));
  EXPECT_FALSE(executor.Submit([] {}, nullptr));
  WaitFor([&] { return executor.running() == 1; });
  release.Notify();
  WaitFor([&] { return executor.running() == 0; });
  EXPECT_TRUE(executor.Submit([] {}, nullptr));
}

TEST(BoundedExecutorTest, RemoveTakesBackAQueuedTask) {
  BoundedExecutor executor(1, 2);
  absl::Notification release;
  ASSERT_TRUE(executor.Submit([&] { release.WaitForNotification(); }, nullptr));
  WaitFor([&] { return executor.running() == 1; });
  bool ran = false, dropped = false;
  auto ticket = executor.Submit([&] { ran = true; }, [&] { dropped = true; });
  ASSERT_TRUE(ticket);
  EXPECT_TRUE(executor.Remove(*ticket));
  EXPECT_FALSE(executor.Remove(*ticket));
  release.Notify();
  executor.Stop();
  EXPECT_FALSE(ran);
  EXPECT_FALSE(dropped);
}

TEST(BoundedExecutorTest, StopDropsQueuedTasksAndWaitsForRunningOnes) {
  BoundedExecutor executor(1, 4);
  absl::Notification started, release;
  std::atomic<bool> finished = false;
  ASSERT_TRUE(executor.Submit(
      [&] {
        started.Notify();
        release.WaitForNotification();
        finished = true;
      },
      nullptr));
  started.WaitForNotification();
  int dropped = 0;
  for (int i = 0; i < 3; ++i)
    ASSERT_TRUE(executor.Submit([] {}, [&] { ++dropped; }));
  std::thread stopper([&] { executor.Stop(); });
  absl::SleepFor(absl::Milliseconds(20));
  release.Notify();
  stopper.join();
  EXPECT_TRUE(finished);
  EXPECT_EQ(dropped, 3);
  EXPECT_FALSE(executor.Submit([] {}, nullptr));
}

}  // namespace
}  // namespace pdserve
