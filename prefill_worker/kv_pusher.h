// KvPusher: the prefill worker's one thread of KV transport I/O. The engine
// loop reports each layer's freshly written KV (Generator's
// KvLayerObserver); the pusher turns every report into one batched Write of
// that layer's byte ranges into the decode worker's landing blocks, so layer
// l is on the wire while layer l + 1 computes. After a request's last layer
// it sends the KvComplete notification, then hands the outcome back.
//
//   loop thread:   PushLayer(l=0) PushLayer(l=1) ... Finish(push, done)
//   pusher thread:   Write(l=0)     Write(l=1)   ... Notify, done(status)
//
// Jobs run in the order they were queued, so a request's Finish runs after
// all its layer writes and its `done` marks the point after which the
// pusher never touches the request's KV blocks again: only then may the
// engine release them.
//
// The pusher runs one or more transports (the prefill worker's
// --kv_transport list), each with the local pool registered once: the pool
// itself, or — a device pool over a transport of host memory — its pinned
// host staging, into which each layer job first copies its ranges (the
// stage callback) and from which the transport then reads them. A push
// carries the landing's usable offers, best first (kv::ChooseKvOffers); its
// first write connects to the first offer that answers, falling back past
// offers whose connect fails (or failed in the last 10 s: passed over
// while another offer is left), and the push stays on that offer. A push
// that fails after that (the peer refuses a range, is gone, or times out)
// or is aborted drops its remaining layer jobs without reading their
// blocks; its `done` still runs, with the error.
//
// Thread-safety: PushLayer, Finish, counters() and KvPush::Abort from any
// thread; everything else (connections, the transport's Write) happens on
// the pusher thread. One KvConnection per (transport, endpoint) is cached
// and dropped after an error.
#ifndef PDSERVE_PREFILL_WORKER_KV_PUSHER_H_
#define PDSERVE_PREFILL_WORKER_KV_PUSHER_H_

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
#include "engine/generator.h"
#include "engine/kv_layout.h"
#include "kv_transfer/negotiation.h"
#include "kv_transfer/transport.h"

namespace pdserve {

// Where one request's KV goes: the decode worker's landing, checked by the
// caller (layout equal to the local one, block ids inside the remote pool).
struct KvLandingTarget {
  // The offers this pusher runs a transport for, best first; not empty.
  std::vector<kv::KvOffer> offers;
  // Blocks in the remote pool (for PoolOffset).
  int32_t remote_pool_blocks = 0;
  // Position p lands in block_ids[p / block_size].
  std::vector<BlockId> block_ids;
  // Positions below this are on the decode worker already (shared prefix
  // blocks, Landing.cached_tokens): never written. Default: 0.
  int32_t cached_tokens = 0;
  // Landing.landing_id: carried by every write and the notification.
  uint64_t landing_id = 0;
};

// One request's push: shared by the threads that queue its jobs, abort it,
// and run it.
class KvPush {
 public:
  KvPush(RequestId id, KvLandingTarget target)
      : id_(id), target_(std::move(target)) {}

  RequestId id() const { return id_; }
  const KvLandingTarget& target() const { return target_; }

  // Stops the push: layer jobs not started yet are dropped, no
  // notification is sent, and `done` receives `why`. The first error wins;
  // an OK `why` is ignored.
  void Abort(absl::Status why) ABSL_LOCKS_EXCLUDED(mu_);
  // OK unless aborted or failed.
  absl::Status status() const ABSL_LOCKS_EXCLUDED(mu_);
  bool aborted() const ABSL_LOCKS_EXCLUDED(mu_) { return !status().ok(); }

 private:
  friend class KvPusher;

  const RequestId id_;
  const KvLandingTarget target_;
  mutable absl::Mutex mu_;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  // When the first layer was queued (the transfer's start) and when Finish
  // was called: the forward pass that computed the last layer had ended
  // (the start of the transfer's tail).
  absl::Time first_layer_queued_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time finish_queued_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  // Pusher thread only.
  uint64_t kv_bytes_ = 0;
  // The offer of target_.offers the push connected to (-1 before), and
  // its key in the pusher's connection cache.
  int offer_ = -1;
  std::string connection_key_;
};

// What a finished push reports.
struct KvPushStats {
  // Bytes written into the landing.
  uint64_t kv_bytes = 0;
  // From the first layer queued to the notification acknowledged: the
  // whole transfer, most of it overlapping the forward pass. Zero when no
  // notification was sent.
  absl::Duration transfer = absl::ZeroDuration();
  // From Finish (the forward pass over the last layer had ended) to the
  // notification acknowledged: the part that did not overlap compute. Zero
  // when no notification was sent.
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

// One transport a pusher runs, and the local pool's memory as it reads it.
struct KvPusherTransport {
  std::unique_ptr<kv::KvTransport> transport;
  // Registered with `transport` once: the pool, or its host staging.
  std::span<std::byte> memory;
  // `memory` is the pool's host staging: each write's ranges are staged
  // (KvPusher's StageCallback) before the transport reads them.
  bool staged = false;
};

// What a pusher moved over one of its transports since it started.
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

class KvPusher {
 public:
  // Called on the pusher thread with a push's outcome; must not block.
  using DoneCallback =
      absl::AnyInvocable<void(absl::Status status, const KvPushStats& stats)>;
  // Called on the pusher thread when a push fails on the transport (before
  // its `done`), so the caller can stop computing it; must not block.
  using FailureCallback =
      absl::AnyInvocable<void(const std::shared_ptr<KvPush>& push)>;
  // Called on the pusher thread before a staged transport's write: copies
  // `ranges` of the pool into its host staging (EngineLoop::
  // CopyKvToHostStaging) and returns when they are there.
  using StageCallback =
      absl::AnyInvocable<absl::Status(std::span<const KvByteRange> ranges)>;

  // Registers each transport's memory (a KV pool of `local_blocks` blocks
  // laid out as `layout`, or its staging) with it (1 to kv::kMaxKvOffers
  // transports, distinct names) and starts the pusher thread. The memory
  // must outlive the pusher. `stage` is needed when a transport is staged.
  static absl::StatusOr<std::unique_ptr<KvPusher>> Create(
      std::vector<KvPusherTransport> transports, int32_t local_blocks,
      const KvBlockLayout& layout, StageCallback stage,
      FailureCallback on_failure);

  // Stop()s, then closes the transports.
  ~KvPusher();

  // The names of the transports, in the order given to Create: what a
  // landing's offers are matched against.
  const std::vector<std::string>& transport_names() const {
    return transport_names_;
  }
  // Per transport, in the order of transport_names().
  std::vector<KvTransportCounters> counters() const;

  // Queues one Write per entry of `kvs`, of layer `layer`, of its positions
  // from its target's cached_tokens on (none when nothing is left). Never
  // blocks on I/O (the loop thread calls it from the layer observer).
  void PushLayer(int32_t layer, std::span<const LayerKv> kvs)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Queues the end of `push`, after its layer jobs: unless the push failed
  // or was aborted, sends `notification` to the landing's endpoint; then
  // calls `done` with the push's status. `done` runs exactly once (with
  // UNAVAILABLE after Stop).
  void Finish(std::shared_ptr<KvPush> push, std::string notification,
              DoneCallback done) ABSL_LOCKS_EXCLUDED(mu_);

  // Runs the Finish jobs queued so far with UNAVAILABLE (without touching
  // the transport), drops the layer jobs, and joins the thread. Later
  // PushLayer calls are dropped and later Finish calls run `done` at once.
  // Idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // One transport the pusher runs, and what it moved.
  struct Lane {
    std::unique_ptr<kv::KvTransport> transport;
    kv::RegionId local_region;
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

  // A connection and the lane it runs on.
  struct Link {
    kv::KvConnection* connection;
    Lane* lane;
    const kv::KvOffer* offer;
  };

  KvPusher(std::vector<std::unique_ptr<Lane>> lanes, int32_t local_blocks,
           const KvBlockLayout& layout, StageCallback stage,
           FailureCallback on_failure);
  void Run();
  void RunLayer(Job& job);
  void RunFinish(Job& job);
  static std::vector<std::string> NamesOf(
      const std::vector<std::unique_ptr<Lane>>& lanes);
  Lane* LaneOf(const kv::KvOffer& offer) const;
  // The push's connection: the one of its chosen offer, or else the first
  // offer (best first) that connects; every offer's error when none does.
  absl::StatusOr<Link> LinkFor(KvPush& push);
  // The cached connection to `offer` (cache key `key`), connecting when
  // there is none; sets `*is_new` when it connected.
  absl::StatusOr<kv::KvConnection*> ConnectionTo(const std::string& key,
                                                 const kv::KvOffer& offer,
                                                 Lane& lane, bool* is_new);
  void Fail(const std::shared_ptr<KvPush>& push, const kv::KvOffer* offer,
            absl::Status why);

  const std::vector<std::unique_ptr<Lane>> lanes_;
  const std::vector<std::string> transport_names_;
  const int32_t local_blocks_;
  const KvBlockLayout layout_;
  StageCallback stage_;         // Pusher thread only.
  FailureCallback on_failure_;  // Pusher thread only.

  // Pusher thread only. Keyed by transport name + '\n' + endpoint.
  absl::flat_hash_map<std::string, std::unique_ptr<kv::KvConnection>>
      connections_;
  // Offers whose connect failed, until when they are passed over.
  absl::flat_hash_map<std::string, absl::Time> failed_connects_;
  std::vector<kv::WriteOp> ops_;     // Scratch.
  std::vector<KvByteRange> staged_;  // Scratch.

  absl::Mutex mu_;
  std::deque<Job> jobs_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace pdserve

#endif  // PDSERVE_PREFILL_WORKER_KV_PUSHER_H_
