#include "decode_worker/decode_metrics.h"

namespace pdserve {

DecodeMetrics::DecodeMetrics()
    : engine_(&registry_, "pdserve_decode", "step"),
      kv_received_bytes_(registry_.AddCounterFamily(
          "pdserve_decode_kv_received_bytes_total",
          "KV bytes received per transport, as KvComplete notifications "
          "announce them (the prompt's tokens times the KV bytes of one token "
          "across all layers); counted when the notification arrives.",
          {"transport"})) {}

void DecodeMetrics::WatchLoop(const EngineLoop* loop) {
  engine_.WatchLoad(loop);
  registry_.AddCallbackGauge(
      "pdserve_decode_open_landings",
      "KV reservations (landings) open: waiting for their KV or their "
      "Decode call.",
      [loop] { return loop->load().reserved; });
}

void DecodeMetrics::WatchFence(const kv::LandingFence* fence) {
  registry_.AddCallbackCounter(
      "pdserve_decode_kv_fenced_writes_total",
      "KV writes dropped on arrival because their landing was no longer "
      "open (a push that outlived its request; tcp).",
      [fence] { return static_cast<double>(fence->dropped_writes()); });
  registry_.AddCallbackGauge(
      "pdserve_decode_kv_unfenced_landings",
      "Landings open, or closed with their blocks held back until no write "
      "can land in them any more.",
      [fence] { return static_cast<double>(fence->tracked()); });
}

Counter* DecodeMetrics::AddReceiver(absl::string_view transport) {
  return kv_received_bytes_->WithLabels({std::string(transport)});
}

}  // namespace pdserve
