// The etcd flags of pdserve's processes (docs/deployment.md, "Discovery"):
//   every process:  --etcd=http://HOST:2379[,...]  --etcd_prefix=/pdserve/
//                   --etcd_cert_file --etcd_key_file --etcd_ca_file (TLS,
//                   with https:// endpoints)
//   workers only:   --advertise=HOST:PORT  --etcd_lease_ttl=10s
// (the worker ones come with pdserve_etcd_worker_flags). Flags are read
// only by the mains, through these functions.
#ifndef PDSERVE_COMMON_ETCD_FLAGS_H_
#define PDSERVE_COMMON_ETCD_FLAGS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/etcd_registration.h"
#include "common/tls.h"
#include "pdserve/internal/v1/cluster_config.pb.h"

namespace pdserve {

// The certificates of the --etcd_*_file flags (all three or none); null
// when none is set. INVALID_ARGUMENT naming the missing flag, or the file
// that cannot be read or parsed.
absl::StatusOr<std::unique_ptr<TlsCertificates>> EtcdTlsFromFlags();

// --etcd as a list; empty when discovery is off.
std::vector<std::string> EtcdEndpointsFromFlags();
// --etcd_prefix, ending in '/'.
std::string EtcdPrefixFromFlags();

// Where a worker's registration lives: "<prefix>workers/<id>".
std::string WorkerRegistrationKey(const std::string& prefix, const std::string& id);

// The address routers should reach a worker at: `advertise` when set, else
// `listen`'s host with the bound `port`. INVALID_ARGUMENT when `listen`'s
// host is a wildcard (0.0.0.0, [::], empty) and `advertise` is not set.
absl::StatusOr<std::string> AdvertisedAddress(const std::string& listen, int port,
                                              const std::string& advertise);

// What a worker announces (internal::v1::WorkerRegistration's fields).
struct WorkerAnnouncement {
  std::string role;  // "prefill" or "decode"
  std::string id;
  std::string model;
  std::string kv_transports;  // Comma-separated, as --kv_transport.
  int64_t kv_blocks = 0;
  int32_t block_size = 0;
  // --listen and the port it bound: the address, unless --advertise.
  std::string listen;
  int port = 0;
};

// With --etcd set: registers `worker` under --etcd_prefix with a
// --etcd_lease_ttl lease and keeps it there, over TLS with `etcd_tls`
// (EtcdTlsFromFlags; null: plaintext), which must outlive the
// registration. Null without --etcd.
absl::StatusOr<std::unique_ptr<EtcdRegistration>> RegisterWorkerFromFlags(
    const WorkerAnnouncement& worker, const TlsCertificates* etcd_tls);

}  // namespace pdserve

#endif  // PDSERVE_COMMON_ETCD_FLAGS_H_
