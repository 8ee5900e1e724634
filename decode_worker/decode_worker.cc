#include "decode_worker/decode_worker.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "proto/convert.h"

namespace pdserve {

namespace wire = ::pdserve::internal::v1;

// One Decode call: a server stream fed by the engine loop. Owned by a
// shared_ptr: the reactor's own reference lasts until OnDone, the engine's
// sink and a parked reservation hold theirs as long as they may call in.
class DecodeWorker::DecodeCall final : public grpc::ServerWriteReactor<wire::DecodeResponse> {
 public:
  static std::shared_ptr<DecodeCall> Start(DecodeWorker* worker, const wire::DecodeRequest& request) {
    std::shared_ptr<DecodeCall> call(new DecodeCall(worker, request));
    call->self_ = call;
    return call;
  }

  RequestId id() const { return id_; }
  const wire::DecodeRequest& request() const { return request_; }

  // Loop thread: one engine event. Returns true after the last one.
  bool OnEngineEvent(const GenerationEvent& e) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (!e.has_token) {  // Cancelled in the engine.
      if (!final_status_) final_status_ = grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
      MaybeWrite();
      return true;
    }
    ToWire(e.token, pending_.add_tokens());
    const bool last = e.finish != FinishReason::kNone;
    if (last) {
      pending_.set_finish_reason(ToWire(e.finish));
      if (!final_status_) final_status_ = grpc::Status::OK;
    }
    MaybeWrite();
    return last;
  }

  // Any thread: ends the call with `status` once queued tokens are out.
  void End(grpc::Status status) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (!final_status_) final_status_ = std::move(status);
    MaybeWrite();
  }

  void OnWriteDone(bool ok) override ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    write_in_flight_ = false;
    if (!ok) {  // The stream broke (client gone); nothing more goes out.
      if (!final_status_) final_status_ = grpc::Status(grpc::StatusCode::CANCELLED, "stream broken");
      pending_.Clear();
    }
    MaybeWrite();
  }

  void OnCancel() override {
    DecodeWorker* worker = worker_;
    const RequestId id = id_;
    worker->loop_->Post([worker, id](Generator& g) {
      if (auto it = worker->reservations_.find(id); it != worker->reservations_.end()) {
        g.ReleaseReservation(id);
        worker->reservations_.erase(it);
      }
      g.Cancel(id);
    });
    End(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the caller"));
  }

  void OnDone() override {
    std::shared_ptr<DecodeCall> self;
    {
      absl::MutexLock lock(&mu_);
      done_ = true;
      self = std::move(self_);
    }
    // `self` may be the last reference: this object ends with the scope.
  }

 private:
  DecodeCall(DecodeWorker* worker, const wire::DecodeRequest& request)
      : worker_(worker), request_(request), id_(request.request().request_id()) {}

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
  const wire::DecodeRequest request_;
  const RequestId id_;

  absl::Mutex mu_;
  std::shared_ptr<DecodeCall> self_ ABSL_GUARDED_BY(mu_);
  wire::DecodeResponse pending_ ABSL_GUARDED_BY(mu_);  // Tokens not written yet.
  wire::DecodeResponse writing_ ABSL_GUARDED_BY(mu_);  // The write in flight.
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
  PD_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, Model::Load(options.model));
  PD_ASSIGN_OR_RETURN(std::unique_ptr<ModelRunner> runner,
                      CreateModelRunner(model, {.backend = options.backend,
                                                .kv_cache_bytes = options.kv_cache_bytes,
                                                .block_size = options.block_size,
                                                .num_threads = options.num_threads}));
  kv::TransportOptions transport_options;
  transport_options.listen_address = options.kv_listen_address;
  PD_ASSIGN_OR_RETURN(std::unique_ptr<kv::KvTransport> transport,
                      kv::CreateKvTransport(options.kv_transport, transport_options));
  std::unique_ptr<DecodeWorker> worker(new DecodeWorker(options, std::move(transport)));
  EngineLoop::Options loop_options;
  loop_options.generator = {.max_batch_tokens = options.max_batch_tokens,
                            .max_running = options.max_running};
  DecodeWorker* w = worker.get();
  PD_ASSIGN_OR_RETURN(worker->loop_,
                      EngineLoop::Create(std::move(runner), loop_options,
                                         [w](Generator& g) { w->ExpireReservations(g); }));
  PD_ASSIGN_OR_RETURN(worker->region_, worker->transport_->RegisterMemory(worker->loop_->kv_memory()));
  worker->notification_thread_ = std::thread([w] { w->ReceiveNotifications(); });
  PD_LOG(INFO) << "decode worker: model " << options.model << ", " << worker->loop_->num_kv_blocks()
               << " KV blocks of " << options.block_size << " tokens, KV over "
               << options.kv_transport << " at " << worker->transport_->endpoint();
  return worker;
}

DecodeWorker::DecodeWorker(const DecodeWorkerOptions& options,
                           std::unique_ptr<kv::KvTransport> transport)
    : options_(options), transport_(std::move(transport)), worker_id_(options.worker_id) {}

DecodeWorker::~DecodeWorker() {
  stopping_ = true;
  if (notification_thread_.joinable()) notification_thread_.join();
  // Streams still subscribed get a cancellation from the loop's destructor.
  loop_.reset();
  for (auto& [id, r] : reservations_) {
    if (r.parked) r.parked->End(grpc::Status(grpc::StatusCode::UNAVAILABLE, "worker shutting down"));
  }
  reservations_.clear();
}

void DecodeWorker::set_worker_id(std::string id) {
  absl::MutexLock lock(&mu_);
  worker_id_ = std::move(id);
}

std::string DecodeWorker::worker_id() const {
  absl::MutexLock lock(&mu_);
  return worker_id_;
}

void DecodeWorker::ReceiveNotifications() {
  while (!stopping_) {
    absl::StatusOr<kv::Notification> n = transport_->WaitNotification(absl::Milliseconds(100));
    if (!n.ok()) {
      if (n.status().code() != absl::StatusCode::kDeadlineExceeded) {
        PD_LOG(WARNING) << "KV notification: " << n.status();
      }
      continue;
    }
    wire::KvComplete complete;
    if (!complete.ParseFromString(n->message)) {
      PD_LOG(WARNING) << "ignoring a KV notification that is not a KvComplete ("
                      << n->message.size() << " bytes)";
      continue;
    }
    const uint64_t id = complete.request_id();
    loop_->Post([this, id](Generator& g) { OnKvComplete(id, g); });
  }
}

void DecodeWorker::OnKvComplete(uint64_t request_id, Generator& generator) {
  auto it = reservations_.find(RequestId(request_id));
  if (it == reservations_.end()) {
    PD_LOG(WARNING) << "KvComplete for request " << request_id
                    << " without a reservation (expired or released)";
    return;
  }
  it->second.kv_complete = true;
  if (std::shared_ptr<DecodeCall> parked = std::move(it->second.parked)) {
    StartDecode(parked, generator);
  }
}

void DecodeWorker::ExpireReservations(Generator& generator) {
  const absl::Time now = absl::Now();
  for (auto it = reservations_.begin(); it != reservations_.end();) {
    if (it->second.expires > now) {
      ++it;
      continue;
    }
    const RequestId id = it->first;
    if (it->second.parked) {
      it->second.parked->End(grpc::Status(
          grpc::StatusCode::DEADLINE_EXCEEDED,
          absl::StrCat("the KV of request ", id.value, " did not arrive within ",
                       absl::FormatDuration(options_.reservation_timeout))));
    } else {
      PD_LOG(WARNING) << "reservation of request " << id.value << " expired unused";
    }
    generator.ReleaseReservation(id);
    reservations_.erase(it++);
  }
}

void DecodeWorker::StartDecode(const std::shared_ptr<DecodeCall>& call, Generator& generator) {
  const RequestId id = call->id();
  GenerationRequest request = FromWire(call->request().request());
  absl::Status status;
  if (call->request().has_first_token()) {
    auto it = reservations_.find(id);
    if (it == reservations_.end()) {
      status = absl::NotFoundError(absl::StrCat("no KV reservation for request ", id.value,
                                                " (never made, expired or released)"));
    } else if (!it->second.kv_complete) {
      if (it->second.parked) {
        status = absl::InvalidArgumentError(
            absl::StrCat("request ", id.value, " already has a Decode call"));
      } else {
        it->second.parked = call;  // Starts on KvComplete.
        return;
      }
    } else {
      status = generator.AddPrefilled(std::move(request), call->request().first_token().token_id());
      if (!status.ok()) generator.ReleaseReservation(id);
      reservations_.erase(it);
    }
  } else {
    status = generator.Add(std::move(request));
  }
  if (!status.ok()) {
    call->End(ToGrpcStatus(status));
    return;
  }
  loop_->Subscribe(id, [call](const GenerationEvent& e) { return call->OnEngineEvent(e); });
}

grpc::ServerUnaryReactor* DecodeWorker::Reserve(grpc::CallbackServerContext* context,
                                                const wire::ReserveRequest* request,
                                                wire::Landing* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const RequestId id(request->request_id());
  const int32_t num_tokens =
      static_cast<int32_t>(std::min<uint32_t>(request->num_tokens(), 1u << 30));
  response->set_decode_worker_id(worker_id());
  response->set_transport(transport_->capabilities().name);
  response->set_endpoint(transport_->endpoint());
  response->set_region_id(region_.value);
  response->set_pool_blocks(static_cast<uint32_t>(loop_->num_kv_blocks()));
  ToWire(loop_->kv_layout(), response->mutable_layout());
  loop_->Post([this, id, num_tokens, response, reactor](Generator& g) {
    absl::StatusOr<std::span<const BlockId>> blocks = g.Reserve(id, num_tokens);
    if (!blocks.ok()) {
      reactor->Finish(ToGrpcStatus(blocks.status()));
      return;
    }
    for (BlockId b : *blocks) response->add_block_ids(b.value);
    reservations_[id] = Reservation{.expires = absl::Now() + options_.reservation_timeout};
    reactor->Finish(grpc::Status::OK);
  });
  return reactor;
}

grpc::ServerWriteReactor<wire::DecodeResponse>* DecodeWorker::Decode(
    grpc::CallbackServerContext* context, const wire::DecodeRequest* request) {
  std::shared_ptr<DecodeCall> call = DecodeCall::Start(this, *request);
  loop_->Post([this, call](Generator& g) { StartDecode(call, g); });
  return call.get();
}

grpc::ServerUnaryReactor* DecodeWorker::Release(grpc::CallbackServerContext* context,
                                                const wire::ReleaseRequest* request,
                                                wire::ReleaseResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const RequestId id(request->request_id());
  loop_->Post([this, id, reactor](Generator& g) {
    if (auto it = reservations_.find(id); it != reservations_.end()) {
      if (it->second.parked) {
        it->second.parked->End(grpc::Status(grpc::StatusCode::ABORTED, "reservation released"));
      }
      g.ReleaseReservation(id);
      reservations_.erase(it);
    }
    reactor->Finish(grpc::Status::OK);
  });
  return reactor;
}

grpc::ServerUnaryReactor* DecodeWorker::GetLoad(grpc::CallbackServerContext* context,
                                                const wire::LoadRequest* request,
                                                wire::LoadReport* response) {
  const EngineLoad load = loop_->load();
  response->set_worker_id(worker_id());
  response->set_role("decode");
  response->set_model(options_.model);
  ToWire(loop_->kv_layout(), response->mutable_layout());
  response->set_total_blocks(load.total_blocks);
  response->set_free_blocks(load.free_blocks);
  response->set_running(load.running);
  response->set_waiting(load.waiting);
  response->set_reservations(load.reserved);
  response->set_pending_prompt_tokens(load.pending_prompt_tokens);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace pdserve
