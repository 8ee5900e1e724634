// DecodeMetrics: pd-decode's Prometheus metrics (docs/metrics.md),
// pdserve_decode_*: its engine loop's (EngineMetrics: step time, batch
// size, generated tokens, running and waiting requests, KV blocks by state,
// prefix-cache hits), landings open, KV bytes received per transport, and
// the landing fence's dropped writes and landings not fenced yet.
//
// Thread-safety: every method from any thread; AddReceiver before serving.
// Ownership: the watched loop must outlive every scrape.
#ifndef PDSERVE_DECODE_WORKER_DECODE_METRICS_H_
#define PDSERVE_DECODE_WORKER_DECODE_METRICS_H_

#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "common/metrics.h"
#include "engine/engine_loop.h"
#include "engine/engine_metrics.h"
#include "kv_transfer/landing_fence.h"

namespace pdserve {

class DecodeMetrics {
 public:
  DecodeMetrics();

  // The engine gauges and the landings open, read from `loop` at scrape.
  void WatchLoop(const EngineLoop* loop);
  // The counter of KV bytes received over receiving transport `transport`;
  // call once per transport at setup and keep the pointer.
  Counter* AddReceiver(absl::string_view transport);
  // The fence's counters, read from `fence` at scrape (it must outlive
  // every scrape).
  void WatchFence(const kv::LandingFence* fence);

  MetricsRegistry& registry() { return registry_; }
  EngineMetrics& engine() { return engine_; }

 private:
  MetricsRegistry registry_;
  EngineMetrics engine_;
  CounterFamily* const kv_received_bytes_;
};

}  // namespace pdserve

#endif  // PDSERVE_DECODE_WORKER_DECODE_METRICS_H_
