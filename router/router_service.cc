#include "router/router_service.h"

#include <algorithm>
#include <deque>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "proto/convert.h"
#include "router/response_assembler.h"

namespace pdserve {
namespace {

// Parses a raw request; INVALID_ARGUMENT when it is not a `Message`.
template <typename Message>
absl::Status ParseRequest(const grpc::ByteBuffer& raw, Message* message) {
  grpc::ByteBuffer copy(raw);  // Deserialize consumes its input.
  if (grpc::SerializationTraits<Message>::Deserialize(&copy, message).ok()) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "the request is not a valid ", Message::descriptor()->full_name(),
      "; its string fields (text, stop, model, request_id) must be valid "
      "UTF-8"));
}

void Serialize(const google::protobuf::MessageLite& message,
               grpc::ByteBuffer* out) {
  bool own_buffer = false;
  // Only fails for messages over 2 GiB, which a response never is.
  grpc::SerializationTraits<google::protobuf::MessageLite>::Serialize(
      message, out, &own_buffer)
      .IgnoreError();
}

// The API-key check of a call (ApiKeys::Check on its `authorization`).
absl::Status Authorize(const grpc::CallbackServerContext& context,
                       const ApiKeys& keys) {
  if (!keys.enabled()) return absl::OkStatus();
  const auto& metadata = context.client_metadata();
  const auto it = metadata.find("authorization");
  if (it == metadata.end()) return keys.Check("");
  return keys.Check(std::string_view(it->second.data(), it->second.size()));
}

// Ends a call at once with a status.
class FinishedWriteReactor final
    : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  explicit FinishedWriteReactor(const absl::Status& status) {
    Finish(ToGrpcStatus(status));
  }
  void OnDone() override { delete this; }
};

// One Generate call: the reactor gRPC drives, and the GenerateStream the
// orchestrator sends to (from gRPC's callback threads). Owned by a
// shared_ptr: the reactor's own reference goes in OnDone, the
// orchestrator's when the request ends.
class GenerateCall final : public grpc::ServerWriteReactor<grpc::ByteBuffer>,
                           public GenerateStream {
 public:
  static GenerateCall* Start(grpc::CallbackServerContext* context,
                             const v1::GenerateRequest& request,
                             RequestOrchestrator* orchestrator,
                             absl::Duration default_deadline,
                             RouterMetrics* metrics) {
    auto call = std::shared_ptr<GenerateCall>(
        new GenerateCall(context, default_deadline, metrics));
    {
      absl::MutexLock lock(&call->mu_);
      call->self_ = call;
    }
    std::shared_ptr<RunningRequest> running =
        orchestrator->Start(request, call);
    bool cancelled;
    {
      absl::MutexLock lock(&call->mu_);
      call->running_ = running;
      cancelled = call->cancelled_;
    }
    // OnCancel came before the handle: cancel now.
    if (cancelled) running->Cancel();
    return call.get();
  }

  // GenerateStream.
  absl::Time deadline() const override { return deadline_; }
  void End(const absl::Status& status) override { FinishWith(status); }
  void Send(v1::GenerateResponse message) override {
    {
      absl::MutexLock lock(&mu_);
      if (final_status_ || write_failed_) return;
      record_.Sent(message);
      if (write_in_flight_) {
        // One queued message per choice at most: a later message of a
        // choice joins the one already queued (in order); other choices'
        // messages queue beside it.
        auto same_choice = [&](const v1::GenerateResponse& m) {
          return m.index() == message.index();
        };
        if (auto it =
                std::find_if(pending_.begin(), pending_.end(), same_choice);
            it != pending_.end()) {
          MergeResponse(std::move(message), &*it);
        } else {
          pending_.push_back(std::move(message));
        }
        return;
      }
      write_in_flight_ = true;
    }
    // Only the thread that set write_in_flight_ touches writing_ until
    // OnWriteDone.
    writing_.Clear();
    Serialize(message, &writing_);
    StartWrite(&writing_);
  }

  // Ends the call with `status` once the writes queued before it are done.
  // Only the first call counts.
  void FinishWith(const absl::Status& status) {
    {
      absl::MutexLock lock(&mu_);
      if (final_status_) return;
      final_status_ = status;
      record_.Finish("grpc", status);
      if (write_in_flight_) return;  // OnWriteDone finishes.
    }
    Finish(ToGrpcStatus(status));
  }

  // Reactions.
  void OnWriteDone(bool ok) override {
    bool write_next = false;
    std::optional<absl::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      if (!ok) {
        // The stream is broken (the client is gone); OnCancel follows.
        write_failed_ = true;
        pending_.clear();
      }
      if (!pending_.empty()) {
        writing_.Clear();
        Serialize(pending_.front(), &writing_);
        pending_.pop_front();
        write_next = true;
      } else {
        write_in_flight_ = false;
        finish = final_status_;
      }
    }
    if (write_next) {
      StartWrite(&writing_);
    } else if (finish) {
      Finish(ToGrpcStatus(*finish));
    }
  }

  void OnCancel() override {
    std::shared_ptr<RunningRequest> running;
    {
      // Every member this reaction reads, it reads under mu_, which OnDone
      // takes before the call can go (gRPC runs OnDone after OnCancel, but
      // through code ThreadSanitizer cannot see).
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      running = running_;
    }
    if (running) running->Cancel();
  }

  void OnDone() override {
    std::shared_ptr<GenerateCall> self;
    {
      absl::MutexLock lock(&mu_);
      self = std::move(self_);
    }
    // `self` may be the last reference: this ends here. Others that still
    // hold the call no longer touch gRPC (the call is finished).
  }

 private:
  GenerateCall(grpc::CallbackServerContext* context,
               absl::Duration default_deadline, RouterMetrics* metrics)
      : deadline_(ClientDeadline(context, default_deadline)),
        record_(absl::Now(), *metrics) {}

  static absl::Time ClientDeadline(grpc::CallbackServerContext* context,
                                   absl::Duration default_deadline) {
    const absl::Time now = absl::Now();
    const absl::Time client = absl::FromChrono(context->deadline());
    // gRPC's "no deadline" is the far future.
    return client - now > absl::Hours(24 * 365) ? now + default_deadline
                                                : client;
  }

  const absl::Time deadline_;

  mutable absl::Mutex mu_;
  std::shared_ptr<GenerateCall> self_ ABSL_GUARDED_BY(mu_);
  RequestRecord record_ ABSL_GUARDED_BY(mu_);
  // The request's handle; set once the orchestrator took the request.
  std::shared_ptr<RunningRequest> running_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool write_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool write_failed_ ABSL_GUARDED_BY(mu_) = false;
  // Messages not written yet, oldest first; one per choice at most.
  std::deque<v1::GenerateResponse> pending_ ABSL_GUARDED_BY(mu_);
  std::optional<absl::Status> final_status_ ABSL_GUARDED_BY(mu_);
  // The message being written; owned by whoever set write_in_flight_.
  grpc::ByteBuffer writing_;
};

}  // namespace

RouterService::RouterService(std::shared_ptr<const ServedModel> model,
                             WorkerRegistry* registry,
                             RequestOrchestrator* orchestrator,
                             const ApiKeys* api_keys,
                             absl::Duration default_deadline,
                             RouterMetrics* metrics,
                             const EtcdDiscovery* discovery)
    : model_(std::move(model)),
      registry_(registry),
      orchestrator_(orchestrator),
      api_keys_(api_keys),
      default_deadline_(default_deadline),
      metrics_(metrics),
      discovery_(discovery) {}

grpc::ServerWriteReactor<grpc::ByteBuffer>* RouterService::Generate(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw) {
  if (absl::Status s = Authorize(*context, *api_keys_); !s.ok()) {
    return new FinishedWriteReactor(s);
  }
  v1::GenerateRequest request;
  if (absl::Status s = ParseRequest(*raw, &request); !s.ok()) {
    return new FinishedWriteReactor(s);
  }
  return GenerateCall::Start(context, request, orchestrator_,
                             default_deadline_, metrics_);
}

grpc::ServerUnaryReactor* RouterService::Tokenize(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw,
    grpc::ByteBuffer* raw_response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  v1::TokenizeRequest parsed;
  v1::TokenizeResponse tokenized;
  const v1::TokenizeRequest* request = &parsed;
  v1::TokenizeResponse* response = &tokenized;
  absl::Status status = Authorize(*context, *api_keys_);
  if (status.ok()) status = ParseRequest(*raw, &parsed);
  if (status.ok()) status = model_->CheckName(request->model());
  if (status.ok() && model_->tokenizer() == nullptr) {
    status = absl::FailedPreconditionError(
        absl::StrCat("model '", model_->name(), "' has no tokenizer"));
  }
  if (status.ok()) {
    const bool add_special =
        !request->has_add_special_tokens() || request->add_special_tokens();
    absl::StatusOr<std::vector<int32_t>> ids =
        model_->tokenizer()->Encode(request->text(), add_special);
    if (ids.ok()) {
      response->mutable_token_ids()->Assign(ids->begin(), ids->end());
    } else {
      status = ids.status();
    }
  }
  if (status.ok()) Serialize(tokenized, raw_response);
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerUnaryReactor* RouterService::ListModels(
    grpc::CallbackServerContext* context, const v1::ListModelsRequest*,
    v1::ListModelsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (absl::Status s = Authorize(*context, *api_keys_); !s.ok()) {
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  v1::ModelInfo* info = response->add_models();
  info->set_name(model_->name());
  info->set_context_length(model_->context_length());
  info->set_vocab_size(model_->vocab_size());
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* RouterService::Health(
    grpc::CallbackServerContext* context, const v1::HealthRequest*,
    v1::HealthResponse* response) {
  response->set_prefill_workers(registry_->healthy_prefill());
  response->set_decode_workers(registry_->healthy_decode());
  for (const WorkerSnapshot& w : registry_->Snapshot()) {
    v1::WorkerStatus* status = response->add_workers();
    status->set_id(w.id);
    status->set_role(w.role == WorkerRole::kPrefill ? "prefill" : "decode");
    status->set_healthy(w.healthy);
    for (const internal::v1::KvTransportCounters& c :
         w.last_report.kv_transports()) {
      v1::KvTransportUsage* usage = status->add_kv_transports();
      usage->set_transport(c.transport());
      usage->set_pushes(c.pushes());
      usage->set_bytes(c.bytes());
      usage->set_fallbacks(c.fallbacks());
    }
  }
  *response->mutable_discovery() = DiscoveryStatus(discovery_);
  response->set_serving(response->decode_workers() > 0);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace pdserve
