#include "kv_transfer/region_table.h"

#include "absl/strings/str_cat.h"

namespace pdserve::kv {

RegionId RegionTable::Register(std::span<std::byte> memory) {
  absl::MutexLock lock(&mu_);
  const uint32_t id = next_id_++;
  regions_[id] = Region{memory, 0};
  return RegionId(id);
}

absl::Status RegionTable::Deregister(RegionId region) {
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(region.value);
  if (it == regions_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown memory region ", region.value));
  }
  mu_.Await(absl::Condition(
      +[](Region* r) { return r->users == 0; }, &it->second));
  regions_.erase(region.value);
  return absl::OkStatus();
}

absl::Status RegionTable::Access(RegionId region, uint64_t offset, uint64_t length,
                                 const std::function<void(std::span<std::byte>)>& fn) {
  std::span<std::byte> bytes;
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(region.value);
    if (it == regions_.end()) {
      return absl::NotFoundError(absl::StrCat("unknown memory region ", region.value));
    }
    const uint64_t size = it->second.memory.size();
    if (offset > size || length > size - offset) {
      return absl::OutOfRangeError(absl::StrCat("range [", offset, ", +", length,
                                                ") outside region ", region.value, " of ", size,
                                                " bytes"));
    }
    bytes = it->second.memory.subspan(offset, length);
    ++it->second.users;
  }
  fn(bytes);  // Outside the lock: this may be a large copy.
  absl::MutexLock lock(&mu_);
  --regions_[region.value].users;
  return absl::OkStatus();
}

absl::Status NotificationQueue::Push(Notification n) {
  absl::MutexLock lock(&mu_);
  if (queue_.size() >= capacity_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("notification queue full (", capacity_, " waiting)"));
  }
  queue_.push_back(std::move(n));
  return absl::OkStatus();
}

absl::StatusOr<Notification> NotificationQueue::Wait(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !queue_.empty(); };
  if (!mu_.AwaitWithTimeout(absl::Condition(&ready), timeout)) {
    return absl::DeadlineExceededError("no notification within the timeout");
  }
  Notification n = std::move(queue_.front());
  queue_.pop_front();
  return n;
}

}  // namespace pdserve::kv
