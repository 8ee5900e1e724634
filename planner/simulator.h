// Simulator: a discrete-event model of a pdserve cluster — the router (its
// real RoutingPolicy, router/routing_policy.h, fed load reports every
// poll_interval_s plus what it dispatched since, and its KV-capacity
// admission queue, router/orchestrator.h), x prefill workers and y decode
// workers, each a Generator (continuous batching, chunked prefill up to
// max_batch_tokens, max_running, KV blocks reserved for prompt + max_tokens
// at admission, prefix cache with LRU reuse of freed blocks) whose steps
// cost Profile::step — running a Workload. x = 0 is the colocated cluster:
// decode workers prefill locally.
//
// Disaggregated requests: the router reserves prompt + output blocks on D,
// the prefill worker computes the prompt (its blocks held until pushed),
// each chunk's KV is pushed over the transport as the chunk computes (the
// layer-wise push: only what is left after the forward pass adds to the
// first token), the first token goes to the client, then D adds the request
// to its batch once the KV has landed. Output: one RequestRecord per
// request, as pd-bench would have recorded it, so planner/summary.h
// summarises both the same way.
//
// Deterministic: the same inputs give the same records. Cost: a few
// microseconds per simulated step (an hour of the Mooncake conversation
// trace simulates in seconds).
// Thread-safety: Simulate is a pure function.
#ifndef PDSERVE_PLANNER_SIMULATOR_H_
#define PDSERVE_PLANNER_SIMULATOR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/profile.h"
#include "planner/summary.h"
#include "planner/workload.h"
#include "router/routing_policy.h"

namespace pdserve::planner {

struct ClusterShape {
  // 0: colocated. Default: 1.
  int32_t prefill = 1;
  // Default: 1.
  int32_t decode = 1;
  // The router's routing section (docs/routing.md). Default: kv_aware.
  RoutingOptions routing;
  // Which of Profile::transfers the KV moves over. Default: "tcp".
  std::string transport = "tcp";

  // "2P3D", "0P2D" (colocated).
  std::string Name() const;
};

struct SimulationOptions {
  // > 0: closed loop with this many requests in flight, arrival times
  // ignored; 0: open loop at the workload's arrival times. Default: 0.
  int32_t concurrency = 0;
  // Requests the router queues for KV capacity before refusing with
  // RESOURCE_EXHAUSTED (router --max_queued). Default: 4096.
  int32_t max_queued = 4096;
};

// INVALID_ARGUMENT for a shape with no decode worker or an unknown
// transport. A request larger than a decode worker's pool, or refused by a
// full queue, is recorded with outcome RESOURCE_EXHAUSTED, as the router
// answers it.
absl::StatusOr<std::vector<RequestRecord>> Simulate(const Profile& profile,
                                                    const ClusterShape& shape,
                                                    const Workload& workload,
                                                    const SimulationOptions& options = {});

}  // namespace pdserve::planner

#endif  // PDSERVE_PLANNER_SIMULATOR_H_
