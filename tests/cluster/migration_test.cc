// Request migration end to end, as separate processes on loopback
// (deploy/local/cluster.sh): when the decode worker serving a stream is
// killed (kill -9) or stalls (SIGSTOP) after tokens were streamed, the
// router continues the stream on the other decode worker — through a
// prefill worker or prefilled locally — and the client gets exactly the
// uninterrupted run's tokens, greedy and seeded, with the original prompt
// length in its usage; the stalled worker frees the abandoned request once
// it runs again; with --migration_limit=0 the stream ends UNAVAILABLE; and
// 32 concurrent streams all complete when one of two decode workers dies.
//
// builtin:tiny decodes a token in well under a millisecond, faster than a
// test can look up which worker serves a stream. So the stream's own read
// callback freezes (SIGSTOP) every decode worker as soon as its first
// tokens arrive; the router's routing counters then say which worker holds
// the stream; that one is killed or left stopped, the other resumed.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/builtin_tiny.h"
#include "engine/generator.h"
#include "gtest/gtest.h"
#include "tests/cluster/local_cluster.h"
#include "tests/cluster/stream_case.h"
#include "tests/common/metrics_test_util.h"
#include "tests/engine/test_util.h"

namespace pdserve {
namespace {

namespace v1 = ::pdserve::v1;
using testing_util::ClusterSpec;
using testing_util::LocalCluster;
using testing_util::RandomPrompt;
using testing_util::SampleValue;

// Tokens a stream has when its decode worker is frozen.
constexpr int kTokensBeforeFailure = 20;

using Case = testing_util::StreamCase;
using testing_util::ToRequest;

using testing_util::GenerateStream;
using testing_util::StreamResult;

SamplingParams Greedy(int32_t max_tokens) {
  return {.temperature = 0.0f, .max_tokens = max_tokens, .ignore_eos = true};
}

SamplingParams Seeded(int32_t max_tokens, uint64_t seed) {
  return {.temperature = 0.9f,
          .top_p = 0.9f,
          .seed = seed,
          .max_tokens = max_tokens,
          .ignore_eos = true};
}

// The engine's own tokens for `c`, run alone in this process.
std::vector<int32_t> Uninterrupted(const Case& c) {
  auto model = MakeTinyModel();
  EXPECT_TRUE(model.ok()) << model.status();
  auto runner = CreateModelRunner(*model, {.num_kv_blocks = 128, .num_threads = 1});
  EXPECT_TRUE(runner.ok()) << runner.status();
  return testing_util::GeneratedTokens(**runner, {RequestId(1), c.prompt, c.sampling});
}

std::string DecodeName(int i) { return absl::StrCat("decode-", i); }

// The router's /metrics page.
std::string RouterMetrics(const LocalCluster& cluster) {
  absl::StatusOr<std::string> page =
      testing_util::HttpGet(cluster.MetricsPort("router"), "/metrics");
  EXPECT_TRUE(page.ok()) << page.status();
  return page.value_or("");
}

double RoutedTo(const std::string& metrics, const std::string& worker) {
  return SampleValue(metrics, absl::StrCat(R"(pdserve_router_routed_total{role="decode",worker=")",
                                           worker, "\"}"));
}

double Migrations(const LocalCluster& cluster, const std::string& outcome) {
  return SampleValue(RouterMetrics(cluster),
                     absl::StrCat(R"(pdserve_router_migrations_total{outcome=")", outcome, "\"}"));
}

void Signal(LocalCluster& cluster, const std::string& name, int signal) {
  ASSERT_EQ(::kill(cluster.Pid(name), signal), 0) << name;
}

// Free KV blocks of decode worker `name` return to its total within 10 s.
bool KvBlocksAllFree(LocalCluster& cluster, const std::string& name) {
  auto stub = cluster.DecodeStub(name);
  for (int attempt = 0; attempt < 100; ++attempt) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
    internal::v1::LoadReport load;
    if (stub->GetLoad(&context, {}, &load).ok() && load.free_blocks() == load.total_blocks()) {
      return true;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  return false;
}

// Streams `c` on a cluster with two decode workers; after
// kTokensBeforeFailure tokens both decode workers are frozen and
// `interrupt(serving, other)` runs with the names of the one serving the
// stream and the other. Returns the stream's result.
StreamResult InterruptedStream(
    LocalCluster& cluster, const Case& c,
    const std::function<void(const std::string& serving, const std::string& other)>& interrupt) {
  const std::string before = RouterMetrics(cluster);
  std::atomic<bool> freezing = false;
  absl::Notification frozen;
  StreamResult result;
  std::thread stream([&] {
    result = GenerateStream(cluster.router(), c, [&](size_t tokens) {
      if (tokens < kTokensBeforeFailure || freezing.exchange(true)) return;
      for (int i = 0; i < 2; ++i) Signal(cluster, DecodeName(i), SIGSTOP);
      frozen.Notify();
    });
  });
  const bool froze = frozen.WaitForNotificationWithTimeout(absl::Seconds(30));
  EXPECT_TRUE(froze) << "the stream never got " << kTokensBeforeFailure << " tokens";
  if (froze) {
    const std::string now = RouterMetrics(cluster);
    int serving = -1;
    for (int i = 0; i < 2; ++i) {
      if (RoutedTo(now, DecodeName(i)) > RoutedTo(before, DecodeName(i))) serving = i;
    }
    if (serving < 0) {
      ADD_FAILURE() << "no decode worker was routed the stream";
      for (int i = 0; i < 2; ++i) Signal(cluster, DecodeName(i), SIGCONT);
    } else {
      interrupt(DecodeName(serving), DecodeName(1 - serving));
    }
  }
  stream.join();
  return result;
}

// Every cluster must give back every KV block it held (LocalCluster's
// check, at its end, of the decode workers still alive).
const bool kLeakCheck = [] {
  LocalCluster::on_kv_leak = [](const std::string& leak) { ADD_FAILURE() << "KV leak: " << leak; };
  return true;
}();

void ExpectUninterrupted(const StreamResult& got, const Case& c) {
  const std::vector<int32_t> want = Uninterrupted(c);
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_EQ(got.tokens, want);
  EXPECT_EQ(got.finish, v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(got.usage.prompt_tokens(), c.prompt.size());
  EXPECT_EQ(got.usage.completion_tokens(), want.size());
}

struct KillCase {
  const char* name;
  int prefill_workers;
  bool seeded;
};

class KilledDecodeWorkerTest : public ::testing::TestWithParam<KillCase> {};

// kill -9 of the serving decode worker after 20 of 250 tokens: the stream
// goes on elsewhere (through the prefill worker, or prefilled locally on
// the other decode worker) with the uninterrupted run's tokens.
TEST_P(KilledDecodeWorkerTest, StreamContinuesOnTheOtherWorkerWithTheSameTokens) {
  const KillCase& p = GetParam();
  auto started = LocalCluster::Start({.prefill = p.prefill_workers, .decode = 2});
  ASSERT_TRUE(started.ok()) << started.status();
  LocalCluster& cluster = **started;
  const Case c{RandomPrompt(40, 7), p.seeded ? Seeded(250, 4242) : Greedy(250)};
  const StreamResult got =
      InterruptedStream(cluster, c, [&](const std::string& serving, const std::string& other) {
        Signal(cluster, serving, SIGKILL);
        Signal(cluster, other, SIGCONT);
      });
  ExpectUninterrupted(got, c);
  EXPECT_EQ(Migrations(cluster, "continued"), 1);
}

INSTANTIATE_TEST_SUITE_P(
    Clusters, KilledDecodeWorkerTest,
    ::testing::Values(KillCase{"OnePrefillGreedy", 1, false},
                      KillCase{"OnePrefillSeeded", 1, true},
                      KillCase{"NoPrefillGreedy", 0, false},
                      KillCase{"NoPrefillSeeded", 0, true}),
    [](const ::testing::TestParamInfo<KillCase>& info) { return std::string(info.param.name); });

// A decode worker that stops (SIGSTOP) mid-stream: after the router's stall
// timeout the stream goes on elsewhere; once the worker runs again, the
// abandoned request is cancelled there and its KV blocks come back.
TEST(MigrationTest, StalledDecodeWorkerIsLeftAndFreesTheRequestWhenItResumes) {
  ClusterSpec spec{.prefill = 1, .decode = 2};
  spec.router_args = "--decode_stall_timeout=1.5s";
  auto started = LocalCluster::Start(spec);
  ASSERT_TRUE(started.ok()) << started.status();
  LocalCluster& cluster = **started;
  const Case c{RandomPrompt(30, 9), Seeded(200, 77)};
  std::string stalled;
  const absl::Time start = absl::Now();
  const StreamResult got =
      InterruptedStream(cluster, c, [&](const std::string& serving, const std::string& other) {
        stalled = serving;
        Signal(cluster, other, SIGCONT);
      });
  const absl::Duration took = absl::Now() - start;
  ASSERT_FALSE(stalled.empty());
  Signal(cluster, stalled, SIGCONT);
  ExpectUninterrupted(got, c);
  EXPECT_GE(took, absl::Milliseconds(1500)) << "migrated before the stall timeout";
  EXPECT_EQ(Migrations(cluster, "continued"), 1);
  EXPECT_TRUE(KvBlocksAllFree(cluster, stalled));
}

// With --migration_limit=0 a stream whose decode worker dies ends
// UNAVAILABLE, saying so; the tokens it got are the run's first ones.
TEST(MigrationTest, WithoutMigrationsALostWorkerEndsTheStreamUnavailable) {
  ClusterSpec spec{.prefill = 0, .decode = 2};
  spec.router_args = "--migration_limit=0";
  auto started = LocalCluster::Start(spec);
  ASSERT_TRUE(started.ok()) << started.status();
  LocalCluster& cluster = **started;
  const Case c{RandomPrompt(40, 5), Greedy(250)};
  const StreamResult got =
      InterruptedStream(cluster, c, [&](const std::string& serving, const std::string& other) {
        Signal(cluster, serving, SIGKILL);
        Signal(cluster, other, SIGCONT);
      });
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(absl::StrContains(got.status.error_message(), "0 migration(s) tried"))
      << got.status.error_message();
  const std::vector<int32_t> want = Uninterrupted(c);
  ASSERT_GE(got.tokens.size(), static_cast<size_t>(kTokensBeforeFailure));
  ASSERT_LT(got.tokens.size(), want.size());
  EXPECT_TRUE(std::equal(got.tokens.begin(), got.tokens.end(), want.begin()));
  EXPECT_EQ(Migrations(cluster, "limit_spent"), 1);
  EXPECT_EQ(Migrations(cluster, "continued"), 0);
}

// 32 concurrent streams, greedy and seeded, on one prefill and two decode
// workers; decode-0 freezes once a stream has 20 tokens and is killed
// 300 ms later (streams reserving on it meanwhile fail then too). Every
// stream completes with its uninterrupted tokens.
TEST(MigrationTest, ConcurrentStreamsAllCompleteWhenADecodeWorkerDies) {
  auto started = LocalCluster::Start({.prefill = 1, .decode = 2});
  ASSERT_TRUE(started.ok()) << started.status();
  LocalCluster& cluster = **started;
  std::vector<Case> cases;
  for (int i = 0; i < 32; ++i) {
    const int32_t max_tokens = 150 + 5 * i;
    cases.push_back({RandomPrompt(10 + i, 100 + i),
                     i % 2 == 0 ? Greedy(max_tokens) : Seeded(max_tokens, 1000 + i)});
  }
  std::atomic<bool> freezing = false;
  absl::Notification frozen;
  std::vector<StreamResult> got(cases.size());
  std::vector<std::thread> streams;
  for (size_t i = 0; i < cases.size(); ++i) {
    streams.emplace_back([&, i] {
      got[i] = GenerateStream(cluster.router(), cases[i], [&](size_t tokens) {
        if (tokens < kTokensBeforeFailure || freezing.exchange(true)) return;
        Signal(cluster, DecodeName(0), SIGSTOP);
        frozen.Notify();
      });
    });
  }
  ASSERT_TRUE(frozen.WaitForNotificationWithTimeout(absl::Seconds(30)));
  absl::SleepFor(absl::Milliseconds(300));
  Signal(cluster, DecodeName(0), SIGKILL);
  for (auto& s : streams) s.join();
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("stream ", i));
    ExpectUninterrupted(got[i], cases[i]);
  }
  EXPECT_GT(Migrations(cluster, "continued"), 0);
}

}  // namespace
}  // namespace pdserve
