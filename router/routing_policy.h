// RoutingPolicy: where one request runs — which decode worker holds its KV
// and decodes it, and which prefill worker computes its prompt, or none:
// the decode worker prefills it itself ("local prefill", conditional
// disaggregation). Chosen by name from a registry (CreateRoutingPolicy),
// the name and thresholds from the cluster config's `routing`
// (cluster_config.proto RoutingConfig):
//
//   round_robin   decode and prefill workers each in turn; always
//                 disaggregated when a prefill worker is up. Ignores load
//                 and cache.
//   least_loaded  the decode worker with the most free KV blocks (ties: the
//                 fewest running + waiting), the prefill worker with the
//                 fewest pending prompt tokens (ties likewise); always
//                 disaggregated when a prefill worker is up. Ignores the
//                 cache. (What WorkerRegistry::PickDecode/PickPrefill do.)
//   kv_aware      (default) the cost model below.
//
// kv_aware estimates each option's time to first token in prompt-token
// equivalents (the time a prefill worker takes to compute one prompt
// token), from the workers' last load reports plus what the router sent
// them since, and the prefix blocks the KV index says each holds:
//
//   uncached(W)     = prompt tokens - tokens of the leading prompt blocks W
//                     holds (never the block of the last token)
//   decode_load(D)  = decode_request_cost_tokens * (running + waiting +
//                     requests sent since the report)
//   pair (P, D)     = P's pending prompt tokens (queue)      + uncached(P)
//                     + block_move_cost_tokens * (prompt blocks D lacks)
//                     + decode_load(D)
//   local on D      = D's pending prompt tokens + uncached(D) + decode_load(D)
//
// A decode worker is feasible when its free blocks (less those reserved
// since its report) cover prompt + max_tokens less the blocks it shares.
// Among feasible decode workers:
//   1. a D whose uncached part is at most local_prefill_max_tokens prefills
//      locally (the cheapest such D): a short computation beats a transfer;
//   2. else the cheapest of the pairs (P, D) and — only when the prefill
//      workers are the bottleneck, every one with more than
//      prefill_queue_limit_tokens pending, and D has no request waiting —
//      local prefill on D.
// No feasible D: the one with the most free blocks, paired as in 2 (its
// Reserve will answer RESOURCE_EXHAUSTED and the caller tries another).
// No prefill worker: local prefill on the cheapest D. Ties rotate.
//
// Thread-safety: Choose may be called from any thread concurrently.
#ifndef PDSERVE_ROUTER_ROUTING_POLICY_H_
#define PDSERVE_ROUTER_ROUTING_POLICY_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "pdserve/internal/v1/cluster_config.pb.h"

namespace pdserve {

// One healthy, compatible worker a request may go to, as the router sees it.
struct WorkerLoad {
  std::string id;
  // From its last LoadReport.
  int64_t free_blocks = 0;
  int64_t running = 0;
  int64_t waiting = 0;
  int64_t pending_prompt_tokens = 0;
  // Sent by the router since that report (WorkerRegistry::NoteDispatched):
  // prompt tokens (prefill) or reserved tokens (decode), KV blocks
  // reserved (decode), requests.
  int64_t dispatched_tokens = 0;
  int64_t dispatched_blocks = 0;
  int64_t dispatched_requests = 0;
  // Leading blocks of the prompt's hash chain its prefix cache holds
  // (KvIndex::LeadingBlocks).
  int32_t cached_blocks = 0;
};

struct RoutingInput {
  int32_t prompt_tokens = 0;
  int32_t max_tokens = 0;
  int32_t block_size = 16;
  std::span<const WorkerLoad> decode;
  std::span<const WorkerLoad> prefill;
};

struct RoutingChoice {
  // Index into RoutingInput::decode; -1 when it is empty.
  int decode = -1;
  // Index into RoutingInput::prefill; -1: the decode worker prefills.
  int prefill = -1;
};

// The routing section of the cluster config with its defaults applied.
struct RoutingOptions {
  // Default: "kv_aware".
  std::string policy = "kv_aware";
  // kv_aware: a decode worker prefills a prompt itself when at most this
  // many of its tokens are not in its prefix cache. Default: 64, measured
  // by pd-prefix-bench (docs/benchmarks.md, "KV-aware routing"): against 0
  // it cut TTFT p50 by a third and p90 by a sixth; 256 cut p50 further
  // (p90 the same in the quieter of two runs) but put 6x the prompt tokens
  // on the decode workers, whose cost to running decodes that bench does
  // not measure.
  int64_t local_prefill_max_tokens = 64;
  // kv_aware: prefill workers with more prompt tokens than this pending,
  // every one of them, are the bottleneck; decode workers with room then
  // prefill locally when that is cheaper. Default: 4096 (eight steps of
  // the default 512-token batch). Measured (docs/capacity_planning.md,
  // run 5): lower limits cost TPOT on ordinary bursts; against never, 4096
  // cut TTFT p90 by 20-35% and raised TPOT p90 from ~1.5 to 13-25 ms.
  int64_t prefill_queue_limit_tokens = 4096;
  // kv_aware: the cost of moving one KV block from P to D, in prompt-token
  // equivalents (most of a transfer overlaps the forward pass). Default: 1.
  double block_move_cost_tokens = 1.0;
  // kv_aware: the cost of each request in D's batch. Default: 8.
  double decode_request_cost_tokens = 8.0;
};

class RoutingPolicy {
 public:
  virtual ~RoutingPolicy() = default;
  virtual const std::string& name() const = 0;
  virtual RoutingChoice Choose(const RoutingInput& input) = 0;
};

// The names CreateRoutingPolicy knows, sorted.
std::vector<std::string> RoutingPolicyNames();

// NOT_FOUND for an unknown policy name; INVALID_ARGUMENT for a negative
// threshold or cost.
absl::StatusOr<std::unique_ptr<RoutingPolicy>> CreateRoutingPolicy(
    const RoutingOptions& options);

// The options a config's `routing` section gives (defaults for what it
// leaves unset). Checks what CreateRoutingPolicy checks, INVALID_ARGUMENT.
absl::StatusOr<RoutingOptions> RoutingOptionsFromConfig(
    const internal::v1::RoutingConfig& config);

}  // namespace pdserve

#endif  // PDSERVE_ROUTER_ROUTING_POLICY_H_
