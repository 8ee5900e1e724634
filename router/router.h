// Router: pd-router's server — the public Generation API in front of a
// cluster of prefill and decode workers (DESIGN.md, "router/").
//
//   RouterOptions options;
//   options.cluster = *LoadClusterConfig("cluster.json");
//   auto router = Router::Start(options);   // Serving on (*router)->port().
//   ...
//   (*router)->Shutdown();
//
// Thread-safety: port(), api_keys() and stats from any thread; Shutdown()
// from one.
// Ownership: the Router owns the gRPC and HTTP servers, the worker
// registry (and its poller) and the orchestrator (and its admission
// thread).
#ifndef PDSERVE_ROUTER_ROUTER_H_
#define PDSERVE_ROUTER_ROUTER_H_

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/http_server.h"
#include "grpcpp/grpcpp.h"
#include "pdserve/internal/v1/cluster_config.pb.h"
#include "router/api_keys.h"
#include "router/etcd_discovery.h"

namespace pdserve {

class OpenAiService;
class RequestOrchestrator;
class RouterMetrics;
class RouterService;
class ServedModel;
class WorkerRegistry;

struct RouterOptions {
  // gRPC address to listen on; port 0 picks a free port. Default:
  // "127.0.0.1:0".
  std::string listen = "127.0.0.1:0";
  // Credentials of the public gRPC API (TLS, common/tls.h); null:
  // plaintext. Default: null.
  std::shared_ptr<grpc::ServerCredentials> credentials;
  // Credentials of the channels to the workers (internal mTLS); null:
  // plaintext. Default: null.
  std::shared_ptr<grpc::ChannelCredentials> worker_credentials;
  // The model and the workers; must pass ValidateClusterConfig. Default:
  // empty (Start fails).
  internal::v1::ClusterConfig cluster;
  // Requests waiting for KV room on the decode workers (admission is by
  // KV capacity, orchestrator.h); more are refused with RESOURCE_EXHAUSTED.
  // Default: 4096.
  int max_queued = 4096;
  // Period of the workers' load reports. Default: 100 ms.
  absl::Duration poll_interval = absl::Milliseconds(100);
  // Deadline of one load report. Default: 1 s.
  absl::Duration load_timeout = absl::Seconds(1);
  // Other prefill workers tried after one fails. Default: 2.
  int prefill_retries = 2;
  // Times one choice may move to another decode worker after its own
  // failed or stalled (orchestrator.h, "Migration"); 0: never. Default: 3.
  int migration_limit = 3;
  // A running Decode stream silent this long is a stalled decode worker:
  // cancelled, and its choice migrates. Default: 10 s.
  absl::Duration decode_stall_timeout = absl::Seconds(10);
  // Deadline of a Generate call whose client set none. Default: 10 min.
  absl::Duration default_deadline = absl::Minutes(10);
  // Deadline of Reserve and Release calls. Default: 5 s.
  absl::Duration control_timeout = absl::Seconds(5);
  // Address of the OpenAI-compatible HTTP API; port 0 picks a free port,
  // empty serves no HTTP. Default: "127.0.0.1:0".
  std::string http_listen = "127.0.0.1:0";
  // The HTTP server's threads and bounds (its listen field is ignored).
  HttpServer::Options http;
  // API keys: when any is set, every call but Health must carry
  // `authorization: Bearer <key>` for one of them (ApiKeys). Each must be a
  // valid key (api_keys.h). Default: none (open).
  std::vector<std::string> api_keys;
  // etcd endpoints ("http://host:port"): workers are also discovered there
  // (router/etcd_discovery.h), and the config's lists may be empty.
  // Default: none (the config's workers only).
  std::vector<std::string> etcd_endpoints;
  // The cluster's key prefix in etcd. Default: "/pdserve/".
  std::string etcd_prefix = "/pdserve/";
  // TLS to etcd (EtcdClient::Options::tls). Default: null (plaintext).
  std::shared_ptr<grpc::ChannelCredentials> etcd_tls;
};

class Router {
 public:
  // Loads the model's tokenizer, starts polling the workers and serving.
  // INVALID_ARGUMENT for bad options or config; the model's load error;
  // UNAVAILABLE when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<Router>> Start(
      const RouterOptions& options);

  // Shutdown(), then frees everything.
  ~Router();

  // The bound port.
  int port() const { return port_; }
  // The bound HTTP port; 0 when no HTTP is served.
  int http_port() const { return http_ ? http_->port() : 0; }

  // Stops taking calls, lets those in flight run for up to `grace`, then
  // cancels the rest; stops the workers' polling. Idempotent.
  void Shutdown(absl::Duration grace = absl::Seconds(5));

  // The keys every front door checks (the gRPC service does; the HTTP
  // server calls api_keys().Check with the Authorization header's value).
  const ApiKeys& api_keys() const { return api_keys_; }

  // Requests started and not ended (queued ones included) / waiting for
  // KV room now.
  int64_t running_requests() const;
  int64_t queued_requests() const;

 private:
  Router() = default;
  // Adds the live gauges (requests running and queued, connections,
  // workers) to metrics_.
  void AddGauges();

  // Destroyed in reverse: the server before what its calls use.
  ApiKeys api_keys_;
  std::shared_ptr<const ServedModel> model_;
  std::unique_ptr<WorkerRegistry> registry_;
  std::unique_ptr<EtcdDiscovery> discovery_;  // Null without etcd.
  std::unique_ptr<RequestOrchestrator> orchestrator_;
  std::unique_ptr<RouterMetrics> metrics_;
  std::unique_ptr<RouterService> service_;
  std::unique_ptr<OpenAiService> openai_;
  std::unique_ptr<HttpServer> http_;
  // http_ as the connections gauge reads it: a scrape can come in through
  // http_ before Start has stored it.
  std::atomic<const HttpServer*> http_for_gauges_{nullptr};
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  bool shut_down_ = false;
};

}  // namespace pdserve

#endif  // PDSERVE_ROUTER_ROUTER_H_
