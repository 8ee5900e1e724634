#include "router/router.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_server.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "router/cluster_config.h"
#include "router/openai_service.h"
#include "router/orchestrator.h"
#include "router/router_metrics.h"
#include "router/router_service.h"
#include "router/served_model.h"
#include "router/worker_registry.h"

namespace pdserve {

absl::StatusOr<std::unique_ptr<Router>> Router::Start(
    const RouterOptions& options) {
  if (options.max_queued < 0 || options.prefill_retries < 0 ||
      options.migration_limit < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad router options: max_queued ", options.max_queued,
        " (>= 0), prefill_retries ", options.prefill_retries,
        " (>= 0), migration_limit ", options.migration_limit, " (>= 0)"));
  }
  if (options.default_deadline <= absl::ZeroDuration() ||
      options.control_timeout <= absl::ZeroDuration() ||
      options.decode_stall_timeout <= absl::ZeroDuration() ||
      options.decode_stall_timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(
        "default_deadline, control_timeout and decode_stall_timeout must be "
        "positive (and the stall timeout finite)");
  }
  PD_RETURN_IF_ERROR(
      ValidateClusterConfig(options.cluster, !options.etcd_endpoints.empty()));

  std::unique_ptr<Router> router(new Router());
  PD_ASSIGN_OR_RETURN(router->api_keys_, ApiKeys::Create(options.api_keys));
  PD_ASSIGN_OR_RETURN(router->model_, ServedModel::Load(options.cluster));
  const ModelConfig& config = router->model_->config();
  PD_ASSIGN_OR_RETURN(
      router->registry_,
      WorkerRegistry::Create(
          options.cluster,
          ExpectedWorkerModel{.model = router->model_->spec(),
                              .num_layers = config.num_layers,
                              .num_kv_heads = config.num_kv_heads,
                              .head_dim = config.head_dim},
          WorkerRegistry::Options{
              .poll_interval = options.poll_interval,
              .load_timeout = options.load_timeout,
              .channel_credentials = options.worker_credentials}));
  if (!options.etcd_endpoints.empty()) {
    PD_ASSIGN_OR_RETURN(router->discovery_,
                        EtcdDiscovery::Start({.endpoints = options.etcd_endpoints,
                                              .tls = options.etcd_tls,
                                              .prefix = options.etcd_prefix},
                                             router->registry_.get()));
  }
  RouterMetrics::Options metrics;
  for (const auto& w : options.cluster.prefill_workers()) {
    metrics.prefill_workers.push_back(w.id());
  }
  for (const auto& w : options.cluster.decode_workers()) {
    metrics.decode_workers.push_back(w.id());
  }
  router->metrics_ = std::make_unique<RouterMetrics>(metrics);
  router->orchestrator_ = std::make_unique<RequestOrchestrator>(
      router->model_, router->registry_.get(), router->metrics_.get(),
      RequestOrchestrator::Options{
          .prefill_retries = options.prefill_retries,
          .control_timeout = options.control_timeout,
          .max_queued = options.max_queued,
          .recheck_interval = options.poll_interval,
          .migration_limit = options.migration_limit,
          .decode_stall_timeout = options.decode_stall_timeout});
  router->AddGauges();
  router->service_ = std::make_unique<RouterService>(
      router->model_, router->registry_.get(), router->orchestrator_.get(),
      &router->api_keys_, options.default_deadline, router->metrics_.get(),
      router->discovery_.get());
  if (!options.http_listen.empty()) {
    router->openai_ = std::make_unique<OpenAiService>(OpenAiService::Deps{
        .model = router->model_,
        .registry = router->registry_.get(),
        .orchestrator = router->orchestrator_.get(),
        .metrics = router->metrics_.get(),
        .api_keys = &router->api_keys_,
        .discovery = router->discovery_.get(),
        .request_deadline = options.default_deadline});
    HttpServer::Options http = options.http;
    http.listen = options.http_listen;
    OpenAiService* openai = router->openai_.get();
    auto http_server = HttpServer::Start(
        http, [openai](HttpRequest request,
                       std::shared_ptr<HttpExchange> exchange) {
          openai->Handle(std::move(request), std::move(exchange));
        });
    if (!http_server.ok()) {
      router->Shutdown(absl::ZeroDuration());
      return http_server.status();
    }
    router->http_ = *std::move(http_server);
    router->http_for_gauges_.store(router->http_.get());
  }

  auto started = StartGrpcServer(options.listen, {router->service_.get()},
                                 options.credentials);
  if (!started.ok()) {
    router->Shutdown(absl::ZeroDuration());
    return started.status();
  }
  router->server_ = std::move(started->server);
  router->port_ = started->port;
  PD_LOG(INFO) << "pd-router serving model '" << router->model_->name()
               << "' on port " << router->port_ << " (gRPC) and "
               << router->http_port() << " (HTTP) with "
               << options.cluster.prefill_workers_size() << " prefill and "
               << options.cluster.decode_workers_size() << " decode workers"
               << (router->api_keys_.enabled()
                       ? absl::StrCat(", ", router->api_keys_.size(),
                                      " API keys required")
                       : ", no API key required");
  return router;
}

Router::~Router() { Shutdown(); }

void Router::Shutdown(absl::Duration grace) {
  if (shut_down_) return;
  shut_down_ = true;
  // Calls still running after the grace period are cancelled, which cancels
  // their downstream calls; the request threads then finish them.
  // HTTP connections close at once: their requests are cancelled like
  // those of gRPC calls past the grace period.
  // Requests still queued end with UNAVAILABLE once the gRPC server has
  // stopped taking calls; the others end as their clients are cancelled,
  // and the registry's channels stay until their last downstream call is
  // done.
  if (http_) http_->Stop();
  if (server_) server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
  if (orchestrator_) orchestrator_->Stop();
  if (server_) server_->Wait();
  if (orchestrator_) orchestrator_->WaitUntilIdle();
  // Discovery adds and removes the registry's workers: it stops first.
  discovery_.reset();
  registry_.reset();  // Stops polling.
}

void Router::AddGauges() {
  MetricsRegistry& r = metrics_->registry();
  // Scraped only through http_, which stops before any of these goes.
  r.AddCallbackGauge("pdserve_router_requests_running",
                     "Generation requests started and not ended (queued ones included).",
                     [this] { return double(orchestrator_->running()); });
  r.AddCallbackGauge("pdserve_router_requests_queued",
                     "Generation requests waiting for KV room on the decode workers.",
                     [this] { return double(orchestrator_->queued()); });
  r.AddCallbackGauge("pdserve_router_http_connections",
                     "Open HTTP connections.",
                     [this] {
                       const HttpServer* http = http_for_gauges_.load();
                       return http != nullptr ? http->connections() : 0;
                     });
  r.AddCallbackGaugeFamily(
      "pdserve_router_healthy_workers",
      "Workers answering load reports and taking new work (not draining), "
      "by role.",
      {"role"},
      [this](std::vector<LabeledValue>* out) {
        out->push_back({{"prefill"}, double(registry_->healthy_prefill())});
        out->push_back({{"decode"}, double(registry_->healthy_decode())});
      });
  // The decode workers' KV pools as of their last load report: free blocks
  // returning to the total is how a client sees that nothing leaked.
  r.AddCallbackGaugeFamily(
      "pdserve_router_worker_kv_blocks",
      "KV blocks of each decode worker (state total or free), as of its "
      "last load report.",
      {"worker", "state"}, [this](std::vector<LabeledValue>* out) {
        for (const WorkerSnapshot& w : registry_->Snapshot()) {
          if (w.role != WorkerRole::kDecode) continue;
          out->push_back(
              {{w.id, "total"}, double(w.last_report.total_blocks())});
          out->push_back({{w.id, "free"}, double(w.last_report.free_blocks())});
        }
      });
  if (discovery_ != nullptr) {
    r.AddCallbackGauge("pdserve_router_etcd_connected",
                       "1 while the worker view follows etcd; 0 while etcd is "
                       "unreachable and the router serves from its last view.",
                       [this] { return discovery_->state().connected ? 1.0 : 0.0; });
    r.AddCallbackGauge("pdserve_router_etcd_workers",
                       "Workers registered in etcd, as the router last saw them.",
                       [this] { return double(discovery_->state().workers); });
  }
}

int64_t Router::running_requests() const {
  return orchestrator_->running();
}
int64_t Router::queued_requests() const { return orchestrator_->queued(); }

}  // namespace pdserve
