// PrefillMetrics: pd-prefill's Prometheus metrics (docs/metrics.md),
// pdserve_prefill_*: its engine loop's (EngineMetrics: batch time, queued
// prompt tokens, ...) and its KV pushes (bytes, pushes and fallbacks per
// transport, push time, failures).
//
// Thread-safety: every method from any thread.
// Ownership: the watched sender must outlive every scrape.
#ifndef PDSERVE_PREFILL_WORKER_PREFILL_METRICS_H_
#define PDSERVE_PREFILL_WORKER_PREFILL_METRICS_H_

#include "absl/status/status.h"
#include "common/metrics.h"
#include "engine/engine_metrics.h"
#include "kv_transfer/kv_sender.h"

namespace pdserve {

class PrefillMetrics {
 public:
  PrefillMetrics();

  // Adds the per-transport counters the KV sender keeps, read at scrape.
  void WatchSender(const kv::KvSender* sender);
  // One push ended with `status` (stats as the KvSender reports them).
  void PushDone(const absl::Status& status, const kv::KvPushStats& stats);

  MetricsRegistry& registry() { return registry_; }
  EngineMetrics& engine() { return engine_; }

 private:
  MetricsRegistry registry_;
  EngineMetrics engine_;
  Histogram* const push_seconds_;
  Histogram* const push_tail_seconds_;
  CounterFamily* const push_failures_;
};

}  // namespace pdserve

#endif  // PDSERVE_PREFILL_WORKER_PREFILL_METRICS_H_
