#include "decode_worker/decode_server.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_server.h"
#include "common/log.h"
#include "common/metrics_http.h"
#include "common/status_macros.h"

namespace pdserve {

absl::StatusOr<std::unique_ptr<DecodeServer>> DecodeServer::Start(
    const DecodeServerOptions& options) {
  PD_ASSIGN_OR_RETURN(std::unique_ptr<DecodeWorker> worker,
                      DecodeWorker::Create(options.worker));
  PD_ASSIGN_OR_RETURN(StartedServer started,
                      StartGrpcServer(options.listen_address, {worker.get()},
                                      options.credentials));
  if (options.worker.worker_id.empty()) {
    worker->set_worker_id(absl::StrCat("decode-", started.port));
  }
  absl::StatusOr<std::unique_ptr<HttpServer>> http =
      StartMetricsServer(options.metrics_listen, &worker->metrics());
  if (!http.ok()) {
    started.server->Shutdown();
    return http.status();
  }
  std::unique_ptr<HttpServer> metrics_http = *std::move(http);
  PD_LOG(INFO) << "pd-decode serving on port " << started.port
               << (metrics_http ? absl::StrCat(", /metrics on port ",
                                               metrics_http->port())
                                : std::string());
  auto server = std::unique_ptr<DecodeServer>(new DecodeServer(
      options, std::move(worker), std::move(started.server), started.port));
  server->metrics_http_ = std::move(metrics_http);
  return server;
}

DecodeServer::DecodeServer(const DecodeServerOptions& options,
                           std::unique_ptr<DecodeWorker> worker,
                           std::unique_ptr<grpc::Server> server, int port)
    : options_(options),
      worker_(std::move(worker)),
      server_(std::move(server)),
      port_(port) {}

DecodeServer::~DecodeServer() { Shutdown(); }

void DecodeServer::Shutdown() {
  if (metrics_http_) metrics_http_->Stop();
  if (server_ == nullptr) return;
  server_->Shutdown(absl::ToChronoTime(absl::Now() + options_.shutdown_grace));
  server_->Wait();
  server_.reset();
}

}  // namespace pdserve
