#include "decode_worker/decode_server.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace pdserve {

absl::StatusOr<std::unique_ptr<DecodeServer>> DecodeServer::Start(
    const DecodeServerOptions& options) {
  PD_ASSIGN_OR_RETURN(std::unique_ptr<DecodeWorker> worker,
                      DecodeWorker::Create(options.worker));
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(options.listen_address,
                           grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(worker.get());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve on ", options.listen_address));
  }
  if (options.worker.worker_id.empty())
    worker->set_worker_id(absl::StrCat("decode-", port));
  PD_LOG(INFO) << "pd-decode serving on port " << port;
  return std::unique_ptr<DecodeServer>(
      new DecodeServer(options, std::move(worker), std::move(server), port));
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
  if (server_ == nullptr) return;
  server_->Shutdown(absl::ToChronoTime(absl::Now() + options_.shutdown_grace));
  server_->Wait();
  server_.reset();
}

}  // namespace pdserve
