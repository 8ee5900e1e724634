// The receiving-side bookkeeping every transport shares: registered memory
// regions with bounds-checked access, and the bounded queue of
// notifications. Internal to kv_transfer/.
#ifndef PDSERVE_KV_TRANSFER_REGION_TABLE_H_
#define PDSERVE_KV_TRANSFER_REGION_TABLE_H_

#include <cstddef>
#include <deque>
#include <functional>
#include <span>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kv_transfer/transport.h"

namespace pdserve::kv {

class RegionTable {
 public:
  RegionId Register(std::span<std::byte> memory);
  // Waits until no access to the region is in progress. NOT_FOUND if unknown.
  absl::Status Deregister(RegionId region);

  // Runs `fn` on bytes [offset, offset + length) of `region` while the
  // region cannot be deregistered. NOT_FOUND for an unknown region,
  // OUT_OF_RANGE for a range outside it; `fn` is not called then.
  absl::Status Access(RegionId region, uint64_t offset, uint64_t length,
                      const std::function<void(std::span<std::byte>)>& fn);

 private:
  struct Region {
    std::span<std::byte> memory;
    int users = 0;
  };
  absl::Mutex mu_;
  uint32_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint32_t, Region> regions_ ABSL_GUARDED_BY(mu_);
};

class NotificationQueue {
 public:
  explicit NotificationQueue(size_t capacity) : capacity_(capacity) {}
  // RESOURCE_EXHAUSTED when `capacity` notifications are already waiting.
  absl::Status Push(Notification n);
  absl::StatusOr<Notification> Wait(absl::Duration timeout);

 private:
  const size_t capacity_;
  absl::Mutex mu_;
  std::deque<Notification> queue_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_REGION_TABLE_H_
