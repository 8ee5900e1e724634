// RouterMetrics: what pd-router counts about the requests it serves, on
// both front ends (gRPC and HTTP), and how it routes them; the router's one
// metrics object, exposed as Prometheus text at GET /metrics. Names follow
// DESIGN.md's "Observability": pdserve_router_*, base units, _total for
// counters, _seconds for durations (docs/metrics.md lists every one).
//
// Thread-safety: every method from any thread. Recording is relaxed atomic
// adds on series created in advance: the per-worker routing counters for
// the configured worker ids, the retry kinds, migration outcomes and
// rejection reasons listed
// below. Only a label value seen for the first time (a worker id not in the
// configuration, an outcome's first request) takes a short lock; nothing
// allocates per token.
#ifndef PDSERVE_ROUTER_ROUTER_METRICS_H_
#define PDSERVE_ROUTER_ROUTER_METRICS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/metrics.h"
#include "pdserve/v1/generation.pb.h"

namespace pdserve {

class RouterMetrics {
 public:
  // Series labelled by worker are created for these ids up front, so a
  // worker never routed to still shows 0. Defaults: none.
  struct Options {
    std::vector<std::string> prefill_workers;
    std::vector<std::string> decode_workers;
  };

  RouterMetrics() : RouterMetrics(Options()) {}
  explicit RouterMetrics(const Options& options);

  // One finished Generate request (or HTTP generation request). `api` is
  // "grpc" or "http"; `outcome` "ok" or the lower-case status code name
  // ("invalid_argument", "resource_exhausted", ...). `ttft` is unset
  // (zero) when no token was sent.
  void RequestFinished(absl::string_view api, absl::string_view outcome,
                       uint64_t prompt_tokens, uint64_t completion_tokens,
                       absl::Duration ttft, absl::Duration total);
  // One choice ended with `reason` (its last message's finish_reason).
  void ChoiceFinished(v1::FinishReason reason);
  // The gap between two token-bearing messages of one choice, divided by
  // the tokens in the later one (RequestRecord::Sent).
  void InterTokenLatency(absl::Duration per_token);

  // For the orchestrator:
  // A request's prefill (`role` "prefill") or decode ("decode") was sent to
  // worker `worker_id`; one call per attempt.
  void Routed(absl::string_view role, absl::string_view worker_id);
  // The chosen worker's prefix cache held `cached_tokens` of the request's
  // `prompt_tokens`, as the routing decision estimated it.
  void PrefixMatched(uint64_t prompt_tokens, uint64_t cached_tokens);
  // A retry of `kind`: "prefill" (another prefill worker), "decode"
  // (another decode worker, the first one full).
  void Retried(absl::string_view kind);
  // A choice that lost its decode worker (failed or stalled), by
  // `outcome`: "continued" (placed on another one), "limit_spent",
  // "no_worker" (ended UNAVAILABLE), "abandoned" (its client left first).
  void Migrated(absl::string_view outcome);
  // A request refused at admission, for `reason`: "queue_full",
  // "too_large", "stopping".
  void Rejected(absl::string_view reason);
  // Time a request waited for a router thread.
  void QueueTime(absl::Duration waited);

  // Where the router adds its callback gauges (requests running, ...).
  MetricsRegistry& registry() { return registry_; }
  // The Prometheus text exposition (format 0.0.4).
  std::string Exposition() const { return registry_.Exposition(); }

 private:
  using CounterMap = absl::flat_hash_map<std::string, Counter*>;
  // The counter in `known` (fixed after construction, read without a
  // lock), else the family's child (a lock).
  static Counter* Find(const CounterMap& known, CounterFamily* family,
                       std::vector<std::string> labels,
                       absl::string_view key);

  MetricsRegistry registry_;
  CounterFamily* const requests_;
  CounterFamily* const finished_choices_;
  Counter* const prompt_tokens_;
  Counter* const generation_tokens_;
  Histogram* const ttft_;
  Histogram* const itl_;
  Histogram* const tpot_;
  Histogram* const e2e_;
  Histogram* const queue_time_;
  CounterFamily* const routed_;
  Counter* const prefix_prompt_tokens_;
  Counter* const prefix_cached_tokens_;
  CounterFamily* const retries_;
  CounterFamily* const migrations_;
  CounterFamily* const rejected_;
  // Pre-created series, by worker id / kind / reason; const after
  // construction.
  CounterMap routed_prefill_;
  CounterMap routed_decode_;
  CounterMap retries_by_kind_;
  CounterMap migrations_by_outcome_;
  CounterMap rejected_by_reason_;
  Counter* finish_stop_ = nullptr;
  Counter* finish_length_ = nullptr;
};

// "ok", or the status code's name in lower case ("resource_exhausted").
std::string OutcomeName(int absl_status_code);

// What one request contributes to the metrics, gathered from the messages
// it sends: the time of its first token, the gaps between tokens, each
// choice's finish reason and usage. The gRPC and the HTTP front end keep
// one per request.
// Thread-safety: none; its owner serializes the calls.
class RequestRecord {
 public:
  // `metrics` (not owned; must outlive the record) receives what is
  // recorded per message (inter-token latency, finish reasons) and the
  // request at its end.
  RequestRecord(absl::Time started, RouterMetrics& metrics)
      : started_(started), metrics_(metrics) {}

  absl::Time started() const { return started_; }

  // Notes a message sent to the client.
  void Sent(const v1::GenerateResponse& message);
  // Records the request, ended with `status`, as `api` ("grpc", "http").
  void Finish(absl::string_view api, const absl::Status& status) const;

 private:
  const absl::Time started_;
  RouterMetrics& metrics_;
  absl::Duration ttft_;  // Zero until a token was sent.
  uint64_t prompt_tokens_ = 0;
  uint64_t completion_tokens_ = 0;
  // When each choice (by index) last sent tokens; InfinitePast before.
  std::vector<absl::Time> last_token_;
};

}  // namespace pdserve

#endif  // PDSERVE_ROUTER_ROUTER_METRICS_H_
