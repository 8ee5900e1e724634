// RequestOrchestrator: runs Generate requests across the cluster without a
// thread per request, following DESIGN.md's request flow "decode reserves,
// prefill pushes":
//
//   validate and tokenize -> admit (KV capacity) -> Reserve on a decode
//   worker D -> Prefill on a prefill worker P with D's landing (retried on
//   other P with the same reservation) -> stream the first token -> Decode
//   on D from the first token -> stream tokens until a finish.
//
// Every downstream call is a gRPC callback (reactor) client call; the
// router's threads only react to their completions, and a request costs
// its state (a few KiB) rather than a thread. Where a request runs is the
// registry's routing policy (routing_policy.h): a decode worker D and a
// prefill worker P, or D alone — conditional disaggregation: short
// uncached prompts, prefill workers that are the bottleneck, or none
// healthy — which then skips Reserve/Prefill and prefills the prompt
// itself. Reserve carries the prompt's block hashes, so D shares the
// prefix blocks its cache holds and P pushes only the rest.
//
// Admission is by KV capacity. The orchestrator keeps a ledger of the KV
// blocks (prompt + max_tokens, rounded up to D's blocks) each request it
// placed holds on its decode worker; a request is placed on a decode worker
// whose reported pool has room for it beyond the ledger. A request no worker
// has room for waits in a bounded queue, lowest GenerateRequest.priority
// first and in arrival order within a priority, and is placed as soon as a
// request ends or a load report shows room (and re-checked every
// recheck_interval). The queue full, or a request larger than every decode
// worker's pool, is RESOURCE_EXHAUSTED at once; no healthy decode worker is
// UNAVAILABLE. A request waiting past its deadline ends DEADLINE_EXCEEDED.
//
// Faults: a D that answers RESOURCE_EXHAUSTED (another router filled it)
// sends the request to the next D with room, or back to its place in the
// queue; when every D has answered so, the request fails with
// RESOURCE_EXHAUSTED. A worker answering INVALID_ARGUMENT to a request the
// router checked is INTERNAL to the client (the cluster's fault, not the
// request's). Every downstream call carries the client's deadline and is
// cancelled when the client cancels; a reservation that will not be decoded
// is released.
//
// Migration. A D that fails otherwise — its Reserve or Decode call ends
// with any other code: UNAVAILABLE (gone, the channel broke), INTERNAL or
// UNKNOWN (a crash), DEADLINE_EXCEEDED (a parked decode whose KV never
// came), NOT_FOUND (it lost the reservation), ... — or whose
// running Decode stream sends nothing for decode_stall_timeout (the call is
// then cancelled, which frees the request there once the worker runs
// again), loses the choice: its blocks leave the ledger, that D is
// excluded for this choice (the registry's health checks judge the worker
// itself), and the choice goes back to admission, keeping its place, to be
// placed anew. It resumes there from what the client has: the prompt plus
// every token relayed so far as the new prompt, resumed_tokens their count
// (the engine samples on at that step and counts them as output, so the
// continuation equals the uninterrupted run, greedy or seeded), max_tokens
// what is left; prefilled by a prefill worker into a fresh reservation or
// locally, as the policy chooses. No token is sent twice or skipped; usage
// keeps the original prompt length and counts every token. The same holds
// before the first token. A choice migrates at most migration_limit times;
// past that, or when no decode worker is left to take it, its stream ends
// UNAVAILABLE (the tokens sent stand) with a message that says how many
// migrations were tried.
//
// n > 1 choices share the prompt's KV through the prefix caches rather than
// an engine-level fork (vLLM V1's fan-out): choice 0 runs as a request of
// its own. As soon as its prompt's KV is in a decode worker's prefix cache —
// its first Decode message came back — choices 1..n-1 start on that worker
// (preferred when it has room) and are prefilled there (it computes only
// the tail past the prompt's last full block). When choice 0 ends with its
// first token on a prefill worker, the other choices go the usual way and
// their prefill worker serves the prompt from its own cache. A choice that
// fails ends the request with its status and cancels the others.
//
// Thread-safety: every method from any thread. Start() never blocks: it
// validates, places or queues the request and returns; its stream hears the
// rest from gRPC's callback threads and the admission thread.
// Ownership: the orchestrator shares the model and borrows the registry,
// which must outlive it; each request keeps its stream until it finishes.
#ifndef PDSERVE_ROUTER_ORCHESTRATOR_H_
#define PDSERVE_ROUTER_ORCHESTRATOR_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "pdserve/v1/generation.pb.h"
#include "router/served_model.h"
#include "router/worker_registry.h"

namespace pdserve {

class RouterMetrics;

// The client side of one Generate request, as the orchestrator sees it.
class GenerateStream {
 public:
  virtual ~GenerateStream() = default;
  // When the client's call ends (its deadline, or the router's default).
  virtual absl::Time deadline() const = 0;
  // Queues `message` for the client; never blocks. For n > 1 the choices
  // send from several threads at once.
  virtual void Send(v1::GenerateResponse message) = 0;
  // The request is over: `status` ends the call (OK after the last message
  // was sent). Called exactly once, after every Send; possibly from inside
  // RequestOrchestrator::Start.
  virtual void End(const absl::Status& status) = 0;
};

// A request the orchestrator runs, as its front end holds it.
class RunningRequest {
 public:
  virtual ~RunningRequest() = default;
  // The client went away: the request ends with CANCELLED (unless it ended
  // already), its downstream calls are cancelled and its reservation is
  // released. Idempotent; any thread; never blocks.
  virtual void Cancel() = 0;
};

class RequestOrchestrator {
 public:
  struct Options {
    // Further prefill workers to try after the first fails. Default: 2.
    int32_t prefill_retries = 2;
    // Deadline of Reserve and Release calls (capped by the client's).
    // Default: 5 s.
    absl::Duration control_timeout = absl::Seconds(5);
    // A Release the decode worker did not answer (down, or cut off by the
    // network) is sent again after 1, 2, 4, ... s for this long, so the
    // blocks of a worker that comes back are not held until its own
    // reservation timeout frees them. Default: 60 s (that timeout's
    // default).
    absl::Duration release_retry_window = absl::Seconds(60);
    // Requests waiting for KV capacity; more are refused with
    // RESOURCE_EXHAUSTED. Default: 4096.
    int32_t max_queued = 4096;
    // How often waiting requests are checked against the workers' latest
    // load reports when no request ended meanwhile. Default: 50 ms.
    absl::Duration recheck_interval = absl::Milliseconds(50);
    // Times one choice may move to another decode worker after its own
    // failed or stalled; 0: never (the stream ends UNAVAILABLE). Default: 3.
    int32_t migration_limit = 3;
    // A Decode stream that has sent a message and then sends none for this
    // long is a stalled worker: the call is cancelled and the choice
    // migrates. Must be positive. Default: 10 s.
    absl::Duration decode_stall_timeout = absl::Seconds(10);
  };

  // `metrics` may be null. Starts the admission thread and the stall watch.
  RequestOrchestrator(std::shared_ptr<const ServedModel> model,
                      WorkerRegistry* registry, RouterMetrics* metrics,
                      const Options& options);
  // Stop(), then waits for every request to end; then ends the stall watch.
  ~RequestOrchestrator();

  // Starts `request`; its messages and its end go to `stream`. Returns the
  // handle that cancels it (it may have finished already, e.g. refused).
  std::shared_ptr<RunningRequest> Start(
      const v1::GenerateRequest& request,
      std::shared_ptr<GenerateStream> stream);

  // Refuses new requests and ends the queued ones with UNAVAILABLE;
  // requests already placed run on (cancel them through their handles).
  // Idempotent.
  void Stop();
  // Waits until no request runs, no downstream call is in flight and no
  // downstream call's context is left.
  void WaitUntilIdle();

  // Requests started and not finished, queued ones included.
  int64_t running() const { return running_.load(std::memory_order_relaxed); }
  // Choices waiting for KV capacity.
  int64_t queued() const;

 private:
  class Choice;
  class Request;
  class DecodeCall;
  friend class Choice;
  friend class Request;
  friend class DecodeCall;

  // Where a choice waits in the queue: (priority, arrival).
  using QueueKey = std::pair<int32_t, uint64_t>;

  // Places `choice` on a decode worker with room (committing its blocks)
  // and starts it there, or queues it, or ends it with the reason it can
  // be neither. A choice coming back from a full or failed worker keeps
  // its first arrival, so it waits ahead of later requests.
  void Admit(const std::shared_ptr<Choice>& choice);
  // The decode worker `choice` goes to now, its blocks committed there; or
  // null with, in `why`, an error when it should not wait.
  const WorkerEndpoint* PlaceLocked(Choice& choice, absl::Status* why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records where a choice was placed (routing metrics).
  void Placed(const Choice& choice);
  // Returns `choice`'s committed blocks; wakes the admission thread when
  // some request waits.
  void Uncommit(Choice& choice);
  // Removes a queued choice; false when it is not queued.
  bool Dequeue(Choice& choice);
  void AdmissionLoop();
  // The stall watch: streams are watched from their start to their end.
  void WatchStream(DecodeCall* call);
  // Whether the watch cancelled `call` as stalled.
  bool UnwatchStream(DecodeCall* call);
  // Every quarter of the stall timeout (at most a second), cancels the
  // watched streams that sent a message once and none for
  // decode_stall_timeout since, and sends the Release retries that are due.
  void StallWatchLoop();
  // A Release to send again (release_retry_window).
  struct ReleaseRetry {
    const WorkerEndpoint* decode = nullptr;
    uint64_t request_id = 0;
    absl::Time due;
    absl::Duration backoff;
    absl::Time give_up;
  };
  // Frees `request_id`'s reservation on `decode`; `done` (may be null)
  // hears how the first attempt went. Unanswered attempts are retried in
  // the background.
  void Release(const WorkerEndpoint* decode, uint64_t request_id,
               std::function<void(const absl::Status&)> done);
  // One attempt of `retry`'s Release; `done` (may be null) hears how it
  // went.
  void SendRelease(ReleaseRetry retry,
                   std::function<void(const absl::Status&)> done);
  void CallStarted() { calls_.fetch_add(1, std::memory_order_relaxed); }
  void CallEnded();
  // The context of one downstream call, counted until it is destroyed
  // (WaitUntilIdle waits for that too). A context holds its channel, and
  // it may go on one of gRPC's callback threads, after the call's
  // callback; were the registry's channels gone by then, the channel
  // would go with it, on that thread, and so might the last reference to
  // gRPC 1.51's shared callback queue, which is then freed under the
  // thread still serving it (an abort in grpc_cq_internal_unref).
  std::shared_ptr<grpc::ClientContext> NewCallContext(absl::Time deadline);
  uint64_t NewId() { return next_id_.fetch_add(1); }

  const std::shared_ptr<const ServedModel> model_;
  WorkerRegistry* const registry_;
  RouterMetrics* const metrics_;
  const Options options_;
  std::atomic<uint64_t> next_id_;
  std::atomic<int64_t> running_ = 0;
  // Choices not ended (placed or queued) and Release calls in flight: what
  // WaitUntilIdle waits for.
  std::atomic<int64_t> calls_ = 0;

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t arrivals_ ABSL_GUARDED_BY(mu_) = 0;
  absl::btree_map<QueueKey, std::shared_ptr<Choice>> queue_
      ABSL_GUARDED_BY(mu_);
  // KV blocks committed per decode worker.
  absl::flat_hash_map<const WorkerEndpoint*, int64_t> committed_
      ABSL_GUARDED_BY(mu_);
  // Set when a request ended or arrived: the admission thread looks now.
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  absl::CondVar wake_cv_;
  absl::CondVar idle_cv_;
  std::thread admission_;

  // The Decode streams in flight, for the stall watch.
  absl::Mutex streams_mu_;
  absl::flat_hash_set<DecodeCall*> streams_ ABSL_GUARDED_BY(streams_mu_);
  std::vector<ReleaseRetry> release_retries_ ABSL_GUARDED_BY(streams_mu_);
  // Set by Stop(): no retry is sent after it (the registry, whose workers
  // they name, may go once Stop and WaitUntilIdle have returned).
  bool releases_stopped_ ABSL_GUARDED_BY(streams_mu_) = false;
  bool watch_stopping_ ABSL_GUARDED_BY(streams_mu_) = false;
  absl::CondVar watch_cv_;

  // Downstream calls' contexts not destroyed yet (NewCallContext), which
  // WaitUntilIdle waits for too.
  absl::Mutex contexts_mu_;
  int64_t live_contexts_ ABSL_GUARDED_BY(contexts_mu_) = 0;
  std::thread stall_watch_;
};

}  // namespace pdserve

#endif  // PDSERVE_ROUTER_ORCHESTRATOR_H_
