// The TCP receiver against a hostile or broken sender speaking raw bytes:
// truncated, corrupt and oversized frames, a stalled frame, and a sender
// facing a receiver that never answers. Nothing may crash, hang, allocate
// without bound or touch registered memory.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kv_transfer/tcp_frame.h"
#include "kv_transfer/transport.h"

namespace pdserve::kv {
namespace {

int Dial(const std::string& endpoint) {
  const size_t colon = endpoint.rfind(':');
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(std::stoi(endpoint.substr(colon + 1))));
  inet_pton(AF_INET, endpoint.substr(0, colon).c_str(), &addr.sin_addr);
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  timeval tv{5, 0};  // No test may hang on a read.
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

void SendBytes(int fd, const void* data, size_t len) {
  ASSERT_EQ(::send(fd, data, len, MSG_NOSIGNAL), static_cast<ssize_t>(len));
}

void SendHeader(int fd, FrameHeader h) {
  std::byte raw[kFrameHeaderBytes];
  EncodeFrameHeader(h, raw);
  SendBytes(fd, raw, sizeof(raw));
}

std::vector<std::byte> Table(const std::vector<WriteSegment>& segments) {
  std::vector<std::byte> table(segments.size() * kSegmentBytes);
  for (size_t i = 0; i < segments.size(); ++i) EncodeSegment(segments[i], table.data() + i * kSegmentBytes);
  return table;
}

// A WRITE frame's header and segment table (`data` payload bytes to follow);
// its checksum is `crc`.
void SendWriteHead(int fd, uint32_t region, const std::vector<WriteSegment>& segments, size_t data, uint32_t crc) {
  const std::vector<std::byte> table = Table(segments);
  SendHeader(fd, {.type = FrameType::kWrite,
                  .region = region,
                  .length = static_cast<uint32_t>(table.size() + data),
                  .segments = static_cast<uint32_t>(segments.size()),
                  .crc = crc});
  SendBytes(fd, table.data(), table.size());
}

// The checksum a WRITE frame of `segments` carrying `payload` should have.
uint32_t WriteCrc(const std::vector<WriteSegment>& segments, std::span<const std::byte> payload) {
  return Crc32c(payload, Crc32c(Table(segments)));
}

// Reads the receiver's reply frame: its type and, for ERROR, the code.
std::pair<FrameType, absl::StatusCode> ReadReply(int fd) {
  std::byte raw[kFrameHeaderBytes];
  size_t got = 0;
  while (got < sizeof(raw)) {
    const ssize_t n = ::recv(fd, raw + got, sizeof(raw) - got, 0);
    if (n <= 0) return {FrameType::kWrite, absl::StatusCode::kUnavailable};  // Closed.
    got += static_cast<size_t>(n);
  }
  FrameHeader h;
  EXPECT_TRUE(DecodeFrameHeader(raw, h));
  std::vector<char> message(h.length);  // Consume the error text.
  for (size_t read = 0; read < message.size();) {
    const ssize_t n = ::recv(fd, message.data() + read, message.size() - read, 0);
    if (n <= 0) break;
    read += static_cast<size_t>(n);
  }
  return {h.type, static_cast<absl::StatusCode>(h.region)};
}

// A loopback listener (backlog 1) and the endpoint that dials it.
std::pair<int, std::string> Listen() {
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  EXPECT_EQ(::listen(listener, 1), 0);
  socklen_t len = sizeof(addr);
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
  return {listener, "127.0.0.1:" + std::to_string(ntohs(addr.sin_port))};
}

bool ClosedByPeer(int fd) {
  char c;
  return ::recv(fd, &c, 1, 0) == 0;
}

class TcpWireTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TransportOptions o;
    o.max_frame_bytes = 1024;
    o.io_timeout = absl::Milliseconds(300);
    auto t = CreateKvTransport("tcp", o);
    ASSERT_TRUE(t.ok()) << t.status();
    receiver_ = *std::move(t);
    auto r = receiver_->RegisterMemory(memory_);
    ASSERT_TRUE(r.ok());
    region_ = *r;
  }

  // The receiver still serves a well-behaved sender, and `memory_` past
  // `landing_end` is untouched by what came before. (A refused write frame
  // may have partly landed inside its own checked range: the transfer
  // failed, so nothing reads those bytes.)
  void ExpectHealthyAndUntouched(size_t landing_end = 0) {
    for (size_t i = landing_end; i < memory_.size(); ++i) ASSERT_EQ(memory_[i], std::byte{0}) << i;
    auto sender = CreateKvTransport("tcp", {});
    ASSERT_TRUE(sender.ok());
    std::vector<std::byte> src(16, std::byte{9});
    auto local = (*sender)->RegisterMemory(src);
    ASSERT_TRUE(local.ok());
    auto conn = (*sender)->Connect(receiver_->endpoint());
    ASSERT_TRUE(conn.ok());
    const WriteOp op{*local, 0, region_, 100, 16};
    ASSERT_TRUE((*conn)->Write({&op, 1}).ok());
    EXPECT_EQ(memory_[100], std::byte{9});
  }

  std::vector<std::byte> memory_ = std::vector<std::byte>(4096, std::byte{0});
  std::unique_ptr<KvTransport> receiver_;
  RegionId region_;
};

TEST_F(TcpWireTest, TruncatedHeaderThenCloseIsIgnored) {
  const int fd = Dial(receiver_->endpoint());
  const char partial[10] = {};
  SendBytes(fd, partial, sizeof(partial));
  ::close(fd);
  ExpectHealthyAndUntouched();
}

TEST_F(TcpWireTest, BadMagicIsRefused) {
  const int fd = Dial(receiver_->endpoint());
  std::byte raw[kFrameHeaderBytes] = {};
  SendBytes(fd, raw, sizeof(raw));
  EXPECT_EQ(ReadReply(fd), std::pair(FrameType::kError, absl::StatusCode::kDataLoss));
  EXPECT_TRUE(ClosedByPeer(fd));
  ::close(fd);
  ExpectHealthyAndUntouched();
}

TEST_F(TcpWireTest, APeerOfTheOlderFormatIsToldToUpgrade) {
  const int fd = Dial(receiver_->endpoint());
  std::byte raw[kFrameHeaderBytes] = {};
  StoreWire<uint32_t>(raw, 0, kFrameMagicV1);
  StoreWire<uint8_t>(raw, 4, 1);  // Its WRITE.
  SendBytes(fd, raw, sizeof(raw));
  EXPECT_EQ(ReadReply(fd), std::pair(FrameType::kError, absl::StatusCode::kFailedPrecondition));
  ::close(fd);
  ExpectHealthyAndUntouched();
}

TEST_F(TcpWireTest, ASenderFacingAnOlderReceiverIsToldToUpgrade) {
  // A receiver of the older format refuses the first frame with an ERROR
  // of its own format.
  const auto [listener, endpoint] = Listen();
  std::thread old_receiver([listener] {
    const int fd = ::accept(listener, nullptr, nullptr);
    std::byte raw[kFrameHeaderBytes] = {};
    StoreWire<uint32_t>(raw, 0, kFrameMagicV1);
    StoreWire<uint8_t>(raw, 4, static_cast<uint8_t>(FrameType::kError));
    StoreWire<uint32_t>(raw, 8, static_cast<uint32_t>(absl::StatusCode::kDataLoss));
    ::send(fd, raw, sizeof(raw), MSG_NOSIGNAL);
    ::shutdown(fd, SHUT_WR);
    char sink[4096];
    while (::recv(fd, sink, sizeof(sink), 0) > 0) {
    }
    ::close(fd);
  });
  auto sender = CreateKvTransport("tcp", {});
  ASSERT_TRUE(sender.ok());
  std::vector<std::byte> src(64);
  auto local = (*sender)->RegisterMemory(src);
  ASSERT_TRUE(local.ok());
  auto conn = (*sender)->Connect(endpoint);
  ASSERT_TRUE(conn.ok()) << conn.status();
  const WriteOp op{*local, 0, RegionId(1), 0, src.size()};
  const absl::Status s = (*conn)->Write({&op, 1});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("upgrade"), std::string_view::npos) << s;
  old_receiver.join();
  ::close(listener);
}

TEST_F(TcpWireTest, OversizedFrameIsRefusedBeforeItsPayload) {
  const int fd = Dial(receiver_->endpoint());
  SendHeader(fd, {.type = FrameType::kWrite, .region = region_.value, .length = 0xFFFFFFF0u, .segments = 1});  // ~4 GiB.
  EXPECT_EQ(ReadReply(fd), std::pair(FrameType::kError, absl::StatusCode::kResourceExhausted));
  ::close(fd);
  ExpectHealthyAndUntouched();
}

// Every receiver takes frames of up to kMaxWritePayloadBytes, whatever
// frame size it sends itself (this one's is 1 KiB): a worker of another
// release, sending larger frames, still delivers to it. A byte more is
// refused before its payload.
TEST_F(TcpWireTest, FramesUpToTheWireLimitLandWhateverFrameSizeTheReceiverSends) {
  std::vector<std::byte> big(kMaxWritePayloadBytes, std::byte{0});
  auto region = receiver_->RegisterMemory(big);
  ASSERT_TRUE(region.ok());
  TransportOptions o;
  o.max_frame_bytes = kMaxWritePayloadBytes;  // One frame for the whole write.
  auto sender = CreateKvTransport("tcp", o);
  ASSERT_TRUE(sender.ok()) << sender.status();
  std::vector<std::byte> src(kMaxWritePayloadBytes, std::byte{7});
  auto local = (*sender)->RegisterMemory(src);
  ASSERT_TRUE(local.ok());
  auto conn = (*sender)->Connect(receiver_->endpoint());
  ASSERT_TRUE(conn.ok()) << conn.status();
  const WriteOp op{*local, 0, *region, 0, src.size()};
  const absl::Status s = (*conn)->Write({&op, 1});
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(big == src);

  const int fd = Dial(receiver_->endpoint());
  SendWriteHead(fd, region->value, {{0, kMaxWritePayloadBytes + 1}}, kMaxWritePayloadBytes + 1, 0);
  EXPECT_EQ(ReadReply(fd), std::pair(FrameType::kError, absl::StatusCode::kResourceExhausted));
  ::close(fd);
  ASSERT_TRUE(receiver_->DeregisterMemory(*region).ok());
  ExpectHealthyAndUntouched();
}

TEST(TcpTransportOptionsTest, FramesLargerThanReceiversAcceptAreInvalid) {
  TransportOptions o;
  o.max_frame_bytes = kMaxWritePayloadBytes + 1;
  const auto t = CreateKvTransport("tcp", o);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
}

TEST_F(TcpWireTest, CorruptPayloadIsRefusedAndStaysInItsRange) {
  const int fd = Dial(receiver_->endpoint());
  std::vector<std::byte> payload(64, std::byte{5});
  const std::vector<WriteSegment> segments = {{0, 64}};
  const uint32_t crc = WriteCrc(segments, payload);
  payload[10] = std::byte{6};  // Flipped in flight.
  SendWriteHead(fd, region_.value, segments, payload.size(), crc);
  SendBytes(fd, payload.data(), payload.size());
  EXPECT_EQ(ReadReply(fd), std::pair(FrameType::kError, absl::StatusCode::kDataLoss));
  ::close(fd);
  ExpectHealthyAndUntouched(/*landing_end=*/64);
}

TEST_F(TcpWireTest, SegmentsOfOneFrameLandWhereTheirTableSays) {
  const int fd = Dial(receiver_->endpoint());
  std::vector<std::byte> payload(100);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<std::byte>(i + 1);
  // Out of order, the last one ending where the range check ends.
  const std::vector<WriteSegment> segments = {{3000, 40}, {8, 50}, {4086, 10}};
  SendWriteHead(fd, region_.value, segments, payload.size(), WriteCrc(segments, payload));
  SendBytes(fd, payload.data(), payload.size());
  SendHeader(fd, {.type = FrameType::kSync});
  EXPECT_EQ(ReadReply(fd).first, FrameType::kAck);
  EXPECT_EQ(0, std::memcmp(&memory_[3000], &payload[0], 40));
  EXPECT_EQ(0, std::memcmp(&memory_[8], &payload[40], 50));
  EXPECT_EQ(0, std::memcmp(&memory_[4086], &payload[90], 10));
  for (size_t i = 0; i < memory_.size(); ++i) {
    const bool written = (i >= 3000 && i < 3040) || (i >= 8 && i < 58) || i >= 4086;
    if (!written) {
      ASSERT_EQ(memory_[i], std::byte{0}) << i;
    }
  }
  ::close(fd);
}

TEST_F(TcpWireTest, MalformedSegmentTablesAreRefusedBeforeAnyPayload) {
  struct Case {
    const char* what;
    std::vector<WriteSegment> segments;
    size_t data;  // Payload bytes the header announces.
    absl::StatusCode code;
  };
  const std::vector<Case> cases = {
      {"an empty segment", {{0, 16}, {100, 0}}, 16, absl::StatusCode::kDataLoss},
      {"segments longer than the payload", {{0, 16}, {100, 16}}, 24, absl::StatusCode::kDataLoss},
      {"segments shorter than the payload", {{0, 16}}, 24, absl::StatusCode::kDataLoss},
      {"a segment past the region", {{0, 16}, {4090, 16}}, 32, absl::StatusCode::kOutOfRange},
      {"a segment past 2^64", {{0, 16}, {~uint64_t{0} - 4, 16}}, 32, absl::StatusCode::kOutOfRange},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const int fd = Dial(receiver_->endpoint());
    SendWriteHead(fd, region_.value, c.segments, c.data, 0);
    EXPECT_EQ(ReadReply(fd), std::pair(FrameType::kError, c.code));
    ::close(fd);
  }
  // A table the header's length cannot hold, and segment counts out of
  // bounds (a malformed header).
  for (const auto& [length, segments] : {std::pair<uint32_t, uint32_t>{16, 2}, {0, 0}, {16 * 257, 257}}) {
    const int fd = Dial(receiver_->endpoint());
    SendHeader(fd, {.type = FrameType::kWrite, .region = region_.value, .length = length, .segments = segments});
    EXPECT_EQ(ReadReply(fd), std::pair(FrameType::kError, absl::StatusCode::kDataLoss)) << segments;
    ::close(fd);
  }
  ExpectHealthyAndUntouched();
}

TEST_F(TcpWireTest, StalledFrameTimesOutWithinItsRange) {
  const int fd = Dial(receiver_->endpoint());
  std::vector<std::byte> payload(512, std::byte{5});
  const std::vector<WriteSegment> segments = {{0, 512}};
  SendWriteHead(fd, region_.value, segments, payload.size(), WriteCrc(segments, payload));
  SendBytes(fd, payload.data(), 100);  // ...and nothing more.
  const auto start = absl::Now();
  EXPECT_TRUE(ClosedByPeer(fd));  // After io_timeout (300 ms).
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  ::close(fd);
  ExpectHealthyAndUntouched(/*landing_end=*/512);
}

TEST_F(TcpWireTest, SenderGivesUpOnAReceiverThatNeverAnswers) {
  // A listener that accepts and then reads nothing.
  const auto [listener, endpoint] = Listen();

  TransportOptions o;
  o.io_timeout = absl::Milliseconds(300);
  auto sender = CreateKvTransport("tcp", o);
  ASSERT_TRUE(sender.ok());
  std::vector<std::byte> src(16 << 20);  // More than the socket buffers hold.
  auto local = (*sender)->RegisterMemory(src);
  ASSERT_TRUE(local.ok());
  auto conn = (*sender)->Connect(endpoint);
  ASSERT_TRUE(conn.ok()) << conn.status();
  const auto start = absl::Now();
  const WriteOp op{*local, 0, RegionId(1), 0, src.size()};
  const absl::Status s = (*conn)->Write({&op, 1});
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  ::close(listener);
}

TEST(Crc32cTest, KnownValue) {
  const std::string check = "123456789";  // The standard check input.
  const auto bytes = std::as_bytes(std::span(check.data(), check.size()));
  EXPECT_EQ(Crc32c(bytes), 0xE3069283u);
  EXPECT_EQ(Crc32c(bytes.subspan(4), Crc32c(bytes.first(4))), 0xE3069283u);  // Continued.
  EXPECT_EQ(Crc32c({}), 0u);
}

// The iSCSI specification's CRC examples (RFC 3720, B.4): 32 bytes each.
TEST(Crc32cTest, Rfc3720Examples) {
  std::vector<std::byte> zeros(32, std::byte{0}), ones(32, std::byte{0xFF}), up(32), down(32);
  for (int i = 0; i < 32; ++i) {
    up[i] = std::byte(i);
    down[i] = std::byte(31 - i);
  }
  EXPECT_EQ(Crc32c(zeros), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(ones), 0x62A8AB43u);
  EXPECT_EQ(Crc32c(up), 0x46DD794Eu);
  EXPECT_EQ(Crc32c(down), 0x113FDB5Cu);
}

// The polynomial's definition, one bit at a time (reflected 0x82F63B78).
uint32_t BitwiseCrc32c(std::span<const std::byte> data) {
  uint32_t crc = 0xFFFFFFFFu;
  for (std::byte b : data) {
    crc ^= static_cast<uint8_t>(b);
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
  }
  return ~crc;
}

// Every length up to 1100 bytes and longer ones, at every alignment mod 8,
// whole and continued from a split: the library's short, folded and tail
// paths all meet the definition.
TEST(Crc32cTest, MatchesTheDefinitionAtEveryLengthAndAlignment) {
  std::vector<std::byte> buf(70000);
  uint32_t x = 12345;
  for (std::byte& b : buf) b = std::byte((x = x * 1103515245u + 12345u) >> 24);
  std::vector<size_t> lengths;
  for (size_t n = 0; n <= 1100; ++n) lengths.push_back(n);
  for (size_t n : {4095, 4096, 4097, 65535, 65536, 65537}) lengths.push_back(n);
  for (size_t n : lengths) {
    for (size_t align = 0; align < 8; ++align) {
      const auto data = std::span<const std::byte>(buf).subspan(align, n);
      const uint32_t want = BitwiseCrc32c(data);
      ASSERT_EQ(Crc32c(data), want) << "length " << n << ", offset " << align;
      const size_t cut = n / 3;
      ASSERT_EQ(Crc32c(data.subspan(cut), Crc32c(data.first(cut))), want) << "length " << n;
    }
  }
}

}  // namespace
}  // namespace pdserve::kv
