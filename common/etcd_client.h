// EtcdClient: the few calls of etcd's v3 gRPC API that pdserve's discovery
// needs (proto/etcd/etcd_v3.proto): put, list and delete keys, grant, keep
// alive and revoke leases, and watch a key prefix.
//
// Endpoints are "http://host:port" (or "host:port"); with several, a call
// that finds its endpoint unreachable tries the next one, and the client
// stays on the one that answered. TLS to etcd is not supported yet
// ("https://" is refused at Create).
//
// Every unary call carries Options::call_timeout as its deadline.
//
// Thread-safety: all methods may be called from any thread; an EtcdWatch is
// read by one thread, and Cancel() may come from any.
// Ownership: the client owns its channels; a watch holds a reference to
// its channel and may outlive the client.
#ifndef PDSERVE_COMMON_ETCD_CLIENT_H_
#define PDSERVE_COMMON_ETCD_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "etcd/etcd_v3.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace pdserve {

// One key-value pair as etcd holds it.
struct EtcdKeyValue {
  std::string key;
  std::string value;
  int64_t mod_revision = 0;
  int64_t lease = 0;
};

// A change under a watched prefix. For deletions (explicit, or the key's
// lease expired) `kv.value` is empty.
struct EtcdEvent {
  enum class Type { kPut, kDelete };
  Type type = Type::kPut;
  EtcdKeyValue kv;
};

// A stream of the events under one prefix (EtcdClient::Watch).
class EtcdWatch {
 public:
  ~EtcdWatch();

  // Blocks until the next event; false when the watch ended: cancelled,
  // the connection to etcd lost, or the server cancelled it (status()
  // says which).
  bool Next(EtcdEvent* event);
  // Why the watch ended; OK while it runs. CANCELLED after Cancel().
  absl::Status status() const;
  // Ends the watch; Next() returns false soon after. Thread-safe.
  void Cancel();

 private:
  friend class EtcdClient;
  EtcdWatch() = default;

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<etcdserverpb::Watch::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<etcdserverpb::WatchRequest,
                                           etcdserverpb::WatchResponse>>
      stream_;
  std::atomic<bool> cancelled_{false};
  // Events of the last response not yet handed out, and where Next is.
  etcdserverpb::WatchResponse pending_;
  int next_event_ = 0;
  mutable absl::Mutex mu_;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

class EtcdClient {
 public:
  struct Options {
    // "http://host:port", "https://host:port" or "host:port", at least
    // one. Default: none.
    std::vector<std::string> endpoints;
    // TLS to etcd (https:// endpoints; bare ones follow): the channel
    // credentials, e.g. TlsCertificates::ChannelCredentials(). Null:
    // plaintext (http://). Default: null.
    std::shared_ptr<grpc::ChannelCredentials> tls;
    // Deadline of every unary call. Default: 2 s.
    absl::Duration call_timeout = absl::Seconds(2);
  };

  // INVALID_ARGUMENT for no endpoint, a malformed one, an https:// one
  // without `tls` or an http:// one with it.
  // Connects lazily: an unreachable etcd shows on the first call.
  static absl::StatusOr<std::unique_ptr<EtcdClient>> Create(const Options& options);

  // Parses a comma-separated endpoint list (the --etcd flags); spaces
  // around an endpoint and empty entries are dropped.
  static std::vector<std::string> SplitEndpoints(const std::string& list);

  absl::Status Put(const std::string& key, const std::string& value, int64_t lease = 0);
  absl::Status Delete(const std::string& key);

  struct Listing {
    std::vector<EtcdKeyValue> kvs;
    // The store's revision the listing is as of: watch from revision + 1
    // to see every later change.
    int64_t revision = 0;
  };
  // Every key that starts with `prefix`.
  absl::StatusOr<Listing> List(const std::string& prefix);

  // A lease of `ttl` (rounded up to whole seconds, at least 1); its id.
  absl::StatusOr<int64_t> GrantLease(absl::Duration ttl);
  // One keep-alive: the lease's remaining TTL after it. NOT_FOUND when the
  // lease expired or was revoked (its keys are gone).
  absl::StatusOr<absl::Duration> KeepAlive(int64_t lease);
  // Ends the lease now; its keys are deleted.
  absl::Status RevokeLease(int64_t lease);

  // Watches every key that starts with `prefix`, from `start_revision`
  // (0: changes from now on). FAILED_PRECONDITION when that revision has
  // been compacted away (list again); UNAVAILABLE when etcd is unreachable.
  absl::StatusOr<std::unique_ptr<EtcdWatch>> Watch(const std::string& prefix,
                                                  int64_t start_revision);

  // The endpoint calls go to now ("host:port").
  std::string current_endpoint() const;

 private:
  struct Endpoint {
    std::string address;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<etcdserverpb::KV::Stub> kv;
    std::unique_ptr<etcdserverpb::Lease::Stub> lease;
  };

  explicit EtcdClient(const Options& options) : options_(options) {}
  // Runs `call` on the current endpoint, then on each other one while the
  // endpoint is unreachable (UNAVAILABLE or DEADLINE_EXCEEDED).
  template <typename Call>
  grpc::Status CallWithFailover(Call call);
  void SetDeadline(grpc::ClientContext& context) const;

  const Options options_;
  std::vector<Endpoint> endpoints_;  // Fixed after Create().
  std::atomic<size_t> current_{0};
};

}  // namespace pdserve

#endif  // PDSERVE_COMMON_ETCD_CLIENT_H_
