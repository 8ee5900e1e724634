// The worker-only etcd flags (common/etcd_flags.h).
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
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
    const WorkerAnnouncement& announcement, const TlsCertificates* etcd_tls) {
  const std::vector<std::string> endpoints = EtcdEndpointsFromFlags();
  if (endpoints.empty()) return std::unique_ptr<EtcdRegistration>();
  if (announcement.id.empty()) {
    return absl::InvalidArgumentError("--etcd needs --worker_id: the worker's name in the cluster");
  }
  absl::StatusOr<std::string> address = AdvertisedAddress(
      announcement.listen, announcement.port, absl::GetFlag(FLAGS_advertise));
  if (!address.ok()) return address.status();
  internal::v1::WorkerRegistration worker;
  worker.set_id(announcement.id);
  worker.set_role(announcement.role);
  worker.set_address(*address);
  worker.set_model(announcement.model);
  for (absl::string_view t : absl::StrSplit(announcement.kv_transports, ',', absl::SkipEmpty())) {
    worker.add_kv_transports(std::string(t));
  }
  worker.set_kv_blocks(announcement.kv_blocks);
  worker.set_block_size(announcement.block_size);
  std::string json;
  if (auto s = google::protobuf::util::MessageToJsonString(worker, &json); !s.ok()) {
    return absl::InternalError(absl::StrCat("cannot render the registration: ", s.ToString()));
  }
  return EtcdRegistration::Start({.endpoints = endpoints,
                                  .tls = etcd_tls != nullptr ? etcd_tls->ChannelCredentials()
                                                             : nullptr,
                                  .key = WorkerRegistrationKey(EtcdPrefixFromFlags(), worker.id()),
                                  .value = json,
                                  .ttl = absl::GetFlag(FLAGS_etcd_lease_ttl)});
}

}  // namespace pdserve
