#include "prefill_worker/prefill_worker.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "engine/kv_layout.h"
#include "engine/model.h"
#include "engine/model_runner.h"
#include "kv_transfer/fault_injection.h"
#include "proto/convert.h"

namespace pdserve {

namespace wire = ::pdserve::internal::v1;

namespace {

// Longest Landing.decode_worker_id accepted (ids come from the cluster
// config; a bound costs nothing).
constexpr size_t kMaxDecodeWorkerIdBytes = 1024;

// The engine's id of the request a push carries.
RequestId EngineIdOf(const kv::KvPush& push) {
  return RequestId(push.request_id());
}

}  // namespace

// The reactor of one Prefill call. Finished exactly once: by Prefill() on a
// bad request, by Start() when the engine refuses it, or by OnPushDone.
class PrefillWorker::PrefillCall final : public grpc::ServerUnaryReactor {
 public:
  PrefillCall(PrefillWorker* worker, const wire::PrefillRequest* request,
              wire::PrefillResponse* response)
      : worker_(worker),
        request_(request),
        response_(response),
        arrival_(absl::Now()) {}

  void OnCancel() override {
    // Client cancel or deadline. The RPC's outcome is settled already; what
    // matters is that the engine stops and the blocks come back.
    if (push_ == nullptr) return;  // Refused before it started.
    push_->Abort(absl::CancelledError("the Prefill call was cancelled"));
    worker_->CancelInEngine(push_);
  }

  void OnDone() override {
    PrefillWorker* worker = worker_;
    delete this;
    worker->CallDone();
  }

  const wire::PrefillRequest& request() const { return *request_; }
  wire::PrefillResponse* response() { return response_; }
  absl::Time arrival() const { return arrival_; }
  const std::shared_ptr<kv::KvPush>& push() const { return push_; }
  // Before the reactor is handed to gRPC; constant afterwards.
  void set_push(std::shared_ptr<kv::KvPush> push) { push_ = std::move(push); }

 private:
  PrefillWorker* const worker_;
  const wire::PrefillRequest* const request_;  // Owned by gRPC until OnDone.
  wire::PrefillResponse* const response_;      // Likewise.
  const absl::Time arrival_;
  std::shared_ptr<kv::KvPush> push_;
};

absl::StatusOr<std::unique_ptr<PrefillWorker>> PrefillWorker::Create(
    const PrefillWorkerOptions& options) {
  if (options.transfer_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("transfer_timeout must be positive");
  }
  auto metrics = std::make_unique<PrefillMetrics>();
  PD_ASSIGN_OR_RETURN(
      std::unique_ptr<EngineLoop> loop,
      EngineLoop::Start(options.engine, nullptr,
                        [m = metrics.get()](const EngineStepStats& stats) {
                          m->engine().OnStep(stats);
                        }));
  PD_ASSIGN_OR_RETURN(const std::vector<std::string> names,
                      kv::ParseKvTransportList(options.kv_transport));
  kv::TransportOptions transport_options;
  transport_options.io_timeout = options.transfer_timeout;
  std::unique_ptr<PrefillWorker> worker(
      new PrefillWorker(options, std::move(metrics), std::move(loop)));
  PrefillWorker* w = worker.get();
  std::vector<kv::KvSenderTransport> transports;
  std::vector<std::string> staged;
  for (const std::string& name : names) {
    kv::KvSenderTransport& t = transports.emplace_back();
    PD_ASSIGN_OR_RETURN(t.transport,
                        kv::CreateKvTransportWithFaults(name, transport_options, options.kv_fault));
    const kv::TransportCapabilities& caps = t.transport->capabilities();
    absl::StatusOr<std::span<std::byte>> memory =
        w->loop_->KvMemoryForTransport(caps.host_memory, caps.device_memory,
                                       &t.staged);
    if (!memory.ok()) {
      return absl::Status(
          memory.status().code(),
          absl::StrCat("KV transport ", name, ": ", memory.status().message()));
    }
    t.memory = *memory;
    if (t.staged) staged.push_back(name);
  }
  PD_ASSIGN_OR_RETURN(
      worker->sender_,
      kv::KvSender::Create(
          std::move(transports), w->loop_->num_kv_blocks(),
          w->loop_->kv_layout(),
          [w](std::span<const kv::WriteOp> writes) {
            // The sender's writes read the staging at the pool's offsets.
            std::vector<KvByteRange> ranges;
            ranges.reserve(writes.size());
            for (const kv::WriteOp& op : writes)
              ranges.push_back({.offset = op.local_offset, .length = op.length});
            return w->loop_->CopyKvToHostStaging(ranges);
          },
          [w](const std::shared_ptr<kv::KvPush>& push) {
            w->CancelInEngine(push);
          }));
  w->metrics_->engine().WatchLoad(w->loop_.get());
  w->metrics_->WatchSender(w->sender_.get());
  AddDrainingGauge(&w->metrics_->registry(), w);
  w->loop_->Post([w](Generator& generator) {
    generator.set_kv_layer_observer(
        [w](int32_t layer, std::span<const ComputedKv> computed) {
          w->OnLayer(layer, computed);
        });
  });
  PD_LOG(INFO) << "prefill worker: model " << options.engine.model << ", "
               << w->loop_->num_kv_blocks() << " KV blocks of "
               << options.engine.block_size << " tokens, KV pushed over "
               << kv::FormatKvTransportList(w->sender_->transport_names())
               << (staged.empty()
                       ? std::string()
                       : absl::StrCat(" (staged through pinned host memory: ",
                                      kv::FormatKvTransportList(staged), ")"));
  return worker;
}

PrefillWorker::PrefillWorker(const PrefillWorkerOptions& options,
                             std::unique_ptr<PrefillMetrics> metrics,
                             std::unique_ptr<EngineLoop> loop)
    : options_(options),
      metrics_(std::move(metrics)),
      loop_(std::move(loop)),
      worker_id_(options.worker_id) {}

PrefillWorker::~PrefillWorker() {
  {
    absl::MutexLock lock(&mu_);
    loop_gone_ = true;
  }
  // The sender stops first: its writes read the pool (and its staging
  // copies go through the runner), which go with the loop. Stop() finishes
  // the calls it has queued with UNAVAILABLE; sinks still subscribed then
  // get a cancellation from the loop's destructor, and their push's Finish
  // runs its `done` at once.
  if (sender_ != nullptr) sender_->Stop();
  loop_.reset();
}

void PrefillWorker::set_worker_id(std::string id) {
  absl::MutexLock lock(&mu_);
  worker_id_ = std::move(id);
}

int PrefillWorker::in_flight() const {
  absl::MutexLock lock(&mu_);
  return in_flight_;
}

bool PrefillWorker::WaitUntilIdle(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]()
                  ABSL_SHARED_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
  return mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
}

void PrefillWorker::StartDraining() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
}

bool PrefillWorker::draining() const {
  absl::MutexLock lock(&mu_);
  return draining_;
}

bool PrefillWorker::drain_reported() const {
  absl::MutexLock lock(&mu_);
  return drain_reported_;
}

void PrefillWorker::CallDone() {
  absl::MutexLock lock(&mu_);
  --in_flight_;
}

void PrefillWorker::PostToLoop(EngineLoop::Command command) {
  absl::MutexLock lock(&mu_);
  if (!loop_gone_) loop_->Post(std::move(command));
}

absl::StatusOr<std::vector<kv::KvOffer>> PrefillWorker::CheckRequest(
    const wire::PrefillRequest& request) const {
  if (!request.has_request() || !request.has_landing()) {
    return absl::InvalidArgumentError(
        "a PrefillRequest needs a request and a landing");
  }
  const wire::EngineRequest& r = request.request();
  const wire::Landing& landing = request.landing();
  if (r.prompt().empty()) return absl::InvalidArgumentError("prompt is empty");
  if (r.max_tokens() < 1)
    return absl::InvalidArgumentError("max_tokens must be at least 1");
  const int64_t context = loop_->model().config().max_position_embeddings;
  if (static_cast<int64_t>(r.prompt_size()) + r.max_tokens() > context) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt (", r.prompt_size(), " tokens) + max_tokens (", r.max_tokens(),
        ") exceeds the model's context of ", context));
  }
  // The landing: a pool this worker can write into.
  const KvBlockLayout& ours = loop_->kv_layout();
  absl::StatusOr<KvBlockLayout> theirs = FromWire(landing.layout());
  if (!theirs.ok() || *theirs != ours) {
    wire::KvLayout want;
    ToWire(ours, &want);
    return absl::FailedPreconditionError(absl::StrCat(
        "the landing's KV layout {", landing.layout().ShortDebugString(),
        "} differs from this worker's {", want.ShortDebugString(), "}"));
  }
  // The id names the KV sender's lane for the decode worker.
  if (landing.decode_worker_id().size() > kMaxDecodeWorkerIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("the landing's decode_worker_id is ",
                     landing.decode_worker_id().size(), " bytes long; at most ",
                     kMaxDecodeWorkerIdBytes));
  }
  if (landing.pool_blocks() == 0 || landing.pool_blocks() > (1u << 30)) {
    return absl::InvalidArgumentError(
        absl::StrCat("landing pool of ", landing.pool_blocks(), " blocks"));
  }
  const int64_t needed = BlocksForTokens(r.prompt_size(), ours.block_size);
  if (landing.block_ids_size() < needed) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the landing has ", landing.block_ids_size(), " blocks; the prompt of ",
        r.prompt_size(), " tokens needs ", needed));
  }
  if (landing.cached_tokens() % ours.block_size != 0 ||
      (landing.cached_tokens() > 0 &&
       landing.cached_tokens() >= static_cast<uint32_t>(r.prompt_size()))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the landing's cached_tokens (", landing.cached_tokens(),
        ") is not a multiple of the block size ", ours.block_size,
        " below the prompt's ", r.prompt_size(), " tokens"));
  }
  for (int32_t id : landing.block_ids()) {
    if (id < 0 || static_cast<uint32_t>(id) >= landing.pool_blocks()) {
      return absl::InvalidArgumentError(
          absl::StrCat("landing block id ", id, " outside [0, ",
                       landing.pool_blocks(), ")"));
    }
  }
  // The transports: the offers, or the single one of an older landing.
  std::vector<kv::KvOffer> offered;
  for (const wire::KvOffer& o : landing.offers()) {
    if (offered.size() > kv::kMaxKvOffers) break;  // Refused just below.
    offered.push_back({.transport = o.transport(),
                       .endpoint = o.endpoint(),
                       .region = kv::RegionId(o.region_id())});
  }
  if (offered.empty() && !landing.transport().empty()) {
    offered.push_back({.transport = landing.transport(),
                       .endpoint = landing.endpoint(),
                       .region = kv::RegionId(landing.region_id())});
  }
  return kv::ChooseKvOffers(offered, sender_->transport_names());
}

grpc::ServerUnaryReactor* PrefillWorker::Prefill(
    grpc::CallbackServerContext* context, const wire::PrefillRequest* request,
    wire::PrefillResponse* response) {
  bool refused;
  {
    // Under the lock that counts calls: once StartDraining returned, a
    // call either counts in in_flight_ or is refused here.
    absl::MutexLock lock(&mu_);
    ++in_flight_;
    refused = draining_;
  }
  auto* call = new PrefillCall(this, request, response);
  if (refused) {
    call->Finish(ToGrpcStatus(DrainingError("prefill")));
    return call;
  }
  absl::StatusOr<std::vector<kv::KvOffer>> offers = CheckRequest(*request);
  if (!offers.ok()) {
    call->Finish(ToGrpcStatus(offers.status()));
    return call;
  }
  const wire::Landing& landing = request->landing();
  const int32_t bs = loop_->kv_layout().block_size;
  // Sent instead of the KvComplete when the push stops early on a
  // connection still open: the decode worker frees the landing at once.
  wire::KvComplete aborted;
  aborted.set_request_id(request->request().request_id());
  aborted.set_num_tokens(0);
  aborted.set_cached_tokens(landing.cached_tokens());
  aborted.set_landing_id(landing.landing_id());
  aborted.set_aborted(true);
  kv::KvLandingTarget target{
      .destination = landing.decode_worker_id(),
      .offers = *std::move(offers),
      .remote_pool_blocks = static_cast<int32_t>(landing.pool_blocks()),
      .cached_tokens = static_cast<int32_t>(landing.cached_tokens()),
      .landing_id = landing.landing_id(),
      .abort_notification = aborted.SerializeAsString()};
  const int32_t needed = static_cast<int32_t>(
      BlocksForTokens(request->request().prompt_size(), bs));
  target.block_ids.reserve(needed);
  for (int i = 0; i < needed; ++i)
    target.block_ids.push_back(BlockId(landing.block_ids(i)));
  call->set_push(std::make_shared<kv::KvPush>(request->request().request_id(),
                                              std::move(target)));
  loop_->Post([this, call](Generator& generator) { Start(call, generator); });
  return call;
}

void PrefillWorker::Start(PrefillCall* call, Generator& generator) {
  const std::shared_ptr<kv::KvPush>& push = call->push();
  const RequestId id = EngineIdOf(*push);
  if (active_.contains(id)) {
    call->Finish(ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
        "request ", id.value, " is already being prefilled here"))));
    return;
  }
  if (absl::Status s = push->status(); !s.ok()) {  // Cancelled while queued.
    call->Finish(ToGrpcStatus(s));
    return;
  }
  // The engine's copy ends after its first token and keeps its KV for the
  // sender: KV for the prompt + 1 token only, whatever max_tokens says.
  GenerationRequest engine_request = FromWire(call->request().request());
  engine_request.hold_kv = true;
  engine_request.sampling.max_tokens = 1;
  if (absl::Status s = generator.Add(std::move(engine_request)); !s.ok()) {
    call->Finish(ToGrpcStatus(s));
    return;
  }
  active_[id] = push;
  loop_->Subscribe(
      id, [this, call](const GenerationEvent& e) { return OnEvent(call, e); });
}

void PrefillWorker::OnLayer(int32_t layer,
                            std::span<const ComputedKv> computed) {
  layer_scratch_.clear();
  for (const ComputedKv& c : computed) {
    auto it = active_.find(c.id);
    if (it == active_.end() || it->second->aborted()) continue;
    layer_scratch_.push_back({.push = it->second,
                              .block_table = c.block_table,
                              .begin = c.begin,
                              .end = c.end});
  }
  if (!layer_scratch_.empty()) sender_->PushLayer(layer, layer_scratch_);
  layer_scratch_.clear();  // Drops the shared_ptr copies.
}

bool PrefillWorker::OnEvent(PrefillCall* call, const GenerationEvent& event) {
  const std::shared_ptr<kv::KvPush>& push = call->push();
  std::string notification;
  if (event.has_token) {
    const wire::EngineRequest& r = call->request().request();
    wire::PrefillResponse* response = call->response();
    ToWire(event.token, response->mutable_first_token());
    for (const SampledToken& t : event.prompt_logprobs) {
      ToWire(t, response->add_prompt_logprobs());
    }
    // The engine ran with max_tokens 1: its kLength means "one token", which
    // ends the request only when the caller asked for one.
    response->set_finish_reason(
        event.finish == FinishReason::kStop ? wire::FINISH_REASON_STOP
        : r.max_tokens() == 1               ? wire::FINISH_REASON_LENGTH
                                            : wire::FINISH_REASON_UNSPECIFIED);
    response->set_prefill_micros(
        absl::ToInt64Microseconds(absl::Now() - call->arrival()));
    wire::KvComplete complete;
    complete.set_request_id(r.request_id());
    complete.set_num_tokens(r.prompt_size());
    complete.set_cached_tokens(call->request().landing().cached_tokens());
    complete.set_landing_id(call->request().landing().landing_id());
    notification = complete.SerializeAsString();
  } else {
    // Cancelled: by us (the push is aborted already) or by the engine after
    // a backend failure.
    push->Abort(
        absl::UnavailableError("the prefill engine cancelled the request"));
  }
  sender_->Finish(
      push, std::move(notification),
      [this, call](absl::Status status, const kv::KvPushStats& stats) {
        OnPushDone(call, std::move(status), stats);
      });
  return true;
}

void PrefillWorker::OnPushDone(PrefillCall* call, absl::Status status,
                               const kv::KvPushStats& stats) {
  metrics_->PushDone(status, stats);
  // The sender is done with the blocks: the engine may have them back.
  PostToLoop([this, push = call->push()](Generator& generator) {
    const RequestId id = EngineIdOf(*push);
    auto it = active_.find(id);
    if (it == active_.end() || it->second != push) return;
    generator.ReleaseKv(id);
    active_.erase(it);
  });
  if (status.ok()) {
    wire::PrefillResponse* response = call->response();
    response->set_kv_bytes(stats.kv_bytes);
    response->set_transfer_tail_micros(
        absl::ToInt64Microseconds(stats.transfer_tail));
    response->set_transfer_micros(absl::ToInt64Microseconds(stats.transfer));
  }
  call->Finish(ToGrpcStatus(status));
}

void PrefillWorker::CancelInEngine(const std::shared_ptr<kv::KvPush>& push) {
  PostToLoop([this, push](Generator& generator) {
    const RequestId id = EngineIdOf(*push);
    auto it = active_.find(id);
    if (it != active_.end() && it->second == push) generator.Cancel(id);
  });
}

grpc::ServerUnaryReactor* PrefillWorker::GetLoad(
    grpc::CallbackServerContext* context, const wire::LoadRequest* request,
    wire::LoadReport* response) {
  const EngineLoad load = loop_->load();
  {
    absl::MutexLock lock(&mu_);
    response->set_worker_id(worker_id_);
    response->set_draining(draining_);
    drain_reported_ = drain_reported_ || draining_;
  }
  response->set_role("prefill");
  response->set_model(options_.engine.model);
  ToWire(loop_->kv_layout(), response->mutable_layout());
  ToWire(load, response);
  ToWire(loop_->kv_events(), *request, response);
  for (const kv::KvTransportCounters& c : sender_->counters()) {
    wire::KvTransportCounters* out = response->add_kv_transports();
    out->set_transport(c.transport);
    out->set_pushes(c.pushes);
    out->set_bytes(c.bytes);
    out->set_fallbacks(c.fallbacks);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace pdserve
