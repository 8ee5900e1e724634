// DecodeWorker: the pdserve.internal.v1.DecodeWorker service
// (proto/pdserve/internal/v1/worker.proto) over an EngineLoop. It owns the
// big paged KV pool, registered once with each transport of its
// kv::KvReceiver (the receiving half of the hand-off, kv_transfer/
// kv_receiver.h): Reserve() holds blocks for a request and answers a
// Landing that offers every one of those transports,
// prefill workers write the prompt's KV straight into those blocks and send
// a KvComplete notification, and Decode() then continues the request from
// its first token in the continuous-batching loop, streaming tokens. A
// Decode without a first token prefills locally (colocated mode). A device
// pool (cuda backend) is registered as is with transports of device memory
// (cuda_ipc, nccl) and through its pinned host staging with the others; KV
// landing in the staging is copied into the pool at KvComplete, before
// the request decodes.
//
// One request, across the threads that touch it:
//   gRPC threads         Reserve / Decode / Release / cancellation: post a
//                        command to the loop and return.
//   notification threads KvComplete (one thread per transport) -> post
//                        "complete" to the loop.
//   loop thread          reservations (expiry on the tick), AddPrefilled or
//                        Add, token events -> the call's stream.
// A Decode that ends early (client cancel, deadline, server shutdown)
// cancels its request in the engine, or drops its reservation when it was
// still waiting for the KV; a reservation that no Decode takes within the
// reservation timeout is dropped.
//
// Draining (common/drain.h): once StartDraining() ran, Reserve and a
// Decode without first_token (a local prefill) are refused with
// UNAVAILABLE "... draining ..." (checked on the loop thread, so a
// reservation is either made before the drain or refused); a Decode that
// takes a reservation made before, and every stream running, are served
// to their end. RequestsInFlight() counts what is left: requests in the
// engine plus reservations open.
//
// Fencing (kv_transfer/landing_fence.h): each reservation is a landing
// with an id no other landing ever had; every KV write and the KvComplete
// carry it. A dropped reservation's blocks are held back from the pool
// until no byte of its push can still land in them: its sender said it is
// done (KvComplete, aborted or not), or every transport here drops writes
// into closed landings (tcp), or the quarantine has passed. So a late
// write never lands in blocks another request owns.
//
// Thread-safety: the service methods are called by gRPC on any thread and
// never block. Destroy only after the server serving it has shut down.
#ifndef PDSERVE_DECODE_WORKER_DECODE_WORKER_H_
#define PDSERVE_DECODE_WORKER_DECODE_WORKER_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/drain.h"
#include "decode_worker/decode_metrics.h"
#include "engine/engine_loop.h"
#include "kv_transfer/kv_receiver.h"
#include "kv_transfer/transport.h"
#include "pdserve/internal/v1/worker.grpc.pb.h"

namespace pdserve {

struct DecodeWorkerOptions {
  // The model, its KV pool and the engine loop.
  EngineConfig engine;
  // Name in load reports and landings; set_worker_id can set it later.
  // Default: empty.
  std::string worker_id;
  // kv_transfer transports KV may arrive on: a comma list in preference
  // order (kv::ParseKvTransportList), every one offered in each landing.
  // Default: "tcp".
  std::string kv_transport = "tcp";
  // Address the transports that listen on a socket (tcp) listen on.
  // Default: "127.0.0.1:0".
  std::string kv_listen_address = "127.0.0.1:0";
  // A reservation no Decode has taken by then is freed; a Decode waiting
  // for KvComplete past it fails with DEADLINE_EXCEEDED. The router
  // releases reservations it gives up on, so this only catches a router
  // that vanished; it must outlast the longest wait in a prefill queue.
  // Default: 60 s.
  absl::Duration reservation_timeout = absl::Seconds(60);
  // How long the blocks of a dropped reservation are held back when a
  // one-sided transport (ucx, inproc, cuda_ipc, nccl) is offered and the
  // sender never said it was done: must exceed the prefill workers'
  // --transfer_timeout_ms. Default: 15 s.
  absl::Duration kv_quarantine = absl::Seconds(15);
  // Faults injected into every KV transport (kv::ParseKvFaultSpec; tests
  // only). Default: empty, none.
  std::string kv_fault;
};

class DecodeWorker final : public internal::v1::DecodeWorker::CallbackService,
                           public DrainableWorker {
 public:
  // Loads the model, allocates the KV pool and registers it with every
  // transport, starts the engine loop and the notification threads.
  // INVALID_ARGUMENT for bad options (a malformed transport list); NOT_FOUND
  // for an unknown model, backend or transport.
  static absl::StatusOr<std::unique_ptr<DecodeWorker>> Create(
      const DecodeWorkerOptions& options);
  // Stops the notification threads, waits for KV writes in progress, stops
  // the loop; Decode calls still open end with UNAVAILABLE.
  ~DecodeWorker() override;

  // Shares the prompt's longest cached prefix of full blocks when the
  // request brings its block hashes (Landing.cached_tokens).
  // RESOURCE_EXHAUSTED when the blocks are not free; INVALID_ARGUMENT for
  // a zero request id, a duplicate id, num_tokens outside [1, context] or
  // prompt_tokens above it.
  grpc::ServerUnaryReactor* Reserve(grpc::CallbackServerContext* context,
                                    const internal::v1::ReserveRequest* request,
                                    internal::v1::Landing* response) override;
  // With first_token: NOT_FOUND without a reservation, DEADLINE_EXCEEDED
  // when its KV does not land within the reservation timeout,
  // INVALID_ARGUMENT when the landed KV does not cover the prompt (or the
  // push disagrees with the landing's cached_tokens, or the prompt is not
  // the one whose block hashes the Reserve shared).
  // Without: prefills locally. INVALID_ARGUMENT for what the engine
  // refuses (and a zero id); RESOURCE_EXHAUSTED when the request could
  // never fit in the pool.
  grpc::ServerWriteReactor<internal::v1::DecodeResponse>* Decode(
      grpc::CallbackServerContext* context,
      const internal::v1::DecodeRequest* request) override;
  // Draining: UNAVAILABLE (DrainingError) for the ones above that bring new
  // work (Reserve; Decode without first_token).
  // Frees a reservation; a Decode waiting on it ends with ABORTED.
  grpc::ServerUnaryReactor* Release(
      grpc::CallbackServerContext* context,
      const internal::v1::ReleaseRequest* request,
      internal::v1::ReleaseResponse* response) override;
  grpc::ServerUnaryReactor* GetLoad(
      grpc::CallbackServerContext* context,
      const internal::v1::LoadRequest* request,
      internal::v1::LoadReport* response) override;

  void set_worker_id(std::string id) ABSL_LOCKS_EXCLUDED(mu_);

  // DrainableWorker.
  void StartDraining() override;
  bool draining() const override {
    return draining_.load(std::memory_order_acquire);
  }
  // Asks the loop (waits up to 1 s for its answer; unanswered, the last
  // published load's count).
  int64_t RequestsInFlight() override;
  bool drain_reported() const override {
    return drain_reported_.load(std::memory_order_acquire);
  }

  // pd-decode's metrics, for /metrics (decode_metrics.h).
  const MetricsRegistry& metrics() { return metrics_.registry(); }
  // Blocks of its KV pool (what it announces in etcd).
  int32_t num_kv_blocks() const { return loop_->num_kv_blocks(); }

 private:
  class DecodeCall;
  // A reservation; loop thread only.
  struct Reservation {
    absl::Time expires;
    // The landing's fence id (Landing.landing_id).
    uint64_t landing_id = 0;
    // KvComplete arrived: the prompt's KV of kv_tokens tokens landed.
    bool kv_complete = false;
    uint32_t kv_tokens = 0;
    // The KvComplete's cached_tokens: what the push left alone.
    uint32_t kv_cached_tokens = 0;
    // It landed in the pool's host staging, not in the pool.
    bool kv_staged = false;
    // The reserved blocks, in sequence order; the first cached_tokens
    // positions are shared prefix-cache blocks (Landing.cached_tokens).
    std::vector<BlockId> blocks;
    uint32_t cached_tokens = 0;
    // A Decode waiting for KvComplete.
    std::shared_ptr<DecodeCall> parked;
  };
  using ReservationMap = absl::flat_hash_map<RequestId, Reservation>;

  // The blocks of a dropped reservation whose landing is not fenced yet.
  struct Quarantined {
    uint64_t landing_id = 0;
    std::vector<BlockId> blocks;
  };

  explicit DecodeWorker(const DecodeWorkerOptions& options);
  std::string worker_id() const ABSL_LOCKS_EXCLUDED(mu_);
  // A notification over the receiver's offer `offer` (its thread).
  void OnNotification(size_t offer, kv::Notification notification);

  // Loop thread.
  void StartDecode(const std::shared_ptr<DecodeCall>& call,
                   Generator& generator);
  // Admits a prefilled call whose reservation `it` has its KV.
  void ContinuePrefilled(const std::shared_ptr<DecodeCall>& call,
                         ReservationMap::iterator it, Generator& generator);
  // Streams `call`'s events once its request is in the engine (`status`
  // OK), or ends it with `status`.
  void Begin(const std::shared_ptr<DecodeCall>& call, absl::Status status);
  void CancelDecode(const std::shared_ptr<DecodeCall>& call,
                    Generator& generator);
  void OnKvComplete(const internal::v1::KvComplete& complete, bool staged,
                    Generator& generator);
  // Copies the staged KV of `reservation`'s positions [cached_tokens,
  // tokens), every layer, from the host staging into the pool (the shared
  // blocks before are the pool's own).
  absl::Status UnstageKv(const Reservation& reservation, uint32_t tokens);
  // Expires reservations and early releases past their time.
  void ExpireReservations(Generator& generator);
  // Remembers a Release of `id` that found no reservation.
  void NoteEarlyRelease(RequestId id);
  // Ends a reservation whose KV the engine did not take: its blocks go
  // back to the pool once its landing is fenced.
  void DropReservation(ReservationMap::iterator it, Generator& generator);
  // Hands back the quarantined blocks whose landing is fenced now.
  void FreeFencedBlocks(Generator& generator);

  const DecodeWorkerOptions options_;
  // The receiving half of the hand-off: transports, landings, fence. Set
  // once in Create.
  std::unique_ptr<kv::KvReceiver> receiver_;
  // Per offer of the receiver: KV bytes its KvCompletes announced. Filled
  // in Create.
  std::vector<Counter*> received_bytes_;
  // Loop thread only.
  ReservationMap reservations_;
  std::vector<Quarantined> quarantined_;
  // Ids released before any reservation of theirs arrived, until when a
  // late Reserve of one is refused: the router releases a Reserve it got no
  // answer to, and the two calls' handlers may run in either order (a
  // partition that heals while both are in flight), so without this the
  // late Reserve would hold its blocks until reservation_timeout. At most
  // kMaxEarlyReleases, the oldest dropped first.
  static constexpr size_t kMaxEarlyReleases = 1 << 16;
  absl::flat_hash_map<RequestId, absl::Time> released_early_;
  // Before loop_: the loop's on_step hook records into it.
  DecodeMetrics metrics_;
  // Set once in Create; stopped first (its thread uses the fields above).
  std::unique_ptr<EngineLoop> loop_;

  // Set once by StartDraining; read by the loop thread and scrapes.
  std::atomic<bool> draining_ = false;
  // A GetLoad answered `draining`.
  std::atomic<bool> drain_reported_ = false;

  mutable absl::Mutex mu_;
  std::string worker_id_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve

#endif  // PDSERVE_DECODE_WORKER_DECODE_WORKER_H_
