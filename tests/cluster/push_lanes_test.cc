// A stalled decode worker delays only its own requests' KV (issue 15): in a
// 1P2D cluster, with decode-0 frozen (SIGSTOP) while the prefill worker
// has pushes to it in flight, requests placed on decode-1 keep their time
// to first token within 20% of the unfrozen cluster's. With one pusher
// thread for every destination they waited for the frozen worker's writes
// to time out.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/cluster/local_cluster.h"
#include "tests/engine/test_util.h"

namespace pdserve {
namespace {

namespace v1 = ::pdserve::v1;
using testing_util::ClusterSpec;
using testing_util::LocalCluster;
using testing_util::RandomPrompt;

constexpr int kPromptTokens = 300;
// Long enough that no push to the frozen worker times out during a round
// (a few seconds frozen), so its writes stay in flight the whole time.
constexpr int kTransferTimeoutMs = 20000;

struct Timed {
  grpc::Status status;
  // From the call to its first token; InfiniteDuration when none came.
  absl::Duration ttft = absl::InfiniteDuration();
  absl::Time first_token = absl::InfiniteFuture();
};

// One Generate stream of a fresh 300-token prompt, to its end; counts its
// first token in `*first_tokens` when given.
Timed Generate(v1::Generation::Stub& router, uint32_t seed,
               std::atomic<int>* first_tokens = nullptr) {
  const std::vector<int32_t> prompt = RandomPrompt(kPromptTokens, seed);
  v1::GenerateRequest request;
  request.mutable_token_ids()->mutable_ids()->Assign(prompt.begin(),
                                                     prompt.end());
  request.set_max_tokens(4);
  request.set_ignore_eos(true);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
  Timed out;
  const absl::Time start = absl::Now();
  auto reader = router.Generate(&context, request);
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
    if (response.token_ids().empty() || out.first_token != absl::InfiniteFuture())
      continue;
    out.first_token = absl::Now();
    out.ttft = out.first_token - start;
    if (first_tokens != nullptr) first_tokens->fetch_add(1);
  }
  out.status = reader->Finish();
  return out;
}

// Healthy decode workers, as the router sees them.
int HealthyDecodeWorkers(v1::Generation::Stub& router) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::HealthResponse health;
  if (!router.Health(&context, {}, &health).ok()) return -1;
  return static_cast<int>(health.decode_workers());
}

bool WaitForHealthyDecodeWorkers(v1::Generation::Stub& router, int want) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline) {
    if (HealthyDecodeWorkers(router) == want) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

// Prompt tokens queued or being computed on the prefill worker; -1 when it
// does not answer.
int64_t PendingPromptTokens(LocalCluster& cluster) {
  auto stub = cluster.PrefillStub("prefill-0");
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  internal::v1::LoadReport load;
  if (!stub->GetLoad(&context, {}, &load).ok()) return -1;
  return static_cast<int64_t>(load.pending_prompt_tokens());
}

// SIGSTOP, returning once the process is stopped (it is not our child, so
// /proc tells, not waitpid).
bool Freeze(pid_t pid) {
  if (::kill(pid, SIGSTOP) != 0) return false;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
    std::string id, name, state;
    stat >> id >> name >> state;  // The name of a pd- binary has no space.
    if (state == "T") return true;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return false;
}

// `count` requests arriving every `interval` whatever the answers (open
// loop, as clients do): a stall holds up every request that arrives during
// it, not only the next one.
std::vector<Timed> OpenLoop(v1::Generation::Stub& router, int count,
                            absl::Duration interval, uint32_t* seed) {
  std::vector<Timed> out(count);
  std::vector<std::thread> threads;
  const absl::Time start = absl::Now();
  for (int i = 0; i < count; ++i) {
    absl::SleepFor(start + interval * i - absl::Now());
    threads.emplace_back(
        [&, i, s = (*seed)++] { out[i] = Generate(router, s); });
  }
  for (auto& t : threads) t.join();
  return out;
}

absl::Duration Median(std::vector<absl::Duration> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

TEST(PushLanesTest, FrozenDecodeWorkerDelaysOnlyItsOwnRequests) {
  constexpr int kRounds = 4;
  constexpr int kMeasuredPerRound = 12;
  // Well above a request's time to first token (about 30 ms here), so the
  // measured requests do not queue behind each other.
  constexpr absl::Duration kArrivalInterval = absl::Milliseconds(150);
  // Started together before the freeze: round robin places half of them
  // on decode-0, whose pushes the freeze then stalls.
  constexpr int kInFlight = 6;
  ClusterSpec spec;
  spec.decode = 2;
  spec.prefill_args +=
      absl::StrCat(" --transfer_timeout_ms=", kTransferTimeoutMs);
  spec.routing = R"({"policy": "round_robin"})";
  auto started = LocalCluster::Start(spec);
  ASSERT_TRUE(started.ok()) << started.status();
  LocalCluster& cluster = **started;
  v1::Generation::Stub& router = cluster.router();
  const pid_t frozen = cluster.Pid("decode-0");
  uint32_t seed = 1;

  std::vector<absl::Duration> unfrozen, during;
  int stalled_in_flight = 0;
  for (int round = 0; round < kRounds; ++round) {
    // Unfrozen: requests alternating over both workers.
    for (const Timed& t :
         OpenLoop(router, kMeasuredPerRound, kArrivalInterval, &seed)) {
      ASSERT_TRUE(t.status.ok()) << t.status.error_message();
      unfrozen.push_back(t.ttft);
    }

    // Requests in flight on both decode workers; decode-0 freezes once
    // the first of them has its first token (the others are queued or
    // computing on the prefill worker, their KV not all pushed).
    std::vector<Timed> in_flight(kInFlight);
    std::atomic<int> first_tokens = 0;
    std::vector<std::thread> threads;
    for (int i = 0; i < kInFlight; ++i) {
      threads.emplace_back([&, i, s = seed++] {
        in_flight[i] = Generate(router, s, &first_tokens);
      });
    }
    const absl::Time wait_until = absl::Now() + absl::Seconds(30);
    while (first_tokens.load() == 0 && absl::Now() < wait_until)
      absl::SleepFor(absl::Microseconds(200));
    ASSERT_TRUE(Freeze(frozen));
    // From here on the router places requests on decode-1 only; the
    // prefill worker's queue drains (its pushes to decode-0 stay stuck).
    ASSERT_TRUE(WaitForHealthyDecodeWorkers(router, 1));
    const absl::Time drain_until = absl::Now() + absl::Seconds(30);
    while (PendingPromptTokens(cluster) != 0 && absl::Now() < drain_until)
      absl::SleepFor(absl::Milliseconds(5));

    for (const Timed& t :
         OpenLoop(router, kMeasuredPerRound, kArrivalInterval, &seed)) {
      // A failed request counts, with no first token, against the median.
      EXPECT_TRUE(t.status.ok()) << t.status.error_message();
      during.push_back(t.ttft);
    }
    const absl::Time thawed_at = absl::Now();
    ::kill(frozen, SIGCONT);
    for (auto& t : threads) t.join();
    // The requests on decode-0 got their first token only after it woke
    // (or failed): their pushes were stuck while the others were measured.
    for (const Timed& t : in_flight) {
      if (t.first_token > thawed_at) ++stalled_in_flight;
    }
    ASSERT_TRUE(WaitForHealthyDecodeWorkers(router, 2));
  }
  EXPECT_GT(stalled_in_flight, 0)
      << "no push to the frozen worker was in flight: the test proves nothing";
  const absl::Duration unfrozen_median = Median(unfrozen);
  const absl::Duration during_median = Median(during);
  std::cout << "TTFT median: unfrozen " << unfrozen_median
            << ", decode-0 frozen (requests on decode-1) " << during_median
            << "; requests stuck behind the freeze: " << stalled_in_flight
            << " of " << kRounds * kInFlight << "\n";
  RecordProperty("unfrozen_ttft_median_us",
                 static_cast<int>(absl::ToInt64Microseconds(unfrozen_median)));
  RecordProperty("frozen_ttft_median_us",
                 static_cast<int>(absl::ToInt64Microseconds(during_median)));
  EXPECT_LE(during_median, unfrozen_median * 1.2)
      << "unfrozen " << unfrozen_median << ", frozen " << during_median;
  if (HasFailure()) std::cout << "prefill-0 log:\n" << cluster.Log("prefill-0");
}

// Every cluster must give back every KV block it held, the frozen
// worker's included.
const bool kLeakCheck = [] {
  LocalCluster::on_kv_leak = [](const std::string& leak) {
    ADD_FAILURE() << "KV leak: " << leak;
  };
  return true;
}();

}  // namespace
}  // namespace pdserve
