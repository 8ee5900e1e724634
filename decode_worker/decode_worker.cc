#include "decode_worker/decode_worker.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "engine/kv_layout.h"
#include "kv_transfer/fault_injection.h"
#include "kv_transfer/negotiation.h"
#include "proto/convert.h"

namespace pdserve {

namespace wire = ::pdserve::internal::v1;

// One Decode call: a server stream fed by the engine loop. Owned through
// shared_ptrs: the reactor's own reference lasts until OnDone; the engine
// sink, a parked reservation and queued loop commands hold theirs for as
// long as they may call in, so a sink firing after the client left finds
// a live object whose stream simply takes no more writes.
//
// Thread-safety: the stream state is guarded by mu_ (gRPC runs reactions
// on its threads, the loop feeds events on its own); `stage` belongs to
// the loop thread.
class DecodeWorker::DecodeCall final
    : public grpc::ServerWriteReactor<wire::DecodeResponse> {
 public:
  // Where the request stands in the engine. Loop thread only.
  enum class Stage {
    kNew,      // StartDecode has not run yet.
    kParked,   // Waiting in its reservation for KvComplete.
    kRunning,  // In the Generator; the loop's sink feeds the stream.
    kEnded,    // Nothing in the engine or the reservations any more.
  };

  static std::shared_ptr<DecodeCall> Create(
      DecodeWorker* worker, const wire::DecodeRequest& request) {
    std::shared_ptr<DecodeCall> call(new DecodeCall(worker, request));
    call->self_ = call;
    return call;
  }

  RequestId id() const { return id_; }
  const wire::DecodeRequest& request() const { return request_; }

  Stage stage = Stage::kNew;

  // Loop thread: one engine event. Returns true after the last one.
  bool OnEngineEvent(const GenerationEvent& e) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (!e.has_token) {
      // Cancelled in the engine without the caller asking: the loop is
      // going away or a step failed. Another worker may do better.
      SetFinalStatus(grpc::Status(
          grpc::StatusCode::UNAVAILABLE,
          "the decode worker dropped the request (shutting down or an "
          "engine failure)"));
      MaybeWrite();
      return true;
    }
    for (const SampledToken& t : e.prompt_logprobs) {
      ToWire(t, pending_.add_prompt_logprobs());
    }
    ToWire(e.token, pending_.add_tokens());
    const bool last = e.finish != FinishReason::kNone;
    if (last) {
      pending_.set_finish_reason(ToWire(e.finish));
      SetFinalStatus(grpc::Status::OK);
    }
    MaybeWrite();
    return last;
  }

  // Any thread: ends the call with `status` once queued tokens are out
  // (the first status set wins).
  void End(grpc::Status status) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    SetFinalStatus(std::move(status));
    MaybeWrite();
  }

  void OnWriteDone(bool ok) override ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    write_in_flight_ = false;
    if (!ok) {  // The stream broke (client gone); nothing more goes out.
      SetFinalStatus(
          grpc::Status(grpc::StatusCode::CANCELLED, "stream broken"));
      pending_.Clear();
    }
    MaybeWrite();
  }

  void OnCancel() override ABSL_LOCKS_EXCLUDED(mu_) {
    std::shared_ptr<DecodeCall> self;
    {
      absl::MutexLock lock(&mu_);
      self = self_;  // Set until OnDone, which comes after OnCancel.
    }
    if (self != nullptr) {
      worker_->loop_->Post([self = std::move(self)](Generator& g) {
        self->worker_->CancelDecode(self, g);
      });
    }
    End(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the caller"));
  }

  void OnDone() override ABSL_LOCKS_EXCLUDED(mu_) {
    std::shared_ptr<DecodeCall> self;
    {
      absl::MutexLock lock(&mu_);
      done_ = true;
      self = std::move(self_);
    }
    // `self` may be the last reference: this object may end with the scope.
  }

 private:
  DecodeCall(DecodeWorker* worker, const wire::DecodeRequest& request)
      : worker_(worker),
        request_(request),
        id_(request.request().request_id()) {}

  void SetFinalStatus(grpc::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!final_status_) final_status_ = std::move(status);
  }

  // Starts the next write (every token queued meanwhile in one message),
  // or finishes once the last token is out. One write in flight at most.
  void MaybeWrite() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || done_ || write_in_flight_) return;
    if (pending_.tokens_size() > 0) {
      writing_.Swap(&pending_);
      pending_.Clear();
      write_in_flight_ = true;
      StartWrite(&writing_);
    } else if (final_status_) {
      finished_ = true;
      Finish(*final_status_);
    }
  }

  DecodeWorker* const worker_;
  // A copy: the loop reads it after the call may be done.
  const wire::DecodeRequest request_;
  const RequestId id_;

  absl::Mutex mu_;
  std::shared_ptr<DecodeCall> self_ ABSL_GUARDED_BY(mu_);
  // Tokens not written yet.
  wire::DecodeResponse pending_ ABSL_GUARDED_BY(mu_);
  // The write in flight.
  wire::DecodeResponse writing_ ABSL_GUARDED_BY(mu_);
  bool write_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::Status> final_status_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;  // Finish() called.
  bool done_ ABSL_GUARDED_BY(mu_) = false;      // OnDone() ran.
};

absl::StatusOr<std::unique_ptr<DecodeWorker>> DecodeWorker::Create(
    const DecodeWorkerOptions& options) {
  if (options.reservation_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("reservation_timeout must be positive");
  }
  if (options.kv_quarantine <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("kv_quarantine must be positive");
  }
  std::unique_ptr<DecodeWorker> worker(new DecodeWorker(options));
  DecodeWorker* w = worker.get();
  PD_ASSIGN_OR_RETURN(
      w->receiver_, kv::KvReceiver::Create(
                        {.transports = options.kv_transport,
                         .listen_address = options.kv_listen_address,
                         .quarantine = options.kv_quarantine,
                         .fault_spec = options.kv_fault}));
  w->metrics_.WatchFence(&w->receiver_->fence());
  PD_ASSIGN_OR_RETURN(worker->loop_,
                      EngineLoop::Start(
                          options.engine,
                          [w](Generator& g) {
                            w->ExpireReservations(g);
                            w->FreeFencedBlocks(g);
                            int64_t reserved = 0;
                            for (const auto& [id, r] : w->reservations_) {
                              reserved += r.blocks.size();
                            }
                            for (const Quarantined& q : w->quarantined_) {
                              reserved += q.blocks.size();
                            }
                            w->metrics_.engine().set_reserved_blocks(reserved);
                          },
                          [w](const EngineStepStats& stats) {
                            w->metrics_.engine().OnStep(stats);
                          }));
  w->metrics_.WatchLoop(w->loop_.get());
  AddDrainingGauge(&w->metrics_.registry(), w);
  PD_RETURN_IF_ERROR(w->receiver_->Start(
      [w](const kv::TransportCapabilities& caps,
          bool* staged) -> absl::StatusOr<std::span<std::byte>> {
        w->received_bytes_.push_back(w->metrics_.AddReceiver(caps.name));
        return w->loop_->KvMemoryForTransport(caps.host_memory,
                                              caps.device_memory, staged);
      },
      [w](size_t offer, kv::Notification n) {
        w->OnNotification(offer, std::move(n));
      }));
  std::vector<std::string> offered;
  for (const kv::KvReceiverOffer& o : w->receiver_->offers()) {
    offered.push_back(
        absl::StrCat(o.transport, " at ", o.endpoint,
                     o.staged ? " (staged through pinned host memory)" : ""));
  }
  PD_LOG(INFO) << "decode worker: model " << options.engine.model << ", "
               << worker->loop_->num_kv_blocks() << " KV blocks of "
               << options.engine.block_size << " tokens, KV offered over "
               << absl::StrJoin(offered, ", ");
  return worker;
}

DecodeWorker::DecodeWorker(const DecodeWorkerOptions& options)
    : options_(options), worker_id_(options.worker_id) {}

DecodeWorker::~DecodeWorker() {
  // No peer may write into the pool once it is freed: wait for writes in
  // progress and refuse later ones before the loop (and its runner) goes.
  if (receiver_ != nullptr) receiver_->Stop();
  // Streams still subscribed get a cancellation from the loop's destructor.
  loop_.reset();
  for (auto& [id, r] : reservations_) {
    if (r.parked) {
      r.parked->End(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                 "the decode worker is shutting down"));
    }
  }
  reservations_.clear();
}

void DecodeWorker::set_worker_id(std::string id) {
  absl::MutexLock lock(&mu_);
  worker_id_ = std::move(id);
}

void DecodeWorker::StartDraining() {
  draining_.store(true, std::memory_order_release);
}

int64_t DecodeWorker::RequestsInFlight() {
  // On the loop thread, after every command posted before: a Reserve or
  // Decode that got past the draining check is counted.
  struct Probe {
    absl::Notification answered;
    int64_t requests = 0;
  };
  auto probe = std::make_shared<Probe>();
  loop_->Post([this, probe](Generator& g) {
    probe->requests = int64_t{g.num_running()} + g.num_waiting() +
                      static_cast<int64_t>(reservations_.size());
    probe->answered.Notify();
  });
  if (probe->answered.WaitForNotificationWithTimeout(absl::Seconds(1))) {
    return probe->requests;
  }
  const EngineLoad load = loop_->load();
  return std::max<int64_t>(int64_t{load.running} + load.waiting + load.reserved,
                           1);
}

std::string DecodeWorker::worker_id() const {
  absl::MutexLock lock(&mu_);
  return worker_id_;
}

void DecodeWorker::OnNotification(size_t offer, kv::Notification n) {
  wire::KvComplete complete;
  if (!complete.ParseFromString(n.message)) {
    PD_LOG(WARNING) << "ignoring a KV notification that is not a KvComplete ("
                    << n.message.size() << " bytes)";
    return;
  }
  // Every write of the push came before this on its connection.
  receiver_->fence().SenderDone(complete.landing_id());
  const KvBlockLayout& layout = loop_->kv_layout();
  received_bytes_[offer]->Increment(uint64_t{complete.num_tokens()} *
                                    layout.block_bytes() / layout.block_size);
  loop_->Post([this, complete, staged = receiver_->offers()[offer].staged](
                  Generator& g) { OnKvComplete(complete, staged, g); });
}

void DecodeWorker::OnKvComplete(const wire::KvComplete& complete, bool staged,
                                Generator& generator) {
  auto it = reservations_.find(RequestId(complete.request_id()));
  if (it == reservations_.end() ||
      it->second.landing_id != complete.landing_id()) {
    // Its landing is gone (fenced by this very notification if it was
    // quarantined): a push that ended after its request did.
    PD_LOG(INFO) << "ignoring KvComplete for request "
                 << complete.request_id() << " (landing "
                 << complete.landing_id()
                 << "): no such reservation (never made, expired, released, "
                    "already decoding, or an earlier landing of the request)";
    return;
  }
  if (complete.aborted()) {
    // Nothing more will land: the blocks can go back now, and a Decode
    // waiting for this KV learns at once that it will not come.
    if (const std::shared_ptr<DecodeCall>& parked = it->second.parked) {
      parked->stage = DecodeCall::Stage::kEnded;
      parked->End(grpc::Status(grpc::StatusCode::ABORTED,
                               "the prefill worker aborted the KV push"));
    }
    DropReservation(it, generator);
    return;
  }
  it->second.kv_complete = true;
  it->second.kv_tokens = complete.num_tokens();
  it->second.kv_cached_tokens = complete.cached_tokens();
  it->second.kv_staged = staged;
  if (std::shared_ptr<DecodeCall> parked = std::move(it->second.parked)) {
    ContinuePrefilled(parked, it, generator);
  }
}

void DecodeWorker::NoteEarlyRelease(RequestId id) {
  if (released_early_.size() >= kMaxEarlyReleases) {
    auto oldest = std::min_element(
        released_early_.begin(), released_early_.end(),
        [](const auto& a, const auto& b) { return a.second < b.second; });
    released_early_.erase(oldest);
  }
  released_early_[id] = absl::Now() + options_.reservation_timeout;
}

void DecodeWorker::ExpireReservations(Generator& generator) {
  const absl::Time now = absl::Now();
  absl::erase_if(released_early_,
                 [now](const auto& entry) { return entry.second <= now; });
  for (auto it = reservations_.begin(); it != reservations_.end();) {
    if (it->second.expires > now) {
      ++it;
      continue;
    }
    const RequestId id = it->first;
    if (const std::shared_ptr<DecodeCall>& parked = it->second.parked) {
      parked->stage = DecodeCall::Stage::kEnded;
      parked->End(grpc::Status(
          grpc::StatusCode::DEADLINE_EXCEEDED,
          absl::StrCat("the KV of request ", id.value,
                       " did not arrive within ",
                       absl::FormatDuration(options_.reservation_timeout))));
    } else {
      PD_LOG(WARNING) << "reservation of request " << id.value
                      << " expired unused";
    }
    DropReservation(it++, generator);
  }
}

void DecodeWorker::DropReservation(ReservationMap::iterator it,
                                   Generator& generator) {
  const RequestId id = it->first;
  const uint64_t landing = it->second.landing_id;
  reservations_.erase(it);
  if (receiver_->fence().Close(landing, absl::Now())) {
    generator.ReleaseReservation(id);
    return;
  }
  quarantined_.push_back(
      {.landing_id = landing, .blocks = generator.TakeReservation(id)});
}

void DecodeWorker::FreeFencedBlocks(Generator& generator) {
  const absl::Time now = absl::Now();
  std::erase_if(quarantined_, [&](const Quarantined& q) {
    if (!receiver_->fence().Fenced(q.landing_id, now)) return false;
    generator.ReleaseBlocks(q.blocks);
    return true;
  });
}

void DecodeWorker::StartDecode(const std::shared_ptr<DecodeCall>& call,
                               Generator& generator) {
  if (call->stage != DecodeCall::Stage::kNew) return;  // Cancelled already.
  const RequestId id = call->id();
  if (id.value == 0) {
    return Begin(call, absl::InvalidArgumentError("request_id must be set"));
  }
  if (!call->request().has_first_token()) {
    if (draining()) return Begin(call, DrainingError("decode"));
    return Begin(call, generator.Add(FromWire(call->request().request())));
  }
  auto it = reservations_.find(id);
  if (it == reservations_.end()) {
    return Begin(call, absl::NotFoundError(absl::StrCat(
                           "no KV reservation for request ", id.value,
                           " (never made, expired, released or taken)")));
  }
  if (it->second.parked) {
    return Begin(call,
                 absl::InvalidArgumentError(absl::StrCat(
                     "request ", id.value, " already has a Decode call")));
  }
  if (!it->second.kv_complete) {
    it->second.parked = call;  // Goes on at KvComplete or expiry.
    call->stage = DecodeCall::Stage::kParked;
    return;
  }
  ContinuePrefilled(call, it, generator);
}

void DecodeWorker::ContinuePrefilled(const std::shared_ptr<DecodeCall>& call,
                                     ReservationMap::iterator it,
                                     Generator& generator) {
  const RequestId id = it->first;
  const wire::DecodeRequest& request = call->request();
  const uint32_t prompt_tokens = request.request().prompt_size();
  absl::Status status;
  // The request was checked when it was reserved; a landing that does not
  // match it is a hand-off gone wrong (a notification altered on its way),
  // which the router answers by prefilling again elsewhere.
  if (it->second.kv_tokens != prompt_tokens) {
    status = absl::DataLossError(absl::StrCat(
        "KV of ", it->second.kv_tokens, " tokens landed for request ", id.value,
        ", whose prompt has ", prompt_tokens));
  } else if (it->second.kv_cached_tokens != it->second.cached_tokens) {
    status = absl::DataLossError(absl::StrCat(
        "the KV push of request ", id.value, " skipped ",
        it->second.kv_cached_tokens, " cached tokens; the landing had ",
        it->second.cached_tokens));
  } else {
    if (it->second.kv_staged) status = UnstageKv(it->second, prompt_tokens);
    // On success the Generator takes the reservation's blocks.
    if (status.ok()) {
      status = generator.AddPrefilled(FromWire(request.request()),
                                      request.first_token().token_id());
    }
  }
  // KvComplete came: its sender writes no more, so the close fences (and
  // forgets) the landing at once.
  receiver_->fence().Close(it->second.landing_id, absl::Now());
  if (!status.ok()) generator.ReleaseReservation(id);
  reservations_.erase(it);
  Begin(call, std::move(status));
}

absl::Status DecodeWorker::UnstageKv(const Reservation& reservation,
                                     uint32_t tokens) {
  const KvBlockLayout& layout = loop_->kv_layout();
  const int32_t pool_blocks = loop_->num_kv_blocks();
  const int64_t needed = BlocksForTokens(tokens, layout.block_size);
  if (needed > static_cast<int64_t>(reservation.blocks.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV of ", tokens, " tokens does not fit the ",
                     reservation.blocks.size(), " reserved blocks"));
  }
  std::vector<KvByteRange> ranges;
  for (int32_t layer = 0; layer < layout.num_layers; ++layer) {
    ForEachKvRange(layout, layer, reservation.blocks.data(), pool_blocks,
                   reservation.blocks.data(), pool_blocks,
                   static_cast<int32_t>(reservation.cached_tokens),
                   static_cast<int32_t>(tokens),
                   [&](size_t offset, size_t, size_t length) {
                     ranges.push_back({.offset = offset, .length = length});
                   });
  }
  if (absl::Status s = loop_->CopyKvFromHostStaging(ranges); !s.ok()) {
    return absl::InternalError(
        absl::StrCat("copying staged KV into the pool: ", s.ToString()));
  }
  return absl::OkStatus();
}

void DecodeWorker::Begin(const std::shared_ptr<DecodeCall>& call,
                         absl::Status status) {
  if (!status.ok()) {
    call->stage = DecodeCall::Stage::kEnded;
    call->End(ToGrpcStatus(status));
    return;
  }
  call->stage = DecodeCall::Stage::kRunning;
  loop_->Subscribe(call->id(), [call](const GenerationEvent& e) {
    const bool last = call->OnEngineEvent(e);
    if (last) call->stage = DecodeCall::Stage::kEnded;
    return last;
  });
}

void DecodeWorker::CancelDecode(const std::shared_ptr<DecodeCall>& call,
                                Generator& generator) {
  switch (call->stage) {
    case DecodeCall::Stage::kParked:
      if (auto it = reservations_.find(call->id());
          it != reservations_.end() && it->second.parked == call) {
        DropReservation(it, generator);
      }
      break;
    case DecodeCall::Stage::kRunning:
      // Frees its blocks; the sink gets the kCancelled event and lets go.
      generator.Cancel(call->id());
      break;
    case DecodeCall::Stage::kNew:
    case DecodeCall::Stage::kEnded:
      break;
  }
  call->stage = DecodeCall::Stage::kEnded;
}

grpc::ServerUnaryReactor* DecodeWorker::Reserve(
    grpc::CallbackServerContext* context, const wire::ReserveRequest* request,
    wire::Landing* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const RequestId id(request->request_id());
  if (id.value == 0) {
    reactor->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                 "request_id must be set"));
    return reactor;
  }
  // Past int32 is past any context; the Generator refuses it.
  const int32_t num_tokens =
      static_cast<int32_t>(std::min<uint32_t>(request->num_tokens(), 1u << 30));
  response->set_decode_worker_id(worker_id());
  for (const kv::KvReceiverOffer& o : receiver_->offers()) {
    wire::KvOffer* offer = response->add_offers();
    offer->set_transport(o.transport);
    offer->set_endpoint(o.endpoint);
    offer->set_region_id(o.region.value);
  }
  response->set_pool_blocks(static_cast<uint32_t>(loop_->num_kv_blocks()));
  ToWire(loop_->kv_layout(), response->mutable_layout());
  const int32_t prompt_tokens = static_cast<int32_t>(
      std::min<uint32_t>(request->prompt_tokens(), 1u << 30));
  std::vector<uint64_t> hashes(request->prompt_block_hashes().begin(),
                               request->prompt_block_hashes().end());
  loop_->Post([this, id, num_tokens, prompt_tokens, hashes = std::move(hashes),
               response, reactor](Generator& g) {
    if (draining()) {
      reactor->Finish(ToGrpcStatus(DrainingError("decode")));
      return;
    }
    if (released_early_.erase(id) > 0) {
      reactor->Finish(grpc::Status(
          grpc::StatusCode::ABORTED,
          absl::StrCat("request ", id.value,
                       " was released before its reservation arrived")));
      return;
    }
    absl::StatusOr<KvReservation> reserved =
        g.Reserve(id, num_tokens, prompt_tokens, hashes);
    if (!reserved.ok()) {
      reactor->Finish(ToGrpcStatus(reserved.status()));
      return;
    }
    const std::span<const BlockId> blocks = reserved->blocks;
    response->mutable_block_ids()->Reserve(static_cast<int>(blocks.size()));
    for (BlockId b : blocks) response->add_block_ids(b.value);
    response->set_cached_tokens(static_cast<uint32_t>(reserved->cached_tokens));
    const uint64_t landing_id = receiver_->fence().Open();
    response->set_landing_id(landing_id);
    reservations_[id] = Reservation{
        .expires = absl::Now() + options_.reservation_timeout,
        .landing_id = landing_id,
        .blocks = {blocks.begin(), blocks.end()},
        .cached_tokens = static_cast<uint32_t>(reserved->cached_tokens)};
    // A caller that asks GetLoad once Reserve returned sees the blocks taken.
    loop_->PublishLoad();
    reactor->Finish(grpc::Status::OK);
  });
  return reactor;
}

grpc::ServerWriteReactor<wire::DecodeResponse>* DecodeWorker::Decode(
    grpc::CallbackServerContext* context, const wire::DecodeRequest* request) {
  std::shared_ptr<DecodeCall> call = DecodeCall::Create(this, *request);
  loop_->Post([this, call](Generator& g) { StartDecode(call, g); });
  return call.get();
}

grpc::ServerUnaryReactor* DecodeWorker::Release(
    grpc::CallbackServerContext* context, const wire::ReleaseRequest* request,
    wire::ReleaseResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const RequestId id(request->request_id());
  loop_->Post([this, id, reactor](Generator& g) {
    if (auto it = reservations_.find(id); it != reservations_.end()) {
      if (const std::shared_ptr<DecodeCall>& parked = it->second.parked) {
        parked->stage = DecodeCall::Stage::kEnded;
        parked->End(grpc::Status(grpc::StatusCode::ABORTED,
                                 "the reservation was released"));
      }
      DropReservation(it, g);
    } else if (id.value != 0) {
      NoteEarlyRelease(id);
    }
    // A caller that asks GetLoad once Release returned sees the blocks free.
    loop_->PublishLoad();
    reactor->Finish(grpc::Status::OK);
  });
  return reactor;
}

grpc::ServerUnaryReactor* DecodeWorker::GetLoad(
    grpc::CallbackServerContext* context, const wire::LoadRequest* request,
    wire::LoadReport* response) {
  const EngineLoad load = loop_->load();
  response->set_worker_id(worker_id());
  response->set_role("decode");
  response->set_model(options_.engine.model);
  ToWire(loop_->kv_layout(), response->mutable_layout());
  ToWire(load, response);
  ToWire(loop_->kv_events(), *request, response);
  if (draining()) {
    response->set_draining(true);
    drain_reported_.store(true, std::memory_order_release);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace pdserve
