#include "prefill_worker/prefill_metrics.h"

#include <vector>

#include "absl/strings/ascii.h"

namespace pdserve {

PrefillMetrics::PrefillMetrics()
    : engine_(&registry_, "pdserve_prefill", "batch"),
      push_seconds_(registry_.AddHistogram(
          "pdserve_prefill_kv_push_seconds",
          "Time of one request's KV push, from its first layer queued to the "
          "KvComplete notification acknowledged (mostly overlapping the "
          "forward pass).",
          LatencyBuckets())),
      push_tail_seconds_(registry_.AddHistogram(
          "pdserve_prefill_kv_push_tail_seconds",
          "The part of a KV push after the forward pass ended: what it added "
          "to the time to first token.",
          LatencyBuckets())),
      push_failures_(registry_.AddCounterFamily(
          "pdserve_prefill_kv_push_failures_total",
          "Prefill calls whose KV push failed, by status code (lower case; "
          "cancelled: the caller gave up).",
          {"code"})) {}

void PrefillMetrics::WatchSender(const kv::KvSender* sender) {
  registry_.AddCallbackCounterFamily(
      "pdserve_prefill_kv_pushed_bytes_total",
      "KV bytes written into decode workers' landings, per transport.",
      {"transport"}, [sender](std::vector<LabeledValue>* out) {
        for (const kv::KvTransportCounters& c : sender->counters()) {
          out->push_back({{c.transport}, static_cast<double>(c.bytes)});
        }
      });
  registry_.AddCallbackCounterFamily(
      "pdserve_prefill_kv_pushes_total",
      "KV pushes delivered (KvComplete acknowledged), per transport.",
      {"transport"}, [sender](std::vector<LabeledValue>* out) {
        for (const kv::KvTransportCounters& c : sender->counters()) {
          out->push_back({{c.transport}, static_cast<double>(c.pushes)});
        }
      });
  registry_.AddCallbackCounterFamily(
      "pdserve_prefill_kv_push_fallbacks_total",
      "Pushes that moved past a transport to their landing's next offer (its "
      "connect failed, now or within the last 10 s), per transport left.",
      {"transport"}, [sender](std::vector<LabeledValue>* out) {
        for (const kv::KvTransportCounters& c : sender->counters()) {
          out->push_back({{c.transport}, static_cast<double>(c.fallbacks)});
        }
      });
}

void PrefillMetrics::PushDone(const absl::Status& status,
                              const kv::KvPushStats& stats) {
  if (!status.ok()) {
    push_failures_
        ->WithLabels({absl::AsciiStrToLower(absl::StatusCodeToString(status.code()))})
        ->Increment();
    return;
  }
  if (stats.transfer > absl::ZeroDuration()) {
    push_seconds_->ObserveDuration(stats.transfer);
    push_tail_seconds_->ObserveDuration(stats.transfer_tail);
  }
}

}  // namespace pdserve
