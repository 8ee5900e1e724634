// RouterMetrics: what pd-router counts about the requests it serves, on
// both front ends (gRPC and HTTP), written as Prometheus text for
// GET /metrics. Names follow DESIGN.md's "Observability": pdserve_router_*,
// base units, _total for counters, _seconds for durations.
//
// Thread-safety: every method from any thread. Recording a request is a few
// relaxed atomic adds (and one short lock for its outcome label); nothing
// is recorded per token.
#ifndef PDSERVE_ROUTER_ROUTER_METRICS_H_
#define PDSERVE_ROUTER_ROUTER_METRICS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "pdserve/v1/generation.pb.h"

namespace pdserve {

// A latency histogram with fixed bucket bounds in seconds.
class LatencyHistogram {
 public:
  // Upper bounds, 1 ms to 5 min; the +Inf bucket is implicit.
  static constexpr std::array<double, 16> kBounds = {
      0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
      0.5,   1,      2.5,   5,    10,    30,   60,  300};

  void Observe(absl::Duration duration);
  // Appends the histogram's # HELP, # TYPE and sample lines.
  void Write(absl::string_view name, absl::string_view help,
             std::string* out) const;

 private:
  std::array<std::atomic<uint64_t>, kBounds.size() + 1> buckets_{};
  std::atomic<uint64_t> count_{0};
  std::atomic<uint64_t> sum_nanos_{0};
};

class RouterMetrics {
 public:
  // One finished Generate request (or HTTP generation request). `api` is
  // "grpc" or "http"; `outcome` "ok" or the lower-case status code name
  // ("invalid_argument", "resource_exhausted", ...). `ttft` is unset
  // (zero) when no token was sent.
  void RequestFinished(absl::string_view api, absl::string_view outcome,
                       uint64_t prompt_tokens, uint64_t completion_tokens,
                       absl::Duration ttft, absl::Duration total);

  // The Prometheus text exposition. `gauges` adds lines of live values
  // (requests running and queued, connections) the caller owns.
  std::string Exposition(
      const std::function<void(std::string*)>& gauges) const;

 private:
  mutable absl::Mutex mu_;
  absl::btree_map<std::pair<std::string, std::string>, uint64_t> requests_
      ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> prompt_tokens_{0};
  std::atomic<uint64_t> generation_tokens_{0};
  LatencyHistogram ttft_;
  LatencyHistogram tpot_;
  LatencyHistogram e2e_;
};

// "ok", or the status code's name in lower case ("resource_exhausted").
std::string OutcomeName(int absl_status_code);

// What one request contributes to the metrics, gathered from the messages
// it sends: the time of its first token and each choice's usage. The gRPC
// and the HTTP front end keep one per request.
// Thread-safety: none; its owner serializes the calls.
class RequestRecord {
 public:
  explicit RequestRecord(absl::Time started) : started_(started) {}

  absl::Time started() const { return started_; }

  // Notes a message sent to the client.
  void Sent(const v1::GenerateResponse& message);
  // Records the request, ended with `status`, as `api` ("grpc", "http").
  void Finish(absl::string_view api, const absl::Status& status,
              RouterMetrics& metrics) const;

 private:
  const absl::Time started_;
  absl::Duration ttft_;  // Zero until a token was sent.
  uint64_t prompt_tokens_ = 0;
  uint64_t completion_tokens_ = 0;
};

}  // namespace pdserve

#endif  // PDSERVE_ROUTER_ROUTER_METRICS_H_
