// WorkerRegistry: the prefill and decode workers of the cluster config, their
// health and load, and the choice of a worker for a request.
//
// A poller thread asks every worker for its LoadReport (GetLoad, with a short
// deadline) every poll interval, each worker independently, so one hung
// worker delays no other. A worker is healthy from its first good report
// until a poll fails or a call to it fails with UNAVAILABLE, and healthy
// again once it answers. Only healthy, compatible workers are chosen:
//   decode:  most free KV blocks, less the blocks the router reserved on it
//            since its last report; ties go to fewer running + waiting;
//   prefill: fewest pending prompt tokens, plus the prompt tokens the router
//            sent it since its last report (so a burst spreads).
// Remaining ties rotate. A draining worker (its report says `draining`,
// or a call to it was refused as draining: common/drain.h) is healthy but
// never chosen, and holds no KV room for admission, until a report from
// a poll started after the refusal says otherwise (a restarted process).
// Route() instead asks the cluster config's routing
// policy (router/routing_policy.h) for a decode worker and a prefill worker
// (or local prefill) at once, weighing the prefix blocks each worker holds:
// the registry keeps a KvIndex fed from the reports' prefix-cache events
// (each poll sends the worker's cursor; a worker that turns unhealthy is
// dropped from it). On becoming healthy a worker's report is checked
// against the served model: a worker whose role differs from the config or
// whose KV shape (layers, KV heads, head dim) differs from the model's is
// logged as an error and never chosen; a different model name, block size
// or dtype than the other workers is logged as an error.
//
// Membership: the cluster config's workers are members from the start;
// AddWorker and RemoveWorker change the set at run time (discovery through
// etcd, router/etcd_discovery.h). A removed worker is never chosen or
// polled again, but its entry stays, so that the WorkerEndpoint pointers
// of requests still running on it remain valid (their calls fail and the
// requests migrate); the same id and address added again revives it.
//
// Thread-safety: all methods may be called from any thread.
// Ownership: the registry owns the channels, stubs and the poller; the
// WorkerEndpoint pointers it hands out live as long as the registry.
#ifndef PDSERVE_ROUTER_WORKER_REGISTRY_H_
#define PDSERVE_ROUTER_WORKER_REGISTRY_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "router/kv_index.h"
#include "router/routing_policy.h"
#include "pdserve/internal/v1/cluster_config.pb.h"
#include "pdserve/internal/v1/worker.grpc.pb.h"

namespace pdserve {

enum class WorkerRole { kPrefill, kDecode };

// One worker: its identity and stubs, fixed for the registry's life. The
// stubs are thread-safe.
struct WorkerEndpoint {
  WorkerRole role;
  std::string id;
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  // Exactly one is set, by role.
  std::unique_ptr<internal::v1::DecodeWorker::Stub> decode;
  std::unique_ptr<internal::v1::PrefillWorker::Stub> prefill;
};

// What a worker must agree with (from the served model).
struct ExpectedWorkerModel {
  // Model spec as the workers report it ("builtin:tiny" or a directory).
  std::string model;
  int32_t num_layers = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
};

// A request to place: its prompt (token ids) and its max_tokens.
struct RouteQuery {
  std::span<const int32_t> prompt;
  int32_t max_tokens = 0;
};

// Where a request goes (WorkerRegistry::Route).
struct RouteDecision {
  // Null when no decode worker is healthy (UNAVAILABLE).
  const WorkerEndpoint* decode = nullptr;
  // Null: the decode worker prefills the prompt itself (a Decode call
  // without first_token).
  const WorkerEndpoint* prefill = nullptr;
  // Prompt tokens the KV index says each holds in its prefix cache (an
  // estimate; Landing.cached_tokens is what the decode worker shares).
  int32_t decode_cached_tokens = 0;
  int32_t prefill_cached_tokens = 0;
  // The prompt's block hash chain at the workers' block size: what
  // ReserveRequest.prompt_block_hashes carries (with prompt_tokens).
  int32_t block_size = 0;
  std::vector<uint64_t> prompt_block_hashes;
};

// One worker's state, for Health and status displays.
struct WorkerSnapshot {
  std::string id;
  WorkerRole role;
  bool healthy = false;
  internal::v1::LoadReport last_report;  // Empty before the first one.
};

class WorkerRegistry {
 public:
  struct Options {
    // Period of the GetLoad polls. Default: 100 ms.
    absl::Duration poll_interval = absl::Milliseconds(100);
    // Deadline of one GetLoad. Default: 1 s.
    absl::Duration load_timeout = absl::Seconds(1);
    // Credentials of the channels to the workers (internal mTLS,
    // common/tls.h); null: plaintext. Default: null.
    std::shared_ptr<grpc::ChannelCredentials> channel_credentials;
  };

  // Creates channels to every worker of `config` (which must have passed
  // ValidateClusterConfig) and starts polling. No worker is healthy before
  // its first report.
  static absl::StatusOr<std::unique_ptr<WorkerRegistry>> Create(
      const internal::v1::ClusterConfig& config, ExpectedWorkerModel expected,
      const Options& options);

  // Stops the poller and waits for the polls in flight.
  ~WorkerRegistry();

  // The least-loaded healthy worker of the role that is not in `exclude`;
  // null when there is none.
  const WorkerEndpoint* PickDecode(
      std::span<const WorkerEndpoint* const> exclude = {});
  const WorkerEndpoint* PickPrefill(
      std::span<const WorkerEndpoint* const> exclude = {});

  // The routing policy's choice for `query` among the healthy, compatible
  // workers not excluded (workers that failed this request already).
  RouteDecision Route(const RouteQuery& query,
                      std::span<const WorkerEndpoint* const> exclude_decode = {},
                      std::span<const WorkerEndpoint* const> exclude_prefill = {});

  const RoutingPolicy& routing_policy() const { return *policy_; }
  const KvIndex& kv_index() const { return kv_index_; }

  // Counts work the router sent `worker` that its next report will show:
  // for a decode worker `tokens` reserved (and one more request), for a
  // prefill worker `tokens` prompt tokens.
  void NoteDispatched(const WorkerEndpoint* worker, int64_t tokens);

  // A call to `worker` failed with `status`. A draining refusal
  // (IsDrainingRefusal) marks it draining at once, not unhealthy.
  // Otherwise UNAVAILABLE from a decode
  // worker marks it unhealthy at once; from a prefill worker only when its
  // channel is down (a live prefill worker answers UNAVAILABLE itself when
  // it cannot reach the decode worker). Either way the worker is polled now
  // rather than at the next tick.
  void ReportCallFailure(const WorkerEndpoint* worker,
                         const absl::Status& status);

  // Workers that take new work: healthy, compatible, not draining.
  int healthy_prefill() const;
  int healthy_decode() const;
  std::vector<WorkerSnapshot> Snapshot() const;

  // A decode worker's KV pool as of its last report: what admission
  // weighs a request's blocks against.
  struct KvCapacity {
    const WorkerEndpoint* worker = nullptr;
    // Healthy and compatible: it may be chosen.
    bool usable = false;
    int64_t total_blocks = 0;
    // Tokens per block; 0 before the first report.
    int32_t block_size = 0;
  };
  // Every decode worker that is a member now, with its pool, read under one
  // lock (admission calls it for each request it places).
  std::vector<KvCapacity> DecodeCapacities() const;

  // Makes the worker `id` at `address` a member (polled from now on, chosen
  // once healthy). An id that is a member already with another address or
  // role is replaced: its old entry is removed first. INVALID_ARGUMENT for
  // an empty id or address; FAILED_PRECONDITION for an id of the cluster
  // config (static workers are not replaced from outside).
  absl::Status AddWorker(WorkerRole role, const std::string& id,
                         const std::string& address);
  // Ends the membership of `id` (nothing when it is not a member): it is
  // no longer chosen nor polled. FAILED_PRECONDITION for an id of the
  // cluster config.
  absl::Status RemoveWorker(const std::string& id);

 private:
  struct WorkerState {
    std::unique_ptr<WorkerEndpoint> endpoint;
    // From the cluster config (never removed).
    bool configured = false;
    // Chosen and polled; false once removed.
    bool member = true;
    bool healthy = false;
    bool compatible = true;
    bool has_report = false;
    bool warned = false;  // Said once that it does not answer yet.
    // Refusing new work (see the class comment). A report from a poll
    // numbered at most drain_refused_poll predates a refusal seen then.
    bool draining = false;
    uint64_t polls_started = 0;
    uint64_t drain_refused_poll = 0;
    internal::v1::LoadReport report;
    // Work sent since the last report, and the part of it sent before the
    // poll now in flight (which that poll's report will include).
    int64_t dispatched_tokens = 0;
    int64_t dispatched_blocks = 0;
    int64_t dispatched_requests = 0;
    int64_t polled_tokens = 0;
    int64_t polled_blocks = 0;
    int64_t polled_requests = 0;
    // The poll in flight; its context stays until the next poll starts.
    bool poll_in_flight = false;
    std::unique_ptr<grpc::ClientContext> poll_context;
    internal::v1::LoadRequest poll_request;
    internal::v1::LoadReport poll_response;
  };

  WorkerRegistry(ExpectedWorkerModel expected, const Options& options,
                 std::unique_ptr<RoutingPolicy> policy);
  void PollLoop();
  void StartPoll(WorkerState* worker) ABSL_LOCKS_EXCLUDED(mu_);
  void OnPollDone(WorkerState* worker, const grpc::Status& status)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Logs the problems of `report`; false when the worker cannot be used.
  bool CheckCompatible(const WorkerState& worker,
                       const internal::v1::LoadReport& report)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MarkUnhealthy(WorkerState* worker, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Logs a change.
  void SetDraining(WorkerState* worker, bool draining)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  WorkerState* StateOf(const WorkerEndpoint* endpoint) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A new entry (a member, not yet healthy) for a worker.
  std::unique_ptr<WorkerState> NewState(WorkerRole role, const std::string& id,
                                        const std::string& address);
  void RemoveLocked(WorkerState* w, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const WorkerEndpoint* Pick(WorkerRole role,
                             std::span<const WorkerEndpoint* const> exclude);

  const ExpectedWorkerModel expected_;
  const Options options_;
  const std::unique_ptr<RoutingPolicy> policy_;  // Thread-safe.
  KvIndex kv_index_;                             // Thread-safe.
  mutable absl::Mutex mu_;
  // Every worker ever added, members or not (never erased: see
  // "Membership"). The states' fields are guarded by mu_ too, apart from
  // `endpoint`, which is fixed once the state is added.
  std::vector<std::unique_ptr<WorkerState>> workers_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int polls_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t rotation_ ABSL_GUARDED_BY(mu_) = 0;
  // The first report's layout, which every other worker should share.
  bool have_reference_layout_ ABSL_GUARDED_BY(mu_) = false;
  internal::v1::KvLayout reference_layout_ ABSL_GUARDED_BY(mu_);
  std::string reference_worker_ ABSL_GUARDED_BY(mu_);
  std::thread poller_;
};

}  // namespace pdserve

#endif  // PDSERVE_ROUTER_WORKER_REGISTRY_H_
