// LandingFence: the receiving side's record of which landings may still be
// written, and when the blocks of a landing that closed are safe to hand to
// another request.
//
// A landing opens when a decode worker reserves blocks for a request's KV
// and closes when the reservation ends (the KV was consumed, released,
// expired, or its Decode went away). From its close on, the receiver drops
// every write tagged with it (transports that fence writes: tcp). Its blocks
// may go back to the pool (Fenced) only once no byte can still land in
// them:
//   - its sender said it will write no more (KvComplete, aborted or not),
//     and writes are ordered before that notification on every transport;
//   - or every transport the receiver runs fences writes and none is
//     being placed into the landing at this moment;
//   - or the quarantine, longer than any sender's I/O timeout, has passed
//     since it closed (one-sided transports: ucx, inproc, cuda_ipc, nccl,
//     whose writes the receiver never sees).
//
// Landing ids are never reused (a random 62-bit start, then +1), so a write
// or notification from before a decode worker restarted matches nothing.
//
// Thread-safety: every method from any thread.
#ifndef PDSERVE_KV_TRANSFER_LANDING_FENCE_H_
#define PDSERVE_KV_TRANSFER_LANDING_FENCE_H_

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kv_transfer/transport.h"

namespace pdserve::kv {

class LandingFence final : public WriteFence {
 public:
  // `every_write_fenced`: every transport of the receiver fences writes
  // (TransportCapabilities::fences_writes). `quarantine` must exceed the
  // senders' I/O timeout.
  LandingFence(bool every_write_fenced, absl::Duration quarantine);

  // A new landing, open for writes.
  uint64_t Open() ABSL_LOCKS_EXCLUDED(mu_);
  // Its sender will write no more. Unknown landings are ignored.
  void SenderDone(uint64_t landing) ABSL_LOCKS_EXCLUDED(mu_);
  // No write into it lands from now on (where the transport fences).
  // Returns Fenced(landing, now): true when its blocks are safe at once.
  bool Close(uint64_t landing, absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);
  // A closed landing: true once no write can land in its blocks any more
  // (the header's three ways); the landing is then forgotten. True for an
  // unknown landing.
  bool Fenced(uint64_t landing, absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);

  // WriteFence: writes into open landings only.
  bool BeginWrite(uint64_t landing) override ABSL_LOCKS_EXCLUDED(mu_);
  void EndWrite(uint64_t landing) override ABSL_LOCKS_EXCLUDED(mu_);

  // Writes dropped because their landing was not open, since the start.
  uint64_t dropped_writes() const ABSL_LOCKS_EXCLUDED(mu_);
  // Landings open or closed and not yet fenced.
  size_t tracked() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  bool FencedLocked(uint64_t landing, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  struct Landing {
    bool open = true;
    bool sender_done = false;
    int32_t writes_in_progress = 0;
    absl::Time closed = absl::InfiniteFuture();
  };

  const bool every_write_fenced_;
  const absl::Duration quarantine_;
  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, Landing> landings_ ABSL_GUARDED_BY(mu_);
  uint64_t dropped_writes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_LANDING_FENCE_H_
