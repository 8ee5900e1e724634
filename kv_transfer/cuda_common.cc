#include "kv_transfer/cuda_common.h"

#include <cuda.h>  // Driver types only: no binary links libcuda.

#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"

namespace pdserve::kv {

absl::Status CudaError(cudaError_t e, std::string_view what) {
  cudaGetLastError();  // Clear a non-sticky error for later calls.
  const std::string message =
      absl::StrCat(std::string(what), ": ", cudaGetErrorName(e), " (",
                   cudaGetErrorString(e), ")");
  return e == cudaErrorMemoryAllocation ? absl::ResourceExhaustedError(message)
                                        : absl::InternalError(message);
}

absl::StatusOr<int> RequireCudaDevice(std::string_view transport) {
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("the ", std::string(transport),
                     " KV transport needs a CUDA device: cudaGetDeviceCount: ",
                     cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
  }
  if (count == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("the ", std::string(transport),
                     " KV transport needs a CUDA device: none is visible"));
  }
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) {
    return CudaError(e, "cudaGetDevice");
  }
  // Makes the device's primary context current on this thread.
  if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
    return CudaError(e, "cudaSetDevice");
  }
  return device;
}

absl::StatusOr<DeviceAllocation> FindDeviceAllocation(const void* ptr) {
  cudaPointerAttributes attr{};
  if (const cudaError_t e = cudaPointerGetAttributes(&attr, ptr);
      e != cudaSuccess) {
    return CudaError(e, "cudaPointerGetAttributes");
  }
  if (attr.type != cudaMemoryTypeDevice) {
    return absl::InvalidArgumentError(
        "not device memory (cudaMalloc'ed memory is registered; host and "
        "managed memory go over tcp or ucx)");
  }
  using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static const GetAddressRange get_range = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000,
                                         cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return GetAddressRange{nullptr};
    }
    return reinterpret_cast<GetAddressRange>(fn);
  }();
  if (get_range == nullptr) {
    return absl::InternalError("the CUDA driver has no cuMemGetAddressRange");
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  if (const CUresult r =
          get_range(&base, &size, reinterpret_cast<CUdeviceptr>(ptr));
      r != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuMemGetAddressRange failed (CUresult ", r, ")"));
  }
  return DeviceAllocation{reinterpret_cast<std::byte*>(base), size};
}

absl::Status WaitForEvent(cudaEvent_t event, absl::Time deadline,
                          std::string_view what,
                          const std::function<absl::Status()>& poll) {
  // Copies of a few MiB finish in microseconds: spin first, then sleep in
  // steps that stay small next to a transfer.
  const auto spin_until =
      std::chrono::steady_clock::now() + std::chrono::microseconds(200);
  while (true) {
    const cudaError_t e = cudaEventQuery(event);
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady) return CudaError(e, what);
    if (poll) {
      if (absl::Status s = poll(); !s.ok()) return s;
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(std::string(what), ": timed out"));
    }
    if (std::chrono::steady_clock::now() < spin_until) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

absl::StatusOr<RegionId> DeviceRegionTable::Register(
    std::span<std::byte> memory) {
  if (memory.empty()) {
    return absl::InvalidArgumentError("cannot register empty memory");
  }
  absl::StatusOr<DeviceAllocation> a = FindDeviceAllocation(memory.data());
  if (!a.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot register memory: ", a.status().message()));
  }
  const size_t offset = static_cast<size_t>(memory.data() - a->base);
  if (offset > a->size || memory.size() > a->size - offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot register memory: ", memory.size(), " bytes at offset ", offset,
        " run past their allocation of ", a->size, " bytes"));
  }
  absl::MutexLock lock(&mu_);
  const uint32_t id = next_id_++;
  regions_[id] = Region{memory};
  return RegionId(id);
}

absl::Status DeviceRegionTable::Deregister(RegionId region,
                                           absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(region.value);
  if (it == regions_.end() || it->second.leaving) {
    return absl::NotFoundError(
        absl::StrCat("unknown memory region ", region.value));
  }
  Region& r = it->second;
  r.leaving = true;  // No new pins.
  if (!mu_.AwaitWithTimeout(absl::Condition(
                                +[](Region* r) { return r->users == 0; }, &r),
                            timeout)) {
    r.leaving = false;
    return absl::DeadlineExceededError(absl::StrCat(
        "memory region ", region.value,
        " is still the target or source of a transfer; deregister it later"));
  }
  regions_.erase(region.value);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::byte*>> DeviceRegionTable::Pin(
    std::span<const RegionRange> ranges) {
  std::vector<std::byte*> addresses;
  addresses.reserve(ranges.size());
  absl::MutexLock lock(&mu_);
  for (const RegionRange& range : ranges) {
    auto it = regions_.find(range.region);
    if (it == regions_.end() || it->second.leaving) {
      return absl::NotFoundError(
          absl::StrCat("unknown memory region ", range.region));
    }
    const uint64_t size = it->second.memory.size();
    if (range.offset > size || range.length > size - range.offset) {
      return absl::OutOfRangeError(absl::StrCat(
          "range [", range.offset, ", +", range.length, ") outside region ",
          range.region, " of ", size, " bytes"));
    }
    addresses.push_back(it->second.memory.data() + range.offset);
  }
  for (const RegionRange& range : ranges) ++regions_[range.region].users;
  return addresses;
}

void DeviceRegionTable::Unpin(std::span<const RegionRange> ranges) {
  absl::MutexLock lock(&mu_);
  for (const RegionRange& range : ranges) {
    if (auto it = regions_.find(range.region); it != regions_.end()) {
      --it->second.users;
    }
  }
}

absl::StatusOr<std::span<std::byte>> DeviceRegionTable::Find(RegionId region) {
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(region.value);
  if (it == regions_.end() || it->second.leaving) {
    return absl::NotFoundError(
        absl::StrCat("unknown memory region ", region.value));
  }
  return it->second.memory;
}

std::vector<RegionRange> LocalRanges(std::span<const WriteOp> ops) {
  std::vector<RegionRange> ranges;
  ranges.reserve(ops.size());
  for (const WriteOp& op : ops) {
    ranges.push_back({op.local_region.value, op.local_offset, op.length});
  }
  return ranges;
}

}  // namespace pdserve::kv
