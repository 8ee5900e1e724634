#include "client/pdserve_client.h"

#include <utility>

#include "grpcpp/grpcpp.h"

namespace pdserve {
namespace {

absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

void SetDeadline(grpc::ClientContext& context, absl::Duration timeout) {
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

}  // namespace

GenerationClient::GenerationClient(std::unique_ptr<v1::Generation::Stub> stub,
                                   const Options& options)
    : stub_(std::move(stub)), options_(options) {}

absl::StatusOr<std::unique_ptr<GenerationClient>> GenerationClient::Create(
    const std::string& address, const Options& options) {
  if (address.empty()) {
    return absl::InvalidArgumentError("the server address is empty");
  }
  auto channel =
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  return std::unique_ptr<GenerationClient>(
      new GenerationClient(v1::Generation::NewStub(channel), options));
}

absl::Status GenerationClient::Generate(
    const v1::GenerateRequest& request,
    absl::FunctionRef<bool(const v1::GenerateResponse&)> on_response) {
  grpc::ClientContext context;
  SetDeadline(context, options_.generate_timeout);
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader =
      stub_->Generate(&context, request);
  v1::GenerateResponse response;
  bool stopped = false;
  while (!stopped && reader->Read(&response)) {
    if (!on_response(response)) {
      stopped = true;
      context.TryCancel();
    }
  }
  const grpc::Status status = reader->Finish();
  if (stopped) return absl::CancelledError("cancelled by the caller");
  return FromGrpc(status);
}

absl::StatusOr<v1::TokenizeResponse> GenerationClient::Tokenize(
    const v1::TokenizeRequest& request) {
  grpc::ClientContext context;
  SetDeadline(context, options_.call_timeout);
  v1::TokenizeResponse response;
  const grpc::Status status = stub_->Tokenize(&context, request, &response);
  if (!status.ok()) return FromGrpc(status);
  return response;
}

absl::StatusOr<v1::ListModelsResponse> GenerationClient::ListModels() {
  grpc::ClientContext context;
  SetDeadline(context, options_.call_timeout);
  v1::ListModelsResponse response;
  const grpc::Status status =
      stub_->ListModels(&context, v1::ListModelsRequest(), &response);
  if (!status.ok()) return FromGrpc(status);
  return response;
}

absl::StatusOr<v1::HealthResponse> GenerationClient::Health() {
  grpc::ClientContext context;
  SetDeadline(context, options_.call_timeout);
  v1::HealthResponse response;
  const grpc::Status status =
      stub_->Health(&context, v1::HealthRequest(), &response);
  if (!status.ok()) return FromGrpc(status);
  return response;
}

}  // namespace pdserve
