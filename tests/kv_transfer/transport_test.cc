// The conformance suite every KV transport passes: byte-exact transfer of
// scattered block sets, notifications after their writes, refused ranges,
// regions that come and go, and a peer that goes away. The cross-process
// half runs the receiver in its own process (kv-transfer-peer) and stops
// or kills it mid-transfer.
#include "kv_transfer/transport.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstring>
#include <numeric>
#include <random>
#include <sstream>
#include <thread>

#include "gtest/gtest.h"
#include "kv_transfer/tcp_frame.h"
#include "tests/kv_transfer/peer_process.h"
#include "tests/kv_transfer/transport_names.h"

// UCX 1.13 leaks a shared-memory endpoint whose creation fails (the peer
// is gone): uct_mm_ep_t_new's error path. Its allocations are seen only as
// far as UCX's own allocator (UCX has no frame pointers), so everything
// UCX allocates for itself is left out; nothing of ours is.
extern "C" const char* __lsan_default_suppressions() {
  return "leak:uct_mm_ep_t_new\nleak:libuct.so\nleak:ucs_malloc\n";
}

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

  // `src` filled from `rng` and registered with the sender, `dst` with the
  // receiver, and a connection between them.
  struct Wired {
    RegionId local, remote;
    std::unique_ptr<KvConnection> conn;
  };
  void Wire(std::vector<std::byte>& src, std::vector<std::byte>& dst, std::mt19937& rng, Wired& out) {
    for (auto& b : src) b = static_cast<std::byte>(rng());
    auto local = sender_->RegisterMemory(src);
    auto remote = receiver_->RegisterMemory(dst);
    ASSERT_TRUE(local.ok() && remote.ok());
    auto conn = sender_->Connect(receiver_->endpoint());
    ASSERT_TRUE(conn.ok()) << conn.status();
    out = {*local, *remote, *std::move(conn)};
  }

  std::unique_ptr<KvTransport> sender_, receiver_;
};

TEST_P(TransportTest, ScatteredBlocksArriveByteExactBeforeTheirNotification) {
  // A "KV pool" of 64 blocks x 4 layers on each side; blocks land at other ids.
  constexpr size_t kBlock = 3000, kBlocks = 64, kLayers = 4;
  std::vector<std::byte> src(kBlock * kBlocks * kLayers),
      dst(src.size(), std::byte{0});
  std::mt19937 rng(1);
  Wired w;
  ASSERT_NO_FATAL_FAILURE(Wire(src, dst, rng, w));

  std::vector<std::pair<size_t, size_t>>
      moved;  // (source block, destination block)
  for (size_t i = 0; i < 20; ++i)
    moved.push_back({(i * 7 + 3) % kBlocks, (i * 13 + 5) % kBlocks});
  for (size_t layer = 0; layer < kLayers; ++layer) {
    std::vector<WriteOp> ops;
    for (auto [s, d] : moved) {
      ops.push_back({w.local, (layer * kBlocks + s) * kBlock, w.remote,
                     (layer * kBlocks + d) * kBlock, kBlock});
    }
    ASSERT_TRUE(w.conn->Write(ops).ok());
    ASSERT_TRUE(w.conn->Notify("layer " + std::to_string(layer)).ok());
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
      EXPECT_EQ(0, std::memcmp(&dst[(layer * kBlocks + d) * kBlock],
                               &src[(layer * kBlocks + s) * kBlock], kBlock))
          << "layer " << layer << " block " << d;
    }
  }
  for (size_t b = 0; b < written.size(); ++b) {
    if (!written[b]) {
      EXPECT_EQ(dst[b * kBlock], std::byte{0}) << "untouched block " << b;
    }
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
  // A bad local range is caught before anything is sent; the connection stays
  // usable.
  const WriteOp bad_local{*local, 1000, *remote, 0, 100};
  EXPECT_EQ((*conn)->Write({&bad_local, 1}).code(),
            absl::StatusCode::kInvalidArgument);
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
  EXPECT_EQ((*conn3)->Write({&overflow, 1}).code(),
            absl::StatusCode::kOutOfRange);
  for (size_t i = 16; i < dst.size(); ++i) ASSERT_EQ(dst[i], std::byte{0}) << i;
  // A message over the limit is refused before it is sent.
  auto conn4 = sender_->Connect(receiver_->endpoint());
  ASSERT_TRUE(conn4.ok());
  EXPECT_EQ((*conn4)
                ->Notify(std::string(SmallLimits().max_message_bytes + 1, 'x'))
                .code(),
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

TEST_P(TransportTest, RandomBlockSetsOverManyLayersArriveByteExact) {
  // 32 layers of a 96-block pool; every post carries a random, non-contiguous
  // set of blocks (some of them two adjacent blocks in one op), each landing
  // at a random free block of the peer.
  constexpr size_t kBlock = 1536, kBlocks = 96, kLayers = 32;
  std::vector<std::byte> src(kBlock * kBlocks * kLayers),
      dst(src.size(), std::byte{0});
  std::mt19937 rng(7);
  Wired w;
  ASSERT_NO_FATAL_FAILURE(Wire(src, dst, rng, w));
  std::vector<size_t> order(kBlocks);
  std::iota(order.begin(), order.end(), 0);
  std::vector<uint8_t> expected_owner(kBlocks * kLayers, 0);  // 1: written.
  std::vector<std::pair<size_t, size_t>> landed;  // (dst byte, src byte)
  for (size_t layer = 0; layer < kLayers; ++layer) {
    std::shuffle(order.begin(), order.end(), rng);
    const size_t count = 1 + rng() % 40;
    std::vector<WriteOp> ops;
    for (size_t i = 0; i + 1 < count * 2 && i + 1 < kBlocks; i += 2) {
      const size_t s = order[i], d = order[i + 1];
      const size_t len =
          (s + 1 < kBlocks && d + 1 < kBlocks && rng() % 4 == 0) ? 2 : 1;
      const uint64_t so = (layer * kBlocks + s) * kBlock,
                     dof = (layer * kBlocks + d) * kBlock;
      bool clash = false;
      for (size_t k = 0; k < len; ++k)
        clash |= expected_owner[layer * kBlocks + d + k] != 0;
      if (clash) continue;
      for (size_t k = 0; k < len; ++k) {
        expected_owner[layer * kBlocks + d + k] = 1;
        landed.push_back({dof + k * kBlock, so + k * kBlock});
      }
      ops.push_back({w.local, so, w.remote, dof, len * kBlock});
    }
    ASSERT_TRUE(w.conn->Write(ops).ok()) << "layer " << layer;
    ASSERT_TRUE(w.conn->Notify("layer " + std::to_string(layer)).ok());
  }
  for (size_t layer = 0; layer < kLayers; ++layer) {
    auto n = receiver_->WaitNotification(absl::Seconds(5));
    ASSERT_TRUE(n.ok()) << n.status();
    ASSERT_EQ(n->message, "layer " + std::to_string(layer));
  }
  for (auto [d, s] : landed)
    ASSERT_EQ(0, std::memcmp(&dst[d], &src[s], kBlock)) << d;
  for (size_t b = 0; b < expected_owner.size(); ++b) {
    if (expected_owner[b] == 0) {
      ASSERT_TRUE(std::all_of(&dst[b * kBlock], &dst[b * kBlock] + kBlock,
                              [](std::byte x) { return x == std::byte{0}; }))
          << "untouched block " << b;
    }
  }
}

TEST_P(TransportTest, ManySmallOpsOfOnePostArriveByteExact) {
  // More ops in one post than one frame of the tcp transport holds
  // (kMaxWriteSegments), each a 64-byte slot of a scattered block, some
  // empty, landing in reverse order.
  constexpr size_t kSlot = 64, kSlots = 700;
  std::vector<std::byte> src(kSlot * kSlots), dst(src.size(), std::byte{0});
  std::mt19937 rng(3);
  Wired w;
  ASSERT_NO_FATAL_FAILURE(Wire(src, dst, rng, w));
  std::vector<WriteOp> ops;
  for (size_t i = 0; i < kSlots; ++i) {
    ops.push_back({w.local, i * kSlot, w.remote, (kSlots - 1 - i) * kSlot, i % 97 == 5 ? 0 : kSlot});
  }
  ASSERT_TRUE(w.conn->Write(ops).ok());
  for (size_t i = 0; i < kSlots; ++i) {
    const std::byte* landed = &dst[(kSlots - 1 - i) * kSlot];
    if (i % 97 == 5) {
      EXPECT_TRUE(std::all_of(landed, landed + kSlot, [](std::byte x) { return x == std::byte{0}; })) << i;
    } else {
      EXPECT_EQ(0, std::memcmp(landed, &src[i * kSlot], kSlot)) << i;
    }
  }
}

TEST_P(TransportTest, RegionsRegisteredAfterConnectingAndDeregisteredAreSeen) {
  std::vector<std::byte> src(4096, std::byte{5}), first(4096), second(4096);
  auto local = sender_->RegisterMemory(src);
  auto r1 = receiver_->RegisterMemory(first);
  ASSERT_TRUE(local.ok() && r1.ok());
  auto conn = sender_->Connect(receiver_->endpoint());
  ASSERT_TRUE(conn.ok());
  auto r2 = receiver_->RegisterMemory(second);  // After the connection.
  ASSERT_TRUE(r2.ok());
  const WriteOp op{*local, 0, *r2, 100, 200};
  ASSERT_TRUE((*conn)->Write({&op, 1}).ok());
  // Read after the notification, as the decode worker does.
  ASSERT_TRUE((*conn)->Notify("written").ok());
  ASSERT_TRUE(receiver_->WaitNotification(absl::Seconds(5)).ok());
  EXPECT_EQ(second[100], std::byte{5});
  EXPECT_EQ(second[299], std::byte{5});
  EXPECT_EQ(second[300], std::byte{0});
  // Deregistered while the connection holds its key: the next write into
  // it is refused, and nothing lands.
  ASSERT_TRUE(receiver_->DeregisterMemory(*r1).ok());
  const WriteOp stale{*local, 0, *r1, 0, 64};
  EXPECT_EQ((*conn)->Write({&stale, 1}).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(first[0], std::byte{0});
  EXPECT_EQ(receiver_->DeregisterMemory(*r1).code(),
            absl::StatusCode::kNotFound);
  // A deregistered local region is refused before anything is sent.
  auto conn2 = sender_->Connect(receiver_->endpoint());
  ASSERT_TRUE(conn2.ok());
  ASSERT_TRUE(sender_->DeregisterMemory(*local).ok());
  const WriteOp gone{*local, 0, *r2, 0, 64};
  EXPECT_EQ((*conn2)->Write({&gone, 1}).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_P(TransportTest, ConcurrentSendersToOneReceiver) {
  constexpr size_t kSenders = 3, kChunk = 8192, kRounds = 20;
  std::vector<std::byte> dst(kSenders * kChunk);
  auto remote = receiver_->RegisterMemory(dst);
  ASSERT_TRUE(remote.ok());
  std::vector<std::unique_ptr<KvTransport>> senders;
  std::vector<std::vector<std::byte>> srcs(kSenders);
  for (size_t i = 0; i < kSenders; ++i) {
    auto t = CreateKvTransport(GetParam(), SmallLimits());
    ASSERT_TRUE(t.ok());
    senders.push_back(*std::move(t));
    srcs[i].assign(kChunk, static_cast<std::byte>(i + 1));
  }
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (size_t i = 0; i < kSenders; ++i) {
    threads.emplace_back([&, i] {
      auto local = senders[i]->RegisterMemory(srcs[i]);
      auto conn = senders[i]->Connect(receiver_->endpoint());
      if (!local.ok() || !conn.ok()) return void(++failures);
      const WriteOp op{*local, 0, *remote, i * kChunk, kChunk};
      for (size_t r = 0; r < kRounds; ++r) {
        if (!(*conn)->Write({&op, 1}).ok()) ++failures;
        if (!(*conn)->Notify(std::to_string(i)).ok()) ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_EQ(failures.load(), 0);
  std::vector<int> per_sender(kSenders, 0);
  for (size_t n = 0; n < kSenders * kRounds; ++n) {
    auto note = receiver_->WaitNotification(absl::Seconds(5));
    ASSERT_TRUE(note.ok()) << note.status();
    ++per_sender[std::stoi(note->message)];
  }
  for (size_t i = 0; i < kSenders; ++i) {
    EXPECT_EQ(per_sender[i], kRounds);
    EXPECT_EQ(dst[i * kChunk], static_cast<std::byte>(i + 1));
    EXPECT_EQ(dst[(i + 1) * kChunk - 1], static_cast<std::byte>(i + 1));
  }
}

// Every transport built into this binary that registers host memory
// ("ucx" alone takes UCX_TLS from the environment, so the suite pins both
// UCX modes explicitly; cuda_ipc and nccl have gpu_transport_test.cc).
INSTANTIATE_TEST_SUITE_P(Transports, TransportTest,
                         ::testing::ValuesIn(HostMemoryTransports()),
                         TransportTestName);

class CrossProcessTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CrossProcessTest, ScatteredLayersLandByteExactInAnotherProcess) {
  constexpr size_t kBlock = 4096, kBlocks = 48, kLayers = 12;
  auto peer = PeerProcess::Start(KV_TRANSFER_PEER, GetParam(), kBlock * kBlocks * kLayers, 5000);
  ASSERT_NE(peer, nullptr);
  auto sender = CreateKvTransport(GetParam(), SmallLimits());
  ASSERT_TRUE(sender.ok());
  std::vector<std::byte> src(kBlock * kBlocks * kLayers);
  std::mt19937 rng(11);
  for (auto& b : src) b = static_cast<std::byte>(rng());
  auto local = (*sender)->RegisterMemory(src);
  auto conn = (*sender)->Connect(peer->endpoint);
  ASSERT_TRUE(local.ok() && conn.ok()) << conn.status();
  std::vector<size_t> order(kBlocks);
  std::iota(order.begin(), order.end(), 0);
  std::vector<std::pair<uint64_t, uint64_t>> landed;  // (dst, src) byte offsets
  std::vector<bool> written(kBlocks * kLayers, false);
  for (size_t layer = 0; layer < kLayers; ++layer) {
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<WriteOp> ops;
    for (size_t i = 0; i < 10; ++i) {  // Blocks order[2i] -> order[2i+1].
      const uint64_t so = (layer * kBlocks + order[2 * i]) * kBlock;
      const uint64_t dof = (layer * kBlocks + order[2 * i + 1]) * kBlock;
      ops.push_back({*local, so, RegionId(peer->region), dof, kBlock});
      landed.push_back({dof, so});
      written[layer * kBlocks + order[2 * i + 1]] = true;
    }
    ASSERT_TRUE((*conn)->Write(ops).ok()) << layer;
    ASSERT_TRUE((*conn)->Notify("layer " + std::to_string(layer)).ok());
  }
  for (size_t layer = 0; layer < kLayers; ++layer) {
    EXPECT_EQ(peer->Command("notify 5000"), "layer " + std::to_string(layer));
  }
  EXPECT_EQ(peer->Command("notify 10"), "TIMEOUT");
  for (auto [d, s] : landed) {
    ASSERT_EQ(peer->Command("crc " + std::to_string(d) + " " +
                            std::to_string(kBlock)),
              std::to_string(Crc32c(std::span(src).subspan(s, kBlock))))
        << "block at " << d;
  }
  const std::vector<std::byte> zeros(kBlock);
  const std::string zero_crc = std::to_string(Crc32c(zeros));
  for (size_t b = 0; b < written.size(); ++b) {
    if (!written[b]) {
      ASSERT_EQ(peer->Command("crc " + std::to_string(b * kBlock) + " 4096"),
                zero_crc);
    }
  }
}

TEST_P(CrossProcessTest, StoppedPeerTimesOutAndTheConnectionCloses) {
  auto peer = PeerProcess::Start(KV_TRANSFER_PEER, GetParam(), 8 << 20, 5000);
  ASSERT_NE(peer, nullptr);
  std::vector<std::byte> src(8 << 20, std::byte{9});  // Outlives the sender.
  TransportOptions o = SmallLimits();
  o.io_timeout = absl::Milliseconds(500);
  auto sender = CreateKvTransport(GetParam(), o);
  ASSERT_TRUE(sender.ok());
  auto local = (*sender)->RegisterMemory(src);
  auto conn = (*sender)->Connect(peer->endpoint);
  ASSERT_TRUE(local.ok() && conn.ok()) << conn.status();
  peer->Stop();
  const auto t0 = std::chrono::steady_clock::now();
  const WriteOp op{*local, 0, RegionId(peer->region), 0, src.size()};
  const absl::Status write = (*conn)->Write({&op, 1});
  // A transport whose writes need no receiver CPU may finish the write;
  // the notification needs the receiver and must time out.
  const absl::Status notify = write.ok() ? (*conn)->Notify("x") : write;
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count();
  EXPECT_TRUE(write.ok() || absl::IsDeadlineExceeded(write)) << write;
  if (write.ok()) {
    EXPECT_TRUE((*sender)->capabilities().one_sided)
        << "a write finished without the receiver";
  }
  EXPECT_TRUE(absl::IsDeadlineExceeded(notify)) << notify;
  EXPECT_LT(secs, 3.0);
  EXPECT_FALSE((*conn)->Notify("y").ok()) << "closed after a timeout";
  peer->Signal(SIGCONT);
  // The peer serves new connections once it runs again.
  auto again = (*sender)->Connect(peer->endpoint);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE((*again)->Notify("after").ok());
  std::string seen;
  for (int i = 0; i < 3 && seen != "after"; ++i)
    seen = peer->Command("notify 2000");
  EXPECT_EQ(seen, "after");
}

TEST_P(CrossProcessTest, PeerKilledMidTransferIsUnavailable) {
  constexpr size_t kBytes = 8 << 20, kOp = 64 << 10;
  auto peer = PeerProcess::Start(KV_TRANSFER_PEER, GetParam(), kBytes, 5000);
  ASSERT_NE(peer, nullptr);
  std::vector<std::byte> src(kBytes, std::byte{3});  // Outlives the sender.
  TransportOptions o;
  o.io_timeout = absl::Seconds(4);  // Room for sanitizer builds.
  auto sender = CreateKvTransport(GetParam(), o);
  ASSERT_TRUE(sender.ok());
  auto local = (*sender)->RegisterMemory(src);
  auto conn = (*sender)->Connect(peer->endpoint);
  ASSERT_TRUE(local.ok() && conn.ok()) << conn.status();
  std::vector<WriteOp> ops;  // Many ops per post, in reverse order.
  for (size_t off = 0; off < kBytes; off += kOp) {
    ops.push_back(
        {*local, off, RegionId(peer->region), kBytes - kOp - off, kOp});
  }
  const absl::Status first = (*conn)->Write(ops);
  ASSERT_TRUE(first.ok()) << first;
  std::atomic<int> writes{0};
  absl::Status last;
  std::thread writer([&] {
    const auto until =
        std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (std::chrono::steady_clock::now() < until) {
      last = (*conn)->Write(ops);
      if (!last.ok()) return;
      ++writes;
    }
  });
  while (writes.load() < 2)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const auto killed = std::chrono::steady_clock::now();
  peer->Kill();
  writer.join();
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - killed)
          .count();
  EXPECT_TRUE(absl::IsUnavailable(last)) << last;
  EXPECT_LT(secs, 7.0) << "found within the io timeout";
  EXPECT_TRUE(absl::IsUnavailable((*conn)->Notify("x")));
}

INSTANTIATE_TEST_SUITE_P(
    Transports, CrossProcessTest,
    ::testing::ValuesIn(HostMemoryTransports({"inproc"})),  // One process.
    TransportTestName);

TEST(TransportRegistryTest, UnknownTransportAndBadOptions) {
  EXPECT_EQ(CreateKvTransport("carrier-pigeon", {}).status().code(),
            absl::StatusCode::kNotFound);
  TransportOptions o;
  o.max_frame_bytes = 0;
  EXPECT_EQ(CreateKvTransport("tcp", o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o = {};
  o.listen_address = "no-port";
  EXPECT_FALSE(CreateKvTransport("tcp", o).ok());
}

}  // namespace
}  // namespace pdserve::kv
