// Fault injection for kv_transfer, in the style of LevelDB's Env: one small
// interface (KvFaultHook) decides the fate of each write batch and each
// notification, and a forwarding KvTransport wraps a real one and consults
// it. Tests drive it in process with a hook object of their own, and across
// processes with a spec string (the workers' --kv_fault flag) that
// ParseKvFaultSpec turns into a seeded random hook.
//
// What each fault does, as seen by both ends:
//   delay     the call waits, then goes through unchanged.
//   drop      lost as a real network loses it: a dropped write batch never
//             reaches the peer, a dropped notification is never delivered.
//             The sender waits out the transport's io_timeout, gets
//             DEADLINE_EXCEEDED, and the connection is closed (the peer sees
//             it go), as when a peer stops acknowledging.
//   truncate  only a prefix of the batch's bytes is written (of a
//             notification: a prefix of its bytes is delivered), then the
//             connection fails: the sender gets UNAVAILABLE.
//   corrupt   a notification arrives with one byte altered; a write batch is
//             sent with one op's remote target altered (an unknown region,
//             an offset past the region, or an offset whose end overflows),
//             which the receiver's bounds validation must refuse.
//
// Where faults apply: write batches at the sending end (KvConnection::Write);
// notifications at the sending end (KvConnection::Notify) and at the
// receiving end (KvTransport::WaitNotification, where delay, drop, truncate
// and corrupt act on the message handed to the caller). So on a decode
// worker, which only receives, only notification rules act.
//
// Thread-safety: a KvFaultHook is called from any thread at once; the
// wrapper has the thread-safety of the transport it wraps.
#ifndef PDSERVE_KV_TRANSFER_FAULT_INJECTION_H_
#define PDSERVE_KV_TRANSFER_FAULT_INJECTION_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kv_transfer/transport.h"

namespace pdserve::kv {

enum class KvFaultAction { kPass, kDelay, kDrop, kTruncate, kCorrupt };

// "pass", "delay", "drop", "truncate", "corrupt".
std::string_view KvFaultActionName(KvFaultAction action);

struct KvFault {
  KvFaultAction action = KvFaultAction::kPass;
  // How long kDelay waits. Default: zero.
  absl::Duration delay = absl::ZeroDuration();
  // Chooses where kTruncate cuts and what kCorrupt alters (any value is
  // valid; the wrapper reduces it), so that a seeded hook replays the same
  // faults. Default: 0.
  uint64_t choice = 0;
};

// Decides each transfer's fate. Implementations must be thread-safe.
class KvFaultHook {
 public:
  virtual ~KvFaultHook() = default;
  // A batch about to be written by KvConnection::Write.
  virtual KvFault OnWrite(std::span<const WriteOp> ops) = 0;
  // A notification about to be sent by KvConnection::Notify, or just taken
  // by KvTransport::WaitNotification (`received` true).
  virtual KvFault OnNotify(std::string_view message, bool received) = 0;
};

// Parses a fault spec: comma-separated rules, each
//   write:ACTION[:p=P]  or  notify:ACTION[:p=P]
// where ACTION is delay=DURATION (absl duration: "200ms", "1s"), drop,
// truncate or corrupt, and P (default 1) the probability in [0, 1] that the
// rule fires on a given call; plus at most one seed=N (default 1). Rules are
// tried in order and the first that fires decides; none firing passes.
// Example: "write:delay=200ms:p=0.2,notify:drop:p=0.1,seed=7".
// The hook draws from one generator seeded with N, so one process's run of
// calls in the same order gets the same faults. An empty spec is
// INVALID_ARGUMENT (no hook is wanted then: see CreateKvTransportWithFaults);
// so is any malformed rule, with a message naming it.
absl::StatusOr<std::shared_ptr<KvFaultHook>> ParseKvFaultSpec(
    std::string_view spec);

// Wraps `transport` so that every connection it makes and every
// notification it receives consults `hook`. `io_timeout` is how long a
// dropped call waits before it fails (the wrapped transport's
// TransportOptions::io_timeout, so the sender sees the failure when a real
// loss would show).
std::unique_ptr<KvTransport> WrapKvTransportWithFaults(
    std::unique_ptr<KvTransport> transport, std::shared_ptr<KvFaultHook> hook,
    absl::Duration io_timeout);

// CreateKvTransport, wrapped with the hook of `fault_spec` unless the spec
// is empty (then exactly CreateKvTransport). INVALID_ARGUMENT for a
// malformed spec; CreateKvTransport's errors otherwise.
absl::StatusOr<std::unique_ptr<KvTransport>> CreateKvTransportWithFaults(
    std::string_view name, const TransportOptions& options,
    std::string_view fault_spec);

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_FAULT_INJECTION_H_
