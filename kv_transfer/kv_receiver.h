// KvReceiver: the receiving half of the KV hand-off (kv_sender.h is the
// sending half); a decode worker runs one. It runs the transports KV may
// arrive on, registers the worker's KV memory with each, says what a
// landing offers, opens and fences landings (landing_fence.h: a closed
// landing's writes are dropped where the transport sees them, and its
// blocks are safe to reuse only once nothing can land in them), and hands
// every notification a sender delivers to its owner.
//
//   Create   transports made and fenced; landings can open and close
//   Start    memory registered, one notification thread per transport
//   Stop     threads joined, memory deregistered (writes in progress end)
//
// The notifications are opaque here: the owner parses them (a KvComplete)
// and tells the fence when a sender is done (fence().SenderDone).
//
// Thread-safety: offers(), fence() and the fence's methods from any
// thread once Start returned; Create, Start and Stop from one thread.
#ifndef PDSERVE_KV_TRANSFER_KV_RECEIVER_H_
#define PDSERVE_KV_TRANSFER_KV_RECEIVER_H_

#include <atomic>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kv_transfer/landing_fence.h"
#include "kv_transfer/transport.h"

namespace pdserve::kv {

struct KvReceiverOptions {
  // Transports KV may arrive on: a comma list in preference order
  // (ParseKvTransportList). Default: "tcp".
  std::string transports = "tcp";
  // Where the transports that listen on a socket (tcp) listen.
  // Default: "127.0.0.1:0".
  std::string listen_address = "127.0.0.1:0";
  // LandingFence's quarantine: longer than any sender's I/O timeout.
  // Default: 15 s.
  absl::Duration quarantine = absl::Seconds(15);
  // Faults injected into every transport (fault_injection.h; tests only).
  // Default: empty, none.
  std::string fault_spec;
};

// One transport KV arrives on, as a landing offers it.
struct KvReceiverOffer {
  std::string transport;
  std::string endpoint;
  RegionId region;
  // The region is the KV pool's host staging (a device pool over a
  // transport of host memory): what lands there is copied into the pool
  // before it is read.
  bool staged = false;
};

class KvReceiver {
 public:
  // The memory transport `caps` registers: the pool, or its host staging
  // (then *staged = true).
  using MemoryFor = absl::FunctionRef<absl::StatusOr<std::span<std::byte>>(
      const TransportCapabilities& caps, bool* staged)>;
  // A notification that arrived over offers()[offer]; called on that
  // transport's thread, must not block.
  using OnNotification =
      absl::AnyInvocable<void(size_t offer, Notification notification)>;

  // Makes the transports and the fence. INVALID_ARGUMENT for a malformed
  // list or fault spec, a non-positive quarantine; NOT_FOUND for a
  // transport not built in.
  static absl::StatusOr<std::unique_ptr<KvReceiver>> Create(
      const KvReceiverOptions& options);
  // Stop()s.
  ~KvReceiver();

  // Registers each transport's memory and starts delivering notifications
  // to `on_notification`. The memory must stay valid until Stop.
  absl::Status Start(MemoryFor memory_for, OnNotification on_notification);
  // Joins the notification threads, then deregisters the memory (waiting
  // for writes in progress; later ones are refused). Idempotent.
  void Stop();

  // In preference order; complete once Start returned.
  const std::vector<KvReceiverOffer>& offers() const { return offers_; }
  LandingFence& fence() { return *fence_; }
  const LandingFence& fence() const { return *fence_; }

 private:
  KvReceiver() = default;
  void Receive(size_t offer);

  // Before the transports, which consult it until they are gone.
  std::unique_ptr<LandingFence> fence_;
  std::vector<std::unique_ptr<KvTransport>> transports_;
  std::vector<KvReceiverOffer> offers_;
  OnNotification on_notification_;
  std::vector<std::thread> threads_;
  std::atomic<bool> stopping_ = false;
  bool started_ = false;
};

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_KV_RECEIVER_H_
