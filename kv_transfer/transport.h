// kv_transfer: moves byte ranges of registered memory (a worker's KV pool)
// from one worker to another, with small notifications ordered after the
// writes. The KV byte layout the ranges carry is engine/kv_layout.h.
//
// A KvTransport is one worker's end: it registers local memory, accepts
// peers (the receiving side) and connects to peers (the sending side).
// Transports are chosen by name at run time (CreateKvTransport); a caller
// asks capabilities() instead of casting.
//
// Every transfer is bounded: a timeout on every wait, a size limit on every
// frame and message, and bounds checks against the registered region before
// a byte is written. A peer cannot make a worker allocate without limit.
//
// Thread-safety: KvTransport methods may be called from any thread.
// A KvConnection is used by one thread at a time, and is destroyed before
// the KvTransport that made it.
#ifndef PDSERVE_KV_TRANSFER_TRANSPORT_H_
#define PDSERVE_KV_TRANSFER_TRANSPORT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/strong_id.h"

namespace pdserve::kv {

using RegionId = StrongId<struct RegionIdTag, uint32_t>;

// Copy `length` bytes from (local_region, local_offset) of the sender to
// (remote_region, remote_offset) of the receiver.
struct WriteOp {
  RegionId local_region;
  uint64_t local_offset = 0;
  RegionId remote_region;
  uint64_t remote_offset = 0;
  uint64_t length = 0;
  // The landing the bytes belong to (Landing.landing_id; 0: none). A
  // receiver that places the bytes itself (tcp) drops a write whose
  // landing its filter says is no longer open (KvTransport::
  // SetLandingFilter).
  uint64_t landing = 0;
};

struct TransportCapabilities {
  std::string name;            // "tcp", "inproc", "ucx:shm", ...
  bool device_memory = false;  // Can register GPU memory directly.
  bool one_sided = false;      // Writes land without the receiver's CPU.
  bool cross_host = false;     // Reaches other machines.
  // Moves a host-memory KV pool (false: device memory only; a worker with
  // a host pool must not offer or use it).
  bool host_memory = true;
  // The receiver places every write itself and asks its WriteFence first
  // (KvTransport::SetWriteFence): a write into a closed landing never
  // lands, however late it comes.
  bool fences_writes = false;
};

struct Notification {
  std::string message;
};

struct TransportOptions {
  // Address the receiving side listens on ("host:port"; port 0 picks one).
  // Default: "127.0.0.1:0".
  std::string listen_address = "127.0.0.1:0";
  // tcp: the most KV bytes of one frame this side sends, at most 1 MiB
  // (what every receiver accepts; more: CreateKvTransport returns
  // INVALID_ARGUMENT); longer writes are split. 512 KiB
  // measured best on loopback: a frame is checksummed and copied while it
  // is still in the cache, and checksumming one overlaps sending the one
  // before (bench/kv_transfer_bench.cc, docs/benchmarks.md).
  // Default: 512 KiB.
  uint32_t max_frame_bytes = 512u << 10;
  // Largest notification message. Default: 64 KiB.
  uint32_t max_message_bytes = 64u << 10;
  // Notifications held for WaitNotification before the sender is refused.
  // Default: 4096.
  size_t max_pending_notifications = 4096;
  // Limit on every wait: a write's acknowledgement, a frame's remaining
  // bytes, a connect. Default: 10 s.
  absl::Duration io_timeout = absl::Seconds(10);
};

// The sending side's connection to one peer.
class KvConnection {
 public:
  virtual ~KvConnection() = default;

  // Writes every op, in order, and returns once the peer has them in its
  // memory. INVALID_ARGUMENT for a local range outside its region;
  // OUT_OF_RANGE / NOT_FOUND when the peer refuses a remote range or
  // region; DEADLINE_EXCEEDED after io_timeout without progress;
  // UNAVAILABLE when the peer is gone. After an error other than
  // INVALID_ARGUMENT the connection is closed.
  virtual absl::Status Write(std::span<const WriteOp> ops) = 0;

  // Delivers `message` to the peer's WaitNotification after every write
  // before it; returns once the peer has queued it. RESOURCE_EXHAUSTED when
  // the peer's queue is full or the message too long.
  virtual absl::Status Notify(std::string_view message) = 0;
};

// The receiving side's gate for tagged writes (WriteOp::landing): which
// landings are open. A transport that places writes itself
// (capabilities().fences_writes) calls BeginWrite before a write's bytes go
// into memory and EndWrite once they are in; the owner of the landings
// (kv_transfer/landing_fence.h) hands a closed landing's memory to someone
// else only when no write is between the two.
class WriteFence {
 public:
  virtual ~WriteFence() = default;
  // True: place the write, then call EndWrite. False: drop its bytes.
  virtual bool BeginWrite(uint64_t landing) = 0;
  virtual void EndWrite(uint64_t landing) = 0;
};

class KvTransport {
 public:
  virtual ~KvTransport() = default;

  virtual const TransportCapabilities& capabilities() const = 0;
  // What a peer passes to Connect to reach this transport.
  virtual std::string endpoint() const = 0;

  // Makes `memory` readable by local writes and writable by peers. The
  // memory must stay valid until DeregisterMemory (or destruction).
  virtual absl::StatusOr<RegionId> RegisterMemory(std::span<std::byte> memory) = 0;
  // Waits for writes in progress into the region, then forgets it.
  virtual absl::Status DeregisterMemory(RegionId region) = 0;

  virtual absl::StatusOr<std::unique_ptr<KvConnection>> Connect(std::string_view endpoint) = 0;

  // Gates every later write into this transport's regions (receiving
  // side; the fence must outlive the transport). A no-op for transports
  // whose writes land without the receiver (capabilities().fences_writes
  // false). Call before peers connect.
  virtual void SetWriteFence(WriteFence* fence) {}

  // The next notification from any peer, or DEADLINE_EXCEEDED.
  virtual absl::StatusOr<Notification> WaitNotification(absl::Duration timeout) = 0;
};

// "tcp", "inproc"; when built with UCX, "ucx" (UCX_TLS from the
// environment), "ucx:shm", "ucx:tcp" or "ucx:TLS+LIST" (UCX transports
// joined with '+', e.g. "ucx:rc_verbs+sm"); when built with CUDA,
// "cuda_ipc" and "nccl" (FAILED_PRECONDITION without a device).
// NOT_FOUND for a transport not built into this binary.
absl::StatusOr<std::unique_ptr<KvTransport>> CreateKvTransport(std::string_view name,
                                                               const TransportOptions& options);

// The names CreateKvTransport accepts here ("ucx:TLS-LIST" aside).
std::vector<std::string> AvailableKvTransports();

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_TRANSPORT_H_
