// KvPusher over a staged transport: the path a device KV pool takes over a
// transport of host memory (tcp, ucx). The lane registers a separate host
// staging buffer; the pusher must copy each layer job's ranges into it (the
// stage callback, here a memcpy from the test's pool) before the transport
// reads them, so the landing receives the pool's bytes, and nothing but the
// pushed ranges is staged.
#include "prefill_worker/kv_pusher.h"

#include <cstring>
#include <future>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kv_transfer/transport.h"

namespace pdserve {
namespace {

constexpr int32_t kLocalBlocks = 8;
constexpr int32_t kRemoteBlocks = 10;

KvBlockLayout TestLayout() {
  return {.num_layers = 3,
          .num_kv_heads = 2,
          .head_dim = 4,
          .block_size = 4,
          .dtype = DType::kF32};
}

class StagedPushTest : public testing::Test {
 protected:
  void SetUp() override {
    const size_t local_bytes = layout_.block_bytes() * kLocalBlocks;
    pool_.resize(local_bytes);
    std::mt19937 rng(7);
    for (std::byte& b : pool_) b = static_cast<std::byte>(rng());
    staging_.assign(local_bytes, std::byte{0});
    landing_.assign(layout_.block_bytes() * kRemoteBlocks, std::byte{0});

    kv::TransportOptions options;
    options.io_timeout = absl::Seconds(5);
    auto receiver = kv::CreateKvTransport("tcp", options);
    ASSERT_TRUE(receiver.ok()) << receiver.status();
    receiver_ = *std::move(receiver);
    auto region = receiver_->RegisterMemory(landing_);
    ASSERT_TRUE(region.ok()) << region.status();
    region_ = *region;
  }

  // A pusher with one staged tcp lane; `stage` copies pool -> staging
  // unless `fail_stage`.
  std::unique_ptr<KvPusher> MakePusher(bool fail_stage) {
    kv::TransportOptions options;
    options.io_timeout = absl::Seconds(5);
    auto sender = kv::CreateKvTransport("tcp", options);
    EXPECT_TRUE(sender.ok()) << sender.status();
    std::vector<KvPusherTransport> transports;
    transports.push_back(
        {.transport = *std::move(sender), .memory = staging_, .staged = true});
    auto pusher = KvPusher::Create(
        std::move(transports), kLocalBlocks, layout_,
        [this, fail_stage](std::span<const KvByteRange> ranges) {
          if (fail_stage) return absl::InternalError("copy engine on fire");
          for (const KvByteRange& r : ranges) {
            std::memcpy(staging_.data() + r.offset, pool_.data() + r.offset,
                        r.length);
            ++staged_ranges_;
          }
          return absl::OkStatus();
        },
        [this](const std::shared_ptr<KvPush>&) { ++failures_; });
    EXPECT_TRUE(pusher.ok()) << pusher.status();
    return pusher.ok() ? *std::move(pusher) : nullptr;
  }

  std::shared_ptr<KvPush> MakePush() {
    KvLandingTarget target{.offers = {{.transport = "tcp",
                                       .endpoint = receiver_->endpoint(),
                                       .region = region_}},
                           .remote_pool_blocks = kRemoteBlocks,
                           .block_ids = {BlockId(7), BlockId(2), BlockId(5)}};
    return std::make_shared<KvPush>(RequestId(1), std::move(target));
  }

  // Pushes positions [0, kTokens) of every layer in two chunks and waits
  // for the outcome.
  absl::Status PushAll(KvPusher& pusher, std::shared_ptr<KvPush> push) {
    for (const auto& [begin, end] : {std::pair{0, 6}, std::pair{6, kTokens}}) {
      for (int32_t layer = 0; layer < layout_.num_layers; ++layer) {
        const LayerKv kv{.push = push,
                         .block_table = local_table_,
                         .begin = begin,
                         .end = end};
        pusher.PushLayer(layer, {&kv, 1});
      }
    }
    std::promise<absl::Status> done;
    pusher.Finish(push, "complete",
                  [&done](absl::Status s, const KvPushStats&) {
                    done.set_value(std::move(s));
                  });
    return done.get_future().get();
  }

  static constexpr int32_t kTokens = 10;
  const KvBlockLayout layout_ = TestLayout();
  const std::vector<BlockId> local_table_ = {BlockId(1), BlockId(6),
                                             BlockId(3)};
  std::vector<std::byte> pool_, staging_, landing_;
  std::unique_ptr<kv::KvTransport> receiver_;
  kv::RegionId region_;
  int staged_ranges_ = 0;  // Pusher thread while pushing.
  int failures_ = 0;       // Likewise.
};

TEST_F(StagedPushTest, LandingGetsThePoolsBytesThroughTheStaging) {
  std::unique_ptr<KvPusher> pusher = MakePusher(/*fail_stage=*/false);
  ASSERT_NE(pusher, nullptr);
  std::shared_ptr<KvPush> push = MakePush();
  ASSERT_TRUE(PushAll(*pusher, push).ok());
  auto note = receiver_->WaitNotification(absl::Seconds(5));
  ASSERT_TRUE(note.ok()) << note.status();
  EXPECT_EQ(note->message, "complete");

  // Every pushed range arrived with the pool's bytes; nothing else of the
  // landing or the staging was touched.
  std::vector<std::byte> want_landing(landing_.size(), std::byte{0});
  std::vector<std::byte> want_staging(staging_.size(), std::byte{0});
  for (int32_t layer = 0; layer < layout_.num_layers; ++layer) {
    ForEachKvRange(
        layout_, layer, local_table_.data(), kLocalBlocks,
        push->target().block_ids.data(), kRemoteBlocks, 0, kTokens,
        [&](size_t src, size_t dst, size_t length) {
          std::memcpy(want_landing.data() + dst, pool_.data() + src, length);
          std::memcpy(want_staging.data() + src, pool_.data() + src, length);
        });
  }
  EXPECT_TRUE(landing_ == want_landing);
  EXPECT_TRUE(staging_ == want_staging);
  // K and V of each block touched, per chunk and layer: chunk [0, 6)
  // touches 2 blocks, [6, 10) 2 blocks.
  EXPECT_EQ(staged_ranges_, 2 * (2 + 2) * layout_.num_layers);
  EXPECT_EQ(failures_, 0);
}

TEST_F(StagedPushTest, StagingFailureFailsThePushWithoutWriting) {
  std::unique_ptr<KvPusher> pusher = MakePusher(/*fail_stage=*/true);
  ASSERT_NE(pusher, nullptr);
  const absl::Status status = PushAll(*pusher, MakePush());
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal) << status;
  EXPECT_NE(status.message().find("copy engine on fire"), std::string::npos)
      << status;
  EXPECT_EQ(failures_, 1);
  EXPECT_TRUE(std::all_of(landing_.begin(), landing_.end(),
                          [](std::byte b) { return b == std::byte{0}; }));
  EXPECT_TRUE(absl::IsDeadlineExceeded(
      receiver_->WaitNotification(absl::Milliseconds(200)).status()));
}

TEST_F(StagedPushTest, StagedTransportWithoutStageCallbackIsRefused) {
  auto sender = kv::CreateKvTransport("tcp", kv::TransportOptions());
  ASSERT_TRUE(sender.ok());
  std::vector<KvPusherTransport> transports;
  transports.push_back(
      {.transport = *std::move(sender), .memory = staging_, .staged = true});
  auto pusher = KvPusher::Create(std::move(transports), kLocalBlocks, layout_,
                                 nullptr, nullptr);
  EXPECT_EQ(pusher.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdserve
