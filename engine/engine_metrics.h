// EngineMetrics: the Prometheus metrics of a worker's EngineLoop, shared by
// pd-prefill and pd-decode (docs/metrics.md): the step time, batch size and
// tokens of each step (fed by EngineLoop::Options::on_step), and the loop's
// load read at scrape time (requests running and waiting, queued prompt
// tokens, KV blocks by state, prefix-cache hits).
//
// Thread-safety: OnStep on the loop thread; set_reserved_blocks from any
// thread; scrapes from any thread.
// Ownership: `registry` and the watched loop are not owned; the loop must
// outlive every scrape of the registry (stop the /metrics server first).
#ifndef PDSERVE_ENGINE_ENGINE_METRICS_H_
#define PDSERVE_ENGINE_ENGINE_METRICS_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "common/metrics.h"
#include "engine/engine_loop.h"

namespace pdserve {

class EngineMetrics {
 public:
  // Registers `<prefix>_<step>_seconds` (the step histogram: "step" on
  // decode, "batch" on prefill, where a step is a prefill batch),
  // `<prefix>_<step>_cpu_seconds` (the loop thread's CPU in each),
  // `<prefix>_<step>_gap_seconds` (between back-to-back steps),
  // `<prefix>_batch_size`, `<prefix>_generated_tokens_total` and
  // `<prefix>_computed_prompt_tokens_total` in `registry`.
  EngineMetrics(MetricsRegistry* registry, absl::string_view prefix,
                absl::string_view step);

  // Adds the load gauges and counters, read from `loop` at each scrape:
  // `<prefix>_running_requests`, `_waiting_requests`,
  // `_queued_prompt_tokens`, `_kv_blocks{state}` and
  // `_prefix_cached_tokens_total`.
  void WatchLoad(const EngineLoop* loop);

  // The loop's on_step hook.
  void OnStep(const EngineStepStats& stats);

  // KV blocks held by reservations (decode): shown as state "reserved" and
  // taken out of "used". Default: 0.
  void set_reserved_blocks(int64_t blocks) {
    reserved_blocks_.store(blocks, std::memory_order_relaxed);
  }

 private:
  MetricsRegistry* const registry_;
  const std::string prefix_;
  Histogram* const step_seconds_;
  Histogram* const step_cpu_seconds_;
  Histogram* const step_gap_seconds_;
  Histogram* const batch_size_;
  Counter* const generated_tokens_;
  Counter* const computed_prompt_tokens_;
  std::atomic<int64_t> reserved_blocks_{0};
};

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_ENGINE_METRICS_H_
