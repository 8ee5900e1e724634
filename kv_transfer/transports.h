// Factories of the transports built into this binary (internal; callers use
// CreateKvTransport).
#ifndef PDSERVE_KV_TRANSFER_TRANSPORTS_H_
#define PDSERVE_KV_TRANSFER_TRANSPORTS_H_

#include <memory>
#include <string_view>

#include "absl/status/statusor.h"
#include "kv_transfer/transport.h"

namespace pdserve::kv {

std::unique_ptr<KvTransport> CreateInprocTransport(const TransportOptions& options);
absl::StatusOr<std::unique_ptr<KvTransport>> CreateTcpTransport(const TransportOptions& options);
// `name` is "ucx" or "ucx:MODE" (ucx_transport.cc). Built with UCX only.
absl::StatusOr<std::unique_ptr<KvTransport>> CreateUcxTransport(std::string_view name,
                                                                const TransportOptions& options);

// Built with CUDA only (PDSERVE_HAVE_CUDA). FAILED_PRECONDITION without a
// CUDA device; nccl also without a loadable libnccl.
absl::StatusOr<std::unique_ptr<KvTransport>> CreateCudaIpcTransport(
    const TransportOptions& options);
absl::StatusOr<std::unique_ptr<KvTransport>> CreateNcclTransport(
    const TransportOptions& options);

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_TRANSPORTS_H_
