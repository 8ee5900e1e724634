#include "router/orchestrator.h"

#include <algorithm>
#include <thread>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "engine/sampler.h"
#include "proto/convert.h"
#include "router/response_assembler.h"

namespace pdserve {
namespace {

namespace wire = ::pdserve::internal::v1;

uint64_t RandomU64() {
  thread_local absl::BitGen gen;
  return absl::Uniform<uint64_t>(gen);
}

v1::FinishReason ToPublic(wire::FinishReason finish) {
  switch (finish) {
    case wire::FINISH_REASON_STOP:
      return v1::FINISH_REASON_STOP;
    case wire::FINISH_REASON_LENGTH:
      return v1::FINISH_REASON_LENGTH;
    default:
      return v1::FINISH_REASON_UNSPECIFIED;
  }
}

// `status` with "what: " in front of its message.
absl::Status Annotate(const absl::Status& status, const std::string& what) {
  return absl::Status(status.code(),
                      absl::StrCat(what, ": ", status.message()));
}

// A downstream call's context, registered with the client's stream for
// cancellation for as long as it lives.
class DownstreamContext {
 public:
  DownstreamContext(GenerateStream& stream, absl::Time deadline)
      : stream_(stream) {
    context_.set_deadline(absl::ToChronoTime(deadline));
    registered_ = stream_.AddDownstream(&context_);
  }
  ~DownstreamContext() {
    if (registered_) stream_.RemoveDownstream(&context_);
  }
  DownstreamContext(const DownstreamContext&) = delete;
  DownstreamContext& operator=(const DownstreamContext&) = delete;

  // False when the client had already cancelled: do not start the call.
  bool ok() const { return registered_; }
  grpc::ClientContext* get() { return &context_; }

 private:
  GenerateStream& stream_;
  grpc::ClientContext context_;
  bool registered_ = false;
};

// The stream of one choice of an n > 1 request: the client's stream, plus
// a cancellation of its own that Fail() sets when another choice failed.
class ChoiceStream final : public GenerateStream {
 public:
  explicit ChoiceStream(GenerateStream& client) : client_(client) {}

  absl::Time deadline() const override { return client_.deadline(); }
  bool AddDownstream(grpc::ClientContext* context) override {
    absl::MutexLock lock(&mu_);
    if (failed_ || !client_.AddDownstream(context)) return false;
    downstream_.push_back(context);
    return true;
  }
  void RemoveDownstream(grpc::ClientContext* context) override {
    absl::MutexLock lock(&mu_);
    client_.RemoveDownstream(context);
    std::erase(downstream_, context);
  }
  bool cancelled() const override {
    absl::MutexLock lock(&mu_);
    return failed_ || client_.cancelled();
  }
  void Send(v1::GenerateResponse message) override {
    client_.Send(std::move(message));
  }

  // Cancels the choice's downstream calls, now and later.
  void Fail() {
    absl::MutexLock lock(&mu_);
    failed_ = true;
    // Under mu_ as in the router's own stream: no context goes meanwhile.
    for (grpc::ClientContext* context : downstream_) context->TryCancel();
  }

 private:
  GenerateStream& client_;
  mutable absl::Mutex mu_;
  bool failed_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<grpc::ClientContext*> downstream_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

// One request's state across its attempts.
struct RequestOrchestrator::Request {
  GenerateStream& stream;
  ValidatedRequest validated;
  // The current attempt's id (a new one per decode worker tried).
  uint64_t id = 0;
  wire::EngineRequest engine;
  ResponseAssembler out;
  absl::Time deadline;
  ChoiceHooks hooks;

  // Tells hooks.on_prompt_cached, the first time only.
  void PromptCached(const WorkerEndpoint* decode) {
    if (hooks.on_prompt_cached)
      std::exchange(hooks.on_prompt_cached, nullptr)(decode);
  }

  int64_t prompt_tokens() const { return engine.prompt_size(); }
  int64_t reserve_tokens() const {
    return engine.prompt_size() + static_cast<int64_t>(engine.max_tokens());
  }
};

// How one attempt on a decode worker ended.
struct RequestOrchestrator::Attempt {
  enum Kind {
    kDone,          // `status` ends the call.
    kDecodeFull,    // No KV blocks on that worker: try another.
    kDecodeFailed,  // It failed before the client got a token: may retry.
  };
  Kind kind = kDone;
  absl::Status status;

  static Attempt Done(absl::Status s) { return {kDone, std::move(s)}; }
};

RequestOrchestrator::RequestOrchestrator(
    std::shared_ptr<const ServedModel> model, WorkerRegistry* registry,
    const Options& options)
    : model_(std::move(model)),
      registry_(registry),
      options_(options),
      // Random start: ids stay unique across router restarts too, as far as
      // the workers' leftover state is concerned.
      next_id_((RandomU64() >> 2) + 1) {}

absl::Status RequestOrchestrator::ClientEnded(const Request& r) const {
  if (absl::Now() >= r.deadline) {
    return absl::DeadlineExceededError("the request's deadline passed");
  }
  if (r.stream.cancelled()) {
    return absl::CancelledError("the client cancelled the request");
  }
  return absl::OkStatus();
}

absl::Status RequestOrchestrator::Run(const v1::GenerateRequest& request,
                                      GenerateStream& stream) {
  PD_ASSIGN_OR_RETURN(ValidatedRequest validated,
                      ValidateGenerateRequest(request, *model_));
  if (!validated.engine.sampling.seed) {
    validated.engine.sampling.seed = RandomU64();
  }
  const std::string request_id =
      request.request_id().empty() ? absl::StrCat("req-", next_id_.fetch_add(1))
                                   : request.request_id();
  if (validated.n == 1) {
    return RunChoice(validated, 0, request_id, stream, {});
  }
  return RunChoices(validated, request_id, stream);
}

absl::Status RequestOrchestrator::RunChoices(const ValidatedRequest& validated,
                                             const std::string& request_id,
                                             GenerateStream& stream) {
  const uint32_t n = validated.n;
  // Choice i runs on choice_streams[i]; choices 1..n-1 on threads of their
  // own, started by choice 0's on_prompt_cached.
  std::vector<std::unique_ptr<ChoiceStream>> choice_streams;
  for (uint32_t i = 0; i < n; ++i) {
    choice_streams.push_back(std::make_unique<ChoiceStream>(stream));
  }
  std::vector<absl::Status> statuses(n);
  auto fail_others = [&](uint32_t failed) {
    for (uint32_t i = 0; i < n; ++i) {
      if (i != failed) choice_streams[i]->Fail();
    }
  };
  std::vector<std::thread> others;
  bool started = false;  // Touched by choice 0's thread (this one) only.
  auto start_others = [&](const WorkerEndpoint* decode) {
    started = true;
    for (uint32_t i = 1; i < n; ++i) {
      others.emplace_back([&, i, decode] {
        statuses[i] = RunChoice(validated, i, request_id, *choice_streams[i],
                                {.prefix_holder = decode});
        if (!statuses[i].ok()) fail_others(i);
      });
    }
  };
  statuses[0] = RunChoice(validated, 0, request_id, *choice_streams[0],
                          {.on_prompt_cached = start_others});
  if (!statuses[0].ok()) {
    fail_others(0);
  } else if (!started) {
    // Choice 0 ended with its first token, on a prefill worker (whose
    // prefix cache holds the prompt now) or by a stop string.
    start_others(nullptr);
  }
  for (std::thread& t : others) t.join();
  // The first failure, in choice order, that is not just another choice's
  // cancellation of this one.
  for (const absl::Status& s : statuses) {
    if (!s.ok() && !absl::IsCancelled(s)) return s;
  }
  for (const absl::Status& s : statuses) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status RequestOrchestrator::RunChoice(const ValidatedRequest& validated,
                                            uint32_t index,
                                            const std::string& request_id,
                                            GenerateStream& stream,
                                            ChoiceHooks hooks) {
  const uint64_t first_id = next_id_.fetch_add(1);
  ResponseAssembler::Options out_options{
      .tokenizer = model_->tokenizer(),
      .skip_special_tokens = validated.skip_special_tokens,
      .stop_strings = validated.stop_strings,
      .logprobs = validated.engine.sampling.logprobs > 0,
      .request_id = request_id,
      .prompt_tokens = static_cast<uint32_t>(validated.engine.prompt.size()),
      .index = index};
  Request r{.stream = stream,
            .validated = validated,
            .id = first_id,
            .engine = {},
            .out = ResponseAssembler(std::move(out_options)),
            .deadline = stream.deadline(),
            .hooks = std::move(hooks)};
  SamplingParams& sampling = r.validated.engine.sampling;
  sampling.seed = ChoiceSeed(*sampling.seed, index);
  if (index > 0) sampling.prompt_logprobs.reset();  // Choice 0 carries them.
  std::vector<const WorkerEndpoint*> tried;
  bool any_full = false;
  bool retried_failure = false;
  absl::Status last_failure;
  for (;;) {
    PD_RETURN_IF_ERROR(ClientEnded(r));
    const WorkerEndpoint* decode = tried.empty() && r.hooks.prefix_holder
                                       ? r.hooks.prefix_holder
                                       : registry_->PickDecode(tried);
    if (decode == nullptr) {
      if (!last_failure.ok()) return last_failure;
      if (any_full) {
        return absl::ResourceExhaustedError(
            "no decode worker has free KV blocks for the request; retry "
            "later");
      }
      return absl::UnavailableError("no healthy decode worker");
    }
    tried.push_back(decode);
    if (tried.size() > 1) r.id = next_id_.fetch_add(1);
    r.validated.engine.id = RequestId(r.id);
    r.engine.Clear();
    ToWire(r.validated.engine, &r.engine);

    Attempt attempt = RunOnDecode(decode, r);
    switch (attempt.kind) {
      case Attempt::kDone:
        return attempt.status;
      case Attempt::kDecodeFull:
        any_full = true;
        break;
      case Attempt::kDecodeFailed:
        PD_LOG(WARNING) << "request " << r.id << ": decode worker "
                        << decode->id
                        << " failed before any token: " << attempt.status;
        if (retried_failure) return attempt.status;
        retried_failure = true;
        last_failure = attempt.status;
        break;
    }
  }
}

RequestOrchestrator::Attempt RequestOrchestrator::RunOnDecode(
    const WorkerEndpoint* decode, Request& r) {
  wire::DecodeRequest decode_request;
  *decode_request.mutable_request() = r.engine;
  const bool disaggregate = decode != r.hooks.prefix_holder &&
                            r.prompt_tokens() > options_.short_prompt_tokens &&
                            registry_->healthy_prefill() > 0;
  if (!disaggregate) {
    return Decode(decode, decode_request, /*disaggregated=*/false, r);
  }

  wire::Landing landing;
  {
    DownstreamContext context(
        r.stream, std::min(r.deadline, absl::Now() + options_.control_timeout));
    if (!context.ok()) return Attempt::Done(ClientEnded(r));
    wire::ReserveRequest reserve;
    reserve.set_request_id(r.id);
    reserve.set_num_tokens(static_cast<uint32_t>(r.reserve_tokens()));
    registry_->NoteDispatched(decode, r.reserve_tokens());
    const absl::Status status = FromGrpcStatus(
        decode->decode->Reserve(context.get(), reserve, &landing));
    if (!status.ok()) {
      if (absl::Status ended = ClientEnded(r); !ended.ok()) {
        return Attempt::Done(ended);
      }
      if (absl::IsResourceExhausted(status)) {
        return {Attempt::kDecodeFull, status};
      }
      if (absl::IsInvalidArgument(status)) {  // See Prefill().
        return Attempt::Done(absl::InternalError(
            absl::StrCat("decode worker ", decode->id,
                         " refused the reservation: ", status.message())));
      }
      registry_->ReportCallFailure(decode, status);
      return {Attempt::kDecodeFailed,
              Annotate(status,
                       absl::StrCat("Reserve on decode worker ", decode->id))};
    }
  }

  absl::StatusOr<wire::PrefillResponse> prefilled = Prefill(landing, r);
  if (!prefilled.ok()) {
    const absl::Status released = Release(decode, r.id);
    // Every prefill worker failing may be the decode worker's fault (they
    // could not reach it); then another decode worker may do.
    if (absl::IsUnavailable(released) && ClientEnded(r).ok()) {
      return {Attempt::kDecodeFailed, prefilled.status()};
    }
    return Attempt::Done(prefilled.status());
  }

  // The first token goes to the client at once: this is the TTFT.
  v1::GenerateResponse message = r.out.NewMessage();
  r.out.AddPromptLogprobs(prefilled->prompt_logprobs(), &message);
  if (absl::Status s = r.out.AddToken(prefilled->first_token(), &message);
      !s.ok()) {
    Release(decode, r.id).IgnoreError();
    return Attempt::Done(s);
  }
  if (prefilled->finish_reason() != wire::FINISH_REASON_UNSPECIFIED ||
      r.out.stopped()) {
    Release(decode, r.id).IgnoreError();
    r.out.Finish(ToPublic(prefilled->finish_reason()), &message);
    r.stream.Send(std::move(message));
    return Attempt::Done(absl::OkStatus());
  }
  r.stream.Send(std::move(message));
  *decode_request.mutable_first_token() = prefilled->first_token();
  return Decode(decode, decode_request, /*disaggregated=*/true, r);
}

absl::StatusOr<wire::PrefillResponse> RequestOrchestrator::Prefill(
    const wire::Landing& landing, Request& r) {
  wire::PrefillRequest request;
  *request.mutable_request() = r.engine;
  *request.mutable_landing() = landing;
  std::vector<const WorkerEndpoint*> tried;
  absl::Status last = absl::UnavailableError("no healthy prefill worker");
  for (int attempt = 0; attempt <= options_.prefill_retries; ++attempt) {
    const WorkerEndpoint* prefill = registry_->PickPrefill(tried);
    if (prefill == nullptr) break;
    tried.push_back(prefill);
    DownstreamContext context(r.stream, r.deadline);
    if (!context.ok()) return ClientEnded(r);
    registry_->NoteDispatched(prefill, r.prompt_tokens());
    wire::PrefillResponse response;
    const absl::Status status = FromGrpcStatus(
        prefill->prefill->Prefill(context.get(), request, &response));
    if (status.ok()) return response;
    PD_RETURN_IF_ERROR(ClientEnded(r));
    registry_->ReportCallFailure(prefill, status);
    last = Annotate(status, absl::StrCat("prefill worker ", prefill->id));
    PD_LOG(WARNING) << "request " << r.id << ": " << last;
    // The router checked everything the client sent, so a worker refusing
    // the request (or the landing) is the cluster's fault, not the
    // client's; another prefill worker would refuse it too.
    if (absl::IsInvalidArgument(status)) {
      return absl::InternalError(last.message());
    }
  }
  return absl::UnavailableError(
      absl::StrCat("prefill failed on ", tried.size(),
                   " worker(s); last error: ", last.message()));
}

RequestOrchestrator::Attempt RequestOrchestrator::Decode(
    const WorkerEndpoint* decode, const wire::DecodeRequest& decode_request,
    bool disaggregated, Request& r) {
  DownstreamContext context(r.stream, r.deadline);
  if (!context.ok()) {
    if (disaggregated) Release(decode, r.id).IgnoreError();
    return Attempt::Done(ClientEnded(r));
  }
  if (!disaggregated) registry_->NoteDispatched(decode, r.reserve_tokens());
  std::unique_ptr<grpc::ClientReader<wire::DecodeResponse>> reader =
      decode->decode->Decode(context.get(), decode_request);

  bool finished = false;
  absl::Status token_error;
  wire::DecodeResponse response;
  while (!finished && reader->Read(&response)) {
    // The worker's engine holds the prompt's KV now, in its prefix cache.
    r.PromptCached(decode);
    v1::GenerateResponse message = r.out.NewMessage();
    r.out.AddPromptLogprobs(response.prompt_logprobs(), &message);
    for (const wire::SampledToken& token : response.tokens()) {
      token_error = r.out.AddToken(token, &message);
      if (!token_error.ok() || r.out.stopped()) break;
    }
    if (!token_error.ok()) break;
    if (r.out.stopped() ||
        response.finish_reason() != wire::FINISH_REASON_UNSPECIFIED) {
      r.out.Finish(ToPublic(response.finish_reason()), &message);
      finished = true;
    }
    if (message.token_ids_size() > 0 || finished) {
      r.stream.Send(std::move(message));
    }
  }
  // A stop string ends the request before the worker would: cancel it. After
  // a finish reason the worker ends the stream itself.
  if (r.out.stopped() || !token_error.ok()) context.get()->TryCancel();
  const absl::Status status = FromGrpcStatus(reader->Finish());
  if (finished) return Attempt::Done(absl::OkStatus());
  if (!token_error.ok()) {
    if (disaggregated) Release(decode, r.id).IgnoreError();
    return Attempt::Done(token_error);
  }
  if (absl::Status ended = ClientEnded(r); !ended.ok()) {
    // The worker frees a cancelled decode itself; the release covers a
    // Decode call that never reached it.
    if (disaggregated) Release(decode, r.id).IgnoreError();
    return Attempt::Done(ended);
  }
  const absl::Status failure =
      status.ok()
          ? absl::UnavailableError("the stream ended without a finish reason")
          : status;
  registry_->ReportCallFailure(decode, failure);
  if (disaggregated && !absl::IsUnavailable(failure))
    Release(decode, r.id).IgnoreError();
  const std::string where = absl::StrCat("decode worker ", decode->id);
  if (r.out.completion_tokens() == 0) {
    if (absl::IsResourceExhausted(failure)) {
      return {Attempt::kDecodeFull, failure};
    }
    if (absl::IsInvalidArgument(failure)) {
      // As for prefill: the request was checked, so this is internal.
      return Attempt::Done(absl::InternalError(
          absl::StrCat(where, " refused the request: ", failure.message())));
    }
    return {Attempt::kDecodeFailed, Annotate(failure, where)};
  }
  PD_LOG(WARNING) << "request " << r.id << ": " << where << " failed after "
                  << r.out.completion_tokens() << " tokens: " << failure;
  return Attempt::Done(absl::UnavailableError(
      absl::StrCat(where, " failed after ", r.out.completion_tokens(),
                   " tokens: ", failure.message())));
}

absl::Status RequestOrchestrator::Release(const WorkerEndpoint* decode,
                                          uint64_t request_id) {
  grpc::ClientContext context;
  context.set_deadline(
      absl::ToChronoTime(absl::Now() + options_.control_timeout));
  wire::ReleaseRequest request;
  request.set_request_id(request_id);
  wire::ReleaseResponse response;
  const absl::Status status =
      FromGrpcStatus(decode->decode->Release(&context, request, &response));
  if (!status.ok()) {
    PD_LOG(WARNING) << "request " << request_id << ": Release on decode worker "
                    << decode->id << " failed: " << status;
    registry_->ReportCallFailure(decode, status);
  }
  return status;
}

}  // namespace pdserve
