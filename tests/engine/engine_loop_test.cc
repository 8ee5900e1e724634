// EngineLoop: commands run on its thread in order, events reach their
// request's sink, an idle loop sleeps (it must not steal a core from the
// compute threads of a worker beside it), and destruction cancels what is
// still subscribed.
#include "engine/engine_loop.h"

#include <sys/resource.h>

#include <atomic>
#include <fstream>
#include <string>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "engine/builtin_tiny.h"
#include "gtest/gtest.h"

namespace pdserve {
namespace {

std::unique_ptr<EngineLoop> MakeLoop(
    absl::AnyInvocable<void(Generator&)> tick = nullptr) {
  auto model = MakeTinyModel();
  EXPECT_TRUE(model.ok());
  auto runner =
      CreateModelRunner(*model, {.num_kv_blocks = 64, .num_threads = 1});
  EXPECT_TRUE(runner.ok());
  auto loop = EngineLoop::Create(*std::move(runner), {}, std::move(tick));
  EXPECT_TRUE(loop.ok());
  return *std::move(loop);
}

absl::Duration ProcessCpuTime() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return absl::DurationFromTimeval(u.ru_utime) +
         absl::DurationFromTimeval(u.ru_stime);
}

TEST(EngineLoopTest, EventsReachTheirSinkAndLoadComesBackToIdle) {
  std::unique_ptr<EngineLoop> loop = MakeLoop();
  const int32_t idle = loop->load().free_blocks;
  absl::Notification done;
  std::vector<int32_t> tokens;  // Written on the loop thread until `done`.
  loop->Post([&](Generator& g) {
    SamplingParams sp{.temperature = 0.0f, .max_tokens = 7, .ignore_eos = true};
    ASSERT_TRUE(g.Add({RequestId(1), {256, 1, 2, 3}, sp}).ok());
    loop->Subscribe(RequestId(1), [&](const GenerationEvent& e) {
      tokens.push_back(e.token.token);
      if (e.finish == FinishReason::kNone) return false;
      done.Notify();
      return true;
    });
  });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(tokens.size(), 7u);
  for (int i = 0; i < 100 && loop->load().free_blocks != idle; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(loop->load().free_blocks, idle);
  EXPECT_EQ(loop->load().running, 0);
}

TEST(EngineLoopTest, ItsThreadIsNamedPdEngine) {
  // pd-plan profile tells a worker's engine thread from its serving threads
  // by this name (planner/profiler.cc).
  std::unique_ptr<EngineLoop> loop = MakeLoop();
  std::string name;
  absl::Notification named;
  loop->Post([&](Generator&) {
    std::ifstream comm("/proc/thread-self/comm");
    std::getline(comm, name);
    named.Notify();
  });
  ASSERT_TRUE(named.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(name, "pd-engine");
}

TEST(EngineLoopTest, IdleLoopSleepsWithAndWithoutATick) {
  for (bool with_tick : {false, true}) {
    std::atomic<int> ticks = 0;
    std::unique_ptr<EngineLoop> loop =
        with_tick ? MakeLoop([&](Generator&) { ++ticks; }) : MakeLoop();
    absl::SleepFor(absl::Milliseconds(50));
    const absl::Duration before = ProcessCpuTime();
    absl::SleepFor(absl::Milliseconds(500));
    EXPECT_LT(ProcessCpuTime() - before, absl::Milliseconds(100))
        << "with_tick " << with_tick;
    if (with_tick) {
      EXPECT_GE(ticks, 5);  // Every 50 ms.
      EXPECT_LE(ticks, 20);
    }
  }
}

TEST(EngineLoopTest, DestructionCancelsSubscribedRequests) {
  std::unique_ptr<EngineLoop> loop = MakeLoop();
  std::atomic<bool> cancelled = false;
  absl::Notification subscribed;
  loop->Post([&](Generator& g) {
    SamplingParams sp{
        .temperature = 0.0f, .max_tokens = 900, .ignore_eos = true};
    ASSERT_TRUE(g.Add({RequestId(1), {256, 1}, sp}).ok());
    loop->Subscribe(RequestId(1), [&](const GenerationEvent& e) {
      if (!e.has_token && e.finish == FinishReason::kCancelled)
        cancelled = true;
      return !e.has_token;
    });
    subscribed.Notify();
  });
  ASSERT_TRUE(subscribed.WaitForNotificationWithTimeout(absl::Seconds(10)));
  loop.reset();
  EXPECT_TRUE(cancelled);
}

// The gap between back-to-back steps holds what the loop does between
// them: here each token's sink sleeps 5 ms (sinks run on the loop thread).
// Each step's CPU time is the loop thread's, inside the step.
// A request that finds the loop idle starts a step that is not back to
// back.
TEST(EngineLoopTest, StepGapCountsTheLoopsWorkBetweenBackToBackSteps) {
  auto model = MakeTinyModel();
  ASSERT_TRUE(model.ok());
  auto runner = CreateModelRunner(*model, {.num_kv_blocks = 64, .num_threads = 1});
  ASSERT_TRUE(runner.ok());
  std::vector<EngineStepStats> steps;  // Loop thread until the last sink.
  auto loop = EngineLoop::Create(
      *std::move(runner),
      {.on_step = [&](const EngineStepStats& stats) { steps.push_back(stats); }});
  ASSERT_TRUE(loop.ok());
  constexpr absl::Duration kSinkTime = absl::Milliseconds(5);
  for (int64_t id : {1, 2}) {
    absl::Notification done;
    (*loop)->Post([&](Generator& g) {
      SamplingParams sp{.temperature = 0.0f, .max_tokens = 4, .ignore_eos = true};
      ASSERT_TRUE(g.Add({RequestId(id), {256, 1, 2, 3}, sp}).ok());
      (*loop)->Subscribe(RequestId(id), [&](const GenerationEvent& e) {
        absl::SleepFor(kSinkTime);
        if (e.finish == FinishReason::kNone) return false;
        done.Notify();
        return true;
      });
    });
    ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    // Idle between the two requests.
    absl::SleepFor(absl::Milliseconds(50));
  }
  // Each request: a prefill step and three decode steps, 4 tokens.
  ASSERT_EQ(steps.size(), 8u);
  for (size_t i = 0; i < steps.size(); ++i) {
    SCOPED_TRACE(i);
    const bool first_of_request = i % 4 == 0;
    // The loop thread's CPU in the step, read within its wall time.
    EXPECT_GT(steps[i].cpu, absl::ZeroDuration());
    EXPECT_LE(steps[i].cpu, steps[i].duration);
    EXPECT_EQ(steps[i].gap.has_value(), !first_of_request);
    if (!first_of_request && steps[i].gap) {
      EXPECT_GE(*steps[i].gap, kSinkTime);
      EXPECT_LT(*steps[i].gap, absl::Seconds(1));
    }
  }
}

// A host pool is registered as it is with any transport of host memory,
// never staged, and refused to a transport of device memory only. (The
// staging of a device pool: CudaBackendTest.KvHostStagingCopiesRangesBothWays
// and, across workers, ClusterOnGpuTest.)
TEST(EngineLoopTest,
     HostPoolIsRegisteredAsItIsOrRefusedToDeviceOnlyTransports) {
  std::unique_ptr<EngineLoop> loop = MakeLoop();
  for (const bool takes_device : {false, true}) {
    bool staged = true;
    auto memory = loop->KvMemoryForTransport(/*takes_host_memory=*/true,
                                             takes_device, &staged);
    ASSERT_TRUE(memory.ok()) << memory.status();
    EXPECT_EQ(memory->data(), loop->kv_memory().data());
    EXPECT_EQ(memory->size(), loop->kv_memory().size());
    EXPECT_FALSE(staged);
  }
  bool staged = true;
  auto refused =
      loop->KvMemoryForTransport(/*takes_host_memory=*/false,
                                 /*takes_device_memory=*/true, &staged);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("host memory"), std::string::npos);
  EXPECT_FALSE(staged);
}

}  // namespace
}  // namespace pdserve
