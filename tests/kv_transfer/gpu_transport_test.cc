// The conformance cases of transport_test.cc for the device transports
// (cuda_ipc, nccl), with device memory on both sides: byte-exact random
// non-contiguous block sets over many layers, notifications after their
// writes, refused ranges, regions that come and go, peer loss; and, for
// cuda_ipc, a receiver in another process (kv-transfer-device-peer)
// stopped or killed mid-transfer. Label gpu: every test skips without a
// CUDA device.
//
// In one process, nccl runs its loopback mode (a one-rank communicator:
// NCCL cannot join two ranks on one GPU); its two-rank mode needs two
// GPUs (the cross-process test with the peer on device 1).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>

#include "gtest/gtest.h"
#include "kv_transfer/tcp_frame.h"
#include "kv_transfer/transport.h"
#include "tests/kv_transfer/peer_process.h"
#include "tests/kv_transfer/transport_names.h"

namespace pdserve::kv {
namespace {

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

#define PD_REQUIRE_CUDA_DEVICES(n)                                 \
  do {                                                             \
    if (DeviceCount() < (n)) {                                     \
      GTEST_SKIP() << "needs " << (n) << " CUDA device(s), found " \
                   << DeviceCount();                               \
    }                                                              \
  } while (0)

// Device memory with host-side upload and download.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    EXPECT_EQ(cudaMalloc(&ptr_, bytes), cudaSuccess);
    EXPECT_EQ(cudaMemset(ptr_, 0, bytes), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(ptr_); }

  std::span<std::byte> span() {
    return {static_cast<std::byte*>(ptr_), bytes_};
  }
  void Upload(const std::vector<std::byte>& host) {
    ASSERT_EQ(
        cudaMemcpy(ptr_, host.data(), host.size(), cudaMemcpyHostToDevice),
        cudaSuccess);
  }
  std::vector<std::byte> Download() const {
    std::vector<std::byte> host(bytes_);
    EXPECT_EQ(cudaMemcpy(host.data(), ptr_, bytes_, cudaMemcpyDeviceToHost),
              cudaSuccess);
    return host;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

std::vector<std::byte> RandomBytes(size_t n, uint32_t seed) {
  std::vector<std::byte> v(n);
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

TransportOptions Options() {
  TransportOptions o;
  o.io_timeout = absl::Seconds(5);
  return o;
}

class GpuTransportTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    PD_REQUIRE_CUDA_DEVICES(1);
    auto a = CreateKvTransport(GetParam(), Options());
    auto b = CreateKvTransport(GetParam(), Options());
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    sender_ = *std::move(a);
    receiver_ = *std::move(b);
    EXPECT_TRUE(sender_->capabilities().device_memory);
  }
  std::unique_ptr<KvTransport> sender_, receiver_;
};

TEST_P(GpuTransportTest, RandomBlockSetsOverManyLayersArriveByteExact) {
  constexpr size_t kBlock = 16 * 1024, kBlocks = 96, kLayers = 32;
  const std::vector<std::byte> host =
      RandomBytes(kBlock * kBlocks * kLayers, 7);
  DeviceBuffer src(host.size()), dst(host.size());
  src.Upload(host);
  auto local = sender_->RegisterMemory(src.span());
  auto remote = receiver_->RegisterMemory(dst.span());
  ASSERT_TRUE(local.ok() && remote.ok());
  auto conn = sender_->Connect(receiver_->endpoint());
  ASSERT_TRUE(conn.ok()) << conn.status();
  std::mt19937 rng(7);
  std::vector<size_t> order(kBlocks);
  std::iota(order.begin(), order.end(), 0);
  std::vector<uint8_t> written(kBlocks * kLayers, 0);
  std::vector<std::pair<size_t, size_t>> landed;  // (dst byte, src byte)
  for (size_t layer = 0; layer < kLayers; ++layer) {
    std::shuffle(order.begin(), order.end(), rng);
    const size_t count = 1 + rng() % 40;
    std::vector<WriteOp> ops;
    for (size_t i = 0; i + 1 < count * 2 && i + 1 < kBlocks; i += 2) {
      const size_t s = order[i], d = order[i + 1];
      const size_t len =
          (s + 1 < kBlocks && d + 1 < kBlocks && rng() % 4 == 0) ? 2 : 1;
      bool clash = false;
      for (size_t k = 0; k < len; ++k)
        clash |= written[layer * kBlocks + d + k] != 0;
      if (clash) continue;
      const uint64_t so = (layer * kBlocks + s) * kBlock,
                     dof = (layer * kBlocks + d) * kBlock;
      for (size_t k = 0; k < len; ++k) {
        written[layer * kBlocks + d + k] = 1;
        landed.push_back({dof + k * kBlock, so + k * kBlock});
      }
      ops.push_back({*local, so, *remote, dof, len * kBlock});
    }
    ASSERT_TRUE((*conn)->Write(ops).ok()) << "layer " << layer;
    ASSERT_TRUE((*conn)->Notify("layer " + std::to_string(layer)).ok());
  }
  for (size_t layer = 0; layer < kLayers; ++layer) {
    auto n = receiver_->WaitNotification(absl::Seconds(5));
    ASSERT_TRUE(n.ok()) << n.status();
    ASSERT_EQ(n->message, "layer " + std::to_string(layer));  // In order.
  }
  const std::vector<std::byte> out = dst.Download();
  for (auto [d, s] : landed)
    ASSERT_EQ(0, std::memcmp(&out[d], &host[s], kBlock)) << d;
  for (size_t b = 0; b < written.size(); ++b) {
    if (written[b] == 0) {
      ASSERT_TRUE(std::all_of(&out[b * kBlock], &out[b * kBlock] + kBlock,
                              [](std::byte x) { return x == std::byte{0}; }))
          << "untouched block " << b;
    }
  }
}

TEST_P(GpuTransportTest, RefusedRangesNameTheProblemAndWriteNothing) {
  DeviceBuffer src(1024), dst(1024);
  src.Upload(std::vector<std::byte>(1024, std::byte{7}));
  auto local = sender_->RegisterMemory(src.span());
  auto remote = receiver_->RegisterMemory(dst.span());
  ASSERT_TRUE(local.ok() && remote.ok());
  std::vector<std::byte> host_memory(64);
  EXPECT_EQ(sender_->RegisterMemory(host_memory).status().code(),
            absl::StatusCode::kInvalidArgument)
      << "host memory is not registered";
  auto conn = sender_->Connect(receiver_->endpoint());
  ASSERT_TRUE(conn.ok()) << conn.status();
  const WriteOp bad_local{*local, 1000, *remote, 0, 100};
  EXPECT_EQ((*conn)->Write({&bad_local, 1}).code(),
            absl::StatusCode::kInvalidArgument);
  const WriteOp ok{*local, 0, *remote, 0, 16};
  EXPECT_TRUE((*conn)->Write({&ok, 1}).ok()) << "stays open";
  const WriteOp unknown{*local, 0, RegionId(remote->value + 99), 0, 16};
  EXPECT_EQ((*conn)->Write({&unknown, 1}).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::IsUnavailable((*conn)->Notify("x"))) << "closed";
  for (const WriteOp& outside :
       {WriteOp{*local, 0, *remote, 1020, 16},
        WriteOp{*local, 0, *remote, ~uint64_t{0} - 4, 16}}) {
    auto c = sender_->Connect(receiver_->endpoint());
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ((*c)->Write({&outside, 1}).code(), absl::StatusCode::kOutOfRange);
  }
  const std::vector<std::byte> out = dst.Download();
  for (size_t i = 16; i < out.size(); ++i) ASSERT_EQ(out[i], std::byte{0}) << i;
  auto c = sender_->Connect(receiver_->endpoint());
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(
      (*c)->Notify(std::string(Options().max_message_bytes + 1, 'x')).code(),
      absl::StatusCode::kResourceExhausted);
}

TEST_P(GpuTransportTest, RegionsRegisteredLaterAndDeregisteredAreSeen) {
  DeviceBuffer src(4096), first(4096), second(4096);
  src.Upload(std::vector<std::byte>(4096, std::byte{5}));
  auto local = sender_->RegisterMemory(src.span());
  auto r1 = receiver_->RegisterMemory(first.span());
  ASSERT_TRUE(local.ok() && r1.ok());
  auto conn = sender_->Connect(receiver_->endpoint());
  ASSERT_TRUE(conn.ok()) << conn.status();
  const WriteOp into_first{*local, 0, *r1, 0, 64};
  ASSERT_TRUE((*conn)->Write({&into_first, 1}).ok());
  auto r2 = receiver_->RegisterMemory(second.span());  // After connecting.
  ASSERT_TRUE(r2.ok());
  const WriteOp op{*local, 0, *r2, 100, 200};
  ASSERT_TRUE((*conn)->Write({&op, 1}).ok());
  ASSERT_TRUE((*conn)->Notify("written").ok());
  ASSERT_TRUE(receiver_->WaitNotification(absl::Seconds(5)).ok());
  const std::vector<std::byte> out = second.Download();
  EXPECT_EQ(out[100], std::byte{5});
  EXPECT_EQ(out[299], std::byte{5});
  EXPECT_EQ(out[300], std::byte{0});
  // Deregistered while the connection has used it: refused from then on.
  ASSERT_TRUE(receiver_->DeregisterMemory(*r1).ok());
  EXPECT_EQ((*conn)->Write({&into_first, 1}).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(receiver_->DeregisterMemory(*r1).code(),
            absl::StatusCode::kNotFound);
  auto conn2 = sender_->Connect(receiver_->endpoint());
  ASSERT_TRUE(conn2.ok());
  ASSERT_TRUE(sender_->DeregisterMemory(*local).ok());
  EXPECT_EQ((*conn2)->Write({&op, 1}).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_P(GpuTransportTest, PeerThatGoesAwayIsUnavailable) {
  DeviceBuffer src(1 << 16), dst(1 << 16);
  auto local = sender_->RegisterMemory(src.span());
  auto remote = receiver_->RegisterMemory(dst.span());
  ASSERT_TRUE(local.ok() && remote.ok());
  auto conn = sender_->Connect(receiver_->endpoint());
  ASSERT_TRUE(conn.ok());
  const std::string endpoint = receiver_->endpoint();
  receiver_.reset();
  const WriteOp op{*local, 0, *remote, 0, 1 << 16};
  EXPECT_TRUE(absl::IsUnavailable((*conn)->Write({&op, 1})));
  EXPECT_TRUE(absl::IsUnavailable((*conn)->Notify("x"))) << "stays closed";
  EXPECT_FALSE(sender_->Connect(endpoint).ok());
}

TEST_P(GpuTransportTest, NotificationQueueIsBounded) {
  TransportOptions o = Options();
  o.max_pending_notifications = 3;
  auto receiver = CreateKvTransport(GetParam(), o);
  ASSERT_TRUE(receiver.ok());
  auto conn = sender_->Connect((*receiver)->endpoint());
  ASSERT_TRUE(conn.ok());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE((*conn)->Notify("n").ok());
  EXPECT_EQ((*conn)->Notify("n").code(), absl::StatusCode::kResourceExhausted);
}

std::vector<std::string> DeviceTransports() {
  std::vector<std::string> names;
  for (const std::string& n : AvailableKvTransports()) {
    if (RegistersDeviceMemoryOnly(n)) names.push_back(n);
  }
  return names;
}

INSTANTIATE_TEST_SUITE_P(Transports, GpuTransportTest,
                         ::testing::ValuesIn(DeviceTransports()),
                         TransportTestName);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(GpuTransportTest);

// The receiver in another process. cuda_ipc: on the same GPU. nccl: on
// device 1 (two GPUs), since NCCL refuses two processes on one GPU.
class GpuCrossProcessTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    PD_REQUIRE_CUDA_DEVICES(GetParam() == "nccl" ? 2 : 1);
  }
  std::unique_ptr<PeerProcess> StartPeer(size_t bytes, int timeout_ms) {
    // The peer process runs the same transport; nccl's on device 1.
    const std::string device = GetParam() == "nccl" ? "1" : "0";
    return PeerProcess::Start(KV_TRANSFER_DEVICE_PEER, GetParam(), bytes,
                              timeout_ms, device);
  }
};

TEST_P(GpuCrossProcessTest, ScatteredLayersLandByteExactInAnotherProcess) {
  constexpr size_t kBlock = 64 * 1024, kBlocks = 48, kLayers = 12;
  auto peer = StartPeer(kBlock * kBlocks * kLayers, 5000);
  ASSERT_NE(peer, nullptr);
  auto sender = CreateKvTransport(GetParam(), Options());
  ASSERT_TRUE(sender.ok()) << sender.status();
  const std::vector<std::byte> host =
      RandomBytes(kBlock * kBlocks * kLayers, 11);
  DeviceBuffer src(host.size());
  src.Upload(host);
  auto local = (*sender)->RegisterMemory(src.span());
  auto conn = (*sender)->Connect(peer->endpoint);
  ASSERT_TRUE(local.ok() && conn.ok()) << conn.status();
  std::mt19937 rng(11);
  std::vector<size_t> order(kBlocks);
  std::iota(order.begin(), order.end(), 0);
  std::vector<std::pair<uint64_t, uint64_t>> landed;
  for (size_t layer = 0; layer < kLayers; ++layer) {
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<WriteOp> ops;
    for (size_t i = 0; i < 10; ++i) {
      const uint64_t so = (layer * kBlocks + order[2 * i]) * kBlock;
      const uint64_t dof = (layer * kBlocks + order[2 * i + 1]) * kBlock;
      ops.push_back({*local, so, RegionId(peer->region), dof, kBlock});
      landed.push_back({dof, so});
    }
    ASSERT_TRUE((*conn)->Write(ops).ok()) << layer;
    ASSERT_TRUE((*conn)->Notify("layer " + std::to_string(layer)).ok());
  }
  for (size_t layer = 0; layer < kLayers; ++layer) {
    EXPECT_EQ(peer->Command("notify 5000"), "layer " + std::to_string(layer));
  }
  for (auto [d, s] : landed) {
    ASSERT_EQ(peer->Command("crc " + std::to_string(d) + " " +
                            std::to_string(kBlock)),
              std::to_string(Crc32c(std::span(host).subspan(s, kBlock))))
        << "block at " << d;
  }
}

TEST_P(GpuCrossProcessTest, StoppedPeerTimesOutAndTheConnectionCloses) {
  auto peer = StartPeer(8 << 20, 5000);
  ASSERT_NE(peer, nullptr);
  TransportOptions o = Options();
  o.io_timeout = absl::Milliseconds(500);
  auto sender = CreateKvTransport(GetParam(), o);
  ASSERT_TRUE(sender.ok());
  DeviceBuffer src(8 << 20);
  auto local = (*sender)->RegisterMemory(src.span());
  auto conn = (*sender)->Connect(peer->endpoint);
  ASSERT_TRUE(local.ok() && conn.ok()) << conn.status();
  peer->Stop();
  const auto t0 = std::chrono::steady_clock::now();
  const WriteOp op{*local, 0, RegionId(peer->region), 0, 8 << 20};
  const absl::Status write = (*conn)->Write({&op, 1});
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count();
  EXPECT_TRUE(absl::IsDeadlineExceeded(write)) << write;
  EXPECT_LT(secs, 3.0);
  EXPECT_FALSE((*conn)->Notify("y").ok()) << "closed after a timeout";
  peer->Signal(SIGCONT);
  auto again = (*sender)->Connect(peer->endpoint);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE((*again)->Notify("after").ok());
  std::string seen;
  for (int i = 0; i < 3 && seen != "after"; ++i)
    seen = peer->Command("notify 2000");
  EXPECT_EQ(seen, "after");
}

TEST_P(GpuCrossProcessTest, PeerKilledMidTransferIsUnavailable) {
  constexpr size_t kBytes = 64 << 20, kOp = 256 << 10;
  auto peer = StartPeer(kBytes, 5000);
  ASSERT_NE(peer, nullptr);
  auto sender = CreateKvTransport(GetParam(), Options());
  ASSERT_TRUE(sender.ok());
  DeviceBuffer src(kBytes);
  auto local = (*sender)->RegisterMemory(src.span());
  auto conn = (*sender)->Connect(peer->endpoint);
  ASSERT_TRUE(local.ok() && conn.ok()) << conn.status();
  std::vector<WriteOp> ops;  // Many ops per post, in reverse order.
  for (size_t off = 0; off < kBytes; off += kOp) {
    ops.push_back(
        {*local, off, RegionId(peer->region), kBytes - kOp - off, kOp});
  }
  ASSERT_TRUE((*conn)->Write(ops).ok());
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
  EXPECT_LT(secs, 7.0);
  EXPECT_TRUE(absl::IsUnavailable((*conn)->Notify("x")));
}

INSTANTIATE_TEST_SUITE_P(Transports, GpuCrossProcessTest,
                         ::testing::ValuesIn(DeviceTransports()),
                         TransportTestName);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(GpuCrossProcessTest);

TEST(GpuTransportSetupTest, NcclRefusesTwoProcessesOnOneGpu) {
  PD_REQUIRE_CUDA_DEVICES(1);
  const auto names = AvailableKvTransports();
  if (std::find(names.begin(), names.end(), "nccl") == names.end()) {
    GTEST_SKIP() << "nccl is not built";
  }
  auto peer =
      PeerProcess::Start(KV_TRANSFER_DEVICE_PEER, "nccl", 4096, 5000, "0");
  ASSERT_NE(peer, nullptr);
  auto sender = CreateKvTransport("nccl", Options());
  ASSERT_TRUE(sender.ok()) << sender.status();
  EXPECT_EQ((*sender)->Connect(peer->endpoint).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace pdserve::kv
