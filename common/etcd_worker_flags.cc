// The worker-only etcd flags (common/etcd_flags.h).
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/etcd_flags.h"
#include "google/protobuf/util/json_util.h"

ABSL_FLAG(std::string, advertise, "",
          "With --etcd: the gRPC address HOST:PORT routers reach this worker "
          "at (default: --listen with the bound port; required when --listen "
          "is a wildcard such as 0.0.0.0)");
ABSL_FLAG(absl::Duration, etcd_lease_ttl, absl::Seconds(10),
          "With --etcd: TTL of this worker's lease; a worker that dies leaves "
          "the routers within it (at least 2s)");

namespace pdserve {

absl::StatusOr<std::unique_ptr<EtcdRegistration>> RegisterWorkerFromFlags(
    internal::v1::WorkerRegistration worker, const std::string& listen, int port) {
  const std::vector<std::string> endpoints = EtcdEndpointsFromFlags();
  if (endpoints.empty()) return std::unique_ptr<EtcdRegistration>();
  if (worker.id().empty()) {
    return absl::InvalidArgumentError("--etcd needs --worker_id: the worker's name in the cluster");
  }
  absl::StatusOr<std::string> address =
      AdvertisedAddress(listen, port, absl::GetFlag(FLAGS_advertise));
  if (!address.ok()) return address.status();
  worker.set_address(*address);
  std::string json;
  if (auto s = google::protobuf::util::MessageToJsonString(worker, &json); !s.ok()) {
    return absl::InternalError(absl::StrCat("cannot render the registration: ", s.ToString()));
  }
  return EtcdRegistration::Start({.endpoints = endpoints,
                                  .key = WorkerRegistrationKey(EtcdPrefixFromFlags(), worker.id()),
                                  .value = json,
                                  .ttl = absl::GetFlag(FLAGS_etcd_lease_ttl)});
}

}  // namespace pdserve
