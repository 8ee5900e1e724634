// What the device transports (cuda_ipc, nccl) share: CUDA errors as
// Status, the device check, bounded waits on CUDA events, and the table of
// registered device memory with pinning. Built with CUDA only; internal to
// kv_transfer/.
#ifndef PDSERVE_KV_TRANSFER_CUDA_COMMON_H_
#define PDSERVE_KV_TRANSFER_CUDA_COMMON_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <functional>
#include <map>
#include <span>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kv_transfer/control_channel.h"
#include "kv_transfer/transport.h"

namespace pdserve::kv {

// `what` failed with `e`: RESOURCE_EXHAUSTED for out-of-memory, INTERNAL
// otherwise. Clears the thread's last (non-sticky) error.
absl::Status CudaError(cudaError_t e, std::string_view what);

// The calling thread's current device, or FAILED_PRECONDITION naming
// `transport` when no CUDA device (or driver) is visible.
absl::StatusOr<int> RequireCudaDevice(std::string_view transport);

// The cudaMalloc allocation holding `ptr`: its base and size
// (cuMemGetAddressRange, reached through the runtime so that no binary
// links libcuda). INVALID_ARGUMENT when `ptr` is not device memory.
struct DeviceAllocation {
  std::byte* base = nullptr;
  size_t size = 0;
};
absl::StatusOr<DeviceAllocation> FindDeviceAllocation(const void* ptr);

// Polls `event` until it completes, `poll` (when given) returns an error,
// or the deadline (DEADLINE_EXCEEDED naming `what`). Spins briefly, then
// sleeps between polls.
absl::Status WaitForEvent(cudaEvent_t event, absl::Time deadline,
                          std::string_view what,
                          const std::function<absl::Status()>& poll = {});

// Registered device memory. A region is pinned by every range a transfer
// holds on it; Deregister waits (bounded) until none does. Thread-safe.
class DeviceRegionTable {
 public:
  // INVALID_ARGUMENT for empty memory or memory that is not one device
  // allocation (host, managed, or spanning two allocations).
  absl::StatusOr<RegionId> Register(std::span<std::byte> memory);
  // NOT_FOUND for an unknown region; DEADLINE_EXCEEDED (the region stays
  // registered) when a transfer still pins it after `timeout`.
  absl::Status Deregister(RegionId region, absl::Duration timeout);

  // Checks every range, then pins each range's region and returns each
  // range's address, in order. NOT_FOUND for an unknown region,
  // OUT_OF_RANGE for a range outside its region; nothing is pinned then.
  absl::StatusOr<std::vector<std::byte*>> Pin(
      std::span<const RegionRange> ranges);
  // Releases what Pin(ranges) pinned.
  void Unpin(std::span<const RegionRange> ranges);

  // The region's memory, or NOT_FOUND (also while it is being
  // deregistered).
  absl::StatusOr<std::span<std::byte>> Find(RegionId region);

 private:
  struct Region {
    std::span<std::byte> memory;
    int users = 0;
    bool leaving = false;
  };
  absl::Mutex mu_;
  uint32_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint32_t, Region> regions_ ABSL_GUARDED_BY(mu_);
};

// The local ranges of `ops` (for Pin on the sending side).
std::vector<RegionRange> LocalRanges(std::span<const WriteOp> ops);

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_CUDA_COMMON_H_
