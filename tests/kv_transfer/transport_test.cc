// The conformance suite every KV transport passes: byte-exact transfer of
// scattered block sets, notifications after their writes, refused ranges,
// and a peer that goes away.
#include "kv_transfer/transport.h"

#include <random>
#include <thread>

#include "gtest/gtest.h"

namespace pdserve::kv {
namespace {

TransportOptions SmallLimits() {
  TransportOptions o;
  o.max_frame_bytes = 4096;  // Forces multi-frame writes.
  o.io_timeout = absl::Seconds(5);
  return o;
}

class TransportTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    auto a = CreateKvTransport(GetParam(), SmallLimits());
    auto b = CreateKvTransport(GetParam(), SmallLimits());
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    sender_ = *std::move(a);
    receiver_ = *std::move(b);
  }
  std::unique_ptr<KvTransport> sender_, receiver_;
};

TEST_P(TransportTest, ScatteredBlocksArriveByteExactBeforeTheirNotification) {
  // A "KV pool" of 64 blocks x 4 layers on each side; blocks land at other ids.
  constexpr size_t kBlock = 3000, kBlocks = 64, kLayers = 4;
  std::vector<std::byte> src(kBlock * kBlocks * kLayers), dst(src.size(), std::byte{0});
  std::mt19937 rng(1);
  for (auto& b : src) b = static_cast<std::byte>(rng());
  auto local = sender_->RegisterMemory(src);
  auto remote = receiver_->RegisterMemory(dst);
  ASSERT_TRUE(local.ok() && remote.ok());
  auto conn = sender_->Connect(receiver_->endpoint());
  ASSERT_TRUE(conn.ok()) << conn.status();

  std::vector<std::pair<size_t, size_t>> moved;  // (source block, destination block)
  for (size_t i = 0; i < 20; ++i) moved.push_back({(i * 7 + 3) % kBlocks, (i * 13 + 5) % kBlocks});
  for (size_t layer = 0; layer < kLayers; ++layer) {
    std::vector<WriteOp> ops;
    for (auto [s, d] : moved) {
      ops.push_back({*local, (layer * kBlocks + s) * kBlock, *remote, (layer * kBlocks + d) * kBlock, kBlock});
    }
    ASSERT_TRUE((*conn)->Write(ops).ok());
    ASSERT_TRUE((*conn)->Notify("layer " + std::to_string(layer)).ok());
  }
  for (size_t layer = 0; layer < kLayers; ++layer) {
    auto n = receiver_->WaitNotification(absl::Seconds(5));
    ASSERT_TRUE(n.ok()) << n.status();
    EXPECT_EQ(n->message, "layer " + std::to_string(layer));  // In order.
  }
  std::vector<bool> written(kBlocks * kLayers, false);
  for (size_t layer = 0; layer < kLayers; ++layer) {
    for (auto [s, d] : moved) {
      written[layer * kBlocks + d] = true;
      EXPECT_EQ(0, std::memcmp(&dst[(layer * kBlocks + d) * kBlock], &src[(layer * kBlocks + s) * kBlock], kBlock))
          << "layer " << layer << " block " << d;
    }
  }
  for (size_t b = 0; b < written.size(); ++b) {
    if (!written[b]) EXPECT_EQ(dst[b * kBlock], std::byte{0}) << "untouched block " << b;
  }
  EXPECT_EQ(receiver_->WaitNotification(absl::Milliseconds(50)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST_P(TransportTest, RefusedRangesNameTheProblemAndWriteNothing) {
  std::vector<std::byte> src(1024, std::byte{7}), dst(1024, std::byte{0});
  auto local = sender_->RegisterMemory(src);
  auto remote = receiver_->RegisterMemory(dst);
  ASSERT_TRUE(local.ok() && remote.ok());
  auto conn = sender_->Connect(receiver_->endpoint());
  ASSERT_TRUE(conn.ok());
  // A bad local range is caught before anything is sent; the connection stays usable.
  const WriteOp bad_local{*local, 1000, *remote, 0, 100};
  EXPECT_EQ((*conn)->Write({&bad_local, 1}).code(), absl::StatusCode::kInvalidArgument);
  const WriteOp ok{*local, 0, *remote, 0, 16};
  EXPECT_TRUE((*conn)->Write({&ok, 1}).ok());
  // The peer refuses an unknown region and an out-of-range offset.
  const WriteOp unknown{*local, 0, RegionId(remote->value + 99), 0, 16};
  auto s = (*conn)->Write({&unknown, 1});
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  auto conn2 = sender_->Connect(receiver_->endpoint());
  ASSERT_TRUE(conn2.ok());
  const WriteOp outside{*local, 0, *remote, 1020, 16};
  s = (*conn2)->Write({&outside, 1});
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
  const WriteOp overflow{*local, 0, *remote, ~uint64_t{0} - 4, 16};
  auto conn3 = sender_->Connect(receiver_->endpoint());
  ASSERT_TRUE(conn3.ok());
  EXPECT_EQ((*conn3)->Write({&overflow, 1}).code(), absl::StatusCode::kOutOfRange);
  for (size_t i = 16; i < dst.size(); ++i) ASSERT_EQ(dst[i], std::byte{0}) << i;
  // A message over the limit is refused before it is sent.
  auto conn4 = sender_->Connect(receiver_->endpoint());
  ASSERT_TRUE(conn4.ok());
  EXPECT_EQ((*conn4)->Notify(std::string(SmallLimits().max_message_bytes + 1, 'x')).code(),
            absl::StatusCode::kResourceExhausted);
}

TEST_P(TransportTest, PeerThatGoesAwayIsUnavailable) {
  std::vector<std::byte> src(1 << 16), dst(1 << 16);
  auto local = sender_->RegisterMemory(src);
  auto remote = receiver_->RegisterMemory(dst);
  ASSERT_TRUE(local.ok() && remote.ok());
  auto conn = sender_->Connect(receiver_->endpoint());
  ASSERT_TRUE(conn.ok());
  const std::string endpoint = receiver_->endpoint();
  receiver_.reset();
  const WriteOp op{*local, 0, *remote, 0, src.size()};
  const absl::Status s = (*conn)->Write({&op, 1});
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_TRUE(absl::IsUnavailable((*conn)->Notify("x"))) << "stays closed";
  auto again = sender_->Connect(endpoint);
  EXPECT_FALSE(again.ok());
}

TEST_P(TransportTest, NotificationQueueIsBounded) {
  TransportOptions o = SmallLimits();
  o.max_pending_notifications = 3;
  auto receiver = CreateKvTransport(GetParam(), o);
  ASSERT_TRUE(receiver.ok());
  auto conn = sender_->Connect((*receiver)->endpoint());
  ASSERT_TRUE(conn.ok());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE((*conn)->Notify("n").ok());
  EXPECT_EQ((*conn)->Notify("n").code(), absl::StatusCode::kResourceExhausted);
}

// Every transport built into this binary ("ucx" alone takes UCX_TLS from
// the environment, so the suite pins both UCX modes explicitly).
std::string TestName(const ::testing::TestParamInfo<std::string>& info) {
  std::string name = info.param;
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return name;
}

INSTANTIATE_TEST_SUITE_P(Transports, TransportTest, ::testing::ValuesIn(AvailableKvTransports()),
                         TestName);

TEST(TransportRegistryTest, UnknownTransportAndBadOptions) {
  EXPECT_EQ(CreateKvTransport("carrier-pigeon", {}).status().code(), absl::StatusCode::kNotFound);
  TransportOptions o;
  o.max_frame_bytes = 0;
  EXPECT_EQ(CreateKvTransport("tcp", o).status().code(), absl::StatusCode::kInvalidArgument);
  o = {};
  o.listen_address = "no-port";
  EXPECT_FALSE(CreateKvTransport("tcp", o).ok());
}

}  // namespace
}  // namespace pdserve::kv
