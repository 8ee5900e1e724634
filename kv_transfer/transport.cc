#include "kv_transfer/transport.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kv_transfer/transports.h"

namespace pdserve::kv {

absl::StatusOr<std::unique_ptr<KvTransport>> CreateKvTransport(std::string_view name,
                                                               const TransportOptions& options) {
  if (options.max_frame_bytes == 0 || options.max_message_bytes == 0 ||
      options.max_pending_notifications == 0 || options.io_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("transport limits and timeout must be positive");
  }
  if (name == "tcp") return CreateTcpTransport(options);
  if (name == "inproc") return CreateInprocTransport(options);
#ifdef PDSERVE_HAVE_UCX
  if (name == "ucx" || name.starts_with("ucx:")) return CreateUcxTransport(name, options);
#endif
#ifdef PDSERVE_HAVE_CUDA
  if (name == "cuda_ipc") return CreateCudaIpcTransport(options);
#endif
#ifdef PDSERVE_HAVE_NCCL
  if (name == "nccl") return CreateNcclTransport(options);
#endif
  return absl::NotFoundError(absl::StrCat("KV transport '", std::string(name),
                                          "' is not built into this binary (available: ",
                                          absl::StrJoin(AvailableKvTransports(), ", "), ")"));
}

std::vector<std::string> AvailableKvTransports() {
  std::vector<std::string> names = {"tcp", "inproc"};
#ifdef PDSERVE_HAVE_UCX
  names.insert(names.end(), {"ucx", "ucx:shm", "ucx:tcp"});
#endif
  // Listed when built, device or not: creating one without a device (or
  // without libnccl) answers FAILED_PRECONDITION. Probing for a device
  // here would start the CUDA driver in every process that asks.
#ifdef PDSERVE_HAVE_CUDA
  names.push_back("cuda_ipc");
#endif
#ifdef PDSERVE_HAVE_NCCL
  names.push_back("nccl");
#endif
  return names;
}

}  // namespace pdserve::kv
