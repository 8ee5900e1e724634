// DecodeServer: a DecodeWorker behind a gRPC server, as pd-decode runs it
// (and as tests run it in-process).
//
// Thread-safety: port() and worker() from any thread; Shutdown() from one.
#ifndef PDSERVE_DECODE_WORKER_DECODE_SERVER_H_
#define PDSERVE_DECODE_WORKER_DECODE_SERVER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/http_server.h"
#include "decode_worker/decode_worker.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"

namespace pdserve {

struct DecodeServerOptions {
  // gRPC address ("host:port"; port 0 picks a free one).
  // Default: "127.0.0.1:0".
  std::string listen_address = "127.0.0.1:0";
  // The gRPC server's credentials (internal mTLS, common/tls.h); null:
  // plaintext. Default: null.
  std::shared_ptr<grpc::ServerCredentials> credentials;
  // An empty worker.worker_id becomes "decode-<bound port>".
  DecodeWorkerOptions worker;
  // Address of the /metrics and /health HTTP endpoint ("host:port"; port 0
  // picks a free one); empty serves none. Default: empty.
  std::string metrics_listen;
  // How long Shutdown lets streams in flight finish before cancelling them.
  // Default: 5 s.
  absl::Duration shutdown_grace = absl::Seconds(5);
};

class DecodeServer {
 public:
  // Creates the worker and starts serving. UNAVAILABLE when the address
  // cannot be bound; the worker's errors as they come.
  static absl::StatusOr<std::unique_ptr<DecodeServer>> Start(
      const DecodeServerOptions& options);

  // Shutdown()s.
  ~DecodeServer();

  int port() const { return port_; }
  DecodeWorker& worker() { return *worker_; }
  // The bound /metrics port; 0 when none is served.
  int metrics_port() const { return metrics_http_ ? metrics_http_->port() : 0; }

  // Stops accepting calls, lets those in flight finish for shutdown_grace,
  // cancels the rest and waits for them. Idempotent.
  void Shutdown();

 private:
  DecodeServer(const DecodeServerOptions& options,
               std::unique_ptr<DecodeWorker> worker,
               std::unique_ptr<grpc::Server> server, int port);

  const DecodeServerOptions options_;
  const std::unique_ptr<DecodeWorker> worker_;  // Outlives server_.
  // Reads the worker's metrics: stopped first.
  std::unique_ptr<HttpServer> metrics_http_;
  std::unique_ptr<grpc::Server> server_;
  const int port_;
};

}  // namespace pdserve

#endif  // PDSERVE_DECODE_WORKER_DECODE_SERVER_H_
