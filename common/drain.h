// Draining: how a pdserve worker process ends gracefully (docs/router.md,
// "Drain").
//
// On the first SIGTERM or SIGINT a worker's main() runs
//
//   StartDrain      the worker refuses new work from now on (UNAVAILABLE
//                   whose message says "draining": DrainingError) and
//                   says `draining` in its LoadReport, so that routers
//                   stop choosing it at their next poll; a router that
//                   sent work before it saw the report gets the refusal
//                   and places the work elsewhere (IsDrainingRefusal);
//   (deregister)    the main's hook for dynamic discovery (revoking an
//                   etcd lease); nothing with a static cluster config;
//   AwaitDrain      waits until the requests the worker holds are done
//                   and a load report saying `draining` went out (so the
//                   router polling it sends no more work, rather than
//                   finding it gone; waited for at most 2 s, routers poll
//                   every 100 ms), or the drain timeout passes, or a
//                   second SIGTERM or SIGINT comes (then at once);
// and then shuts its server down and exits 0. Requests still running at
// the deadline end with the process: the router migrates their streams to
// another decode worker (router/orchestrator.h, "Migration"), which is how
// "migrate after the deadline" works.
//
// Thread-safety: DrainingError and IsDrainingRefusal from any thread;
// StartDrain and AwaitDrain from main() only (AwaitDrain takes termination
// signals, which BlockTerminationSignals must have blocked).
#ifndef PDSERVE_COMMON_DRAIN_H_
#define PDSERVE_COMMON_DRAIN_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/metrics.h"

namespace pdserve {

// What a worker offers the drain. Implementations are thread-safe.
class DrainableWorker {
 public:
  virtual ~DrainableWorker() = default;
  // From now on new work is refused with DrainingError. Idempotent.
  virtual void StartDraining() = 0;
  virtual bool draining() const = 0;
  // The requests the worker holds and still serves: 0 once it is idle. May
  // block briefly (the engine loop is asked).
  virtual int64_t RequestsInFlight() = 0;
  // A LoadReport saying `draining` was answered.
  virtual bool drain_reported() const = 0;
};

// The refusal of new work by a draining `role` worker ("decode",
// "prefill"): UNAVAILABLE, the message containing "worker is draining".
absl::Status DrainingError(absl::string_view role);

// Whether `status` is a worker's DrainingError (after any number of
// annotations of the message): the worker is healthy but takes no new
// work, so the caller places the work elsewhere.
bool IsDrainingRefusal(const absl::Status& status);

// Adds the gauge pdserve_worker_draining (1 while draining, else 0) to
// `registry`, read from `worker` at each scrape (it must outlive them).
void AddDrainingGauge(MetricsRegistry* registry, const DrainableWorker* worker);

// Where a drain stands (StartDrain's answer, AwaitDrain's argument).
struct DrainProgress {
  std::string program;
  absl::Time started;
  absl::Time deadline;
  // RequestsInFlight() when the drain started.
  int64_t in_flight_at_start = 0;
};

// Puts `worker` into draining and logs it, as `program`, with the requests
// in flight and the deadline `timeout` from now.
DrainProgress StartDrain(const std::string& program, DrainableWorker& worker,
                         absl::Duration timeout);

// Waits until `worker` holds no request and has reported that it drains
// (or 2 s passed since the start), the drain's deadline passes, or a
// second SIGTERM/SIGINT arrives; logs how many requests finished and how
// many were left. Returns the requests left (0: drained). A SIGHUP meanwhile
// runs `on_reload` (when set), as before the drain.
int64_t AwaitDrain(DrainableWorker& worker, const DrainProgress& progress,
                   const std::function<void()>& on_reload = {});

}  // namespace pdserve

#endif  // PDSERVE_COMMON_DRAIN_H_
