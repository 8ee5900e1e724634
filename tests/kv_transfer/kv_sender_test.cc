// KvSender: pushes of a request's KV layer by layer into a landing, over
// tcp. Covers the staged path (a device pool over a transport of host
// memory), the abort notification that lets a decode worker free a landing
// at once, and the lanes: a stalled destination delays only its own
// pushes, idle lanes end, Stop drains every lane.
#include "kv_transfer/kv_sender.h"

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "gtest/gtest.h"
#include "kv_transfer/transport.h"
#include "tests/kv_transfer/peer_process.h"

namespace pdserve::kv {
namespace {

constexpr int32_t kLocalBlocks = 8;
constexpr int32_t kRemoteBlocks = 10;
constexpr int32_t kTokens = 10;

KvBlockLayout TestLayout() {
  return {.num_layers = 3,
          .num_kv_heads = 2,
          .head_dim = 4,
          .block_size = 4,
          .dtype = DType::kF32};
}

std::unique_ptr<KvTransport> Tcp(absl::Duration io_timeout) {
  TransportOptions options;
  options.io_timeout = io_timeout;
  auto transport = CreateKvTransport("tcp", options);
  EXPECT_TRUE(transport.ok()) << transport.status();
  return transport.ok() ? *std::move(transport) : nullptr;
}

// A local pool of random bytes, and pushes of its blocks.
class SenderTest : public testing::Test {
 protected:
  SenderTest() {
    pool_.resize(layout_.block_bytes() * kLocalBlocks);
    std::mt19937 rng(7);
    for (std::byte& b : pool_) b = static_cast<std::byte>(rng());
  }

  // A sender writing straight from the pool over tcp.
  std::unique_ptr<KvSender> MakeSender(absl::Duration io_timeout,
                                       const KvSenderOptions& options = {}) {
    std::vector<KvSenderTransport> transports;
    transports.push_back({.transport = Tcp(io_timeout), .memory = pool_});
    auto sender = KvSender::Create(
        std::move(transports), kLocalBlocks, layout_, nullptr,
        [this](const std::shared_ptr<KvPush>&) { ++failures_; }, options);
    EXPECT_TRUE(sender.ok()) << sender.status();
    return sender.ok() ? *std::move(sender) : nullptr;
  }

  std::shared_ptr<KvPush> MakePush(
      uint64_t id, const std::string& endpoint, RegionId region,
      std::vector<BlockId> blocks = {BlockId(7), BlockId(2), BlockId(5)},
      int32_t remote_blocks = kRemoteBlocks) {
    KvLandingTarget target{
        .offers = {{.transport = "tcp", .endpoint = endpoint, .region = region}},
        .remote_pool_blocks = remote_blocks,
        .block_ids = std::move(blocks),
        .abort_notification = "aborted " + std::to_string(id)};
    return std::make_shared<KvPush>(id, std::move(target));
  }

  // Queues positions [0, kTokens) of `layers` layers in two chunks.
  void PushLayers(KvSender& sender, const std::shared_ptr<KvPush>& push,
                  int32_t layers) {
    for (const auto& [begin, end] : {std::pair{0, 6}, std::pair{6, kTokens}}) {
      for (int32_t layer = 0; layer < layers; ++layer) {
        const LayerKv kv{.push = push,
                         .block_table = local_table_,
                         .begin = begin,
                         .end = end};
        sender.PushLayer(layer, {&kv, 1});
      }
    }
  }

  // Queues the end of `push` (notification "complete ID"); the future
  // gets its `done` status. Counts the `done` calls in dones_.
  std::future<absl::Status> Finish(KvSender& sender,
                                   std::shared_ptr<KvPush> push) {
    auto done = std::make_shared<std::promise<absl::Status>>();
    std::future<absl::Status> result = done->get_future();
    const std::string note = "complete " + std::to_string(push->request_id());
    sender.Finish(std::move(push), note,
                  [this, done](absl::Status s, const KvPushStats&) {
                    dones_.fetch_add(1);
                    done->set_value(std::move(s));
                  });
    return result;
  }

  absl::Status PushAll(KvSender& sender, const std::shared_ptr<KvPush>& push) {
    PushLayers(sender, push, layout_.num_layers);
    return Finish(sender, push).get();
  }

  // The landing's bytes a push of positions [0, kTokens) of `layers`
  // layers into `blocks` leaves, over `landing`.
  std::vector<std::byte> Expected(std::vector<std::byte> landing,
                                  const std::vector<BlockId>& blocks,
                                  int32_t layers) const {
    for (int32_t layer = 0; layer < layers; ++layer) {
      ForEachKvRange(layout_, layer, local_table_.data(), kLocalBlocks,
                     blocks.data(), kRemoteBlocks, 0, kTokens,
                     [&](size_t src, size_t dst, size_t length) {
                       std::memcpy(landing.data() + dst, pool_.data() + src,
                                   length);
                     });
    }
    return landing;
  }

  const KvBlockLayout layout_ = TestLayout();
  const std::vector<BlockId> local_table_ = {BlockId(1), BlockId(6),
                                             BlockId(3)};
  std::vector<std::byte> pool_;
  std::atomic<int> failures_ = 0;
  std::atomic<int> dones_ = 0;
};

// A receiving tcp transport in this process, with a landing pool.
class SenderToLocalReceiverTest : public SenderTest {
 protected:
  void SetUp() override {
    landing_.assign(layout_.block_bytes() * kRemoteBlocks, std::byte{0});
    receiver_ = Tcp(absl::Seconds(5));
    ASSERT_NE(receiver_, nullptr);
    auto region = receiver_->RegisterMemory(landing_);
    ASSERT_TRUE(region.ok()) << region.status();
    region_ = *region;
  }

  std::shared_ptr<KvPush> MakeLocalPush(
      uint64_t id,
      std::vector<BlockId> blocks = {BlockId(7), BlockId(2), BlockId(5)}) {
    return MakePush(id, receiver_->endpoint(), region_, std::move(blocks));
  }

  // The next notification's text; "" when none comes within `timeout`.
  std::string NextNotification(absl::Duration timeout) {
    auto note = receiver_->WaitNotification(timeout);
    return note.ok() ? note->message : "";
  }

  std::vector<std::byte> landing_;
  std::unique_ptr<KvTransport> receiver_;
  RegionId region_;
};

// The staged path: the transport reads a separate host staging buffer, so
// the sender must copy each layer job's ranges into it (the stage
// callback, here a memcpy from the pool) before the transport reads them;
// nothing but the pushed ranges is staged.
class StagedPushTest : public SenderToLocalReceiverTest {
 protected:
  void SetUp() override {
    SenderToLocalReceiverTest::SetUp();
    staging_.assign(pool_.size(), std::byte{0});
  }

  std::unique_ptr<KvSender> MakeStagedSender(bool fail_stage) {
    std::vector<KvSenderTransport> transports;
    transports.push_back({.transport = Tcp(absl::Seconds(5)),
                          .memory = staging_,
                          .staged = true});
    auto sender = KvSender::Create(
        std::move(transports), kLocalBlocks, layout_,
        [this, fail_stage](std::span<const WriteOp> writes) {
          if (fail_stage) return absl::InternalError("copy engine on fire");
          for (const WriteOp& w : writes) {
            std::memcpy(staging_.data() + w.local_offset,
                        pool_.data() + w.local_offset, w.length);
            ++staged_ranges_;
          }
          return absl::OkStatus();
        },
        [this](const std::shared_ptr<KvPush>&) { ++failures_; });
    EXPECT_TRUE(sender.ok()) << sender.status();
    return sender.ok() ? *std::move(sender) : nullptr;
  }

  std::vector<std::byte> staging_;
  int staged_ranges_ = 0;  // Under the sender's stage lock.
};

TEST_F(StagedPushTest, LandingGetsThePoolsBytesThroughTheStaging) {
  std::unique_ptr<KvSender> sender = MakeStagedSender(/*fail_stage=*/false);
  ASSERT_NE(sender, nullptr);
  std::shared_ptr<KvPush> push = MakeLocalPush(1);
  ASSERT_TRUE(PushAll(*sender, push).ok());
  EXPECT_EQ(NextNotification(absl::Seconds(5)), "complete 1");

  // Every pushed range arrived with the pool's bytes; nothing else of the
  // landing or the staging was touched.
  const std::vector<BlockId>& blocks = push->target().block_ids;
  EXPECT_TRUE(landing_ == Expected(std::vector<std::byte>(landing_.size()),
                                   blocks, layout_.num_layers));
  std::vector<std::byte> want_staging(staging_.size(), std::byte{0});
  for (int32_t layer = 0; layer < layout_.num_layers; ++layer) {
    ForEachKvRange(layout_, layer, local_table_.data(), kLocalBlocks,
                   blocks.data(), kRemoteBlocks, 0, kTokens,
                   [&](size_t src, size_t, size_t length) {
                     std::memcpy(want_staging.data() + src, pool_.data() + src,
                                 length);
                   });
  }
  EXPECT_TRUE(staging_ == want_staging);
  // K and V of each block touched, per chunk and layer: chunk [0, 6)
  // touches 2 blocks, [6, 10) 2 blocks.
  EXPECT_EQ(staged_ranges_, 2 * (2 + 2) * layout_.num_layers);
  EXPECT_EQ(failures_, 0);
}

TEST_F(StagedPushTest, StagingFailureFailsThePushWithoutWriting) {
  std::unique_ptr<KvSender> sender = MakeStagedSender(/*fail_stage=*/true);
  ASSERT_NE(sender, nullptr);
  const absl::Status status = PushAll(*sender, MakeLocalPush(1));
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal) << status;
  EXPECT_NE(status.message().find("copy engine on fire"), std::string::npos)
      << status;
  EXPECT_EQ(failures_, 1);
  EXPECT_TRUE(std::all_of(landing_.begin(), landing_.end(),
                          [](std::byte b) { return b == std::byte{0}; }));
  // The push had connected and its connection is fine: the landing hears
  // that nothing more comes, and nothing else.
  EXPECT_EQ(NextNotification(absl::Seconds(5)), "aborted 1");
  EXPECT_EQ(NextNotification(absl::Milliseconds(200)), "");
}

TEST_F(StagedPushTest, StagedTransportWithoutStageCallbackIsRefused) {
  std::vector<KvSenderTransport> transports;
  transports.push_back({.transport = Tcp(absl::Seconds(5)),
                        .memory = staging_,
                        .staged = true});
  auto sender = KvSender::Create(std::move(transports), kLocalBlocks, layout_,
                                 nullptr, nullptr);
  EXPECT_EQ(sender.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(SenderToLocalReceiverTest, AbortedPushNotifiesTheLandingAfterItsWrites) {
  std::unique_ptr<KvSender> sender = MakeSender(absl::Seconds(5));
  ASSERT_NE(sender, nullptr);
  // Push 1 writes layer 0; push 2 (same destination, hence same lane,
  // other blocks) completes behind it, so layer 0 of push 1 is written.
  std::shared_ptr<KvPush> aborted = MakeLocalPush(1);
  PushLayers(*sender, aborted, 1);
  const std::vector<BlockId> other = {BlockId(0), BlockId(1), BlockId(3)};
  ASSERT_TRUE(PushAll(*sender, MakeLocalPush(2, other)).ok());
  EXPECT_EQ(NextNotification(absl::Seconds(5)), "complete 2");

  aborted->Abort(absl::CancelledError("the caller gave up"));
  for (int32_t layer = 1; layer < layout_.num_layers; ++layer) {
    const LayerKv kv{.push = aborted, .block_table = local_table_, .end = kTokens};
    sender->PushLayer(layer, {&kv, 1});
  }
  const absl::Status status = Finish(*sender, aborted).get();
  EXPECT_TRUE(absl::IsCancelled(status)) << status;
  EXPECT_EQ(NextNotification(absl::Seconds(5)), "aborted 1");
  EXPECT_EQ(NextNotification(absl::Milliseconds(200)), "");
  // Layer 0 of push 1 and all of push 2 landed; the layers queued after
  // the abort were dropped.
  std::vector<std::byte> want = Expected(
      std::vector<std::byte>(landing_.size()), aborted->target().block_ids, 1);
  want = Expected(std::move(want), other, layout_.num_layers);
  EXPECT_TRUE(landing_ == want);
  EXPECT_EQ(failures_, 0);
}

TEST_F(SenderToLocalReceiverTest, PushAbortedBeforeConnectingSendsNothing) {
  std::unique_ptr<KvSender> sender = MakeSender(absl::Seconds(5));
  ASSERT_NE(sender, nullptr);
  std::shared_ptr<KvPush> push = MakeLocalPush(1);
  push->Abort(absl::CancelledError("the caller gave up"));
  PushLayers(*sender, push, layout_.num_layers);
  EXPECT_TRUE(absl::IsCancelled(Finish(*sender, push).get()));
  EXPECT_EQ(NextNotification(absl::Milliseconds(300)), "");
}

TEST_F(SenderToLocalReceiverTest, PushWhoseConnectionFailedSendsNothing) {
  std::unique_ptr<KvSender> sender = MakeSender(absl::Seconds(5));
  ASSERT_NE(sender, nullptr);
  // The push believes in a larger pool: the receiver refuses the write
  // and the transport closes the connection.
  std::shared_ptr<KvPush> push =
      MakePush(1, receiver_->endpoint(), region_,
               {BlockId(900), BlockId(901), BlockId(902)}, 1000);
  const absl::Status status = PushAll(*sender, push);
  EXPECT_FALSE(status.ok());
  EXPECT_FALSE(absl::IsInternal(status)) << "a peer's refusal, not ours: "
                                         << status;
  EXPECT_EQ(failures_, 1);
  EXPECT_EQ(NextNotification(absl::Milliseconds(300)), "");
  // The next push to that receiver connects again and completes.
  ASSERT_TRUE(PushAll(*sender, MakeLocalPush(2)).ok());
  EXPECT_EQ(NextNotification(absl::Seconds(5)), "complete 2");
}

TEST_F(SenderToLocalReceiverTest, IdleLaneEndsAndTheNextPushStartsAnother) {
  std::unique_ptr<KvSender> sender = MakeSender(
      absl::Seconds(5), {.lane_idle_timeout = absl::Milliseconds(100)});
  ASSERT_NE(sender, nullptr);
  ASSERT_TRUE(PushAll(*sender, MakeLocalPush(1)).ok());
  EXPECT_EQ(NextNotification(absl::Seconds(5)), "complete 1");
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (sender->lane_count() > 0 && absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(sender->lane_count(), 0u);
  ASSERT_TRUE(PushAll(*sender, MakeLocalPush(2)).ok());
  EXPECT_EQ(NextNotification(absl::Seconds(5)), "complete 2");
}

TEST_F(SenderToLocalReceiverTest, DestinationsBeyondTheLaneBoundShareALane) {
  std::unique_ptr<KvSender> sender =
      MakeSender(absl::Seconds(5), {.max_lanes = 1});
  ASSERT_NE(sender, nullptr);
  std::vector<std::byte> second_landing(landing_.size(), std::byte{0});
  std::unique_ptr<KvTransport> second = Tcp(absl::Seconds(5));
  ASSERT_NE(second, nullptr);
  auto second_region = second->RegisterMemory(second_landing);
  ASSERT_TRUE(second_region.ok());
  ASSERT_TRUE(PushAll(*sender, MakeLocalPush(1)).ok());
  ASSERT_TRUE(
      PushAll(*sender, MakePush(2, second->endpoint(), *second_region)).ok());
  EXPECT_EQ(sender->lane_count(), 1u);
  EXPECT_EQ(NextNotification(absl::Seconds(5)), "complete 1");
  auto note = second->WaitNotification(absl::Seconds(5));
  ASSERT_TRUE(note.ok()) << note.status();
  EXPECT_EQ(note->message, "complete 2");
}

TEST_F(SenderToLocalReceiverTest, EachDestinationHasALaneAndCountersAddUp) {
  std::unique_ptr<KvSender> sender = MakeSender(absl::Seconds(5));
  ASSERT_NE(sender, nullptr);
  std::vector<std::byte> second_landing(landing_.size(), std::byte{0});
  std::unique_ptr<KvTransport> second = Tcp(absl::Seconds(5));
  ASSERT_NE(second, nullptr);
  auto second_region = second->RegisterMemory(second_landing);
  ASSERT_TRUE(second_region.ok());
  ASSERT_TRUE(PushAll(*sender, MakeLocalPush(1)).ok());
  ASSERT_TRUE(
      PushAll(*sender, MakePush(2, second->endpoint(), *second_region)).ok());
  EXPECT_EQ(sender->lane_count(), 2u);
  // Positions [0, 10) of every layer: K and V of 10 slots each.
  const uint64_t push_bytes =
      uint64_t{2} * kTokens * layout_.slot_bytes() * layout_.num_layers;
  const std::vector<KvTransportCounters> counters = sender->counters();
  ASSERT_EQ(counters.size(), 1u);
  EXPECT_EQ(counters[0].transport, "tcp");
  EXPECT_EQ(counters[0].pushes, 2u);
  EXPECT_EQ(counters[0].bytes, 2 * push_bytes);
  EXPECT_EQ(counters[0].fallbacks, 0u);
}

// Receivers in other processes, which can be stopped (SIGSTOP) like a
// decode worker that stalls.
class SenderLanesTest : public SenderTest {
 protected:
  std::unique_ptr<PeerProcess> StartPeer() {
    auto peer = PeerProcess::Start(KV_TRANSFER_PEER, "tcp",
                                   layout_.block_bytes() * kRemoteBlocks, 5000);
    EXPECT_NE(peer, nullptr);
    return peer;
  }
  std::shared_ptr<KvPush> PushTo(PeerProcess& peer, uint64_t id) {
    return MakePush(id, peer.endpoint, RegionId(peer.region));
  }
};

// Pushes of one destination, one after another: each one's latency (from
// its first layer queued to its `done`).
std::vector<absl::Duration> TimedPushes(
    int count, absl::FunctionRef<absl::Status()> push) {
  std::vector<absl::Duration> latencies;
  for (int i = 0; i < count; ++i) {
    const absl::Time start = absl::Now();
    const absl::Status status = push();
    EXPECT_TRUE(status.ok()) << status;
    latencies.push_back(absl::Now() - start);
  }
  return latencies;
}

absl::Duration Median(std::vector<absl::Duration> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

TEST_F(SenderLanesTest, StalledDestinationDelaysOnlyItsOwnPushes) {
  // Rounds of pushes to the healthy destination, each round once with both
  // destinations running and once with the other stopped while a push to
  // it is under way: a load spike on the machine hits both alike.
  constexpr int kRounds = 5;
  constexpr int kPushesPerRound = 10;
  constexpr absl::Duration kIoTimeout = absl::Seconds(4);
  std::unique_ptr<PeerProcess> healthy = StartPeer(), stalled = StartPeer();
  ASSERT_TRUE(healthy != nullptr && stalled != nullptr);
  std::unique_ptr<KvSender> sender = MakeSender(kIoTimeout);
  ASSERT_NE(sender, nullptr);
  uint64_t next_id = 1;
  auto push_healthy = [&] {
    return PushAll(*sender, PushTo(*healthy, next_id++));
  };
  // Both destinations connected and working.
  ASSERT_TRUE(PushAll(*sender, PushTo(*stalled, next_id++)).ok());
  std::vector<absl::Duration> baseline, during;
  for (int round = 0; round < kRounds; ++round) {
    for (absl::Duration d : TimedPushes(kPushesPerRound, push_healthy))
      baseline.push_back(d);

    // The stalled destination's lane blocks in a write for up to
    // kIoTimeout.
    stalled->Stop();
    std::shared_ptr<KvPush> stuck = PushTo(*stalled, next_id++);
    PushLayers(*sender, stuck, layout_.num_layers);
    std::future<absl::Status> stuck_done = Finish(*sender, stuck);
    absl::SleepFor(absl::Milliseconds(50));  // Its first write is under way.
    const absl::Time stall_start = absl::Now();
    for (absl::Duration d : TimedPushes(kPushesPerRound, push_healthy))
      during.push_back(d);
    const absl::Duration all_during = absl::Now() - stall_start;
    // The healthy pushes all ended while the stuck one still waits.
    EXPECT_EQ(stuck_done.wait_for(std::chrono::seconds(0)),
              std::future_status::timeout);
    EXPECT_LT(all_during, kIoTimeout / 2);

    stalled->Signal(SIGCONT);
    const absl::Status stuck_status = stuck_done.get();
    EXPECT_TRUE(stuck_status.ok() || absl::IsDeadlineExceeded(stuck_status))
        << stuck_status;
  }
  const absl::Duration base_median = Median(baseline);
  const absl::Duration during_median = Median(during);
  // A stall shared with the healthy destination costs it up to kIoTimeout
  // (seconds) a push. The bound leaves room for the other tests ctest -j2
  // runs beside this one: on a loaded CI machine a 3 ms baseline measured
  // 8.8 ms during the stall, from load alone.
  EXPECT_LE(during_median, base_median * 3 + absl::Milliseconds(20))
      << "baseline " << base_median << ", during the stall " << during_median;
  RecordProperty("baseline_median_us",
                 static_cast<int>(absl::ToInt64Microseconds(base_median)));
  RecordProperty("stalled_median_us",
                 static_cast<int>(absl::ToInt64Microseconds(during_median)));
  std::cout << "healthy push median: baseline " << base_median
            << ", other destination stalled " << during_median << "\n";
  EXPECT_EQ(dones_, 1 + kRounds * (2 * kPushesPerRound + 1));
}

TEST_F(SenderLanesTest, StopRunsEveryQueuedDoneOnce) {
  std::unique_ptr<PeerProcess> stalled = StartPeer();
  ASSERT_NE(stalled, nullptr);
  std::unique_ptr<KvSender> sender = MakeSender(absl::Seconds(1));
  ASSERT_NE(sender, nullptr);
  ASSERT_TRUE(PushAll(*sender, PushTo(*stalled, 1)).ok());
  stalled->Stop();
  std::vector<std::future<absl::Status>> done;
  for (uint64_t id = 2; id < 6; ++id) {
    std::shared_ptr<KvPush> push = PushTo(*stalled, id);
    PushLayers(*sender, push, layout_.num_layers);
    done.push_back(Finish(*sender, push));
  }
  absl::SleepFor(absl::Milliseconds(50));  // The first write is under way.
  sender->Stop();
  // The write under way ended (its timeout); everything behind it was
  // finished without touching the transport.
  for (auto& d : done) {
    ASSERT_EQ(d.wait_for(std::chrono::seconds(0)), std::future_status::ready);
    const absl::Status status = d.get();
    EXPECT_TRUE(absl::IsDeadlineExceeded(status) || absl::IsUnavailable(status))
        << status;
  }
  EXPECT_EQ(dones_, 5);
  // After Stop, Finish answers at once.
  std::future<absl::Status> late = Finish(*sender, PushTo(*stalled, 6));
  EXPECT_TRUE(absl::IsUnavailable(late.get()));
  stalled->Signal(SIGCONT);
}

}  // namespace
}  // namespace pdserve::kv
