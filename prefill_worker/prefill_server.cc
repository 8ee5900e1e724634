#include "prefill_worker/prefill_server.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_server.h"
#include "common/log.h"
#include "common/metrics_http.h"
#include "common/status_macros.h"

namespace pdserve {

absl::StatusOr<std::unique_ptr<PrefillServer>> PrefillServer::Start(
    const PrefillServerOptions& options) {
  PD_ASSIGN_OR_RETURN(std::unique_ptr<PrefillWorker> worker,
                      PrefillWorker::Create(options.worker));
  PD_ASSIGN_OR_RETURN(StartedServer started,
                      StartGrpcServer(options.listen_address, {worker.get()},
                                      options.credentials));
  if (options.worker.worker_id.empty()) {
    worker->set_worker_id(absl::StrCat("prefill-", started.port));
  }
  absl::StatusOr<std::unique_ptr<HttpServer>> http =
      StartMetricsServer(options.metrics_listen, &worker->metrics());
  if (!http.ok()) {
    started.server->Shutdown();
    return http.status();
  }
  std::unique_ptr<HttpServer> metrics_http = *std::move(http);
  PD_LOG(INFO) << "pd-prefill serving on port " << started.port
               << (metrics_http ? absl::StrCat(", /metrics on port ",
                                               metrics_http->port())
                                : std::string());
  auto server = std::unique_ptr<PrefillServer>(new PrefillServer(
      options, std::move(worker), std::move(started.server), started.port));
  server->metrics_http_ = std::move(metrics_http);
  return server;
}

PrefillServer::PrefillServer(const PrefillServerOptions& options,
                             std::unique_ptr<PrefillWorker> worker,
                             std::unique_ptr<grpc::Server> server, int port)
    : options_(options),
      worker_(std::move(worker)),
      server_(std::move(server)),
      port_(port) {}

PrefillServer::~PrefillServer() { Shutdown(); }

void PrefillServer::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  if (metrics_http_) metrics_http_->Stop();
  server_->Shutdown(absl::ToChronoTime(absl::Now() + options_.shutdown_grace));
  // Cancelled calls end once the engine and the KV sender have let go of them
  // (a transfer blocked on a peer takes up to the transfer timeout).
  if (!worker_->WaitUntilIdle(absl::Now() + options_.worker.transfer_timeout +
                              absl::Seconds(5))) {
    PD_LOG(ERROR) << worker_->in_flight()
                  << " Prefill calls still in flight at shutdown";
  }
  server_->Wait();
  server_.reset();
}

}  // namespace pdserve
