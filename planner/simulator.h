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
// summarises both the same way, and the engines' summed step times.
//
// Timeline of one request (t: when its last prompt chunk's step ends):
//   colocated    first token t + colocated_first_token_s;
//   disaggregated
//                the push of each step's KV (its uncached tokens *
//                kv_bytes_per_token bytes, over the prefill worker's one
//                link at bytes_per_s, behind earlier pushes) ends no
//                earlier than the step; the KV has landed latency_s after
//                the last push ends (L); first token L +
//                disaggregated_first_token_s, the prefill worker's blocks
//                free at L, the request joins D's queue at L;
//   later tokens the end of their decode step + token_delivery_s
//                (disaggregated: + disaggregated_token_delivery_s);
//   serving CPU  a prefill worker's serving threads take engine time from its
//                CPU share. The push lane sends a step's KV while the step
//                computes, so the step takes prefill_cpu_per_kv_byte_s for
//                each byte it pushes on top of its own cost. The gRPC
//                threads take prefill_cpu_per_request_s at each Prefill: the
//                worker's next step takes that on top of its own, less what
//                the engine's idle time since has left to the threads;
//   step cost    a worker's step costs the step model's time times its
//                role's Profile::prefill_engine_scale, or on a decode
//                worker decode_engine_scale for a step that computes prompt
//                tokens and decode_batch_scale for one that only decodes
//                (its engine's CPU over the model's, measured on serving
//                workers: busy with long prompts, or, for decode batches,
//                under closed-loop streams);
//   the stream is in order (no token before the one before it), and the
//   router's ledger frees the request's blocks when its last token arrives.
//
// The engine's policy is the real one: planner/sim/simulated_generator.h
// follows engine/generator.cc step by step on the real KvBlockPool (a test
// checks it against the real Generator), and the routing is the router's
// own RoutingPolicy. What the model leaves out or simplifies:
//   - Step cost is the fitted linear model, whatever the batch's shape
//     beyond its terms; no noise. A serving worker's engine is calibrated
//     by constant factors, measured at one load each (a prefill worker's
//     and a colocated decode worker's on long prompts, a disaggregated
//     decode worker's decode batches on closed-loop streams), whatever its
//     neighbours do then. No other interference
//     between workers sharing a machine (CPU cores, caches, memory
//     bandwidth).
//   - The fixed serving costs (Profile's *_s fields) are constants added
//     at the end; the RPCs that carry a request to a worker take no time
//     (Reserve, Prefill, Decode reach their worker at once), and neither
//     does the router (tokenizing, admission) nor its one thread per
//     request.
//   - The push is a fluid: bytes leave as fast as the link goes from the
//     step's start, done no earlier than the step's end (the last layer's
//     share of a step after the forward pass is neglected); one link per
//     prefill worker, whichever decode worker it feeds; no per-message
//     cost but latency_s once per request.
//   - Load reports are instant snapshots at each poll (all workers at once)
//     rather than the state after the worker's last engine-loop iteration;
//     the KV index applies every prefix-cache event at each poll (no
//     bound on a report's events, no lost deltas).
//   - No faults, retries, migrations, cancellations, deadlines, stop
//     sequences or EOS (every request generates its output_tokens), no
//     n > 1, priorities, prompt logprobs; one router.
//   - Every decode worker has the same pool (decode_kv_blocks), every
//     prefill worker the same (prefill_kv_blocks); one Profile for both
//     roles (same engine options and step cost).
//   - A prompt larger than the prefill pool fails UNAVAILABLE at once (the
//     real router learns it from each prefill worker in turn).
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

struct Simulation {
  // One per workload request, in its order.
  std::vector<RequestRecord> records;
  // The engine steps' times summed over the prefill workers and over the
  // decode workers (colocated ones included): the step cost, plus a
  // prefill step's push CPU; not the streaming overheads or the serving
  // threads' CPU that a simulated step also waits for. That is what the
  // workers' step-time histograms add up to (pdserve_prefill_batch_seconds,
  // pdserve_decode_step_seconds: the forward pass alone), so a run's
  // measured sums tell how far the step model held during it.
  double prefill_step_s = 0;
  double decode_step_s = 0;
  // The decode workers' steps and the sequences in them, summed over the
  // steps (pdserve_decode_batch_size's count and sum): their mean batch.
  int64_t decode_steps = 0;
  int64_t decode_step_sequences = 0;
  // The decode workers' time outside the forward pass, summed over the
  // steps that followed one without idling: each one's streaming overheads
  // and the serving threads' CPU it waited for. The model's counterpart of
  // pdserve_decode_step_gap_seconds (the time between back-to-back steps).
  double decode_gap_s = 0;
  // Requests the router had a decode worker prefill (all of them when
  // colocated): where a routing threshold (kv_aware's
  // prefill_queue_limit_tokens) tips one way or the other.
  int64_t decode_prefills = 0;
};

// INVALID_ARGUMENT for a bad profile (ValidateProfile), a shape with no
// decode worker, an unknown transport (when there is a prefill worker) or
// routing policy, a workload request with no prompt or output token, or (open
// loop) a negative arrival time. A request larger than a decode worker's
// pool, or refused by a full queue, is recorded with outcome
// RESOURCE_EXHAUSTED, as the router answers it; one beyond max_context
// (when set) INVALID_ARGUMENT. A workload request with fewer block_ids than
// its prompt needs has the rest of its prompt to itself (shares nothing).
absl::StatusOr<Simulation> Simulate(const Profile& profile, const ClusterShape& shape,
                                    const Workload& workload,
                                    const SimulationOptions& options = {});

}  // namespace pdserve::planner

#endif  // PDSERVE_PLANNER_SIMULATOR_H_
