#include "common/grpc_server.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace pdserve {

absl::StatusOr<StartedServer> StartGrpcServer(
    const std::string& listen_address,
    std::initializer_list<grpc::Service*> services,
    std::shared_ptr<grpc::ServerCredentials> credentials) {
  grpc::ServerBuilder builder;
  StartedServer started;
  builder.AddListeningPort(
      listen_address,
      credentials != nullptr ? std::move(credentials)
                             : grpc::InsecureServerCredentials(),
      &started.port);
  for (grpc::Service* service : services) builder.RegisterService(service);
  started.server = builder.BuildAndStart();
  if (started.server == nullptr || started.port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve on ", listen_address));
  }
  return started;
}

}  // namespace pdserve
