// GenerationClient: a small C++ client of pdserve's public gRPC API
// (proto/pdserve/v1/generation.proto), as served by pd-router.
//
//   auto client = GenerationClient::Create("127.0.0.1:50051");
//   v1::GenerateRequest request;
//   request.set_text("Once upon a time");
//   absl::Status s = (*client)->Generate(request,
//       [](const v1::GenerateResponse& r) { std::cout << r.text(); return true;
//       });
//
// Errors are the server's status codes (see generation.proto) as
// absl::Status; a server that cannot be reached is UNAVAILABLE.
//
// Thread-safety: a GenerationClient may be used from many threads at once;
// calls share one channel.
#ifndef PDSERVE_CLIENT_PDSERVE_CLIENT_H_
#define PDSERVE_CLIENT_PDSERVE_CLIENT_H_

#include <memory>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "pdserve/v1/generation.grpc.pb.h"

namespace pdserve {

class GenerationClient {
 public:
  struct Options {
    // Deadline of a whole Generate stream. Default: 10 min.
    absl::Duration generate_timeout = absl::Minutes(10);
    // Deadline of Tokenize, ListModels and Health. Default: 10 s.
    absl::Duration call_timeout = absl::Seconds(10);
  };

  // A client of the server at `address` ("host:port"). Connects lazily: an
  // unreachable server shows in the first call. INVALID_ARGUMENT for an
  // empty address.
  static absl::StatusOr<std::unique_ptr<GenerationClient>> Create(
      const std::string& address, const Options& options);
  static absl::StatusOr<std::unique_ptr<GenerationClient>> Create(
      const std::string& address) {
    return Create(address, Options());
  }

  // Runs `request`, calling `on_response` on this thread with each message
  // in order (the last one has the finish reason and usage). Returning false
  // from it cancels the call; Generate then returns CANCELLED. OK once the
  // stream ended normally.
  absl::Status Generate(
      const v1::GenerateRequest& request,
      absl::FunctionRef<bool(const v1::GenerateResponse&)> on_response);

  absl::StatusOr<v1::TokenizeResponse> Tokenize(
      const v1::TokenizeRequest& request);
  absl::StatusOr<v1::ListModelsResponse> ListModels();
  absl::StatusOr<v1::HealthResponse> Health();

 private:
  GenerationClient(std::unique_ptr<v1::Generation::Stub> stub,
                   const Options& options);

  const std::unique_ptr<v1::Generation::Stub> stub_;
  const Options options_;
};

}  // namespace pdserve

#endif  // PDSERVE_CLIENT_PDSERVE_CLIENT_H_
