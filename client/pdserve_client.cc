#include "client/pdserve_client.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "grpcpp/grpcpp.h"

namespace pdserve {
namespace {

absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

// The codes that say "this attempt was not taken up; another may be".
bool Retryable(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable ||
         code == absl::StatusCode::kResourceExhausted;
}

// `status` of the last of `attempts` attempts, saying so when there were
// several.
absl::Status LastAttempt(const absl::Status& status, int attempts,
                         absl::string_view why_no_more) {
  if (attempts == 1) return status;
  return absl::Status(
      status.code(),
      absl::StrCat(status.message(), " (attempt ", attempts,
                   why_no_more.empty() ? "" : "; ", why_no_more, ")"));
}

absl::Status Cancelled() {
  return absl::CancelledError("cancelled by the caller");
}

// Whether `key` can be a gRPC metadata value after "Bearer ".
bool SendableKey(const std::string& key) {
  return std::all_of(key.begin(), key.end(),
                     [](char c) { return c > 0x20 && c < 0x7f; });
}

}  // namespace

void Cancellation::Cancel() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
  // Under mu_: Detach waits, so the context outlives this. TryCancel runs
  // no code of ours.
  if (context_ != nullptr) context_->TryCancel();
}

bool Cancellation::cancelled() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

bool Cancellation::Attach(grpc::ClientContext* context) {
  absl::MutexLock lock(&mu_);
  if (cancelled_) return false;
  context_ = context;
  return true;
}

void Cancellation::Detach() {
  absl::MutexLock lock(&mu_);
  context_ = nullptr;
}

bool Cancellation::WaitUntil(absl::Time until) {
  absl::MutexLock lock(&mu_);
  mu_.AwaitWithDeadline(absl::Condition(&cancelled_), until);
  return !cancelled_;
}

GenerationClient::GenerationClient(std::unique_ptr<v1::Generation::Stub> stub,
                                   const Options& options)
    : stub_(std::move(stub)), options_(options) {}

absl::StatusOr<std::unique_ptr<GenerationClient>> GenerationClient::Create(
    const std::string& address, const Options& options) {
  if (address.empty()) {
    return absl::InvalidArgumentError("the server address is empty");
  }
  if (options.generate_timeout <= absl::ZeroDuration() ||
      options.call_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "generate_timeout and call_timeout must be positive");
  }
  const RetryPolicy& r = options.retry;
  if (r.max_attempts < 1 || r.initial_backoff < absl::ZeroDuration() ||
      r.max_backoff < r.initial_backoff || !(r.multiplier >= 1.0) ||
      !(r.jitter >= 0.0 && r.jitter <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad retry policy: max_attempts ", r.max_attempts,
        " (>= 1), initial_backoff ", absl::FormatDuration(r.initial_backoff),
        " (>= 0), max_backoff ", absl::FormatDuration(r.max_backoff),
        " (>= initial_backoff), multiplier ", r.multiplier, " (>= 1), jitter ",
        r.jitter, " (in [0, 1])"));
  }
  if (!SendableKey(options.api_key)) {
    return absl::InvalidArgumentError(
        "the API key has a character other than printable ASCII without "
        "space");
  }
  if (options.tls_certificate_chain.empty() != options.tls_private_key.empty()) {
    return absl::InvalidArgumentError(
        "a client certificate needs its private key and the reverse");
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (options.tls) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_root_certificates;
    ssl.pem_cert_chain = options.tls_certificate_chain;
    ssl.pem_private_key = options.tls_private_key;
    credentials = grpc::SslCredentials(ssl);
  } else {
    credentials = grpc::InsecureChannelCredentials();
  }
  auto channel = grpc::CreateChannel(address, credentials);
  return std::unique_ptr<GenerationClient>(
      new GenerationClient(v1::Generation::NewStub(channel), options));
}

void GenerationClient::Prepare(grpc::ClientContext& context,
                               absl::Time deadline) const {
  context.set_deadline(absl::ToChronoTime(deadline));
  if (!options_.api_key.empty()) {
    context.AddMetadata("authorization",
                        absl::StrCat("Bearer ", options_.api_key));
  }
}

bool GenerationClient::Backoff(int attempt, absl::Time deadline,
                               Cancellation& cancellation) const {
  const RetryPolicy& r = options_.retry;
  const double scale = std::pow(r.multiplier, attempt - 1);
  const absl::Duration ceiling =
      std::min(r.max_backoff, r.initial_backoff * scale);
  absl::BitGen random;
  const absl::Duration wait =
      ceiling * (1.0 - r.jitter * absl::Uniform(random, 0.0, 1.0));
  const absl::Time until = absl::Now() + wait;
  if (until >= deadline) return false;
  return cancellation.WaitUntil(until);
}

absl::Status GenerationClient::Generate(
    const v1::GenerateRequest& request,
    absl::FunctionRef<bool(const v1::GenerateResponse&)> on_response,
    Cancellation* cancellation) {
  Cancellation own;
  Cancellation& cancel = cancellation != nullptr ? *cancellation : own;
  const absl::Time deadline = absl::Now() + options_.generate_timeout;
  // Every attempt carries the same id.
  const v1::GenerateRequest* to_send = &request;
  std::optional<v1::GenerateRequest> with_id;
  if (request.request_id().empty()) {
    with_id = request;
    absl::BitGen random;
    with_id->set_request_id(absl::StrFormat("%016x%016x",
                                            absl::Uniform<uint64_t>(random),
                                            absl::Uniform<uint64_t>(random)));
    to_send = &*with_id;
  }
  for (int attempt = 1;; ++attempt) {
    grpc::ClientContext context;
    Prepare(context, deadline);
    if (!cancel.Attach(&context)) return Cancelled();
    std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader =
        stub_->Generate(&context, *to_send);
    v1::GenerateResponse response;
    bool received = false;
    bool stopped = false;
    while (reader->Read(&response)) {
      received = true;
      if (!on_response(response)) {
        stopped = true;
        context.TryCancel();
        break;
      }
    }
    const grpc::Status grpc_status = reader->Finish();
    cancel.Detach();
    if (grpc_status.ok() && !stopped) return absl::OkStatus();
    if (stopped || cancel.cancelled()) return Cancelled();
    const absl::Status status = FromGrpc(grpc_status);
    // After the first message an attempt is never repeated: its tokens
    // were delivered.
    if (received || !Retryable(status.code())) {
      return LastAttempt(status, attempt, "");
    }
    if (attempt >= options_.retry.max_attempts) {
      return LastAttempt(status, attempt, "no attempt left");
    }
    if (!Backoff(attempt, deadline, cancel)) {
      if (cancel.cancelled()) return Cancelled();
      return LastAttempt(status, attempt, "no time left before the deadline");
    }
  }
}

template <typename Response>
absl::StatusOr<Response> GenerationClient::Unary(
    absl::FunctionRef<grpc::Status(grpc::ClientContext*, Response*)> call) {
  Cancellation never;  // Unary calls take no Cancellation.
  const absl::Time deadline = absl::Now() + options_.call_timeout;
  for (int attempt = 1;; ++attempt) {
    grpc::ClientContext context;
    Prepare(context, deadline);
    Response response;
    const absl::Status status = FromGrpc(call(&context, &response));
    if (status.ok()) return response;
    if (!Retryable(status.code())) return LastAttempt(status, attempt, "");
    if (attempt >= options_.retry.max_attempts) {
      return LastAttempt(status, attempt, "no attempt left");
    }
    if (!Backoff(attempt, deadline, never)) {
      return LastAttempt(status, attempt, "no time left before the deadline");
    }
  }
}

absl::StatusOr<v1::TokenizeResponse> GenerationClient::Tokenize(
    const v1::TokenizeRequest& request) {
  return Unary<v1::TokenizeResponse>(
      [&](grpc::ClientContext* context, v1::TokenizeResponse* response) {
        return stub_->Tokenize(context, request, response);
      });
}

absl::StatusOr<v1::ListModelsResponse> GenerationClient::ListModels() {
  return Unary<v1::ListModelsResponse>(
      [&](grpc::ClientContext* context, v1::ListModelsResponse* response) {
        return stub_->ListModels(context, v1::ListModelsRequest(), response);
      });
}

absl::StatusOr<v1::HealthResponse> GenerationClient::Health() {
  return Unary<v1::HealthResponse>(
      [&](grpc::ClientContext* context, v1::HealthResponse* response) {
        return stub_->Health(context, v1::HealthRequest(), response);
      });
}

}  // namespace pdserve
