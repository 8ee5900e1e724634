// Starting a gRPC server the way every pdserve process does: one address,
// port 0 picking a free port, plaintext or TLS (common/tls.h).
#ifndef PDSERVE_COMMON_GRPC_SERVER_H_
#define PDSERVE_COMMON_GRPC_SERVER_H_

#include <initializer_list>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"

namespace pdserve {

struct StartedServer {
  std::unique_ptr<grpc::Server> server;
  int port = 0;  // The bound port.
};

// Serves `services` (which must outlive the server) on `listen_address`
// ("host:port") with `credentials` (null: plaintext). UNAVAILABLE when the
// address cannot be bound.
absl::StatusOr<StartedServer> StartGrpcServer(
    const std::string& listen_address,
    std::initializer_list<grpc::Service*> services,
    std::shared_ptr<grpc::ServerCredentials> credentials = nullptr);

}  // namespace pdserve

#endif  // PDSERVE_COMMON_GRPC_SERVER_H_
