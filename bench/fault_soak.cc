// pd-fault-soak: a real 2P3D cluster (deploy/local/cluster.sh) under mixed
// load for --duration, hit by a fault every --fault_every: kill -9 of a
// prefill or a decode worker (restarted 2 s later on its port), SIGSTOP
// and SIGCONT 3 s later of either, or a router restart, in turn. Prints a
// progress line every 10 s and, at the end, the requests completed (equal
// to the fault-free run or not), migrated (the router's
// pdserve_router_migrations_total, summed over router restarts), failed by
// status code (clients retry UNAVAILABLE for up to 30 s, as they must
// across a router restart; retries are counted), and the KV blocks the decode
// workers still hold (must be 0), with the fault matrix row of tests/fault. Run
// from the build tree.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <iostream>
#include <random>
#include <set>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "tests/cluster/local_cluster.h"
#include "tests/fault/fault_harness.h"

ABSL_FLAG(absl::Duration, duration, absl::Minutes(30),
          "How long the load runs");
ABSL_FLAG(absl::Duration, fault_every, absl::Seconds(20),
          "Time between faults");
ABSL_FLAG(int32_t, streams, 16, "Concurrent streams");
ABSL_FLAG(uint32_t, seed, 1, "Seed of the load and of the fault victims");

namespace pdserve::fault {
namespace {

constexpr int kPrefill = 2;
constexpr int kDecode = 3;

// The router's migrations so far; -1 when it does not count them (a build
// without migration).
int RouterMigrations(testing_util::LocalCluster& cluster) {
  absl::StatusOr<std::string> metrics =
      testing_util::HttpGet(cluster.MetricsPort("router"), "/metrics");
  const double migrations =
      metrics.ok() ? MetricSum(*metrics, "pdserve_router_migrations_total")
                   : -1;
  return migrations < 0 ? -1 : static_cast<int>(migrations);
}

int Run() {
  const absl::Duration duration = absl::GetFlag(FLAGS_duration);
  const absl::Duration fault_every = absl::GetFlag(FLAGS_fault_every);
  const int streams = absl::GetFlag(FLAGS_streams);
  if (duration <= absl::ZeroDuration() || fault_every <= absl::Seconds(5) ||
      streams < 1) {
    std::cerr << "pd-fault-soak: --duration must be positive, --fault_every "
                 "above 5 s, --streams at least 1\n";
    return 2;
  }
  std::mt19937 random(absl::GetFlag(FLAGS_seed));
  const std::vector<StreamCase> pool = MixedLoad(64, absl::GetFlag(FLAGS_seed));
  absl::StatusOr<std::vector<std::vector<int32_t>>> pool_reference =
      ReferenceOutputs(pool);
  if (!pool_reference.ok()) {
    std::cerr << "pd-fault-soak: reference run: " << pool_reference.status()
              << "\n";
    return 1;
  }

  testing_util::ClusterSpec spec{.prefill = kPrefill, .decode = kDecode};
  // A restarted router leaves the reservations it made behind; the decode
  // workers free them after this timeout (default 60 s), which the final
  // check waits out.
  spec.decode_args += " --reservation_timeout_ms=10000";
  auto started = testing_util::LocalCluster::Start(spec);
  if (!started.ok()) {
    std::cerr << "pd-fault-soak: " << started.status() << "\n";
    return 1;
  }
  testing_util::LocalCluster& cluster = **started;
  std::cout << "pd-fault-soak: " << kPrefill << "P" << kDecode
            << "D builtin:tiny, " << streams
            << " concurrent streams, a fault every "
            << absl::FormatDuration(fault_every) << " for "
            << absl::FormatDuration(duration) << std::endl;

  ScenarioTally tally;
  tally.scenario =
      absl::StrCat("soak ", absl::FormatDuration(duration), ", a fault every ",
                   absl::FormatDuration(fault_every));
  absl::Mutex tally_mu;
  int migrations_before_restarts =
      -1;  // Counted by routers since restarted (-1: none counts).
  std::atomic<int> faults = 0;
  const absl::Time end = absl::Now() + duration;

  // The faults, in turn, each on a random victim of its kind.
  std::thread faulter([&] {
    const std::vector<std::string> kinds = {"kill prefill", "kill decode",
                                            "stop decode", "stop prefill",
                                            "restart router"};
    for (size_t turn = 0; absl::Now() + fault_every < end; ++turn) {
      absl::SleepFor(fault_every);
      const std::string& kind = kinds[turn % kinds.size()];
      const bool prefill = kind.ends_with("prefill");
      const std::string victim =
          kind == "restart router"
              ? "router"
              : absl::StrCat(prefill ? "prefill-" : "decode-",
                             random() % (prefill ? kPrefill : kDecode));
      absl::Status status;
      if (kind.starts_with("kill")) {
        status = cluster.Restart(victim, absl::Seconds(2));
      } else if (kind.starts_with("stop")) {
        ::kill(cluster.Pid(victim), SIGSTOP);
        absl::SleepFor(absl::Seconds(3));
        ::kill(cluster.Pid(victim), SIGCONT);
      } else {
        if (const int counted = RouterMigrations(cluster); counted >= 0) {
          migrations_before_restarts =
              std::max(migrations_before_restarts, 0) + counted;
        }
        status = cluster.Restart(victim);
      }
      ++faults;
      std::cout << absl::StrFormat(
                       "  fault %d: %s %s%s", faults.load(), kind, victim,
                       status.ok() ? ""
                                   : absl::StrCat(" (", status.message(), ")"))
                << std::endl;
    }
  });

  // Waves of `streams` concurrent requests drawn from the pool.
  std::thread progress([&] {
    while (absl::Now() < end) {
      absl::SleepFor(std::min(absl::Seconds(10), end - absl::Now()));
      absl::MutexLock lock(&tally_mu);
      int failed = 0;
      for (const auto& [code, count] : tally.failed_by_code) failed += count;
      std::cout << absl::StrFormat(
                       "[%5.0f s] requests %d: completed %d (different %d), "
                       "failed %d, retried %d; "
                       "faults %d",
                       absl::ToDoubleSeconds(duration - (end - absl::Now())),
                       tally.streams,
                       tally.completed_equal + tally.completed_different,
                       tally.completed_different, failed, tally.retried,
                       faults.load())
                << std::endl;
    }
  });
  std::mt19937 pick(absl::GetFlag(FLAGS_seed) + 1);
  while (absl::Now() < end) {
    std::vector<StreamCase> wave;
    std::vector<std::vector<int32_t>> wave_reference;
    for (int i = 0; i < streams; ++i) {
      const size_t k = pick() % pool.size();
      wave.push_back(pool[k]);
      wave_reference.push_back((*pool_reference)[k]);
    }
    // Clients retry UNAVAILABLE, as they must across a router restart;
    // the retries are counted.
    LoadRun load(cluster.router(), wave, {.retry_unavailable = true});
    const std::vector<StreamOutcome>& outcomes = load.Join();
    absl::MutexLock lock(&tally_mu);
    JudgeStreams(wave_reference, outcomes, tally);
  }
  faulter.join();
  progress.join();

  CheckProcesses(Processes(cluster, kPrefill, kDecode), {}, tally,
                 absl::Seconds(20));
  const int migrations_now = RouterMigrations(cluster);
  tally.migrations =
      migrations_now < 0
          ? migrations_before_restarts
          : std::max(migrations_before_restarts, 0) + migrations_now;
  tally.faults = faults.load();
  int failed = 0;
  for (const auto& [code, count] : tally.failed_by_code) failed += count;
  std::cout << "\nrequests: " << tally.streams << "; completed "
            << tally.completed_equal << " equal to the fault-free run, "
            << tally.completed_different << " different; migrated "
            << (tally.migrations < 0
                    ? "n/a (the router has no pdserve_router_migrations_total)"
                    : absl::StrCat(tally.migrations))
            << "; failed " << failed << "; retried after UNAVAILABLE "
            << tally.retried << "; faults " << faults.load()
            << "; blocks leaked " << tally.leaked_blocks << "\n\n"
            << FormatMatrix({tally});
  if (!tally.problems.empty()) {
    // Failures by a clear status are outcomes; these are broken expectations.
    std::cout << "\nproblems:\n  " << absl::StrJoin(tally.problems, "\n  ")
              << "\n";
  }
  return tally.leaked_blocks == 0 && tally.completed_different == 0 ? 0 : 1;
}

}  // namespace
}  // namespace pdserve::fault

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return pdserve::fault::Run();
}
