// KvSender: the sending half of the KV hand-off. A prefill worker's engine
// loop reports each layer's freshly written KV; the sender turns every
// report into one batched Write of that layer's byte ranges into the decode
// worker's landing blocks, so layer l is on the wire while layer l + 1
// computes. After a request's last layer it sends the KvComplete
// notification, then hands the outcome back.
//
//   loop thread:  PushLayer(l=0) PushLayer(l=1) ... Finish(push, done)
//   lane thread:    Write(l=0)     Write(l=1)   ... Notify, done(status)
//
// Writes never wait on each other across destinations: every destination
// (a decode worker: KvLandingTarget::destination) has its own lane, a
// thread with its own job queue and its own connections, created on first
// use and reaped after lane_idle_timeout without work. A decode worker
// that stalls (up to the transport's I/O timeout) holds up its own lane
// only. Past max_lanes live lanes, a new destination shares the existing
// lane with the fewest queued jobs.
//
// Jobs of one push run on one lane in the order they were queued, so a
// request's Finish runs after all its layer writes returned, and its `done`
// marks the point after which the sender never touches the request's KV
// blocks again: only then may the engine release them.
//
// The sender runs one or more transports (the prefill worker's
// --kv_transport list), each with the local pool registered once: the pool
// itself, or — a device pool over a transport of host memory — its pinned
// host staging, into which each layer job first copies its ranges (the
// stage callback) and from which the transport then reads them. A push
// carries the landing's usable offers, best first (kv::ChooseKvOffers); its
// first write connects to the first offer that answers, falling back past
// offers whose connect fails (or failed on its lane in the last 10 s:
// passed over while another offer is left), and the push stays on that
// offer. A push that fails after that (the peer refuses a range, is gone,
// or times out) or is aborted drops its remaining layer jobs without
// reading their blocks; its `done` still runs, with the error.
//
// Fencing (DESIGN.md, kv_transfer/): a push that connected and then is
// aborted or fails while its connection stays open sends its landing's
// abort_notification in place of the KvComplete, after its last write
// returned, so the decode worker knows no further byte comes and frees the
// landing at once. When its connection was closed by an error, it sends
// nothing: the decode worker fences the landing by itself (tcp drops the
// late frames; a one-sided transport's landing waits out the quarantine,
// kv_transfer/landing_fence.h).
//
// Thread-safety: PushLayer, Finish, Stop, counters(), lane_count() and
// KvPush::Abort from any thread (Stop, which joins the lanes, not from a
// callback of the sender); connections and the transport's Write and
// Notify are used only by the lane thread that owns them.
#ifndef PDSERVE_KV_TRANSFER_KV_SENDER_H_
#define PDSERVE_KV_TRANSFER_KV_SENDER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/kv_layout.h"
#include "kv_transfer/negotiation.h"
#include "kv_transfer/transport.h"

namespace pdserve::kv {

// Where one request's KV goes: the decode worker's landing, checked by the
// caller (layout equal to the local one, block ids inside the remote pool).
struct KvLandingTarget {
  // The decode worker holding the landing (Landing.decode_worker_id):
  // pushes to one destination share a lane. Empty: the first offer's
  // transport and endpoint stand for it.
  std::string destination;
  // The offers this sender runs a transport for, best first; not empty.
  std::vector<KvOffer> offers;
  // Blocks in the remote pool (for PoolOffset).
  int32_t remote_pool_blocks = 0;
  // Position p lands in block_ids[p / block_size].
  std::vector<BlockId> block_ids;
  // Positions below this are on the decode worker already (shared prefix
  // blocks, Landing.cached_tokens): never written. Default: 0.
  int32_t cached_tokens = 0;
  // Landing.landing_id: carried by every write.
  uint64_t landing_id = 0;
  // The notification that tells the landing this push stopped early and
  // writes no more (the caller's KvComplete with aborted set); empty: none
  // is sent.
  std::string abort_notification;
};

// One request's push: shared by the threads that queue its jobs, abort it,
// and run it.
class KvPush {
 public:
  // `request_id` is the request's wire id (EngineRequest.request_id).
  KvPush(uint64_t request_id, KvLandingTarget target);

  uint64_t request_id() const { return request_id_; }
  const KvLandingTarget& target() const { return target_; }

  // Stops the push: layer jobs not started yet are dropped, the
  // abort_notification is sent in place of the KvComplete (see the file
  // comment), and `done` receives `why`. The first error wins; an OK `why`
  // is ignored.
  void Abort(absl::Status why) ABSL_LOCKS_EXCLUDED(mu_);
  // OK unless aborted or failed.
  absl::Status status() const ABSL_LOCKS_EXCLUDED(mu_);
  bool aborted() const ABSL_LOCKS_EXCLUDED(mu_) { return !status().ok(); }

 private:
  friend class KvSender;

  const uint64_t request_id_;
  const KvLandingTarget target_;
  // The lane key of target_.destination, built once.
  const std::string lane_key_;
  mutable absl::Mutex mu_;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  // When the first layer was queued (the transfer's start) and when Finish
  // was called: the forward pass that computed the last layer had ended
  // (the start of the transfer's tail).
  absl::Time first_layer_queued_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time finish_queued_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  // Touched only by the lane thread running the push's jobs (a lane hands
  // a push to its successor only through the sender's locks).
  uint64_t kv_bytes_ = 0;
  // The offer of target_.offers the push connected to (-1 before), its key
  // in the lane's connection cache, and the serial number of the
  // connection it last used (0: none).
  int offer_ = -1;
  std::string connection_key_;
  uint64_t connection_serial_ = 0;
};

// What a finished push reports.
struct KvPushStats {
  // Bytes written into the landing.
  uint64_t kv_bytes = 0;
  // From the first layer queued to the notification acknowledged: the
  // whole transfer, most of it overlapping the forward pass. Zero when no
  // KvComplete was sent.
  absl::Duration transfer = absl::ZeroDuration();
  // From Finish (the forward pass over the last layer had ended) to the
  // notification acknowledged: the part that did not overlap compute. Zero
  // when no KvComplete was sent.
  absl::Duration transfer_tail = absl::ZeroDuration();
};

// One sequence of one layer report: positions [begin, end) of `push`'s
// request sit in `block_table` (the local pool's blocks, sequence order).
// The table is copied; it need only live through the PushLayer call.
struct LayerKv {
  std::shared_ptr<KvPush> push;
  std::span<const BlockId> block_table;
  int32_t begin = 0;
  int32_t end = 0;
};

// One transport a sender runs, and the local pool's memory as it reads it.
struct KvSenderTransport {
  std::unique_ptr<KvTransport> transport;
  // Registered with `transport` once: the pool, or its host staging.
  std::span<std::byte> memory;
  // `memory` is the pool's host staging: each write's ranges are staged
  // (KvSender's StageCallback) before the transport reads them.
  bool staged = false;
};

// What a sender moved over one of its transports since it started, over
// all its lanes.
struct KvTransportCounters {
  std::string transport;
  // Pushes whose KvComplete it delivered.
  uint64_t pushes = 0;
  // KV bytes it wrote.
  uint64_t bytes = 0;
  // Pushes that moved on past it to the next offer of their landing: its
  // connect failed, now or within the last 10 s.
  uint64_t fallbacks = 0;
};

struct KvSenderOptions {
  // Lanes (threads) alive at once; past it new destinations share lanes.
  // Default: 64.
  size_t max_lanes = 64;
  // A lane with no job for this long ends, closing its connections; the
  // next push to its destination starts a new one. Default: 60 s.
  absl::Duration lane_idle_timeout = absl::Seconds(60);
};

class KvSender {
 public:
  // Called on a lane thread with a push's outcome; must not block.
  using DoneCallback =
      absl::AnyInvocable<void(absl::Status status, const KvPushStats& stats)>;
  // Called on a lane thread when a push fails on the transport (before its
  // `done`), so the caller can stop computing it; must not block. Lanes
  // may call it concurrently.
  using FailureCallback =
      absl::AnyInvocable<void(const std::shared_ptr<KvPush>& push) const>;
  // Called on a lane thread before a staged transport's write: copies the
  // local ranges [local_offset, local_offset + length) of `writes` from
  // the pool into its host staging (EngineLoop::CopyKvToHostStaging) and
  // returns when they are there. One lane at a time (the runner allows
  // one copying thread beside its forward pass).
  using StageCallback =
      absl::AnyInvocable<absl::Status(std::span<const WriteOp> writes) const>;

  // Registers each transport's memory (a KV pool of `local_blocks` blocks
  // laid out as `layout`, or its staging) with it (1 to kMaxKvOffers
  // transports, distinct names). The memory must outlive the sender.
  // `stage` is needed when a transport is staged. INVALID_ARGUMENT for
  // bad arguments; the transports' registration errors as they come.
  static absl::StatusOr<std::unique_ptr<KvSender>> Create(
      std::vector<KvSenderTransport> transports, int32_t local_blocks,
      const KvBlockLayout& layout, StageCallback stage,
      FailureCallback on_failure, const KvSenderOptions& options = {});

  // Stop()s, then closes the transports.
  ~KvSender();

  // The names of the transports, in the order given to Create: what a
  // landing's offers are matched against.
  const std::vector<std::string>& transport_names() const {
    return transport_names_;
  }
  // Per transport, in the order of transport_names().
  std::vector<KvTransportCounters> counters() const;
  // Lanes alive now.
  size_t lane_count() const ABSL_LOCKS_EXCLUDED(mu_);

  // Queues one Write per entry of `kvs`, of layer `layer`, of its positions
  // from its target's cached_tokens on (none when nothing is left), on the
  // lane of its destination. Never blocks on I/O (the loop thread calls it
  // from the layer observer).
  void PushLayer(int32_t layer, std::span<const LayerKv> kvs)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Queues the end of `push`, after its layer jobs: unless the push failed
  // or was aborted, sends `notification` to the landing's endpoint (else
  // the abort_notification, see the file comment); then calls `done` with
  // the push's status. `done` runs exactly once (with UNAVAILABLE after
  // Stop).
  void Finish(std::shared_ptr<KvPush> push, std::string notification,
              DoneCallback done) ABSL_LOCKS_EXCLUDED(mu_);

  // Runs the Finish jobs queued so far with UNAVAILABLE (without touching
  // the transport), drops the layer jobs, and joins every lane once its
  // job in progress returns. Later PushLayer calls are dropped and later
  // Finish calls run `done` at once. Idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // One transport the sender runs, shared by every lane, and what it moved.
  struct SenderTransport {
    std::unique_ptr<KvTransport> transport;
    RegionId local_region;
    bool staged = false;
    std::atomic<uint64_t> pushes = 0;
    std::atomic<uint64_t> bytes = 0;
    std::atomic<uint64_t> fallbacks = 0;
  };

  struct Job {
    std::shared_ptr<KvPush> push;
    // Layer job: layer >= 0, blocks of positions [first_block * block_size,
    // end) in the local pool. Finish job: layer < 0.
    int32_t layer = -1;
    std::vector<BlockId> blocks;
    int32_t first_block = 0;
    int32_t begin = 0;
    int32_t end = 0;
    std::string notification;
    DoneCallback done;
  };

  struct LaneConnection {
    std::unique_ptr<KvConnection> connection;
    // Unique per sender: tells a push whether the connection it wrote on
    // is still this one.
    uint64_t serial = 0;
  };

  // One destination's lane (or several, past max_lanes).
  struct Lane {
    absl::Mutex mu;
    std::deque<Job> jobs ABSL_GUARDED_BY(mu);
    bool stopping ABSL_GUARDED_BY(mu) = false;
    // Lane thread only. Keyed by transport name + '\n' + endpoint.
    absl::flat_hash_map<std::string, LaneConnection> connections;
    // Offers whose connect failed, until when they are passed over.
    absl::flat_hash_map<std::string, absl::Time> failed_connects;
    std::vector<WriteOp> ops;  // Scratch.
    // Set by the lane thread as its last act after being reaped: joining
    // it then takes no time.
    std::atomic<bool> exited = false;
    std::thread thread;
  };

  // A connection and the transport it runs on.
  struct Link {
    KvConnection* connection;
    SenderTransport* transport;
    const KvOffer* offer;
  };

  KvSender(std::vector<std::unique_ptr<SenderTransport>> transports,
           int32_t local_blocks, const KvBlockLayout& layout,
           StageCallback stage, FailureCallback on_failure,
           const KvSenderOptions& options);
  static std::vector<std::string> NamesOf(
      const std::vector<std::unique_ptr<SenderTransport>>& transports);

  // The lane that runs `push`'s jobs, started when its destination has
  // none. Appends the reaped lanes whose thread has exited to `*joinable`
  // (to be joined once mu_ is released).
  Lane& LaneFor(const KvPush& push,
                std::vector<std::unique_ptr<Lane>>* joinable)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the lane when it still has nothing to do; false when a job came
  // meanwhile or the sender is stopping.
  bool Reap(Lane* lane) ABSL_LOCKS_EXCLUDED(mu_);
  static void Join(std::vector<std::unique_ptr<Lane>> lanes);

  // Lane thread.
  void RunLane(Lane* lane);
  void RunLayer(Lane& lane, Job& job);
  void RunFinish(Lane& lane, Job& job);
  void NotifyAborted(Lane& lane, KvPush& push);
  SenderTransport* TransportOf(const KvOffer& offer) const;
  // The push's connection: the one of its chosen offer, or else the first
  // offer (best first) that connects; every offer's error when none does.
  absl::StatusOr<Link> LinkFor(Lane& lane, KvPush& push);
  // The lane's cached connection to `offer` (cache key `key`), connecting
  // when there is none; sets `*is_new` when it connected.
  absl::StatusOr<LaneConnection*> ConnectionTo(Lane& lane,
                                               const std::string& key,
                                               const KvOffer& offer,
                                               SenderTransport& transport,
                                               bool* is_new);
  void Fail(Lane& lane, const std::shared_ptr<KvPush>& push,
            const KvOffer* offer, absl::Status why);

  const std::vector<std::unique_ptr<SenderTransport>> transports_;
  const std::vector<std::string> transport_names_;
  const int32_t local_blocks_;
  const KvBlockLayout layout_;
  const KvSenderOptions options_;
  const FailureCallback on_failure_;
  // Serializes the stage callback over the lanes.
  absl::Mutex stage_mu_;
  const StageCallback stage_ ABSL_GUARDED_BY(stage_mu_);
  std::atomic<uint64_t> next_connection_serial_ = 1;

  // Lock order: mu_ before any Lane::mu.
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // The live lanes, and which lane each destination key is on.
  std::vector<std::unique_ptr<Lane>> lanes_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Lane*> lane_of_ ABSL_GUARDED_BY(mu_);
  // Reaped lanes whose thread is not joined yet.
  std::vector<std::unique_ptr<Lane>> reaped_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_KV_SENDER_H_
