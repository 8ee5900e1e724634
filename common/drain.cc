#include "common/drain.h"

#include <algorithm>
#include <functional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/process.h"

namespace pdserve {

namespace {

// What every DrainingError says and IsDrainingRefusal looks for.
constexpr absl::string_view kDraining = "worker is draining";

// How often AwaitDrain looks whether the worker is idle.
constexpr absl::Duration kDrainCheckInterval = absl::Milliseconds(50);
// How long an idle worker waits for a router to read that it drains: ten
// of the routers' default poll intervals, twice their load timeout.
constexpr absl::Duration kDrainReportWait = absl::Seconds(2);

}  // namespace

absl::Status DrainingError(absl::string_view role) {
  return absl::UnavailableError(absl::StrCat(
      "the ", role, " ", kDraining,
      " (shutting down gracefully) and takes no new work; place it on "
      "another worker"));
}

bool IsDrainingRefusal(const absl::Status& status) {
  return absl::IsUnavailable(status) &&
         absl::StrContains(status.message(), kDraining);
}

void AddDrainingGauge(MetricsRegistry* registry,
                      const DrainableWorker* worker) {
  registry->AddCallbackGauge(
      "pdserve_worker_draining",
      "1 while the worker drains (after SIGTERM/SIGINT: it refuses new work "
      "and finishes what it holds before exiting), else 0.",
      [worker] { return worker->draining() ? 1.0 : 0.0; });
}

DrainProgress StartDrain(const std::string& program, DrainableWorker& worker,
                         absl::Duration timeout) {
  worker.StartDraining();
  DrainProgress progress{.program = program,
                         .started = absl::Now(),
                         .deadline = absl::Now() + timeout};
  progress.in_flight_at_start = worker.RequestsInFlight();
  PD_LOG(INFO) << program << ": draining: refusing new work, "
               << progress.in_flight_at_start
               << " request(s) in flight, exiting when they are done or in "
               << absl::FormatDuration(timeout)
               << " (a second SIGTERM/SIGINT exits at once)";
  return progress;
}

int64_t AwaitDrain(DrainableWorker& worker, const DrainProgress& progress,
                   const std::function<void()>& on_reload) {
  int64_t left = worker.RequestsInFlight();
  const char* why = "idle";
  auto done = [&] {
    return left == 0 &&
           (worker.drain_reported() ||
            absl::Now() >= progress.started + kDrainReportWait);
  };
  while (!done()) {
    const absl::Time now = absl::Now();
    if (now >= progress.deadline) {
      why = "the drain timeout passed";
      break;
    }
    if (const int signal = WaitForTerminationSignalFor(
            std::min(kDrainCheckInterval, progress.deadline - now), on_reload);
        signal != 0) {
      PD_LOG(WARNING) << progress.program << ": signal " << signal
                      << " during the drain: exiting at once";
      why = "a second signal came";
      break;
    }
    left = worker.RequestsInFlight();
  }
  PD_LOG(INFO) << progress.program << ": drain over after "
               << absl::FormatDuration(absl::Now() - progress.started) << " ("
               << why << "): "
               << std::max<int64_t>(progress.in_flight_at_start - left, 0)
               << " request(s) finished, " << left << " left"
               << (left > 0 ? " (they end with the process; the router "
                              "migrates their streams)"
                            : "");
  return left;
}

}  // namespace pdserve
