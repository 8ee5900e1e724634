// The control channel of the device transports (cuda_ipc over a Unix
// socket, nccl over TCP): the small messages that go with device-to-device
// copies. KV bytes never travel on it. Internal to kv_transfer/, and used
// by its tests to craft raw frames.
//
// Every frame is a 24-byte little-endian header and `length` payload bytes:
//
//   u32 magic 'PDGC' | u8 type | u8 version (1) | u16 zero | u32 value |
//   u32 length | u32 crc32c of the payload | u32 zero
//
// A frame is refused before its payload is read when the header is
// malformed (DATA_LOSS) or the length exceeds its type's limit
// (RESOURCE_EXHAUSTED); a payload that fails its checksum is DATA_LOSS.
// The receiver of a frame never allocates more than the limit.
#ifndef PDSERVE_KV_TRANSFER_CONTROL_CHANNEL_H_
#define PDSERVE_KV_TRANSFER_CONTROL_CHANNEL_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <list>
#include <span>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kv_transfer/socket_io.h"
#include "kv_transfer/transport.h"

namespace pdserve::kv {

constexpr uint32_t kControlMagic = 0x43474450;  // "PDGC" little-endian.
constexpr uint8_t kControlVersion = 1;
constexpr size_t kControlHeaderBytes = 24;
// Ops in one WRITE frame; a Write with more is sent as several.
constexpr size_t kMaxOpsPerFrame = 8192;
// Payload limit of the HELLO / HELLO_REPLY / GRANT / ACK frames.
constexpr uint32_t kMaxControlPayload = 1u << 20;

enum class ControlType : uint8_t {
  kHello = 1,   // sender -> receiver: who is connecting (transport-specific)
  kHelloReply,  // receiver -> sender: who answers (transport-specific)
  kWrite,       // sender -> receiver: the remote ranges of a batch of writes
  kGrant,       // receiver -> sender: ranges checked and pinned (+ details)
  kDone,        // sender -> receiver: the copies of the last grant finished
  kNotify,      // sender -> receiver: a notification message
  kAck,         // receiver -> sender: the request before it is done
  kError,       // receiver -> sender: value is an absl::StatusCode, payload
                // the message; the receiver then ends the connection
};

struct ControlFrame {
  ControlType type = ControlType::kHello;
  uint32_t value = 0;
  std::vector<std::byte> payload;
};

// The most payload a frame of `type` may carry.
uint32_t ControlPayloadLimit(ControlType type, uint32_t max_message_bytes);

void EncodeControlHeader(ControlType type, uint32_t value,
                         std::span<const std::byte> payload,
                         std::byte out[kControlHeaderBytes]);

absl::Status SendControl(int fd, ControlType type, uint32_t value,
                         std::span<const std::byte> payload,
                         absl::Time deadline);
// Reads one frame into `frame` (its payload buffer is reused). UNAVAILABLE
// when the peer closed, DEADLINE_EXCEEDED, DATA_LOSS for a malformed header
// or a bad checksum, RESOURCE_EXHAUSTED for a payload over its limit.
absl::Status RecvControl(int fd, uint32_t max_message_bytes,
                         absl::Time deadline, ControlFrame& frame);

// A reply the sender waits for: OK when `frame` has the `expected` type,
// the peer's status for an ERROR, DATA_LOSS for anything else.
absl::Status CheckReply(const ControlFrame& frame, ControlType expected);

// Bounds-checked little-endian payload building and parsing.
class ControlWriter {
 public:
  template <typename T>
  void Put(T v) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    out.insert(out.end(), p, p + sizeof(T));
  }
  void PutBytes(std::span<const std::byte> b) {
    out.insert(out.end(), b.begin(), b.end());
  }
  std::vector<std::byte> out;
};

class ControlReader {
 public:
  explicit ControlReader(std::span<const std::byte> data) : data_(data) {}
  template <typename T>
  bool Get(T& v) {
    if (data_.size() < sizeof(T)) return false;
    std::memcpy(&v, data_.data(), sizeof(T));
    data_ = data_.subspan(sizeof(T));
    return true;
  }
  bool GetBytes(std::span<std::byte> out) {
    if (data_.size() < out.size()) return false;
    std::memcpy(out.data(), data_.data(), out.size());
    data_ = data_.subspan(out.size());
    return true;
  }
  size_t left() const { return data_.size(); }

 private:
  std::span<const std::byte> data_;
};

// A byte range of a registered region (the remote ranges of a WRITE frame).
struct RegionRange {
  uint32_t region = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// u32 count, then per op: u32 region | u32 zero | u64 offset | u64 length.
std::vector<std::byte> EncodeRanges(std::span<const WriteOp> ops);
// DATA_LOSS unless the payload is exactly `count` well-formed ranges and
// count <= kMaxOpsPerFrame.
absl::StatusOr<std::vector<RegionRange>> DecodeRanges(
    std::span<const std::byte> payload);

// The receiving side's server: accepts connections on a listening socket
// and serves each on a thread of its own. Destruction stops accepting,
// tells the serving threads (stopping()) and joins them.
class ControlServer {
 public:
  struct Options {
    // Connections served at once; more are closed at accept. Default: 1024.
    size_t max_peers = 1024;
    // Called on an accepted socket; false closes it unserved. Default: all.
    std::function<bool(int fd)> admit;
  };
  using ServeFn = std::function<void(const ControlServer&, Fd)>;
  // `serve` runs once per connection, on its own thread, and owns the fd.
  ControlServer(Fd listener, Options options, ServeFn serve);
  ~ControlServer();

  bool stopping() const { return stop_.load(); }

  // Waits between requests for the next frame of a connection: idles
  // while the peer is quiet, then reads the whole frame within
  // `io_timeout`. CANCELLED once the server stops; else as RecvControl.
  absl::Status NextFrame(int fd, uint32_t max_message_bytes,
                         absl::Duration io_timeout, ControlFrame& frame) const;

  // Sends ERROR (`why`) and ends the connection. Closing with unread
  // bytes would reset it and could destroy the ERROR before the peer
  // reads it, so the input is drained (bounded in time) after a
  // half-close.
  void Refuse(int fd, const absl::Status& why, uint32_t max_message_bytes,
              absl::Duration io_timeout) const;

 private:
  struct Peer {
    std::thread thread;
    std::atomic<bool> done{false};
  };
  void AcceptLoop();

  const Fd listener_;
  const Options options_;
  const ServeFn serve_;
  std::atomic<bool> stop_{false};
  absl::Mutex mu_;
  std::list<Peer> peers_ ABSL_GUARDED_BY(mu_);  // Addresses stay put.
  std::thread accept_thread_;  // Last: starts once the rest exists.
};

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_CONTROL_CHANNEL_H_
