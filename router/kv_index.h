// KvIndex: which worker holds which prefix-cache blocks, as the workers
// report it (LoadReport.kv_events, engine/kv_event_log.h): per worker the
// set of block content hashes its KV pool holds, the block size they were
// computed at, and the cursor (epoch, last event applied) to ask the next
// report from. The router's routing policies ask it how many leading blocks
// of a prompt's hash chain (engine/kv_cache.h PromptBlockHashes) each
// worker holds.
//
// It is a hint: a worker may have evicted a block since its last report
// (the decode worker's Reserve then shares less, Landing.cached_tokens says
// how much), and hashes beyond a report's bound are missing until their
// next event.
//
// Memory: one hash (8 bytes plus the set's overhead) per block held per
// worker.
//
// Thread-safety: every method may be called from any thread (the
// registry's poller applies reports while request paths query).
#ifndef PDSERVE_ROUTER_KV_INDEX_H_
#define PDSERVE_ROUTER_KV_INDEX_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "pdserve/internal/v1/worker.pb.h"

namespace pdserve {

class KvIndex {
 public:
  // Where a worker's next LoadRequest should start (LoadRequest
  // kv_events_epoch / kv_events_seq); {0, 0} asks for a snapshot.
  struct Cursor {
    uint64_t epoch = 0;
    uint64_t seq = 0;
  };

  // Applies one report of `worker`, whose pool has blocks of `block_size`
  // tokens: a snapshot replaces its set; a delta that follows its cursor
  // is applied; a delta that does not (another epoch, a gap: a report lost
  // or reordered) is dropped and the cursor reset, so that the next report
  // is a snapshot. Returns false for a dropped delta.
  bool Apply(const std::string& worker, int32_t block_size,
             const internal::v1::KvCacheEvents& events)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Forgets `worker` (it went unhealthy: its pool may be gone); its cursor
  // resets. Unknown workers are fine.
  void Drop(const std::string& worker) ABSL_LOCKS_EXCLUDED(mu_);

  Cursor CursorOf(const std::string& worker) const ABSL_LOCKS_EXCLUDED(mu_);

  // How many leading blocks of `hashes` (a prompt's chain at `block_size`)
  // `worker` holds: 0 for an unknown worker or one of another block size.
  int32_t LeadingBlocks(const std::string& worker,
                        std::span<const uint64_t> hashes,
                        int32_t block_size) const ABSL_LOCKS_EXCLUDED(mu_);

  // Hashes held by `worker` (0 when unknown).
  size_t num_hashes(const std::string& worker) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct WorkerBlocks {
    int32_t block_size = 0;
    Cursor cursor;
    absl::flat_hash_set<uint64_t> hashes;
  };

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, WorkerBlocks> workers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve

#endif  // PDSERVE_ROUTER_KV_INDEX_H_
