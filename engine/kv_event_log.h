// KvEventLog: a worker's recent prefix-cache events (KvBlockPool's "hash
// stored" / "hash evicted"), numbered, and the set of hashes the pool holds
// after the last of them: what the worker publishes to the router's KV index
// (router/kv_index.h) in each LoadReport.
//
// Each log has an epoch, random per process start (per log), and numbers its
// events 1, 2, 3, ... A reader keeps a cursor (epoch, last seq seen) and asks
// for what follows it. It gets the net change since the cursor (a delta):
// per hash the last event of it, as two disjoint lists, stored and evicted,
// which apply in any order. When the cursor is of another epoch, ahead of
// the log, or older than the oldest event kept, it gets a snapshot instead:
// every hash held, replacing what it knew.
//
// Bounds (so one report stays small, whatever the pool's size):
//   - the log keeps the last `capacity` events (default 65536, 1 MiB);
//   - a delta covers at most `max_report_hashes` events (default 8192,
//     64 KiB of hashes); the reader catches up over the next reports;
//   - a snapshot carries at most `max_report_hashes` hashes; a pool holding
//     more sets `truncated` and the reader misses the rest until their next
//     event (the index is a routing hint; a miss only costs a cache hit).
//
// Thread-safety: every method may be called from any thread.
#ifndef PDSERVE_ENGINE_KV_EVENT_LOG_H_
#define PDSERVE_ENGINE_KV_EVENT_LOG_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "engine/kv_cache.h"

namespace pdserve {

// What a reader is told after its cursor.
struct KvEventsReport {
  uint64_t epoch = 0;
  // True: `stored` is every hash held (up to the bound) and replaces the
  // reader's set; `evicted` is empty. False: a delta after `after_seq`.
  bool snapshot = false;
  // Snapshot: some held hashes did not fit.
  bool truncated = false;
  // The delta applies to a reader whose cursor is (epoch, after_seq).
  uint64_t after_seq = 0;
  // The reader's cursor afterwards: (epoch, last_seq).
  uint64_t last_seq = 0;
  std::vector<uint64_t> stored;
  std::vector<uint64_t> evicted;
};

class KvEventLog {
 public:
  struct Options {
    // Events kept for deltas. Default: 65536.
    size_t capacity = 65536;
    // Most events in a delta and most hashes in a snapshot. Default: 8192.
    size_t max_report_hashes = 8192;
  };

  // Picks a random nonzero epoch.
  explicit KvEventLog(const Options& options);
  KvEventLog() : KvEventLog(Options()) {}

  uint64_t epoch() const { return epoch_; }

  // Numbers and keeps `events` (in order) and applies them to the held set.
  void Append(std::span<const KvCacheEvent> events) ABSL_LOCKS_EXCLUDED(mu_);

  // What follows the cursor (epoch, seq); epoch 0 is "no cursor".
  KvEventsReport ReportSince(uint64_t epoch, uint64_t seq) const
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const Options options_;
  const uint64_t epoch_;

  mutable absl::Mutex mu_;
  // Events first_seq_ .. last_seq_.
  std::deque<KvCacheEvent> events_ ABSL_GUARDED_BY(mu_);
  uint64_t first_seq_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t last_seq_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_set<uint64_t> held_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_KV_EVENT_LOG_H_
