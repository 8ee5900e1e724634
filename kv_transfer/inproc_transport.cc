// "inproc": transports in one process reach each other by name and copy
// with memcpy. For tests of the workers, and as the reference behaviour the
// other transports are checked against.
#include <atomic>
#include <cstring>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kv_transfer/region_table.h"
#include "kv_transfer/transports.h"

namespace pdserve::kv {
namespace {

// What a peer reaches: shared so a connection outliving its peer sees
// UNAVAILABLE instead of freed memory.
struct InprocCore {
  explicit InprocCore(const TransportOptions& o) : options(o), notifications(o.max_pending_notifications) {}
  const TransportOptions options;
  RegionTable regions;
  NotificationQueue notifications;
};

absl::Mutex registry_mu;
absl::flat_hash_map<std::string, std::weak_ptr<InprocCore>>& Registry() {
  static auto* registry = new absl::flat_hash_map<std::string, std::weak_ptr<InprocCore>>();
  return *registry;
}

class InprocConnection final : public KvConnection {
 public:
  InprocConnection(std::shared_ptr<InprocCore> self, std::weak_ptr<InprocCore> peer)
      : self_(std::move(self)), peer_(std::move(peer)) {}

  absl::Status Write(std::span<const WriteOp> ops) override {
    auto peer = peer_.lock();
    if (!peer) return absl::UnavailableError("inproc peer is gone");
    for (const WriteOp& op : ops) {
      absl::Status remote = absl::OkStatus();
      const absl::Status local = self_->regions.Access(
          op.local_region, op.local_offset, op.length, [&](std::span<std::byte> src) {
            remote = peer->regions.Access(op.remote_region, op.remote_offset, op.length,
                                          [&](std::span<std::byte> dst) {
                                            std::memcpy(dst.data(), src.data(), src.size());
                                          });
          });
      if (!local.ok()) return absl::InvalidArgumentError(absl::StrCat("local ", local.message()));
      PD_RETURN_IF_ERROR(remote);
    }
    return absl::OkStatus();
  }

  absl::Status Notify(std::string_view message) override {
    auto peer = peer_.lock();
    if (!peer) return absl::UnavailableError("inproc peer is gone");
    if (message.size() > peer->options.max_message_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat("notification of ", message.size(),
                                                       " bytes exceeds the peer's limit"));
    }
    return peer->notifications.Push({std::string(message)});
  }

 private:
  const std::shared_ptr<InprocCore> self_;
  const std::weak_ptr<InprocCore> peer_;
};

class InprocTransport final : public KvTransport {
 public:
  explicit InprocTransport(const TransportOptions& options)
      : core_(std::make_shared<InprocCore>(options)),
        endpoint_(absl::StrCat("inproc://", next_id_.fetch_add(1))) {
    absl::MutexLock lock(&registry_mu);
    Registry()[endpoint_] = core_;
  }
  ~InprocTransport() override {
    absl::MutexLock lock(&registry_mu);
    Registry().erase(endpoint_);
  }

  const TransportCapabilities& capabilities() const override { return caps_; }
  std::string endpoint() const override { return endpoint_; }
  absl::StatusOr<RegionId> RegisterMemory(std::span<std::byte> memory) override {
    return core_->regions.Register(memory);
  }
  absl::Status DeregisterMemory(RegionId region) override { return core_->regions.Deregister(region); }

  absl::StatusOr<std::unique_ptr<KvConnection>> Connect(std::string_view endpoint) override {
    absl::MutexLock lock(&registry_mu);
    auto it = Registry().find(std::string(endpoint));
    if (it == Registry().end() || it->second.expired()) {
      return absl::UnavailableError(absl::StrCat("no inproc transport at ", std::string(endpoint)));
    }
    return std::unique_ptr<KvConnection>(new InprocConnection(core_, it->second));
  }

  absl::StatusOr<Notification> WaitNotification(absl::Duration timeout) override {
    return core_->notifications.Wait(timeout);
  }

 private:
  static inline std::atomic<uint64_t> next_id_{1};
  const TransportCapabilities caps_{"inproc", false, true, false};
  const std::shared_ptr<InprocCore> core_;
  const std::string endpoint_;
};

}  // namespace

std::unique_ptr<KvTransport> CreateInprocTransport(const TransportOptions& options) {
  return std::make_unique<InprocTransport>(options);
}

}  // namespace pdserve::kv
