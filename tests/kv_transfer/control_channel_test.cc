// The device transports' control channel and what of cuda_ipc / nccl runs
// without a GPU: frames that are truncated, oversized or corrupt are
// refused with the right code (and without reading or allocating past the
// limit), Unix socket endpoints are validated, a server answers a bad
// frame with ERROR, and the transports are named and refuse to start
// without a device; accepted TCP connections have TCP_NODELAY. Runs in
// CI (no GPU).
#include "kv_transfer/control_channel.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kv_transfer/socket_io.h"
#include "kv_transfer/transport.h"

namespace pdserve::kv {
namespace {

constexpr uint32_t kMaxMessage = 1024;

class ControlFrameTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int fds[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, fds), 0);
    a_ = Fd(fds[0]);
    b_ = Fd(fds[1]);
  }
  void SendRaw(std::span<const std::byte> bytes) {
    ASSERT_EQ(SendAll(a_.get(), bytes.data(), bytes.size(),
                      absl::Now() + absl::Seconds(1)),
              Io::kOk);
  }
  // A header as EncodeControlHeader makes it, then `patch` applied.
  std::vector<std::byte> Header(ControlType type, uint32_t value,
                                std::span<const std::byte> payload) {
    std::vector<std::byte> h(kControlHeaderBytes);
    EncodeControlHeader(type, value, payload, h.data());
    return h;
  }
  absl::Status Receive(ControlFrame& frame,
                       absl::Duration timeout = absl::Milliseconds(200)) {
    return RecvControl(b_.get(), kMaxMessage, absl::Now() + timeout, frame);
  }
  Fd a_, b_;
};

std::vector<std::byte> Bytes(std::string_view s) {
  const auto b = std::as_bytes(std::span(s.data(), s.size()));
  return {b.begin(), b.end()};
}

TEST_F(ControlFrameTest, FramesRoundTrip) {
  const auto payload = Bytes("kv complete");
  ASSERT_TRUE(SendControl(a_.get(), ControlType::kNotify, 7, payload,
                          absl::Now() + absl::Seconds(1))
                  .ok());
  ASSERT_TRUE(SendControl(a_.get(), ControlType::kDone, 0, {},
                          absl::Now() + absl::Seconds(1))
                  .ok());
  ControlFrame f;
  ASSERT_TRUE(Receive(f).ok());
  EXPECT_EQ(f.type, ControlType::kNotify);
  EXPECT_EQ(f.value, 7u);
  EXPECT_EQ(f.payload, payload);
  ASSERT_TRUE(Receive(f).ok());
  EXPECT_EQ(f.type, ControlType::kDone);
  EXPECT_TRUE(f.payload.empty());
}

TEST_F(ControlFrameTest, TruncatedFramesAreUnavailableOrTimeOut) {
  const auto payload = Bytes("0123456789");
  auto h = Header(ControlType::kNotify, 0, payload);
  SendRaw(std::span(h).first(10));  // Half a header, then nothing.
  ControlFrame f;
  EXPECT_EQ(Receive(f).code(), absl::StatusCode::kDeadlineExceeded);
  SendRaw(std::span(h).subspan(10));
  SendRaw(std::span(payload).first(4));  // The payload stops half way...
  EXPECT_EQ(Receive(f).code(), absl::StatusCode::kDeadlineExceeded);
  a_.Reset();  // ... and the peer goes.
  EXPECT_EQ(Receive(f).code(), absl::StatusCode::kUnavailable);
}

TEST_F(ControlFrameTest, OversizedFramesAreRefusedBeforeTheirPayload) {
  // A NOTIFY over max_message_bytes, a DONE with any payload, a WRITE
  // longer than kMaxOpsPerFrame ranges, a GRANT over kMaxControlPayload:
  // refused from the header alone (no payload is sent here).
  struct Case {
    ControlType type;
    uint32_t length;
  } cases[] = {
      {ControlType::kNotify, kMaxMessage + 1},
      {ControlType::kError, kMaxMessage + 1},
      {ControlType::kDone, 1},
      {ControlType::kWrite, 4 + 24 * kMaxOpsPerFrame + 1},
      {ControlType::kGrant, kMaxControlPayload + 1},
      {ControlType::kHello, ~0u},
  };
  for (const Case& c : cases) {
    auto h = Header(c.type, 0, {});
    std::memcpy(h.data() + 12, &c.length, 4);
    SendRaw(h);
    ControlFrame f;
    const absl::Status s = Receive(f);
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted)
        << static_cast<int>(c.type) << ": " << s;
    EXPECT_LE(f.payload.capacity(), size_t{kMaxControlPayload});
  }
}

TEST_F(ControlFrameTest, CorruptFramesAreDataLoss) {
  const auto payload = Bytes("hello");
  const auto good = Header(ControlType::kNotify, 0, payload);
  // (byte offset, new value): magic, type 0, type 9, version, reserved
  // u16, reserved u32, checksum.
  const std::pair<size_t, uint8_t> patches[] = {
      {0, 0x00}, {4, 0}, {4, 9}, {5, 2}, {6, 1}, {21, 1}, {16, 0x5a}};
  for (auto [at, value] : patches) {
    auto h = good;
    h[at] = static_cast<std::byte>(value);
    SendRaw(h);
    SendRaw(payload);
    ControlFrame f;
    EXPECT_EQ(Receive(f).code(), absl::StatusCode::kDataLoss) << "byte " << at;
    // Resynchronize: a fresh pair for the next case.
    SetUp();
  }
}

TEST(ControlPayloadTest, RangesRoundTripAndMalformedListsAreRefused) {
  const WriteOp ops[] = {{RegionId(1), 0, RegionId(7), 4096, 512},
                         {RegionId(1), 9, RegionId(8), ~uint64_t{0}, 1}};
  const std::vector<std::byte> encoded = EncodeRanges(ops);
  auto ranges = DecodeRanges(encoded);
  ASSERT_TRUE(ranges.ok()) << ranges.status();
  ASSERT_EQ(ranges->size(), 2u);
  EXPECT_EQ((*ranges)[0].region, 7u);
  EXPECT_EQ((*ranges)[0].offset, 4096u);
  EXPECT_EQ((*ranges)[0].length, 512u);
  EXPECT_EQ((*ranges)[1].offset, ~uint64_t{0});

  auto truncated = encoded;
  truncated.pop_back();
  EXPECT_EQ(DecodeRanges(truncated).status().code(),
            absl::StatusCode::kDataLoss);
  auto longer = encoded;
  longer.push_back(std::byte{0});
  EXPECT_EQ(DecodeRanges(longer).status().code(), absl::StatusCode::kDataLoss);
  auto padded = encoded;
  padded[4 + 4] = std::byte{1};  // The first range's reserved word.
  EXPECT_EQ(DecodeRanges(padded).status().code(), absl::StatusCode::kDataLoss);
  auto lying = encoded;  // Claims more ranges than it carries.
  const uint32_t many = kMaxOpsPerFrame + 1;
  std::memcpy(lying.data(), &many, 4);
  EXPECT_EQ(DecodeRanges(lying).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(DecodeRanges({}).status().code(), absl::StatusCode::kDataLoss);
}

TEST(ControlPayloadTest, RepliesCarryThePeersStatus) {
  ControlFrame f;
  f.type = ControlType::kGrant;
  EXPECT_TRUE(CheckReply(f, ControlType::kGrant).ok());
  EXPECT_EQ(CheckReply(f, ControlType::kAck).code(),
            absl::StatusCode::kDataLoss);
  f.type = ControlType::kError;
  f.value = static_cast<uint32_t>(absl::StatusCode::kOutOfRange);
  f.payload = Bytes("range [1020, +16) outside region 1 of 1024 bytes");
  const absl::Status s = CheckReply(f, ControlType::kGrant);
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange);
  EXPECT_NE(s.message().find("outside region 1"), std::string_view::npos);
  f.value = 0;  // An "OK" error is not OK.
  EXPECT_EQ(CheckReply(f, ControlType::kGrant).code(),
            absl::StatusCode::kUnknown);
  f.value = 99;
  EXPECT_EQ(CheckReply(f, ControlType::kGrant).code(),
            absl::StatusCode::kUnknown);
}

TEST(UnixEndpointTest, PathsAndAbstractNamesOnly) {
  EXPECT_TRUE(ParseUnixEndpoint("unix:/run/pdserve/kv.sock").ok());
  auto abstract = ParseUnixEndpoint("unix:@pdserve-kv-1");
  ASSERT_TRUE(abstract.ok());
  EXPECT_EQ(abstract->addr.sun_path[0], '\0');
  for (std::string_view bad : std::initializer_list<std::string_view>{
           "", "unix:", "unix:@", "unix:relative/path", "/run/kv.sock",
           "127.0.0.1:5000", "tcp:/x", std::string_view("unix:/a\0b", 9)}) {
    EXPECT_EQ(ParseUnixEndpoint(bad).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  const std::string too_long = "unix:/" + std::string(200, 'x');
  EXPECT_EQ(ParseUnixEndpoint(too_long).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      ConnectUnix("unix:@pdserve-test-nobody-listens", absl::Milliseconds(100))
          .status()
          .code(),
      absl::StatusCode::kUnavailable);
}

// Both ends of a TCP control connection send small frames at once: with
// Nagle's algorithm on the accepted end, a reply written in two pieces
// waited for the peer's delayed ACK, 40 ms per nccl write on an H100.
TEST(SocketIoTest, AcceptedTcpConnectionsHaveNoDelayAndUnixOnesWork) {
  auto listener = ListenTcp("127.0.0.1:0");
  ASSERT_TRUE(listener.ok()) << listener.status();
  auto client = ConnectTcp(listener->second, absl::Seconds(2));
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_EQ(WaitFor(listener->first.get(), POLLIN,
                    absl::Now() + absl::Seconds(2)),
            Io::kOk);
  const Fd accepted = Accept(listener->first.get());
  ASSERT_GE(accepted.get(), 0);
  for (int fd : {client->get(), accepted.get()}) {
    int on = 0;
    socklen_t len = sizeof(on);
    ASSERT_EQ(::getsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, &len), 0);
    EXPECT_NE(on, 0) << (fd == accepted.get() ? "accepted" : "connected");
  }

  const std::string endpoint = absl::StrCat("unix:@pdserve-accept-", getpid());
  auto unix_listener = ListenUnix(endpoint);
  ASSERT_TRUE(unix_listener.ok()) << unix_listener.status();
  auto unix_client = ConnectUnix(endpoint, absl::Seconds(2));
  ASSERT_TRUE(unix_client.ok()) << unix_client.status();
  ASSERT_EQ(WaitFor(unix_listener->get(), POLLIN,
                    absl::Now() + absl::Seconds(2)),
            Io::kOk);
  EXPECT_GE(Accept(unix_listener->get()).get(), 0);
}

TEST(ControlServerTest, AnswersAMalformedFrameWithAnErrorAndCloses) {
  const std::string endpoint =
      "unix:@pdserve-control-test-" + std::to_string(::getpid());
  auto listener = ListenUnix(endpoint);
  ASSERT_TRUE(listener.ok()) << listener.status();
  EXPECT_EQ(ListenUnix(endpoint).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ControlServer server(
      *std::move(listener), {}, [](const ControlServer& server, Fd fd) {
        ControlFrame frame;
        while (true) {
          absl::Status s =
              server.NextFrame(fd.get(), kMaxMessage, absl::Seconds(1), frame);
          if (s.ok()) {
            s = SendControl(fd.get(), ControlType::kAck, 0, {},
                            absl::Now() + absl::Seconds(1));
          }
          if (!s.ok()) {
            server.Refuse(fd.get(), s, kMaxMessage, absl::Seconds(1));
            return;
          }
        }
      });
  auto fd = ConnectUnix(endpoint, absl::Seconds(1));
  ASSERT_TRUE(fd.ok()) << fd.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  ASSERT_TRUE(
      SendControl(fd->get(), ControlType::kNotify, 0, Bytes("x"), deadline)
          .ok());
  ControlFrame reply;
  ASSERT_TRUE(RecvControl(fd->get(), kMaxMessage, deadline, reply).ok());
  EXPECT_TRUE(CheckReply(reply, ControlType::kAck).ok());
  // Garbage where a header belongs, then more garbage the server drains.
  std::vector<std::byte> junk(kControlHeaderBytes + 4096, std::byte{0x41});
  ASSERT_EQ(SendAll(fd->get(), junk.data(), junk.size(), deadline), Io::kOk);
  ASSERT_TRUE(RecvControl(fd->get(), kMaxMessage, deadline, reply).ok());
  EXPECT_EQ(CheckReply(reply, ControlType::kAck).code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(RecvControl(fd->get(), kMaxMessage, deadline, reply).code(),
            absl::StatusCode::kUnavailable);
}

bool Built(const std::string& name) {
  const auto names = AvailableKvTransports();
  return std::find(names.begin(), names.end(), name) != names.end();
}

TEST(DeviceTransportRegistryTest, NamedAndRefusedWithoutADevice) {
  for (const std::string name : {"cuda_ipc", "nccl"}) {
    auto t = CreateKvTransport(name, {});
    if (!Built(name)) {
      EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound) << name;
      continue;
    }
    if (t.ok()) {
      GTEST_SKIP() << "a CUDA device is present: gpu_transport_test covers "
                   << name;
    }
    EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition)
        << name << ": " << t.status();
    EXPECT_NE(t.status().message().find(name), std::string_view::npos)
        << t.status();
  }
  // Close names are not these transports.
  for (std::string_view near : {"cuda-ipc", "cuda_ipc:x", "NCCL", "nccl:ib"}) {
    EXPECT_EQ(CreateKvTransport(near, {}).status().code(),
              absl::StatusCode::kNotFound)
        << near;
  }
}

}  // namespace
}  // namespace pdserve::kv
