// libFuzzer target: the bytes a KV sender (a prefill worker, or anything
// that reaches a decode worker's KV port) may send to a receiver. The first
// byte picks the receiver and how the rest is read:
//   0 (mod 4): the tcp transport, the bytes as they are (bad magic,
//         headers, tables, lengths, ...);
//   1: the tcp transport, the rest read as a list of frames that the
//         harness encodes with valid headers and checksums (unless a frame
//         asks for a bad one), so that the fuzzer gets past the checksum
//         into landing, fencing and notifications: WRITE (segments inside,
//         across and outside the region; an open landing or one the fence
//         does not know, as a closed and fenced one is), NOTIFY, SYNC and
//         raw bytes in between;
//   2: the device transports' control channel (control_channel.h) read
//         frame by frame with RecvControl until it fails, the bytes as they
//         are;
//   3: the same, with frames the harness encodes (any type, WRITE payloads
//         as range lists whose count may lie).
// The tcp transport's bytes go down a real socket into a live receiver with
// one registered region and the decode worker's real LandingFence; the
// client then half-closes and reads until the receiver closes. The control
// channel's go down a socket pair.
// Findings besides a crash, a sanitizer report or a leak:
//   - a hang: no close within 5 s (the receiver's I/O timeout is 300 ms);
//   - a byte written outside the region (guard bytes around it);
//   - a write left "in progress" in the fence once the connection is gone
//     (the landing's blocks could then never be reused);
//   - a notification longer than the limit;
//   - a control frame accepted with a payload over its type's limit (a
//     guard on RecvControl's own check; WRITE payloads also go through
//     DecodeRanges, for the sanitizers).
#include <fuzzer/FuzzedDataProvider.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kv_transfer/control_channel.h"
#include "kv_transfer/landing_fence.h"
#include "kv_transfer/socket_io.h"
#include "kv_transfer/tcp_frame.h"
#include "kv_transfer/transport.h"
#include "tests/fuzz/socket_exchange.h"

namespace {

using pdserve::kv::ControlType;
using pdserve::kv::Crc32c;
using pdserve::kv::EncodeFrameHeader;
using pdserve::kv::EncodeSegment;
using pdserve::kv::FrameHeader;
using pdserve::kv::FrameType;
using pdserve::kv::kFrameHeaderBytes;
using pdserve::kv::kMaxWriteSegments;
using pdserve::kv::kSegmentBytes;
using pdserve::kv::WriteSegment;

constexpr size_t kRegionBytes = 64 << 10;
constexpr size_t kGuardBytes = 4 << 10;
constexpr std::byte kGuard{0xA5};
constexpr uint32_t kMaxMessageBytes = 1024;

struct Receiver {
  std::unique_ptr<pdserve::kv::KvTransport> transport;
  pdserve::kv::LandingFence fence{/*every_write_fenced=*/true, absl::Seconds(1)};
  std::vector<std::byte> memory;  // Guard, region, guard.
  uint32_t region = 0;
};

Receiver& Live() {
  static Receiver* const receiver = [] {
    auto* r = new Receiver;
    pdserve::kv::TransportOptions options;
    options.max_message_bytes = kMaxMessageBytes;
    options.max_pending_notifications = 64;
    options.io_timeout = absl::Milliseconds(300);
    auto transport = pdserve::kv::CreateKvTransport("tcp", options);
    if (!transport.ok()) __builtin_trap();
    r->transport = std::move(*transport);
    r->transport->SetWriteFence(&r->fence);
    r->memory.assign(kRegionBytes + 2 * kGuardBytes, kGuard);
    auto region = r->transport->RegisterMemory(
        std::span(r->memory).subspan(kGuardBytes, kRegionBytes));
    if (!region.ok()) __builtin_trap();
    r->region = region->value;
    return r;
  }();
  return *receiver;
}

void Append(std::vector<std::byte>& out, std::span<const std::byte> bytes) {
  out.insert(out.end(), bytes.begin(), bytes.end());
}

void AppendFrame(std::vector<std::byte>& out, FrameHeader h,
                 std::span<const std::byte> table,
                 std::span<const std::byte> body, bool bad_crc) {
  h.crc = Crc32c(body, Crc32c(table)) ^ (bad_crc ? 1u : 0u);
  std::byte header[kFrameHeaderBytes];
  EncodeFrameHeader(h, header);
  Append(out, header);
  Append(out, table);
  Append(out, body);
}

// Mode 1's frames: `open` is this input's open landing.
std::vector<std::byte> EncodeFrames(FuzzedDataProvider& in, uint64_t open,
                                    uint32_t region) {
  std::vector<std::byte> out;
  while (in.remaining_bytes() > 0) {
    const uint8_t kind = in.ConsumeIntegral<uint8_t>();
    const bool bad_crc = kind & 0x80;
    switch (kind % 5) {
      case 0:
      case 1: {  // WRITE
        FrameHeader h{.type = FrameType::kWrite};
        switch (in.ConsumeIntegralInRange<int>(0, 2)) {
          case 0: h.landing = open; break;
          case 1: h.landing = open + 1000; break;  // Not open.
          default: h.landing = in.ConsumeIntegral<uint64_t>();
        }
        h.region = in.ConsumeBool() ? region : in.ConsumeIntegral<uint32_t>();
        const uint32_t n =
            in.ConsumeIntegralInRange<uint32_t>(0, kMaxWriteSegments + 1);
        std::vector<std::byte> table(size_t{n} * kSegmentBytes);
        uint64_t data = 0;
        for (uint32_t i = 0; i < n; ++i) {
          WriteSegment s;
          s.offset = in.ConsumeBool()
                         ? in.ConsumeIntegralInRange<uint64_t>(0, kRegionBytes + 64)
                         : in.ConsumeIntegral<uint64_t>();
          s.length = in.ConsumeIntegralInRange<uint32_t>(0, 2048);
          EncodeSegment(s, table.data() + i * kSegmentBytes);
          data += s.length;
        }
        h.segments = n;
        h.length = in.ConsumeIntegralInRange<int>(0, 15) == 0
                       ? in.ConsumeIntegral<uint32_t>()  // A lie.
                       : static_cast<uint32_t>(table.size() + data);
        // As many data bytes as the input has left, up to the segments'.
        const std::vector<uint8_t> body = in.ConsumeBytes<uint8_t>(data);
        AppendFrame(out, h, table, std::as_bytes(std::span(body)), bad_crc);
        break;
      }
      case 2: {  // NOTIFY
        const std::string message = in.ConsumeRandomLengthString(2048);
        const FrameHeader h{.type = FrameType::kNotify,
                            .length = static_cast<uint32_t>(message.size())};
        AppendFrame(out, h, {},
                    std::as_bytes(std::span(message.data(), message.size())),
                    bad_crc);
        break;
      }
      case 3:
        AppendFrame(out, {.type = FrameType::kSync}, {}, {}, false);
        break;
      default: {  // Raw bytes between frames.
        const std::string raw = in.ConsumeRandomLengthString(64);
        Append(out, std::as_bytes(std::span(raw.data(), raw.size())));
      }
    }
  }
  return out;
}

// Mode 3's frames: the header by EncodeControlHeader, any type byte, the
// payload from the input (a WRITE's as a range list, its count may lie).
std::vector<std::byte> EncodeControlFrames(FuzzedDataProvider& in) {
  std::vector<std::byte> out;
  while (in.remaining_bytes() > 0) {
    const auto type = static_cast<ControlType>(in.ConsumeIntegralInRange<int>(0, 9));
    const uint32_t value = in.ConsumeIntegral<uint32_t>();
    pdserve::kv::ControlWriter payload;
    if (type == ControlType::kWrite && in.ConsumeBool()) {
      const uint32_t count = in.ConsumeIntegralInRange<uint32_t>(0, 16);
      payload.Put<uint32_t>(in.ConsumeIntegralInRange<int>(0, 7) == 0
                                ? in.ConsumeIntegral<uint32_t>()  // A lie.
                                : count);
      for (uint32_t i = 0; i < count; ++i) {
        payload.Put<uint32_t>(in.ConsumeIntegral<uint32_t>());
        payload.Put<uint32_t>(in.ConsumeBool() ? 0 : in.ConsumeIntegral<uint32_t>());
        payload.Put<uint64_t>(in.ConsumeIntegral<uint64_t>());
        payload.Put<uint64_t>(in.ConsumeIntegral<uint64_t>());
      }
    } else {
      const std::string bytes = in.ConsumeRandomLengthString(2048);
      payload.PutBytes(std::as_bytes(std::span(bytes.data(), bytes.size())));
    }
    std::byte header[pdserve::kv::kControlHeaderBytes];
    EncodeControlHeader(type, value, payload.out, header);
    if (in.ConsumeIntegralInRange<int>(0, 15) == 0) header[16] ^= std::byte{1};  // Bad checksum.
    Append(out, header);
    Append(out, payload.out);
  }
  return out;
}

// Reads control frames from `bytes` until RecvControl fails (at the end of
// the bytes at the latest) and checks what it accepted.
void ReadControl(std::span<const std::byte> bytes) {
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) __builtin_trap();
  // A writer of its own: the reader may stop (at a refused frame) before
  // the bytes are all sent, and then its close ends the writer's send.
  std::thread writer([&] {
    for (size_t sent = 0; sent < bytes.size();) {
      const ssize_t n = ::send(fds[0], bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      sent += static_cast<size_t>(n);
    }
    ::close(fds[0]);
  });
  pdserve::kv::SetNonBlocking(fds[1]);
  pdserve::kv::ControlFrame frame;
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (pdserve::kv::RecvControl(fds[1], kMaxMessageBytes, deadline, frame).ok()) {
    if (frame.payload.size() > pdserve::kv::ControlPayloadLimit(frame.type, kMaxMessageBytes)) {
      __builtin_trap();
    }
    if (frame.type == ControlType::kWrite) {
      pdserve::kv::DecodeRanges(frame.payload).IgnoreError();
    }
  }
  ::close(fds[1]);
  writer.join();
}

// The process's threads (the receiver serves each connection on one).
size_t Threads() {
  const std::filesystem::directory_iterator tasks("/proc/self/task");
  return static_cast<size_t>(std::distance(begin(tasks), end(tasks)));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  if (data[0] % 4 >= 2) {
    if (data[0] % 4 == 2) {
      ReadControl(std::as_bytes(std::span(data + 1, size - 1)));
    } else {
      FuzzedDataProvider in(data + 1, size - 1);
      ReadControl(EncodeControlFrames(in));
    }
    return 0;
  }
  Receiver& r = Live();
  const uint64_t open = r.fence.Open();
  std::vector<std::byte> bytes;
  if (data[0] % 4 == 0) {
    Append(bytes, std::as_bytes(std::span(data + 1, size - 1)));
  } else {
    FuzzedDataProvider in(data + 1, size - 1);
    bytes = EncodeFrames(in, open, r.region);
  }
  const size_t threads = Threads();
  auto fd = pdserve::kv::ConnectTcp(r.transport->endpoint(), absl::Seconds(5));
  if (!fd.ok()) __builtin_trap();
  pdserve::fuzz::ExchangeUntilClosed(fd->Release(), bytes, std::chrono::seconds(5));
  // The receiver may close its side before its connection's thread ends
  // (it refuses a peer with ERROR, a half-close, then reads to the peer's
  // end); a leak check between the two would see that thread's buffers.
  const auto give_up =
      std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (Threads() > threads) {
    if (std::chrono::steady_clock::now() > give_up) __builtin_trap();  // Hung.
    std::this_thread::yield();
  }

  // The receiver closed the connection only after its last write ended.
  if (!r.fence.Close(open, absl::Now())) __builtin_trap();  // A write leaked.
  const auto outside = [&](size_t at) { return r.memory[at] != kGuard; };
  for (size_t i = 0; i < kGuardBytes; ++i) {
    if (outside(i) || outside(kGuardBytes + kRegionBytes + i)) __builtin_trap();
  }
  while (true) {
    auto note = r.transport->WaitNotification(absl::ZeroDuration());
    if (!note.ok()) break;
    if (note->message.size() > kMaxMessageBytes) __builtin_trap();
  }
  return 0;
}
