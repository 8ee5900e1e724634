// KV fencing on the decode worker (decode_worker.h, kv_transfer/
// landing_fence.h), on every host-memory transport: a write into a landing
// whose reservation was dropped never lands in blocks handed to another
// request. The worker runs with the KV canary, which fills free blocks
// with a pattern and counts those found written when they are handed out
// again (LoadReport.kv_canary_violations); the test sends the late writes
// through a real transport, as a prefill worker whose push outlived its
// request would.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "decode_worker/decode_server.h"
#include "engine/kv_layout.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "kv_transfer/transport.h"
#include "proto/convert.h"

namespace pdserve {
namespace {

namespace wire = ::pdserve::internal::v1;

constexpr int32_t kBlocks = 8;  // The whole pool: every landing reuses it.
constexpr int32_t kBlockTokens = 16;

std::vector<std::string> HostTransports() {
  std::vector<std::string> out;
  for (const std::string& name : kv::AvailableKvTransports()) {
    if (name != "cuda_ipc" && name != "nccl") out.push_back(name);
  }
  return out;
}

class FencingTest : public ::testing::TestWithParam<std::string> {
 protected:
  void Start(absl::Duration quarantine) {
    DecodeServerOptions options;
    options.worker.engine.num_kv_blocks = kBlocks;
    options.worker.engine.block_size = kBlockTokens;
    options.worker.engine.num_threads = 1;
    options.worker.engine.kv_canary = true;
    options.worker.engine.tick_period = absl::Milliseconds(10);
    options.worker.kv_transport = GetParam();
    options.worker.kv_quarantine = quarantine;
    options.shutdown_grace = absl::Milliseconds(200);
    auto server = DecodeServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    stub_ = wire::DecodeWorker::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                            grpc::InsecureChannelCredentials()));
    auto sender = kv::CreateKvTransport(GetParam(), {});
    ASSERT_TRUE(sender.ok()) << sender.status();
    sender_ = *std::move(sender);
    fences_writes_ = sender_->capabilities().fences_writes;
  }

  wire::LoadReport Load() {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    wire::LoadReport load;
    EXPECT_TRUE(stub_->GetLoad(&ctx, {}, &load).ok());
    return load;
  }

  grpc::Status Reserve(uint64_t id, wire::Landing* landing) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    wire::ReserveRequest r;
    r.set_request_id(id);
    r.set_num_tokens(kBlocks * kBlockTokens);
    return stub_->Reserve(&ctx, r, landing);
  }

  void Release(uint64_t id) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    wire::ReleaseRequest r;
    r.set_request_id(id);
    wire::ReleaseResponse out;
    ASSERT_TRUE(stub_->Release(&ctx, r, &out).ok());
  }

  // Reserves the whole pool for `id`, retrying while fenced blocks are
  // still held back; false when it never fits within `patience`.
  bool ReserveWhenFree(uint64_t id, wire::Landing* landing,
                       absl::Duration patience) {
    const absl::Time give_up = absl::Now() + patience;
    while (true) {
      const grpc::Status s = Reserve(id, landing);
      if (s.ok()) return true;
      EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
          << s.error_message();
      if (absl::Now() > give_up) return false;
      absl::SleepFor(absl::Milliseconds(20));
    }
  }

  const wire::KvOffer& Offer(const wire::Landing& landing) {
    for (const wire::KvOffer& o : landing.offers()) {
      if (o.transport() == GetParam()) return o;
    }
    ADD_FAILURE() << "no " << GetParam() << " offer";
    return landing.offers(0);
  }

  // Writes 0x77 over every byte of every block of `landing`, tagged with
  // its landing id: a push that goes on after its request was given up.
  absl::Status LateWrite(const wire::Landing& landing) {
    auto layout = FromWire(landing.layout());
    if (!layout.ok()) return layout.status();
    source_.assign(layout->block_bytes() * kBlocks, std::byte{0x77});
    auto region = sender_->RegisterMemory(source_);
    if (!region.ok()) return region.status();
    const wire::KvOffer& offer = Offer(landing);
    auto connection = sender_->Connect(offer.endpoint());
    if (!connection.ok()) return connection.status();
    std::vector<kv::WriteOp> ops;
    for (int32_t layer = 0; layer < layout->num_layers; ++layer) {
      for (int32_t b : landing.block_ids()) {
        const size_t at = layout->PoolOffset(layer, BlockId(b), kBlocks);
        ops.push_back({.local_region = *region,
                       .local_offset = at,
                       .remote_region = kv::RegionId(offer.region_id()),
                       .remote_offset = at,
                       .length = layout->layer_block_bytes(),
                       .landing = landing.landing_id()});
      }
    }
    connection_ = *std::move(connection);
    return connection_->Write(ops);
  }

  void Notify(const wire::KvComplete& complete) {
    ASSERT_NE(connection_, nullptr);
    ASSERT_TRUE(connection_->Notify(complete.SerializeAsString()).ok());
  }

  // Waits (up to `patience`) for every block to be free.
  bool AllFree(absl::Duration patience) {
    const absl::Time give_up = absl::Now() + patience;
    while (Load().free_blocks() != kBlocks) {
      if (absl::Now() > give_up) return false;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return true;
  }

  void TearDown() override {
    connection_.reset();
    stub_.reset();
    server_.reset();
  }

  std::unique_ptr<DecodeServer> server_;
  std::unique_ptr<wire::DecodeWorker::Stub> stub_;
  std::unique_ptr<kv::KvTransport> sender_;
  std::unique_ptr<kv::KvConnection> connection_;
  std::vector<std::byte> source_;
  bool fences_writes_ = false;
};

// The hole issue 15 found: the router releases a reservation whose push is
// still running; the blocks went straight back to the pool, the push's
// next write landed in them, and the next request got them.
TEST_P(FencingTest, LateWriteIntoAReleasedLandingNeverLandsInBlocksHandedOutAgain) {
  Start(/*quarantine=*/absl::Milliseconds(400));
  wire::Landing first;
  ASSERT_TRUE(Reserve(1, &first).ok());
  ASSERT_EQ(first.block_ids_size(), kBlocks);
  ASSERT_NE(first.landing_id(), 0u);
  Release(1);
  if (!fences_writes_) {
    // A one-sided write cannot be refused: the blocks wait out the
    // quarantine instead of going back at once.
    EXPECT_LT(Load().free_blocks(), static_cast<uint32_t>(kBlocks));
  }
  const absl::Status write = LateWrite(first);
  // Dropped by the receiver (OK to the sender) or landed in held blocks.
  EXPECT_TRUE(write.ok()) << write;

  wire::Landing second;
  ASSERT_TRUE(ReserveWhenFree(2, &second, absl::Seconds(5)));
  EXPECT_NE(second.landing_id(), first.landing_id());
  EXPECT_EQ(Load().kv_canary_violations(), 0u)
      << "a write into released landing " << first.landing_id()
      << " landed in free blocks";
  Release(2);
  EXPECT_TRUE(AllFree(absl::Seconds(5)));
  EXPECT_EQ(Load().kv_canary_violations(), 0u);
}

TEST_P(FencingTest, AbortedPushHandsTheBlocksBackWithoutAQuarantine) {
  Start(/*quarantine=*/absl::Seconds(60));
  wire::Landing landing;
  ASSERT_TRUE(Reserve(1, &landing).ok());
  ASSERT_TRUE(LateWrite(landing).ok());  // Part of a push, then it stops.
  Release(1);
  wire::KvComplete aborted;
  aborted.set_request_id(1);
  aborted.set_landing_id(landing.landing_id());
  aborted.set_aborted(true);
  Notify(aborted);
  EXPECT_TRUE(AllFree(absl::Seconds(3)))
      << "the sender said it was done; nothing can land any more";
  EXPECT_EQ(Load().kv_canary_violations(), 0u);
}

TEST_P(FencingTest, AbortBeforeTheDecodeArrivesEndsItWithAborted) {
  Start(/*quarantine=*/absl::Seconds(60));
  wire::Landing landing;
  ASSERT_TRUE(Reserve(7, &landing).ok());
  ASSERT_TRUE(LateWrite(landing).ok());
  wire::DecodeRequest d;
  d.mutable_request()->set_request_id(7);
  for (int i = 0; i < 8; ++i) d.mutable_request()->add_prompt(3 + i);
  d.mutable_request()->set_max_tokens(4);
  d.mutable_first_token()->set_token_id(5);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  auto reader = stub_->Decode(&ctx, d);
  absl::SleepFor(absl::Milliseconds(100));  // Parked, waiting for the KV.
  wire::KvComplete aborted;
  aborted.set_request_id(7);
  aborted.set_landing_id(landing.landing_id());
  aborted.set_aborted(true);
  Notify(aborted);
  wire::DecodeResponse msg;
  EXPECT_FALSE(reader->Read(&msg));
  const grpc::Status s = reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
  EXPECT_TRUE(AllFree(absl::Seconds(3)));
}

// A KvComplete of an earlier landing of the same request (a push that
// outlived its reservation, the request since reserved again) does not
// complete the new landing, whose KV has not come.
TEST_P(FencingTest, CompletionOfAnEarlierLandingIsIgnored) {
  Start(/*quarantine=*/absl::Milliseconds(200));
  wire::Landing old_landing;
  ASSERT_TRUE(Reserve(3, &old_landing).ok());
  ASSERT_TRUE(LateWrite(old_landing).ok());
  Release(3);
  wire::Landing landing;
  ASSERT_TRUE(ReserveWhenFree(3, &landing, absl::Seconds(5)));
  wire::KvComplete stale;
  stale.set_request_id(3);
  stale.set_num_tokens(8);
  stale.set_landing_id(old_landing.landing_id());
  Notify(stale);
  wire::DecodeRequest d;
  d.mutable_request()->set_request_id(3);
  for (int i = 0; i < 8; ++i) d.mutable_request()->add_prompt(3 + i);
  d.mutable_request()->set_max_tokens(4);
  d.mutable_first_token()->set_token_id(5);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Milliseconds(500)));
  auto reader = stub_->Decode(&ctx, d);
  wire::DecodeResponse msg;
  EXPECT_FALSE(reader->Read(&msg)) << "decoded KV that never landed";
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  Release(3);
  EXPECT_TRUE(AllFree(absl::Seconds(5)));
}

INSTANTIATE_TEST_SUITE_P(
    Transports, FencingTest, ::testing::ValuesIn(HostTransports()),
    [](const ::testing::TestParamInfo<std::string>& info) {
      std::string name = info.param;
      for (char& c : name) {
        if (c == ':') c = '_';
      }
      return name;
    });

}  // namespace
}  // namespace pdserve
