// EtcdRegistration: keeps one key in etcd for as long as this process
// lives, under a lease, so that the key vanishes within the lease's TTL
// when the process dies or loses etcd — how a worker announces itself to
// the routers (docs/deployment.md, "Discovery").
//
// A thread grants the lease, puts the key and renews the lease every third
// of its TTL. When etcd cannot be reached it says so once and keeps trying
// each second; when the lease has expired meanwhile (etcd deleted the key,
// and routers dropped the worker) it registers again under a new lease.
// Withdraw() revokes the lease, so routers drop the worker at once (a
// drain's first step).
//
// Thread-safety: all methods may be called from any thread.
// Ownership: owns its client and thread.
#ifndef PDSERVE_COMMON_ETCD_REGISTRATION_H_
#define PDSERVE_COMMON_ETCD_REGISTRATION_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/etcd_client.h"

namespace pdserve {

class EtcdRegistration {
 public:
  struct Options {
    // etcd endpoints ("http://host:port"). Default: none (required).
    std::vector<std::string> endpoints;
    // TLS to etcd (EtcdClient::Options::tls). Default: null (plaintext).
    std::shared_ptr<grpc::ChannelCredentials> tls;
    // The key and its value. Default: none (required).
    std::string key;
    std::string value;
    // Lease TTL: how long the key outlives this process. Default: 10 s.
    absl::Duration ttl = absl::Seconds(10);
  };

  // Starts registering in the background and returns at once (etcd may
  // come up after the worker). INVALID_ARGUMENT for bad options.
  static absl::StatusOr<std::unique_ptr<EtcdRegistration>> Start(const Options& options);

  // Withdraw()s.
  ~EtcdRegistration();

  // Stops renewing and revokes the lease (the key goes at once). Idempotent.
  void Withdraw();

  // The key is in etcd as far as this process knows.
  bool registered() const;

 private:
  EtcdRegistration(const Options& options, std::unique_ptr<EtcdClient> client)
      : options_(options), client_(std::move(client)) {}
  void Run();

  const Options options_;
  const std::unique_ptr<EtcdClient> client_;
  std::thread thread_;
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t lease_ ABSL_GUARDED_BY(mu_) = 0;  // 0: none held.
};

}  // namespace pdserve

#endif  // PDSERVE_COMMON_ETCD_REGISTRATION_H_
