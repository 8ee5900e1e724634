// GenerationClient: the C++ client of pdserve's public gRPC API
// (proto/pdserve/v1/generation.proto), as served by pd-router.
//
//   GenerationClient::Options options;
//   options.api_key = "my-key";                     // If the router wants one.
//   auto client = GenerationClient::Create("127.0.0.1:50051", options);
//   v1::GenerateRequest request;
//   request.set_text("Once upon a time");
//   absl::Status s = (*client)->Generate(request,
//       [](const v1::GenerateResponse& r) { std::cout << r.text(); return true;
//       });
//
// The call contract, the same in the Python SDK (docs/python_sdk.md):
// - Deadline: every call has one (Options::generate_timeout for Generate,
//   Options::call_timeout for the others), covering all its attempts and
//   the waits between them. Passed: DEADLINE_EXCEEDED.
// - Retries: an attempt that fails with UNAVAILABLE or RESOURCE_EXHAUSTED
//   is tried again, after an exponential backoff with jitter
//   (RetryPolicy), up to RetryPolicy::max_attempts attempts — but a
//   Generate stream only while no message has arrived: once the first
//   token is delivered, an error ends the call (the tokens delivered stand;
//   none is ever delivered twice). No other code is retried. The status of
//   the last attempt is returned when attempts run out.
// - Cancellation: a Cancellation cancels a call from any thread, the
//   call's own callback included (so does the callback returning false);
//   the call returns CANCELLED and the server frees what the request held.
// - Request id: every attempt of a Generate call carries the same
//   request_id — the caller's, or one the client makes when it is empty —
//   so the server's logs and every response name the call.
// - API key: sent on every call as `authorization: Bearer <key>`.
// - Errors are the server's status codes (see generation.proto) as
//   absl::Status; a server that cannot be reached is UNAVAILABLE, a
//   missing or wrong API key UNAUTHENTICATED.
//
// Thread-safety: a GenerationClient may be used from many threads at once;
// calls share one channel. A Cancellation may be used from any thread.
#ifndef PDSERVE_CLIENT_PDSERVE_CLIENT_H_
#define PDSERVE_CLIENT_PDSERVE_CLIENT_H_

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "pdserve/v1/generation.grpc.pb.h"

namespace pdserve {

// When and how often a failed attempt is tried again (see the contract
// above). The wait before attempt k+1 (k >= 1) is
//   b = min(max_backoff, initial_backoff * multiplier^(k-1)),
// drawn uniformly from [b * (1 - jitter), b], and never past the deadline.
struct RetryPolicy {
  // Attempts of one call, the first included; 1 disables retries.
  // Default: 3.
  int max_attempts = 3;
  // Default: 100 ms.
  absl::Duration initial_backoff = absl::Milliseconds(100);
  // Default: 2.
  double multiplier = 2.0;
  // Default: 2 s.
  absl::Duration max_backoff = absl::Seconds(2);
  // Share of each wait drawn at random, in [0, 1], so that clients refused
  // together do not come back together. Default: 0.5.
  double jitter = 0.5;
};

// Cancels one GenerationClient call from any thread. Pass it to the call;
// Cancel() before the call starts makes it return CANCELLED at once, during
// the call cancels the attempt in flight (or the wait for the next one).
// Once cancelled it stays cancelled: use a new one per call.
class Cancellation {
 public:
  Cancellation() = default;
  Cancellation(const Cancellation&) = delete;
  Cancellation& operator=(const Cancellation&) = delete;

  // Idempotent; never blocks on the network.
  void Cancel();
  bool cancelled() const;

 private:
  friend class GenerationClient;

  // Makes `context` the attempt to cancel; false (and nothing attached)
  // when already cancelled.
  bool Attach(grpc::ClientContext* context);
  void Detach();
  // Waits until `until` or a Cancel(); false when cancelled.
  bool WaitUntil(absl::Time until);

  mutable absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* context_ ABSL_GUARDED_BY(mu_) = nullptr;
};

class GenerationClient {
 public:
  struct Options {
    // Deadline of a whole Generate call, retries included. Default: 10 min.
    absl::Duration generate_timeout = absl::Minutes(10);
    // Deadline of Tokenize, ListModels and Health, retries included.
    // Default: 10 s.
    absl::Duration call_timeout = absl::Seconds(10);
    // Default: RetryPolicy's defaults (3 attempts).
    RetryPolicy retry;
    // Sent as `authorization: Bearer <api_key>`; printable ASCII. Default:
    // empty (none sent).
    std::string api_key;
    // TLS to the server; false is a plaintext channel. Default: false.
    bool tls = false;
    // PEM root certificates the server's certificate must chain to (with
    // tls); empty: the system's roots. Default: empty.
    std::string tls_root_certificates;
    // PEM certificate chain and private key presented to a server that
    // asks for a client certificate (pd-router --tls_client_ca_file); both
    // or neither, with tls. Default: empty (none presented).
    std::string tls_certificate_chain;
    std::string tls_private_key;
  };

  // A client of the server at `address` ("host:port"). Connects lazily: an
  // unreachable server shows in the first call. INVALID_ARGUMENT for an
  // empty address, non-positive timeouts, a bad retry policy, an API key
  // that cannot be sent, or a client certificate without its key.
  static absl::StatusOr<std::unique_ptr<GenerationClient>> Create(
      const std::string& address, const Options& options);
  static absl::StatusOr<std::unique_ptr<GenerationClient>> Create(
      const std::string& address) {
    return Create(address, Options());
  }

  // Runs `request`, calling `on_response` on this thread with each message
  // in order (the last one has the finish reason and usage). Returning
  // false from it, or cancelling `cancellation`, cancels the call; Generate
  // then returns CANCELLED. OK once the stream ended normally.
  absl::Status Generate(
      const v1::GenerateRequest& request,
      absl::FunctionRef<bool(const v1::GenerateResponse&)> on_response,
      Cancellation* cancellation = nullptr);

  absl::StatusOr<v1::TokenizeResponse> Tokenize(
      const v1::TokenizeRequest& request);
  absl::StatusOr<v1::ListModelsResponse> ListModels();
  absl::StatusOr<v1::HealthResponse> Health();

 private:
  GenerationClient(std::unique_ptr<v1::Generation::Stub> stub,
                   const Options& options);

  // Sets the deadline and the API key of one attempt.
  void Prepare(grpc::ClientContext& context, absl::Time deadline) const;
  // Waits the backoff before attempt `attempt + 1`; false when the wait
  // would pass `deadline` or `cancellation` was cancelled.
  bool Backoff(int attempt, absl::Time deadline,
               Cancellation& cancellation) const;
  // A unary call (`call` runs one attempt) under the retry contract.
  template <typename Response>
  absl::StatusOr<Response> Unary(
      absl::FunctionRef<grpc::Status(grpc::ClientContext*, Response*)> call);

  const std::unique_ptr<v1::Generation::Stub> stub_;
  const Options options_;
};

}  // namespace pdserve

#endif  // PDSERVE_CLIENT_PDSERVE_CLIENT_H_
