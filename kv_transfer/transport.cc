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
  return absl::NotFoundError(absl::StrCat("KV transport '", std::string(name),
                                          "' is not built into this binary (available: ",
                                          absl::StrJoin(AvailableKvTransports(), ", "), ")"));
}

std::vector<std::string> AvailableKvTransports() {
  std::vector<std::string> names = {"tcp", "inproc"};
#ifdef PDSERVE_HAVE_UCX
  names.insert(names.end(), {"ucx", "ucx:shm", "ucx:tcp"});
#endif
  return names;
}

}  // namespace pdserve::kv
