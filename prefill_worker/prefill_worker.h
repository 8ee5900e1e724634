// PrefillWorker: the pdserve.internal.v1.PrefillWorker service
// (proto/pdserve/internal/v1/worker.proto). It runs prompts on an EngineLoop
// — batched under a token budget, long prompts in chunks, prefix caching —
// and pushes each layer's KV into the decode worker's landing blocks as soon
// as that layer is computed (kv::KvSender), then notifies the decode worker
// (KvComplete) and answers the first token.
//
// One request, across the threads that touch it:
//   gRPC thread    Prefill(): checks the landing and the request, posts Add.
//   loop thread    Add (hold_kv, max_tokens 1); layer observer -> PushLayer;
//                  first-token event -> KvSender::Finish.
//   lane thread    (the sender's thread for the landing's decode worker)
//                  the layer writes, the KvComplete notification, then
//                  posts ReleaseKv to the loop and finishes the RPC.
// A failed transfer or a cancelled call (client cancel, deadline) aborts
// the push and cancels the engine request; the sender then tells the
// decode worker with an aborted KvComplete when it can. The KV blocks are
// released only from the push's `done`, after the sender has stopped
// reading them.
//
// Draining (common/drain.h): once StartDraining() ran, Prefill calls are
// refused with UNAVAILABLE "... draining ..."; those in flight run to the
// end of their push. RequestsInFlight() is in_flight().
//
// Thread-safety: the service methods are called by gRPC on any thread and
// never block. set_worker_id and in_flight from any thread.
// Destroy only after the server serving it has shut down and
// WaitUntilIdle() returned (no call in flight).
#ifndef PDSERVE_PREFILL_WORKER_PREFILL_WORKER_H_
#define PDSERVE_PREFILL_WORKER_PREFILL_WORKER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/drain.h"
#include "engine/engine_loop.h"
#include "pdserve/internal/v1/worker.grpc.pb.h"
#include "kv_transfer/kv_sender.h"
#include "prefill_worker/prefill_metrics.h"

namespace pdserve {

struct PrefillWorkerOptions {
  // The model, its KV pool and the engine loop.
  EngineConfig engine;
  // Name in load reports; set_worker_id can set it later. Default: empty.
  std::string worker_id;
  // kv_transfer transports the KV may be pushed with: a comma list
  // (kv::ParseKvTransportList). Each landing's KV goes over the best one
  // the decode worker also offers (kv_transfer/negotiation.h). Default:
  // "tcp".
  std::string kv_transport = "tcp";
  // Limit on every wait of a KV transfer (connect, a write's
  // acknowledgement, the notification's); past it the Prefill call fails
  // with DEADLINE_EXCEEDED. Default: 10 s.
  absl::Duration transfer_timeout = absl::Seconds(10);
  // Faults injected into every KV transport (kv::ParseKvFaultSpec; tests
  // only). Default: empty, none.
  std::string kv_fault;
};

class PrefillWorker final
    : public internal::v1::PrefillWorker::CallbackService,
      public DrainableWorker {
 public:
  // Loads the model, allocates the KV pool and starts the engine loop and
  // the KV sender. INVALID_ARGUMENT for bad options; NOT_FOUND for an unknown
  // backend or transport; model loading errors as they come.
  static absl::StatusOr<std::unique_ptr<PrefillWorker>> Create(
      const PrefillWorkerOptions& options);
  ~PrefillWorker() override;

  grpc::ServerUnaryReactor* Prefill(
      grpc::CallbackServerContext* context,
      const internal::v1::PrefillRequest* request,
      internal::v1::PrefillResponse* response) override;
  grpc::ServerUnaryReactor* GetLoad(
      grpc::CallbackServerContext* context,
      const internal::v1::LoadRequest* request,
      internal::v1::LoadReport* response) override;

  void set_worker_id(std::string id) ABSL_LOCKS_EXCLUDED(mu_);
  // Prefill calls not done yet.
  int in_flight() const ABSL_LOCKS_EXCLUDED(mu_);
  // Blocks until no Prefill call is in flight or `deadline` passes; true
  // when idle.
  bool WaitUntilIdle(absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);

  // DrainableWorker.
  void StartDraining() override ABSL_LOCKS_EXCLUDED(mu_);
  bool draining() const override ABSL_LOCKS_EXCLUDED(mu_);
  int64_t RequestsInFlight() override { return in_flight(); }
  bool drain_reported() const override ABSL_LOCKS_EXCLUDED(mu_);

  const KvBlockLayout& kv_layout() const { return loop_->kv_layout(); }
  // pd-prefill's metrics, for /metrics (prefill_metrics.h).
  const MetricsRegistry& metrics() { return metrics_->registry(); }
  // Blocks of its KV pool (what it announces in etcd).
  int32_t num_kv_blocks() const { return loop_->num_kv_blocks(); }

 private:
  class PrefillCall;

  PrefillWorker(const PrefillWorkerOptions& options,
                std::unique_ptr<PrefillMetrics> metrics,
                std::unique_ptr<EngineLoop> loop);
  // The checks that need no engine state: the landing's usable offers,
  // best first, or the status to fail the call with.
  absl::StatusOr<std::vector<kv::KvOffer>> CheckRequest(
      const internal::v1::PrefillRequest& request) const;
  // Loop thread.
  void Start(PrefillCall* call, Generator& generator);
  void OnLayer(int32_t layer, std::span<const ComputedKv> computed);
  bool OnEvent(PrefillCall* call, const GenerationEvent& event);
  // A sender lane thread: the push of `call` is over.
  void OnPushDone(PrefillCall* call, absl::Status status,
                  const kv::KvPushStats& stats);
  // Any thread: stop computing `push`'s request (no-op once it is gone).
  void CancelInEngine(const std::shared_ptr<kv::KvPush>& push);
  void PostToLoop(EngineLoop::Command command) ABSL_LOCKS_EXCLUDED(mu_);
  void CallDone() ABSL_LOCKS_EXCLUDED(mu_);

  const PrefillWorkerOptions options_;
  // Outlives the loop and the sender, which record into it.
  const std::unique_ptr<PrefillMetrics> metrics_;
  std::unique_ptr<kv::KvSender> sender_;  // Set once in Create.
  // Destroyed before sender_ (the loop's observer and sinks use it). The
  // sender's lanes reach it only through PostToLoop.
  std::unique_ptr<EngineLoop> loop_;

  // Loop thread only. The requests the engine holds (from Add until
  // ReleaseKv) by id: a Prefill call for an id held here is refused.
  absl::flat_hash_map<RequestId, std::shared_ptr<kv::KvPush>> active_;
  std::vector<kv::LayerKv> layer_scratch_;  // Scratch of OnLayer.

  mutable absl::Mutex mu_;
  std::string worker_id_ ABSL_GUARDED_BY(mu_);
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  // Set once by StartDraining: Prefill calls are refused.
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  // A GetLoad answered `draining`.
  bool drain_reported_ ABSL_GUARDED_BY(mu_) = false;
  // Set while the loop is being destroyed: the sender stops posting to it.
  bool loop_gone_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace pdserve

#endif  // PDSERVE_PREFILL_WORKER_PREFILL_WORKER_H_
