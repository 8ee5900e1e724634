#include "router/orchestrator.h"

#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/drain.h"
#include "common/log.h"
#include "engine/kv_layout.h"
#include "engine/sampler.h"
#include "grpcpp/grpcpp.h"
#include "proto/convert.h"
#include "router/response_assembler.h"
#include "router/router_metrics.h"

namespace pdserve {
namespace {

namespace wire = ::pdserve::internal::v1;

// How early before the request's deadline a downstream call's
// DEADLINE_EXCEEDED still counts as that deadline (Choice::ClientEnded).
constexpr absl::Duration kDeadlineSlack = absl::Milliseconds(20);

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

// The handle of a request that ended inside Start (refused or invalid).
class EndedRequest final : public RunningRequest {
 public:
  void Cancel() override {}
};

}  // namespace

// One choice of a request: a state machine over gRPC callback calls.
// Its steps run one at a time (each starts the next call from the previous
// one's completion), so the attempt state needs no lock; mu_ guards what
// Cancel() touches from other threads. The admission fields are the
// orchestrator's, under its mu_.
class RequestOrchestrator::Choice final
    : public std::enable_shared_from_this<Choice> {
 public:
  Choice(RequestOrchestrator* orchestrator, std::shared_ptr<Request> request,
         const ValidatedRequest& validated, const std::string& request_id,
         uint32_t index, const WorkerEndpoint* preferred, absl::Time deadline,
         int32_t priority);

  // Starts the choice on decode worker `decode` (its blocks committed).
  void Run(const WorkerEndpoint* decode);
  // Ends the choice with `status`; only the first call counts.
  void End(absl::Status status);
  void Cancel();

  // The Decode stream's reactions (DecodeCall).
  // Takes one message; false when the choice wants no more (a stop string
  // or a bad token: the call is then cancelled).
  bool OnDecodeMessage(const wire::DecodeResponse& response);
  // The stream ended with `status`; `stalled`: the stall watch cancelled it.
  void OnDecodeDone(const absl::Status& status, bool stalled);

  // Admission state: the orchestrator's mu_.
  QueueKey key;
  bool queued = false;
  const WorkerEndpoint* committed_on = nullptr;
  int64_t committed_blocks = 0;
  // Decode workers tried (failed or full), for admission's choice.
  std::vector<const WorkerEndpoint*> tried;
  // The last decode failure, UNAVAILABLE, once the choice migrated; ends
  // the choice when no other worker is left.
  absl::Status last_failure;
  // The routing policy's choice for the current attempt.
  RouteDecision route;

  const uint32_t index;
  const WorkerEndpoint* const preferred;
  const absl::Time deadline;
  const int32_t priority;
  const int64_t reserve_tokens;
  const absl::Time created = absl::Now();

  std::span<const int32_t> prompt() const { return validated_.engine.prompt; }
  int32_t max_tokens() const {
    return static_cast<int32_t>(validated_.engine.sampling.max_tokens);
  }

 private:
  // CANCELLED or DEADLINE_EXCEEDED when the client's call is over.
  absl::Status ClientEnded() const;
  // The same after a downstream call failed with `call`: also
  // DEADLINE_EXCEEDED when the call ran out of time under the request's
  // own deadline (not the worker's failure, and no time for another).
  // gRPC may say so a little before absl::Now() reaches the deadline: the
  // worker's end computes it from the grpc-timeout header with its cached
  // clock (up to 4 ms early seen here under load); kDeadlineSlack covers
  // that.
  absl::Status ClientEnded(const absl::Status& call) const;
  // A context for the next call, registered for Cancel(); null when the
  // choice was cancelled already (do not start the call).
  std::shared_ptr<grpc::ClientContext> NewContext(absl::Time deadline);
  void CallDone();

  void StartReserve();
  void OnReserved(const absl::Status& status);
  void StartPrefill();
  void OnPrefilled(const absl::Status& status);
  // Every prefill worker failed with `status`: release the landing, then
  // try another decode worker when the release says this one is down.
  void PrefillFailed(absl::Status status);
  void StartDecode();
  // Adds `token` to `message` for the client and keeps its id, which a
  // migration resumes from.
  absl::Status Relay(const wire::SampledToken& token,
                     v1::GenerateResponse* message);
  // This decode worker answered that it has no room: another one, or the
  // queue.
  void RetryFull();
  // This decode worker is draining (common/drain.h) and refused the new
  // work: back to admission, neither a migration nor a failure; the
  // registry no longer offers the worker.
  void Redirect();
  // This decode worker failed with `failure` (naming it): the choice goes
  // on elsewhere from the tokens relayed so far, or ends UNAVAILABLE when
  // the migration limit is spent.
  void Migrate(const absl::Status& failure);
  // Back to admission, this decode worker excluded; `failure` (when set)
  // ends the choice if no other worker can take it.
  void Readmit(absl::Status failure);
  void ReleaseLanding();

  RequestOrchestrator* const orchestrator_;
  const std::shared_ptr<Request> request_;
  ValidatedRequest validated_;
  ResponseAssembler out_;

  // The request as the client sent it, which a migration extends.
  const size_t original_prompt_tokens_;
  const int32_t original_max_tokens_;
  // The ids of the tokens relayed to the client, in order.
  std::vector<int32_t> generated_;
  // Moves to other decode workers so far.
  int32_t migrations_ = 0;
  // Sent back to admission by a migration and not placed yet (metrics).
  bool migrating_ = false;

  // The current attempt.
  const WorkerEndpoint* decode_ = nullptr;
  uint64_t id_ = 0;
  wire::EngineRequest engine_;
  bool disaggregated_ = false;
  wire::ReserveRequest reserve_;
  wire::Landing landing_;
  std::vector<const WorkerEndpoint*> tried_prefill_;
  // Those of tried_prefill_ that refused as draining: no failed attempt.
  int32_t draining_prefill_ = 0;
  absl::Status last_prefill_error_;
  wire::PrefillResponse prefilled_;
  wire::SampledToken first_token_;
  // Decode stream outcome.
  bool finished_ = false;
  absl::Status token_error_;
  bool prompt_cached_ = false;

  // The deadline of the current call (NewContext).
  absl::Time call_deadline_ = absl::InfinitePast();

  mutable absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  std::shared_ptr<grpc::ClientContext> context_ ABSL_GUARDED_BY(mu_);
};

// One request: its choices, and its stream until it finishes.
class RequestOrchestrator::Request final
    : public RunningRequest,
      public std::enable_shared_from_this<Request> {
 public:
  Request(RequestOrchestrator* orchestrator,
          std::shared_ptr<GenerateStream> stream, ValidatedRequest validated,
          std::string request_id, int32_t priority)
      : orchestrator_(orchestrator),
        validated_(std::move(validated)),
        request_id_(std::move(request_id)),
        priority_(priority),
        n_(validated_.n),
        deadline_(stream->deadline()),
        stream_(std::move(stream)),
        choices_(n_),
        statuses_(n_),
        remaining_(static_cast<int>(n_)) {}

  // Creates choice `index` and admits it.
  void StartChoice(uint32_t index, const WorkerEndpoint* preferred) {
    auto choice = std::make_shared<Choice>(orchestrator_, shared_from_this(),
                                           validated_, request_id_, index,
                                           preferred, deadline_, priority_);
    bool cancelled;
    {
      absl::MutexLock lock(&mu_);
      choices_[index] = choice;
      cancelled = cancelled_;
    }
    orchestrator_->CallStarted();
    if (cancelled) {
      choice->End(absl::CancelledError("the client cancelled the request"));
    } else {
      orchestrator_->Admit(choice);
    }
  }

  void Cancel() override {
    std::vector<std::shared_ptr<Choice>> choices;
    {
      absl::MutexLock lock(&mu_);
      if (cancelled_) return;
      cancelled_ = true;
      choices = choices_;
    }
    for (auto& c : choices) {
      if (c) c->Cancel();
    }
  }

  void Send(v1::GenerateResponse message) {
    // stream_ is only reset once every choice ended, after their last Send.
    stream_->Send(std::move(message));
  }

  // Choice 0's prompt KV is in `decode`'s prefix cache: the others start.
  void PromptCached(const WorkerEndpoint* decode) {
    if (n_ == 1) return;
    {
      absl::MutexLock lock(&mu_);
      if (others_started_ || cancelled_ || failed_) return;
      others_started_ = true;
    }
    for (uint32_t i = 1; i < n_; ++i) StartChoice(i, decode);
  }

  void ChoiceDone(uint32_t index, absl::Status status) {
    std::vector<std::shared_ptr<Choice>> to_cancel;
    bool start_others = false;
    std::shared_ptr<GenerateStream> stream;
    absl::Status final_status;
    {
      absl::MutexLock lock(&mu_);
      statuses_[index] = std::move(status);
      --remaining_;
      if (!statuses_[index].ok()) {
        failed_ = true;
        for (auto& c : choices_) {
          if (c) to_cancel.push_back(c);
        }
      }
      if (index == 0 && !others_started_ && n_ > 1) {
        others_started_ = true;
        if (statuses_[0].ok() && !cancelled_) {
          // Choice 0 ended with its first token, on a prefill worker
          // (whose prefix cache holds the prompt now) or by a stop string.
          start_others = true;
        } else {
          // The others never start.
          remaining_ -= static_cast<int>(n_ - 1);
          for (uint32_t i = 1; i < n_; ++i) {
            statuses_[i] = absl::CancelledError("another choice failed");
          }
        }
      }
      if (remaining_ == 0) {
        stream = std::move(stream_);
        final_status = FinalStatus();
        choices_.clear();
      }
    }
    for (auto& c : to_cancel) c->Cancel();
    if (start_others) {
      for (uint32_t i = 1; i < n_; ++i) StartChoice(i, nullptr);
    }
    if (stream) {
      stream->End(final_status);
      orchestrator_->running_.fetch_sub(1, std::memory_order_relaxed);
    }
  }

 private:
  // The first failure, in choice order, that is not just another choice's
  // cancellation of this one.
  absl::Status FinalStatus() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const absl::Status& s : statuses_) {
      if (!s.ok() && !absl::IsCancelled(s)) return s;
    }
    for (const absl::Status& s : statuses_) {
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }

  RequestOrchestrator* const orchestrator_;
  const ValidatedRequest validated_;
  const std::string request_id_;
  const int32_t priority_;
  const uint32_t n_;
  const absl::Time deadline_;

  absl::Mutex mu_;
  std::shared_ptr<GenerateStream> stream_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<Choice>> choices_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Status> statuses_ ABSL_GUARDED_BY(mu_);
  int remaining_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool failed_ ABSL_GUARDED_BY(mu_) = false;
  bool others_started_ ABSL_GUARDED_BY(mu_) = false;
};

// One Decode stream: a read reactor that hands each message to its choice
// and deletes itself when the call is done.
class RequestOrchestrator::DecodeCall final
    : public grpc::ClientReadReactor<wire::DecodeResponse> {
 public:
  DecodeCall(RequestOrchestrator* orchestrator, std::shared_ptr<Choice> choice,
             std::shared_ptr<grpc::ClientContext> context)
      : orchestrator_(orchestrator),
        choice_(std::move(choice)),
        context_(std::move(context)) {}

  void Start(const WorkerEndpoint* decode, wire::DecodeRequest request) {
    request_ = std::move(request);
    orchestrator_->WatchStream(this);
    decode->decode->async()->Decode(context_.get(), &request_, this);
    StartRead(&response_);
    StartCall();
  }

  // The stall watch, under its mutex: true (once) when the stream sent a
  // message and none since `silent_since` (absl::GetCurrentTimeNanos).
  bool MarkIfStalled(int64_t silent_since) {
    const int64_t last = last_message_nanos_.load(std::memory_order_relaxed);
    if (stalled_ || last == 0 || last >= silent_since) return false;
    stalled_ = true;
    return true;
  }
  // Whether MarkIfStalled said so; under the watch's mutex.
  bool stalled() const { return stalled_; }
  const std::shared_ptr<grpc::ClientContext>& context() const {
    return context_;
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // OnDone follows.
    last_message_nanos_.store(absl::GetCurrentTimeNanos(),
                              std::memory_order_relaxed);
    if (!wanted_ || !choice_->OnDecodeMessage(response_)) {
      // A stop string or a bad token ended the choice before the worker
      // would: cancel it (its completion comes after this reaction).
      if (wanted_) context_->TryCancel();
      wanted_ = false;
    }
    response_.Clear();
    StartRead(&response_);
  }

  void OnDone(const grpc::Status& status) override {
    const bool stalled = orchestrator_->UnwatchStream(this);
    choice_->OnDecodeDone(FromGrpcStatus(status), stalled);
    delete this;
  }

 private:
  RequestOrchestrator* const orchestrator_;
  const std::shared_ptr<Choice> choice_;
  const std::shared_ptr<grpc::ClientContext> context_;
  wire::DecodeRequest request_;
  wire::DecodeResponse response_;
  bool wanted_ = true;
  // When the last message came; 0 before the first (a stream is watched
  // only once it runs: a parked decode has the reservation's timeout).
  std::atomic<int64_t> last_message_nanos_ = 0;
  // Set by the stall watch under its mutex, read in OnDone under it.
  bool stalled_ = false;
};

RequestOrchestrator::Choice::Choice(RequestOrchestrator* orchestrator,
                                    std::shared_ptr<Request> request,
                                    const ValidatedRequest& validated,
                                    const std::string& request_id,
                                    uint32_t index,
                                    const WorkerEndpoint* preferred,
                                    absl::Time deadline, int32_t priority)
    : index(index),
      preferred(preferred),
      deadline(deadline),
      priority(priority),
      reserve_tokens(static_cast<int64_t>(validated.engine.prompt.size()) +
                     validated.engine.sampling.max_tokens),
      orchestrator_(orchestrator),
      request_(std::move(request)),
      validated_(validated),
      out_(ResponseAssembler::Options{
          .tokenizer = orchestrator->model_->tokenizer(),
          .skip_special_tokens = validated.skip_special_tokens,
          .stop_strings = validated.stop_strings,
          .logprobs = validated.engine.sampling.logprobs > 0,
          .request_id = request_id,
          .prompt_tokens =
              static_cast<uint32_t>(validated.engine.prompt.size()),
          .index = index}),
      original_prompt_tokens_(validated.engine.prompt.size()),
      original_max_tokens_(validated.engine.sampling.max_tokens),
      id_(orchestrator->NewId()) {
  SamplingParams& sampling = validated_.engine.sampling;
  sampling.seed = ChoiceSeed(*sampling.seed, index);
  if (index > 0) sampling.prompt_logprobs.reset();  // Choice 0 carries them.
  // Grown past this only by long generations, a few times each.
  generated_.reserve(std::min(original_max_tokens_, 1024));
}

absl::Status RequestOrchestrator::Choice::ClientEnded() const {
  if (absl::Now() >= deadline) {
    return absl::DeadlineExceededError("the request's deadline passed");
  }
  absl::MutexLock lock(&mu_);
  if (cancelled_) {
    return absl::CancelledError("the client cancelled the request");
  }
  return absl::OkStatus();
}

absl::Status RequestOrchestrator::Choice::ClientEnded(
    const absl::Status& call) const {
  if (absl::IsDeadlineExceeded(call) && call_deadline_ >= deadline &&
      absl::Now() + kDeadlineSlack >= deadline) {
    return absl::DeadlineExceededError("the request's deadline passed");
  }
  return ClientEnded();
}

std::shared_ptr<grpc::ClientContext> RequestOrchestrator::Choice::NewContext(
    absl::Time call_deadline) {
  call_deadline_ = call_deadline;
  std::shared_ptr<grpc::ClientContext> context =
      orchestrator_->NewCallContext(call_deadline);
  absl::MutexLock lock(&mu_);
  if (cancelled_) return nullptr;
  context_ = context;
  return context;
}

void RequestOrchestrator::Choice::CallDone() {
  absl::MutexLock lock(&mu_);
  context_.reset();
}

void RequestOrchestrator::Choice::Cancel() {
  std::shared_ptr<grpc::ClientContext> context;
  {
    absl::MutexLock lock(&mu_);
    if (cancelled_ || ended_) return;
    cancelled_ = true;
    context = context_;
  }
  // Outside mu_: gRPC may run the call's completion inline.
  if (context) context->TryCancel();
  if (orchestrator_->Dequeue(*this)) End(ClientEnded());
}

void RequestOrchestrator::Choice::End(absl::Status status) {
  {
    absl::MutexLock lock(&mu_);
    if (ended_) return;
    ended_ = true;
    context_.reset();
  }
  if (migrating_ && orchestrator_->metrics_ != nullptr) {
    // Admission ended it: no decode worker took it, or its client left.
    orchestrator_->metrics_->Migrated(
        absl::IsCancelled(status) || absl::IsDeadlineExceeded(status)
            ? "abandoned"
            : "no_worker");
  }
  orchestrator_->Uncommit(*this);
  request_->ChoiceDone(index, std::move(status));
  orchestrator_->CallEnded();
}

void RequestOrchestrator::Choice::Run(const WorkerEndpoint* decode) {
  if (absl::Status ended = ClientEnded(); !ended.ok()) return End(ended);
  if (migrating_) {
    migrating_ = false;
    if (orchestrator_->metrics_ != nullptr) {
      orchestrator_->metrics_->Migrated("continued");
    }
  }
  if (decode_ != nullptr) id_ = orchestrator_->NewId();  // A new attempt.
  decode_ = decode;
  validated_.engine.id = RequestId(id_);
  engine_.Clear();
  ToWire(validated_.engine, &engine_);
  // The policy chose where the prompt is computed: a prefill worker, or
  // this decode worker (conditional disaggregation, and the choices after
  // the first, which find the prompt in their worker's cache).
  disaggregated_ = route.prefill != nullptr;
  if (disaggregated_) {
    // The prompt counts on the prefill worker from the decision on, not
    // from its Prefill call a Reserve round trip later: the requests of a
    // burst, placed before any Reserve is answered, see each other.
    orchestrator_->registry_->NoteDispatched(route.prefill, engine_.prompt_size());
    StartReserve();
  } else {
    orchestrator_->registry_->NoteDispatched(decode_, reserve_tokens);
    StartDecode();
  }
}

void RequestOrchestrator::Choice::StartReserve() {
  std::shared_ptr<grpc::ClientContext> context = NewContext(std::min(
      deadline, absl::Now() + orchestrator_->options_.control_timeout));
  if (!context) return End(ClientEnded());
  reserve_.set_request_id(id_);
  reserve_.set_num_tokens(static_cast<uint32_t>(reserve_tokens));
  // The decode worker shares the leading blocks its cache holds; the
  // landing says how many, and the prefill worker pushes only the rest.
  reserve_.set_prompt_tokens(static_cast<uint32_t>(engine_.prompt_size()));
  reserve_.mutable_prompt_block_hashes()->Assign(
      route.prompt_block_hashes.begin(), route.prompt_block_hashes.end());
  landing_.Clear();
  orchestrator_->registry_->NoteDispatched(decode_, reserve_tokens);
  decode_->decode->async()->Reserve(
      context.get(), &reserve_, &landing_,
      [self = shared_from_this(), context](grpc::Status status) {
        self->OnReserved(FromGrpcStatus(status));
      });
}

void RequestOrchestrator::Choice::OnReserved(const absl::Status& status) {
  CallDone();
  if (status.ok()) {
    tried_prefill_.clear();
    draining_prefill_ = 0;
    last_prefill_error_ = absl::UnavailableError("no healthy prefill worker");
    return StartPrefill();
  }
  if (absl::Status ended = ClientEnded(status); !ended.ok()) {
    // Cut short, it may have reserved all the same.
    ReleaseLanding();
    return End(ended);
  }
  if (absl::IsResourceExhausted(status)) return RetryFull();
  if (IsDrainingRefusal(status)) {
    orchestrator_->registry_->ReportCallFailure(decode_, status);
    return Redirect();
  }
  if (absl::IsInvalidArgument(status)) {  // See OnPrefilled().
    return End(absl::InternalError(
        absl::StrCat("decode worker ", decode_->id,
                     " refused the reservation: ", status.message())));
  }
  orchestrator_->registry_->ReportCallFailure(decode_, status);
  // Unanswered: the worker may have made the reservation and the answer
  // been lost (a partition). Release it, retried until the worker hears
  // it, rather than leave its blocks to the reservation timeout; the next
  // attempt has a new id, so this never releases that one.
  if (absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status)) ReleaseLanding();
  Migrate(Annotate(status, absl::StrCat("Reserve on decode worker ", decode_->id)));
}

void RequestOrchestrator::Choice::StartPrefill() {
  // The policy's prefill worker first; after a failure the least loaded
  // of the others.
  const WorkerEndpoint* prefill = nullptr;
  if (tried_prefill_.empty()) {
    prefill = route.prefill;
  } else if (static_cast<int>(tried_prefill_.size()) - draining_prefill_ <=
             orchestrator_->options_.prefill_retries) {
    prefill = orchestrator_->registry_->PickPrefill(tried_prefill_);
    if (prefill != nullptr && orchestrator_->metrics_ != nullptr) {
      orchestrator_->metrics_->Retried("prefill");
    }
  }
  if (prefill == nullptr && IsDrainingRefusal(last_prefill_error_)) {
    // The last prefill worker asked drains and no other is left: the
    // choice is placed anew, and may be prefilled by its decode worker.
    ReleaseLanding();
    return Redirect();
  }
  if (prefill == nullptr) {
    return PrefillFailed(absl::UnavailableError(absl::StrCat(
        "prefill failed on ", tried_prefill_.size(),
        " worker(s); last error: ", last_prefill_error_.message())));
  }
  tried_prefill_.push_back(prefill);
  std::shared_ptr<grpc::ClientContext> context = NewContext(deadline);
  if (!context) {
    ReleaseLanding();
    return End(ClientEnded());
  }
  auto request = std::make_shared<wire::PrefillRequest>();
  *request->mutable_request() = engine_;
  *request->mutable_landing() = landing_;
  prefilled_.Clear();
  // The policy's choice was counted when it was made (Run).
  if (tried_prefill_.size() > 1) {
    orchestrator_->registry_->NoteDispatched(prefill, engine_.prompt_size());
  }
  prefill->prefill->async()->Prefill(
      context.get(), request.get(), &prefilled_,
      [self = shared_from_this(), context, request](grpc::Status status) {
        self->OnPrefilled(FromGrpcStatus(status));
      });
}

void RequestOrchestrator::Choice::OnPrefilled(const absl::Status& status) {
  CallDone();
  if (!status.ok()) {
    if (absl::Status ended = ClientEnded(status); !ended.ok()) {
      ReleaseLanding();
      return End(ended);
    }
    const WorkerEndpoint* prefill = tried_prefill_.back();
    orchestrator_->registry_->ReportCallFailure(prefill, status);
    last_prefill_error_ =
        Annotate(status, absl::StrCat("prefill worker ", prefill->id));
    if (IsDrainingRefusal(status)) {
      ++draining_prefill_;
    } else {
      PD_LOG(WARNING) << "request " << id_ << ": " << last_prefill_error_;
    }
    // The router checked everything the client sent, so a worker refusing
    // the request (or the landing) is the cluster's fault, not the
    // client's; another prefill worker would refuse it too.
    if (absl::IsInvalidArgument(status)) {
      ReleaseLanding();
      return End(absl::InternalError(last_prefill_error_.message()));
    }
    return StartPrefill();
  }

  // The first token goes to the client at once: this is the TTFT.
  v1::GenerateResponse message = out_.NewMessage();
  out_.AddPromptLogprobs(prefilled_.prompt_logprobs(), &message);
  if (absl::Status s = Relay(prefilled_.first_token(), &message); !s.ok()) {
    ReleaseLanding();
    return End(s);
  }
  if (prefilled_.finish_reason() != wire::FINISH_REASON_UNSPECIFIED ||
      out_.stopped()) {
    ReleaseLanding();
    out_.Finish(ToPublic(prefilled_.finish_reason()), &message);
    request_->Send(std::move(message));
    return End(absl::OkStatus());
  }
  request_->Send(std::move(message));
  first_token_ = prefilled_.first_token();
  prefilled_.Clear();
  StartDecode();
}

void RequestOrchestrator::Choice::PrefillFailed(absl::Status status) {
  // Every prefill worker failing may be the decode worker's fault (they
  // could not reach it); then another decode worker may do.
  orchestrator_->Release(
      decode_, id_,
      [self = shared_from_this(), status](const absl::Status& released) {
        // Unanswered (down, or cut off by the network): another decode
        // worker may do. The Release goes on being retried meanwhile.
        if ((absl::IsUnavailable(released) ||
             absl::IsDeadlineExceeded(released)) &&
            self->ClientEnded().ok()) {
          return self->Migrate(Annotate(
              status, absl::StrCat("decode worker ", self->decode_->id,
                                   " is unreachable and")));
        }
        self->End(status);
      });
}

void RequestOrchestrator::Choice::ReleaseLanding() {
  orchestrator_->Release(decode_, id_, nullptr);
}

void RequestOrchestrator::Choice::StartDecode() {
  std::shared_ptr<grpc::ClientContext> context = NewContext(deadline);
  if (!context) {
    if (disaggregated_) ReleaseLanding();
    return End(ClientEnded());
  }
  wire::DecodeRequest request;
  *request.mutable_request() = engine_;
  if (disaggregated_) *request.mutable_first_token() = first_token_;
  finished_ = false;
  token_error_ = absl::OkStatus();
  auto* call =
      new DecodeCall(orchestrator_, shared_from_this(), std::move(context));
  call->Start(decode_, std::move(request));
}

bool RequestOrchestrator::Choice::OnDecodeMessage(
    const wire::DecodeResponse& response) {
  if (!prompt_cached_) {
    // The worker's engine holds the prompt's KV now, in its prefix cache.
    prompt_cached_ = true;
    if (index == 0) request_->PromptCached(decode_);
  }
  v1::GenerateResponse message = out_.NewMessage();
  out_.AddPromptLogprobs(response.prompt_logprobs(), &message);
  for (const wire::SampledToken& token : response.tokens()) {
    token_error_ = Relay(token, &message);
    if (!token_error_.ok() || out_.stopped()) break;
  }
  if (!token_error_.ok()) return false;
  if (out_.stopped() ||
      response.finish_reason() != wire::FINISH_REASON_UNSPECIFIED) {
    out_.Finish(ToPublic(response.finish_reason()), &message);
    finished_ = true;
  }
  if (message.token_ids_size() > 0 || finished_) {
    request_->Send(std::move(message));
  }
  // After a finish reason the worker ends the stream itself.
  return !out_.stopped();
}

void RequestOrchestrator::Choice::OnDecodeDone(const absl::Status& status,
                                               bool stalled) {
  CallDone();
  if (finished_) return End(absl::OkStatus());
  if (!token_error_.ok()) {
    if (disaggregated_) ReleaseLanding();
    return End(token_error_);
  }
  if (absl::Status ended = ClientEnded(status); !ended.ok()) {
    // The worker frees a cancelled decode itself; the release covers a
    // Decode call that never reached it.
    if (disaggregated_) ReleaseLanding();
    return End(ended);
  }
  absl::Status failure = status;
  if (stalled) {
    failure = absl::UnavailableError(absl::StrCat(
        "no token for ",
        absl::FormatDuration(orchestrator_->options_.decode_stall_timeout),
        " (stalled; the call was cancelled)"));
  } else if (status.ok()) {
    failure = absl::UnavailableError("the stream ended without a finish reason");
  }
  orchestrator_->registry_->ReportCallFailure(decode_, failure);
  if (IsDrainingRefusal(failure)) {
    // Refused before it started (a local prefill): no token came from it.
    if (disaggregated_) ReleaseLanding();
    return Redirect();
  }
  // A Decode the network lost on its way never took the reservation; the
  // worker ignores a Release for a reservation a Decode already took.
  if (disaggregated_) ReleaseLanding();
  if (absl::IsInvalidArgument(failure)) {
    // As for prefill: the request was checked, so this is internal.
    return End(absl::InternalError(absl::StrCat(
        "decode worker ", decode_->id, " refused the request: ", failure.message())));
  }
  if (absl::IsResourceExhausted(failure) && generated_.empty()) return RetryFull();
  Migrate(Annotate(failure, absl::StrCat("decode worker ", decode_->id, " failed after ",
                                         generated_.size(), " tokens")));
}

absl::Status RequestOrchestrator::Choice::Relay(const wire::SampledToken& token,
                                                v1::GenerateResponse* message) {
  if (absl::Status s = out_.AddToken(token, message); !s.ok()) return s;
  generated_.push_back(token.token_id());
  return absl::OkStatus();
}

void RequestOrchestrator::Choice::RetryFull() {
  if (orchestrator_->metrics_ != nullptr) {
    orchestrator_->metrics_->Retried("decode");
  }
  Readmit(absl::OkStatus());
}

void RequestOrchestrator::Choice::Redirect() {
  if (orchestrator_->metrics_ != nullptr) {
    orchestrator_->metrics_->Retried("decode");
  }
  orchestrator_->Uncommit(*this);
  orchestrator_->Admit(shared_from_this());
}

void RequestOrchestrator::Choice::Migrate(const absl::Status& failure) {
  const int32_t limit = orchestrator_->options_.migration_limit;
  const int32_t sent = static_cast<int32_t>(generated_.size());
  PD_LOG(WARNING) << "request " << id_ << ": " << failure << "; "
                  << (migrations_ < limit ? "migrating" : "not migrating")
                  << " (migration " << migrations_ + 1 << ", limit " << limit
                  << ")";
  if (migrations_ >= limit) {
    if (orchestrator_->metrics_ != nullptr) {
      orchestrator_->metrics_->Migrated("limit_spent");
    }
    return End(absl::UnavailableError(absl::StrCat(
        failure.message(), "; ", migrations_,
        " migration(s) tried, the limit (migration_limit ", limit, ")")));
  }
  const int32_t left = original_max_tokens_ - sent;
  if (left < 1) {  // The worker sent the last token without its finish.
    return End(absl::InternalError(absl::StrCat(
        failure.message(), "; all ", sent, " tokens were sent without a finish reason")));
  }
  ++migrations_;
  migrating_ = true;
  // Resume from what the client has: the tokens sent become the prompt's
  // tail, generated again by nobody.
  GenerationRequest& engine = validated_.engine;
  engine.prompt.resize(original_prompt_tokens_);
  engine.prompt.insert(engine.prompt.end(), generated_.begin(), generated_.end());
  engine.resumed_tokens = sent;
  engine.sampling.max_tokens = left;
  // Sent with the first token already.
  if (sent > 0) engine.sampling.prompt_logprobs.reset();
  Readmit(absl::UnavailableError(absl::StrCat(
      failure.message(), "; no other decode worker could take it (",
      migrations_, " migration(s) tried)")));
}

void RequestOrchestrator::Choice::Readmit(absl::Status failure) {
  orchestrator_->Uncommit(*this);
  {
    absl::MutexLock lock(&orchestrator_->mu_);
    tried.push_back(decode_);
    if (!failure.ok()) last_failure = std::move(failure);
  }
  orchestrator_->Admit(shared_from_this());
}

RequestOrchestrator::RequestOrchestrator(
    std::shared_ptr<const ServedModel> model, WorkerRegistry* registry,
    RouterMetrics* metrics, const Options& options)
    : model_(std::move(model)),
      registry_(registry),
      metrics_(metrics),
      options_(options),
      // Random start: ids stay unique across router restarts too, as far as
      // the workers' leftover state is concerned.
      next_id_((RandomU64() >> 2) + 1),
      admission_([this] { AdmissionLoop(); }),
      stall_watch_([this] { StallWatchLoop(); }) {}

RequestOrchestrator::~RequestOrchestrator() {
  Stop();
  WaitUntilIdle();
  {
    absl::MutexLock lock(&streams_mu_);
    watch_stopping_ = true;
    watch_cv_.Signal();
  }
  stall_watch_.join();
  // The Release retries the watch sent before it stopped.
  WaitUntilIdle();
}

void RequestOrchestrator::WatchStream(DecodeCall* call) {
  absl::MutexLock lock(&streams_mu_);
  streams_.insert(call);
}

bool RequestOrchestrator::UnwatchStream(DecodeCall* call) {
  absl::MutexLock lock(&streams_mu_);
  streams_.erase(call);
  return call->stalled();
}

void RequestOrchestrator::StallWatchLoop() {
  const absl::Duration timeout = options_.decode_stall_timeout;
  const absl::Duration period = std::clamp(
      timeout / 4, absl::Milliseconds(10), absl::Seconds(1));
  std::vector<std::shared_ptr<grpc::ClientContext>> stalled;
  absl::MutexLock lock(&streams_mu_);
  while (!watch_stopping_) {
    watch_cv_.WaitWithTimeout(&streams_mu_, period);
    const int64_t silent_since =
        absl::GetCurrentTimeNanos() - absl::ToInt64Nanoseconds(timeout);
    for (DecodeCall* call : streams_) {
      if (call->MarkIfStalled(silent_since)) stalled.push_back(call->context());
    }
    const absl::Time now = absl::Now();
    auto due = std::partition(
        release_retries_.begin(), release_retries_.end(),
        [now](const ReleaseRetry& r) { return r.due > now; });
    std::vector<ReleaseRetry> releases;
    if (!releases_stopped_) {
      releases.assign(due, release_retries_.end());
      // Counted as a call until they are sent, so that a WaitUntilIdle
      // after Stop() waits for them.
      if (!releases.empty()) CallStarted();
    }
    release_retries_.erase(due, release_retries_.end());
    if (stalled.empty() && releases.empty()) continue;
    // Outside the mutex: a cancellation may complete the call inline, and
    // its OnDone unwatches it; a failed Release adds its retry.
    streams_mu_.Unlock();
    for (const auto& context : stalled) context->TryCancel();
    stalled.clear();
    for (const ReleaseRetry& r : releases) SendRelease(r, nullptr);
    if (!releases.empty()) CallEnded();
    streams_mu_.Lock();
  }
}

std::shared_ptr<RunningRequest> RequestOrchestrator::Start(
    const v1::GenerateRequest& request,
    std::shared_ptr<GenerateStream> stream) {
  absl::StatusOr<ValidatedRequest> validated =
      ValidateGenerateRequest(request, *model_);
  if (!validated.ok()) {
    stream->End(validated.status());
    return std::make_shared<EndedRequest>();
  }
  if (!validated->engine.sampling.seed) {
    validated->engine.sampling.seed = RandomU64();
  }
  // Workers admit in this order (first come, first served), and a request
  // migrated or retried keeps its place.
  validated->engine.arrival_unix_us = absl::ToUnixMicros(absl::Now());
  std::string request_id = request.request_id().empty()
                               ? absl::StrCat("req-", NewId())
                               : request.request_id();
  running_.fetch_add(1, std::memory_order_relaxed);
  auto run = std::make_shared<Request>(this, std::move(stream),
                                       *std::move(validated),
                                       std::move(request_id),
                                       request.priority());
  run->StartChoice(0, nullptr);
  return run;
}

void RequestOrchestrator::Admit(const std::shared_ptr<Choice>& choice) {
  absl::Status why;
  const WorkerEndpoint* decode = nullptr;
  {
    absl::MutexLock lock(&mu_);
    const bool first = choice->key.second == 0;  // Never admitted before.
    if (first) choice->key = {choice->priority, ++arrivals_};
    if (stopping_) {
      why = absl::UnavailableError("the router is stopping");
    } else {
      // A new request places at once only when none waits before it; one
      // coming back from a full or failed worker keeps its place.
      const bool ahead_waits =
          !queue_.empty() && queue_.begin()->first < choice->key;
      if (!ahead_waits) decode = PlaceLocked(*choice, &why);
      if (decode == nullptr && why.ok()) {
        if (first && static_cast<int64_t>(queue_.size()) >=
                         options_.max_queued) {
          why = absl::ResourceExhaustedError(absl::StrCat(
              "the decode workers have no KV room for the request and ",
              queue_.size(),
              " requests already wait for it (the router's max_queued); "
              "retry later"));
        } else {
          queue_.emplace(choice->key, choice);
          choice->queued = true;
          wake_ = true;
          wake_cv_.Signal();
        }
      }
    }
  }
  if (decode != nullptr) {
    Placed(*choice);
    choice->Run(decode);
  } else if (!why.ok()) {
    if (metrics_ != nullptr && absl::IsResourceExhausted(why)) {
      metrics_->Rejected(absl::StrContains(why.message(), "max_queued")
                             ? "queue_full"
                             : "too_large");
    } else if (metrics_ != nullptr && absl::IsUnavailable(why)) {
      metrics_->Rejected("stopping");
    }
    choice->End(why);
  }
}

void RequestOrchestrator::Placed(const Choice& choice) {
  if (metrics_ == nullptr) return;
  const RouteDecision& route = choice.route;
  if (choice.tried.empty()) {
    metrics_->QueueTime(absl::Now() - choice.created);
  }
  metrics_->Routed("decode", route.decode->id);
  if (route.prefill != nullptr) metrics_->Routed("prefill", route.prefill->id);
  // What the chosen worker need not compute: the prefill worker's cached
  // prefix, or the decode worker's when it prefills locally.
  metrics_->PrefixMatched(choice.prompt().size(),
                          route.prefill != nullptr
                              ? route.prefill_cached_tokens
                              : route.decode_cached_tokens);
}

const WorkerEndpoint* RequestOrchestrator::PlaceLocked(Choice& choice,
                                                       absl::Status* why) {
  std::vector<const WorkerEndpoint*> exclude = choice.tried;
  bool any_usable = false, any_untried = false;
  int64_t largest_tokens = 0;
  const WorkerEndpoint* preferred = nullptr;
  // The request's blocks on each decode worker, at its block size.
  absl::flat_hash_map<const WorkerEndpoint*, int64_t> blocks;
  for (const WorkerRegistry::KvCapacity& capacity : registry_->DecodeCapacities()) {
    const WorkerEndpoint* w = capacity.worker;
    if (!capacity.usable) continue;
    blocks[w] = BlocksForTokens(choice.reserve_tokens,
                                capacity.block_size > 0 ? capacity.block_size
                                                        : 16);
    any_usable = true;
    largest_tokens = std::max(
        largest_tokens,
        capacity.total_blocks * std::max<int64_t>(capacity.block_size, 1));
    if (std::find(choice.tried.begin(), choice.tried.end(), w) !=
        choice.tried.end()) {
      continue;
    }
    any_untried = true;
    if (committed_[w] + blocks[w] > capacity.total_blocks) {
      exclude.push_back(w);
    } else if (w == choice.preferred) {
      preferred = w;
    }
  }
  if (!any_usable) {
    *why = choice.last_failure.ok()
               ? absl::UnavailableError("no healthy decode worker")
               : choice.last_failure;
    return nullptr;
  }
  if (choice.reserve_tokens > largest_tokens) {
    *why = absl::ResourceExhaustedError(absl::StrCat(
        "the request needs KV for ", choice.reserve_tokens,
        " tokens (prompt + max_tokens) and the largest decode worker's pool "
        "holds ",
        largest_tokens, "; lower max_tokens or shorten the prompt"));
    return nullptr;
  }
  if (!any_untried) {
    // Every worker failed or said it was full although the ledger saw room
    // (requests of other routers, which it does not count).
    *why = !choice.last_failure.ok()
               ? choice.last_failure
               : absl::ResourceExhaustedError(
                     "every decode worker answered that its KV blocks are "
                     "taken (by requests this router does not see); retry "
                     "later");
    return nullptr;
  }
  if (preferred != nullptr) {
    choice.route = RouteDecision{.decode = preferred};
  } else {
    choice.route = registry_->Route(
        {.prompt = choice.prompt(), .max_tokens = choice.max_tokens()},
        exclude);
  }
  const WorkerEndpoint* decode = choice.route.decode;
  // Not one weighed above: it became healthy meanwhile; the next look
  // weighs it.
  const auto it = blocks.find(decode);
  if (it == blocks.end()) return nullptr;
  choice.committed_on = decode;
  choice.committed_blocks = it->second;
  committed_[decode] += choice.committed_blocks;
  return decode;
}

void RequestOrchestrator::Uncommit(Choice& choice) {
  absl::MutexLock lock(&mu_);
  if (choice.committed_on == nullptr) return;
  committed_[choice.committed_on] -= choice.committed_blocks;
  choice.committed_on = nullptr;
  choice.committed_blocks = 0;
  if (!queue_.empty()) {
    wake_ = true;
    wake_cv_.Signal();
  }
}

bool RequestOrchestrator::Dequeue(Choice& choice) {
  absl::MutexLock lock(&mu_);
  if (!choice.queued) return false;
  queue_.erase(choice.key);
  choice.queued = false;
  return true;
}

int64_t RequestOrchestrator::queued() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(queue_.size());
}

void RequestOrchestrator::AdmissionLoop() {
  absl::MutexLock lock(&mu_);
  absl::Time next_expiry_scan = absl::InfinitePast();
  while (!stopping_) {
    if (!wake_) {
      const absl::Time until = queue_.empty()
                                   ? absl::InfiniteFuture()
                                   : absl::Now() + options_.recheck_interval;
      wake_cv_.WaitWithDeadline(&mu_, until);
    }
    wake_ = false;
    if (stopping_) break;
    const absl::Time now = absl::Now();
    const bool scan_expiry = now >= next_expiry_scan;
    if (scan_expiry) next_expiry_scan = now + options_.recheck_interval;
    std::vector<std::pair<std::shared_ptr<Choice>, const WorkerEndpoint*>>
        placed;
    std::vector<std::pair<std::shared_ptr<Choice>, absl::Status>> ended;
    // Strict order: the first that cannot be placed holds back those
    // behind it (they are only checked for their deadline).
    bool blocked = false;
    for (auto it = queue_.begin(); it != queue_.end();) {
      Choice& choice = *it->second;
      std::optional<absl::Status> end;
      const WorkerEndpoint* decode = nullptr;
      if (now >= choice.deadline) {
        end = absl::DeadlineExceededError(
            "the request's deadline passed while it waited for KV room");
      } else if (!blocked) {
        absl::Status why;
        decode = PlaceLocked(choice, &why);
        if (decode == nullptr && !why.ok()) end = why;
        blocked = decode == nullptr && why.ok();
      } else {
        blocked = true;
      }
      if (decode != nullptr || end) {
        choice.queued = false;
        if (decode != nullptr) {
          placed.emplace_back(it->second, decode);
        } else {
          ended.emplace_back(it->second, *end);
        }
        it = queue_.erase(it);
        continue;
      }
      if (blocked && !scan_expiry) break;
      ++it;
    }
    if (placed.empty() && ended.empty()) continue;
    mu_.Unlock();
    for (auto& [choice, decode] : placed) {
      Placed(*choice);
      choice->Run(decode);
    }
    for (auto& [choice, why] : ended) choice->End(why);
    mu_.Lock();
  }
}

void RequestOrchestrator::Stop() {
  absl::btree_map<QueueKey, std::shared_ptr<Choice>> queued;
  {
    absl::MutexLock lock(&streams_mu_);
    releases_stopped_ = true;
  }
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    queued.swap(queue_);
    for (auto& [key, choice] : queued) choice->queued = false;
    wake_cv_.Signal();
  }
  admission_.join();
  for (auto& [key, choice] : queued) {
    choice->End(absl::UnavailableError("the router is stopping"));
  }
}

void RequestOrchestrator::WaitUntilIdle() {
  {
    absl::MutexLock lock(&mu_);
    while (calls_.load() > 0) idle_cv_.Wait(&mu_);
  }
  // Every context belongs to a counted call, so none is made now; those
  // of the calls that ended may still be going on gRPC's threads.
  absl::MutexLock lock(&contexts_mu_);
  const absl::Condition none_left(
      +[](int64_t* live) { return *live == 0; }, &live_contexts_);
  while (!contexts_mu_.AwaitWithTimeout(none_left, absl::Seconds(10))) {
    PD_LOG(WARNING) << "stopping: still waiting for " << live_contexts_
                    << " downstream call context(s) to be released";
  }
}

// Counts down under mu_: once WaitUntilIdle sees zero the orchestrator may
// go, and nothing here touches it after the unlock.
void RequestOrchestrator::CallEnded() {
  absl::MutexLock lock(&mu_);
  if (calls_.fetch_sub(1) == 1) idle_cv_.SignalAll();
}

std::shared_ptr<grpc::ClientContext> RequestOrchestrator::NewCallContext(
    absl::Time deadline) {
  {
    absl::MutexLock lock(&contexts_mu_);
    ++live_contexts_;
  }
  // The deleter takes only contexts_mu_, which is never held around other
  // code: a context may go wherever its last holder does.
  auto context = std::shared_ptr<grpc::ClientContext>(
      new grpc::ClientContext, [this](grpc::ClientContext* gone) {
        delete gone;  // Its channel reference goes first.
        absl::MutexLock lock(&contexts_mu_);
        --live_contexts_;
      });
  context->set_deadline(absl::ToChronoTime(deadline));
  return context;
}

void RequestOrchestrator::Release(
    const WorkerEndpoint* decode, uint64_t request_id,
    std::function<void(const absl::Status&)> done) {
  const absl::Time now = absl::Now();
  SendRelease({.decode = decode,
               .request_id = request_id,
               .due = now,
               .backoff = absl::Seconds(1),
               .give_up = now + options_.release_retry_window},
              std::move(done));
}

void RequestOrchestrator::SendRelease(
    ReleaseRetry retry, std::function<void(const absl::Status&)> done) {
  const WorkerEndpoint* const decode = retry.decode;
  const uint64_t request_id = retry.request_id;
  struct Call {
    std::shared_ptr<grpc::ClientContext> context;
    wire::ReleaseRequest request;
    wire::ReleaseResponse response;
  };
  auto call = std::make_shared<Call>();
  call->context = NewCallContext(absl::Now() + options_.control_timeout);
  call->request.set_request_id(request_id);
  CallStarted();
  decode->decode->async()->Release(
      call->context.get(), &call->request, &call->response,
      [this, call, decode, request_id, retry,
       done = std::move(done)](grpc::Status grpc_status) mutable {
        const absl::Status status = FromGrpcStatus(grpc_status);
        if (!status.ok()) {
          PD_LOG(WARNING) << "request " << request_id
                          << ": Release on decode worker " << decode->id
                          << " failed: " << status;
          registry_->ReportCallFailure(decode, status);
        }
        // Unanswered: the worker may be cut off rather than gone, and its
        // blocks held until it hears the Release.
        const bool unanswered =
            absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status);
        retry.due = absl::Now() + retry.backoff;
        retry.backoff *= 2;
        if (unanswered && retry.due < retry.give_up) {
          absl::MutexLock lock(&streams_mu_);
          release_retries_.push_back(retry);
        }
        if (done) done(status);
        CallEnded();
      });
}

}  // namespace pdserve
