// EtcdDiscovery: the router's view of the workers that registered in etcd
// (common/etcd_registration.h), kept in the WorkerRegistry.
//
// A thread lists "<prefix>workers/" and then watches it from the listing's
// revision: a registration that appears (or changes address or role) adds
// the worker to the registry, one that goes — deleted by a drain, or by
// etcd when the worker's lease ran out — removes it. Several routers may
// watch the same prefix: each keeps its own view, and none writes.
//
// When etcd cannot be reached the registry keeps the last view (workers
// already known keep serving, polled as always) and state() says since when
// etcd is unreachable; the thread lists again every retry interval, and the
// fresh listing replaces the view once etcd answers.
//
// A registration that does not parse, or whose id differs from its key,
// or whose role is unknown, is logged once and ignored.
//
// Thread-safety: all methods may be called from any thread.
// Ownership: owns its client and thread; the registry must outlive it.
#ifndef PDSERVE_ROUTER_ETCD_DISCOVERY_H_
#define PDSERVE_ROUTER_ETCD_DISCOVERY_H_

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/etcd_client.h"
#include "pdserve/v1/generation.pb.h"
#include "router/worker_registry.h"

namespace pdserve {

class EtcdDiscovery {
 public:
  struct Options {
    // etcd endpoints ("http://host:port"). Default: none (required).
    std::vector<std::string> endpoints;
    // TLS to etcd (EtcdClient::Options::tls). Default: null (plaintext).
    std::shared_ptr<grpc::ChannelCredentials> tls;
    // The cluster's key prefix, ending in '/'. Default: "/pdserve/".
    std::string prefix = "/pdserve/";
    // Wait between attempts while etcd is unreachable. Default: 1 s.
    absl::Duration retry_interval = absl::Seconds(1);
  };

  // Starts watching; returns at once (etcd may come up later).
  // INVALID_ARGUMENT for bad options.
  static absl::StatusOr<std::unique_ptr<EtcdDiscovery>> Start(const Options& options,
                                                              WorkerRegistry* registry);

  // Stops watching; the registry keeps the workers it has.
  ~EtcdDiscovery();

  struct State {
    // The view follows etcd now (listed and watching).
    bool connected = false;
    // Why not, while not connected (empty before the first attempt).
    std::string error;
    // Since when it is in its present state.
    absl::Time since;
    // Workers registered in the view.
    int workers = 0;
    // The endpoint it talks to.
    std::string endpoint;
  };
  State state() const;

 private:
  struct Known {
    WorkerRole role;
    std::string address;
  };

  EtcdDiscovery(const Options& options, std::unique_ptr<EtcdClient> client,
                WorkerRegistry* registry)
      : options_(options), client_(std::move(client)), registry_(registry) {}
  void Run();
  // Applies one registration (a put) or its removal (a delete) to the view.
  void ApplyPut(const EtcdKeyValue& kv);
  void ApplyDelete(const std::string& key);
  void SetConnected(bool connected, const std::string& error) ABSL_LOCKS_EXCLUDED(mu_);

  const Options options_;
  const std::unique_ptr<EtcdClient> client_;
  WorkerRegistry* const registry_;
  std::string workers_prefix_;
  // Known registrations by key; only the discovery thread touches it.
  absl::flat_hash_map<std::string, Known> known_;
  std::thread thread_;

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  EtcdWatch* watch_ ABSL_GUARDED_BY(mu_) = nullptr;  // The running watch.
  State state_ ABSL_GUARDED_BY(mu_);
};

// What Health reports about `discovery` (null: the workers come from the
// cluster config).
v1::Discovery DiscoveryStatus(const EtcdDiscovery* discovery);

}  // namespace pdserve

#endif  // PDSERVE_ROUTER_ETCD_DISCOVERY_H_
