// "tcp": the portable transport. Writes travel as checksummed frames
// (tcp_frame.h) over one TCP stream per connection; the receiver checks
// every frame against its registered regions before copying it in.
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <list>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kv_transfer/region_table.h"
#include "kv_transfer/socket_io.h"
#include "kv_transfer/tcp_frame.h"
#include "kv_transfer/transports.h"

namespace pdserve::kv {
namespace {

// How often blocked threads look at the stop flag.
constexpr absl::Duration kStopPoll = absl::Milliseconds(50);

// A peer of the release before the segment tables (its frames begin with
// kFrameMagicV1) cannot speak to this one: during a rolling upgrade, the
// KV pushes between an upgraded worker and one that is not fail with this.
constexpr char kOlderPeer[] =
    "the KV peer speaks an older tcp frame format (PDKV, before scattered segments); "
    "upgrade the prefill and decode workers to the same release";

Io SendFrame(int fd, const FrameHeader& h, std::span<const std::byte> payload, absl::Time deadline) {
  std::byte header[kFrameHeaderBytes];
  EncodeFrameHeader(h, header);
  iovec iov[] = {{header, sizeof(header)}, {const_cast<std::byte*>(payload.data()), payload.size()}};
  return SendAllV(fd, iov, deadline);
}

class TcpConnection final : public KvConnection {
 public:
  TcpConnection(Fd fd, RegionTable* local, const TransportOptions& options)
      : fd_(std::move(fd)), local_(local), options_(options) {}

  absl::Status Write(std::span<const WriteOp> ops) override {
    if (fd_.get() < 0) return absl::UnavailableError("connection is closed");
    for (const WriteOp& op : ops) {  // Check every local range before sending anything.
      PD_RETURN_IF_ERROR(CheckLocal(op));
    }
    for (Cursor at; at.op < ops.size();) PD_RETURN_IF_ERROR(SendWriteFrame(ops, at));
    return Sync();
  }

  absl::Status Notify(std::string_view message) override {
    if (fd_.get() < 0) return absl::UnavailableError("connection is closed");
    if (message.size() > options_.max_message_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat("notification of ", message.size(),
                                                       " bytes exceeds the limit of ",
                                                       options_.max_message_bytes));
    }
    const auto payload = std::as_bytes(std::span(message.data(), message.size()));
    const FrameHeader h{FrameType::kNotify, 0, static_cast<uint32_t>(message.size()), 0, Crc32c(payload)};
    if (Io io = SendFrame(fd_.get(), h, payload, absl::Now() + options_.io_timeout); io != Io::kOk) {
      return Fail(PeerError(IoStatus(io, "sending a notification")));
    }
    return Sync();
  }

 private:
  // Where the next frame starts: byte `done` of ops[op].
  struct Cursor {
    size_t op = 0;
    uint64_t done = 0;
  };

  // One WRITE frame of the ops from `at` on that share its regions and
  // landing, up to max_frame_bytes and kMaxWriteSegments (an op longer
  // than what is left of the frame is split); `at` moves past them.
  absl::Status SendWriteFrame(std::span<const WriteOp> ops, Cursor& at) {
    const WriteOp& first = ops[at.op];
    segments_.clear();
    sources_.clear();
    uint64_t data = 0;
    uint64_t low = UINT64_MAX;  // The local range that spans the sources.
    uint64_t high = 0;
    for (; at.op < ops.size(); at.done = 0, ++at.op) {
      const WriteOp& op = ops[at.op];
      if (op.local_region != first.local_region || op.remote_region != first.remote_region ||
          op.landing != first.landing) {
        break;
      }
      while (at.done < op.length && data < options_.max_frame_bytes && segments_.size() < kMaxWriteSegments) {
        const auto n = static_cast<uint32_t>(std::min<uint64_t>(op.length - at.done, options_.max_frame_bytes - data));
        segments_.push_back({op.remote_offset + at.done, n});
        sources_.push_back(op.local_offset + at.done);
        low = std::min(low, sources_.back());
        high = std::max(high, sources_.back() + n);
        at.done += n;
        data += n;
      }
      if (at.done < op.length) break;  // The frame is full.
    }
    if (segments_.empty()) return absl::OkStatus();  // Only empty ops.
    // Every source lies in the local region (CheckLocal), so the range
    // that spans them does too.
    table_.resize(segments_.size() * kSegmentBytes);
    for (size_t i = 0; i < segments_.size(); ++i) EncodeSegment(segments_[i], table_.data() + i * kSegmentBytes);
    Io io = Io::kOk;
    const absl::Status local =
        local_->Access(first.local_region, low, high - low, [&](std::span<std::byte> span) {
          std::byte header[kFrameHeaderBytes];
          iov_.assign({{header, sizeof(header)}, {table_.data(), table_.size()}});
          uint32_t crc = Crc32c(table_);
          for (size_t i = 0; i < segments_.size(); ++i) {
            const std::span<std::byte> src = span.subspan(sources_[i] - low, segments_[i].length);
            crc = Crc32c(src, crc);
            iov_.push_back({src.data(), src.size()});
          }
          const FrameHeader h{.type = FrameType::kWrite,
                              .region = first.remote_region.value,
                              .length = static_cast<uint32_t>(table_.size() + data),
                              .segments = static_cast<uint32_t>(segments_.size()),
                              .crc = crc,
                              .landing = first.landing};
          EncodeFrameHeader(h, header);
          io = SendAllV(fd_.get(), iov_, absl::Now() + options_.io_timeout);
        });
    if (!local.ok()) return Fail(absl::InvalidArgumentError(absl::StrCat("local ", local.message())));
    if (io != Io::kOk) return Fail(PeerError(IoStatus(io, "sending KV")));
    return absl::OkStatus();
  }

  absl::Status CheckLocal(const WriteOp& op) {
    const absl::Status s = local_->Access(op.local_region, op.local_offset, op.length, [](auto) {});
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("local ", s.message()));
    return absl::OkStatus();
  }

  // SYNC, then the peer's ACK (or its ERROR).
  absl::Status Sync() {
    const absl::Time deadline = absl::Now() + options_.io_timeout;
    if (Io io = SendFrame(fd_.get(), {FrameType::kSync}, {}, deadline); io != Io::kOk) {
      return Fail(PeerError(IoStatus(io, "sending a sync")));
    }
    absl::Status reply = ReadReply(deadline);
    if (!reply.ok()) return Fail(reply);
    return absl::OkStatus();
  }

  // The receiver answers only ACK or ERROR.
  absl::Status ReadReply(absl::Time deadline) {
    std::byte raw[kFrameHeaderBytes];
    if (Io io = RecvAll(fd_.get(), raw, sizeof(raw), deadline); io != Io::kOk) {
      return IoStatus(io, "waiting for the peer's acknowledgement");
    }
    FrameHeader h;
    if (!DecodeFrameHeader(raw, h)) {
      if (IsOlderFormat(raw)) return absl::FailedPreconditionError(kOlderPeer);
      return absl::DataLossError("malformed reply from the peer");
    }
    if (h.type == FrameType::kAck && h.length == 0) return absl::OkStatus();
    if (h.type != FrameType::kError || h.length > options_.max_message_bytes) {
      return absl::DataLossError("unexpected reply from the peer");
    }
    std::string message(h.length, '\0');
    if (Io io = RecvAll(fd_.get(), reinterpret_cast<std::byte*>(message.data()), h.length, deadline);
        io != Io::kOk) {
      return IoStatus(io, "reading the peer's error");
    }
    const auto code = h.region <= 16 ? static_cast<absl::StatusCode>(h.region) : absl::StatusCode::kUnknown;
    return absl::Status(code == absl::StatusCode::kOk ? absl::StatusCode::kUnknown : code,
                        absl::StrCat("peer refused the transfer: ", message));
  }

  // A send failed: the peer may have said why before closing.
  absl::Status PeerError(absl::Status send_error) {
    absl::Status reason = ReadReply(absl::Now() + absl::Milliseconds(200));
    return reason.ok() || absl::IsDeadlineExceeded(reason) || absl::IsUnavailable(reason) ? send_error : reason;
  }

  absl::Status Fail(absl::Status s) {
    if (!absl::IsInvalidArgument(s)) fd_.Reset();
    return s;
  }

  Fd fd_;
  RegionTable* const local_;
  const TransportOptions options_;
  // The frame being sent (kept to reuse their memory).
  std::vector<WriteSegment> segments_;
  std::vector<uint64_t> sources_;  // Local offset of each segment.
  std::vector<std::byte> table_;
  std::vector<iovec> iov_;
};

class TcpTransport final : public KvTransport {
 public:
  static absl::StatusOr<std::unique_ptr<KvTransport>> Create(const TransportOptions& options) {
    if (options.max_frame_bytes > kMaxWritePayloadBytes) {
      return absl::InvalidArgumentError(absl::StrCat("tcp frames of ", options.max_frame_bytes,
                                                     " bytes exceed what receivers accept (",
                                                     kMaxWritePayloadBytes, ")"));
    }
    PD_ASSIGN_OR_RETURN(auto listener, ListenTcp(options.listen_address));
    return std::unique_ptr<KvTransport>(
        new TcpTransport(options, std::move(listener.first), std::move(listener.second)));
  }

  ~TcpTransport() override {
    stop_.store(true);
    accept_thread_.join();
    absl::MutexLock lock(&mu_);
    for (Peer& p : peers_) p.thread.join();
  }

  const TransportCapabilities& capabilities() const override { return caps_; }
  std::string endpoint() const override { return endpoint_; }
  absl::StatusOr<RegionId> RegisterMemory(std::span<std::byte> memory) override {
    return regions_.Register(memory);
  }
  absl::Status DeregisterMemory(RegionId region) override { return regions_.Deregister(region); }
  void SetWriteFence(WriteFence* fence) override { fence_.store(fence); }

  absl::StatusOr<std::unique_ptr<KvConnection>> Connect(std::string_view endpoint) override {
    PD_ASSIGN_OR_RETURN(Fd fd, ConnectTcp(endpoint, options_.io_timeout));
    return std::unique_ptr<KvConnection>(new TcpConnection(std::move(fd), &regions_, options_));
  }

  absl::StatusOr<Notification> WaitNotification(absl::Duration timeout) override {
    return notifications_.Wait(timeout);
  }

 private:
  struct Peer {
    std::thread thread;
    std::atomic<bool> done{false};
  };

  TcpTransport(const TransportOptions& options, Fd listen_fd, std::string endpoint)
      : options_(options),
        endpoint_(std::move(endpoint)),
        notifications_(options.max_pending_notifications),
        listen_fd_(std::move(listen_fd)),
        accept_thread_([this] { AcceptLoop(); }) {}

  void AcceptLoop() {
    while (!stop_.load()) {
      if (WaitFor(listen_fd_.get(), POLLIN, absl::Now() + kStopPoll) != Io::kOk) continue;
      Fd fd = Accept(listen_fd_.get());
      if (fd.get() < 0) continue;
      absl::MutexLock lock(&mu_);
      // Reap peers whose connections have ended.
      for (auto it = peers_.begin(); it != peers_.end();) {
        if (it->done.load()) {
          it->thread.join();
          it = peers_.erase(it);
        } else {
          ++it;
        }
      }
      Peer& peer = peers_.emplace_back();
      peer.thread = std::thread([this, &peer, f = std::move(fd)]() mutable {
        Serve(std::move(f));
        peer.done.store(true);
      });
    }
  }

  // Sends ERROR and ends the connection. Closing with unread bytes in the
  // socket would reset it and could destroy the ERROR before the sender
  // reads it, so the input is drained (bounded in time) after a half-close.
  void Refuse(int fd, const absl::Status& why) {
    const std::string msg(why.message().substr(0, options_.max_message_bytes));
    const auto payload = std::as_bytes(std::span(msg.data(), msg.size()));
    const FrameHeader h{FrameType::kError, static_cast<uint32_t>(why.code()), static_cast<uint32_t>(msg.size()),
                        0, Crc32c(payload)};
    const absl::Time deadline = absl::Now() + options_.io_timeout;
    if (SendFrame(fd, h, payload, deadline) != Io::kOk) return;
    ::shutdown(fd, SHUT_WR);
    std::byte sink[4096];
    while (!stop_.load() && WaitFor(fd, POLLIN, std::min(deadline, absl::Now() + kStopPoll)) == Io::kOk) {
      const ssize_t n = ::recv(fd, sink, sizeof(sink), 0);
      if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) return;
      if (absl::Now() > deadline) return;
    }
  }

  // Reads and drops `length` payload bytes; false when the peer stops
  // sending them.
  static bool Discard(int fd, uint32_t length, absl::Time deadline) {
    std::byte sink[16 << 10];
    for (uint32_t left = length; left > 0;) {
      const uint32_t n = std::min<uint32_t>(left, sizeof(sink));
      if (RecvAll(fd, sink, n, deadline) != Io::kOk) return false;
      left -= n;
    }
    return true;
  }

  // A WRITE frame's table and where its segments land (kept per
  // connection to reuse their memory).
  struct WriteFrame {
    std::vector<std::byte> table;
    std::vector<WriteSegment> segments;
    std::vector<iovec> iov;
  };

  // Lands a WRITE frame's segments in place (no staging copy) after their
  // range is checked, and verifies them there. An error fails the transfer
  // (the decode worker never reads blocks whose transfer did not complete)
  // and ends the connection; `lost` when the peer stopped sending half way,
  // so that nothing is left to answer.
  absl::Status Land(int fd, const FrameHeader& h, absl::Time deadline, WriteFrame& frame, bool& lost) {
    frame.table.resize(size_t{h.segments} * kSegmentBytes);
    if (h.length < frame.table.size()) return absl::DataLossError("write frame shorter than its segment table");
    if (RecvAll(fd, frame.table.data(), frame.table.size(), deadline) != Io::kOk) {
      lost = true;
      return absl::OkStatus();
    }
    frame.segments.resize(h.segments);
    uint64_t data = 0;
    uint64_t low = UINT64_MAX;
    uint64_t high = 0;
    for (uint32_t i = 0; i < h.segments; ++i) {
      WriteSegment& seg = frame.segments[i];
      if (!DecodeSegment(frame.table.data() + i * kSegmentBytes, seg)) {
        return absl::DataLossError("malformed write segment");
      }
      if (seg.offset > UINT64_MAX - seg.length) {
        return absl::OutOfRangeError(absl::StrCat("write segment at ", seg.offset, " runs past 2^64"));
      }
      data += seg.length;
      low = std::min(low, seg.offset);
      high = std::max(high, seg.offset + seg.length);
    }
    if (data != h.length - frame.table.size()) {
      return absl::DataLossError("write segments do not add up to the frame's length");
    }
    // Each segment is inside the checked range that spans them all.
    Io io = Io::kOk;
    bool intact = true;
    const absl::Status s = regions_.Access(RegionId(h.region), low, high - low, [&](std::span<std::byte> span) {
      frame.iov.clear();
      for (const WriteSegment& seg : frame.segments) frame.iov.push_back({span.data() + (seg.offset - low), seg.length});
      io = RecvAllV(fd, frame.iov, deadline);
      if (io != Io::kOk) return;
      uint32_t crc = Crc32c(frame.table);
      for (const WriteSegment& seg : frame.segments) crc = Crc32c(span.subspan(seg.offset - low, seg.length), crc);
      intact = crc == h.crc;
    });
    if (!s.ok()) return s;
    if (io != Io::kOk) {
      lost = true;
      return absl::OkStatus();
    }
    if (!intact) return absl::DataLossError("frame checksum mismatch");
    return absl::OkStatus();
  }

  // One peer's stream of frames. What a peer can make us hold is bounded:
  // writes land in registered memory after a range check, notifications in
  // one staging buffer of at most max_message_bytes.
  void Serve(Fd fd) {
    std::vector<std::byte> staging;
    WriteFrame frame;
    std::byte raw[kFrameHeaderBytes];
    while (!stop_.load()) {
      // Idle between frames for as long as the peer likes; once a frame has
      // begun, the rest must arrive within io_timeout.
      const Io ready = WaitFor(fd.get(), POLLIN, absl::Now() + kStopPoll);
      if (ready == Io::kTimeout) continue;
      if (ready != Io::kOk) return;
      const absl::Time deadline = absl::Now() + options_.io_timeout;
      if (RecvAll(fd.get(), raw, sizeof(raw), deadline) != Io::kOk) return;
      FrameHeader h;
      if (!DecodeFrameHeader(raw, h)) {
        if (IsOlderFormat(raw)) return Refuse(fd.get(), absl::FailedPreconditionError(kOlderPeer));
        return Refuse(fd.get(), absl::DataLossError("malformed frame header"));
      }
      // A WRITE's limit is the format's, not this side's own frame size.
      const uint64_t limit =
          h.type == FrameType::kWrite    ? uint64_t{kMaxWritePayloadBytes} + h.segments * kSegmentBytes
          : h.type == FrameType::kNotify ? options_.max_message_bytes
                                         : 0;
      if (h.type == FrameType::kAck || h.type == FrameType::kError) {
        return Refuse(fd.get(), absl::DataLossError("unexpected frame type from a sender"));
      }
      if (h.length > limit) {
        return Refuse(fd.get(), absl::ResourceExhaustedError(absl::StrCat(
                                    "frame of ", h.length, " bytes exceeds the limit of ", limit)));
      }
      absl::Status s = absl::OkStatus();
      switch (h.type) {
        case FrameType::kWrite: {
          // The fence first: a write into a landing that is no longer open
          // (released, expired, its request gone) is read and dropped, and
          // the connection, which other landings share, goes on.
          WriteFence* const fence = fence_.load();
          if (fence != nullptr && !fence->BeginWrite(h.landing)) {
            if (!Discard(fd.get(), h.length, deadline)) return;
            break;
          }
          bool lost = false;
          s = Land(fd.get(), h, deadline, frame, lost);
          if (fence != nullptr) fence->EndWrite(h.landing);
          if (lost) return;
          break;
        }
        case FrameType::kNotify: {
          if (staging.size() < h.length) staging.resize(h.length);
          if (RecvAll(fd.get(), staging.data(), h.length, deadline) != Io::kOk) return;
          const std::span<const std::byte> payload(staging.data(), h.length);
          if (Crc32c(payload) != h.crc) return Refuse(fd.get(), absl::DataLossError("frame checksum mismatch"));
          s = notifications_.Push({std::string(reinterpret_cast<const char*>(payload.data()), payload.size())});
          break;
        }
        case FrameType::kSync:
          if (SendFrame(fd.get(), {FrameType::kAck}, {}, deadline) != Io::kOk) return;
          break;
        default:
          break;
      }
      if (!s.ok()) return Refuse(fd.get(), s);
    }
  }

  const TransportOptions options_;
  const TransportCapabilities caps_{
      .name = "tcp", .device_memory = false, .one_sided = false, .cross_host = true, .fences_writes = true};
  std::atomic<WriteFence*> fence_{nullptr};
  const std::string endpoint_;
  RegionTable regions_;
  NotificationQueue notifications_;
  std::atomic<bool> stop_{false};
  Fd listen_fd_;
  absl::Mutex mu_;
  std::list<Peer> peers_ ABSL_GUARDED_BY(mu_);  // std::list: Peer addresses stay put.
  std::thread accept_thread_;  // Last: starts once everything above exists.
};

}  // namespace

absl::StatusOr<std::unique_ptr<KvTransport>> CreateTcpTransport(const TransportOptions& options) {
  return TcpTransport::Create(options);
}

}  // namespace pdserve::kv
