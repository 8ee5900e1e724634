#include "kv_transfer/kv_receiver.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/process.h"
#include "common/status_macros.h"
#include "kv_transfer/fault_injection.h"
#include "kv_transfer/negotiation.h"

namespace pdserve::kv {

absl::StatusOr<std::unique_ptr<KvReceiver>> KvReceiver::Create(
    const KvReceiverOptions& options) {
  if (options.quarantine <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("the KV quarantine must be positive");
  }
  PD_ASSIGN_OR_RETURN(const std::vector<std::string> names,
                      ParseKvTransportList(options.transports));
  std::unique_ptr<KvReceiver> receiver(new KvReceiver());
  TransportOptions transport_options;
  transport_options.listen_address = options.listen_address;
  bool every_write_fenced = true;
  for (const std::string& name : names) {
    PD_ASSIGN_OR_RETURN(
        std::unique_ptr<KvTransport> transport,
        CreateKvTransportWithFaults(name, transport_options, options.fault_spec));
    every_write_fenced &= transport->capabilities().fences_writes;
    receiver->transports_.push_back(std::move(transport));
  }
  receiver->fence_ =
      std::make_unique<LandingFence>(every_write_fenced, options.quarantine);
  for (auto& transport : receiver->transports_) {
    transport->SetWriteFence(receiver->fence_.get());
  }
  return receiver;
}

KvReceiver::~KvReceiver() { Stop(); }

absl::Status KvReceiver::Start(MemoryFor memory_for,
                               OnNotification on_notification) {
  if (started_) return absl::FailedPreconditionError("started already");
  started_ = true;
  for (auto& transport : transports_) {
    const TransportCapabilities& caps = transport->capabilities();
    KvReceiverOffer offer{.transport = caps.name,
                          .endpoint = transport->endpoint()};
    absl::StatusOr<std::span<std::byte>> memory =
        memory_for(caps, &offer.staged);
    if (!memory.ok()) {
      return absl::Status(memory.status().code(),
                          absl::StrCat("KV transport ", caps.name, ": ",
                                       memory.status().message()));
    }
    PD_ASSIGN_OR_RETURN(offer.region, transport->RegisterMemory(*memory));
    offers_.push_back(std::move(offer));
  }
  on_notification_ = std::move(on_notification);
  for (size_t i = 0; i < transports_.size(); ++i) {
    threads_.emplace_back([this, i] {
      NameThisThread("pd-kv-receive");
      Receive(i);
    });
  }
  return absl::OkStatus();
}

void KvReceiver::Stop() {
  stopping_ = true;
  for (std::thread& t : threads_) t.join();
  threads_.clear();
  for (size_t i = 0; i < offers_.size(); ++i) {
    if (absl::Status s = transports_[i]->DeregisterMemory(offers_[i].region);
        !s.ok()) {
      PD_LOG(WARNING) << "deregistering KV memory from "
                      << offers_[i].transport << ": " << s;
    }
  }
  offers_.clear();
}

void KvReceiver::Receive(size_t offer) {
  KvTransport& transport = *transports_[offer];
  while (!stopping_) {
    absl::StatusOr<Notification> n =
        transport.WaitNotification(absl::Milliseconds(100));
    if (n.ok()) {
      on_notification_(offer, *std::move(n));
    } else if (!absl::IsDeadlineExceeded(n.status())) {
      PD_LOG(WARNING) << "KV notification over "
                      << transport.capabilities().name << ": " << n.status();
    }
  }
}

}  // namespace pdserve::kv
