// Graceful drain and rolling restart end to end (issue 17, part 5), as
// separate processes on loopback (deploy/local/cluster.sh) and real
// signals: a worker sent SIGTERM refuses new work, finishes what it holds,
// and exits 0; the router places new work elsewhere without the client
// seeing an error; past --drain_timeout (or on a second signal) the worker
// exits anyway and the router migrates its streams; and restarting every
// worker in turn under continuous load loses no request.
//
// Streams must still be running when the signal comes, and builtin:tiny
// decodes a token in well under a millisecond, so the drain tests run
// builtin:llama-110m (tens of milliseconds a token on one thread); the
// rolling restart runs builtin:tiny under continuous load. Outputs are
// compared with the same requests run on the idle cluster (110m) or in
// this process (tiny), greedy.
//
// The test process is a child subreaper: the workers the launcher starts
// (and that the tests start again) become its children when the
// launching shell exits, so a drained worker's exit status can be read.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/model.h"
#include "engine/model_runner.h"
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
using testing_util::GenerateStream;
using testing_util::LocalCluster;
using testing_util::RandomPrompt;
using testing_util::SampleValue;
using testing_util::StreamResult;
using Case = testing_util::StreamCase;

const bool kSubreaper = prctl(PR_SET_CHILD_SUBREAPER, 1) == 0;

SamplingParams Greedy(int32_t max_tokens) {
  return {.temperature = 0.0f, .max_tokens = max_tokens, .ignore_eos = true};
}

// The engine's own tokens for each of `cases` on builtin model `model`,
// each run alone in this process.
std::vector<std::vector<int32_t>> References(const std::string& model,
                                             const std::vector<Case>& cases) {
  std::vector<std::vector<int32_t>> out;
  auto loaded = Model::Load(model);
  EXPECT_TRUE(loaded.ok()) << loaded.status();
  if (!loaded.ok()) return out;
  auto runner = CreateModelRunner(*loaded, {.num_kv_blocks = 128, .num_threads = 1});
  EXPECT_TRUE(runner.ok()) << runner.status();
  if (!runner.ok()) return out;
  for (const Case& c : cases) {
    out.push_back(testing_util::GeneratedTokens(**runner, {RequestId(1), c.prompt, c.sampling}));
  }
  return out;
}

// A cluster of builtin:llama-110m workers, one engine thread each; 64 MiB
// pools hold over 2,500 tokens of its KV (12 layers, 4 KV heads of 64:
// at most 24 KiB a token).
ClusterSpec SlowCluster(int prefill, int decode, const std::string& drain_timeout) {
  ClusterSpec spec{.prefill = prefill, .decode = decode, .model = "builtin:llama-110m"};
  spec.prefill_args =
      absl::StrCat("--num_threads=1 --max_batch_tokens=64 --kv_cache_mb=64 --drain_timeout=",
                   drain_timeout);
  // Reservations outlast the slowest prefill queue: under the sanitizers
  // the 110M model's long prompts wait past the 60 s default, and these
  // tests are about the drain, not reservation expiry.
  spec.decode_args = absl::StrCat(
      "--num_threads=1 --max_batch_tokens=64 --kv_cache_mb=64 --kv_canary "
      "--reservation_timeout_ms=600000 --drain_timeout=",
      drain_timeout);
  return spec;
}

// Waits until child `pid` exits; its exit code, or an error when it was
// killed by a signal, is not this process's child, or still runs after
// `timeout`.
absl::StatusOr<int> WaitForExit(pid_t pid, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    int status = 0;
    const pid_t got = ::waitpid(pid, &status, WNOHANG);
    if (got == pid) {
      if (WIFEXITED(status)) return WEXITSTATUS(status);
      return absl::AbortedError(absl::StrCat("pid ", pid, " ended by signal ",
                                             WIFSIGNALED(status) ? WTERMSIG(status) : -1));
    }
    if (got < 0) return absl::FailedPreconditionError(absl::StrCat("pid ", pid, " is no child"));
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("pid ", pid, " still runs after ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

// Sends SIGTERM to every process of the cluster still running and reaps
// it, so that the launcher's `down` finds no zombie children to wait for.
void StopAndReap(LocalCluster& cluster, int prefill, int decode) {
  std::vector<std::string> names = {"router"};
  for (int i = 0; i < prefill; ++i) names.push_back(absl::StrCat("prefill-", i));
  for (int i = 0; i < decode; ++i) names.push_back(absl::StrCat("decode-", i));
  std::vector<pid_t> pids;
  for (const std::string& name : names) {
    const pid_t pid = cluster.Pid(name);
    if (::kill(pid, SIGTERM) == 0) pids.push_back(pid);
  }
  for (pid_t pid : pids) (void)WaitForExit(pid, absl::Seconds(30));
}

std::string Metrics(int port) {
  absl::StatusOr<std::string> page = testing_util::HttpGet(port, "/metrics");
  return page.value_or("");
}

double RoutedTo(const LocalCluster& cluster, const std::string& role, const std::string& worker) {
  return SampleValue(Metrics(cluster.MetricsPort("router")),
                     absl::StrCat(R"(pdserve_router_routed_total{role=")", role, R"(",worker=")",
                                  worker, "\"}"));
}

double Migrations(const LocalCluster& cluster, const std::string& outcome) {
  return SampleValue(Metrics(cluster.MetricsPort("router")),
                     absl::StrCat(R"(pdserve_router_migrations_total{outcome=")", outcome, "\"}"));
}

// Polls `condition` every 10 ms until it holds or `timeout` passes.
bool WaitFor(const std::function<bool()>& condition, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!condition()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

// Free KV blocks of decode worker `name` return to its total (and no
// canary was hit) within 20 s.
void ExpectKvAllFree(LocalCluster& cluster, const std::string& name) {
  auto stub = cluster.DecodeStub(name);
  internal::v1::LoadReport load;
  const bool all_free = WaitFor(
      [&] {
        grpc::ClientContext context;
        context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
        load.Clear();
        return stub->GetLoad(&context, {}, &load).ok() &&
               load.free_blocks() == load.total_blocks();
      },
      absl::Seconds(20));
  EXPECT_TRUE(all_free) << name << ": " << load.ShortDebugString();
  EXPECT_EQ(load.kv_canary_violations(), 0) << name;
}

// Runs `cases` concurrently; `on_tokens(i, n)` hears stream i's count.
std::vector<StreamResult> RunConcurrently(
    LocalCluster& cluster, const std::vector<Case>& cases,
    const std::function<void(size_t, size_t)>& on_tokens = nullptr) {
  std::vector<StreamResult> got(cases.size());
  std::vector<std::thread> streams;
  for (size_t i = 0; i < cases.size(); ++i) {
    streams.emplace_back([&, i] {
      got[i] = GenerateStream(
          cluster.router(), cases[i],
          on_tokens ? std::function<void(size_t)>([&, i](size_t n) { on_tokens(i, n); }) : nullptr,
          absl::Seconds(180));
    });
  }
  for (auto& s : streams) s.join();
  return got;
}

void ExpectComplete(const StreamResult& got, const std::vector<int32_t>& want, const Case& c) {
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_EQ(got.tokens, want);
  EXPECT_EQ(got.finish, v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(got.usage.prompt_tokens(), c.prompt.size());
  EXPECT_EQ(got.usage.completion_tokens(), want.size());
}

// What worker `name` logged when its drain started: the requests it held.
int DrainedRequestsAtStart(const LocalCluster& cluster, const std::string& name) {
  const std::string log = cluster.Log(name);
  const std::string marker = "draining: refusing new work, ";
  const size_t at = log.rfind(marker);
  if (at == std::string::npos) return -1;
  return std::atoi(log.c_str() + at + marker.size());
}

class DrainTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(kSubreaper) << "prctl(PR_SET_CHILD_SUBREAPER) failed"; }
  void TearDown() override {
    if (cluster_ != nullptr) StopAndReap(*cluster_, spec_.prefill, spec_.decode);
    cluster_.reset();
  }
  // The cluster, or null (the test failed then).
  LocalCluster* Start(const ClusterSpec& spec) {
    spec_ = spec;
    auto started = LocalCluster::Start(spec);
    EXPECT_TRUE(started.ok()) << started.status();
    if (started.ok()) cluster_ = *std::move(started);
    return cluster_.get();
  }

  ClusterSpec spec_;
  std::unique_ptr<LocalCluster> cluster_;
};

// SIGTERM to a decode worker serving streams: they run to their end there
// (no migration), with the idle cluster's tokens; requests sent during the
// drain go to the other decode worker and succeed; the drained worker
// exits 0 long before its timeout; the other one gives back every block.
TEST_F(DrainTest, DecodeWorkerFinishesItsStreamsAndExits) {
  LocalCluster* up = Start(SlowCluster(1, 2, "120s"));
  ASSERT_NE(up, nullptr);
  LocalCluster& cluster = *up;
  std::vector<Case> running, during;
  for (int i = 0; i < 4; ++i) running.push_back({RandomPrompt(16 + i, 10 + i), Greedy(48)});
  for (int i = 0; i < 3; ++i) during.push_back({RandomPrompt(12 + i, 50 + i), Greedy(16)});
  std::vector<std::vector<int32_t>> want_running, want_during;
  for (const StreamResult& r : RunConcurrently(cluster, running)) {
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    want_running.push_back(r.tokens);
  }
  for (const StreamResult& r : RunConcurrently(cluster, during)) {
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    want_during.push_back(r.tokens);
  }
  ExpectKvAllFree(cluster, "decode-0");
  const double routed_before = RoutedTo(cluster, "decode", "decode-0");

  // Every stream has its first tokens (so it runs on its decode worker)
  // before the signal.
  std::vector<std::atomic<bool>> has_tokens(running.size());
  std::atomic<int> started = 0;
  absl::Notification all_started;
  std::vector<StreamResult> got;
  std::thread streams([&] {
    got = RunConcurrently(cluster, running, [&](size_t i, size_t n) {
      if (n >= 2 && !has_tokens[i].exchange(true) &&
          ++started == static_cast<int>(running.size())) {
        all_started.Notify();
      }
    });
  });
  ASSERT_TRUE(all_started.WaitForNotificationWithTimeout(absl::Seconds(120)));
  ASSERT_GE(RoutedTo(cluster, "decode", "decode-0") - routed_before, 1)
      << "no stream runs on decode-0";
  const pid_t pid = cluster.Pid("decode-0");
  const absl::Time signalled = absl::Now();
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  const int metrics_port = cluster.MetricsPort("decode-0");
  EXPECT_TRUE(WaitFor(
      [&] { return SampleValue(Metrics(metrics_port), "pdserve_worker_draining") == 1; },
      absl::Seconds(20)))
      << "decode-0 never reported draining";

  // Once the router has seen the report, no new request goes to decode-0.
  EXPECT_TRUE(WaitFor(
      [&] {
        return SampleValue(Metrics(cluster.MetricsPort("router")),
                           R"(pdserve_router_healthy_workers{role="decode"})") == 1;
      },
      absl::Seconds(20)))
      << "the router still counts decode-0 as taking new work";
  const double routed_to_draining = RoutedTo(cluster, "decode", "decode-0");
  const double routed_to_other = RoutedTo(cluster, "decode", "decode-1");
  const std::vector<StreamResult> got_during = RunConcurrently(cluster, during);
  EXPECT_EQ(RoutedTo(cluster, "decode", "decode-0"), routed_to_draining);
  EXPECT_EQ(RoutedTo(cluster, "decode", "decode-1") - routed_to_other, during.size());
  streams.join();
  for (size_t i = 0; i < running.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("running stream ", i));
    ExpectComplete(got[i], want_running[i], running[i]);
  }
  for (size_t i = 0; i < during.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("stream sent during the drain ", i));
    ExpectComplete(got_during[i], want_during[i], during[i]);
  }
  const absl::StatusOr<int> exit = WaitForExit(pid, absl::Seconds(60));
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_EQ(*exit, 0);
  EXPECT_LT(absl::Now() - signalled, absl::Seconds(100)) << "the drain ran into its timeout";
  EXPECT_GE(DrainedRequestsAtStart(cluster, "decode-0"), 1) << cluster.Log("decode-0");
  EXPECT_TRUE(absl::StrContains(cluster.Log("decode-0"), "(idle)")) << cluster.Log("decode-0");
  EXPECT_EQ(Migrations(cluster, "continued"), 0) << "the drain should not need migrations";
  ExpectKvAllFree(cluster, "decode-1");
}

// SIGTERM to a prefill worker prefilling long prompts: its prefills finish
// their push, every request completes with the engine's own tokens,
// requests sent during the drain go to the other prefill worker and
// succeed, and it exits 0 long before its timeout.
TEST_F(DrainTest, PrefillWorkerFinishesItsPrefillsAndExits) {
  std::vector<Case> running, during;
  for (int i = 0; i < 4; ++i) running.push_back({RandomPrompt(300 + 7 * i, 20 + i), Greedy(6)});
  for (int i = 0; i < 3; ++i) during.push_back({RandomPrompt(100 + i, 60 + i), Greedy(6)});
  // Computed here, not on the cluster, whose prefix caches would then
  // hold the prompts and prefill them at once.
  const std::vector<std::vector<int32_t>> want_running = References("builtin:llama-110m", running);
  const std::vector<std::vector<int32_t>> want_during = References("builtin:llama-110m", during);
  ASSERT_EQ(want_running.size(), running.size());
  ASSERT_EQ(want_during.size(), during.size());

  LocalCluster* up = Start(SlowCluster(2, 1, "120s"));
  ASSERT_NE(up, nullptr);
  LocalCluster& cluster = *up;
  auto prefill0 = cluster.PrefillStub("prefill-0");
  std::vector<StreamResult> got;
  std::thread streams([&] { got = RunConcurrently(cluster, running); });
  // prefill-0 has prompts in its engine.
  const bool busy = WaitFor(
      [&] {
        grpc::ClientContext context;
        context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
        internal::v1::LoadReport load;
        return prefill0->GetLoad(&context, {}, &load).ok() &&
               load.running() + load.waiting() > 0;
      },
      absl::Seconds(60));
  const pid_t pid = cluster.Pid("prefill-0");
  const absl::Time signalled = absl::Now();
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  const std::vector<StreamResult> got_during = RunConcurrently(cluster, during);
  streams.join();
  ASSERT_TRUE(busy) << "prefill-0 never had a prompt to prefill";
  for (size_t i = 0; i < running.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("running request ", i));
    ExpectComplete(got[i], want_running[i], running[i]);
  }
  for (size_t i = 0; i < during.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("request sent during the drain ", i));
    ExpectComplete(got_during[i], want_during[i], during[i]);
  }
  const absl::StatusOr<int> exit = WaitForExit(pid, absl::Seconds(60));
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_EQ(*exit, 0);
  EXPECT_LT(absl::Now() - signalled, absl::Seconds(100)) << "the drain ran into its timeout";
  EXPECT_GE(DrainedRequestsAtStart(cluster, "prefill-0"), 1) << cluster.Log("prefill-0");
  EXPECT_TRUE(absl::StrContains(cluster.Log("prefill-0"), "(idle)")) << cluster.Log("prefill-0");
  ExpectKvAllFree(cluster, "decode-0");
}

struct CutShortCase {
  const char* name;
  // The decode workers' --drain_timeout.
  const char* drain_timeout;
  // A second SIGTERM once the worker drains.
  bool second_signal;
};

class DrainCutShortTest : public DrainTest,
                          public ::testing::WithParamInterface<CutShortCase> {};

// A drain cut short — by its timeout, or by a second signal — while a
// stream runs: the worker exits 0 at once, and the router migrates the
// stream to the other decode worker, so the client gets every token of
// the idle cluster's run.
TEST_P(DrainCutShortTest, StreamMigratesAndCompletes) {
  const CutShortCase& p = GetParam();
  LocalCluster* up = Start(SlowCluster(0, 2, p.drain_timeout));
  ASSERT_NE(up, nullptr);
  LocalCluster& cluster = *up;
  // Long enough that the stream still runs when the drain is cut short,
  // on a machine many times faster than the 110M model's ~7 ms a token
  // here.
  const Case c{RandomPrompt(20, 33), Greedy(240)};
  const std::vector<StreamResult> idle = RunConcurrently(cluster, {c});
  ASSERT_TRUE(idle[0].status.ok()) << idle[0].status.error_message();
  double routed_before[2];
  for (int i = 0; i < 2; ++i) {
    routed_before[i] = RoutedTo(cluster, "decode", absl::StrCat("decode-", i));
  }
  absl::Notification started;
  std::vector<StreamResult> got;
  std::thread stream([&] {
    got = RunConcurrently(cluster, {c}, [&](size_t, size_t n) {
      if (n >= 5 && !started.HasBeenNotified()) started.Notify();
    });
  });
  ASSERT_TRUE(started.WaitForNotificationWithTimeout(absl::Seconds(120)));
  std::string serving;
  for (int i = 0; i < 2; ++i) {
    const std::string name = absl::StrCat("decode-", i);
    if (RoutedTo(cluster, "decode", name) > routed_before[i]) serving = name;
  }
  ASSERT_FALSE(serving.empty());
  const pid_t pid = cluster.Pid(serving);
  const absl::Time signalled = absl::Now();
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  if (p.second_signal) {
    const int metrics_port = cluster.MetricsPort(serving);
    EXPECT_TRUE(WaitFor(
        [&] { return SampleValue(Metrics(metrics_port), "pdserve_worker_draining") == 1; },
        absl::Seconds(20)));
    ASSERT_EQ(::kill(pid, SIGINT), 0);
  }
  const absl::StatusOr<int> exit = WaitForExit(pid, absl::Seconds(60));
  const absl::Duration took = absl::Now() - signalled;
  stream.join();
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_EQ(*exit, 0);
  EXPECT_LT(took, absl::Seconds(20)) << "the worker did not exit at once";
  ExpectComplete(got[0], idle[0].tokens, c);
  EXPECT_EQ(Migrations(cluster, "continued"), 1);
  EXPECT_TRUE(absl::StrContains(cluster.Log(serving),
                                p.second_signal ? "a second signal came" : "the drain timeout passed"))
      << cluster.Log(serving);
  EXPECT_TRUE(absl::StrContains(cluster.Log(serving), "1 left")) << cluster.Log(serving);
  ExpectKvAllFree(cluster, serving == "decode-0" ? "decode-1" : "decode-0");
}

INSTANTIATE_TEST_SUITE_P(Drains, DrainCutShortTest,
                         ::testing::Values(CutShortCase{"Timeout", "250ms", false},
                                           CutShortCase{"SecondSignal", "120s", true}),
                         [](const ::testing::TestParamInfo<CutShortCase>& info) {
                           return std::string(info.param.name);
                         });

// Every worker of a 2P2D cluster in turn gets SIGTERM, exits 0 and starts
// again on its port, while four clients send greedy streams back to back:
// no request fails, every output is the engine's own, no stream had to
// migrate, and afterwards every decode worker has all its KV blocks free.
TEST_F(DrainTest, RollingRestartUnderLoadLosesNoRequest) {
  std::vector<Case> cases;
  for (int i = 0; i < 12; ++i) {
    cases.push_back({RandomPrompt(20 + 9 * i, 200 + i), Greedy(150 + 10 * i)});
  }
  const std::vector<std::vector<int32_t>> want = References("builtin:tiny", cases);
  ASSERT_EQ(want.size(), cases.size());
  ClusterSpec spec{.prefill = 2, .decode = 2};
  spec.prefill_args += " --drain_timeout=60s";
  spec.decode_args += " --drain_timeout=60s";
  LocalCluster* up = Start(spec);
  ASSERT_NE(up, nullptr);
  LocalCluster& cluster = *up;

  std::atomic<bool> stop = false;
  std::atomic<int> completed = 0;
  absl::Mutex mu;
  std::vector<std::string> failures;  // Guarded by mu.
  std::vector<std::thread> clients;
  for (int k = 0; k < 4; ++k) {
    clients.emplace_back([&, k] {
      for (size_t n = k; !stop; n += 4) {
        const size_t i = n % cases.size();
        const StreamResult got = GenerateStream(cluster.router(), cases[i]);
        if (!got.status.ok() || got.tokens != want[i] || got.finish != v1::FINISH_REASON_LENGTH) {
          absl::MutexLock lock(&mu);
          failures.push_back(absl::StrCat("case ", i, ": ", got.status.error_code(), " ",
                                          got.status.error_message(), "; ", got.tokens.size(),
                                          " tokens of ", want[i].size(),
                                          got.tokens == want[i] ? "" : " (wrong tokens)"));
        }
        ++completed;
      }
    });
  }
  // Waits until `more` requests beyond now have completed.
  auto load_runs = [&](int more) {
    const int target = completed + more;
    return WaitFor([&] { return completed >= target; }, absl::Seconds(120));
  };
  EXPECT_TRUE(load_runs(8));
  // Requests the decode workers held when their drains began.
  int held_at_drain = 0;
  for (const std::string name : {"prefill-0", "prefill-1", "decode-0", "decode-1"}) {
    SCOPED_TRACE(name);
    const std::string command = cluster.PinnedCommandLine(name);
    ASSERT_FALSE(command.empty());
    const pid_t pid = cluster.Pid(name);
    ASSERT_EQ(::kill(pid, SIGTERM), 0);
    const absl::StatusOr<int> exit = WaitForExit(pid, absl::Seconds(90));
    ASSERT_TRUE(exit.ok()) << exit.status();
    EXPECT_EQ(*exit, 0);
    EXPECT_TRUE(absl::StrContains(cluster.Log(name), "drain over")) << cluster.Log(name);
    if (absl::StartsWith(name, "decode")) {
      held_at_drain += std::max(DrainedRequestsAtStart(cluster, name), 0);
    }
    ASSERT_TRUE(cluster.Relaunch(name, command).ok()) << cluster.Log("router");
    EXPECT_TRUE(load_runs(8)) << "no requests complete after restarting " << name;
  }
  stop = true;
  for (auto& c : clients) c.join();
  EXPECT_GT(completed, 40);
  EXPECT_GE(held_at_drain, 1) << "the decode workers drained with nothing to finish";
  {
    absl::MutexLock lock(&mu);
    EXPECT_TRUE(failures.empty()) << failures.size() << " of " << completed
                                  << " requests failed; first: " << failures[0];
  }
  // The drains did it, not the failover: no stream had to move.
  EXPECT_EQ(Migrations(cluster, "continued"), 0);
  EXPECT_EQ(Migrations(cluster, "limit_spent"), 0);
  ExpectKvAllFree(cluster, "decode-0");
  ExpectKvAllFree(cluster, "decode-1");
}

}  // namespace
}  // namespace pdserve
