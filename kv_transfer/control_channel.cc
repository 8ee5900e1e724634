#include "kv_transfer/control_channel.h"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "kv_transfer/socket_io.h"
#include "kv_transfer/tcp_frame.h"

namespace pdserve::kv {
namespace {

constexpr size_t kRangeBytes = 24;
// How often a blocked server thread looks at the stop flag.
constexpr absl::Duration kStopPoll = absl::Milliseconds(50);

}  // namespace

uint32_t ControlPayloadLimit(ControlType type, uint32_t max_message_bytes) {
  switch (type) {
    case ControlType::kWrite:
      return 4 + kMaxOpsPerFrame * kRangeBytes;
    case ControlType::kNotify:
    case ControlType::kError:
      return max_message_bytes;
    case ControlType::kDone:
      return 0;
    case ControlType::kHello:
    case ControlType::kHelloReply:
    case ControlType::kGrant:
    case ControlType::kAck:
      return kMaxControlPayload;
  }
  return 0;
}

void EncodeControlHeader(ControlType type, uint32_t value,
                         std::span<const std::byte> payload,
                         std::byte out[kControlHeaderBytes]) {
  std::memset(out, 0, kControlHeaderBytes);
  StoreWire<uint32_t>(out, 0, kControlMagic);
  StoreWire<uint8_t>(out, 4, static_cast<uint8_t>(type));
  StoreWire<uint8_t>(out, 5, kControlVersion);
  StoreWire<uint32_t>(out, 8, value);
  StoreWire<uint32_t>(out, 12, static_cast<uint32_t>(payload.size()));
  StoreWire<uint32_t>(out, 16, Crc32c(payload));
}

absl::Status SendControl(int fd, ControlType type, uint32_t value,
                         std::span<const std::byte> payload,
                         absl::Time deadline) {
  std::byte header[kControlHeaderBytes];
  EncodeControlHeader(type, value, payload, header);
  if (Io io = SendAll(fd, header, sizeof(header), deadline); io != Io::kOk) {
    return IoStatus(io, "control channel");
  }
  return IoStatus(SendAll(fd, payload.data(), payload.size(), deadline),
                  "control channel");
}

absl::Status RecvControl(int fd, uint32_t max_message_bytes,
                         absl::Time deadline, ControlFrame& frame) {
  std::byte raw[kControlHeaderBytes];
  if (Io io = RecvAll(fd, raw, sizeof(raw), deadline); io != Io::kOk) {
    return IoStatus(io, "control channel");
  }
  const uint8_t type = LoadWire<uint8_t>(raw, 4);
  if (LoadWire<uint32_t>(raw, 0) != kControlMagic ||
      type < static_cast<uint8_t>(ControlType::kHello) ||
      type > static_cast<uint8_t>(ControlType::kError) ||
      LoadWire<uint16_t>(raw, 6) != 0 || LoadWire<uint32_t>(raw, 20) != 0) {
    return absl::DataLossError("malformed control frame header");
  }
  if (LoadWire<uint8_t>(raw, 5) != kControlVersion) {
    return absl::DataLossError(
        absl::StrCat("control frame of version ", LoadWire<uint8_t>(raw, 5),
                     " (this side speaks ", kControlVersion, ")"));
  }
  frame.type = static_cast<ControlType>(type);
  frame.value = LoadWire<uint32_t>(raw, 8);
  const uint32_t length = LoadWire<uint32_t>(raw, 12);
  const uint32_t limit = ControlPayloadLimit(frame.type, max_message_bytes);
  if (length > limit) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "control frame of ", length, " bytes exceeds the limit of ", limit));
  }
  frame.payload.resize(length);
  if (Io io = RecvAll(fd, frame.payload.data(), length, deadline);
      io != Io::kOk) {
    return IoStatus(io, "control channel");
  }
  if (Crc32c(frame.payload) != LoadWire<uint32_t>(raw, 16)) {
    return absl::DataLossError("control frame checksum mismatch");
  }
  return absl::OkStatus();
}

absl::Status CheckReply(const ControlFrame& frame, ControlType expected) {
  if (frame.type == expected) return absl::OkStatus();
  if (frame.type != ControlType::kError) {
    return absl::DataLossError(absl::StrCat(
        "unexpected control frame ", static_cast<int>(frame.type),
        " from the peer (wanted ", static_cast<int>(expected), ")"));
  }
  const auto code = frame.value >= 1 && frame.value <= 16
                        ? static_cast<absl::StatusCode>(frame.value)
                        : absl::StatusCode::kUnknown;
  return absl::Status(
      code,
      absl::StrCat(
          "peer refused the transfer: ",
          absl::string_view(reinterpret_cast<const char*>(frame.payload.data()),
                            frame.payload.size())));
}

std::vector<std::byte> EncodeRanges(std::span<const WriteOp> ops) {
  ControlWriter w;
  w.out.reserve(4 + ops.size() * kRangeBytes);
  w.Put<uint32_t>(static_cast<uint32_t>(ops.size()));
  for (const WriteOp& op : ops) {
    w.Put<uint32_t>(op.remote_region.value);
    w.Put<uint32_t>(0);
    w.Put<uint64_t>(op.remote_offset);
    w.Put<uint64_t>(op.length);
  }
  return std::move(w.out);
}

absl::StatusOr<std::vector<RegionRange>> DecodeRanges(
    std::span<const std::byte> payload) {
  ControlReader r(payload);
  uint32_t count = 0;
  if (!r.Get(count) || count > kMaxOpsPerFrame ||
      r.left() != size_t{count} * kRangeBytes) {
    return absl::DataLossError("malformed write ranges");
  }
  std::vector<RegionRange> ranges(count);
  for (RegionRange& range : ranges) {
    uint32_t zero = 0;
    r.Get(range.region);
    r.Get(zero);
    r.Get(range.offset);
    r.Get(range.length);
    if (zero != 0) return absl::DataLossError("malformed write ranges");
  }
  return ranges;
}

ControlServer::ControlServer(Fd listener, Options options, ServeFn serve)
    : listener_(std::move(listener)),
      options_(std::move(options)),
      serve_(std::move(serve)),
      accept_thread_([this] { AcceptLoop(); }) {}

ControlServer::~ControlServer() {
  stop_.store(true);
  accept_thread_.join();
  absl::MutexLock lock(&mu_);
  for (Peer& p : peers_) p.thread.join();
}

void ControlServer::AcceptLoop() {
  while (!stop_.load()) {
    if (WaitFor(listener_.get(), POLLIN, absl::Now() + kStopPoll) != Io::kOk)
      continue;
    Fd fd = Accept(listener_.get());
    if (fd.get() < 0) continue;
    if (options_.admit && !options_.admit(fd.get())) continue;
    absl::MutexLock lock(&mu_);
    for (auto it = peers_.begin(); it != peers_.end();) {  // Reap ended ones.
      if (it->done.load()) {
        it->thread.join();
        it = peers_.erase(it);
      } else {
        ++it;
      }
    }
    if (peers_.size() >= options_.max_peers) continue;  // Closes fd.
    Peer& peer = peers_.emplace_back();
    peer.thread = std::thread([this, &peer, f = std::move(fd)]() mutable {
      serve_(*this, std::move(f));
      peer.done.store(true);
    });
  }
}

absl::Status ControlServer::NextFrame(int fd, uint32_t max_message_bytes,
                                      absl::Duration io_timeout,
                                      ControlFrame& frame) const {
  while (true) {
    if (stop_.load()) return absl::CancelledError("transport is closing");
    const Io ready = WaitFor(fd, POLLIN, absl::Now() + kStopPoll);
    if (ready == Io::kTimeout) continue;
    if (ready != Io::kOk) return IoStatus(ready, "control channel");
    return RecvControl(fd, max_message_bytes, absl::Now() + io_timeout, frame);
  }
}

void ControlServer::Refuse(int fd, const absl::Status& why,
                           uint32_t max_message_bytes,
                           absl::Duration io_timeout) const {
  const std::string msg(why.message().substr(0, max_message_bytes));
  const absl::Time deadline = absl::Now() + io_timeout;
  if (!SendControl(fd, ControlType::kError, static_cast<uint32_t>(why.code()),
                   std::as_bytes(std::span(msg.data(), msg.size())), deadline)
           .ok()) {
    return;
  }
  ::shutdown(fd, SHUT_WR);
  std::byte sink[4096];
  while (!stop_.load() && absl::Now() < deadline &&
         WaitFor(fd, POLLIN, std::min(deadline, absl::Now() + kStopPoll)) ==
             Io::kOk) {
    const ssize_t n = ::recv(fd, sink, sizeof(sink), 0);
    if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) return;
  }
}

}  // namespace pdserve::kv
